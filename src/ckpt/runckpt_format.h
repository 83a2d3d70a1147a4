/* The on-disk format of run checkpoints (ckpt/runckpt.h), shared by the
 * collective save/load and the single-process export. Private to ckpt/.
 *
 * DIR/latest.json              {"format", "version", "step_dir": "step-00000120", "step": 120}
 *                              the commit point: written last (temp + fsync + rename, then
 *                              the directory fsync'd); names the one valid checkpoint
 * DIR/step-00000120/           one checkpoint (a second save at the same step uses
 *                              "step-00000120.b", so the committed one is never rewritten)
 *   rank-00003.safetensors     world rank 3's pieces (absent when it owns none)
 *   config.json                the model (ml_model_config_write: saved family, float32)
 *   source/                    copies of the files of the source model's description
 *                              (config.json, tokenizer*, ...: ckpt/hf_source.h)
 *   metadata.json              every piece, the mesh, the run state, the source (below)
 *
 * A piece is a 2-D block (1-D for 1-D tensors) of a global tensor: the rows
 * of its TP-local tensor one rank holds in its FSDP shard, at global offset
 * [r0, c0] (TP Shard(0) moves r0, Shard(1) moves c0), the same block for
 * each state. A rank file stores per piece one fp32 tensor per state under
 * the state's key, as torch DCP flattens a state dict: "param" → NAME,
 * "exp_avg" → "optim.state.NAME.exp_avg", "exp_avg_sq" →
 * "optim.state.NAME.exp_avg_sq" (NAME: the HF checkpoint key in the saved
 * family's layout, ml_family_rename).
 *
 * metadata.json:
 *   {"format": "meshlm-run-checkpoint", "version": 1, "dtype": "F32",
 *    "optimizer_step": N, "run_state": {"step", "consumed", "seed" (decimal
 *    string: a u64), "nseq"}, "mesh": {"world_size", "dp_replicate",
 *    "dp_shard", "cp", "tp"}, "config": "config.json", "files": {name: rank},
 *    "tensors": {NAME: {"shape": [..], "keys": {state: key}, "pieces":
 *    [{"file": name, "offset": [r0(, c0)], "shape": [nr(, nc)]}, ...]}},
 *    "source": the source model's description (ckpt/hf_source.h; absent
 *    in checkpoints of older meshlm versions, and when the source could
 *    not be read at save time)} */
#ifndef ML_RUNCKPT_FORMAT_H
#define ML_RUNCKPT_FORMAT_H

#include <stdbool.h>
#include <stdint.h>

#include <jansson.h>

#include "io/json.h"
#include "io/safetensors.h"
#include "ckpt/runckpt.h"

/* Checkpointed states of a parameter, in this order. */
enum { ML_RC_PARAM, ML_RC_EXP_AVG, ML_RC_EXP_AVG_SQ, ML_RC_STATES };
extern const char *const ml_rc_state_names[ML_RC_STATES];

enum { ML_RC_PATH = 4096, ML_RC_NAME = 64, ML_RC_KEY = 256 };

/* The step directory's subdirectory of the source model's files. */
#define ML_RC_SOURCE "source"

/* The key state s of tensor `name` is stored under in a rank file. Errors:
 * it does not fit cap bytes. */
int ml_rc_state_key(const char *name, int state, char *out, size_t cap);

/* "rank-%05d.safetensors". */
void ml_rc_rank_file(int rank, char *out, size_t cap);

/* ---------------------------------------------------------------- saving */

/* World rank 0, before any rank writes: create `dir` (and parents), choose
 * the directory name of a checkpoint at `step` (name[ML_RC_NAME]; never the
 * committed one), empty and create it. Errors: I/O (path named). */
int ml_rc_begin(const char *dir, int64_t step, char *name);

/* World rank 0, after a save failed on some rank (every rank past its
 * writes): remove the step directory `name` under `dir` with whatever it
 * holds, unless latest.json commits it (a failure after the commit, while
 * pruning older ones). A name ml_rc_begin never chose (empty) is a no-op.
 * Errors: I/O (path named). */
int ml_rc_abandon(const char *dir, const char *name);

/* One parameter as metadata.json lists it: name (saved layout), ndim,
 * global shape ([n, 1] for 1-D), and whether the run froze it (listed in
 * metadata's "frozen"; its AdamW states are saved as zeros: it has none). */
typedef struct ml_rc_param {
  const char *name;
  int ndim;
  int64_t shape[2];
  bool frozen;
} ml_rc_param;

