#!/usr/bin/env bash
# Frozen parameters (--freeze, engine/freeze.h) against full training, one rank: the
# smollm2-135m preset (tied embeddings: freezing embed_tokens freezes lm_head too), S=512,
# global batch 4, full vs --freeze FREEZE (default: the embedding and layers 0-9 of 30,
# so backward stops at layer 10): median tokens/s, the peak RSS, and `meshlm plan`'s device
# memory for both. Figures for notes; nothing here is asserted.
# usage: bench/freeze.sh [STEPS [FREEZE]]   (after `make`)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-4}
freeze=${2:-'model.embed_tokens.*,model.layers.[0-9].*'}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# idle OpenMP threads must sleep, not spin, or they steal the cores OpenBLAS computes on
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
cores=$(nproc)
export OPENBLAS_NUM_THREADS=$cores OMP_NUM_THREADS=$cores
find src -name '*.[ch]' | sort | xargs cat > "$out/corpus.txt"
build/meshlm init --arch llama --preset smollm2-135m --out "$out/model" > /dev/null
args=(train --model "$out/model" --data "$out/corpus.txt" --steps "$steps" --batch-size 4 --seq-len 512
      --lr 1e-4 --peak-tflops "${BENCH_PEAK_TFLOPS:-1}")

# shellcheck source=bench/metrics_report.sh
. bench/metrics_report.sh
plan_mem() { # label, flags: plan's FSDP shards and step peak
  build/meshlm plan --model "$out/model" --batch-size 4 --seq-len 512 "${@:2}" |
    grep -E 'FSDP shards|peak of one training step|frozen \(' | sed "s/^ */$1: /"
}

load=$(cut -d' ' -f1-3 /proc/loadavg)
build/meshlm "${args[@]}" --metrics "$out/full.jsonl" > /dev/null
build/meshlm "${args[@]}" --freeze "$freeze" --metrics "$out/frozen.jsonl" > "$out/log"
echo "smollm2-135m, S=512, global batch 4, 1 rank x $cores threads, $steps steps (median of steps 2..$steps)"
echo "load average before the runs: $load, after: $(cut -d' ' -f1-3 /proc/loadavg)"
grep -- '--freeze' "$out/log"
report "$out/full.jsonl" "full"
report "$out/frozen.jsonl" "frozen"
plan_mem full
plan_mem frozen --freeze "$freeze"
