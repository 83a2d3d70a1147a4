/* Placement propagation through the decoder for a tensor-parallel plan
 * (parallel/tp.h): the walk over the model's modules — embedding, then per
 * layer the block table's modules (model/block.h), then the final norm and
 * lm_head — that decides every activation edge's redistributes and every
 * parameter's shard, refusing plans whose layouts do not compose. */
#include <stdio.h>
#include <string.h>

#include "common/status.h"
#include "model/block.h"
#include "parallel/tp_impl.h"

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

/* The module of kind `kind` whose struct is `ptr` (containers: their
 * layer), which the model lists (a sparse layer has other modules than a
 * dense one, so none is found by its position). */
static node module_at(walk *w, ml_module_kind kind, const void *ptr) {
  int i = 0;
  while (i < w->m->n_modules - 1 &&
         !(w->m->modules[i].ptr == ptr && w->m->modules[i].kind == kind))
    i++;
  return node_at(w, i);
}

/* The module of row `role` in layer l. */
static node row_node(walk *w, int l, ml_block_role role) {
  const ml_block_row *r = ml_block_row_of(role);
  ml_layer *L = &w->m->layers[l];
  bool box = r->kind == ML_MOD_ATTENTION || r->kind == ML_MOD_MLP;
  return module_at(w, r->kind, box ? (const void *)L : ml_block_at(L, r));
}

/* The leaf module whose struct is `ptr`. */
static node leaf(walk *w, const void *ptr) {
  ml_model *m = w->m;
  int l;
  const ml_block_row *r = ml_block_row_at(m, ptr, &l);
  if (r) return row_node(w, l, r->role);
  if (ptr == &m->embed_tokens) return node_at(w, 0);
  if (ptr == &m->norm) return module_at(w, ML_MOD_RMSNORM, ptr);
  return node_at(w, m->n_modules - 1); /* lm_head */
}

/* A new edge. Errors: more edges than the block table bounds (ml_tp_apply). */
static ml_tp_edge *edge_new(walk *w, const char *module, const char *which, val v, int64_t C) {
  if (w->tp->n_edges == w->tp->cap_edges) {
    ml_err("plan: more than %d activation edges at '%s'", w->tp->cap_edges, module);
    return NULL;
  }
  ml_tp_edge *e = &w->tp->edges[w->tp->n_edges++];
  snprintf(e->name, sizeof e->name, "%s %s", module, which);
  e->p[0] = v.p;
  e->n = 1;
  e->C = C;
  e->tp = w->tp;
  e->grad_in = ml_tp_grad_of(v.p);
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
                mod, field, ml_tp_pstr(declared), ml_tp_pstr(v->p), v->from, field, ml_tp_pstr(v->p));
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
      if (!ml_tp_is_part(v->p))
        return ml_err("plan: '%s' (%s) all-reduces its output, but that output is %s, not "
                      "Partial: the sum would count it tp times; expected it only above "
                      "local_rowwise modules",
                      mod, s->label, ml_tp_pstr(v->p));
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


static int shard_param(walk *w, ml_param *p, int d) {
  ml_tp *tp = w->tp;
  int *dim = &tp->param_dim[p - w->m->params];
  if (*dim == d) return 0; /* tied: already sharded this way */
  if (*dim >= 0)
    return ml_err("plan: '%s' is tied between modules that shard it on dims %d and %d; tied "
                  "embeddings must stay tied (embed_tokens rowwise and lm_head colwise both "
                  "shard the vocab dim 0)",
                  p->name, *dim, d);
  unsigned char rule = ml_tp_heads_rule(w->m, p, d);
  int64_t n = p->shape[d], start, len, own;
  int64_t c = (n + tp->size - 1) / tp->size;
  if (!rule && c * (tp->size - 1) >= n)
    return ml_err("%s: dim %d of size %lld cannot be split into %d non-empty torch.chunk "
                  "shards; expected a size > %lld",
                  p->name, d, (long long)n, tp->size, (long long)(c * (tp->size - 1)));
  ml_tp_slice_of(w->m, tp->size, p, d, rule, tp->rank, &start, &len, &own);
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
  return ml_tp_grad_of(in);
}

/* A norm on v (in place of the activation, no edge): per-row over all
 * features, so v must be Replicate or Shard(1). */
