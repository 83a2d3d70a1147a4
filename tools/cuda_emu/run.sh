#!/usr/bin/env bash
# Builds one test of tools/cuda_emu (test_attention by default; see its
# header) against the current src/kernels/cuda, every .cu turned into C++ by
# transform.py, under AddressSanitizer and UBSan, and runs it with the given
# arguments: the developer's loop outside CMake (CTest runs the same
# programs, label cuda_emu). Needs python3 and g++ with the CUDA toolkit's
# headers (/usr/local/cuda/include); no GPU, no nvcc.
# usage: tools/cuda_emu/run.sh [test_attention|test_kernels] [test arguments]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
test=test_attention
case "${1:-}" in test_*) test=$1; shift ;; esac
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mkdir -p "$out/kernels/cuda"
python3 "$here/transform.py" "$root/src/kernels/cuda/common.cuh" "$out/kernels/cuda/common.cuh"
for cu in "$root"/src/kernels/cuda/*.cu; do
  python3 "$here/transform.py" "$cu" "$out/$(basename "$cu" .cu).cpp"
done
g++ -std=c++17 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -I"$out" -I"$here" \
  -I"$root/src" -I/usr/local/cuda/include "$out"/*.cpp "$here/emu.cpp" "$here/$test.cpp" \
  -o "$out/test"
"$out/test" "$@"
