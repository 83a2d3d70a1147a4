#!/usr/bin/env bash
# Chat data end to end (data/data_chat.h): {"messages": [...]} records
# rendered with the model directory's chat_template.jinja (SmolLM2's real
# template) and tokenized with tests/fixtures/data_formats' tokenizer (it
# fits `init --preset tiny`), against transformers' apply_chat_template ids
# and assistant masks of the same conversations (tests/fixtures/chat/
# cases.json, tools/gen_chat_fixtures.py). Checks:
# - tokenize writes input_ids and loss_mask = transformers' ids and masks;
# - logprobs reports those input_ids, on 1 rank and on 2 (dp=2);
# - train: step 1's loss (one batch of both conversations) is minus the
#   mean of logprobs' log-probs over the assistant tokens, and over every
#   token but the first with --assistant-only-loss false (config key
#   assistant_only_loss); 2 ranks give the 1-rank loss within the bound;
#   tokenize's output (input_ids + loss_mask) trains to the same loss bitwise;
# - bad input, on 2 ranks: every rank exits non-zero and one message names
#   the model directory and files (no template) or the file, line and field.
# usage: test_data_chat.sh MESHLM SOURCE_DIR JSON_CHECK TOL_BOUND
set -u
meshlm=$1
src=$2
json_check=$3
tol_bound=$4
. "$src/tests/cli/common.sh"
fx=$src/tests/fixtures
model=$work/model
"$meshlm" init --arch llama --preset tiny --seed 5 --out "$model" > /dev/null || exit 1
cp "$fx/data_formats/tokenizer.json" "$fx/data_formats/tokenizer_config.json" "$model/"
cp "$fx/jinja/templates/smollm2.jinja" "$model/chat_template.jinja"

# case NAME: the fixture line of conversation NAME (data_formats tokenizer, SmolLM2's template)
case_line() {
  grep -F "\"name\": \"$1\", \"tokenizer\": \"data_formats\", \"template\": \"jinja/templates/smollm2.jinja\"" \
    "$fx/chat/cases.json"
}
# array LINE NAME: the JSON array field NAME of LINE, comma-separated, no spaces
array() { sed -E "s/.*\"$2\": ?\[([^]]*)\].*/\1/" <<<"$1" | tr -d ' '; }
names="system_user_assistant two_turns"
: > "$work/chat.jsonl"
for n in $names; do
  printf '{"messages": %s, "id": "%s"}\n' \
    "$(sed -E 's/.*"messages": (\[.*\]), "text".*/\1/' <<<"$(case_line "$n")")" "$n" >> "$work/chat.jsonl"
done

# 1. tokenize: transformers' ids and assistant masks
"$meshlm" tokenize --model "$model" --data "$work/chat.jsonl" --out "$work/tok.jsonl" > "$work/out" 2> "$work/err"
good=1 i=0
while IFS= read -r line; do
  i=$((i + 1))
  n=$(sed -n "${i}p" <<<"${names// /$'\n'}")
  want=$(case_line "$n")
  "$json_check" <<<"$line" || good=0
  [ "$(array "$line" input_ids)" = "$(array "$want" input_ids)" ] || { good=0; echo "$n: input_ids"; }
  [ "$(array "$line" loss_mask)" = "$(array "$want" assistant_masks)" ] || { good=0; echo "$n: loss_mask"; }
  grep -q "\"id\": *\"$n\"" <<<"$line" && ! grep -q '"messages"' <<<"$line" || { good=0; echo "$n: fields"; }
done < "$work/tok.jsonl"
if [ $good -eq 1 ] && [ $i -eq 2 ]; then
  ok "tokenize messages: input_ids and loss_mask = transformers' apply_chat_template ids and masks"
else
  bad "tokenize messages"; cat "$work/out"
fi

# 2. logprobs: the same ids, on 1 and 2 ranks
good=1
for np in 1 2; do
  mpiexec -n $np "$meshlm" logprobs --model "$model" --data "$work/chat.jsonl" --out "$work/lp$np.jsonl" \
    > /dev/null 2> "$work/err" || good=0
  i=0
  while IFS= read -r line; do
    i=$((i + 1))
    n=$(sed -n "${i}p" <<<"${names// /$'\n'}")
    [ "$(array "$line" input_ids)" = "$(array "$(case_line "$n")" input_ids)" ] || good=0
  done < "$work/lp$np.jsonl"
  [ $i -eq 2 ] || good=0
done
if [ $good -eq 1 ]; then
  ok "logprobs of messages: input_ids = transformers' ids, on 1 and 2 ranks"
else
  bad "logprobs of messages"
fi

