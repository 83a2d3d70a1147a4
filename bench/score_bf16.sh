#!/usr/bin/env bash
# Scoring in bf16 against fp32 and against transformers (issue 30's RL hot
# path): 16 random sequences of 512 tokens (bench_api_logprobs --dump, seed 1)
# scored by the real SmolLM2-135M-Instruct (MODEL, default
# /work/real/smollm2-135m-fp32: fp32 weights; bf16 is --param-dtype bf16 on
# them, as autocast keeps fp32 master weights), one process, all cores, in
# ROUNDS rounds (default 2) alternating fp32 and bf16 and the tools:
#  - meshlm logprobs (CLI): tokens/s of the whole process (start-up, load,
#    JSONL in and out) and its peak RSS (GNU time);
#  - meshlm_logprobs (API, bench_api_logprobs --bf16): tokens/s of one call
#    after a warm-up, median of 3 (the engine's own time);
#  - transformers (bench/score_peer.py): forward + log_softmax + gather of the
#    batch, per call after a warm-up (median of 3) and the whole process,
#    peak RSS; bf16 = torch.autocast.
# Then the ISA oneDNN dispatches to (ONEDNN_VERBOSE of one bf16 call) and the
# CPU. Figures for notes; nothing asserted.
# usage: bench/score_bf16.sh [BUILD_DIR]   (ROUNDS=N, MODEL=DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
model=${MODEL:-/work/real/smollm2-135m-fp32}
rounds=${ROUNDS:-2}
for b in "$build/meshlm" "$build/bench_api_logprobs"; do
  [[ -x $b ]] || { echo "score_bf16.sh: $b not built" >&2; exit 1; }
done
command -v /usr/bin/time > /dev/null || { echo "score_bf16.sh: needs GNU time" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
threads=$(nproc)
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads
n=16 S=512
tokens=$((n * S))
seqs=(--n $n --min-len $S --max-len $S --seed 1)
"$build/bench_api_logprobs" --model "$model" "${seqs[@]}" --dump "$out/seqs.jsonl" --dump-only

# timed LOG CMD...: CMD's stdout into LOG; prints "wall_s peak_rss_mib"
timed() {
  local log=$1 t0 t1
  shift
  t0=$(date +%s.%N)
  /usr/bin/time -v "$@" > "$log" 2> "$log.err" || { cat "$log.err" >&2; exit 1; }
  t1=$(date +%s.%N)
  awk -v a="$t0" -v b="$t1" '/Maximum resident set size/ { printf "%.2f %.0f\n", b - a, $6 / 1024 }' \
    "$log.err"
}

rows=()
for r in $(seq "$rounds"); do
  for dt in fp32 bf16; do
    bf=$([[ $dt == bf16 ]] && echo 1 || echo 0)
    flags=()
    [[ $dt == bf16 ]] && flags=(--param-dtype bf16)
    read -r cw crss <<< "$(timed "$out/cli" "$build/meshlm" logprobs --model "$model" \
      --data "$out/seqs.jsonl" --out "$out/lp.jsonl" --micro-batch-tokens $tokens "${flags[@]}")"
    timed "$out/api" "$build/bench_api_logprobs" --model "$model" "${seqs[@]}" --iters 3 \
      --micro-batch-tokens $tokens --unshard 1 --bf16 "$bf" > /dev/null
    api=$(sed -n 's/^RESULT.* tokens_per_s=\([^ ]*\).*/\1/p' "$out/api")
    read -r tw trss <<< "$(timed "$out/torch" python3 bench/score_peer.py --model "$model" \
      --data "$out/seqs.jsonl" --seq-len $S --mode "$dt" --threads "$threads")"
    tcall=$(sed -n 's/^torch-score.* tokens_per_s=\([^ ]*\).*/\1/p' "$out/torch")
    rows+=("$(awk -v r="$r" -v d="$dt" -v t=$tokens -v cw="$cw" -v crss="$crss" -v api="$api" \
      -v tw="$tw" -v tc="$tcall" -v trss="$trss" 'BEGIN {
      printf "%5s %-5s | %9.1f %9.1f %8s | %9.1f %9.1f %8s | %6.2f %6.2f", r, d, t / cw, api, crss,
        t / tw, tc, trss, api / tc, (t / cw) / (t / tw) }')")
    echo "round $r $dt done" >&2
  done
done
echo "scoring $n x $S tokens, $model, 1 process x $threads threads"
printf "%5s %-5s | %-28s | %-28s | %-13s\n" "" "" "meshlm" "transformers" "meshlm/torch"
printf "%5s %-5s | %9s %9s %8s | %9s %9s %8s | %6s %6s\n" round dtype "process" "call" \
  "RSS MiB" "process" "call" "RSS MiB" "call" "proc"
printf "%5s %-5s | %9s %9s %8s | %9s %9s %8s | %6s %6s\n" "" "" "tok/s" "tok/s" "" "tok/s" \
  "tok/s" "" "" ""
for row in "${rows[@]}"; do echo "$row"; done
isa=$(ONEDNN_VERBOSE=1 DNNL_VERBOSE=1 "$build/bench_api_logprobs" --model "$model" --n 1 \
  --min-len 16 --max-len 16 --iters 1 --bf16 1 2>&1 | grep -m1 -io 'isa:[^,]*' || true)
echo "oneDNN: ${isa:-no verbose output (ONEDNN_VERBOSE)}"
lscpu | sed -nE 's/^Model name: *(.*)/CPU: \1/p' | head -n 1
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) (other work inflates wall time)"
