/* Row-parallel linears computed whole in the batch-invariant mode (tp_whole.h). */
#include "parallel/tp_whole.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/status.h"
#include "parallel/tp_impl.h"
#include "tensor/dtype.h"

/* ml_whole_hook.cols over tp's group: dst [rows, K] (=) the [rows, K] matrix whose columns the
 * tp ranks hold as w's dim 1 is cut (ml_tp_param_slice: whole heads for o_proj, torch.chunk
 * otherwise), from this rank's columns src [rows, len] of dtype dt. Equal-size collective:
 * each rank's columns zero-padded to the widest rank's for the wire (as redistribute.h), then
 * placed at their offsets. */
static int gather_cols(void *ctx, const ml_param *w, const void *src, int64_t rows, ml_dtype dt,
                       void *dst) {
  ml_tp *tp = ctx;
  int t = tp->size;
  int64_t *start = ml_calloc(2 * (size_t)t, sizeof *start, "the tp ranks' column cuts");
  if (!start) return -1;
  int64_t *len = start + t, own, wide = 0, K = w->shape[1];
  for (int r = 0; r < t; r++) {
    ml_tp_param_slice(tp, tp->model, w, r, &start[r], &len[r], &own);
    if (len[r] > wide) wide = len[r];
  }
  size_t esz = ml_dtype_size(dt);
  // wire: [send: rows, wide | recv: t, rows, wide] (the size checked by the allocation)
  char *wire = ml_be_alloc(tp->be, ml_mul_sat(ml_mul_sat(t + 1, rows), wide), esz,
                           "the tp all-gather of %s's columns (%d ranks x %lld x %lld)", w->name,
                           t, (long long)rows, (long long)wide);
  if (!wire) {
    free(start);
    return -1;
  }
  size_t piece = (size_t)(rows * wide) * esz;
  char *recv = wire + piece;
  int64_t me = len[tp->rank];
  int rc = me < wide ? ml_be_zero(tp->be, wire, piece) : 0;
  if (!rc && me > 0 && rows > 0)
    rc = ml_be_copy2d(tp->be, wire, wide * esz, src, (size_t)me * esz, (size_t)me * esz,
                      (size_t)rows);
  if (!rc)
    rc = ml_all_gather_t(tp->comm, wire, recv, (size_t)(rows * wide),
                         dt == ML_BF16 ? ML_ELEM_BF16 : ML_ELEM_F32);
  for (int r = 0; r < t && !rc; r++)
    if (len[r] > 0 && rows > 0)
      rc = ml_be_copy2d(tp->be, (char *)dst + (size_t)start[r] * esz, (size_t)K * esz,
                        recv + (size_t)r * piece, wide * esz, (size_t)len[r] * esz, (size_t)rows);
  ml_be_free(tp->be, wire);
  free(start);
  return rc;
}

/* The output edge the walk made for linear module `name` (parallel/tp_walk.c edge_new). */
static ml_tp_edge *output_edge(ml_tp *tp, const char *name) {
  char want[sizeof tp->edges[0].name];
  snprintf(want, sizeof want, "%s output", name);
  for (int i = 0; i < tp->n_edges; i++)
    if (!strcmp(tp->edges[i].name, want)) return &tp->edges[i];
  return NULL;
}

int ml_tp_whole_apply(ml_tp *tp, ml_model *m) {
  if (tp->size == 1) return 0;
  for (int i = 0; i < m->n_modules; i++) {
    const ml_module *mod = &m->modules[i];
    if (mod->kind != ML_MOD_LINEAR) continue;
    ml_linear *lin = mod->ptr;
    if (ml_tp_param_dim(tp, m, lin->weight) != 1) continue;
    if (lin == &m->lm_head)
      return ml_err("batch_invariant (--batch-invariant) with tp = %d: the plan makes lm_head "
                    "rowwise, whose Partial logits sum split products; expected lm_head colwise "
                    "(vocab-parallel) or replicated",
                    tp->size);
    ml_tp_edge *e = output_edge(tp, mod->name);
    if (!e || !ml_tp_is_part(e->p[0]))
      return ml_err("batch_invariant with tp = %d: row-parallel '%s' has no Partial output edge; "
                    "expected the plan walk to have made one",
                    tp->size, mod->name);
    e->p[0] = ml_replicate(); /* the whole output: the edge's Partial sum is already done */
    lin->out = (ml_edge){0};
    ml_tp_set_hooks(&lin->out, e);
    lin->whole = (ml_whole_hook){gather_cols, tp};
  }
  return 0;
}

/* *dst [p->local[0], p->shape[1]] of p's dtype in pool memory = parameter p gathered whole. */
static int hold_one(ml_tp *tp, const ml_param *p, void **dst) {
  *dst = ml_be_alloc(tp->be, ml_mul_sat(p->local[0], p->shape[1]), ml_dtype_size(p->dtype),
                     "%s gathered whole for the generate call [%lld x %lld]", p->name,
                     (long long)p->local[0], (long long)p->shape[1]);
  if (!*dst) return -1;
  return gather_cols(tp, p, p->data, p->local[0], p->dtype, *dst);
}

int ml_tp_whole_hold(ml_tp *tp, ml_model *m) {
  for (int i = 0; i < m->n_modules; i++) {
    if (m->modules[i].kind != ML_MOD_LINEAR) continue;
    ml_linear *lin = m->modules[i].ptr;
    if (!lin->whole.cols) continue;
    ML_TRY(hold_one(tp, lin->weight, &lin->whole_weight));
    if (lin->lora_a) ML_TRY(hold_one(tp, lin->lora_a, &lin->whole_lora_a));
  }
  return 0;
}

void ml_tp_whole_release(ml_tp *tp, ml_model *m) {
  for (int i = 0; i < m->n_modules; i++) {
    if (m->modules[i].kind != ML_MOD_LINEAR) continue;
    ml_linear *lin = m->modules[i].ptr;
    if (!lin->whole.cols) continue; /* nothing held (and tp 1 has no backend of its own) */
    ml_be_free(tp->be, lin->whole_weight);
    ml_be_free(tp->be, lin->whole_lora_a);
    lin->whole_weight = lin->whole_lora_a = NULL;
  }
}
