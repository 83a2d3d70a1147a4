# Source with the root where tools/device_bundle.sh's packages were unpacked:
#   . tools/device_env.sh /opt/meshlm-rt
# Puts their libraries first on the loader's path and relocates Open MPI
# (OPAL_PREFIX and OPAL_LIBDIR: its plugins and help files under that root;
# OPAL_SYSCONFDIR: Debian's openmpi-mca-params.conf, which turns off the
# ucx/ofi/openib components) and the PMIx it is built on (Debian's libpmix2,
# its own prefix .../pmix2 with absolute libdir and datadir: PMIX_PREFIX
# alone leaves its plugins and help files at the compiled-in path, so
# PMIX_LIBDIR and PMIX_DATADIR too), for running build/meshlm and the tests
# on a machine that does not have them installed. `mpiexec` and `mpirun`
# (Debian's alternatives links, which dpkg -x does not make) are ROOT/bin's
# links to Open MPI's orterun, first on PATH. Returns 1 naming what is
# missing when ROOT holds no Open MPI.
rt=${1:?usage: . tools/device_env.sh ROOT}
if [ ! -x "$rt/usr/bin/orterun" ]; then
  echo "device_env.sh: $rt/usr/bin/orterun is missing: unpack tools/device_bundle.sh's packages" \
    "(.device/debs, openmpi-bin among them) into $rt first" >&2
  return 1
fi
ma=x86_64-linux-gnu
lib=$rt/usr/lib/$ma
LD_LIBRARY_PATH="$lib:$lib/openblas-pthread:$lib/openmpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
export OPAL_PREFIX="$rt/usr"
export OPAL_LIBDIR="$lib/openmpi/lib"
export OPAL_SYSCONFDIR="$rt/etc/openmpi"
export PMIX_PREFIX="$lib/pmix2"
export PMIX_LIBDIR="$PMIX_PREFIX/lib" PMIX_DATADIR="$PMIX_PREFIX/share"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMP_WAIT_POLICY=passive
mkdir -p "$rt/bin"
for l in mpiexec mpirun; do ln -sfn "$rt/usr/bin/orterun" "$rt/bin/$l"; done
export PATH="$rt/bin:$rt/usr/bin:$PATH"
unset ma l lib
