#!/usr/bin/env bash
# Bad input through the CLI: each case must exit non-zero on every rank with
# one clear message naming the file or field, and leave no output behind.
# usage: test_bad_input.sh MESHLM SOURCE_DIR
set -u
meshlm=$1
src=$2
fx=$src/tests/fixtures/llama_tied
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
pass=0 fail=0
echo '{"input_ids": [1, 2, 3, 4, 5]}' > "$work/data.jsonl"

# expect NAME PATTERN CMD...: CMD fails, stderr matches PATTERN, no output file.
expect() {
  local name=$1 pattern=$2
  shift 2
  rm -f "$work/out.jsonl"
  local err rc
  err=$(timeout 120 "$@" 2>&1 >/dev/null)
  rc=$?
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -qE -- "$pattern" <<<"$err" && [ ! -e "$work/out.jsonl" ]; then
    pass=$((pass + 1))
    echo "ok   $name: $(grep -m1 'meshlm: error' <<<"$err")"
  else
    fail=$((fail + 1))
    echo "FAIL $name (exit $rc), stderr:"
    echo "$err" | head -5
  fi
}

# model dir NAME: a copy of the fixture to corrupt
model() {
  mkdir -p "$work/$1"
  cp "$fx/config.json" "$fx/model.safetensors" "$work/$1/"
  echo "$work/$1"
}

logprobs=("$meshlm" logprobs --data "$work/data.jsonl" --out "$work/out.jsonl" --model)

