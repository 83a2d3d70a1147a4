#!/usr/bin/env python3
"""gen_fixtures.py - generate the Hugging Face reference fixtures for meshlm tests.

PURPOSE
    meshlm must reproduce Hugging Face transformers numerically.  This script
    builds tiny random models with transformers, saves them exactly as
    `save_pretrained(dir, safe_serialization=True)` writes them (float32), and
    records a float64 reference (logprobs, loss, parameter gradients) that the
    C tests compare against.

    CI NEVER RUNS THIS SCRIPT (CI has neither torch nor transformers).  It is
    run once by hand on a machine with `pip install torch transformers
    safetensors` and its output under tests/fixtures/ is committed.

USAGE
    python3 tools/gen_fixtures.py --out tests/fixtures [--only NAME ...]

OUTPUT (one directory per fixture NAME under --out)
    NAME/config.json         as written by save_pretrained (float32 model)
    NAME/model.safetensors   as written by save_pretrained (float32 weights)
    NAME/grads.safetensors   d loss / d param for every named parameter (HF
                             names, e.g. model.layers.0.self_attn.q_proj.weight),
                             computed in float64, stored as float32.  For tied
                             models there is no lm_head.weight entry: the
                             embedding gradient contains both uses.
    NAME/expected.json       {"input_ids": [[S ints] x B],
                              "loss_mask": [[S 0/1] x B]   (only if masked),
                              "loss": float,
                              "logprobs": [[S-1 floats] x B]}

DEFINITIONS (hold exactly, in float64)
    logprobs[b][t] = log_softmax(logits[b, t])[input_ids[b][t+1]], t = 0..S-2
    loss = mean over all (b, t), t in 0..S-2, with (no mask or
           loss_mask[b][t+1] == 1), of -logprobs[b][t]
    i.e. HF labels = input_ids with -100 where the mask is 0, standard shift,
    mean reduction over non-ignored targets across the whole batch.

    The reference is computed by reloading the saved checkpoint with
    from_pretrained(dtype=float64, attn_implementation="eager"), so the
    expected values correspond bit-for-bit to the committed float32 weights.

    Weights are re-initialised with a larger scale than HF's default 0.02 so
    that logits are far from uniform: linear/embedding weights ~ N(0, 0.1^2),
    norm weights 1 + 0.1*N(0,1), biases 0.1*N(0,1).
"""

import argparse
import json
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

B, S = 2, 24

LLAMA_BASE = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    attention_bias=False,
    mlp_bias=False,
)