static int norm_apply(walk *w, ml_rmsnorm *n, val *v) {
  if (!n->weight) return 0;
  node nd = leaf(w, n);
  const ml_style *s = nd.style;
  bool sp = s && s->kind == ML_STYLE_SEQUENCE_PARALLEL;
  if (sp && !v->dt && !ml_tp_is_seq(v->p))
    return ml_err("plan: '%s' is SequenceParallel (input Shard(1)) but receives a local %s from "
                  "'%s'; expected the residual stream sharded on the sequence (embed_tokens "
                  "output_layouts Shard(1), o_proj/down_proj output_layouts Shard(1))",
                  nd.name, ml_tp_pstr(v->p), v->from);
  if (redistributes(s) && !sp && !ml_placement_eq(s->desired_input_layout, v->p))
    return ml_err("plan: '%s' would redistribute its input from %s to %s; a norm's input is "
                  "the residual stream, whose layout embed_tokens decides",
                  nd.name, ml_tp_pstr(v->p), ml_tp_pstr(s->desired_input_layout));
  if (!ml_tp_is_rep(v->p) && !ml_tp_is_seq(v->p))
    return ml_err("plan: '%s' normalises over all features but receives %s from '%s'; expected "
                  "Replicate() or Shard(1)",
                  nd.name, ml_tp_pstr(v->p), v->from);
  if (ml_tp_is_seq(v->p)) mark_partial(w, n->weight);
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
  if (!ml_tp_is_rep(v->p)) mark_partial(w, n->weight);
  return 0;
}

/* Shard a Linear's parameters for its style; its natural output placement
 * for input placement `in` (after the style's input side). */
static int linear_shard(walk *w, ml_linear *lin, node nd, val in, ml_placement *out) {
  shard_kind k = kind_of(nd.style);
  if (k == SHARD_COL) {
    if (!ml_tp_is_rep(in.p))
      return ml_err("plan: colwise '%s' needs its input Replicate() but it arrives %s from '%s'",
                    nd.name, ml_tp_pstr(in.p), in.from);
    if (w->tp->size > 1) {
      ML_TRY(shard_param(w, lin->weight, 0));
      if (lin->bias) ML_TRY(shard_param(w, lin->bias, 0));
      if (lin->lora_b) ML_TRY(shard_param(w, lin->lora_b, 0));
    }
    mark_partial(w, lin->lora_a); /* dA = du^T·x, du from this rank's rows of B only */
    *out = ml_shard(-1);
  } else if (k == SHARD_ROW) {
    if (!ml_tp_is_feat(in.p))
      return ml_err("plan: rowwise '%s' needs its input Shard(-1) (features) but it arrives %s "
                    "from '%s'",
                    nd.name, ml_tp_pstr(in.p), in.from);
    if (w->tp->size > 1) {
      ML_TRY(shard_param(w, lin->weight, 1));
      if (lin->lora_a) ML_TRY(shard_param(w, lin->lora_a, 1));
      lin->bias_in_forward = w->tp->rank == 0; /* Replicate bias, added once to the Partial sum */
    }
    mark_partial(w, lin->lora_b); /* dB = dy^T·(s·u), u = x_local·A_local^T a Partial sum */
    *out = ml_partial();
  } else {
    if (!ml_tp_is_rep(in.p) && !ml_tp_is_seq(in.p))
      return ml_err("plan: '%s' is replicated and needs all its input features, but they arrive "
                    "%s from '%s'",
                    nd.name, ml_tp_pstr(in.p), in.from);
    if (ml_tp_is_seq(in.p)) {
      mark_partial(w, lin->weight);
      mark_partial(w, lin->bias);
      mark_partial(w, lin->lora_a);
      mark_partial(w, lin->lora_b);
    }
    *out = in.p;
  }
  return 0;
}

/* Linears reading one activation v (q/k/v; gate/up; or one alone) inside
 * container `box` (its PrepareModuleInput applies first): the shared input
 * edge, then each one's output edge (left open: outs[i] / oedge[i]). */
