/* Sharded, resumable run checkpoints (DESIGN §9), as torch.distributed.
 * checkpoint (DCP) saves an FSDP2 + TP model: every rank writes the pieces
 * of the global tensors it owns — fp32 master weights and AdamW exp_avg /
 * exp_avg_sq — with their global offsets, so a run on another mesh (dp or tp
 * changed) can read the blocks it needs; the run state (optimizer step,
 * data-order seed, loader position) goes into the metadata, written last
 * (temp file + fsync + rename) so that a crash during a save leaves the
 * previous checkpoint loadable. HSDP replicas hold identical shards; only
 * dp_replicate rank 0 writes them. */
#ifndef ML_RUNCKPT_H
#define ML_RUNCKPT_H

#include <stdint.h>

#include "train/engine.h"

/* What the trainer needs to continue exactly where it stopped. */
typedef struct ml_run_state {
  int64_t step;     /* optimizer steps completed (AdamW's step count, the LR schedule's position) */
  int64_t consumed; /* loader position: sequences of the global batch stream consumed */
  uint64_t seed;    /* data-order seed (the loader's RNG state is a pure function of it) */
  int64_t nseq;     /* sequences in the dataset, to refuse resuming over other data */
} ml_run_state;

/* Collective over the world: write the engine's sharded state and `st` as
 * a new checkpoint under `dir` (created if needed), committing it by
 * renaming the metadata into place last; then remove older checkpoints'
 * files. Errors (every rank): I/O (path named), allocation. */
int ml_run_save(ml_engine *e, const char *dir, const ml_run_state *st);

/* Collective over the world: load the latest committed checkpoint under
 * `dir` into an engine opened on the same model (any mesh): each rank reads
 * the blocks of every tensor it owns, then ml_engine_sync_params; *st
 * receives the run state and e->step is set. Errors (every rank): no
 * committed checkpoint, a parameter missing or of another shape (named with
 * both shapes), a model of another config, I/O. */
int ml_run_load(ml_engine *e, const char *dir, ml_run_state *st);

/* Single process: consolidate the latest committed checkpoint under
 * `ckpt_dir` into an HF checkpoint in `out_dir` (config.json +
 * model.safetensors, sharded with model.safetensors.index.json above
 * max_shard_bytes, as save_pretrained), loadable by transformers. Errors:
 * no committed checkpoint, missing or inconsistent pieces, I/O. */
int ml_run_export(const char *ckpt_dir, const char *out_dir, size_t max_shard_bytes);

#endif
