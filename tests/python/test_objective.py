"""Python objectives (MESHLM_LOSS_CUSTOM), importance sampling, the split
steps' Python side, and non-finite inputs.

* Every built-in loss re-implemented as a Python callable: the same
  per-target fp64 arithmetic (math.exp is the C library's exp, Python floats
  are IEEE doubles without contraction), so the gradient weights are the same
  fp32 numbers: the grad norm and the weights after the step are bitwise the
  built-in's.  The loss is a fp64 sum of the same N terms w*l, which the
  built-in may fuse into its accumulation (an fma under -march=native, the
  product not rounded) while the callable's terms are rounded first: each sum
  is within gamma64(N + 1) * sum|w*l| of the exact one (recursive summation,
  tests/tolerance.h R2), so the two differ by at most twice that.
* DPO and GSPO against double-precision references written here, from
  logprobs()'s sequence sums: the objective's seq_logprobs come from the same
  forward-only pass (the same numbers), so the losses differ by the fp64
  summation of their terms only (the bound above, with the reference's own sum
  of K terms).
* Importance sampling at known points: old = logprobs()'s values, the ratio
  r = exp(lp - old) = 1 to a few fp32 ulps (the training forward and
  logprobs() agree to ~1e-6 relative, test_train), gen = old - log(rho) with
  chosen rho: the loss is -sum(m A rho) / sum(m) within test_train's clipped-PG
  tolerance (rel 1e-4, abs 1e-5: r's ~1e-6 times |A rho| <= 10, with margin);
  the mismatch metrics are functions of the inputs only, computed here in
  double from the same fp32 arrays in another summation order (gamma64 of the
  count, relative).
"""

import math

import numpy as np
import pytest
from conftest import make_seqs, mesh_id, meshes

import meshlm

U64 = 2.0 ** -53


def gamma64(k):
    return k * U64 / (1.0 - k * U64)


def batch(n=8, seed=51):
    seqs = make_seqs(n, seed=seed, lo=4, hi=24)
    rng = np.random.default_rng(seed + 1)
    masks = []
    for s in seqs:
        m = rng.integers(0, 2, size=len(s) - 1).astype(bool)
        m[-1] = True
        masks.append(m)
    return seqs, masks, rng


def share(info, *lists):
    """This data-parallel rank's share (contiguous halves keep DPO pairs together)."""
    n = len(lists[0])
    per = n // info["dp_size"]
    sel = slice(info["dp_rank"] * per, (info["dp_rank"] + 1) * per)
    return [lst[sel] for lst in lists]


# --- the built-ins as Python objectives (parallel/objective.c's arithmetic) ------------------

def builtin_terms(kind, x, w, A, old, ref, beta, lo=0.2, hi=0.2):
    """(w*l, w*dl) of one target as parallel/objective.c computes them."""
    if kind == "nll":
        l, dl = -x, -1.0
    elif kind == "weighted_nll":
        l, dl = -A * x, -A
    else:
        r = math.exp(x - old)
        rc = min(max(r, 1.0 - lo), 1.0 + hi)
        l1, l2 = -A * r, -A * rc
        l = l1 if l1 >= l2 else l2
        dl = -A * r if l1 >= l2 else 0.0
    if kind != "nll" and beta > 0:
        d = ref - x
        e = math.exp(d)
        l += beta * (e - d - 1.0)
        dl += beta * (1.0 - e)
    return w * l, w * dl


def as_objective(kind, beta):
    # the library's fields are fp32 (meshlm_loss): the same numbers here
    lo, hi, beta = float(np.float32(0.2)), float(np.float32(0.2)), float(np.float32(beta))

    def fn(c):
        loss = np.empty(len(c.logprobs))
        grad = np.empty(len(c.logprobs))
        t = c.tensors
        for i in range(len(c.logprobs)):
            A = float(np.float32(t["tw"][i]))
            loss[i], grad[i] = builtin_terms(kind, float(c.logprobs[i]), float(c.weight[i]), A,
                                             float(t["old"][i]), float(t["ref"][i]), beta,
                                             lo, hi)
        return loss, grad
    return fn


