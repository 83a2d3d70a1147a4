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
static ml_elem param_elem(const ml_fsdp *f) {
  return f->opts.param_dtype == ML_BF16 ? ML_ELEM_BF16 : ML_ELEM_F32;
}

static int unit_layout(ml_fsdp *f, ml_fsdp_unit *u) {
  u->chunk_rows = ml_calloc((size_t)u->n * 3, sizeof(int64_t), "fsdp layout");
  if (!u->chunk_rows) return -1;
  u->shard_off = u->chunk_rows + u->n;
  u->full_off = u->shard_off + u->n;
  ml_fsdp_layout(u->params, u->n, f->dp->size, u->chunk_rows, u->shard_off, u->full_off,
                 &u->shard_numel, &u->full_numel);
  return 0;
}

/* Read this rank's rows of p's TP-local tensor from the checkpoint. */
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
  int64_t row0 = r0 + (p->tp_dim == 0 ? p->tp_start : 0);
  int64_t col0 = p->tp_dim == 1 ? p->tp_start : 0;
  return ml_st_read_block(t, row0, nr, col0, p->local[1], u->shard + u->shard_off[i]);
}

static void point_params(ml_fsdp_unit *u, float *base, int grads) {
  for (int i = 0; i < u->n; i++) {
    float *ptr = base ? base + u->full_off[i] : NULL;
    if (grads) u->params[i]->grad = ptr;
    else u->params[i]->data = ptr;
  }
}

static int unit_init(ml_fsdp *f, ml_fsdp_unit *u, const ml_ckpt *ck) {
  ML_TRY(unit_layout(f, u));
  size_t n = (size_t)u->shard_numel;
  u->shard = ml_calloc(n * 4, sizeof(float), "fsdp shard, grads and AdamW state");
  if (!u->shard) return -1;
  u->shard_grad = u->shard + n;
  u->adam_m = u->shard_grad + n;
  u->adam_v = u->adam_m + n;
  for (int i = 0; i < u->n; i++) ML_TRY(load_param(f, u, i, ck));
  if (params_alias(f)) { /* the shard is the whole TP-local tensor */
    u->full = u->shard;
    point_params(u, u->full, 0);
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
    for (int i = 0; i < m->n_params; i++)
      if (m->params[i].unit == u) unit->params[unit->n++] = &m->params[i];
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
    size_t n = (size_t)(max_shard * dp->size);
    f->comm_buf = ml_malloc(sizeof(float) * n, "fsdp comm buffer");
    f->grad_buf = ml_malloc(sizeof(float) * (size_t)max_shard, "fsdp grad buffer");
    if (opts->reduce_dtype == ML_BF16) f->wire = ml_malloc(sizeof(uint16_t) * n, "fsdp bf16 wire buffer");
    if (!f->comm_buf || !f->grad_buf || (opts->reduce_dtype == ML_BF16 && !f->wire)) return -1;
  }
  return ml_fsdp_sync_params(f);
}

void ml_fsdp_destroy(ml_fsdp *f) {
  if (f->units) {
    for (int u = 0; u < f->n_units; u++) {
      ml_fsdp_unit *unit = &f->units[u];
      if (unit->in_flight) ml_wait(f->dp, &unit->req);
      if (unit->send != unit->shard) free(unit->send);
      free(unit->recv);
      if (!params_alias(f)) free(unit->full);
      if (!grads_alias(f)) free(unit->full_grad);
      free(unit->shard);
      free(unit->chunk_rows);
    }
    free(f->units[0].params); /* the slots array */
  }
  free(f->units);
  free(f->comm_buf);
  free(f->grad_buf);
  free(f->wire);
  memset(f, 0, sizeof *f);
}

/* Copy between the rank-major gathered layout `wire` (dp blocks of
 * shard_numel elements of `elem`, fp32 or bf16) and the unsharded fp32
 * buffer `full`: to_full widens, the other way rounds and zero-pads. */
