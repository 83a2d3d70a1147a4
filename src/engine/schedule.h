/* Learning-rate schedule: linear warmup from 0, then constant, linear or
 * cosine decay to min_lr, as a pure function of the 0-based optimizer step
 * (so a resumed run continues the schedule from its step count).
 *
 * With peak lr η, min_lr η_min, warmup W, total steps T and the last step
 * N = T − 1:
 *   step k < W:   η · k / W                           (warmup, 0 at step 0)
 *   constant:     η
 *   otherwise:    p = min(1, (k − W) / max(1, N − W))
 *                 linear:  η_min + (η − η_min) · (1 − p)
 *                 cosine:  η_min + (η − η_min) · ½ (1 + cos(π p))
 * Source: transformers.optimization — the warmup and the cosine are
 * get_cosine_with_min_lr_schedule_with_warmup(num_warmup_steps=W,
 * num_training_steps=N, min_lr=η_min), constant is
 * get_constant_schedule_with_warmup(W), linear is its warmup followed by
 * get_wsd_schedule's linear decay to min_lr_ratio (num_stable_steps=0,
 * num_decay_steps=N − W); the step k is the scheduler's last_epoch when
 * the optimizer takes its k-th step (LambdaLR stepped after each
 * optimizer.step()). One deliberate difference: transformers (and
 * Megatron's OptimizerParamScheduler) reach η_min one step after the last
 * when given num_training_steps = T; here the decay ends on the last step
 * itself (torchtitan adds a virtual step for the same reason, the other
 * way round), hence N = T − 1. tools/gen_schedule_fixture.py computes the
 * values of tests/unit/test_schedule.c with those torch schedulers. */
#ifndef ML_SCHEDULE_H
#define ML_SCHEDULE_H

#include <stdint.h>

typedef enum { ML_LR_CONSTANT, ML_LR_LINEAR, ML_LR_COSINE } ml_lr_decay;

typedef struct ml_lr_schedule {
  ml_lr_decay decay;
  double lr;            /* peak learning rate η */
  double min_lr;        /* η_min, reached on the last step (linear, cosine) */
  int64_t warmup_steps; /* W >= 0; 0 = start at η */
  int64_t total_steps;  /* T >= 1: steps of the whole run, resumed parts included */
} ml_lr_schedule;

/* The learning rate of 0-based optimizer step `step` (formula above); steps
 * past the last keep η_min (η for constant). */
double ml_lr_at(const ml_lr_schedule *s, int64_t step);

#endif
