#!/usr/bin/env bash
# Mixture-of-experts families end to end (model/moe.h): `meshlm init --arch
# qwen3_moe|mixtral|qwen2_moe` writes a model that trains and exports with the same tensor names and
# config keys, also under expert parallelism (--ep, whose export equals one rank's byte for byte at
# learning rate 0); `meshlm plan --ep` shows the experts per rank and the balanced all-to-all bytes
# (under tp each tp rank dispatching its chunk of the tokens); expert layers under sequence
# parallelism, a plan sharding a router or an expert, --ep (config ep_size) not dividing the world
# or num_experts or on a model without experts, and MoE configs meshlm does not implement or cannot
# bound, are refused with one message naming what was found and what is expected; `meshlm logprobs
# --routing` writes each token's experts per layer, the same on any dp mesh.
# usage: test_moe.sh MESHLM SOURCE_DIR JSON_CHECK ...
set -u
meshlm=$1
src=$2
json_check=$3
. "$src/tests/cli/common.sh"

# expect_fail NAME PATTERN -- CMD...: CMD exits non-zero and its stderr matches PATTERN.
expect_fail() {
  local name=$1 pat=$2
  shift 3
  if "$@" > "$work/out" 2> "$work/err"; then
    bad "$name (exit 0)"
  elif grep -q -- "$pat" "$work/err"; then
    ok "$name"
  else
    bad "$name (message)"
  fi
}

awk 'BEGIN { srand(1); for (r = 0; r < 8; r++) { s = "";
  for (i = 0; i < 24; i++) s = s (i ? "," : "") int(rand() * 250); print "{\"input_ids\": [" s "]}" } }' \
  > "$work/data.jsonl"

for arch in qwen3_moe mixtral qwen2_moe; do
  if "$meshlm" init --out "$work/$arch" --arch "$arch" --preset tiny > "$work/out" 2> "$work/err" &&
     grep -q -E '"num_(local_)?experts": 4' "$work/$arch/config.json" &&
     grep -q '"num_experts_per_tok": 2' "$work/$arch/config.json"; then
    ok "init --arch $arch"
  else
    bad "init --arch $arch"
  fi
  # two steps on dp_shard 2, exported: the same tensors (names, dtypes, shapes) as init wrote,
  # every one of them updated by the steps (its bytes changed)
  if mpiexec -n 2 "$meshlm" train --model "$work/$arch" --data "$work/data.jsonl" --steps 2 \
       --batch-size 4 --seq-len 24 --export-hf "$work/$arch-hf" > "$work/out" 2> "$work/err" &&
     "$5" "$work/$arch" > "$work/a.lst" && "$5" "$work/$arch-hf" > "$work/b.lst" &&
     cmp -s <(cut -d' ' -f1-3 "$work/a.lst") <(cut -d' ' -f1-3 "$work/b.lst") &&
     [ -z "$(join <(cut -d' ' -f1,4 "$work/a.lst") <(cut -d' ' -f1,4 "$work/b.lst") |
             awk '$2 == $3')" ]; then
    ok "$arch: train on dp_shard 2, export"
  else
    bad "$arch: train on dp_shard 2, export"
  fi
  # the same under expert parallelism (--ep 2): the first step's loss as without it (the
  # numbers agree to the printed digits: tests/mpi/test_parity.c bounds them)
  if mpiexec -n 2 "$meshlm" train --model "$work/$arch" --data "$work/data.jsonl" --steps 2 \
       --batch-size 4 --seq-len 24 --ep 2 --export-hf "$work/$arch-ep" > "$work/out-ep" \
       2> "$work/err" &&
     "$5" "$work/$arch-ep" > "$work/c.lst" &&
     cmp -s <(cut -d' ' -f1-3 "$work/a.lst") <(cut -d' ' -f1-3 "$work/c.lst") &&
     loss=$(grep -m1 -o 'loss [0-9.]*' "$work/out") && [ -n "$loss" ] &&
     [ "$loss" = "$(grep -m1 -o 'loss [0-9.]*' "$work/out-ep")" ] &&
     grep -q 'ep all_to_all x[1-9]' "$work/out-ep"
  then
    ok "$arch: train with --ep 2, export"
  else
    bad "$arch: train with --ep 2, export"
  fi
  # the export assembles each expert from the ep rank holding it (parallel/ep.h): after a step
  # at learning rate 0 (the parameters stay as loaded, bitwise) --ep 2 writes one rank's bytes
  if mpiexec -n 2 "$meshlm" train --model "$work/$arch" --data "$work/data.jsonl" --steps 1 \
       --batch-size 4 --seq-len 24 --lr 0 --ep 2 --export-hf "$work/$arch-ep0" > "$work/out" \
       2> "$work/err" &&
     "$meshlm" train --model "$work/$arch" --data "$work/data.jsonl" --steps 1 \
       --batch-size 4 --seq-len 24 --lr 0 --export-hf "$work/$arch-one0" > "$work/out" \
       2> "$work/err" &&
     cmp -s "$work/$arch-ep0/model.safetensors" "$work/$arch-one0/model.safetensors"; then
    ok "$arch: --ep 2 export = one rank's export, byte for byte"
  else
    bad "$arch: --ep 2 export = one rank's export, byte for byte"
  fi
