#!/usr/bin/env bash
# The runtime of a meshlm build for an offline GPU machine that has the
# CUDA toolkit and driver but none of meshlm's other libraries: the Debian
# packages of every shared library that build/meshlm and the test binaries
# load (Open MPI, OpenBLAS, oneDNN, jansson, cmocka and what they load),
# apart from glibc, libgcc, libstdc++ and CUDA's own, plus Open MPI's
# launcher (openmpi-bin), downloaded into .device/debs; and the part of the
# build the GPU checks run — build/meshlm, the tests labelled cuda and the
# CTest files — copied into .device/build (the whole build directory is
# over the device tool's 64 MiB). tools/device_checks.sh unpacks the
# packages next to the system, not over it, links build to .device/build
# and runs the checks; carry .device.
#
# usage: tools/device_bundle.sh [BUILD]   (default build; run after building;
#        needs apt-get access here; .device/ is ignored by git)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
dest=.device/debs
mkdir -p "$dest"
ex=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$ex")"
grep -qx '/.device/' "$ex" 2> /dev/null || echo '/.device/' >> "$ex"
# the owning package of a library path (Debian's merged /usr: dpkg knows /usr/lib)
owner() {
  local p
  p=$(readlink -f "$1")
  dpkg -S "$p" 2> /dev/null || dpkg -S "/usr${p#/usr}" 2> /dev/null ||
    dpkg -S "${p/#\/lib/\/usr\/lib}" 2> /dev/null || true
}
bins=$(find "$BUILD" -maxdepth 3 -type f -perm -u+x ! -name '*.so*' ! -name '*.sh' | head -n 200)
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
# the build's GPU part, same relative paths
rm -rf .device/build
(cd "$BUILD" && find . -name CTestTestfile.cmake -o -path ./meshlm -o -path './tests/cuda/test_*' \
  -type f -perm -u+x) | while read -r f; do
  mkdir -p ".device/build/$(dirname "$f")" && cp -p "$BUILD/$f" ".device/build/$f"
done
strip --strip-unneeded .device/build/meshlm .device/build/tests/cuda/test_* 2> /dev/null || true
du -sh "$dest" .device/build
echo "packages: $(echo "$pkgs" | tr '\n' ' ')"
