/* meshlm plan: what a training run on a mesh would do, without running it
 * (one process, no mpirun, no weights read: config.json only). It takes
 * train's flags for everything that shapes a step (mesh, plan, SP, dtypes,
 * ZeRO, reshard, prefetch, activation checkpointing, batch), selects the
 * plan and applies it exactly as `meshlm train` does (ml_plan_select,
 * ml_tp_apply), once per tp rank over a group that does not exist (ml_comm
 * with ops NULL), so plan errors are the training run's; then it reports
 * first a summary: the model, the mesh, the plan and, from the engine's own
 * step run on the meta backend (engine/predict.h), one step's collectives
 * per mesh group and the memory per rank; then every module's style and
 * per-rank shard shapes and every activation edge's placements and
 * collectives, a decoder layer identical to an earlier one as one line
 * unless --verbose (plan_layers.h). --json prints the same as one JSON
 * document, every layer. */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "cli/plan_heads.h"
#include "cli/plan_layers.h"
#include "cli/train_flags.h"
#include "common/status.h"
#include "model/config.h"
#include "model/model.h"
#include "parallel/plan.h"
#include "parallel/loss.h"
#include "parallel/tp.h"
#include "tensor/placement.h"
#include "engine/predict.h"

typedef struct plan_opts {
  ml_train_opts t; /* train's settings (the flags plan takes of them: plan_flags) */
  int64_t dp_shard;
  bool json, verbose;
} plan_opts;

/* One tp rank's model with the plan applied over its (fake) tp group. */
typedef struct plan_rank {
  ml_comm comm;
  ml_model model;
  ml_tp tp;
  ml_prediction pred;
  bool created, applied;
} plan_rank;

typedef struct plan_run {
  plan_opts o;
  ml_model_config cfg;
  ml_plan plan;
  bool have_plan;
  plan_rank *ranks; /* [tp] */
  int n_ranks;
} plan_run;

/* ---- building ----------------------------------------------------------- */

/* The local micro-batch: --batch-size over dp ranks and --grad-accum. */
static int64_t local_batch(const plan_opts *o) {
  return o->t.batch / (o->t.dp_replicate * o->dp_shard * o->t.grad_accum);
}

static int check_opts(const plan_opts *o) {
  ML_TRY(ml_train_opts_check(&o->t));
  if (o->dp_shard < 1 || o->dp_shard > 1 << 16 || o->t.tp > 1 << 16 ||
      o->t.dp_replicate > 1 << 16 || o->t.cp > 1 << 16)
    return ml_err("plan: --tp, --cp, --dp-shard and --dp-replicate must be in 1..65536; found "
                  "tp=%" PRId64 ", cp=%" PRId64 ", dp_shard=%" PRId64 ", dp_replicate=%" PRId64,
                  o->t.tp, o->t.cp, o->dp_shard, o->t.dp_replicate);
  int64_t dp = o->t.dp_replicate * o->dp_shard;
  if (o->t.batch % (dp * o->t.grad_accum) != 0) /* the message of `meshlm train` */
    return ml_err("--batch-size %lld is not divisible by the data-parallel size %d x --grad-accum "
                  "%lld; expected a multiple of it",
                  (long long)o->t.batch, (int)dp, (long long)o->t.grad_accum);
  return 0;
}

static int build(plan_run *run) {
  const plan_opts *o = &run->o;
  ML_TRY(check_opts(o));
  ML_TRY(ml_model_config_load(o->t.model, &run->cfg));
  ML_TRY(ml_model_config_check_seq_len(&run->cfg, o->t.model, o->t.seq_len,
                                       "plan: flag --seq-len"));
  run->n_ranks = (int)o->t.tp;
  run->ranks = ml_calloc((size_t)run->n_ranks, sizeof *run->ranks, "plan ranks");
  if (!run->ranks) return -1;
  ml_engine_opts eo = ml_train_settings_of(&o->t).engine;
  char what[192];
  ml_train_batch_words(&o->t, (int)(o->t.dp_replicate * o->dp_shard), what, sizeof what);
  for (int r = 0; r < run->n_ranks; r++) {
    plan_rank *pr = &run->ranks[r];
    /* a tp group that is only described: ml_tp_apply never communicates */
    pr->comm = (ml_comm){.ops = NULL, .impl = NULL, .rank = r, .size = (int)o->t.tp};
    snprintf(pr->comm.name, sizeof pr->comm.name, "tp");
    pr->created = true; /* destroying a zeroed or half-built model, tp or plan is safe */
    ML_TRY(ml_model_create(&run->cfg, &pr->model));
    if (r == 0) {
      run->have_plan = true;
      ML_TRY(ml_plan_select(&pr->model, o->t.model, o->t.plan, o->t.sp, &run->plan));
    }
    pr->applied = true;
    ML_TRY(ml_tp_apply(&pr->tp, &run->plan, &pr->model, &pr->comm));
    ML_TRY(ml_tp_check_sequence_parallel(&pr->tp, &run->plan, o->t.sp));
    /* world rank r: tp rank r of the first dp and cp coordinates (tp is fastest; the cp
     * ranks of a tp rank differ only in which positions they hold) */
    ml_predict_shape shape = {(int)o->t.dp_replicate, (int)o->dp_shard, (int)o->t.cp,
                              (int)o->t.tp, r, local_batch(o), o->t.seq_len,
                              (int)o->t.grad_accum, what, (int)o->t.ep};
    ML_TRY(ml_predict_step(o->t.model, &eo, &shape, &pr->pred));
  }
  return 0;
}

static void run_free(plan_run *run) {
  for (int r = 0; run->ranks && r < run->n_ranks; r++) {
    if (run->ranks[r].applied) ml_tp_destroy(&run->ranks[r].tp);
    if (run->ranks[r].created) ml_model_destroy(&run->ranks[r].model);
  }
  free(run->ranks);
  if (run->have_plan) ml_plan_free(&run->plan);
}

