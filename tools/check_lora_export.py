#!/usr/bin/env python3
"""Check a LoRA run's exports against PEFT itself (run by hand; needs torch, transformers, peft).

    tools/check_lora_export.py MESHLM BASE_FIXTURE_DIR WORK_DIR [TARGETS]

Trains 3 steps of rank-4 LoRA (TARGETS as --lora-targets takes them; the default
q,k,v,o,gate,up,down; e.g. all-linear on Phi-3, whose fused qkv_proj / gate_up_proj PEFT adapts
as one module each) with `meshlm train`, exports the
adapter (--export-hf) and the merged model (--merge-lora), then:
  1. loads the adapter with peft.PeftModel.from_pretrained on the base model and
     compares its float64 log-probs of the fixture batch with `meshlm logprobs --adapter`;
  2. compares peft's merge_and_unload() weights with meshlm's merged export;
  3. compares the merged export's log-probs (transformers, no peft) with (1).
Prints the worst differences; exits non-zero beyond 1e-4 (fp32 forward vs float64).
"""
import json
import os
import subprocess
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def logprobs(model, ids):
    with torch.no_grad():
        lsm = torch.log_softmax(model(input_ids=ids).logits[:, :-1, :], dim=-1)
    return lsm.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def main():
    meshlm, base, work = sys.argv[1:4]
    targets = sys.argv[4] if len(sys.argv) > 4 else None
    os.makedirs(work, exist_ok=True)
    ids = torch.tensor(json.load(open(os.path.join(base, "expected.json")))["input_ids"])
    data = os.path.join(work, "batch.jsonl")
    with open(data, "w") as f:
        for row in ids.tolist():
            f.write(json.dumps({"input_ids": row}) + "\n")
    common = ["train", "--model", base, "--data", data, "--seq-len", str(ids.shape[1]),
              "--batch-size", str(ids.shape[0]), "--steps", "3", "--lr", "1e-2",
              "--lora-rank", "4", "--lora-alpha", "16", "--peak-tflops", "1"]
    if targets:
        common += ["--lora-targets", targets]
    adapter, merged = os.path.join(work, "adapter"), os.path.join(work, "merged")
    subprocess.run([meshlm] + common + ["--export-hf", adapter], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run([meshlm] + common + ["--export-hf", merged, "--merge-lora"], check=True,
                   stdout=subprocess.DEVNULL)
    out = os.path.join(work, "lp.jsonl")
    subprocess.run([meshlm, "logprobs", "--model", base, "--adapter", adapter, "--data", data,
                    "--out", out], check=True, stdout=subprocess.DEVNULL)
    ours = torch.tensor([json.loads(l)["logprobs"] for l in open(out)], dtype=torch.float64)

    # mixture-of-experts models: per-expert loops (float64 has no grouped GEMM)
    with open(os.path.join(base, "config.json")) as f:
        cfg = json.load(f)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    moe = {"experts_implementation": "eager"} if experts else {}
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64,
                                                 attn_implementation="eager", **moe)
    peft = PeftModel.from_pretrained(model, adapter).to(torch.float64)
    peft.train(False)
    ref = logprobs(peft, ids)
    d1 = (ours - ref).abs().max().item()
    print(f"peft-loaded adapter vs meshlm logprobs --adapter: max |diff| {d1:.3g}")
    sd = peft.merge_and_unload().state_dict()
    exported = load_file(os.path.join(merged, "model.safetensors"))
    # the tensors both name alike (transformers 5 holds a mixture-of-experts block's experts
    # as fused parameters where the checkpoint has one tensor per expert: not adapted anyway)
    both = [k for k in exported if k in sd]
    d2 = max((exported[k].double() - sd[k]).abs().max().item() for k in both)
    print(f"merge_and_unload vs meshlm --merge-lora: {len(both)} of {len(exported)} tensors, "
          f"max |diff| {d2:.3g}")
    m2 = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float64,
                                              attn_implementation="eager", **moe)
    m2.train(False)
    d3 = (logprobs(m2, ids) - ref).abs().max().item()
    print(f"merged export (transformers) vs peft adapter logprobs: max |diff| {d3:.3g}")
    sys.exit(0 if max(d1, d2, d3) < 1e-4 else 1)


if __name__ == "__main__":
    main()
