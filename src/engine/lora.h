/* LoRA fine-tuning of an engine's model (model/lora.h for the adapters and
 * their forward/backward), with PEFT's LoraConfig semantics: the adapters
 * are the only trainable parameters besides what --freeze leaves (every
 * base weight frozen, requires_grad=False, as PEFT's
 * mark_only_lora_as_trainable with bias "none"); lora_A starts
 * Kaiming-uniform(a = √5) as nn.Linear and PEFT's reset_lora_parameters
 * initialise it (bound 1/sqrt(in_features)) from a seed, lora_B at zero, so
 * the first forward is the base model's; or both come from a PEFT adapter
 * directory (adapter_config.json + adapter_model.safetensors, keys
 * base_model.model.<module>.lora_A.weight). The adapters are fp32 masters
 * sharded by FSDP in their layer's unit and computed in the policy's
 * param_dtype as the base GEMM. Under tensor parallelism they take NeMo
 * Automodel's LoRA-aware placements (parallel/tp.h): a colwise base
 * (weight Shard(0)) has lora_A Replicate and lora_B Shard(0) cut as the
 * weight's rows; a rowwise base (Shard(1)) has lora_A Shard(1) cut as the
 * weight's columns and lora_B Replicate, its Partial x·A^T·B^T added to the
 * base's Partial output before the one all-reduce / reduce-scatter; the
 * Replicate adapter's gradient is Partial over tp and summed there as a
 * replicated norm weight's. lora_dropout > 0 drops lora_A's input in
 * training micro-batches (model/lora_drop.h; ml_lora_dropout_begin). */
#ifndef ML_ENGINE_LORA_H
#define ML_ENGINE_LORA_H

#include <stdbool.h>
#include <stdint.h>

#include "model/model.h"
#include "comm/host.h"
#include "parallel/fsdp.h"

/* LoRA options (PEFT LoraConfig's names). rank 0 and adapter NULL: off. */
typedef struct ml_lora_opts {
  int64_t rank;        /* r (--lora-rank); 0: no LoRA unless `adapter` gives it */
  double alpha;        /* lora_alpha (--lora-alpha) */
  double dropout;      /* lora_dropout (--lora-dropout): [0, 1) (model/lora_drop.h) */
  const char *targets; /* target_modules (--lora-targets): comma-separated names or all-linear */
  bool rslora;         /* use_rslora (--lora-rslora): scaling alpha / sqrt(r) */
  uint64_t seed;       /* lora_A's initialisation */
  const char *adapter; /* a PEFT adapter directory to start from (--adapter), or NULL */
} ml_lora_opts;

/* The LoRA configuration in effect: the options', or the adapter's
 * (adapter_config.json) when one is given. */
typedef struct ml_lora {
  bool on;
  int64_t rank;
  double alpha, dropout, scaling;
  bool rslora;
  char *targets;
  uint64_t seed;
  char *adapter; /* owned copy of the adapter directory, or NULL */
  int64_t micro; /* training micro-batches since the last ml_engine_zero_grad (the dropout
                    mask's micro-batch index) */
} ml_lora;

/* Settle the configuration from o (and o->adapter's adapter_config.json,
 * whose r, lora_alpha, use_rslora and target_modules must equal o's when
 * o->rank > 0, and lora_dropout o's when o->dropout is not 0; with rank 0
 * the adapter's configuration rules) and attach the adapters to m (ml_lora_attach).
 * Off (rank 0, no adapter): nothing. m->lora_drop.p takes lora_dropout
 * (inactive until ml_lora_dropout_begin). Errors (naming
 * the option / field): lora_dropout outside [0, 1), adapter_config.json unreadable or with an
 * unsupported option (peft_type other than LORA, use_dora, modules_to_save,
 * bias other than "none", rank_pattern / alpha_pattern, fan_in_fan_out,
 * layers_to_transform, layer_replication, exclude_modules, lora_bias,
 * target_parameters, trainable_token_indices, use_qalora,
 * alora_invocation_tokens, use_bdlora, velora_config, monteclora_config,
 * arrow_config, kasa_config, a regular expression as target_modules;
 * fields that only choose an initialisation — init_lora_weights,
 * loftq_config, eva_config, corda_config, lora_ga_config — are read past:
 * the adapter's values are loaded), those of
 * ml_lora_attach. */
int ml_lora_setup(ml_lora *l, const ml_lora_opts *o, ml_model *m);

/* Freeze every base parameter of m (those that are not adapters). */
void ml_lora_freeze_base(ml_model *m);

/* Set the adapters' values in FSDP's shards f of m (then synced to the
 * parameters, ml_fsdp_sync_params): from l->adapter's
 * adapter_model.safetensors (PEFT's keys base_model.model.<param key>: the
 * name, or for a fused module's lora_B parts their rows of its one tensor),
 * or from l->seed (lora_A Kaiming-uniform(a = √5), U(−1/√in, 1/√in), the
 * adapters drawn in parameter order from one splitmix64 stream, the same
 * on every rank; lora_B zeros). Every rank calls it. Errors: allocation,
 * the adapter's file unreadable, a tensor missing, of another shape, or
 * one the model has no adapter for (each named). */
int ml_lora_load(const ml_lora *l, ml_fsdp *f, const ml_model *m);

/* Before training micro-batch [B, S] (whole sequences, before cp's cut)
 * of this data-parallel rank: m's dropout context active (model/lora_drop.h)
 * with the key ml_rng_hash(ml_rng_hash(l->seed, step), l->micro) — step:
 * the optimizer steps taken (ml_engine.step, restored on resume), l->micro
 * then counted up —, row0 this rank's first row in the global micro-batch
 * (the rows of the lower data-parallel ranks of `dp` before it: one host
 * all-gather of B over dp, collective there), row_len S, row_pos each local
 * position's index in its sequence (context parallelism's pieces; NULL:
 * 0 .. S − 1). Nothing, and no collective, when lora_dropout is 0 or LoRA
 * is off. Errors: the all-gather's. */
int ml_lora_dropout_begin(ml_lora *l, ml_model *m, ml_host *dp, int64_t step, int64_t B,
                          int64_t S, const int64_t *row_pos);

/* After that micro-batch's backward: the context inactive again. */
void ml_lora_dropout_end(ml_model *m);

void ml_lora_free(ml_lora *l);

#endif