# u64 little-endian header length, then the header, then the data
safetensors() {
  local header=$1 nbytes=$2 out=$3 len
  len=${#header}
  printf "$(printf '\\x%02x' $((len & 255)) $(((len >> 8) & 255)) 0 0 0 0 0 0)" > "$out"
  printf '%s' "$header" >> "$out"
  head -c "$nbytes" /dev/zero >> "$out"
}

m=$(model truncated)
truncate -s -100 "$m/model.safetensors"
expect truncated-safetensors "model.safetensors" "${logprobs[@]}" "$m"

m=$(model header_past_eof)
printf '\xff\xff\xff\x00\x00\x00\x00\x00{}' > "$m/model.safetensors"
expect header-length-past-eof "model.safetensors" "${logprobs[@]}" "$m"

m=$(model overlap)
safetensors '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}' 12 "$m/model.safetensors"
expect overlapping-offsets "model.safetensors.*(overlap|gap)" "${logprobs[@]}" "$m"

m=$(model missing_field)
grep -v '"hidden_size"' "$fx/config.json" > "$m/config.json"
expect missing-config-field "config.json.*hidden_size" "${logprobs[@]}" "$m"

m=$(model unknown_arch)
sed 's/LlamaForCausalLM/MambaForCausalLM/' "$fx/config.json" > "$m/config.json"
expect unknown-architecture "config.json.*MambaForCausalLM.*LlamaForCausalLM" "${logprobs[@]}" "$m"

# RoPE fields (model/config.c), each named with the entry it sits in
rope() { # rope NAME FIXTURE SED: a copy of the fixture whose config.json is edited by SED
  mkdir -p "$work/$1"
  cp "$src/tests/fixtures/$2/model.safetensors" "$work/$1/"
  sed -E "$3" "$src/tests/fixtures/$2/config.json" > "$work/$1/config.json"
  echo "$work/$1"
}
m=$(rope rope_type llama_yarn 's/"rope_type": "yarn"/"rope_type": "su"/')
expect rope-unknown-type "config.json: field 'rope_parameters.rope_type': unsupported rope type 'su'" \
  "${logprobs[@]}" "$m"
m=$(rope yarn_attention llama_yarn 's/"beta_fast": 8.0/"attention_factor": -1.0, "beta_fast": 8.0/')
expect rope-yarn-attention-factor "config.json: field 'rope_parameters.attention_factor': expected a positive number or null, found -1" \
  "${logprobs[@]}" "$m"
m=$(rope partial llama_yarn 's/"rope_type": "yarn"/"rope_type": "yarn", "partial_rotary_factor": 0.5/')
expect rope-partial-rotary "config.json: field 'rope_parameters.partial_rotary_factor': meshlm rotates whole heads; expected 1.0, found 0.5" \
  "${logprobs[@]}" "$m"
m=$(rope short_factor llama_longrope 's/"short_factor": \[/"short_factor": [1.0, /')
expect rope-longrope-factors "config.json: field 'rope_parameters.short_factor': expected a list of 8 numbers \(head_dim / 2\)" \
  "${logprobs[@]}" "$m"
m=$(rope dynamic_factor llama_dynamic 's/"factor": 2.0/"factor": "2"/')
expect rope-dynamic-factor "config.json: field 'rope_parameters.factor': expected a number, found \"2\"" \
  "${logprobs[@]}" "$m"

m=$(model wrong_shape)
sed 's/"intermediate_size": 160/"intermediate_size": 128/' "$fx/config.json" > "$m/config.json"
expect tensor-shape-mismatch "gate_proj.weight.*shape" "${logprobs[@]}" "$m"
# a 1-D tensor of another size: input_layernorm.weight as F16 [128] (the same 256 bytes; the
# header stays 2056 bytes, one of its padding spaces taken), named with both shapes
m=$(model wrong_shape_1d)
perl -0777 -pi -e 's/("model\.layers\.0\.input_layernorm\.weight":\{"dtype":")F32(","shape":\[)64\]/${1}F16${2}128]/ or die; s/\}\}   /}}  / or die' \
  "$m/model.safetensors"
expect tensor-shape-mismatch-1d "input_layernorm.weight' has shape \[128\]; expected \[64\] from config.json" \
  "${logprobs[@]}" "$m"

expect tp-above-heads "tp=5 exceeds num_attention_heads=4" \
  mpiexec -n 5 "$meshlm" logprobs --model "$fx" --data "$work/data.jsonl" --out "$work/out.jsonl" --tp 5
expect world-not-divisible-by-tp "world size 3 is not divisible" \
  mpiexec -n 3 "$meshlm" logprobs --model "$fx" --data "$work/data.jsonl" --out "$work/out.jsonl" --tp 2

echo '{"input_ids": [1, 2, 999]}' > "$work/bad_ids.jsonl"
expect token-id-out-of-range "bad_ids.jsonl:1.*999" \
  "$meshlm" logprobs --model "$fx" --data "$work/bad_ids.jsonl" --out "$work/out.jsonl"
expect unknown-flag "--bogus" "$meshlm" train --model "$fx" --data "$work/data.jsonl" --bogus 1

# meshlm train settings: flags, config file, combinations
train=("$meshlm" train --model "$fx" --data "$work/data.jsonl" --steps 1 --seq-len 8)
expect bad-dtype "--param-dtype: expected one of fp32, bf16, found 'fp16'" "${train[@]}" --param-dtype fp16
expect bad-device "--device: expected one of cpu, cuda, found 'tpu'" "${train[@]}" --device tpu
# without a GPU (CI) --device cuda is refused on every rank with the reason; with one it runs
if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
  expect cuda-without-gpu "train: flag --device cuda: .*device 'cuda': (no CUDA GPU is visible|this build has no CUDA backend)" \
    mpirun -np 2 "${train[@]}" --device cuda
  expect logprobs-cuda-without-gpu "logprobs: flag --device cuda: .*device 'cuda'" \
    "$meshlm" logprobs --model "$fx" --data "$work/data.jsonl" --out "$work/out.jsonl" --device cuda
fi
expect bad-schedule "--lr-schedule: expected one of constant, linear, cosine, found 'step'" "${train[@]}" --lr-schedule step
expect bad-norm-type "--grad-norm-type: expected one of 2, inf, found '1'" "${train[@]}" --grad-norm-type 1
expect bad-zero "--zero: expected an integer in \[1, 3\], found 0" "${train[@]}" --zero 0
expect cp-zero "--cp: expected an integer in \[1, 2147483647\], found 0" "${train[@]}" --cp 0
expect cp-not-dividing "world size 2 is not divisible by dp_replicate\(1\) x cp\(4\) x tp\(1\) = 4" \
  mpiexec -n 2 "${train[@]}" --cp 4
expect cpu-offload-value "flag --cpu-offload takes no value or =true / =false, found 'maybe'" \
  mpiexec -n 2 "${train[@]}" --cpu-offload=maybe
echo '{"cpu_offload": "yes"}' > "$work/offload.json"
expect config-cpu-offload-type "offload.json: key 'cpu_offload': expected a boolean, found a string" \
  mpiexec -n 2 "${train[@]}" --config "$work/offload.json"
expect grad-accum-not-dividing "--batch-size 6 is not divisible by --grad-accum 4" \
  "${train[@]}" --batch-size 6 --grad-accum 4
expect grad-accum-times-dp-not-dividing "--batch-size 4 is not divisible by the data-parallel size 2 x --grad-accum 4 = 8" \
  mpiexec -n 2 "${train[@]}" --batch-size 4 --grad-accum 4
expect save-every-without-save "--save-every 2 needs --save" "${train[@]}" --save-every 2
echo '{"model": "m", "tensor_parallel": 2}' > "$work/unknown_key.json"
expect config-unknown-key "unknown_key.json: unknown key 'tensor_parallel'; accepted keys: model, data, tensor_parallel_size" \
  "$meshlm" train --config "$work/unknown_key.json"
echo '{"grad_accum": "2"}' > "$work/wrong_type.json"
expect config-wrong-type "wrong_type.json: key 'grad_accum': expected an integer, found a string" \
  "${train[@]}" --config "$work/wrong_type.json"
echo '{"param_dtype": "fp8"}' > "$work/bad_value.json"
expect config-bad-value "bad_value.json: key 'param_dtype': expected one of fp32, bf16, found \"fp8\"" \
  "${train[@]}" --config "$work/bad_value.json"
expect config-missing "missing.json: cannot open" "${train[@]}" --config "$work/missing.json"
"${train[@]}" --batch-size 1 --save "$work/ck" > /dev/null 2>&1
expect resume-other-seed "--resume .*ck: the checkpoint was trained with --seed 0 on 1 sequences, this run has --seed 7" \
  "${train[@]}" --batch-size 1 --resume "$work/ck" --seed 7
mkdir -p "$work/empty_ck"
expect resume-no-checkpoint "empty_ck" "${train[@]}" --batch-size 1 --resume "$work/empty_ck"
expect unknown-command "unknown command" "$meshlm" fly

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
