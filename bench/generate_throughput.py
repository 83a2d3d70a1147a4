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
  gen MB      (new) the peak resident memory during generate(max_new_tokens=NEW)
              (VmHWM, reset just before the call through /proc/self/clear_refs;
              the largest rank's)
  kv B/tok    the KV cache's bytes a position (2 · layers · kv heads ·
              head_dim · 4, or 2 with bf16 parameters where the cache is bf16)
  kv MB       the KV cache the call's layout holds at its fullest (from the
              layout, not measured): slots (an earlier meshlm, --old: every
              sequence a slot of prompt + new − 1 fp32 positions, samples
              copying their prompt's keys) or pages (this tree: 16-position
              blocks, a prompt's samples sharing its full prompt blocks)
--samples N makes each prompt continue N times (generate(n=N), GRPO's
group): B rows are B / N prompts of N samples (a prompt prefilled once).
Implementations, side by side:
  new         this tree (build/): every sequence decodes together
  old         --old ROOT, a source tree of an earlier meshlm with its build
              (ROOT/python, ROOT/build/libmeshlm.so): its generate() (before
              continuous batching: one group per prompt length; before paging:
              a slot of fp32 keys per sequence)
  torch       transformers' generate() (LlamaForCausalLM from the same
              directory, do_sample, top_k 0, use_cache; bf16: the model in
              torch.bfloat16), where torch and transformers import
