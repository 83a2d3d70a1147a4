#!/usr/bin/env python3
"""gen_schedule_fixture.py - the expected learning rates of tests/unit/test_schedule.c.

PURPOSE
    Runs torch's LambdaLR with the transformers schedule functions that
    src/engine/schedule.h names as its reference, on a dummy parameter, and
    prints the learning rate the optimizer uses at each 0-based step k
    (param_groups[0]["lr"] before the k-th scheduler.step()) as the C table of
    test_schedule.c:
      constant: get_constant_schedule_with_warmup(W)
      cosine:   get_cosine_with_min_lr_schedule_with_warmup(W, N, min_lr=MIN)
      linear:   warmup k/max(1, W) (transformers' linear warmup), then
                get_wsd_schedule's linear decay (num_stable_steps=0,
                num_decay_steps=N - W, min_lr_ratio=MIN/LR)
    with N = T - 1 (the decay ends on the last step; see schedule.h).
    CI NEVER RUNS THIS SCRIPT; it needs `pip install torch transformers`.

USAGE
    python3 tools/gen_schedule_fixture.py > /tmp/table.c   # paste into the test
"""
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers.optimization import (_get_constant_schedule_with_warmup_lr_lambda,
                                       _get_cosine_schedule_with_warmup_lr_lambda,
                                       _get_linear_schedule_with_warmup_lr_lambda,
                                       _get_wsd_scheduler_lambda)

# (decay, lr, min_lr, warmup W, total T)
CASES = [
    ("constant", 1e-3, 0.0, 3, 10),
    ("linear", 1e-3, 1e-4, 3, 10),
    ("cosine", 1e-3, 1e-4, 3, 10),
    ("cosine", 2e-3, 0.0, 0, 6),
    ("linear", 5e-4, 0.0, 1, 5),
    ("linear", 1e-3, 1e-5, 4, 4),  # the warmup covers the whole run
    ("cosine", 3e-4, 3e-5, 0, 1),  # a single step
]


def linear_lambda(k, W, N, ratio):
    if k < W:
        return _get_linear_schedule_with_warmup_lr_lambda(k, num_warmup_steps=W, num_training_steps=N)
    return _get_wsd_scheduler_lambda(k, num_warmup_steps=W, num_stable_steps=0, num_decay_steps=N - W,
                                     warmup_type="linear", decay_type="linear", min_lr_ratio=ratio,
                                     num_cycles=0.5)


def lr_lambda(decay, lr, min_lr, W, T):
    N = T - 1
    if decay == "constant":
        return partial(_get_constant_schedule_with_warmup_lr_lambda, num_warmup_steps=W)
    if decay == "cosine":
        return partial(_get_cosine_schedule_with_warmup_lr_lambda, num_warmup_steps=W,
                       num_training_steps=N, num_cycles=0.5, min_lr_rate=min_lr / lr)
    return partial(linear_lambda, W=W, N=N, ratio=min_lr / lr)


def rates(decay, lr, min_lr, W, T):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = LambdaLR(opt, lr_lambda(decay, lr, min_lr, W, T))
    out = []
    for _ in range(T):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def main():
    print(f"    /* tools/gen_schedule_fixture.py, torch {torch.__version__} */")
    print("    /* clang-format off */")
    for decay, lr, min_lr, W, T in CASES:
        values = [f"{v:.17g}" for v in rates(decay, lr, min_lr, W, T)]
        rows = [", ".join(values[i:i + 3]) for i in range(0, len(values), 3)]
        print(f"    {{ML_LR_{decay.upper()}, {lr!r}, {min_lr!r}, {W}, {T},")
        print("     {" + ",\n      ".join(rows) + "}},")
    print("    /* clang-format on */")


if __name__ == "__main__":
    main()
