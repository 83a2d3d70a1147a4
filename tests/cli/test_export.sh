#!/usr/bin/env bash
# Run checkpoint → HF export, end to end through the CLI: train the
# llama_tied fixture (a transformers checkpoint) 4 steps over 4 ranks
# (dp_shard 2 x tp 2) with --save every 2 steps, `meshlm export` the latest
# checkpoint in one process, and check
#  - the export is byte-identical to the collective consolidated save of
#    the same run (train --export-hf): config.json and model.safetensors;
#  - only the latest checkpoint is kept, and latest.json names step 4;
#  - --max-shard-size splits the export into shards + index, which
#    `meshlm logprobs` reads with the same result;
#  - meshlm's log-probs of the export match those transformers computed in
#    float64 for the fixture's weights (tests/fixtures/llama_tied/
#    expected.json) within tests/tolerance.h's bound for meshlm against that
#    reference (relative L2, printed by tol_bound). The run trains with
#    --lr 0, so the export holds exactly the fixture's weights on any CPU
#    (AdamW moves no weight, weight decay included) while every moment,
#    shard and piece goes through the save, the commit and the export: after
#    real steps the weights would depend on the CPU's rounding through AdamW,
#    which no bound covers. (tools/export_check.py checks a trained export
#    against transformers by hand);
#  - export errors: no committed checkpoint, a bad --max-shard-size.
# usage: test_export.sh MESHLM SOURCE_DIR JSON_CHECK TOL_BOUND
#        (ML_KEEP_WORK=DIR keeps the files)
set -eu
meshlm=$1
src=$2
tol_bound=$4
fx=$src/tests/fixtures/llama_tied
if [ -n "${ML_KEEP_WORK:-}" ]; then
  work=$ML_KEEP_WORK
  rm -rf "$work" && mkdir -p "$work"
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
fail() { echo "FAIL: $*"; exit 1; }

mpiexec -n 4 "$meshlm" train --model "$fx" --data "$src/tests/fixtures/export_roundtrip/train.txt" \
  --tp 2 --steps 4 --batch-size 4 --seq-len 64 --lr 0 --seed 5 --save "$work/ck" --save-every 2 \
  --export-hf "$work/direct"
grep -q '"step_dir": "step-00000004"' "$work/ck/latest.json" || fail "latest.json: $(cat "$work/ck/latest.json")"
[ "$(ls -d "$work"/ck/step-* | wc -l)" -eq 1 ] || fail "older checkpoints kept: $(ls "$work/ck")"
ls -l "$work"/ck/step-00000004

"$meshlm" export --checkpoint "$work/ck" --out "$work/hf"
for f in config.json model.safetensors; do
  cmp "$work/hf/$f" "$work/direct/$f" || fail "export $f differs from train --export-hf"
done
"$meshlm" export --checkpoint "$work/ck" --out "$work/hf_sharded" --max-shard-size 100000
[ -f "$work/hf_sharded/model.safetensors.index.json" ] || fail "no index for --max-shard-size 100000"
[ "$(ls "$work"/hf_sharded/model-*-of-*.safetensors | wc -l)" -ge 2 ] || fail "expected shards"

# the fixture's sequences and transformers' log-probs of them, one row a line
rows() { sed -E "s/.*\"$1\": \[\[([^]]*)\], \[([^]]*)\]\].*/\1\n\2/" "$fx/expected.json"; }
rows input_ids | sed 's/.*/{"input_ids": [&]}/' > "$work/score.jsonl"
"$meshlm" logprobs --model "$work/hf" --data "$work/score.jsonl" --out "$work/lp.jsonl"
"$meshlm" logprobs --model "$work/hf_sharded" --data "$work/score.jsonl" --out "$work/lp_sharded.jsonl"
cmp "$work/lp.jsonl" "$work/lp_sharded.jsonl" || fail "the sharded export scores differently"

values() { sed -E 's/.*\[//; s/\].*//' | tr ',' '\n'; }
bound=$("$tol_bound" "$work/hf" logprobs ref 24 48)
paste <(values < "$work/lp.jsonl") <(rows logprobs | values) | awk -v t="$bound" '
  NF != 2 { bad = 1 }
  { d = $1 - $2; e += d * d; r += $2 * $2; n++ }
  END { printf "log-probs of the export vs transformers: %d tokens, relative L2 %.3g (bound %.3g)\n", n, sqrt(e / r), t
        exit (bad || n != 46 || sqrt(e) > t * sqrt(r)) }' || fail "log-probs differ from the transformers fixture"

mkdir -p "$work/empty"
if "$meshlm" export --checkpoint "$work/empty" --out "$work/none" 2> "$work/err"; then
  fail "export of a directory without a checkpoint succeeded"
fi
grep -q "no committed checkpoint" "$work/err" || fail "message: $(cat "$work/err")"
if "$meshlm" export --checkpoint "$work/ck" --out "$work/none" --max-shard-size -1 2> "$work/err"; then
  fail "--max-shard-size -1 accepted"
fi
grep -q "max-shard-size" "$work/err" || fail "message: $(cat "$work/err")"
echo "1 passed, 0 failed"
