#!/usr/bin/env bash
# --freeze PATTERNS (engine/freeze.h: requires_grad=False on the parameters whose HF names match),
# end to end on the tiny llama preset (untied, 2 layers):
#  (a) one AdamW step, no clipping (--max-grad-norm 0) and weight decay 0.1 (a frozen parameter
#      stepped by mistake would decay): every frozen tensor of the --export-hf bitwise equal to
#      the initial weights (and the unfrozen run changes them: the check can fail), every other
#      bitwise equal to the same step without --freeze (a trainable gradient does not depend on
#      requires_grad of others, and AdamW is elementwise), via st_list's hashes; on 1 rank and
#      dp_shard 2 x tp 2 + SP, freezing the embedding, and a partly frozen set (the final norm,
#      whose gradient is Partial under SP, and one q_proj: units with frozen and trainable chunks);
#      and on dp_shard 2 with --cpu-offload and bf16 parameters, with ZeRO-1 (all-reduce), on cp 2,
#      and on tp 4 with shared kv heads (llama_h9kv3) and their projections frozen;
#  (b) the grad norm over trainable parameters only: runs freezing a set F and its complement C
#      print n_F and n_C with n_F^2 + n_C^2 = n^2, n the unfrozen run's (each a sum of squares over
#      a part of the same gradients); a norm counting frozen gradients breaks it;
#  (c) collectives of the last step: an all-frozen unit (layer 0) does one reduce-scatter fewer on
#      dp_shard 2, a partly frozen one (a q_proj) as many with fewer bytes (its trainable prefix),
#      and the run's counts and bytes equal `meshlm plan --freeze` (dp 2, dp 2 x tp 2 + SP with
#      backward stopping below the frozen prefix);
#  (d) a run checkpoint of a frozen run resumes bit-exact (losses, export), and a resume with
#      another --freeze set is refused naming both;
#  (e) the config key (a JSON list) equals the flag; Phi-3's fused qkv_proj (HF's one Parameter)
#      freezes its three parts; errors: a pattern matching nothing, every parameter frozen, an
#      empty pattern, the tied lm_head, a config value of the wrong type.
# usage: test_freeze.sh MESHLM SOURCE_DIR JSON_CHECK TOL_BOUND ST_LIST
set -u
meshlm=$1
src=$2
st_list=$5
. "$src/tests/cli/common.sh"

"$meshlm" init --arch llama --preset tiny --seed 3 --out "$work/model" > /dev/null || exit 1
"$st_list" "$work/model" > "$work/init.txt" || exit 1
base=(train --model "$work/model" --data "$src/README.md" --seq-len 64 --batch-size 8 --lr 1e-3
  --weight-decay 0.1 --max-grad-norm 0 --peak-tflops 1)
# launch NP ARGS...: one process, or an MPI job of NP
launch() {
  local np=$1
  shift
  if [ "$np" -eq 1 ]; then "$meshlm" "$@"; else mpiexec -n "$np" "$meshlm" "$@"; fi
}
norm_of() { sed -E 's/.*"grad_norm":([^,]+),.*/\1/' "$1" | tail -1; }
losses() { sed -E 's/.*"loss":([^,]+),.*/\1/' "$1"; }
# line NAME FILE: st_list's line of tensor NAME
line() { grep "^$1 " "$2"; }
# is_frozen NAME PATTERNS: NAME matches one of the comma-separated fnmatch PATTERNS (bash's
# [[ == ]] globbing: * also matches dots, as fnmatch(3) without flags)
is_frozen() {
  local p list
  IFS=, read -ra list <<< "$2"
  for p in "${list[@]}"; do [[ $1 == $p ]] && return 0; done
  return 1
}

# check_export PATTERNS INIT FULL FROZEN WHERE: st_list listings of the initial weights, the
# unfrozen step's and the frozen step's export: every tensor PATTERNS freeze = initial (and the
# unfrozen step changed it: else the check is void), every other = the unfrozen step's
check_export() {
  local pats=$1 init=$2 full=$3 fz=$4 wrong= n_frozen=0 name
  while read -r name _; do
    if is_frozen "$name" "$pats"; then
      n_frozen=$((n_frozen + 1))
      [ "$(line "$name" "$fz")" = "$(line "$name" "$init")" ] ||
        wrong="$wrong $name (frozen: not the initial weights)"
      [ "$(line "$name" "$full")" != "$(line "$name" "$init")" ] ||
        wrong="$wrong $name (the unfrozen step left it unchanged: the check is void)"
    else
      [ "$(line "$name" "$fz")" = "$(line "$name" "$full")" ] ||
        wrong="$wrong $name (trainable: not the unfrozen step's)"
    fi
  done < "$init"
  if [ -n "$wrong" ] || [ "$n_frozen" -eq 0 ]; then
    bad "--freeze '$pats' on $5: $n_frozen frozen;$wrong"
  else
    ok "--freeze '$pats' on $5 rank(s): $n_frozen frozen tensors = initial, the rest = unfrozen step, bitwise"
  fi
}

