/* Consolidation of an engine's sharded state into global HF tensors, and
 * the consolidated HF export: every rank contributes its shards (FSDP
 * all-gather over dp_shard, then an all-gather of the TP pieces over tp).
 * World rank 0 writes config.json and model.safetensors (sharded with
 * model.safetensors.index.json above 5 GiB, as save_pretrained) in fp32 so
 * transformers' from_pretrained loads it. Tied checkpoints omit
 * lm_head.weight. A composite family's text tower is saved as its text-only
 * family (ml_family_saved: Gemma3ForConditionalGeneration → Gemma3ForCausalLM,
 * model.language_model.* → model.*); the vision tower is never built. */
#ifndef ML_SAVE_H
#define ML_SAVE_H

#include <stddef.h>

#include "train/engine.h"

/* What ml_engine_export consolidates: the fp32 master weights, the
 * gradients left by the last backward, or AdamW's exp_avg / exp_avg_sq
 * (torch.optim.AdamW state, as FSDP2's full optimizer state dict). */
typedef enum {
  ML_EXPORT_PARAMS,
  ML_EXPORT_GRADS,
  ML_EXPORT_EXP_AVG,
  ML_EXPORT_EXP_AVG_SQ
} ml_export_what;

/* Shard size of ml_engine_save_hf and `meshlm export`'s default: 5 GiB
 * (save_pretrained's max_shard_size default is "5GB"). */
#define ML_HF_MAX_SHARD_BYTES ((size_t)5 << 30)

/* Collective over the world: out[i] = the global tensor [shape] of the
 * i-th parameter in FSDP unit order (names from ml_engine_export_param) of
 * `what`, in host memory from ml_be_host_alloc(e->be), on every rank; the
 * caller frees each with ml_be_host_free(e->be, ·), also after an error
 * (entries not reached are left as they were). Errors: allocation,
 * collectives, copies. */
int ml_engine_export(ml_engine *e, ml_export_what what, float **out);
/* The i-th parameter in export order. */
const ml_param *ml_engine_export_param(const ml_engine *e, int i);

/* Write the consolidated weights as an HF checkpoint to `dir`. Collective.
 * Errors (on every rank): allocation, the write on rank 0 (file named). */
int ml_engine_save_hf(ml_engine *e, const char *dir);

/* One process: write global fp32 tensors as an HF checkpoint in `dir`
 * (created with its parents if missing): config.json of `cfg` in its saved family's layout
 * (ml_family_saved, dtype float32) and tensors[i] [params[i]->shape] under
 * params[i]'s name renamed into that layout (ml_family_rename), in the
 * given order; one model.safetensors, or shards + index above
 * max_shard_bytes (0 = never shard). params hold the model's parameters,
 * so a tied lm_head is not among them. Errors: I/O (file named). */
int ml_hf_write(const char *dir, const ml_model_config *cfg, const ml_param *const *params,
                float *const *tensors, int n, size_t max_shard_bytes);

#endif
