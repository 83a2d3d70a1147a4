#!/usr/bin/env bash
# LoRA from the command line (engine/lora.h), on the tiny llama preset (untied, 2 layers):
#  (a) --lora-rank trains the adapters only: --export-hf writes a PEFT adapter directory
#      (adapter_config.json with PEFT's fields, adapter_model.safetensors with PEFT's key names:
#      lora_A [r, in] and lora_B [out, r] of every targeted linear, nothing else), and the same
#      run with --merge-lora writes an HF checkpoint whose non-adapted tensors are the initial
#      weights bitwise and whose adapted ones moved; on 1 rank, dp_shard 2 and tp 2;
#  (b) the exported adapter loaded back (--adapter) scores as the merged export within the
#      bound of two fp32 evaluations with adapters (tol_bound lora-pair:4), and trains on;
#  (c) a run checkpoint resumes bit-exact (the losses of steps 3-4 of a 4-step run equal a 2-step
#      run resumed for 2 more), and `meshlm export` of it is refused naming an adapter; the
#      collectives of a LoRA step equal `meshlm plan`'s, the reduce-scatter moving fewer bytes
#      than full fine-tuning's (the adapters only: the units' trainable prefix), also from an
#      exported adapter (--adapter) and with --lora-dropout and --lora-rslora; activation
#      checkpointing and CPU offload leave the losses bitwise;
#  (d) config keys lora_targets (a JSON list) and lora_use_rslora equal the flags;
#  (e) errors: --lora-dropout 1, an unknown target, --merge-lora without LoRA;
#  (f) --lora-dropout 0.1 trains (its second step's loss differs from p = 0's: lora_B starts at
#      0, so the first step's loss cannot) and the PEFT export records lora_dropout 0.1.
# usage: test_lora.sh MESHLM SOURCE_DIR JSON_CHECK TOL_BOUND ST_LIST
set -u
meshlm=$1
src=$2
json_check=$3
st_list=$5
. "$src/tests/cli/common.sh"

"$meshlm" init --arch llama --preset tiny --seed 3 --out "$work/model" > /dev/null || exit 1
"$st_list" "$work/model" > "$work/init.txt" || exit 1
base=(train --model "$work/model" --data "$src/README.md" --seq-len 32 --batch-size 4 --lr 1e-2
  --max-grad-norm 0 --peak-tflops 1 --lora-rank 4 --lora-alpha 16
  --lora-targets q_proj,v_proj,down_proj)
launch() {
  local np=$1
  shift
  if [ "$np" -eq 1 ]; then "$meshlm" "$@"; else mpiexec -n "$np" "$meshlm" "$@"; fi
}
losses() { sed -E 's/.*"loss":([^,]+),.*/\1/' "$1"; }