done

fx=$src/tests/fixtures/mixtral
expect_fail "tp 2 with sequence parallelism refused" "--sequence-parallel with tp = 2: MixtralForCausalLM has expert layers, which take a Replicate() residual stream under tp" -- \
  mpiexec -n 2 "$meshlm" logprobs --model "$fx" --data "$work/data.jsonl" --out "$work/lp.jsonl" \
  --tp 2 --sequence-parallel
echo '{"model.layers.*.block_sparse_moe.experts.*.w1": "colwise"}' > "$work/expert_plan.json"
expect_fail "a plan sharding an expert refused" "plan: 'model.layers.0.block_sparse_moe.experts.0.w1' (colwise) is part of a mixture-of-experts block, which is replicated over tp" -- \
  "$meshlm" plan --model "$fx" --tp 2 --parallel-plan "$work/expert_plan.json"
echo '{"model.layers.*.block_sparse_moe.gate": "rowwise"}' > "$work/router_plan.json"
expect_fail "a plan sharding the router refused" "plan: 'model.layers.0.block_sparse_moe.gate' (rowwise) is part of a mixture-of-experts block" -- \
  "$meshlm" plan --model "$fx" --tp 2 --parallel-plan "$work/router_plan.json"

"$meshlm" init --out "$work/llama" --arch llama --preset tiny > "$work/out" 2>&1
train_ep() { # RANKS MODEL FLAGS...: one step of a train run
  local n=$1 model=$2
  shift 2
  mpiexec -n "$n" "$meshlm" train --model "$model" --data "$work/data.jsonl" --steps 1 \
    --batch-size 6 --seq-len 24 "$@"
}
expect_fail "ep not dividing the world" "--ep (ep_size) 3: dp_replicate(1) x dp_shard(2) x cp(1) x tp(1) = 2 ranks is not a multiple of it" -- \
  train_ep 2 "$fx" --ep 3
echo '{"ep_size": 3}' > "$work/ep.json"
expect_fail "config ep_size 3 of 4 experts" "--ep (ep_size) 3: MixtralForCausalLM has 4 experts per layer, not a multiple of it" -- \
  train_ep 3 "$fx" --config "$work/ep.json"
expect_fail "ep without experts" "--ep (ep_size) 2: LlamaForCausalLM has no mixture-of-experts layers" -- \
  train_ep 2 "$work/llama" --ep 2

# plan (the meta backend models a balanced routing, model/moe.h): qwen3_moe (8 experts, top 2,
# hidden 32, 2 sparse layers), dp_shard 2, ep 2, 24 tokens per rank: each rank dispatches its
# 24 x 2 rows and its 4 experts get half of both ranks' rows (48), so per sparse layer forward
# and backward each move (48 + 48) x 32 fp32 = 12 KiB, and the step's 8 all-to-alls 49152 B
if "$meshlm" plan --model "$src/tests/fixtures/qwen3_moe" --seq-len 24 --batch-size 2 \
     --dp-shard 2 --ep 2 > "$work/plan" 2> "$work/err" &&
   grep -q "experts: 8 per sparse layer (2 of 3 layers), top 2; 4 computed per rank (ep 2)" \
     "$work/plan" &&
   grep -q "forward 12.00 KiB, backward 12.00 KiB; balanced routing" "$work/plan" &&
   grep -Eq "ep +all_to_all +8 calls +49152 B" "$work/plan"; then
  ok "plan --ep 2: experts per rank, balanced all-to-all bytes"
else
  bad "plan --ep 2: experts per rank, balanced all-to-all bytes"
fi
# the same with the ep group spanning tp 2 (model/moe.h): each tp rank dispatches its chunk of
# its 48 tokens, 24 x 2 rows, and its 4 experts get half of both ranks' rows (48): the same
# 12 KiB per sparse layer each way; the output and the input gradient of each sparse layer
# all-gathered over tp, 2 x 24 x 32 fp32 = 6 KiB each, 4 in the step
if "$meshlm" plan --model "$src/tests/fixtures/qwen3_moe" --seq-len 24 --batch-size 2 \
     --tp 2 --ep 2 > "$work/plan" 2> "$work/err" &&
   grep -q "24 token rows x top 2 per rank, each tp rank its chunk of the tokens): forward 12.00 KiB, backward 12.00 KiB" "$work/plan" &&
   grep -Eq "ep +all_to_all +8 calls +49152 B" "$work/plan" &&
   grep -Eq "tp +all_gather +4 calls +24576 B" "$work/plan"; then
  ok "plan --tp 2 --ep 2: each tp rank's chunk dispatched, all-gathered over tp"
else
  bad "plan --tp 2 --ep 2: each tp rank's chunk dispatched, all-gathered over tp"