# (a) + (b): one step per mesh, unfrozen, then each frozen set
embed='model.embed_tokens.*'
partial='model.norm.weight,model.layers.0.self_attn.q_proj.weight'
F='model.embed_tokens.*,model.layers.0.*'
C='model.layers.1.*,model.norm.weight,lm_head.weight'
for mesh in "1" "4 --tp 2 --sequence-parallel" "2 --cpu-offload --param-dtype bf16" "2 --zero 1" \
  "2 --cp 2"; do
  set -- $mesh
  np=$1
  shift
  tag=${np}r
  launch "$np" "${base[@]}" --steps 1 "$@" --metrics "$work/m_full.jsonl" \
    --export-hf "$work/e_full" > /dev/null 2> "$work/err" || { bad "unfrozen run on $mesh"; continue; }
  "$st_list" "$work/e_full" > "$work/full.txt"
  for pats in "$embed" "$partial" "$F" "$C"; do
    rm -rf "$work/e_fz"
    if ! launch "$np" "${base[@]}" --steps 1 "$@" --freeze "$pats" --metrics "$work/m_fz.jsonl" \
      --export-hf "$work/e_fz" > /dev/null 2> "$work/err"; then
      bad "--freeze '$pats' on $mesh"
      continue
    fi
    cp "$work/m_fz.jsonl" "$work/m_${tag}_${pats//[^a-z0-9]/_}.jsonl"
    "$st_list" "$work/e_fz" > "$work/fz.txt"
    check_export "$pats" "$work/init.txt" "$work/full.txt" "$work/fz.txt" "$mesh"
  done
  # (b) n_F^2 + n_C^2 = n^2 up to rounding. Each printed norm is sqrt of a sum of squares of fp32
  # gradients computed in double (k_norm_partials: products exact, 24 + 24 significant bits < 53; the
  # gradients bitwise those of the unfrozen run, as (a) shows for the weights), summed in some order
  # over ranks and parameters: relative error <= gamma_{N-1} in u64 = 2^-53 (tolerance.h R2, terms
  # >= 0; N <= the model's 131392 elements), one more u64 for the sqrt, none for printing (17
  # digits round-trip). Squaring in awk doubles the relative error and adds u64; the two additions
  # add u64 each: |n_F^2 + n_C^2 - n^2| <= (2 (2 gamma_N + 3 u64) + 2 u64) n^2 <= (4 N + 8) u64 n^2.
  n=$(norm_of "$work/m_full.jsonl")
  nF=$(norm_of "$work/m_${tag}_${F//[^a-z0-9]/_}.jsonl")
  nC=$(norm_of "$work/m_${tag}_${C//[^a-z0-9]/_}.jsonl")
  if awk -v n="$n" -v a="$nF" -v b="$nC" 'BEGIN {
      N = 131392; u = 2^-53; bound = (4 * N + 8) * u
      rel = (a * a + b * b - n * n) / (n * n); if (rel < 0) rel = -rel
      printf "     grad norms: unfrozen %s, F %s, C %s: |nF^2 + nC^2 - n^2| / n^2 = %.3g (bound %.3g)\n", n, a, b, rel, bound
      exit !(rel <= bound && a < n && b < n) }'; then
    ok "grad norm over trainable parameters on $mesh rank(s): n_F^2 + n_C^2 = n^2"
  else
    bad "grad norm over trainable parameters on $mesh rank(s)"
  fi
  rm -rf "$work/e_full" "$work/e_fz"
done

# (a) on shared kv heads (llama_h9kv3: 3 kv heads over tp 4, their gradient rows summed over
# their holders): every k_proj and one v_proj frozen
h9=(train --model "$src/tests/fixtures/llama_h9kv3" --data "$src/README.md" --seq-len 32
  --batch-size 4 --lr 1e-3 --weight-decay 0.1 --max-grad-norm 0 --steps 1 --tp 4)
