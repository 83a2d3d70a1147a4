#!/usr/bin/env python3
"""A real LoRA SFT run checked against PEFT (issue 33's Numbers; run by hand, not by CI; needs
torch, transformers and peft):

    bench/lora_sft.py MESHLM MODEL_DIR WORK_DIR [STEPS]

MODEL_DIR is an HF checkpoint with its tokenizer (SmolLM2-135M and Gemma-3-270M in fp32 for the
issue's figures).
Trains STEPS (default 20) steps of rank-8 all-linear LoRA (lora_alpha 16) with `meshlm train` on
bench/data/lora_sft.jsonl (56 prompt/completion records the authors wrote: sums, opposites, the
days, the seasons, plurals; the loss on the completions only), batch 8, exports the PEFT adapter
(--export-hf), then scores the first 8 records with `meshlm logprobs --adapter` and with
peft.PeftModel.from_pretrained on the base model (transformers, float64 for the reference), and
prints: the loss of each step, the mean of the first and last 3, the worst |difference| and rel L2
of the completion log-probs (meshlm fp32 vs PEFT float64), and how far the adapter moved them
from the base model's (so that the agreement is not the base's). Figures for notes; nothing is
asserted beyond the run finishing.
"""
import json
import os
import subprocess
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "lora_sft.jsonl")


def peft_logprobs(model, ids):
    """log p(ids[t+1] | ids[:t+1]) for one sequence, float64."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    lsm = torch.log_softmax(logits, dim=-1)
    return lsm.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


def main():
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    meshlm, model_dir, work = sys.argv[1:4]
    steps = int(sys.argv[4]) if len(sys.argv) == 5 else 20
    os.makedirs(work, exist_ok=True)
    metrics, adapter = os.path.join(work, "metrics.jsonl"), os.path.join(work, "adapter")
    subprocess.run([meshlm, "train", "--model", model_dir, "--data", DATA, "--steps", str(steps),
                    "--batch-size", "8", "--seq-len", "64", "--lr", "2e-3", "--warmup-steps", "2",
                    "--lora-rank", "8", "--lora-alpha", "16", "--lora-targets", "all-linear",
                    "--metrics", metrics, "--export-hf", adapter, "--peak-tflops", "1"],
                   check=True, stdout=subprocess.DEVNULL)
    losses = [json.loads(line)["loss"] for line in open(metrics)]
    print("losses: " + " ".join(f"{x:.4f}" for x in losses))
    print(f"mean of steps 1-3 {sum(losses[:3]) / 3:.4f}, of the last 3 {sum(losses[-3:]) / 3:.4f}")

    score = os.path.join(work, "score.jsonl")
    with open(DATA) as f, open(score, "w") as g:
        for line in list(f)[:8]:
            g.write(line)
    out = os.path.join(work, "lp.jsonl")
    subprocess.run([meshlm, "logprobs", "--model", model_dir, "--adapter", adapter, "--data",
                    score, "--out", out], check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in open(out)]

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    base_lp = [peft_logprobs(base, r["input_ids"]) for r in rows]
    peft = PeftModel.from_pretrained(base, adapter).eval()
    num = den = moved = base_sq = worst = 0.0
    for r, b in zip(rows, base_lp):
        ref = peft_logprobs(peft, r["input_ids"])
        p = r["prompt_tokens"]  # the completion's targets: positions p-1 .. S-2
        ours = torch.tensor(r["logprobs"], dtype=torch.float64)[p - 1:]
        ref, b = ref[p - 1:], b[p - 1:]
        num += float(((ours - ref) ** 2).sum())
        den += float((ref ** 2).sum())
        moved += float(((b - ref) ** 2).sum())
        base_sq += float((b ** 2).sum())
        worst = max(worst, float((ours - ref).abs().max()))
    print(f"completion log-probs, meshlm --adapter (fp32) vs PEFT (float64), {len(rows)} records: "
          f"worst |diff| {worst:.3g}, rel L2 {(num / den) ** 0.5:.3g}; the adapter moved them "
          f"from the base model's by {(moved / base_sq) ** 0.5:.3g} of their L2 norm")


if __name__ == "__main__":
    main()
