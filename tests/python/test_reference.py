"""The reference policy in the policy's session (set_reference,
reference_logprobs): after training, its log-probs are a second, untrained
session's, bitwise (the same forward on the same weights: the shards
swapped in around the pass); scoring it leaves the policy alone
(its log-probs and its next step bitwise those of a session that never
scored the reference); set_reference again takes the current weights; no
reference is an error."""

import numpy as np
import pytest
from conftest import make_seqs, mesh_id, meshes

import meshlm


def engines():
    """The meshes, then ZeRO-2 (parameters gathered once and kept: gathered again around the
    exchange) and CPU offload (the shards in host memory)."""
    return meshes() + [{"zero": 2}, {"cpu_offload": True}]


def engine_id(kw):
    return mesh_id(kw) if not kw or "tp" in kw else "-".join("%s%s" % i for i in kw.items())


@pytest.mark.parametrize("mesh", engines(), ids=engine_id)
def test_reference_policy(model_dir, mesh):
    seqs = make_seqs(6, seed=101, lo=4, hi=30)
    with meshlm.Policy(model_dir, lr=1e-2, **mesh) as p, \
            meshlm.Policy(model_dir, lr=1e-2, **mesh) as q, \
            meshlm.Policy(model_dir, lr=1e-2, **mesh) as init:
        info = p.info
        mine = seqs[info["dp_rank"]::info["dp_size"]]
        with pytest.raises(meshlm.MeshlmError, match="no reference policy"):
            p.reference_logprobs(seqs)
        p.set_reference()
        for _ in range(2):
            ra = p.train_step(mine)
            rb = q.train_step(mine)
            assert ra["loss"] == rb["loss"] and ra["grad_norm"] == rb["grad_norm"]
        ref, ref_sums = p.reference_logprobs(seqs)
        want, want_sums = init.logprobs(seqs)
        for a, b in zip(ref, want):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ref_sums, want_sums)
        now = p.logprobs(seqs)[0]
        assert any(not np.array_equal(a, b) for a, b in zip(now, want))  # training moved it
        for a, b in zip(now, q.logprobs(seqs)[0]):
            np.testing.assert_array_equal(a, b)  # the policy untouched by the exchange
        ra = p.train_step(mine)
        rb = q.train_step(mine)
        assert ra["loss"] == rb["loss"] and ra["grad_norm"] == rb["grad_norm"]
        p.set_reference()
        for a, b in zip(p.reference_logprobs(seqs)[0], p.logprobs(seqs)[0]):
            np.testing.assert_array_equal(a, b)


def test_inference_only_bf16(model_dir):
    """Policy(inference_only=True) under bf16: the weights in bf16 alone, the same log-probs
    and reference log-probs as a training policy's bitwise; training refused naming the
    option."""
    seqs = make_seqs(4, seed=103, lo=4, hi=30)
    with meshlm.Policy(model_dir, param_dtype="bf16") as p, \
            meshlm.Policy(model_dir, param_dtype="bf16", inference_only=True) as q:
        want = p.logprobs(seqs)[0]
        q.set_reference()
        for got in (q.logprobs(seqs)[0], q.reference_logprobs(seqs)[0]):
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)
        info = q.info
        with pytest.raises(meshlm.MeshlmError, match="inference_only"):
            q.train_step(seqs[info["dp_rank"]::info["dp_size"]])
