/* The global grad norm (engine.h ml_engine_grad_norm) and its partials
 * computed during backward (engine/grad_norm.h). */
#include "engine/grad_norm.h"

#include <math.h>
#include <stdlib.h>

#include "common/checked.h"
#include "common/status.h"
#include "engine/engine.h"

/* The piece of unit's parameter i this rank counts in the norm
 * (ml_engine_owned_rows): false when none (frozen: grad None, not in
 * clip_grad_norm_'s norm; no rows owned here). */
static bool owned_piece(const ml_engine *e, const ml_fsdp_unit *unit, int i, ml_norm_seg *seg) {
  if (unit->params[i]->frozen) return false;
  int64_t skip, nr, cols = unit->params[i]->local[1];
  ml_engine_owned_rows(e, unit, i, &skip, &nr);
  *seg = (ml_norm_seg){unit->shard_grad + unit->shard_off[i] + skip * cols, nr * cols};
  return nr > 0;
}

/* total (=) its fold with a partial s: + for the sum of squares, max for the inf-norm. */
static double fold(bool inf, double total, double s) { return inf ? fmax(total, s) : total + s; }

/* This rank's part of the norm in one pass: the sum of squares (norm_type
 * 2) or the max |g| (INFINITY) of the gradients it owns, each parameter
 * once, units in order. */
static int local_norm_part(const ml_engine *e, bool inf, double *total) {
  const ml_fsdp *f = &e->fsdp;
  *total = 0.0;
  for (int u = 0; u < f->n_units; u++) {
    const ml_fsdp_unit *unit = &f->units[u];
    for (int i = 0; i < unit->n; i++) {
      ml_norm_seg seg;
      if (!owned_piece(e, unit, i, &seg)) continue;
      double s;
      ML_TRY(ml_be_norm_partial(f->shard_be, seg.g, seg.n, inf ? ML_NORM_ABSMAX : ML_NORM_SUMSQ,
                                &s));
      *total = fold(inf, *total, s);
    }
  }
  return 0;
}

/* The same from the partials held for norm_type (one copy to the host): 1,
 * or 0 when none are held for it (then the one pass). They are taken. */
static int held_norm_part(ml_engine *e, double norm_type, double *total) {
  ml_norm_parts *np = &e->norm;
  if (np->have != norm_type || np->have == 0) return 0;
  np->have = 0;
  const ml_fsdp *f = &e->fsdp;
  if (np->dev != np->host) /* the one device-to-host copy of the step */
    ML_TRY(ml_be_copy(f->shard_be, np->host, np->dev, sizeof(double) * (size_t)np->used,
                      ML_COPY_D2H));
  bool inf = isinf(norm_type);
  *total = 0.0;
  for (int u = 0; u < f->n_units; u++) {
    const ml_fsdp_unit *unit = &f->units[u];
    for (int i = 0; i < unit->n; i++) {
      ml_norm_seg seg;
      if (owned_piece(e, unit, i, &seg))
        *total = fold(inf, *total, np->host[np->at[np->first[u] + i]]);
    }
  }
  return 1;
}

int ml_engine_grad_norm(ml_engine *e, double norm_type, double *norm) {
  bool inf = isinf(norm_type);
  if (!inf && norm_type != 2.0)
    return ml_err("grad norm type %g: expected 2 (L2) or inf", norm_type);
  double v;
  ML_TRY(ml_engine_train_state(e));
  ML_TRY(ml_fsdp_settle_grads(&e->fsdp)); /* a fresh unit's gradient reads as zeros */
  int held = held_norm_part(e, norm_type, &v);
  if (held < 0) return -1;
  if (!held) ML_TRY(local_norm_part(e, inf, &v));
  ML_TRY(ml_host_all_reduce_f64(ml_mesh_host(e->mesh, ML_GROUP_WORLD), &v, 1,
                                inf ? ML_RED_MAX : ML_RED_SUM));
  *norm = inf ? v : sqrt(v);
  return 0;
}

void ml_engine_norm_ahead(ml_engine *e, double norm_type) {
  e->norm.ahead = norm_type == 2.0 || isinf(norm_type) ? norm_type : 0.0;
}

