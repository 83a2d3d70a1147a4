#!/usr/bin/env bash
# Whether pre-packed (blocked) bf16 weights would speed the scoring GEMMs up
# (issue 30; bench/results/2026-11-27-score-bf16.md): builds
# bench/onednn_packed_b.c against the system oneDNN and runs it on the
# SmolLM2-135M scoring shapes of 16 x 512 tokens (gate/up, down, q/o, k/v,
# and the fused classifier's lm_head tile), all cores. Figures for notes.
# usage: bench/onednn_packed_b.sh [ITERS]
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cc -O2 -std=c11 -D_POSIX_C_SOURCE=200809L bench/onednn_packed_b.c -o "$out/packed" -ldnnl
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
for shape in "8192 1536 576" "8192 576 1536" "8192 576 576" "8192 192 576" "4096 4096 576"; do
  # shellcheck disable=SC2086
  "$out/packed" $shape "${1:-7}"
done
lscpu | sed -nE 's/^Model name: *(.*)/CPU: \1/p' | head -n 1
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
