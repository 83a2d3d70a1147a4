"""Policy.routing() and routing=: router replay (Megatron-LM's R3; model/moe.h)
through the binding, on the qwen3_moe fixture (8 experts, top 2, layer 0
dense).  The recorded routing has one (L_k, layers, k) array per sequence, -1
at the dense layer and k distinct experts elsewhere; a train step replaying it
is bitwise the step without (loss, grad norm, and the next log-probs); another
routing changes the loss; a wrong shape and a dense model are refused naming
the argument."""

import os

import numpy as np
import pytest
from conftest import REPO, make_seqs

import meshlm

QWEN3_MOE = os.path.join(REPO, "tests", "fixtures", "qwen3_moe")
LLAMA = os.path.join(REPO, "tests", "fixtures", "llama_untied")


def policy():
    return meshlm.Policy(QWEN3_MOE, max_grad_norm=0, micro_batch_tokens=24)


def mine(p, n=5, seed=11):
    return make_seqs(n, seed=seed, vocab=303)[p.info["dp_rank"]::p.info["dp_size"]]


def test_record():
    with policy() as p:
        seqs = mine(p)
        rt = p.routing(seqs)
        assert len(rt) == len(seqs)
        for r, s in zip(rt, seqs):
            assert r.dtype == np.int32 and r.shape == (len(s), 3, 2)
            assert (r[:, 0] == -1).all()
            assert ((r[:, 1:] >= 0) & (r[:, 1:] < 8)).all()
            assert (r[:, 1:, 0] != r[:, 1:, 1]).all()


def test_replay_own_is_bitwise():
    with policy() as a, policy() as c:
        seqs = mine(a)
        rt = a.routing(seqs)
        ra = a.train_step(seqs)
        rc = c.train_step(seqs, routing=rt)
        assert ra["loss"] == rc["loss"] and ra["grad_norm"] == rc["grad_norm"]
        for x, y in zip(a.logprobs(seqs)[0], c.logprobs(seqs)[0]):
            assert x.tobytes() == y.tobytes()


def test_replay_other_changes_the_loss():
    with policy() as p:
        seqs = mine(p)
        rt = p.routing(seqs)
        other = [np.where(r >= 0, (r + 1) % 8, r) for r in rt]
        own = p.eval_loss(seqs)["loss"]
        assert p.eval_loss(seqs, routing=np.concatenate(other))["loss"] != own


def test_refused():
    with policy() as p:
        seqs = mine(p)
        rt = p.routing(seqs)
        with pytest.raises(meshlm.MeshlmError, match=r"routing\[0\]: shape"):
            p.train_step(seqs, routing=[r[:, :2] for r in rt])
    with meshlm.Policy(LLAMA) as d:
        with pytest.raises(meshlm.MeshlmError, match="has no experts"):
            d.routing(make_seqs(2, seed=1))