--mixed gives the B prompts B distinct lengths (PROMPT − B/2 .. PROMPT +
B/2 − 1 when B > 1), the case where old runs one group per prompt.
MESHLM_LIBRARY, when set, is new's library (else build/libmeshlm.so).
--device cuda runs new on the GPU (Policy(device="cuda"): its KV cache on
the CUDA backend's paged block attention) and torch with the model on the
GPU (synchronised before each time is read).
--ranks N runs new over N MPI ranks (mpiexec), each with cores / N
threads, on a mesh of tp --tp (dp_shard N / tp): generate() on the policy's
mesh (the tp ranks decode the prompts together; each data-parallel rank
its share of the B prompts), or with --replica on a one-rank replica per
rank (each rank its share of the prompts); times are the slowest rank's.
Figures for notes; nothing here is asserted.

usage: bench/generate_throughput.py [--batches 1,8,64] [--prompt 128] [--new 256]
         [--dtypes fp32,bf16] [--old ROOT] [--old-max-batch 8] [--mixed] [--impls new,old,torch]
         [--samples 1] [--no-step] [--device cpu] [--batch-invariant]
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


def reset_peak_rss():
    """Linux: the process's peak resident set (VmHWM) reset to its current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mb():
    """VmHWM of this process in MB (MiB, as rss MB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def worker(a):
    """One measurement in this process: prints one JSON line."""
    if a.impl == "torch":
        return torch_worker(a)
    import meshlm
    inv = {"batch_invariant": True} if a.batch_invariant else {}
    with meshlm.Policy(a.model, param_dtype=a.dtype, tp=a.tp, device=a.device, **inv) as p:
        vocab = p.info["vocab_size"]
        ps = prompts_of(a.batch // a.samples, a.prompt, a.mixed, vocab, 1)
        share = p.info["rank"] if a.replica else p.info["dp_rank"]
        of = p.info["world"] if a.replica else p.info["dp_size"]
        ps = ps[share::of]
        kw = dict(eos_token_id=-2, replica=a.replica, n=a.samples)
        p.generate(ps[:1], max_new_tokens=2, **kw)  # opens the replica (replica only)
        t = []
        for new in (1, a.new):
            reset_peak_rss()
            t0 = time.perf_counter()
            out = p.generate(ps, max_new_tokens=new, seed=3, **kw)
            t.append(time.perf_counter() - t0)
            assert all(len(x) == new for x in out[0])
        gen_rss = peak_rss_mb()
        if not a.no_step:
            p.train_step([ps[0]])
            t0 = time.perf_counter()
            p.generate(ps, max_new_tokens=1, seed=3, **kw)
            t.append(time.perf_counter() - t0)
        else:
            t.append(float("nan"))
        rank = p.info["rank"]
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    with open(os.path.join(a.out, "rank%d.json" % rank), "w") as f:
        json.dump({"prefill": t[0], "total": t[1], "step": t[2], "rss": rss, "gen": gen_rss}, f)


def torch_worker(a):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count())
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    m = AutoModelForCausalLM.from_pretrained(a.model, dtype=dt).eval().to(a.device)
    ps = prompts_of(a.batch // a.samples, a.prompt, a.mixed, m.config.vocab_size, 1)
    width = max(len(x) for x in ps)
    ids = torch.zeros((len(ps), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(ps):  # left padding, as generate() wants for decoder-only models
        ids[i, width - len(x):] = torch.from_numpy(x.astype("int64"))
        mask[i, width - len(x):] = 1
    ids, mask = ids.to(a.device), mask.to(a.device)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    kw = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              use_cache=True, pad_token_id=0, eos_token_id=None,
              num_return_sequences=a.samples)
    t = []
    with torch.inference_mode():
        m.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=2, min_new_tokens=2,
                   do_sample=True, top_k=0, pad_token_id=0, eos_token_id=None)
        for new in (1, a.new):
            sync()
            t0 = time.perf_counter()
            m.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
            sync()
            t.append(time.perf_counter() - t0)
    with open(os.path.join(a.out, "rank0.json"), "w") as f:
        json.dump({"prefill": t[0], "total": t[1]}, f)


def kv_sizes(model, impl, dtype, batch, a):
    """(bytes a position, MB at the fullest) of the KV cache's layout (see the docstring)."""
    c = json.load(open(os.path.join(model, "config.json")))
    heads = c["num_attention_heads"]
    hd = c.get("head_dim") or c["hidden_size"] // heads
    pages = impl == "new"
    per_pos = 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", heads) * hd * \
        (2 if pages and dtype == "bf16" else 4)
    length = a.prompt + a.new - 1
    if not pages:
        return per_pos, min(batch, 256) * length * per_pos / 1e6
    blk = 16
    shared = a.prompt // blk
    own = -(-length // blk) - shared
    prompts = batch // a.samples
    return per_pos, prompts * (shared + a.samples * own) * blk * per_pos / 1e6


def run(a, impl, dtype, batch, model):
    env = dict(os.environ)
    ranks = a.ranks if impl == "new" else 1
    n = str(max(os.cpu_count() // ranks, 1))
    env.update(OMP_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n, OMP_WAIT_POLICY="passive")
    if impl == "new":
        env["PYTHONPATH"] = os.path.join(ROOT, "python")
        env["MESHLM_LIBRARY"] = os.environ.get("MESHLM_LIBRARY") or \
            os.path.join(ROOT, "build", "libmeshlm.so")
    elif impl == "old":
        env["PYTHONPATH"] = os.path.join(a.old, "python")
        env["MESHLM_LIBRARY"] = os.path.join(a.old, "build", "libmeshlm.so")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--impl", impl, "--dtype", dtype,
           "--batch", str(batch), "--prompt", str(a.prompt), "--new", str(a.new),
           "--model", model, "--tp", str(a.tp if impl == "new" else 1),
           "--samples", str(a.samples), "--device", a.device] + \
        (["--mixed"] if a.mixed else []) + (["--replica"] if a.replica else []) + \
        (["--no-step"] if a.no_step else []) + \
        (["--batch-invariant"] if a.batch_invariant and impl != "torch" else [])
    if ranks > 1:
        cmd = ["mpiexec", "-n", str(ranks), "--oversubscribe", "--bind-to", "none"] + cmd
    with tempfile.TemporaryDirectory() as out:  # one JSON file per rank
        r = subprocess.run(cmd + ["--out", out], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            err = [x for x in r.stderr.strip().splitlines() if "Error" in x or "error" in x]
            return None, (err or r.stderr.strip().splitlines() or ["failed"])[-1]
        rows = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))]
    return {k: max(x.get(k, float("nan")) for x in rows)
            for k in ("prefill", "total", "step", "rss", "gen")}, None


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
    ap.add_argument("--samples", type=int, default=1,
                    help="samples per prompt (generate(n=)): B rows = B / samples prompts")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (new and torch on the GPU)")
    ap.add_argument("--no-step", action="store_true",
                    help="skip the generate after a train step (step s)")
    # one measurement (internal)
    ap.add_argument("--batch-invariant", action="store_true",
                    help="new and old in the batch-invariant mode (Policy(batch_invariant=True))")
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
        print("smollm2-135m (random weights), prompt %d%s, %d new tokens, %d sample(s) a "
              "prompt, %d cores, device %s, temperature 1, no stop id; new: %d rank(s), tp %d, %s%s"
              % (a.prompt, " (B distinct lengths)" if a.mixed else "", a.new, a.samples,
                 os.cpu_count(), a.device, a.ranks, a.tp,
                 "a replica per rank" if a.replica else "the policy's mesh",
                 "; batch-invariant mode" if a.batch_invariant else ""))
        print("%-6s %-5s %5s %10s %10s %14s %8s %8s %8s %9s %8s"
              % ("impl", "dtype", "batch", "prefill s", "total s", "decode tok/s", "step s",
                 "rss MB", "gen MB", "kv B/tok", "kv MB"))
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
                    kv = kv_sizes(model, impl, dtype, batch, a) if impl != "torch" else \
                        (float("nan"), float("nan"))
                    print("%-6s %-5s %5d %10.2f %10.2f %14.1f %8.2f %8.0f %8.0f %9.0f %8.0f"
                          % (impl, dtype, batch, r["prefill"], r["total"], dec, r["step"],
                             r["rss"], r["gen"], kv[0], kv[1]), flush=True)


if __name__ == "__main__":
    main()
