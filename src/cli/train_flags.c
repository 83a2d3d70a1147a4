#include "cli/train_flags.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>

#include "cli/cli.h"
#include "cli/device.h"
#include "common/checked.h"
#include "common/lookup.h"
#include "common/status.h"
#include "engine/fp32_params.h"
#include "ckpt/hf_export.h"

/* The choices of the enumerated flags and the values they stand for (same
 * order). */
static const char *const k_dtypes[] = {"fp32", "bf16", NULL};
static const ml_dtype k_dtype_values[] = {ML_F32, ML_BF16};
static const char *const k_reshard[] = {"default", "true", "false", NULL};
static const ml_reshard_policy k_reshard_values[] = {ML_RESHARD_DEFAULT, ML_RESHARD_ALWAYS,
                                                     ML_RESHARD_NEVER};
static const char *const k_ac[] = {"none", "mlp", "layer", "selective", NULL};
static const ml_ac_mode k_ac_values[] = {ML_AC_NONE, ML_AC_MLP, ML_AC_LAYER, ML_AC_SELECTIVE};
static const char *const k_schedules[] = {"constant", "linear", "cosine", NULL};
static const ml_lr_decay k_schedule_values[] = {ML_LR_CONSTANT, ML_LR_LINEAR, ML_LR_COSINE};
static const char *const k_norm_types[] = {"2", "inf", NULL};
static const double k_norm_values[] = {2.0, INFINITY};
static const char *const k_true_false[] = {"true", "false", NULL};

/* Config keys that are not the flag's own name: NeMo RL's dtensor_cfg
 * names (sequence_parallel and cpu_offload already are), and JSON booleans
 * for activation checkpointing as NeMo writes them. */
static const ml_config_alias k_aliases[] = {
    {"tensor_parallel_size", "--tp", NULL, NULL, false},
    {"dp_replicate_size", "--dp-replicate", NULL, NULL, false},
    {"context_parallel_size", "--cp", NULL, NULL, false},
    {"ep_size", "--ep", NULL, NULL, false},
    {"custom_parallel_plan", "--parallel-plan", NULL, NULL, false},
    {"activation_checkpointing", "--activation-checkpointing", "layer", "none", false},
    {"packing", "--packing", "true", "false", false},
    {"assistant_only_loss", "--assistant-only-loss", "true", "false", false},
    {"freeze", "--freeze", NULL, NULL, true},
    {"fp32_params", "--fp32-params", NULL, NULL, true},
    {"lora_targets", "--lora-targets", NULL, NULL, true},
    {"lora_use_rslora", "--lora-rslora", NULL, NULL, false},
};

const char ml_fp32_params_help[] =
    "keep the parameters whose HF names match these comma-separated fnmatch patterns in fp32 "
    "under --param-dtype bf16: fp32 all-gather and GEMMs, as every MoE router";

void ml_print_fp32_params(const char *cmd, const ml_engine *e, const char *patterns) {
  int n32;
  int64_t numel32;
  ml_fp32_params_count(&e->model, &n32, &numel32);
  if (n32 && e->opts.fsdp.param_dtype == ML_BF16)
    ml_cli_print("%s: %d parameter tensors (%lld elements) kept in fp32 under bf16 (the MoE "
                 "routers%s%s): all-gathered and computed in fp32\n",
                 cmd, n32, (long long)numel32, patterns ? ", --fp32-params " : "",
                 patterns ? patterns : "");
}

ml_arg_choice ml_dtype_choice(void) { return (ml_arg_choice){k_dtypes, 0}; }
ml_dtype ml_dtype_chosen(const ml_arg_choice *c) { return k_dtype_values[c->index]; }

