#!/usr/bin/env bash
# Memory per step where GEMM shapes follow the data, with oneDNN's primitive cache at its default
# (DNNL_PRIMITIVE_CACHE_CAPACITY=1024: meshlm leaves a capacity the environment sets) and as
# meshlm bounds it (backend/cpu/cpu.h, ML_CPU_GEMM_ONEDNN_CACHE): a Qwen3-MoE `small` (each
# expert's GEMMs see a new M, its routed tokens, every step) on 2 ranks x 1 thread, dp_shard 2
# without and with --ep 2, and the dense llama `small` on the same mesh (fixed shapes: the
# control), S 128, global batch 8, --corpus's text; per run the peak RSS (max over ranks) at steps
# 1, 5, 10, 15, 20, the mean minor page faults a step over steps 5..20 and the median tokens/s of
# steps 5..20. The runs go one after the other: on a shared machine tokens/s swings with the
# load (compare RSS and faults; repeat before/after for tokens/s). Figures for notes; nothing here
# is asserted.
# usage: bench/gemm_cache_memory.sh CORPUS [STEPS]   (after `make`; CORPUS: a text file)
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${1:?usage: bench/gemm_cache_memory.sh CORPUS [STEPS]}
steps=${2:-20}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
build/meshlm init --arch qwen3_moe --preset small --out "$out/moe" > /dev/null
build/meshlm init --preset small --out "$out/dense" > /dev/null
# the per-run line of metrics file $2 under label $1
summary() {
  python3 - "$1" "$2" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[2])]
rss = [round(r["peak_rss_mib_max"]) for r in rows]
late = rows[4:]
tps = sorted(r["tokens_per_s"] for r in late)
print("%-22s RSS MiB %s  faults/step %d  tokens/s %.0f" % (
    sys.argv[1], " ".join(str(rss[i - 1]) for i in (1, 5, 10, 15, 20) if i <= len(rss)),
    sum(r["minor_faults"] for r in late) // max(len(late), 1), tps[len(tps) // 2] if tps else 0))
PY
}
for run in "moe 1" "moe 2" "dense 1"; do
  set -- $run
  for cache in default bounded; do
    env=()
    [ "$cache" = default ] && env=(-x DNNL_PRIMITIVE_CACHE_CAPACITY=1024)
    mpiexec -n 2 --bind-to none -x OMP_NUM_THREADS=1 -x OMP_WAIT_POLICY=passive "${env[@]}" \
      build/meshlm train --model "$out/$1" --data "$corpus" --steps "$steps" --ep "$2" \
      --metrics "$out/m.jsonl" > "$out/log"
    summary "$1 ep$2 $cache" "$out/m.jsonl"
  done
done
