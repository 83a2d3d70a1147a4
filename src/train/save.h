/* Consolidated HF export of an engine's current weights: every rank
 * contributes its shards (FSDP all-gather over dp_shard, then an
 * all-gather of the TP pieces over tp), world rank 0 writes config.json and
 * model.safetensors (sharded with model.safetensors.index.json above 5 GB,
 * as save_pretrained) in fp32 so transformers' from_pretrained loads it.
 * Tied checkpoints omit lm_head.weight. */
#ifndef ML_SAVE_H
#define ML_SAVE_H

#include "train/engine.h"

/* Collective over the world. Errors (on every rank): allocation, the write
 * on rank 0 (file named). */
int ml_engine_save_hf(ml_engine *e, const char *dir);

#endif
