#include "parallel/fsdp.h"

#include <stdlib.h>
#include <string.h>

#include "common/status.h"

void ml_fsdp_param_rows(const ml_fsdp *f, const ml_fsdp_unit *unit, int i, int64_t *r0,
                        int64_t *nr) {
  int64_t rows = unit->params[i]->local[0], c = unit->chunk_rows[i];
  int64_t s = c * f->dp->rank;
  *r0 = s < rows ? s : rows;
  *nr = (s + c < rows ? s + c : rows) - *r0;
}

int ml_fsdp_unit_of(const ml_model *m, const ml_param *p) {
  return p->layer >= 0 ? p->layer : (int)m->cfg.n_layers;
}

int ml_fsdp_unit_params(const ml_model *m, int u, ml_param **out) {
  int n = 0;
  for (int i = 0; i < m->n_params; i++)
    if (ml_fsdp_unit_of(m, &m->params[i]) == u) out[n++] = &m->params[i];
  return n;
}

int ml_fsdp_param_index(const ml_fsdp_unit *unit, const ml_param *p) {
  for (int i = 0; i < unit->n; i++)
    if (unit->params[i] == p) return i;
  return -1;
}

/* Plain int64 sums: the parameters come from a config that passed
 * ml_model_config_load's limits (config.h), so a unit holds < 2^47
 * elements, and its padded shard c·cols summed over the unit is at most
 * that / dp + (its columns, < 2^30). */
void ml_fsdp_layout(ml_param *const *params, int n, int dp, int64_t *chunk_rows,
                    int64_t *shard_off, int64_t *full_off, int64_t *shard_numel,
                    int64_t *full_numel) {
  int64_t shard = 0, full = 0;
  for (int i = 0; i < n; i++) {
    const ml_param *p = params[i];
    int64_t c = (p->local[0] + dp - 1) / dp;
    if (chunk_rows) chunk_rows[i] = c;
    if (shard_off) shard_off[i] = shard;
    if (full_off) full_off[i] = full;
    shard += c * p->local[1];
    full += ml_param_numel(p);
  }
  *shard_numel = shard;
  *full_numel = full;
}

bool ml_fsdp_reshard_after_forward(ml_reshard_policy policy, int u, int n_units) {
  if (u == n_units - 1) return false; /* the root: its head runs forward and backward per chunk */
  if (policy != ML_RESHARD_DEFAULT) return policy == ML_RESHARD_ALWAYS;
  return u < n_units - 2;
}

/* Unsharded parameters kept between steps (ZeRO-1/2). */
static bool persistent(const ml_fsdp *f) { return f->opts.zero < 3; }
/* The shard is the unsharded fp32 tensor (one rank, fp32 params). */
static bool params_alias(const ml_fsdp *f) {
  return f->dp->size == 1 && f->opts.param_dtype == ML_F32;
}
/* Backward accumulates straight into shard_grad: nothing to reduce or round. */
static bool grads_alias(const ml_fsdp *f) {
  return params_alias(f) && f->rep->size == 1 && f->opts.reduce_dtype == ML_F32;
}
static ml_elem elem_of(ml_dtype t) { return t == ML_BF16 ? ML_ELEM_BF16 : ML_ELEM_F32; }
static ml_dtype dtype_of(ml_elem e) { return e == ML_ELEM_BF16 ? ML_BF16 : ML_F32; }
static ml_elem param_elem(const ml_fsdp *f) { return elem_of(f->opts.param_dtype); }

static int unit_layout(ml_fsdp *f, ml_fsdp_unit *u) {
  u->chunk_rows = ml_calloc((size_t)u->n * 3, sizeof(int64_t), "fsdp layout");
  if (!u->chunk_rows) return -1;
  u->shard_off = u->chunk_rows + u->n;
  u->full_off = u->shard_off + u->n;
  ml_fsdp_layout(u->params, u->n, f->dp->size, u->chunk_rows, u->shard_off, u->full_off,
                 &u->shard_numel, &u->full_numel);
  return 0;
}

/* Read this rank's rows of p's TP-local tensor from the checkpoint into
 * host staging, then copy them into the shard on the device. */
