"""Policy(lora_rank=...): LoRA through the library (engine/lora.h). One AdamW step with
weight decay and no clipping: every base weight refits bitwise as it was (a base weight
stepped by mistake would decay), every adapter moves; the seeded start scores as the base
model bit for bit (lora_B = 0); the list and the comma-separated string of targets are one
option; bad options raise naming them."""

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
    with pytest.raises(meshlm.MeshlmError, match="lora_dropout \\(--lora-dropout\\) 0.1"):
        meshlm.Policy(model_dir, lora_rank=4, lora_dropout=0.1)
    with pytest.raises(meshlm.MeshlmError, match="target module 'nope' not found"):
        meshlm.Policy(model_dir, lora_rank=4, lora_targets=["q_proj", "nope"])