kv='model.layers.*.self_attn.k_proj.weight,model.layers.0.self_attn.v_proj.weight'
"$st_list" "$src/tests/fixtures/llama_h9kv3" > "$work/h9_init.txt"
if launch 4 "${h9[@]}" --export-hf "$work/h9_full" > /dev/null 2> "$work/err" &&
  launch 4 "${h9[@]}" --freeze "$kv" --export-hf "$work/h9_fz" > /dev/null 2> "$work/err"; then
  "$st_list" "$work/h9_full" > "$work/h9_full.txt"
  "$st_list" "$work/h9_fz" > "$work/h9_fz.txt"
  check_export "$kv" "$work/h9_init.txt" "$work/h9_full.txt" "$work/h9_fz.txt" "tp 4, shared kv heads, 4"
else
  bad "llama_h9kv3 on tp 4 with --freeze '$kv'"
fi

# (c) the last step's collectives as train prints them (rank 0) and as plan predicts them
# run_colls FILE: "group kind xN (X MB)" one per line
run_colls() { grep '^train: collectives of the last step' "$1" | sed 's/.*(rank 0)://' |
  grep -oE '[a-z_]+ [a-z_]+ x[0-9]+ \([0-9.]+ MB\)'; }
# plan_colls ARGS...: the training step's collectives of `meshlm plan` in the same form
plan_colls() {
  "$meshlm" plan --model "$work/model" --seq-len 64 --batch-size 8 "$@" |
    awk '/one training step/ { on = 1; next } on && !/ calls / { exit }
         on { printf "%s %s x%s (%.3f MB)\n", $1, $2, $3, $5 / 1e6 }'
}
rs_calls() { run_colls "$1" | grep 'dp_shard_cp reduce_scatter' | sed -E 's/.* x([0-9]+) .*/\1/'; }
rs_mb() { run_colls "$1" | grep 'dp_shard_cp reduce_scatter' | sed -E 's/.*\(([0-9.]+) MB\)/\1/'; }
for fz in "" "model.layers.0.*" "model.layers.0.self_attn.q_proj.weight"; do
  launch 2 "${base[@]}" --steps 1 ${fz:+--freeze "$fz"} > "$work/c_${fz//[^a-z0-9]/_}.txt" \
    2> "$work/err" || bad "collectives run ${fz:+--freeze $fz}"
done
full_rs=$(rs_calls "$work/c_.txt")
fz_rs=$(rs_calls "$work/c_model_layers_0__.txt")
if [ -n "$full_rs" ] && [ "$fz_rs" = "$((full_rs - 1))" ]; then
  ok "an all-frozen unit (layer 0) does no reduce-scatter: $fz_rs calls, $full_rs unfrozen"
else
  bad "reduce-scatters with layer 0 frozen: $fz_rs, unfrozen: $full_rs (expected one fewer)"
fi
# a partly frozen unit reduces its trainable prefix only: as many calls, fewer bytes (q_proj's
# chunk, 32 x 64 fp32 per rank, of which the counting comm records dp = 2: 0.016 MB)
q=c_model_layers_0_self_attn_q_proj_weight.txt
if [ "$(rs_calls "$work/$q")" = "$full_rs" ] &&
  awk -v a="$(rs_mb "$work/$q")" -v b="$(rs_mb "$work/c_.txt")" 'BEGIN { exit !(a < b) }'; then
  ok "a partly frozen unit (layer 0's q_proj): $full_rs reduce-scatters, $(rs_mb "$work/$q") MB < $(rs_mb "$work/c_.txt") MB"
else
  bad "a partly frozen unit's reduce-scatters: $(rs_calls "$work/$q") calls, $(rs_mb "$work/$q") MB; unfrozen $full_rs, $(rs_mb "$work/c_.txt") MB"
