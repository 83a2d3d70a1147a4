#!/usr/bin/env bash
# Sizes bounded before arithmetic (issue 9, part 2): a config.json size, a
# flag or a sequence beyond what meshlm can count or hold is refused up
# front with one message naming the file, field or flag, what was found and
# what was expected; every rank exits non-zero, with no MPI_ABORT and no
# wrapped count.
# usage: test_bad_sizes.sh MESHLM SOURCE_DIR
set -u
meshlm=$1
src=$2
fx=$src/tests/fixtures/llama_tied # max_position_embeddings 256
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
pass=0 fail=0
echo '{"input_ids": [1, 2, 3, 4, 5]}' > "$work/data.jsonl"

# expect NAME RANKS PATTERN... -- ARGS...: `meshlm ARGS` (under mpiexec -n
# RANKS when RANKS > 1) fails on every rank, stderr has exactly one
# "meshlm: error" line matching every PATTERN (grep -E), no MPI_ABORT, no
# negative number, and no output file.
expect() {
  local name=$1 ranks=$2
  shift 2
  local patterns=()
  while [ "$1" != "--" ]; do patterns+=("$1"); shift; done
  shift
  rm -f "$work"/rc.* "$work/out.jsonl"
  # each rank records its own exit status and exits 0, so that mpiexec does
  # not kill the other ranks before they record theirs
  # (the rank: Open MPI's variable, else the PMI one of MPICH's hydra)
  local wrap='"$@"; echo $? > "$RC_DIR/rc.${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}"'
  if [ "$ranks" -gt 1 ]; then
    RC_DIR=$work timeout 120 mpiexec -n "$ranks" bash -c "$wrap" rank "$meshlm" "$@" \
      > "$work/stdout" 2> "$work/err"
  else
    RC_DIR=$work timeout 120 bash -c "$wrap" rank "$meshlm" "$@" > "$work/stdout" 2> "$work/err"
  fi
  local rc=$? why=""
  [ $rc -eq 0 ] || why="mpiexec or timeout exit $rc"
  for r in $(seq 0 $((ranks - 1))); do
    [ "$(cat "$work/rc.$r" 2>/dev/null)" != 0 ] && [ -s "$work/rc.$r" ] || why="$why; rank $r exit $(cat "$work/rc.$r" 2>/dev/null)"
  done
  local lines
  lines=$(grep -c 'meshlm: error' "$work/err")
  [ "$lines" -eq 1 ] || why="$why; $lines error lines"
  for p in "${patterns[@]}"; do grep 'meshlm: error' "$work/err" | grep -qE -- "$p" || why="$why; no /$p/"; done
  grep -q 'MPI_ABORT' "$work/err" && why="$why; MPI_ABORT"
  grep 'meshlm: error' "$work/err" | grep -qE -- ' -[0-9]{6,}' && why="$why; a negative (wrapped) count"
  [ -e "$work/out.jsonl" ] && why="$why; output file left"
  if [ -z "$why" ]; then
    pass=$((pass + 1))
    echo "ok   $name: $(grep -m1 'meshlm: error' "$work/err")"
  else
    fail=$((fail + 1))
    echo "FAIL $name (${why#; }), stderr:"
    head -8 "$work/err"
  fi
}

# model NAME SED: a copy of the fixture whose config.json is edited by SED
model() {
  mkdir -p "$work/$1"
  cp "$fx/model.safetensors" "$work/$1/"
  sed -E "$2" "$fx/config.json" > "$work/$1/config.json"
  echo "$work/$1"
}

# config.json sizes: refused before any product is formed (the plan used to
# print "-6422937842468171776 parameters" and exit 0)
m=$(model hidden 's/"hidden_size": [0-9]+/"hidden_size": 1000000000000/')
expect plan-hidden-size-1e12 1 "config\.json: field 'hidden_size'" "found 1000000000000" \
  "from 1 to 1048576" -- plan --model "$m"
m=$(model inter 's/"intermediate_size": [0-9]+/"intermediate_size": 444444444444024/')
expect plan-intermediate-size 1 "config\.json: field 'intermediate_size'" "found 444444444444024" \
  "from 1 to 16777216" -- plan --model "$m"
m=$(model vocab 's/"vocab_size": [0-9]+/"vocab_size": 4294967296/')
expect logprobs-vocab-size 1 "config\.json: field 'vocab_size'" "found 4294967296" "16777216" \
  -- logprobs --model "$m" --data "$work/data.jsonl" --out "$work/out.jsonl"
m=$(model kv 's/"num_key_value_heads": [0-9]+/"num_key_value_heads": 9223372036854775807/')
expect train-kv-heads 2 "config\.json: field 'num_key_value_heads'" "found 9223372036854775807" \
  -- train --model "$m" --data "$work/data.jsonl" --steps 1 --seq-len 8 --batch-size 2

# sequences longer than max_position_embeddings: refused up front naming both
# (train used to fail mid-step: "out of memory allocating 320744000000 bytes
# for layer activations", two error lines, MPI_ABORT)
expect train-seq-len-above-positions 2 "--seq-len" "100000000 tokens" \
  "max_position_embeddings 256 of .*config\.json" "at most 256" \
  -- train --model "$fx" --data "$work/data.jsonl" --steps 1 --seq-len 100000000 --batch-size 2
expect plan-seq-len-above-positions 1 "--seq-len" "max_position_embeddings 256" \
  -- plan --model "$fx" --seq-len 257
echo "{\"input_ids\": [$(yes 1 | head -n 300 | paste -sd,)]}" > "$work/long.jsonl"
expect logprobs-sequence-above-positions 2 "long\.jsonl:1: field 'input_ids': 300 tokens" \
  "max_position_embeddings 256" -- logprobs --model "$fx" --data "$work/long.jsonl" --out "$work/out.jsonl"

# batches beyond 64-bit counts: named by their flags, never a wrapped count
expect train-tokens-per-step-overflow 2 "--batch-size 2000000000000000000 x --seq-len 256" "2\^63" \
  -- train --model "$fx" --data "$work/data.jsonl" --steps 1 --seq-len 256 --batch-size 2000000000000000000
expect train-activations-beyond-2^63 2 "activations of layer 0" "--batch-size 20000000000000000" \
  "--seq-len 256" "more than 2\^63 bytes" \
  -- train --model "$fx" --data "$work/data.jsonl" --steps 1 --seq-len 256 --batch-size 20000000000000000
expect plan-memory-beyond-2^63 1 "--batch-size" "more than 2\^63 bytes" \
  -- plan --model "$fx" --seq-len 256 --batch-size 100000000000000

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
