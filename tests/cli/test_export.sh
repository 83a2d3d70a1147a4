#!/usr/bin/env bash
# HF export, end to end through the CLI (train --export-hf, the collective
# streamed export; meshlm export, one process from a run checkpoint). The
# sources are copies of transformers fixtures with tokenizer files added
# (the fixtures have none) beside files that are not the model's. Runs
# train with --lr 0, so an export holds exactly its source's weights on any
# CPU (AdamW moves no weight, weight decay included) while every moment,
# shard and piece goes through the gather, the save and the commit: after
# real steps the weights would depend on the CPU's rounding through AdamW,
# which no bound covers (tools/export_check.py checks a trained export
# against transformers by hand). Tensors are compared through st_list (name,
# dtype, shape, hash of the bytes).
#  1. llama_tied over 4 ranks (dp_shard 2 x tp 2), saved every 2 steps:
#     meshlm export is byte-identical to train --export-hf, every file; the
#     tokenizer, chat template and generation files are copied byte for
#     byte, nothing else; the tensors are the source's (fp32, tied lm_head
#     omitted) and score the source's log-probs exactly, within
#     tests/tolerance.h's bound of transformers' (the fixture's expected.json);
#     --max-shard-size gives shards + index that score the same; both print
#     one line: the directory, its tensors, safetensors files, files, bytes.
#  2. dtypes: --export-dtype bf16 holds the fp32 weights rounded to nearest
#     even (st_list --bf16) and says bfloat16 in config.json; a bf16 source
#     exports bf16 by default (the same bytes: bf16 → fp32 → bf16 is exact),
#     fp32 with --export-dtype fp32, scoring the same log-probs.
#  3. gemma3_vlm over 2 ranks: the export is a Gemma3ForConditionalGeneration
#     (vision_config kept) with every source tensor, the vision tower and
#     projector byte-identical, also under --export-dtype bf16 (which rounds
#     only the text tower); log-probs as the source's.
#  3b. phi3 over 4 ranks (tp 2, q/k/v and gate/up split from the fused
#     tensors): the export writes self_attn.qkv_proj and mlp.gate_up_proj
#     fused again, every tensor byte for byte the source's, no unfused name;
#     meshlm export = train --export-hf; the log-probs the source's.
#  4. the source moved away: an export that carries tensors from it fails
#     naming it and leaves nothing; one that carries none still works from
#     the checkpoint's copies of the files. Moved together with the
#     checkpoint, the source is found relative to it, also past another
#     model at the recorded path (its config.json differs: refused).
#  5. a checkpoint without a source record (older meshlm): a warning, and
#     the text model alone (Gemma3ForCausalLM), scoring the same.
#  6. failures: a write error in the middle of an export (ulimit -f) leaves
#     neither the output nor its staging directory, and an earlier export in
#     that directory untouched — in meshlm export and in train --export-hf
#     (rank 0 the writer; one message); an export over an earlier sharded
#     one removes its stale shards; no committed checkpoint, bad flags.
# usage: test_export.sh MESHLM SOURCE_DIR JSON_CHECK TOL_BOUND ST_LIST
set -u
meshlm=$1
src=$2
json_check=$3
tol_bound=$4
st_list=$5
. "$src/tests/cli/common.sh"
# token ids, not raw text: the sources' tokenizer.json is a stand-in that does not tokenize
data=$work/train.jsonl
awk 'BEGIN { for (r = 0; r < 16; r++) { s = ""; for (i = 0; i < 64; i++) s = s (i ? ", " : "") (r * 37 + i * 11) % 256
  print "{\"input_ids\": [" s "]}" } }' > "$data"

