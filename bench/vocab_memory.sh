#!/usr/bin/env bash
# Large vocabularies: peak RSS per rank of Gemma-3-270M (262,144-token
# vocabulary; its tied embedding / lm_head is 168 M of its 268 M parameters)
# training 2 steps of --seq-len 256, --batch-size 4 on 4 ranks, as 4-way FSDP
# and as dp_shard 2 x tp 2, against the ZeRO-3 estimate 16·Ψ/N + activations
# (fp32 parameter, gradient and two AdamW moments sharded over N = 4 ranks,
# plus `meshlm plan`'s saved activations per rank), with `meshlm plan`'s
# predicted step peak (the device pool) and its collective bytes per step.
# Needs the converted checkpoint in /work/real (tools/real_models.sh); skips
# without it. Figures for notes; nothing asserted.
# usage: bench/vocab_memory.sh [MODEL_DIR]   (after `make`; MESHLM=path picks another binary,
#        e.g. one built from an earlier commit, to compare)
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-/work/real/gemma3-270m-fp32}
meshlm=${MESHLM:-build/meshlm}
if [ ! -f "$model/config.json" ]; then
  echo "vocab_memory: no checkpoint at $model; skipped"
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=passive OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
S=256 B=4 N=4
echo "$model, S=$S, global batch $B, $N ranks x 1 thread, 2 steps ($meshlm)"
printf "%-16s %12s %16s %14s %14s %14s\n" mesh "16Ψ/N+act" "RSS/rank MiB" "device MiB" \
  "plan peak" "plan comm/step"
for mesh in "dp_shard 4:" "dp2 x tp2:--tp 2"; do
  name=${mesh%%:*}
  tp_flags=${mesh#*:}
  tp=1
  [ -n "$tp_flags" ] && tp=${tp_flags##* }
  # shellcheck disable=SC2086
  "$meshlm" plan --model "$model" --dp-shard $((N / tp)) $tp_flags --seq-len $S --batch-size $B \
    --json > "$out/plan.json"
  read -r est peak comm < <(python3 - "$out/plan.json" "$N" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1])); n = int(sys.argv[2])
r = d["per_tp_rank"][0]; m = r["memory_bytes"]
est = 16 * d["model"]["parameters"] / n + m["activations"]
comm = sum(k["bytes"] for g in r["train_step"].values() for k in g.values())
print(f"{est / 2**20:.0f} {m['train_peak'] / 2**20:.0f} {comm / 2**20:.0f}")
EOF
)
  # shellcheck disable=SC2086
  mpirun -np $N "$meshlm" train --model "$model" --data README.md --seq-len $S --batch-size $B \
    --steps 2 --lr 1e-5 $tp_flags --peak-tflops 1 --metrics "$out/m.jsonl" > "$out/train.log"
  rss=$(tail -n 1 "$out/m.jsonl" |
    sed -E 's/.*"peak_rss_mib_min": ?([0-9.]+).*"peak_rss_mib_max": ?([0-9.]+).*/\1 \2/' |
    awk '{ printf "%.0f-%.0f", $1, $2 }')
  dev=$(tail -n 1 "$out/m.jsonl" | sed -E 's/.*"device_peak_mib": ?([0-9.]+).*/\1/' |
    awk '{ printf "%.0f", $1 }')
  printf "%-16s %8s MiB %16s %14s %10s MiB %10s MiB\n" "$name" "$est" "$rss" "$dev" "$peak" "$comm"
done
lscpu | sed -nE 's/^Model name: *(.*)/CPU: \1/p' | head -n 1
