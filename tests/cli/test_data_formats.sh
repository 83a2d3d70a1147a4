#!/usr/bin/env bash
# Data formats end to end (data/data.h): text and prompt/completion JSONL
# and raw text, tokenized in C with the model directory's tokenizer.json.
# The model is `init --preset tiny` (vocab 256) with the tokenizer of
# tests/fixtures/data_formats (256 ids; tools/gen_data_format_fixture.py),
# whose cases.json holds transformers tokenizers' ids of every text used
# here: the ids logprobs reports and the token counts train reports are
# checked against them. Checks:
# - train 2 steps on text records (packed, and --packing false with a
#   custom --text-key from a --config file), on prompt/completion records
#   and on raw text; the first step's loss of the unpacked runs equals the
#   mean of `logprobs`' log-probs over the targets (every token but the
#   first; the completion's tokens) within tolerance.h's bound;
# - logprobs of prompt/completion records: input_ids = prompt (BOS) +
#   completion + EOS, prompt_tokens, completion_logprobs = the matching
#   entries of logprobs, completion_logprob_sum = their sum; the same on
#   2 ranks (dp=2, tp=2, cp=2) as on 1 within the bound;
# - bad input: every rank exits non-zero with one message naming the file,
#   line and field (or flag), and no output is left behind.
# usage: test_data_formats.sh MESHLM SOURCE_DIR JSON_CHECK TOL_BOUND
set -u
meshlm=$1
src=$2
json_check=$3
tol_bound=$4
. "$src/tests/cli/common.sh"
fx=$src/tests/fixtures/data_formats
model=$work/model
"$meshlm" init --arch llama --preset tiny --seed 5 --out "$model" > /dev/null || exit 1
cp "$fx/tokenizer.json" "$fx/tokenizer_config.json" "$model/"

t1="The quick brown fox jumps over the lazy dog."
t2="meshlm trains and scores decoder language models."
p1="Question: what is two plus two?"
c1=" Answer: four."
p2="Name a colour of the sky."
c2=" Blue, on a clear day."
printf '{"text": "%s"}\n\n{"text": "%s", "source": 7}\n' "$t1" "$t2" > "$work/text.jsonl"
printf '{"body": "%s"}\n{"body": "%s"}\n' "$t1" "$t2" > "$work/body.jsonl"
printf '{"prompt": "%s", "completion": "%s"}\n{"completion": "%s", "prompt": "%s"}\n' \
  "$p1" "$c1" "$c2" "$p2" > "$work/pc.jsonl"
printf '%s' "$t1" > "$work/raw.txt"

# golden TEXT true|false: the fixture's ids of TEXT (comma-separated)
golden() {
  grep -F "{\"text\": \"$1\", \"add_special\": $2," "$fx/cases.json" |
    sed -E 's/.*"ids": \[([^]]*)\].*/\1/'
}
eos=$(sed -nE '1s/.*"eos": ([0-9]+).*/\1/p' "$fx/cases.json")
count() { tr ',' '\n' <<<"$1" | grep -c .; }
# array LINE NAME: the JSON array field NAME of LINE, comma-separated
array() { sed -E "s/.*\"$2\": \[([^]]*)\].*/\1/" <<<"$1"; }
number() { sed -E "s/.*\"$2\": ([-0-9.eE+]+).*/\1/" <<<"$1"; }
sum() { tr ',' '\n' <<<"$1" | awk '{ s += $1 } END { printf "%.17g\n", s }'; }
# close A B BOUND: |A - B| <= BOUND·|A|. A sum of log-probs against the sum of its printed
# entries: the entries are floats printed to 9 significant digits (each within 5e-9 relative of
# the float summed), so sums of these same-sign numbers agree within 1e-8 relative.
close() {
  awk -v a="$1" -v b="$2" -v t="$3" 'BEGIN { d = a - b; m = a < 0 ? -a : a
    exit !((d < 0 ? -d : d) <= t * m) }'
}
# windows L S: the rows of L tokens cut into windows of S (a tail of >= 2 tokens kept)
windows() { echo $(($1 / $2 + ($1 % $2 >= 2))); }
# mean_nll LIST: minus the mean of a comma-separated list
mean_nll() { awk -v s="$(sum "$1")" -v n="$(count "$1")" 'BEGIN { printf "%.17g\n", -s / n }'; }
train() { "$meshlm" train --model "$model" --steps 2 --batch-size 2 --peak-tflops 1 "$@"; }
loss1() { sed -nE '1s/.*"loss": ?([-0-9.eE+]+).*/\1/p' "$1"; }

# 1. text records, packed: the documents' tokens (BOS from the template, EOS appended)
n_text=$(($(count "$(golden "$t1" true)") + 1 + $(count "$(golden "$t2" true)") + 1))
line="train: data $work/text.jsonl: 2 text records, $n_text tokens -> $(windows $n_text 16) sequences"
if train --data "$work/text.jsonl" --seq-len 16 --metrics "$work/m_text.jsonl" > "$work/out" 2> "$work/err" &&
   grep -qF "$line (packed into --seq-len windows)" "$work/out" &&
   [ "$(wc -l < "$work/m_text.jsonl")" -eq 2 ]; then
  ok "train on text records, packed: $(grep 'train: data' "$work/out")"