# mk_source FIXTURE DIR: a copy of the fixture with tokenizer files and a README
mk_source() {
  cp -r "$src/tests/fixtures/$1" "$2"
  printf '{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}\n' > "$2/tokenizer.json"
  printf '{"bos_token": "<s>", "model_max_length": 256}\n' > "$2/tokenizer_config.json"
  printf '{"eos_token": "</s>"}\n' > "$2/special_tokens_map.json"
  printf '{%% for m in messages %%}{{ m.content }}{%% endfor %%}\n' > "$2/chat_template.jinja"
  printf 'not part of the model\n' > "$2/README.md"
}
# same_files A B: the same file names, each byte-identical
same_files() {
  [ "$(ls "$1")" = "$(ls "$2")" ] || return 1
  for f in "$1"/*; do cmp -s "$f" "$2/$(basename "$f")" || return 1; done
}
lp() { "$meshlm" logprobs --model "$1" --data "$work/score.jsonl" --out "$2" > /dev/null 2>&1; }
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }
train() { "$meshlm" train --data "$data" --batch-size 4 --seq-len 64 --lr 0 --seed 5 "$@"; }

# the fixture's sequences and transformers' log-probs of them, one row a line
fx=$src/tests/fixtures/llama_tied
rows() { sed -E "s/.*\"$1\": \[\[([^]]*)\], \[([^]]*)\]\].*/\1\n\2/" "$fx/expected.json"; }
rows input_ids | sed 's/.*/{"input_ids": [&]}/' > "$work/score.jsonl"

# ---- 1. llama_tied: export = train --export-hf, files, tensors, log-probs
mk_source llama_tied "$work/llama"
mpiexec -n 4 "$meshlm" train --model "$work/llama" --data "$data" --tp 2 --steps 4 --batch-size 4 \
  --seq-len 64 --lr 0 --seed 5 --save "$work/ck" --save-every 2 --export-hf "$work/direct" \
  > "$work/out" 2>&1 || { cat "$work/out"; exit 1; }
check "latest.json names step 4, the only checkpoint kept" \
  'grep -q "\"step_dir\": \"step-00000004\"" "$work/ck/latest.json" &&
   [ "$(ls -d "$work"/ck/step-* | wc -l)" -eq 1 ]'
"$meshlm" export --checkpoint "$work/ck" --out "$work/hf" > "$work/export.out" 2> "$work/err"
check "meshlm export = train --export-hf, every file byte for byte" 'same_files "$work/hf" "$work/direct"'
# summary DIR SHARDS: the success line's account of DIR: its tensors (st_list's lines) in SHARDS
# safetensors files, its files and their bytes
summary() {
  local tensors files bytes
  tensors=$("$st_list" "$1" | wc -l)
  files=$(find "$1" -maxdepth 1 -type f | wc -l)
  bytes=$(find "$1" -maxdepth 1 -type f -printf '%s\n' | awk '{ b += $1 } END { print b }')
  echo "$tensors tensors in $2 safetensors file$([ "$2" -eq 1 ] || echo s), $files files, $bytes bytes \\([0-9.]+ [KMG]iB\\)"
}
check "meshlm export and train --export-hf print one line: the directory, tensors, files, bytes" \
  '[ "$(wc -l < "$work/export.out")" -eq 1 ] &&
   grep -qE "^export: wrote $work/hf from the latest checkpoint in $work/ck: $(summary "$work/hf" 1)\$" "$work/export.out" &&
   grep -qE "^train: exported $work/direct: $(summary "$work/direct" 1)\$" "$work/out"'
copied() {
  for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja \
    generation_config.json; do
    cmp -s "$1/$f" "$work/llama/$f" || return 1
  done
}
want="chat_template.jinja config.json generation_config.json model.safetensors"
want="$want special_tokens_map.json tokenizer.json tokenizer_config.json "
check "tokenizer, chat template and generation files copied byte for byte, nothing else" \
  '[ "$(ls "$work/hf" | tr "\n" " ")" = "$want" ] && copied "$work/hf"'
"$st_list" "$work/llama" > "$work/src.lst"
"$st_list" "$work/hf" > "$work/hf.lst"
check "the export's tensors are the source's (fp32, no tied lm_head), config.json says float32" \
  'cmp -s "$work/src.lst" "$work/hf.lst" && ! grep -q "^lm_head" "$work/hf.lst" &&
   grep -q "\"dtype\": \"float32\"" "$work/hf/config.json" && grep -q LlamaForCausalLM "$work/hf/config.json"'
lp "$work/llama" "$work/lp_src.jsonl"
lp "$work/hf" "$work/lp.jsonl"
check "the export scores the source's log-probs exactly" 'cmp -s "$work/lp.jsonl" "$work/lp_src.jsonl"'
"$meshlm" export --checkpoint "$work/ck" --out "$work/hf_sharded" --max-shard-size 100000 > "$work/export.out"
check "--max-shard-size 100000: shards + index, scoring the same" \
  '[ -f "$work/hf_sharded/model.safetensors.index.json" ] &&
   grep -qE ": $(summary "$work/hf_sharded" "$(ls "$work"/hf_sharded/model-*-of-*.safetensors | wc -l)")\$" "$work/export.out" &&
   [ "$(ls "$work"/hf_sharded/model-*-of-*.safetensors | wc -l)" -ge 2 ] &&
   lp "$work/hf_sharded" "$work/lp_sharded.jsonl" && cmp -s "$work/lp.jsonl" "$work/lp_sharded.jsonl"'
values() { sed -E 's/.*\[//; s/\].*//' | tr ',' '\n'; }
bound=$("$tol_bound" "$work/hf" logprobs ref 24 48)
if paste <(values < "$work/lp.jsonl") <(rows logprobs | values) | awk -v t="$bound" '
  NF != 2 { bad = 1 }
  { d = $1 - $2; e += d * d; r += $2 * $2; n++ }
  END { printf "log-probs of the export vs transformers: %d tokens, relative L2 %.3g (bound %.3g)\n",
              n, sqrt(e / r), t
        exit (bad || n != 46 || sqrt(e) > t * sqrt(r)) }'; then
  ok "log-probs of the export within the bound of transformers'"
else
  bad "log-probs differ from the transformers fixture"
fi

# ---- 2. dtypes
"$meshlm" export --checkpoint "$work/ck" --out "$work/bf16" --export-dtype bf16 > /dev/null
"$st_list" "$work/hf" --bf16 > "$work/rne.lst"
"$st_list" "$work/bf16" > "$work/bf16.lst"
check "--export-dtype bf16: the fp32 weights rounded to nearest even, config.json says bfloat16" \
  'cmp -s "$work/rne.lst" "$work/bf16.lst" && grep -q " BF16 " "$work/bf16.lst" &&
   grep -q "\"dtype\": \"bfloat16\"" "$work/bf16/config.json"'
mpiexec -n 2 "$meshlm" train --model "$work/bf16" --data "$data" --steps 2 --batch-size 4 --seq-len 64 \
  --lr 0 --seed 5 --save "$work/ck16" --export-hf "$work/direct16" > "$work/out" 2>&1 || cat "$work/out"
check "a bf16 source exports bf16 by default, the same bytes" \
  '"$st_list" "$work/direct16" | cmp -s - "$work/bf16.lst" &&
   grep -q "\"dtype\": \"bfloat16\"" "$work/direct16/config.json"'
"$meshlm" export --checkpoint "$work/ck16" --out "$work/f32of16" --export-dtype fp32 > /dev/null
lp "$work/bf16" "$work/lp16.jsonl"
lp "$work/f32of16" "$work/lp16f.jsonl"
check "--export-dtype fp32 of a bf16 run: fp32 tensors, config.json float32, the same log-probs" \
  '! "$st_list" "$work/f32of16" | grep -qv " F32 " &&
   grep -q "\"dtype\": \"float32\"" "$work/f32of16/config.json" &&
   cmp -s "$work/lp16.jsonl" "$work/lp16f.jsonl"'

# ---- 3. gemma3_vlm: the original architecture, the vision tower carried
mk_source gemma3_vlm "$work/vlm"
mpiexec -n 2 "$meshlm" train --model "$work/vlm" --data "$data" --steps 2 --batch-size 4 --seq-len 64 \
  --lr 0 --seed 5 --save "$work/ckv" --export-hf "$work/directv" > "$work/out" 2>&1 || cat "$work/out"
"$meshlm" export --checkpoint "$work/ckv" --out "$work/hfv" > /dev/null 2>&1
"$st_list" "$work/vlm" > "$work/vlm.lst"
check "VLM: Gemma3ForConditionalGeneration with vision_config, every source tensor byte for byte" \
  'grep -q Gemma3ForConditionalGeneration "$work/hfv/config.json" &&
   grep -q "\"vision_config\"" "$work/hfv/config.json" &&
   "$st_list" "$work/hfv" | cmp -s - "$work/vlm.lst" && [ "$(grep -c "^vision_tower" "$work/vlm.lst")" -gt 0 ]'
check "VLM: meshlm export = train --export-hf, generation_config.json copied" \
  'same_files "$work/hfv" "$work/directv" &&
   cmp -s "$work/hfv/generation_config.json" "$work/vlm/generation_config.json"'
lp "$work/vlm" "$work/lpv_src.jsonl"
lp "$work/hfv" "$work/lpv.jsonl"
check "VLM: the export scores the source's log-probs exactly" 'cmp -s "$work/lpv.jsonl" "$work/lpv_src.jsonl"'
"$meshlm" export --checkpoint "$work/ckv" --out "$work/hfv16" --export-dtype bf16 > /dev/null 2>&1
"$st_list" "$work/hfv16" > "$work/hfv16.lst"
check "VLM --export-dtype bf16: the text tower rounded, the vision tower and projector unchanged" \
  'diff <(grep -v "^language_model" "$work/hfv16.lst") <(grep -v "^language_model" "$work/vlm.lst") &&
   diff <(grep "^language_model" "$work/hfv16.lst") <("$st_list" "$work/vlm" --bf16 | grep "^language_model")'

# ---- 3b. phi3: fused tensors split on load, fused again on export
mk_source phi3 "$work/phi3"
mpiexec -n 4 "$meshlm" train --model "$work/phi3" --data "$data" --tp 2 --steps 2 --batch-size 4 \
  --seq-len 64 --lr 0 --seed 5 --save "$work/ckp" --export-hf "$work/directp" > "$work/out" 2>&1 ||
  cat "$work/out"
"$meshlm" export --checkpoint "$work/ckp" --out "$work/hfp" > /dev/null 2>&1
"$st_list" "$work/phi3" > "$work/phi3.lst"
check "Phi-3: the fused qkv_proj / gate_up_proj written back, every tensor byte for byte" \
  '"$st_list" "$work/hfp" | cmp -s - "$work/phi3.lst" &&
   grep -q "^model.layers.1.self_attn.qkv_proj.weight F32 \[128,64\]" "$work/phi3.lst" &&
   grep -q "^model.layers.0.mlp.gate_up_proj.weight F32 \[320,64\]" "$work/phi3.lst" &&
   ! grep -q "q_proj\|gate_proj" "$work/phi3.lst"'
check "Phi-3: meshlm export = train --export-hf" 'same_files "$work/hfp" "$work/directp"'
lp "$work/phi3" "$work/lpp_src.jsonl"
lp "$work/hfp" "$work/lpp.jsonl"
check "Phi-3: the export scores the source's log-probs exactly" \
  'cmp -s "$work/lpp.jsonl" "$work/lpp_src.jsonl"'

# ---- 4. the source moved away
mv "$work/vlm" "$work/vlm.moved"
"$meshlm" export --checkpoint "$work/ckv" --out "$work/gone" > /dev/null 2> "$work/err"
rc=$?
check "VLM source moved: the export fails naming it, leaving nothing" \
  '[ $rc -ne 0 ] && grep -q "source model .*/vlm holds the 23 tensors" "$work/err" && [ ! -e "$work/gone" ] &&
   [ ! -e "$work/gone.export-tmp" ]'
mv "$work/vlm.moved" "$work/vlm"
mkdir "$work/together"
mv "$work/vlm" "$work/ckv" "$work/together/"
"$meshlm" export --checkpoint "$work/together/ckv" --out "$work/hf_together" > /dev/null 2> "$work/err"
check "VLM source and checkpoint moved together: the export finds the source relative to it" \
  'grep -q "\"dir_rel\": \"../../../vlm\"" "$work"/together/ckv/step-*/metadata.json &&
   same_files "$work/hf_together" "$work/hfv"'
mk_source gemma3_vlm "$work/vlm" # another model at the recorded path: a config.json of its own
sed -i 's/"rms_norm_eps": [^,]*,/"rms_norm_eps": 1e-3,/' "$work/vlm/config.json"
"$meshlm" export --checkpoint "$work/together/ckv" --out "$work/hf_other" > /dev/null 2> "$work/err"
check "another model at the recorded path: refused, the relative path taken" \
  '! cmp -s "$work/vlm/config.json" "$work/together/vlm/config.json" &&
   same_files "$work/hf_other" "$work/hfv"'
mv "$work/together/vlm" "$work/vlm.moved"
"$meshlm" export --checkpoint "$work/together/ckv" --out "$work/gone" > /dev/null 2> "$work/err"
rc=$?
check "another model at the recorded path, none at the relative one: refused naming both" \
  '[ $rc -ne 0 ] && grep -q "/vlm/config.json differs from the recorded .*: another model; nor at .*/together/ckv/step-[0-9]*/source/../../../vlm, relative to the checkpoint" "$work/err" &&
   [ ! -e "$work/gone" ]'
rm -r "$work/vlm"
mv "$work/vlm.moved" "$work/vlm"
mv "$work/together/ckv" "$work/ckv"
mv "$work/llama" "$work/llama.moved"
"$meshlm" export --checkpoint "$work/ck" --out "$work/hf_moved" > /dev/null 2> "$work/err"
check "llama source moved: nothing to carry, the export is complete from the checkpoint" \
  'same_files "$work/hf_moved" "$work/hf"'
mv "$work/llama.moved" "$work/llama"

# ---- 5. a checkpoint without a source record
cp -r "$work/ckv" "$work/ckold"
meta=$(ls "$work"/ckold/step-*/metadata.json)
awk '{ l[NR] = $0 } END { for (i = 1; i <= NR; i++) if (l[i] ~ /^  "source": \{/) s = i
  for (i = 1; i <= NR; i++) { if (i == s - 1) sub(/,$/, "", l[i]); if (s && i >= s && i < NR) continue; print l[i] } }' \
  "$meta" > "$work/meta" && mv "$work/meta" "$meta"
