#!/usr/bin/env bash
# The run's contract under faults (issue 9): a rank other than 0 failing
# during a save reaches the user with its own message and rank, and the
# failed save leaves nothing behind while the committed checkpoint stays
# loadable; a second run saving into a directory in use is refused at start
# naming the holder, on every rank; a lock left by a killed run does not
# block the next one.
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
limited="if [ \"\$OMPI_COMM_WORLD_RANK\" = 1 ]; then trap '' XFSZ; ulimit -f 64; fi; exec \"\$@\""
OMPI_MCA_btl=self,tcp mpiexec -n 2 bash -c "$limited" limited "$meshlm" "${train[@]}" --steps 3 \
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

finish