static int load_param(ml_fsdp *f, ml_fsdp_unit *u, int i, const ml_ckpt *ck) {
  const ml_param *p = u->params[i];
  const ml_st_tensor *t = ml_ckpt_find(ck, p->name);
  if (!t) return ml_err("%s: checkpoint has no tensor '%s'", ck->dir, p->name);
  int64_t want1 = p->ndim == 2 ? p->shape[1] : 0, got1 = t->ndim == 2 ? t->shape[1] : 0;
  if (t->ndim != p->ndim || t->shape[0] != p->shape[0] || got1 != want1)
    return ml_err("%s: tensor '%s' has shape [%lld%s%lld] (ndim %d); expected [%lld%s%lld] from "
                  "config.json",
                  ck->dir, p->name, (long long)t->shape[0], t->ndim == 2 ? ", " : "",
                  (long long)got1, t->ndim, (long long)p->shape[0], p->ndim == 2 ? ", " : "",
                  (long long)want1);
  int64_t r0, nr;
  ml_fsdp_param_rows(f, u, i, &r0, &nr);
  if (nr == 0) return 0;
  int64_t row0 = p->offset[0] + r0, col0 = p->offset[1]; /* in the global tensor */
  int64_t n = nr * p->local[1]; /* rows of a parameter's chunk: bounded (ml_fsdp_layout) */
  float *stage = ml_be_host_alloc(f->be, n, sizeof(float), "loading '%s'", p->name);
  if (!stage) return -1;
  int rc = ml_st_read_block(t, row0, nr, col0, p->local[1], stage);
  if (rc == 0)
    rc = ml_be_copy(f->be, u->shard + u->shard_off[i], stage, sizeof(float) * (size_t)n,
                    ML_COPY_H2D);
  ml_be_host_free(f->be, stage);
  return rc;
}

/* Point the unit's parameters at their places in `base`, the unsharded
 * buffer of `type` (NULL: not materialised). */
static void point_data(ml_fsdp_unit *u, void *base, ml_dtype type) {
  for (int i = 0; i < u->n; i++) {
    u->params[i]->data = base ? (char *)base + ml_dtype_size(type) * (size_t)u->full_off[i] : NULL;
    u->params[i]->dtype = type;
  }
}

/* The same for the unsharded fp32 gradients. */
static void point_grads(ml_fsdp_unit *u, float *base) {
  for (int i = 0; i < u->n; i++) u->params[i]->grad = base ? base + u->full_off[i] : NULL;
}

static int unit_init(ml_fsdp *f, ml_fsdp_unit *u, const ml_ckpt *ck) {
  ML_TRY(unit_layout(f, u));
  size_t n = (size_t)u->shard_numel; /* bounded (ml_fsdp_layout): 4n floats fit */
  u->shard = ml_be_alloc(f->be, 4 * u->shard_numel, sizeof(float),
                         "the FSDP shard, its gradient and AdamW state (%d parameters)", u->n);
  if (!u->shard) return -1;
  ML_TRY(ml_be_zero(f->be, u->shard, 4 * n * sizeof(float))); /* padding rows stay 0 */
  u->shard_grad = u->shard + n;
  u->adam_m = u->shard_grad + n;
  u->adam_v = u->adam_m + n;
  for (int i = 0; ck && i < u->n; i++) ML_TRY(load_param(f, u, i, ck));
  if (params_alias(f)) { /* the shard is the whole TP-local tensor */
    u->full = u->shard;
    point_data(u, u->full, ML_F32);
  }
  return 0;
}

static int check_opts(const ml_fsdp_opts *o) {
  if (o->param_dtype != ML_F32 && o->param_dtype != ML_BF16)
    return ml_err("fsdp param_dtype %s: expected fp32 or bf16", ml_dtype_name(o->param_dtype));
  if (o->reduce_dtype != ML_F32 && o->reduce_dtype != ML_BF16)
    return ml_err("fsdp reduce_dtype %s: expected fp32 or bf16", ml_dtype_name(o->reduce_dtype));
  if (o->zero < 1 || o->zero > 3) return ml_err("zero stage %d: expected 1, 2 or 3", o->zero);
  if (o->prefetch_forward < 0 || o->prefetch_backward < 0)
    return ml_err("fsdp prefetch depths %d (forward), %d (backward): expected >= 0",
                  o->prefetch_forward, o->prefetch_backward);
  return 0;
}