"$meshlm" export --checkpoint "$work/ckold" --out "$work/hfold" > /dev/null 2> "$work/err"
lp "$work/hfold" "$work/lpold.jsonl"
check "no source record: a warning, the text model alone, the same log-probs" \
  '"$json_check" < "$meta" && ! grep -q "\"source\"" "$meta" && grep -q "records no source model" "$work/err" &&
   grep -q Gemma3ForCausalLM "$work/hfold/config.json" && ! "$st_list" "$work/hfold" | grep -q vision &&
   [ "$(ls "$work/hfold" | tr "\n" " ")" = "config.json model.safetensors " ] &&
   cmp -s "$work/lpold.jsonl" "$work/lpv.jsonl"'

# ---- 6. failures
# The writer's file size limit (ulimit -f, with SIGXFSZ ignored so write()
# fails with EFBIG as it would with ENOSPC) is below the weights; set in
# the rank alone (mpiexec and its shared-memory segments are not limited),
# the shared-memory transport off (its segment files would hit it).
rank0_limited="if [ \"\${OMPI_COMM_WORLD_RANK:-\$PMI_RANK}\" = 0 ]; then trap '' XFSZ; ulimit -f 100; fi; exec \"\$@\""
limited() { mpiexec_noshm -n 1 bash -c "$rank0_limited" limited "$@"; }
limited "$meshlm" export --checkpoint "$work/ck" --out "$work/fail" > /dev/null 2> "$work/err"
rc=$?
check "a write error mid-export leaves no output and no staging directory" \
  '[ $rc -ne 0 ] && grep -q "File too large" "$work/err" && [ ! -e "$work/fail" ] && [ ! -e "$work/fail.export-tmp" ]'
