#!/usr/bin/env bash
# Inference-only scoring (issue 30: bf16 scoring's peak RSS at most fp32's):
# `meshlm logprobs` (always an inference-only session: under bf16 the FSDP
# units' weights in bf16 alone, parallel/fsdp.h) of 16 random sequences of
# 512 tokens (bench_api_logprobs --dump, seed 1) on MODEL (default: the real
# SmolLM2-135M-Instruct, /work/real/smollm2-135m-fp32; any HF checkpoint,
# e.g. `meshlm init --preset smollm2-135m --tie-word-embeddings`), one
# process, all cores, one micro-batch, fp32 and bf16, for the build under
# test and the build BEFORE (e.g. one of main), alternating, ROUNDS rounds
# (default 2): the whole process's tokens/s and peak RSS (GNU time), and
# the log-probs of both builds compared (bf16: bitwise equal expected).
# Then `meshlm plan`'s logprobs rows of the build under test. Figures for
# notes; nothing asserted.
# usage: bench/score_inference_only.sh BEFORE_BUILD_DIR [BUILD_DIR]   (ROUNDS=N, MODEL=DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:?usage: bench/score_inference_only.sh BEFORE_BUILD_DIR [BUILD_DIR]}
after=${2:-build}
model=${MODEL:-/work/real/smollm2-135m-fp32}
rounds=${ROUNDS:-2}
for b in "$before/meshlm" "$after/meshlm" "$after/bench_api_logprobs"; do
  [[ -x $b ]] || { echo "score_inference_only.sh: $b not built" >&2; exit 1; }
done
command -v /usr/bin/time > /dev/null || { echo "score_inference_only.sh: needs GNU time" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
threads=$(nproc)
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads
n=16 S=512
tokens=$((n * S))
"$after/bench_api_logprobs" --model "$model" --n $n --min-len $S --max-len $S --seed 1 \
  --dump "$out/seqs.jsonl" --dump-only

# run BUILD DTYPE TAG: prints "tokens/s peak_rss_mib user_s"; log-probs into $out/TAG.jsonl
run() {
  local t0 t1
  t0=$(date +%s.%N)
  /usr/bin/time -v "$1/meshlm" logprobs --model "$model" --data "$out/seqs.jsonl" \
    --out "$out/$3.jsonl" --micro-batch-tokens $tokens --param-dtype "$2" \
    > /dev/null 2> "$out/time.txt" || { cat "$out/time.txt" >&2; exit 1; }
  t1=$(date +%s.%N)
  awk -v a="$t0" -v b="$t1" -v t=$tokens '/User time/ { u = $4 }
    /Maximum resident set size/ { r = $6 } END { printf "%.1f %.0f %.1f\n", t / (b - a), r / 1024, u }' \
    "$out/time.txt"
}

echo "meshlm logprobs, $n x $S tokens, $model, 1 process x $threads threads"
printf "%5s %-5s %-7s %10s %12s %8s\n" round dtype build "tok/s" "peak RSS MiB" "user s"
for r in $(seq "$rounds"); do
  for dt in fp32 bf16; do
    for side in before after; do
      b=$before
      [[ $side == after ]] && b=$after
      read -r tps rss user <<< "$(run "$b" "$dt" "$side-$dt")"
      printf "%5s %-5s %-7s %10s %12s %8s\n" "$r" "$dt" "$side" "$tps" "$rss" "$user"
    done
  done
done
for dt in fp32 bf16; do
  if cmp -s "$out/before-$dt.jsonl" "$out/after-$dt.jsonl"; then same=identical; else same=DIFFERENT; fi
  echo "$dt log-probs, before vs after: $same"
done
for dt in fp32 bf16; do
  echo "meshlm plan --param-dtype $dt (the build under test): logprobs rows"
  "$after/meshlm" plan --model "$model" --seq-len $S --batch-size $n --param-dtype "$dt" |
    grep -E "logprobs|reference policy|held by the pool"
done
lscpu | sed -nE 's/^Model name: *(.*)/CPU: \1/p' | head -n 1
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) (other work inflates wall time)"
