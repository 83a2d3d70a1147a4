"""Policy.logprobs against the `meshlm logprobs` command on the same sequences."""

import json
import os
import struct
import warnings

import numpy as np
import pytest
from conftest import RANK, make_seqs, mesh_id, meshes, wait_for

import meshlm
from meshlm import tools

# The library's meshlm_logprobs and the CLI's logprobs are the same code
# path: the same micro-batch planner (engine/pack.h, both given the same
# micro_batch_tokens), forward pass and vocab-parallel log-softmax; the CLI
# prints each fp32 value with %.9g, which round-trips fp32 exactly.  On one
# rank the two are bit-identical (measured).  The tolerance covers what may
# differ in summation order, not in math: on a data-parallel mesh the
# log-softmax runs vocab-parallel over the FSDP group (its max and sum over
# the vocabulary shards: measured 1 ulp, 4.8e-7 at |lp| ~5.5 for a 256-byte
# vocabulary), and a rank's share of the batch may be packed into other
# micro-batches than the one-process CLI packs them (another GEMM row
# blocking).  rtol 1e-6 / atol 1e-6 (~2 ulps at 5.5) allow that and nothing
# more: a wrong token, position or mask moves a log-prob by 1e-2 and more.
RTOL = ATOL = 1e-6
# On a tensor-parallel mesh the CLI (one process, tp 1) is another
# summation order again (row-parallel partial sums all-reduced over tp as
# well): the README's "any mesh gives the single-rank result within fp32
# rounding".  Measured: 1 ulp at tp 2; 5e-6 (~10 ulps of 5.5) leaves room
# for other BLAS kernels' orders, still far below any real error.
ATOL_TP = 5e-6
MICRO_BATCH_TOKENS = 256   # a few micro-batches per call


def cli_logprobs(rankdir, model_dir, seqs, tag):
    """`meshlm logprobs` (one process) on seqs: a list of float64 arrays."""
    data = os.path.join(rankdir, tag + ".in.jsonl")
    out = os.path.join(rankdir, tag + ".out.jsonl")
    with open(data, "w") as f:
        for s in seqs:
            f.write(json.dumps({"input_ids": [int(t) for t in s]}) + "\n")
    tools.run_cli(["logprobs", "--model", model_dir, "--data", data, "--out", out,
                   "--micro-batch-tokens", MICRO_BATCH_TOKENS])
    with open(out) as f:
        return [np.array(json.loads(line)["logprobs"], np.float64) for line in f]


@pytest.mark.parametrize("mesh", meshes(), ids=mesh_id)
def test_logprobs_equal_cli(model_dir, rankdir, mesh):
    seqs = make_seqs(12, seed=11, lo=2, hi=48)
    with meshlm.Policy(model_dir, micro_batch_tokens=MICRO_BATCH_TOKENS, **mesh) as p:
        info = p.info
        mine = seqs[info["dp_rank"]::info["dp_size"]]   # this data-parallel rank's share
        lps, sums = p.logprobs(mine)
        rng = np.random.default_rng(5)
        masks = [rng.integers(0, 2, size=len(s) - 1).astype(bool) for s in mine]
        mlps, msums = p.logprobs(mine, mask=masks)
        # the same mask as one concatenated array
        flat, fsums = p.logprobs(mine, mask=np.concatenate(masks).astype(np.uint8))
    ref = cli_logprobs(rankdir, model_dir, mine, "lp_" + mesh_id(mesh))
    atol = ATOL if not mesh else ATOL_TP
    assert len(lps) == len(mine) and sums.dtype == np.float64 and sums.shape == (len(mine),)
    for k, (s, a, r) in enumerate(zip(mine, lps, ref)):
        assert a.dtype == np.float32 and a.shape == (len(s) - 1,)
        np.testing.assert_allclose(a, r, rtol=RTOL, atol=atol, err_msg="sequence %d" % k)
        # the sum is the fp64 sum of the fp32 entries: equal up to summation order
        assert sums[k] == pytest.approx(np.sum(a, dtype=np.float64), rel=1e-12, abs=1e-9)
        # masked: 0 where the mask is 0, the unmasked value elsewhere (same call layout
        # up to the mask, so equal within the same tolerance), sums over the masked entries
        m = masks[k]
        assert np.all(mlps[k][~m] == 0)
        np.testing.assert_allclose(mlps[k][m], r[m], rtol=RTOL, atol=atol)
        tol = atol * max(1, m.sum()) + RTOL * np.abs(r[m]).sum()
        assert abs(msums[k] - r[m].sum()) <= tol
        np.testing.assert_array_equal(flat[k], mlps[k])
    np.testing.assert_array_equal(fsums, msums)


def test_logprobs_layouts(model_dir):
    """Token dtypes and containers: lists, int8..uint64 arrays, a 2-D array;
    an empty batch; the results do not depend on them."""
    seqs = make_seqs(4, seed=3, lo=5, hi=5)
    with meshlm.Policy(model_dir) as p:
        ref, ref_sums = p.logprobs(seqs)
        for conv in (lambda s: [list(map(int, x)) for x in s],
                     lambda s: [x.astype(np.uint8) for x in s],
                     lambda s: [x.astype(np.int16) for x in s],
                     lambda s: [x.astype(np.uint64) for x in s],
                     lambda s: np.stack(s).astype(np.int32)):
            got, got_sums = p.logprobs(conv(seqs))
            for a, b in zip(got, ref):
                np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(got_sums, ref_sums)
        empty, esums = p.logprobs([])
        assert empty == [] and esums.shape == (0,)
        one, osums = p.logprobs([np.array([65])])   # one token: nothing to predict
        assert one[0].shape == (0,) and osums[0] == 0


def nan_in_lm_head(path):
    """Set element [0, 0] of the output projection (lm_head.weight, or the tied
    embedding) of the fp32 safetensors file at path to NaN."""
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        name = "lm_head.weight" if "lm_head.weight" in header else "model.embed_tokens.weight"
        assert header[name]["dtype"] == "F32"
        f.seek(8 + n + header[name]["data_offsets"][0])
        f.write(np.float32(np.nan).tobytes())


def test_nonfinite_logprobs_warn(model_dir, shared_path):
    """A NaN weight makes every log-prob NaN: returned as they are, with one
    warning counting the unmasked ones and naming the first; counted in
    last_call_stats; no warning at finite weights."""
    seqs = make_seqs(3, seed=4, lo=4)
    d = shared_path("nan")
    with meshlm.Policy(model_dir) as p:
        p.export(d, dtype="fp32")
        if RANK == 0:
            nan_in_lm_head(os.path.join(d, "model.safetensors"))
            open(d + ".ready", "w").close()
        wait_for(d + ".ready")
        p.reload(d)
        mask = [np.r_[0, np.ones(len(s) - 2)] for s in seqs]
        n = sum(len(s) - 2 for s in seqs)
        with pytest.warns(UserWarning) as caught:
            lps, _ = p.logprobs(seqs, mask=mask)
        assert len(caught) == 1
        msg = str(caught[0].message)
        assert "%d log-probs are not finite" % n in msg and "sequence 0, entry 1" in msg, msg
        assert p.last_call_stats()["nonfinite_logprobs"] == n
        assert all(lp[0] == 0 and np.isnan(lp[1:]).all() for lp in lps)
        p.reload(model_dir)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            p.logprobs(seqs)
        assert p.last_call_stats()["nonfinite_logprobs"] == 0

