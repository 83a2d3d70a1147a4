/* Tensor-parallel plans as data: an ordered list of (module-name pattern →
 * parallel style), as torch's parallelize_module(module, mesh["tp"], plan)
 * and NeMo's per-family plans (ARCHITECTURE.md §4–§5). Patterns are HF module names
 * where `*` matches exactly one dot-separated segment
 * ("model.layers.*.self_attn.q_proj"), like torch's per-atom fnmatch.
 *
 * Styles follow torch.distributed.tensor.parallel (style.py) with their
 * constructor arguments and defaults; HF's plan strings
 * (transformers tensor_parallel.py, `base_model_tp_plan`) translate onto
 * them (ml_style_from_hf). */
#ifndef ML_PLAN_H
#define ML_PLAN_H

#include <stdbool.h>
#include <stddef.h>

#include "model/model.h"
#include "tensor/placement.h"

typedef enum {
  ML_STYLE_COLWISE,               /* ColwiseParallel */
  ML_STYLE_ROWWISE,               /* RowwiseParallel */
  ML_STYLE_SEQUENCE_PARALLEL,     /* SequenceParallel (sequence_dim 1) */
  ML_STYLE_PREPARE_INPUT,         /* PrepareModuleInput */
  ML_STYLE_PREPARE_OUTPUT,        /* PrepareModuleOutput */
  ML_STYLE_PREPARE_INPUT_OUTPUT,  /* PrepareModuleInputOutput */
  ML_STYLE_REPLICATE,             /* HF replicated_with_grad_allreduce / replicate */
  ML_STYLE_GATHER,                /* HF gather / all_reduce: output Partial → Replicate */
  ML_STYLE_KINDS
} ml_style_kind;

/* One parallel style. Placements are over the tp mesh dim, for the
 * module's first input / output activation [B, S, C]:
 *  input_layout          how a plain (local) input is to be read — torch's
 *                        input_layouts (DTensor.from_local); a DTensor input
 *                        keeps its own placement;
 *  desired_input_layout  what the module computes on (redistributed to);
 *  output_layout         what the module hands out (Colwise/Rowwise/SP), or
 *                        the annotation of its plain output (PrepareModuleOutput);
 *  desired_output_layout PrepareModuleOutput's target;
 *  use_local_output      hand out a local tensor (true) or a DTensor.
 * Colwise/Rowwise with `local` are HF's local_colwise / local_rowwise:
 * weights sharded, activations not redistributed (use_dtensor=False). */
typedef struct ml_style {
  ml_style_kind kind;
  ml_placement input_layout, desired_input_layout;
  ml_placement output_layout, desired_output_layout;
  bool use_local_output;
  bool local;
  bool hf;           /* from an HF string: RowwiseParallel on an Embedding reads ids Replicate */
  char label[48];    /* how the plan spelled it, for reports: "colwise", "RowwiseParallel" */
} ml_style;

/* torch defaults: ColwiseParallel() input Replicate → output Shard(−1),
 * use_local_output; RowwiseParallel() input Shard(−1) → output Replicate,
 * use_local_output; SequenceParallel() input/output Shard(1),
 * use_local_output false; PrepareModuleInput/Output: Replicate → Replicate,
 * use_local_output false (set the layouts after). */
ml_style ml_style_default(ml_style_kind kind);
/* "ColwiseParallel", ... */
const char *ml_style_kind_name(ml_style_kind k);

/* Translate an HF plan string (colwise, rowwise, colwise_rep /
 * colwise_gather_output, rowwise_rep / rowwise_split_input,
 * embedding_rowwise, embedding_colwise, sequence_parallel, local_colwise,
 * local_rowwise, gather / all_reduce, replicated_with_grad_allreduce /
 * replicate). Errors: an unknown string, named with the accepted ones;
 * `where` prefixes the message (file and key). */
int ml_style_from_hf(const char *s, const char *where, ml_style *out);
/* The accepted HF strings, comma-separated (for messages). */
const char *ml_style_hf_names(void);

/* Parse "Replicate()", "Replicate", "Shard(1)", "Shard(-1)", "Partial()",
 * "Partial". Errors name `where`. */