@pytest.mark.parametrize("mesh", meshes(), ids=mesh_id)
@pytest.mark.parametrize("kind,beta,seq_level", [("nll", 0.0, False), ("nll", 0.0, True),
                                                 ("weighted_nll", 0.0, False),
                                                 ("clipped_pg", 0.05, False),
                                                 ("clipped_pg", 0.0, True)])
def test_builtins_as_callables(model_dir, mesh, kind, beta, seq_level):
    seqs, masks, rng = batch()
    with meshlm.Policy(model_dir, lr=1e-3, **mesh) as p, \
            meshlm.Policy(model_dir, lr=1e-3, **mesh) as q:
        lps = p.logprobs(seqs)[0]
        tw = [rng.normal(size=len(l)).astype(np.float32) for l in lps]
        old = [(l + rng.uniform(-0.3, 0.3, size=len(l))).astype(np.float32) for l in lps]
        ref = [(l + rng.uniform(-0.1, 0.1, size=len(l))).astype(np.float32) for l in lps]
        info = p.info
        my = share(info, seqs, masks, tw, old, ref)
        kw = dict(token_mask=my[1], token_weights=my[2], old_logprobs=my[3], ref_logprobs=my[4],
                  sequence_level=seq_level, kl_penalty=beta)
        ra = p.train_step(my[0], loss=kind, **kw)
        kw.pop("kl_penalty")
        rb = q.train_step(my[0], loss=as_objective(kind, beta),
                          tensors={"tw": my[2], "old": my[3], "ref": my[4]}, **kw)
        assert ra["grad_norm"] == rb["grad_norm"]
        assert ra["tokens"] == rb["tokens"] and ra["step"] == rb["step"]
        # the bound's sum|w*l| over the global batch, from logprobs()'s values (within ~1e-6
        # relative of the training forward's: the factor 2 covers it)
        total = sum(int(m.sum()) for m in masks)
        nseq = sum(1 for m in masks if m.any())
        absum = 0.0
        for k, (l, m) in enumerate(zip(lps, masks)):
            for t in np.flatnonzero(m):
                w = 1.0 / (int(m.sum()) * nseq) if seq_level else 1.0 / total
                absum += abs(builtin_terms(kind, float(l[t]), float(np.float32(w)),
                                           float(tw[k][t]), float(old[k][t]),
                                           float(ref[k][t]), beta)[0])
        assert abs(ra["loss"] - rb["loss"]) <= 2.0 * 2.0 * gamma64(total + 1) * absum
        for a, b in zip(p.logprobs(seqs)[0], q.logprobs(seqs)[0]):
            np.testing.assert_array_equal(a, b)  # the same update


# --- DPO and GSPO ------------------------------------------------------------------------------

def log_sigmoid(z):
    return -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))


def dpo_objective(beta):
    """NeMo RL DPOLossFn's preference term: pairs (2j, 2j + 1) = (chosen,
    rejected) of this rank's batch, reward r_k = S_k - R_k (the sequence's
    masked log-prob sum minus the reference's), L_p = -log sigmoid(beta (r_c -
    r_r)), the mean over the global pairs P.  Each pair's L_p / P is split
    evenly over its masked targets (n_p of them); dL/dlp_t = dL/dS_k / P."""
    def fn(c):
        P = c.global_sequences / 2
        S = c.seq_logprobs
        t = c.tensors
        loss = np.empty(len(c.logprobs))
        grad = np.empty(len(c.logprobs))
        for i, k in enumerate(c.seq):
            ch, rj = k - k % 2, k - k % 2 + 1
            z = beta * ((S[ch] - t["ref_c"][i]) - (S[rj] - t["ref_r"][i]))
            dz = -1.0 / (1.0 + math.exp(z))  # d(-log sigmoid z)/dz = -sigmoid(-z)
            loss[i] = -log_sigmoid(z) / (P * t["pair_targets"][i])
            grad[i] = (1.0 if k == ch else -1.0) * beta * dz / P
        return loss, grad
    return fn


