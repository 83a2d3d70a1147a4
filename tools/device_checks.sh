#!/usr/bin/env bash
# Everything the CUDA backend must pass on a GPU machine, in one command of
# at most ~7 minutes for an offline, bare machine (the device tool), in
# stages that each run even when the one before failed:
#   preflight  unpack the packages tools/device_bundle.sh gathered into
#              MESHLM_RT (tools/device_env.sh), then nvidia-smi, ldd of every
#              binary and library of the bundle and of the unpacked tree (no
#              "not found"), `mpiexec -n 1 true`, lscpu, and where the
#              machine's libnccl.so.2 is (loaded at run time, not carried)
#   ctest      CUDA_LAUNCH_BLOCKING=1 ctest -L '^cuda$' -j4 (the label exactly:
#              -L is a regular expression, and plain 'cuda' also selects the
#              emulator's cuda_emu tests, not in the bundle; every kernel against
#              the CPU backend, every fixture family's log-probs and training
#              step against the CPU, the staged and NCCL comms against MPI on
#              1 and 2 ranks sharing the GPU, training on 2 and 4 ranks sharing
#              it against 1; 90 s a test, the bundle's build sets it), at most
#              CTEST_S (default 170) seconds in all
#   bench      bench/cuda_train.sh with few steps and the PyTorch eager peer
#              only (no torch.compile), at most BENCH_S (default 180) seconds
# and, named only (not by default), the figures of a tuning pass:
#   peak       bench/gemm_peak.py: a large bf16 GEMM's rate through PyTorch
#              (cuBLAS), the measured ceiling for MFU (60 s at most)
#   profile    MESHLM_OP_PROFILE=1 on 2 training steps of the bench's
#              Llama-3.2-1B shape (S 2048, batch 8, bf16): the last step's time
#              per operator (src/backend/profile.h) into profile.log, the six
#              heaviest classes in the summary (PROFILE_S, default 120, seconds;
#              PROFILE_DEVICE=cpu PROFILE_PRESET=tiny PROFILE_SEQ=64: a dry run here)
#   generate   bench/generate_throughput.py --device cuda: decode tokens/s of
#              the smollm2-135m preset at batches GEN_BATCHES (default
#              1,8,64), prompt 128, GEN_NEW (default 128) new tokens, meshlm and
#              (where transformers imports) transformers' generate() on the
#              GPU (GEN_S, default 150, seconds)
#   attention  build/bench_cuda_attention (bf16 on ATTN_SHAPES, default the
#              Llama-3.2-1B and Llama-3-8B attention shapes at S 2048; fp32 on
#              the first) and bench/attention_peer.py (PyTorch SDPA's flash
#              and cuDNN backends) on the same shapes (ATTENTION_S, default
#              120, seconds)
# Every stage logs into OUT (the device tool's $OUT; default
# /tmp/meshlm-device) and appends `STAGE STATUS SECONDS DETAIL` to
# OUT/summary.txt (STATUS ok, fail, no-gpu for a preflight that finds no
# GPU, skipped for a ctest where tests skipped and none failed). Exits 0
# when every stage it ran is ok.
# usage: tools/device_checks.sh [STAGE...]   (default: preflight ctest bench; also peak,
#        profile; from the
#        repository root with .device carried; MESHLM_BUNDLE=DIR for another bundle,
#        MESHLM_RT=DIR where to unpack it, default /tmp/meshlm-rt)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
root=$(pwd -P)
bundle=${MESHLM_BUNDLE:-.device}
# the build as tools/device_bundle.sh packs it
if [ ! -f "$bundle/build/CTestTestfile.cmake" ] && [ -f "$bundle/build.tar.xz" ]; then
  tar -C "$bundle" -xJf "$bundle/build.tar.xz" || exit 2
fi
if [ ! -f "$bundle/build/CTestTestfile.cmake" ]; then
  echo "device_checks.sh: no bundle at $bundle (build/CTestTestfile.cmake and build.tar.xz" \
    "missing): run" \
    "tools/device_bundle.sh and carry .device" >&2
  exit 2
fi
bundle=$(cd "$bundle" && pwd -P)
rt=${MESHLM_RT:-/tmp/meshlm-rt}
out=${OUT:-/tmp/meshlm-device}
mkdir -p "$out" "$rt"
summary=$out/summary.txt
: > "$summary"
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(preflight ctest bench)
failed=0
# record STAGE STATUS START DETAIL: one summary line (and on stdout)
record() {
  local line
  line="$1 $2 $(($(date +%s) - $3)) ${*:4}"
  echo "$line" | tee -a "$summary"
  [ "$2" = ok ] || failed=1
}

