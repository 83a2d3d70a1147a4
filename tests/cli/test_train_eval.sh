#!/usr/bin/env bash
# meshlm train --eval-data FILE --eval-every N on a tiny model:
#  (a) with --lr 0 the weights never move (AdamW's update is lr times a
#      finite term, weight decay lr·wd·p: both exactly 0), so the eval loss
#      of a held-out set that is exactly a step's batch, evaluated in the
#      same geometry (the same rows on the same ranks, one micro-batch),
#      runs the same forward and loss pass on the same weights and sums the
#      same per-token NLLs in the same order over the same ranks: it must
#      equal the step's printed loss bitwise (the metrics' round-trip reals
#      compared as strings). One record of 64 token ids, --batch-size = the
#      data-parallel size, on 1 rank, dp_shard 2 (the step's batch wraps
#      the one record onto both ranks; the eval's second rank runs a
#      padding row without targets: (s+s)/(2c) = s/c exactly), tp 2 and
#      cp 2 (each cp rank's piece summed over dp_cp as the step's);
#      every --eval-every step and the last, the metrics' eval line
#      {"step", "eval_loss", "eval_tokens"} and the progress line;
#  (b) dp_shard 2 against 1 rank on 47 sequences in micro-batches of 2 (the
#      last one short: a padding row on the second rank): the eval losses
#      agree within tests/tolerance.h's bound for two fp32 evaluations of
#      the loss in different orders (tol_bound loss pair);
#  (c) the config keys eval_data / eval_every give the flags' eval lines
#      bitwise;
#  (e) --steps 0 evaluates the initial weights once;
#  (d) errors: --eval-every without --eval-data, a negative --eval-every,
#      a missing and an empty --eval-data file (named), on 2 ranks every
#      rank exiting non-zero.
# usage: test_train_eval.sh MESHLM SOURCE_DIR JSON_CHECK TOL_BOUND
set -u
meshlm=$1
src=$2
json_check=$3
tol_bound=$4
. "$src/tests/cli/common.sh"

"$meshlm" init --arch llama --preset tiny --seed 3 --out "$work/model" > /dev/null
head -c 64 "$src/README.md" | od -An -tu1 -v | tr -s ' \n' ' ' |
  awk '{ printf "{\"input_ids\": ["; for (i = 1; i <= NF; i++) printf "%s%s", (i > 1 ? ", " : ""), $i; print "]}" }' \
  > "$work/rec.jsonl"
head -c 3000 "$src/README.md" > "$work/text.txt" # 47 sequences of 64 bytes
common=(--model "$work/model" --seq-len 64 --peak-tflops 1)
# field FILE KEY: the values of KEY in the metrics lines that have it, one per line
field() { grep "\"$2\":" "$1" | sed -E "s/.*\"$2\":([^,}]+).*/\1/"; }

# (a) --lr 0: the eval loss is the step's loss, bitwise
for mesh in "1 1" "2 2" "2 1 --tp 2" "2 1 --cp 2"; do
  set -- $mesh
  np=$1 batch=$2
  shift 2
  launch=()
  [ "$np" -gt 1 ] && launch=(mpiexec -n "$np")
  m=$work/m$np$*.jsonl
  if ! "${launch[@]}" "$meshlm" train "${common[@]}" --data "$work/rec.jsonl" --eval-data "$work/rec.jsonl" \
      --batch-size "$batch" --lr 0 --steps 3 --eval-every 2 --metrics "$m" "$@" > "$work/out" 2> "$work/err"; then
    bad "(a) np $np $*: train with --eval-data failed"; continue
  fi
  loss=$(field "$m" loss | sed -n 2p) eval=$(field "$m" eval_loss)
  [ "$(field "$m" step | tr '\n' ' ')" = "1 2 2 3 3 " ] && [ "$(echo "$eval" | wc -l)" -eq 2 ] &&
    ok "(a) np $np $*: eval lines after steps 2 (--eval-every 2) and 3 (the last)" ||
    bad "(a) np $np $*: eval lines at steps $(field "$m" step | tr '\n' ' '), expected 1 2 2 3 3"
  [ "$(echo "$eval" | sort -u)" = "$loss" ] && ok "(a) np $np $*: eval loss = the step's loss bitwise ($loss)" ||
    bad "(a) np $np $*: eval losses $(echo $eval) differ from the step's loss $loss"
  line=$(grep eval_loss "$m" | head -1)
  "$json_check" step eval_loss eval_tokens <<< "$line" &&
    [ "$(echo "$line" | sed -E 's/"[a-z_]+"://g; s/[^,]//g')" = ",," ] &&
    [ "$(field "$m" eval_tokens | head -1)" = 63 ] && ok "(a) np $np $*: eval line $line" ||
    bad "(a) np $np $*: eval line $line: expected {\"step\", \"eval_loss\", \"eval_tokens\": 63}"
  grep -qE "^eval step 2: loss [0-9.]+ \(63 tokens\)$" "$work/out" &&
    grep -q "^train: eval data $work/rec.jsonl: 1 record, 64 tokens -> 1 sequences" "$work/out" &&
    ok "(a) np $np $*: progress lines" || bad "(a) np $np $*: no 'eval step 2: loss X (63 tokens)' line"
