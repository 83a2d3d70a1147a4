#!/usr/bin/env bash
# Training throughput of the `small` Llama (~13M parameters, S=128, global
# batch 8) on 1 rank and on 4 ranks (dp_shard=2 x tp=2, without and with
# sequence parallelism): median tokens/s,
# MFU (6N + 12·L·H·S per token against the peak meshlm measures at start-up
# with a GEMM calibration, or --peak-tflops given as BENCH_PEAK_TFLOPS),
# the largest rank's peak RSS, and the
# collectives per step. Figures for notes; nothing here is asserted.
# usage: bench/train_throughput.sh [STEPS]   (after `make`)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-12}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# idle OpenMP threads must sleep, not spin, or they steal the cores OpenBLAS computes on
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
cores=$(nproc)
find src -name '*.[ch]' | sort | xargs cat > "$out/corpus.txt"
build/meshlm init --arch llama --preset small --out "$out/model" > /dev/null
args=(train --model "$out/model" --data "$out/corpus.txt" --steps "$steps" --batch-size 8 --seq-len 128 --lr 1e-3
      --peak-tflops "${BENCH_PEAK_TFLOPS:-0}")

report() { # metrics file, label: medians over the steps after the first two
  tail -n +3 "$1" | sed -E 's/.*"tokens_per_s": ?([0-9.eE+-]+).*"mfu": ?([0-9.eE+-]+).*"peak_rss_mib_max": ?([0-9.eE+-]+).*/\1 \2 \3/' |
    sort -n | awk -v label="$2" '{ t[NR] = $1; m[NR] = $2; r = $3 } END {
      i = int((NR + 1) / 2); printf "%-32s tokens/s %8.1f   MFU %5.1f%%   peak RSS %.1f MiB (largest rank)\n", label, t[i], 100 * m[i], r }'
}

OPENBLAS_NUM_THREADS=$cores OMP_NUM_THREADS=$cores build/meshlm "${args[@]}" --metrics "$out/m1.jsonl" > "$out/log1"
threads=$(( cores / 4 > 0 ? cores / 4 : 1 ))
OPENBLAS_NUM_THREADS=$threads OMP_NUM_THREADS=$threads mpirun -np 4 build/meshlm "${args[@]}" --tp 2 \
  --metrics "$out/m4.jsonl" > "$out/log4"
OPENBLAS_NUM_THREADS=$threads OMP_NUM_THREADS=$threads mpirun -np 4 build/meshlm "${args[@]}" --tp 2 \
  --sequence-parallel --metrics "$out/m4sp.jsonl" > "$out/log4sp"
echo "small Llama, S=128, global batch 8, $cores cores, $steps steps (median of steps 3..$steps)"
report "$out/m1.jsonl" "1 rank ($cores threads)"
report "$out/m4.jsonl" "4 ranks dp_shard=2 x tp=2"
report "$out/m4sp.jsonl" "4 ranks dp_shard=2 x tp=2 + SP"
grep "collectives" "$out/log4" "$out/log4sp"
