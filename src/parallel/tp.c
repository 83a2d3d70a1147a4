#include "parallel/tp.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/status.h"
#include "model/block.h"
#include "parallel/redistribute.h"
#include "parallel/tp_impl.h"

const char *ml_tp_pstr(ml_placement p) {
  static char bufs[4][32];
  static int k;
  k = (k + 1) % 4;
  return ml_placement_str(p, bufs[k], sizeof bufs[k]);
}

/* ---- edge hooks: forward and backward chains ------------------------- */

float *ml_tp_work(ml_tp *tp, size_t need) {
  if (need == 0) need = 1; /* empty activations still get a buffer */
  if (need > tp->work_cap) {
    ml_be_free(tp->be, tp->work);
    tp->work_cap = 0;
    tp->work = ml_be_alloc(tp->be, (int64_t)need, sizeof(float),
                           "the redistribute scratch (%zu floats)", need);
    if (!tp->work) return NULL;
    tp->work_cap = need;
  }
  return tp->work;
}

void ml_tp_release_work(ml_tp *tp) {
  if (tp->be) ml_be_free(tp->be, tp->work);
  tp->work = NULL;
  tp->work_cap = 0;
}

/* ARCHITECTURE.md §3; the chain p[] holds at most 8 placements, so each direction
 * has at most 8 steps. */
int ml_tp_edge_steps(const ml_tp_edge *e, bool backward, ml_placement *from, ml_placement *to) {
  int k = 0;
  if (!backward) {
    for (int i = 0; i + 1 < e->n; i++)
      if (!ml_placement_eq(e->p[i], e->p[i + 1])) {
        from[k] = e->p[i];
        to[k++] = e->p[i + 1];
      }
    return k;
  }
  ml_placement g = e->grad_in;
  for (int i = e->n - 1; i >= 0; i--) { /* step i−1 → i backward; i = 0: arrival at p[0] */
    ml_placement t = ml_tp_grad_of(e->p[i > 0 ? i - 1 : 0]);
    if (!ml_placement_eq(g, t)) {
      from[k] = g;
      to[k++] = t;
    }
    g = t;
  }
  return k;
}

static int edge_run(ml_tp_edge *e, bool backward, ml_act *a) {
  ml_placement from[ML_TP_MAX_STEPS], to[ML_TP_MAX_STEPS];
  int k = ml_tp_edge_steps(e, backward, from, to);
  if (!k) return 0;
  float *w = ml_tp_work(e->tp, (size_t)ml_redistribute_work(a->B, a->S, a->C, e->tp->size));
  if (!w) return -1;
  for (int i = 0; i < k; i++) ML_TRY(ml_redistribute(e->tp->be, e->tp->comm, from[i], to[i], a, w));
  return 0;
}

static int edge_fwd(void *ctx, ml_act *a) { return edge_run(ctx, false, a); }
static int edge_bwd(void *ctx, ml_act *a) { return edge_run(ctx, true, a); }

/* Whether an edge communicates or reshapes in that direction. */
static bool edge_active(const ml_tp_edge *e, bool backward) {
  ml_placement from[ML_TP_MAX_STEPS], to[ML_TP_MAX_STEPS];
  return ml_tp_edge_steps(e, backward, from, to) > 0;
}

int ml_tp_edge_cost(const ml_tp_edge *e, bool backward, int64_t B, int64_t S,
                    int64_t calls[ML_COLL_KINDS], int64_t bytes[ML_COLL_KINDS]) {
  ml_placement from[ML_TP_MAX_STEPS], to[ML_TP_MAX_STEPS];
  int k = ml_tp_edge_steps(e, backward, from, to);
  for (int i = 0; i < k; i++) {
    ml_coll kinds[2];
    int64_t b[2];
    int n;
    ML_TRY(ml_redistribute_cost(from[i], to[i], B, S, e->C, e->tp->size, kinds, b, &n));
    for (int j = 0; j < n; j++) {
      calls[kinds[j]]++;
      bytes[kinds[j]] = ml_add_sat(bytes[kinds[j]], b[j]); /* B·S from flags: saturate */
    }
  }
  return 0;
}


void ml_tp_set_hooks(ml_edge *edge, ml_tp_edge *e) {
  bool fwd = edge_active(e, false), bwd = edge_active(e, true);
  if (!fwd && !bwd) return;
  if (fwd) edge->fwd = (ml_hook){edge_fwd, e};
  if (bwd) edge->bwd = (ml_hook){edge_bwd, e};
  int64_t cap = 0;
  for (int i = 0; i < e->n; i++) {
    int64_t s0, len = e->C;
    if (ml_tp_is_feat(e->p[i])) ml_chunk(e->C, e->tp->size, e->tp->rank, &s0, &len);
    if (len > cap) cap = len;
  }
  edge->cap_c = cap;
}

