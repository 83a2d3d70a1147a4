/* meshlm train's settings: the flag table, the config-file keys (NeMo RL's
 * dtensor_cfg names where it has one, else the flag name with '-' → '_'),
 * the checks of values and combinations, and their mapping onto the
 * engine's options, the LR schedule and the grad norm type. Kept apart from
 * the training loop (cmd_train.c) and free of MPI so that unit tests parse
 * exactly what the CLI parses. */
#ifndef ML_TRAIN_FLAGS_H
#define ML_TRAIN_FLAGS_H

#include <stdbool.h>
#include <stdint.h>

#include "cli/args.h"
#include "cli/config_file.h"
#include "data/data.h"
#include "engine/engine.h"
#include "engine/settings.h"

typedef struct ml_train_opts {
  /* model, data, mesh and plan */
  const char *model, *data, *plan, *config;
  ml_arg_choice device, device_comm; /* cli/device.h */
  int64_t tp, dp_replicate, cp;
  int64_t ep; /* --ep: expert-parallel size of the MoE layers (parallel/ep.h) */
  bool sp;
  /* data formats (data/data.h): the record keys (tokenizer_dir is --model,
     packing and assistant_only_loss from the choices below), --packing
     true|false and --assistant-only-loss true|false */
  ml_data_opts data_keys;
  ml_arg_choice packing, assistant_only;
  /* FSDP2 and activation checkpointing (the choices are mapped onto the
     engine's enums by ml_train_engine_opts) */
  ml_arg_choice param_dtype, reduce_dtype, output_dtype, reshard, ac;
  int64_t zero, prefetch_forward, prefetch_backward;
  bool cpu_offload;
  /* the loop */
  int64_t steps, batch, grad_accum, seq_len, seed;
  /* AdamW, schedule, clipping: the flags' values in `step` (lr, min_lr, warmup, betas, eps,
     weight decay, max norm); its schedule's decay and total_steps and its norm_type are
     set from lr_schedule, steps and grad_norm_type by ml_train_settings_of */
  ml_step_opts step;
  ml_arg_choice lr_schedule, grad_norm_type;
  /* outputs */
  double peak_tflops; /* of the whole mesh; 0 = measured at start-up (ml_gemm_flops_per_s) */
  const char *metrics, *save, *resume, *export_hf;
  ml_arg_choice export_dtype; /* of --export-hf: ckpt/hf_export.h's ml_export_dtype, by index */
  int64_t save_every;
  /* held-out evaluation: --eval-data FILE's mean NLL every --eval-every steps (0: only after
     the last) */
  const char *eval_data;
  int64_t eval_every;
  bool batch_invariant; /* --batch-invariant: ml_engine_opts.batch_invariant */
  const char *freeze;   /* --freeze: ml_engine_opts.freeze (comma-separated fnmatch patterns) */
  /* LoRA (engine/lora.h): --lora-rank, --lora-alpha, --lora-dropout, --lora-targets,
     --lora-rslora, --adapter onto ml_engine_opts.lora (its seed: --seed) */
  int64_t lora_rank;
  double lora_alpha, lora_dropout;
  const char *lora_targets, *adapter;
  bool lora_rslora;
  bool merge_lora; /* --merge-lora: --export-hf writes the merged weights (ckpt/lora_export.h) */
  const char *fp32_params; /* --fp32-params: ml_engine_opts.fp32_params (fnmatch patterns) */
} ml_train_opts;

/* Capacity of a spec array for ml_train_flags. */
enum { ML_TRAIN_MAX_FLAGS = 64 };

/* The record-key flags train and logprobs share (--text-key, --prompt-key,
 * --completion-key) over d's keys, into spec[0..3); returns 3. */
size_t ml_data_key_flags(ml_data_opts *d, ml_arg *spec);