else
  bad "train on text records, packed"; cat "$work/out"
fi

# 2. text records one per row (--config: packing false, text_key body); step 1's loss is
# the mean log-prob of every token but each document's first
printf '{"packing": false, "text_key": "body"}\n' > "$work/cfg.json"
"$meshlm" logprobs --model "$model" --data "$work/text.jsonl" --out "$work/lp_text.jsonl" \
  > /dev/null 2> "$work/err"
want=$(mean_nll "$(while IFS= read -r l; do array "$l" logprobs; done < "$work/lp_text.jsonl" | paste -sd,)")
bound=$("$tol_bound" "$model" loss pair 32 64)
if train --data "$work/body.jsonl" --config "$work/cfg.json" --seq-len 32 --metrics "$work/m_body.jsonl" \
     > "$work/out" 2> "$work/err" &&
   grep -q "2 text records, $n_text tokens -> 2 sequences (one per record)" "$work/out" &&
   close "$want" "$(loss1 "$work/m_body.jsonl")" "$bound"; then
  ok "train on text records, one per row: step 1 loss $(loss1 "$work/m_body.jsonl") = logprobs' $want"
else
  bad "train on text records, one per row: loss $(loss1 "$work/m_body.jsonl") vs $want"; cat "$work/out"
fi

# 3. prompt/completion: logprobs' fields against the golden ids and against one another
"$meshlm" logprobs --model "$model" --data "$work/pc.jsonl" --out "$work/lp1.jsonl" > /dev/null 2> "$work/err"
pc_ok=1 comp=""
i=0
while IFS= read -r line; do
  i=$((i + 1))
  if [ $i -eq 1 ]; then p=$p1 c=$c1; else p=$p2 c=$c2; fi
  ids="$(golden "$p" true), $(golden "$c" false), $eos"
  np=$(count "$(golden "$p" true)")
  lp=$(array "$line" logprobs)
  cl=$(array "$line" completion_logprobs)
  expect_cl=$(tr -d ' ' <<<"$lp" | tr ',' '\n' | tail -n +"$np" | paste -sd, | sed 's/,/, /g')
  "$json_check" <<<"$line" || pc_ok=0
  [ "$(array "$line" input_ids)" = "$ids" ] || { pc_ok=0; echo "record $i: input_ids, expected $ids"; }
  [ "$(number "$line" prompt_tokens)" = "$np" ] || { pc_ok=0; echo "record $i: prompt_tokens"; }
  [ "$cl" = "$expect_cl" ] || { pc_ok=0; echo "record $i: completion_logprobs != logprobs[$((np - 1)):]"; }
  close "$(sum "$cl")" "$(number "$line" completion_logprob_sum)" 1e-8 || { pc_ok=0; echo "record $i: sum"; }
  comp="$comp${comp:+,}$cl"
done < "$work/lp1.jsonl"
if [ $pc_ok -eq 1 ] && [ $i -eq 2 ]; then
  ok "logprobs of prompt/completion: input_ids = golden prompt + completion + EOS,\
 completion_logprobs = logprobs[prompt_tokens-1:], completion_logprob_sum = their sum"
else
  bad "logprobs of prompt/completion records"
fi

# 4. train on them: step 1's loss is minus the mean of the completion log-probs
want=$(mean_nll "$comp")
if train --data "$work/pc.jsonl" --seq-len 32 --metrics "$work/m_pc.jsonl" > "$work/out" 2> "$work/err" &&
   grep -q "2 prompt/completion records, .* -> 2 sequences (one per record)" "$work/out" &&
   close "$want" "$(loss1 "$work/m_pc.jsonl")" "$bound"; then
  ok "train on prompt/completion records: step 1 loss $(loss1 "$work/m_pc.jsonl") = completions' $want"
else
  bad "train on prompt/completion: loss $(loss1 "$work/m_pc.jsonl") vs $want"; cat "$work/out"
fi

# 5. the same log-probs on 2 ranks: dp=2, tp=2, cp=2
lbound=$("$tol_bound" "$model" logprobs pair 31 31)
values() { while IFS= read -r l; do array "$l" logprobs; done < "$1" | tr ',' '\n'; }
# the fields other than log-probs: prompt_tokens, input_ids
strip() {
  sed -E 's/"(logprobs|completion_logprobs)": \[[^]]*\], //g; s/"completion_logprob_sum": [^,]*, //' "$1"
}
for mesh in "" "--tp 2" "--cp 2"; do
  # shellcheck disable=SC2086
  mpiexec -n 2 "$meshlm" logprobs --model "$model" --data "$work/pc.jsonl" --out "$work/lp2.jsonl" $mesh \
    > /dev/null 2> "$work/err"
  same=1
  while IFS= read -r line; do
    s=$(sum "$(array "$line" completion_logprobs)")
    close "$s" "$(number "$line" completion_logprob_sum)" 1e-8 || same=0
  done < "$work/lp2.jsonl"
  [ "$(strip "$work/lp1.jsonl")" = "$(strip "$work/lp2.jsonl")" ] || same=0
  rel=$(paste <(values "$work/lp1.jsonl") <(values "$work/lp2.jsonl") |
    awk '{ d = $1 - $2; e += d * d; r += $1 * $1 } END { printf "%.3g\n", sqrt(e / r) }')
  if [ $same -eq 1 ] && awk -v r="$rel" -v t="$lbound" 'BEGIN { exit !(r <= t) }'; then
    ok "logprobs of prompt/completion on 2 ranks ${mesh:-dp=2}: relative L2 $rel vs 1 rank\
 (bound $lbound), same ids and prompt lengths, sums"
  else
    bad "logprobs on 2 ranks ${mesh:-dp=2}: relative L2 $rel"
  fi