# The build has this checkout's absolute paths compiled in (the CTest files,
# the tests' fixture directory, meshlm's RUNPATH to its library): make the
# source directory lead to this copy and the build directory to the bundle's
# (and, for bench/cuda_train.sh, ./build too).
src=$(sed -n 's/^# Source directory: //p' "$bundle/build/CTestTestfile.cmake")
bdir=$(sed -n 's/^# Build directory: //p' "$bundle/build/CTestTestfile.cmake")
if [ -n "$src" ] && [ "$src" != "$root" ] && [ ! -e "$src" ]; then
  mkdir -p "$(dirname "$src")" && ln -s "$root" "$src"
fi
links=("$bdir")
[[ " ${stages[*]} " != *" bench "* && " ${stages[*]} " != *" profile "* &&
  " ${stages[*]} " != *" generate "* ]] || links+=("$root/build")
for b in "${links[@]}"; do
  if [ -n "$b" ] && [ ! -e "$b" ]; then mkdir -p "$(dirname "$b")" && ln -s "$bundle/build" "$b"; fi
done

# The unpacked packages' environment, in this shell (every stage runs under it).
for f in "$bundle"/debs/*.deb; do [ -e "$f" ] && dpkg -x "$f" "$rt"; done
# shellcheck source=tools/device_env.sh
. tools/device_env.sh "$rt" 2> "$out/device_env.log"
env_rc=$?
export LD_LIBRARY_PATH="$bundle/build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

preflight() {
  local t0 gpu=ok detail=() nf
  t0=$(date +%s)
  [ "$env_rc" -eq 0 ] || detail+=("device_env.sh failed: $(head -c 300 "$out/device_env.log")")
  if ! command -v nvidia-smi > /dev/null; then
    gpu=no-gpu detail+=("no GPU: nvidia-smi not found")
    echo "nvidia-smi: not found" > "$out/nvidia-smi.txt"
  elif ! nvidia-smi > "$out/nvidia-smi.txt" 2>&1; then
    gpu=no-gpu detail+=("no GPU: nvidia-smi failed ($(head -n 1 "$out/nvidia-smi.txt"))")
  fi
  # ldd of the bundle's binaries and libraries and of every library unpacked
  {
    find -L "$bundle/build" -type f \( -perm -u+x -o -name '*.so*' \)
    find -L "$rt" -type f -name '*.so*'
    find -L "$rt/usr/bin" -type f -perm -u+x
  } 2> /dev/null | sort -u | while read -r f; do
    [ "$(od -An -tx1 -N4 "$f" | tr -d ' ')" = 7f454c46 ] || continue
    echo "== $f"
    ldd "$f" 2>&1
  done > "$out/ldd.txt"
  nf=$(grep -c 'not found' "$out/ldd.txt")
  if [ "$nf" -gt 0 ]; then
    detail+=("ldd: $nf not found (ldd.txt): $(grep -B0 'not found' "$out/ldd.txt" | sort -u |
      head -n 5 | tr -s ' \t' ' ' | tr '\n' ';')")
    grep -e '^==' -e 'not found' "$out/ldd.txt" | grep -B1 'not found' | grep '^==' |
      head -n 5 > "$out/ldd_not_found_in.txt"
  fi
  if ! timeout 60 mpiexec -n 1 true > "$out/mpiexec.txt" 2>&1; then
    detail+=("mpiexec -n 1 true failed ($(command -v mpiexec), mpiexec.txt)")
  fi
  lscpu > "$out/lscpu.txt" 2>&1
  grep -E '^(Model name|Flags)' "$out/lscpu.txt" | grep -o 'Model name.*\|avx512f\|amx_tile' |
    tr -s ' \n' ' ' > "$out/cpu.txt"
  # NCCL is not in the bundle: the machine's own libnccl.so.2, if any, serves meshes of several
  # ranks (loaded at run time; without it they use the staged comm)
  local nccl
  nccl=$(ldconfig -p 2> /dev/null | sed -n 's/.*libnccl\.so\.2 .*=> //p' | head -n 1)
  local status=ok
  [ ${#detail[@]} -eq 0 ] || status=fail
  [ "$gpu" = ok ] || status=no-gpu
  record preflight "$status" "$t0" "${detail[*]:-}" "cpu: $(cat "$out/cpu.txt");" \
    "nccl: ${nccl:-none (ldconfig)}"
}

ctest_stage() {
  local t0 rc
  t0=$(date +%s)
  (cd "$bundle/build" && CUDA_LAUNCH_BLOCKING=1 timeout -k 5 "${CTEST_S:-170}" \
    ctest -L '^cuda$' -j4 --output-on-failure) > "$out/ctest_cuda.log" 2>&1
  rc=$?
  # the result line, how many skipped (no GPU: every one), the failed by name;
  # status ok, skipped (none failed, some skipped: the GPU was not usable) or fail
  local skipped status=fail
  skipped=$(grep -cE '^\s+[0-9]+ - .* \(Skipped\)$' "$out/ctest_cuda.log")
  [ $rc -ne 0 ] || status=$([ "$skipped" -eq 0 ] && echo ok || echo skipped)
  record ctest "$status" "$t0" "rc=$rc;" "$(grep '% tests passed' "$out/ctest_cuda.log");" \
    "skipped: $skipped;" \
    "not passed: $(grep -E '^\s+[0-9]+ - .* \(.*\)$' "$out/ctest_cuda.log" | grep -v '(Skipped)' |
      sed -E 's/^\s+[0-9]+ - //' | tr '\n' ' ')"
}

# timed_stage NAME LOG SECONDS CMD...: CMD under a time limit, its output into OUT/LOG,
# its status recorded (the detail: what `summarize LOG` prints, set by the caller)
timed_stage() {
  local name=$1 log=$out/$2 limit=$3 t0 rc
  shift 3
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$log" 2>&1
  rc=$?
  record "$name" "$([ $rc -eq 0 ] && echo ok || echo fail)" "$t0" "rc=$rc" "$(summarize "$log")"
}

bench_stage() {
  summarize() { grep -E '^(meshlm|torch)' "$1" | tr -s ' ' | tr '\n' ';'; }
  PEER_MODES=${PEER_MODES:-bf16} LP_SEQS=${LP_SEQS:-16} timed_stage bench bench_cuda.log \
    "${BENCH_S:-180}" bash bench/cuda_train.sh 2048 8 "${BENCH_STEPS:-6}"
}

peak_stage() {
  summarize() { grep '^gemm_peak' "$1"; }
  timed_stage peak gemm_peak.txt 60 python3 bench/gemm_peak.py
}

profile_stage() {
  summarize() { sed -n '/^op profile/,$p' "$1" | sed -n '1p;3,8p' | tr -s ' ' | tr '\n' ';'; }
  M=$out/profile-model D=${PROFILE_DEVICE:-cuda} P=${PROFILE_PRESET:-llama3.2-1b} \
    S=${PROFILE_SEQ:-2048} timed_stage profile profile.log "${PROFILE_S:-120}" bash -ec '
    build/meshlm init --arch llama --preset "$P" --out "$M" > /dev/null
    V=$(sed -nE "s/.*\"vocab_size\": ?([0-9]+).*/\1/p" "$M/config.json")
    awk -v V="$V" -v S="$S" '\''BEGIN { srand(1); for (i = 0; i < 8; i++) {
      printf "{\"input_ids\": [%d", int(rand() * V)
      for (t = 1; t < S; t++) printf ", %d", int(rand() * V); print "]}" } }'\'' > "$M/train.jsonl"
    MESHLM_OP_PROFILE=1 build/meshlm train --device "$D" --model "$M" --data "$M/train.jsonl" \
      --param-dtype bf16 --seq-len "$S" --batch-size 8 --steps 2 --peak-tflops 989'
  rm -rf "$out/profile-model"
}

