/* FSDP's gradients (parallel/fsdp.h): the unsharded gradient buffers of a
 * unit's backward, their reduction into the shards (reduce-scatter, HSDP
 * all-reduce, the vocab rows), zero_grad, and under cpu_offload their
 * copies to the host shards and the wait for them at the end of backward
 * (FSDP2's foreach_reduce and finalize_backward). */
#include <string.h>

#include "common/status.h"
#include "parallel/fsdp.h"
#include "parallel/fsdp_impl.h"

/* Point the unit's gathered parameters' grad at their places in the
 * unsharded fp32 gradients `base` (NULL: none); the vocab-parallel ones
 * have none there (ml_fsdp_rows gives their rows' gradient), nor the
 * frozen ones (no weight gradient: their places stay zero). */
static void point_grads(ml_fsdp_unit *u, float *base) {
  for (int i = 0; i < u->n; i++) {
    bool at = base && !u->vocab[i] && !u->params[i]->frozen;
    u->params[i]->grad = at ? base + u->full_off[i] : NULL;
  }
}

/* cpu_offload, a gradient accumulated in place: its device copy dst [n]
 * of shard_grad[at ..] (zero while fresh), loaded without blocking the
 * host (the backward that adds to it follows in the compute stream). */
static int load_grad(ml_fsdp *f, ml_fsdp_unit *unit, float *dst, int64_t at, int64_t n) {
  size_t bytes = sizeof(float) * (size_t)n;
  if (unit->grad_fresh) return ml_be_zero(f->be, dst, bytes);
  return ml_be_copy_async(f->be, dst, unit->shard_grad + at, bytes, ML_COPY_H2D);
}

/* cpu_offload: shard_grad[at .. at+n) (=) the device's g [n], copied
 * without waiting (ml_fsdp_finish_backward does). */
static int store_grad(ml_fsdp *f, ml_fsdp_unit *unit, int64_t at, const float *g, int64_t n) {
  ML_TRY(ml_be_copy_async(f->be, unit->shard_grad + at, g, sizeof(float) * (size_t)n,
                          ML_COPY_D2H));
  ML_TRY(ml_be_event_record(f->be, &unit->grad_ev));
  unit->grad_pending = true;
  return 0;
}

/* shard_grad[at .. at+n) += the device's reduced gradient g [n], its
 * leading lo elements rounded to bf16 values in the same pass (a gradient
 * computed in a bf16 param_dtype; lo = 0 under cpu_offload: rounded
 * before); while fresh (shard_grad holds no value since zero_grad) written
 * (=) instead, as 0 + g: on the device (ml_be_add_grad); under cpu_offload
 * on the host: while fresh the copy itself, without waiting, else through
 * host_grad (blocking) and added there by shard_be. */
static int add_grad(ml_fsdp *f, ml_fsdp_unit *unit, int64_t at, const float *g, int64_t n,
                    int64_t lo) {
  if (!fsdp_offload(f)) {
    float *y = unit->shard_grad + at;
    if (lo > 0) ML_TRY(ml_be_add_grad(f->be, y, g, lo, unit->grad_fresh, true));
    return n > lo ? ml_be_add_grad(f->be, y + lo, g + lo, n - lo, unit->grad_fresh, false) : 0;
  }
  if (unit->grad_fresh) return store_grad(f, unit, at, g, n);
  ML_TRY(ml_be_copy(f->be, f->host_grad, g, sizeof(float) * (size_t)n, ML_COPY_D2H));
  return ml_be_add(f->shard_be, unit->shard_grad + at, f->host_grad, n);
}

/* shard_grad[at .. at+n) zeroed while the unit is fresh: the lazy part of
 * zero_grad (ml_fsdp_zero_grads), where no reduction writes it (the
 * backward accumulates into it: grads_alias, rows_grad_alias; frozen chunks
 * past the reduced ones) or before another reader (ml_fsdp_settle_grad). */
static int zero_fresh(ml_fsdp *f, ml_fsdp_unit *unit, int64_t at, int64_t n) {
  if (!unit->grad_fresh || n <= 0) return 0;
  return ml_be_zero(f->shard_be, unit->shard_grad + at, sizeof(float) * (size_t)n);
}