/* ---- shared helpers ----------------------------------------------------- */

static const char *pstr(ml_placement p, char *buf, size_t cap) {
  return ml_placement_str(p, buf, cap);
}

static const char *kind_name(ml_module_kind k) {
  switch (k) {
    case ML_MOD_LINEAR: return "Linear";
    case ML_MOD_EMBEDDING: return "Embedding";
    case ML_MOD_RMSNORM: return "RMSNorm";
    default: return "container";
  }
}

/* The parameters of a leaf module (weight, bias), NULL where absent. */
static void module_params(const ml_module *mod, const ml_param *out[2]) {
  out[0] = out[1] = NULL;
  switch (mod->kind) {
    case ML_MOD_LINEAR: {
      const ml_linear *l = mod->ptr;
      out[0] = l->weight;
      out[1] = l->bias;
      break;
    }
    case ML_MOD_EMBEDDING: out[0] = ((const ml_embedding *)mod->ptr)->weight; break;
    case ML_MOD_RMSNORM: out[0] = ((const ml_rmsnorm *)mod->ptr)->weight; break;
    default: break;
  }
}

/* The role of module_params' entry i. */
static const char *param_role(int i) { return i == 0 ? "weight" : "bias"; }

static bool pred_equal(const ml_prediction *a, const ml_prediction *b) {
  return !memcmp(a->train, b->train, sizeof a->train) &&
         !memcmp(a->logprobs, b->logprobs, sizeof a->logprobs) &&
         !memcmp(&a->mem, &b->mem, sizeof a->mem);
}

/* Parameter p0 of rank 0's model as tp rank r's model holds it. */
static const ml_param *param_on(const plan_run *run, int r, const ml_param *p0) {
  const ml_model *m0 = &run->ranks[0].model;
  return &run->ranks[r].model.params[p0 - m0->params];
}

/* ---- text --------------------------------------------------------------- */

static void text_shape(char *buf, size_t cap, const ml_param *p, const int64_t *shape) {
  if (p->ndim == 1) snprintf(buf, cap, "[%" PRId64 "]", shape[0]);
  else snprintf(buf, cap, "[%" PRId64 ", %" PRId64 "]", shape[0], shape[1]);
}

/* Ring attention's passes per layer and micro-batch, from the counted step:
 * forward = the logprobs pass's (forward only) / layers; backward = the
 * training step's per micro-batch less that (with AC, the recomputed
 * forward's ring runs again and is counted there). */
typedef struct ring_costs {
  int64_t fwd_calls, fwd_bytes, bwd_calls, bwd_bytes;
} ring_costs;

static ring_costs ring_per_layer(const ml_prediction *p, int64_t layers) {
  const ml_comm_stats *tr = &p->train[ML_GROUP_CP], *lp = &p->logprobs[ML_GROUP_CP];
  int64_t n = layers * p->shape.grad_accum;
  ring_costs c = {.fwd_calls = lp->calls[ML_COLL_SEND_RECV] / layers,
                  .fwd_bytes = lp->bytes[ML_COLL_SEND_RECV] / layers};
  c.bwd_calls = tr->calls[ML_COLL_SEND_RECV] / n - c.fwd_calls;
  c.bwd_bytes = tr->bytes[ML_COLL_SEND_RECV] / n - c.fwd_bytes;
  return c;
}

static void text_cp(const plan_run *run) {
  const plan_opts *o = &run->o;
  const ml_prediction *p = &run->ranks[0].pred;
  int64_t cp = o->t.cp, c = p->S_pad / (2 * cp);
  ring_costs r = ring_per_layer(p, run->cfg.n_layers);
  char fb[32], bb[32];
  ml_cli_print("context parallel: cp %" PRId64 ", each sequence padded to %" PRId64
               " positions (%" PRId64 " masked at the end), cut into %" PRId64
               " chunks of %" PRId64 "; cp rank r holds chunks r and %" PRId64
               " - r: %" PRId64 " positions per sequence; FSDP over dp_shard x cp = %" PRId64
               "\n",
               cp, p->S_pad, p->S_pad - p->S, 2 * cp, c, 2 * cp - 1, p->s_local,
               o->dp_shard * cp);
  ml_cli_print("  ring attention per layer and micro-batch (cp send_recv): forward %" PRId64
               " passes (K/V), %s; backward %" PRId64 " passes (K/V and dK/dV%s), %s\n",
               r.fwd_calls, ml_cli_bytes(r.fwd_bytes, fb, sizeof fb), r.bwd_calls,
               ml_train_settings_of(&o->t).engine.ac == ML_AC_NONE ? ""
                                                                   : ", AC's recomputed forward",
               ml_cli_bytes(r.bwd_bytes, bb, sizeof bb));
}

/* The sparse layers' experts per rank and, under --ep, the ep group's
 * all-to-all bytes per sparse layer and micro-batch (the meta backend's
 * balanced routing, model/moe.h: a run's bytes follow its routing). */