ml_train_opts ml_train_opts_with(const ml_train_settings *d) {
  const ml_fsdp_opts *f = &d->engine.fsdp;
  return (ml_train_opts){
      .device = ml_device_choice(),
      .device_comm = ml_device_comm_choice(),
      .tp = 1,
      .dp_replicate = 1,
      .cp = 1,
      .ep = 1,
      .plan = d->engine.parallel_plan,
      .sp = d->engine.sequence_parallel,
      .data_keys = ml_data_opts_default(NULL),
      .packing = {k_true_false, 0},
      .assistant_only = {k_true_false, 0},
      .param_dtype = {k_dtypes, ML_INDEX_OF(k_dtype_values, f->param_dtype)},
      .reduce_dtype = {k_dtypes, ML_INDEX_OF(k_dtype_values, f->reduce_dtype)},
      .output_dtype = {k_dtypes, ML_INDEX_OF(k_dtype_values, d->engine.output_dtype)},
      .reshard = {k_reshard, ML_INDEX_OF(k_reshard_values, f->reshard_after_forward)},
      .ac = {k_ac, ML_INDEX_OF(k_ac_values, d->engine.ac)},
      .zero = f->zero,
      .prefetch_forward = f->prefetch_forward,
      .prefetch_backward = f->prefetch_backward,
      .cpu_offload = f->cpu_offload,
      .steps = d->step.schedule.total_steps,
      .batch = 8,
      .grad_accum = 1,
      .seq_len = 128,
      .step = d->step,
      .lr_schedule = {k_schedules, ML_INDEX_OF(k_schedule_values, d->step.schedule.decay)},
      .grad_norm_type = {k_norm_types, ML_INDEX_OF(k_norm_values, d->step.norm_type)},
      .export_dtype = {ml_export_dtype_names, ML_EXPORT_DTYPE_SOURCE},
      .peak_tflops = 0,
      .batch_invariant = d->engine.batch_invariant,
      .freeze = d->engine.freeze,
      .lora_rank = d->engine.lora.rank,
      .lora_alpha = d->engine.lora.alpha,
      .lora_dropout = d->engine.lora.dropout,
      .lora_targets = d->engine.lora.targets,
      .lora_rslora = d->engine.lora.rslora,
      .adapter = d->engine.lora.adapter,
      .fp32_params = d->engine.fp32_params};
}

ml_train_opts ml_train_opts_default(void) {
  ml_train_settings d = ml_train_defaults(ML_DEFAULTS_CLI);
  return ml_train_opts_with(&d);
}

size_t ml_data_key_flags(ml_data_opts *d, ml_arg *spec) {
  spec[0] = (ml_arg){"--text-key", ML_ARG_STR, &d->text_key, "JSONL field of a text record",
                     false, "KEY"};
  spec[1] = (ml_arg){"--prompt-key", ML_ARG_STR, &d->prompt_key,
                     "JSONL field of a prompt/completion record's prompt", false, "KEY"};
  spec[2] = (ml_arg){"--completion-key", ML_ARG_STR, &d->completion_key,
                     "JSONL field of its completion (train: the only targets)", false, "KEY"};
  return 3;
}