def test_dpo(model_dir):
    beta = 0.5
    seqs, masks, rng = batch(n=8, seed=61)
    with meshlm.Policy(model_dir, lr=1e-2) as p:
        info = p.info
        _, sums = p.logprobs(seqs, mask=masks)
        ref_sum = np.array([s - rng.uniform(0.0, 2.0) for s in sums])  # a reference policy
        pair_t = np.array([masks[k - k % 2].sum() + masks[k - k % 2 + 1].sum()
                           for k in range(len(seqs))], np.float64)
        ref_c = np.array([ref_sum[k - k % 2] for k in range(len(seqs))])
        ref_r = np.array([ref_sum[k - k % 2 + 1] for k in range(len(seqs))])
        my = share(info, seqs, masks, list(pair_t), list(ref_c), list(ref_r))
        kw = dict(token_mask=my[1], seq_logprobs=True,
                  seq_tensors={"pair_targets": my[2], "ref_c": my[3], "ref_r": my[4]})
        obj = dpo_objective(beta)
        # the double reference from logprobs()'s sums (the objective's pre-pass computes the
        # same numbers, api_score)
        pairs = [-log_sigmoid(beta * ((sums[j] - ref_sum[j]) - (sums[j + 1] - ref_sum[j + 1])))
                 for j in range(0, len(seqs), 2)]
        want = sum(pairs) / len(pairs)
        ev = p.eval_loss(my[0], loss=obj, **kw)
        assert abs(ev["loss"] - want) <= 2.0 * gamma64(sum(pair_t) / 2 + len(pairs)) * want
        r = p.train_step(my[0], loss=obj, **kw)
        assert r["loss"] == ev["loss"] and not r["skipped"]
        after = p.eval_loss(my[0], loss=obj, **kw)
        assert after["loss"] < r["loss"]  # the gradient's sign and scale move the margins up


def gspo_objective(eps):
    """GSPO (NeMo RL ClippedPGLossFn with sequence_level_importance_ratios):
    s_k = exp(mean_{masked t in k} (lp_t - old_t)), l_k = max(-A_k s_k, -A_k
    clip(s_k, 1 - eps, 1 + eps)), the loss the mean over sequences (sequence
    level: weight_t = 1 / (n_k K)).  Per target: weight_t * l_k, and
    dL/dlp_t = weight_t * dl_k/ds_k * s_k (ds_k/dlp_t = s_k / n_k; the weight
    carries 1 / n_k)."""
    def fn(c):
        t = c.tensors
        loss = np.empty(len(c.logprobs))
        grad = np.empty(len(c.logprobs))
        for i, k in enumerate(c.seq):
            n = t["n"][i]
            s = math.exp((c.seq_logprobs[k] - t["old_sum"][i]) / n)
            A = t["A"][i]
            sc = min(max(s, 1.0 - eps), 1.0 + eps)
            l1, l2 = -A * s, -A * sc
            loss[i] = c.weight[i] * max(l1, l2)
            grad[i] = c.weight[i] * (-A * s if l1 >= l2 else 0.0)
        return loss, grad
    return fn


