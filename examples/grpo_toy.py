#!/usr/bin/env python3
"""GRPO on a toy task, with meshlm's Python binding.

The policy -- a small randomly initialised Llama with a byte vocabulary, made
with `meshlm init` unless --model names one -- must learn to answer a fixed
prompt (b"Q: name? A: ") with a target byte string (b"meshlm").  The reward
is checkable in code and dense: the fraction of the target's positions that
the completion matches.

One step, on every data-parallel rank (the loop of NeMo RL's GRPO):
  1. sample G completions of the prompt per group (Policy.generate,
     temperature 1; each rank its own groups, its own seed);
  2. rewards, and GRPO's group-normalised advantages (r - mean) / (std + 1e-6)
     over each group (each rank normalises its own groups: no cross-rank
     communication is needed);
  3. old log-probs of prompt + completion under the sampling policy
     (Policy.logprobs, masked to the completion's tokens);
  4. --epochs optimizer steps of the clipped policy-gradient loss, written
     here in Python (grpo_loss: the loss as a function of the per-token
     log-probs, Policy.train_step(loss=grpo_loss(...), tensors=...)), or the
     built-in (--builtin-loss: loss="clipped_pg"), optionally with a k3 KL
     penalty to the initial policy (--kl-beta), held as the session's
     reference policy (Policy.set_reference: no second model).

Run:  python3 examples/grpo_toy.py [--model DIR] [--steps N] [--out DIR]
      mpirun -np 2 python3 examples/grpo_toy.py ...      (2 data-parallel ranks)

Writes OUT/rewards_rank<R>.csv on every rank, and on rank 0 OUT/rewards.csv
(step, mean reward over ranks, each rank's) and OUT/rewards.png (gnuplot if
the binary exists, else matplotlib if importable, else no plot; it says which).
The meshlm binary (to make the model) is $MESHLM or the checkout's build/meshlm;
the library is found as the meshlm package finds it ($MESHLM_LIBRARY, ...).
"""

import argparse
import csv
import os
import shutil
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import meshlm
except ImportError:  # running from a checkout without installing the package
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
    import meshlm
