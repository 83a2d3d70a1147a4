/* One step's collectives and per-rank memory, predicted (see predict.h). */
#include "parallel/predict.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/status.h"
#include "parallel/fsdp.h"
#include "parallel/loss.h"
#include "parallel/redistribute.h"

/* The placement of a gradient for an activation of placement p (tp.c). */
static ml_placement grad_of(ml_placement p) { return p.kind == ML_PARTIAL ? ml_replicate() : p; }

int ml_predict_grad_chain(const ml_tp_edge *e, ml_placement *out, int cap) {
  int n = 0;
  ml_placement g = e->grad_in;
  if (n < cap) out[n++] = g;
  for (int i = e->n - 1; i >= 0; i--) {
    ml_placement t = grad_of(e->p[i]);
    if (ml_placement_eq(g, t)) continue;
    if (n < cap) out[n++] = t;
    g = t;
  }
  return n;
}

int ml_predict_edge(const ml_tp_edge *e, int64_t B, int64_t S, ml_comm_stats *fwd,
                    ml_comm_stats *bwd) {
  memset(fwd, 0, sizeof *fwd);
  memset(bwd, 0, sizeof *bwd);
  for (int i = 0; i + 1 < e->n; i++) {
    if (ml_placement_eq(e->p[i], e->p[i + 1])) continue;
    ml_coll kinds[2];
    int64_t b[2];
    int n;
    ML_TRY(ml_redistribute_cost(e->p[i], e->p[i + 1], B, S, e->C, e->tp->size, kinds, b, &n));
    for (int j = 0; j < n; j++) {
      fwd->calls[kinds[j]]++;
      fwd->bytes[kinds[j]] = ml_add_sat(fwd->bytes[kinds[j]], b[j]);
    }
  }
  /* forward + backward as tp.c counts them; the backward is the rest (a
   * saturated total stays saturated) */
  ML_TRY(ml_tp_edge_cost(e, B, S, bwd->calls, bwd->bytes));
  for (int k = 0; k < ML_COLL_KINDS; k++) {
    bwd->calls[k] -= fwd->calls[k];
    if (bwd->bytes[k] != ML_SAT) bwd->bytes[k] -= fwd->bytes[k];
  }
  return 0;
}

/* Sizes here scale with the flags' batch B·S: every sum and product of them
 * saturates at ML_SAT (common/checked.h), and ml_predict_step refuses a
 * prediction that saturated. Config-only sizes (the FSDP units) are
 * bounded by config.h's limits and stay plain. */
static void stats_add(ml_comm_stats *to, const ml_comm_stats *from, int64_t times) {
  for (int k = 0; k < ML_COLL_KINDS; k++) {
    to->calls[k] = ml_add_sat(to->calls[k], ml_mul_sat(from->calls[k], times));
    to->bytes[k] = ml_add_sat(to->bytes[k], ml_mul_sat(from->bytes[k], times));
  }
}

/* Add calls/bytes to the step's totals and, when non-zero, to the breakdown. */
static void item(ml_prediction *p, const char *what, ml_group g, ml_coll k, int64_t calls,
                 int64_t bytes) {
  if (calls == 0) return;
  p->train[g].calls[k] = ml_add_sat(p->train[g].calls[k], calls);
  p->train[g].bytes[k] = ml_add_sat(p->train[g].bytes[k], bytes);
  for (int i = 0; i < p->n_items; i++) {
    ml_predict_item *it = &p->items[i];
    if (!strcmp(it->what, what) && it->group == g && it->kind == k) {
      it->calls = ml_add_sat(it->calls, calls);
      it->bytes = ml_add_sat(it->bytes, bytes);
      return;
    }
  }
  if (p->n_items < ML_PREDICT_MAX_ITEMS)
    p->items[p->n_items++] = (ml_predict_item){what, g, k, calls, bytes};
}

static void items_of(ml_prediction *p, const char *what, const ml_comm_stats *s) {
  for (int k = 0; k < ML_COLL_KINDS; k++)
    item(p, what, ML_GROUP_TP, (ml_coll)k, s->calls[k], s->bytes[k]);
}

/* The name of the module whose struct is `ptr`, or NULL. */
static const char *module_name(const ml_model *m, const void *ptr) {
  for (int i = 0; i < m->n_modules; i++)
    if (m->modules[i].ptr == ptr) return m->modules[i].name;
  return NULL;
}