static int grad_begin_one(ml_fsdp *f, ml_fsdp_unit *unit) {
  if (unit->frozen) return 0; /* no gradient: every param->grad stays NULL */
  if (fsdp_grads_alias(f, unit)) { /* backward accumulates straight into the shard's grads */
    ML_TRY(zero_fresh(f, unit, 0, unit->grad_numel));
    unit->grad_fresh = false;
    point_grads(unit, unit->shard_grad);
    return 0;
  }
  if (unit->grad_full > 0) { /* the gathered trainable parameters' (a leading part) */
    unit->full_grad = ml_be_alloc(f->be, unit->grad_full, sizeof(float),
                                  "the unsharded gradients of a unit");
    if (!unit->full_grad) return -1;
    if (fsdp_grads_in_place(f, unit)) /* offloaded: one rank's unsharded gradient is the shard's */
      ML_TRY(load_grad(f, unit, unit->full_grad, 0, unit->grad_full));
    else
      ML_TRY(ml_be_zero(f->be, unit->full_grad, sizeof(float) * (size_t)unit->grad_full));
  }
  point_grads(unit, unit->full_grad);
  int64_t n = fsdp_rows_grad_numel(unit);
  if (n == 0) return 0;
  if (fsdp_rows_grad_alias(f, unit)) { /* the rows' gradient is complete: into shard_grad */
    unit->rows_grad = unit->shard_grad + unit->gather_numel;
    return zero_fresh(f, unit, unit->gather_numel, n); /* the gathered part: reduce writes it */
  }
  unit->rows_grad = ml_be_alloc(f->be, n, sizeof(float), "the vocab rows' gradient of a unit");
  if (!unit->rows_grad) return -1;
  if (fsdp_rows_grad_in_place(f, unit))
    return load_grad(f, unit, unit->rows_grad, unit->gather_numel, n);
  return ml_be_zero(f->be, unit->rows_grad, sizeof(float) * (size_t)n);
}

int ml_fsdp_grad_begin(ml_fsdp *f, int u) {
  ML_TRY(grad_begin_one(f, &f->units[u]));
  int w = f->units[u].with; /* its expert unit along */
  return w >= 0 ? grad_begin_one(f, &f->units[w]) : 0;
}

/* The gradient reduction of one unit over its dp (and its replicas) in
 * reduce_dtype: rank-major staging → reduce-scatter (ZeRO-1: all-reduce,
 * then this rank's block) → all-reduce over the replicas → += shard_grad;
 * of each rank's trainable prefix of the gathered part (fsdp_reduce_numel:
 * the frozen chunks after it have no gradient). Under a bf16 param_dtype
 * the param_dtype part's gradient (the fp32 part's is fp32) is rounded to
 * bf16 values, as the GEMMs computing it in bf16 would hold it, in the
 * first pass that reads full_grad: the staging copy (an fp32 wire rounds
 * in it, a bf16 wire's conversion rounds), or on one rank the add into
 * shard_grad (in place before the replicas' all-reduce or the copy to
 * the host). The same bits as rounding full_grad first: each element is
 * rounded once and then added or moved as before. */
static int reduce_unit(ml_fsdp *f, ml_fsdp_unit *unit) {
  int dp = unit->dp->size;
  size_t n = (size_t)fsdp_reduce_numel(unit);
  bool bf16 = f->opts.reduce_dtype == ML_BF16, round = f->opts.param_dtype == ML_BF16;
  ml_elem elem = bf16 ? ML_ELEM_BF16 : ML_ELEM_F32;
  size_t es = ml_elem_size(elem);
  /* full_grad's param_dtype part: its leading lo elements */
  int64_t lo = !round ? 0 : fsdp_lo_full(unit) < unit->grad_full ? fsdp_lo_full(unit)
                                                                  : unit->grad_full;
  int64_t add_lo = 0; /* of the reduced gradient: rounded in the add */
  void *stage = bf16 ? (void *)f->wire : (void *)f->comm_buf;
  if (dp == 1 && !bf16) { /* one rank's staging is full_grad itself: same layout, same type */
    stage = unit->full_grad;
    if (unit->rep->size == 1 && !fsdp_offload(f)) add_lo = lo;
    else ML_TRY(ml_be_round_bf16(f->be, unit->full_grad, (size_t)lo));
  } else {
    ML_TRY(fsdp_copy_part(f, unit, stage, elem, unit->full_grad, ML_F32, 0, 0, (int64_t)n, 0,
                          round));
  }
  void *red = (char *)stage + es * n * (size_t)unit->dp->rank; /* this rank's reduced block */
  if (dp > 1 && f->opts.zero == 1) {
    ML_TRY(ml_all_reduce(unit->dp, stage, n * (size_t)dp, elem, ML_RED_SUM));
  } else if (dp > 1) {
    /* out of place; with bf16 the fp32 staging buffer is free to receive */
    red = bf16 ? (void *)f->comm_buf : (void *)f->grad_buf;
    ML_TRY(ml_reduce_scatter_t(unit->dp, stage, red, n, elem));
  }
  if (unit->rep->size > 1) ML_TRY(ml_all_reduce(unit->rep, red, n, elem, ML_RED_SUM));
  float *g = red;
  if (bf16) {
    ML_TRY(ml_be_convert(f->be, f->grad_buf, ML_F32, red, ML_BF16, n));
    g = f->grad_buf;
  }
  return add_grad(f, unit, 0, g, (int64_t)n, add_lo);
}

/* The vocab-parallel rows' gradient g [n] of unit rounded to bf16 where
 * their parameter computed in it (param_dtype bf16, not kept in fp32). */