from meshlm import tools


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint dir (default: make OUT/model with meshlm init)")
    ap.add_argument("--preset", default="tiny", help="meshlm init --preset of a new model")
    ap.add_argument("--out", default="grpo_toy_out", help="output directory")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--group", type=int, default=64, help="completions per group (G)")
    ap.add_argument("--groups", type=int, default=4,
                    help="groups (of the same prompt) per data-parallel rank")
    ap.add_argument("--epochs", type=int, default=2, help="optimizer steps per batch (PPO epochs)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=0.1, help="ratio clip epsilon (low and high)")
    ap.add_argument("--kl-beta", type=float, default=0.0, help="k3 KL penalty to the initial "
                    "policy (0: none, no reference policy is opened)")
    ap.add_argument("--prompt", default="Q: name? A: ")
    ap.add_argument("--target", default="meshlm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="no per-step lines")
    ap.add_argument("--builtin-loss", action="store_true",
                    help="the built-in clipped_pg instead of the Python-defined loss")
    return ap.parse_args(argv)


def reward(completion, target):
    """Fraction of the target's positions the completion matches (dense, in [0, 1])."""
    n = min(len(completion), len(target))
    return float(np.count_nonzero(completion[:n] == target[:n])) / len(target)


def group_advantages(r, eps=1e-6):
    """GRPO: (r - mean) / (std + eps) within a group (population std, as NeMo RL)."""
    r = np.asarray(r, np.float64)
    return (r - r.mean()) / (r.std() + eps)


def grpo_loss(clip, beta):
    """The clipped surrogate with a k3 KL to the reference, as a Python
    objective (meshlm.ObjectiveChunk -> loss terms, dL/dlogprobs per target):
    r = exp(lp - old), l = max(-A r, -A clip(r, 1 - eps, 1 + eps)) + beta k3,
    k3 = exp(ref - lp) - (ref - lp) - 1, each term times its normalisation
    weight (token level: 1 / the global batch's masked tokens) -- the
    built-in clipped_pg's formulas (NeMo RL ClippedPGLossFn), any other loss
    of the log-probs written the same way."""
    def fn(c):
        lp = c.logprobs.astype(np.float64)
        A, old, ref = c.tensors["A"], c.tensors["old"], c.tensors["ref"]
        r = np.exp(lp - old)
        l1, l2 = -A * r, -A * np.clip(r, 1.0 - clip, 1.0 + clip)
        d = ref - lp
        k3 = np.exp(d) - d - 1.0
        loss = c.weight * (np.maximum(l1, l2) + beta * k3)
        grad = c.weight * (np.where(l1 >= l2, -A * r, 0.0) + beta * (1.0 - np.exp(d)))
        return loss, grad
    return fn


def wait_for(path, what, timeout=300.0):
    t0 = time.time()
    while not os.path.exists(path):
        if time.time() - t0 > timeout:
            raise RuntimeError("waited %.0f s for %s (%s)" % (timeout, what, path))
        time.sleep(0.05)


def ensure_model(args):
    """The model directory: --model, or OUT/model made once by rank 0 (the
    other ranks wait for it; it is moved into place complete)."""
    if args.model:
        return args.model
    path = os.path.join(args.out, "model")
    if tools.launcher_rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        tmp = "%s.tmp-%s" % (path, tools.job_id())
        shutil.rmtree(tmp, ignore_errors=True)
        tools.run_cli(["init", "--arch", "llama", "--preset", args.preset, "--seed", args.seed,
                       "--out", tmp])
        os.replace(tmp, path)
        print("grpo_toy: made %s (meshlm init --preset %s)" % (path, args.preset), flush=True)
    wait_for(os.path.join(path, "config.json"), "the model rank 0 makes")
    return path


def sync(policy):
    """A barrier over the policy's ranks without mpi4py: a collective call
    (every rank's library compares the call with the others' before it runs)."""
    policy.logprobs([np.zeros(2, np.int32)])


def plot(csv_path, png_path, nranks):
    """rewards.csv -> png: gnuplot, else matplotlib, else none. Says which."""
    if shutil.which("gnuplot"):
        script = ("set terminal png size 800,500; set output '%s'; set datafile separator ',';"
                  "set key top left; set xlabel 'step'; set ylabel 'mean reward';"
                  "set yrange [0:1]; set grid;"
                  "plot '%s' using 1:2 skip 1 with linespoints title 'mean over %d rank(s)'"
                  % (png_path, csv_path, nranks))
        p = subprocess.run(["gnuplot", "-e", script], stderr=subprocess.PIPE,
                           universal_newlines=True)
        if p.returncode == 0:
            return "gnuplot"
        print("grpo_toy: gnuplot failed: %s" % p.stderr.strip(), flush=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    data = np.loadtxt(csv_path, delimiter=",", skiprows=1, ndmin=2)
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(data[:, 0], data[:, 1], marker="o", label="mean over %d rank(s)" % nranks)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1)
    ax.grid(True)
    ax.legend(loc="upper left")
    fig.savefig(png_path)
    return "matplotlib"


def main(argv=None):
    """Run the loop (argv: the command line's arguments); returns this rank's
    list of (step, mean reward of its own samples)."""
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    model = ensure_model(args)
    prompt = np.frombuffer(args.prompt.encode(), np.uint8).astype(np.int32)
    target = np.frombuffer(args.target.encode(), np.uint8).astype(np.int32)
    P, T = len(prompt), len(target)
    t0 = time.time()
    policy = meshlm.Policy(model, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0,
                           max_grad_norm=1.0)
    if args.kl_beta > 0:
        policy.set_reference()  # the initial weights, frozen in this session
    info = policy.info
    rank, dp_rank, dp_size = info["rank"], info["dp_rank"], info["dp_size"]
    log = rank == 0 and not args.quiet
    if rank == 0:
        print("grpo_toy: %s, %d parameters, %d rank(s) (dp %d), %d x %d samples per rank, "
              "target %r" % (model, info["num_params"], info["world"], dp_size, args.groups,
                             args.group, args.target), flush=True)
    csv_path = os.path.join(args.out, "rewards_rank%d.csv" % rank)
    history = []
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "reward", "loss", "clip_fraction", "kl", "grad_norm", "seconds"])
        for step in range(1, args.steps + 1):
            ts = time.time()
            # 1. sample: groups of `group` samples per prompt, each prompt prefilled once
            # (each data-parallel rank its own seed; tp/cp ranks of one share it)
            seed = args.seed * 1000003 + step * 1009 + dp_rank
            t_gen = time.time()
            comps, gen_lps, _ = policy.generate([prompt] * args.groups, n=args.group,
                                                max_new_tokens=T, temperature=1.0,
                                                eos_token_id=-2, seed=seed)
            # 2. rewards and group-normalised advantages
            rewards = np.array([reward(c, target) for c in comps])
            adv = np.concatenate([group_advantages(rewards[g * args.group:(g + 1) * args.group])
                                  for g in range(args.groups)]).astype(np.float32)
            # 3. old log-probs of prompt + completion, masked to the completion
            seqs = [np.concatenate([prompt, c]) for c in comps]
            mask = [np.arange(len(s) - 1) >= P - 1 for s in seqs]
            t_score = time.time()
            old, _ = policy.logprobs(seqs, mask=mask)
            ref_lps = (policy.reference_logprobs(seqs, mask=mask)[0] if args.kl_beta > 0
                       else [np.zeros(len(s) - 1, np.float32) for s in seqs])
            if step == 1 and log:
                d = max(float(np.max(np.abs(o[P - 1:] - g))) for o, g in zip(old, gen_lps))
                print("grpo_toy: generate's log-probs vs logprobs(): max |diff| %.2e" % d,
                      flush=True)
            # 4. clipped policy-gradient steps
            t_train = time.time()
            for _ in range(args.epochs):
                if args.builtin_loss:
                    r = policy.train_step(seqs, loss="clipped_pg", token_mask=mask,
                                          seq_weights=adv, old_logprobs=old,
                                          ref_logprobs=ref_lps, ratio_clip_min=args.clip,
                                          ratio_clip_max=args.clip, kl_penalty=args.kl_beta)
                else:
                    r = policy.train_step(seqs, loss=grpo_loss(args.clip, args.kl_beta),
                                          token_mask=mask, tensors={"old": old, "ref": ref_lps},
                                          seq_tensors={"A": adv})
            t_end = time.time()
            phases = (t_score - t_gen, t_train - t_score, t_end - t_train)
            mean_r = float(rewards.mean())
            history.append((step, mean_r))
            w.writerow([step, "%.6f" % mean_r, "%.6g" % r["loss"], "%.4f" % r["clip_fraction"],
                        "%.6g" % r["kl"], "%.6g" % r["grad_norm"], "%.3f" % (time.time() - ts)])
            f.flush()
            if log:
                best = comps[int(np.argmax(rewards))].astype(np.uint8).tobytes()
                print("step %3d  reward %.3f  loss %+.4f  clip %.3f  grad_norm %.3f  best %r  "
                      "%.2f s (generate %.2f, score %.2f, train %.2f)"
                      % ((step, mean_r, r["loss"], r["clip_fraction"], r["grad_norm"], best,
                          time.time() - ts) + phases), flush=True)
    sync(policy)  # every rank's CSV is complete
    world = info["world"]
    policy.close()
    elapsed = time.time() - t0
    if rank == 0:
        per_rank = []
        for r_ in range(world):
            with open(os.path.join(args.out, "rewards_rank%d.csv" % r_)) as f:
                per_rank.append([float(row["reward"]) for row in csv.DictReader(f)])
        merged = os.path.join(args.out, "rewards.csv")
        with open(merged, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "reward"] + ["reward_rank%d" % r_ for r_ in range(world)])
            for i in range(len(per_rank[0])):
                vals = [p[i] for p in per_rank]
                w.writerow([i + 1, "%.6f" % np.mean(vals)] + ["%.6f" % v for v in vals])
        means = [float(np.mean([p[i] for p in per_rank])) for i in range(len(per_rank[0]))]
        k = max(1, min(5, len(means) // 4))
        print("grpo_toy: %d steps in %.1f s; mean reward over ranks: first %d steps %.3f, "
              "last %d steps %.3f" % (len(means), elapsed, k, np.mean(means[:k]), k,
                                      np.mean(means[-k:])), flush=True)
        png = os.path.join(args.out, "rewards.png")
        how = plot(merged, png, world) if means else None
        print("grpo_toy: wrote %s and %s" % (merged, "%s (%s)" % (png, how) if how else
                                            "no plot (neither gnuplot nor matplotlib found)"),
              flush=True)
    return history


if __name__ == "__main__":
    main()
