#!/usr/bin/env bash
# The run's contract under faults (issue 9): a rank other than 0 failing
# during a save reaches the user with its own message and rank, and the
# failed save leaves nothing behind while the committed checkpoint stays
# loadable; a second run saving into a directory in use is refused at start
# naming the holder, on every rank; a lock left by a killed run does not
# block the next one. A run that fails before saving leaves no --save
# directory it created (nor its lock file in one it did not); a save killed
# before its commit leaves a step directory that the next run saving there
# removes at start, with one warning (issue 26). Where the file system has
# no flock, the run saves unlocked after one warning.
# usage: test_run_faults.sh MESHLM SOURCE_DIR JSON_CHECK
set -u
meshlm=$1
src=$2
. "$src/tests/cli/common.sh"
bg=
on_exit='[ -n "$bg" ] && kill "$bg" 2>/dev/null'

"$meshlm" init --arch llama --preset tiny --seed 3 --out "$work/model" > /dev/null || exit 1
train=(train --model "$work/model" --data "$src/tests/fixtures/export_roundtrip/train.txt"
       --batch-size 2 --seq-len 32 --peak-tflops 1)

# 1. Rank 1 cannot write its file of the step-3 save: its file size limit
# (ulimit -f, with SIGXFSZ ignored so write() fails with EFBIG as it would
# with ENOSPC) is below its rank file. Shared-memory transport off: its
# segment files would hit the limit too.
mpiexec -n 2 "$meshlm" "${train[@]}" --steps 2 --save "$work/ck" > /dev/null 2>&1
limited="if [ \"\${OMPI_COMM_WORLD_RANK:-\$PMI_RANK}\" = 1 ]; then trap '' XFSZ; ulimit -f 64; fi; exec \"\$@\""
mpiexec_noshm -n 2 bash -c "$limited" limited "$meshlm" "${train[@]}" --steps 3 \
  --save "$work/ck" --resume "$work/ck" > "$work/out" 2> "$work/err"
rc=$?
if [ $rc -ne 0 ] && grep -q "meshlm: error (rank 1): .*rank-00001.safetensors.*File too large" "$work/err" &&
   [ "$(grep -c 'meshlm: error' "$work/err")" -eq 1 ]; then
  ok "rank 1's write error reaches the user: $(grep 'meshlm: error' "$work/err")"
else
  bad "rank 1's write error (exit $rc)"
fi
if [ ! -e "$work/ck/step-00000003" ] && grep -q '"step_dir": "step-00000002"' "$work/ck/latest.json" &&
   [ -d "$work/ck/step-00000002" ]; then
  ok "the failed save left no step directory; step 2 stays committed"
else
  bad "after the failed save: $(ls -A "$work/ck" | tr '\n' ' ')"
fi
if mpiexec -n 2 "$meshlm" "${train[@]}" --steps 3 --save "$work/ck" --resume "$work/ck" > "$work/out" 2> "$work/err" &&
   grep -q "resumed from .* at step 2" "$work/out"; then
  ok "the committed checkpoint still resumes"
else
  bad "resume after the failed save"
fi

# 2. One writer per checkpoint directory.
"$meshlm" "${train[@]}" --steps 1000000 --save "$work/busy" --save-every 1000000 > /dev/null 2>&1 &
bg=$!
for _ in $(seq 600); do grep -q "pid $bg " "$work/busy/.meshlm-lock" 2>/dev/null && break; sleep 0.1; done
mpiexec -n 2 "$meshlm" "${train[@]}" --steps 1 --save "$work/busy" > "$work/out" 2> "$work/err"
rc=$?
if [ $rc -ne 0 ] && grep -q "busy: another meshlm run is saving into this checkpoint directory (pid $bg on host " "$work/err" &&
   [ "$(grep -c 'meshlm: error' "$work/err")" -eq 1 ] && ! grep -q "^step" "$work/out"; then
  ok "a second writer is refused at start: $(grep 'meshlm: error' "$work/err")"
else
  bad "second writer (exit $rc)"
fi
kill -9 "$bg"
wait "$bg" 2>/dev/null
bg=
if "$meshlm" "${train[@]}" --steps 1 --save "$work/busy" > "$work/out" 2> "$work/err"; then
  ok "the lock of a killed run does not block the next"
else
  bad "saving after the holder was killed"
fi

