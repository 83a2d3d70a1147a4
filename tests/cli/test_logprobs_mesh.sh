#!/usr/bin/env bash
# meshlm logprobs of sequences of different lengths (2 to 61 tokens, more
# sequences than ranks, a length-1 budget overflow) on every mesh of 2 and
# 4 ranks and with small packed micro-batches: the same log-probs as one
# rank scoring them one micro-batch at a time, within tolerance.h's bound
# for two fp32 evaluations (tol_bound ... pair), in input order. The ranks
# score different lengths, which under vocab parallelism (embed_tokens and
# lm_head rows split over FSDP's group) must still exchange equal token
# counts: the planner pads micro-batch j to the longest on every rank.
set -euo pipefail
source "$(dirname "$0")/common.sh"
meshlm=$1 tol_bound=$4
model="$work/model"
"$meshlm" init --arch llama --preset tiny --seed 3 --out "$model" > /dev/null
awk 'BEGIN { srand(7); for (k = 0; k < 9; k++) { n = 2 + int(rand() * 60); printf "{\"input_ids\": [";
             for (i = 0; i < n; i++) printf "%s%d", i ? ", " : "", int(rand() * 256); print "]}" } }' \
  > "$work/in.jsonl"
values() { sed -E 's/.*"logprobs": \[([^]]*)\].*/\1/' "$1" | tr ',' '\n' | sed '/^ *$/d'; }
"$meshlm" logprobs --model "$model" --data "$work/in.jsonl" --out "$work/one.jsonl" \
  --micro-batch-tokens 1 > /dev/null 2> "$work/err"
bound=$("$tol_bound" "$model" logprobs pair 61 61)
n_one=$(values "$work/one.jsonl" | wc -l)
check() { # NAME RANKS FLAGS...
  local name=$1 ranks=$2
  shift 2
  if ! mpiexec -n "$ranks" "$meshlm" logprobs --model "$model" --data "$work/in.jsonl" \
      --out "$work/mesh.jsonl" "$@" > /dev/null 2> "$work/err"; then
    bad "$name: failed"
    return
  fi
  local rel n
  n=$(values "$work/mesh.jsonl" | wc -l)
  rel=$(paste <(values "$work/one.jsonl") <(values "$work/mesh.jsonl") |
    awk '{ d = $1 - $2; e += d * d; r += $1 * $1 } END { printf "%.3g\n", sqrt(e / r) }')
  if [ "$n" -eq "$n_one" ] && awk -v r="$rel" -v t="$bound" 'BEGIN { exit !(r <= t) }'; then
    ok "$name: $n log-probs, relative L2 $rel vs one rank (bound $bound)"
  else
    bad "$name: $n of $n_one log-probs, relative L2 $rel (bound $bound)"
  fi
}
check "1 rank, one packed micro-batch" 1
check "dp=2" 2
check "dp=2, micro-batches of 24 tokens" 2 --micro-batch-tokens 24
check "dp=4 (vocab-parallel over 4)" 4
check "dp=2 x tp=2" 4 --tp 2
check "tp=2 + SP, micro-batches of 40 tokens" 2 --tp 2 --sequence-parallel --micro-batch-tokens 40
check "cp=2 (one sequence per micro-batch)" 2 --cp 2
finish