static void text_experts(const plan_run *run) {
  const plan_opts *o = &run->o;
  const ml_model_config *c = &run->cfg;
  const ml_prediction *p = &run->ranks[0].pred;
  int64_t sparse = 0, ep = o->t.ep;
  for (int64_t l = 0; l < c->n_layers; l++) sparse += ml_config_moe_layer(c, l);
  int64_t world = o->t.dp_replicate * o->dp_shard * o->t.cp * o->t.tp;
  ml_cli_print("experts: %" PRId64 " per sparse layer (%" PRId64 " of %" PRId64
               " layers), top %" PRId64 "; %" PRId64 " computed per rank (ep %" PRId64 "), ",
               c->n_experts, sparse, c->n_layers, c->top_k, c->n_experts / ep, ep);
  if (ep == 1)
    ml_cli_print("their parameters FSDP-sharded with their layer\n");
  else /* parallel/ep.h: Shard(0) over ep, FSDP over ep_shard in units of their own */
    ml_cli_print("their parameters held there alone, FSDP-sharded over ep_shard (%" PRId64
                 " ranks) in units of their own\n",
                 world / ep);
  if (c->shared_inter > 0) /* model/moe_shared.h: a dense MLP of its layer, never exchanged */
    ml_cli_print("  a shared expert of %" PRId64 " features per sparse layer, gated by "
                 "sigmoid(%s): computed on every rank's own tokens, its parameters "
                 "FSDP-sharded with their layer\n",
                 c->shared_inter, c->family->shared_gate);
  if (ep == 1 || sparse == 0) return;
  int64_t fwd = p->logprobs[ML_GROUP_EP].bytes[ML_COLL_ALL_TO_ALL] / sparse;
  int64_t step = p->train[ML_GROUP_EP].bytes[ML_COLL_ALL_TO_ALL] / (sparse * o->t.grad_accum);
  char fb[32], bb[32];
  /* under tp each tp rank dispatches its torch.chunk of the tokens (model/moe.h): rank 0's */
  int64_t T = p->B * p->s_local, Td = o->t.tp > 1 ? ml_chunk_size(T, (int)o->t.tp) : T;
  ml_cli_print("  ep all-to-all per sparse layer and micro-batch (dispatch + combine, %" PRId64
               " token rows x top %" PRId64 " per rank%s): forward %s, backward %s%s; balanced "
               "routing (expert e gets T*k/E of each rank's rows), a run's bytes follow its "
               "routing\n",
               Td, c->top_k, o->t.tp > 1 ? ", each tp rank its chunk of the tokens" : "",
               ml_cli_bytes(fwd, fb, sizeof fb),
               ml_cli_bytes(step - fwd, bb, sizeof bb),
               ml_train_settings_of(&o->t).engine.ac == ML_AC_NONE ? ""
                                                                   : " (AC's recomputed forward "
                                                                     "included)");
}

/* The model, the mesh, the plan and what the residual stream and the logits are. */
static void text_summary(const plan_run *run) {
  const plan_opts *o = &run->o;
  const ml_model_config *c = &run->cfg;
  const plan_rank *r0 = &run->ranks[0];
  int64_t dp = o->t.dp_replicate * o->dp_shard, world = dp * o->t.cp * o->t.tp;
  char b1[32], b2[32];
  ml_cli_print("plan: %s (%s, %s): %" PRId64 " layers, hidden %" PRId64 ", heads %" PRId64
               "/%" PRId64 " kv, intermediate %" PRId64 ", vocab %" PRId64 ", %" PRId64
               " parameters%s\n",
               o->t.model, c->family->name, c->family->architecture, c->n_layers, c->hidden,
               c->n_heads, c->n_kv_heads, c->intermediate, c->vocab,
               ml_model_config_num_params(c), c->tie_embeddings ? ", tied embeddings" : "");
  ml_cli_print("mesh: dp_replicate %" PRId64 " x dp_shard %" PRId64 " x cp %" PRId64
               " x tp %" PRId64 " = world %" PRId64 " ranks; batch %" PRId64
               " sequences of %" PRId64 " tokens (%" PRId64 " per dp rank)\n",
               o->t.dp_replicate, o->dp_shard, o->t.cp, o->t.tp, world, o->t.batch,
               o->t.seq_len, o->t.batch / dp);
  if (o->t.cp > 1) text_cp(run);
  if (c->n_experts > 0) text_experts(run);
  ml_cli_print("plan %s%s\n  reason: %s\n", run->plan.name,
               run->plan.sequence_parallel ? " (sequence parallel)" : "", run->plan.reason);
  ml_cli_print("residual stream %s, logits %s%s\n", pstr(r0->tp.residual, b1, sizeof b1),
               pstr(r0->tp.logits, b2, sizeof b2),
               r0->tp.logits.kind == ML_SHARD ? " (vocab-parallel loss)" : " (whole rows)");
}

/* The heads over tp and the plan's rules. */
static void text_rules(const plan_run *run) {
  const plan_rank *r0 = &run->ranks[0];
  ml_cli_print("\n");
  if (ml_plan_heads_split(&r0->tp, &r0->model)) ml_plan_heads_text(&r0->tp, &r0->model);
  ml_cli_print("rules (pattern -> style, in plan order):\n");
  for (size_t i = 0; i < run->plan.n; i++) {
    const ml_style *s = &run->plan.rules[i].style;
    const char *kn = ml_style_kind_name(s->kind);
    if (strcmp(s->label, kn))
      ml_cli_print("  %-44s %s [%s]\n", run->plan.rules[i].pattern, s->label, kn);
    else ml_cli_print("  %-44s %s\n", run->plan.rules[i].pattern, kn);
  }
}

/* A listing of the model's modules or tp edges, identical layers collapsed
 * unless --verbose (plan_layers.h), printed. */
static int print_listing(const plan_run *run, int n, const char *(*name)(const void *, int),
                         int (*render)(const void *, int, const char *, ml_text *)) {
  char prefix[160];
  snprintf(prefix, sizeof prefix, "%slayers.", run->cfg.family->prefix);
  ml_listing l = {n, name, render, run, prefix, (int)run->cfg.n_layers, run->o.verbose};
  ml_text out = {0};
  int rc = ml_listing_text(&l, &out);
  if (rc == 0 && out.s) ml_cli_print("%s", out.s);
  ml_text_free(&out);
  return rc;
}

static const char *module_name(const void *ctx, int i) {
  return ((const plan_run *)ctx)->ranks[0].model.modules[i].name;
}

/* Module i's lines (ml_listing.render): style, then per parameter its
 * global shape, tp placement, local shapes and FSDP rows. */
