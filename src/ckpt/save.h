/* Consolidation of an engine's sharded state into global tensors: the HF
 * export at the end of a run (meshlm train --export-hf), streamed to world
 * rank 0 one tensor at a time and written with the rest of the source model
 * (ckpt/hf_export.h: original architecture, tokenizer files, untrained
 * tensors, source dtypes); and, for tests, every tensor on every rank. */
#ifndef ML_SAVE_H
#define ML_SAVE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "ckpt/hf_export.h"

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
 * i-th parameter in export order (ml_engine_export_param; under expert
 * parallelism each expert's from the ep rank holding it) of
 * `what` (a frozen unit's gradients and AdamW state: zeros), in host memory
 * from ml_be_host_alloc(e->be), on every rank; the
 * caller frees each with ml_be_host_free(e->be, ·), also after an error
 * (entries not reached are left as they were). Errors: allocation,
 * collectives, copies. */
int ml_engine_export(ml_engine *e, ml_export_what what, float **out);
/* The i-th parameter in export order (engine.h ml_engine.order: by decoder
 * layer, then the root; the same on every rank); NULL out of range. */
const ml_param *ml_engine_export_param(const ml_engine *e, int i);

/* The piece of parameter i of `unit` this rank contributes when the
 * mesh's shards are consolidated (the HF export; a run checkpoint's
 * pieces, ckpt/runckpt.h): the rows of its TP-local tensor held in its
 * FSDP chunk (ml_fsdp_param_rows) that it owns (ml_engine_owned_rows),
 * fp32, row-major, at element *at of the unit's flat arrays (unit->shard +
 * *at), placed in the global tensor at off[2] with shape[2] ([n, 1] for
 * 1-D) by the TP placement. false when it contributes none: it holds no
 * rows, or only rows another rank contributes — an HSDP replica
 * (dp_replicate rank > 0), a tp rank > 0 of a TP-replicated parameter, the
 * copies of kv heads a lower tp rank owns (parallel/tp.h ml_tp_heads); cp
 * ranks hold distinct rows (FSDP shards over dp_shard_cp). The pieces of
 * all ranks tile the global tensor exactly. */
bool ml_engine_piece(const ml_engine *e, const ml_fsdp_unit *unit, int i, int64_t off[2],
                     int64_t shape[2], int64_t *at);

/* Receives parameter k (export order) as its global fp32 tensor [p->shape],
 * valid during the call. Non-zero stops the stream (an error). */
typedef int (*ml_param_sink)(void *ctx, int k, const ml_param *p, const float *global);

/* Collective over the world: every parameter, in export order, assembled
 * from the ranks' pieces (ml_engine_piece) on world rank `root` — or on
 * rank 0 and broadcast to every rank when root < 0 — and handed to `sink`
 * there, one tensor at a time: each rank copies its piece to host memory
 * and sends it to the root, which places it, before the next tensor (so a
 * receiver holds one global tensor, plus for a column-sharded one a piece,
 * beyond its shards; the others one piece). As FSDP2's full_state_dict
 * with cpu_offload (rank0_only when root >= 0). Errors (every rank, the
 * first failing rank's message): root out of range, allocation,
 * collectives, the sink's. */
int ml_engine_stream_params(ml_engine *e, int root, ml_param_sink sink, void *ctx);

/* Whether a stream moves parameter p (the same answer on every rank). */
typedef bool (*ml_param_filter)(const ml_param *p);

/* ml_engine_stream_params over the parameters `want` accepts only (NULL:
 * every one), each still handed to `sink` with its export index k; the
 * others move no byte. Collective over the world; errors as
 * ml_engine_stream_params'. */
int ml_engine_stream_selected(ml_engine *e, int root, ml_param_filter want, ml_param_sink sink,
                              void *ctx);

/* Collective over the world: write the trained weights as an HF checkpoint
 * in `dir` (a LoRA run, e->lora.on: its adapters as a PEFT adapter
 * directory instead, ckpt/lora_export.h) with the rest of the source model e->model_dir
 * (ckpt/hf_export.h), trained tensors in `dtype`, one file up to
 * ML_HF_MAX_SHARD_BYTES, streamed to world rank 0 tensor by tensor
 * (ml_engine_stream_params), which writes each before the next. Errors (every rank,
 * the first failing rank's message): the source unreadable (named),
 * allocation, collectives, I/O on rank 0 (path named); nothing is left of
 * a failed export (hf_export.h). */
int ml_engine_save_hf(ml_engine *e, const char *dir, ml_export_dtype dtype);

#endif
