/* FSDP (torch's fully_shard / FSDP2, DESIGN §6) over the dp_shard_cp group
 * (dp_shard × cp, NeMo Automodel's name), with HSDP over dp_replicate.
 *
 * Unit = one decoder layer, plus a root unit (embedding, final norm,
 * lm_head). Each parameter's TP-local tensor is chunked on dim 0 across the
 * group (chunk = ceil(rows / dp), zero-padded), and a unit's chunks are
 * packed into one flat shard per rank: shard = [chunk of p0 | chunk of p1 |
 * ...]. Unsharding is one all-gather of the flat shards (in param_dtype)
 * followed by a copy into the unit's contiguous unsharded fp32 buffer
 * (FSDP2's copy-out; bf16 values widened exactly); gradients are rounded to
 * param_dtype (they were computed in it), copied into the same rank-major
 * layout, reduce-scattered in reduce_dtype (SUM: the loss is already
 * normalised by the global token count), all-reduced over dp_replicate
 * under HSDP, and added to the shard's fp32 gradient. Master weights,
 * gradients and AdamW state live on the shard in fp32.
 *
 * Prefetch (FSDP2's implicit prefetching, set_modules_to_forward_prefetch):
 * ml_fsdp_prefetch starts a unit's all-gather without blocking (MPI
 * nonblocking collective); ml_fsdp_unshard waits for it.
 *
 * ZeRO stages: 3 is the above. 2 keeps every unit's unsharded parameters
 * between steps (re-gathered after the optimizer step: ml_fsdp_sync_params),
 * so forward and backward gather nothing; 1 also all-reduces whole
 * gradients instead of reduce-scattering them (each rank then keeps its
 * shard's slice for the optimizer). The reshard policy applies to ZeRO-3. */
#ifndef ML_FSDP_H
#define ML_FSDP_H

#include <stdbool.h>

#include "comm/comm.h"
#include "io/checkpoint.h"
#include "model/model.h"
#include "tensor/dtype.h"

/* reshard_after_forward of fully_shard: the default policy (layers true,
 * the root and the last layer false), or the same value for every unit. */
typedef enum { ML_RESHARD_DEFAULT, ML_RESHARD_ALWAYS, ML_RESHARD_NEVER } ml_reshard_policy;

/* FSDP2's fully_shard options (torch.distributed.fsdp.MixedPrecisionPolicy,
 * reshard_after_forward) plus the ZeRO stage and the prefetch depths. */
typedef struct ml_fsdp_opts {
  ml_dtype param_dtype;  /* ML_F32 or ML_BF16: all-gather dtype of the parameters, the
                            dtype the unsharded parameters are kept in, and so the GEMMs'
                            compute dtype (bf16 operands, fp32 accumulation) */
  ml_dtype reduce_dtype; /* ML_F32 or ML_BF16: dtype gradients are reduced in */
  ml_reshard_policy reshard_after_forward;
  int zero;              /* 3: params, grads and optimizer state sharded (FSDP); 2: params
                            stay unsharded between steps; 1: grads also all-reduced whole */
  int prefetch_forward;  /* units whose all-gather is issued ahead in forward (0 = none) */
  int prefetch_backward; /* the same in backward */
} ml_fsdp_opts;

typedef struct ml_fsdp_unit {
  ml_param **params;
  int n;
  int64_t *chunk_rows;  /* per param: ceil(local rows / dp) */
  int64_t *shard_off;   /* per param: offset of its chunk in the flat shard */
  int64_t *full_off;    /* per param: offset in the unsharded buffer */
  int64_t shard_numel;  /* per rank, padding included */
  int64_t full_numel;
  float *shard, *shard_grad, *adam_m, *adam_v; /* [shard_numel] fp32 each (device memory) */
  void *full;       /* unsharded parameters in param_dtype, while materialised */
  float *full_grad; /* unsharded fp32 gradients, during backward */
  bool reshard_after_forward;
  /* an all-gather in flight (prefetch): its request and wire buffers */
  ml_request req;
  void *send, *recv;
  bool in_flight;
} ml_fsdp_unit;

typedef struct ml_fsdp {
  ml_backend *be; /* the model's: shards, buffers and copies live there */
  ml_comm *dp;  /* dp_shard (× cp): the group parameters are sharded over */
  ml_comm *rep; /* dp_replicate: HSDP replicas (size 1: plain FSDP) */
  ml_fsdp_opts opts;
  ml_fsdp_unit *units; /* n_layers + 1; the root is the last */
  int n_units;
  float *comm_buf;  /* [dp · max shard_numel] fp32: gather / gradient staging */
  float *grad_buf;  /* [max shard_numel] fp32: the reduced gradient, added to shard_grad */
  uint16_t *wire;   /* [dp · max shard_numel] bf16 gradients on the wire (reduce_dtype BF16
                       only) */
} ml_fsdp;

