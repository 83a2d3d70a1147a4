#!/usr/bin/env python3
"""export_check.py - check a `meshlm export` checkpoint with Hugging Face transformers.

PURPOSE
    `meshlm export` consolidates a sharded run checkpoint (meshlm train --save)
    into an HF checkpoint.  This script loads that directory with transformers
    (AutoModelForCausalLM, eager attention, computed in float64 from the fp32
    weights), refuses missing / unexpected / mismatched keys, computes for each
    line of DATA.jsonl ({"input_ids": [ints]}) the per-token log-probs
        lp[t] = log_softmax(logits[t])[input_ids[t+1]],  t = 0..S-2
    and compares them with meshlm's output for the same data (MESHLM.jsonl,
    `meshlm logprobs --model EXPORT_DIR`: {"logprobs": [S-1 floats]} per line).
    With --write FILE it records the HF log-probs in meshlm's JSONL format.

    CI NEVER RUNS THIS SCRIPT (CI has neither torch nor transformers); it needs
    `pip install torch transformers safetensors`.

USAGE
    python3 tools/export_check.py EXPORT_DIR DATA.jsonl MESHLM.jsonl
                                  [--tol 1e-5] [--write FIXTURE.jsonl]

CHECKING A TRAINED EXPORT BY HAND
    build/meshlm logprobs --model HF_DIR --data DATA.jsonl --out lp.jsonl
    python3 tools/export_check.py HF_DIR DATA.jsonl lp.jsonl
    for HF_DIR from `meshlm export` or `meshlm train --export-hf`.  CI's
    tests/cli/test_export.sh trains with --lr 0, so that its export holds the
    llama_tied fixture's weights on any CPU, and compares with that
    fixture's recorded transformers log-probs; this script checks trained
    weights, whose values depend on the CPU that trained them.

TOLERANCE
    Here meshlm (fp32) and HF (float64) score the same weights: --tol defaults
    to 1e-5 abs, a by-hand check; the CI tests use the derived bounds of
    tests/tolerance.h instead.
"""

import argparse
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def hf_logprobs(model, ids):
    x = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=x).logits.double()
    lp = torch.log_softmax(logits[0, :-1], dim=-1)
    return lp.gather(-1, x[0, 1:, None])[:, 0].tolist()


def main():
    ap = argparse.ArgumentParser(description="HF transformers vs meshlm log-probs of an exported checkpoint.")
    ap.add_argument("export_dir")
    ap.add_argument("data_jsonl")
    ap.add_argument("meshlm_jsonl")
    ap.add_argument("--tol", type=float, default=1e-5, help="max abs difference allowed (default 1e-5)")
    ap.add_argument("--write", help="write HF's log-probs here (meshlm logprobs JSONL format)")
    args = ap.parse_args()

    model, info = AutoModelForCausalLM.from_pretrained(
        args.export_dir, dtype=torch.float64, attn_implementation="eager", output_loading_info=True)
    model.train(False)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        sys.exit(f"{args.export_dir}: loading problems: {problems}")

    data, mine = read_jsonl(args.data_jsonl), read_jsonl(args.meshlm_jsonl)
    if len(data) != len(mine):
        sys.exit(f"{len(data)} data lines but {len(mine)} meshlm lines")
    worst, rows = 0.0, []
    for i, (d, m) in enumerate(zip(data, mine)):
        ref = hf_logprobs(model, d["input_ids"])
        got = m["logprobs"]
        if len(got) != len(ref):
            sys.exit(f"line {i + 1}: meshlm has {len(got)} log-probs, expected {len(ref)}")
        diff = max(abs(a - b) for a, b in zip(got, ref))
        worst = max(worst, diff)
        print(f"line {i + 1}: {len(ref)} tokens, mean lp {sum(ref) / len(ref):.6f}, max abs diff {diff:.3g}")
        rows.append(ref)
    print(f"{type(model).__name__}: max abs difference meshlm vs HF {worst:.3g} (tol {args.tol:g})")
    if args.write:
        with open(args.write, "w") as f:
            for ref in rows:
                f.write(json.dumps({"logprobs": [float(f"{v:.9g}") for v in ref]}) + "\n")
        print(f"wrote {args.write}")
    if worst > args.tol:
        sys.exit(1)


if __name__ == "__main__":
    main()
