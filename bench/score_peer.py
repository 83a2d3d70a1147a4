#!/usr/bin/env python3
"""transformers peer of `meshlm logprobs` for the scoring benchmark (issue 30).

Scores the sequences of --data (JSONL {"input_ids": [...]}, truncated or
padded with id 0 to --seq-len, as torch_peer.py loads them) with the
transformers model of --model (AutoModelForCausalLM, attn_implementation
"sdpa", fp32 weights) the way an RL trainer computes per-token log-probs:
under torch.no_grad, one forward of the whole batch, then
log_softmax(logits.float(), -1) gathered at the next token — what
`meshlm logprobs` writes. --mode bf16 runs the forward under
torch.autocast("cpu", dtype=torch.bfloat16) (bf16 GEMMs with fp32
accumulation, the fp32 master weights kept; what `meshlm logprobs
--param-dtype bf16` computes), fp32 without autocast. One mode per process,
so that the peak RSS (ru_maxrss) is the mode's own.

One warm-up call, then --iters timed calls; prints one line

  torch-score mode=bf16 threads=2 tokens=8192 tokens_per_s=1234.5 call_s=6.63 cpu_s=13.1 peak_rss_mib=3210.0

with the median call's wall time and the mean CPU seconds of a call (the
process's user + system time over all its threads, time.process_time: the
work, less sensitive to other load than wall time, as bench_api_logprobs'
"CPU s per call"). Nothing is asserted.

usage: bench/score_peer.py --model DIR --data FILE [--seq-len 512] [--mode bf16|fp32]
         [--iters 3] [--threads T]
"""
import argparse
import os
import resource
import statistics
import sys
import time

from torch_peer import load_tokens


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--mode", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    a = p.parse_args()
    import torch
    import transformers
    torch.set_num_threads(a.threads)
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        a.model, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    ids = load_tokens(a.data, a.seq_len, 0, model.config.vocab_size, 0, torch)
    bf16 = a.mode == "bf16"

    def score():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids).logits[:, :-1]
        lp = torch.log_softmax(logits.float(), dim=-1)
        return lp.gather(-1, ids[:, 1:, None]).squeeze(-1)

    score()
    times = []
    c0 = time.process_time()
    for _ in range(a.iters):
        t0 = time.perf_counter()
        out = score()
        times.append(time.perf_counter() - t0)
    cpu = (time.process_time() - c0) / a.iters
    tokens = ids.numel()
    call = statistics.median(times)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(f"torch-score mode={a.mode} threads={a.threads} tokens={tokens} "
          f"tokens_per_s={tokens / call:.1f} call_s={call:.3f} cpu_s={cpu:.2f} mean_lp={float(out.mean()):.4f} "
          f"peak_rss_mib={rss:.1f}", flush=True)
    print(f"score_peer: torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
          f"transformers {transformers.__version__}", file=sys.stderr)


if __name__ == "__main__":
    main()
