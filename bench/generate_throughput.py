#!/usr/bin/env python3
"""Generation throughput of the `smollm2-135m` preset (random weights,
`meshlm init`), one process on every core, through the Python binding.

For each dtype (fp32; bf16: param_dtype bf16, meshlm's mixed precision) and
batch B (prompts of --prompt tokens, random ids, each continued by --new
sampled tokens at temperature 1, no stop id), in one process per
measurement:
  prefill s   the wall time of generate(max_new_tokens=1): the prompts'
              forward and one draw each
  total s     generate(max_new_tokens=NEW)
  decode tok/s  B·(NEW − 1) / (total − prefill): the generated tokens of the
              decode steps per second of wall clock
  step s      (new) generate(max_new_tokens=1) right after a train step: the
              prefill plus, with --replica, the refit of the changed weights
  rss MB      (new) the process's peak resident memory (the slowest rank's
              when several: the largest)
Implementations, side by side:
  new         this tree (build/): every sequence decodes together
  old         --old ROOT, a source tree of an earlier meshlm with its build
              (ROOT/python, ROOT/build/libmeshlm.so): its generate(), which
              batches prompts of equal length only (one group per length)
  torch       transformers' generate() (LlamaForCausalLM from the same
              directory, do_sample, top_k 0, use_cache; bf16: the model in
              torch.bfloat16), where torch and transformers import
--mixed gives the B prompts B distinct lengths (PROMPT − B/2 .. PROMPT +
B/2 − 1 when B > 1), the case where old runs one group per prompt.
--ranks N runs new over N MPI ranks (mpiexec), each with cores / N
threads, on a mesh of tp --tp (dp_shard N / tp): generate() on the policy's
mesh (the tp ranks decode the prompts together; each data-parallel rank
its share of the B prompts), or with --replica on a one-rank replica per
rank (each rank its share of the prompts); times are the slowest rank's.
Figures for notes; nothing here is asserted.

usage: bench/generate_throughput.py [--batches 1,8,64] [--prompt 128] [--new 256]
         [--dtypes fp32,bf16] [--old ROOT] [--old-max-batch 8] [--mixed] [--impls new,old,torch]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prompts_of(batch, prompt, mixed, vocab, seed):
    import numpy as np
    rng = np.random.default_rng(seed)
    lens = [prompt + i - batch // 2 if mixed and batch > 1 else prompt for i in range(batch)]
    return [rng.integers(0, vocab, n).astype(np.int32) for n in lens]


def worker(a):
    """One measurement in this process: prints one JSON line."""
    if a.impl == "torch":
        return torch_worker(a)
    import meshlm
    with meshlm.Policy(a.model, param_dtype=a.dtype, tp=a.tp) as p:
        vocab = p.info["vocab_size"]
        ps = prompts_of(a.batch, a.prompt, a.mixed, vocab, 1)
        share = p.info["rank"] if a.replica else p.info["dp_rank"]
        of = p.info["world"] if a.replica else p.info["dp_size"]
        ps = ps[share::of]
        kw = dict(eos_token_id=-2, replica=a.replica)
        p.generate(ps[:1], max_new_tokens=2, **kw)  # opens the replica (replica only)
        t = []
        for new in (1, a.new):
            t0 = time.perf_counter()
            out = p.generate(ps, max_new_tokens=new, seed=3, **kw)
            t.append(time.perf_counter() - t0)
            assert all(len(x) == new for x in out[0])
        p.train_step([ps[0]])
        t0 = time.perf_counter()
        p.generate(ps, max_new_tokens=1, seed=3, **kw)
        t.append(time.perf_counter() - t0)
        rank = p.info["rank"]
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    with open(os.path.join(a.out, "rank%d.json" % rank), "w") as f:
        json.dump({"prefill": t[0], "total": t[1], "step": t[2], "rss": rss}, f)


def torch_worker(a):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count())
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    m = AutoModelForCausalLM.from_pretrained(a.model, dtype=dt).eval()
    ps = prompts_of(a.batch, a.prompt, a.mixed, m.config.vocab_size, 1)
    width = max(len(x) for x in ps)
    ids = torch.zeros((len(ps), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(ps):  # left padding, as generate() wants for decoder-only models
        ids[i, width - len(x):] = torch.from_numpy(x.astype("int64"))
        mask[i, width - len(x):] = 1
    kw = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              use_cache=True, pad_token_id=0, eos_token_id=None)
    t = []
    with torch.inference_mode():
        m.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=2, min_new_tokens=2,
                   do_sample=True, top_k=0, pad_token_id=0, eos_token_id=None)
        for new in (1, a.new):
            t0 = time.perf_counter()
            m.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
            t.append(time.perf_counter() - t0)
    with open(os.path.join(a.out, "rank0.json"), "w") as f:
        json.dump({"prefill": t[0], "total": t[1]}, f)


def run(a, impl, dtype, batch, model):
    env = dict(os.environ)
    ranks = a.ranks if impl == "new" else 1
    n = str(max(os.cpu_count() // ranks, 1))
    env.update(OMP_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n, OMP_WAIT_POLICY="passive")
    if impl == "new":
        env["PYTHONPATH"] = os.path.join(ROOT, "python")
        env["MESHLM_LIBRARY"] = os.path.join(ROOT, "build", "libmeshlm.so")
    elif impl == "old":
        env["PYTHONPATH"] = os.path.join(a.old, "python")
        env["MESHLM_LIBRARY"] = os.path.join(a.old, "build", "libmeshlm.so")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--impl", impl, "--dtype", dtype,
           "--batch", str(batch), "--prompt", str(a.prompt), "--new", str(a.new),
           "--model", model, "--tp", str(a.tp if impl == "new" else 1)] + \
        (["--mixed"] if a.mixed else []) + (["--replica"] if a.replica else [])
    if ranks > 1:
        cmd = ["mpiexec", "-n", str(ranks), "--oversubscribe", "--bind-to", "none"] + cmd
    with tempfile.TemporaryDirectory() as out:  # one JSON file per rank
        r = subprocess.run(cmd + ["--out", out], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            err = [x for x in r.stderr.strip().splitlines() if "Error" in x or "error" in x]
            return None, (err or r.stderr.strip().splitlines() or ["failed"])[-1]
        rows = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))]
    return {k: max(x.get(k, float("nan")) for x in rows)
            for k in ("prefill", "total", "step", "rss")}, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--impls", default="new,old,torch")
    ap.add_argument("--old", help="an earlier meshlm source tree with its build/")
    ap.add_argument("--old-max-batch", type=int, default=8,
                    help="largest batch old runs (its prefill of B equal-length prompts keeps "
                         "every layer's activations of [B, PROMPT]: ~1 MB a token for "
                         "smollm2-135m, 8 GB at 64 x 128)")
    ap.add_argument("--mixed", action="store_true", help="B distinct prompt lengths")
    ap.add_argument("--model", help="a model directory (default: smollm2-135m from meshlm init)")
    ap.add_argument("--ranks", type=int, default=1, help="MPI ranks of new (cores / ranks threads)")
    ap.add_argument("--tp", type=int, default=1, help="new's tp (divides --ranks)")
    ap.add_argument("--replica", action="store_true",
                    help="new generates on a one-rank replica per rank, not the policy's mesh")
    # one measurement (internal)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    impls = [i for i in a.impls.split(",") if i != "old" or a.old]
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or os.path.join(tmp, "model")
        if not a.model:
            subprocess.run([os.path.join(ROOT, "build", "meshlm"), "init", "--arch", "llama",
                            "--preset", "smollm2-135m", "--out", model], check=True,
                           stdout=subprocess.DEVNULL)
        print("smollm2-135m (random weights), prompt %d%s, %d new tokens, %d cores, "
              "temperature 1, no stop id; new: %d rank(s), tp %d, %s"
              % (a.prompt, " (B distinct lengths)" if a.mixed else "", a.new, os.cpu_count(),
                 a.ranks, a.tp, "a replica per rank" if a.replica else "the policy's mesh"))
        print("%-6s %-5s %5s %10s %10s %14s %8s %8s" % ("impl", "dtype", "batch", "prefill s",
                                                     "total s", "decode tok/s", "step s",
                                                     "rss MB"))
        for dtype in a.dtypes.split(","):
            for batch in [int(b) for b in a.batches.split(",")]:
                for impl in impls:
                    if impl == "old" and batch > a.old_max_batch:
                        print("%-6s %-5s %5d   skipped: batch > --old-max-batch %d"
                              % (impl, dtype, batch, a.old_max_batch))
                        continue
                    r, err = run(a, impl, dtype, batch, model)
                    if r is None:
                        print("%-6s %-5s %5d   skipped: %s" % (impl, dtype, batch, err[:90]))
                        continue
                    dec = batch * (a.new - 1) / max(r["total"] - r["prefill"], 1e-9)
                    print("%-6s %-5s %5d %10.2f %10.2f %14.1f %8.2f %8.0f"
                          % (impl, dtype, batch, r["prefill"], r["total"], dec, r["step"],
                             r["rss"]), flush=True)


if __name__ == "__main__":
    main()