static int round_rows(ml_fsdp *f, const ml_fsdp_unit *unit, float *g, int64_t n) {
  for (int i = 0; i < unit->n; i++) {
    const ml_param *p = unit->params[i];
    int64_t at = unit->shard_off[i] - unit->gather_numel, len = unit->chunk_rows[i] * p->local[1];
    if (!unit->vocab[i] || fsdp_param_dtype_of(f, p) != ML_BF16 || at >= n) continue;
    ML_TRY(ml_be_round_bf16(f->be, g + at, (size_t)(at + len <= n ? len : n - at)));
  }
  return 0;
}

/* The vocab-parallel rows' gradient of one unit, complete on this rank
 * (every token of the group went through its rows): rounded to param_dtype
 * (it was computed in it, as full_grad is), all-reduced over the replicas
 * in reduce_dtype (rounded to it once even without replicas, as the
 * reduce-scatter would), += shard_grad. Where it accumulated in place:
 * nothing to do, or under cpu_offload its copy stored back. */
static int reduce_rows(ml_fsdp *f, ml_fsdp_unit *unit) {
  if (fsdp_rows_grad_alias(f, unit)) return 0;
  if (fsdp_rows_grad_in_place(f, unit))
    return store_grad(f, unit, unit->gather_numel, unit->rows_grad, fsdp_rows_grad_numel(unit));
  size_t n = (size_t)fsdp_rows_grad_numel(unit);
  float *g = unit->rows_grad;
  ML_TRY(round_rows(f, unit, g, (int64_t)n));
  if (f->opts.reduce_dtype == ML_BF16) {
    uint16_t *w = ml_be_alloc(f->be, (int64_t)n, sizeof(uint16_t), "the bf16 vocab rows' "
                              "gradient of a unit");
    if (!w) return -1;
    int rc = ml_be_convert(f->be, w, ML_BF16, g, ML_F32, n);
    if (rc == 0 && unit->rep->size > 1)
      rc = ml_all_reduce(unit->rep, w, n, ML_ELEM_BF16, ML_RED_SUM);
    if (rc == 0) rc = ml_be_convert(f->be, g, ML_F32, w, ML_BF16, n);
    ml_be_free(f->be, w);
    ML_TRY(rc);
  } else if (unit->rep->size > 1) {
    ML_TRY(ml_all_reduce(unit->rep, g, n, ML_ELEM_F32, ML_RED_SUM));
  }
  return add_grad(f, unit, unit->gather_numel, g, (int64_t)n, 0);
}

static int reduce_one(ml_fsdp *f, ml_fsdp_unit *unit) {
  point_grads(unit, NULL);
  if (fsdp_grads_alias(f, unit) || unit->frozen) return 0;
  int rc = 0;
  bool in_place = fsdp_grads_in_place(f, unit);
  if (unit->grad_full > 0)
    rc = in_place ? store_grad(f, unit, 0, unit->full_grad, unit->grad_full)
                  : reduce_unit(f, unit);
  /* while fresh, the gathered part's frozen chunks that no reduction writes: zeros */
  int64_t wrote = unit->grad_full == 0 ? 0 : in_place ? unit->grad_full : fsdp_reduce_numel(unit);
  if (rc == 0) rc = zero_fresh(f, unit, wrote, fsdp_reduce_numel(unit) - wrote);
  if (rc == 0 && fsdp_rows_grad_numel(unit)) rc = reduce_rows(f, unit);
  unit->grad_fresh = false;
  ml_be_free(f->be, unit->full_grad);
  if (!fsdp_rows_grad_alias(f, unit)) ml_be_free(f->be, unit->rows_grad);
  unit->full_grad = unit->rows_grad = NULL;
  return rc;
}

int ml_fsdp_reduce_grads(ml_fsdp *f, int u) {
  int w = f->units[u].with; /* its expert unit along, reduced over its own group */
  if (w >= 0) ML_TRY(reduce_one(f, &f->units[w]));
  return reduce_one(f, &f->units[u]);
}

void ml_fsdp_zero_grads(ml_fsdp *f) {
  for (int u = 0; u < f->n_units; u++) f->units[u].grad_fresh = !f->units[u].frozen;
}

int ml_fsdp_settle_grad(ml_fsdp *f, ml_fsdp_unit *unit) {
  if (unit->frozen || !unit->grad_fresh) return 0;
  ML_TRY(zero_fresh(f, unit, 0, unit->grad_numel));
  unit->grad_fresh = false;
  return 0;
}

int ml_fsdp_settle_grads(ml_fsdp *f) {
  for (int u = 0; u < f->n_units; u++) ML_TRY(ml_fsdp_settle_grad(f, &f->units[u]));
  return 0;
}

int ml_fsdp_finish_backward(ml_fsdp *f) {
  for (int u = 0; u < f->n_units; u++) {
    ml_fsdp_unit *unit = &f->units[u];
    if (!unit->grad_pending) continue;
    unit->grad_pending = false;
    ML_TRY(ml_be_event_sync(f->be, &unit->grad_ev));
  }
  return ml_fsdp_settle_grads(f); /* the units this backward gave no gradient */
}

