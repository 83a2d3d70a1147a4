"""The rate a large bf16 GEMM reaches on this device through PyTorch (cuBLAS
on a GPU, oneDNN/MKL on a CPU): the measured ceiling MFU figures are read
against besides the datasheet's (issue 29). N×N×N products on random normal
data (never zeros: METHOD.md), 3 warm-ups, then the median of REPS timed
products (CUDA events on a GPU, perf_counter on a CPU); prints one line.
usage: python3 bench/gemm_peak.py [--n 8192] [--reps 20] [--device cuda|cpu]"""
import argparse
import statistics
import time

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    a_ = torch.randn(a.n, a.n, device=a.device, dtype=torch.bfloat16)
    b_ = torch.randn_like(a_)
    for _ in range(3):
        a_ @ b_
    times = []
    for _ in range(a.reps):
        if a.device == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            a_ @ b_
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e-3)
        else:
            t0 = time.perf_counter()
            a_ @ b_
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"gemm_peak: bf16 {a.n}^3 on {name}: median {2 * a.n**3 / t / 1e12:.1f} TFLOP/s "
          f"({a.reps} products; torch {torch.__version__})")


if __name__ == "__main__":
    main()
