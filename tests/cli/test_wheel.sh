#!/usr/bin/env bash
# pip install ./python gives a binding that carries its library: a wheel
# built from a copy of python/ (so the checkout is not written into) holds
# meshlm/libmeshlm.so and the PEP 561 marker meshlm/py.typed, installs into a
# directory with no MESHLM_LIBRARY set and no build tree to find, loads its
# own copy, and says its version.
# Skipped (exit 0, saying why) where python3 has no pip or setuptools.
# usage: test_wheel.sh MESHLM SOURCE_DIR
set -u
src=$(cd "$2" && pwd)
. "$src/tests/cli/common.sh"
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }
if ! python3 -c "import setuptools, pip, numpy" 2> /dev/null; then
  echo "skipped: python3 lacks pip, setuptools or numpy"
  exit 0
fi
cp -r "$src/python" "$work/python"
rm -rf "$work/python/build" "$work/python/build-lib" "$work/python/"*.egg-info
MESHLM_SOURCE_DIR=$src MESHLM_CMAKE_ARGS="-DMESHLM_CUDA=OFF" \
  python3 -m pip wheel --no-build-isolation --no-deps "$work/python" -w "$work/wheel" \
  > "$work/err" 2>&1
ls "$work"/wheel/*.whl > /dev/null 2>&1 || grep -i -m5 -B2 "error" "$work/err"
check "pip wheel builds a platform wheel carrying meshlm/libmeshlm.so" \
  'ls "$work"/wheel/meshlm-*-linux_*.whl > /dev/null 2>&1 &&
   python3 -m zipfile -l "$work"/wheel/meshlm-*.whl | grep -q "meshlm/libmeshlm.so"'
check "the wheel carries the PEP 561 marker meshlm/py.typed (the package is typed)" \
  'python3 -m zipfile -l "$work"/wheel/meshlm-*.whl | grep -q "meshlm/py.typed"'
python3 -m pip install --no-deps --target "$work/site" "$work"/wheel/meshlm-*.whl > "$work/err" 2>&1
cd "$work" && env -u MESHLM_LIBRARY PYTHONPATH="$work/site" python3 -c '
import meshlm, os, sys
assert meshlm.library_path().startswith(sys.argv[1]), meshlm.library_path()
print(meshlm.version(), meshlm.__version__)' "$work/site" > "$work/out" 2> "$work/err"
v=$(awk '/#define MESHLM_VERSION_(MAJOR|MINOR|PATCH)/ { printf "%s%s", sep, $3; sep = "." }' \
  "$src/include/meshlm/meshlm.h")
check "the installed package loads its own library, versions agree (meshlm.h's $v)" \
  '[ "$(cat "$work/out")" = "$v $v" ]'
finish
