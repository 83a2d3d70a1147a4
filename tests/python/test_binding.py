"""The binding itself: struct layouts against the header, library lookup,
bf16 helpers, options, info, generate."""

import ctypes
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest
from conftest import REPO, RANK, WORLD, make_seqs

import meshlm
from meshlm import _lib as L

STRUCTS = ["meshlm_options", "meshlm_info", "meshlm_seqs", "meshlm_loss", "meshlm_train_batch",
           "meshlm_step_result", "meshlm_weight", "meshlm_tensor", "meshlm_sampling",
           "meshlm_call_stats", "meshlm_fused", "meshlm_family", "meshlm_objective_chunk",
           "meshlm_scores"]


def test_struct_layouts_match_header():
    """Every ctypes.Structure has the header's fields at the C compiler's
    offsets and sizes (compiled with mpicc against include/meshlm/meshlm.h)."""
    cc = shutil.which("mpicc")
    header = os.path.join(REPO, "include", "meshlm", "meshlm.h")
    if not cc or not os.path.exists(header):
        pytest.skip("needs mpicc and include/meshlm/meshlm.h")
    with open(header) as f:
        declared = set(re.findall(r"typedef struct (\w+) \{", f.read()))
    assert declared == set(STRUCTS), "the header's structs and the binding's differ"
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "meshlm/meshlm.h"',
             'int main(void) {']
    want = []
    for s in STRUCTS:
        cls = getattr(L, s)
        lines.append('printf("%s %%zu\\n", sizeof(%s));' % (s, s))
        want.append("%s %d" % (s, ctypes.sizeof(cls)))
        for f, _ in cls._fields_:
            lines.append('printf("%s.%s %%zu %%zu\\n", offsetof(%s, %s), sizeof(((%s *)0)->%s));'
                         % (s, f, s, f, s, f))
            want.append("%s.%s %d %d" % (s, f, getattr(cls, f).offset, getattr(cls, f).size))
    lines.append("return 0; }")
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "layout.c"), os.path.join(d, "layout")
        with open(src, "w") as f:
            f.write("\n".join(lines) + "\n")
        subprocess.run([cc, "-I" + os.path.join(REPO, "include"), src, "-o", exe], check=True)
        got = subprocess.run([exe], check=True, stdout=subprocess.PIPE,
                             universal_newlines=True).stdout.split("\n")
    assert got[:-1] == want


def test_library_and_version():
    assert meshlm.version() == "0.2.0" == meshlm.__version__
    assert os.path.exists(meshlm.library_path())


def test_struct_sizes():
    """Every struct the library reads or writes carries its size, set by the
    binding (positional fields follow it); the library refuses another."""
    for s in STRUCTS:
        cls = getattr(L, s)
        if issubclass(cls, L.Sized):
            assert cls._fields_[0] == ("struct_size", ctypes.c_size_t), s
            assert cls().struct_size == ctypes.sizeof(cls), s
        else:
            assert s in ("meshlm_seqs", "meshlm_fused"), s  # embedded only, never sized
    tb = L.meshlm_train_batch(L.meshlm_seqs(0, None, None))
    assert tb.struct_size == ctypes.sizeof(tb) and tb.seqs.n == 0
    lib = L.load()
    o = L.meshlm_options()
    assert lib.meshlm_options_init(ctypes.byref(o), ctypes.sizeof(o) + 8) == -1
    assert o.struct_size == ctypes.sizeof(o) + 8  # only the size written
    assert lib.meshlm_options_init(ctypes.byref(o), ctypes.sizeof(o)) == 0
    assert o.struct_size == ctypes.sizeof(o) and o.micro_batch_tokens == 4096


