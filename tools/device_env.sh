# Source with the root where tools/device_bundle.sh's packages were unpacked:
#   . tools/device_env.sh /opt/meshlm-rt
# Puts their libraries first on the loader's path and relocates Open MPI
# (OPAL_PREFIX: its plugins and help files under that root), for running
# build/meshlm and the tests on a machine that does not have them installed.
rt=${1:?usage: . tools/device_env.sh ROOT}
export LD_LIBRARY_PATH="$rt/usr/lib/x86_64-linux-gnu:$rt/usr/lib/x86_64-linux-gnu/openblas-pthread:$rt/usr/lib/x86_64-linux-gnu/openmpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$rt/usr/bin:$PATH"
export OPAL_PREFIX="$rt/usr"
export OPAL_LIBDIR="$rt/usr/lib/x86_64-linux-gnu/openmpi/lib"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMP_WAIT_POLICY=passive
# Debian's mpirun is an alternatives link that dpkg -x does not make
mkdir -p "$rt/bin" && ln -sfn "$rt/usr/bin/orterun" "$rt/bin/mpirun"
export PATH="$rt/bin:$PATH"
