#!/usr/bin/env bash
# meshlm train's loop end to end on a tiny model:
#  (a) gradient accumulation: --grad-accum 2 equals one batch: the first
#      step's loss and gradient norm within the bounds for two fp32
#      evaluations in different orders (tests/tolerance.h §3, printed by
#      tol_bound; |Δ‖g‖| <= ‖Δg‖), on 1 rank, on 2 (dp_shard=2) and on
#      tp=2 with sequence parallelism;
#  (b) --config FILE gives bitwise the losses of the same flags (NeMo's key
#      names included, on 2 ranks with tensor_parallel_size 2), and a flag
#      overrides the file;
#  (c) the LR schedule (cosine, warmup) is the lr of the metrics (within
#      tolerance.h's tol_schedule_abs; a flag's constant lr exactly);
#  (d) --max-grad-norm with --grad-norm-type inf runs, and the inf-norm of
#      the first step is at most its L2 norm;
#  (e) a non-finite gradient skips the step: an absurd --lr (1e30, no
#      clipping) blows the weights up in step 1, so steps 2 and 3 have NaN
#      gradients: they are reported ("step N: skipped, non-finite gradient
#      in NAME") and marked "skipped": true, and the run ends normally — on
#      1 rank and on 2 (tp=2);
#  (f) --save / --resume: 2 steps, saved, resumed to 4 gives the losses and
#      the weights of 4 uninterrupted steps bitwise on the same mesh; on
#      dp_shard=2 the first resumed step's loss (the loaded weights, summed
#      in another order) within the pair bound of (a) — the next one follows
#      an AdamW step on another mesh, which no rounding bound covers
#      (tests/mpi/train_check.h), so it is printed only; warmup schedule
#      included; --save-every N saves every N steps and after the last.
# usage: test_train_loop.sh MESHLM SOURCE_DIR JSON_CHECK TOL_BOUND
set -eu
meshlm=$1
src=$2
tol_bound=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
pass=0

"$meshlm" init --arch llama --preset tiny --seed 3 --out "$work/model" > /dev/null
base=(train --model "$work/model" --data "$src/README.md" --seq-len 64 --batch-size 8 --lr 1e-3)
# field FILE KEY: the values of KEY in a metrics JSONL, one per line
field() { sed -E "s/.*\"$2\":([^,}]+).*/\1/" "$1"; }
ok() { pass=$((pass + 1)); echo "ok   $1"; }
# close NAME TOL A B: two columns of numbers agree within TOL relative
close() {
  paste <(echo "$3") <(echo "$4") | awk -v name="$1" -v tol="$2" '
    { d = $1 - $2; if (d < 0) d = -d; m = $1 < 0 ? -$1 : $1; r = m > 0 ? d / m : d; if (r > w) w = r; n++ }
    END { printf "%s: %d values, worst relative difference %.3g (bound %.3g)\n", name, n, w, tol
          exit (n == 0 || w > tol) }'
}
# the pair bound of QUANTITY for the tiny model's batch of 8 x 64 tokens
pair() { "$tol_bound" "$work/model" "$1" pair 64 512; }

# (a) gradient accumulation (tp=2 + SP: the norms' Partial grads are summed over tp per
# micro-batch, the earlier micro-batches' set aside, not summed again)
for mesh in 1 2 "2 --tp 2 --sequence-parallel"; do
  set -- $mesh
  np=$1
  shift
  run=("${base[@]}" --steps 1 "$@")
  [ "$np" -eq 1 ] && launch=() || launch=(mpiexec -n "$np")
  "${launch[@]}" "$meshlm" "${run[@]}" --metrics "$work/ga1.jsonl" > /dev/null
  "${launch[@]}" "$meshlm" "${run[@]}" --grad-accum 2 --metrics "$work/ga2.jsonl" > "$work/out.txt"
  grep -q "in 2 micro-batch" "$work/out.txt"
  close "accumulation loss, $mesh rank(s)" "$(pair loss)" "$(field "$work/ga1.jsonl" loss)" "$(field "$work/ga2.jsonl" loss)"
  close "accumulation grad norm, $mesh rank(s)" "$(pair grads)" "$(field "$work/ga1.jsonl" grad_norm)" \
    "$(field "$work/ga2.jsonl" grad_norm)"
  ok "grad-accum 2 = one batch on $mesh rank(s)"
done

# (b) config file = flags; a flag overrides the file
cat > "$work/cfg.json" << EOF
{"model": "$work/model", "data": "$src/README.md", "seq_len": 64, "batch_size": 8, "lr": 1e-3,
 "steps": 3, "tensor_parallel_size": 2, "sequence_parallel": true, "grad_accum": 2,
 "lr_schedule": "linear", "warmup_steps": 1, "custom_parallel_plan": null, "activation_checkpointing": false}
EOF
mpiexec -n 2 "$meshlm" train --config "$work/cfg.json" --metrics "$work/c1.jsonl" > /dev/null
mpiexec -n 2 "$meshlm" "${base[@]}" --steps 3 --tp 2 --sequence-parallel --grad-accum 2 --lr-schedule linear \
  --warmup-steps 1 --metrics "$work/c2.jsonl" > /dev/null
