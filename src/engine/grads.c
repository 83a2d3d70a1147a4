#include "engine/grads.h"

#include "common/status.h"

/* Whether p has a Partial gradient to all-reduce over tp (a frozen
 * parameter has none). */
static bool partial(const ml_tp *tp, const ml_param *p) {
  return !p->frozen && ml_tp_grad_partial(tp, p);
}

/* Whether p is a k_proj / v_proj with shared kv heads whose gradient rows
 * are summed over their holders (a frozen parameter has none). */
static bool kv_shared(const ml_tp *tp, const ml_param *p) {
  return !p->frozen && tp->n_kv_shared > 0 &&
         tp->param_heads[p - tp->model->params] == ML_TP_KV_HEADS;
}

/* Whether p's gradient takes a tp step after backward: Partial, or the
 * rows of a k_proj / v_proj that holds shared kv heads. */
static bool tp_reduced(const ml_tp *tp, const ml_param *p) {
  return partial(tp, p) || kv_shared(tp, p);
}

/* Each (unit, index) whose gradient takes a tp step, in unit order: calls
 * fn with its shard gradient [k floats]; stops at the first error. */
typedef int (*grad_fn)(ml_grads *gs, ml_tp *tp, const ml_fsdp_unit *u, float *g, size_t k,
                       size_t *off);
static int each_reduced(ml_grads *gs, ml_tp *tp, ml_fsdp *f, grad_fn fn, size_t *off) {
  *off = 0;
  for (int u = 0; u < f->n_units; u++) {
    ml_fsdp_unit *unit = &f->units[u];
    for (int i = 0; i < unit->n; i++) {
      if (!tp_reduced(tp, unit->params[i])) continue;
      size_t k = (size_t)(unit->chunk_rows[i] * unit->params[i]->local[1]);
      ML_TRY(fn(gs, tp, unit, unit->shard_grad + unit->shard_off[i], k, off));
    }
  }
  return 0;
}

static int count_rows(ml_grads *gs, ml_tp *tp, const ml_fsdp_unit *u, float *g, size_t k,
                      size_t *off) {
  *off += k;
  return 0;
}
// stash (=) g; g (=) 0 (where the shards live: on their backend)
static int stash_rows(ml_grads *gs, ml_tp *tp, const ml_fsdp_unit *u, float *g, size_t k,
                      size_t *off) {
  ml_backend *be = gs->f->shard_be;
  ML_TRY(ml_be_copy(be, gs->stash + *off, g, k * sizeof(float), ML_COPY_D2D));
  *off += k;
  return ml_be_zero(be, g, k * sizeof(float));
}
// g += stash
static int unstash_rows(ml_grads *gs, ml_tp *tp, const ml_fsdp_unit *u, float *g, size_t k,
                        size_t *off) {
  ML_TRY(ml_be_add(gs->f->shard_be, g, gs->stash + *off, (int64_t)k));
  *off += k;
  return 0;
}

int ml_grads_tp_begin(ml_grads *gs, ml_tp *tp, ml_fsdp *f) {
  if (tp->size == 1) return 0;
  size_t n;
  ML_TRY(each_reduced(gs, tp, f, count_rows, &n));
  if (n == 0) return 0;
  for (int u = 0; u < f->n_units; u++) /* the stash reads them: a fresh unit's as zeros */
    for (int i = 0; i < f->units[u].n; i++)
      if (tp_reduced(tp, f->units[u].params[i])) {
        ML_TRY(ml_fsdp_settle_grad(f, &f->units[u]));
        break;
      }
  if (!gs->stash) {
    gs->f = f;
    gs->stash = ml_fsdp_shard_alloc(f, (int64_t)n, sizeof(float),
                                    "the gradients accumulated before a micro-batch's tp step "
                                    "(%zu floats)",
                                    n);
    if (!gs->stash) return -1;
  }
  return each_reduced(gs, tp, f, stash_rows, &n);
}

/* The Partial gradients: one all-reduce of their shard rows over tp. */
static int reduce_partial(ml_tp *tp, ml_fsdp *f) {
  if (tp->n_partial == 0) return 0;
  size_t n = 0;
  for (int pass = 0; pass < 2; pass++) {
    float *buf = pass ? ml_tp_work(tp, n) : NULL;
    if (pass && !buf) return -1;
    size_t off = 0;
    for (int u = 0; u < f->n_units; u++) {
      ml_fsdp_unit *unit = &f->units[u];
      for (int i = 0; i < unit->n; i++) {
        if (!partial(tp, unit->params[i])) continue;
        size_t k = (size_t)(unit->chunk_rows[i] * unit->params[i]->local[1]);
        if (pass)
          ML_TRY(ml_be_copy(tp->be, buf + off, unit->shard_grad + unit->shard_off[i],
                            k * sizeof(float), ml_fsdp_shard_to_device(f)));
        off += k;
      }
    }
    if (!pass) {
      n = off;
      if (n == 0) return 0; /* every Partial gradient frozen */
      continue;
    }
    ML_TRY(ml_all_reduce(tp->comm, buf, n, ML_ELEM_F32, ML_RED_SUM));
    off = 0;
    for (int u = 0; u < f->n_units; u++) {
      ml_fsdp_unit *unit = &f->units[u];
      for (int i = 0; i < unit->n; i++) {
        if (!partial(tp, unit->params[i])) continue;
        size_t k = (size_t)(unit->chunk_rows[i] * unit->params[i]->local[1]);
        ML_TRY(ml_be_copy(tp->be, unit->shard_grad + unit->shard_off[i], buf + off,
                          k * sizeof(float), ml_fsdp_device_to_shard(f)));
        off += k;
      }
    }
  }
  return 0;
}