/* The defaults: the engine's and the step's of the CLI (engine/settings.h
 * ml_train_defaults(ML_DEFAULTS_CLI): fp32, FSDP2's reshard policy,
 * ZeRO-3, prefetch 1/2, no AC, 10 steps, AdamW lr 3e-4 constant, clip at
 * 1.0 (L2)), then one rank's mesh, batch 8 × 128 tokens, no accumulation,
 * MFU against a measured GEMM rate; record keys text / prompt /
 * completion, text records packed. */
ml_train_opts ml_train_opts_default(void);

/* ml_train_opts_default with the engine's and the step's settings of d
 * instead of the CLI's (README's "Defaults" test reads the library's
 * column through it). */
ml_train_opts ml_train_opts_with(const ml_train_settings *d);

/* Fill spec[0..) with the flags over `o` (dst pointers into it); returns
 * their number (<= ML_TRAIN_MAX_FLAGS). */
size_t ml_train_flags(ml_train_opts *o, ml_arg *spec);

/* The argument vector to parse against spec: the tokens of the config file
 * named by the last --config in argv (none without it), then argv itself,
 * so the command line overrides the file (config_file.h). Errors: those of
 * ml_config_argv_build. Free out with ml_config_argv_free. */
int ml_train_argv(int argc, char **argv, const ml_arg *spec, size_t n, ml_config_argv *out);

/* Values and combinations a single flag's type cannot check: ranges
 * (--steps >= 0, --zero 1..3, --cp >= 1, ...), --batch-size not divisible by
 * --grad-accum, --save-every without --save, --eval-every without
 * --eval-data, --batch-size x --seq-len
 * beyond int64. One message naming the flag, the value found and what is
 * expected. (--seq-len against the model's max_position_embeddings:
 * ml_model_config_check_seq_len, once the model is read.) */
int ml_train_opts_check(const ml_train_opts *o);

/* Allocate one micro-batch's buffers (activations, residual stream) up
 * front, on a mesh of dp data-parallel ranks, so that a batch too large for
 * memory fails before the first step where every rank agrees on it; the
 * out-of-memory message names the flags that sized the buffer: "... (4
 * sequences per rank (--batch-size 8 / (2 data-parallel ranks x
 * --grad-accum 1)) x --seq-len 4096; hidden_size ...)". Call after
 * ml_train_opts_check (the product fits) and the --batch-size divisibility
 * check. Errors: allocation (ml_engine_reserve). */
int ml_train_reserve(ml_engine *e, const ml_train_opts *o, int dp);
/* How messages name the micro-batch, in the flags' terms (the text quoted
 * above), into buf[cap]. */
void ml_train_batch_words(const ml_train_opts *o, int dp, char *buf, size_t cap);

/* The data options the flags select: the keys, --packing, and the --model
 * directory as the tokenizer's. */
ml_data_opts ml_train_data_opts(const ml_train_opts *o);

/* The engine's and the step's settings the flags select (the LR schedule
 * over the run's --steps, the norm type 2.0 or INFINITY): the CLI's one
 * mapping onto the engine. */
ml_train_settings ml_train_settings_of(const ml_train_opts *o);

/* --fp32-params's help text: one for train, plan and logprobs. */
extern const char ml_fp32_params_help[];
/* Say on stdout, as "CMD: N parameter tensors (E elements) kept in fp32
 * under bf16 (the MoE routers, --fp32-params PATTERNS): all-gathered and
 * computed in fp32", the parameters e keeps in fp32 under param_dtype bf16
 * (engine/fp32_params.h; patterns: the flag's value, NULL: not given);
 * nothing when there are none or param_dtype is fp32. */
void ml_print_fp32_params(const char *cmd, const ml_engine *e, const char *patterns);

/* The choice of a dtype flag (--param-dtype, ...): "fp32" (the default) or
 * "bf16", and the ml_dtype a parsed one stands for. */
ml_arg_choice ml_dtype_choice(void);
ml_dtype ml_dtype_chosen(const ml_arg_choice *c);

#endif