attention_stage() {
  summarize() { grep '^attention' "$1" | sed -E 's/; median of.*//' | tr -s ' ' | tr '\n' ';'; }
  local shapes=(${ATTN_SHAPES:-8 2048 32 8 64 4 2048 32 8 128})
  timed_stage attention attention.log "${ATTENTION_S:-120}" bash -c '
    "$0"/bench_cuda_attention --compute bf16 "$@" && "$0"/bench_cuda_attention --compute f32 \
      "${@:1:5}" && python3 bench/attention_peer.py "$@"' "$bundle/build" "${shapes[@]}"
}

generate_stage() {
  summarize() { grep -E '^(new|torch) ' "$1" | tr -s ' ' | tr '\n' ';'; }
  MESHLM_LIBRARY=$(ls "$bundle"/build/libmeshlm.so* | head -n 1) \
    timed_stage generate generate.log "${GEN_S:-150}" python3 bench/generate_throughput.py \
    --device cuda --impls new,torch --dtypes fp32,bf16 --batches "${GEN_BATCHES:-1,8,64}" \
    --prompt 128 --new "${GEN_NEW:-128}" --no-step
}

for s in "${stages[@]}"; do
  case $s in
    preflight) preflight ;;
    ctest) ctest_stage ;;
    bench) bench_stage ;;
    peak) peak_stage ;;
    profile) profile_stage ;;
    attention) attention_stage ;;
    generate) generate_stage ;;
    *) echo "device_checks.sh: unknown stage '$s' (expected preflight, ctest, bench, peak," \
      "profile, attention, generate)" >&2; exit 2 ;;
  esac
done
exit $failed
