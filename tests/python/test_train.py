"""train_step: the losses' values at a known point, the step count, save / resume."""

import math

import numpy as np
import pytest
from conftest import make_seqs, mesh_id, meshes

import meshlm

# The loss of a step is the mean of per-token terms computed by the training
# forward pass, reduced over micro-batches and ranks (its own summation
# order, fp32 log-probs, the sums in higher precision); the expected value is
# the same mean of logprobs()'s fp32 values summed here in float64.  Each
# per-token log-prob agrees to a few fp32 ulps (~1e-6 of ~5.5, see
# test_logprobs), so the mean does too: rtol 1e-5 leaves a margin of ~10x and
# is still far below what one wrong token, mask entry or weight would change
# (~1e-2 relative on a batch of a few hundred tokens).
RTOL = 1e-5


def batch(n=8, seed=21):
    seqs = make_seqs(n, seed=seed, lo=3, hi=30)
    rng = np.random.default_rng(seed + 1)
    masks = []
    for s in seqs:
        m = rng.integers(0, 2, size=len(s) - 1).astype(bool)
        m[-1] = True   # every sequence has a target
        masks.append(m)
    weights = rng.normal(size=n).astype(np.float32)
    return seqs, masks, weights


def mine(info, *lists):
    """This data-parallel rank's share of each list."""
    sel = slice(info["dp_rank"], None, info["dp_size"])
    return [lst[sel] for lst in lists]


@pytest.mark.parametrize("mesh", meshes(), ids=mesh_id)
def test_train_step_losses(model_dir, mesh):
    seqs, masks, w = batch()
    total = int(sum(m.sum() for m in masks))
    with meshlm.Policy(model_dir, lr=1e-3, **mesh) as p:
        info = p.info
        assert info["step"] == 0
        my_seqs, my_masks, my_w = mine(info, seqs, masks, list(w))

        def all_lps():
            # every rank scores the whole global batch itself, so that each can
            # compute the expected global loss without communication
            return p.logprobs(seqs, mask=masks)[0]

        # NLL at step 1: the mean of -log p over the global batch's masked tokens
        lps = all_lps()
        want = -sum(l[m].sum(dtype=np.float64) for l, m in zip(lps, masks)) / total
        r = p.train_step(my_seqs, loss="nll", token_mask=my_masks)
        assert r["loss"] == pytest.approx(want, rel=RTOL)
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 and not r["skipped"]
        assert r["step"] == 1 and p.info["step"] == 1
        assert r["tokens"] == total and r["sequences"] == len(seqs)
        assert r["lr"] == pytest.approx(1e-3) and r["kl"] == 0

        # sequence level: the mean over sequences of each one's mean
        lps = all_lps()
        want = -np.mean([l[m].mean(dtype=np.float64) for l, m in zip(lps, masks)])
        r = p.train_step(my_seqs, loss="nll", token_mask=my_masks, sequence_level=True)
        assert r["loss"] == pytest.approx(want, rel=RTOL) and r["step"] == 2

        # weighted NLL with per-sequence weights (REINFORCE), masks as one flat array
        lps = all_lps()
        want = -sum(float(wk) * l[m].sum(dtype=np.float64)
                    for l, m, wk in zip(lps, masks, w)) / total
        r = p.train_step(my_seqs, loss="weighted_nll",
                         token_mask=np.concatenate(my_masks) if my_masks else [],
                         seq_weights=np.array(my_w, np.float32))
        assert r["loss"] == pytest.approx(want, rel=RTOL, abs=1e-6) and r["step"] == 3

        # clipped PG at the sampling policy (old = current log-probs): every ratio
        # is 1 (to fp32 rounding), nothing is clipped, loss = -sum(m A) / sum(m);
        # the k3 KL to a reference equal to the policy is 0
        lps = all_lps()
        my_lps, = mine(info, lps)
        want = -sum(float(wk) * m.sum() for m, wk in zip(masks, w)) / total
        r = p.train_step(my_seqs, loss="clipped_pg", token_mask=my_masks,
                         seq_weights=np.array(my_w, np.float32), old_logprobs=my_lps,
                         ref_logprobs=my_lps, kl_penalty=0.1)
        assert r["loss"] == pytest.approx(want, rel=1e-4, abs=1e-5)
        assert r["clip_fraction"] == 0 and abs(r["kl"]) < 1e-6 and r["step"] == 4
        assert math.isfinite(r["grad_norm"]) and not r["skipped"]

        # per-token weights equal to the sequence weights give the same loss
        lps = all_lps()
        my_lps, = mine(info, lps)
        tw = [np.full(len(s) - 1, wk, np.float32) for s, wk in zip(my_seqs, my_w)]
        want = -sum(float(wk) * m.sum() for m, wk in zip(masks, w)) / total
        r = p.train_step(my_seqs, loss="clipped_pg", token_mask=my_masks, token_weights=tw,
                         old_logprobs=my_lps)
        assert r["loss"] == pytest.approx(want, rel=1e-4, abs=1e-5) and r["step"] == 5


def test_train_step_learns_and_counts(model_dir, shared_path):
    """Ten NLL steps on one batch lower its loss; an empty share on a rank is
    allowed (rank > 0 passes nothing); save / resume restore the step and the
    weights."""
    seqs = make_seqs(4, seed=8, lo=8, hi=16)
    with meshlm.Policy(model_dir, lr=1e-2) as p:
        info = p.info
        share = seqs if info["dp_rank"] == 0 else []
        losses = [p.train_step(share)["loss"] for _ in range(10)]
        assert all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0] - 0.1
        assert p.info["step"] == 10
        lps, _ = p.logprobs(seqs)
        d = shared_path("ckpt")
        p.save(d)
    with meshlm.Policy(model_dir) as q:
        assert q.info["step"] == 0
        q.resume(d)
        assert q.info["step"] == 10
        lps2, _ = q.logprobs(seqs)
        for a, b in zip(lps, lps2):
            np.testing.assert_array_equal(a, b)
        r = q.train_step(seqs[q.info["dp_rank"]::q.info["dp_size"]])
        assert r["step"] == 11
