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

bool ml_fsdp_reshard_after_forward(int u, int n_units) { return u < n_units - 2; }

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
  if (f->dp->size == 1) { /* the shard is the whole TP-local tensor */
    u->full = u->shard;
    point_params(u, u->full, 0);
  }
  return 0;
}

int ml_fsdp_init(ml_fsdp *f, ml_model *m, ml_comm *dp, const ml_ckpt *ck) {
  memset(f, 0, sizeof *f);
  f->dp = dp;
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
    unit->reshard_after_forward = ml_fsdp_reshard_after_forward(u, f->n_units);
  }
  int64_t max_shard = 0;
  for (int u = 0; u < f->n_units; u++) {
    ML_TRY(unit_init(f, &f->units[u], ck));
    if (f->units[u].shard_numel > max_shard) max_shard = f->units[u].shard_numel;
  }
  if (dp->size > 1) {
    f->comm_buf = ml_malloc(sizeof(float) * (size_t)(max_shard * dp->size), "fsdp comm buffer");
    f->grad_buf = ml_malloc(sizeof(float) * (size_t)max_shard, "fsdp grad buffer");
    if (!f->comm_buf || !f->grad_buf) return -1;
  }
  return 0;
}

void ml_fsdp_destroy(ml_fsdp *f) {
  if (f->units) {
    for (int u = 0; u < f->n_units; u++) {
      ml_fsdp_unit *unit = &f->units[u];
      if (f->dp->size > 1) {
        free(unit->full);
        free(unit->full_grad);
      }
      free(unit->shard);
      free(unit->chunk_rows);
    }
    free(f->units[0].params); /* the slots array */
  }
  free(f->units);
  free(f->comm_buf);
  free(f->grad_buf);
  memset(f, 0, sizeof *f);
}

/* Copy between the rank-major gathered layout and the unsharded buffer. */
static void copy_rank_major(const ml_fsdp *f, const ml_fsdp_unit *u, float *full, int to_full) {
  int dp = f->dp->size;
  for (int r = 0; r < dp; r++) {
    float *chunk_base = f->comm_buf + (int64_t)r * u->shard_numel;
    for (int i = 0; i < u->n; i++) {
      const ml_param *p = u->params[i];
      int64_t c = u->chunk_rows[i], cols = p->local[1], rows = p->local[0];
      int64_t r0 = c * r < rows ? c * r : rows, nr = (c * r + c < rows ? c * r + c : rows) - r0;
      float *full_rows = full + u->full_off[i] + r0 * cols;
      float *chunk = chunk_base + u->shard_off[i];
      size_t bytes = sizeof(float) * (size_t)(nr * cols);
      if (to_full) memcpy(full_rows, chunk, bytes);
      else {
        memcpy(chunk, full_rows, bytes);
        memset(chunk + nr * cols, 0, sizeof(float) * (size_t)((c - nr) * cols));
      }
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
  copy_rank_major(f, unit, dst, 1);
  return 0;
}

int ml_fsdp_unshard(ml_fsdp *f, int u) {
  ml_fsdp_unit *unit = &f->units[u];
  if (unit->full) return 0;
  unit->full = ml_malloc(sizeof(float) * (size_t)unit->full_numel, "unsharded parameters");
  if (!unit->full) return -1;
  ML_TRY(ml_fsdp_gather_flat(f, u, unit->shard, unit->full));
  point_params(unit, unit->full, 0);
  return 0;
}

void ml_fsdp_reshard(ml_fsdp *f, int u) {
  ml_fsdp_unit *unit = &f->units[u];
  if (f->dp->size == 1 || !unit->full) return;
  free(unit->full);
  unit->full = NULL;
  point_params(unit, NULL, 0);
}

int ml_fsdp_grad_begin(ml_fsdp *f, int u) {
  ml_fsdp_unit *unit = &f->units[u];
  if (f->dp->size == 1) { /* backward accumulates straight into the shard's grads */
    point_params(unit, unit->shard_grad, 1);
    return 0;
  }
  unit->full_grad = ml_calloc((size_t)unit->full_numel, sizeof(float), "unsharded gradients");
  if (!unit->full_grad) return -1;
  point_params(unit, unit->full_grad, 1);
  return 0;
}

int ml_fsdp_reduce_grads(ml_fsdp *f, int u) {
  ml_fsdp_unit *unit = &f->units[u];
  point_params(unit, NULL, 1);
  if (f->dp->size == 1) return 0;
  copy_rank_major(f, unit, unit->full_grad, 0);
  free(unit->full_grad);
  unit->full_grad = NULL;
  ML_TRY(ml_reduce_scatter(f->dp, f->comm_buf, f->grad_buf, (size_t)unit->shard_numel));
  for (int64_t k = 0; k < unit->shard_numel; k++) unit->shard_grad[k] += f->grad_buf[k];
  return 0;
}

int ml_fsdp_sync_params(ml_fsdp *f) {
  (void)f;
  return 0;
}
