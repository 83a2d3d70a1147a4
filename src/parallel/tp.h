/* Apply a tensor-parallel plan to a model over the tp group, as torch's
 * parallelize_module does with ColwiseParallel / RowwiseParallel
 * (torch/distributed/tensor/parallel/style.py): each matched module's
 * parameters get their placement and local slice (torch.chunk sizes), and
 * its edges get the redistribute hooks of DESIGN §3:
 *   Colwise, input Replicate: forward none; backward all-reduce of the
 *     input grad (Partial → Replicate, Megatron's f).
 *   Rowwise, output Replicate: forward all-reduce (Partial → Replicate,
 *     Megatron's g); backward none. Rowwise bias Replicate, added once.
 *   Rowwise on Embedding: vocab rows Shard(0), out-of-range ids give 0,
 *     output Partial → all-reduce.
 * Hooks here are in place, so layouts that change the local activation
 * shape (sequence parallel, Shard(1) outputs, gathered outputs) are
 * refused with a clear message. q/k/v (and gate/up) read one activation:
 * their input hooks must agree and run once on it (one all-reduce of the
 * summed grad instead of three: the same numbers, fewer collectives). */
#ifndef ML_TP_H
#define ML_TP_H

#include "comm/comm.h"
#include "model/model.h"
#include "parallel/plan.h"

/* Validate and apply `plan`. Errors (before anything is changed on a
 * module the error concerns, identical on every rank): a pattern that
 * matches no module, a style on a module kind it cannot shard, heads or kv
 * heads not divisible by tp, a dimension too small for tp shards, siblings
 * with different input layouts, unsupported layouts. With tp->size == 1
 * only the validation runs. */
int ml_tp_apply(const ml_plan *plan, ml_model *m, ml_comm *tp);

/* Local extent of torch.chunk(n, parts)[rank]: start and length. */
void ml_chunk(int64_t n, int parts, int rank, int64_t *start, int64_t *len);

#endif
