#!/usr/bin/env bash
# Training throughput of a Qwen3-MoE on 1 rank, S=SEQ (default 128), global batch BATCH
# (default 8), against the same model and tokens through transformers (bench/torch_peer.py:
# eager experts loop, sdpa attention, fp32, the same AdamW step), both on THREADS threads:
# median tokens/s and peak RSS, the meshlm run and the peer alternating ROUNDS times (default 1)
# so that a loaded machine's drift shows in both; then 2 ranks x 1 thread, FSDP over dp_shard 2
# without and with expert parallelism (--ep 2: each rank computes half of the experts, tokens
# exchanged by all-to-all): median tokens/s, peak RSS per rank (max and min over ranks) and the
# collectives of the last step on rank 0 (the ep group's all-to-all bytes among them), and
# `meshlm plan`'s FSDP shard bytes per rank of both 2-rank meshes (parallel/ep.h: under --ep the
# experts are held by their ep rank alone). Figures for notes; nothing here is asserted.
# SIZE: small (default; `meshlm init --arch qwen3_moe --preset small`: 8 layers, hidden 384, 4
# experts of 256 features, top 2; ~13M parameters) or 150m (issue 34's size, written by
# bench/moe_model.py with transformers: hidden 512, 8 layers, 16 experts of 512, top 2, vocab
# 32000; ~139M parameters, ~51M active per token). Token ids are drawn from the model's vocabulary.
# usage: bench/moe_throughput.sh [STEPS] [THREADS] [SIZE]   (after `make`; torch + transformers for
# the peer and for SIZE 150m)
# env: MESHLM the binary (default build/meshlm, e.g. another build's for a before/after), PEER=0
# skips the transformers peer, SEQ, BATCH, ROUNDS as above
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-8}
threads=${2:-2}
size=${3:-small}
seq=${SEQ:-128}
batch=${BATCH:-8}
rounds=${ROUNDS:-1}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
meshlm=${MESHLM:-build/meshlm}
case $size in
  small) "$meshlm" init --arch qwen3_moe --preset small --out "$out/model" > /dev/null ;;
  150m) python3 bench/moe_model.py --out "$out/model" ;;
  *) echo "moe_throughput.sh: SIZE '$size': expected small or 150m" >&2; exit 2 ;;
esac
vocab=$(grep -o '"vocab_size": *[0-9]*' "$out/model/config.json" | grep -o '[0-9]*$')
awk -v S="$seq" -v V="$vocab" 'BEGIN { srand(7); for (r = 0; r < 64; r++) { s = "";
  for (i = 0; i < S; i++) s = s (i ? "," : "") int(rand() * V); print "{\"input_ids\": [" s "]}" } }' \
  > "$out/data.jsonl"
echo "Qwen3-MoE $size, S=$seq, global batch $batch, $threads threads, $steps steps (median of steps 3..$steps)"
# median tokens/s of steps 3.. of metrics file $2, and the last step's peak RSS (max, min over
# ranks), printed under label $1
summary() {
  tail -n +3 "$2" |
    sed -E 's/.*"tokens_per_s": ?([0-9.eE+-]+).*"peak_rss_mib_min": ?([0-9.eE+-]+),"peak_rss_mib_max": ?([0-9.eE+-]+).*/\1 \3 \2/' |
    sort -n | awk -v label="$1" '{ t[NR] = $1; hi = $2; lo = $3 } END { i = int((NR + 1) / 2);
      printf "%-24s tokens/s %8.1f   peak RSS %.1f MiB (min over ranks %.1f)\n", label, t[i], hi, lo }'
}
# the transformers peer on the same model and tokens, or a line saying why not
peer() {
  if [ "${PEER:-1}" = 0 ]; then
    echo "torch peer skipped (PEER=0)"
  elif python3 -c 'import torch, transformers' 2> /dev/null; then
    python3 bench/torch_peer.py --model "$out/model" --data "$out/data.jsonl" --seq-len "$seq" \
      --batch-size "$batch" --steps "$steps" --threads "$threads" --modes fp32 \
      --experts-implementation eager 2> "$out/peer.log"
  else
    echo "torch peer skipped: torch/transformers not installed"
  fi
}
for ((r = 1; r <= rounds; r++)); do
  OPENBLAS_NUM_THREADS=$threads OMP_NUM_THREADS=$threads "$meshlm" train --model "$out/model" \
    --data "$out/data.jsonl" --steps "$steps" --batch-size "$batch" --seq-len "$seq" --lr 1e-3 \
    --metrics "$out/m.jsonl" > "$out/log"
  summary "meshlm 1 rank (round $r)" "$out/m.jsonl"
  peer
done
for ep in 1 2; do
  OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 mpiexec -n 2 "$meshlm" train --model "$out/model" \
    --data "$out/data.jsonl" --steps "$steps" --batch-size "$batch" --seq-len "$seq" --lr 1e-3 \
    --ep "$ep" --metrics "$out/m$ep.jsonl" > "$out/log$ep"
  summary "meshlm dp2 ep$ep (2x1 thr)" "$out/m$ep.jsonl"
  grep 'collectives of the last step' "$out/log$ep" | sed 's/^train: /  /'
  "$meshlm" plan --model "$out/model" --batch-size "$batch" --seq-len "$seq" --dp-shard 2 \
    --ep "$ep" | grep -E 'FSDP shards|peak of one training step' | sed 's/^ */  plan: /'
done
