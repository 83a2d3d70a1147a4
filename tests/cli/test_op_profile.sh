#!/usr/bin/env bash
# MESHLM_OP_PROFILE=1 (backend/profile.h), on the CPU backend:
#  (a) unset, `meshlm train` prints no profile;
#  (b) set, it prints the table: a header, GEMM rows named by shape, and one
#      row per operator, ml_be_attention_fwd / _bwd and ml_be_adamw among them;
#  (c) the table is the last step's: --steps 2 and --steps 3 give the same
#      classes with the same call counts, and ml_be_attention_fwd ran once
#      per layer (num_hidden_layers of the tiny preset; one micro-batch, no
#      activation checkpointing) — a profile that kept earlier steps or model
#      loading would count more.
# usage: test_op_profile.sh MESHLM SOURCE_DIR ...
set -u
meshlm=$1
src=$2
. "$src/tests/cli/common.sh"

"$meshlm" init --arch llama --preset tiny --out "$work/m" > /dev/null
layers=$(sed -nE 's/.*"num_hidden_layers": ([0-9]+).*/\1/p' "$work/m/config.json")
head -c 3000 "$src/README.md" > "$work/t.txt"
train() { "$meshlm" train --model "$work/m" --data "$work/t.txt" --seq-len 64 --batch-size 2 "$@"; }
# calls FILE: "class calls" per row of the profile table in FILE, sorted
calls() { sed -n '/^op profile/,$p' "$1" | awk 'NR > 2 { n = $(NF - 3); NF -= 4; print $0, n }' | sort; }

train --steps 2 > "$work/plain" 2>&1
if grep -q 'op profile' "$work/plain"; then bad "(a) no table without MESHLM_OP_PROFILE"; else
  ok "(a) no table without MESHLM_OP_PROFILE"; fi
for s in 2 3; do MESHLM_OP_PROFILE=1 train --steps $s > "$work/p$s" 2>&1 || bad "(b) train --steps $s"; done
if grep -q '^op profile (MESHLM_OP_PROFILE=1' "$work/p3" && grep -q '^gemm [0-9]*x[0-9]*x[0-9]*' "$work/p3" &&
  grep -q '^ml_be_attention_fwd ' "$work/p3" && grep -q '^ml_be_attention_bwd ' "$work/p3" &&
  grep -q '^ml_be_adamw ' "$work/p3"; then ok "(b) the table and its rows"; else
  bad "(b) the table and its rows"; sed -n '/op profile/,$p' "$work/p3" | head; fi
calls "$work/p2" > "$work/c2"
calls "$work/p3" > "$work/c3"
if [ -s "$work/c3" ] && cmp -s "$work/c2" "$work/c3"; then ok "(c) the same table after 2 and 3 steps"; else
  bad "(c) the same table after 2 and 3 steps"; diff "$work/c2" "$work/c3" | head; fi
n=$(awk '$1 == "ml_be_attention_fwd" { print $2 }' "$work/c3")
if [ "$n" = "$layers" ]; then ok "(c) ml_be_attention_fwd once per layer ($layers)"; else
  bad "(c) ml_be_attention_fwd: ${n:-none} calls, expected $layers (one step's)"; fi
finish