[ "$(field "$work/c1.jsonl" loss)" = "$(field "$work/c2.jsonl" loss)" ] || { echo "FAIL: config and flags differ"; exit 1; }
"$meshlm" train --config "$work/cfg.json" --tensor-parallel-size 2 2>&1 | grep -q "unknown flag '--tensor-parallel-size'" ||
  { echo "FAIL: NeMo names are config keys, not flags"; exit 1; }
"$meshlm" train --lr 5e-4 --config "$work/cfg.json" --tp 1 --steps 2 --lr-schedule constant --warmup-steps 0 \
  --sequence-parallel=false --metrics "$work/c3.jsonl" > /dev/null
close "lr from the command line over the file's" 0 "$(field "$work/c3.jsonl" lr)" "$(printf '%s\n' 5e-4 5e-4)"
ok "config file = the same flags (bitwise), flags override it"

# (c) LR schedule: cosine from 1e-3 to 1e-4 after 2 warmup steps over 6 steps
"$meshlm" "${base[@]}" --steps 6 --lr-schedule cosine --warmup-steps 2 --min-lr 1e-4 --metrics "$work/lr.jsonl" > /dev/null
paste <(field "$work/lr.jsonl" lr) <(printf '%s\n' 0 5e-4 1e-3 7.75e-4 3.25e-4 1e-4) |
  awk -v t="$("$tol_bound" schedule 1e-3)" '{ d = $1 - $2; d = d < 0 ? -d : d; if (d > w) w = d; n++ }
    END { printf "cosine schedule: %d steps, worst abs difference %.3g (bound %.3g)\n", n, w, t; exit (n != 6 || w > t) }'
ok "LR schedule in the metrics"

# (d) inf-norm clipping
"$meshlm" "${base[@]}" --steps 2 --max-grad-norm 0.05 --grad-norm-type inf --metrics "$work/inf.jsonl" > /dev/null
"$meshlm" "${base[@]}" --steps 1 --metrics "$work/l2.jsonl" > /dev/null
paste <(field "$work/inf.jsonl" grad_norm | head -1) <(field "$work/l2.jsonl" grad_norm) <(field "$work/inf.jsonl" loss | tail -1) |
  awk '{ printf "step 1: inf-norm %s, L2 norm %s; step 2 loss %s\n", $1, $2, $3; exit !($1 > 0 && $1 <= $2 && $3 > 0) }'
ok "--max-grad-norm with --grad-norm-type inf"

# (e) non-finite gradients skip the step
for np in 1 2; do
  [ "$np" -eq 1 ] && launch=() || launch=(mpiexec -n "$np")
  "${launch[@]}" "$meshlm" "${base[@]}" --tp "$np" --steps 3 --lr 1e30 --max-grad-norm 0 --metrics "$work/nan.jsonl" > "$work/out.txt"
  grep -E "^step 2: skipped, non-finite gradient in (model|lm_head)\." "$work/out.txt"
  grep -qE "^step 3 .*\| skipped$" "$work/out.txt"
  [ "$(field "$work/nan.jsonl" skipped | tr '\n' ' ')" = "false true true " ] ||
    { echo "FAIL: skipped flags $(field "$work/nan.jsonl" skipped | tr '\n' ' ')"; exit 1; }
  ok "non-finite gradient skips the step on $np rank(s)"
done

# (f) save and resume
run=("${base[@]}" --warmup-steps 3)
"$meshlm" "${run[@]}" --steps 4 --metrics "$work/full.jsonl" --export-hf "$work/full" > /dev/null
"$meshlm" "${run[@]}" --steps 2 --save "$work/ck" > /dev/null
cp -r "$work/ck" "$work/ck2"
"$meshlm" "${run[@]}" --steps 4 --resume "$work/ck" --metrics "$work/res1.jsonl" --export-hf "$work/res1" > "$work/out.txt"
grep -q "resumed from $work/ck at step 2" "$work/out.txt"
[ "$(field "$work/res1.jsonl" step | tr '\n' ' ')" = "3 4 " ] || { echo "FAIL: resumed steps"; exit 1; }
[ "$(field "$work/res1.jsonl" loss)" = "$(field "$work/full.jsonl" loss | tail -2)" ] || { echo "FAIL: resumed losses differ"; exit 1; }
cmp "$work/full/model.safetensors" "$work/res1/model.safetensors" || { echo "FAIL: resumed weights differ"; exit 1; }
mpiexec -n 2 "$meshlm" "${run[@]}" --steps 4 --resume "$work/ck2" --metrics "$work/res2.jsonl" > /dev/null
close "first step resumed on dp_shard=2" "$(pair loss)" "$(field "$work/res2.jsonl" loss | head -1)" \
  "$(field "$work/full.jsonl" loss | sed -n 3p)"
echo "step 4 loss resumed on dp_shard=2 $(field "$work/res2.jsonl" loss | tail -1), uninterrupted $(field "$work/full.jsonl" loss | tail -1)"
"$meshlm" "${run[@]}" --steps 3 --save "$work/ck3" --save-every 2 > "$work/out.txt"
[ "$(grep -c "saved run checkpoint" "$work/out.txt")" -eq 2 ] && grep -q "(step 3)" "$work/out.txt" ||
  { echo "FAIL: --save-every"; cat "$work/out.txt"; exit 1; }
ok "save, resume (same mesh bitwise, other mesh within the bound), --save-every"

echo "$pass passed, 0 failed"
