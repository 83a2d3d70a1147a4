"""Policy(fp32_params=...): parameters kept and computed in fp32 under param_dtype bf16
through the library (engine/fp32_params.h; the numbers are tests/mpi/test_fp32_params.c's):
the list and the comma-separated string are one option, a step trains, and a pattern
matching nothing raises naming the option and the pattern."""

import numpy as np
import pytest
from conftest import make_seqs

import meshlm

KEPT = ["model.norm.weight", "model.layers.*.self_attn.o_proj.weight"]


def one_step(model_dir, fp32_params):
    with meshlm.Policy(model_dir, lr=1e-2, param_dtype="bf16", fp32_params=fp32_params) as p:
        r = p.train_step(make_seqs(2, seed=3))
        assert not r["skipped"] and np.isfinite(r["loss"])
        return r["loss"], p.refit(root=-1)


def test_fp32_params_step(model_dir):
    loss, w = one_step(model_dir, KEPT)
    joined_loss, joined = one_step(model_dir, ",".join(KEPT))
    assert loss == joined_loss
    for n in w:
        assert w[n].tobytes() == joined[n].tobytes(), n


def test_fp32_params_errors(model_dir):
    with pytest.raises(meshlm.MeshlmError,
                       match="fp32_params \\(--fp32-params\\): pattern 'model.nope.\\*' matches "
                             "no parameter"):
        meshlm.Policy(model_dir, param_dtype="bf16", fp32_params=["model.norm.weight", "model.nope.*"])