done

# 6. raw text with a tokenizer.json: one document, tokenized
n_raw=$(($(count "$(golden "$t1" true)") + 1))
if train --data "$work/raw.txt" --seq-len 8 > "$work/out" 2> "$work/err" &&
   grep -qF "1 raw text record, $n_raw tokens -> $(windows $n_raw 8) sequences (packed" "$work/out"; then
  ok "train on raw text: $(grep 'train: data' "$work/out")"
else
  bad "train on raw text"; cat "$work/out"
fi

# 7. bad input
# expect NAME PATTERN CMD...: CMD fails, stderr matches PATTERN (fixed string), no output file
expect() {
  local name=$1 pattern=$2
  shift 2
  rm -f "$work/bad_out.jsonl"
  local err rc
  err=$(timeout 120 "$@" 2>&1 >/dev/null)
  rc=$?
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -qF -- "$pattern" <<<"$err" &&
     [ ! -e "$work/bad_out.jsonl" ]; then
    ok "$name: $(grep -m1 'meshlm: error' <<<"$err")"
  else
    bad "$name (exit $rc): $err"
  fi
}
mkdir "$work/notok"
cp "$model/config.json" "$model/model.safetensors" "$work/notok/"
missing="tokenizing text needs the model's tokenizer, and $work/notok/tokenizer.json does not exist"
expect "prompt/completion without tokenizer.json, 2 ranks" \
  "pc.jsonl:1: fields 'prompt' + 'completion': $missing" \
  mpiexec -n 2 "$meshlm" logprobs --data "$work/pc.jsonl" --out "$work/bad_out.jsonl" --model "$work/notok"
expect "text without tokenizer.json (train)" "text.jsonl:1: field 'text': $missing" \
  "$meshlm" train --model "$work/notok" --data "$work/text.jsonl" --steps 1 --batch-size 1
printf '{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n' > "$work/bad.jsonl"
expect "missing completion" "bad.jsonl:2: field 'completion': expected a string (the completion of\
 field 'prompt'), found the field missing" \
  mpiexec -n 2 "$meshlm" logprobs --model "$model" --data "$work/bad.jsonl" --out "$work/bad_out.jsonl"
printf '{"text": "a b c"}\n{"text": 5}\n' > "$work/bad.jsonl"
expect "text not a string" "bad.jsonl:2: field 'text': expected a string, found 5" \
  "$meshlm" train --model "$model" --data "$work/bad.jsonl" --steps 1 --batch-size 1
printf '{"text": "a b c"}\n{"input_ids": [1, 2, 3]}\n' > "$work/bad.jsonl"
expect "formats mixed" \
  "bad.jsonl:2: a record in the input_ids format, but line 1's is in the text format" \
  "$meshlm" train --model "$model" --data "$work/bad.jsonl" --steps 1 --batch-size 1
printf '{"question": "a", "answer": "b"}\n' > "$work/bad.jsonl"
expect "keys not found" "bad.jsonl:1: no data field: expected field 'input_ids' (token ids),\
 'text' (text, --text-key), 'prompt' + 'completion' (--prompt-key, --completion-key) or 'messages'" \
  "$meshlm" logprobs --model "$model" --data "$work/bad.jsonl" --out "$work/bad_out.jsonl"
printf '{"question": "%s", "answer": "%s"}\n' "$p1" "$c1" > "$work/qa.jsonl"
if "$meshlm" logprobs --model "$model" --data "$work/qa.jsonl" --out "$work/qa_out.jsonl" \
     --prompt-key question --completion-key answer > /dev/null 2> "$work/err" &&
   [ "$(head -1 "$work/lp1.jsonl")" = "$(cat "$work/qa_out.jsonl")" ]; then
  ok "--prompt-key question --completion-key answer: the same output"
else
  bad "--prompt-key / --completion-key"
fi
printf '{"prompt": "%s", "completion": "%s"}\n' "$p1" "$(seq -s ' ' 600)" > "$work/bad.jsonl"
expect "longer than max_position_embeddings" \
  "bad.jsonl:1: fields 'prompt' + 'completion':" \
  "$meshlm" logprobs --model "$model" --data "$work/bad.jsonl" --out "$work/bad_out.jsonl"
expect "--packing maybe" "--packing" \
  "$meshlm" train --model "$model" --data "$work/text.jsonl" --packing maybe
finish
