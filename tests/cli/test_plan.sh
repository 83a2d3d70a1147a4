#!/usr/bin/env bash
# meshlm plan end to end, one process without mpirun: the text and JSON
# reports on llama_tied and qwen2 at tp 2 with and without sequence
# parallelism (from config.json alone: no weights are read), the summary
# first and identical layers collapsed (smollm2-135m), and plan errors
# that must exit non-zero with one clear message, as `meshlm train` would.
# usage: test_plan.sh MESHLM SOURCE_DIR JSON_CHECK
set -u
meshlm=$1
src=$2
json_check=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
pass=0 fail=0

ok() {
  pass=$((pass + 1))
  echo "ok   $1"
}
bad() {
  fail=$((fail + 1))
  echo "FAIL $1"
  [ -n "${2:-}" ] && echo "$2" | head -20
}

# config-only copies of the fixtures: plan must not need the safetensors
for fx in llama_tied qwen2; do
  mkdir -p "$work/$fx"
  cp "$src/tests/fixtures/$fx/config.json" "$work/$fx/"
done

# expect_ok NAME PATTERN... -- CMD...: CMD succeeds, stdout matches every PATTERN.
expect_ok() {
  local name=$1
  shift
  local pats=()
  while [ "$1" != "--" ]; do
    pats+=("$1")
    shift
  done
  shift
  local out rc
  out=$(timeout 120 "$@" 2>"$work/err")
  rc=$?
  if [ $rc -ne 0 ]; then
    bad "$name (exit $rc)" "$(cat "$work/err")"
    return
  fi
  for p in "${pats[@]}"; do
    if ! grep -qE -- "$p" <<<"$out"; then
      bad "$name: output lacks /$p/" "$out"
      return
    fi
  done
  ok "$name"
}

# expect_json NAME CMD...: CMD succeeds and prints one valid JSON document
# with the report's fields.
expect_json() {
  local name=$1
  shift
  local rc
  timeout 120 "$@" >"$work/out.json" 2>"$work/err"
  rc=$?
  if [ $rc -ne 0 ]; then
    bad "$name (exit $rc)" "$(cat "$work/err")"
  elif ! "$json_check" model.family mesh.world plan.name plan.reason residual logits modules edges \
      per_tp_rank <"$work/out.json" 2>"$work/err"; then
    bad "$name: not the JSON report" "$(cat "$work/err")"
  else
    ok "$name"
  fi
}

# expect_err NAME PATTERN CMD...: CMD fails, and stderr holds exactly one
# "meshlm: error:" line, matching PATTERN.
expect_err() {
  local name=$1 pattern=$2
  shift 2
  local err rc n
  err=$(timeout 120 "$@" 2>&1 >/dev/null)
  rc=$?
  n=$(grep -c 'meshlm: error:' <<<"$err")
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$n" -eq 1 ] && grep -qE -- "$pattern" <<<"$err"; then
    ok "$name: $(grep -m1 'meshlm: error' <<<"$err")"
  else
    bad "$name (exit $rc, $n error lines)" "$err"
  fi
}

# ---- reports ----------------------------------------------------------------

for fx in llama_tied qwen2; do
  m=$work/$fx
  expect_ok "$fx tp2" "^plan .*-optimized" "residual stream Replicate\(\)" "logits Shard\(-1\)" \
    "embed_tokens \(Embedding\)" "Shard\(0\): tp0 \[" "tp +all_reduce" \
    "memory per rank" -- \
    "$meshlm" plan --model "$m" --tp 2
  expect_ok "$fx tp2 sp" "^plan .*-optimized-sp" "residual stream Shard\(1\)" "SequenceParallel" \
    "grad Partial" "tp +all_gather" "tp +reduce_scatter" -- \
    "$meshlm" plan --model "$m" --tp 2 --sequence-parallel
  expect_ok "$fx dp2 x tp2 sp" "dp_shard 2 x cp 1 x tp 2 = world 4" "dp_shard_cp +all_gather" \
    "dp_shard_cp +reduce_scatter" -- \
    "$meshlm" plan --model "$m" --tp 2 --dp-shard 2 --sequence-parallel --batch-size 4 --seq-len 16
  # train's step flags: activation checkpointing and bf16 parameters change the step
  expect_ok "$fx dp2 x tp2 ac layer bf16" "peak of one training step" "dp_shard_cp +all_gather" -- \
    "$meshlm" plan --model "$m" --tp 2 --dp-shard 2 --activation-checkpointing layer \
    --param-dtype bf16 --batch-size 4 --seq-len 16
  # context parallelism: 15 tokens padded to 16 = 4 chunks of 4, ring attention's passes
  expect_ok "$fx cp2 x tp2" "dp_shard 1 x cp 2 x tp 2 = world 4" \
    "padded to 16 positions \(1 masked at the end\), cut into 4 chunks of 4" \
    "ring attention per layer and micro-batch \(cp send_recv\): forward 1 passes \(K/V\)" \
    "cp +send_recv" "dp_shard_cp +reduce_scatter" -- \
    "$meshlm" plan --model "$m" --tp 2 --cp 2 --batch-size 2 --seq-len 15
  expect_json "$fx cp2 --json" "$meshlm" plan --model "$m" --cp 2 --seq-len 15 --json
  expect_json "$fx tp2 --json" "$meshlm" plan --model "$m" --tp 2 --json
  expect_json "$fx tp2 sp --json" "$meshlm" plan --model "$m" --tp 2 --sequence-parallel --json
