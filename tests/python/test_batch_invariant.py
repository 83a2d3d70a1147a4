"""Policy(batch_invariant=True): a token's log-prob is the same float32 bit
pattern whatever batch or micro-batch scores it, and generate's log-probs are
logprobs()' of prompt + generation (asserted with np.array_equal on the raw
float32 values, never a tolerance).  Every rank scores its own share of the
batch on a data-parallel mesh of the whole job (dp_shard 2 under mpirun -np
2), against the same sequences scored one at a time."""

import numpy as np
from conftest import make_seqs

import meshlm


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def test_batch_equals_alone(model_dir):
    seqs = make_seqs(10, seed=23, lo=2, hi=60)  # as many on each of 1 or 2 ranks
    with meshlm.Policy(model_dir, batch_invariant=True, micro_batch_tokens=64) as p:
        info = p.info
        mine = seqs[info["dp_rank"]::info["dp_size"]]
        together, _ = p.logprobs(mine)
        for k, s in enumerate(mine):
            alone, _ = p.logprobs([s])  # collective: every rank scores one at a time
            assert np.array_equal(bits(together[k]), bits(alone[0])), k


def test_generate_equals_logprobs(model_dir):
    with meshlm.Policy(model_dir, batch_invariant=True) as p:
        rng = np.random.default_rng(3 + p.info["dp_rank"])
        prompts = [rng.integers(0, p.info["vocab_size"], n, dtype=np.int32) for n in (5, 9)]
        for greedy in (True, False):
            toks, glps, _ = p.generate(prompts, max_new_tokens=6, greedy=greedy, eos_token_id=-2,
                                       seed=7)
            full = [np.concatenate([q, t]) for q, t in zip(prompts, toks)]
            lps, _ = p.logprobs(full)
            for k, q in enumerate(prompts):
                got = glps[k][:len(toks[k])]
                want = lps[k][len(q) - 1:]
                assert np.array_equal(bits(got), bits(want)), (greedy, k)
