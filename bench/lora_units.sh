#!/usr/bin/env bash
# Which FSDP units the LoRA adapters belong in (issue 33: "in their own small units or with their
# layer's unit"), priced on SmolLM2-135M at dp_shard 2 (S=128, global batch 4, r=16 all-linear):
# today the adapters' fp32 masters are parameters of their layer's unit (one all-gather of
# [adapters | base] per layer, forward and again in backward, and one reduce-scatter of the
# adapters' prefix). The alternatives move the same bytes and differ in calls:
#   own unit per layer: + one all-gather per layer gather (60 a step here), reduce-scatters the same;
#   one unit for every adapter: one all-gather of all adapters and one reduce-scatter at the end of
#   backward instead of 30, every adapter and its gradient held whole for the step.
# This runs the LoRA step (tokens/s, the time blocked on FSDP collectives, the run's collective
# count) and times single calls of the sizes involved (build/bench_collective_calls,
# bench/collective_calls.c) so that each alternative's change of calls is priced in microseconds. Per-rank shard
# sizes of SmolLM2-135M at dp_shard 2 (fp32 elements): one layer's base weights 3540096 / 2 =
# 1770048 (q, o 576x576; k, v 192x576; gate, up 1536x576, down 576x1536; two norms 576), its
# adapters r*(in+out) summed over the 7 linears 162816 / 2 = 81408, both 1851456, all 30 layers'
# adapters 2442240. Figures for notes; nothing here is asserted.
# usage: bench/lora_units.sh MODEL_DIR [STEPS [ITERS]]   (after `make`; MODEL_DIR: SmolLM2-135M)
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: bench/lora_units.sh MODEL_DIR [STEPS [ITERS]]}
steps=${2:-4}
iters=${3:-200}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
threads=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
export OPENBLAS_NUM_THREADS=$threads OMP_NUM_THREADS=$threads
find src -name '*.[ch]' | sort | xargs cat > "$out/corpus.txt"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
mpirun -np 2 build/meshlm train --model "$model" --data "$out/corpus.txt" --steps "$steps" \
  --batch-size 4 --seq-len 128 --lr 1e-4 --peak-tflops 1 --lora-rank 16 --lora-alpha 32 \
  --lora-targets all-linear --metrics "$out/m.jsonl" > "$out/train.log"
tail -n +2 "$out/m.jsonl" | sed -E 's/.*"tokens_per_s": ?([0-9.eE+-]+).*"fsdp_wait_ms": ?([0-9.eE+-]+).*/\1 \2/' |
  awk '{ printf "LoRA dp_shard 2 step: tokens/s %.1f, %.1f ms/step (512 tokens), blocked on FSDP collectives %.1f ms\n", $1, 512000 / $1, $2 }'
grep "collectives of the last step" "$out/train.log" | sed 's/^train: //'
mpirun -np 2 build/bench_collective_calls "$iters" 81408 1770048 1851456 2442240
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
