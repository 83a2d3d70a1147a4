#!/usr/bin/env bash
# The command line on the GPU against the CPU, one rank, the tiny Llama preset:
#  (a) meshlm logprobs --device cuda of records of different lengths, which it packs into
#      micro-batches of documents (varlen attention: the CUDA backend's block attention per
#      document), against --device cpu: every record's log-probs within the pair bound of
#      tests/tolerance.h §3 (tol_bound logprobs pair: two fp32 evaluations in different
#      orders), as relative L2 over all of them;
#  (b) meshlm train --device cuda with LoRA (r 4 on q_proj, v_proj, down_proj, alpha 16:
#      frozen base weights, adapters trained) against --device cpu: each of 2 steps' loss and
#      gradient norm within the LoRA pair bound (tol_bound lora-pair:4; |Δ‖g‖| <= ‖Δg‖).
# Exits 77 (skipped) when --device cuda cannot start (no GPU, a build without CUDA).
# usage: test_cuda_cli.sh MESHLM SOURCE_DIR TOL_BOUND
set -uo pipefail
meshlm=$1 src=$2 tol_bound=$3
source "$src/tests/cli/common.sh"
"$meshlm" init --arch llama --preset tiny --seed 3 --out "$work/model" > /dev/null || exit 1
python3 - "$work/data.jsonl" << 'PY'
import json, random, sys
random.seed(5)
with open(sys.argv[1], "w") as f:
    for n in (7, 33, 18, 64, 5, 41, 29, 12):
        f.write(json.dumps({"input_ids": [random.randrange(0, 256) for _ in range(n)]}) + "\n")
PY
score() {
  "$meshlm" logprobs --model "$work/model" --data "$work/data.jsonl" --out "$work/$1.jsonl" \
    --micro-batch-tokens 96 --device "$1" > /dev/null 2> "$work/err"
}
if ! score cuda; then
  if grep -q "no CUDA GPU is visible\|has no CUDA backend" "$work/err"; then
    echo "skipped: $(head -1 "$work/err")"
    exit 77
  fi
  bad "(a) logprobs --device cuda failed"
elif ! score cpu; then
  bad "(a) logprobs --device cpu failed"
else
  bound=$("$tol_bound" "$work/model" logprobs pair 64 64)
  if python3 - "$work/cuda.jsonl" "$work/cpu.jsonl" "$bound" << 'PY'; then
import json, math, sys
a = [json.loads(l)["logprobs"] for l in open(sys.argv[1])]
b = [json.loads(l)["logprobs"] for l in open(sys.argv[2])]
assert [len(x) for x in a] == [len(x) for x in b], "record lengths differ"
num = sum((x - y) ** 2 for p, q in zip(a, b) for x, y in zip(p, q))
den = sum(y * y for q in b for y in q)
rel = math.sqrt(num / den)
print("(a) packed log-probs cuda vs cpu: %d records, rel L2 %.3g (bound %s)" % (len(a), rel, sys.argv[3]))
sys.exit(0 if rel <= float(sys.argv[3]) else 1)
PY
    ok "(a) packed log-probs within the pair bound"
  else
    bad "(a) packed log-probs beyond the pair bound"
  fi
fi

lora=(train --model "$work/model" --data "$src/README.md" --seq-len 32 --batch-size 4 --lr 1e-2
  --steps 2 --max-grad-norm 0 --peak-tflops 1 --lora-rank 4 --lora-alpha 16
  --lora-targets q_proj,v_proj,down_proj)
numbers() { sed -E 's/.*"loss":([^,]+),"grad_norm":([^,]+),.*/\1 \2/' "$1"; }
if "$meshlm" "${lora[@]}" --device cuda --metrics "$work/lg.jsonl" > /dev/null 2> "$work/err" &&
  "$meshlm" "${lora[@]}" --device cpu --metrics "$work/lc.jsonl" > /dev/null 2> "$work/err"; then
  bl=$("$tol_bound" "$work/model" loss lora-pair:4 32 128)
  bg=$("$tol_bound" "$work/model" grads lora-pair:4 32 128)
  paste -d' ' <(numbers "$work/lg.jsonl") <(numbers "$work/lc.jsonl") > "$work/pairs"
  step=0
  while read -r l1 g1 l2 g2; do
    step=$((step + 1))
    if awk -v a="$l1" -v b="$l2" -v t="$bl" -v g="$g1" -v h="$g2" -v u="$bg" \
        'function abs(x) { return x < 0 ? -x : x }
        BEGIN { exit !(abs(a - b) <= t * abs(b) && abs(g - h) <= u * abs(h)) }'; then
      ok "(b) LoRA step $step cuda vs cpu: loss $l1 vs $l2, grad norm $g1 vs $g2 (bounds $bl, $bg)"
    else
      bad "(b) LoRA step $step cuda vs cpu: loss $l1 vs $l2, grad norm $g1 vs $g2 (bounds $bl, $bg)"
    fi
  done < "$work/pairs"
  [ "$step" -eq 2 ] || bad "(b) LoRA: $step steps in the metrics, expected 2"
else
  bad "(b) LoRA training on cuda or cpu failed"
fi
finish
