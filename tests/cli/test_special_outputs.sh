#!/usr/bin/env bash
# Outputs that are not regular files (issue 26): logprobs --out, tokenize
# --out and train --metrics naming a character device or a FIFO write into
# it in place (a FIFO's reader receives the lines a regular file gets); the
# device node stays a device, the FIFO a FIFO, and no PATH.tmp appears
# beside them. A directory given as an output file is refused, naming it,
# and left as it was. A private device node (mknod, where permitted) is
# tried before /dev/null, whose checks are skipped when the private one was
# replaced: a broken build must not destroy the machine's /dev/null.
# usage: test_special_outputs.sh MESHLM SOURCE_DIR
set -u
meshlm=$1
src=$2
. "$src/tests/cli/common.sh"
reader=
on_exit='[ -n "$reader" ] && kill "$reader" 2>/dev/null'

fx=$src/tests/fixtures
printf '{"input_ids": [1, 2, 3, 4, 5]}\n{"input_ids": [5, 4, 3]}\n' > "$work/data.jsonl"
lp=(logprobs --model "$fx/llama_tied" --data "$work/data.jsonl")
tok=(tokenize --model "$fx/tokenizer/bytelevel_legacy" --data "$fx/tokenizer/cli/in.jsonl")
train=(train --model "$fx/llama_tied" --data "$work/data.jsonl" --steps 2 --batch-size 2 --seq-len 4
       --peak-tflops 1)
"$meshlm" "${lp[@]}" --out "$work/lp.jsonl" > /dev/null 2> "$work/err" || bad "logprobs to a regular file"
mpiexec -n 2 "$meshlm" "${lp[@]}" --out "$work/lp2.jsonl" --tp 2 > /dev/null 2> "$work/err" ||
  bad "logprobs --tp 2 to a regular file"
"$meshlm" "${tok[@]}" --out "$work/tok.jsonl" > /dev/null 2> "$work/err" || bad "tokenize to a regular file"

# 1. Character devices: a private one when mknod is permitted, then /dev/null.
# to_device NAME DEV ARGS...: meshlm ARGS writing into DEV succeeds and DEV
# stays a character device with no DEV.tmp beside it
to_device() {
  local name=$1 dev=$2
  shift 2
  "$meshlm" "$@" > "$work/out" 2> "$work/err"
  local rc=$?
  if [ $rc -eq 0 ] && [ -c "$dev" ] && [ ! -e "$dev.tmp" ]; then
    ok "$name: written into $dev, still a character device"
  else
    bad "$name (exit $rc): $(ls -l "$dev" "$dev.tmp" 2>&1 | tr '\n' ' ')"
  fi
}
devices=
if mknod "$work/null" c 1 3 2> /dev/null; then devices="$work/null"; fi
for dev in $devices /dev/null; do
  if [ "$dev" = /dev/null ] && [ -n "$devices" ] && [ ! -c "$work/null" ]; then
    bad "/dev/null checks skipped: the private device node was replaced"
    break
  fi
  to_device "logprobs --out" "$dev" "${lp[@]}" --out "$dev"
  to_device "tokenize --out" "$dev" "${tok[@]}" --out "$dev"
  to_device "train --metrics" "$dev" "${train[@]}" --metrics "$dev"
done
if [ -c /dev/null ]; then ok "/dev/null is still a character device"; else bad "/dev/null was replaced"; fi

# 2. A FIFO: its reader gets what a regular file gets, and it stays a FIFO.
# to_fifo NAME WANT NP ARGS...: `mpiexec -n NP meshlm ARGS` writing into
# $work/fifo while a reader copies it to $work/got; the copy equals WANT
# (a reader waiting on a FIFO nobody opens gives up after 60 s)
to_fifo() {
  local name=$1 want=$2 np=$3
  shift 3
  rm -f "$work/fifo" "$work/got"
  mkfifo "$work/fifo"
  timeout 60 cat "$work/fifo" > "$work/got" &
  reader=$!
  mpiexec -n "$np" "$meshlm" "$@" > "$work/out" 2> "$work/err"
  local rc=$?
  wait "$reader"
  local rrc=$?
  reader=
  if [ $rc -eq 0 ] && [ $rrc -eq 0 ] && [ -p "$work/fifo" ] && [ ! -e "$work/fifo.tmp" ] &&
     cmp -s "$want" "$work/got"; then
    ok "$name: the FIFO's reader received the output"
  else
    bad "$name (exit $rc, reader $rrc): $(ls -l "$work"/fifo* 2>&1 | tr '\n' ' ')"
  fi
}
to_fifo "logprobs --out" "$work/lp.jsonl" 1 "${lp[@]}" --out "$work/fifo"
to_fifo "logprobs --out, 2 ranks (tp 2)" "$work/lp2.jsonl" 2 "${lp[@]}" --out "$work/fifo" --tp 2
to_fifo "tokenize --out" "$work/tok.jsonl" 1 "${tok[@]}" --out "$work/fifo"
"$meshlm" "${train[@]}" --metrics "$work/m.jsonl" > /dev/null 2>&1
rm -f "$work/fifo" "$work/got"
mkfifo "$work/fifo"
timeout 60 cat "$work/fifo" > "$work/got" &
reader=$!
"$meshlm" "${train[@]}" --metrics "$work/fifo" > "$work/out" 2> "$work/err"
rc=$?
wait "$reader"
reader=
if [ $rc -eq 0 ] && [ -p "$work/fifo" ] && [ "$(wc -l < "$work/got")" -eq 2 ] &&
   [ "$(grep -c '"step": *[12],' "$work/got")" -eq 2 ]; then
  ok "train --metrics: the FIFO's reader received 2 lines"
else
  bad "train --metrics into a FIFO (exit $rc): $(cat "$work/got")"
fi

# 3. A directory as an output file: refused, named, untouched.
# to_dir NAME PATTERN ARGS...: meshlm ARGS exits non-zero with PATTERN in
# its message and $work/dir as it was (empty, nothing beside it)
mkdir "$work/dir"
to_dir() {
  local name=$1 pattern=$2
  shift 2
  "$meshlm" "$@" > "$work/out" 2> "$work/err"
  local rc=$?
  if [ $rc -ne 0 ] && grep -qE -- "$pattern" "$work/err" && [ -d "$work/dir" ] &&
     [ -z "$(ls -A "$work/dir")" ] && [ -z "$(ls -d "$work"/dir?* 2>/dev/null)" ]; then
    ok "$name: $(grep 'meshlm: error' "$work/err")"
  else
    bad "$name (exit $rc): $(ls -A "$work" | tr '\n' ' ')"
  fi
}
to_dir "logprobs --out DIR" "error: .*/dir: is a directory; expected a file to write" \
  "${lp[@]}" --out "$work/dir"
to_dir "tokenize --out DIR" "error: .*/dir: is a directory; expected a file to write" \
  "${tok[@]}" --out "$work/dir"
to_dir "train --metrics DIR" "error: .*/dir: .*Is a directory" "${train[@]}" --metrics "$work/dir"

finish
