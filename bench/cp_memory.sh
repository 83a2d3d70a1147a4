#!/usr/bin/env bash
# Context parallelism at long sequences: peak RSS per rank, saved
# activations per rank (`meshlm plan`'s prediction: the engine's step on the
# meta backend) and tokens/s of training the SmolLM2-135M-shaped model
# (preset smollm2-135m: hidden 576, 30 layers, 9 heads / 3 kv heads, vocab
# 49152; random weights, fp32) on one sequence of S tokens per step, for
# each cp size: cp ranks on this machine's cores (threads per rank = cores /
# cp, OMP_WAIT_POLICY=passive; mpiexec --bind-to none, or Open MPI binds a
# lone rank's threads to one core). The preset's max_position_embeddings (8192,
# SmolLM2's) is raised to the longest S in the copied config.json: RoPE is
# unchanged, only the length check moves. Activation checkpointing `layer`
# from S >= AC_FROM (default 16384, where the fp32 activations of one rank
# no longer fit 24 GiB at cp=1). tokens/s is the last step's (the first
# includes the pools' first allocations); with STEPS=1 it is the first's.
# Figures for notes; nothing asserted.
# usage: bench/cp_memory.sh [STEPS [SEQS [CPS]]]   (after `make`)
#        e.g. bench/cp_memory.sh 2 "4096 8192" "1 2 4"
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-2}
seqs=${2:-"4096 8192 16384"}
cps=${3:-"1 2 4"}
ac_from=${AC_FROM:-16384}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=passive
cores=$(nproc)
longest=$(tr ' ' '\n' <<<"$seqs" | sort -n | tail -1)
build/meshlm init --arch llama --preset smollm2-135m --out "$out/m" > /dev/null
sed -i -E "s/(\"max_position_embeddings\": *)[0-9]+/\1$((longest > 8192 ? longest : 8192))/" \
  "$out/m/config.json"
find src -name '*.[ch]' | sort | xargs cat > "$out/corpus.txt" # bytes as token ids
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
field() { tail -n 1 "$1" | sed -E "s/.*\"$2\": ?([-0-9.eE+]+).*/\1/"; }
echo "smollm2-135m shape, fp32, 1 sequence per step, $steps step(s), $cores cores; $(lscpu |
  sed -nE 's/^Model name: +//p')"
printf "%6s %3s %-6s %8s %13s %13s %10s\n" S cp ac threads "act MiB/rank" "RSS MiB/rank" tokens/s
for S in $seqs; do
  ac=none
  [ "$S" -ge "$ac_from" ] && ac=layer
  for cp in $cps; do
    threads=$((cores / cp > 0 ? cores / cp : 1))
    act=$(build/meshlm plan --model "$out/m" --cp "$cp" --dp-shard 1 --batch-size 1 --seq-len "$S" \
      --activation-checkpointing "$ac" --json |
      sed -nE 's/.*"activations": ([0-9]+).*/\1/p' | head -1)
    OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads mpiexec --bind-to none -n "$cp" \
      build/meshlm train \
      --model "$out/m" --data "$out/corpus.txt" --cp "$cp" --steps "$steps" --batch-size 1 \
      --seq-len "$S" --activation-checkpointing "$ac" --peak-tflops 1 \
      --metrics "$out/m_${S}_$cp.jsonl" > /dev/null
    printf "%6s %3s %-6s %8s %13s %13.1f %10.1f\n" "$S" "$cp" "$ac" "$threads" "$(mib "$act")" \
      "$(field "$out/m_${S}_$cp.jsonl" peak_rss_mib_max)" \
      "$(field "$out/m_${S}_$cp.jsonl" tokens_per_s)"
  done
done
