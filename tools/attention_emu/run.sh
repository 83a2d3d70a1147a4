#!/usr/bin/env bash
# Builds test.cpp (see its header) against the current src/kernels/cuda/attention.cu,
# under AddressSanitizer and UBSan, and runs it with the given arguments.
# Needs python3 (transform.py turns the .cu into C++ for emu.h) and g++.
# usage: tools/attention_emu/run.sh [test arguments]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
python3 "$here/transform.py" "$root/src/kernels/cuda/attention.cu" "$out/attention.cpp"
g++ -std=c++17 -O1 -g -fsanitize=address,undefined -I"$here" -I"$root/src" \
  -I/usr/local/cuda/include "$out/attention.cpp" "$here/emu.cpp" "$here/test.cpp" -o "$out/test"
"$out/test" "$@"
