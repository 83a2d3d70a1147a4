#!/usr/bin/env bash
# End to end through the CLI: init a tiny model, train it 4 steps on 1 rank
# and on 4 ranks (dp_shard=2 x tp=2), check that both runs report the same
# losses (rel 1e-4 after AdamW steps), that --metrics has one line per step,
# and that logprobs of the two saved checkpoints agree (abs 1e-4).
# usage: test_train_cli.sh MESHLM SOURCE_DIR
set -eu
meshlm=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1

"$meshlm" init --arch llama --preset tiny --seed 3 --out "$work/model"
train=(train --model "$work/model" --data "$src/README.md" --steps 4 --batch-size 4 --seq-len 64 --lr 1e-3)
"$meshlm" "${train[@]}" --metrics "$work/m1.jsonl" --export-hf "$work/s1"
mpiexec -n 4 "$meshlm" "${train[@]}" --tp 2 --metrics "$work/m4.jsonl" --export-hf "$work/s4"

[ "$(wc -l < "$work/m1.jsonl")" -eq 4 ] || { echo "FAIL: expected 4 metrics lines"; exit 1; }
losses() { sed -E 's/.*"loss": ?([-0-9.eE+]+).*/\1/' "$1"; }
paste <(losses "$work/m1.jsonl") <(losses "$work/m4.jsonl") | awk '
  { d = $1 - $2; if (d < 0) d = -d; r = d / $1; if (r > w) w = r
    printf "step %d loss 1 rank %s, 4 ranks %s\n", NR, $1, $2 }
  END { printf "worst relative loss difference %.3g\n", w; exit (w > 1e-4) }'

head -c 300 "$src/README.md" | od -An -tu1 -v | tr -s ' \n' ' ' |
  awk '{ printf "{\"input_ids\": ["; for (i = 1; i <= NF; i++) printf "%s%s", (i > 1 ? ", " : ""), $i; print "]}" }' > "$work/score.jsonl"
"$meshlm" logprobs --model "$work/s1" --data "$work/score.jsonl" --out "$work/l1.jsonl"
mpiexec -n 2 "$meshlm" logprobs --model "$work/s4" --data "$work/score.jsonl" --out "$work/l4.jsonl" --tp 2
paste <(tr -d '{}[]"a-z:' < "$work/l1.jsonl" | tr ',' '\n') <(tr -d '{}[]"a-z:' < "$work/l4.jsonl" | tr ',' '\n') | awk '
  { d = $1 - $2; if (d < 0) d = -d; if (d > w) w = d; n++ }
  END { printf "logprobs of the saved checkpoints: %d tokens, max abs difference %.3g\n", n, w; exit (n < 299 || w > 1e-4) }'
echo "1 passed, 0 failed"
