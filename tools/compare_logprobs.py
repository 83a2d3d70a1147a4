#!/usr/bin/env python3
"""compare_logprobs.py - compare meshlm logprobs against Hugging Face transformers.

PURPOSE
    For every line of DATA.jsonl (each an object with "input_ids": [ints]),
    computes with transformers (AutoModelForCausalLM, eager attention) the
    per-position logprobs
        lp[t] = log_softmax(logits[t])[input_ids[t+1]],  t = 0..S-2
    and compares them with the corresponding line of MESHLM_OUT.jsonl (each an
    object {"logprobs": [S-1 floats]}; lines are matched in order).  Prints the
    per-line and overall max abs difference; exits non-zero on a shape/count
    mismatch or if --tol is given and exceeded.

    CI NEVER RUNS THIS SCRIPT (CI has neither torch nor transformers); it needs
    `pip install torch transformers safetensors`.

USAGE
    python3 tools/compare_logprobs.py MODEL_DIR DATA.jsonl MESHLM_OUT.jsonl
                                      [--double] [--tol 1e-4] [--quiet]

    By default the HF model runs in float32; --double runs it in float64.
"""

import argparse
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def read_jsonl(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def main():
    ap = argparse.ArgumentParser(description="Max abs difference of HF vs meshlm logprobs.")
    ap.add_argument("model_dir")
    ap.add_argument("data_jsonl")
    ap.add_argument("meshlm_jsonl")
    ap.add_argument("--double", action="store_true", help="run HF in float64")
    ap.add_argument("--tol", type=float, default=None, help="fail if overall max diff exceeds this")
    ap.add_argument("--quiet", action="store_true", help="only print the summary")
    args = ap.parse_args()

    dtype = torch.float64 if args.double else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=dtype, attn_implementation="eager")
    model.train(False)

    data = read_jsonl(args.data_jsonl)
    mine = read_jsonl(args.meshlm_jsonl)
    if len(data) != len(mine):
        sys.exit(f"line count mismatch: {len(data)} data lines vs {len(mine)} meshlm lines")

    overall = 0.0
    n_tok = 0
    for i, (d, m) in enumerate(zip(data, mine)):
        ids = torch.tensor([d["input_ids"]], dtype=torch.long)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        ref = torch.log_softmax(logits[0, :-1].double(), dim=-1)
        ref = ref.gather(-1, ids[0, 1:, None])[:, 0]
        got = torch.tensor(m["logprobs"], dtype=torch.float64)
        if got.shape != ref.shape:
            sys.exit(f"line {i}: meshlm has {got.numel()} logprobs, expected {ref.numel()} "
                     f"(S-1 for S={ids.shape[1]})")
        diff = (got - ref).abs()
        md = diff.max().item() if diff.numel() else 0.0
        overall = max(overall, md)
        n_tok += diff.numel()
        if not args.quiet:
            at = int(diff.argmax()) if diff.numel() else -1
            print(f"line {i}: S={ids.shape[1]} max|diff|={md:.3e} (at t={at}) "
                  f"mean lp hf={ref.mean().item():.6f} meshlm={got.mean().item():.6f}")
    print(f"{len(data)} lines, {n_tok} logprobs, overall max|diff| = {overall:.3e}")
    if args.tol is not None and not overall <= args.tol:
        print(f"FAIL: exceeds tol {args.tol}")
        sys.exit(1)


if __name__ == "__main__":
    main()