static int render_module(const void *ctx, int i, const char *name, ml_text *out) {
  const plan_run *run = ctx;
  const plan_rank *r0 = &run->ranks[0];
  const ml_model *m = &r0->model;
  const ml_module *mod = &m->modules[i];
  const ml_plan_rule *rule = r0->tp.modules[i].rule;
  char style[256];
  const char *kn = rule ? ml_style_kind_name(rule->style.kind) : "";
  if (rule && strcmp(rule->style.label, kn))
    snprintf(style, sizeof style, "%s [%s] from '%s'", rule->style.label, kn, rule->pattern);
  else if (rule)
    snprintf(style, sizeof style, "%s from '%s'", kn, rule->pattern);
  else snprintf(style, sizeof style, "replicated (no rule)");
  ml_text_printf(out, "  %s (%s): %s\n", name, kind_name(mod->kind), style);
  const ml_param *ps[2];
  module_params(mod, ps);
  for (int k = 0; k < 2; k++) {
    const ml_param *p = ps[k];
    if (!p) continue;
    char g[48], where[192] = "";
    text_shape(g, sizeof g, p, p->shape);
    if (strncmp(p->name, mod->name, strlen(mod->name)) != 0)
      snprintf(where, sizeof where, " (tied: %s)", p->name);
    ml_text_printf(out, "    %s %s%s: ", param_role(k), g, where);
    int dim = ml_tp_param_dim(&r0->tp, m, p);
    if (dim < 0) {
      ml_text_printf(out, "Replicate()%s",
                     ml_tp_grad_partial(&r0->tp, p) ? ", grad Partial (all-reduced over tp)" : "");
    } else {
      ml_text_printf(out, "Shard(%d):", dim);
      for (int r = 0; r < run->n_ranks; r++) {
        char l[48];
        const ml_param *pr = param_on(run, r, p);
        text_shape(l, sizeof l, pr, pr->local);
        ml_text_printf(out, " tp%d %s", r, l);
      }
    }
    int64_t fs = run->o.dp_shard * run->o.t.cp; /* FSDP shards over dp_shard_cp */
    if (fs > 1) {
      int64_t rows = (p->local[0] + fs - 1) / fs;
      bool vocab = r0->pred.vocab_group > 1 &&
                   (p == m->embed_tokens.weight || p == m->lm_head.weight);
      ml_text_printf(out, "; fsdp %" PRId64 " rows/rank (tp0)%s", rows,
                     vocab ? ", vocab-parallel (never all-gathered)" : "");
    }
    ml_text_printf(out, "\n");
  }
  return 0;
}

static int text_modules(const plan_run *run) {
  ml_cli_print("\nmodules (style; parameters: global shape, tp placement, local shape per tp "
               "rank%s):\n",
               run->o.dp_shard * run->o.t.cp > 1 ? ", FSDP rows per dp_shard_cp rank" : "");
  return print_listing(run, run->ranks[0].model.n_modules, module_name, render_module);
}

static void text_costs(char *buf, size_t cap, const ml_comm_stats *s) {
  size_t n = 0;
  buf[0] = 0;
  for (int k = 0; k < ML_COLL_KINDS && n < cap; k++) {
    if (!s->calls[k]) continue;
    char h[32];
    n += (size_t)snprintf(buf + n, cap - n, "%s%s x%" PRId64 " (%s)", n ? ", " : "",
                          ml_coll_name((ml_coll)k), s->calls[k],
                          ml_cli_bytes(s->bytes[k], h, sizeof h));
  }
  if (!n) snprintf(buf, cap, "none");
}

static void chain_str(char *buf, size_t cap, const ml_placement *p, int n) {
  size_t k = 0;
  buf[0] = 0;
  for (int i = 0; i < n && k < cap; i++) {
    char b[32];
    k += (size_t)snprintf(buf + k, cap - k, "%s%s", i ? " -> " : "", pstr(p[i], b, sizeof b));
  }
}

/* Whether e is lm_head's output edge (its hooks run once per logits chunk). */
static bool is_logits_edge(const ml_model *m, const ml_tp_edge *e) {
  for (int i = 0; i < m->n_modules; i++) {
    if (m->modules[i].ptr != &m->lm_head) continue;
    size_t n = strlen(m->modules[i].name);
    return !strncmp(e->name, m->modules[i].name, n) && !strcmp(e->name + n, " output");
  }
  return false;
}

/* Edge e's collectives in one step of prediction p's local batch, forward
 * and backward: its steps (ml_tp_edge_steps) on [B, S], except lm_head's
 * output edge, which runs once per logits chunk. One pass each way:
 * activation checkpointing's reruns of forward edges are not included here
 * (the per-group step totals, from the engine's own step, count them). */
static int edge_costs(const ml_model *m, const ml_tp_edge *e, const ml_prediction *p,
                      ml_comm_stats *fwd, ml_comm_stats *bwd) {
  memset(fwd, 0, sizeof *fwd);
  memset(bwd, 0, sizeof *bwd);
  bool logits = is_logits_edge(m, e);
  int64_t T = p->B * p->s_local, chunk = p->loss_chunk, full = T / chunk, rest = T % chunk;
  for (int dir = 0; dir < 2; dir++) {
    ml_comm_stats *s = dir ? bwd : fwd;
    if (!logits) {
      ML_TRY(ml_tp_edge_cost(e, dir, p->B, p->s_local, s->calls, s->bytes));
      continue;
    }
    for (int64_t c = 0; c < full; c++)
      ML_TRY(ml_tp_edge_cost(e, dir, 1, chunk, s->calls, s->bytes));
    if (rest) ML_TRY(ml_tp_edge_cost(e, dir, 1, rest, s->calls, s->bytes));
  }
  return 0;
}