size_t ml_train_flags(ml_train_opts *o, ml_arg *spec) {
  const ml_arg flags[] = {
      {"--model", ML_ARG_STR, &o->model, "HF checkpoint directory (config.json + safetensors)",
       true, "DIR"},
      {"--data", ML_ARG_STR, &o->data,
       "JSONL records: input_ids [+ loss_mask], text, prompt + completion, or messages "
       "(chat); or raw text", true,
       "FILE"},
      {"--config", ML_ARG_STR, &o->config,
       "JSON file with any of these settings (flags override it)", false, "FILE.json"},
      /* mesh and plan */
      {"--tp", ML_ARG_INT, &o->tp, "tensor-parallel size", false, NULL},
      {"--dp-replicate", ML_ARG_INT, &o->dp_replicate,
       "HSDP replicas (dp_shard = world / (dp_replicate*cp*tp))", false, NULL},
      {"--cp", ML_ARG_INT, &o->cp,
       "context-parallel size: ring attention over cp ranks sharing each sequence", false, NULL},
      {"--ep", ML_ARG_INT, &o->ep,
       "expert-parallel size: the MoE experts split over ep ranks, tokens sent by all-to-all",
       false, NULL},
      {"--sequence-parallel", ML_ARG_FLAG, &o->sp, "shard norms and residuals on the sequence",
       false, NULL},
      {"--parallel-plan", ML_ARG_STR, &o->plan, "plan file (JSON), or auto|optimized|hf|default",
       false, "PLAN"},
      {"--device", ML_ARG_CHOICE, &o->device, ml_device_help(), false, NULL},
      {"--device-comm", ML_ARG_CHOICE, &o->device_comm, ml_device_comm_help(), false, NULL},
      /* FSDP2 */
      {"--param-dtype", ML_ARG_CHOICE, &o->param_dtype, "parameter all-gather and compute dtype",
       false, NULL},
      {"--reduce-dtype", ML_ARG_CHOICE, &o->reduce_dtype, "gradient reduce-scatter dtype", false,
       NULL},
      {"--output-dtype", ML_ARG_CHOICE, &o->output_dtype, "logits dtype", false, NULL},
      {"--reshard-after-forward", ML_ARG_CHOICE, &o->reshard, "free gathered params after forward",
       false, NULL},
      {"--zero", ML_ARG_INT, &o->zero,
       "ZeRO stage: 3 params+grads+state sharded, 2 grads+state, 1 state", false, NULL},
      {"--prefetch-forward", ML_ARG_INT, &o->prefetch_forward,
       "units all-gathered ahead in forward (0 = off)", false, NULL},
      {"--prefetch-backward", ML_ARG_INT, &o->prefetch_backward,
       "units all-gathered ahead in backward (0 = off)", false, NULL},
      {"--activation-checkpointing", ML_ARG_CHOICE, &o->ac, "recompute in backward", false, NULL},
      {"--cpu-offload", ML_ARG_FLAG, &o->cpu_offload,
       "FSDP shards, their grads and AdamW state in host memory; optimizer step on the host",
       false, NULL},
      {"--batch-invariant", ML_ARG_FLAG, &o->batch_invariant,
       "every token's log-prob the same bits in any batch, packing, micro-batch, dp, cp or tp "
       "size",
       false, NULL},
      {"--freeze", ML_ARG_STR, &o->freeze,
       "freeze the parameters whose HF names match these comma-separated fnmatch patterns "
       "(requires_grad=False)",
       false, "PATTERNS"},
      {"--fp32-params", ML_ARG_STR, &o->fp32_params, ml_fp32_params_help, false, "PATTERNS"},
      /* LoRA (PEFT's LoraConfig) */
      {"--lora-rank", ML_ARG_INT, &o->lora_rank,
       "LoRA rank r: train rank-r adapters on --lora-targets, every base weight frozen (0 = off)",
       false, NULL},
      {"--lora-alpha", ML_ARG_FLOAT, &o->lora_alpha, "LoRA alpha: scaling alpha / r", false, NULL},
      {"--lora-dropout", ML_ARG_FLOAT, &o->lora_dropout,
       "LoRA dropout on the adapters' input, in [0, 1)", false, NULL},
      {"--lora-targets", ML_ARG_STR, &o->lora_targets,
       "comma-separated linear module names (q_proj,v_proj,...) or all-linear", false, "NAMES"},
      {"--lora-rslora", ML_ARG_FLAG, &o->lora_rslora, "rank-stabilized scaling alpha / sqrt(r)",
       false, NULL},
      {"--adapter", ML_ARG_STR, &o->adapter,
       "start from this PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)",
       false, "DIR"},
      /* the loop */
      {"--steps", ML_ARG_INT, &o->steps, "optimizer steps of the whole run", false, NULL},
      {"--batch-size", ML_ARG_INT, &o->batch, "global batch in sequences (per optimizer step)",
       false, NULL},
      {"--grad-accum", ML_ARG_INT, &o->grad_accum, "micro-batches per step (gradient accumulation)",
       false, NULL},
      {"--seq-len", ML_ARG_INT, &o->seq_len, "tokens per sequence", false, NULL},
      {"--seed", ML_ARG_INT, &o->seed, "seed of the data order", false, NULL},
      /* optimizer */
      {"--lr", ML_ARG_FLOAT, &o->step.schedule.lr, "peak AdamW learning rate", false, NULL},
      {"--lr-schedule", ML_ARG_CHOICE, &o->lr_schedule, "decay after the warmup, to --min-lr",
       false, NULL},
      {"--warmup-steps", ML_ARG_INT, &o->step.schedule.warmup_steps,
       "linear warmup from 0 over this many steps", false, NULL},
      {"--min-lr", ML_ARG_FLOAT, &o->step.schedule.min_lr,
       "learning rate of the last step (linear, cosine)", false, NULL},
      {"--beta1", ML_ARG_FLOAT, &o->step.beta1, "AdamW beta1 (first moment's decay)", false, NULL},
      {"--beta2", ML_ARG_FLOAT, &o->step.beta2, "AdamW beta2 (second moment's decay)", false, NULL},
      {"--eps", ML_ARG_FLOAT, &o->step.eps, "AdamW eps (added to the denominator)", false, NULL},
      {"--weight-decay", ML_ARG_FLOAT, &o->step.weight_decay, "AdamW decoupled weight decay",
       false, NULL},
      {"--max-grad-norm", ML_ARG_FLOAT, &o->step.max_grad_norm,
       "clip the global grad norm (0 = off)", false, NULL},
      {"--grad-norm-type", ML_ARG_CHOICE, &o->grad_norm_type, "norm of --max-grad-norm", false,
       NULL},
      /* outputs */
      {"--peak-tflops", ML_ARG_FLOAT, &o->peak_tflops,
       "peak TFLOP/s of the whole mesh, for MFU (0 = measure a GEMM at start-up)", false, NULL},
      {"--metrics", ML_ARG_STR, &o->metrics, "write one JSON object per step to this file", false,
       "FILE"},
      {"--save", ML_ARG_STR, &o->save, "sharded run checkpoint directory (resumable)", false,
       "DIR"},
      {"--save-every", ML_ARG_INT, &o->save_every, "save every N steps (0 = only after the last)",
       false, NULL},
      {"--resume", ML_ARG_STR, &o->resume, "continue from the run checkpoint in this directory",
       false, "DIR"},
      {"--export-hf", ML_ARG_STR, &o->export_hf,
       "write a consolidated HF checkpoint here at the end", false, "DIR"},
      {"--merge-lora", ML_ARG_FLAG, &o->merge_lora,
       "LoRA: --export-hf writes the base weights with the adapters merged (W + scaling*B*A), "
       "not a PEFT adapter",
       false, NULL},
      {"--export-dtype", ML_ARG_CHOICE, &o->export_dtype,
       "dtype of --export-hf's trained tensors (source: each as in --model)", false, NULL},
      /* held-out evaluation */
      {"--eval-data", ML_ARG_STR, &o->eval_data,
       "held-out records (--data's formats): their mean NLL, no gradient", false, "FILE"},
      {"--eval-every", ML_ARG_INT, &o->eval_every,
       "evaluate --eval-data every N steps (0 = only after the last)", false, NULL},
  };
  size_t n = sizeof flags / sizeof flags[0];
  _Static_assert(sizeof flags / sizeof flags[0] + 5 <= ML_TRAIN_MAX_FLAGS,
                 "raise ML_TRAIN_MAX_FLAGS");
  for (size_t i = 0; i < n; i++) spec[i] = flags[i];
  n += ml_data_key_flags(&o->data_keys, spec + n);
  spec[n++] = (ml_arg){"--packing", ML_ARG_CHOICE, &o->packing,
                       "text records: pack documents into --seq-len windows (false: one per row, "
                       "padded)",
                       false, NULL};
  spec[n++] = (ml_arg){"--assistant-only-loss", ML_ARG_CHOICE, &o->assistant_only,
                       "messages records: targets are the assistant turns only, as TRL's "
                       "assistant_only_loss (false: every token)",
                       false, NULL};
  return n;
}