/* The shared kv heads' rows of a k_proj / v_proj shard gradient g (local
 * rows r0.. of the rank's slice starting at global row `first`, where f's
 * shards live) and the packed device buffer [n_kv_shared · hd rows, cols]
 * (to_buf: g → buf, else back). */
static int shared_rows(ml_tp *tp, const ml_fsdp *f, const ml_param *p, float *g, int64_t r0,
                       int64_t nr, int64_t first, float *buf, bool to_buf) {
  int64_t hd = tp->model->cfg.head_dim, cols = p->local[1];
  for (int j = 0; j < tp->n_kv_shared; j++) {
    int64_t a = tp->kv_shared[j] * hd, b = a + hd; /* the head's global rows */
    int64_t lo = a > first + r0 ? a : first + r0, hi = b < first + r0 + nr ? b : first + r0 + nr;
    if (lo >= hi) continue;
    float *row_g = g + (lo - first - r0) * cols, *row_b = buf + (j * hd + lo - a) * cols;
    size_t bytes = sizeof(float) * (size_t)((hi - lo) * cols);
    ML_TRY(ml_be_copy(tp->be, to_buf ? row_b : row_g, to_buf ? row_g : row_b, bytes,
                      to_buf ? ml_fsdp_shard_to_device(f) : ml_fsdp_device_to_shard(f)));
  }
  return 0;
}

/* The shared kv heads' partial gradients: summed over every (tp, dp) rank
 * holding their rows, packed per parameter in unit order. */
static int reduce_kv_shared(ml_tp *tp, ml_fsdp *f) {
  if (tp->n_kv_shared == 0) return 0;
  int64_t hd = tp->model->cfg.head_dim, n = 0;
  for (int pass = 0; pass < 2; pass++) {
    float *buf = pass ? ml_tp_work(tp, (size_t)n) : NULL;
    if (pass && !buf) return -1;
    if (pass) ML_TRY(ml_be_zero(tp->be, buf, sizeof(float) * (size_t)n));
    for (int dir = 0; dir < (pass ? 2 : 1); dir++) {
      int64_t off = 0;
      for (int u = 0; u < f->n_units; u++) {
        ml_fsdp_unit *unit = &f->units[u];
        for (int i = 0; i < unit->n; i++) {
          ml_param *p = unit->params[i];
          if (!kv_shared(tp, p)) continue;
          int64_t r0, nr;
          ml_fsdp_param_rows(f, unit, i, &r0, &nr);
          if (pass)
            ML_TRY(shared_rows(tp, f, p, unit->shard_grad + unit->shard_off[i], r0, nr,
                               p->offset[0], buf + off, dir == 0));
          off += tp->n_kv_shared * hd * p->local[1];
        }
      }
      n = off;
      if (n == 0) return 0; /* every shared kv head's projection frozen */
      if (pass && dir == 0) {
        ML_TRY(ml_all_reduce(tp->comm, buf, (size_t)n, ML_ELEM_F32, ML_RED_SUM));
        if (f->dp->size > 1) ML_TRY(ml_all_reduce(f->dp, buf, (size_t)n, ML_ELEM_F32, ML_RED_SUM));
      }
    }
  }
  return 0;
}

int ml_grads_tp_reduce(ml_grads *gs, ml_tp *tp, ml_fsdp *f) {
  if (tp->size == 1) return 0;
  ML_TRY(reduce_partial(tp, f));
  ML_TRY(reduce_kv_shared(tp, f));
  size_t n;
  return gs->stash ? each_reduced(gs, tp, f, unstash_rows, &n) : 0;
}

bool ml_grads_tp_stepped(const ml_tp *tp, const ml_param *p) {
  return tp->size > 1 && tp_reduced(tp, p);
}

void ml_grads_free(ml_grads *gs) {
  if (gs->f) ml_fsdp_shard_free(gs->f, gs->stash);
  gs->stash = NULL;
  gs->f = NULL;
}
