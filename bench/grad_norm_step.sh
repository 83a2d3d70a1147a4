#!/usr/bin/env bash
# The grad norm's partials computed during backward (engine/grad_norm.h, issue
# 30) against the one pass after backward: training tokens/s of this build's
# meshlm and of another build's (BASE: a meshlm binary from before the change),
# SmolLM2-135M's shape (the smollm2-135m preset, random weights, 134.5M
# parameters) at S=512, global batch 4, on random ids (seed 0), one process with
# every core as threads, --param-dtype fp32 and bf16, the two builds alternating
# ROUNDS times (so slow drifts of shared cores hit both). Per run: the median
# tokens/s over its steps after the first two; per dtype: each build's median
# over the rounds (the lower middle one of an even count) and their ratio. On shared cores other load moves both: the
# load average is printed before and after. Figures for notes; nothing here is
# asserted.
# usage: bench/grad_norm_step.sh BASE_MESHLM [STEPS [ROUNDS]]   (after `make`;
#        defaults 5 and 3; 2 cores: about 2 minutes per run)
set -euo pipefail
cd "$(dirname "$0")/.."
base=$1
steps=${2:-5}
rounds=${3:-3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
cores=$(nproc)
median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
run_tps() { # binary, dtype: the run's median tokens/s after its first two steps
  OPENBLAS_NUM_THREADS=$cores OMP_NUM_THREADS=$cores "$1" train --model "$out/smol" \
    --data "$out/ids.jsonl" --steps "$steps" --batch-size 4 --seq-len 512 --lr 1e-3 \
    --param-dtype "$2" --metrics "$out/m.jsonl" > /dev/null
  tail -n +3 "$out/m.jsonl" | sed -E 's/.*"tokens_per_s": ?([0-9.eE+-]+).*/\1/' | median
}
echo "cpu: $(sed -nE 's/^model name\s*: //p' /proc/cpuinfo | head -n 1), $cores cores"
git log -1 --format='meshlm: %h %s' 2> /dev/null || true
echo "load average at start: $(cut -d ' ' -f 1-3 /proc/loadavg)"
build/meshlm init --arch llama --preset smollm2-135m --out "$out/smol" > /dev/null
awk -v n=$(( 4 * steps )) 'BEGIN { srand(0); for (i = 0; i < n; i++) {
  printf "{\"input_ids\": [%d", int(rand() * 49152); for (t = 1; t < 512; t++) printf ", %d", int(rand() * 49152)
  print "]}" } }' > "$out/ids.jsonl"
printf "%-6s %14s %14s %8s   (per round: this / base)\n" dtype "this tok/s" "base tok/s" ratio
for dtype in fp32 bf16; do
  : > "$out/this" && : > "$out/base" && rows=""
  for r in $(seq "$rounds"); do
    t=$(run_tps build/meshlm "$dtype") && b=$(run_tps "$base" "$dtype")
    echo "$t" >> "$out/this" && echo "$b" >> "$out/base"
    rows="$rows $(printf '%.1f/%.1f' "$t" "$b")"
  done
  t=$(median < "$out/this") && b=$(median < "$out/base")
  printf "%-6s %14.1f %14.1f %8.3f  %s\n" "$dtype" "$t" "$b" "$(awk -v a="$t" -v b="$b" 'BEGIN { print a / b }')" "$rows"
done
echo "load average at end: $(cut -d ' ' -f 1-3 /proc/loadavg)"