FIXTURES = [
    dict(
        name="llama_tied",
        cls=LlamaForCausalLM,
        config=lambda: LlamaConfig(
            **LLAMA_BASE,
            vocab_size=256,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        seed=1001,
        mask=False,
    ),
    dict(
        name="llama_untied",
        cls=LlamaForCausalLM,
        config=lambda: LlamaConfig(
            **LLAMA_BASE,
            vocab_size=300,
            tie_word_embeddings=False,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
        seed=1002,
        mask=False,
    ),
    dict(
        name="qwen2",
        cls=Qwen2ForCausalLM,
        config=lambda: Qwen2Config(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=301,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
        ),
        seed=1003,
        mask=True,
    ),
]


def reinit_(model, gen):
    """Write larger-scale random values into every (unique) parameter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if name.endswith("norm.weight"):
                val = 1.0 + 0.1 * noise
            elif name.endswith(".bias"):
                val = 0.1 * noise
            else:
                val = 0.1 * noise
            p.copy_(val.to(p.dtype))


def save_model(model, out_dir):
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    except TypeError:
        # newer transformers dropped the argument (safetensors is the only format)
        model.save_pretrained(out_dir)


def make_fixture(fx, out_root):
    name = fx["name"]
    out_dir = os.path.join(out_root, name)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)

    torch.manual_seed(fx["seed"])
    gen = torch.Generator().manual_seed(fx["seed"])

    # ---- float32 model, re-initialised, saved -------------------------------
    config = fx["config"]()
    model = fx["cls"](config).to(torch.float32)
    reinit_(model, gen)
    model.config.dtype = torch.float32  # recorded in config.json
    save_model(model, out_dir)
    vocab = config.vocab_size

    # ---- inputs ---------------------------------------------------------------
    input_ids = torch.randint(0, vocab, (B, S), generator=gen)
    loss_mask = None
    if fx["mask"]:
        loss_mask = (torch.rand((B, S), generator=gen) < 0.7).long()
        loss_mask[:, 0] = 0
        assert int(loss_mask[:, 1:].sum()) > 0

    # ---- float64 eager reference from the saved checkpoint ------------------
    ref, info = AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float64, attn_implementation="eager",
        output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        sys.exit(f"{name}: loading info not clean: {bad}")
    assert type(ref) is fx["cls"], type(ref)
    ref.train(False)  # dropout is 0 anyway; keep things deterministic
    ref.zero_grad(set_to_none=True)

    logits = ref(input_ids=input_ids).logits  # [B, S, V] float64
    assert logits.dtype == torch.float64
    lsm = torch.log_softmax(logits[:, :-1, :], dim=-1)
    tgt = input_ids[:, 1:]
    logprobs = lsm.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)  # [B, S-1]
    if loss_mask is None:
        sel = torch.ones_like(tgt, dtype=torch.bool)
    else:
        sel = loss_mask[:, 1:].bool()
    loss = -(logprobs[sel]).sum() / sel.sum()

    # cross-check against HF's own loss with -100 labels (HF's loss function
    # upcasts logits to float32, so this only agrees to ~1e-7 relative)
    labels = input_ids.clone()
    if loss_mask is not None:
        labels[loss_mask == 0] = -100
    with torch.no_grad():
        hf_loss = ref(input_ids=input_ids, labels=labels).loss
    assert abs(hf_loss.item() - loss.item()) < 1e-5 * abs(loss.item()), (hf_loss.item(), loss.item())

    loss.backward()

    grads = {}
    for pname, p in ref.named_parameters():
        assert p.grad is not None, pname
        grads[pname] = p.grad.detach().to(torch.float32).contiguous()
    saved = load_file(os.path.join(out_dir, "model.safetensors"))
    if set(saved) != set(grads):
        sys.exit(f"{name}: grad names {sorted(set(grads) ^ set(saved))} "
                 "differ from model.safetensors")
    for k, v in saved.items():
        assert v.dtype == torch.float32, (k, v.dtype)
    if config.tie_word_embeddings:
        assert "lm_head.weight" not in grads
    if fx["cls"] is Qwen2ForCausalLM:
        for k, v in saved.items():
            if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                assert v.abs().max() > 0, k
    save_file(grads, os.path.join(out_dir, "grads.safetensors"))

    expected = {"input_ids": input_ids.tolist()}
    if loss_mask is not None:
        expected["loss_mask"] = loss_mask.tolist()
    expected["loss"] = loss.item()
    expected["logprobs"] = [[float(x) for x in row] for row in logprobs.detach().tolist()]
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump(expected, f)
        f.write("\n")

    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    gmax = max(g.abs().max().item() for g in grads.values())
    lp = logprobs.detach()
    print(f"{name:14s} loss={loss.item():.10f} max|grad|={gmax:.4e} "
          f"logprob range=[{lp.min().item():.3f}, {lp.max().item():.3f}] "
          f"params={len(grads)} size={size / 1024:.1f} KiB")
    return size


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--only", nargs="*", help="fixture names to (re)generate")
    args = ap.parse_args()

    torch.set_default_dtype(torch.float32)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    os.makedirs(args.out, exist_ok=True)
    total = 0
    for fx in FIXTURES:
        if args.only and fx["name"] not in args.only:
            continue
        total += make_fixture(fx, args.out)
    print(f"total {total / 1024:.1f} KiB")
    if total > 5 * 1024 * 1024:
        sys.exit("fixtures exceed 5 MB")


if __name__ == "__main__":
    main()
