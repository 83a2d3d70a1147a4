/* The gradients' tensor-parallel step over the FSDP shards, between a
 * micro-batch's backward and the grad norm: the Partial gradients of
 * tp-replicated parameters (SP norms, q_norm/k_norm on sharded heads, HF
 * replicated_with_grad_allreduce: torch's DTensor Partial → Replicate on
 * the gradient) summed over tp, and the partial gradients of the
 * key/value heads several tp ranks hold (parallel/tp.h ml_tp_heads) summed
 * over their holders. The tp plan says which parameters (parallel/tp.h
 * ml_tp_grad_partial, ml_tp_param_slice); FSDP says where their rows lie
 * (parallel/fsdp.h); this file joins the two, so that neither parallel
 * layer reads the other's internals. */
#ifndef ML_GRADS_H
#define ML_GRADS_H

#include "parallel/fsdp.h"
#include "parallel/tp.h"

/* The gradients set aside across a micro-batch's tp step (zero-initialise;
 * ml_grads_free). */
typedef struct ml_grads {
  float *stash; /* the reduced parameters' shard gradients as accumulated before this
                   micro-batch (where f's shards live: ml_fsdp_shard_alloc) */
  const ml_fsdp *f;
} ml_grads;

/* Before a micro-batch's backward: set aside the shard gradients of the
 * parameters ml_grads_tp_reduce reduces (accumulated by earlier
 * micro-batches) and zero them, so its sums add only this micro-batch's
 * partial gradients (then it adds them back): a sum over tp of accumulated
 * gradients would count the earlier micro-batches tp times. No-op with tp
 * size 1. Errors: allocation, copies. */
int ml_grads_tp_begin(ml_grads *gs, ml_tp *tp, ml_fsdp *f);

/* Sum the Partial gradients of tp-replicated parameters over tp: one
 * all-reduce of this rank's FSDP shard rows of every such parameter (the
 * same rows on every tp rank), after backward and before the grad norm;
 * then the partial gradients of key/value heads several tp ranks hold
 * (ml_tp_heads): the shared heads' rows of every k_proj / v_proj shard,
 * placed at their global rows, all-reduced over tp and then over the FSDP
 * group (a replica's rows lie in another dp rank's shard on each tp rank),
 * and written back; finally the gradients ml_grads_tp_begin set aside are
 * added back. Once per micro-batch, after its backward. No-op with tp size
 * 1 or nothing partial or shared. Errors: allocation, collectives. */
int ml_grads_tp_reduce(ml_grads *gs, ml_tp *tp, ml_fsdp *f);

/* Whether p's shard gradient takes the tp step (ml_grads_tp_reduce changes
 * it after its unit's reduction): a Partial gradient, or a k_proj / v_proj
 * holding shared kv heads; never with tp size 1 or when frozen. */
bool ml_grads_tp_stepped(const ml_tp *tp, const ml_param *p);

void ml_grads_free(ml_grads *gs);

#endif