# (a) the PEFT adapter and the merged export
for run in 1 2 tp2; do # tp2: 2 ranks, --tp 2 (the LoRA-aware TP placements)
  np=${run#tp}
  tpa=()
  [ "$run" = tp2 ] && tpa=(--tp 2)
  if launch "$np" "${base[@]}" "${tpa[@]}" --steps 2 --export-hf "$work/ad$run" > /dev/null 2> "$work/err" &&
    launch "$np" "${base[@]}" "${tpa[@]}" --steps 2 --export-hf "$work/mg$run" --merge-lora > /dev/null \
      2> "$work/err"; then
    ok "$run: LoRA runs export"
  else
    bad "$run: LoRA runs export"
    continue
  fi
  mkdir -p "$work/ls$run" # st_list reads model.safetensors
  ln -sf "$work/ad$run/adapter_model.safetensors" "$work/ls$run/model.safetensors"
  "$st_list" "$work/ls$run" | awk '{print $1, $2, $3}' > "$work/ad$run.txt"
  want=$(for l in 0 1; do
    echo "base_model.model.model.layers.$l.mlp.down_proj.lora_A.weight F32 [4,192]"
    echo "base_model.model.model.layers.$l.mlp.down_proj.lora_B.weight F32 [64,4]"
    echo "base_model.model.model.layers.$l.self_attn.q_proj.lora_A.weight F32 [4,64]"
    echo "base_model.model.model.layers.$l.self_attn.q_proj.lora_B.weight F32 [64,4]"
    echo "base_model.model.model.layers.$l.self_attn.v_proj.lora_A.weight F32 [4,64]"
    echo "base_model.model.model.layers.$l.self_attn.v_proj.lora_B.weight F32 [32,4]"
  done | sort)
  if [ "$(sort "$work/ad$run.txt")" = "$want" ]; then ok "$run: adapter keys, dtypes, shapes"
  else bad "$run: adapter listing"; diff <(echo "$want") <(sort "$work/ad$run.txt"); fi
  cfg=$work/ad$run/adapter_config.json
  if "$json_check" peft_type r lora_alpha lora_dropout target_modules use_rslora bias task_type \
    base_model_name_or_path < "$cfg" && grep -q '"peft_type": "LORA"' "$cfg" &&
    grep -q '"r": 4,' "$cfg" && grep -q '"lora_alpha": 16' "$cfg" &&
    grep -q '"bias": "none"' "$cfg" && grep -q '"task_type": "CAUSAL_LM"' "$cfg" &&
    [ "$(tr -d ' \n' < "$cfg" | grep -o '"target_modules":\[[^]]*\]')" = \
      '"target_modules":["down_proj","q_proj","v_proj"]' ]; then
    ok "$run: adapter_config.json"
  else
    bad "$run: adapter_config.json"; cat "$cfg"
  fi
  "$st_list" "$work/mg$run" > "$work/mg$run.txt"
  wrong=
  while read -r name rest; do
    was=$(grep "^$name " "$work/init.txt")
    case $name in
      *q_proj.weight | *v_proj.weight | *down_proj.weight)
        [ "$name $rest" = "$was" ] && wrong="$wrong $name(unchanged)" ;;
      *) [ "$name $rest" = "$was" ] || wrong="$wrong $name(changed)" ;;
    esac
  done < "$work/mg$run.txt"
  if [ -z "$wrong" ] && [ "$(wc -l < "$work/mg$run.txt")" = "$(wc -l < "$work/init.txt")" ]; then
    ok "$run: merged export: adapted weights moved, the others bitwise the base"
  else
    bad "$run: merged export:$wrong"
  fi
done

# (b) the adapter loaded back scores as the merged model, and trains on
printf '{"input_ids": [%s]}\n' "$(seq -s, 5 36)" > "$work/batch.jsonl"
if "$meshlm" logprobs --model "$work/model" --adapter "$work/ad1" --data "$work/batch.jsonl" \
  --out "$work/lp_ad.jsonl" > /dev/null 2> "$work/err" &&
  "$meshlm" logprobs --model "$work/mg1" --data "$work/batch.jsonl" --out "$work/lp_mg.jsonl" > /dev/null \
    2> "$work/err"; then
  # two fp32 evaluations with rank-4 adapters (tolerance.h §8): the merged weight rounds W + s·B·A
# once where the adapter path adds its products to the base GEMM's output; both within the bound
bound=$("$4" "$work/model" logprobs lora-pair:4 32 32)
  rel=$(paste <(tr -d '{}[]"a-z_: ' < "$work/lp_ad.jsonl" | tr , '\n') \
    <(tr -d '{}[]"a-z_: ' < "$work/lp_mg.jsonl" | tr , '\n') |
    awk '{d = $1 - $2; n += d * d; s += $2 * $2} END {printf "%.3g", sqrt(n / s)}')
  if awk -v r="$rel" -v b="$bound" 'BEGIN {exit !(r <= b)}'; then
    ok "logprobs --adapter = the merged export's (rel L2 $rel, bound $bound)"
  else
    bad "logprobs --adapter vs merged: rel L2 $rel > bound $bound"
  fi
else
  bad "logprobs --adapter / merged"
fi
if "$meshlm" train --model "$work/model" --data "$src/README.md" --seq-len 32 --batch-size 4 \
  --steps 1 --peak-tflops 1 --adapter "$work/ad1" > /dev/null 2> "$work/err"; then
  ok "train --adapter continues from an exported adapter"
else
  bad "train --adapter"
fi