# nll ALL: minus the mean log-prob of the targets (ALL=1: every token but the first; else the
# assistant mask's tokens, token t scored by logprobs[t-1])
nll() {
  local i=0 n line
  while IFS= read -r line; do
    i=$((i + 1))
    n=$(sed -n "${i}p" <<<"${names// /$'\n'}")
    paste -d' ' <(array "$line" logprobs | tr ',' '\n') \
      <(array "$(case_line "$n")" assistant_masks | tr ',' '\n' | tail -n +2)
  done < "$work/lp1.jsonl" |
    awk -v all="$1" '{ if (all || $2 == 1) { s += $1; k++ } } END { printf "%.17g\n", -s / k }'
}
close() {
  awk -v a="$1" -v b="$2" -v t="$3" 'BEGIN { d = a - b; m = a < 0 ? -a : a
    exit !((d < 0 ? -d : d) <= t * m) }'
}
loss1() { sed -nE '1s/.*"loss": ?([-0-9.eE+]+).*/\1/p' "$1"; }
bound=$("$tol_bound" "$model" loss pair 256 512)
train() {
  "$meshlm" train --model "$model" --steps 1 --batch-size 2 --seq-len 256 --peak-tflops 1 "$@"
}

# 3. train on the assistant turns, and on every token
printf '{"assistant_only_loss": false}\n' > "$work/all.json"
for mode in assistant all; do
  if [ $mode = assistant ]; then args=(); want=$(nll 0); else args=(--config "$work/all.json"); want=$(nll 1); fi
  if train --data "$work/chat.jsonl" "${args[@]}" --metrics "$work/m_$mode.jsonl" > "$work/out" 2> "$work/err" &&
     grep -q "2 messages records, 332 tokens -> 2 sequences (one per record)" "$work/out" &&
     close "$want" "$(loss1 "$work/m_$mode.jsonl")" "$bound"; then
    ok "train on messages ($mode tokens): step 1 loss $(loss1 "$work/m_$mode.jsonl") = logprobs' $want"
  else
    bad "train on messages ($mode tokens): loss $(loss1 "$work/m_$mode.jsonl") vs $want"; cat "$work/out"
  fi
done
if train --data "$work/tok.jsonl" --metrics "$work/m_tok.jsonl" > "$work/out" 2> "$work/err" &&
   [ "$(loss1 "$work/m_tok.jsonl")" = "$(loss1 "$work/m_assistant.jsonl")" ]; then
  ok "train on tokenize's output (input_ids + loss_mask): the conversations' loss, bitwise"
else
  bad "train on tokenize's output: loss $(loss1 "$work/m_tok.jsonl")"; cat "$work/out"
fi
if mpiexec -n 2 "$meshlm" train --model "$model" --data "$work/chat.jsonl" --steps 1 --batch-size 2 \
     --seq-len 256 --peak-tflops 1 --metrics "$work/m_dp2.jsonl" > "$work/out" 2> "$work/err" &&
   close "$(loss1 "$work/m_assistant.jsonl")" "$(loss1 "$work/m_dp2.jsonl")" "$bound"; then
  ok "train on messages, dp=2: loss $(loss1 "$work/m_dp2.jsonl") = 1 rank's"
else
  bad "train on messages, dp=2"; cat "$work/out"
fi

# 4. bad input on 2 ranks: every rank fails, one message
expect() {
  local name=$1 pattern=$2
  shift 2
  local err rc
  err=$(timeout 120 mpiexec -n 2 "$@" 2>&1 >/dev/null)
  rc=$?
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -qF -- "$pattern" <<<"$err" &&
     [ "$(grep -c 'meshlm: error' <<<"$err")" -eq 1 ]; then
    ok "$name: $(grep -m1 'meshlm: error' <<<"$err")"
  else
    bad "$name (exit $rc): $err"
  fi
}
mkdir "$work/plain"
cp "$model"/*.json "$model"/*.safetensors "$work/plain/"
expect "no chat template" "no chat template: neither $work/plain/chat_template.jinja nor field 'chat_template'" \
  "$meshlm" train --model "$work/plain" --data "$work/chat.jsonl" --steps 1 --batch-size 2 --seq-len 256
{ head -1 "$work/chat.jsonl"; echo '{"messages": [{"role": "user", "content": 7}]}'; } > "$work/bad.jsonl"
expect "a content that is not text" "bad.jsonl:2: field 'messages'[0].content: expected a string" \
  "$meshlm" train --model "$model" --data "$work/bad.jsonl" --steps 1 --batch-size 2 --seq-len 256
echo '{"messages": []}' > "$work/empty.jsonl"
expect "an empty conversation" "empty.jsonl:1: field 'messages': expected at least one message" \
  "$meshlm" logprobs --model "$model" --data "$work/empty.jsonl" --out "$work/x.jsonl"
finish
