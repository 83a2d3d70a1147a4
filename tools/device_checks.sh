#!/usr/bin/env bash
# Everything the CUDA backend must pass on a GPU machine, in one command for
# an offline, bare machine (the device tool): unpack the runtime packages
# tools/device_bundle.sh gathered, then the GPU tests (ctest label cuda,
# every kernel against the CPU backend and every fixture family's
# log-probs and training step against the CPU), then bench/cuda_train.sh on
# the Llama-3.2-1B shape. Logs go to OUT (the device tool's $OUT) when set.
# usage: tools/device_checks.sh   (from the repository root, with .device carried)
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=build
[ -e build ] || ln -s .device/build build
out=${OUT:-/tmp/meshlm-device}
mkdir -p "$out"
# the build has this checkout's absolute path compiled in (ctest files, the
# tests' fixture directory): make that path lead to this copy
src=$(sed -n 's/^# Source directory: //p' "$BUILD/CTestTestfile.cmake")
if [ "$src" != "$(pwd -P)" ] && [ ! -e "$src" ]; then
  mkdir -p "$(dirname "$src")" && ln -s "$(pwd -P)" "$src"
fi
rt=/opt/meshlm-rt
for f in .device/debs/*.deb; do dpkg -x "$f" "$rt"; done
# shellcheck source=tools/device_env.sh
. tools/device_env.sh "$rt"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
(cd "$BUILD" && ctest -L cuda --output-on-failure --timeout 600) 2>&1 | tee "$out/ctest_cuda.log"
bash bench/cuda_train.sh 2>&1 | tee "$out/bench_cuda.log"