fi
# qwen2_moe (1 sparse layer of 8 experts, a shared expert of 24 features): the shared expert
# named, and the all-to-all bytes those of the routed experts alone (4 calls, 24576 B)
if "$meshlm" plan --model "$src/tests/fixtures/qwen2_moe" --seq-len 24 --batch-size 2 \
     --dp-shard 2 --ep 2 > "$work/plan" 2> "$work/err" &&
   grep -q "a shared expert of 24 features per sparse layer, gated by sigmoid(shared_expert_gate)" \
     "$work/plan" &&
   grep -Eq "ep +all_to_all +4 calls +24576 B" "$work/plan"; then
  ok "plan --ep 2: the shared expert"
else
  bad "plan --ep 2: the shared expert"
fi
expect_fail "plan ep not dividing experts" "--ep (ep_size) 3" -- \
  "$meshlm" plan --model "$fx" --seq-len 24 --batch-size 3 --dp-shard 3 --ep 3

# logprobs --routing on qwen3_moe (3 layers, layer 0 dense, 8 experts, top 2): per line S tokens
# (one more than the log-probs), each with 3 layers of 2 experts, [-1, -1] at layer 0 and two
# distinct experts in 0 .. 7 at the others; under --batch-invariant (every router logit the same
# bits in any batch) the routing and log-probs at dp 2 with other micro-batches are the 1-rank
# run's, byte for byte; on a model without experts the flag is refused, named.
qm=$src/tests/fixtures/qwen3_moe
if "$meshlm" logprobs --model "$qm" --data "$work/data.jsonl" --out "$work/r1.jsonl" --routing \
     --batch-invariant > "$work/out" 2> "$work/err" &&
   mpiexec -n 2 "$meshlm" logprobs --model "$qm" --data "$work/data.jsonl" --out "$work/r2.jsonl" \
     --routing --batch-invariant --micro-batch-tokens 30 > "$work/out" 2> "$work/err" &&
   cmp -s "$work/r1.jsonl" "$work/r2.jsonl"; then
  ok "logprobs --routing: dp 2 = 1 rank"
else
  bad "logprobs --routing: dp 2 = 1 rank"
fi
msg=$(while IFS= read -r line; do
        "$json_check" logprobs routing <<<"$line" > /dev/null 2>&1 || { echo "not JSON"; break; }
        printf '%s|%s\n' "$(sed -E 's/.*"logprobs": \[([^]]*)\].*/\1/' <<<"$line")" \
          "$(sed -E 's/.*"routing": \[\[\[(.*)\]\]\]\}$/\1/' <<<"$line")"
      done < "$work/r1.jsonl" |
  awk -F'|' '$0 == "not JSON" { print; exit }
    { n = split($1, lp, ","); m = split($2, tok, /\]\], *\[\[/);
      if (m != n + 1) { print "line " NR ": " m " tokens for " n " log-probs"; exit }
      for (t = 1; t <= m; t++) {
        if (split(tok[t], lay, /\], *\[/) != 3) { print "line " NR ": not 3 layers"; exit }
        for (l = 1; l <= 3; l++) {
          if (split(lay[l], e, ",") != 2) { print "line " NR ": not 2 experts"; exit }
          if (l == 1 && (e[1] != -1 || e[2] != -1)) { print "line " NR ": dense layer " lay[l]; exit }
          if (l > 1 && (e[1] < 0 || e[1] > 7 || e[2] < 0 || e[2] > 7 || e[1] == e[2])) {
            print "line " NR ": experts " lay[l]; exit } } } }')
if [ -z "$msg" ] && [ -s "$work/r1.jsonl" ]; then
  ok "logprobs --routing: S tokens x 3 layers x 2 experts, -1 at the dense layer"
else
  bad "logprobs --routing: $msg"
fi
expect_fail "--routing without experts" "flag --routing: LlamaForCausalLM has no experts" -- \
  "$meshlm" logprobs --model "$work/llama" --data "$work/data.jsonl" --out "$work/lp.jsonl" \
  --routing

# config.json fields out of range, each named
bad_config() { # NAME PATTERN SED-EXPRESSION
  rm -rf "$work/bad" && cp -r "$src/tests/fixtures/qwen3_moe" "$work/bad"
  sed -i "$3" "$work/bad/config.json"
  expect_fail "$1" "$2" -- "$meshlm" logprobs --model "$work/bad" --data "$work/data.jsonl" \
    --out "$work/lp.jsonl"
}
bad_config "top-k above the experts" "field 'num_experts_per_tok': 9 experts per token" \
  's/"num_experts_per_tok": 2/"num_experts_per_tok": 9/'
bad_config "mlp_only_layers index" "field 'mlp_only_layers\[0\]': expected a layer index from 0 to 2" \
  's/^    0$/    7/'
bad_config "router jitter" "field 'router_jitter_noise'" \
  's/"rms_norm_eps"/"router_jitter_noise": 0.01, "rms_norm_eps"/'
bad_config "experts above the limit" "field 'num_local_experts': expected an integer from 1 to 4096" \
  's/"num_local_experts": 8/"num_local_experts": 5000/'
finish
