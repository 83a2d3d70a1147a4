#!/usr/bin/env python3
"""PyTorch peer of `meshlm train` for the throughput benchmarks.

Trains the transformers model of a meshlm model directory (AutoModelForCausalLM:
LlamaForCausalLM for `meshlm init --arch llama`)
(config.json + model.safetensors, as `meshlm init` writes them) on the same
tokens meshlm reads, with the same optimizer step meshlm takes: AdamW
(betas 0.9/0.999, eps 1e-8, weight decay 0 — meshlm's defaults), the grad
norm clipped to 1.0 (meshlm's --max-grad-norm default), global batch B
sequences of S tokens, one micro-batch, one process. Attention is
attn_implementation="sdpa" (torch's scaled_dot_product_attention).

Modes (--modes, comma-separated):
  fp32      fp32 weights and arithmetic (MKL/oneDNN sgemm)
  bf16      torch.autocast("cpu", dtype=torch.bfloat16) around forward and
            loss, eager: fp32 master weights and optimizer, bf16 GEMMs with
            fp32 accumulation (oneDNN) — what `--param-dtype bf16` is meant
            to become
  compile-fp32, compile-bf16
            the same under torch.compile (inductor); a compile error is
            reported as one "skipped" line, not a failure

Data (--data): a JSONL file of {"input_ids": [...]} lines (truncated to S,
padded with id 0, as meshlm's loader does), or raw text whose bytes are the
ids in non-overlapping windows of S bytes; or none, for random ids in
[0, vocab) from --seed. The global batch of step k is sequences
(k*B + i) mod nseq in file order (meshlm takes them in an order shuffled by
its --seed: the same tokens and shapes, other batches; throughput does not
depend on which).

--device cuda runs the same on the GPU (model and ids on cuda:0, autocast
on "cuda", TF32 off so fp32 stays fp32): each step ends with
torch.cuda.synchronize(), and the line adds peak_device_mib
(torch.cuda.max_memory_allocated over the mode).

Every step is timed from the forward to the end of optimizer.step();
tokens/s = B*S / step time, as meshlm's metrics count them (padding
included). Per mode one line on stdout:

  torch mode=bf16 threads=2 steps=12 tokens_per_s=1234.5 step_s=0.83 loss=5.41 peak_rss_mib=812.3

with the median over the steps after --warmup (2) steps; peak_rss_mib is
the process's peak RSS so far (ru_maxrss), which only grows over the modes
run in one process. Progress goes to stderr.

usage: bench/torch_peer.py --model DIR [--data FILE] --seq-len S --batch-size B
         --steps N [--threads T] [--modes fp32,bf16] [--lr 1e-3] [--device cpu|cuda]
         [--experts-implementation eager]
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="meshlm model directory (config.json + safetensors)")
    p.add_argument("--data", help="JSONL with input_ids, or raw text (bytes); default: random ids")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="global batch in sequences")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per mode, warm-up included")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads")
    p.add_argument("--modes", default="fp32,bf16",
                   help="comma-separated: fp32, bf16, compile-fp32, compile-bf16")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seed of the random ids (no --data)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--experts-implementation", default=None,
                   help="mixture-of-experts models: transformers' experts_implementation "
                        "(eager: the loop over experts; default: transformers' choice)")
    a = p.parse_args()
    if a.steps <= a.warmup:
        p.error(f"--steps {a.steps} must exceed --warmup {a.warmup}")
    return a


def load_tokens(path, seq_len, batch, vocab, seed, torch):
    """[nseq, seq_len] int64 ids, as meshlm's loader builds them."""
    if path is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (batch, seq_len), generator=g)
    with open(path, "rb") as f:
        raw = f.read()
    rows = []
    if raw.lstrip()[:1] == b"{":
        for line in raw.decode().splitlines():
            if line.strip():
                ids = json.loads(line)["input_ids"][:seq_len]
                rows.append(ids + [0] * (seq_len - len(ids)))
    else:
        if vocab < 256:
            sys.exit(f"torch_peer: raw text needs a vocabulary of at least 256, not {vocab}")
        for off in range(0, len(raw), seq_len):
            w = list(raw[off:off + seq_len])
            if len(w) >= 2:
                rows.append(w + [0] * (seq_len - len(w)))
    if not rows:
        sys.exit(f"torch_peer: no sequences in {path}")
    ids = torch.tensor(rows, dtype=torch.int64)
    if int(ids.max()) >= vocab or int(ids.min()) < 0:
        sys.exit(f"torch_peer: ids outside [0, {vocab}) in {path}")
    return ids


def run_mode(mode, a, tokens, torch, transformers):
    torch.manual_seed(0)
    kw = {"experts_implementation": a.experts_implementation} if a.experts_implementation else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        a.model, dtype=torch.float32, attn_implementation="sdpa", **kw).to(a.device)
    model.train()
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    bf16 = mode.endswith("bf16")

    def fwd(ids):
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=bf16):
            return model(input_ids=ids, labels=ids).loss

    if mode.startswith("compile-"):
        fwd = torch.compile(fwd)
    nseq = tokens.shape[0]
    times, loss = [], float("nan")
    for k in range(a.steps):
        idx = torch.tensor([(k * a.batch_size + i) % nseq for i in range(a.batch_size)])
        ids = tokens[idx].to(a.device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = fwd(ids)
        out.backward()
        if a.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_grad_norm)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        loss = float(out.detach())
        times.append(dt)
        print(f"torch_peer: {mode} step {k + 1} loss {loss:.4f} {a.batch_size * a.seq_len / dt:.1f} tok/s",
              file=sys.stderr, flush=True)
    step_s = statistics.median(times[a.warmup:])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    dev = f" peak_device_mib={torch.cuda.max_memory_allocated() / 2**20:.1f}" if cuda else ""
    print(f"torch mode={mode} device={a.device} threads={a.threads} steps={a.steps} "
          f"tokens_per_s={a.batch_size * a.seq_len / step_s:.1f} step_s={step_s:.3f} "
          f"loss={loss:.4f} peak_rss_mib={rss:.1f}{dev}", flush=True)
    del model, opt


def main():
    a = parse_args()
    import torch
    import transformers
    torch.set_num_threads(a.threads)
    if a.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    transformers.utils.logging.disable_progress_bar()
    cfg = transformers.AutoConfig.from_pretrained(a.model)
    tokens = load_tokens(a.data, a.seq_len, a.batch_size, cfg.vocab_size, a.seed, torch)
    where = (torch.cuda.get_device_name() if a.device == "cuda" else
             f"{torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 "
             f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    print(f"torch_peer: torch {torch.__version__} ({where}), transformers "
          f"{transformers.__version__}, {a.threads} threads, sdpa attention, "
          f"{tokens.shape[0]} sequences x {a.seq_len}", file=sys.stderr, flush=True)
    for mode in a.modes.split(","):
        if mode not in ("fp32", "bf16", "compile-fp32", "compile-bf16"):
            sys.exit(f"torch_peer: unknown mode '{mode}'")
        try:
            run_mode(mode, a, tokens, torch, transformers)
        except Exception as e:  # torch.compile failures (no compiler, inductor errors)
            if not mode.startswith("compile-"):
                raise
            msg = str(e).strip().splitlines()
            print(f"torch mode={mode} skipped: {type(e).__name__}: {msg[0] if msg else ''}",
                  flush=True)


if __name__ == "__main__":
    main()