int ml_fsdp_init(ml_fsdp *f, ml_model *m, ml_comm *dp, ml_comm *rep, const ml_fsdp_opts *opts,
                 const ml_ckpt *ck) {
  memset(f, 0, sizeof *f);
  ML_TRY(check_opts(opts));
  if (!m->be) return ml_err("ml_fsdp_init: the model has no backend (ml_model.be)");
  f->be = m->be;
  f->dp = dp;
  f->rep = rep;
  f->opts = *opts;
  f->n_units = (int)m->cfg.n_layers + 1;
  f->units = ml_calloc((size_t)f->n_units, sizeof *f->units, "fsdp units");
  ml_param **slots = ml_calloc((size_t)m->n_params, sizeof *slots, "fsdp units");
  if (!f->units || !slots) {
    free(slots);
    return -1;
  }
  /* slots holds every parameter, grouped by unit */
  int used = 0;
  for (int u = 0; u < f->n_units; u++) {
    ml_fsdp_unit *unit = &f->units[u];
    unit->params = slots + used;
    unit->n = ml_fsdp_unit_params(m, u, unit->params);
    used += unit->n;
    unit->reshard_after_forward =
        ml_fsdp_reshard_after_forward(opts->reshard_after_forward, u, f->n_units);
  }
  int64_t max_shard = 0;
  for (int u = 0; u < f->n_units; u++) {
    ML_TRY(unit_init(f, &f->units[u], ck));
    if (f->units[u].shard_numel > max_shard) max_shard = f->units[u].shard_numel;
  }
  if (!grads_alias(f)) {
    /* dp shards of a unit: its elements plus at most dp - 1 padding rows (bounded, see
     * ml_fsdp_layout) */
    int64_t n = max_shard * dp->size;
    f->comm_buf = ml_be_alloc(f->be, n, sizeof(float), "the FSDP communication buffer");
    f->grad_buf = ml_be_alloc(f->be, max_shard, sizeof(float), "the FSDP gradient buffer");
    if (opts->reduce_dtype == ML_BF16)
      f->wire = ml_be_alloc(f->be, n, sizeof(uint16_t), "the FSDP bf16 gradient buffer");
    if (!f->comm_buf || !f->grad_buf || (opts->reduce_dtype == ML_BF16 && !f->wire)) return -1;
  }
  return ml_fsdp_sync_params(f);
}

void ml_fsdp_destroy(ml_fsdp *f) {
  if (f->units) {
    for (int u = 0; u < f->n_units; u++) {
      ml_fsdp_unit *unit = &f->units[u];
      if (unit->in_flight) ml_wait(f->dp, &unit->req);
      if (unit->send != unit->shard) ml_be_free(f->be, unit->send);
      if (unit->recv != unit->send) ml_be_free(f->be, unit->recv); /* one rank: the same */
      if (!params_alias(f)) ml_be_free(f->be, unit->full);
      if (!grads_alias(f)) ml_be_free(f->be, unit->full_grad);
      ml_be_free(f->be, unit->shard);
      free(unit->chunk_rows);
    }
    free(f->units[0].params); /* the slots array */
  }
  free(f->units);
  if (f->be) {
    ml_be_free(f->be, f->comm_buf);
    ml_be_free(f->be, f->grad_buf);
    ml_be_free(f->be, f->wire);
  }
  memset(f, 0, sizeof *f);
}

/* Copy between the rank-major gathered layout `wire` (dp blocks of
 * shard_numel elements of `elem`) and the unsharded buffer `full` of
 * `type`, converting where the types differ (widening exact, narrowing
 * rounds to nearest-even); the way to `wire` zero-pads each chunk. */
