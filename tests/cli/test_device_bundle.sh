#!/usr/bin/env bash
# The GPU machine's tooling (issue 27), what of it a machine without a GPU
# can check: tools/device_bundle.sh --check fails over the size limit naming
# the largest pieces; tools/device_env.sh gives mpiexec and mpirun from the
# unpacked tree first on PATH (and says what is missing when the tree has
# no Open MPI); tests/cuda/mpiexec.sh finds its launcher at run time; and
# tools/device_checks.sh's preflight, on a bundle of this build and a tree
# of this system's Open MPI and PMIx files laid out as dpkg -x lays them
# (links; skipped where dpkg does not list them), relocates Open MPI, runs
# `mpiexec -n 1 true`, finds every library and reports "no GPU" cleanly; a
# bundle whose build is packed (build.tar.xz, as device_bundle.sh packs it)
# is unpacked first; the profile stage runs on the CPU as a dry run.
# usage: test_device_bundle.sh MESHLM SOURCE_DIR
set -u
meshlm=$1 src=$2
. "$src/tests/cli/common.sh"
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }

# 1. the size check: over the limit, the largest pieces named
mkdir -p "$work/b/debs"
truncate -s 3M "$work/b/debs/big.deb"
truncate -s 100K "$work/b/debs/small.deb"
size_check() { MESHLM_BUNDLE_MAX_MIB=$1 bash "$src/tools/device_bundle.sh" --check "$work/b"; }
size_check 2 > "$work/out" 2> "$work/err"
rc=$?
check "bundle over the limit: fails naming its size and largest pieces" \
  '[ $rc -ne 0 ] && grep -q "weighs 3 MiB, over 2 MiB" "$work/err" &&
   sed -n 2p "$work/err" | grep -q "3.0 MiB .*big.deb" && grep -q "small.deb" "$work/err"'
size_check 4 > "$work/out" 2> "$work/err"
rc=$?
check "bundle within the limit: passes" \
  '[ $rc -eq 0 ] && grep -q "3 MiB of at most 4 MiB" "$work/out"'

# 2. device_env.sh: mpiexec and mpirun from the tree, whatever the system has
mkdir -p "$work/fake/usr/bin"
printf '#!/bin/sh\necho "orterun $*"\n' > "$work/fake/usr/bin/orterun"
chmod +x "$work/fake/usr/bin/orterun"
(cd "$src" && . tools/device_env.sh "$work/fake" &&
  echo "$(command -v mpiexec) $(command -v mpirun)" && mpiexec -n 1 true && mpirun -n 2 x &&
  echo "$PMIX_PREFIX $OPAL_PREFIX") > "$work/out" 2>&1
check "device_env.sh: mpiexec, mpirun first on PATH, the tree's orterun; PMIx relocated" \
  'grep -qx "$work/fake/bin/mpiexec $work/fake/bin/mpirun" "$work/out" &&
   grep -qx "orterun -n 1 true" "$work/out" && grep -qx "orterun -n 2 x" "$work/out" &&
   grep -qx "$work/fake/usr/lib/x86_64-linux-gnu/pmix2 $work/fake/usr" "$work/out"'
(cd "$src" && . tools/device_env.sh "$work/none") > "$work/out" 2>&1
rc=$?
check "device_env.sh on a tree without Open MPI: returns 1 naming orterun" \
  '[ $rc -eq 1 ] && grep -q "$work/none/usr/bin/orterun is missing" "$work/out"'

# 3. the cuda_engine tests' launcher: MESHLM_MPIEXEC, else mpiexec on PATH, else a clear error
MESHLM_MPIEXEC=$work/fake/usr/bin/orterun sh "$src/tests/cuda/mpiexec.sh" -n 1 t > "$work/out" 2>&1
check "mpiexec.sh: MESHLM_MPIEXEC" 'grep -qx "orterun -n 1 t" "$work/out"'
PATH=$work/fake/bin:/usr/bin:/bin sh "$src/tests/cuda/mpiexec.sh" -n 1 t > "$work/out" 2>&1
check "mpiexec.sh: mpiexec found on PATH at run time" 'grep -qx "orterun -n 1 t" "$work/out"'
mkdir -p "$work/nompi"
ln -s "$(command -v env)" "$work/nompi/env"
PATH=$work/nompi /bin/sh "$src/tests/cuda/mpiexec.sh" -n 1 t > "$work/out" 2>&1
rc=$?
check "mpiexec.sh: no launcher, a message" '[ $rc -ne 0 ] && grep -q "no MPI launcher" "$work/out"'

