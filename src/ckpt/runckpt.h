/* Sharded, resumable run checkpoints (ARCHITECTURE.md §9), as torch.distributed.
 * checkpoint (DCP) saves an FSDP2 + TP model: every rank writes the pieces
 * of the global tensors it owns — fp32 master weights and AdamW exp_avg /
 * exp_avg_sq — with their global offsets, so a run on another mesh (dp or tp
 * changed) can read the blocks it needs; the run state (optimizer step,
 * data-order seed, loader position) goes into the metadata, written last
 * (temp file + fsync + rename) so that a crash during a save leaves the
 * previous checkpoint loadable. HSDP replicas hold identical shards; only
 * dp_replicate rank 0 writes them.
 *
 * Layout (ckpt/runckpt_format.h has the details):
 *   DIR/latest.json                    the commit point: names the step directory
 *   DIR/step-00000120/rank-00003.safetensors   rank 3's pieces, keys as DCP
 *                                      flattens a state dict: NAME,
 *                                      optim.state.NAME.exp_avg, .exp_avg_sq
 *   DIR/step-00000120/config.json      the model (saved family, float32)
 *   DIR/step-00000120/source/          copies of the source model's config.json,
 *                                      tokenizer and generation files (hf_source.h)
 *   DIR/step-00000120/metadata.json    every piece (tensor, file, global offset,
 *                                      shape), the saving mesh, the run state, the
 *                                      source model's description
 * A piece is the rows of a parameter's TP-local tensor one rank holds in
 * its FSDP shard (ml_fsdp_param_rows), placed in the global tensor by the
 * TP placement: FSDP2's sharded state dict (DTensor Shard(0) over dp_shard
 * composed with the TP placement), written without its padding rows.
 * DIR must be visible to every rank (a shared file system). */
#ifndef ML_RUNCKPT_H
#define ML_RUNCKPT_H

#include <stdint.h>

#include "engine/engine.h"
#include "ckpt/hf_export.h"

/* What the trainer needs to continue exactly where it stopped. */
typedef struct ml_run_state {
  int64_t step;     /* trainer steps completed (the LR schedule's position; AdamW's own
                       count, e->step, which skipped steps do not advance, is saved too) */
  int64_t consumed; /* loader position: sequences of the global batch stream consumed */
  uint64_t seed;    /* data-order seed (the loader's RNG state is a pure function of it) */
  int64_t nseq;     /* sequences in the dataset, to refuse resuming over other data */
} ml_run_state;

/* Collective over the world: write the engine's sharded state, e->step and
 * `st` as a new checkpoint under `dir` (created with its parents if
 * needed): every rank writes its file (temp + fsync + rename, then fsyncs
 * the step directory); after a collective agreement that all succeeded,
 * world rank 0 writes config.json, records the source model e->model_dir
 * for `meshlm export` (its description and a copy of its small files,
 * ckpt/hf_source.h; the tensors the run does not train stay in the
 * source, referenced by its absolute path: a VLM's vision tower may be
 * large; an unreadable source only costs a warning) and metadata.json, and
 * commits by
 * replacing DIR/latest.json (temp + fsync + rename, directory fsync'd);
 * only then are the other step directories (older checkpoints, a save that
 * never committed) removed. A crash at any point before the rename leaves
 * the previous latest.json and its checkpoint intact. A second save at the
 * same step goes to another directory, never over the committed one. A
 * save that fails on any rank removes its uncommitted step directory.
 * Errors (every rank, each with the first failing rank's message): I/O
 * (path named), allocation.
 *
 * Test hook: with the environment variable MESHLM_TEST_CRASH_IN_SAVE set
 * to "STEP:RANK", the save with st->step == STEP makes world rank RANK
 * write its file, cut it to half its size (a torn write) and raise SIGKILL
 * on itself, so tests can kill a rank in the middle of a save
 * (tests/cli/test_crash_save.sh). Unset, it costs one getenv per save. */
int ml_run_save(ml_engine *e, const char *dir, const ml_run_state *st);

/* Collective over the world: load the latest committed checkpoint under
 * `dir` into an engine opened on the same model (any mesh: dp_replicate,
 * dp_shard and tp may all differ from the saving one — resharding on
 * load, as DCP's load_state_dict): for every parameter each rank reads the
 * block of the global tensor its shard holds (weights, exp_avg,
 * exp_avg_sq) from whichever pieces intersect it, checks the block is
 * exactly covered, then ml_engine_sync_params; *st receives the run state
 * and e->step the optimizer step. Gradients are left alone (a step starts
 * with ml_engine_zero_grad). Errors (every rank): no committed checkpoint,
 * a config.json field deciding the parameters' names or shapes that
 * differs (named, found vs expected), a tensor missing or of another shape
 * (named with both shapes), a piece missing from its file, a rank file
 * truncated or corrupt (named, by the safetensors reader), I/O. After an
 * error *st and e->step are unchanged but the shards may be partly
 * overwritten: close the engine. */
int ml_run_load(ml_engine *e, const char *dir, ml_run_state *st);

/* Single process, no collective: consolidate the latest committed
 * checkpoint under `ckpt_dir` into an HF checkpoint in `out_dir`, the same
 * files ml_engine_save_hf writes for the engine that saved it
 * (ckpt/hf_export.h: the source model's architecture, config.json, files
 * and untrained tensors, read from the source directory the checkpoint
 * names; trained tensors in `dtype`; one model.safetensors, or shards +
 * model.safetensors.index.json above max_shard_bytes, 0 = never, as
 * save_pretrained). Each global tensor is assembled from its pieces (DCP's
 * format_utils dcp_to_torch_save) and written before the next, so memory
 * holds one tensor. A checkpoint without a source record (saved by an
 * older meshlm) exports config.json and the weights of its saved text
 * family, fp32 under ML_EXPORT_DTYPE_SOURCE, with a warning on stderr.
 * Errors: no committed checkpoint, a LoRA run's checkpoint (its adapters are
 * exported by meshlm train --export-hf, ckpt/lora_export.h), missing or
 * inconsistent pieces (named),
 * the source directory missing or changed when it holds tensors to carry
 * (named), I/O. */
int ml_run_export(const char *ckpt_dir, const char *out_dir, size_t max_shard_bytes,
                  ml_export_dtype dtype);

#endif
