#!/usr/bin/env bash
# bf16 compute on CPU: training tokens/s of meshlm with --param-dtype fp32
# against bf16, and of the PyTorch peer (bench/torch_peer.py: transformers'
# LlamaForCausalLM, sdpa attention, AdamW, the same shapes and threads) in
# fp32 and in torch.autocast("cpu", dtype=torch.bfloat16), eager.
# Models and meshes:
#   small        (~13M parameters, byte vocabulary) S=128, global batch 8, on
#                the raw bytes of src/ as train_throughput.sh; 1 rank with
#                every core as threads, and 4 ranks dp_shard=2 x tp=2
#   smollm2-135m (SmolLM2-135M's shape, 134.5M parameters, tied) S=512,
#                global batch 4 (BENCH_SMOL_BATCH), on random ids (seed 0)
#                written as JSONL for both tools; 1 rank, and 4 ranks
#                dp_shard=4 (tp=2 does not divide its 9 heads);
#                BENCH_SMOL_SEQ_LENS="256 512" adds S=256
# The 4-rank meshes run cores/4 threads per rank (at least 1, oversubscribed
# where cores < 4). The peer runs once per model with every core as threads,
# and both meshes are compared with it (the same machine). Per row: median
# tokens/s over the steps after the first two, bf16/fp32, meshlm/torch
# (meshlm fp32 against torch fp32, meshlm bf16 against torch autocast bf16),
# MFU from meshlm's metrics ((6N + 12·L·H·S) per token against the GEMM
# peak meshlm measures at start-up in the run's dtype — fp32, or bf16 on
# the CPU's bf16 units — or BENCH_PEAK_TFLOPS; the peer's fp32 and bf16 MFU
# are against the 1-rank fp32 and bf16 runs' peaks),
# the peak RSS (meshlm: its largest rank; the peer: its process, which
# holds both modes) and meshlm's minor page faults per step (the median of
# --metrics' minor_faults: 0 once the pools hold the step's buffers). The
# ISA oneDNN dispatches to (DNNL_VERBOSE) and its bf16 matmul are printed. BENCH_TORCH_COMPILE=1 adds torch.compile rows (the first
# step compiles: a minute for small, several for smollm2-135m on 2 cores);
# without torch installed (pip install torch transformers; never in CI) the
# peer's rows are skipped. Figures for notes; nothing here is asserted. On
# shared cores other load moves both tokens/s and the start-up peak (so MFU
# past 100%): the load average is printed before and after; compare ratios
# within one run. 2 cores: about 9 minutes with STEPS=12 SMOL_STEPS=4.
# usage: bench/bf16_throughput.sh [STEPS [SMOL_STEPS]]   (after `make`; defaults 12 and 5)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-12}
smol_steps=${2:-5}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# idle OpenMP threads must sleep, not spin, or they steal the cores OpenBLAS computes on
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
cores=$(nproc)
threads4=$(( cores / 4 > 0 ? cores / 4 : 1 ))
peak=${BENCH_PEAK_TFLOPS:-0}
smol_batch=${BENCH_SMOL_BATCH:-4}
modes=fp32,bf16
[ "${BENCH_TORCH_COMPILE:-0}" = 1 ] && modes=$modes,compile-fp32,compile-bf16
have_torch=1
python3 -c 'import torch, transformers' 2> /dev/null || have_torch=0

median() { # metrics file, key: median over the steps after the first two
  tail -n +3 "$1" | sed -E "s/.*\"$2\": ?([0-9.eE+-]+).*/\1/" | sort -g |
    awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}
last() { tail -n 1 "$1" | sed -E "s/.*\"$2\": ?([0-9.eE+-]+).*/\1/"; }
field() { sed -nE "s/.*mode=$2 .*$3=([0-9.eE+-]+).*/\1/p" "$1"; } # peer output, mode, key
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || b == 0) print "-"; else printf "%.2f", a / b }'; }
pct() { awk -v a="$1" 'BEGIN { if (a == "") print "-"; else printf "%.1f%%", 100 * a }'; }
progress() { echo "bf16_throughput: $*" >&2; }

meshlm_run() { # tag, np, threads, dtype, train args...: writes $out/tag.jsonl
  local tag=$1 np=$2 th=$3 dtype=$4
  shift 4
  progress "meshlm $tag"
  if [ "$np" = 1 ]; then
    OPENBLAS_NUM_THREADS=$th OMP_NUM_THREADS=$th build/meshlm "$@" --param-dtype "$dtype" \
      --peak-tflops "$peak" --metrics "$out/$tag.jsonl" > "$out/$tag.log"
  else
    OPENBLAS_NUM_THREADS=$th OMP_NUM_THREADS=$th mpirun -np "$np" build/meshlm "$@" \
      --param-dtype "$dtype" --peak-tflops "$peak" --metrics "$out/$tag.jsonl" > "$out/$tag.log"
  fi
}

