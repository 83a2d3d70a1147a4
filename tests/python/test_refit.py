"""refit / refit_stream against export, reload and reload_tensors."""

import json
import os
import struct

import numpy as np
import pytest
from conftest import barrier, make_seqs, mesh_id, meshes

import meshlm

_ST_DTYPES = {"F32": np.float32, "BF16": np.uint16, "F16": np.float16, "I64": np.int64}


def read_safetensors(path):
    """A safetensors file as a dict name -> numpy array: 8 bytes little-endian
    header length, the JSON header (name -> dtype, shape, data_offsets
    relative to the data that follows; __metadata__), the raw little-endian
    data.  BF16 is returned as uint16 bits."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        begin, end = h["data_offsets"]
        dt = np.dtype(_ST_DTYPES[h["dtype"]]).newbyteorder("<")
        out[name] = np.frombuffer(data[begin:end], dtype=dt).reshape(h["shape"])
    return out


def read_checkpoint(d):
    """Every tensor of an HF checkpoint directory (one file or an index of shards)."""
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for fn in files:
        out.update(read_safetensors(os.path.join(d, fn)))
    return out


def assert_bytes_equal(a, b, name):
    assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
    assert a.shape == b.shape, (name, a.shape, b.shape)
    assert a.tobytes() == b.tobytes(), "%s differs" % name


@pytest.mark.parametrize("mesh", meshes(), ids=mesh_id)
def test_refit_equals_export(model_dir, shared_path, mesh):
    with meshlm.Policy(model_dir, lr=1e-2, **mesh) as p:
        info = p.info
        seqs = make_seqs(4, seed=2)[info["dp_rank"]::info["dp_size"]]
        p.train_step(seqs)   # weights that are no longer the source's
        weights = p.weights()
        for dtype in ("source", "bf16", "fp32"):
            d = shared_path("export_" + dtype)
            p.export(d, dtype=dtype)
            barrier(p)   # rank 0 wrote it
            exported = read_checkpoint(d)
            got = p.refit(root=-1, dtype=dtype)
            assert list(got) == [w[0] for w in weights]   # refit order
            assert set(exported) == set(got)
            for name, shape, src in weights:
                want = np.uint16 if dtype == "bf16" or (dtype == "source" and src == "bf16") \
                    else np.float32
                assert got[name].dtype == want and got[name].shape == shape
                assert_bytes_equal(got[name], exported[name], name)
            # to rank 0 only
            to0 = p.refit(root=0, dtype=dtype)
            if info["rank"] == 0:
                for name in got:
                    assert_bytes_equal(to0[name], got[name], name)
            else:
                assert to0 is None
            # streamed, one tensor at a time, to every rank
            seen = []
            p.refit_stream(lambda n, a: seen.append((n, a)), root=-1, dtype=dtype)
            assert [n for n, _ in seen] == list(got)
            for n, a in seen:
                assert_bytes_equal(a, got[n], n)
        # bf16 bits are fp32's upper halves (round to nearest even)
        f32, b16 = p.refit(-1, "fp32"), p.refit(-1, "bf16")
        for name in f32:
            np.testing.assert_array_equal(b16[name], meshlm.f32_to_bf16(f32[name]))


def test_refit_stream_views_and_stop(model_dir):
    with meshlm.Policy(model_dir) as p:
        full = p.refit(root=-1)
        names = []

        def keep_view(name, a):
            assert not a.flags.writeable
            assert_bytes_equal(a, full[name], name)
            names.append(name)

        p.refit_stream(keep_view, root=-1, copy=False)
        assert names == list(full)
        # returning False stops the refit: every rank fails
        with pytest.raises(meshlm.MeshlmError):
            p.refit_stream(lambda n, a: False, root=-1)
        # an exception in the callback stops it too and is re-raised
        with pytest.raises(ZeroDivisionError):
            p.refit_stream(lambda n, a: 1 / 0, root=-1)
        p.refit(root=-1)   # still usable


@pytest.mark.parametrize("mesh", meshes(), ids=mesh_id)
def test_reload_tensors_and_reload(model_dir, mesh):
    seqs = make_seqs(3, seed=4)
    with meshlm.Policy(model_dir, **mesh) as p:
        before = p.refit(root=-1)
        lp0, _ = p.logprobs(seqs)
        name = "lm_head.weight" if "lm_head.weight" in before else list(before)[-1]
        changed = {name: before[name] * np.float32(0.5)}
        p.reload_tensors(changed)
        after = p.refit(root=-1)
        assert_bytes_equal(after[name], changed[name], name)
        for n in before:
            if n != name:
                assert_bytes_equal(after[n], before[n], n)
        lp1, _ = p.logprobs(seqs)
        assert any(not np.array_equal(a, b) for a, b in zip(lp0, lp1))
        # bf16 bits given for an fp32 model: stored as their fp32 values
        bits = meshlm.f32_to_bf16(before[name])
        p.reload_tensors({name: bits})
        np.testing.assert_array_equal(p.refit(root=-1)[name], meshlm.bf16_to_f32(bits))
        # every weight from the source checkpoint again
        p.reload(model_dir)
        again = p.refit(root=-1)
        for n in before:
            assert_bytes_equal(again[n], before[n], n)
        lp2, _ = p.logprobs(seqs)
        for a, b in zip(lp0, lp2):
            np.testing.assert_array_equal(a, b)


def test_refit_matches_source_checkpoint(model_dir):
    """Before any step, refit("source") is the checkpoint the policy was opened from."""
    src = read_checkpoint(model_dir)
    with meshlm.Policy(model_dir) as p:
        got = p.refit(root=-1)
    for name, a in got.items():
        assert_bytes_equal(a, src[name], name)
