"""Errors raise meshlm.MeshlmError with a message, on every rank, and leave the
session usable."""

import os
import re

import numpy as np
import pytest
from conftest import RANK, WORLD, make_seqs

import meshlm


def raises(fn, *words):
    """fn() raises MeshlmError whose message names each of words (case-insensitive)."""
    with pytest.raises(meshlm.MeshlmError) as e:
        fn()
    msg = str(e.value)
    assert msg.strip(), "an empty message"
    for w in words:
        assert w.lower() in msg.lower(), "%r does not name %r" % (msg, w)
    return msg


def test_open_errors(model_dir, workdir):
    missing = os.path.join(workdir, "no-such-model")
    raises(lambda: meshlm.Policy(missing), "no-such-model")
    raises(lambda: meshlm.Policy(model_dir, tp=3))           # 3 does not divide the world
    raises(lambda: meshlm.Policy(model_dir, param_dtype="fp16"), "param_dtype")
    raises(lambda: meshlm.Policy(model_dir, schedule="step"), "schedule")


def test_message_without_c_location(workdir):
    """A library message reads as Python's: the C source location it carries
    ("config.c:NN") is kept apart in e.c_location."""
    with pytest.raises(meshlm.MeshlmError) as e:
        meshlm.Policy(os.path.join(workdir, "no-such-model"))
    assert re.fullmatch(r"[a-z_]+\.c:\d+", e.value.c_location or ""), e.value.c_location
    assert not re.search(r"\w\.c:\d+", str(e.value)), str(e.value)
    assert "no-such-model" in str(e.value)


def test_call_errors(model_dir):
    seqs = make_seqs(3, seed=9)
    with meshlm.Policy(model_dir) as p:
        ref, _ = p.logprobs(seqs)
        # bad lengths: a sequence of no token (the library's check) ...
        raises(lambda: p.logprobs([seqs[0], np.array([], np.int32)]))
        # ... and per-token arrays of the wrong length (the binding's, before the call)
        raises(lambda: p.logprobs(seqs, mask=np.ones(5, np.uint8)), "mask")
        raises(lambda: p.logprobs(seqs, mask=[np.ones(len(s), bool) for s in seqs]), "mask")
        raises(lambda: p.train_step(seqs, loss="weighted_nll", seq_weights=[1.0]),
               "seq_weights")
        # a token id outside the vocabulary, one that does not fit int32, a float id
        raises(lambda: p.logprobs([np.array([1, 256, 3])]), "256")
        raises(lambda: p.logprobs([np.array([1, 2 ** 40])]))
        raises(lambda: p.logprobs([np.array([1.0, 2.0])]), "dtype")
        raises(lambda: p.logprobs(np.arange(4)))                 # not a list of sequences
        # what a loss needs, left out; a field out of range
        raises(lambda: p.train_step(seqs, loss="clipped_pg"), "old_logprobs")
        raises(lambda: p.train_step(seqs, loss="nll", token_mask=[np.zeros(len(s) - 1)
                                                                  for s in seqs]))
        raises(lambda: p.train_step(seqs, loss="ppo"), "loss")
        raises(lambda: p.generate([seqs[0]], max_new_tokens=0), "max_new")
        raises(lambda: p.generate([seqs[0]], temperature=0.0), "temperature")
        # beyond the model's positions: refused before the outputs are allocated
        room = p.info["max_seq_len"] - len(seqs[0])
        for too_many in (room + 1, 2 ** 40):
            raises(lambda: p.generate([seqs[0]], max_new_tokens=too_many), "max_new_tokens",
                   str(room))
        raises(lambda: p.reload_tensors({"no.such.tensor": np.zeros(3, np.float32)}),
               "no.such.tensor")
        raises(lambda: p.reload_tensors({"lm_head.weight": np.zeros(3, np.int64)}), "dtype")
        # a mask value other than 0 / 1 (it was taken as 1)
        raises(lambda: p.logprobs(seqs, mask=[np.full(len(s) - 1, 0.5) for s in seqs]),
               "mask", "0.5", "sequence 0, entry 0")
        bits = [np.ones(len(s) - 1) for s in seqs]
        bits[1][2] = 2
        raises(lambda: p.train_step(seqs, token_mask=bits), "token_mask", "2",
               "sequence 1, entry 2")
        # a non-finite weight, named with its first index
        name, shape, _ = p.weights()[0]
        nan = np.zeros(shape, np.float32)
        nan.flat[3] = nan.flat[5] = np.nan
        raises(lambda: p.reload_tensors({name: nan}), name, "index 3")
        raises(lambda: p.export(p.model_dir + "/config.json"))   # an existing file
        raises(lambda: p.export("/tmp/x", dtype="fp8"), "dtype")
        # none of them changed the session: no step, the same log-probs
        assert p.info["step"] == 0
        again, _ = p.logprobs(seqs)
        for a, b in zip(ref, again):
            np.testing.assert_array_equal(a, b)
    # closed
    for call in (lambda: p.logprobs(seqs), lambda: p.train_step(seqs), lambda: p.info,
                 lambda: p.refit(), lambda: p.generate([seqs[0]]), lambda: p.save("/tmp/x")):
        raises(call, "closed")
    p.close()   # closing twice is fine
    assert p.closed


def test_one_rank_wrong(model_dir):
    """Arguments only one rank gets wrong: that rank raises the binding's
    message, the others an error naming it, and nobody waits forever."""
    seqs = make_seqs(2, seed=3)
    total = sum(len(s) - 1 for s in seqs)
    bad = RANK == WORLD - 1
    with meshlm.Policy(model_dir) as p:
        wrong_mask = np.ones(total + 1 if bad else total, np.uint8)
        for call in (lambda: p.logprobs(seqs, mask=wrong_mask),
                     lambda: p.logprobs(seqs, mask=np.full(total, 0.5 if bad else 1.0)),
                     lambda: p.train_step(seqs, token_mask=wrong_mask),
                     lambda: p.generate(np.arange(3) if bad else seqs, max_new_tokens=2),
                     lambda: p.generate(seqs, max_new_tokens=2 ** 40 if bad else 2),
                     lambda: p.reload_tensors({"x": np.zeros(2, np.int8)} if bad else {})):
            msg = raises(call)
            if not bad:
                assert "rank %d" % (WORLD - 1) in msg
        assert p.info["step"] == 0
        p.logprobs(seqs)


def test_close_during_call(model_dir):
    """Rank 0 closes while the others score: their call raises naming
    meshlm_close, the next one naming rank 0, and their close returns
    (it used to wait for rank 0 forever)."""
    if WORLD == 1:
        pytest.skip("needs more than one rank")
    seqs = make_seqs(2, seed=5)
    p = meshlm.Policy(model_dir)
    if RANK == 0:
        p.close()
    else:
        raises(lambda: p.logprobs(seqs), "meshlm_close")
        raises(lambda: p.logprobs(seqs), "rank 0 closed the session")
        p.close()
    assert p.closed
