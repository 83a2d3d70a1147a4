#!/usr/bin/env python3
"""Generate LoRA test fixtures with PEFT (run by hand; needs torch, transformers, peft).

For each base fixture of tests/fixtures (written by tools/gen_fixtures.py)
this writes tests/fixtures/<base>_lora/:

    adapter_config.json        PEFT LoraConfig as save_pretrained writes it
    adapter_model.safetensors  lora_A / lora_B (float32), keys
                               base_model.model.model.layers.N.<mod>.lora_A.weight;
                               lora_A and lora_B both random and NON-ZERO (a zero
                               lora_B would hide every error of the adapter path
                               and of dA)
    expected.json              {"base": "<base fixture>", "input_ids", "loss_mask"
                               (when the base has one), "loss", "logprobs"} of the
                               PeftModel, float64 eager, as gen_fixtures.py defines them
    grads.safetensors          d loss / d adapter (float64 computed, stored float32),
                               keyed by meshlm's parameter names
                               (model.layers.N.<mod>.lora_A.weight)
    merged.safetensors         merge_and_unload()'s weights of the adapted linears
                               (W + scaling * B @ A, float64 computed, stored float32)

The batch is the base fixture's (expected.json input_ids and loss_mask).
Config: r 4, lora_alpha 8 (scaling 2), lora_dropout 0, bias "none"; llama: the
seven decoder linears by name; qwen2: use_rslora (scaling 8 / sqrt(4) = 4) on
q_proj,v_proj only; gemma3: "all-linear" (PEFT resolves it to every linear but
the output layer and writes the names it found); llama_h9kv3 (9 heads, 3 kv heads): the
seven by name; phi3: "all-linear" (qkv_proj, o_proj, gate_up_proj, down_proj: two fused);
qwen3_moe, mixtral and qwen2_moe: q_proj,k_proj,v_proj,o_proj (the experts, the router and
qwen2_moe's shared expert frozen); qwen3:
the seven by name; mistral: "all-linear".
`--only NAME` writes that fixture alone.
"""
import argparse
import json
import os

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FIXTURES = [
    dict(name="llama_untied_lora", base="llama_untied", targets=ALL, rslora=False, seed=11),
    dict(name="qwen2_lora", base="qwen2", targets=["q_proj", "v_proj"], rslora=True, seed=12),
    dict(name="gemma3_lora", base="gemma3", targets="all-linear", rslora=False, seed=13),
    # 9 query heads, 3 kv heads: on tp 2 and 4 a kv head is held by two ranks, so are lora_B's
    # rows of k_proj / v_proj (their gradients summed over the holders)
    dict(name="llama_h9kv3_lora", base="llama_h9kv3", targets=ALL, rslora=False, seed=14),
    # Phi-3's fused checkpoint linears: PEFT adapts qkv_proj and gate_up_proj as one module each
    # (one lora_A, one lora_B over the parts' rows); meshlm shares lora_A among the parts
    dict(name="phi3_lora", base="phi3", targets="all-linear", rslora=False, seed=15),
    # a mixture-of-experts model: attention's linears adapted, the router and experts frozen
    dict(name="qwen3_moe_lora", base="qwen3_moe", targets=ALL[:4], rslora=False, seed=16,
         moe=True),
    # the remaining families: Qwen3 (q_norm / k_norm after q_proj / k_proj), Mistral (sliding
    # window), Mixtral (a mixture of experts: attention's linears, as qwen3_moe)
    dict(name="qwen3_lora", base="qwen3", targets=ALL, rslora=False, seed=17),
    dict(name="mistral_lora", base="mistral", targets="all-linear", rslora=False, seed=18),
    dict(name="mixtral_lora", base="mixtral", targets=ALL[:4], rslora=False, seed=19, moe=True),
    # Qwen2-MoE (a shared expert beside the routed ones, q/k/v biases): attention's linears, the
    # router, the experts and the shared expert frozen
    dict(name="qwen2_moe_lora", base="qwen2_moe", targets=ALL[:4], rslora=False, seed=20,
         moe=True),
]
PREFIX = "base_model.model."


def make(fx, root):
    base_dir = os.path.join(root, fx["base"])
    out = os.path.join(root, fx["name"])
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(base_dir, "expected.json")) as f:
        base = json.load(f)
    ids = torch.tensor(base["input_ids"])
    mask = torch.tensor(base["loss_mask"]) if "loss_mask" in base else None

    # the experts as per-expert loops (float64 has no grouped GEMM), as gen_fixtures.py loads them
    moe_kw = {"experts_implementation": "eager"} if fx.get("moe") else {}
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                 attn_implementation="eager", **moe_kw)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=fx["targets"],
                     bias="none", task_type="CAUSAL_LM", use_rslora=fx["rslora"])
    peft = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(fx["seed"])
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_" in n:  # both non-zero, of the size PEFT's init gives lora_A
                p.copy_(torch.empty(p.shape).uniform_(-0.5, 0.5, generator=gen)
                        / p.shape[1] ** 0.5)
    peft.save_pretrained(out)
    os.remove(os.path.join(out, "README.md"))  # the model card: not a fixture
    # float64 reference of the float32 values just saved
    peft = peft.to(torch.float64)
    peft.train(False)
    out_ = peft(input_ids=ids)
    logits = out_.logits
    lsm = torch.log_softmax(logits[:, :-1, :], dim=-1)
    tgt = ids[:, 1:]
    logprobs = lsm.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    sel = torch.ones_like(tgt, dtype=torch.bool) if mask is None else mask[:, 1:].bool()
    loss = -(logprobs[sel]).sum() / sel.sum()
    if getattr(out_, "aux_loss", None) is not None:  # the MoE load-balancing term, as
        loss = loss + model.config.router_aux_loss_coef * out_.aux_loss  # gen_fixtures.py adds it
    loss.backward()
    grads = {}
    for n, p in peft.named_parameters():
        if p.grad is not None:
            assert "lora_" in n, n  # only the adapters train
            key = n[len(PREFIX):].replace(".default.", ".")
            grads[key] = p.grad.detach().to(torch.float32).contiguous()
        else:
            assert "lora_" not in n and not p.requires_grad, n
    save_file(grads, os.path.join(out, "grads.safetensors"))
    merged = peft.merge_and_unload()
    sd = merged.state_dict()
    adapted = {k[: -len(".lora_A.weight")] for k in grads if k.endswith(".lora_A.weight")}
    save_file({m + ".weight": sd[m + ".weight"].to(torch.float32).contiguous() for m in adapted},
              os.path.join(out, "merged.safetensors"))
    expected = {"base": fx["base"], "input_ids": ids.tolist()}
    if mask is not None:
        expected["loss_mask"] = mask.tolist()
    expected["loss"] = loss.item()
    expected["logprobs"] = [[float(x) for x in r] for r in logprobs.detach().tolist()]
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f)
        f.write("\n")
    saved = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert sorted(saved) == sorted(PREFIX + k for k in grads), sorted(saved)
    print(f"{fx['name']}: loss {loss.item():.10f} (base {base['loss']:.10f}) "
          f"{len(grads)} adapter tensors")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--only", help="write this fixture alone (e.g. phi3_lora)")
    args = ap.parse_args()
    for fx in FIXTURES:
        if args.only in (None, fx["name"]):
            make(fx, args.out)


if __name__ == "__main__":
    main()
