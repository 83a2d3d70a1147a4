#!/usr/bin/env bash
# LoRA (--lora-rank, engine/lora.h) against full fine-tuning, one rank: the smollm2-135m preset,
# S=512, global batch 4, full vs --lora-rank RANK (default 16) --lora-alpha 2*RANK on every
# linear of the decoder (all-linear): median tokens/s, the peak RSS, and `meshlm plan`'s device
# memory for both; with DROPOUT > 0 a third run with --lora-dropout DROPOUT (model/lora_drop.h:
# the masks drawn on the host, forward and again in backward). Figures for notes; nothing here
# is asserted.
# usage: bench/lora.sh [STEPS [RANK [DROPOUT]]]   (after `make`)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-4}
rank=${2:-16}
dropout=${3:-0}
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
lora=(--lora-rank "$rank" --lora-alpha $((2 * rank)) --lora-targets all-linear)

# shellcheck source=bench/metrics_report.sh
. bench/metrics_report.sh
plan_mem() { # label, flags: plan's FSDP shards and step peak
  build/meshlm plan --model "$out/model" --batch-size 4 --seq-len 512 "${@:2}" |
    grep -E 'FSDP shards|peak of one training step' | sed "s/^ */$1: /"
}

load=$(cut -d' ' -f1-3 /proc/loadavg)
build/meshlm "${args[@]}" --metrics "$out/full.jsonl" > /dev/null
build/meshlm "${args[@]}" "${lora[@]}" --metrics "$out/lora.jsonl" > /dev/null
drop=(--lora-dropout "$dropout")
if [ "$dropout" != 0 ]; then
  build/meshlm "${args[@]}" "${lora[@]}" "${drop[@]}" --metrics "$out/drop.jsonl" > /dev/null
fi
echo "smollm2-135m, S=512, global batch 4, 1 rank x $cores threads, $steps steps (median of steps 2..$steps)"
echo "load average before the runs: $load, after: $(cut -d' ' -f1-3 /proc/loadavg)"
report "$out/full.jsonl" "full"
report "$out/lora.jsonl" "lora r=$rank"
if [ "$dropout" != 0 ]; then report "$out/drop.jsonl" "lora r=$rank dropout $dropout"; fi
plan_mem full
plan_mem "lora r=$rank" "${lora[@]}"