/* The gradient's chain of e: grad_in, then where each backward step goes. */
static int grad_chain(const ml_tp_edge *e, ml_placement *chain) {
  ml_placement from[ML_TP_MAX_STEPS], to[ML_TP_MAX_STEPS];
  int k = ml_tp_edge_steps(e, true, from, to);
  chain[0] = e->grad_in;
  for (int i = 0; i < k; i++) chain[i + 1] = to[i];
  return k + 1;
}

static const char *edge_name(const void *ctx, int i) {
  return ((const plan_run *)ctx)->ranks[0].tp.edges[i].name;
}

/* Edge i's lines (ml_listing.render): its chains and their collectives. */
static int render_edge(const void *ctx, int i, const char *name, ml_text *out) {
  const plan_run *run = ctx;
  const plan_rank *r0 = &run->ranks[0];
  const ml_tp_edge *e = &r0->tp.edges[i];
  ml_placement g[ML_TP_MAX_STEPS + 1];
  int ng = grad_chain(e, g);
  ml_comm_stats f, b;
  ML_TRY(edge_costs(&r0->model, e, &r0->pred, &f, &b));
  char fc[160], gc[160], fs[200], bs[200];
  chain_str(fc, sizeof fc, e->p, e->n);
  chain_str(gc, sizeof gc, g, ng);
  text_costs(fs, sizeof fs, &f);
  text_costs(bs, sizeof bs, &b);
  if (e->n == 1 && ng == 1) /* nothing to redistribute either way */
    ml_text_printf(out, "  %s [C=%" PRId64 "]: %s, gradient %s: no collective\n", name, e->C, fc,
                   gc);
  else
    ml_text_printf(out, "  %s [C=%" PRId64 "]\n    forward  %s: %s\n    backward %s: %s\n", name,
                   e->C, fc, fs, gc, bs);
  return 0;
}

static int text_edges(const plan_run *run) {
  const ml_prediction *pd = &run->ranks[0].pred;
  ml_cli_print("\nactivation edges (forward chain | gradient chain; collectives of one step of "
               "the local batch [%" PRId64 ", %" PRId64 "], lm_head's output per logits chunk):\n",
               pd->B, pd->s_local);
  return print_listing(run, run->ranks[0].tp.n_edges, edge_name, render_edge);
}

static void text_stats(const ml_comm_stats *st) {
  for (int g = 0; g < ML_GROUP_KINDS; g++)
    for (int k = 0; k < ML_COLL_KINDS; k++) {
      if (!st[g].calls[k]) continue;
      char h[32];
      ml_cli_print("    %-12s %-15s %6" PRId64 " calls %14" PRId64 " B (%s)\n",
                   ml_group_name((ml_group)g), ml_coll_name((ml_coll)k), st[g].calls[k],
                   st[g].bytes[k], ml_cli_bytes(st[g].bytes[k], h, sizeof h));
    }
}

static void text_prediction(const ml_prediction *p) {
  ml_cli_print("  one training step (zero_grad, %d x forward + backward, grad norm, AdamW), per "
               "group:\n",
               p->shape.grad_accum);
  text_stats(p->train);
  bool any = false;
  for (int g = 0; g < ML_GROUP_KINDS; g++)
    for (int k = 0; k < ML_COLL_KINDS; k++) any = any || p->train[g].calls[k];
  if (!any) ml_cli_print("    none (one rank)\n");
  if (p->vocab_group > 1)
    ml_cli_print("  embed_tokens and lm_head vocab-parallel over dp_shard_cp (%d ranks): each "
                 "computes on its FSDP shard's vocab rows, never all-gathered; the token ids, "
                 "lm_head's input and their gradients travel instead, the loss runs on the "
                 "group's %" PRId64 " tokens\n",
                 p->vocab_group, p->B * p->s_local * p->vocab_group);
  ml_cli_print("  logits: %" PRId64 " chunk(s) of up to %" PRId64 " tokens\n", p->loss_chunks,
               p->loss_chunk);
  if (p->frozen_params)
    ml_cli_print("  frozen (--freeze): %d parameters, %" PRId64 " elements; %d FSDP unit(s) "
                 "wholly frozen (no gradient, AdamW state or reduce-scatter)\n",
                 p->frozen_params, p->frozen_numel, p->frozen_units);
  if (p->fp32_params)
    ml_cli_print("  kept in fp32 under bf16 (the MoE routers, --fp32-params): %d parameters, "
                 "%" PRId64 " elements; %d FSDP unit(s) with an fp32 part, all-gathered in fp32 "
                 "beside their bf16 part (%" PRId64 " bytes a rank receives gathering each "
                 "once)\n",
                 p->fp32_params, p->fp32_numel, p->fp32_units, p->fp32_gather_bytes);
  ml_cli_print("  one logprobs pass (forward only), per group:\n");
  text_stats(p->logprobs);
  const ml_predict_memory *m = &p->mem;
  struct {
    const char *what;
    int64_t v;
  } rows[] = {{p->frozen_units ? "FSDP shards: params (+ grads, AdamW state unless frozen), fp32"
                                : "FSDP shards: params, grads, AdamW exp_avg + exp_avg_sq (fp32)",
               m->shards},
              {m->host ? "in use once train opens (FSDP buffers, persistent params, a micro-batch)"
                       : "in use once train opens (shards, FSDP buffers, persistent params, a "
                         "micro-batch)",
               m->opened},
              {"saved activations (all layers, AC workspace)", m->activations},
              {"peak of one training step", m->train_peak},
              {"held by the pool after the step (cached too; CPU: RSS <= this + the libraries)",
               m->step_reserved},
              {m->host ? "logprobs' parameter shards (host; inference-only: bf16 alone under bf16)"
                       : "logprobs' parameter shards (inference-only: bf16 alone under bf16)",
               m->logprobs_shards},
              {m->host ? "in use once logprobs opens (FSDP buffers, persistent params)"
                       : "in use once logprobs opens (shards, FSDP buffers, persistent params)",
               m->logprobs_opened},
              {"peak of one logprobs pass", m->logprobs_peak},
              {"held by the pool after the pass (cached blocks too; CPU: RSS less the libraries)",
               m->logprobs_reserved}};
  char h[32];
  ml_cli_print("  device memory per rank (the engine's step on the meta backend):\n");
  const char *ref = "a reference policy's shards, if captured (meshlm_set_reference)";
  for (size_t i = m->host ? 1 : 0; i < sizeof rows / sizeof rows[0]; i++) /* shards: host */
    ml_cli_print("    %-80s %12s\n", rows[i].what, ml_cli_bytes(rows[i].v, h, sizeof h));
  if (!m->host) {
    ml_cli_print("    %-80s %12s\n", ref, ml_cli_bytes(m->reference, h, sizeof h));
    return;
  }
  ml_cli_print("  host memory per rank (--cpu-offload), none of it in the device rows above:\n");
  ml_cli_print("    %-80s %12s\n", rows[0].what, ml_cli_bytes(m->shards, h, sizeof h));
  ml_cli_print("    %-80s %12s\n", ref, ml_cli_bytes(m->reference, h, sizeof h));
  ml_cli_print("    %-80s %12s\n", "in all, with the staging of gradients accumulated there",
               ml_cli_bytes(m->host, h, sizeof h));
}

