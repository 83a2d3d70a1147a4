#!/bin/sh
# The MPI launcher of the cuda_engine tests, resolved when they run rather
# than when they were configured: MESHLM_MPIEXEC when set, else mpiexec
# found on PATH. The build's MPIEXEC_EXECUTABLE is /usr/bin/mpiexec, a
# Debian alternatives link that a tree unpacked with dpkg -x (the GPU
# machine's, tools/device_env.sh) does not have.
# usage: mpiexec.sh ARGS...   (ARGS as mpiexec's)
launcher=${MESHLM_MPIEXEC:-$(command -v mpiexec)}
if [ -z "$launcher" ]; then
  echo "tests/cuda/mpiexec.sh: no MPI launcher: mpiexec is not on PATH ($PATH)" \
    "and MESHLM_MPIEXEC is unset" >&2
  exit 1
fi
exec "$launcher" "$@"
