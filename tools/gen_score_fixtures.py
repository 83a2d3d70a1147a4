#!/usr/bin/env python3
"""Entropy and top-k references for the scoring tests (tests/api/test_api_topk.c).

For each fixture named on the command line (default: llama_untied, the api
tests' fixture), reads tests/fixtures/NAME/model.safetensors and expected.json's input_ids,
runs transformers in float64 (eager attention, as tools/gen_fixtures.py's
reference) and writes tests/fixtures/NAME/scores.json:

    {"k": K,
     "entropy":   [[S-1 floats] x B]  H_t = -sum_v p_v log p_v (nats) of
                                      log_softmax(logits[b, t]), t = 0..S-2
     "weight":    [[S-1 floats] x B]  sum_v p_v |log p_v| |1 + log p_v|: the
                                      first-order weight of the log-probs'
                                      errors in H (dH/dlog p_v = -p_v (1 + log p_v))
     "topk_ids":  [[[K ints] x S-1] x B]  the K most probable tokens, best
                                      first (equal log-probs: lower id first)
     "topk_logprobs": [[[K floats] x S-1] x B]
     "gaps":      [[S-1 floats] x B] the smallest difference between
                  consecutive log-probs among the K + 1 best of each position
                  (how far the reference is from a tie that would make its
                  top-K ids rounding-dependent)
     "gap":       the smallest of them}

These follow NeMo RL's get_topk_logits (per-position top-k, next-token
aligned) and verl's entropy_from_logits, as log-probs. Needs torch and
transformers (not in CI): the committed scores.json is what the tests read.
usage: tools/gen_score_fixtures.py [NAME ...]"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

K = 5
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")


def scores(name):
    d = os.path.join(ROOT, name)
    with open(os.path.join(d, "expected.json")) as f:
        ids = torch.tensor(json.load(f)["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64,
                                                 attn_implementation="eager")
    model.train(False)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1, :]  # [B, S-1, V] float64
    lsm = torch.log_softmax(logits, dim=-1)
    p = lsm.exp()
    ent = -(p * lsm).sum(-1)
    weight = (p * lsm.abs() * (1.0 + lsm).abs()).sum(-1)
    V = lsm.shape[-1]
    # sort by (-log-prob, id): a stable sort of ids ascending keeps the lower id first on ties
    order = torch.sort(-lsm, dim=-1, stable=True).indices
    top = order[..., : K + 1]
    vals = lsm.gather(-1, top)
    gaps = (vals[..., :-1] - vals[..., 1:]).min(-1).values  # [B, S-1]
    gap = float(gaps.min())
    assert V > K
    with open(os.path.join(d, "scores.json"), "w") as f:
        json.dump({"k": K, "entropy": ent.tolist(), "weight": weight.tolist(),
                   "topk_ids": top[..., :K].tolist(), "topk_logprobs": vals[..., :K].tolist(),
                   "gaps": gaps.tolist(), "gap": gap}, f)
    print(f"{name}: entropy mean {float(ent.mean()):.6f}, smallest top-{K + 1} gap {gap:.3g}")


def main():
    for name in sys.argv[1:] or ["llama_untied"]:
        scores(name)


if __name__ == "__main__":
    main()
