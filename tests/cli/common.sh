# Sourced by CLI tests: the environment mpiexec needs as root on a small
# machine, a work directory removed at exit ($on_exit runs first), and the
# pass/fail bookkeeping of checks that go on after a failure.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
work=$(mktemp -d)
on_exit=
trap 'eval "$on_exit"; rm -rf "$work"' EXIT
# mpiexec with the shared-memory transports off (Open MPI's btl, MPICH's
# UCX), for ranks under a file size limit (ulimit -f), which their
# shared-memory segment files would hit
mpiexec_noshm() { OMPI_MCA_btl=self,tcp UCX_TLS=self,tcp mpiexec "$@"; }
pass=0 fail=0
ok() { pass=$((pass + 1)); echo "ok   $1"; }
# bad NAME: a failed check; shows the start of $work/err when there is one
bad() { fail=$((fail + 1)); echo "FAIL $1"; [ -f "$work/err" ] && head -20 "$work/err"; }
# finish: the summary line, and the script's status
finish() { echo "$pass passed, $fail failed"; [ "$fail" -eq 0 ]; }