def test_bf16_helpers():
    x = np.array([1.0, -2.5, 3.140625, 1 + 2 ** -8, 1 + 3 * 2 ** -9, 65504.0, np.inf, 0.0],
                 np.float32)
    b = meshlm.f32_to_bf16(x)
    assert b.dtype == np.uint16
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: to even (1); 1 + 3*2^-9 rounds up
    np.testing.assert_array_equal(meshlm.bf16_to_f32(b),
                                  [1.0, -2.5, 3.140625, 1.0, 1 + 2 ** -7, 65536.0, np.inf, 0.0])
    assert np.isnan(meshlm.bf16_to_f32(meshlm.f32_to_bf16(np.array([np.nan], np.float32))))[0]
    with pytest.raises(TypeError):
        meshlm.bf16_to_f32(np.zeros(2, np.float32))


def test_options_and_info(model_dir):
    with meshlm.Policy(model_dir, lr=3e-4, betas=(0.8, 0.9), schedule="cosine",
                       warmup_steps=2, total_steps=10, micro_batch_tokens=64,
                       activation_checkpointing="selective", unshard_for_inference=False) as p:
        o = p._options
        assert (o.lr, o.beta1, o.beta2, o.schedule, o.warmup_steps, o.total_steps,
                o.micro_batch_tokens, o.ac, o.unshard_for_inference) == \
            (3e-4, 0.8, 0.9, L.LR_COSINE, 2, 10, 64, L.AC_SELECTIVE, 0)
        # what was not given keeps meshlm_options_default's value
        d = L.meshlm_options()
        L.load().meshlm_options_init(ctypes.byref(d), ctypes.sizeof(d))
        assert (o.eps, o.weight_decay, o.max_grad_norm, o.tp) == \
            (d.eps, d.weight_decay, d.max_grad_norm, d.tp)
        i = p.info
        assert (i["rank"], i["world"]) == (RANK, WORLD)
        assert i["dp_shard"] == WORLD and i["dp_size"] == WORLD and i["tp"] == 1
        assert i["vocab_size"] == 256 and i["hidden_size"] == 64 and i["num_layers"] == 2
        assert i["num_params"] == sum(int(np.prod(s)) for _, s, _ in p.weights())
        assert i["eos_token_id"] == -1 and i["step"] == 0
        assert "closed" not in repr(p)
        # warmup: the first step's lr is 0, the second's lr / 2
        seqs = make_seqs(2, seed=1)[i["dp_rank"]::i["dp_size"]]
        assert p.train_step(seqs)["lr"] == 0
        assert p.train_step(seqs)["lr"] == pytest.approx(1.5e-4)
    assert "closed" in repr(p)


def test_readme_defaults_table():
    """README.md's "Defaults": every row's meshlm_options field exists and holds
    the library default the table gives (tests/unit/test_defaults_doc.c checks
    the flags, keys and the engine's table)."""
    from meshlm import policy as P
    d = L.meshlm_options()
    L.load().meshlm_options_init(ctypes.byref(d), ctypes.sizeof(d))
    words = {"param_dtype": P._DTYPES, "reduce_dtype": P._DTYPES, "output_dtype": P._DTYPES,
             "reshard_after_forward": P._RESHARD, "ac": P._AC, "schedule": P._SCHEDULES,
             "grad_norm_type": P._NORMS}
    text = open(os.path.join(REPO, "README.md")).read().split("## Defaults", 1)[1]
    rows = [[c.strip().strip("`") for c in line.strip().strip("|").split("|")]
            for line in text.split("\n## ", 1)[0].splitlines()
            if line.startswith("| ") and not line.startswith("| setting")]
    assert len(rows) > 10
    fields = {f for f, _ in L.meshlm_options._fields_}
    for _, flag, _, field, _, want in rows:
        assert field in fields, "README Defaults: %s: no meshlm_options.%s" % (flag, field)
        got = getattr(d, field)
        if field in words:
            expect = words[field][want]
        elif field == "parallel_plan":
            got, expect = got or b"auto", want.encode()
        elif field in ("freeze", "adapter", "fp32_params"):  # NULL: nothing frozen, no adapter,
            # the MoE routers alone kept in fp32
            got, expect = got or b"none", want.encode()
        elif field == "lora_targets":
            expect = want.encode()
        elif want in ("true", "false"):
            expect = int(want == "true")
        else:
            expect = float(want)
        assert got == expect, "README Defaults: meshlm_options.%s is %r, the table says %s" % (
            field, got, want)


