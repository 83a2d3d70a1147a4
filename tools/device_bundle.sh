#!/usr/bin/env bash
# The runtime of a meshlm build for an offline GPU machine that has the
# CUDA toolkit and driver but none of meshlm's other libraries: the Debian
# packages of every shared library that build/meshlm and the test binaries
# load (Open MPI, OpenBLAS, oneDNN, jansson, cmocka and what they load),
# apart from glibc, libgcc, libstdc++ and CUDA's own, plus Open MPI's
# launcher (openmpi-bin) and PMIx, downloaded into .device/debs; and the
# part of the build the GPU checks run — meshlm, its libmeshlm.so, the
# tests labelled cuda (tests/mpi's test_generate_mesh among them), tol_bound (their tolerances), bench_cuda_attention
# and the CTest files —
# copied into .device/build and packed as .device/build.tar.xz (the whole
# build directory is over the device tool's 64 MiB, and the tree it carries
# with the bundle — every tracked file — counts against the same 64 MiB:
# packed, the build's 19 MiB take under 2). The build is
# its own (BUILD, default build-device), configured with
# -DMESHLM_MARCH=x86-64-v3: the GPU machine's CPU is unknown, and a native
# build of a machine with AVX-512 would stop there on SIGILL; each GPU test
# limited to 90 s (-DMESHLM_CUDA_TEST_TIMEOUT=90).
# tools/device_checks.sh unpacks the build and the packages (next to the
# system, not over it), makes BUILD lead to .device/build and runs the
# checks; carry .device. The bundle must weigh at most MESHLM_BUNDLE_MAX_MIB
# (default 60) MiB, and with the tracked tree at most the tool's 64 MiB:
# over either, this fails naming its largest pieces.
#
# usage: tools/device_bundle.sh [BUILD]   (configures and builds BUILD, then packs;
#          needs apt-get access here; .device/ is ignored by git)
#        tools/device_bundle.sh --check [DIR]   (only the size check of a packed
#          bundle, default .device)
set -euo pipefail
cd "$(dirname "$0")/.."
max=${MESHLM_BUNDLE_MAX_MIB:-60}
# check_size DIR: DIR's bytes (apparent size: what the device tool copies) within max MiB
check_size() {
  local bytes
  bytes=$(du -s --apparent-size -B1 "$1" | cut -f1)
  if [ "$bytes" -gt $((max * 1048576)) ]; then
    echo "device_bundle.sh: $1 weighs $((bytes / 1048576)) MiB, over $max MiB (the device tool" \
      "carries 64 MiB in all); its largest pieces:" >&2
    find "$1" -type f -printf '%s %p\n' | sort -rn | head -n 10 |
      awk '{ printf "  %8.1f MiB  %s\n", $1 / 1048576, $2 }' >&2
    return 1
  fi
  echo "bundle: $1, $((bytes / 1048576)) MiB of at most $max MiB"
}
if [ "${1:-}" = --check ]; then
  check_size "${2:-.device}"
  exit
fi
BUILD=${1:-build-device}
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DMESHLM_MARCH=x86-64-v3 \
  -DMESHLM_CUDA_TEST_TIMEOUT=90 > /dev/null
cmake --build "$BUILD" -j"${JOBS:-2}" --target meshlm test_cuda_ops test_cuda_engine \
  test_device_comm test_generate_mesh tol_bound bench_cuda_attention > /dev/null
dest=.device/debs
rm -rf .device
mkdir -p "$dest"
ex=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$ex")"
grep -qx '/.device/' "$ex" 2> /dev/null || echo '/.device/' >> "$ex"
# the build's GPU part, same relative paths: meshlm's library by its soname
soname=$(readelf -d "$BUILD/meshlm" | sed -n 's/.*(NEEDED).*\[\(libmeshlm\.so[^]]*\)\].*/\1/p')
if ! readelf -d "$BUILD/$soname" | grep -q 'NEEDED.*libcudart'; then
  echo "device_bundle.sh: $BUILD has no CUDA backend ($soname does not load libcudart: nvcc" \
    "was not found when it was configured, or MESHLM_CUDA=OFF)" >&2
  exit 1
fi
(cd "$BUILD" && find . -name CTestTestfile.cmake -o -path ./meshlm -o -path "./$soname" \
  -o -path ./tests/tol_bound -o -path './tests/cuda/test_*' -type f -perm -u+x \
  -o -path ./tests/mpi/test_generate_mesh \
  -o -path ./bench_cuda_attention) | while read -r f; do
  mkdir -p ".device/build/$(dirname "$f")" && cp -L "$BUILD/$f" ".device/build/$f"
done
strip --strip-unneeded .device/build/meshlm ".device/build/$soname" .device/build/tests/tol_bound \
  .device/build/tests/cuda/test_* .device/build/tests/mpi/test_generate_mesh \
  .device/build/bench_cuda_attention
# the owning package of a library path (Debian's merged /usr: dpkg knows /usr/lib)
owner() {
  local p
  p=$(readlink -f "$1")
  dpkg -S "$p" 2> /dev/null || dpkg -S "/usr${p#/usr}" 2> /dev/null ||
    dpkg -S "${p/#\/lib/\/usr\/lib}" 2> /dev/null || true
}
bins=$(find .device/build -type f -perm -u+x)
libs=$(for b in $bins; do ldd "$b" 2> /dev/null | awk '$3 ~ /^\// { print $3 }'; done | sort -u)
pkgs=$(for l in $libs; do owner "$l"; done | cut -d: -f1 | sort -u |
  grep -vE '^(libc6|libgcc-s1|libstdc\+\+6|zlib1g|libudev1|libcrypt1)$' |
  grep -v '^cuda-\|^libcu\|^libnccl\|^libcudnn' || true)
# Open MPI's plugins and launcher load more than the binaries do
pkgs="$pkgs openmpi-bin openmpi-common libopenmpi3 libpmix2 libhwloc15 libevent-core-2.1-7
  libevent-pthreads-2.1-7 libfabric1 libucx0 libnl-3-200 libnl-route-3-200 libibverbs1
  librdmacm1 libpsm2-2 libpsm-infinipath1 libnuma1 libxml2 libicu72 libltdl7"
pkgs=$(echo "$pkgs" | tr ' ' '\n' | grep -v '^$' | sort -u)
(cd "$dest" && apt-get download $pkgs > /dev/null)
tar -C .device -cJf .device/build.tar.xz build
du -sh "$dest" .device/build .device/build.tar.xz
rm -rf .device/build
echo "packages: $(echo "$pkgs" | tr '\n' ' ')"
check_size .device
# what travels with it: the tracked tree (the device tool's 64 MiB are for both)
tree=$(git ls-files -z | du -cb --apparent-size --files0-from=- | tail -n 1 | cut -f1)
bundle=$(du -s --apparent-size -B1 .device | cut -f1)
if [ $((tree + bundle)) -gt $((64 * 1048576)) ]; then
  echo "device_bundle.sh: the tracked tree ($((tree / 1048576)) MiB) and .device ($((bundle / 1048576))" \
    "MiB) are over the device tool's 64 MiB together" >&2
  exit 1
fi
echo "with the tracked tree: $(((tree + bundle) / 1048576)) MiB of the device tool's 64"
