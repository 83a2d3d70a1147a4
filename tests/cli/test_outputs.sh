#!/usr/bin/env bash
# Outputs every reader accepts and figures that say what they are (issue 9):
# log-probs of a model whose weights are NaN are JSON (null, one warning);
# checkpoint tensors the model does not use are reported; the progress line
# says what MFU is taken against, and the metrics carry the peak and the
# peak RSS in MiB over the ranks (min <= max); the progress line's elapsed
# time and ETA, and the metrics' time.
# usage: test_outputs.sh MESHLM SOURCE_DIR JSON_CHECK
set -u
meshlm=$1
src=$2
json_check=$3
. "$src/tests/cli/common.sh"
# every line of FILE is one valid JSON document
jsonl_ok() { while IFS= read -r line; do "$json_check" <<<"$line" || return 1; done < "$1"; }

fx=$src/tests/fixtures/llama_tied
printf '{"input_ids": [1, 2, 3, 4, 5]}\n{"input_ids": [5, 4, 3]}\n' > "$work/data.jsonl"

# 1. NaN weights: every data byte of the fixture set to 0xff (a NaN in F32).
mkdir "$work/nan"
cp "$fx/config.json" "$work/nan/"
st=$fx/model.safetensors
hlen=$(od -An -tu8 -N8 "$st" | tr -d ' ')
size=$(stat -c %s "$st")
{ head -c $((8 + hlen)) "$st"; head -c $((size - 8 - hlen)) /dev/zero | tr '\0' '\377'; } > "$work/nan/model.safetensors"
mpiexec -n 2 "$meshlm" logprobs --model "$work/nan" --data "$work/data.jsonl" --out "$work/lp.jsonl" --tp 2 \
  > "$work/out" 2> "$work/err"
rc=$?
if [ $rc -eq 0 ] && jsonl_ok "$work/lp.jsonl" && [ "$(wc -l < "$work/lp.jsonl")" -eq 2 ] &&
   grep -q '^{"logprobs": \[null, null, null, null\]}$' "$work/lp.jsonl" &&
   [ "$(grep -c 'meshlm: warning: logprobs: 6 log-probs are not finite (NaN or inf), the first on line 1 of' "$work/err")" -eq 1 ]; then
  ok "non-finite log-probs are JSON null: $(grep warning "$work/err")"
else
  bad "non-finite log-probs (exit $rc): $(head -c 300 "$work/lp.jsonl")"
fi
"$meshlm" logprobs --model "$fx" --data "$work/data.jsonl" --out "$work/lp.jsonl" > "$work/out" 2> "$work/err"
if jsonl_ok "$work/lp.jsonl" && ! grep -q null "$work/lp.jsonl" && ! grep -q warning "$work/err"; then
  ok "finite log-probs: numbers, no warning"
else
  bad "finite log-probs"
fi

# 2. A composite checkpoint's other towers are reported, not silently ignored.
"$meshlm" logprobs --model "$src/tests/fixtures/gemma3_vlm" --data "$work/data.jsonl" --out "$work/lp.jsonl" \
  > "$work/out" 2> "$work/err"
if grep -q "meshlm: warning: .*gemma3_vlm: 23 checkpoint tensors are not used by the Gemma3ForConditionalGeneration model and ignored: multi_modal_projector.mm_input_projection_weight, " "$work/err"; then
  ok "unused tensors reported: $(cut -c 1-160 "$work/err")..."
else
  bad "unused tensors"
fi

# 3. MFU and RSS figures over 2 ranks, measured peak and given peak.
train=(train --model "$fx" --data "$work/data.jsonl" --steps 2 --batch-size 2 --seq-len 4)
mpiexec -n 2 "$meshlm" "${train[@]}" --metrics "$work/m.jsonl" > "$work/out" 2> "$work/err"
rc=$?
peak_line=$(grep -c "^train: MFU against [0-9.]* TFLOP/s measured (fp32 GEMM 1024^3, 2 ranks at once)" "$work/out")
step_line=$(grep -c "^step 2 | .* | mfu [0-9.]*% of measured peak | peak_rss [0-9.]* MiB" "$work/out")
mm=$(sed -n 2p "$work/m.jsonl" | sed -E 's/.*"peak_tflops": ?([0-9.eE+-]+), ?"peak_measured": ?true, ?"peak_rss_mib_min": ?([0-9.eE+-]+), ?"peak_rss_mib_max": ?([0-9.eE+-]+).*/\1 \2 \3/')
if [ $rc -eq 0 ] && [ "$peak_line" -eq 1 ] && [ "$step_line" -eq 1 ] && jsonl_ok "$work/m.jsonl" &&
   awk -v m="$mm" 'BEGIN { split(m, v, " "); exit !(v[1] > 0 && v[2] > 0 && v[2] <= v[3]) }'; then
  ok "measured peak: $(grep '^train: MFU' "$work/out"); metrics peak, rss min, max: $mm"
else
  bad "measured peak (exit $rc): $(cat "$work/out")"
fi
"$meshlm" "${train[@]}" --peak-tflops 2 --metrics "$work/m.jsonl" > "$work/out" 2> "$work/err"
if grep -q "^step 2 | .* | mfu [0-9.]*% of --peak-tflops | peak_rss [0-9.]* MiB | elapsed [0-9.hms]* eta 0\.0s$" "$work/out" &&
   ! grep -q "measured" "$work/out" && grep -q '"peak_tflops": *2\(\.0\)*, *"peak_measured": *false' "$work/m.jsonl"; then
  ok "given peak: $(grep '^step 2' "$work/out")"
else
  bad "given peak: $(cat "$work/out")"
fi

# 4. Elapsed time and ETA: every step line has them; the metrics' time (seconds since the
#    command started) is a real that grows from step to step.
times=$(sed -E 's/.*"time": ?([0-9.eE+-]+)}$/\1/' "$work/m.jsonl" | tr '\n' ' ')
if [ "$(grep -c "^step [12] | .* | elapsed [0-9.hms]* eta [0-9.hms]*$" "$work/out")" -eq 2 ] &&
   grep -q '^step 1 | .* eta [0-9.hms]*$' "$work/out" && grep -q '"time": *[0-9.eE+-]*}$' "$work/m.jsonl" &&
   awk -v t="$times" 'BEGIN { n = split(t, v, " "); exit !(n == 2 && v[1] > 0 && v[2] >= v[1]) }'; then
  ok "elapsed and eta: $(grep -o 'elapsed .*' "$work/out" | tr '\n' ';') metrics time: $times"
else
  bad "elapsed and eta: $(cat "$work/out"); times $times"
fi

finish