done

# (b) dp_shard 2 against 1 rank, the last micro-batch short
for np in 1 2; do
  launch=()
  [ "$np" -gt 1 ] && launch=(mpiexec -n "$np")
  "${launch[@]}" "$meshlm" train "${common[@]}" --data "$work/text.txt" --eval-data "$work/text.txt" \
    --batch-size 4 --grad-accum 2 --steps 1 --metrics "$work/b$np.jsonl" > "$work/out$np" 2> "$work/err" ||
    bad "(b) train on $np rank(s) failed"
done
e1=$(field "$work/b1.jsonl" eval_loss) e2=$(field "$work/b2.jsonl" eval_loss)
t1=$(field "$work/b1.jsonl" eval_tokens) t2=$(field "$work/b2.jsonl" eval_tokens)
bound=$("$tol_bound" "$work/model" loss pair 64 3008)
if [ "$t1" = 2953 ] && [ "$t2" = 2953 ] &&
  awk -v a="$e1" -v b="$e2" -v t="$bound" 'BEGIN { d = a - b; d = d < 0 ? -d : d;
    printf "(b) eval loss 1 rank %s, dp_shard 2 %s: relative difference %.3g (bound %.3g)\n", a, b, d / a, t
    exit !(a > 0 && d / a <= t) }'; then
  ok "(b) dp_shard 2 = 1 rank within the pair bound, 2953 targets each"
else
  bad "(b) eval losses $e1 / $e2, targets $t1 / $t2 (expected 2953)"
fi

# (c) the config keys
printf '{"eval_data": "%s", "eval_every": 1}\n' "$work/rec.jsonl" > "$work/cfg.json"
"$meshlm" train "${common[@]}" --data "$work/rec.jsonl" --batch-size 1 --lr 0 --steps 2 \
  --config "$work/cfg.json" --metrics "$work/c1.jsonl" > /dev/null 2> "$work/err" &&
  "$meshlm" train "${common[@]}" --data "$work/rec.jsonl" --batch-size 1 --lr 0 --steps 2 \
    --eval-data "$work/rec.jsonl" --eval-every 1 --metrics "$work/c2.jsonl" > /dev/null 2>&1 &&
  [ "$(grep eval_loss "$work/c1.jsonl" | wc -l)" -eq 2 ] &&
  [ "$(grep eval_loss "$work/c1.jsonl")" = "$(grep eval_loss "$work/c2.jsonl")" ] &&
  ok "(c) config keys eval_data, eval_every = the flags" || bad "(c) config keys eval_data, eval_every"

# (e) --steps 0: no step, one evaluation of the initial weights (step 0); with
#     --lr 0 the weights of (a)'s 1-rank run never moved, so its eval loss
#     is this one bitwise
if "$meshlm" train "${common[@]}" --data "$work/rec.jsonl" --eval-data "$work/rec.jsonl" \
    --batch-size 1 --steps 0 --metrics "$work/e.jsonl" > "$work/out" 2> "$work/err" &&
  [ "$(field "$work/e.jsonl" step)" = 0 ] &&
  [ "$(field "$work/e.jsonl" eval_loss)" = "$(field "$work/m1.jsonl" eval_loss | head -1)" ]; then
  ok "(e) --steps 0: one eval line at step 0, the --lr 0 run's eval loss bitwise"
else
  bad "(e) --steps 0: eval lines $(grep eval_loss "$work/e.jsonl" 2> /dev/null), expected one at step 0"
fi

# (d) errors
: > "$work/empty.jsonl"
# refused CASE EXPECTED ARGS...: every rank of a 2-rank run exits non-zero, stderr matches
refused() {
  local name=$1 want=$2
  shift 2
  if mpiexec -n 2 "$meshlm" train "${common[@]}" --data "$work/rec.jsonl" --batch-size 2 \
      "$@" > "$work/out" 2> "$work/err"; then
    bad "(d) $name: accepted"
  elif ! grep -q -- "$want" "$work/err"; then
    bad "(d) $name: no message matching '$want'"
  else
    ok "(d) $name: $(grep -o -- "$want.*" "$work/err" | head -1)"
  fi
}
refused "--eval-every without --eval-data" "flag --eval-every 2 needs --eval-data FILE" --eval-every 2
refused "negative --eval-every" "flag --eval-every: expected an integer >= 0, found -1" \
  --eval-data "$work/rec.jsonl" --eval-every -1
refused "missing --eval-data file" "$work/nope.jsonl" --eval-data "$work/nope.jsonl"
refused "empty --eval-data file" "$work/empty.jsonl: empty dataset" --eval-data "$work/empty.jsonl"
finish