row() { # label, fp32 tok/s, bf16 tok/s, MFU fp32, MFU bf16, RSS fp32, RSS bf16, vs torch fp32, vs torch bf16, faults/step fp32, bf16
  printf "%-36s %9s %9s %6s %7s %7s %8s %8s %7s %7s %7s %7s\n" "$@"
}

# bench: model tag, preset, S, B, steps, data file, mesh-4 flags, mesh-4 label
bench() {
  local tag=$1 preset=$2 S=$3 B=$4 n=$5 data=$6 flags4=$7 label4=$8
  local args=(train --model "$out/$preset" --data "$data" --steps "$n" --batch-size "$B"
              --seq-len "$S" --lr 1e-3)
  local m1=$tag-1 m4=$tag-4 t=$out/$tag-torch.txt
  meshlm_run "$m1-fp32" 1 "$cores" fp32 "${args[@]}"
  meshlm_run "$m1-bf16" 1 "$cores" bf16 "${args[@]}"
  # shellcheck disable=SC2086 # flags4 is a word list
  meshlm_run "$m4-fp32" 4 "$threads4" fp32 "${args[@]}" $flags4
  # shellcheck disable=SC2086
  meshlm_run "$m4-bf16" 4 "$threads4" bf16 "${args[@]}" $flags4
  : > "$t"
  if [ "$have_torch" = 1 ]; then
    progress "torch peer $tag ($modes)"
    OMP_NUM_THREADS=$cores python3 bench/torch_peer.py --model "$out/$preset" --data "$data" \
      --seq-len "$S" --batch-size "$B" --steps "$n" --threads "$cores" --modes "$modes" \
      --lr 1e-3 > "$t" 2> "$out/$tag-torch.log" || progress "torch peer failed: $(tail -n 1 "$out/$tag-torch.log")"
  fi
  local tf tb
  tf=$(field "$t" fp32 tokens_per_s)
  tb=$(field "$t" bf16 tokens_per_s)
  echo
  echo "$preset, S=$S, global batch $B, $n steps (median of steps 3..$n)"
  row "" "tok/s" "tok/s" "bf16/" "MFU" "MFU" "RSS MiB" "RSS MiB" "/torch" "/torch" "flt/stp" "flt/stp"
  row "" "fp32" "bf16" "fp32" "fp32" "bf16" "fp32" "bf16" "fp32" "bf16" "fp32" "bf16"
  local m lab
  for m in "$m1" "$m4"; do
    if [ "$m" = "$m1" ]; then lab="meshlm 1 rank x $cores thr"; else lab="meshlm $label4 x $threads4 thr"; fi
    local f b
    f=$(median "$out/$m-fp32.jsonl" tokens_per_s)
    b=$(median "$out/$m-bf16.jsonl" tokens_per_s)
    row "$lab" "$(printf %.1f "$f")" "$(printf %.1f "$b")" "$(ratio "$b" "$f")" \
      "$(pct "$(median "$out/$m-fp32.jsonl" mfu)")" "$(pct "$(median "$out/$m-bf16.jsonl" mfu)")" \
      "$(printf %.1f "$(last "$out/$m-fp32.jsonl" peak_rss_mib_max)")" \
      "$(printf %.1f "$(last "$out/$m-bf16.jsonl" peak_rss_mib_max)")" \
      "$(ratio "$f" "$tf")" "$(ratio "$b" "$tb")" \
      "$(median "$out/$m-fp32.jsonl" minor_faults)" "$(median "$out/$m-bf16.jsonl" minor_faults)"
  done
  printf "meshlm's measured peaks (TFLOP/s, GEMM 1024^3 in the run's dtype at start-up; BENCH_PEAK_TFLOPS fixes one):"
  for m in "$m1" "$m4"; do
    printf " %s fp32 %.3f bf16 %.3f;" "${m##*-}-rank" "$(last "$out/$m-fp32.jsonl" peak_tflops)" \
      "$(last "$out/$m-bf16.jsonl" peak_tflops)"
  done
  echo
  if [ "$have_torch" = 0 ]; then
    echo "torch peer skipped: python3 cannot import torch and transformers (pip install torch transformers)"
    return
  fi
  # the peer's MFU: against the peaks of the 1-rank runs of its dtype
  local f1 mfu1 b1 mfub1 p
  f1=$(median "$out/$m1-fp32.jsonl" tokens_per_s)
  mfu1=$(median "$out/$m1-fp32.jsonl" mfu)
  b1=$(median "$out/$m1-bf16.jsonl" tokens_per_s)
  mfub1=$(median "$out/$m1-bf16.jsonl" mfu)
  for p in "" compile-; do
    [ "$p" = compile- ] && [ "${BENCH_TORCH_COMPILE:-0}" != 1 ] && continue
    if grep -q "mode=${p}fp32 skipped\|mode=${p}bf16 skipped" "$t"; then
      grep "skipped" "$t"
      continue
    fi
    local pf pb
    pf=$(field "$t" "${p}fp32" tokens_per_s)
    pb=$(field "$t" "${p}bf16" tokens_per_s)
    [ -z "$pf$pb" ] && { echo "torch peer ${p:-eager} gave no figures (see its log)"; continue; }
    row "torch ${p:-eager-}sdpa x $cores thr" "$pf" "$pb" "$(ratio "$pb" "$pf")" \
      "$(pct "$(awk -v a="$pf" -v m="$mfu1" -v f="$f1" 'BEGIN { if (a != "") print a * m / f }')")" \
      "$(pct "$(awk -v a="$pb" -v m="$mfub1" -v f="$b1" 'BEGIN { if (a != "") print a * m / f }')")" \
      "$(field "$t" "${p}fp32" peak_rss_mib)" "$(field "$t" "${p}bf16" peak_rss_mib)" "" ""
  done
}

