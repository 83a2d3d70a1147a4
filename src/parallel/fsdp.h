/* FSDP (torch's fully_shard / FSDP2, DESIGN §6) over the dp_shard group.
 *
 * Unit = one decoder layer, plus a root unit (embedding, final norm,
 * lm_head). Each parameter's TP-local tensor is chunked on dim 0 across the
 * group (chunk = ceil(rows / dp), zero-padded), and a unit's chunks are
 * packed into one flat shard per rank: shard = [chunk of p0 | chunk of p1 |
 * ...]. Unsharding is one all-gather of the flat shards followed by a copy
 * into the unit's contiguous unsharded buffer (FSDP2's copy-out); gradients
 * are copied into the same rank-major layout and reduce-scattered (SUM: the
 * loss is already normalised by the global token count) into the shard's
 * gradient. Master weights, gradients and AdamW state live on the shard.
 * With a group of one rank the shard is the unsharded tensor and no
 * collective runs. reshard_after_forward: true for layers, false for the
 * root and the last layer (needed at once in backward), as FSDP2's
 * fully_shard defaults are used in torchtitan. */
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
  ml_dtype param_dtype;  /* ML_F32 or ML_BF16: all-gather dtype of the parameters and the
                            dtype compute inputs are rounded to (CPU: bf16 storage, fp32
                            arithmetic) */
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
  float *shard, *shard_grad, *adam_m, *adam_v; /* [shard_numel] each */
  float *full, *full_grad;                     /* unsharded, while materialised */
  bool reshard_after_forward;
} ml_fsdp_unit;

typedef struct ml_fsdp {
  ml_comm *dp;
  ml_fsdp_unit *units; /* n_layers + 1; the root is the last */
  int n_units;
  float *comm_buf; /* [dp · max shard_numel], gather / reduce-scatter staging */
  float *grad_buf; /* [max shard_numel], reduce-scatter output, added to shard_grad */
} ml_fsdp;

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
 * unsharded parameters after forward: every layer but the last. */
bool ml_fsdp_reshard_after_forward(int u, int n_units);

/* Build the units of `m` (after TP is applied), allocate this rank's
 * shards and fill them from the checkpoint `ck` (each rank reads only its
 * slice). Errors: a parameter missing from the checkpoint or with another
 * shape (named, with both shapes), unreadable dtype, allocation. */
int ml_fsdp_init(ml_fsdp *f, ml_model *m, ml_comm *dp, const ml_ckpt *ck);
void ml_fsdp_destroy(ml_fsdp *f);

/* Materialise unit u's parameters (all-gather; no-op if already there) and
 * point param->data at them. */
int ml_fsdp_unshard(ml_fsdp *f, int u);
/* Free unit u's unsharded parameters (param->data = NULL); no-op when the
 * shard is the full tensor. */
void ml_fsdp_reshard(ml_fsdp *f, int u);
/* Unsharded gradients for unit u (param->grad set): zeroed, or with one
 * rank the shard's gradient itself (backward accumulates into it). */
int ml_fsdp_grad_begin(ml_fsdp *f, int u);
/* Reduce-scatter unit u's gradients and add them to shard_grad (+=, so
 * micro-batches accumulate; ml_engine_zero_grad clears), then free them. */
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
