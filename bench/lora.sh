#!/usr/bin/env bash
# LoRA (--lora-rank, engine/lora.h) against full fine-tuning: S=SEQ (default 512), global batch
# BATCH (default 4), full vs --lora-rank RANK (default 16) --lora-alpha 2*RANK on every linear of
# the decoder (all-linear), on each mesh of MESHES (default "1"): median tokens/s, the largest
# peak RSS of a rank, `meshlm plan`'s FSDP shards, step peak and collectives of one training step
# (calls and bytes per group, tp rank 0, the same flags) beside the run's own count of its last step;
# with DROPOUT > 0 a third run with --lora-dropout DROPOUT (model/lora_drop.h: the masks drawn on
# the host, forward and again in backward). MODEL: an HF checkpoint directory with its tokenizer
# (real weights; default: the smollm2-135m preset, random weights). A mesh is 1, dpN (dp_shard N)
# or dpNxtpM (dp_shard N x tp M); its ranks share the cores (nproc / ranks threads each, at least
# 1: more ranks than cores run oversubscribed). Figures for notes; nothing here is asserted.
# usage: [MODEL=DIR] [MESHES="1 dp2 dp2xtp2"] [SEQ=512] [BATCH=4] bench/lora.sh [STEPS [RANK [DROPOUT]]]
# (after `make`)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-4}
rank=${2:-16}
dropout=${3:-0}
seq=${SEQ:-512}
batch=${BATCH:-4}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# idle OpenMP threads must sleep, not spin, or they steal the cores OpenBLAS computes on
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
cores=$(nproc)
find src -name '*.[ch]' | sort | xargs cat > "$out/corpus.txt"
model=${MODEL:-}
if [ -z "$model" ]; then
  model="$out/model"
  build/meshlm init --arch llama --preset smollm2-135m --out "$model" > /dev/null
fi
args=(train --model "$model" --data "$out/corpus.txt" --steps "$steps" --batch-size "$batch"
      --seq-len "$seq" --lr 1e-4 --peak-tflops "${BENCH_PEAK_TFLOPS:-1}")
lora=(--lora-rank "$rank" --lora-alpha $((2 * rank)) --lora-targets all-linear)
drop=(--lora-dropout "$dropout")

# shellcheck source=bench/metrics_report.sh
. bench/metrics_report.sh
plan_step() { # flags: plan's step peak and the training step's collectives (tp rank 0)
  build/meshlm plan --model "$model" --batch-size "$batch" --seq-len "$seq" "$@" |
    awk '/FSDP shards|peak of one training step/ && !seen[substr($0, 1, 20)]++ {
           sub(/^ */, "  plan: "); print }
         /^tp rank 0:/ { on = 1; next }
         on && /one training step/ { step = 1; next }
         step && /calls/ { sub(/^ */, "  plan: "); print; next }
         step { step = 0; on = 0 }'
}
mesh_flags() { # mesh → "ranks|plan flags|train flags"
  case $1 in
    1) echo "1||" ;;
    dp[0-9]*x*tp[0-9]*) local d=${1#dp} t=${1#*tp}; d=${d%%x*}
      echo "$((d * t))|--dp-shard $d --tp $t|--tp $t" ;;
    dp[0-9]*) echo "${1#dp}|--dp-shard ${1#dp}|" ;;
    *) echo "bench/lora.sh: MESHES entry '$1': expected 1, dpN or dpNxtpM" >&2; return 1 ;;
  esac
}
run() { # label, ranks, train flags...
  local tag=$1 n=$2
  shift 2
  local threads=$((cores / n > 0 ? cores / n : 1))
  OPENBLAS_NUM_THREADS=$threads OMP_NUM_THREADS=$threads \
    mpirun -np "$n" build/meshlm "${args[@]}" "$@" --metrics "$out/$tag.jsonl" > "$out/$tag.log"
  report "$out/$tag.jsonl" "$tag"
  grep "collectives of the last step" "$out/$tag.log" | sed 's/^train: /  run: /; s/:$/: none/'
}

echo "$(basename "$model"), S=$seq, global batch $batch, $cores cores, $steps steps (median of steps 2..$steps)"
for mesh in ${MESHES:-1}; do
  IFS='|' read -r n pflags tflags <<< "$(mesh_flags "$mesh")"
  # shellcheck disable=SC2206  # the flags split on spaces
  pf=($pflags) tf=($tflags)
  echo "== mesh $mesh: $n rank(s) x $((cores / n > 0 ? cores / n : 1)) thread(s)$([ "$n" -gt "$cores" ] && echo ", oversubscribed: $n ranks on $cores cores")"
  echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
  run "full-$mesh" "$n" "${tf[@]}"
  plan_step "${pf[@]}"
  run "lora-r$rank-$mesh" "$n" "${tf[@]}" "${lora[@]}"
  plan_step "${pf[@]}" "${lora[@]}"
  if [ "$dropout" != 0 ]; then
    run "lora-r$rank-drop$dropout-$mesh" "$n" "${tf[@]}" "${lora[@]}" "${drop[@]}"
    plan_step "${pf[@]}" "${lora[@]}" "${drop[@]}"
  fi
  echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
done