# 3. A run that fails after taking the lock, before any save, leaves no trace.
# gone NAME ARGS...: meshlm ARGS fails and $work/new does not exist
gone() {
  local name=$1
  shift
  "$@" > "$work/out" 2> "$work/err"
  local rc=$?
  if [ $rc -ne 0 ] && grep -q "meshlm: error" "$work/err" && [ ! -e "$work/new" ]; then
    ok "$name: the --save directory it created is gone"
  else
    bad "$name (exit $rc): $(find "$work/new" 2>&1 | tr '\n' ' ')"
  fi
}
gone "a model that does not exist" "$meshlm" train --model "$work/nosuch" \
  --data "$src/tests/fixtures/export_roundtrip/train.txt" --save "$work/new/a/ck"
gone "--batch-size 3 over 2 ranks" mpiexec -n 2 "$meshlm" "${train[@]}" --steps 1 --batch-size 3 \
  --save "$work/new"
mkdir "$work/pre"
"$meshlm" "${train[@]}" --steps 1 --save "$work/pre" --model "$work/nosuch" > "$work/out" 2> "$work/err"
rc=$?
if [ $rc -ne 0 ] && [ -d "$work/pre" ] && [ -z "$(ls -A "$work/pre")" ]; then
  ok "a --save directory that existed stays, without a lock file"
else
  bad "existing --save directory after a failed run (exit $rc): $(ls -A "$work/pre")"
fi

# 4. A save killed before its commit (rank 1 dies in the step-2 save): the
# next run saving into the directory removes step 2 at start, even one that
# then fails, and keeps the committed step 1.
MESHLM_TEST_CRASH_IN_SAVE=2:1 mpiexec -n 2 "$meshlm" "${train[@]}" --steps 2 --save-every 1 \
  --save "$work/killed" > "$work/out" 2>&1
if [ -d "$work/killed/step-00000002" ] && grep -q '"step_dir": "step-00000001"' "$work/killed/latest.json"; then
  ok "the killed save left step-00000002 uncommitted"
else
  bad "the killed save: $(ls -A "$work/killed" | tr '\n' ' ')"
fi
mpiexec -n 2 "$meshlm" "${train[@]}" --steps 1 --batch-size 3 --save "$work/killed" > "$work/out" 2> "$work/err"
note="meshlm: warning: .*/killed: removed uncommitted step-00000002 (left by a save that did not finish; committed: step-00000001)"
if [ ! -e "$work/killed/step-00000002" ] && [ -d "$work/killed/step-00000001" ] &&
   grep -q '"step_dir": "step-00000001"' "$work/killed/latest.json" &&
   [ "$(grep -c "$note" "$work/err")" -eq 1 ] && [ "$(grep -c warning "$work/err")" -eq 1 ]; then
  ok "the next run removed the uncommitted step: $(grep warning "$work/err")"
else
  bad "the uncommitted step after the next run: $(ls -A "$work/killed" | tr '\n' ' ')"
fi
if mpiexec -n 2 "$meshlm" "${train[@]}" --steps 2 --save "$work/killed" --resume "$work/killed" \
     > "$work/out" 2> "$work/err" && grep -q "resumed from .* at step 1" "$work/out" &&
   grep -q '"step_dir": "step-00000002"' "$work/killed/latest.json"; then
  ok "step 1 still resumes and step 2 commits"
else
  bad "resume after the cleaned killed save"
fi

# 5. A file system without flock (the test hook makes flock fail with each
# of ENOLCK, EOPNOTSUPP, ENOSYS): the run goes on unlocked after one
# warning naming DIR, and its checkpoint commits.
for err in ENOLCK EOPNOTSUPP ENOSYS; do
  MESHLM_TEST_FLOCK_UNSUPPORTED=$err mpiexec -n 2 "$meshlm" "${train[@]}" --steps 1 \
    --save "$work/nolock-$err" > "$work/out" 2> "$work/err"
  rc=$?
  note="meshlm: warning: .*/nolock-$err: the file system does not support flock (.*): two runs saving into .*/nolock-$err would not be kept apart; going on without the lock"
  if [ $rc -eq 0 ] && [ "$(grep -c "$note" "$work/err")" -eq 1 ] &&
     [ "$(grep -c warning "$work/err")" -eq 1 ] &&
     grep -q '"step_dir": "step-00000001"' "$work/nolock-$err/latest.json"; then
    ok "flock failing with $err: the run saves unlocked: $(grep warning "$work/err")"
  else
    bad "flock failing with $err (exit $rc): $(ls -A "$work/nolock-$err" 2>&1 | tr '\n' ' ')"
  fi
done

finish