# (c) resume bit-exact; meshlm export refuses the LoRA checkpoint
launch 2 "${base[@]}" --steps 4 --metrics "$work/full.jsonl" > /dev/null 2> "$work/err"
launch 2 "${base[@]}" --steps 2 --save "$work/ck" > /dev/null 2> "$work/err"
launch 2 "${base[@]}" --steps 4 --resume "$work/ck" --metrics "$work/b.jsonl" > /dev/null \
  2> "$work/err"
if [ "$(losses "$work/full.jsonl" | tail -2)" = "$(losses "$work/b.jsonl" | tail -2)" ] &&
  [ "$(losses "$work/b.jsonl" | wc -l)" = 2 ]; then
  ok "resume: steps 3-4 bitwise the uninterrupted run's"
else
  bad "resume: $(losses "$work/full.jsonl" | tr '\n' ' ') vs $(losses "$work/b.jsonl" | tr '\n' ' ')"
fi
if "$meshlm" export --checkpoint "$work/ck" --out "$work/x" 2> "$work/err"; then bad "export of a LoRA checkpoint"
elif grep -q "a LoRA run's checkpoint (it holds adapters such as 'model.layers" "$work/err"; then
  ok "meshlm export refuses a LoRA checkpoint"
else bad "export message: $(cat "$work/err")"; fi

# (c2) the collectives of a LoRA step on dp_shard 2 equal `meshlm plan`'s (the meta backend runs
# the same step), and reduce only the adapters: fewer bytes than a full fine-tuning step
run_colls() { grep '^train: collectives of the last step' "$1" | sed 's/.*(rank 0)://' |
  grep -oE '[a-z_]+ [a-z_]+ x[0-9]+ \([0-9.]+ MB\)'; }
plan_colls() {
  "$meshlm" plan --model "$work/model" --seq-len 32 --batch-size 4 "$@" |
    awk '/one training step/ { on = 1; next } on && !/ calls / { exit }
         on { printf "%s %s x%s (%.3f MB)\n", $1, $2, $3, $5 / 1e6 }'
}
rs_mb() { run_colls "$1" | grep 'dp_shard_cp reduce_scatter' | sed -E 's/.*\(([0-9.]+) MB\)/\1/'; }
launch 2 "${base[@]}" --steps 1 > "$work/cl.txt" 2> "$work/err"
launch 2 train --model "$work/model" --data "$src/README.md" --seq-len 32 --batch-size 4 \
  --steps 1 --peak-tflops 1 > "$work/cf.txt" 2> "$work/err"
lora_flags=(--lora-rank 4 --lora-alpha 16 --lora-targets q_proj,v_proj,down_proj)
if [ -n "$(run_colls "$work/cl.txt")" ] &&
  [ "$(run_colls "$work/cl.txt" | sort)" = "$(plan_colls --dp-shard 2 "${lora_flags[@]}" | sort)" ]
then
  ok "collectives of a LoRA step on dp_shard 2 = meshlm plan's"
else
  bad "LoRA collectives: run vs plan"
  diff <(run_colls "$work/cl.txt" | sort) <(plan_colls --dp-shard 2 "${lora_flags[@]}" | sort)
fi
if awk -v a="$(rs_mb "$work/cl.txt")" -v b="$(rs_mb "$work/cf.txt")" 'BEGIN { exit !(a < b) }'
then
  ok "LoRA reduce-scatters the adapters only: $(rs_mb "$work/cl.txt") MB < $(rs_mb "$work/cf.txt") MB"
else
  bad "LoRA reduce-scatter bytes $(rs_mb "$work/cl.txt") MB vs full $(rs_mb "$work/cf.txt") MB"
fi

# (c2b) plan takes every LoRA flag train takes: a step from an exported adapter (--adapter) and
# one with --lora-dropout and --lora-rslora communicate as `meshlm plan` with the same flags says
ad_flags=(--adapter "$work/ad1")
dr_flags=("${lora_flags[@]}" --lora-dropout 0.1 --lora-rslora)
for v in ad dr; do
  declare -n fl=${v}_flags
  launch 2 train --model "$work/model" --data "$src/README.md" --seq-len 32 --batch-size 4 \
    --steps 1 --peak-tflops 1 "${fl[@]}" > "$work/c$v.txt" 2> "$work/err"
  if [ -n "$(run_colls "$work/c$v.txt")" ] &&
    [ "$(run_colls "$work/c$v.txt" | sort)" = "$(plan_colls --dp-shard 2 "${fl[@]}" | sort)" ]
  then
    ok "collectives of a LoRA step with ${fl[*]} on dp_shard 2 = meshlm plan's"
  else
    bad "LoRA collectives with ${fl[*]}: run vs plan"; cat "$work/err"
    diff <(run_colls "$work/c$v.txt" | sort) <(plan_colls --dp-shard 2 "${fl[@]}" | sort)
  fi
  unset -n fl
