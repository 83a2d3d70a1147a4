#!/usr/bin/env bash
# --device-comm staged (comm/comm_staged.h: every collective copied device →
# host staging → MPI → host → device) on the CPU backend, whose device pool
# and host staging pool are distinct memory: on every mesh of 2 and 4 ranks
# (dp_shard=2, tp=2, dp_shard=2 x tp=2 + SP, HSDP dp_replicate=2 x
# dp_shard=2, cp=2, and dp_shard=2 with bf16 parameters and reductions)
# three training steps give bitwise the losses and gradient norms of the
# plain MPI comm, and an export of the same bytes: the same MPI reductions
# on the same bytes. Rank 0 says which comm the mesh uses, once. Refusals:
# --device-comm nccl on the cpu device fails on every rank, naming the flag;
# an unknown value names the choices.
# usage: test_device_comm.sh MESHLM SOURCE_DIR ...
set -euo pipefail
source "$(dirname "$0")/common.sh"
meshlm=$1 src=$2
"$meshlm" init --arch llama --preset tiny --seed 3 --out "$work/model" > /dev/null
train=(train --model "$work/model" --data "$src/README.md" --seq-len 64 --batch-size 8 --steps 3
       --lr 1e-3 --peak-tflops 1)
# numbers FILE: each metrics line's loss and grad_norm, as printed
numbers() { sed -E 's/.*"loss":([^,]+),"grad_norm":([^,]+),.*/\1 \2/' "$1"; }
check() { # NAME RANKS FLAGS...
  local name=$1 ranks=$2
  shift 2
  local comm
  for comm in mpi staged; do
    local flags=()
    [ "$comm" = staged ] && flags=(--device-comm staged)
    rm -rf "$work/$comm"
    if ! mpiexec -n "$ranks" "$meshlm" "${train[@]}" "$@" "${flags[@]}" \
        --metrics "$work/$comm.jsonl" --export-hf "$work/$comm" > /dev/null 2> "$work/err.$comm"; then
      cp "$work/err.$comm" "$work/err"
      bad "$name: the $comm run failed"
      return
    fi
  done
  local lines
  lines=$(grep -c '^meshlm: device comm: staged' "$work/err.staged" || true)
  if [ "$lines" -ne 1 ] || grep -q '^meshlm: device comm' "$work/err.mpi"; then
    bad "$name: $lines 'device comm: staged' lines with staged (expected 1), and with MPI: $(
      grep '^meshlm: device comm' "$work/err.mpi" || echo none)"
  elif [ "$(numbers "$work/mpi.jsonl")" != "$(numbers "$work/staged.jsonl")" ] ||
       [ "$(wc -l < "$work/mpi.jsonl")" -ne 3 ]; then
    bad "$name: losses and grad norms differ: $(numbers "$work/mpi.jsonl" | tr '\n' ' ') vs $(
      numbers "$work/staged.jsonl" | tr '\n' ' ')"
  elif ! cmp -s "$work/mpi/model.safetensors" "$work/staged/model.safetensors"; then
    bad "$name: the exported weights differ"
  else
    ok "$name: 3 steps' losses and grad norms and the export bitwise equal ($(
      numbers "$work/staged.jsonl" | tail -1))"
  fi
}
check "dp_shard=2" 2
check "tp=2" 2 --tp 2
check "dp_shard=2 x tp=2 + SP" 4 --tp 2 --sequence-parallel
check "HSDP dp_replicate=2 x dp_shard=2" 4 --dp-replicate 2
check "cp=2" 2 --cp 2
check "dp_shard=2, bf16 params and reductions" 2 --param-dtype bf16 --reduce-dtype bf16
# logprobs: the same output bytes on dp=2 (vocab-parallel over 2) and tp=2 + SP
awk 'BEGIN { srand(7); for (k = 0; k < 5; k++) { n = 2 + int(rand() * 60); printf "{\"input_ids\": [";
             for (i = 0; i < n; i++) printf "%s%d", i ? ", " : "", int(rand() * 256); print "]}" } }' \
  > "$work/in.jsonl"
for mesh in "" "--tp 2 --sequence-parallel"; do
  lp=(logprobs --model "$work/model" --data "$work/in.jsonl" $mesh)
  if mpiexec -n 2 "$meshlm" "${lp[@]}" --out "$work/lp_mpi.jsonl" > /dev/null 2> "$work/err" &&
      mpiexec -n 2 "$meshlm" "${lp[@]}" --device-comm staged --out "$work/lp_staged.jsonl" \
        > /dev/null 2> "$work/err" &&
      cmp -s "$work/lp_mpi.jsonl" "$work/lp_staged.jsonl"; then
    ok "logprobs ${mesh:-dp=2}: the staged comm's output bitwise the MPI comm's"
  else
    bad "logprobs ${mesh:-dp=2}: failed or differs"
  fi
done
# the line names the comm and the reason
if grep -q 'staged (MPI through host staging buffers), as train: flag --device-comm staged asks' \
    "$work/err.staged"; then
  ok "rank 0's line: $(cat "$work/err.staged" | grep '^meshlm: device comm')"
else
  bad "rank 0's line: $(grep '^meshlm: device comm' "$work/err.staged" || echo none)"
fi
# refusals: every rank exits non-zero
if mpiexec -n 2 "$meshlm" "${train[@]}" --device-comm nccl > /dev/null 2> "$work/err"; then
  bad "--device-comm nccl on cpu: ran"
elif grep -q "train: flag --device-comm nccl: device 'cpu' keeps tensors in host memory" \
    "$work/err"; then
  ok "--device-comm nccl on cpu: refused, naming the flag"
else
  bad "--device-comm nccl on cpu: unexpected message"
fi
if "$meshlm" "${train[@]}" --device-comm gloo > /dev/null 2> "$work/err"; then
  bad "--device-comm gloo: ran"
elif grep -q -- "--device-comm" "$work/err" && grep -q "staged" "$work/err"; then
  ok "--device-comm gloo: refused: $(head -1 "$work/err")"
else
  bad "--device-comm gloo: unexpected message"
fi
finish
