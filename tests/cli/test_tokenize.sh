#!/usr/bin/env bash
# meshlm tokenize end to end: JSONL text → JSONL input_ids, byte for byte the
# ids HF `tokenizers` gives (tests/fixtures/tokenizer/cli/expected_*.jsonl,
# made by tools/gen_tokenizer_fixtures.py): with and without special tokens
# (a template adding BOS and EOS), SmolLM2's tokenizer, under mpirun (rank 0
# writes, the others wait), another --text-key; and bad input: a record
# without the text field (the message names the file, the line and the
# field), invalid JSON, a model directory without tokenizer.json, an
# unsupported tokenizer component — each exits non-zero and leaves an
# existing output file as it was.
# usage: test_tokenize.sh MESHLM SOURCE_DIR JSON_CHECK TOL_BOUND
set -u
meshlm=$1
src=$2
json_check=$3
fx=$src/tests/fixtures/tokenizer
. "$src/tests/cli/common.sh"

# same NAME FILE EXPECTED: FILE is EXPECTED, byte for byte
same() {
  if cmp -s "$2" "$3"; then ok "$1"; else bad "$1: $(cmp "$2" "$3" 2>&1 | head -1)"; fi
}

run() { "$meshlm" tokenize --data "$fx/cli/in.jsonl" "$@" 2>"$work/err"; }

run --model "$fx/bytelevel_legacy" --out "$work/special.jsonl"
same "BOS + EOS template" "$work/special.jsonl" "$fx/cli/expected_special.jsonl"
run --model "$fx/bytelevel_legacy" --out "$work/plain.jsonl" --no-special
same "--no-special" "$work/plain.jsonl" "$fx/cli/expected_plain.jsonl"
run --model "$fx/smollm2" --out "$work/smol.jsonl"
same "SmolLM2's tokenizer.json" "$work/smol.jsonl" "$fx/cli/expected_smollm2.jsonl"
mpiexec -n 2 "$meshlm" tokenize --model "$fx/bytelevel_legacy" --data "$fx/cli/in.jsonl" \
  --out "$work/mpi.jsonl" 2>"$work/err" >"$work/mpi.log"
same "mpiexec -n 2" "$work/mpi.jsonl" "$fx/cli/expected_special.jsonl"
if [ "$(grep -c '^tokenize:' "$work/mpi.log")" = 1 ]; then ok "one summary line under mpiexec"
else bad "summary lines: $(cat "$work/mpi.log")"; fi

printf '{"content": "hello meshlm", "n": 1}\n' > "$work/other.jsonl"
"$meshlm" tokenize --model "$fx/bytelevel" --data "$work/other.jsonl" --out "$work/other_out.jsonl" \
  --text-key content 2>"$work/err" >/dev/null
if "$json_check" input_ids n < "$work/other_out.jsonl" 2>"$work/err" &&
   ! grep -q content "$work/other_out.jsonl"; then ok "--text-key content, other fields kept"
else bad "--text-key: $(cat "$work/other_out.jsonl")"; fi

# fails NAME PATTERN ARGS...: tokenize exits non-zero with PATTERN in its
# message and the previous output file untouched
fails() {
  local name=$1 pattern=$2
  shift 2
  echo previous > "$work/kept.jsonl"
  if "$meshlm" tokenize --out "$work/kept.jsonl" "$@" 2>"$work/err" >/dev/null; then
    bad "$name: exit 0"
  elif ! grep -qE -- "$pattern" "$work/err"; then
    bad "$name: message lacks /$pattern/"
  elif [ "$(cat "$work/kept.jsonl")" != previous ] || ls "$work"/kept.jsonl.* >/dev/null 2>&1; then
    bad "$name: output touched"
  else
    ok "$name: $(head -1 "$work/err")"
  fi
}

printf '{"text": "fine"}\n{"txt": "typo"}\n' > "$work/missing.jsonl"
fails "missing text field" "missing.jsonl:2: field 'text': missing" \
  --model "$fx/bytelevel" --data "$work/missing.jsonl"
printf '{"text": "fine"}\n\n{"text": 5}\n' > "$work/wrong.jsonl"
fails "text not a string" "wrong.jsonl:3: field 'text': expected a string" \
  --model "$fx/bytelevel" --data "$work/wrong.jsonl"
printf '{"text": "fine"}\n{"text": "unterminated\n' > "$work/broken.jsonl"
fails "invalid JSON" "broken.jsonl:2:.*invalid JSON" \
  --model "$fx/bytelevel" --data "$work/broken.jsonl"
mkdir -p "$work/empty_model"
fails "no tokenizer.json" "empty_model/tokenizer.json: cannot open" \
  --model "$work/empty_model" --data "$fx/cli/in.jsonl"
mkdir -p "$work/wordpiece"
sed 's/"type": "BPE"/"type": "WordPiece"/' "$fx/bytelevel/tokenizer.json" > "$work/wordpiece/tokenizer.json"
fails "unsupported model" "tokenizer.json: field 'model.type': found \"WordPiece\"" \
  --model "$work/wordpiece" --data "$fx/cli/in.jsonl"
fails "missing input" "nosuch.jsonl: cannot open" \
  --model "$fx/bytelevel" --data "$work/nosuch.jsonl"
finish