def test_gspo(model_dir):
    eps = 0.2
    seqs, masks, rng = batch(n=8, seed=71)
    with meshlm.Policy(model_dir, lr=1e-3) as p:
        info = p.info
        lps, sums = p.logprobs(seqs, mask=masks)
        n = np.array([m.sum() for m in masks], np.float64)
        shift = rng.uniform(-0.5, 0.5, size=len(seqs))  # mean log-ratio per sequence
        old_sum = sums - shift * n
        A = rng.normal(size=len(seqs))
        my = share(info, seqs, masks, list(n), list(old_sum), list(A))
        obj = gspo_objective(eps)
        kw = dict(token_mask=my[1], sequence_level=True, seq_logprobs=True,
                  seq_tensors={"n": my[2], "old_sum": my[3], "A": my[4]})
        ls = []
        for k in range(len(seqs)):
            s = math.exp((sums[k] - old_sum[k]) / n[k])
            ls.append(max(-A[k] * s, -A[k] * min(max(s, 1 - eps), 1 + eps)))
        want = sum(ls) / len(seqs)
        assert any(abs(x) > eps for x in shift)  # some ratios clipped, some not
        r = p.eval_loss(my[0], loss=obj, **kw)
        absum = sum(abs(x) for x in ls) / len(seqs)
        # the terms weight_t l_k: fp32 weights (relative 2^-24 each) summed in fp64
        assert abs(r["loss"] - want) <= (2.0 ** -24 + 2.0 * gamma64(n.sum() + len(seqs))) * absum


# --- importance sampling -------------------------------------------------------------------------

@pytest.mark.parametrize("level,trunc,lo,hi", [("token", "none", 0.0, 0.0),
                                               ("token", "tis", 0.0, 1.5),
                                               ("token", "icepop", 0.5, 1.5),
                                               ("token", "seq-mask-tis", 0.9, 1.1),
                                               ("sequence", "none", 0.0, 0.0)])
def test_importance_sampling(model_dir, level, trunc, lo, hi):
    seqs, masks, rng = batch(n=8, seed=81)
    with meshlm.Policy(model_dir, lr=1e-3) as p:
        info = p.info
        lps = p.logprobs(seqs)[0]
        rho_want = [np.exp(rng.uniform(-0.7, 0.7, size=len(l))) for l in lps]
        old = [l.astype(np.float32) for l in lps]
        gen = [(o - np.log(r)).astype(np.float32) for o, r in zip(old, rho_want)]
        A = [rng.normal(size=len(l)).astype(np.float32) for l in lps]
        # the reference: rho from the fp32 arrays as the library computes it (fp64)
        total, num, merr, gkl, oob, oob_of = 0, 0.0, 0.0, 0.0, 0, 0
        nseq = 0
        for k in range(len(seqs)):
            m = masks[k]
            d = old[k].astype(np.float64) - gen[k].astype(np.float64)
            if level == "sequence":
                rho = np.full(len(d), math.exp(d[m].sum()))
            else:
                rho = np.exp(d)
            if trunc == "tis":
                oob += int((rho[m] > hi).sum())
                oob_of += int(m.sum())
                rho = np.minimum(rho, hi)
            elif trunc == "icepop":
                out = ~((rho >= lo) & (rho <= hi))
                oob += int(out[m].sum())
                oob_of += int(m.sum())
                rho = np.where(out, 0.0, rho)
            elif trunc == "seq-mask-tis":
                geo = math.exp(d[m].mean())
                keep = lo <= geo <= hi
                oob += int(not keep)
                oob_of += 1
                rho = rho if keep else np.zeros_like(rho)
            nk = int(m.sum())
            nseq += 1
            total += nk
            contrib = float(-(A[k][m].astype(np.float64) * rho[m].astype(np.float32)).sum())
            num += contrib / nk if level == "sequence" else contrib
            merr += float(np.exp(np.abs(d[m])).sum())
            gkl += float((np.exp(d[m]) - d[m] - 1.0).sum())
        want = num / nseq if level == "sequence" else num / total
        my = share(info, seqs, masks, old, gen, A)
        r = p.train_step(my[0], loss="clipped_pg", token_mask=my[1], old_logprobs=my[2],
                         generation_logprobs=my[3], token_weights=my[4],
                         sequence_level=(level == "sequence"), ratio_clip_min=0.5,
                         ratio_clip_max=0.5, is_level=level, is_truncation=trunc,
                         is_ratio_min=lo, is_ratio_max=hi)
        assert r["loss"] == pytest.approx(want, rel=1e-4, abs=1e-5)
        assert r["token_mult_prob_error"] == pytest.approx(merr / total, rel=gamma64(total + 8))
        assert r["gen_kl_error"] == pytest.approx(gkl / total, rel=1e-12, abs=gamma64(total + 8)
                                                  * merr / total)
        assert r["is_oob_fraction"] == (oob / oob_of if oob_of else 0.0)
        if trunc != "none":
            assert 0 < oob < oob_of  # the case truncates some, not all


