"""Policy.logprobs(return_entropy=True) and Policy.topk_logprobs (meshlm_score):
the log-probs bitwise the plain call's, every vocabulary entry once per
position with k = vocab_size, the next token's entry bitwise its log-prob,
best first (log-probs non-increasing: the logits' order), the top-5 a
bitwise prefix; the mask; bad k.
(The values against a float64 reference: tests/api/test_api_topk.c.)"""

import numpy as np
import pytest
from conftest import make_seqs, mesh_id, meshes

import meshlm


@pytest.mark.parametrize("mesh", meshes(), ids=mesh_id)
def test_entropy_and_topk(model_dir, mesh):
    seqs = make_seqs(6, seed=21, lo=1, hi=30)
    with meshlm.Policy(model_dir, **mesh) as p:
        V = p.info["vocab_size"]
        mine = seqs[p.info["dp_rank"]::p.info["dp_size"]]
        lps, sums = p.logprobs(mine)
        elps, esums, ent = p.logprobs(mine, return_entropy=True)
        ids, tlps = p.topk_logprobs(mine, V)
        ids5, tlps5 = p.topk_logprobs(mine, 5)
        rng = np.random.default_rng(3)
        masks = [rng.integers(0, 2, size=len(s) - 1).astype(bool) for s in mine]
        mids, mtlps = p.topk_logprobs(mine, 5, mask=masks)
        _, _, ment = p.logprobs(mine, mask=masks, return_entropy=True)
    np.testing.assert_array_equal(esums, sums)
    for s, a, b, h, i, t, i5, t5, m, mi, mt, mh in zip(mine, lps, elps, ent, ids, tlps, ids5,
                                                       tlps5, masks, mids, mtlps, ment):
        n = len(s) - 1
        assert a.tobytes() == b.tobytes()
        assert h.dtype == np.float32 and h.shape == (n,)
        assert np.all((h >= 0) & (h <= np.log(V) * (1 + 1e-6)))  # entropy of V outcomes
        assert i.dtype == np.int32 and i.shape == (n, V) and t.shape == (n, V)
        for r in range(n):
            assert sorted(i[r]) == list(range(V))  # every token once
            c = int(np.flatnonzero(i[r] == s[r + 1])[0])
            assert t[r, c].tobytes() == a[r].tobytes()
            assert np.all(np.diff(t[r]) <= 0)
        assert i5.tobytes() == np.ascontiguousarray(i[:, :5]).tobytes()
        assert t5.tobytes() == np.ascontiguousarray(t[:, :5]).tobytes()
        np.testing.assert_array_equal(mi, np.where(m[:, None], i5, -1))
        np.testing.assert_array_equal(mt, np.where(m[:, None], t5, 0))
        np.testing.assert_array_equal(mh, np.where(m, h, 0))


def test_topk_bad_k(model_dir):
    seqs = make_seqs(2, seed=1, lo=3, hi=6)
    with meshlm.Policy(model_dir) as p:
        V = p.info["vocab_size"]
        for k, words in ((-1, ["k", "-1"]), (V + 1, ["topk", str(V + 1), "vocab_size"]),
                         (2.0, ["k", "int"])):
            with pytest.raises(meshlm.MeshlmError) as e:
                p.topk_logprobs(seqs, k)
            for w in words:
                assert w.lower() in str(e.value).lower()
        ids, lps = p.topk_logprobs(seqs, 0)  # the session still works; k = 0: empty rows
        assert [x.shape for x in ids] == [(len(s) - 1, 0) for s in seqs]


@pytest.mark.parametrize("mesh", meshes(), ids=mesh_id)
def test_entropy_bonus(model_dir, mesh):
    """train_step(entropy_coef=c): the loss is the plain step's minus c times
    the reported mean entropy (the same forward; the fp64 sums of the
    objective's terms and the -c*w*H terms interleaved: within
    gamma64(2n + 2) of their absolute sum, tests/tolerance.h R2), which lies
    in [0, log V]; 0 reported without the bonus."""
    seqs = make_seqs(4, seed=8, lo=3, hi=20)
    c = float(np.float32(0.25))  # the C field is a float
    with meshlm.Policy(model_dir, **mesh) as p0, meshlm.Policy(model_dir, **mesh) as p1:
        V = p0.info["vocab_size"]
        mine = seqs[p0.info["dp_rank"]::p0.info["dp_size"]]
        r0 = p0.train_step(mine)
        r1 = p1.train_step(mine, entropy_coef=c)
    n = sum(len(s) - 1 for s in seqs)
    u64 = 2.0 ** -53
    bound = (2 * n + 2) * u64 / (1 - (2 * n + 2) * u64) * (abs(r0["loss"]) + c * r1["entropy"])
    assert abs(r1["loss"] + c * r1["entropy"] - r0["loss"]) <= bound
    assert 0 < r1["entropy"] <= np.log(V) and r0["entropy"] == 0.0
