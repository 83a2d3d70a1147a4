"""The overhead of a Python objective (MESHLM_LOSS_CUSTOM through the binding)
against the built-in it re-implements: clipped PG with k3 KL, one train_step
per iteration on the same batch, median wall time per step, tokens/s, and the
time spent inside the Python callable per call (numpy, vectorised: what an RL
framework would write).  Figures for notes; nothing is asserted.
usage: python3 bench/objective_callback.py MODEL_DIR [ITERS] [SEQS] [LEN]"""
import statistics
import sys
import time

import numpy as np

import meshlm


def clipped_pg(eps=0.2, beta=0.05):
    stats = {"calls": 0, "seconds": 0.0, "targets": 0}

    def fn(c):
        t0 = time.perf_counter()
        x = c.logprobs.astype(np.float64)
        A, old, ref = c.tensors["A"], c.tensors["old"], c.tensors["ref"]
        r = np.exp(x - old)
        l1, l2 = -A * r, -A * np.clip(r, 1 - eps, 1 + eps)
        d = ref - x
        e = np.exp(d)
        loss = c.weight * (np.maximum(l1, l2) + beta * (e - d - 1.0))
        grad = c.weight * (np.where(l1 >= l2, -A * r, 0.0) + beta * (1.0 - e))
        stats["calls"] += 1
        stats["targets"] += len(x)
        stats["seconds"] += time.perf_counter() - t0
        return loss, grad
    return fn, stats


def main():
    model = sys.argv[1]
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    length = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    rng = np.random.default_rng(0)
    with meshlm.Policy(model, lr=1e-6) as p:
        vocab = p.info["vocab_size"]
        seqs = [rng.integers(0, vocab, size=length) for _ in range(n)]
        lps = p.logprobs(seqs)[0]
        old = [(l + rng.uniform(-0.1, 0.1, size=len(l))).astype(np.float32) for l in lps]
        ref = [(l + rng.uniform(-0.1, 0.1, size=len(l))).astype(np.float32) for l in lps]
        A = [np.full(len(l), rng.normal(), np.float32) for l in lps]
        tokens = sum(len(s) - 1 for s in seqs)
        kw = dict(token_weights=A, old_logprobs=old, ref_logprobs=ref)
        fn, stats = clipped_pg()
        rows = []
        for name in ("built-in clipped_pg", "Python callable"):
            times = []
            stats.update(calls=0, seconds=0.0, targets=0)
            for _ in range(iters + 1):  # the first is a warm-up
                t0 = time.perf_counter()
                if name.startswith("built-in"):
                    p.train_step(seqs, loss="clipped_pg", kl_penalty=0.05, **kw)
                else:
                    p.train_step(seqs, loss=fn, tensors={"A": A, "old": old, "ref": ref})
                times.append(time.perf_counter() - t0)
            step = statistics.median(times[1:])
            per_call = stats["seconds"] / stats["calls"] * 1e3 if stats["calls"] else 0.0
            calls = stats["calls"] / (iters + 1)
            rows.append((name, step, calls, per_call))
        print("model %s, %d sequences x %d tokens (%d targets), %d steps each (median)"
              % (model, n, length, tokens, iters))
        for name, step, calls, per_call in rows:
            print("%-20s step %8.1f ms  %8.0f tokens/s  callable: %4.1f calls/step, %.3f ms/call"
                  % (name, step * 1e3, tokens / step, calls, per_call))
        print("overhead of the callable per step: %.1f ms (%.2f %%)"
              % ((rows[1][1] - rows[0][1]) * 1e3, (rows[1][1] / rows[0][1] - 1) * 100))


if __name__ == "__main__":
    main()