/* One step's collectives per group and the memory, per tp rank (a rank
 * that predicts another's numbers says so). */
static void text_predictions(const plan_run *run) {
  ml_cli_print("\ncollectives (bytes as the counting comm records them: the full buffer per "
               "rank) and memory:\n");
  for (int r = 0; r < run->n_ranks; r++) {
    const ml_prediction *p = &run->ranks[r].pred;
    int same = -1;
    for (int q = 0; q < r && same < 0; q++)
      if (pred_equal(p, &run->ranks[q].pred)) same = q;
    if (same >= 0) {
      ml_cli_print("tp rank %d: as tp rank %d\n", r, same);
      continue;
    }
    ml_cli_print("tp rank %d:\n", r);
    text_prediction(p);
  }
}

/* The summary first (model, mesh, plan, collectives, memory), then the
 * heads, rules, modules and edges. */
static int print_text(const plan_run *run) {
  text_summary(run);
  text_predictions(run);
  text_rules(run);
  ML_TRY(text_modules(run));
  return text_edges(run);
}

/* ---- JSON --------------------------------------------------------------- */

static json_t *jplacement(ml_placement p) {
  char b[32];
  return json_string(pstr(p, b, sizeof b));
}

static json_t *jshape(const ml_param *p, const int64_t *shape) {
  json_t *a = json_array();
  for (int d = 0; d < p->ndim; d++) json_array_append_new(a, json_integer(shape[d]));
  return a;
}

static json_t *jstats(const ml_comm_stats *s) {
  json_t *o = json_object();
  for (int k = 0; k < ML_COLL_KINDS; k++) {
    json_t *c = json_object();
    json_object_set_new(c, "calls", json_integer(s->calls[k]));
    json_object_set_new(c, "bytes", json_integer(s->bytes[k]));
    json_object_set_new(o, ml_coll_name((ml_coll)k), c);
  }
  return o;
}

static json_t *jgroups(const ml_comm_stats *st) {
  json_t *o = json_object();
  for (int g = 0; g < ML_GROUP_KINDS; g++)
    json_object_set_new(o, ml_group_name((ml_group)g), jstats(&st[g]));
  return o;
}

static json_t *jheader(const plan_run *run) {
  const plan_opts *o = &run->o;
  const ml_model_config *c = &run->cfg;
  json_t *root = json_object();
  json_t *model = json_object();
  json_object_set_new(model, "dir", json_string(o->t.model));
  json_object_set_new(model, "family", json_string(c->family->name));
  json_object_set_new(model, "architecture", json_string(c->family->architecture));
  json_object_set_new(model, "layers", json_integer(c->n_layers));
  json_object_set_new(model, "hidden", json_integer(c->hidden));
  json_object_set_new(model, "heads", json_integer(c->n_heads));
  json_object_set_new(model, "kv_heads", json_integer(c->n_kv_heads));
  json_object_set_new(model, "head_dim", json_integer(c->head_dim));
  json_object_set_new(model, "intermediate", json_integer(c->intermediate));
  json_object_set_new(model, "vocab", json_integer(c->vocab));
  json_object_set_new(model, "tied_embeddings", json_boolean(c->tie_embeddings));
  json_object_set_new(model, "parameters", json_integer(ml_model_config_num_params(c)));
  json_object_set_new(root, "model", model);
  json_t *mesh = json_object();
  json_object_set_new(mesh, "dp_replicate", json_integer(o->t.dp_replicate));
  json_object_set_new(mesh, "dp_shard", json_integer(o->dp_shard));
  json_object_set_new(mesh, "cp", json_integer(o->t.cp));
  json_object_set_new(mesh, "tp", json_integer(o->t.tp));
  json_object_set_new(mesh, "ep", json_integer(o->t.ep));
  json_object_set_new(mesh, "world",
                      json_integer(o->t.dp_replicate * o->dp_shard * o->t.cp * o->t.tp));
  json_object_set_new(root, "mesh", mesh);
  json_t *batch = json_object();
  json_object_set_new(batch, "global_sequences", json_integer(o->t.batch));
  json_object_set_new(batch, "local_sequences",
                      json_integer(o->t.batch / (o->t.dp_replicate * o->dp_shard)));
  json_object_set_new(batch, "seq_len", json_integer(o->t.seq_len));
  json_object_set_new(root, "batch", batch);
  json_t *plan = json_object();
  json_object_set_new(plan, "name", json_string(run->plan.name));
  json_object_set_new(plan, "reason", json_string(run->plan.reason));
  json_object_set_new(plan, "sequence_parallel", json_boolean(run->plan.sequence_parallel));
  json_t *rules = json_array();
  for (size_t i = 0; i < run->plan.n; i++) {
    json_t *r = json_object();
    json_object_set_new(r, "pattern", json_string(run->plan.rules[i].pattern));
    json_object_set_new(r, "label", json_string(run->plan.rules[i].style.label));
    json_object_set_new(r, "style", json_string(ml_style_kind_name(run->plan.rules[i].style.kind)));
    json_array_append_new(rules, r);
  }
  json_object_set_new(plan, "rules", rules);
  json_object_set_new(root, "plan", plan);
  json_object_set_new(root, "residual", jplacement(run->ranks[0].tp.residual));
  json_object_set_new(root, "logits", jplacement(run->ranks[0].tp.logits));
  return root;
}

