#!/usr/bin/env bash
# Scoring throughput through the library (meshlm_logprobs, bench/api_logprobs.c)
# against the CLI (`meshlm logprobs`) on the same random variable-length
# sequences: the API on 1 rank and on dp2 (2 ranks, 1 thread each), with
# unshard_for_inference 0 and 1, timed per call after a warm-up (median of
# BENCH_ITERS); the CLI on 1 rank and dp2, timed as the whole process (start-up,
# model load, JSONL in and out). Models: `meshlm init --preset small` (~13M, the
# demo's), and the real checkpoints /work/real/smollm2-135m-fp32 and
# /work/real/gemma3-270m-fp32 when present (MESHLM_REAL names another
# directory). Figures for notes; nothing here is asserted.
# usage: bench/api_logprobs.sh [BUILD_DIR]   (after building bench_api_logprobs and meshlm)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
bench=$build/bench_api_logprobs
meshlm=$build/meshlm
for b in "$bench" "$meshlm"; do
  [[ -x $b ]] || { echo "api_logprobs.sh: $b not built (cmake --build $build)" >&2; exit 1; }
done
real=${MESHLM_REAL:-/work/real}
iters=${BENCH_ITERS:-3}
mbt=${BENCH_MICRO_BATCH_TOKENS:-4096}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# idle OpenMP threads must sleep, not spin, or they steal the cores OpenBLAS computes on
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
cores=$(nproc)
half=$(( cores / 2 > 0 ? cores / 2 : 1 ))
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -n 1)

"$meshlm" init --arch llama --preset small --seed 0 --out "$out/small" > /dev/null
# name dir n min-len max-len: the small model gets more and longer sequences
models=("small $out/small 64 16 512")
[[ -f $real/smollm2-135m-fp32/config.json ]] && models+=("smollm2-135m $real/smollm2-135m-fp32 16 32 256")
[[ -f $real/gemma3-270m-fp32/config.json ]] && models+=("gemma3-270m $real/gemma3-270m-fp32 16 32 256")

field() { sed -n "s/.*RESULT.* $1=\([^ ]*\).*/\1/p" "$2"; }

# run LOG THREADS RANKS CMD...: CMD (under mpirun for RANKS > 1), its wall and
# CPU seconds (user + sys of the process and its children) into LOG.time
run() {
  local log=$1 threads=$2 ranks=$3 TIMEFORMAT='%R %U %S'
  shift 3
  local pre=()
  [[ $ranks == 1 ]] || pre=(mpirun -np "$ranks")
  { time (OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads "${pre[@]}" "$@" > "$log" \
            2> "$log.err"); } 2> "$log.time"
}

# api LABEL RANKS THREADS UNSHARD DIR N MIN MAX: "tokens/s CPU-s" of one call
api() {
  local log="$out/$1.log"
  run "$log" "$3" "$2" "$bench" --model "$5" --n "$6" --min-len "$7" --max-len "$8" --seed 1 \
    --iters "$iters" --micro-batch-tokens "$mbt" --unshard "$4"
  grep -E "^meshlm_logprobs" "$log" | sed "s/^/  $1: /" >&2
  echo "$(field tokens_per_s "$log") $(field cpu_s "$log")"
}

# cli LABEL RANKS THREADS DIR TOKENS: "tokens/s CPU-s" of the whole process
cli() {
  local log="$out/$1.log"
  run "$log" "$3" "$2" "$meshlm" logprobs --model "$4" --data "$out/seqs.jsonl" \
    --out "$out/$1.jsonl" --micro-batch-tokens "$mbt"
  awk -v n="$5" -v l="$1" '{ printf "  %s: whole process %.2f s, CPU %.2f s\n", l, $1, $2 + $3 \
    > "/dev/stderr"; printf "%.2f %.2f\n", n / $1, $2 + $3 }' "$log.time"
}

rows=()
cpus=()
for m in "${models[@]}"; do
  read -r name dir n lmin lmax <<< "$m"
  echo "== $name ($dir): $n sequences of $lmin..$lmax tokens" >&2
  OMP_NUM_THREADS=1 "$bench" --model "$dir" --n "$n" --min-len "$lmin" --max-len "$lmax" --seed 1 \
    --dump "$out/seqs.jsonl" --dump-only
  tokens=$(sed 's/[^,]//g' "$out/seqs.jsonl" | awk '{ t += length($0) + 1 } END { print t }')
  read -r a10 u10 <<< "$(api "$name-api-1rank-unshard0" 1 "$cores" 0 "$dir" "$n" "$lmin" "$lmax")"
  read -r a11 u11 <<< "$(api "$name-api-1rank-unshard1" 1 "$cores" 1 "$dir" "$n" "$lmin" "$lmax")"
  read -r a20 u20 <<< "$(api "$name-api-dp2-unshard0" 2 "$half" 0 "$dir" "$n" "$lmin" "$lmax")"
  read -r a21 u21 <<< "$(api "$name-api-dp2-unshard1" 2 "$half" 1 "$dir" "$n" "$lmin" "$lmax")"
  read -r c1 v1 <<< "$(cli "$name-cli-1rank" 1 "$cores" "$dir" "$tokens")"
  read -r c2 v2 <<< "$(cli "$name-cli-dp2" 2 "$half" "$dir" "$tokens")"
  fmt="%-14s %7s | %9s %9s | %9s %9s | %9s %9s"
  rows+=("$(printf "$fmt" "$name" "$tokens" "$a10" "$a11" "$a20" "$a21" "$c1" "$c2")")
  cpus+=("$(printf "$fmt" "$name" "$tokens" "$u10" "$u11" "$u20" "$u21" "$v1" "$v2")")
done

table_head() {
  printf "%-14s %7s | %-19s | %-19s | %-19s\n" "" "" "API 1 rank" "API dp2" "CLI (process)"
  printf "%-14s %7s | %9s %9s | %9s %9s | %9s %9s\n" model tokens unshard0 unshard1 unshard0 \
    unshard1 "1 rank" dp2
}
echo
echo "meshlm_logprobs (API, per call after a warm-up, median of $iters) vs meshlm logprobs (CLI, whole"
echo "process) on $cpu, $cores cores; micro_batch_tokens $mbt; 1 rank: $cores threads, dp2: 2 x $half"
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) (other work on the machine inflates wall time)"
echo
echo "tokens/s (wall)"
table_head
for r in "${rows[@]}"; do echo "$r"; done
echo
echo "CPU seconds, all ranks (API: one call; CLI: the whole process, start-up and load included)"
table_head
for r in "${cpus[@]}"; do echo "$r"; done
