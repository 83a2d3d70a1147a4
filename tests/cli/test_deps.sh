#!/usr/bin/env bash
# The build's dependencies (cmake/deps.txt) as a user without them meets
# them: configuring with the pkg-config files hidden stops at once with one
# message naming the library and its Debian and RHEL/Fedora packages; `make
# deps` on a system without apt-get names what is missing with the RHEL
# packages, exits 1 and installs nothing; with everything present it says so.
# usage: test_deps.sh MESHLM SOURCE_DIR
set -u
src=$2
. "$src/tests/cli/common.sh"
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }

# configure with no pkg-config module visible: the first missing library named
PKG_CONFIG_LIBDIR=$work/none cmake -S "$src" -B "$work/b" -DMESHLM_CUDA=OFF > "$work/out" 2>&1
rc=$?
check "configure without jansson's pkg-config file fails naming it and its packages" \
  '[ $rc -ne 0 ] && grep -q "meshlm needs jansson" "$work/out" &&
   grep -q "libjansson-dev" "$work/out" && grep -q "jansson-devel" "$work/out"'

# make deps where apt-get is not: a PATH of the tools the script uses, no apt-get
mkdir -p "$work/bin"
for t in bash grep dirname id pkg-config python3 cmake cc mpicc; do
  p=$(command -v "$t") && ln -s "$p" "$work/bin/$t"
done
PATH=$work/bin PKG_CONFIG_LIBDIR=$work/none bash "$src/scripts/install-deps.sh" > "$work/out" 2>&1
rc=$?
check "make deps without apt-get: exit 1, the missing named with their RHEL/Fedora packages" \
  '[ $rc -eq 1 ] && grep -q "missing OpenBLAS jansson PCRE2 utf8proc" "$work/out" &&
   grep -q "dnf install openblas-devel jansson-devel" "$work/out"'
PATH=$work/bin bash "$src/scripts/install-deps.sh" --build-only > "$work/out" 2>&1
rc=$?
check "make deps --build-only with everything present: says so, exit 0" \
  '[ $rc -eq 0 ] && grep -q "everything meshlm needs is present" "$work/out"'
finish