cp -r "$work/hf_sharded" "$work/keep"
limited "$meshlm" export --checkpoint "$work/ck" --out "$work/keep" > /dev/null 2> "$work/err"
rc=$?
check "a write error mid-export leaves an earlier export in that directory untouched" \
  '[ $rc -ne 0 ] && grep -q "File too large" "$work/err" && same_files "$work/keep" "$work/hf_sharded" &&
   [ ! -e "$work/keep.export-tmp" ]'
"$meshlm" export --checkpoint "$work/ck" --out "$work/keep" > /dev/null 2>&1
check "an export over an earlier sharded one removes its stale shards and index" \
  '[ ! -e "$work/keep/model.safetensors.index.json" ] && ! ls "$work"/keep/model-* > /dev/null 2>&1 &&
   "$st_list" "$work/keep" | cmp -s - "$work/hf.lst"'
mpiexec_noshm -n 2 bash -c "$rank0_limited" limited "$meshlm" train --model "$work/llama" \
  --data "$data" --steps 1 --batch-size 4 --seq-len 64 --lr 0 --export-hf "$work/failc" > /dev/null 2> "$work/err"
rc=$?
check "train --export-hf: rank 0's write error, one message, nothing left" \
  '[ $rc -ne 0 ] && [ "$(grep -c "meshlm: error" "$work/err")" -eq 1 ] && grep -q "File too large" "$work/err" &&
   [ ! -e "$work/failc" ] && [ ! -e "$work/failc.export-tmp" ]'

mkdir -p "$work/empty"
"$meshlm" export --checkpoint "$work/empty" --out "$work/none" 2> "$work/err"
rc=$?
check "no committed checkpoint: refused" '[ $rc -ne 0 ] && grep -q "no committed checkpoint" "$work/err"'
"$meshlm" export --checkpoint "$work/ck" --out "$work/none" --max-shard-size -1 2> "$work/err"
rc=$?
check "--max-shard-size -1: refused" '[ $rc -ne 0 ] && grep -q "max-shard-size" "$work/err"'
"$meshlm" export --checkpoint "$work/ck" --out "$work/score.jsonl" 2> "$work/err"
rc=$?
check "--out naming a file: refused before anything is written" \
  '[ $rc -ne 0 ] && grep -q "score.jsonl exists and is not a directory" "$work/err" &&
   [ ! -e "$work/score.jsonl.export-tmp" ]'
"$meshlm" export --checkpoint "$work/ck" --out "$work/none" --export-dtype fp16 2> "$work/err"
rc=$?
check "--export-dtype fp16: refused, naming the choices" \
  '[ $rc -ne 0 ] && grep -q "export-dtype" "$work/err" && grep -q "source" "$work/err" && [ ! -e "$work/none" ]'
finish
