#!/usr/bin/env python3
"""Where a decode step's time goes: the operator profile
(MESHLM_OP_PROFILE=1, backend/profile.h) of Policy.generate, decode steps
only, per generated token, at batch B.

Each configuration (dtype x mode) runs two processes on the same prompts:
generate(max_new_tokens=1) (load, prefill, one draw) and
generate(max_new_tokens=1 + NEW); the profile's classes of the first are
subtracted from the second's, leaving the NEW decode steps, divided by
NEW: ms a step per class. The profile synchronizes the device at every
operator and charges the host's work until the next operator to the one
before it (so the sampler's time lands on the logits' copy to the host);
on the CPU backend synchronizing costs nothing. Also prints the wall time
a step of an unprofiled run of the same shape (the profile's clock costs
~1 µs an operator).

usage: bench/decode_profile.py [--model DIR] [--batch 1] [--prompt 128] [--new 64]
         [--dtypes fp32,bf16] [--modes default,invariant] [--lib build/libmeshlm.so]
The model defaults to the smollm2-135m preset (random weights, `meshlm init`).
Figures for notes; nothing here is asserted.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = re.compile(r"^(.+?)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%$")


KINDS = [("GEMM", ("gemm",)), ("attention", ("attention",)), ("norms", ("rmsnorm",)),
         ("RoPE", ("rope",)), ("KV-cache append", ("scatter_rows",)),
         ("sampling (host)", ("generate: sampling",)),
         ("token log-prob (the mode's)", ("xent",)),
         ("scheduling (host)", ("generate: scheduling",)),
         ("elementwise, casts, copies", ("copy", "zero", "convert", "round", "add", "glu",
                                         "embedding", "scale"))]


def kind_of(name):
    """The kind of a profile class: the first of KINDS whose words it contains."""
    for kind, words in KINDS:
        if any(w in name for w in words):
            return kind
    return "other"


def worker(a):
    import numpy as np
    import meshlm
    inv = {"batch_invariant": True} if a.mode == "invariant" else {}
    with meshlm.Policy(a.model, param_dtype=a.dtype, **inv) as p:
        rng = np.random.default_rng(1)
        ps = [rng.integers(0, p.info["vocab_size"], a.prompt).astype(np.int32)
              for _ in range(a.batch)]
        t0 = time.perf_counter()
        p.generate(ps, max_new_tokens=a.steps, seed=3, eos_token_id=-2)
        print("wall %.6f" % (time.perf_counter() - t0), flush=True)


def run(a, dtype, mode, steps, profile):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), MESHLM_LIBRARY=a.lib,
               OMP_WAIT_POLICY="passive", OMP_NUM_THREADS=str(os.cpu_count()),
               OPENBLAS_NUM_THREADS=str(os.cpu_count()))
    if profile:
        env["MESHLM_OP_PROFILE"] = "1"
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--model",
                        a.model, "--dtype", dtype, "--mode", mode, "--batch", str(a.batch),
                        "--prompt", str(a.prompt), "--steps", str(steps)],
                       env=env, capture_output=True, text=True, check=True)
    classes = {}
    for line in r.stderr.splitlines():
        m = ROW.match(line.strip())
        if m:
            classes[m.group(1).strip()] = (int(m.group(2)), float(m.group(3)))
    wall = float(r.stdout.split()[-1])
    return classes, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--modes", default="default,invariant")
    ap.add_argument("--lib", default=os.path.join(ROOT, "build", "libmeshlm.so"))
    ap.add_argument("--top", type=int, default=14, help="classes printed per configuration")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    with tempfile.TemporaryDirectory() as tmp:
        if not a.model:
            a.model = os.path.join(tmp, "model")
            subprocess.run([os.path.join(ROOT, "build", "meshlm"), "init", "--arch", "llama",
                            "--preset", "smollm2-135m", "--out", a.model], check=True,
                           stdout=subprocess.DEVNULL)
        print("decode profile: batch %d, prompt %d, %d decode steps, %d cores, %s"
              % (a.batch, a.prompt, a.new, os.cpu_count(), a.lib))
        for dtype in a.dtypes.split(","):
            for mode in a.modes.split(","):
                one, _ = run(a, dtype, mode, 1, True)
                many, _ = run(a, dtype, mode, 1 + a.new, True)
                _, w1 = run(a, dtype, mode, 1, False)
                _, wn = run(a, dtype, mode, 1 + a.new, False)
                rows = []
                for name, (calls, ms) in many.items():
                    c0, m0 = one.get(name, (0, 0.0))
                    rows.append((name, (calls - c0) / a.new, (ms - m0) / a.new))
                rows.sort(key=lambda r: -r[2])
                total = sum(r[2] for r in rows)
                print("\n%s, %s mode: profiled %.2f ms a step (unprofiled wall %.2f ms a step, "
                      "%.1f tokens/s)" % (dtype, mode, total, 1e3 * (wn - w1) / a.new,
                                          a.batch * a.new / (wn - w1)))
                kinds = {}
                for name, calls, ms in rows:
                    k = kind_of(name)
                    c0, m0 = kinds.get(k, (0.0, 0.0))
                    kinds[k] = (c0 + calls, m0 + ms)
                print("%-44s %10s %10s %7s" % ("kind", "calls/step", "ms/step", "share"))
                for k, (calls, ms) in sorted(kinds.items(), key=lambda x: -x[1][1]):
                    print("%-44s %10.1f %10.3f %6.1f%%" % (k, calls, ms, 100 * ms / total))
                print("%-44s %10s %10s %7s" % ("class", "calls/step", "ms/step", "share"))
                for name, calls, ms in rows[:a.top]:
                    print("%-44s %10.1f %10.3f %6.1f%%" % (name, calls, ms, 100 * ms / total))
                rest = sum(r[2] for r in rows[a.top:])
                print("%-44s %10s %10.3f %6.1f%%" % ("(the other classes)", "", rest,
                                                     100 * rest / total))


if __name__ == "__main__":
    main()
