/* Per-step training metrics: a human progress line, a JSONL log, peak
 * memory and model FLOPs utilisation (MFU). */
#ifndef ML_METRICS_H
#define ML_METRICS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "backend/backend.h"

typedef struct ml_step_metrics {
  int64_t step;        /* optimizer step (meshlm train counts from 1) */
  double loss;         /* mean token cross-entropy over the global batch (nats) */
  double grad_norm;    /* global L2 norm of the grads before clipping */
  double lr;           /* learning rate used by this step */
  int64_t tokens;      /* target tokens in the global batch of this step */
  double tokens_per_s; /* global tokens (all ranks) per wall-clock second */
  double mfu;          /* fraction of peak_tflops in [0, 1] (ml_mfu); printed as %; 0 = unknown */
  double peak_tflops;  /* the peak MFU is taken against, TFLOP/s of the whole mesh; 0 = unknown */
  bool peak_measured;  /* peak_tflops was measured at start-up (ml_gemm_flops_per_s), not given */
  double peak_rss_mib_min, peak_rss_mib_max; /* peak resident set over the ranks, MiB
                                                (ml_peak_rss_mib of each rank) */
  double device_peak_mib; /* the largest rank's device pool peak since start, MiB
                             (ml_be_memory_stats: torch.cuda.max_memory_allocated) */
  bool skipped;        /* the optimizer step was skipped: a non-finite gradient */
  double fsdp_wait_ms; /* time blocked on FSDP collectives (dp_shard, dp_replicate), max over ranks */
  int64_t minor_faults; /* minor page faults of the step (ml_minor_faults before and after),
                           max over ranks: pages the step touched afresh; 0 in a steady state
                           whose buffers the pools keep */
  double time_s;       /* seconds since the run started (the command's start on world rank 0) */
  double eta_s;        /* seconds to the last step: the mean step time of this run so far
                          times the steps left */
} ml_step_metrics;

/* Write one progress line (newline-terminated) to f, e.g.
 * "step 12 | loss 3.4567 | grad_norm 1.234 | lr 3.00e-04 | tok/s 1234.5 |
 *  mfu 1.23% of measured peak | peak_rss 345.6 MiB | elapsed 1m23s eta 4m10s"
 * (on one line): the MFU says what it is against ("of measured peak", "of
 * --peak-tflops", or "mfu n/a" when the peak is unknown); peak_rss is the
 * largest rank's, followed by " (min M)" when the smallest rank's differs;
 * elapsed is time_s and eta eta_s (below 10 s with a decimal, "3.2s"; then
 * whole seconds, "42s", "1m23s", "2h05m09s"); then " | skipped" for a
 * skipped step. */
void ml_metrics_print(FILE *f, const ml_step_metrics *m);

typedef struct ml_metrics_writer {
  FILE *f;
  char *path; /* for messages */
} ml_metrics_writer;

/* Create (truncate) the JSONL metrics file `path`. Error: cannot open. */
int ml_metrics_open(const char *path, ml_metrics_writer *w);

/* Append one line: a JSON object with exactly the keys step, loss,
 * grad_norm, lr, tokens, tokens_per_s, mfu, peak_tflops, peak_measured,
 * peak_rss_mib_min, peak_rss_mib_max, device_peak_mib, skipped, fsdp_wait_ms,
 * minor_faults, time (in that order; the integers as JSON integers, the flags as booleans, the rest as
 * reals written with round-trip precision, a non-finite value — e.g. a
 * diverged loss — and mfu/peak_tflops when the peak is unknown as null),
 * then flush. Error: write failure (the message names the file). */
int ml_metrics_write(ml_metrics_writer *w, const ml_step_metrics *m);

/* Append one eval line (train --eval-data): {"step": K, "eval_loss": X,
 * "eval_tokens": T} (K and T JSON integers, X a real with round-trip
 * precision, null when not finite), then flush. Error: write failure (the
 * message names the file). */
int ml_metrics_write_eval(ml_metrics_writer *w, int64_t step, double loss, int64_t tokens);

/* Close the file (safe on a writer that failed to open or is closed). */
void ml_metrics_close(ml_metrics_writer *w);

/* Peak resident set size of this process in MiB (2^20 bytes):
 * getrusage(RUSAGE_SELF) ru_maxrss (KiB on Linux) / 1024. 0 when getrusage
 * fails. */
double ml_peak_rss_mib(void);

/* Minor page faults of this process so far: getrusage(RUSAGE_SELF)
 * ru_minflt (pages mapped on first touch, e.g. memory freshly taken from the
 * system). 0 when getrusage fails. */
int64_t ml_minor_faults(void);

/* This process's sustained GEMM rate in FLOP/s, for MFU when the hardware
 * peak is not given: the model's own matrix product (ml_be_gemm on `be`,
 * operands in `dtype`, F32 or BF16 — the compute dtype of the run, so a
 * bf16 run's MFU is against the bf16 matrix units) on [1024, 1024]
 * operands, 2·1024³ FLOP a call, repeated for `seconds` after one warm-up
 * call. Run it on every rank at once (after a barrier) and sum: ranks that
 * share cores then share them here too, so the sum is what the machine
 * delivers. Returns 0 when it cannot run (peak unknown; no error left
 * recorded). */
double ml_gemm_flops_per_s(ml_backend *be, ml_dtype dtype, double seconds);

/* Training FLOPs per token, 6·N + 12·L·H·S: PaLM (Chowdhery et al. 2022)
 * appendix B — 6N for the dense matmuls forward + backward, 12·L·H·S for
 * attention scores and values (ARCHITECTURE.md §10). n_params N: the parameter
 * count the caller chooses to charge (PaLM counts non-embedding params),
 * n_layers L, hidden H (= heads · head_dim), seq_len S in tokens. */
double ml_flops_per_token(double n_params, int64_t n_layers, int64_t hidden, int64_t seq_len);

/* Model FLOPs utilisation as a fraction: flops_per_token · tokens_per_s /
 * peak_flops (peak in FLOP/s of the hardware the tokens were processed on;
 * for a global tokens/s use the sum of all devices' peaks). 0 when
 * peak_flops <= 0 (unknown peak). */
double ml_mfu(double flops_per_token, double tokens_per_s, double peak_flops);

#endif