static int copy_rank_major(const ml_fsdp *f, const ml_fsdp_unit *u, void *wire, ml_elem elem,
                           void *full, ml_dtype type, int to_full) {
  int dp = f->dp->size;
  size_t es = ml_elem_size(elem), fs = ml_dtype_size(type);
  ml_dtype wt = dtype_of(elem);
  for (int r = 0; r < dp; r++) {
    char *block = (char *)wire + es * (size_t)(r * u->shard_numel);
    for (int i = 0; i < u->n; i++) {
      const ml_param *p = u->params[i];
      int64_t c = u->chunk_rows[i], cols = p->local[1], rows = p->local[0];
      int64_t r0 = c * r < rows ? c * r : rows, nr = (c * r + c < rows ? c * r + c : rows) - r0;
      char *full_rows = (char *)full + fs * (size_t)(u->full_off[i] + r0 * cols);
      char *chunk = block + es * (size_t)u->shard_off[i];
      size_t n = (size_t)(nr * cols), pad = (size_t)((c - nr) * cols);
      if (to_full) {
        ML_TRY(ml_be_convert(f->be, full_rows, type, chunk, wt, n));
      } else {
        ML_TRY(ml_be_convert(f->be, chunk, wt, full_rows, type, n));
        ML_TRY(ml_be_zero(f->be, chunk + es * n, es * pad));
      }
    }
  }
  return 0;
}

int ml_fsdp_gather_flat(ml_fsdp *f, int u, const float *src, float *dst) {
  ml_fsdp_unit *unit = &f->units[u];
  if (f->dp->size == 1)
    return ml_be_copy(f->be, dst, src, sizeof(float) * (size_t)unit->full_numel, ML_COPY_D2D);
  ML_TRY(ml_all_gather(f->dp, src, f->comm_buf, (size_t)unit->shard_numel));
  return copy_rank_major(f, unit, f->comm_buf, ML_ELEM_F32, dst, ML_F32, 1);
}

/* Start the all-gather of unit u's shard in param_dtype into unit->recv. */
static int gather_start(ml_fsdp *f, ml_fsdp_unit *unit) {
  int64_t n = unit->shard_numel;
  ml_dtype pt = f->opts.param_dtype;
  size_t es = ml_dtype_size(pt);
  unit->send = unit->shard;
  if (pt != ML_F32) {
    unit->send = ml_be_alloc(f->be, n, es, "a %s parameter shard", ml_dtype_name(pt));
    if (!unit->send) return -1;
    ML_TRY(ml_be_convert(f->be, unit->send, pt, unit->shard, ML_F32, (size_t)n));
  }
  if (f->dp->size == 1) { /* nothing to gather: the "gathered" block is the shard */
    unit->recv = unit->send;
    return 0;
  }
  /* dp shards of a unit: bounded (ml_fsdp_layout) */
  unit->recv = ml_be_alloc(f->be, n * f->dp->size, es, "the gathered parameters of a unit");
  if (!unit->recv) return -1;
  ML_TRY(ml_iall_gather(f->dp, unit->send, unit->recv, (size_t)n, param_elem(f), &unit->req));
  unit->in_flight = true;
  return 0;
}

/* Wait for unit u's all-gather and copy it out into the unsharded buffer,
 * which keeps param_dtype (the GEMMs read it as it is). On one rank the
 * converted shard is that buffer already (same layout: no padding rows),
 * unless one is kept between steps (ZeRO-1/2). */
static int gather_finish(ml_fsdp *f, ml_fsdp_unit *unit) {
  int rc = unit->in_flight ? ml_wait(f->dp, &unit->req) : 0;
  unit->in_flight = false;
  ml_dtype pt = f->opts.param_dtype;
  void *adopt = f->dp->size == 1 && !unit->full && unit->send != unit->shard ? unit->send : NULL;
  if (rc == 0 && adopt) {
    unit->full = adopt;
  } else {
    if (rc == 0 && !unit->full) {
      unit->full = ml_be_alloc(f->be, unit->full_numel, ml_dtype_size(pt),
                               "the unsharded parameters of a unit");
      if (!unit->full) rc = -1;
    }
    if (rc == 0) rc = copy_rank_major(f, unit, unit->recv, param_elem(f), unit->full, pt, 1);
    if (unit->send != unit->shard) ml_be_free(f->be, unit->send);
    if (unit->recv != unit->send) ml_be_free(f->be, unit->recv);
  }
  if (rc == 0) point_data(unit, unit->full, pt);
  unit->send = unit->recv = NULL;
  return rc;
}

int ml_fsdp_prefetch(ml_fsdp *f, int u) {
  if (u < 0 || u >= f->n_units) return 0;
  ml_fsdp_unit *unit = &f->units[u];
  if (unit->full || unit->recv) return 0; /* materialised, or its gather started */
  return gather_start(f, unit);
}

