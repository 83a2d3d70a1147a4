/* The settings of a training session that every front end maps onto — the
 * CLI's flags and --config keys (cli/train_flags.c), the library's
 * meshlm_options (api/session.c) — and their one set of defaults.
 *
 * README.md "Defaults" tabulates every setting with its flag, config key,
 * API field and both front ends' defaults; tests/unit/test_defaults_doc.c
 * checks that table against ml_train_defaults and the CLI's flags, so the
 * two cannot drift. Where the front ends differ (the peak learning rate,
 * AdamW's weight decay, the schedule's length) the CLI's serve a run
 * from the command line (a short run on a small model: a larger lr, no
 * decay, 10 steps) and the library's the RL fine-tuning of a trained policy
 * (a small lr, decoupled weight decay, steps counted by the caller). */
#ifndef ML_SETTINGS_H
#define ML_SETTINGS_H

#include "engine/engine.h"
#include "engine/step.h"

typedef struct ml_train_settings {
  ml_engine_opts engine; /* plan, SP, FSDP2 (dtypes, reshard, ZeRO, prefetch), AC */
  ml_step_opts step;     /* AdamW, the LR schedule, clipping and its norm */
} ml_train_settings;

/* Whose defaults: the CLI's (meshlm train) or the library's (meshlm_open). */
typedef enum { ML_DEFAULTS_CLI, ML_DEFAULTS_API } ml_defaults_for;

/* The defaults, the same for both but where said: engine
 * ml_engine_opts_default (plan auto, no SP, fp32, FSDP2's reshard policy,
 * ZeRO-3, prefetch 1/2, no CPU offload, no AC; the batch-invariant mode off; no frozen
 * parameters; LoRA off, PEFT's lora_alpha 8 and all-linear targets when on); AdamW betas (0.9, 0.999), eps 1e-8;
 * constant schedule without warmup, min_lr 0; clipping at 1.0 in the L2
 * norm; the CLI lr 3e-4, weight decay 0 over 10 steps (--steps), the
 * library lr 1e-5, weight decay 0.01 over total_steps 1. */
ml_train_settings ml_train_defaults(ml_defaults_for who);

#endif
