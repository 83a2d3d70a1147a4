#!/usr/bin/env bash
# meshlm train --device cuda on meshes whose ranks share one GPU (the GPU
# machines lent have one): one step of a tiny Llama on 1 rank, then on
# dp_shard=2, tp=2, dp_shard=2 x tp=2 + SP and HSDP (dp_replicate=2 x
# dp_shard=2) with --device-comm staged
# (comm/comm_staged.h), each step's loss and gradient norm within the pair
# bound of tests/tolerance.h §3 (tol_bound: two fp32 evaluations in
# different orders; |Δ‖g‖| <= ‖Δg‖) of the one-rank run's; then
# dp_shard=2 under --device-comm auto with NCCL_MULTI_RANK_GPU_ENABLE=1:
# where rank 0's line says NCCL serves it (NCCL >= 2.30), its loss, norm
# and export bitwise equal to the staged comm's (a sum over two ranks is
# one addition either way), else the line is printed and the NCCL run
# counted as not run. Exits 77 (skipped) when --device cuda cannot start
# (no GPU, a build without CUDA).
# usage: test_device_comm_train.sh MESHLM SOURCE_DIR TOL_BOUND
set -uo pipefail
meshlm=$1 src=$2 tol_bound=$3
source "$src/tests/cli/common.sh"
launcher=${MESHLM_MPIEXEC:-$(command -v mpiexec)}
"$meshlm" init --arch llama --preset tiny --seed 3 --out "$work/model" > /dev/null
train=(train --model "$work/model" --data "$src/README.md" --seq-len 64 --batch-size 8 --steps 1
       --lr 1e-3 --device cuda --peak-tflops 1)
if ! "$meshlm" "${train[@]}" --metrics "$work/one.jsonl" > /dev/null 2> "$work/err"; then
  if grep -q "no CUDA GPU is visible\|has no CUDA backend" "$work/err"; then
    echo "skipped: $(head -1 "$work/err")"
    exit 77
  fi
  bad "1 rank on cuda failed"
  finish
  exit 1
fi
numbers() { sed -E 's/.*"loss":([^,]+),"grad_norm":([^,]+),.*/\1 \2/' "$1"; }
bound_loss=$("$tol_bound" "$work/model" loss pair 64 512)
bound_grads=$("$tol_bound" "$work/model" grads pair 64 512)
read -r loss1 norm1 < <(numbers "$work/one.jsonl")
# near NAME METRICS: the run's loss and norm within the bounds of the one-rank run's
near() {
  local loss norm
  read -r loss norm < <(numbers "$2")
  if awk -v a="$loss" -v b="$loss1" -v t="$bound_loss" -v g="$norm" -v h="$norm1" \
      -v u="$bound_grads" 'function abs(x) { return x < 0 ? -x : x }
      BEGIN { exit !(abs(a - b) <= t * abs(b) && abs(g - h) <= u * abs(h)) }'; then
    ok "$1: loss $loss, grad norm $norm vs 1 rank $loss1, $norm1 (bounds $bound_loss, $bound_grads)"
  else
    bad "$1: loss $loss, grad norm $norm vs 1 rank $loss1, $norm1 (bounds $bound_loss, $bound_grads)"
  fi
}
# mesh NAME RANKS OUT FLAGS...: a run, its stderr in OUT.err
mesh() {
  local name=$1 ranks=$2 out=$3
  shift 3
  rm -rf "$work/$out"
  if "$launcher" -n "$ranks" "$meshlm" "${train[@]}" "$@" --metrics "$work/$out.jsonl" \
      --export-hf "$work/$out" > /dev/null 2> "$work/$out.err"; then
    return 0
  fi
  cp "$work/$out.err" "$work/err"
  bad "$name: failed"
  return 1
}
mesh "dp_shard=2, staged" 2 dp2 --device-comm staged && near "dp_shard=2, staged" "$work/dp2.jsonl"
mesh "tp=2, staged" 2 tp2 --device-comm staged --tp 2 && near "tp=2, staged" "$work/tp2.jsonl"
mesh "dp_shard=2 x tp=2 + SP, staged" 4 dp2tp2 --device-comm staged --tp 2 --sequence-parallel &&
  near "dp_shard=2 x tp=2 + SP, staged" "$work/dp2tp2.jsonl"
mesh "cp=2, staged" 2 cp2 --device-comm staged --cp 2 && near "cp=2, staged" "$work/cp2.jsonl"
mesh "HSDP dp_replicate=2 x dp_shard=2, staged" 4 hsdp --device-comm staged --dp-replicate 2 &&
  near "HSDP dp_replicate=2 x dp_shard=2, staged" "$work/hsdp.jsonl"
if NCCL_MULTI_RANK_GPU_ENABLE=1 mesh "dp_shard=2, auto" 2 auto; then
  line=$(grep '^meshlm: device comm' "$work/auto.err" || echo "no line")
  if [[ $line != "meshlm: device comm: nccl"* ]]; then
    echo "not run: NCCL on 2 ranks of one GPU: $line"
  elif [ "$(numbers "$work/auto.jsonl")" = "$(numbers "$work/dp2.jsonl")" ] &&
      cmp -s "$work/auto/model.safetensors" "$work/dp2/model.safetensors"; then
    ok "dp_shard=2 on NCCL bitwise the staged comm's ($line)"
  else
    bad "dp_shard=2 on NCCL: $(numbers "$work/auto.jsonl") vs staged $(numbers "$work/dp2.jsonl")"
  fi
fi
finish