static void copy_rank_major(const ml_fsdp *f, const ml_fsdp_unit *u, void *wire, ml_elem elem,
                            float *full, int to_full) {
  int dp = f->dp->size;
  size_t es = ml_elem_size(elem);
  for (int r = 0; r < dp; r++) {
    char *block = (char *)wire + es * (size_t)(r * u->shard_numel);
    for (int i = 0; i < u->n; i++) {
      const ml_param *p = u->params[i];
      int64_t c = u->chunk_rows[i], cols = p->local[1], rows = p->local[0];
      int64_t r0 = c * r < rows ? c * r : rows, nr = (c * r + c < rows ? c * r + c : rows) - r0;
      float *full_rows = full + u->full_off[i] + r0 * cols;
      char *chunk = block + es * (size_t)u->shard_off[i];
      size_t n = (size_t)(nr * cols), pad = (size_t)((c - nr) * cols);
      if (elem == ML_ELEM_BF16 && to_full) ml_convert_to_f32(ML_BF16, chunk, full_rows, n);
      else if (elem == ML_ELEM_BF16) ml_convert_from_f32(ML_BF16, full_rows, chunk, n);
      else if (to_full) memcpy(full_rows, chunk, sizeof(float) * n);
      else memcpy(chunk, full_rows, sizeof(float) * n);
      if (!to_full) memset(chunk + es * n, 0, es * pad);
    }
  }
}

int ml_fsdp_gather_flat(ml_fsdp *f, int u, const float *src, float *dst) {
  ml_fsdp_unit *unit = &f->units[u];
  if (f->dp->size == 1) {
    memcpy(dst, src, sizeof(float) * (size_t)unit->full_numel);
    return 0;
  }
  ML_TRY(ml_all_gather(f->dp, src, f->comm_buf, (size_t)unit->shard_numel));
  copy_rank_major(f, unit, f->comm_buf, ML_ELEM_F32, dst, 1);
  return 0;
}

/* Start the all-gather of unit u's shard in param_dtype into unit->recv. */
static int gather_start(ml_fsdp *f, ml_fsdp_unit *unit) {
  size_t n = (size_t)unit->shard_numel, es = ml_elem_size(param_elem(f));
  unit->send = unit->shard;
  if (param_elem(f) == ML_ELEM_BF16) {
    unit->send = ml_malloc(es * n, "bf16 parameter shard");
    if (!unit->send) return -1;
    ml_convert_from_f32(ML_BF16, unit->shard, unit->send, n);
  }
  unit->recv = ml_malloc(es * n * (size_t)f->dp->size, "gathered parameters");
  if (!unit->recv) return -1;
  if (f->dp->size == 1) { /* nothing to gather: the "gathered" block is the shard */
    memcpy(unit->recv, unit->send, es * n);
    return 0;
  }
  ML_TRY(ml_iall_gather(f->dp, unit->send, unit->recv, n, param_elem(f), &unit->req));
  unit->in_flight = true;
  return 0;
}

/* Wait for unit u's all-gather and copy it out into the unsharded buffer. */
static int gather_finish(ml_fsdp *f, ml_fsdp_unit *unit) {
  int rc = unit->in_flight ? ml_wait(f->dp, &unit->req) : 0;
  unit->in_flight = false;
  if (rc == 0 && !unit->full) {
    unit->full = ml_malloc(sizeof(float) * (size_t)unit->full_numel, "unsharded parameters");
    if (!unit->full) rc = -1;
  }
  if (rc == 0) {
    copy_rank_major(f, unit, unit->recv, param_elem(f), unit->full, 1);
    point_params(unit, unit->full, 0);
  }
  if (unit->send != unit->shard) free(unit->send);
  free(unit->recv);
  unit->send = unit->recv = NULL;
  return rc;
}

int ml_fsdp_prefetch(ml_fsdp *f, int u) {
  if (u < 0 || u >= f->n_units) return 0;
  ml_fsdp_unit *unit = &f->units[u];
  if (unit->full || unit->in_flight) return 0;
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
  free(unit->full);
  unit->full = NULL;
  point_params(unit, NULL, 0);
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
    point_params(unit, unit->shard_grad, 1);
    return 0;
  }
  unit->full_grad = ml_calloc((size_t)unit->full_numel, sizeof(float), "unsharded gradients");
  if (!unit->full_grad) return -1;
  point_params(unit, unit->full_grad, 1);
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
  if (f->opts.param_dtype == ML_BF16) ml_round_bf16(unit->full_grad, (size_t)unit->full_numel);
  void *stage = bf16 ? (void *)f->wire : (void *)f->comm_buf;
  copy_rank_major(f, unit, stage, elem, unit->full_grad, 0);
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
    ml_convert_to_f32(ML_BF16, red, f->grad_buf, n);
    g = f->grad_buf;
  }
  for (size_t k = 0; k < n; k++) unit->shard_grad[k] += g[k];
  return 0;
}

int ml_fsdp_reduce_grads(ml_fsdp *f, int u) {
  ml_fsdp_unit *unit = &f->units[u];
  point_params(unit, NULL, 1);
  if (grads_alias(f)) return 0;
  int rc = reduce_unit(f, unit);
  free(unit->full_grad);
  unit->full_grad = NULL;
  return rc;
}
