#!/usr/bin/env python3
"""torch's bf16 linear on a scoring GEMM shape, the peer of bench/onednn_packed_b.c.

y [M, N] = x [M, K] · W [N, K]^T with bf16 x and W (what torch.autocast runs for
a Linear on CPU: mkldnn/oneDNN bf16 matmul, bf16 output), median ms and GFLOP/s
of ITERS calls after a warm-up. Figures for notes; nothing asserted.

usage: bench/torch_linear_bf16.py M N K [ITERS]
"""
import statistics
import sys
import time

import torch


def main():
    M, N, K = (int(v) for v in sys.argv[1:4])
    iters = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    x = torch.rand(M, K).to(torch.bfloat16)
    w = torch.rand(N, K).to(torch.bfloat16)
    torch.nn.functional.linear(x, w)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        ts.append(1e3 * (time.perf_counter() - t0))
    ms = statistics.median(ts)
    print(f"torch {torch.__version__} bf16 linear {M}x{N}x{K}: {ms:.2f} ms "
          f"({2e-6 * M * N * K / ms:.1f} GFLOP/s), {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
