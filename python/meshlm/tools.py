"""Helpers around the meshlm command-line program and MPI launchers, for
scripts that run under mpirun without mpi4py.

launcher_rank() / launcher_size() read the rank and size the launcher put in
the environment (before any Policy exists, e.g. so that only rank 0 writes a
file).  run_cli() runs the `meshlm` binary as a separate one-process program:
from inside an MPI job the launcher's variables are removed from its
environment, so that it initialises MPI on its own instead of taking the
place of the calling rank.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence

__all__ = ["launcher_rank", "launcher_size", "job_id", "cli_path", "cli_env", "run_cli"]

_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK",
              "SLURM_PROCID")
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")


def _first_int(names: Sequence[str], default: int) -> int:
    for n in names:
        v = os.environ.get(n)
        if v is not None and v.strip().lstrip("-").isdigit():
            return int(v)
    return default


def launcher_rank() -> int:
    """This process's world rank as the MPI launcher set it (0 when not
    launched by one).  Equal to Policy.info["rank"] for MPI_COMM_WORLD."""
    return _first_int(_RANK_VARS, 0)


def launcher_size() -> int:
    """The number of processes the launcher started (1 without one)."""
    return _first_int(_SIZE_VARS, 1)


def job_id() -> str:
    """A string that every rank of one MPI job shares and another job (most
    likely) does not: the launcher's job id, or the parent process id (the
    launcher's daemon, the same for the ranks of one job on one node)."""
    for n in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_JOBID", "SLURM_JOB_ID"):
        v = os.environ.get(n)
        if v:
            return "".join(c if c.isalnum() else "_" for c in v)
    if launcher_size() > 1:
        return "ppid%d" % os.getppid()
    return "pid%d" % os.getpid()


def cli_path() -> str:
    """The meshlm binary: $MESHLM, else `meshlm` on PATH, else the checkout's
    build/meshlm.  Raises FileNotFoundError naming them."""
    env = os.environ.get("MESHLM")
    if env:
        return env
    found = shutil.which("meshlm")
    if found:
        return found
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    local = os.path.join(repo, "build", "meshlm")
    if os.path.exists(local):
        return local
    raise FileNotFoundError("the meshlm binary was not found: set MESHLM to its path, put it on "
                            "PATH, or build the checkout (cmake --build build)")


_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "OPAL_", "ORTE_", "HYDRA_", "MPIR_",
                      "MPI_LOCAL")
_KEEP = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
         "OMPI_MCA_rmaps_base_oversubscribe")


def cli_env(env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """A copy of env (default os.environ) without the MPI launcher's variables,
    for a child program that must start its own one-process MPI."""
    out = dict(os.environ if env is None else env)
    for k in list(out):
        if k.startswith(_LAUNCHER_PREFIXES) and k not in _KEEP:
            del out[k]
    return out


def run_cli(args: Iterable[object], check: bool = True,
            **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run `meshlm ARGS...` (one process, its own MPI) and return the
    subprocess.CompletedProcess (stdout and stderr captured as text).  With
    check, a non-zero exit raises RuntimeError with its stderr."""
    cmd = [cli_path()] + [str(a) for a in args]
    p = subprocess.run(cmd, env=cli_env(kw.pop("env", None)), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, universal_newlines=True, **kw)
    if check and p.returncode != 0:
        raise RuntimeError("%s: exit status %d\n%s" % (" ".join(cmd), p.returncode,
                                                       p.stderr.strip()))
    return p
