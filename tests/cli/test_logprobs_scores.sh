#!/usr/bin/env bash
# meshlm logprobs --entropy --topk K: on one rank and on dp=2 x tp=2 (vocab
# parallelism over tp and the FSDP group), every line valid JSON with the
# four fields (json_check) whose "logprobs" are the plain run's text for text (the same forward, bit
# for bit), an "entropy" of S-1 values in [0, log V], and K top-k ids per
# position, distinct and in range, with non-increasing log-probs; --topk out
# of range and --topk with --cp 2 refused naming the flag. (The values
# against a float64 reference, on every vocab-parallel layout: tests/api/
# test_api_topk.c, tests/mpi/test_scores.c.) --fp32-params as train's, its
# count as meshlm plan's.
set -euo pipefail
source "$(dirname "$0")/common.sh"
meshlm=$1 json_check=$3
model="$work/model"
"$meshlm" init --arch llama --preset tiny --seed 5 --out "$model" > /dev/null
awk 'BEGIN { srand(11); for (k = 0; k < 5; k++) { n = 2 + int(rand() * 30); printf "{\"input_ids\": [";
             for (i = 0; i < n; i++) printf "%s%d", i ? ", " : "", int(rand() * 256); print "]}" } }' \
  > "$work/in.jsonl"
V=$(sed -E 's/.*"vocab_size": *([0-9]+).*/\1/' <(tr -d '\n' < "$model/config.json"))
field() { sed -E "s/.*\"$1\": \[([^]]*)\].*/\1/" "$2"; } # FIELD FILE: a flat array per line
K=3
check() { # NAME RANKS FLAGS...
  local name=$1 ranks=$2
  shift 2
  if ! mpiexec -n "$ranks" "$meshlm" logprobs --model "$model" --data "$work/in.jsonl" \
      --out "$work/plain.jsonl" "$@" > /dev/null 2> "$work/err" ||
    ! mpiexec -n "$ranks" "$meshlm" logprobs --model "$model" --data "$work/in.jsonl" \
      --out "$work/scores.jsonl" --entropy --topk $K "$@" > /dev/null 2> "$work/err"; then
    bad "$name: failed"
    return
  fi
  local line
  while IFS= read -r line; do
    if ! "$json_check" logprobs entropy topk_ids topk_logprobs <<<"$line" > "$work/err" 2>&1; then
      bad "$name: not JSON with the four fields"
      return
    fi
  done < "$work/scores.jsonl"
  if ! cmp -s <(field logprobs "$work/plain.jsonl") <(field logprobs "$work/scores.jsonl"); then
    bad "$name: the log-probs differ from the plain run's"
    return
  fi
  # per line: the entropy's count and range, the top-k rows' ids and order
  local msg
  msg=$(paste -d'|' <(field logprobs "$work/scores.jsonl") <(field entropy "$work/scores.jsonl") \
          <(sed -E 's/.*"topk_ids": \[(.*)\], "topk_logprobs".*/\1/' "$work/scores.jsonl") \
          <(sed -E 's/.*"topk_logprobs": \[(.*)\]\}$/\1/' "$work/scores.jsonl") |
    awk -F'|' -v K=$K -v V="$V" '
      function rows(s, out,   n, i, r) { gsub(/^\[|\]$/, "", s); n = split(s, r, /\], *\[/);
                                         for (i = 1; i <= n; i++) out[i] = r[i]; return n }
      { n = split($1, lp, ","); m = split($2, h, ",");
        if (m != n) { print "line " NR ": " m " entropies for " n " log-probs"; exit }
        for (i = 1; i <= m; i++) if (!(h[i] + 0 >= 0 && h[i] + 0 <= log(V) + 1e-5)) {
          print "line " NR ": entropy " h[i] " outside [0, log V]"; exit }
        if (rows($3, ids) != n || rows($4, vals) != n) { print "line " NR ": not " n " top-k rows"; exit }
        for (t = 1; t <= n; t++) {
          if (split(ids[t], id, ",") != K || split(vals[t], v, ",") != K) {
            print "line " NR ": a row of other than " K; exit }
          for (c = 1; c <= K; c++) {
            if (id[c] + 0 < 0 || id[c] + 0 >= V) { print "line " NR ": id " id[c]; exit }
            for (d = 1; d < c; d++) if (id[d] + 0 == id[c] + 0) { print "line " NR ": id twice"; exit }
            if (c > 1 && v[c] + 0 > v[c - 1] + 0) { print "line " NR ": not best first"; exit } } } }')
  if [ -z "$msg" ]; then
    ok "$name: log-probs as the plain run's, entropy and top-$K well formed"
  else
    bad "$name: $msg"
  fi
}
check "1 rank" 1
check "dp=2 x tp=2" 4 --tp 2
expect_error() { # NAME NEEDLE FLAGS...
  local name=$1 needle=$2
  shift 2
  if "$meshlm" logprobs --model "$model" --data "$work/in.jsonl" --out "$work/x.jsonl" "$@" \
      > /dev/null 2> "$work/err"; then
    bad "$name: accepted"
  elif grep -q -- "$needle" "$work/err"; then
    ok "$name: refused ($needle)"
  else
    bad "$name: another message"
  fi
}
expect_error "--topk above vocab_size" "flag --topk $((V + 1)): expected 0 .. vocab_size $V" \
  --topk $((V + 1))
expect_error "--topk -1" "flag --topk -1" --topk -1
if mpiexec -n 2 "$meshlm" logprobs --model "$model" --data "$work/in.jsonl" --out "$work/x.jsonl" \
    --cp 2 --topk 2 > /dev/null 2> "$work/err"; then
  bad "--topk with --cp 2: accepted"
elif grep -q -- "--cp 1" "$work/err"; then
  ok "--topk with --cp 2: refused"
else
  bad "--topk with --cp 2: another message"
fi

# --fp32-params, train's flag (engine/fp32_params.h): under bf16 the parameters it names are
# gathered and computed in fp32 (the o_proj GEMMs: other log-probs than the plain bf16 run's),
# the count the run reports is meshlm plan's for the same flags (plan = run); under fp32 it
# changes nothing (bitwise); a pattern matching no parameter is refused naming the flag.
kept='model.layers.*.self_attn.o_proj.weight'
score() { # NAME FLAGS...: logprobs into $work/NAME.jsonl, its stdout into $work/NAME.out
  local name=$1
  shift
  "$meshlm" logprobs --model "$model" --data "$work/in.jsonl" --out "$work/$name.jsonl" "$@" \
    > "$work/$name.out" 2> "$work/err"
}
if score bf16 --param-dtype bf16 && score bf16_kept --param-dtype bf16 --fp32-params "$kept" &&
    score fp32 && score fp32_kept --fp32-params "$kept"; then
  run_n=$(sed -nE 's/^logprobs: ([0-9]+) parameter tensors \(([0-9]+) elements\) kept in fp32.*/\1 \2/p' \
    "$work/bf16_kept.out")
  plan_n=$("$meshlm" plan --model "$model" --param-dtype bf16 --fp32-params "$kept" 2> "$work/err" |
    sed -nE 's/.*kept in fp32 under bf16 .*: ([0-9]+) parameters, ([0-9]+) elements;.*/\1 \2/p')
  if cmp -s <(field logprobs "$work/bf16.jsonl") <(field logprobs "$work/bf16_kept.jsonl"); then
    bad "--fp32-params under bf16: the log-probs are the plain bf16 run's"
  else
    ok "--fp32-params under bf16: other log-probs than the plain bf16 run's"
  fi
  if [ -n "$run_n" ] && [ "$run_n" = "$plan_n" ]; then
    ok "--fp32-params: the run keeps $run_n (tensors, elements) in fp32, as meshlm plan says"
  else
    bad "--fp32-params: the run reports '$run_n', meshlm plan '$plan_n'"
  fi
  if cmp -s "$work/fp32.jsonl" "$work/fp32_kept.jsonl" &&
      ! grep -q "kept in fp32" "$work/fp32_kept.out"; then
    ok "--fp32-params under fp32: the same output, bit for bit"
  else
    bad "--fp32-params under fp32: another output"
  fi
else
  bad "--fp32-params: a run failed"
fi
expect_error "--fp32-params matching nothing" \
  "fp32_params (--fp32-params): pattern 'model.nope.\*' matches no parameter" \
  --param-dtype bf16 --fp32-params 'model.nope.*'
finish
