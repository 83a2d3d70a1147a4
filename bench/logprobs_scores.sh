#!/usr/bin/env bash
# The cost of the entropy and top-k outputs of `meshlm logprobs` (the fused
# classifier's extra per-tile sums and lists, parallel/loss.h
# ml_loss_extra): wall seconds of scoring the same sequences with the `small`
# Llama (~13M parameters) plain, with --entropy, --topk 5 and --topk 50, on
# one rank and (with mpiexec) on dp2 x tp2 or what RANKS gives. Best of three
# runs each. Figures for notes; nothing asserted.
# usage: bench/logprobs_scores.sh [RANKS] [SEQUENCES]   (after `make`)
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=${1:-1}
n=${2:-32}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive} OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
build/meshlm init --arch llama --preset small --out "$out/model" > /dev/null
awk -v n="$n" 'BEGIN { srand(3); for (k = 0; k < n; k++) { printf "{\"input_ids\": [";
  for (i = 0; i < 256; i++) printf "%s%d", i ? ", " : "", int(rand() * 256); print "]}" } }' \
  > "$out/in.jsonl"
tp=1
[ "$ranks" -ge 4 ] && [ $((ranks % 2)) -eq 0 ] && tp=2
run() { # FLAGS...: best wall seconds of three
  local best=
  for _ in 1 2 3; do
    local t0 t1
    t0=$(date +%s.%N)
    mpiexec -n "$ranks" build/meshlm logprobs --model "$out/model" --data "$out/in.jsonl" \
      --out "$out/o.jsonl" --tp "$tp" "$@" > /dev/null
    t1=$(date +%s.%N)
    best=$(awk -v a="$best" -v d="$(awk -v x="$t0" -v y="$t1" 'BEGIN { print y - x }')" \
      'BEGIN { print (a == "" || d < a) ? d : a }')
  done
  echo "$best"
}
echo "small Llama, $n sequences of 256 tokens, $ranks rank(s), tp $tp, 1 thread each"
base=$(run)
printf "%-12s %7.3f s\n" plain "$base"
for flags in "--entropy" "--topk 5" "--topk 50" "--entropy --topk 5"; do
  # shellcheck disable=SC2086
  t=$(run $flags)
  printf "%-12s %7.3f s  (%+.1f %%)\n" "$flags" "$t" "$(awk -v a="$t" -v b="$base" 'BEGIN { print 100 * (a / b - 1) }')"
done