done

# (c3) activation checkpointing (the recompute reruns the adapters' forward) and CPU offload leave
# a LoRA run's losses bitwise as they were
launch 2 "${base[@]}" --steps 2 --metrics "$work/p.jsonl" > /dev/null 2> "$work/err"
for extra in "--activation-checkpointing layer" "--cpu-offload"; do
  launch 2 "${base[@]}" --steps 2 $extra --metrics "$work/x.jsonl" > /dev/null 2> "$work/err"
  if [ -s "$work/x.jsonl" ] && [ "$(losses "$work/x.jsonl")" = "$(losses "$work/p.jsonl")" ]; then
    ok "LoRA with $extra: losses bitwise the plain run's"
  else
    bad "LoRA with $extra: $(losses "$work/x.jsonl" | tr '\n' ' ') vs $(losses "$work/p.jsonl" | tr '\n' ' ')"
  fi
done

# (d) config keys
printf '{"lora_rank": 4, "lora_alpha": 16, "lora_targets": ["q_proj", "v_proj", "down_proj"], "lora_use_rslora": true}\n' \
  > "$work/cfg.json"
"$meshlm" train --model "$work/model" --data "$src/README.md" --seq-len 32 --batch-size 4 \
  --lr 1e-2 --max-grad-norm 0 --peak-tflops 1 --steps 2 --config "$work/cfg.json" \
  --metrics "$work/c1.jsonl" > /dev/null 2> "$work/err"
"${meshlm}" "${base[@]}" --steps 2 --lora-rslora --metrics "$work/c2.jsonl" > /dev/null \
  2> "$work/err"
if [ -s "$work/c1.jsonl" ] && [ "$(losses "$work/c1.jsonl")" = "$(losses "$work/c2.jsonl")" ]; then
  ok "config keys lora_* = the flags"
else
  bad "config keys"
fi

# (f) LoRA dropout from the command line
launch 1 "${base[@]}" --steps 2 --metrics "$work/p0.jsonl" > /dev/null 2> "$work/err"
if launch 1 "${base[@]}" --steps 2 --lora-dropout 0.1 --metrics "$work/p1.jsonl" \
  --export-hf "$work/adp" > /dev/null 2> "$work/err" &&
  [ "$(losses "$work/p0.jsonl" | head -1)" = "$(losses "$work/p1.jsonl" | head -1)" ] &&
  [ "$(losses "$work/p0.jsonl" | tail -1)" != "$(losses "$work/p1.jsonl" | tail -1)" ] &&
  grep -q '"lora_dropout": 0.1' "$work/adp/adapter_config.json"; then
  ok "--lora-dropout 0.1 trains, its export records it"
else
  bad "--lora-dropout 0.1: $(losses "$work/p0.jsonl" | tr '\n' ' ') vs $(losses "$work/p1.jsonl" |
    tr '\n' ' '); $(head -3 "$work/err")"
fi

# (e) errors
expect() { # expect WANT NP ARGS...: the run fails with WANT in its message
  local want=$1 np=$2
  shift 2
  if launch "$np" "$@" > /dev/null 2> "$work/err"; then bad "no error: $want"
  elif grep -qF "$want" "$work/err"; then ok "error: $want"
  else bad "message for $want: $(head -3 "$work/err")"; fi
}
expect "lora_dropout (--lora-dropout) 1: expected a probability in [0, 1)" 1 "${base[@]}" \
  --steps 1 --lora-dropout 1
expect "target module 'qkv' not found" 1 "${base[@]}" --steps 1 --lora-targets q_proj,qkv
expect "the run has no LoRA adapters to merge (--merge-lora)" 1 train --model "$work/model" \
  --data "$src/README.md" --seq-len 32 --batch-size 4 --steps 1 --peak-tflops 1 --merge-lora \
  --export-hf "$work/none"
finish