static json_t *jmodules(const plan_run *run) {
  const plan_rank *r0 = &run->ranks[0];
  const ml_model *m = &r0->model;
  json_t *mods = json_array();
  for (int i = 0; i < m->n_modules; i++) {
    const ml_module *mod = &m->modules[i];
    const ml_plan_rule *rule = r0->tp.modules[i].rule;
    json_t *jm = json_object();
    json_object_set_new(jm, "name", json_string(mod->name));
    json_object_set_new(jm, "kind", json_string(kind_name(mod->kind)));
    json_object_set_new(jm, "pattern", rule ? json_string(rule->pattern) : json_null());
    json_object_set_new(jm, "label", json_string(rule ? rule->style.label : "replicated"));
    json_object_set_new(jm, "style",
                        rule ? json_string(ml_style_kind_name(rule->style.kind)) : json_null());
    json_t *params = json_array();
    const ml_param *ps[2];
    module_params(mod, ps);
    for (int k = 0; k < 2; k++) {
      const ml_param *p = ps[k];
      if (!p) continue;
      json_t *jp = json_object();
      json_object_set_new(jp, "role", json_string(param_role(k)));
      json_object_set_new(jp, "name", json_string(p->name));
      json_object_set_new(jp, "shape", jshape(p, p->shape));
      int dim = ml_tp_param_dim(&r0->tp, m, p);
      const char *placement = dim < 0 ? "Replicate()" : dim == 0 ? "Shard(0)" : "Shard(1)";
      json_object_set_new(jp, "placement", json_string(placement));
      json_object_set_new(jp, "grad_partial", json_boolean(ml_tp_grad_partial(&r0->tp, p)));
      json_t *local = json_array(), *rows = json_array();
      for (int r = 0; r < run->n_ranks; r++) {
        const ml_param *pr = param_on(run, r, p);
        json_array_append_new(local, jshape(pr, pr->local));
        int64_t fs = run->o.dp_shard * run->o.t.cp; /* FSDP shards over dp_shard_cp */
        json_array_append_new(rows, json_integer((pr->local[0] + fs - 1) / fs));
      }
      json_object_set_new(jp, "local_shape_per_tp_rank", local);
      json_object_set_new(jp, "fsdp_rows_per_tp_rank", rows);
      bool vocab = r0->pred.vocab_group > 1 &&
                   (p == m->embed_tokens.weight || p == m->lm_head.weight);
      json_object_set_new(jp, "fsdp_vocab_parallel", json_boolean(vocab));
      json_array_append_new(params, jp);
    }
    json_object_set_new(jm, "params", params);
    json_array_append_new(mods, jm);
  }
  return mods;
}

static int jedges(const plan_run *run, json_t **out) {
  const plan_rank *r0 = &run->ranks[0];
  json_t *edges = json_array();
  *out = edges;
  for (int i = 0; i < r0->tp.n_edges; i++) {
    const ml_tp_edge *e = &r0->tp.edges[i];
    ml_placement g[ML_TP_MAX_STEPS + 1];
    int ng = grad_chain(e, g);
    ml_comm_stats f, b;
    ML_TRY(edge_costs(&r0->model, e, &r0->pred, &f, &b));
    json_t *je = json_object(), *fc = json_array(), *gc = json_array();
    for (int k = 0; k < e->n; k++) json_array_append_new(fc, jplacement(e->p[k]));
    for (int k = 0; k < ng; k++) json_array_append_new(gc, jplacement(g[k]));
    json_object_set_new(je, "name", json_string(e->name));
    json_object_set_new(je, "features", json_integer(e->C));
    json_object_set_new(je, "forward", fc);
    json_object_set_new(je, "gradient", gc);
    json_object_set_new(je, "forward_collectives", jstats(&f));
    json_object_set_new(je, "backward_collectives", jstats(&b));
    json_array_append_new(edges, je);
  }
  return 0;
}