static bool edge_active(const ml_tp_edge *e) {
  for (int i = 0; i + 1 < e->n; i++)
    if (!ml_placement_eq(e->p[i], e->p[i + 1])) return true;
  ml_placement g[10];
  return ml_predict_grad_chain(e, g, 10) > 1;
}

static bool ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), k = strlen(suffix);
  return n >= k && !strcmp(s + n - k, suffix);
}

/* Whether e is lm_head's output edge (its hooks run once per logits chunk). */
static bool is_logits_edge(const ml_model *m, const ml_tp_edge *e) {
  const char *lm = module_name(m, &m->lm_head);
  size_t n = lm ? strlen(lm) : 0;
  return lm && !strncmp(e->name, lm, n) && !strcmp(e->name + n, " output");
}

int ml_predict_edge_step(const ml_model *m, const ml_tp_edge *e, const ml_prediction *p,
                         ml_comm_stats *fwd, ml_comm_stats *bwd) {
  if (!is_logits_edge(m, e)) return ml_predict_edge(e, p->B, p->S, fwd, bwd);
  memset(fwd, 0, sizeof *fwd);
  memset(bwd, 0, sizeof *bwd);
  int64_t T = ml_mul_sat(p->B, p->S), chunk = p->loss_chunk;
  int64_t full = chunk > 0 ? T / chunk : 0, rest = chunk > 0 ? T % chunk : 0;
  ml_comm_stats f, b;
  if (full) {
    ML_TRY(ml_predict_edge(e, 1, chunk, &f, &b));
    stats_add(fwd, &f, full);
    stats_add(bwd, &b, full);
  }
  if (rest) {
    ML_TRY(ml_predict_edge(e, 1, rest, &f, &b));
    stats_add(fwd, &f, 1);
    stats_add(bwd, &b, 1);
  }
  return 0;
}

/* tp edges: every edge forward and backward with the batch; lm_head's
 * output edge once per logits chunk. */
static int predict_edges(const ml_model *m, const ml_tp *tp, ml_prediction *p, int64_t *scratch) {
  for (int i = 0; i < tp->n_edges; i++) {
    const ml_tp_edge *e = &tp->edges[i];
    ml_comm_stats tf, tb;
    ML_TRY(ml_predict_edge_step(m, e, p, &tf, &tb));
    bool logits = is_logits_edge(m, e);
    int64_t work = ml_redistribute_work(logits ? 1 : p->B, logits ? p->loss_chunk : p->S, e->C,
                                        tp->size);
    if (edge_active(e) && work > *scratch) *scratch = work;
    items_of(p, "tp edges (forward)", &tf);
    items_of(p, "tp edges (backward)", &tb);
    stats_add(&p->logprobs[ML_GROUP_TP], &tf, 1);
  }
  return 0;
}

/* The vocab-parallel loss: per chunk an all-reduce MAX of nt floats and an
 * all-reduce SUM of 2·nt floats (loss.c chunk_stats), forward only. */
static void predict_loss(const ml_tp *tp, ml_prediction *p) {
  if (tp->logits.kind != ML_SHARD || tp->size == 1) return;
  int64_t bytes = ml_mul_sat(12, ml_mul_sat(p->B, p->S)), calls = ml_mul_sat(2, p->loss_chunks);
  item(p, "vocab-parallel loss (max, sum-exp + target)", ML_GROUP_TP, ML_COLL_ALL_REDUCE, calls,
       bytes);
  ml_comm_stats *lp = &p->logprobs[ML_GROUP_TP];
  lp->calls[ML_COLL_ALL_REDUCE] = ml_add_sat(lp->calls[ML_COLL_ALL_REDUCE], calls);
  lp->bytes[ML_COLL_ALL_REDUCE] = ml_add_sat(lp->bytes[ML_COLL_ALL_REDUCE], bytes);
}

/* FSDP units (ml_fsdp_layout), the partial-grad all-reduce, and the
 * parameter-side memory. Config sizes only: a unit holds < 2^47 elements
 * and the model < 2^58 (config.h), so its sums and their fp32 bytes are
 * plain; products with the mesh size dp saturate. */
