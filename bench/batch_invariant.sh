#!/usr/bin/env bash
# The cost of the batch-invariant mode (--batch-invariant): the same work
# with the mode off and on, side by side, on the `small` Llama (~13M, the
# demo's) and, when present, /work/real/smollm2-135m-fp32 (MESHLM_REAL names
# another directory), 1 rank on every core:
#   - scoring: `meshlm logprobs` of N random sequences (bench_api_logprobs
#     --dump-only writes them), tokens/s of the whole process, median of
#     BENCH_ITERS runs;
#   - training: `meshlm train` (global batch 8, S=128), median tokens/s of
#     steps 3.. from --metrics;
#   - generation: Policy.generate (the Python binding) of 4 prompts of 64
#     tokens, 64 new tokens each (KV-cache decode), generated tokens/s of the
#     call after a warm-up one.
# fp32, and bf16 param_dtype. Figures for notes; nothing here is asserted.
# usage: bench/batch_invariant.sh [BUILD_DIR]   (after building meshlm and bench_api_logprobs)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
meshlm=$build/meshlm
bench=$build/bench_api_logprobs
for b in "$meshlm" "$bench"; do
  [[ -x $b ]] || { echo "batch_invariant.sh: $b not built (cmake --build $build)" >&2; exit 1; }
done
real=${MESHLM_REAL:-/work/real}
iters=${BENCH_ITERS:-3}
steps=${BENCH_STEPS:-8}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# idle OpenMP threads must sleep, not spin, or they steal the cores the GEMMs compute on
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
cores=$(nproc)
export OMP_NUM_THREADS=$cores OPENBLAS_NUM_THREADS=$cores
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -n 1)

"$meshlm" init --arch llama --preset small --seed 0 --out "$out/small" > /dev/null
find src -name '*.[ch]' | sort | xargs cat > "$out/corpus.txt"
# name dir n min-len max-len
models=("small $out/small 64 16 512")
[[ -f $real/smollm2-135m-fp32/config.json ]] && models+=("smollm2-135m $real/smollm2-135m-fp32 16 32 256")

median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

# score DIR TOKENS FLAGS...: tokens/s of `meshlm logprobs`, median of $iters runs
score() {
  local dir=$1 tokens=$2 TIMEFORMAT='%R'
  shift 2
  for _ in $(seq "$iters"); do
    { time "$meshlm" logprobs --model "$dir" --data "$out/seqs.jsonl" --out "$out/lp.jsonl" \
        "$@" > /dev/null 2>&1; } 2>&1 | awk -v n="$tokens" '{ printf "%.1f\n", n / $1 }'
  done | median
}

# decode DIR DTYPE INVARIANT(0|1): generated tokens/s of Policy.generate (bench/decode_rate.py)
decode() {
  local inv=false
  [[ $3 == 1 ]] && inv=true
  PYTHONPATH=python MESHLM_LIBRARY=$build/libmeshlm.so python3 bench/decode_rate.py "$1" \
    param_dtype="$2" batch_invariant=$inv
}

# train DIR FLAGS...: median tokens/s of steps 3..
train() {
  local dir=$1
  shift
  "$meshlm" train --model "$dir" --data "$out/corpus.txt" --steps "$steps" --batch-size 8 \
    --seq-len 128 --lr 1e-4 --metrics "$out/m.jsonl" "$@" > /dev/null 2>&1
  tail -n +3 "$out/m.jsonl" | sed -E 's/.*"tokens_per_s": ?([0-9.eE+-]+).*/\1/' | median
}

echo "batch-invariant mode: off vs on, 1 rank x $cores threads, $cpu"
printf '%-14s %-6s %-9s %12s %12s %8s\n' model dtype work "off tok/s" "on tok/s" "on/off"
for m in "${models[@]}"; do
  read -r name dir n lmin lmax <<< "$m"
  OMP_NUM_THREADS=1 "$bench" --model "$dir" --n "$n" --min-len "$lmin" --max-len "$lmax" \
    --seed 1 --dump "$out/seqs.jsonl" --dump-only
  tokens=$(sed 's/[^,]//g' "$out/seqs.jsonl" | awk '{ t += length($0) + 1 } END { print t }')
  for dt in fp32 bf16; do
    s0=$(score "$dir" "$tokens" --param-dtype "$dt")
    s1=$(score "$dir" "$tokens" --param-dtype "$dt" --batch-invariant)
    t0=$(train "$dir" --param-dtype "$dt")
    t1=$(train "$dir" --param-dtype "$dt" --batch-invariant)
    g0=$(decode "$dir" "$dt" 0)
    g1=$(decode "$dir" "$dt" 1)
    awk -v m="$name" -v d="$dt" -v a="$s0" -v b="$s1" -v c="$t0" -v e="$t1" -v f="$g0" -v g="$g1" 'BEGIN {
      printf "%-14s %-6s %-9s %12.1f %12.1f %8.2f\n", m, d, "logprobs", a, b, b / a
      printf "%-14s %-6s %-9s %12.1f %12.1f %8.2f\n", m, d, "train", c, e, e / c
      printf "%-14s %-6s %-9s %12.1f %12.1f %8.2f\n", m, d, "decode", f, g, g / f }'
  done
done
