"""Generated tokens/s of Policy.generate on random prompts, for the batch-invariant benches.

4 prompts of 64 random tokens, 64 new tokens each, greedy, after a 4-token warm-up call; rank 0's
figure is printed first (the caller keeps the first line). Figures for notes; nothing is asserted.
usage: python3 bench/decode_rate.py MODEL_DIR [Policy keyword=value ...]
       values: ints, "true"/"false", or strings (e.g. param_dtype=bf16 batch_invariant=true tp=2)
"""
import sys
import time

import numpy as np

import meshlm


def value(v):
    if v in ("true", "false"):
        return v == "true"
    try:
        return int(v)
    except ValueError:
        return v


kw = dict(a.split("=", 1) for a in sys.argv[2:])
p = meshlm.Policy(sys.argv[1], **{k: value(v) for k, v in kw.items()})
rng = np.random.default_rng(0)
prompts = [rng.integers(0, p.info["vocab_size"], 64, dtype=np.int32) for _ in range(4)]
p.generate(prompts, max_new_tokens=4, greedy=True, eos_token_id=-2)
t = time.perf_counter()
out = p.generate(prompts, max_new_tokens=64, greedy=True, eos_token_id=-2)[0]
print("%.1f" % (sum(len(o) for o in out) / (time.perf_counter() - t)))
