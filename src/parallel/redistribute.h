/* Placement algebra for activations on one mesh dimension (ARCHITECTURE.md §3):
 * torch.distributed.tensor.DTensor.redistribute on a 1-D mesh
 * (torch/distributed/tensor/_redistribute.py: redistribute_local_tensor and
 * the Redistribute autograd function), for an activation of global shape
 * [B, S, C] held as the local view of tensor/act.h.
 *
 * Placements (tensor/placement.h): Replicate, Shard(1) (sequence: each rank
 * holds its torch.chunk of S for all B sequences), Shard(2) = Shard(−1)
 * (features: its torch.chunk of C for every token), Partial(sum) (every
 * rank holds a full-shape addend; the value is their sum). Shard extents
 * follow torch.chunk (ml_chunk, tensor/placement.h): chunk = ceil(n/t) per rank,
 * the trailing ranks short and possibly empty (C = 5 over 4 ranks is
 * 2, 2, 1, 0); empty shards are valid everywhere. Collectives are
 * equal-size (comm/comm.h): an uneven shard is zero-padded to the chunk for
 * the wire and unpadded after, as torch's DTensor does; zeros add exactly,
 * so the values are those of an uneven collective.
 *
 * Forward transitions and their collectives (t = group size > 1):
 *   same → same                 none
 *   Partial → Replicate         all-reduce                 (Megatron g,
 *                               reduce_from_tensor_model_parallel_region)
 *   Partial → Shard(1)          reduce-scatter on S        (Megatron
 *                               reduce_scatter_to_sequence_parallel_region)
 *   Partial → Shard(−1)         reduce-scatter on C
 *   Shard(1) → Replicate        all-gather on S            (Megatron
 *                               gather_from_sequence_parallel_region)
 *   Shard(−1) → Replicate       all-gather on C            (Megatron
 *                               gather_from_tensor_model_parallel_region)
 *   Replicate → Shard(d)        local slice of this rank's chunk, no
 *                               communication (Megatron
 *                               scatter_to_sequence_parallel_region)
 *   Shard(1) ↔ Shard(−1)        all-gather on the old dim, then local slice
 *                               on the new one (same values as torch, which
 *                               may use an all-to-all here; the cost
 *                               function reports the all-gather issued)
 * A tensor with no elements (B·S·C == 0) and a group of size 1 move
 * nothing: every transition is then a no-op on the data (a Partial of one
 * rank already is the sum; shards of one rank are the whole tensor) that
 * still validates the request and the shapes.
 *
 * Backward (the contract of torch's Redistribute.backward and ARCHITECTURE.md §3's
 * table; this file implements the forward function only, the autograd
 * layer calls it again for the gradient): the backward of a forward
 * from → to is
 *   ml_redistribute(g, grad_placement, from', grad, work)
 * where from' is `from` with Partial replaced by Replicate (the grad of a
 * Partial value is Replicate) and grad_placement is how the grad arrives:
 * `to`, or Partial when `to` is Replicate and the consumer produced
 * per-rank partial grads (e.g. a colwise linear reading a Replicate input).
 * This yields the table:
 *   Shard(d) → Replicate   all-gather    backward Partial → Shard(d),
 *                                         reduce-scatter on d (or, if the
 *                                         grad arrives Replicate, a slice)
 *   Partial → Replicate    all-reduce    backward Replicate → Replicate,
 *                                         none (Partial grad: all-reduce)
 *   Partial → Shard(d)     reduce-scatter backward Shard(d) → Replicate,
 *                                         all-gather on d
 *   Replicate → Shard(d)   slice         backward Shard(d) → Replicate,
 *                                         all-gather on d
 *   Replicate → Replicate  none          backward Partial → Replicate,
 *     (a Replicate input feeding a        all-reduce (Megatron f,
 *     sharded weight)                     copy_to_tensor_model_parallel_region)
 *   Shard(1) ↔ Shard(−1)   all-gather    backward the reverse transition
 * Forward F and backward G are adjoint under the pairing of global values
 * (Shard: concatenation, Partial: sum, Replicate: one copy):
 * <F(x), y> == <x, G(y)>; summed over ranks of local dot products this is
 * exact when one side is Shard(d) against Shard(d) or Partial against
 * Replicate, and counts a Replicate-against-Replicate pair t times.
 *
 * Collectives: ml_redistribute is collective over g: every rank calls it
 * with the same placements and global B, S, C. Request errors (placements)
 * are identical on every rank; shape errors are checked on the local view
 * only, so a caller that can produce them on some ranks treats −1 as fatal
 * for the whole job. */
