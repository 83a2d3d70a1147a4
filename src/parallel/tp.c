#include "parallel/tp.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/status.h"
#include "parallel/redistribute.h"

static const char *pstr(ml_placement p) {
  static char bufs[4][32];
  static int k;
  k = (k + 1) % 4;
  return ml_placement_str(p, bufs[k], sizeof bufs[k]);
}

static bool is_seq(ml_placement p) { return ml_placement_eq(p, ml_shard(1)); }
static bool is_feat(ml_placement p) { return ml_placement_eq(p, ml_shard(-1)); }
static bool is_rep(ml_placement p) { return p.kind == ML_REPLICATE; }
static bool is_part(ml_placement p) { return p.kind == ML_PARTIAL; }
/* The placement a gradient takes for an activation of placement p. */
static ml_placement grad_of(ml_placement p) { return is_part(p) ? ml_replicate() : p; }

/* ---- edge hooks: forward and backward chains ------------------------- */

/* The scratch buffer, grown to `need` floats. */
static float *work_for(ml_tp *tp, size_t need) {
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

/* DESIGN §3; the chain p[] holds at most 8 placements, so each direction
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
    ml_placement t = grad_of(e->p[i > 0 ? i - 1 : 0]);
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
  float *w = work_for(e->tp, (size_t)ml_redistribute_work(a->B, a->S, a->C, e->tp->size));
  if (!w) return -1;
  for (int i = 0; i < k; i++) ML_TRY(ml_redistribute(e->tp->be, e->tp->comm, from[i], to[i], a, w));
  return 0;
}

static int edge_fwd(void *ctx, ml_act *a) { return edge_run(ctx, false, a); }
static int edge_bwd(void *ctx, ml_act *a) { return edge_run(ctx, true, a); }

/* Whether an edge communicates or reshapes at all, forward or backward. */
static bool edge_active(const ml_tp_edge *e) {
  ml_placement from[ML_TP_MAX_STEPS], to[ML_TP_MAX_STEPS];
  return ml_tp_edge_steps(e, false, from, to) + ml_tp_edge_steps(e, true, from, to) > 0;
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

/* ---- propagation ------------------------------------------------------ */

/* An activation as the graph sees it: its placement, whether it travels as
 * a DTensor (then consumers redistribute it) or as a local tensor (then
 * consumers read it with their input_layouts), and who produced it. */
typedef struct val {
  ml_placement p;
  bool dt;
  const char *from;
} val;

typedef struct walk {
  ml_tp *tp;
  ml_model *m;
} walk;

/* A module of the walk: its HF name and its style (NULL: not in the plan). */
typedef struct node {
  const char *name;
  const ml_style *style;
} node;

static node node_at(walk *w, int i) {
  const ml_plan_rule *r = w->tp->modules[i].rule;
  return (node){w->m->modules[i].name, r ? &r->style : NULL};
}

/* The leaf module whose struct is `ptr`. */
static node leaf(walk *w, const void *ptr) {
  for (int i = 0; i < w->m->n_modules; i++) {
    ml_module_kind k = w->m->modules[i].kind;
    if (k != ML_MOD_ATTENTION && k != ML_MOD_MLP && w->m->modules[i].ptr == ptr)
      return node_at(w, i);
  }
  return (node){"?", NULL};
}

/* The container "<prefix>layers.<l>.<what>" (self_attn, mlp). */
static node container(walk *w, int l, const char *what) {
  char name[160];
  snprintf(name, sizeof name, "%slayers.%d.%s", w->m->cfg.family->prefix, l, what);
  for (int i = 0; i < w->m->n_modules; i++)
    if (!strcmp(w->m->modules[i].name, name)) return node_at(w, i);
  return (node){"?", NULL};
}

static ml_tp_edge *edge_new(walk *w, const char *module, const char *which, val v, int64_t C) {
  ml_tp_edge *e = &w->tp->edges[w->tp->n_edges++];
  snprintf(e->name, sizeof e->name, "%s %s", module, which);
  e->p[0] = v.p;
  e->n = 1;
  e->C = C;
  e->tp = w->tp;
  e->grad_in = grad_of(v.p);
  return e;
}

static int edge_push(ml_tp_edge *e, ml_placement p) {
  if (ml_placement_eq(e->p[e->n - 1], p)) return 0;
  if (e->n == (int)(sizeof e->p / sizeof e->p[0]))
    return ml_err("edge '%s': too many layout changes", e->name);
  e->p[e->n++] = p;
  return 0;
}

/* A local input read with `declared` must already be what it claims. */
static int check_annotation(const char *mod, const char *field, ml_placement declared,
                            const val *v) {
  if (v->dt || ml_placement_eq(declared, v->p)) return 0;
  return ml_err("plan: module '%s' declares %s %s but receives a local %s from '%s'; the "
                "layouts do not compose (torch would misread the tensor); expected %s %s, or "
                "use_local_output=false on the producer",
                mod, field, pstr(declared), pstr(v->p), v->from, field, pstr(v->p));
}

static bool redistributes(const ml_style *s) {
  if (!s) return false;
  switch (s->kind) {
    case ML_STYLE_COLWISE:
    case ML_STYLE_ROWWISE:
      return !s->local;
    case ML_STYLE_SEQUENCE_PARALLEL:
    case ML_STYLE_PREPARE_INPUT:
    case ML_STYLE_PREPARE_INPUT_OUTPUT:
      return true;
    default:
      return false;
  }
}

/* The input side of a module's style on edge e: annotation, then the
 * redistribute to what it computes on. */
static int style_input(const char *mod, const ml_style *s, ml_tp_edge *e, val *v) {
  if (!redistributes(s)) return 0;
  ML_TRY(check_annotation(mod, "input_layouts", s->input_layout, v));
  ML_TRY(edge_push(e, s->desired_input_layout));
  v->p = s->desired_input_layout;
  if (s->kind == ML_STYLE_PREPARE_INPUT || s->kind == ML_STYLE_PREPARE_INPUT_OUTPUT)
    v->dt = !s->use_local_output;
  return 0;
}

/* The output side of a module's style on edge e. */
static int style_output(const char *mod, const ml_style *s, ml_tp_edge *e, val *v) {
  if (!s) return 0;
  switch (s->kind) {
    case ML_STYLE_COLWISE:
    case ML_STYLE_ROWWISE:
      if (s->local) break;
      /* fallthrough */
    case ML_STYLE_SEQUENCE_PARALLEL:
      ML_TRY(edge_push(e, s->output_layout));
      v->p = s->output_layout;
      v->dt = !s->use_local_output;
      break;
    case ML_STYLE_PREPARE_OUTPUT:
    case ML_STYLE_PREPARE_INPUT_OUTPUT:
      ML_TRY(check_annotation(mod, "output_layouts", s->output_layout, v));
      ML_TRY(edge_push(e, s->desired_output_layout));
      v->p = s->desired_output_layout;
      v->dt = !s->use_local_output;
      break;
    case ML_STYLE_GATHER:
      if (!is_part(v->p))
        return ml_err("plan: '%s' (%s) all-reduces its output, but that output is %s, not "
                      "Partial: the sum would count it tp times; expected it only above "
                      "local_rowwise modules",
                      mod, s->label, pstr(v->p));
      ML_TRY(edge_push(e, ml_replicate()));
      v->p = ml_replicate();
      v->dt = false;
      break;
    default:
      break;
  }
  v->from = mod;
  return 0;
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

/* How parameter p is cut when sharded on dim d: whole attention heads for
 * q_proj / k_proj / v_proj rows and o_proj columns, else torch.chunk. */
static unsigned char heads_rule(const ml_model *m, const ml_param *p, int d) {
  if (p->layer < 0) return 0;
  const ml_layer *L = &m->layers[p->layer];
  if (d == 0 && (p == L->q_proj.weight || p == L->q_proj.bias)) return ML_TP_QUERY_HEADS;
  if (d == 1 && p == L->o_proj.weight) return ML_TP_QUERY_HEADS;
  if (d == 0 && (p == L->k_proj.weight || p == L->k_proj.bias || p == L->v_proj.weight ||
                 p == L->v_proj.bias))
    return ML_TP_KV_HEADS;
  return 0;
}

/* Rank r's cut of p's dim d under `rule` (start, len, owned from). */
static void slice_of(const ml_model *m, int size, const ml_param *p, int d, unsigned char rule,
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
  slice_of(m, tp->size, p, d, tp->param_heads[p - m->params], r, start, len, own);
}

/* Shard p on dim d over tp (torch.chunk, or whole heads: ml_tp_param_slice):
 * its local view and placement. */
static int shard_param(walk *w, ml_param *p, int d) {
  ml_tp *tp = w->tp;
  int *dim = &tp->param_dim[p - w->m->params];
  if (*dim == d) return 0; /* tied: already sharded this way */
  if (*dim >= 0)
    return ml_err("plan: '%s' is tied between modules that shard it on dims %d and %d; tied "
                  "embeddings must stay tied (embed_tokens rowwise and lm_head colwise both "
                  "shard the vocab dim 0)",
                  p->name, *dim, d);
  unsigned char rule = heads_rule(w->m, p, d);
  int64_t n = p->shape[d], start, len, own;
  int64_t c = (n + tp->size - 1) / tp->size;
  if (!rule && c * (tp->size - 1) >= n)
    return ml_err("%s: dim %d of size %lld cannot be split into %d non-empty torch.chunk "
                  "shards; expected a size > %lld",
                  p->name, d, (long long)n, tp->size, (long long)(c * (tp->size - 1)));
  slice_of(w->m, tp->size, p, d, rule, tp->rank, &start, &len, &own);
  *dim = d;
  tp->param_heads[p - w->m->params] = rule;
  p->offset[d] = start;
  p->local[d] = len;
  return 0;
}

/* p (NULL: none), if replicated over tp, gets a Partial gradient. */
static void mark_partial(walk *w, ml_param *p) {
  ml_tp *tp = w->tp;
  if (!p || tp->size == 1 || ml_tp_param_dim(tp, w->m, p) >= 0 || ml_tp_grad_partial(tp, p))
    return;
  tp->partial[tp->n_partial++] = p;
}

/* ---- modules ---------------------------------------------------------- */

typedef enum { SHARD_NONE, SHARD_COL, SHARD_ROW } shard_kind;

static shard_kind kind_of(const ml_style *s) {
  if (!s) return SHARD_NONE;
  if (s->kind == ML_STYLE_COLWISE) return SHARD_COL;
  if (s->kind == ML_STYLE_ROWWISE) return SHARD_ROW;
  return SHARD_NONE;
}

/* The gradient a consumer hands back for its input. */
static ml_placement consumer_grad(shard_kind k, ml_placement in) {
  if (k == SHARD_COL) return ml_partial();
  if (k == SHARD_ROW) return ml_shard(-1);
  return grad_of(in);
}

/* A norm on v (in place of the activation, no edge): per-row over all
 * features, so v must be Replicate or Shard(1). */
static int norm_apply(walk *w, ml_rmsnorm *n, val *v) {
  if (!n->weight) return 0;
  node nd = leaf(w, n);
  const ml_style *s = nd.style;
  bool sp = s && s->kind == ML_STYLE_SEQUENCE_PARALLEL;
  if (sp && !v->dt && !is_seq(v->p))
    return ml_err("plan: '%s' is SequenceParallel (input Shard(1)) but receives a local %s from "
                  "'%s'; expected the residual stream sharded on the sequence (embed_tokens "
                  "output_layouts Shard(1), o_proj/down_proj output_layouts Shard(1))",
                  nd.name, pstr(v->p), v->from);
  if (redistributes(s) && !sp && !ml_placement_eq(s->desired_input_layout, v->p))
    return ml_err("plan: '%s' would redistribute its input from %s to %s; a norm's input is "
                  "the residual stream, whose layout embed_tokens decides",
                  nd.name, pstr(v->p), pstr(s->desired_input_layout));
  if (!is_rep(v->p) && !is_seq(v->p))
    return ml_err("plan: '%s' normalises over all features but receives %s from '%s'; expected "
                  "Replicate() or Shard(1)",
                  nd.name, pstr(v->p), v->from);
  if (is_seq(v->p)) mark_partial(w, n->weight);
  if (sp) v->dt = !s->use_local_output;
  v->from = nd.name;
  return 0;
}

/* A per-head norm (q_norm / k_norm) on q or k: heads may be sharded. */
static int head_norm_apply(walk *w, ml_rmsnorm *n, const val *v) {
  if (!n->weight) return 0;
  node nd = leaf(w, n);
  if (nd.style && nd.style->kind != ML_STYLE_REPLICATE)
    return ml_err("plan: '%s' normalises each attention head; expected "
                  "replicated_with_grad_allreduce (or no entry), found %s",
                  nd.name, nd.style->label);
  if (!is_rep(v->p)) mark_partial(w, n->weight);
  return 0;
}

/* Shard a Linear's parameters for its style; its natural output placement
 * for input placement `in` (after the style's input side). */
static int linear_shard(walk *w, ml_linear *lin, node nd, val in, ml_placement *out) {
  shard_kind k = kind_of(nd.style);
  if (k == SHARD_COL) {
    if (!is_rep(in.p))
      return ml_err("plan: colwise '%s' needs its input Replicate() but it arrives %s from '%s'",
                    nd.name, pstr(in.p), in.from);
    if (w->tp->size > 1) {
      ML_TRY(shard_param(w, lin->weight, 0));
      if (lin->bias) ML_TRY(shard_param(w, lin->bias, 0));
    }
    *out = ml_shard(-1);
  } else if (k == SHARD_ROW) {
    if (!is_feat(in.p))
      return ml_err("plan: rowwise '%s' needs its input Shard(-1) (features) but it arrives %s "
                    "from '%s'",
                    nd.name, pstr(in.p), in.from);
    if (w->tp->size > 1) {
      ML_TRY(shard_param(w, lin->weight, 1));
      lin->bias_in_forward = w->tp->rank == 0; /* Replicate bias, added once to the Partial sum */
    }
    *out = ml_partial();
  } else {
    if (!is_rep(in.p) && !is_seq(in.p))
      return ml_err("plan: '%s' is replicated and needs all its input features, but they arrive "
                    "%s from '%s'",
                    nd.name, pstr(in.p), in.from);
    if (is_seq(in.p)) {
      mark_partial(w, lin->weight);
      mark_partial(w, lin->bias);
    }
    *out = in.p;
  }
  return 0;
}

static void set_edge_hooks(ml_edge *edge, ml_tp_edge *e) {
  if (!edge_active(e)) return;
  edge->fwd = (ml_hook){edge_fwd, e};
  edge->bwd = (ml_hook){edge_bwd, e};
  int64_t cap = 0;
  for (int i = 0; i < e->n; i++) {
    int64_t s0, len = e->C;
    if (is_feat(e->p[i])) ml_chunk(e->C, e->tp->size, e->tp->rank, &s0, &len);
    if (len > cap) cap = len;
  }
  edge->cap_c = cap;
}

/* Linears reading one activation v (q/k/v; gate/up; or one alone) inside
 * container `box` (its PrepareModuleInput applies first): the shared input
 * edge, then each one's output edge (left open: outs[i] / oedge[i]). */
static int linear_group(walk *w, node box, ml_linear **lins, int n, val v, int64_t C_in,
                        val *outs, ml_tp_edge **oedge) {
  node first = leaf(w, lins[0]);
  ml_tp_edge *in = edge_new(w, first.name, "input", v, C_in);
  ML_TRY(style_input(box.name, box.style, in, &v));
  shard_kind k0 = kind_of(first.style);
  val vin = v;
  for (int i = 0; i < n; i++) {
    node nd = leaf(w, lins[i]);
    val vi = v;
    ml_tp_edge probe = *in;
    ML_TRY(style_input(nd.name, nd.style, &probe, &vi));
    if (i == 0) {
      *in = probe;
      vin = vi;
    } else if (kind_of(nd.style) != k0 || probe.n != in->n || !ml_placement_eq(vi.p, vin.p)) {
      return ml_err("plan: '%s' and '%s' read the same activation but the plan prepares it "
                    "differently; expected the same style on both",
                    first.name, nd.name);
    }
  }
  in->grad_in = consumer_grad(k0, vin.p);
  set_edge_hooks(&lins[0]->in, in);
  for (int i = 0; i < n; i++) {
    node nd = leaf(w, lins[i]);
    ml_placement nat;
    ML_TRY(linear_shard(w, lins[i], nd, vin, &nat));
    val o = {nat, false, nd.name};
    oedge[i] = edge_new(w, nd.name, "output", o, lins[i]->weight->shape[0]);
    ML_TRY(style_output(nd.name, nd.style, oedge[i], &o));
    outs[i] = o;
  }
  return 0;
}

/* Close a linear's output edge: the container's output side, the gradient
 * that arrives (the consumer's), then the hooks. */
static int linear_out_close(ml_linear *lin, ml_tp_edge *e, node box, val *v, ml_placement grad) {
  ML_TRY(style_output(box.name, box.style, e, v));
  e->grad_in = grad;
  set_edge_hooks(&lin->out, e);
  return 0;
}

static const node no_box = {"?", NULL};

static int seq_full(const char *what, const val *v) {
  if (!is_seq(v->p) && !is_part(v->p)) return 0;
  return ml_err("plan: %s needs whole sequences but receives %s from '%s'; expected the "
                "sequence gathered first (input_layouts Shard(1) → Replicate())",
                what, pstr(v->p), v->from);
}

static int residual_join(const char *where, const val *v, val *r) {
  if (!ml_placement_eq(v->p, r->p))
    return ml_err("plan: '%s' hands the residual stream %s (from '%s'), but the residual stream "
                  "is %s (set by embed_tokens); expected output_layouts %s",
                  where, pstr(v->p), v->from, pstr(r->p), pstr(r->p));
  r->dt = r->dt || v->dt;
  return 0;
}

/* q/k/v_proj sharded over tp: whole heads (ml_tp_heads), any tp up to
 * num_attention_heads. With tp not dividing both head counts the heads'
 * pieces are not torch.chunk's of the features, so no edge may
 * redistribute them. Attention on the local heads (`local`): the model
 * learns its rank's grouping; the shared kv heads are listed. */
static int split_heads(walk *w, ml_layer *L, bool local) {
  const ml_model_config *c = &w->m->cfg;
  ml_tp *tp = w->tp;
  int t = tp->size;
  if (c->n_heads < t)
    return ml_err("tp=%d exceeds num_attention_heads=%lld; expected a tp size of at most the "
                  "number of attention heads (each tp rank holds at least one)",
                  t, (long long)c->n_heads);
  bool even = c->n_heads % t == 0 && c->n_kv_heads % t == 0;
  ml_linear *moved[4] = {&L->q_proj, &L->k_proj, &L->v_proj, &L->o_proj};
  for (int i = 0; i < 4 && !even; i++)
    if (i < 3 ? moved[i]->out.fwd.fn != NULL : moved[i]->in.fwd.fn != NULL)
      return ml_err("plan: '%s' redistributes the attention heads (%s layouts), but tp=%d does "
                    "not divide num_attention_heads=%lld and num_key_value_heads=%lld, so the "
                    "heads are not torch.chunk pieces of the features; expected q/k/v_proj "
                    "colwise and o_proj rowwise with local outputs",
                    moved[i]->weight->name, i < 3 ? "output" : "input", t,
                    (long long)c->n_heads, (long long)c->n_kv_heads);
  if (!local) return 0;
  ml_tp_heads h;
  ml_tp_heads_of(c, t, tp->rank, &h);
  w->m->attn_group = h.group;
  w->m->attn_head_off = h.q0 - h.kv0 * h.group;
  if (tp->n_kv_shared || even) return 0; /* the same for every layer */
  for (int r = 1; r < t; r++) {
    ml_tp_heads o;
    ml_tp_heads_of(c, t, r, &o);
    bool inside = o.q0 % o.group != 0; /* its first kv head is rank r−1's last */
    if (inside && (tp->n_kv_shared == 0 || tp->kv_shared[tp->n_kv_shared - 1] != o.kv0))
      tp->kv_shared[tp->n_kv_shared++] = o.kv0;
  }
  return 0;
}

static int attention(walk *w, int l, val *r) {
  const ml_model_config *c = &w->m->cfg;
  ml_layer *L = &w->m->layers[l];
  node box = container(w, l, "self_attn");
  val v = *r;
  ML_TRY(norm_apply(w, &L->attn_norm, &v));
  ml_linear *qkv[3] = {&L->q_proj, &L->k_proj, &L->v_proj};
  val o[3];
  ml_tp_edge *oe[3];
  ML_TRY(linear_group(w, box, qkv, 3, v, c->hidden, o, oe));
  for (int i = 0; i < 3; i++) ML_TRY(seq_full(box.name, &o[i]));
  if (!ml_placement_eq(o[0].p, o[1].p) || !ml_placement_eq(o[1].p, o[2].p))
    return ml_err("plan: '%s': q, k and v must all be head-sharded or all replicated; found %s, "
                  "%s, %s",
                  box.name, pstr(o[0].p), pstr(o[1].p), pstr(o[2].p));
  for (int i = 0; i < 3; i++)
    ML_TRY(linear_out_close(qkv[i], oe[i], no_box, &o[i], grad_of(o[i].p)));
  ML_TRY(head_norm_apply(w, &L->q_norm, &o[0]));
  ML_TRY(head_norm_apply(w, &L->k_norm, &o[1]));
  val att = {o[0].p, o[0].dt, box.name};
  ml_linear *op = &L->o_proj;
  val out;
  ml_tp_edge *ooe;
  ML_TRY(linear_group(w, no_box, &op, 1, att, c->n_heads * c->head_dim, &out, &ooe));
  if (ml_tp_param_dim(w->tp, w->m, L->q_proj.weight) == 0)
    ML_TRY(split_heads(w, L, is_feat(o[0].p)));
  ML_TRY(linear_out_close(op, ooe, box, &out, grad_of(r->p)));
  ML_TRY(norm_apply(w, &L->attn_out_norm, &out));
  return residual_join(box.name, &out, r);
}

static int mlp(walk *w, int l, val *r) {
  const ml_model_config *c = &w->m->cfg;
  ml_layer *L = &w->m->layers[l];
  node box = container(w, l, "mlp");
  val v = *r;
  ML_TRY(norm_apply(w, &L->mlp_norm, &v));
  ml_linear *gu[2] = {&L->gate_proj, &L->up_proj};
  val o[2];
  ml_tp_edge *oe[2];
  ML_TRY(linear_group(w, box, gu, 2, v, c->hidden, o, oe));
  if (!ml_placement_eq(o[0].p, o[1].p))
    return ml_err("plan: gate_proj and up_proj of '%s' must be sharded alike; found %s and %s",
                  box.name, pstr(o[0].p), pstr(o[1].p));
  for (int i = 0; i < 2; i++)
    ML_TRY(linear_out_close(gu[i], oe[i], no_box, &o[i], grad_of(o[i].p)));
  val a = {o[0].p, o[0].dt || o[1].dt, box.name};
  ml_linear *down = &L->down_proj;
  val out;
  ml_tp_edge *doe;
  ML_TRY(linear_group(w, no_box, &down, 1, a, c->intermediate, &out, &doe));
  ML_TRY(linear_out_close(down, doe, box, &out, grad_of(r->p)));
  ML_TRY(norm_apply(w, &L->mlp_out_norm, &out));
  return residual_join(box.name, &out, r);
}

static int embedding(walk *w, val *r) {
  ml_embedding *e = &w->m->embed_tokens;
  node nd = leaf(w, e);
  const ml_style *s = nd.style;
  shard_kind k = kind_of(s);
  if (k == SHARD_ROW && !s->hf && !ml_placement_eq(s->input_layout, ml_replicate()))
    return ml_err("plan: '%s' is RowwiseParallel with input_layouts %s, but an embedding reads "
                  "token ids, which are replicated (torch would all-gather the ids); expected "
                  "RowwiseParallel(input_layouts=Replicate()) or \"embedding_rowwise\"",
                  nd.name, pstr(s->input_layout));
  if (k != SHARD_NONE && w->tp->size > 1)
    ML_TRY(shard_param(w, e->weight, k == SHARD_ROW ? 0 : 1));
  ml_placement nat = k == SHARD_ROW ? ml_partial() : k == SHARD_COL ? ml_shard(-1) : ml_replicate();
  val v = {nat, false, nd.name};
  ml_tp_edge *ed = edge_new(w, nd.name, "output", v, w->m->cfg.hidden);
  ML_TRY(style_output(nd.name, s, ed, &v));
  if (!is_rep(v.p) && !is_seq(v.p))
    return ml_err("plan: '%s' hands out %s; the residual stream must be Replicate() or Shard(1) "
                  "(expected output_layouts Replicate() or Shard(1))",
                  nd.name, pstr(v.p));
  ed->grad_in = grad_of(v.p);
  set_edge_hooks(&e->out, ed);
  *r = v;
  w->tp->residual = v.p;
  return 0;
}

static int head(walk *w, val r) {
  ml_model *m = w->m;
  ML_TRY(norm_apply(w, &m->norm, &r));
  ml_linear *lm = &m->lm_head;
  val logits;
  ml_tp_edge *le;
  ML_TRY(linear_group(w, no_box, &lm, 1, r, m->cfg.hidden, &logits, &le));
  if (!is_rep(logits.p) && !is_feat(logits.p))
    return ml_err("plan: lm_head hands out %s logits; expected Shard(-1) (vocab-parallel loss) or "
                  "Replicate()",
                  pstr(logits.p));
  ML_TRY(linear_out_close(lm, le, no_box, &logits, logits.p));
  w->tp->logits = logits.p;
  return 0;
}

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
      if (!ml_pattern_match(rule->pattern, mod->name)) continue;
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
  tp->edges = ml_calloc((size_t)(14 * m->cfg.n_layers + 8), sizeof *tp->edges, "tp edges");
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
  walk w = {tp, m};
  val r;
  ML_TRY(embedding(&w, &r));
  for (int l = 0; l < m->cfg.n_layers; l++) {
    ML_TRY(attention(&w, l, &r));
    ML_TRY(mlp(&w, l, &r));
  }
  ML_TRY(head(&w, r));
  if (is_seq(tp->residual)) { /* SP: the model sizes its residual buffers to this rank's chunk */
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
  if (tp->be) {
    ml_be_free(tp->be, tp->work);
    ml_be_free(tp->be, tp->stash);
  }
  memset(tp, 0, sizeof *tp);
}

/* Whether p's gradient takes a tp step after backward: Partial, or the
 * rows of a k_proj / v_proj that holds shared kv heads. */
static bool tp_reduced(const ml_tp *tp, const ml_param *p) {
  if (ml_tp_grad_partial(tp, p)) return true;
  return tp->n_kv_shared > 0 && tp->param_heads[p - tp->model->params] == ML_TP_KV_HEADS;
}

/* Each (unit, index) whose gradient takes a tp step, in unit order: calls
 * fn with its shard gradient [k floats]; stops at the first error. */
typedef int (*grad_fn)(ml_tp *tp, ml_fsdp *f, const ml_fsdp_unit *u, int i, float *g, size_t k,
                       size_t *off);
static int each_reduced(ml_tp *tp, ml_fsdp *f, grad_fn fn, size_t *off) {
  *off = 0;
  for (int u = 0; u < f->n_units; u++) {
    ml_fsdp_unit *unit = &f->units[u];
    for (int i = 0; i < unit->n; i++) {
      if (!tp_reduced(tp, unit->params[i])) continue;
      size_t k = (size_t)(unit->chunk_rows[i] * unit->params[i]->local[1]);
      ML_TRY(fn(tp, f, unit, i, unit->shard_grad + unit->shard_off[i], k, off));
    }
  }
  return 0;
}

static int count_rows(ml_tp *tp, ml_fsdp *f, const ml_fsdp_unit *u, int i, float *g, size_t k,
                      size_t *off) {
  *off += k;
  return 0;
}
// stash (=) g; g (=) 0
static int stash_rows(ml_tp *tp, ml_fsdp *f, const ml_fsdp_unit *u, int i, float *g, size_t k,
                      size_t *off) {
  ML_TRY(ml_be_copy(tp->be, tp->stash + *off, g, k * sizeof(float), ML_COPY_D2D));
  *off += k;
  return ml_be_zero(tp->be, g, k * sizeof(float));
}
// g += stash
static int unstash_rows(ml_tp *tp, ml_fsdp *f, const ml_fsdp_unit *u, int i, float *g, size_t k,
                        size_t *off) {
  ML_TRY(ml_be_add(tp->be, g, tp->stash + *off, (int64_t)k));
  *off += k;
  return 0;
}

int ml_tp_grads_begin(ml_tp *tp, ml_fsdp *f) {
  if (tp->size == 1) return 0;
  size_t n;
  ML_TRY(each_reduced(tp, f, count_rows, &n));
  if (n == 0) return 0;
  if (!tp->stash) {
    tp->stash = ml_be_alloc(tp->be, (int64_t)n, sizeof(float),
                            "the gradients accumulated before a micro-batch's tp step (%zu "
                            "floats)",
                            n);
    if (!tp->stash) return -1;
  }
  return each_reduced(tp, f, stash_rows, &n);
}

/* The Partial gradients: one all-reduce of their shard rows over tp. */
static int reduce_partial(ml_tp *tp, ml_fsdp *f) {
  if (tp->n_partial == 0) return 0;
  size_t n = 0;
  for (int pass = 0; pass < 2; pass++) {
    float *buf = pass ? work_for(tp, n) : NULL;
    if (pass && !buf) return -1;
    size_t off = 0;
    for (int u = 0; u < f->n_units; u++) {
      ml_fsdp_unit *unit = &f->units[u];
      for (int i = 0; i < unit->n; i++) {
        if (!ml_tp_grad_partial(tp, unit->params[i])) continue;
        size_t k = (size_t)(unit->chunk_rows[i] * unit->params[i]->local[1]);
        if (pass)
          ML_TRY(ml_be_copy(tp->be, buf + off, unit->shard_grad + unit->shard_off[i],
                            k * sizeof(float), ML_COPY_D2D));
        off += k;
      }
    }
    if (!pass) {
      n = off;
      continue;
    }
    ML_TRY(ml_all_reduce(tp->comm, buf, n, ML_ELEM_F32, ML_RED_SUM));
    off = 0;
    for (int u = 0; u < f->n_units; u++) {
      ml_fsdp_unit *unit = &f->units[u];
      for (int i = 0; i < unit->n; i++) {
        if (!ml_tp_grad_partial(tp, unit->params[i])) continue;
        size_t k = (size_t)(unit->chunk_rows[i] * unit->params[i]->local[1]);
        ML_TRY(ml_be_copy(tp->be, unit->shard_grad + unit->shard_off[i], buf + off,
                          k * sizeof(float), ML_COPY_D2D));
        off += k;
      }
    }
  }
  return 0;
}

/* The shared kv heads' rows of a k_proj / v_proj shard gradient g (local
 * rows r0.. of the rank's slice starting at global row `first`) and the
 * packed buffer [n_kv_shared · hd rows, cols] (to_buf: g → buf, else back). */
static int shared_rows(ml_tp *tp, const ml_param *p, float *g, int64_t r0, int64_t nr,
                       int64_t first, float *buf, bool to_buf) {
  int64_t hd = tp->model->cfg.head_dim, cols = p->local[1];
  for (int j = 0; j < tp->n_kv_shared; j++) {
    int64_t a = tp->kv_shared[j] * hd, b = a + hd; /* the head's global rows */
    int64_t lo = a > first + r0 ? a : first + r0, hi = b < first + r0 + nr ? b : first + r0 + nr;
    if (lo >= hi) continue;
    float *row_g = g + (lo - first - r0) * cols, *row_b = buf + (j * hd + lo - a) * cols;
    size_t bytes = sizeof(float) * (size_t)((hi - lo) * cols);
    ML_TRY(ml_be_copy(tp->be, to_buf ? row_b : row_g, to_buf ? row_g : row_b, bytes,
                      ML_COPY_D2D));
  }
  return 0;
}

/* The shared kv heads' partial gradients: summed over every (tp, dp) rank
 * holding their rows, packed per parameter in unit order. */
static int reduce_kv_shared(ml_tp *tp, ml_fsdp *f) {
  if (tp->n_kv_shared == 0) return 0;
  int64_t hd = tp->model->cfg.head_dim, n = 0;
  for (int pass = 0; pass < 2; pass++) {
    float *buf = pass ? work_for(tp, (size_t)n) : NULL;
    if (pass && !buf) return -1;
    if (pass) ML_TRY(ml_be_zero(tp->be, buf, sizeof(float) * (size_t)n));
    for (int dir = 0; dir < (pass ? 2 : 1); dir++) {
      int64_t off = 0;
      for (int u = 0; u < f->n_units; u++) {
        ml_fsdp_unit *unit = &f->units[u];
        for (int i = 0; i < unit->n; i++) {
          ml_param *p = unit->params[i];
          if (tp->param_heads[p - tp->model->params] != ML_TP_KV_HEADS) continue;
          int64_t r0, nr;
          ml_fsdp_param_rows(f, unit, i, &r0, &nr);
          if (pass)
            ML_TRY(shared_rows(tp, p, unit->shard_grad + unit->shard_off[i], r0, nr,
                               p->offset[0], buf + off, dir == 0));
          off += tp->n_kv_shared * hd * p->local[1];
        }
      }
      n = off;
      if (pass && dir == 0) {
        ML_TRY(ml_all_reduce(tp->comm, buf, (size_t)n, ML_ELEM_F32, ML_RED_SUM));
        if (f->dp->size > 1) ML_TRY(ml_all_reduce(f->dp, buf, (size_t)n, ML_ELEM_F32, ML_RED_SUM));
      }
    }
  }
  return 0;
}

int ml_tp_reduce_partial_grads(ml_tp *tp, ml_fsdp *f) {
  if (tp->size == 1) return 0;
  ML_TRY(reduce_partial(tp, f));
  ML_TRY(reduce_kv_shared(tp, f));
  size_t n;
  return tp->stash ? each_reduced(tp, f, unstash_rows, &n) : 0;
}
