#!/usr/bin/env bash
# make demo: the main job on its built-in default.
# 1. meshlm init: a `small` Llama-shaped model (~13M parameters, byte vocab);
# 2. meshlm train under mpirun -np 4 as dp_shard=2 x tp=2 on real text that
#    any fresh checkout has (this project's own sources and docs);
# 3. meshlm logprobs of a held-out sample with the initial and the trained
#    model. Fails unless the loss has clearly fallen.
# 4. meshlm plot: the loss curve, $out/loss.png when gnuplot is on PATH
#    (Debian: gnuplot-nox), else a sparkline on the terminal.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${DEMO_OUT:-build/demo}
steps=${DEMO_STEPS:-250}
meshlm=build/meshlm
rm -rf "$out"
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# idle OpenMP threads must sleep, not spin, or they steal the cores OpenBLAS computes on
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
ncores=$(nproc)
export OPENBLAS_NUM_THREADS=$(( ncores / 4 > 0 ? ncores / 4 : 1 )) OMP_NUM_THREADS=$(( ncores / 4 > 0 ? ncores / 4 : 1 ))

# Training text: every C source and header, then the docs; the sample
# scored at the end (the tail of the README) is held out.
find src -name '*.[ch]' | sort | xargs cat > "$out/corpus.txt"
head -c -1024 README.md >> "$out/corpus.txt"
tail -c 512 README.md | od -An -tu1 -v | tr -s ' \n' ' ' |
  awk '{ printf "{\"input_ids\": ["; for (i = 1; i <= NF; i++) printf "%s%s", (i > 1 ? ", " : ""), $i; print "]}" }' \
  > "$out/sample.jsonl"
echo "demo: corpus $(wc -c < "$out/corpus.txt") bytes, $steps steps on 4 ranks (dp_shard=2 x tp=2)"

"$meshlm" init --arch llama --preset small --seed 0 --out "$out/init"
mpirun -np 4 "$meshlm" train --model "$out/init" --data "$out/corpus.txt" --tp 2 \
  --steps "$steps" --batch-size 8 --seq-len 128 --lr 2e-3 --weight-decay 0.01 \
  --metrics "$out/metrics.jsonl" --export-hf "$out/trained"

mpirun -np 2 "$meshlm" logprobs --model "$out/init" --data "$out/sample.jsonl" --out "$out/lp_init.jsonl" --tp 2
mpirun -np 2 "$meshlm" logprobs --model "$out/trained" --data "$out/sample.jsonl" --out "$out/lp_trained.jsonl" --tp 2

mean_lp() { tr -d '{}[]"a-z:' < "$1" | tr ',' '\n' | awk '{ s += $1; n++ } END { printf "%.4f", s / n }'; }
loss() { sed -n "$1p" "$out/metrics.jsonl" | sed -E 's/.*"loss": ?([-0-9.eE+]+).*/\1/'; }
first=$(loss 1)
last=$(loss "$steps")
echo "demo: loss first step $first, last step $last"
echo "demo: held-out sample mean log-prob per byte: initial $(mean_lp "$out/lp_init.jsonl"), trained $(mean_lp "$out/lp_trained.jsonl")"
"$meshlm" plot "$out/metrics.jsonl" --out "$out/loss.png" # without gnuplot: a sparkline
awk -v a="$first" -v b="$last" 'BEGIN { if (b < a - 1.0) { print "demo: OK, the loss fell by " a - b; exit 0 }
                                          print "demo: FAILED, the loss did not fall clearly"; exit 1 }'