# --- non-finite inputs, objective errors, split steps --------------------------------------------

@pytest.mark.parametrize("field", ["token_weights", "old_logprobs", "ref_logprobs",
                                   "generation_logprobs", "seq_weights"])
def test_nan_input_is_a_skipped_step(model_dir, field):
    seqs, masks, rng = batch(n=4, seed=91)
    with meshlm.Policy(model_dir, lr=1e-2) as p:
        info = p.info
        lps = p.logprobs(seqs)[0]
        arrays = {"token_weights": [np.ones(len(l), np.float32) for l in lps],
                  "old_logprobs": [l.copy() for l in lps],
                  "ref_logprobs": [l.copy() for l in lps],
                  "generation_logprobs": [l.copy() for l in lps],
                  "seq_weights": np.ones(len(seqs), np.float32)}
        if field == "seq_weights":
            arrays[field][0] = np.nan
        else:
            arrays[field][0][int(np.flatnonzero(masks[0])[0])] = np.nan
        my = share(info, seqs, masks, arrays["token_weights"], arrays["old_logprobs"],
                   arrays["ref_logprobs"], arrays["generation_logprobs"])
        sw = share(info, list(arrays["seq_weights"]))[0]
        r = p.train_step(my[0], loss="clipped_pg", token_mask=my[1], token_weights=my[2],
                         old_logprobs=my[3], ref_logprobs=my[4], generation_logprobs=my[5],
                         seq_weights=np.array(sw, np.float32), kl_penalty=0.1,
                         is_level="token")
        assert r["skipped"] and r["step"] == 1 and not math.isfinite(r["loss"])
        assert "the loss is not finite" in r["skip_reason"]
        if info["dp_rank"] == 0:
            assert field + "[" in r["skip_reason"]
        for a, b in zip(lps, p.logprobs(seqs)[0]):
            np.testing.assert_array_equal(a, b)  # no update


def test_objective_error_and_split_steps(model_dir):
    seqs, masks, _ = batch(n=4, seed=95)
    with meshlm.Policy(model_dir, lr=1e-2) as p, meshlm.Policy(model_dir, lr=1e-2) as q:
        info = p.info
        my = share(info, seqs, masks)

        def broken(c):
            raise KeyError("no such tensor")
        for pol in (p, q):  # the failed call's step: skipped, counted, on both
            with pytest.raises(meshlm.MeshlmError, match="objective raised KeyError") as e:
                pol.forward_backward(my[0], loss=broken, token_mask=my[1])
            assert isinstance(e.value.__cause__, KeyError)
            r = pol.optimizer_step()
            assert r["skipped"] and "loss.objective" in r["skip_reason"] and r["step"] == 1
        # split = train_step bitwise
        ra = q.train_step(my[0], token_mask=my[1])
        p.zero_grad()
        fb = p.forward_backward(my[0], token_mask=my[1])
        rb = p.optimizer_step()
        assert fb["loss"] == ra["loss"] == rb["loss"] and ra["grad_norm"] == rb["grad_norm"]
        assert rb["step"] == ra["step"] == 2
        for a, b in zip(p.logprobs(seqs)[0], q.logprobs(seqs)[0]):
            np.testing.assert_array_equal(a, b)
