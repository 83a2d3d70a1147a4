#!/usr/bin/env bash
# Peak RSS of scoring long sequences (issue 31: forward-only passes keep one
# layer's activations): `meshlm logprobs` of one random sequence of S tokens
# (S = 2048, 8192) on the `small` and `smollm2-135m` presets (random weights,
# `meshlm init`), 1 process, fp32, measured by /usr/bin/time -v (the whole
# process: weights, activations, logits tiles, MPI and the libraries), for
# the binary under test and, with OLD=path, another build side by side
# (e.g. one of an earlier commit). Figures for notes; nothing asserted.
# usage: bench/logprobs_memory.sh [BUILD_DIR]   (OLD=path/to/meshlm to compare)
set -euo pipefail
cd "$(dirname "$0")/.."
meshlm=${1:-build}/meshlm
[[ -x $meshlm ]] || { echo "logprobs_memory.sh: $meshlm not built" >&2; exit 1; }
command -v /usr/bin/time > /dev/null || { echo "logprobs_memory.sh: needs GNU time (apt-get install time)" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=passive
rss() { # binary model S -> peak RSS MiB
  /usr/bin/time -v "$1" logprobs --model "$2" --data "$out/$4-s$3.jsonl" --out "$out/lp.jsonl" \
    --micro-batch-tokens "$3" 2> "$out/time.txt" > /dev/null ||
    { cat "$out/time.txt" >&2; exit 1; }
  awk '/Maximum resident set size/ { printf "%.0f", $6 / 1024 }' "$out/time.txt"
}
echo "peak RSS (MiB) of meshlm logprobs, one sequence of S tokens, 1 process, fp32"
printf "%-14s %6s %10s %10s\n" preset S new "${OLD:+old}"
for preset in small smollm2-135m; do
  "$meshlm" init --arch llama --preset "$preset" --seed 0 --out "$out/$preset" > /dev/null
  for S in 2048 8192; do
    python3 - "$out/$preset" "$S" > "$out/$preset-s$S.jsonl" <<'PY'
import json, random, sys
cfg_path = sys.argv[1] + "/config.json"
cfg = json.load(open(cfg_path))
S = int(sys.argv[2])
if cfg["max_position_embeddings"] < S:
    cfg["max_position_embeddings"] = S
    json.dump(cfg, open(cfg_path, "w"), indent=2)
random.seed(S)
print(json.dumps({"input_ids": [random.randrange(cfg["vocab_size"]) for _ in range(S)]}))
PY
    printf "%-14s %6s %10s %10s\n" "$preset" "$S" "$(rss "$meshlm" "$out/$preset" "$S" "$preset")" \
      "$([[ -n ${OLD:-} ]] && rss "$OLD" "$out/$preset" "$S" "$preset")"
  done
done
lscpu | sed -nE 's/^Model name: *(.*)/CPU: \1/p' | head -n 1
