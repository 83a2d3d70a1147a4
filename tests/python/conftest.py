"""Fixtures of the Python binding's tests.

The tests run as one process (`python3 -m pytest tests/python`) and as an MPI
job (`mpirun -np 2 python3 -m pytest tests/python`): every rank runs the same
tests in the same order, so every collective call is made by every rank.
Nothing is communicated outside the library (no mpi4py): files that all
ranks need (the model) are written once by rank 0 under a directory every
rank of the job computes alike (MESHLM_TEST_DIR, set by the CTest
registration, or build/python-tests, plus the job's id), moved into place
complete; the other ranks wait for them.  Files only one rank needs are
per-rank.
"""

import os
import shutil
import sys
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import meshlm  # noqa: F401
except ImportError:  # a checkout without the package installed
    sys.path.insert(0, os.path.join(REPO, "python"))
    import meshlm  # noqa: F401
from meshlm import tools

RANK = tools.launcher_rank()
WORLD = tools.launcher_size()


def wait_for(path, timeout=120.0):
    """Wait until path exists (written by another rank, moved into place)."""
    t0 = time.time()
    while not os.path.exists(path):
        if time.time() - t0 > timeout:
            raise TimeoutError("waited %.0f s for %s" % (timeout, path))
        time.sleep(0.02)


def barrier(policy):
    """A barrier over the policy's ranks: any collective call is one (each
    rank's library exchanges the call with every other rank's before it
    runs).  A one-sequence log-prob call costs next to nothing."""
    policy.logprobs([np.zeros(2, np.int32)])


def make_seqs(n, seed, lo=2, hi=40, vocab=256):
    """n random token sequences of lengths in [lo, hi], the same on every rank."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(lo, hi + 1))).astype(np.int64)
            for _ in range(n)]


@pytest.fixture(scope="session")
def workdir():
    base = os.environ.get("MESHLM_TEST_DIR") or os.path.join(REPO, "build", "python-tests")
    d = os.path.join(base, tools.job_id())
    if RANK == 0 and os.path.isdir(base):  # earlier runs' directories, an hour old
        for old in os.listdir(base):
            p = os.path.join(base, old)
            if p != d and os.path.isdir(p) and time.time() - os.path.getmtime(p) > 3600:
                shutil.rmtree(p, ignore_errors=True)
    os.makedirs(os.path.join(d, "rank%d" % RANK), exist_ok=True)
    return d


@pytest.fixture(scope="session")
def rankdir(workdir):
    """A directory of this rank's own files."""
    return os.path.join(workdir, "rank%d" % RANK)


@pytest.fixture(scope="session")
def model_dir(workdir):
    """A tiny random Llama with a byte vocabulary (meshlm init --preset tiny),
    made once by rank 0."""
    path = os.path.join(workdir, "model")
    if RANK == 0:
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tools.run_cli(["init", "--arch", "llama", "--preset", "tiny", "--seed", "7",
                       "--out", tmp])
        os.replace(tmp, path)
    wait_for(os.path.join(path, "config.json"))
    return path


@pytest.fixture
def shared_path(workdir, request):
    """A path every rank computes alike for this test (not created)."""
    return lambda name: os.path.join(workdir, "%s.%s" % (request.node.name, name))


def meshes():
    """The meshes the collective tests run on: all data parallel, and all
    tensor parallel when there is more than one rank."""
    return [{}] + ([{"tp": WORLD}] if WORLD > 1 else [])


def mesh_id(kw):
    return "tp%d" % kw["tp"] if kw else "dp"
