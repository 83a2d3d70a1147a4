"""PyTorch's attention on the shapes of bench/cuda_attention.c, for a side-by-side in one
run: torch.nn.functional.scaled_dot_product_attention(is_causal=True) in bf16 with
enable_gqa (k, v of nkv heads), whose CUDA path is FlashAttention-2 (the flash backend,
forced with sdpa_kernel where it accepts the shape), forward and backward. q, k, v, dout
random normal; 2 warm-ups, then the median of REPS timed calls (CUDA events). FLOPs
counted as bench/cuda_attention.c counts them (forward 4·B·S²·nh·hd / 2, backward 2.5×).
Prints one line per shape, in the format of bench_cuda_attention.
usage: python3 bench/attention_peer.py [--reps 10] B S nh nkv hd [B S nh nkv hd ...]"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, reps):
    times = []
    for i in range(reps + 2):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        if i >= 2:
            times.append(s.elapsed_time(e) * 1e-3)
    return statistics.median(times)


def run(B, S, nh, nkv, hd, reps, backend):
    dev, dt = "cuda", torch.bfloat16
    # [B, heads, S, hd] views of [B, S, heads, hd] tensors: meshlm's layout
    q = torch.randn(B, S, nh, hd, device=dev, dtype=dt).transpose(1, 2).requires_grad_()
    k = torch.randn(B, S, nkv, hd, device=dev, dtype=dt).transpose(1, 2).requires_grad_()
    v = torch.randn(B, S, nkv, hd, device=dev, dtype=dt).transpose(1, 2).requires_grad_()
    dout = torch.randn(B, nh, S, hd, device=dev, dtype=dt)
    with sdpa_kernel(backend):
        out = None

        def fwd():
            nonlocal out
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nh)

        def bwd():
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        tf = timed(fwd, reps)
        fwd()
        tb = timed(bwd, reps)
    f = 4.0 * B * S * S * nh * hd / 2
    print(f"attention torch-sdpa-{backend.name.lower()} bf16 B {B} S {S} heads {nh}/{nkv} hd {hd}: "
          f"forward {tf * 1e3:.3f} ms ({f / tf * 1e-12:.1f} TFLOP/s), backward {tb * 1e3:.3f} ms "
          f"({2.5 * f / tb * 1e-12:.1f} TFLOP/s); median of {reps} (torch {torch.__version__})",
          flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("shape", type=int, nargs="+")
    a = p.parse_args()
    if len(a.shape) % 5:
        p.error("shapes are groups of 5: B S nh nkv hd")
    for i in range(0, len(a.shape), 5):
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            try:
                run(*a.shape[i:i + 5], a.reps, backend)
            except RuntimeError as e:  # a backend that refuses the shape: say so, go on
                print(f"attention torch-sdpa-{backend.name.lower()}: {str(e).splitlines()[0]}")


if __name__ == "__main__":
    main()
