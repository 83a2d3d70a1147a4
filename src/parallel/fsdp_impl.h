/* Internal to FSDP (parallel/fsdp.c: layout, shards, unsharding;
 * parallel/fsdp_grads.c: gradients, their reduction and, under
 * cpu_offload, their way to the host): what the two share. Not for use
 * outside parallel/fsdp*. */
#ifndef ML_FSDP_IMPL_H
#define ML_FSDP_IMPL_H

#include "parallel/fsdp.h"

/* Unsharded parameters kept between steps (ZeRO-1/2). */
static inline bool fsdp_persistent(const ml_fsdp *f) { return f->opts.zero < 3; }
static inline bool fsdp_offload(const ml_fsdp *f) { return f->opts.cpu_offload; }
/* The shard is the unsharded fp32 tensor (one rank in the unit's group,
 * fp32 params, on the device). */
static inline bool fsdp_params_alias(const ml_fsdp *f, const ml_fsdp_unit *u) {
  return u->dp->size == 1 && f->opts.param_dtype == ML_F32 && !fsdp_offload(f);
}
/* Backward accumulates into the shard's gradient itself: one rank, fp32,
 * no replicas (nothing to reduce or round). Under cpu_offload into a device
 * copy of it (load_grad, store_grad); else into shard_grad (grads_alias). */
static inline bool fsdp_grads_in_place(const ml_fsdp *f, const ml_fsdp_unit *u) {
  return u->dp->size == 1 && f->opts.param_dtype == ML_F32 && u->rep->size == 1 &&
         f->opts.reduce_dtype == ML_F32;
}
static inline bool fsdp_grads_alias(const ml_fsdp *f, const ml_fsdp_unit *u) {
  return fsdp_grads_in_place(f, u) && !fsdp_offload(f);
}
/* The same for the vocab-parallel rows' gradient: it is complete on this
 * rank, and nothing rounds or reduces it. */
static inline bool fsdp_rows_grad_in_place(const ml_fsdp *f, const ml_fsdp_unit *u) {
  return f->opts.param_dtype == ML_F32 && u->rep->size == 1 && f->opts.reduce_dtype == ML_F32;
}
static inline bool fsdp_rows_grad_alias(const ml_fsdp *f, const ml_fsdp_unit *u) {
  return fsdp_rows_grad_in_place(f, u) && !fsdp_offload(f);
}
static inline ml_elem fsdp_elem_of(ml_dtype t) { return t == ML_BF16 ? ML_ELEM_BF16 : ML_ELEM_F32; }
static inline ml_dtype fsdp_dtype_of(ml_elem e) { return e == ML_ELEM_BF16 ? ML_BF16 : ML_F32; }
static inline ml_elem fsdp_param_elem(const ml_fsdp *f) {
  return fsdp_elem_of(f->opts.param_dtype);
}

/* Elements of the unit's vocab-parallel rows per rank (0: none). */
static inline int64_t fsdp_rows_numel(const ml_fsdp_unit *u) {
  return u->shard_numel - u->gather_numel;
}
/* Per rank, the gathered part's elements with a gradient (its trainable
 * prefix: what the reduce-scatter moves), and the vocab-parallel rows'
 * (their trainable prefix; 0: none). */
static inline int64_t fsdp_reduce_numel(const ml_fsdp_unit *u) {
  return u->grad_numel < u->gather_numel ? u->grad_numel : u->gather_numel;
}
static inline int64_t fsdp_rows_grad_numel(const ml_fsdp_unit *u) {
  return u->grad_numel > u->gather_numel ? u->grad_numel - u->gather_numel : 0;
}

/* The shard as the device reads it: under cpu_offload its device copy
 * (while one is there: gather_start to gather_finish, or reshard). */
static inline float *fsdp_shard_on_device(const ml_fsdp_unit *u) {
  return u->dev_shard ? u->dev_shard : u->shard;
}

/* Free a unit's buffer p (ml_be_free) unless it is the persistent
 * param_dtype shard or its rows part (fsdp.h lp: the one-rank unsharded
 * buffer, the send buffer and the vocab rows may be those, freed with the
 * unit alone). */
static inline void fsdp_free_unless_lp(const ml_fsdp *f, const ml_fsdp_unit *u, void *p) {
  if (u->lp && (p == u->lp || p == u->lp + u->gather_numel)) return;
  ml_be_free(f->be, p);
}

/* Copy between the rank-major layout `wire` (u->dp blocks of `stride`
 * elements of `elem`, each a rank's leading shard part: gather_numel for
 * the gathered parameters, shard_numel for every one, fsdp_reduce_numel for
 * the gathered trainable ones) and the unsharded buffer `full` of `type`
 * (each parameter at full_off), for the parameters whose chunk lies within
 * the block; converting where the types differ (widening exact, narrowing
 * rounds to nearest-even); the way to `wire` zero-pads each chunk. */
int fsdp_copy_rank_major(const ml_fsdp *f, const ml_fsdp_unit *u, void *wire, ml_elem elem,
                         void *full, ml_dtype type, int to_full, int64_t stride);

/* Mixed-dtype units (fsdp.h): the dtype parameter p is gathered and
 * computed in (fp32 where it is kept so: ml_param.fp32; else
 * param_dtype), and where the unit's param_dtype part ends and its fp32
 * part begins, per rank in the shard and in the unsharded layout. */
static inline ml_dtype fsdp_param_dtype_of(const ml_fsdp *f, const ml_param *p) {
  return p->fp32 ? ML_F32 : f->opts.param_dtype;
}
static inline int64_t fsdp_lo_numel(const ml_fsdp_unit *u) {
  return u->gather_numel - u->f32_numel;
}
static inline int64_t fsdp_lo_full(const ml_fsdp_unit *u) { return u->gather_full - u->f32_full; }

/* fsdp_copy_rank_major for the parameters whose chunk lies within
 * [lo, lo + stride) of each rank's shard (a part of it: the fp32 part is
 * lo = fsdp_lo_numel, stride = f32_numel): each rank's block of `wire`
 * holds that range, and `full` starts at the unsharded offset full_lo.
 * round (the way to `wire`, both fp32): the chunks of the parameters
 * outside the fp32 part (u->f32) rounded to bf16 values on the way
 * (ml_be_round_bf16_to: a gradient computed in a bf16 param_dtype, staged
 * for its reduction); a bf16 `wire`'s conversion rounds them anyway. */
int fsdp_copy_part(const ml_fsdp *f, const ml_fsdp_unit *u, void *wire, ml_elem elem, void *full,
                   ml_dtype type, int to_full, int64_t lo, int64_t stride, int64_t full_lo,
                   bool round);

#endif
