/* HF checkpoint directories: the weights of `save_pretrained`.
 *
 * Reading: DIR/model.safetensors, or DIR/model.safetensors.index.json
 * ({"metadata": {"total_size": N}, "weight_map": {name: file}}) and the shard
 * files it names (each opened and validated once). Writing: one
 * model.safetensors, or, above `max_shard_bytes`, model-0000K-of-0000N.
 * safetensors shards plus the index (transformers' `save_pretrained`
 * naming), total_size = sum of tensor bytes. */
#ifndef ML_CHECKPOINT_H
#define ML_CHECKPOINT_H

#include "io/safetensors.h"

typedef struct ml_ckpt {
  char *dir;
  size_t nfiles;
  ml_st_file *files;
} ml_ckpt;

/* Open every weight file of the checkpoint in `dir`. Errors: no weights
 * file, malformed index (field named), a file the index names that is
 * missing or invalid, a tensor in two files, an index entry whose tensor
 * is not in the named file. */
int ml_ckpt_open(const char *dir, ml_ckpt *out);
void ml_ckpt_close(ml_ckpt *c);

/* The tensor `name` from whichever file holds it, or NULL. */
const ml_st_tensor *ml_ckpt_find(const ml_ckpt *c, const char *name);

/* Write `entries` into `dir` (created if missing) as one file, or sharded
 * with an index when their total size exceeds max_shard_bytes (0 = never
 * shard). Each file goes through ml_st_write (temp + rename); the index is
 * written last. */
int ml_ckpt_write(const char *dir, const ml_st_entry *entries, size_t n, size_t max_shard_bytes);

/* Create `dir` and its missing parents (mkdir -p, mode 0777 & ~umask).
 * Errors: a component cannot be created (named, with the reason). */
int ml_ckpt_make_dirs(const char *dir);

#endif
