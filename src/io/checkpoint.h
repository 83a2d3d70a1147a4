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
 * written last. Every entry is checked (ml_st_entry_nbytes) first. */
int ml_ckpt_write(const char *dir, const ml_st_entry *entries, size_t n, size_t max_shard_bytes);

/* The streaming form of ml_ckpt_write (io/safetensors.h's ml_st_writer
 * over the checkpoint's files), for tensors that arrive one at a time: open
 * takes every entry's header fields (any dtype; data not read; names
 * copied), decides the files as ml_ckpt_write does and creates `dir`; the
 * puts then append the current tensor's bytes in entry order, each shard
 * file opened when its first tensor begins and committed (temp + fsync +
 * rename) when its last ends; close writes the index last (sharded), or
 * removes a stale index (one file). Errors: a duplicate name, those of
 * ml_st_writer_*; after an error from a put, ml_ckpt_writer_abandon, which
 * removes the file being written (files already committed stay). */
typedef struct ml_ckpt_writer ml_ckpt_writer;
int ml_ckpt_writer_open(const char *dir, const ml_st_entry *entries, size_t n,
                        size_t max_shard_bytes, ml_ckpt_writer **out);
int ml_ckpt_writer_put(ml_ckpt_writer *w, const void *bytes, size_t nbytes);
int ml_ckpt_writer_put_f32(ml_ckpt_writer *w, const float *x, size_t n);
/* Frees w, also on error. Errors: a tensor not complete (named), I/O. */
int ml_ckpt_writer_close(ml_ckpt_writer *w);
void ml_ckpt_writer_abandon(ml_ckpt_writer *w);

/* Create `dir` and its missing parents (mkdir -p, mode 0777 & ~umask).
 * Errors: a component cannot be created (named, with the reason). */
int ml_ckpt_make_dirs(const char *dir);

#endif