/* ml_norm_parts_alloc's work; on an error the caller frees what it took. */
static int parts_alloc(ml_engine *e) {
  ml_norm_parts *np = &e->norm;
  const ml_fsdp *f = &e->fsdp;
  int64_t total = 0; /* a sum of n_units ints: no int64 overflow */
  np->first = ml_malloc_array(f->n_units ? f->n_units : 1, sizeof *np->first,
                              "the grad-norm slots' units (%d)", f->n_units);
  if (!np->first) return -1;
  for (int u = 0; u < f->n_units; u++) {
    np->first[u] = (int)total;
    total += f->units[u].n;
    if (total > INT32_MAX)
      return ml_err("grad-norm slots: more than %d parameters in the FSDP units; expected "
                    "fewer",
                    INT32_MAX);
  }
  int n = np->n = (int)total;
  int64_t cap = n ? n : 1; /* no parameter: a valid empty array */
  np->at = ml_malloc_array(cap, sizeof *np->at, "the grad-norm slots (%d parameters)", n);
  np->host = ml_malloc_array(cap, sizeof *np->host, "the grad-norm partials (%d)", n);
  np->segs = ml_malloc_array(cap, sizeof *np->segs, "the grad-norm pieces (%d)", n);
  if (!np->at || !np->host || !np->segs) return -1;
  /* where the shards' backend computes on host memory (CPU, cpu_offload) the partials are
     the host array itself: no pool block, no copy */
  np->dev = ml_be_host_memory(f->shard_be)
                ? np->host
                : ml_be_alloc(f->shard_be, cap, sizeof(double), "the grad-norm partials "
                              "(%d)", n);
  return np->dev ? 0 : -1;
}

int ml_norm_parts_alloc(ml_engine *e) {
  if (e->norm.dev) return 0;
  if (parts_alloc(e) == 0) return 0;
  ml_norm_parts_free(e);
  return -1;
}

void ml_norm_parts_free(ml_engine *e) {
  ml_norm_parts *np = &e->norm;
  if (np->dev && np->dev != np->host) ml_be_free(e->fsdp.shard_be, np->dev);
  free(np->first);
  free(np->at);
  free(np->host);
  free(np->segs);
  *np = (ml_norm_parts){0};
}

void ml_norm_parts_begin(ml_engine *e) {
  ml_norm_parts *np = &e->norm;
  np->have = 0;
  np->active = np->dev ? np->ahead : 0;
  np->ahead = 0;
  np->used = 0;
  for (int s = 0; np->active && s < np->n; s++) np->at[s] = -1;
}

/* The partials of unit u's counted parameters still without one, where
 * final(p) (every one: NULL), in one ml_be_norm_partials call. */
static int unit_parts(ml_engine *e, int u, bool (*final)(const ml_engine *, const ml_param *)) {
  ml_norm_parts *np = &e->norm;
  const ml_fsdp_unit *unit = &e->fsdp.units[u];
  int k = 0, at = np->used;
  for (int i = 0; i < unit->n; i++) {
    int s = np->first[u] + i;
    if (np->at[s] >= 0 || (final && !final(e, unit->params[i]))) continue;
    if (!owned_piece(e, unit, i, &np->segs[k])) continue;
    np->at[s] = at + k++;
  }
  np->used += k;
  return k ? ml_be_norm_partials(e->fsdp.shard_be, np->segs, k,
                                 isinf(np->active) ? ML_NORM_ABSMAX : ML_NORM_SUMSQ,
                                 np->dev + at)
           : 0;
}

/* Whether p's shard gradient is final once its unit is reduced: not under
 * cpu_offload (its copy to the host lands at the end of backward), nor one
 * the tp step changes. */
static bool final_at_reduce(const ml_engine *e, const ml_param *p) {
  return !e->fsdp.opts.cpu_offload && !ml_grads_tp_stepped(&e->tp, p);
}

int ml_norm_parts_unit(ml_engine *e, int u) {
  if (!e->norm.active) return 0;
  int w = e->fsdp.units[u].with; /* its expert unit, reduced with it */
  if (w >= 0) ML_TRY(unit_parts(e, w, final_at_reduce));
  return unit_parts(e, u, final_at_reduce);
}

int ml_norm_parts_finish(ml_engine *e) {
  ml_norm_parts *np = &e->norm;
  if (!np->active) return 0;
  for (int u = 0; u < e->fsdp.n_units; u++) ML_TRY(unit_parts(e, u, NULL));
  np->have = np->active;
  np->active = 0;
  return 0;
}

void ml_norm_parts_drop(ml_engine *e) { e->norm.have = 0; }
