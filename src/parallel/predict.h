/* Prediction of one training step's collectives and of per-rank memory,
 * without running anything (for `meshlm plan`, and checked against the
 * counting comm of a real step by tests/mpi/test_predict.c). The role of
 * torch's CommDebugMode run ahead of time.
 *
 * Input: a model after ml_tp_apply (for one tp rank: uneven torch.chunk
 * shards make local shapes, hence FSDP shards and memory, differ between tp
 * ranks), its ml_tp (edges, partial params, logits placement), the mesh
 * sizes dp_replicate × dp_shard × tp (cp = 1) and the local batch: B
 * sequences of S tokens per dp rank.
 *
 * Collectives are counted per mesh group — the groups of parallel/mesh.h
 * (ml_group), each a counting comm — with the counting wrapper's byte
 * convention (comm/comm.h: the collective's full buffer per rank:
 * all-reduce n·elem, all-gather / reduce-scatter group size · n per rank ·
 * 4, n being the padded chunk for uneven torch.chunk shards). Groups
 * without traffic (cp, dp_shard_cp, dp_cp with the engine as it is) stay
 * zero. One training step = ml_engine_forward_backward +
 * ml_engine_grad_norm (train/engine.c):
 *  tp:       every activation edge forward and backward (ml_tp_edge_cost
 *            with the batch [B, S]; lm_head's output edge runs once per
 *            logits chunk, so it is costed per chunk); the vocab-parallel
 *            loss when the logits are Shard(−1) and tp > 1: per logits
 *            chunk of nt tokens (ml_loss_chunk_tokens) an all-reduce MAX of
 *            nt floats and an all-reduce SUM of 2·nt floats; the partial
 *            grad all-reduce (ml_tp_reduce_partial_grads) when tp > 1 and
 *            some parameter has Partial grads: one call, bytes = sum over
 *            those parameters of their FSDP chunk rows × cols × 4;
 *  dp_shard: when dp_shard > 1, FSDP all-gathers: every unit once forward
 *            and again in backward for the units with reshard_after_forward
 *            (every layer but the last); one reduce-scatter per unit; each
 *            dp_shard · shard_numel · 4 bytes (ml_fsdp_layout);
 *  dp:       the reported loss, one all-reduce of one f64 (8 bytes) when
 *            dp_replicate · dp_shard > 1;
 *  world:    the grad norm, one all-reduce of one f64 when world > 1;
 *  dp_replicate: HSDP, when dp_replicate > 1: one all-reduce per unit of
 *            its reduced gradient shard, shard_numel · 4 bytes.
 * For the engine's default options (ml_engine_opts_default: fp32, ZeRO-3,
 * default reshard policy, no activation checkpointing); prefetch changes
 * when all-gathers run, not how many.
 * The logprobs variant (ml_engine_logprobs, forward only): edges forward
 * only (lm_head's per chunk), the loss all-reduces, one FSDP all-gather per
 * unit when dp_shard > 1; nothing on dp or world.
 *
 * Memory per rank, fp32 bytes (an estimate of the large buffers; small
 * bookkeeping and the kernels' own temporaries are left out):
 *  params, grads   sum of the units' shard_numel × 4 (padding included);
 *  adamw           2 × params (exp_avg, exp_avg_sq on the shard);
 *  largest_unit    the largest unit's full_numel × 4 × 2 (params + grads);
 *  unsharded_peak  what FSDP materialises at the peak of backward: the root
 *                  (never resharded before the end) plus the largest layer,
 *                  params + grads each; 0 when dp_shard = 1 (the shard is
 *                  the unsharded tensor);
 *  comm_buffer     FSDP staging dp_shard · max shard_numel × 4 (dp_shard > 1);
 *  tp_scratch      the redistribute scratch: the largest
 *                  ml_redistribute_work(B, S, C, tp) of an active edge
 *                  (lm_head output: [1, chunk, V]; B·S·C when tp divides S
 *                  and C) or the partial-grad buffer, × 4;
 *  activations     saved for backward, summed over layers, with T = B·S
 *                  tokens inside attention / MLP, Tr = B·s tokens on the
 *                  residual stream (s = this rank's torch.chunk of S under
 *                  Shard(1), else S), nh, nkv local heads (q/k_proj local
 *                  rows / head_dim), I local intermediate (gate_proj local
 *                  rows), hd head_dim, H hidden, n residual norms per layer:
 *                    2·Tr·H                 layer input, residual after attention
 *                    n·(Tr·H + Tr)          each norm's output (or input) and rstd
 *                    T·(nh + 2·nkv)·hd      q, k, v after RoPE
 *                    T·nh·hd + B·nh·S²      attention output, probabilities
 *                    T·(nh + nkv)·(hd + 1)  q/k before q_norm/k_norm + rstd (if any)
 *                    3·T·I                  gate, up, act(gate)·up
 *  head            the residual buffer T·H, final norm input/output and rstd
 *                  2·Tr·H + Tr, one logits chunk chunk·(ceil(V/parts) + 4);
 *  total           the sum of the above. */