int ml_fsdp_unshard(ml_fsdp *f, int u) {
  ml_fsdp_unit *unit = &f->units[u];
  if (unit->full && !unit->recv) return 0;
  if (!unit->recv) ML_TRY(gather_start(f, unit));
  return gather_finish(f, unit);
}

void ml_fsdp_reshard(ml_fsdp *f, int u) {
  ml_fsdp_unit *unit = &f->units[u];
  if (params_alias(f) || persistent(f) || !unit->full) return;
  ml_be_free(f->be, unit->full);
  unit->full = NULL;
  point_data(unit, NULL, f->opts.param_dtype);
}

int ml_fsdp_sync_params(ml_fsdp *f) {
  if (params_alias(f) || !persistent(f)) return 0;
  for (int u = 0; u < f->n_units; u++) {
    ML_TRY(gather_start(f, &f->units[u]));
    ML_TRY(gather_finish(f, &f->units[u]));
  }
  return 0;
}

int ml_fsdp_grad_begin(ml_fsdp *f, int u) {
  ml_fsdp_unit *unit = &f->units[u];
  if (grads_alias(f)) { /* backward accumulates straight into the shard's grads */
    point_grads(unit, unit->shard_grad);
    return 0;
  }
  unit->full_grad = ml_be_alloc(f->be, unit->full_numel, sizeof(float),
                                "the unsharded gradients of a unit");
  if (!unit->full_grad) return -1;
  ML_TRY(ml_be_zero(f->be, unit->full_grad, sizeof(float) * (size_t)unit->full_numel));
  point_grads(unit, unit->full_grad);
  return 0;
}

/* The gradient reduction of one unit over dp (and the replicas) in
 * reduce_dtype: rank-major staging → reduce-scatter (ZeRO-1: all-reduce,
 * then this rank's block) → all-reduce over the replicas → += shard_grad. */
static int reduce_unit(ml_fsdp *f, ml_fsdp_unit *unit) {
  int dp = f->dp->size;
  size_t n = (size_t)unit->shard_numel;
  bool bf16 = f->opts.reduce_dtype == ML_BF16;
  ml_elem elem = bf16 ? ML_ELEM_BF16 : ML_ELEM_F32;
  size_t es = ml_elem_size(elem);
  if (f->opts.param_dtype == ML_BF16)
    ML_TRY(ml_be_round_bf16(f->be, unit->full_grad, (size_t)unit->full_numel));
  void *stage = bf16 ? (void *)f->wire : (void *)f->comm_buf;
  if (dp == 1 && !bf16) /* one rank's staging is full_grad itself: same layout, same type */
    stage = unit->full_grad;
  else
    ML_TRY(copy_rank_major(f, unit, stage, elem, unit->full_grad, ML_F32, 0));
  void *red = (char *)stage + es * n * (size_t)f->dp->rank; /* this rank's reduced block */
  if (dp > 1 && f->opts.zero == 1) {
    ML_TRY(ml_all_reduce(f->dp, stage, n * (size_t)dp, elem, ML_RED_SUM));
  } else if (dp > 1) {
    /* out of place; with bf16 the fp32 staging buffer is free to receive */
    red = bf16 ? (void *)f->comm_buf : (void *)f->grad_buf;
    ML_TRY(ml_reduce_scatter_t(f->dp, stage, red, n, elem));
  }
  if (f->rep->size > 1) ML_TRY(ml_all_reduce(f->rep, red, n, elem, ML_RED_SUM));
  float *g = red;
  if (bf16) {
    ML_TRY(ml_be_convert(f->be, f->grad_buf, ML_F32, red, ML_BF16, n));
    g = f->grad_buf;
  }
  return ml_be_add(f->be, unit->shard_grad, g, (int64_t)n);
}

int ml_fsdp_reduce_grads(ml_fsdp *f, int u) {
  ml_fsdp_unit *unit = &f->units[u];
  point_grads(unit, NULL);
  if (grads_alias(f)) return 0;
  int rc = reduce_unit(f, unit);
  ml_be_free(f->be, unit->full_grad);
  unit->full_grad = NULL;
  return rc;
}