static int predict_units(const ml_model *m, const ml_tp *tp, ml_prediction *p) {
  int n_units = (int)m->cfg.n_layers + 1, dp = p->dp_shard, root = n_units - 1;
  ml_param **ps = ml_calloc((size_t)m->n_params + 1, sizeof *ps, "plan units");
  int64_t *rows = ml_calloc((size_t)m->n_params + 1, sizeof *rows, "plan units");
  if (!ps || !rows) {
    free(ps);
    free(rows);
    return -1;
  }
  int64_t partial = 0, shard_total = 0, max_shard = 0, max_full = 0, max_layer = 0, root_full = 0;
  for (int u = 0; u < n_units; u++) {
    int n = ml_fsdp_unit_params(m, u, ps);
    int64_t shard, full;
    ml_fsdp_layout(ps, n, dp, rows, NULL, NULL, &shard, &full);
    for (int i = 0; i < n; i++)
      if (ml_tp_grad_partial(tp, ps[i])) partial += rows[i] * ps[i]->local[1];
    shard_total += shard;
    if (shard > max_shard) max_shard = shard;
    if (full > max_full) max_full = full;
    if (u == root) root_full = full;
    else if (full > max_layer) max_layer = full;
    if (dp > 1) {
      int64_t bytes = ml_mul_sat(4 * (int64_t)dp, shard);
      item(p, "fsdp all-gather (forward)", ML_GROUP_DP_SHARD, ML_COLL_ALL_GATHER, 1, bytes);
      p->logprobs[ML_GROUP_DP_SHARD].calls[ML_COLL_ALL_GATHER]++;
      p->logprobs[ML_GROUP_DP_SHARD].bytes[ML_COLL_ALL_GATHER] += bytes;
      if (ml_fsdp_reshard_after_forward(ML_RESHARD_DEFAULT, u, n_units))
        item(p, "fsdp all-gather (backward)", ML_GROUP_DP_SHARD, ML_COLL_ALL_GATHER, 1, bytes);
      item(p, "fsdp reduce-scatter (grads)", ML_GROUP_DP_SHARD, ML_COLL_REDUCE_SCATTER, 1, bytes);
    }
    if (p->dp_replicate > 1)
      item(p, "hsdp all-reduce (grads)", ML_GROUP_DP_REPLICATE, ML_COLL_ALL_REDUCE, 1, 4 * shard);
  }
  free(ps);
  free(rows);
  if (tp->size > 1 && tp->n_partial > 0)
    item(p, "partial-grad all-reduce (tp-replicated params)", ML_GROUP_TP, ML_COLL_ALL_REDUCE, 1,
         4 * partial);
  ml_predict_memory *mem = &p->mem;
  mem->params = mem->grads = 4 * shard_total;
  mem->adamw = 2 * mem->params;
  mem->largest_unit = 4 * 2 * max_full;
  mem->unsharded_peak = dp > 1 ? 4 * 2 * (root_full + max_layer) : 0;
  mem->comm_buffer = dp > 1 ? ml_mul_sat(4 * (int64_t)dp, max_shard) : 0;
  if (tp->size > 1 && partial > mem->tp_scratch) mem->tp_scratch = partial;
  return 0;
}

/* Saved activations and the head's buffers (formula in predict.h), with
 * saturating sums and products of the batch (common/checked.h). */
