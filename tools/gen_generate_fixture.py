#!/usr/bin/env python3
"""gen_generate_fixture.py - transformers' greedy generations on the fixtures.

PURPOSE
    tests/mpi/test_generate.c checks that meshlm's greedy tokens are
    transformers' `generate(do_sample=False)` on the same model. This script
    writes the reference: for each fixture NAME (tools/gen_fixtures.py), three
    prompts cut from its expected.json input_ids (row 0 tokens 0..4, row 1
    tokens 2..10, row 0 tokens 3..9: lengths 5, 9, 7), each continued alone by
    GenerationMixin.generate with do_sample=False, max_new_tokens =
    min_new_tokens = NEW (no eos stop), use_cache=True, the model loaded with
    dtype=torch.float64 and attn_implementation="eager" (the reference
    arithmetic of gen_fixtures.py: no fp32 near-tie decides a token).

    CI NEVER RUNS THIS SCRIPT (no torch in CI): run by hand, its small output
    committed.

USAGE
    python3 tools/gen_generate_fixture.py --fixtures tests/fixtures [--only NAME ...]

OUTPUT
    NAME/generate.json   {"new": NEW, "prompts": [[ints] x 3], "tokens": [[NEW ints] x 3]}
    (torch 2.15, transformers 5.23 when committed)
"""
import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM

NEW = 16
CUTS = ((0, 0, 5), (1, 2, 9), (0, 3, 7))  # (row, first token, length)
NAMES = ("llama_untied", "gemma3", "qwen3", "llama_h9kv3")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixtures", default="tests/fixtures")
    ap.add_argument("--only", nargs="*", help="fixture names (default: %s)" % " ".join(NAMES))
    a = ap.parse_args()
    for name in a.only or NAMES:
        d = os.path.join(a.fixtures, name)
        ids = json.load(open(os.path.join(d, "expected.json")))["input_ids"]
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64,
                                                     attn_implementation="eager").eval()
        prompts, tokens = [], []
        for row, first, n in CUTS:
            p = ids[row][first:first + n]
            with torch.no_grad():
                out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, n, dtype=torch.long),
                                     do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                                     use_cache=True, eos_token_id=None, pad_token_id=0)
            prompts.append(p)
            tokens.append(out[0, n:].tolist())
        with open(os.path.join(d, "generate.json"), "w") as f:
            json.dump({"new": NEW, "prompts": prompts, "tokens": tokens}, f)
            f.write("\n")
        print(name, tokens)


if __name__ == "__main__":
    main()