#ifndef ML_REDISTRIBUTE_H
#define ML_REDISTRIBUTE_H

#include <stdint.h>

#include "backend/backend.h"
#include "comm/comm.h"
#include "tensor/act.h"
#include "tensor/placement.h"

/* Redistribute activation `a` from placement `from` to `to` over group g,
 * in place: a->x holds the local [B, s, c] view under `from` on entry and
 * under `to` on return, with a->s and a->c updated (a->B, a->S, a->C are the
 * global shape and unchanged). a->x must have room for B·S·C floats.
 * `work` is scratch of at least ml_redistribute_work(B, S, C, g->size)
 * floats, not overlapping a->x; it may be NULL when the transition
 * communicates nothing (same → same, Replicate → Shard(d), group size 1,
 * empty tensors). Uneven shards travel padded (ml_all_gather_padded; a
 * reduce-scatter's blocks are packed padded the same way): a->x's room
 * beyond the local view may be overwritten.
 * Supported: from ∈ {Replicate, Shard(1), Shard(2) = Shard(−1), Partial(sum)},
 * to ∈ {Replicate, Shard(1), Shard(2) = Shard(−1)}, plus Partial → Partial
 * (same → same, nothing).
 * Errors: `to` Partial from anything but Partial (torch's Replicate →
 * Partial split is not supported), Shard(0) or any other dim, negative
 * sizes, a local view inconsistent with `from` (e.g. Shard(1) with a->s not
 * this rank's torch.chunk of a->S, or a->c != a->C), a missing work buffer
 * when one is needed; and communication failures. Messages name the
 * placements, the group and the sizes. On error a is unchanged unless a
 * collective failed. */
int ml_redistribute(ml_backend *be, ml_comm *g, ml_placement from, ml_placement to, ml_act *a,
                    float *work);

/* The collectives ml_redistribute(from → to) issues for a global [B, S, C]
 * activation over a group of `group_size` ranks, without communicating:
 * *n (0, 1 or 2) entries of out[] (kind) and bytes[] (what the counting
 * comm of comm.h records for the call: B·S·C·4 for an all-reduce; for an
 * all-gather or reduce-scatter on the sharded dim d of size n, the padded
 * t·ceil(n/t) in place of n — B·t·ceil(S/t)·C·4 on the sequence,
 * B·S·t·ceil(C/t)·4 on the features — which is B·S·C·4 when t divides n;
 * ML_SAT, common/checked.h, when that exceeds int64).
 * It agrees exactly with the counting wrapper's calls and bytes for the same
 * transition, on every rank. For `meshlm plan`. Errors: as ml_redistribute
 * for the placements and sizes, and group_size < 1. */
int ml_redistribute_cost(ml_placement from, ml_placement to, int64_t B, int64_t S, int64_t C,
                         int group_size, ml_coll out[2], int64_t bytes[2], int *n);

/* Floats of `work` ml_redistribute needs for a global [B, S, C] over
 * `group_size` ranks: the padded blocks of every rank, the larger of
 * B·t·ceil(S/t)·C and B·S·t·ceil(C/t) (>= B·S·C; B·S·C when t divides S
 * and C). Saturates at ML_SAT (common/checked.h). */
int64_t ml_redistribute_work(int64_t B, int64_t S, int64_t C, int group_size);

/* All-gather of uneven torch.chunk shards over the equal-size collective,
 * as torch's DTensor gathers them (torch/distributed/tensor/
 * _collective_utils.py: fill_empty_tensor_to_shards / pad_tensor, then
 * all_gather_into_tensor, then unpad_tensor): this rank's block send[n] is
 * zero-padded in place to `chunk` floats (send must have room for chunk,
 * n <= chunk; every rank passes the same chunk, usually the largest block,
 * ceil(rows / t)·row), and the equal-size all-gather writes rank q's padded
 * block to recv[q·chunk .. (q+1)·chunk) (recv: [g->size·chunk] floats). The
 * caller unpads: block q's first n_q floats are rank q's. Collective over
 * g; counted as an all-gather of g->size·chunk·4 bytes. */
int ml_all_gather_padded(ml_backend *be, ml_comm *g, float *send, size_t n, size_t chunk,
                         float *recv);

#endif