static json_t *jprediction(const ml_prediction *p, int64_t layers) {
  json_t *o = json_object();
  json_object_set_new(o, "tp_rank", json_integer(p->tp_rank));
  json_object_set_new(o, "train_step", jgroups(p->train));
  json_object_set_new(o, "logprobs", jgroups(p->logprobs));
  json_object_set_new(o, "padded_seq_len", json_integer(p->S_pad));
  json_object_set_new(o, "local_seq_len", json_integer(p->s_local));
  ring_costs r = ring_per_layer(p, layers);
  json_t *ring = json_object();
  json_object_set_new(ring, "forward_calls", json_integer(r.fwd_calls));
  json_object_set_new(ring, "forward_bytes", json_integer(r.fwd_bytes));
  json_object_set_new(ring, "backward_calls", json_integer(r.bwd_calls));
  json_object_set_new(ring, "backward_bytes", json_integer(r.bwd_bytes));
  json_object_set_new(o, "ring_attention_per_layer", ring);
  json_object_set_new(o, "vocab_parallel_ranks", json_integer(p->vocab_group));
  json_object_set_new(o, "logits_chunk_tokens", json_integer(p->loss_chunk));
  json_object_set_new(o, "logits_chunks", json_integer(p->loss_chunks));
  json_t *fz = json_object();
  json_object_set_new(fz, "parameters", json_integer(p->frozen_params));
  json_object_set_new(fz, "elements", json_integer(p->frozen_numel));
  json_object_set_new(fz, "units", json_integer(p->frozen_units));
  json_object_set_new(o, "frozen", fz);
  json_t *f32 = json_object();
  json_object_set_new(f32, "parameters", json_integer(p->fp32_params));
  json_object_set_new(f32, "elements", json_integer(p->fp32_numel));
  json_object_set_new(f32, "units", json_integer(p->fp32_units));
  json_object_set_new(f32, "gather_bytes", json_integer(p->fp32_gather_bytes));
  json_object_set_new(o, "fp32_params", f32);
  const ml_predict_memory *m = &p->mem;
  json_t *mem = json_object();
  json_object_set_new(mem, "shards", json_integer(m->shards));
  json_object_set_new(mem, "host", json_integer(m->host));
  json_object_set_new(mem, "opened", json_integer(m->opened));
  json_object_set_new(mem, "activations", json_integer(m->activations));
  json_object_set_new(mem, "train_peak", json_integer(m->train_peak));
  json_object_set_new(mem, "step_reserved", json_integer(m->step_reserved));
  json_object_set_new(mem, "logprobs_peak", json_integer(m->logprobs_peak));
  json_object_set_new(mem, "logprobs_reserved", json_integer(m->logprobs_reserved));
  json_object_set_new(mem, "logprobs_opened", json_integer(m->logprobs_opened));
  json_object_set_new(mem, "logprobs_shards", json_integer(m->logprobs_shards));
  json_object_set_new(mem, "reference_policy", json_integer(m->reference));
  json_object_set_new(o, "memory_bytes", mem);
  return o;
}

static int print_json(const plan_run *run) {
  json_t *root = jheader(run), *edges = NULL;
  json_object_set_new(root, "modules", jmodules(run));
  const plan_rank *r0 = &run->ranks[0];
  if (ml_plan_heads_split(&r0->tp, &r0->model))
    json_object_set_new(root, "attention_heads", ml_plan_heads_json(&r0->tp, &r0->model));
  if (jedges(run, &edges)) {
    json_decref(edges);
    json_decref(root);
    return -1;
  }
  json_object_set_new(root, "edges", edges);
  json_t *per = json_array();
  for (int r = 0; r < run->n_ranks; r++)
    json_array_append_new(per, jprediction(&run->ranks[r].pred, run->cfg.n_layers));
  json_object_set_new(root, "per_tp_rank", per);
  char *s = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
  json_decref(root);
  if (!s) return ml_err("plan: out of memory formatting the JSON report");
  ml_cli_print("%s\n", s);
  free(s);
  return 0;
}

/* The flags of train that shape a step (the rest: data, schedule, outputs,
 * do not change what one step allocates or communicates). */
static const char *const k_step_flags[] = {
    "--model", "--tp", "--dp-replicate", "--cp", "--ep", "--sequence-parallel", "--parallel-plan",
    "--param-dtype", "--reduce-dtype", "--output-dtype", "--reshard-after-forward", "--zero",
    "--prefetch-forward", "--prefetch-backward", "--activation-checkpointing", "--cpu-offload",
    "--batch-invariant", "--batch-size", "--grad-accum", "--seq-len", "--freeze", "--lora-rank",
    "--lora-alpha", "--lora-dropout", "--lora-targets", "--lora-rslora", "--adapter",
    "--fp32-params"};

/* spec[]: train's step flags over o->t, then plan's own. Returns the count. */
static size_t plan_flags(plan_opts *o, ml_arg *spec) {
  ml_arg all[ML_TRAIN_MAX_FLAGS];
  size_t n_all = ml_train_flags(&o->t, all), n = 0;
  for (size_t i = 0; i < n_all; i++)
    for (size_t k = 0; k < sizeof k_step_flags / sizeof k_step_flags[0]; k++)
      if (!strcmp(all[i].name, k_step_flags[k])) spec[n++] = all[i];
  for (size_t i = 0; i < n; i++)
    if (!strcmp(spec[i].name, "--model"))
      spec[i].help = "HF checkpoint directory (only config.json is read)";
  spec[n++] = (ml_arg){"--dp-shard", ML_ARG_INT, &o->dp_shard,
                       "FSDP (sharded data-parallel) size", false, NULL};
  spec[n++] = (ml_arg){"--json", ML_ARG_FLAG, &o->json, "print the report as one JSON document",
                       false, NULL};
  spec[n++] = (ml_arg){"--verbose", ML_ARG_FLAG, &o->verbose,
                       "list every decoder layer's modules and edges (default: a layer identical "
                       "to an earlier one is one line, 'same as')",
                       false, NULL};
  return n;
}

int ml_cmd_plan(ml_host *world, int argc, char **argv) {
  plan_run run = {.o = {.t = ml_train_opts_default(), .dp_shard = 1}};
  plan_opts *o = &run.o;
  ml_arg spec[ML_TRAIN_MAX_FLAGS + 3];
  size_t n = plan_flags(o, spec);
  int rc = ml_cli_parse("plan",
                        "show the parallel plan, per-rank shards, one step's collectives and "
                        "memory, without running (world = dp_replicate x dp_shard x cp x tp); train's "
                        "flags set the step",
                        argc, argv, spec, n);
  if (rc == 1) return 0;
  if (rc == 0) rc = build(&run);
  if (rc == 0) rc = o->json ? print_json(&run) : print_text(&run);
  rc = ml_cli_agree(world, rc);
  run_free(&run);
  return rc;
}
