"""Policy(lora_rank=...): LoRA through the library (engine/lora.h). One AdamW step with
weight decay and no clipping: every base weight refits bitwise as it was (a base weight
stepped by mistake would decay), every adapter moves; the seeded start scores as the base
model bit for bit (lora_B = 0); the list and the comma-separated string of targets are one
option; bad options raise naming them."""

import os

import pytest
from conftest import make_seqs

import meshlm

TARGETS = ["q_proj", "v_proj"]


def step(model_dir, mesh, targets):
    """The weights (refit, every rank) before and after one step, and the first log-probs."""
    with meshlm.Policy(model_dir, lr=1e-2, weight_decay=0.1, max_grad_norm=0, lora_rank=4,
                       lora_alpha=8, lora_targets=targets, lora_seed=7, **mesh) as p:
        before = p.refit(root=-1)
        seqs = make_seqs(4, seed=5)[p.info["dp_rank"]::p.info["dp_size"]]
        lp, _ = p.logprobs(seqs)
        r = p.train_step(seqs)
        assert not r["skipped"] and r["grad_norm"] > 0
        return before, p.refit(root=-1), lp


def test_lora_step(model_dir):
    """All data parallel (FSDP over every rank): LoRA refuses tp > 1."""
    mesh = {}
    init, after, lp = step(model_dir, mesh, TARGETS)
    _, joined, _ = step(model_dir, mesh, ",".join(TARGETS))
    adapters = [n for n in init if ".lora_" in n]
    assert len(adapters) == 2 * 2 * len(TARGETS)  # lora_A, lora_B x 2 layers x targets
    for n in init:
        assert joined[n].tobytes() == after[n].tobytes(), n
        if ".lora_" in n:
            assert after[n].tobytes() != init[n].tobytes(), n
        else:
            assert after[n].tobytes() == init[n].tobytes(), n
    with meshlm.Policy(model_dir, **mesh) as base:
        seqs = make_seqs(4, seed=5)[base.info["dp_rank"]::base.info["dp_size"]]
        plain, _ = base.logprobs(seqs)
    for a, b in zip(lp, plain):
        assert a.tobytes() == b.tobytes()


def test_lora_errors(model_dir):
    with pytest.raises(meshlm.MeshlmError, match="lora_dropout \\(--lora-dropout\\) -0.1"):
        meshlm.Policy(model_dir, lora_rank=4, lora_dropout=-0.1)
    with pytest.raises(meshlm.MeshlmError, match="target module 'nope' not found"):
        meshlm.Policy(model_dir, lora_rank=4, lora_targets=["q_proj", "nope"])


def test_lora_merged(model_dir, shared_path):
    """Merged weights and the LoRA refit views, on every mesh of the job (tp ranks decode
    together): after one step (lora_B no longer zero) refit(lora="merged") is byte for byte
    the merged export and differs from the base in the adapted weights only,
    refit(lora="adapters") is the PEFT export's adapter file under PEFT's keys, and greedy
    generation on the LoRA policy (its unmerged forward) gives the tokens of the merged
    export opened as a plain policy (tests/mpi/test_lora.c bounds their log-probs)."""
    from test_refit import assert_bytes_equal, read_checkpoint, read_safetensors
    merged_dir, peft_dir = shared_path("merged"), shared_path("peft")
    prompts = [s[:6] for s in make_seqs(2, seed=9)]
    with meshlm.Policy(model_dir, lr=1e-2, max_grad_norm=0, lora_rank=4,
                       lora_targets=TARGETS, lora_seed=7) as p:
        seqs = make_seqs(4, seed=5)[p.info["dp_rank"]::p.info["dp_size"]]
        p.train_step(seqs)
        p.export(merged_dir, dtype="fp32", merge_lora=True)
        p.export(peft_dir)
        every = p.refit(root=-1, dtype="fp32")
        merged = p.refit(root=-1, dtype="fp32", lora="merged")
        adapters = p.refit(root=-1, lora="adapters")
        toks, _, _ = p.generate(prompts, max_new_tokens=8, greedy=True)
    on_disk = read_checkpoint(merged_dir)
    assert sorted(merged) == sorted(on_disk)
    for n, a in merged.items():
        assert_bytes_equal(a, on_disk[n], n)
        adapted = any(n.endswith(t + ".weight") for t in TARGETS)
        assert (a.tobytes() != every[n].tobytes()) == adapted, n
    peft = read_safetensors(os.path.join(peft_dir, "adapter_model.safetensors"))
    assert sorted(adapters) == sorted(peft)
    for n, a in adapters.items():
        assert n.startswith("base_model.model.")
        assert_bytes_equal(a, peft[n], n)
        assert_bytes_equal(a, every[n[len("base_model.model."):]], n)
    with meshlm.Policy(merged_dir) as plain:
        want, _, _ = plain.generate(prompts, max_new_tokens=8, greedy=True)
    for a, b in zip(toks, want):
        assert a.tobytes() == b.tobytes()


def test_lora_views_refused(model_dir):
    with meshlm.Policy(model_dir) as p:
        with pytest.raises(meshlm.MeshlmError, match="has no LoRA adapters"):
            p.refit(lora="merged")
        with pytest.raises(meshlm.MeshlmError, match="no LoRA adapters to merge"):
            p.export("unused", merge_lora=True)


def test_lora_dropout(model_dir):
    """lora_dropout through the library: the second training step's loss differs from
    p = 0's (the first's cannot: lora_B starts at 0, so only its gradients differ), and
    scoring is off dropout: the p = 0.3 policy's trained weights, reloaded into a p = 0
    policy, score bitwise alike on both."""
    losses = {}
    for p in (0.0, 0.3):
        with meshlm.Policy(model_dir, lr=1e-2, max_grad_norm=0, lora_rank=4,
                           lora_targets=TARGETS, lora_seed=7, lora_dropout=p) as pol:
            seqs = make_seqs(4, seed=5)[pol.info["dp_rank"]::pol.info["dp_size"]]
            pol.train_step(seqs)
            losses[p] = pol.train_step(seqs)["loss"]
            if p == 0.3:
                trained = pol.refit(root=-1)
                dropped, _ = pol.logprobs(seqs)
    assert losses[0.0] != losses[0.3]
    with meshlm.Policy(model_dir, lora_rank=4, lora_targets=TARGETS, lora_seed=7) as plain:
        plain.reload_tensors(trained)
        kept, _ = plain.logprobs(seqs)
    assert [x.tobytes() for x in dropped] == [x.tobytes() for x in kept]