#ifndef ML_PREDICT_H
#define ML_PREDICT_H

#include <stdint.h>

#include "comm/comm.h"
#include "model/model.h"
#include "parallel/mesh.h"
#include "parallel/tp.h"

/* One line of the breakdown of a step's collectives by source. */
typedef struct ml_predict_item {
  const char *what; /* "tp edges (forward)", "fsdp all-gather (backward)", ... */
  ml_group group;
  ml_coll kind;
  int64_t calls, bytes;
} ml_predict_item;

enum { ML_PREDICT_MAX_ITEMS = 32 };

/* Per-rank memory in bytes (see the header comment for each field). */
typedef struct ml_predict_memory {
  int64_t params, grads, adamw;
  int64_t largest_unit, unsharded_peak, comm_buffer, tp_scratch;
  int64_t activations, head;
  int64_t total;
} ml_predict_memory;

typedef struct ml_prediction {
  int dp_replicate, dp_shard, tp, world;
  int tp_rank;
  int64_t B, S;                   /* local batch per dp rank */
  int64_t loss_chunk, loss_chunks; /* logits chunk (tokens) and chunks per pass */
  ml_comm_stats train[ML_GROUP_KINDS];    /* one training step */
  ml_comm_stats logprobs[ML_GROUP_KINDS]; /* one logprobs pass (forward only) */
  ml_predict_item items[ML_PREDICT_MAX_ITEMS]; /* train, by source, non-zero only */
  int n_items;
  ml_predict_memory mem;
} ml_prediction;

/* Predict one training step and one logprobs pass of the local batch
 * [B, S] on the rank holding `m` (TP applied by `tp`), for a mesh of
 * dp_replicate × dp_shard × tp->size ranks. Pure: reads the model's
 * parameter descriptions and the edges only. Errors: sizes < 1 (B, S,
 * dp_replicate, dp_shard), an edge whose placements ml_redistribute_cost
 * refuses, allocation, a batch so large that a predicted memory or
 * collective size exceeds 2^63 bytes (sizes are accounted with saturating
 * arithmetic, common/checked.h, so nothing wraps). */
int ml_predict_step(const ml_model *m, const ml_tp *tp, int dp_replicate, int dp_shard,
                    int64_t B, int64_t S, ml_prediction *out);

/* The collectives of one edge for a batch [B, S]: forward (the chain p[0]
 * → ... → p[n−1]) and backward (the gradient's chain), per kind. Errors:
 * as ml_tp_edge_cost. */
int ml_predict_edge(const ml_tp_edge *e, int64_t B, int64_t S, ml_comm_stats *fwd,
                    ml_comm_stats *bwd);

/* The collectives of edge e of model m in one step of prediction p's local
 * batch: ml_predict_edge with [B, S], except lm_head's output edge, which
 * runs once per logits chunk (p->loss_chunk tokens, the last one short).
 * Errors: as ml_tp_edge_cost. */
int ml_predict_edge_step(const ml_model *m, const ml_tp_edge *e, const ml_prediction *p,
                         ml_comm_stats *fwd, ml_comm_stats *bwd);

/* The gradient's chain of edge e as it runs backward: grad_in, then the
 * gradient placement of p[n−1], ..., p[0] (Partial activations take
 * Replicate gradients), consecutive repeats dropped; at most `cap` written.
 * Returns the number of placements. */
int ml_predict_grad_chain(const ml_tp_edge *e, ml_placement *out, int cap);

#endif