/* ---- parameters ------------------------------------------------------- */

int ml_tp_param_dim(const ml_tp *tp, const ml_model *m, const ml_param *p) {
  ptrdiff_t i = p - m->params;
  return tp->param_dim && i >= 0 && i < tp->n_params ? tp->param_dim[i] : -1;
}

bool ml_tp_grad_partial(const ml_tp *tp, const ml_param *p) {
  for (int i = 0; i < tp->n_partial; i++)
    if (tp->partial[i] == p) return true;
  return false;
}

void ml_tp_heads_of(const ml_model_config *c, int size, int r, ml_tp_heads *h) {
  int64_t nh = c->n_heads, g = c->n_heads / c->n_kv_heads, base = nh / size, extra = nh % size;
  h->group = g;
  h->nq = base + (r < extra);
  h->q0 = r * base + (r < extra ? r : extra);
  h->kv0 = h->q0 / g;
  h->nkv = (h->q0 + h->nq - 1) / g + 1 - h->kv0;
  /* the previous rank's last query head h->q0 − 1 reads kv0 too iff q0 is inside a group */
  h->kv_own0 = r > 0 && h->q0 % g ? h->kv0 + 1 : h->kv0;
}

unsigned char ml_tp_heads_rule(const ml_model *m, const ml_param *p, int d) {
  if (p->layer < 0) return 0;
  for (int i = 0; i < ML_ROLE_COUNT; i++) {
    const ml_block_row *r = &ml_block_rows[i];
    if (r->heads == ML_HEADS_NONE) continue;
    const ml_linear *lin = ml_block_at(&m->layers[p->layer], r);
    /* a LoRA adapter is cut as its weight: lora_B's rows as the rows, lora_A's columns as
     * the columns */
    if (p != lin->weight && p != lin->bias && p != lin->lora_a && p != lin->lora_b) continue;
    if (d == 0 && r->heads != ML_HEADS_Q_COLS)
      return r->heads == ML_HEADS_Q_ROWS ? ML_TP_QUERY_HEADS : ML_TP_KV_HEADS;
    if (d == 1 && r->heads == ML_HEADS_Q_COLS && (p == lin->weight || p == lin->lora_a))
      return ML_TP_QUERY_HEADS;
  }
  return 0;
}

void ml_tp_slice_of(const ml_model *m, int size, const ml_param *p, int d, unsigned char rule,
                     int r, int64_t *start, int64_t *len, int64_t *own) {
  if (!rule) {
    ml_chunk(p->shape[d], size, r, start, len);
    *own = *start;
    return;
  }
  ml_tp_heads h;
  ml_tp_heads_of(&m->cfg, size, r, &h);
  int64_t hd = m->cfg.head_dim;
  bool q = rule == ML_TP_QUERY_HEADS;
  *start = (q ? h.q0 : h.kv0) * hd;
  *len = (q ? h.nq : h.nkv) * hd;
  *own = q ? *start : h.kv_own0 * hd;
}

void ml_tp_param_slice(const ml_tp *tp, const ml_model *m, const ml_param *p, int r,
                       int64_t *start, int64_t *len, int64_t *own) {
  int d = ml_tp_param_dim(tp, m, p);
  if (d < 0) {
    *start = 0;
    *len = p->shape[0];
    *own = r == 0 ? 0 : *len;
    return;
  }
  ml_tp_slice_of(m, tp->size, p, d, tp->param_heads[p - m->params], r, start, len, own);
}

/* Shard p on dim d over tp (torch.chunk, or whole heads: ml_tp_param_slice):
 * its local view and placement. */

/* ---- rule matching ---------------------------------------------------- */

static bool style_fits(const ml_style *s, ml_module_kind k) {
  switch (s->kind) {
    case ML_STYLE_COLWISE:
    case ML_STYLE_ROWWISE:
      return k == ML_MOD_LINEAR || k == ML_MOD_EMBEDDING;
    case ML_STYLE_SEQUENCE_PARALLEL:
      return k == ML_MOD_RMSNORM;
    case ML_STYLE_REPLICATE:
      return k == ML_MOD_RMSNORM || k == ML_MOD_LINEAR || k == ML_MOD_EMBEDDING;
    case ML_STYLE_PREPARE_INPUT:
    case ML_STYLE_PREPARE_INPUT_OUTPUT:
      return k == ML_MOD_ATTENTION || k == ML_MOD_MLP || k == ML_MOD_RMSNORM;
    case ML_STYLE_PREPARE_OUTPUT:
    case ML_STYLE_GATHER:
      return k == ML_MOD_ATTENTION || k == ML_MOD_MLP || k == ML_MOD_EMBEDDING;
    default:
      return false;
  }
}

