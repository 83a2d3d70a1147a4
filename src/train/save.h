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

#include "train/engine.h"

typedef enum { ML_EXPORT_PARAMS, ML_EXPORT_GRADS } ml_export_what;

/* Collective over the world: out[i] (malloc'd, caller frees, on every
 * rank) = the global tensor [shape] of the i-th parameter in FSDP unit
 * order (names from ml_engine_export_param), of the weights or of the
 * gradients left by the last backward. Errors: allocation, collectives. */
int ml_engine_export(ml_engine *e, ml_export_what what, float **out);
/* The i-th parameter in export order. */
const ml_param *ml_engine_export_param(const ml_engine *e, int i);

/* Write the consolidated weights as an HF checkpoint to `dir`. Collective.
 * Errors (on every rank): allocation, the write on rank 0 (file named). */
int ml_engine_save_hf(ml_engine *e, const char *dir);

#endif
