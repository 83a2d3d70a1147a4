"""Zero-copy interchange (meshlm.interop): DLPack producers in, torch and
ml_dtypes out.  torch and ml_dtypes are optional (CI installs neither): the
tests that need one skip without it; the numpy ones always run."""

import numpy as np
import pytest
from conftest import make_seqs

import meshlm


def test_as_numpy_numpy():
    a = np.arange(6, dtype=np.float32)
    assert meshlm.as_numpy(a) is a
    assert meshlm.as_numpy([1, 2]).tolist() == [1, 2]


def test_ml_dtypes_bf16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bits = meshlm.f32_to_bf16(np.array([1.5, -2.0, 3.140625], np.float32))
    b = meshlm.bf16_array(bits)
    assert b.dtype == ml_dtypes.bfloat16 and np.shares_memory(b, bits)
    np.testing.assert_array_equal(b.astype(np.float32), meshlm.bf16_to_f32(bits))
    back = meshlm.as_numpy(b)
    assert back.dtype == np.uint16 and np.shares_memory(back, bits)


def test_torch_in_and_out():
    torch = pytest.importorskip("torch")
    t = torch.arange(5, dtype=torch.int32)
    a = meshlm.as_numpy(t)
    assert a.dtype == np.int32 and a.ctypes.data == t.data_ptr()  # the same memory
    h = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    bits = meshlm.as_numpy(h)
    assert bits.dtype == np.uint16 and bits.ctypes.data == h.data_ptr()
    np.testing.assert_array_equal(bits, meshlm.f32_to_bf16(np.array([1.5, -2.0], np.float32)))
    out = meshlm.to_torch({"w": bits, "lps": [np.ones(3, np.float32)]}, bf16_bits=True)
    assert out["w"].dtype == torch.bfloat16 and out["w"].data_ptr() == bits.ctypes.data
    assert torch.equal(out["w"], h)
    assert out["lps"][0].dtype == torch.float32


def test_policy_takes_torch(model_dir):
    """Token sequences, masks and reload_tensors' weights given as torch tensors
    (bf16 among them) give bitwise what their numpy twins give; a bf16 refit
    handed to torch without a copy reloads as its bits do."""
    torch = pytest.importorskip("torch")
    seqs = make_seqs(3, seed=21, lo=4, hi=12)
    masks = [np.arange(len(s) - 1) % 2 for s in seqs]
    with meshlm.Policy(model_dir) as p:
        want, wsums = p.logprobs(seqs, mask=masks)
        got, gsums = p.logprobs([torch.from_numpy(s) for s in seqs],
                                mask=[torch.from_numpy(m) for m in masks])
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(gsums, wsums)
        w = p.refit(root=0, dtype="bf16")  # every rank passes root 0: rank 0 gets them
        name = sorted(w)[0] if w else None
        full = meshlm.to_torch(w, bf16_bits=True) if w else None
        if p.info["world"] == 1:
            t = full[name]
            assert t.dtype == torch.bfloat16 and t.data_ptr() == w[name].ctypes.data
            p.reload_tensors({name: w[name]})  # the bf16 bits as numpy
            from_bits, _ = p.logprobs(seqs)
            p.reload_tensors({name: t * 0})
            zero, _ = p.logprobs(seqs)
            p.reload_tensors({name: t})  # the same bits as a torch.bfloat16 tensor
            from_torch, _ = p.logprobs(seqs)
            assert any(not np.array_equal(a, b) for a, b in zip(zero, from_bits))
            for a, b in zip(from_torch, from_bits):
                np.testing.assert_array_equal(a, b)