static int match_rules(ml_tp *tp, const ml_plan *plan, ml_model *m) {
  for (size_t r = 0; r < plan->n; r++) {
    const ml_plan_rule *rule = &plan->rules[r];
    int matched = 0;
    for (int i = 0; i < m->n_modules; i++) {
      const ml_module *mod = &m->modules[i];
      if (!ml_pattern_match(rule->pattern, mod->name) &&
          !(mod->alias[0] && ml_pattern_match(rule->pattern, mod->alias)))
        continue;
      matched++;
      if (tp->modules[i].rule)
        return ml_err("plan '%s': module '%s' is matched by '%s' and by '%s'; expected one rule "
                      "per module",
                      plan->name, mod->name, tp->modules[i].rule->pattern, rule->pattern);
      if (!style_fits(&rule->style, mod->kind))
        return ml_err("plan '%s': %s ('%s') cannot apply to module '%s', a %s",
                      plan->name, rule->style.label, rule->pattern, mod->name,
                      ml_module_kind_name(mod->kind));
      tp->modules[i].rule = rule;
    }
    if (!matched)
      return ml_err("plan '%s': pattern '%s' matches no module of this %s model; expected an HF "
                    "module name such as %s",
                    plan->name, rule->pattern, m->cfg.family->name, m->modules[1].name);
  }
  return 0;
}

int ml_tp_apply(ml_tp *tp, const ml_plan *plan, ml_model *m, ml_comm *comm) {
  memset(tp, 0, sizeof *tp);
  tp->be = m->be;
  tp->comm = comm;
  tp->size = comm->size;
  tp->rank = comm->rank;
  tp->n_modules = m->n_modules;
  tp->modules = ml_calloc((size_t)m->n_modules, sizeof *tp->modules, "tp modules");
  /* an input and an output edge per linear of the block at most, lm_head's two and
   * embed_tokens' output */
  tp->cap_edges = 2 * ml_block_n_linears(&m->cfg) * (int)m->cfg.n_layers + 3;
  tp->edges = ml_calloc((size_t)tp->cap_edges, sizeof *tp->edges, "tp edges");
  tp->partial = ml_calloc((size_t)m->n_params, sizeof *tp->partial, "tp partial params");
  tp->param_dim = ml_calloc((size_t)m->n_params, sizeof *tp->param_dim, "tp placements");
  tp->param_heads = ml_calloc((size_t)m->n_params, sizeof *tp->param_heads, "tp head cuts");
  tp->kv_shared = ml_calloc((size_t)m->cfg.n_kv_heads, sizeof *tp->kv_shared, "tp kv heads");
  if (!tp->modules || !tp->edges || !tp->partial || !tp->param_dim || !tp->param_heads ||
      !tp->kv_shared)
    return -1;
  tp->n_params = m->n_params;
  tp->model = m;
  for (int i = 0; i < m->n_params; i++) tp->param_dim[i] = -1;
  for (int i = 0; i < m->n_modules; i++) tp->modules[i].module = &m->modules[i];
  ML_TRY(match_rules(tp, plan, m));
  ML_TRY(ml_tp_walk(tp, m));
  if (ml_tp_is_seq(tp->residual)) { /* SP: the model sizes its residual buffers to this rank's chunk */
    m->res_parts = tp->size;
    m->res_index = tp->rank;
  }
  return 0;
}

int ml_tp_check_sequence_parallel(const ml_tp *tp, const ml_plan *plan, bool sequence_parallel) {
  if (!sequence_parallel || ml_placement_eq(tp->residual, ml_shard(1))) return 0;
  return ml_err("--sequence-parallel: plan '%s' keeps the residual stream Replicate(); expected "
                "embed_tokens output_layouts Shard(1) and SequenceParallel norms",
                plan->name);
}

void ml_tp_destroy(ml_tp *tp) {
  free(tp->modules);
  free(tp->edges);
  free(tp->partial);
  free(tp->param_dim);
  free(tp->param_heads);
  free(tp->kv_shared);
  ml_tp_release_work(tp);
  memset(tp, 0, sizeof *tp);
}