static int linear_group(walk *w, node box, ml_linear **lins, int n, val v, int64_t C_in,
                        val *outs, ml_tp_edge **oedge) {
  node first = leaf(w, lins[0]);
  ml_tp_edge *in = edge_new(w, first.name, "input", v, C_in);
  if (!in) return -1;
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
  ml_tp_set_hooks(&lins[0]->in, in);
  for (int i = 0; i < n; i++) {
    node nd = leaf(w, lins[i]);
    ml_placement nat;
    ML_TRY(linear_shard(w, lins[i], nd, vin, &nat));
    val o = {nat, false, nd.name};
    oedge[i] = edge_new(w, nd.name, "output", o, lins[i]->weight->shape[0]);
    if (!oedge[i]) return -1;
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
  ml_tp_set_hooks(&lin->out, e);
  return 0;
}

static const node no_box = {"?", NULL};

static int seq_full(const char *what, const val *v) {
  if (!ml_tp_is_seq(v->p) && !ml_tp_is_part(v->p)) return 0;
  return ml_err("plan: %s needs whole sequences but receives %s from '%s'; expected the "
                "sequence gathered first (input_layouts Shard(1) → Replicate())",
                what, ml_tp_pstr(v->p), v->from);
}

static int residual_join(const char *where, const val *v, val *r) {
  if (!ml_placement_eq(v->p, r->p))
    return ml_err("plan: '%s' hands the residual stream %s (from '%s'), but the residual stream "
                  "is %s (set by embed_tokens); expected output_layouts %s",
                  where, ml_tp_pstr(v->p), v->from, ml_tp_pstr(r->p), ml_tp_pstr(r->p));
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
  node box = row_node(w, l, ML_ROLE_ATTN);
  val v = *r;
  ML_TRY(norm_apply(w, &L->attn_norm, &v));
  ml_linear *qkv[ML_ROLE_COUNT]; /* q, k, v */
  ml_block_group(L, ml_block_row_of(ML_ROLE_Q)->group, qkv);
  val o[3];
  ml_tp_edge *oe[3];
  ML_TRY(linear_group(w, box, qkv, 3, v, c->hidden, o, oe));
  for (int i = 0; i < 3; i++) ML_TRY(seq_full(box.name, &o[i]));
  if (!ml_placement_eq(o[0].p, o[1].p) || !ml_placement_eq(o[1].p, o[2].p))
    return ml_err("plan: '%s': q, k and v must all be head-sharded or all replicated; found %s, "
                  "%s, %s",
                  box.name, ml_tp_pstr(o[0].p), ml_tp_pstr(o[1].p), ml_tp_pstr(o[2].p));
  for (int i = 0; i < 3; i++)
    ML_TRY(linear_out_close(qkv[i], oe[i], no_box, &o[i], ml_tp_grad_of(o[i].p)));
  ML_TRY(head_norm_apply(w, &L->q_norm, &o[0]));
  ML_TRY(head_norm_apply(w, &L->k_norm, &o[1]));
  val att = {o[0].p, o[0].dt, box.name};
  ml_linear *op = &L->o_proj;
  val out;
  ml_tp_edge *ooe;
  ML_TRY(linear_group(w, no_box, &op, 1, att, c->n_heads * c->head_dim, &out, &ooe));
  if (ml_tp_param_dim(w->tp, w->m, L->q_proj.weight) == 0)
    ML_TRY(split_heads(w, L, ml_tp_is_feat(o[0].p)));
  ML_TRY(linear_out_close(op, ooe, box, &out, ml_tp_grad_of(r->p)));
  ML_TRY(norm_apply(w, &L->attn_out_norm, &out));
  return residual_join(box.name, &out, r);
}

/* A sparse block under tp > 1 (NeMo Automodel's layout: experts not
 * TP-sharded): its input, the residual stream, Replicate; every tp rank
 * computes the router and a shared expert on the same tokens, and without
 * expert parallelism the whole block, so its output is Replicate (no
 * Partial) and the router's, the experts' and the shared expert's gradients
 * are the same full gradient on every tp rank: replicated, not summed over
 * tp (as a norm's on a Replicate input; the shared expert's stay so under
 * ep too). Under
 * expert parallelism (m->moe_ep.slices > 1: ml_ep_apply before this walk)
 * each tp rank dispatches its chunk of the tokens and the block all-gathers
 * its output and input gradient over tp (model/moe.h), so the output stays
 * Replicate, but the router's gradient on a tp rank comes from its chunk's
 * tokens alone: Partial over tp, summed as a norm's under sequence
 * parallelism (the experts' are not replicated over tp: parallel/ep.h).
 * Errors: a plan entry on the block, its router or an expert (naming the
 * module); a Shard(1) residual stream (sequence parallelism), not supported
 * yet. */
static int sparse_block(walk *w, ml_layer *L, node box, const val *r) {
  if (!ml_tp_is_rep(r->p))
    return ml_err("plan: '%s' is a mixture-of-experts block, which takes a Replicate() residual "
                  "stream under tp (experts not TP-sharded); found %s (sequence parallelism), "
                  "not supported yet with expert layers; expected --sequence-parallel off",
                  box.name, ml_tp_pstr(r->p));
  /* the router, each expert's three linears, then the shared expert's three and its gate */
  int64_t nx = 1 + 3 * w->m->cfg.n_experts, n = nx + (L->moe.shared_gate.weight ? 4 : 0);
  node nd = box;
  for (int64_t i = -1; i < n; i++) {
    const ml_linear *lin = i == 0 ? &L->moe.gate
                           : i < nx ? &L->moe.experts[i - 1]
                           : i < nx + 3 ? &L->moe.shared[i - nx]
                                        : &L->moe.shared_gate;
    if (i >= 0) nd = module_at(w, ML_MOD_LINEAR, lin);
    if (nd.style)
      return ml_err("plan: '%s' (%s) is part of a mixture-of-experts block, which is replicated "
                    "over tp (experts not TP-sharded); expected no plan entry for it",
                    nd.name, nd.style->label);
  }
  if (w->m->moe_ep.slices > 1) {
    const ml_linear *g = &L->moe.gate;
    mark_partial(w, g->weight);
    mark_partial(w, g->bias);
    mark_partial(w, g->lora_a);
    mark_partial(w, g->lora_b);
  }
  val v = *r; /* the norms' styles checked against it; the residual passes unchanged */
  ML_TRY(norm_apply(w, &L->mlp_norm, &v));
  return norm_apply(w, &L->mlp_out_norm, &v);
}

static int mlp(walk *w, int l, val *r) {
  const ml_model_config *c = &w->m->cfg;
  ml_layer *L = &w->m->layers[l];
  node box = row_node(w, l, ML_ROLE_MLP);
  if (L->moe.gate.weight) return w->tp->size == 1 ? 0 : sparse_block(w, L, box, r);
  val v = *r;
  ML_TRY(norm_apply(w, &L->mlp_norm, &v));
  ml_linear *gu[ML_ROLE_COUNT]; /* gate, up */
  ml_block_group(L, ml_block_row_of(ML_ROLE_GATE)->group, gu);
  val o[2];
  ml_tp_edge *oe[2];
  ML_TRY(linear_group(w, box, gu, 2, v, c->hidden, o, oe));
  if (!ml_placement_eq(o[0].p, o[1].p))
    return ml_err("plan: gate_proj and up_proj of '%s' must be sharded alike; found %s and %s",
                  box.name, ml_tp_pstr(o[0].p), ml_tp_pstr(o[1].p));
  for (int i = 0; i < 2; i++)
    ML_TRY(linear_out_close(gu[i], oe[i], no_box, &o[i], ml_tp_grad_of(o[i].p)));
  val a = {o[0].p, o[0].dt || o[1].dt, box.name};
  ml_linear *down = &L->down_proj;
  val out;
  ml_tp_edge *doe;
  ML_TRY(linear_group(w, no_box, &down, 1, a, c->intermediate, &out, &doe));
  ML_TRY(linear_out_close(down, doe, box, &out, ml_tp_grad_of(r->p)));
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
                  nd.name, ml_tp_pstr(s->input_layout));
  if (k != SHARD_NONE && w->tp->size > 1)
    ML_TRY(shard_param(w, e->weight, k == SHARD_ROW ? 0 : 1));
  ml_placement nat = k == SHARD_ROW ? ml_partial() : k == SHARD_COL ? ml_shard(-1) : ml_replicate();
  val v = {nat, false, nd.name};
  ml_tp_edge *ed = edge_new(w, nd.name, "output", v, w->m->cfg.hidden);
  if (!ed) return -1;
  ML_TRY(style_output(nd.name, s, ed, &v));
  if (!ml_tp_is_rep(v.p) && !ml_tp_is_seq(v.p))
    return ml_err("plan: '%s' hands out %s; the residual stream must be Replicate() or Shard(1) "
                  "(expected output_layouts Replicate() or Shard(1))",
                  nd.name, ml_tp_pstr(v.p));
  ed->grad_in = ml_tp_grad_of(v.p);
  ml_tp_set_hooks(&e->out, ed);
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
  if (!ml_tp_is_rep(logits.p) && !ml_tp_is_feat(logits.p))
    return ml_err("plan: lm_head hands out %s logits; expected Shard(-1) (vocab-parallel loss) or "
                  "Replicate()",
                  ml_tp_pstr(logits.p));
  ML_TRY(linear_out_close(lm, le, no_box, &logits, logits.p));
  w->tp->logits = logits.p;
  return 0;
}

int ml_tp_walk(ml_tp *tp, ml_model *m) {
  walk w = {tp, m};
  val r;
  ML_TRY(embedding(&w, &r));
  for (int l = 0; l < m->cfg.n_layers; l++) {
    ML_TRY(attention(&w, l, &r));
    ML_TRY(mlp(&w, l, &r));
  }
  return head(&w, r);
}