/* The FSDP unit of parameter p (fully_shard applied to every decoder layer,
 * then to the root, as torchtitan and NeMo do): its decoder layer's index
 * (ml_param.layer), or m->cfg.n_layers for the root (embedding, final
 * norm, lm_head). Units number n_layers + 1, the root last. */
int ml_fsdp_unit_of(const ml_model *m, const ml_param *p);

/* The parameters of unit u, in m->params order, into out[] (room for
 * m->n_params); returns their count. */
int ml_fsdp_unit_params(const ml_model *m, int u, ml_param **out);

/* The flat-shard layout of one unit's parameters over a group of `dp`
 * ranks, exactly as ml_fsdp_init builds it, without allocating or reading
 * anything (for `meshlm plan`): per parameter i, chunk_rows[i] =
 * ceil(local[0] / dp), shard_off[i] its chunk's offset in the flat shard
 * and full_off[i] its offset in the unsharded buffer (each array may be
 * NULL); *shard_numel = sum of chunk_rows·local[1] (per rank, padding
 * included) and *full_numel = sum of local[0]·local[1]. */
void ml_fsdp_layout(ml_param *const *params, int n, int dp, int64_t *chunk_rows,
                    int64_t *shard_off, int64_t *full_off, int64_t *shard_numel,
                    int64_t *full_numel);

/* Whether unit u of n_units (n_layers + 1, the root last) frees its
 * unsharded parameters after forward under `policy`: by default every
 * layer but the last (FSDP2 as torchtitan applies it); ALWAYS / NEVER: every
 * layer or none. Never the root: the vocab-parallel loss runs lm_head's
 * forward and backward chunk by chunk, so the root's forward ends only
 * when its backward has begun. */
bool ml_fsdp_reshard_after_forward(ml_reshard_policy policy, int u, int n_units);

/* Build the units of `m` (after TP is applied), allocate this rank's
 * shards and fill them from the checkpoint `ck` (each rank reads only its
 * slice; ck NULL: left zero, nothing read); under ZeRO-1/2 gather every
 * unit once. dp: the sharding group;
 * rep: the HSDP replica group (size 1: plain FSDP). Errors: options out
 * of range (named), a parameter missing from the checkpoint or with
 * another shape (named, with both shapes), unreadable dtype, allocation. */
int ml_fsdp_init(ml_fsdp *f, ml_model *m, ml_comm *dp, ml_comm *rep, const ml_fsdp_opts *opts,
                 const ml_ckpt *ck);
void ml_fsdp_destroy(ml_fsdp *f);

/* Start unit u's all-gather without waiting (no-op when u is out of range,
 * materialised or already in flight). */
int ml_fsdp_prefetch(ml_fsdp *f, int u);
/* Materialise unit u's parameters (all-gather, or wait for its prefetch;
 * no-op if already there) and point param->data at them. */
int ml_fsdp_unshard(ml_fsdp *f, int u);
/* Free unit u's unsharded parameters (param->data = NULL); no-op when the
 * shard is the full tensor or the parameters persist (ZeRO-1/2). */
void ml_fsdp_reshard(ml_fsdp *f, int u);
/* Unsharded gradients for unit u (param->grad set): zeroed, or with one
 * rank the shard's gradient itself (backward accumulates into it). */
int ml_fsdp_grad_begin(ml_fsdp *f, int u);
/* Reduce unit u's gradients (reduce-scatter over dp, or all-reduce under
 * ZeRO-1; then all-reduce over the replicas) and add this rank's part to
 * shard_grad (+=, so micro-batches accumulate; ml_engine_zero_grad clears),
 * then free them. */
int ml_fsdp_reduce_grads(ml_fsdp *f, int u);

/* All-gather a flat per-rank array laid out like unit u's shard (`src`,
 * e.g. shard_grad) into the unsharded layout `dst` [full_numel]. */
int ml_fsdp_gather_flat(ml_fsdp *f, int u, const float *src, float *dst);

/* Re-gather the persistent unsharded parameters (ZeRO-1/2) from the
 * shards after they changed (optimizer step, checkpoint load); no-op under
 * ZeRO-3. Collective over the group. */
int ml_fsdp_sync_params(ml_fsdp *f);

/* Which unit holds parameter p: its index, and where its chunk lies. */
int ml_fsdp_param_index(const ml_fsdp_unit *unit, const ml_param *p);

/* Rows [r0, r0+nr) of p's local tensor held in this rank's shard. */
void ml_fsdp_param_rows(const ml_fsdp *f, const ml_fsdp_unit *unit, int i, int64_t *r0,
                        int64_t *nr);

#endif
