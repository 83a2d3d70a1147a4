#!/usr/bin/env bash
# meshlm plot METRICS.jsonl [--out PNG|-] [--field F]:
#  (a) the sparkline (--out -): one block character (▁..█) per step up to
#      72, the lowest step ▁ and the highest █, a '^' under a skipped step,
#      min / max / last with their steps; a null value (a non-finite loss)
#      is a gap; more than 72 steps are 72 columns;
#  (b) --field eval_loss reads the eval lines of a real train --metrics
#      file (train --eval-data), --field grad_norm its step lines;
#  (c) without gnuplot on PATH the sparkline, saying so;
#  (d) with gnuplot on PATH (Debian: gnuplot-nox): a PNG (its 8 signature
#      bytes), at --out and by default at FIELD.png; skipped here without;
#  (e) errors: no file argument, a missing file, a line that is not JSON
#      and a step line without the field (file:line named), an empty file,
#      a file without eval lines for --field eval_loss; under mpirun every
#      rank exits non-zero.
# usage: test_plot.sh MESHLM SOURCE_DIR
set -u
meshlm=$1
src=$2
. "$src/tests/cli/common.sh"

# a metrics file: 10 steps falling from 5 to 0.5, step 4 skipped, step 7 a null loss
for k in $(seq 1 10); do
  loss=$(awk -v k="$k" 'BEGIN { printf "%.3f", 5.5 - k / 2 }')
  [ "$k" -eq 7 ] && loss=null
  skipped=false
  [ "$k" -eq 4 ] && skipped=true
  echo "{\"step\":$k,\"loss\":$loss,\"grad_norm\":1.5,\"skipped\":$skipped}"
done > "$work/m.jsonl"

# (a) the sparkline
"$meshlm" plot "$work/m.jsonl" --out - > "$work/out" 2> "$work/err" || bad "(a) plot --out - failed"
spark=$(sed -n 2p "$work/out")
[ "$spark" = "█▇▆▆▅▄ ▃▂▁" ] && ok "(a) sparkline $spark" || bad "(a) sparkline '$spark', expected '█▇▆▆▅▄ ▃▂▁'"
[ "$(sed -n 3p "$work/out")" = "   ^        (^: a skipped step)" ] && ok "(a) the skipped step marked" ||
  bad "(a) marker line '$(sed -n 3p "$work/out")'"
grep -q "^plot: min 0.5 (step 10), max 5 (step 1), last 0.5 (step 10), 1 skipped step$" "$work/out" &&
  ok "(a) min / max / last" || bad "(a) summary: $(tail -1 "$work/out")"
for k in $(seq 1 200); do echo "{\"step\":$k,\"loss\":$((200 - k))}"; done > "$work/long.jsonl"
"$meshlm" plot "$work/long.jsonl" --out - > "$work/out" 2> "$work/err"
cols=$(sed -n 2p "$work/out" | tr -d '\n' | wc -m)
[ "$cols" -eq 72 ] && grep -q "200 points, each column the mean of its steps" "$work/out" &&
  ok "(a) 200 steps in 72 columns" || bad "(a) 200 steps: $cols columns"

# (b) a real metrics file: step lines and eval lines
"$meshlm" init --arch llama --preset tiny --seed 3 --out "$work/model" > /dev/null
head -c 2000 "$src/README.md" > "$work/text.txt"
"$meshlm" train --model "$work/model" --data "$work/text.txt" --eval-data "$work/text.txt" --seq-len 64 \
  --batch-size 2 --steps 4 --eval-every 2 --peak-tflops 1 --metrics "$work/real.jsonl" > /dev/null 2> "$work/err" ||
  bad "(b) train --metrics failed"
"$meshlm" plot "$work/real.jsonl" --field eval_loss --out - > "$work/out" 2> "$work/err" &&
  grep -q "^plot: eval_loss of $work/real.jsonl, steps 2..4 (2 points)$" "$work/out" &&
  ok "(b) --field eval_loss: the eval lines" || bad "(b) --field eval_loss: $(head -1 "$work/out")"
