#!/usr/bin/env bash
# `meshlm plan`'s predicted device memory against a real 1-step run, per
# activation checkpointing mode, with and without sequence parallelism, on
# the SmolLM2-135M-shaped model (preset smollm2-135m, random weights) at
# S = SEQ, B = BATCH sequences: plan's train_peak (the engine's step on the
# meta backend, engine/predict.h) vs the run's device_peak_mib (the device
# pool's peak, torch.cuda.max_memory_allocated's count) and its peak RSS.
# Meshes: 1 rank, and 3 ranks tp=3 (+SP; SmolLM2 has 9 heads, 3 kv heads).
# --peak-tflops is given, so no GEMM calibration runs before the step.
# Memory does not depend on the load, so shared cores do not move these figures.
# usage: bench/plan_memory.sh [SEQ [BATCH]]   (after `make`; defaults 512 and 4)
set -euo pipefail
cd "$(dirname "$0")/.."
S=${1:-512}
B=${2:-4}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=passive OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
build/meshlm init --arch llama --preset smollm2-135m --out "$out/m" > /dev/null
awk -v n="$B" -v S="$S" 'BEGIN { srand(0); for (i = 0; i < n; i++) {
  printf "{\"input_ids\": [%d", int(rand() * 49152)
  for (t = 1; t < S; t++) printf ", %d", int(rand() * 49152)
  print "]}" } }' > "$out/ids.jsonl"
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
printf "%-34s %-10s %12s %12s %8s %10s\n" mesh ac "plan MiB" "run MiB" "diff" "RSS MiB"
for mesh in "1" "3 --tp 3" "3 --tp 3 --sequence-parallel"; do
  np=${mesh%% *}
  flags=${mesh#"$np"}
  for ac in none mlp layer selective; do
    # shellcheck disable=SC2086
    predicted=$(build/meshlm plan --model "$out/m" $flags --seq-len "$S" --batch-size "$B" \
      --activation-checkpointing "$ac" --json |
      python3 -c 'import json, sys
print(json.load(sys.stdin)["per_tp_rank"][0]["memory_bytes"]["train_peak"])')
    # shellcheck disable=SC2086
    mpirun -np "$np" build/meshlm train --model "$out/m" --data "$out/ids.jsonl" $flags \
      --seq-len "$S" --batch-size "$B" --steps 1 --activation-checkpointing "$ac" \
      --peak-tflops 1 --metrics "$out/m.jsonl" > /dev/null
    run=$(sed -E 's/.*"device_peak_mib": ?([0-9.eE+-]+).*/\1/' "$out/m.jsonl")
    rss=$(sed -E 's/.*"peak_rss_mib_max": ?([0-9.eE+-]+).*/\1/' "$out/m.jsonl")
    p=$(mib "$predicted")
    printf "%-34s %-10s %12s %12.1f %7s%% %10.1f\n" "np=$np$flags" "$ac" "$p" "$run" \
      "$(awk -v a="$run" -v b="$p" 'BEGIN { printf "%+.2f", 100 * (a - b) / a }')" "$rss"
  done
done
lscpu | sed -nE 's/^Model name: *(.*)/CPU: \1/p' | head -n 1
