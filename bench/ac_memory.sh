#!/usr/bin/env bash
# Activation checkpointing: peak RSS and tokens/s of the `small` Llama
# (~13M parameters) on one rank for every --activation-checkpointing mode,
# at S=512 with global batch 4, where the saved activations dominate the
# memory (attention saves only its log-sum-exp: `selective` drops little).
# Figures for notes; nothing asserted.
# usage: bench/ac_memory.sh [STEPS]   (after `make`)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-6}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
export OPENBLAS_NUM_THREADS=$(nproc) OMP_NUM_THREADS=$(nproc)
find src -name '*.[ch]' | sort | xargs cat > "$out/corpus.txt"
build/meshlm init --arch llama --preset small --out "$out/model" > /dev/null
args=(train --model "$out/model" --data "$out/corpus.txt" --steps "$steps" --batch-size 4 --seq-len 512 --lr 1e-3)

echo "small Llama, S=512, global batch 4, 1 rank x $(nproc) threads, $steps steps"
for mode in none selective mlp layer; do
  build/meshlm "${args[@]}" --activation-checkpointing "$mode" --metrics "$out/$mode.jsonl" > /dev/null
  loss=$(tail -n 1 "$out/$mode.jsonl" | sed -E 's/.*"loss": ?([0-9.eE+-]+).*/\1/')
  tail -n +3 "$out/$mode.jsonl" |
    sed -E 's/.*"tokens_per_s": ?([0-9.eE+-]+).*"peak_rss_mib_max": ?([0-9.eE+-]+).*/\1 \2/' |
    sort -g | awk -v m="$mode" -v l="$loss" '{ t[NR] = $1; if ($2 > r) r = $2 } END {
      printf "%-10s peak RSS %7.1f MiB   tokens/s %7.1f (median)   last loss %s\n", m, r, t[int((NR + 1) / 2)], l }'
done