int ml_train_argv(int argc, char **argv, const ml_arg *spec, size_t n, ml_config_argv *out) {
  return ml_config_argv_build(ml_args_value(argc, argv, "--config"), spec, n, k_aliases,
                              sizeof k_aliases / sizeof k_aliases[0], "--config", argc, argv, out);
}

/* An integer flag's allowed range [min, max]. */
typedef struct int_range {
  const char *flag;
  int64_t value, min, max;
} int_range;

static int check_ranges(const int_range *r, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (r[i].value >= r[i].min && r[i].value <= r[i].max) continue;
    if (r[i].max == INT64_MAX)
      return ml_err("train: flag %s: expected an integer >= %" PRId64 ", found %" PRId64, r[i].flag,
                    r[i].min, r[i].value);
    return ml_err("train: flag %s: expected an integer in [%" PRId64 ", %" PRId64
                  "], found %" PRId64,
                  r[i].flag, r[i].min, r[i].max, r[i].value);
  }
  return 0;
}

static int check_nonnegative(const char *flag, double v) {
  if (v >= 0) return 0;
  return ml_err("train: flag %s: expected a number >= 0, found %g", flag, v);
}

static int check_beta(const char *flag, double v) {
  if (v >= 0 && v < 1) return 0;
  return ml_err("train: flag %s: expected a number in [0, 1), found %g", flag, v);
}

