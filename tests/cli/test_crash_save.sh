#!/usr/bin/env bash
# Crash safety of run checkpoints (ARCHITECTURE.md §9): train 5 steps over 4 ranks
# (dp_shard 2 x tp 2) with --save-every 1 while the test hook
# MESHLM_TEST_CRASH_IN_SAVE=3:1 makes rank 1 write half of its file of the
# 3rd save and die (SIGKILL). The job must fail; latest.json must still name
# step 2, whose checkpoint loads: --resume continues from it, and the losses
# and grad norms of steps 3-5 equal, bitwise (the metrics' 17 digits), those
# of an uninterrupted run; the resumed run removes the torn step 3 at start.
# usage: test_crash_save.sh MESHLM SOURCE_DIR
set -eu
meshlm=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
fail() { echo "FAIL: $*"; exit 1; }

"$meshlm" init --arch llama --preset tiny --seed 11 --out "$work/model"
train=(train --model "$work/model" --data "$src/tests/fixtures/export_roundtrip/train.txt" --tp 2
       --steps 5 --batch-size 4 --seq-len 64 --lr 1e-3 --seed 5)
mpiexec -n 4 "$meshlm" "${train[@]}" --metrics "$work/full.jsonl"

if MESHLM_TEST_CRASH_IN_SAVE=3:1 mpiexec -n 4 "$meshlm" "${train[@]}" --save "$work/ck" \
     --save-every 1 --metrics "$work/crashed.jsonl" > "$work/crash.log" 2>&1; then
  cat "$work/crash.log"
  fail "the job survived the killed rank"
fi
grep -q "test hook" "$work/crash.log" || { cat "$work/crash.log"; fail "rank 1 did not die in the save"; }
cat "$work/ck/latest.json"
grep -q '"step_dir": "step-00000002"' "$work/ck/latest.json" || fail "latest.json moved past step 2"
[ -d "$work/ck/step-00000002" ] || fail "the committed checkpoint is gone"
ls -l "$work/ck/step-00000003" || true # the torn, uncommitted save

mpiexec -n 4 "$meshlm" "${train[@]}" --save "$work/ck" --save-every 1 --resume "$work/ck" \
  --metrics "$work/resumed.jsonl"
grep -q '"step_dir": "step-00000005"' "$work/ck/latest.json" || fail "the resumed run did not commit step 5"
[ "$(ls -d "$work"/ck/step-* | wc -l)" -eq 1 ] || fail "stale checkpoints left: $(ls "$work/ck")"

# "step":N,"loss":X,"grad_norm":Y of each line (jansson prints reals with 17 digits)
core() { grep -o '"step": *[0-9]*, *"loss": *[^,]*, *"grad_norm": *[^,]*' "$1"; }
core "$work/full.jsonl" | tail -n 3 > "$work/want"
core "$work/resumed.jsonl" > "$work/got"
cat "$work/got"
[ "$(wc -l < "$work/got")" -eq 3 ] || fail "the resumed run reported $(wc -l < "$work/got") steps, expected 3 (steps 3-5)"
diff "$work/want" "$work/got" || fail "resumed steps differ from the uninterrupted run"
echo "1 passed, 0 failed"
