#!/usr/bin/env bash
# --cpu-offload (FSDP2's CPUOffloadPolicy, parallel/fsdp.h) on the CPU backend, whose device and host
# pools are distinct: the same run with and without it gives bitwise the same numbers —
#  (a) three AdamW steps with gradient accumulation (2 micro-batches) and clipping (a norm bound the
#      tiny model's gradients exceed): every step's loss and grad norm as the metrics print them
#      (17 digits) and the exported safetensors byte for byte, on 1 rank, dp_shard 2,
#      dp_shard 2 x tp 2 + SP, and HSDP (dp_replicate 2 x dp_shard 2); bf16 parameters and
#      reductions on dp_shard 2; ZeRO-2 on dp_shard 2;
#  (b) a run checkpoint saved with offload, resumed with offload, equals the uninterrupted run
#      without it (losses and export), and the checkpoint's files equal those saved without offload;
#  (c) the device pool's peak of each pair is printed (the metrics' device_peak_mib), never asserted:
#      tests do not assert memory; tests/mpi/test_predict.c checks that the device pool holds no
#      shard under offload, against the prediction.
# usage: test_cpu_offload.sh MESHLM SOURCE_DIR
set -eu
meshlm=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
pass=0
ok() { pass=$((pass + 1)); echo "ok   $1"; }
fail() { echo "FAIL $1"; exit 1; }

"$meshlm" init --arch llama --preset tiny --seed 3 --out "$work/model" > /dev/null
base=(train --model "$work/model" --data "$src/README.md" --seq-len 64 --batch-size 8 --lr 1e-3
  --grad-accum 2 --max-grad-norm 0.05 --peak-tflops 1)
# numbers FILE: each step's loss and grad norm as written (17 significant digits)
numbers() { sed -E 's/.*"loss":([^,]+),"grad_norm":([^,]+),.*/\1 \2/' "$1"; }
peak() { grep -o '"device_peak_mib":[0-9.]*' "$1" | tail -1 | cut -d: -f2; }
# launch NP ARGS...: one process, or an MPI job of NP
launch() {
  local np=$1
  shift
  if [ "$np" -eq 1 ]; then "$meshlm" "$@"; else mpiexec -n "$np" "$meshlm" "$@"; fi
}

# (a) + (c)
for mesh in "1" "2" "4 --tp 2 --sequence-parallel" "4 --dp-replicate 2" \
  "2 --param-dtype bf16 --reduce-dtype bf16" "2 --zero 2"; do
  set -- $mesh
  np=$1
  shift
  for off in false true; do
    launch "$np" "${base[@]}" --steps 3 "$@" --cpu-offload=$off --metrics "$work/m_$off.jsonl" \
      --export-hf "$work/e_$off" > "$work/out_$off.txt"
  done
  [ "$(numbers "$work/m_false.jsonl")" = "$(numbers "$work/m_true.jsonl")" ] ||
    { paste <(numbers "$work/m_false.jsonl") <(numbers "$work/m_true.jsonl"); fail "losses/norms differ on $mesh"; }
  cmp "$work/e_false/model.safetensors" "$work/e_true/model.safetensors" ||
    fail "exports differ on $mesh"
  echo "     device pool peak on $mesh rank(s): $(peak "$work/m_false.jsonl") MiB, offloaded" \
    "$(peak "$work/m_true.jsonl") MiB"
  rm -rf "$work/e_false" "$work/e_true"
  ok "--cpu-offload bitwise on $mesh rank(s): losses, grad norms, export"
done

# (b) resume
launch 2 "${base[@]}" --steps 2 --cpu-offload --save "$work/ck_true" > /dev/null
launch 2 "${base[@]}" --steps 2 --save "$work/ck_false" > /dev/null
for f in "$work"/ck_false/step-*/*.safetensors; do
  cmp "$f" "$work/ck_true/${f#"$work"/ck_false/}" || fail "checkpoint file ${f##*/} differs"
done
launch 2 "${base[@]}" --steps 4 --cpu-offload --resume "$work/ck_true" --metrics "$work/r.jsonl" \
  --export-hf "$work/e_r" > /dev/null
launch 2 "${base[@]}" --steps 4 --metrics "$work/u.jsonl" --export-hf "$work/e_u" > /dev/null
[ "$(numbers "$work/r.jsonl")" = "$(numbers "$work/u.jsonl" | tail -2)" ] ||
  { paste <(numbers "$work/r.jsonl") <(numbers "$work/u.jsonl"); fail "resumed losses differ"; }
cmp "$work/e_r/model.safetensors" "$work/e_u/model.safetensors" || fail "resumed export differs"
ok "a checkpoint saved with --cpu-offload: its files those without, resumed = uninterrupted"

echo "$pass passed"