static void predict_activations(const ml_model *m, const ml_tp *tp, ml_prediction *p) {
  const ml_model_config *c = &m->cfg;
  int64_t B = p->B, S = p->S, T = ml_mul_sat(B, S), H = c->hidden, hd = c->head_dim, s = S, start;
  if (ml_placement_eq(tp->residual, ml_shard(1))) ml_chunk(S, tp->size, tp->rank, &start, &s);
  int64_t Tr = ml_mul_sat(B, s), acts = 0;
  for (int l = 0; l < c->n_layers; l++) {
    const ml_layer *L = &m->layers[l];
    char pre[64];
    snprintf(pre, sizeof pre, "%slayers.%d.", c->family->prefix, l);
    int norms = 0;
    bool qk = false;
    for (int i = 0; i < m->n_modules; i++) {
      const ml_module *mod = &m->modules[i];
      if (mod->kind != ML_MOD_RMSNORM || strncmp(mod->name, pre, strlen(pre))) continue;
      if (ends_with(mod->name, ".q_norm") || ends_with(mod->name, ".k_norm")) qk = true;
      else norms++;
    }
    int64_t nh = L->q_proj.weight->local[0] / hd, nkv = L->k_proj.weight->local[0] / hd;
    int64_t I = L->gate_proj.weight->local[0];
    /* per-token widths: config sizes (<= 2^24 each, config.h), plain */
    int64_t per_tok = (nh + 2 * nkv) * hd + nh * hd + 3 * I + (qk ? (nh + nkv) * (hd + 1) : 0);
    int64_t per_res = (2 + norms) * H + norms;
    int64_t P = ml_mul_sat(ml_mul_sat(ml_mul_sat(B, nh), S), S);
    acts = ml_add_sat(acts, ml_mul_sat(Tr, per_res));
    acts = ml_add_sat(acts, ml_add_sat(ml_mul_sat(T, per_tok), P));
  }
  int parts = tp->logits.kind == ML_SHARD ? tp->size : 1;
  int64_t widest = (c->vocab + parts - 1) / parts;
  ml_predict_memory *mem = &p->mem;
  mem->activations = ml_mul_sat(4, acts);
  int64_t head = ml_add_sat(ml_mul_sat(T, H), ml_mul_sat(Tr, 2 * H + 1));
  mem->head = ml_mul_sat(4, ml_add_sat(head, p->loss_chunk * (widest + 4)));
}

/* Whether a size of the prediction saturated (beyond int64). The totals
 * cover their parts: memory by mem.total, each item by its group's stats. */
static bool saturated(const ml_prediction *p) {
  if (p->mem.total == ML_SAT) return true;
  for (int g = 0; g < ML_GROUP_KINDS; g++)
    for (int k = 0; k < ML_COLL_KINDS; k++)
      if (p->train[g].bytes[k] == ML_SAT || p->train[g].calls[k] == ML_SAT ||
          p->logprobs[g].bytes[k] == ML_SAT || p->logprobs[g].calls[k] == ML_SAT)
        return true;
  return false;
}

int ml_predict_step(const ml_model *m, const ml_tp *tp, int dp_replicate, int dp_shard,
                    int64_t B, int64_t S, ml_prediction *out) {
  memset(out, 0, sizeof *out);
  if (B < 1 || S < 1 || dp_replicate < 1 || dp_shard < 1)
    return ml_err("plan: expected a local batch B >= 1, S >= 1 and dp_replicate, dp_shard >= 1; "
                  "found B=%lld, S=%lld, dp_replicate=%d, dp_shard=%d",
                  (long long)B, (long long)S, dp_replicate, dp_shard);
  out->dp_replicate = dp_replicate;
  out->dp_shard = dp_shard;
  out->tp = tp->size;
  out->tp_rank = tp->rank;
  out->world = dp_replicate * dp_shard * tp->size;
  out->B = B;
  out->S = S;
  int parts = tp->logits.kind == ML_SHARD ? tp->size : 1;
  int64_t T = ml_mul_sat(B, S);
  out->loss_chunk = ml_loss_chunk_tokens(T, m->cfg.vocab, parts);
  out->loss_chunks = T / out->loss_chunk + (T % out->loss_chunk != 0);
  int64_t scratch = 0;
  ML_TRY(predict_edges(m, tp, out, &scratch));
  out->mem.tp_scratch = scratch;
  predict_loss(tp, out);
  ML_TRY(predict_units(m, tp, out));
  out->mem.tp_scratch = ml_mul_sat(out->mem.tp_scratch, 4);
  /* the reported loss and the grad norm travel on the host channel (comm/host.h), not here */
  predict_activations(m, tp, out);
  ml_predict_memory *mem = &out->mem;
  int64_t parts_mem[] = {mem->params,     mem->grads,      mem->adamw,       mem->unsharded_peak,
                         mem->comm_buffer, mem->tp_scratch, mem->activations, mem->head};
  mem->total = 0;
  for (size_t i = 0; i < sizeof parts_mem / sizeof parts_mem[0]; i++)
    mem->total = ml_add_sat(mem->total, parts_mem[i]);
  if (saturated(out))
    return ml_err("plan: one step of a local batch of %lld sequences x %lld tokens needs more than "
                  "2^63 bytes per rank (memory or collectives); expected a smaller --batch-size or "
                  "--seq-len",
                  (long long)B, (long long)S);
  return 0;
}