def test_engine_options(model_dir):
    """The FSDP2 options and the grad norm reach the session (README "Defaults")."""
    with meshlm.Policy(model_dir, zero=2, prefetch_forward=0, prefetch_backward=3,
                       reshard_after_forward=False, output_dtype="fp32",
                       activation_checkpointing="mlp", grad_norm_type="inf",
                       cpu_offload=True) as p:
        o = p._options
        assert (o.zero, o.prefetch_forward, o.prefetch_backward, o.reshard_after_forward,
                o.output_dtype, o.ac, o.grad_norm_type, o.cpu_offload) == \
            (2, 0, 3, L.RESHARD_NEVER, L.DTYPE_F32, L.AC_MLP, float("inf"), 1)
        r = p.train_step(make_seqs(2, seed=3)[p.info["dp_rank"]::p.info["dp_size"]])
        assert r["grad_norm"] > 0 and not r["skipped"] and r["nonfinite_param"] == ""
    with pytest.raises(meshlm.MeshlmError, match="grad_norm_type"):
        meshlm.Policy(model_dir, grad_norm_type=1)


def test_generate(model_dir):
    prompts = make_seqs(3, seed=13, lo=3, hi=9)
    # the batch-invariant mode: a row's bits do not depend on the step's other rows (the
    # n-samples check below compares rows of different batches bitwise)
    with meshlm.Policy(model_dir, lr=1e-2, batch_invariant=True) as p:
        mine = prompts if p.info["rank"] == 0 else prompts[:1]   # n may differ per rank
        g1, l1, f1 = p.generate(mine, max_new_tokens=6, greedy=True)
        g2, l2, _ = p.generate(mine, max_new_tokens=6, greedy=True, seed=5)
        assert f1 == ["length"] * len(mine)
        assert all(np.array_equal(a, b) for a, b in zip(g1, g2))
        assert [len(t) for t in g1] == [6] * len(mine)   # no eos in a byte-vocabulary config
        # the per-rank replica (replica=True) against the policy's mesh (the default; here
        # one rank or dp_shard 2: FSDP's gathered weights are the replica's bits, the same
        # kernels run on them): bitwise the same
        gr, lr, _ = p.generate(mine, max_new_tokens=6, greedy=True, replica=True)
        assert all(np.array_equal(a, b) for a, b in zip(g1, gr))
        assert all(np.array_equal(a, b) for a, b in zip(l1, lr))
        assert all(t.dtype == np.int32 and lp.dtype == np.float32 for t, lp in zip(g1, l1))
        s1, _, _ = p.generate(mine, max_new_tokens=8, seed=1)
        s2, _, _ = p.generate(mine, max_new_tokens=8, seed=1)
        s3, _, _ = p.generate(mine, max_new_tokens=8, seed=2)
        assert all(np.array_equal(a, b) for a, b in zip(s1, s2))
        assert any(not np.array_equal(a, b) for a, b in zip(s1, s3))
        # the sampled tokens' log-probs are those logprobs() gives them (the KV-cache
        # decode is another summation order than the full forward: 1e-4 absolute)
        full = [np.concatenate([pr, t]) for pr, t in zip(mine, s1)]
        lps, _ = p.logprobs(full)
        _, sl, _ = p.generate(mine, max_new_tokens=8, seed=1)
        for pr, lp, got in zip(mine, lps, sl):
            np.testing.assert_allclose(got, lp[len(pr) - 1:], atol=1e-4, rtol=0)
        # eos: a sequence stops after it (the eos included)
        eos = int(g1[0][2])
        e, _, fe = p.generate(mine[:1], max_new_tokens=6, greedy=True, eos_token_id=eos)
        stop = int(np.argmax(g1[0] == eos)) + 1
        np.testing.assert_array_equal(e[0], g1[0][:stop])
        assert fe == ["stop"]
        # stop ids, per-prompt max_new_tokens, n samples per prompt (rows k·n + j), top_k /
        # min_p: greedy samples are each the n = 1 row, bitwise
        e, el, fe = p.generate(mine, max_new_tokens=[6] + [3] * (len(mine) - 1), greedy=True,
                               stop=[eos], eos_token_id=-2, n=2)
        assert len(e) == 2 * len(mine)
        for r, (t, lp, why) in enumerate(zip(e, el, fe)):
            k = r // 2
            cap = 6 if k == 0 else 3
            end = min(cap, int(np.argmax(g1[k] == eos)) + 1 if eos in g1[k][:cap] else cap)
            np.testing.assert_array_equal(t, g1[k][:end])
            np.testing.assert_array_equal(lp, l1[k][:end])
            assert why == ("stop" if t[-1] == eos else "length")
        t1, _, _ = p.generate(mine, max_new_tokens=8, seed=1, top_k=3, min_p=0.05, n=3)
        assert len(t1) == 3 * len(mine) and all(len(t) == 8 for t in t1)
        with pytest.raises(meshlm.MeshlmError, match="top_k -1"):
            p.generate(mine, max_new_tokens=4, top_k=-1)
        with pytest.raises(meshlm.MeshlmError, match="max_kv_bytes 1 holds 0 KV blocks"):
            p.generate(mine, max_new_tokens=4, max_kv_bytes=1)
        # after a step, generation sees the new weights
        p.train_step([np.concatenate([mine[0], [7] * 12])])
        g3, l3, _ = p.generate(mine, max_new_tokens=6, greedy=True)
        assert not all(np.array_equal(a, b) for a, b in zip(l1, l3))
        # the policy's mesh after a packed training step (its positions set aside: a prefill
        # longer than the step's tokens reads none of them) = the replica refitted with the
        # new weights, bitwise
        g3r, l3r, _ = p.generate(mine, max_new_tokens=6, greedy=True, replica=True)
        assert all(np.array_equal(a, b) for a, b in zip(g3, g3r))
        assert all(np.array_equal(a, b) for a, b in zip(l3, l3r))
        p.train_step([mine[0]])
        longer = [np.tile(mine[0], 40)[:p.info["max_seq_len"] - 6]]
        g4, l4, _ = p.generate(longer, max_new_tokens=6, greedy=True)
        g4r, l4r, _ = p.generate(longer, max_new_tokens=6, greedy=True, replica=True)
        assert np.array_equal(g4[0], g4r[0]) and np.array_equal(l4[0], l4r[0])
        # every rank with no prompt
        assert p.generate([], max_new_tokens=4) == ([], [], [])


def test_register_family():
    """register_family reaches meshlm_register_family: refusals raise
    MeshlmError with the library's reason; a registered architecture is
    known (a second registration is refused). test_api_family scores one."""
    with pytest.raises(meshlm.MeshlmError, match="base 'gpt2' is not a built-in text family"):
        meshlm.register_family("PyGptForCausalLM", "pygpt", "pygpt", "gpt2")
    with pytest.raises(meshlm.MeshlmError, match="part 'self_attn.v_proj' is not the linear after"):
        meshlm.register_family("PyBadForCausalLM", "pybad", "pybad", "llama",
                               fused={"self_attn.qkv_proj": ["self_attn.q_proj",
                                                             "self_attn.v_proj"]})
    fused = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
             "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"]}
    plan = {"layers.*.self_attn.qkv_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.gate_up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    meshlm.register_family("PyFusedForCausalLM", "pyfused", "pyfused", "llama", fused=fused,
                           tp_plan=plan)
    with pytest.raises(meshlm.MeshlmError, match="already registered"):
        meshlm.register_family("PyFusedForCausalLM", "pyfused", "pyfused", "llama")
