#!/usr/bin/env bash
# The CPU attention backward of two builds (e.g. main's and a branch's) on
# SmolLM2-135M's shape (9 heads over 3 kv heads of 64, 30 layers), S 512,
# batch 4, random ids (seed 0, as bench/bf16_throughput.sh writes them),
# STEPS training steps on 1 rank with THREADS threads, --param-dtype fp32
# and bf16: per build and dtype the operator profile's attention backward
# (MESHLM_OP_PROFILE=1: calls, mean ms a call, its share of the profiled
# time), the median tokens/s of the steps after the first, and the peak RSS
# (--metrics). Each binary runs with the libmeshlm.so beside it (as
# tools/compare_builds.sh). Figures for notes, nothing asserted; the load
# average is printed before and after (shared cores move every figure).
# usage: bench/attention_bwd.sh OLD_BIN NEW_BIN [STEPS [THREADS]]   (defaults 3 and 2)
set -euo pipefail
old=${1:?usage: attention_bwd.sh OLD_BIN NEW_BIN [STEPS [THREADS]]}
new=${2:?usage: attention_bwd.sh OLD_BIN NEW_BIN [STEPS [THREADS]]}
steps=${3:-3}
threads=${4:-2}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
S=512 B=4
echo "CPU: $(lscpu | sed -nE 's/^Model name: *//p' | head -n 1), $(nproc) cores; $threads threads"
echo "load average at start: $(cut -d ' ' -f 1-3 /proc/loadavg)"
"$new" init --arch llama --preset smollm2-135m --out "$out/model" > /dev/null
awk -v n=$((B * steps)) -v S="$S" 'BEGIN { srand(0); for (i = 0; i < n; i++) {
  printf "{\"input_ids\": [%d", int(rand() * 49152); for (t = 1; t < S; t++) printf ", %d", int(rand() * 49152)
  print "]}" } }' > "$out/ids.jsonl"
printf "%-6s %-5s %6s %10s %7s %9s %9s\n" build dtype calls "bwd ms" share "tok/s" "RSS MiB"
for which in old new; do
  bin=$old
  [ "$which" = new ] && bin=$new
  lib=$(cd "$(dirname "$bin")" && pwd)
  for dtype in fp32 bf16; do
    MESHLM_OP_PROFILE=1 OPENBLAS_NUM_THREADS=$threads OMP_NUM_THREADS=$threads LD_LIBRARY_PATH=$lib \
      "$bin" train --model "$out/model" --data "$out/ids.jsonl" --steps "$steps" --batch-size "$B" \
      --seq-len "$S" --lr 1e-3 --param-dtype "$dtype" --metrics "$out/m.jsonl" \
      > "$out/log" 2> "$out/prof"
    row=$(grep -E '^ml_be_attention(_block)?_bwd ' "$out/prof" | head -n 1)
    tok=$(tail -n +2 "$out/m.jsonl" | sed -E 's/.*"tokens_per_s": ?([0-9.eE+-]+).*/\1/' | sort -g |
      awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')
    rss=$(tail -n 1 "$out/m.jsonl" | sed -E 's/.*"peak_rss_mib_max": ?([0-9.eE+-]+).*/\1/')
    echo "$row" | awk -v w="$which" -v d="$dtype" -v t="$tok" -v r="$rss" \
      '{ printf "%-6s %-5s %6d %10.2f %7s %9.1f %9.1f\n", w, d, $2, $4 / 1e3, $5, t, r }'
  done
done
echo "load average at end: $(cut -d ' ' -f 1-3 /proc/loadavg)"