model=$(lscpu | sed -nE 's/^Model name: *//p' | head -n 1)
family=$(lscpu | sed -nE 's/^CPU family: *//p' | head -n 1)
cpumodel=$(lscpu | sed -nE 's/^Model: *//p' | head -n 1)
flags=$(lscpu | sed -nE 's/^Flags: *//p')
has() { case " $flags " in *" $1 "*) echo yes ;; *) echo no ;; esac; }
echo "CPU: $model (family $family, model $cpumodel), $cores cores; amx_tile: $(has amx_tile)," \
  "avx512_bf16: $(has avx512_bf16), avx512f: $(has avx512f)"
if [ "$have_torch" = 1 ]; then
  python3 -c 'import torch, transformers; print("peer: torch", torch.__version__, "(" + torch.backends.cpu.get_cpu_capability() + ", oneDNN bf16:", str(torch.ops.mkldnn._is_mkldnn_bf16_supported()) + "), transformers", transformers.__version__)'
fi
git log -1 --format='meshlm: %h %s' 2> /dev/null || true
# the cores may be shared: the load before and after says how much the figures can be trusted
echo "load average at start: $(cut -d ' ' -f 1-3 /proc/loadavg)"

find src -name '*.[ch]' | sort | xargs cat > "$out/corpus.txt"
build/meshlm init --arch llama --preset small --out "$out/small" > /dev/null
build/meshlm init --arch llama --preset smollm2-135m --out "$out/smollm2-135m" > /dev/null
# oneDNN's ISA and the implementation of the start-up calibration's bf16 matmul
OMP_NUM_THREADS=1 DNNL_VERBOSE=1 build/meshlm train --model "$out/small" --data "$out/corpus.txt" \
  --steps 1 --batch-size 1 --seq-len 16 --param-dtype bf16 > "$out/dnnl.txt" 2> /dev/null || true
sed -nE '/^onednn_verbose,info,cpu,isa:/s/^[^:]*:/oneDNN ISA: /p
  /^onednn_verbose,exec,cpu,matmul,/{s/^onednn_verbose,exec,cpu,matmul,([^,]*),.*/oneDNN bf16 matmul (1024^3): \1/p;q}' \
  "$out/dnnl.txt"
bench small small 128 8 "$steps" "$out/corpus.txt" "--tp 2" "4 ranks dp_shard=2 x tp=2"
for S in ${BENCH_SMOL_SEQ_LENS:-512}; do
  # random ids in [0, 49152), seed 0: one sequence per line, enough for every step
  awk -v n=$(( smol_batch * smol_steps )) -v S="$S" 'BEGIN { srand(0); for (i = 0; i < n; i++) {
    printf "{\"input_ids\": [%d", int(rand() * 49152); for (t = 1; t < S; t++) printf ", %d", int(rand() * 49152)
    print "]}" } }' > "$out/ids-$S.jsonl"
  bench "smol-$S" smollm2-135m "$S" "$smol_batch" "$smol_steps" "$out/ids-$S.jsonl" "" \
    "4 ranks dp_shard=4"
done
echo
echo "load average at end: $(cut -d ' ' -f 1-3 /proc/loadavg)"
