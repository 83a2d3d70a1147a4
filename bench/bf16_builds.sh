#!/usr/bin/env bash
# bf16_builds.sh OLD_BIN NEW_BIN — bf16 training tokens/s of two builds of
# meshlm (e.g. main before a change and after: copy a build's meshlm and
# libmeshlm.so* together, as for tools/compare_builds.sh), run alternately
# on one machine so that drifting load falls on both: `small` (S=128,
# global batch 8, on the raw bytes of src/) and `smollm2-135m` (random
# weights, S=512, global batch 4, random ids), 1 rank with every core as
# threads, --param-dtype bf16. Per build and model: the median of the
# per-round medians of tokens/s over the steps after the first two, and the
# peak RSS. BENCH_ROUNDS (default 2) alternations, BENCH_STEPS (default 5)
# steps per run; BENCH_MODELS (default "small smollm2-135m"); BENCH_DTYPES
# (default bf16; "bf16 fp32" adds fp32 rows, e.g. to set bf16's peak RSS
# beside fp32's of the same build and shape). Figures for
# notes; nothing here is asserted.
set -euo pipefail
old=${1:?usage: bf16_builds.sh OLD_BIN NEW_BIN}
new=${2:?usage: bf16_builds.sh OLD_BIN NEW_BIN}
rounds=${BENCH_ROUNDS:-2} steps=${BENCH_STEPS:-5} cores=$(nproc)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMP_NUM_THREADS=$cores OMP_WAIT_POLICY=passive
echo "$(lscpu | sed -n 's/^Model name: *//p'), $cores cores; load average at start: $(cut -d ' ' -f 1-3 /proc/loadavg)"
find src -name '*.[ch]' | sort | xargs cat > "$out/corpus.txt"
# run BIN ARGS...: BIN with the libmeshlm.so beside it first (compare_builds.sh), then the
# caller's path (a machine whose runtime libraries are unpacked there: tools/device_env.sh)
run() {
  local bin=$1
  shift
  LD_LIBRARY_PATH=$(cd "$(dirname "$bin")" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$bin" "$@"
}
# median FILE FIELD: of FIELD over the metrics lines after the first two
median() {
  python3 - "$1" "$2" <<'PY'
import json, statistics, sys
v = [json.loads(l)[sys.argv[2]] for l in open(sys.argv[1])][2:]
print(statistics.median(v) if v else "nan")
PY
}
for model in ${BENCH_MODELS:-small smollm2-135m}; do
  run "$new" init --arch llama --preset "$model" --out "$out/$model" > /dev/null
  if [ "$model" = small ]; then S=128 B=8 data=$out/corpus.txt
  else
    S=512 B=4 data=$out/ids.jsonl
    awk -v n=$((B * steps)) -v S=$S 'BEGIN { srand(0); for (i = 0; i < n; i++) {
      printf "{\"input_ids\": [%d", int(rand() * 49152); for (t = 1; t < S; t++) printf ", %d", int(rand() * 49152)
      print "]}" } }' > "$data"
  fi
  for dt in ${BENCH_DTYPES:-bf16}; do
    for r in $(seq "$rounds"); do
      for side in old new; do
        bin=$old; [ $side = new ] && bin=$new
        m=$out/$model.$dt.$side
        run "$bin" train --model "$out/$model" --data "$data" --steps "$steps" --batch-size "$B" \
          --seq-len "$S" --lr 1e-3 --param-dtype "$dt" --metrics "$m.$r.jsonl" > /dev/null 2>&1
        echo "$(median "$m.$r.jsonl" tokens_per_s) $(tail -n 1 "$m.$r.jsonl" |
          python3 -c 'import json,sys; print(json.load(sys.stdin)["peak_rss_mib_max"])')" >> "$m"
      done
    done
    for side in old new; do
      m=$out/$model.$dt.$side
      echo "$model S=$S B=$B $dt $side: tokens/s per round $(cut -d ' ' -f 1 "$m" | tr '\n' ' ')" \
        "median $(sort -g "$m" | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}')," \
        "peak RSS MiB $(tail -n 1 "$m" | cut -d ' ' -f 2)"
    done
  done
done
echo "load average at end: $(cut -d ' ' -f 1-3 /proc/loadavg)"
