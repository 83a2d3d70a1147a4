#!/usr/bin/env bash
# meshlm on one NVIDIA GPU (--device cuda): training throughput, MFU and
# peak device memory on the Llama-3.2-1B shape (preset llama3.2-1b: hidden
# 2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192, vocab 128256,
# tied; random weights), bf16 (--param-dtype bf16: bf16 GEMM operands, fp32
# accumulation, fp32 master weights and AdamW state) at S = SEQ, global
# batch BATCH sequences (one micro-batch, one rank); then the PyTorch peer
# (bench/torch_peer.py --device cuda: transformers' LlamaForCausalLM, sdpa
# attention, autocast bf16, AdamW, clip 1.0) eager and under torch.compile
# on the same model, tokens and device; then `meshlm logprobs` throughput
# on an RL scoring batch (LP_SEQS sequences x LP_LEN tokens).
#
# MFU = (6N + 12·L·H·S) FLOPs/token × tokens/s against PEAK_TFLOPS (989:
# the H100 SXM's dense bf16 peak; pass 989 on an H200 too, the same chip).
# Per row: median tokens/s over the steps after the first two, MFU, and
# peak device memory (meshlm: its pool's peak, torch.cuda's
# max_memory_allocated count; torch: max_memory_allocated). Figures for
# notes; nothing is asserted.
# usage: bench/cuda_train.sh [SEQ [BATCH [STEPS]]]   (after `make`, on a GPU machine;
#        defaults 2048, 8, 12; LP_SEQS=64 LP_LEN=1024 PEAK_TFLOPS=989 MODEL=DIR to reuse
#        a model directory; LR=3e-4 the learning rate of both; PEER_MODES=bf16 for the eager peer alone (default
#        bf16,compile-bf16); DEVICE=cpu runs the same on the CPU, for a dry run of this
#        script with PRESET=tiny)
set -euo pipefail
cd "$(dirname "$0")/.."
S=${1:-2048}
B=${2:-8}
STEPS=${3:-12}
LP_SEQS=${LP_SEQS:-64}
LP_LEN=${LP_LEN:-1024}
PEAK=${PEAK_TFLOPS:-989}
LR=${LR:-3e-4} # both sides: their losses track each other step by step (bf16 rounding apart)
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-llama3.2-1b}
PEER_MODES=${PEER_MODES:-bf16,compile-bf16}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
model=${MODEL:-$out/m}
[ -n "${MODEL:-}" ] || build/meshlm init --arch llama --preset "$PRESET" --out "$model" >&2
vocab=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' \
  "$model/config.json")
ids() { # N sequences of LEN random ids in [0, vocab) as JSONL
  awk -v n="$1" -v S="$2" -v V="$vocab" 'BEGIN { srand(0); for (i = 0; i < n; i++) {
    printf "{\"input_ids\": [%d", int(rand() * V)
    for (t = 1; t < S; t++) printf ", %d", int(rand() * V)
    print "]}" } }'
}
ids "$B" "$S" > "$out/train.jsonl"
ids "$LP_SEQS" "$LP_LEN" > "$out/score.jsonl"
median() { sort -g | awk '{ v[NR] = $1 } END { print NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
key() { sed -nE "s/.*\"$1\": ?([0-9.eE+-]+).*/\1/p"; }

build/meshlm train --device "$DEVICE" --model "$model" --data "$out/train.jsonl" \
  --param-dtype bf16 --seq-len "$S" --batch-size "$B" --steps "$STEPS" --lr "$LR" \
  --peak-tflops "$PEAK" --metrics "$out/m.jsonl" >&2
tps=$(tail -n +3 "$out/m.jsonl" | key tokens_per_s | median)
mfu=$(tail -n +3 "$out/m.jsonl" | key mfu | median)
mem=$(key device_peak_mib < "$out/m.jsonl" | sort -g | tail -n 1)
printf "%-24s %12s %8s %14s\n" run tokens/s MFU "peak dev MiB"
printf "%-24s %12.0f %7.1f%% %14.0f\n" "meshlm bf16" "$tps" "$(awk -v m="$mfu" 'BEGIN { print 100 * m }')" "$mem"

if python3 -c 'import torch, transformers' 2> /dev/null; then
  python3 bench/torch_peer.py --device "$DEVICE" --model "$model" --data "$out/train.jsonl" \
    --seq-len "$S" --batch-size "$B" --steps "$STEPS" --lr "$LR" --modes "$PEER_MODES" > "$out/peer.txt"
  # FLOPs per token as meshlm's metrics count them: its MFU / tokens/s × peak
  fpt=$(awk -v m="$mfu" -v t="$tps" -v p="$PEAK" 'BEGIN { print m * p * 1e12 / t }')
  for mode in ${PEER_MODES//,/ }; do
    line=$(grep "mode=$mode " "$out/peer.txt" || true)
    if [ -z "$line" ] || grep -q "mode=$mode skipped" "$out/peer.txt"; then
      echo "torch $mode: skipped"; continue
    fi
    t=$(sed -nE 's/.*tokens_per_s=([0-9.]+).*/\1/p' <<< "$line")
    d=$(sed -nE 's/.*peak_device_mib=([0-9.]+).*/\1/p' <<< "$line")
    printf "%-24s %12.0f %7.1f%% %14.0f   meshlm/torch %.2f\n" "torch $mode" "$t" \
      "$(awk -v f="$fpt" -v t="$t" -v p="$PEAK" 'BEGIN { print 100 * f * t / (p * 1e12) }')" \
      "${d:-0}" "$(awk -v a="$tps" -v b="$t" 'BEGIN { print a / b }')"
  done
else
  echo "torch peer: skipped (no torch/transformers)"
fi

start=$(date +%s.%N)
build/meshlm logprobs --device "$DEVICE" --model "$model" --data "$out/score.jsonl" \
  --out "$out/lp.jsonl" --param-dtype bf16 >&2
end=$(date +%s.%N)
awk -v n="$LP_SEQS" -v s="$LP_LEN" -v a="$start" -v b="$end" 'BEGIN {
  printf "meshlm logprobs bf16: %d x %d tokens in %.2f s (%.0f tokens/s, model load included)\n",
         n, s, b - a, n * s / (b - a) }'
if [ "$DEVICE" = cuda ]; then nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; fi
