#!/usr/bin/env bash
# FSDP communication of the `small` Llama (~13M parameters, S=128, global
# batch 8) on 4 ranks, dp_shard=4: per configuration the median time per
# step the ranks spent blocked on FSDP collectives (fsdp_wait_ms: blocking
# collectives plus waits on prefetched all-gathers, max over ranks), tokens/s
# and the bytes of the last step's collectives. Configurations: prefetch off
# (--prefetch-forward 0 --prefetch-backward 0) against the default (forward
# 1, backward 2); fp32 against bf16 all-gather (--param-dtype bf16) and bf16
# reduction; HSDP (--dp-replicate 2). Figures for notes; nothing asserted.
# usage: bench/fsdp_overlap.sh [STEPS]   (after `make`)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-12}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
threads=$(( $(nproc) / 4 > 0 ? $(nproc) / 4 : 1 ))
export OPENBLAS_NUM_THREADS=$threads OMP_NUM_THREADS=$threads
find src -name '*.[ch]' | sort | xargs cat > "$out/corpus.txt"
build/meshlm init --arch llama --preset small --out "$out/model" > /dev/null
args=(train --model "$out/model" --data "$out/corpus.txt" --steps "$steps" --batch-size 8 --seq-len 128 --lr 1e-3)

median() { # metrics file, key: median over the steps after the first two
  tail -n +3 "$1" | sed -E "s/.*\"$2\": ?([0-9.eE+-]+).*/\1/" | sort -g |
    awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}

run() { # label, extra flags...
  local label=$1 tag
  tag=$(printf %s "$1" | tr -c "A-Za-z0-9" _)
  shift
  mpirun -np 4 build/meshlm "${args[@]}" "$@" --metrics "$out/$tag.jsonl" > "$out/$tag.log"
  printf "%-34s fsdp wait %7.1f ms/step   tokens/s %7.1f\n" "$label" \
    "$(median "$out/$tag.jsonl" fsdp_wait_ms)" "$(median "$out/$tag.jsonl" tokens_per_s)"
  grep "collectives of the last step" "$out/$tag.log" | sed 's/^train: /    /'
}

echo "small Llama, S=128, global batch 8, 4 ranks x $threads thread(s), $steps steps (median of steps 3..$steps)"
run "dp_shard=4, no prefetch" --prefetch-forward 0 --prefetch-backward 0
run "dp_shard=4, prefetch 1/2"
run "dp_shard=4, prefetch 2/3" --prefetch-forward 2 --prefetch-backward 3
run "dp_shard=4, bf16 params" --param-dtype bf16
run "dp_shard=4, bf16 params + reduce" --param-dtype bf16 --reduce-dtype bf16
run "HSDP 2x2, prefetch 1/2" --dp-replicate 2
