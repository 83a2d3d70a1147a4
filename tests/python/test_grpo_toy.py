"""examples/grpo_toy.py: three steps, in this process (on every rank of the job)."""

import csv
import importlib.util
import os

from conftest import REPO, RANK


def load_example():
    path = os.path.join(REPO, "examples", "grpo_toy.py")
    spec = importlib.util.spec_from_file_location("grpo_toy", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_grpo_toy_three_steps(model_dir, workdir):
    toy = load_example()
    out = os.path.join(workdir, "grpo")
    hist = toy.main(["--model", model_dir, "--steps", "3", "--out", out, "--group", "8",
                     "--groups", "2", "--quiet"])
    assert [s for s, _ in hist] == [1, 2, 3]
    assert all(0.0 <= r <= 1.0 for _, r in hist)
    if RANK == 0:
        with open(os.path.join(out, "rewards.csv")) as f:
            rows = list(csv.DictReader(f))
        assert [int(r["step"]) for r in rows] == [1, 2, 3]
        assert abs(float(rows[0]["reward_rank0"]) - hist[0][1]) < 1e-6


def test_grpo_pieces():
    toy = load_example()
    import numpy as np
    t = np.frombuffer(b"meshlm", np.uint8).astype(np.int32)
    assert toy.reward(t, t) == 1.0
    assert toy.reward(np.frombuffer(b"mesxxx", np.uint8).astype(np.int32), t) == 0.5
    a = toy.group_advantages([0.0, 0.5, 1.0])
    assert abs(a.mean()) < 1e-9 and abs(a.std() - 1) < 1e-5
    assert np.all(toy.group_advantages([0.3, 0.3]) == 0)
