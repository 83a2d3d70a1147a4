# Sourced by bench scripts that compare `meshlm train --metrics` runs (bench/freeze.sh,
# bench/lora.sh): report FILE LABEL prints the median tokens/s over the steps after the
# first and the largest peak RSS of the run's metrics lines.
report() {
  tail -n +2 "$1" | sed -E 's/.*"tokens_per_s": ?([0-9.eE+-]+).*"peak_rss_mib_max": ?([0-9.eE+-]+).*/\1 \2/' |
    sort -n | awk -v label="$2" '{ t[NR] = $1; r = ($2 > r ? $2 : r) } END {
      i = int((NR + 1) / 2); printf "%-12s tokens/s %8.1f   peak RSS %.1f MiB\n", label, t[i], r }'
}
