#!/usr/bin/env bash
# The cost of the batch-invariant mode (--batch-invariant) under tensor
# parallelism: tp 2 (2 ranks x 1 thread), the `small` Llama (~13M, the
# demo's), mode off vs on, with the vocab-parallel plan (embed_tokens
# rowwise, lm_head colwise with vocab-sharded logits: the plan whose bits the
# mode keeps across tp sizes, its logits gathered into whole rows per block),
# the default plan and the default plan with sequence parallelism (in the mode
# the row-parallel o_proj / down_proj computed whole on each tp rank from
# all-gathered inputs and weights, parallel/tp_whole.h: tp× their FLOPs).
# Scoring: `meshlm logprobs` tokens/s of the whole run, median of
# BENCH_ITERS; training: `meshlm train` (global batch 8, S=128), median
# tokens/s of steps 3.. from --metrics; decode: Policy.generate's tokens/s
# on the tp 2 mesh (the mode's row-parallel weights gathered once per call).
# fp32. Figures for notes; nothing is asserted.
# usage: bench/batch_invariant_tp.sh [BUILD_DIR]   (after building meshlm and bench_api_logprobs)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
meshlm=$(realpath "$build/meshlm")
bench=$build/bench_api_logprobs
for b in "$meshlm" "$bench"; do
  [[ -x $b ]] || { echo "batch_invariant_tp.sh: $b not built (cmake --build $build)" >&2; exit 1; }
done
iters=${BENCH_ITERS:-3}
steps=${BENCH_STEPS:-8}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive} OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -n 1)
mpi=(mpiexec -np 2 --oversubscribe)
[[ $(id -u) == 0 ]] && mpi+=(--allow-run-as-root)

"$meshlm" init --arch llama --preset small --seed 0 --out "$out/small" > /dev/null
find src -name '*.[ch]' | sort | xargs cat > "$out/corpus.txt"
cat > "$out/vocab.json" <<'JSON'
{"model.embed_tokens": "embedding_rowwise",
 "lm_head": {"style": "ColwiseParallel", "output_layouts": "Shard(-1)", "use_local_output": false}}
JSON
"$bench" --model "$out/small" --n 64 --min-len 16 --max-len 512 --seed 1 \
  --dump "$out/seqs.jsonl" --dump-only
tokens=$(sed 's/[^,]//g' "$out/seqs.jsonl" | awk '{ t += length($0) + 1 } END { print t }')

median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

# score FLAGS...: tokens/s of `meshlm logprobs` on tp 2, median of $iters runs
score() {
  local TIMEFORMAT='%R'
  for _ in $(seq "$iters"); do
    { time "${mpi[@]}" "$meshlm" logprobs --model "$out/small" --data "$out/seqs.jsonl" \
        --out "$out/lp.jsonl" --tp 2 "$@" > /dev/null 2>&1; } 2>&1 |
      awk -v n="$tokens" '{ printf "%.1f\n", n / $1 }'
  done | median
}

# decode PLAN SP(0|1) INVARIANT(0|1): generated tokens/s of Policy.generate on the tp 2 mesh
# (bench/decode_rate.py), rank 0's
decode() {
  local sp=false inv=false
  [[ $2 == 1 ]] && sp=true
  [[ $3 == 1 ]] && inv=true
  PYTHONPATH=python MESHLM_LIBRARY=$build/libmeshlm.so "${mpi[@]}" python3 bench/decode_rate.py \
    "$out/small" tp=2 parallel_plan="$1" sequence_parallel=$sp batch_invariant=$inv \
    2> /dev/null | head -n 1
}

# train FLAGS...: median tokens/s of steps 3.. on tp 2
train() {
  "${mpi[@]}" "$meshlm" train --model "$out/small" --data "$out/corpus.txt" --steps "$steps" \
    --batch-size 8 --seq-len 128 --lr 1e-4 --tp 2 --metrics "$out/m.jsonl" "$@" > /dev/null 2>&1
  tail -n +3 "$out/m.jsonl" | sed -E 's/.*"tokens_per_s": ?([0-9.eE+-]+).*/\1/' | median
}

echo "batch-invariant mode under tp 2: off vs on, 2 ranks x 1 thread, fp32, $cpu"
printf '%-11s %-9s %12s %12s %8s\n' plan work "off tok/s" "on tok/s" "on/off"
for plan in vocab default default-sp; do
  case $plan in
    vocab) f=(--parallel-plan "$out/vocab.json") ;;
    default) f=(--parallel-plan default) ;;
    default-sp) f=(--parallel-plan default --sequence-parallel) ;;
  esac
  s0=$(score "${f[@]}")
  s1=$(score "${f[@]}" --batch-invariant)
  t0=$(train "${f[@]}")
  t1=$(train "${f[@]}" --batch-invariant)
  case $plan in
    vocab) g=("$out/vocab.json" 0) ;;
    default) g=(default 0) ;;
    default-sp) g=(default 1) ;;
  esac
  d0=$(decode "${g[@]}" 0)
  d1=$(decode "${g[@]}" 1)
  awk -v m="$plan" -v a="$s0" -v b="$s1" -v c="$t0" -v e="$t1" -v f="$d0" -v h="$d1" 'BEGIN {
    printf "%-11s %-9s %12.1f %12.1f %8.2f\n", m, "logprobs", a, b, b / a
    printf "%-11s %-9s %12.1f %12.1f %8.2f\n", m, "train", c, e, e / c
    printf "%-11s %-9s %12.1f %12.1f %8.2f\n", m, "decode", f, h, h / f }'
done