int ml_train_opts_check(const ml_train_opts *o) {
  const int_range ranges[] = {
      {"--tp", o->tp, 1, INT32_MAX},
      {"--dp-replicate", o->dp_replicate, 1, INT32_MAX},
      {"--cp", o->cp, 1, INT32_MAX},
      {"--ep", o->ep, 1, INT32_MAX},
      {"--zero", o->zero, 1, 3},
      {"--prefetch-forward", o->prefetch_forward, 0, INT32_MAX},
      {"--prefetch-backward", o->prefetch_backward, 0, INT32_MAX},
      {"--steps", o->steps, 0, INT64_MAX},
      {"--batch-size", o->batch, 1, INT64_MAX},
      {"--grad-accum", o->grad_accum, 1, INT64_MAX},
      {"--seq-len", o->seq_len, 2, INT64_MAX},
      {"--warmup-steps", o->step.schedule.warmup_steps, 0, INT64_MAX},
      {"--save-every", o->save_every, 0, INT64_MAX},
      {"--eval-every", o->eval_every, 0, INT64_MAX},
  };
  ML_TRY(check_ranges(ranges, sizeof ranges / sizeof ranges[0]));
  ML_TRY(check_nonnegative("--lr", o->step.schedule.lr));
  ML_TRY(check_nonnegative("--min-lr", o->step.schedule.min_lr));
  ML_TRY(check_nonnegative("--weight-decay", o->step.weight_decay));
  ML_TRY(check_nonnegative("--max-grad-norm", o->step.max_grad_norm));
  ML_TRY(check_beta("--beta1", o->step.beta1));
  ML_TRY(check_beta("--beta2", o->step.beta2));
  if (!(o->step.eps > 0))
    return ml_err("train: flag --eps: expected a number > 0, found %g", o->step.eps);
  ML_TRY(check_nonnegative("--peak-tflops", o->peak_tflops));
  if (o->batch % o->grad_accum != 0)
    return ml_err("train: flag --batch-size %" PRId64 " is not divisible by --grad-accum %" PRId64
                  "; expected a multiple of it",
                  o->batch, o->grad_accum);
  if (o->save_every > 0 && !o->save)
    return ml_err("train: flag --save-every %" PRId64 " needs --save DIR", o->save_every);
  if (o->eval_every > 0 && !o->eval_data)
    return ml_err("train: flag --eval-every %" PRId64 " needs --eval-data FILE", o->eval_every);
  int64_t tokens;
  if (ml_mul_i64(o->batch, o->seq_len, &tokens))
    return ml_err("train: flags --batch-size %" PRId64 " x --seq-len %" PRId64
                  ": the tokens per step overflow a 64-bit count; expected a product below 2^63",
                  o->batch, o->seq_len);
  return 0;
}

void ml_train_batch_words(const ml_train_opts *o, int dp, char *buf, size_t cap) {
  int64_t local = o->batch / (o->grad_accum * dp);
  snprintf(buf, cap,
           "%" PRId64 " sequence%s per rank (--batch-size %" PRId64 " / (%d data-parallel rank%s x "
           "--grad-accum %" PRId64 ")) x --seq-len %" PRId64,
           local, local == 1 ? "" : "s", o->batch, dp, dp == 1 ? "" : "s", o->grad_accum,
           o->seq_len);
}

int ml_train_reserve(ml_engine *e, const ml_train_opts *o, int dp) {
  char what[192];
  ml_train_batch_words(o, dp, what, sizeof what);
  return ml_engine_reserve(e, o->batch / (o->grad_accum * dp), o->seq_len, false, what);
}

ml_data_opts ml_train_data_opts(const ml_train_opts *o) {
  ml_data_opts d = o->data_keys;
  d.tokenizer_dir = o->model;
  d.packing = o->packing.index == 0;
  d.assistant_only_loss = o->assistant_only.index == 0;
  return d;
}

ml_train_settings ml_train_settings_of(const ml_train_opts *o) {
  ml_train_settings t = {.engine = ml_engine_opts_default(), .step = o->step};
  ml_engine_opts *eo = &t.engine;
  eo->parallel_plan = o->plan;
  eo->sequence_parallel = o->sp;
  eo->fsdp.param_dtype = ml_dtype_chosen(&o->param_dtype);
  eo->fsdp.reduce_dtype = ml_dtype_chosen(&o->reduce_dtype);
  eo->fsdp.reshard_after_forward = k_reshard_values[o->reshard.index];
  eo->fsdp.zero = (int)o->zero;
  eo->fsdp.prefetch_forward = (int)o->prefetch_forward;
  eo->fsdp.prefetch_backward = (int)o->prefetch_backward;
  eo->fsdp.cpu_offload = o->cpu_offload;
  eo->batch_invariant = o->batch_invariant;
  eo->freeze = o->freeze;
  eo->fp32_params = o->fp32_params;
  eo->lora = (ml_lora_opts){.rank = o->lora_rank, .alpha = o->lora_alpha,
                            .dropout = o->lora_dropout, .targets = o->lora_targets,
                            .rslora = o->lora_rslora, .seed = (uint64_t)o->seed,
                            .adapter = o->adapter};
  eo->output_dtype = ml_dtype_chosen(&o->output_dtype);
  eo->ac = k_ac_values[o->ac.index];
  t.step.schedule.decay = k_schedule_values[o->lr_schedule.index];
  t.step.schedule.total_steps = o->steps;
  t.step.norm_type = k_norm_values[o->grad_norm_type.index];
  return t;
}