# 4. device_checks.sh's preflight without a GPU
build=$(dirname "$meshlm")
soname=$(readelf -d "$meshlm" | sed -n 's/.*(NEEDED).*\[\(libmeshlm\.so[^]]*\)\].*/\1/p')
mkdir -p "$work/bundle/debs" "$work/bundle/build" "$work/rt"
cp "$build/CTestTestfile.cmake" "$meshlm" "$work/bundle/build/"
cp -L "$build/$soname" "$work/bundle/build/"
pkgs="openmpi-bin openmpi-common libopenmpi3 libpmix2"
if command -v dpkg > /dev/null && dpkg -L $pkgs > "$work/files" 2> /dev/null; then
  # the installed files as dpkg -x would unpack them under rt, as links
  while read -r f; do
    if [ -f "$f" ] && [ ! -d "$f" ]; then
      mkdir -p "$work/rt$(dirname "$f")" && ln -sf "$f" "$work/rt$f"
    fi
  done < "$work/files"
  (cd "$src" && PATH=/usr/bin:/bin MESHLM_BUNDLE=$work/bundle MESHLM_RT=$work/rt OUT=$work/o \
    bash tools/device_checks.sh preflight) > "$work/out" 2>&1
  rc=$?
  check "preflight without a GPU: exit 1, one summary line 'preflight no-gpu', 'no GPU'" \
    '[ $rc -eq 1 ] && [ "$(wc -l < "$work/o/summary.txt")" -eq 1 ] &&
     grep -q "^preflight no-gpu [0-9]* no GPU: nvidia-smi not found cpu: " "$work/o/summary.txt"'
  check "preflight: ldd of the bundle and the tree, nothing not found" \
    'grep -q "^== $work/bundle/build/meshlm" "$work/o/ldd.txt" &&
     grep -q "^== $work/rt/usr/bin/orterun" "$work/o/ldd.txt" &&
     ! grep -q "not found" "$work/o/ldd.txt" && ! grep -q "ldd:" "$work/o/summary.txt"'
  check "preflight: mpiexec -n 1 true in the tree's environment (device_env.sh), lscpu" \
    '! grep -q "mpiexec" "$work/o/summary.txt" && [ ! -s "$work/o/mpiexec.txt" ] &&
     [ -L "$work/rt/bin/mpiexec" ] && grep -q "^Architecture" "$work/o/lscpu.txt"'
else
  echo "skip preflight: dpkg does not list $pkgs here"
fi
(cd "$src" && OUT=$work/o2 MESHLM_BUNDLE=$work/bundle MESHLM_RT=$work/rt \
  bash tools/device_checks.sh preflght) > "$work/out" 2>&1
rc=$?
check "device_checks.sh: an unknown stage is refused" \
  '[ $rc -eq 2 ] && grep -q "unknown stage .preflght." "$work/out"'
# the profile stage's dry run on the CPU (tiny preset): the last step's table in the summary, its
# attention whole-sequence or, with attention's output in bf16, block attention
# (only where the checkout has build/: otherwise the stage would link it to the bundle's)
if [ -e "$src/build/meshlm" ]; then
  (cd "$src" && PROFILE_DEVICE=cpu PROFILE_PRESET=tiny PROFILE_SEQ=64 OUT=$work/o5 \
    MESHLM_BUNDLE=$work/bundle MESHLM_RT=$work/rt bash tools/device_checks.sh profile) \
    > "$work/out" 2>&1
  rc=$?
  check "device_checks.sh profile (PROFILE_DEVICE=cpu): ok, the table's heaviest classes" \
    '[ $rc -eq 0 ] && grep -q "^profile ok .*op profile (MESHLM_OP_PROFILE=1.*;gemm [0-9x]* bf16" \
      "$work/o5/summary.txt" && grep -Eq "^ml_be_attention(_block)?_fwd " "$work/o5/profile.log" &&
     [ ! -e "$work/o5/profile-model" ]'
else
  echo "skip the profile stage's dry run: $src/build/meshlm is not there"
fi
# the build packed as tools/device_bundle.sh packs it: unpacked before the stages run
mkdir -p "$work/packed/debs"
tar -C "$work/bundle" -cJf "$work/packed/build.tar.xz" build
(cd "$src" && OUT=$work/o4 MESHLM_BUNDLE=$work/packed MESHLM_RT=$work/rt \
  bash tools/device_checks.sh preflght) > "$work/out" 2>&1
rc=$?
check "device_checks.sh: a packed build (build.tar.xz) is unpacked" \
  '[ $rc -eq 2 ] && cmp -s "$work/bundle/build/meshlm" "$work/packed/build/meshlm" &&
   grep -q "unknown stage" "$work/out"'
(cd "$src" && OUT=$work/o3 MESHLM_BUNDLE=$work/nothing bash tools/device_checks.sh) > "$work/out" 2>&1
rc=$?
check "device_checks.sh without a bundle: exit 2, a message" \
  '[ $rc -eq 2 ] && grep -q "no bundle at $work/nothing" "$work/out"'
finish