int ml_placement_parse(const char *s, const char *where, ml_placement *out);

typedef struct ml_plan_rule {
  char pattern[160];
  ml_style style;
} ml_plan_rule;

typedef struct ml_plan {
  char name[64];    /* "llama-optimized-sp", "custom:plan.json", "hf-base_model_tp_plan" */
  char reason[256]; /* why it was chosen, for the report */
  bool sequence_parallel; /* the plan shards the sequence (an SP variant) */
  ml_plan_rule *rules;
  size_t n, cap;
} ml_plan;

/* Append a rule (the plan grows). Errors: allocation. */
int ml_plan_add(ml_plan *p, const char *pattern, ml_style s);
void ml_plan_free(ml_plan *p);

/* The optimized plan of the model's family (NeMo RL _parallelize_llama /
 * _parallelize_qwen / _parallelize_gemma3, torchtitan's SP layout), built
 * from the module tree so every norm is named:
 *  base: embed_tokens Rowwise(input Replicate); q/k/v, gate, up Colwise;
 *        o, down Rowwise; q_norm/k_norm (head-sharded) replicated with grad
 *        all-reduce; lm_head Colwise(output Shard(−1), use_local_output
 *        false) — vocab-sharded logits for the vocab-parallel loss.
 *  sp:   embed_tokens output Shard(1); every layer norm and the final norm
 *        SequenceParallel; self_attn and mlp PrepareModuleInput(Shard(1) →
 *        Replicate) (one all-gather each); o, down Rowwise(output
 *        Shard(1)) (reduce-scatter); lm_head Colwise(input Shard(1)).
 * Errors: allocation. */
int ml_plan_optimized(const ml_model *m, bool sequence_parallel, ml_plan *out);
/* The default Llama-style plan (NeMo Automodel's base plan): the same
 * rules as the optimized base plan without q_norm/k_norm entries, and its
 * SP overlay. */
int ml_plan_default(const ml_model *m, bool sequence_parallel, ml_plan *out);
/* The checkpoint's HF plan: config.json `base_model_tp_plan` (or
 * text_config's), else the family's class plan (ml_family.hf_tp_plan, as
 * transformers' config classes default it), keys prefixed with the
 * base-model prefix, as NeMo's
 * get_hf_tp_plan: embed_tokens added as rowwise_rep when absent; lm_head
 * (the class plan's colwise_rep) as Colwise(output Shard(−1),
 * use_local_output false). *found = false when neither has one.
 * Errors: unreadable config, a non-string style, an unknown string. */
int ml_plan_hf(const ml_model *m, const char *model_dir, ml_plan *out, bool *found);
/* A custom plan file: a JSON object {pattern: style}, in file order, where
 * style is an HF string or an object {"style": torch class name or HF
 * string, "input_layouts", "desired_input_layouts", "output_layouts",
 * "desired_output_layouts": placement or [placement, null...],
 * "use_local_output": bool, "sequence_dim": 1}. Errors name the file, the
 * key and what was expected. */
int ml_plan_load(const char *path, ml_plan *out);

/* A plan given as JSON text (the format of ml_plan_load), each pattern
 * behind `prefix` (a family's module prefix, "model.") except those naming
 * "lm_head"; `what` names it in messages (a registered family's plan).
 * Errors: invalid JSON, and ml_plan_load's. */
int ml_plan_parse(const char *text, const char *what, const char *prefix, ml_plan *out);

/* Choose the plan, as NeMo's _get_parallel_plan: `choice` NULL or "auto":
 * optimized (every supported family has one) > HF > default; a path: that
 * custom file; "optimized", "hf", "default": that source. Sets out->name
 * and out->reason. Errors: sequence_parallel with a source that has no SP
 * variant (the HF plan), a missing HF plan when "hf" is forced, file errors. */
int ml_plan_select(const ml_model *m, const char *model_dir, const char *choice,
                   bool sequence_parallel, ml_plan *out);

/* True when `name` matches `pattern` segment by segment. */
bool ml_pattern_match(const char *pattern, const char *name);

#endif
