/* Parameters kept and computed in fp32 under a bf16 param_dtype, as NeMo
 * Automodel's `fully_shard_by_dtype` (nemo_automodel/components/distributed/
 * parallelizer_utils.py: the Qwen3_5ParallelizationStrategy of
 * parallelizer.py shards each layer with it, keeping the GatedDeltaNet's
 * `_fp32_params` fp32) and DeepSeek-V4's `fully_shard_deepseek_v4`
 * (models/deepseek_v4/fsdp.py, the DeepseekV4ParallelizationStrategy's
 * fully_shard_fn: the parameters `_keep_in_fp32_modules_strict` names)
 * keep such parameters fp32 under a bf16 MixedPrecisionPolicy: their FSDP
 * all-gather moves the fp32 master bits and the GEMMs reading them compute
 * on fp32 operands (the router's logits = fp32 h · fp32 W^T; meshlm's
 * activations are fp32 buffers, so the input needs no cast), while the
 * other parameters are gathered and computed in bf16 (parallel/fsdp.h: the
 * unit's fp32 part). Under param_dtype fp32 every parameter is fp32 already
 * and the marks change nothing. */
#ifndef ML_FP32_PARAMS_H
#define ML_FP32_PARAMS_H

#include <stdint.h>

#include "model/model.h"

/* Mark fp32 (ml_param.fp32) every sparse layer's router gate
 * (<moe_block>.gate.weight: the mark of the mixture-of-experts families,
 * Qwen3-MoE's `model.layers.*.mlp.gate.weight`, Mixtral's
 * `model.layers.*.block_sparse_moe.gate.weight`) and the parameters that
 * `patterns` names (comma-separated fnmatch patterns over HF parameter
 * names: engine/param_match.h; NULL or "": none); the others not. Errors
 * (naming the option fp32_params / --fp32-params): an empty pattern, a
 * pattern matching no parameter (naming it). */
int ml_fp32_params_apply(ml_model *m, const char *patterns);

/* The parameters of m marked fp32: their count and elements (global
 * shapes). */
void ml_fp32_params_count(const ml_model *m, int *n, int64_t *numel);

#endif