/* A piece of one parameter held by one rank: global offset and shape
 * (shape[0] = 0: none). */
typedef struct ml_rc_block {
  int64_t off[2], shape[2];
} ml_rc_block;

/* What metadata.json records besides the pieces. */
typedef struct ml_rc_info {
  ml_run_state st;
  int64_t optimizer_step;
  int world_size, dp_replicate, dp_shard, cp, tp;
  const char *freeze; /* the run's freeze patterns (--freeze) as given, "" for none (metadata's
                         "freeze"; a checkpoint without the key: ""); read: into the metadata */
} ml_rc_info;

/* World rank 0, after every rank's file is on disk: write
 * step_dir/metadata.json, pieces from blocks[r·n + i] (rank r's piece of
 * params[i]), `source` as "source" (NULL: none), and fsync step_dir.
 * Errors: I/O, allocation. */
int ml_rc_write_metadata(const char *step_dir, const ml_rc_info *info, const ml_rc_param *params,
                         int n, const ml_rc_block *blocks, const json_t *source);

/* World rank 0: commit checkpoint `name` under `dir` (latest.json via
 * temp + fsync + rename, then fsync dir), then remove every other step
 * directory. Errors: I/O (path named). */
int ml_rc_commit(const char *dir, const char *name, int64_t step);

/* World rank 0, holding DIR's lock (ckpt/runlock.h), before the run's
 * first save: remove every step directory under `dir` that latest.json
 * does not commit (a save killed before its commit; all of them when there
 * is no latest.json), with one warning naming them. Only names ml_rc_begin
 * chooses are touched. Errors: a malformed latest.json, I/O (path named). */
int ml_rc_clean(const char *dir);

/* fsync a directory (after renaming files into it). Errors: I/O. */
int ml_rc_fsync_dir(const char *dir);

/* --------------------------------------------------------------- reading */

/* The latest committed checkpoint under a directory: metadata parsed, rank
 * files opened (mmap, validated) when first read. */
typedef struct ml_rc_ckpt {
  char dir[ML_RC_PATH];  /* the step directory */
  char meta[ML_RC_PATH]; /* its metadata.json, for messages */
  char config[ML_RC_PATH]; /* its config.json */
  char source_dir[ML_RC_PATH]; /* its copies of the source model's files */
  ml_rc_info info;
  json_t *source;           /* metadata's "source" (checked), or NULL when it has none */
  ml_json json;
  json_t *tensors;          /* metadata's "tensors" */
  json_t *files;            /* {file name: index}, of metadata's "files" */
  int nfiles;
  const char **file_names;  /* [nfiles], into the metadata */
  ml_st_file *open;         /* [nfiles], path NULL until opened */
} ml_rc_ckpt;

/* Read DIR/latest.json and the metadata it names. Errors: no committed
 * checkpoint (latest.json missing), malformed latest.json or metadata.json
 * (file and field named, "source" included), another format version. */
int ml_rc_open(const char *dir, ml_rc_ckpt *out);
void ml_rc_close(ml_rc_ckpt *c);

/* A tensor of the checkpoint as metadata.json lists it. */
typedef struct ml_rc_tensor {
  const char *name;
  int ndim;
  int64_t shape[2]; /* [n, 1] for 1-D */
  const char *keys[ML_RC_STATES];
  int n;
  struct ml_rc_piece {
    int file; /* index into files */
    ml_rc_block b;
  } *pieces;
} ml_rc_tensor;

/* Tensor `name`: 0 (filled; ml_rc_tensor_free), 1 when the checkpoint has
 * none, -1 on a malformed entry (field named). */
int ml_rc_tensor_get(ml_rc_ckpt *c, const char *name, ml_rc_tensor *out);
void ml_rc_tensor_free(ml_rc_tensor *t);

/* dst [nr, nc] = the block at global [r0, c0] of state `state` of t,
 * read from the pieces that intersect it (any mesh saved them: resharding).
 * The pages read are released afterwards (ml_st_release): reading tensor
 * by tensor, memory holds about one. Errors: the block not exactly covered
 * (pieces missing or overlapping), a rank file missing, truncated or
 * corrupt (the safetensors reader names it), a piece's tensor missing from
 * its file or of another shape. */
int ml_rc_read_block(ml_rc_ckpt *c, const ml_rc_tensor *t, int state, int64_t r0, int64_t c0,
                     int64_t nr, int64_t nc, float *dst);

#endif
