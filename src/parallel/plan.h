/* Tensor-parallel plans as data: an ordered list of (module-name pattern →
 * parallel style), as torch's parallelize_module(module, mesh["tp"], plan)
 * and NeMo's per-family plans (DESIGN §4–§5). Patterns are HF module names
 * where `*` matches exactly one dot-separated segment
 * ("model.layers.*.self_attn.q_proj"), like torch's per-atom fnmatch. */
#ifndef ML_PLAN_H
#define ML_PLAN_H

#include <stdbool.h>
#include <stddef.h>

#include "model/config.h"
#include "tensor/placement.h"


typedef enum { ML_STYLE_COLWISE, ML_STYLE_ROWWISE } ml_style_kind;

/* torch.distributed.tensor.parallel ColwiseParallel / RowwiseParallel with
 * their constructor arguments. */
typedef struct ml_style {
  ml_style_kind kind;
  ml_placement input_layout;  /* what the caller hands in */
  ml_placement output_layout; /* what the module hands out */
  bool use_local_output;
} ml_style;

/* ColwiseParallel(): input Replicate, output Shard(−1), use_local_output. */
ml_style ml_style_colwise(void);
/* RowwiseParallel(): input Shard(−1), output Replicate, use_local_output. */
ml_style ml_style_rowwise(void);
const char *ml_style_name(ml_style_kind k);

typedef struct ml_plan_rule {
  char pattern[128];
  ml_style style;
} ml_plan_rule;

typedef struct ml_plan {
  char name[64];    /* "llama-base" */
  char reason[160]; /* why it was chosen, for the report */
  ml_plan_rule *rules;
  size_t n;
} ml_plan;

/* The base plan of the Llama-style families (NeMo's optimized non-SP plan
 * and HF's base_model_tp_plan agree on it): q/k/v, gate, up colwise; o, down
 * rowwise; embed_tokens rowwise with Replicate input (vocab-parallel lookup,
 * output all-reduced); lm_head colwise with the logits kept vocab-sharded
 * (Shard(−1), use_local_output = false) for the vocab-parallel loss. */
int ml_plan_llama_base(const ml_model_config *c, ml_plan *out);
void ml_plan_free(ml_plan *p);

/* True when `name` matches `pattern` segment by segment. */
bool ml_pattern_match(const char *pattern, const char *name);

#endif
