"""Policy(freeze=...): frozen parameters (requires_grad=False) through the library.
One AdamW step without clipping and with weight decay (a frozen tensor stepped by
mistake would decay): the frozen tensors refit bitwise as they were, every other
tensor bitwise as the same step of an unfrozen policy (a trainable gradient does not
depend on requires_grad of others; AdamW is elementwise); the list and the
comma-separated string are one option; bad patterns raise naming them."""

import fnmatch

import numpy as np
import pytest
from conftest import make_seqs, mesh_id, meshes

import meshlm

FROZEN = ["model.embed_tokens.*", "model.layers.0.*"]


def step(model_dir, mesh, freeze):
    """The weights (refit, every rank) before and after one step of a policy."""
    with meshlm.Policy(model_dir, lr=1e-2, weight_decay=0.1, max_grad_norm=0, freeze=freeze,
                       **mesh) as p:
        before = p.refit(root=-1)
        seqs = make_seqs(4, seed=5)[p.info["dp_rank"]::p.info["dp_size"]]
        r = p.train_step(seqs)
        assert not r["skipped"] and r["grad_norm"] > 0
        return before, p.refit(root=-1), r["grad_norm"]


@pytest.mark.parametrize("mesh", meshes(), ids=mesh_id)
def test_frozen_step(model_dir, mesh):
    init, full, n_full = step(model_dir, mesh, None)
    _, frozen, n_frozen = step(model_dir, mesh, FROZEN)
    _, joined, _ = step(model_dir, mesh, ",".join(FROZEN))
    names = sorted(init)
    is_frozen = {n: any(fnmatch.fnmatchcase(n, pat) for pat in FROZEN) for n in names}
    assert 0 < sum(is_frozen.values()) < len(names)
    for n in names:
        want = init[n] if is_frozen[n] else full[n]
        assert frozen[n].tobytes() == want.tobytes(), n
        assert joined[n].tobytes() == frozen[n].tobytes(), n
        if is_frozen[n]:  # the unfrozen step moves it: the check above can fail
            assert full[n].tobytes() != init[n].tobytes(), n
    assert n_frozen < n_full  # the norm over the trainable parameters only


def test_freeze_errors(model_dir):
    with pytest.raises(meshlm.MeshlmError, match="pattern 'model.nope.\\*' matches no parameter"):
        meshlm.Policy(model_dir, freeze=["model.norm.weight", "model.nope.*"])
    with pytest.raises(meshlm.MeshlmError, match="matches all 21 parameters"):
        meshlm.Policy(model_dir, freeze="*")