done
# --cpu-offload: the shards leave the device rows for the host memory line
expect_ok "llama_tied dp2 cpu-offload" \
  "in use once train opens \(FSDP buffers, persistent params, a micro-batch\)" \
  "in use once logprobs opens \(FSDP buffers, persistent params\)" \
  "host memory per rank \(--cpu-offload\)" "FSDP shards: params, grads, AdamW" -- \
  "$meshlm" plan --model "$work/llama_tied" --dp-shard 2 --batch-size 2 --cpu-offload
# qwen2's vocab 301 splits unevenly over 2 ranks (torch.chunk: 151 + 150)
expect_ok "qwen2 uneven vocab shards" "tp0 \[151, 64\] tp1 \[150, 64\]" "^tp rank 1:$" -- \
  "$meshlm" plan --model "$work/qwen2" --tp 2 --dp-shard 2 --batch-size 2
expect_err cp-zero "--cp: expected an integer in \[1, 2147483647\], found 0" \
  "$meshlm" plan --model "$work/llama_tied" --cp 0
expect_ok "one rank" "world 1 ranks" "none \(one rank\)" -- "$meshlm" plan --model "$work/llama_tied"

# smollm2-135m's shape (30 identical layers) on dp_shard 2 x tp 3: the summary (mesh,
# collectives, memory) first, the layers 1-29 one line each in the modules and the edges
# (1,230 lines before they were collapsed), every layer with --verbose, the same JSON either way
if "$meshlm" init --arch llama --preset smollm2-135m --out "$work/smol" >/dev/null 2>"$work/err"; then
  rm -f "$work/smol"/*.safetensors
  smol=("$meshlm" plan --model "$work/smol" --tp 3 --dp-shard 2)
  "${smol[@]}" >"$work/smol.txt" 2>"$work/err"
  rc=$?
  lines=$(wc -l <"$work/smol.txt")
  at() { grep -n -m1 -E -- "$1" "$work/smol.txt" | cut -d: -f1; }
  if [ $rc -eq 0 ] && [ "$lines" -lt 150 ] &&
     [ "$(grep -c '^  model.layers.1-29: same as model.layers.0$' "$work/smol.txt")" -eq 2 ] &&
     [ "$(at '^plan: ')" -eq 1 ] && [ "$(at '^mesh: dp_replicate 1 x dp_shard 2 x cp 1 x tp 3')" -eq 2 ] &&
     [ "$(at 'peak of one training step')" -lt "$(at '^rules ')" ] &&
     [ "$(at '^rules ')" -lt "$(at '^modules ')" ] && [ "$(at '^modules ')" -lt "$(at '^activation edges')" ] &&
     [ "$(at 'model.layers.0.mlp.down_proj \(Linear\)')" -lt "$(at 'model.layers.1-29: same')" ] &&
     ! grep -q 'model.layers.29' "$work/smol.txt"; then
    ok "smollm2-135m dp2 x tp3: $lines lines, the summary first, layers 1-29 collapsed"
  else
    bad "smollm2-135m dp2 x tp3 (exit $rc, $lines lines)" "$(head -40 "$work/smol.txt"; cat "$work/err")"
  fi
  "${smol[@]}" --verbose >"$work/smol_v.txt" 2>"$work/err"
  rc=$?
  if [ $rc -eq 0 ] && ! grep -q 'same as' "$work/smol_v.txt" &&
     grep -q '^  model.layers.29.mlp.down_proj (Linear): RowwiseParallel' "$work/smol_v.txt" &&
     grep -q '^  model.layers.29.mlp.down_proj output \[C=576\]$' "$work/smol_v.txt"; then
    ok "smollm2-135m --verbose: every layer, $(wc -l <"$work/smol_v.txt") lines"
  else
    bad "smollm2-135m --verbose (exit $rc)" "$(cat "$work/err")"
  fi
  "${smol[@]}" --json >"$work/smol.json" 2>"$work/err" &&
    "${smol[@]}" --json --verbose >"$work/smol_v.json" 2>>"$work/err"
  rc=$?
  if [ $rc -eq 0 ] && cmp -s "$work/smol.json" "$work/smol_v.json" &&
     [ "$(grep -c '"name": "model.layers.29.mlp.down_proj output"' "$work/smol.json")" -eq 1 ]; then
    ok "smollm2-135m --json: every layer, --verbose or not"
  else
    bad "smollm2-135m --json (exit $rc)" "$(cat "$work/err")"
  fi
else
  bad "init --preset smollm2-135m" "$(cat "$work/err")"
fi

# ---- errors -------------------------------------------------------------------

m=$work/llama_tied
echo '{"model.layers.*.self_attn.q_proj": "colwize"}' >"$work/unknown_style.json"
expect_err unknown-style "unknown parallel style 'colwize'.*colwise.*rowwise" \
  "$meshlm" plan --model "$m" --tp 2 --parallel-plan "$work/unknown_style.json"
echo '{"model.layers.*.self_attn.qkv_proj": "colwise"}' >"$work/no_match.json"
expect_err pattern-matches-nothing "pattern 'model.layers.\*.self_attn.qkv_proj' matches no module" \
  "$meshlm" plan --model "$m" --tp 2 --parallel-plan "$work/no_match.json"
echo '{"model.norm": "colwise"}' >"$work/colwise_norm.json"
expect_err colwise-on-norm "cannot apply to module 'model.norm'" \
  "$meshlm" plan --model "$m" --tp 2 --parallel-plan "$work/colwise_norm.json"
# a config with an HF base_model_tp_plan: plannable, but without an SP variant
mkdir -p "$work/hf"
sed '0,/{/s//{\n  "base_model_tp_plan": {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise", "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise", "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"},/' \
  "$src/tests/fixtures/llama_tied/config.json" >"$work/hf/config.json"
expect_ok "hf plan" "^plan hf" -- "$meshlm" plan --model "$work/hf" --tp 2 --parallel-plan hf
expect_err sp-with-hf-plan "--sequence-parallel: the HF base_model_tp_plan has no sequence-parallel" \
  "$meshlm" plan --model "$work/hf" --tp 2 --parallel-plan hf --sequence-parallel
# config.json without one: the config class's (Phi-3's names its fused modules, which
# apply to their parts: q/k/v gathered, o_proj split; the optimized plan shards heads)
expect_ok "phi3 class hf plan" "^plan hf-phi3-base_model_tp_plan" \
  "layers.0.self_attn.q_proj .Linear.: colwise_gather_output" \
  "layers.0.mlp.up_proj .Linear.: colwise_gather_output" \
  -- "$meshlm" plan --model "$src/tests/fixtures/phi3" --tp 2 --seq-len 64 --parallel-plan hf
expect_ok "phi3 optimized plan" "^plan phi3-optimized" \
  "layers.0.self_attn.q_proj .Linear.: ColwiseParallel" \
  -- "$meshlm" plan --model "$src/tests/fixtures/phi3" --tp 2 --seq-len 64
expect_err batch-not-divisible "--batch-size 3 is not divisible by the data-parallel size 2" \
  "$meshlm" plan --model "$m" --dp-shard 2 --batch-size 3
expect_err tp-above-heads "tp=8 exceeds num_attention_heads=4" \
  "$meshlm" plan --model "$m" --tp 8
# 4 query heads / 2 kv heads on tp 4: one query head each, each kv head held by two ranks
expect_ok "heads over tp 4" "tp3: query heads 3-3 .1., kv heads 1-1 .1., 1 of them copies" -- \
  "$meshlm" plan --model "$m" --tp 4
expect_err missing-config "config.json" "$meshlm" plan --model "$work/nowhere" --tp 2
expect_err unknown-flag "--pipeline" "$meshlm" plan --model "$m" --pipeline 2

echo "test_plan: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
