#!/usr/bin/env bash
# Training throughput of a small Qwen3-MoE (`meshlm init --arch qwen3_moe --preset small`: 8
# layers, hidden 384, 4 experts of 256 features, top 2; ~13M parameters) on 1 rank, S=128,
# global batch 8, against the same model and tokens through transformers (bench/torch_peer.py:
# eager experts loop, sdpa attention, fp32, the same AdamW step), both on THREADS threads:
# median tokens/s and peak RSS; then 2 ranks x 1 thread, FSDP over dp_shard 2 without and with
# expert parallelism (--ep 2: each rank computes 2 of the 4 experts, tokens exchanged by
# all-to-all): median tokens/s, peak RSS per rank (max and min over ranks) and the collectives
# of the last step on rank 0 (the ep group's all-to-all bytes among them), and `meshlm plan`'s
# FSDP shard bytes per rank of both 2-rank meshes (parallel/ep.h: under --ep the experts are held
# by their ep rank alone). Figures for notes; nothing here is asserted.
# usage: bench/moe_throughput.sh [STEPS] [THREADS]   (after `make`; torch + transformers for the peer)
# env: MESHLM the binary (default build/meshlm, e.g. another build's for a before/after), PEER=0
# skips the transformers peer
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-8}
threads=${2:-2}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
meshlm=${MESHLM:-build/meshlm}
"$meshlm" init --arch qwen3_moe --preset small --out "$out/model" > /dev/null
awk 'BEGIN { srand(7); for (r = 0; r < 64; r++) { s = "";
  for (i = 0; i < 128; i++) s = s (i ? "," : "") int(rand() * 256); print "{\"input_ids\": [" s "]}" } }' \
  > "$out/data.jsonl"
OPENBLAS_NUM_THREADS=$threads OMP_NUM_THREADS=$threads "$meshlm" train --model "$out/model" \
  --data "$out/data.jsonl" --steps "$steps" --batch-size 8 --seq-len 128 --lr 1e-3 \
  --metrics "$out/m.jsonl" > "$out/log"
echo "Qwen3-MoE small, S=128, global batch 8, $threads threads, $steps steps (median of steps 3..$steps)"
# median tokens/s of steps 3.. of metrics file $2, and the last step's peak RSS (max, min over
# ranks), printed under label $1
summary() {
  tail -n +3 "$2" |
    sed -E 's/.*"tokens_per_s": ?([0-9.eE+-]+).*"peak_rss_mib_min": ?([0-9.eE+-]+),"peak_rss_mib_max": ?([0-9.eE+-]+).*/\1 \3 \2/' |
    sort -n | awk -v label="$1" '{ t[NR] = $1; hi = $2; lo = $3 } END { i = int((NR + 1) / 2);
      printf "%-24s tokens/s %8.1f   peak RSS %.1f MiB (min over ranks %.1f)\n", label, t[i], hi, lo }'
}
summary "meshlm 1 rank" "$out/m.jsonl"
for ep in 1 2; do
  OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 mpiexec -n 2 "$meshlm" train --model "$out/model" \
    --data "$out/data.jsonl" --steps "$steps" --batch-size 8 --seq-len 128 --lr 1e-3 --ep "$ep" \
    --metrics "$out/m$ep.jsonl" > "$out/log$ep"
  summary "meshlm dp2 ep$ep (2x1 thr)" "$out/m$ep.jsonl"
  grep 'collectives of the last step' "$out/log$ep" | sed 's/^train: /  /'
  "$meshlm" plan --model "$out/model" --batch-size 8 --seq-len 128 --dp-shard 2 --ep "$ep" |
    grep -E 'FSDP shards|peak of one training step' | sed 's/^ */  plan: /'
done
if [ "${PEER:-1}" = 0 ]; then
  echo "torch peer skipped (PEER=0)"
elif python3 -c 'import torch, transformers' 2> /dev/null; then
  python3 bench/torch_peer.py --model "$out/model" --data "$out/data.jsonl" --seq-len 128 \
    --batch-size 8 --steps "$steps" --threads "$threads" --modes fp32 \
    --experts-implementation eager 2> "$out/peer.log"
else
  echo "torch peer skipped: torch/transformers not installed"
fi