"$meshlm" plot "$work/real.jsonl" --field grad_norm --out - > "$work/out" 2> "$work/err" &&
  grep -q "^plot: grad_norm of $work/real.jsonl, steps 1..4 (4 points)$" "$work/out" &&
  ok "(b) --field grad_norm: the step lines" || bad "(b) --field grad_norm: $(head -1 "$work/out")"

# (c) no gnuplot on PATH: a PATH of links to everything on it but gnuplot (MPI's
# singleton start-up finds its helpers there)
mkdir "$work/bin"
IFS=: read -ra dirs <<< "$PATH"
for d in "${dirs[@]}"; do
  for f in "$d"/*; do
    b=${f##*/}
    [ -x "$f" ] && [ ! -e "$work/bin/$b" ] && [ "${b#gnuplot}" = "$b" ] && ln -s "$f" "$work/bin/$b"
  done
done
(cd "$work" && PATH=$work/bin "$meshlm" plot m.jsonl --out c.png > "$work/out" 2> "$work/err") &&
  [ ! -e "$work/c.png" ] && grep -q "^plot: gnuplot is not on PATH" "$work/out" &&
  grep -q "^█▇▆▆▅▄ ▃▂▁$" "$work/out" && ok "(c) without gnuplot: the sparkline" ||
  bad "(c) without gnuplot: $(head -3 "$work/out")"

# (d) the PNG
png_ok() { [ "$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ]; }
if command -v gnuplot > /dev/null; then
  "$meshlm" plot "$work/m.jsonl" --out "$work/loss curve's.png" > "$work/out" 2> "$work/err" &&
    png_ok "$work/loss curve's.png" && grep -q "^plot: wrote $work/loss curve's.png: loss of" "$work/out" &&
    ok "(d) PNG at --out (a quote and a space in the name)" || bad "(d) PNG at --out"
  (cd "$work" && "$meshlm" plot real.jsonl --field eval_loss > /dev/null 2> "$work/err") &&
    png_ok "$work/eval_loss.png" && ok "(d) PNG at the default FIELD.png" || bad "(d) default eval_loss.png"
  mkdir "$work/dir.png"
  ! "$meshlm" plot "$work/m.jsonl" --out "$work/dir.png" > /dev/null 2> "$work/err" &&
    grep -q "flag --out $work/dir.png: a directory" "$work/err" && ok "(d) --out a directory refused" ||
    bad "(d) --out a directory"
else
  echo "skip (d): gnuplot is not on PATH (Debian: gnuplot-nox)"
fi

# (e) errors
printf '{"step":1,"loss":2}\nnot json\n' > "$work/bad.jsonl"
printf '{"step":1,"loss":2}\n\n{"step":2,"grad_norm":1}\n' > "$work/nofield.jsonl"
: > "$work/empty.jsonl"
# refused NAME EXPECTED ARGS...: plot exits non-zero (on 2 ranks: mpiexec too), stderr matches
refused() {
  local name=$1 want=$2
  shift 2
  for launch in "" "mpiexec -n 2"; do
    if $launch "$meshlm" plot "$@" --out - > "$work/out" 2> "$work/err"; then
      bad "(e) $name${launch:+ ($launch)}: accepted"
    elif ! grep -q -- "$want" "$work/err"; then
      bad "(e) $name${launch:+ ($launch)}: no message matching '$want'"
    else
      ok "(e) $name${launch:+ ($launch)}: $(grep -o -- "$want.*" "$work/err" | head -1)"
    fi
  done
}
refused "no file" "plot: missing the metrics file"
refused "missing file" "$work/nope.jsonl: cannot open the metrics file" "$work/nope.jsonl"
refused "not JSON" "$work/bad.jsonl:2:.*invalid JSON" "$work/bad.jsonl"
refused "no field" "$work/nofield.jsonl:3: field 'loss' (--field): missing" "$work/nofield.jsonl"
refused "empty" "$work/empty.jsonl: empty" "$work/empty.jsonl"
refused "no eval lines" "$work/m.jsonl: no eval line among its 10 lines" "$work/m.jsonl" --field eval_loss
finish