fi
for mesh in "2|--dp-shard 2" "4|--dp-shard 2 --tp 2 --sequence-parallel"; do
  np=${mesh%%|*}
  flags=${mesh#*|}
  run_flags=${flags/--dp-shard 2/}
  launch "$np" "${base[@]}" --steps 1 $run_flags --freeze "$F" > "$work/cm.txt" 2> "$work/err" ||
    { bad "collectives run on $flags --freeze '$F'"; continue; }
  if [ -n "$(run_colls "$work/cm.txt")" ] &&
    [ "$(run_colls "$work/cm.txt" | sort)" = "$(plan_colls $flags --freeze "$F" | sort)" ]; then
    ok "collectives of a frozen step ($flags --freeze '$F') = meshlm plan's"
  else
    bad "collectives of $flags --freeze '$F': run vs plan"
    diff <(run_colls "$work/cm.txt" | sort) <(plan_colls $flags --freeze "$F" | sort)
  fi
done

# (d) resume: an all-frozen unit (layer 0) and a partly frozen one (the root: the final norm)
R='model.layers.0.*,model.norm.weight'
launch 2 "${base[@]}" --steps 2 --freeze "$R" --save "$work/ck" > /dev/null 2> "$work/err" ||
  bad "frozen run with --save"
launch 2 "${base[@]}" --steps 4 --freeze "$R" --resume "$work/ck" --metrics "$work/r.jsonl" \
  --export-hf "$work/e_r" > /dev/null 2> "$work/err" || bad "frozen run resumed"
launch 2 "${base[@]}" --steps 4 --freeze "$R" --metrics "$work/u.jsonl" --export-hf "$work/e_u" \
  > /dev/null 2> "$work/err" || bad "frozen run uninterrupted"
if [ -s "$work/r.jsonl" ] && [ "$(losses "$work/r.jsonl")" = "$(losses "$work/u.jsonl" | tail -2)" ] &&
  cmp -s "$work/e_r/model.safetensors" "$work/e_u/model.safetensors"; then
  ok "a frozen run resumed from its checkpoint = uninterrupted (losses, export bitwise)"
else
  bad "a frozen run resumed differs from the uninterrupted one"
fi
"$st_list" "$work/e_u" > "$work/u.txt"
[ "$(line model.norm.weight "$work/u.txt")" = "$(line model.norm.weight "$work/init.txt")" ] &&
  ok "after 4 steps the frozen final norm is the initial one" ||
  bad "the frozen final norm changed in 4 steps"
# expect_err NAME PATTERN CMD...: CMD fails, its stderr matches PATTERN (grep -E)
expect_err() {
  local name=$1 pat=$2
  shift 2
  if "$@" > /dev/null 2> "$work/err"; then
    bad "$name: succeeded; expected an error"
  elif grep -qE -- "$pat" "$work/err"; then
    ok "$name: $(grep -m1 -oE -- "$pat" "$work/err")"
  else
    bad "$name: the message lacks /$pat/"
  fi
}
expect_err "resume with another --freeze set" \
  "froze --freeze 'model.layers.0.\*,model.norm.weight' and this run --freeze 'model.layers.0.\*'" \
  launch 2 "${base[@]}" --steps 4 --freeze 'model.layers.0.*' --resume "$work/ck"
expect_err "resume without --freeze" "this run --freeze '': model.layers.0.input_layernorm.weight is frozen there" \
  launch 2 "${base[@]}" --steps 4 --resume "$work/ck"

# (e) the config key, as a JSON list, is the flag
echo '{"freeze": ["model.embed_tokens.*", "model.layers.0.*"], "steps": 1}' > "$work/c.json"
"$meshlm" "${base[@]}" --config "$work/c.json" --export-hf "$work/e_cfg" > /dev/null 2> "$work/err" &&
  "$meshlm" "${base[@]}" --steps 1 --freeze "$F" --export-hf "$work/e_flag" > /dev/null 2>&1 &&
  cmp -s "$work/e_cfg/model.safetensors" "$work/e_flag/model.safetensors" &&
  ok "config key freeze (a JSON list) = --freeze (export bitwise)" ||
  bad "config key freeze (a JSON list) vs --freeze"
if "$meshlm" train --model "$src/tests/fixtures/phi3" --data "$src/README.md" --seq-len 32 --steps 1 \
  --freeze 'model.layers.0.self_attn.qkv_proj.weight' > "$work/phi3.txt" 2> "$work/err" &&
  grep -q -- "--freeze '[^']*': 3 of " "$work/phi3.txt"; then
  ok "Phi-3's fused qkv_proj.weight freezes q, k and v"
else
  bad "Phi-3's fused qkv_proj.weight"
fi
echo '{"freeze": ["model.embed_tokens.*", 3]}' > "$work/bad.json"
expect_err "config freeze with a number in the list" "key 'freeze': expected a list of strings" \
  "$meshlm" "${base[@]}" --config "$work/bad.json"
expect_err "a pattern matching nothing" "pattern 'model.layers.7.\*' matches no parameter" \
  "$meshlm" "${base[@]}" --steps 1 --freeze 'model.embed_tokens.*,model.layers.7.*'
expect_err "every parameter frozen" "matches all 21 parameters" \
  "$meshlm" "${base[@]}" --steps 1 --freeze '*'
expect_err "an empty pattern" "pattern 2 is empty" \
  "$meshlm" "${base[@]}" --steps 1 --freeze 'model.norm.weight,,lm_head.weight'
expect_err "the tied lm_head" "lm_head.weight is tied to model.embed_tokens.weight" \
  "$meshlm" train --model "$src/tests/fixtures/llama_tied" --data "$src/README.md" --seq-len 32 \
  --steps 1 --freeze 'lm_head.weight'
expect_err "plan: a pattern matching nothing" "pattern 'nope' matches no parameter" \
  "$meshlm" plan --model "$work/model" --freeze nope

finish
