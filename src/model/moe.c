/* The sparse MoE block (model/moe.h): routing on the host, one GEMM per
 * expert over its gathered tokens on the backend. */
#include "model/moe.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "model/linear.h"
#include "model/moe_shared.h"
#include "tensor/placement.h"

int ml_moe_check(const ml_model *m, const char *device) {
  if (m->cfg.n_experts == 0 || ml_be_host_memory(m->be) || strcmp(device, "meta") == 0) return 0;
  return ml_err("backend '%s': %s's mixture-of-experts layers run on the CPU backend only (their "
                "routing reads host memory); expected --device cpu",
                device, m->cfg.family->architecture);
}

/* Where each (token, choice) of tokens t0 .. t0 + T − 1 of a layer goes
 * (all of its tokens, or this tp rank's chunk of them under ep with tp:
 * model.h ml_moe_ep.slices): the choices routed to expert e are rows
 * off[e] .. off[e + 1] − 1 of the gathered buffers, in token order then
 * choice order; slot[t·k + j] is the row of choice j of token t0 + t. Host
 * memory. */
typedef struct routing {
  int64_t t0, T, E, k;
  int64_t *off;  /* [E + 1] */
  int64_t *slot; /* [T · k] */
} routing;

static void routing_free(routing *r) {
  free(r->off);
  free(r->slot);
}

/* Whether the block models its routing instead of computing it: on the
 * meta backend (`meshlm plan`, engine/predict.h; the only backend without
 * host memory ml_moe_check lets through) nothing can read the router's
 * output, so the routing is taken as balanced — expert e gets rows
 * floor(e·T·k/E) .. floor((e+1)·T·k/E) − 1, in token order — and the host
 * loops over the buffers (gathers, weighted sums, the router's backward)
 * are skipped; the GEMMs and the exchanges run with those sizes. */
static bool modelled(const ml_model *m) { return !ml_be_host_memory(m->be); }

/* The rows of each expert for tokens t0 .. t0 + T − 1 from L's saved
 * top_e (a counting sort), or the balanced routing where it is modelled. */
static int routing_of(const ml_model *m, const ml_layer *L, int64_t t0, int64_t T, routing *r) {
  int64_t E = m->cfg.n_experts, k = m->cfg.top_k;
  *r = (routing){t0, T, E, k, calloc((size_t)E + 1, sizeof(int64_t)),
                 malloc(sizeof(int64_t) * (size_t)(T * k))};
  if (!r->off || !r->slot) {
    routing_free(r);
    return ml_err("out of host memory for the routing of %lld tokens to %lld experts",
                  (long long)T, (long long)E);
  }
  if (modelled(m)) {
    for (int64_t e = 0; e <= E; e++) r->off[e] = e * T * k / E;
    for (int64_t i = 0; i < T * k; i++) r->slot[i] = i;
    return 0;
  }
  const float *top_e = L->acts.top_e + t0 * k;
  for (int64_t i = 0; i < T * k; i++) r->off[(int64_t)top_e[i] + 1]++;
  for (int64_t e = 0; e < E; e++) r->off[e + 1] += r->off[e];
  int64_t *next = malloc(sizeof(int64_t) * (size_t)E);
  if (!next) {
    routing_free(r);
    return ml_err("out of host memory for the routing of %lld experts", (long long)E);
  }
  memcpy(next, r->off, sizeof(int64_t) * (size_t)E);
  for (int64_t i = 0; i < T * k; i++) r->slot[i] = next[(int64_t)top_e[i]]++;
  free(next);
  return 0;
}

/* Router probabilities in place: probs [T, E] holds the logits, becomes
 * softmax over each row (fp32, max-subtracted as torch's softmax); then
 * each token's k experts into top_e / top_w: its top k (torch.topk's
 * descending order; exact ties by the lower index: model/moe.h), or under
 * router replay the recorded ones, rows [T, L, k] of m->route_replay at
 * layer l (a row whose first entry is negative: its own top-k), their
 * weights the probabilities at them; renormalized when
 * norm_topk. taken: [E] host scratch. Errors: a recorded expert out of
 * range or repeated within a token. */
static int route(const ml_model *m, int64_t l, float *probs, float *top_e, float *top_w,
                 int64_t T, bool *taken) {
  int64_t E = m->cfg.n_experts, k = m->cfg.top_k, nl = m->cfg.n_layers;
  for (int64_t t = 0; t < T; t++) {
    float *p = probs + t * E, mx = p[0], sum = 0.0f;
    for (int64_t e = 1; e < E; e++) mx = p[e] > mx ? p[e] : mx;
    for (int64_t e = 0; e < E; e++) sum += p[e] = expf(p[e] - mx);
    for (int64_t e = 0; e < E; e++) p[e] /= sum;
    float *te = top_e + t * k, *tw = top_w + t * k, wsum = 0.0f;
    const int32_t *rec = m->route_replay ? m->route_replay + (t * nl + l) * k : NULL;
    if (rec && rec[0] < 0) rec = NULL; /* not recorded: its own top-k */
    memset(taken, 0, sizeof(bool) * (size_t)E);
    for (int64_t j = 0; j < k; j++) { /* the largest not taken yet, the lower index on ties */
      int64_t best = -1;
      if (rec) {
        best = rec[j];
        if (best < 0 || best >= E || taken[best])
          return ml_err("router replay: token %lld of layer %lld, choice %lld: expert %lld; "
                        "expected %lld distinct experts in 0 .. %lld per token",
                        (long long)t, (long long)l, (long long)j, (long long)best,
                        (long long)k, (long long)E - 1);
      }
      for (int64_t e = 0; !rec && e < E; e++)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = true;
      te[j] = (float)best;
      tw[j] = p[best];
      wsum += p[best];
    }
    if (m->cfg.norm_topk)
      for (int64_t j = 0; j < k; j++) tw[j] /= wsum;
    int32_t *out = m->route_record ? m->route_record + (t * nl + l) * k : NULL;
    for (int64_t j = 0; out && j < k; j++) out[j] = (int32_t)te[j];
  }
  return 0;
}

int ml_moe_aux_begin(ml_model *m, int64_t valid) {
  ml_moe_aux *x = &m->aux;
  x->grad = x->value = 0.0;
  if (!m->cfg.router_aux) return 0;
  int64_t n = 2 * m->cfg.n_experts + 1;
  if (!x->sums && !(x->sums = malloc(sizeof(double) * (size_t)n)))
    return ml_err("out of host memory for the load-balancing loss's %lld sums", (long long)n);
  memset(x->sums, 0, sizeof(double) * (size_t)n);
  x->valid = valid;
  x->pos = NULL;
  x->open = true;
  return 0;
}

void ml_moe_aux_close(ml_model *m) {
  ml_moe_aux *x = &m->aux;
  if (!x->open) return;
  x->open = false;
  int64_t E = m->cfg.n_experts;
  double rows = x->sums[2 * E], dot = 0.0;
  if (rows <= 0.0) return;
  for (int64_t e = 0; e < E; e++) dot += x->sums[e] * x->sums[E + e];
  x->value = (double)E * dot / (rows * rows);
  x->grad = m->cfg.aux_coef * (double)E / (rows * rows);
}

/* Whether token t of a forward over sequences of s local positions counts
 * in the aux sums: its global position is below valid. */
static bool counted(const ml_moe_aux *x, int64_t t, int64_t s) {
  int64_t i = t % s;
  return (x->pos ? x->pos[i] : i) < x->valid;
}

/* The counted tokens of h [B, s] into the aux sums: each one's k choices,
 * its probabilities, one row. */
static void aux_add(ml_model *m, const ml_layer_acts *a, const ml_act *h) {
  ml_moe_aux *x = &m->aux;
  int64_t E = m->cfg.n_experts, k = m->cfg.top_k, T = h->B * h->s;
  for (int64_t t = 0; t < T; t++) {
    if (!counted(x, t, h->s)) continue;
    for (int64_t j = 0; j < k; j++) x->sums[(int64_t)a->top_e[t * k + j]] += 1.0;
    for (int64_t e = 0; e < E; e++) x->sums[E + e] += a->probs[t * E + e];
    x->sums[2 * E] += 1.0;
  }
}

/* dst [T·k, cols] rows in expert order = src [t0 + T, cols] row t0 + t
 * for each of its choices. */
static void gather(const routing *r, const float *src, int64_t cols, float *dst) {
  for (int64_t t = 0; t < r->T; t++)
    for (int64_t j = 0; j < r->k; j++)
      memcpy(dst + r->slot[t * r->k + j] * cols, src + (r->t0 + t) * cols,
             sizeof(float) * (size_t)cols);
}

/* The tokens this rank dispatches of a layer's T: its tp rank's
 * torch.chunk under ep with tp (model.h ml_moe_ep.slices), else all. */
static void dispatched(const ml_model *m, int64_t T, int64_t *t0, int64_t *n) {
  if (m->moe_ep.slices > 1) {
    ml_chunk(T, m->moe_ep.slices, m->moe_ep.slice, t0, n);
  } else {
    *t0 = 0;
    *n = T;
  }
}

/* The view of rows [r0, r0 + n) of a [rows, c] buffer as one sequence. */
static ml_act rows_view(float *x, int64_t r0, int64_t n, int64_t c) {
  return (ml_act){x + r0 * c, 1, n, n, c, c};
}

/* A scratch buffer of n floats in the backend's pool. */
static float *scratch(ml_model *m, int64_t n, const char *what) {
  return ml_be_alloc(m->be, n, sizeof(float), "the MoE block's %s (%lld floats)", what,
                     (long long)n);
}

/* The experts e0 .. e0 + n − 1 over their rows: expert e0 + i takes rows
 * off[i] .. off[i + 1] − 1 of x [off[n], H], one GEMM each; g, u, act
 * [off[n], I] and out [off[n], H] (=) the rows' activations and outputs. */
static int experts_forward(ml_model *m, const ml_layer *L, float *x, const int64_t *off,
                           int64_t e0, int64_t n, float *g, float *u, float *act, float *out) {
  int64_t H = m->cfg.hidden, I = m->cfg.moe_inter, rows = off[n];
  const ml_linear *ex = L->moe.experts;
  for (int64_t i = 0; i < n; i++) {
    int64_t r0 = off[i], k = off[i + 1] - r0, e = e0 + i;
    if (k == 0) continue;
    ml_act xv = rows_view(x, r0, k, H), y;
    ML_TRY(ml_linear_forward(m->be, &ex[3 * e], &xv, NULL, g + r0 * I, &y));
    ML_TRY(ml_linear_forward(m->be, &ex[3 * e + 1], &xv, NULL, u + r0 * I, &y));
  }
  // act: [rows, I] = act(g) · u
  if (rows > 0) ML_TRY(ml_be_glu_fwd(m->be, g, u, act, rows * I, m->cfg.family->act));
  for (int64_t i = 0; i < n; i++) {
    int64_t r0 = off[i], k = off[i + 1] - r0, e = e0 + i;
    if (k == 0) continue;
    ml_act av = rows_view(act, r0, k, I), y;
    ML_TRY(ml_linear_forward(m->be, &ex[3 * e + 2], &av, NULL, out + r0 * H, &y));
  }
  return 0;
}

/* The experts' backward over their rows (layout of experts_forward): dy
 * [rows, H] the outputs' gradient (the down GEMMs' edges may rewrite it),
 * x, act, g, u the forward's; dx [rows, H] (=) the rows' input gradient;
 * da, dg, du [rows, I] scratch; weight gradients (+=). */
static int experts_backward(ml_model *m, ml_layer *L, const int64_t *off, int64_t e0, int64_t n,
                            float *dy, float *x, float *act, const float *g, const float *u,
                            float *dx, float *da, float *dg, float *du) {
  int64_t H = m->cfg.hidden, I = m->cfg.moe_inter, rows = off[n];
  ml_linear *ex = L->moe.experts;
  for (int64_t i = 0; i < n; i++) {
    int64_t r0 = off[i], k = off[i + 1] - r0, e = e0 + i;
    if (k == 0) continue;
    ml_act dyv = rows_view(dy, r0, k, H), av = rows_view(act, r0, k, I);
    ML_TRY(ml_linear_backward(m->be, &ex[3 * e + 2], &dyv, &av, NULL, da + r0 * I, 0));
  }
  if (rows > 0) ML_TRY(ml_be_glu_bwd(m->be, da, g, u, dg, du, rows * I, m->cfg.family->act));
  for (int64_t i = 0; i < n; i++) {
    int64_t r0 = off[i], k = off[i + 1] - r0, e = e0 + i;
    if (k == 0) continue;
    ml_act xv = rows_view(x, r0, k, H);
    ml_act dgv = rows_view(dg, r0, k, I), duv = rows_view(du, r0, k, I);
    ML_TRY(ml_linear_backward(m->be, &ex[3 * e], &dgv, &xv, NULL, dx + r0 * H, 0));
    ML_TRY(ml_linear_backward(m->be, &ex[3 * e + 1], &duv, &xv, NULL, dx + r0 * H, 1));
  }
  return 0;
}

/* ---- expert parallelism (model.h ml_moe_ep) ----
 * Dispatch: each rank's gathered rows are in expert order, so its block
 * for rank p (experts p·El .. (p+1)·El − 1, El = E / ranks) is contiguous:
 * one all-to-all of the per-expert counts, one of the rows. Rank q's block
 * arrives sorted by expert, then token, then choice; the received rows are
 * regrouped by local expert, then source rank (then token, then choice),
 * so each expert's rows are contiguous and in a fixed order; the experts
 * run as on one rank; their outputs go back regrouped by source rank, with
 * the inverse all-to-all, into the sender's expert order (ye), and the
 * sender sums them per token in choice order as on one rank. Backward moves
 * the output gradients the same way as the inputs and the input gradients
 * back as the outputs. */

/* What a layer's forward keeps for backward under expert parallelism. */
struct ml_moe_held {
  int64_t R;      /* rows received for this rank's experts */
  int64_t *cnt;   /* host [ranks · El]: rows from rank q for local expert j at q·El + j */
  float *x;       /* [R, H] the received rows, by local expert then source rank; then g, u,
                     act [R, I] each in the same pool block */
  float *g, *u, *act;
};

void ml_moe_release(ml_model *m, ml_layer *L) {
  struct ml_moe_held *h = L->moe_held;
  if (!h) return;
  ml_be_free(m->be, h->x);
  free(h->cnt);
  free(h);
  L->moe_held = NULL;
}

/* One exchange's sizes: sc[p] the floats this rank sends rank p (its rows
 * of rank p's experts, from the routing's offsets), rc[q] those it receives
 * from rank q (cnt's rows of q), cols floats per row; loff [El + 1] the
 * local experts' row offsets (in rows) in the regrouped layout. */
static void ep_sizes(const ml_model *m, const routing *r, const int64_t *cnt, int64_t cols,
                     int64_t *sc, int64_t *rc, int64_t *loff) {
  int P = m->moe_ep.ranks;
  int64_t El = r->E / P;
  for (int p = 0; p < P; p++) {
    sc[p] = (r->off[(p + 1) * El] - r->off[p * El]) * cols;
    rc[p] = 0;
    for (int64_t j = 0; j < El; j++) rc[p] += cnt[p * El + j] * cols;
  }
  loff[0] = 0;
  for (int64_t j = 0; j < El; j++) {
    loff[j + 1] = loff[j];
    for (int p = 0; p < P; p++) loff[j + 1] += cnt[p * El + j];
  }
}

/* Rows of cols floats between the received layout (source rank, then
 * local expert) and the regrouped one (local expert, then source rank):
 * to_expert: src received → dst regrouped; else the inverse. next: [El]
 * host scratch. */
static void regroup(const ml_model *m, int64_t El, const int64_t *cnt, const int64_t *loff,
                    int64_t cols, const float *src, float *dst, bool to_expert, int64_t *next) {
  int P = m->moe_ep.ranks;
  memcpy(next, loff, sizeof(int64_t) * (size_t)El);
  int64_t at = 0; /* row in the received layout */
  for (int q = 0; q < P; q++)
    for (int64_t j = 0; j < El; j++) {
      int64_t n = cnt[q * El + j], to = next[j];
      next[j] += n;
      size_t bytes = sizeof(float) * (size_t)(n * cols);
      if (to_expert) memcpy(dst + to * cols, src + at * cols, bytes);
      else memcpy(dst + at * cols, src + to * cols, bytes);
      at += n;
    }
}

/* The rows to allocate for R received rows of a rank sending TK: R rounded
 * up to a multiple of ceil(TK / 8). R changes with the routing from layer
 * to layer and step to step; the backend's caching allocator (backend/
 * pool.h) reuses a freed block for a request up to 1/8 smaller, so these
 * sizes, a few classes apart, keep reusing the same blocks instead of
 * caching one per size seen (bench/moe_throughput.sh's ep2, measured:
 * peak RSS 558 MiB per rank with exact sizes, 483 MiB with these). */
static int64_t rows_cap(int64_t R, int64_t TK) {
  int64_t q = (TK + 7) / 8 > 0 ? (TK + 7) / 8 : 1;
  return (R + q - 1) / q * q;
}

/* Host scratch of an exchange: sc, rc [ranks], loff [El + 1], next [El]. */
typedef struct ep_tables {
  int64_t *sc, *rc, *loff, *next;
} ep_tables;

static int ep_tables_alloc(const ml_model *m, ep_tables *t) {
  int64_t P = m->moe_ep.ranks, El = m->cfg.n_experts / P;
  t->sc = malloc(sizeof(int64_t) * (size_t)(2 * P + 2 * El + 1));
  if (!t->sc) return ml_err("out of host memory for the expert exchange's tables");
  t->rc = t->sc + P;
  t->loff = t->rc + P;
  t->next = t->loff + El + 1;
  return 0;
}

// xe: [T·k, H] rows in expert order → ye: [T·k, H] (=) their experts' outputs, same order
static int ep_forward(ml_model *m, ml_layer *L, const routing *r, const float *xe, float *ye) {
  const ml_moe_ep *ep = &m->moe_ep;
  int64_t H = m->cfg.hidden, I = m->cfg.moe_inter, E = r->E, El = E / ep->ranks;
  ml_moe_release(m, L);
  struct ml_moe_held *h = calloc(1, sizeof *h);
  int64_t *mine = malloc(sizeof(int64_t) * (size_t)E); /* rows per expert, sent */
  ep_tables t = {0};
  int rc = h && mine ? ep_tables_alloc(m, &t)
                     : ml_err("out of host memory for the expert exchange of %lld experts",
                              (long long)E);
  if (!rc) L->moe_held = h;
  if (!rc && !(h->cnt = malloc(sizeof(int64_t) * (size_t)E)))
    rc = ml_err("out of host memory for the expert exchange's counts");
  for (int64_t e = 0; !rc && e < E; e++) mine[e] = r->off[e + 1] - r->off[e];
  if (!rc && modelled(m)) /* every rank's routing balanced alike: no exchange */
    for (int64_t i = 0; i < E; i++) h->cnt[i] = mine[(int64_t)ep->rank * El + i % El];
  else if (!rc)
    rc = ep->counts(ep->ctx, mine, (int)El, h->cnt);  // [ranks · El] rows per (q, j)
  float *tmp = NULL; /* [2R, H]: the rows as received, then the outputs as sent back */
  if (!rc) {
    ep_sizes(m, r, h->cnt, H, t.sc, t.rc, t.loff);
    h->R = t.loff[El];
    int64_t cap = rows_cap(h->R, r->T * r->k);
    h->x = scratch(m, cap * (H + 3 * I), "received rows and their activations");
    tmp = scratch(m, 2 * cap * H, "exchanged rows");
    rc = h->x && tmp ? 0 : -1;
  }
  if (!rc) {
    h->g = h->x + h->R * H, h->u = h->g + h->R * I, h->act = h->u + h->R * I;
    rc = ep->rows(ep->ctx, xe, t.sc, tmp, t.rc);  // [R, H] by source rank
  }
  if (!rc) {
    if (!modelled(m)) regroup(m, El, h->cnt, t.loff, H, tmp, h->x, true, t.next);  // by expert
    rc = experts_forward(m, L, h->x, t.loff, (int64_t)ep->rank * El, El, h->g, h->u, h->act,
                         tmp);
  }
  if (!rc) rc = ml_be_sync(m->be);
  if (!rc) {
    float *back = tmp + h->R * H;
    if (!modelled(m)) regroup(m, El, h->cnt, t.loff, H, tmp, back, false, t.next);  // by source
    rc = ep->rows(ep->ctx, back, t.rc, ye, t.sc);  // the inverse exchange
  }
  ml_be_free(m->be, tmp);
  free(t.sc);
  free(mine);
  if (!L->moe_held) free(h);
  return rc;
}

// dye: [T·k, H] output gradients in expert order → dxe: [T·k, H] (=) input gradients
static int ep_backward(ml_model *m, ml_layer *L, const routing *r, const float *dye, float *dxe) {
  const ml_moe_ep *ep = &m->moe_ep;
  struct ml_moe_held *h = L->moe_held;
  if (!h)
    return ml_err("MoE backward under expert parallelism: the layer has no forward's rows (a "
                  "backward without its forward); expected ml_moe_forward first");
  int64_t H = m->cfg.hidden, I = m->cfg.moe_inter, El = r->E / ep->ranks, R = h->R;
  ep_tables t = {0};
  ML_TRY(ep_tables_alloc(m, &t));
  int64_t cap = rows_cap(R, r->T * r->k);
  float *buf = scratch(m, 3 * cap * (H + I), "expert-parallel backward");
  int rc = buf ? 0 : -1;
  float *dyr = buf, *dyl = buf + R * H, *dxl = dyl + R * H, *da = dxl + R * H;
  float *dg = da + R * I, *du = dg + R * I;
  if (!rc) {
    ep_sizes(m, r, h->cnt, H, t.sc, t.rc, t.loff);
    rc = ep->rows(ep->ctx, dye, t.sc, dyr, t.rc);  // [R, H] by source rank
  }
  if (!rc) {
    if (!modelled(m)) regroup(m, El, h->cnt, t.loff, H, dyr, dyl, true, t.next);
    rc = experts_backward(m, L, t.loff, (int64_t)ep->rank * El, El, dyl, h->x, h->act, h->g,
                          h->u, dxl, da, dg, du);
  }
  if (!rc) rc = ml_be_sync(m->be);
  if (!rc) {
    if (!modelled(m)) regroup(m, El, h->cnt, t.loff, H, dxl, dyr, false, t.next);  // by source
    rc = ep->rows(ep->ctx, dyr, t.rc, dxe, t.sc);
  }
  ml_be_free(m->be, buf);
  free(t.sc);
  ml_moe_release(m, L); /* backward was its last use */
  return rc;
}

/* Whether the sparse layers exchange rows with other ranks. */
static bool ep_on(const ml_model *m) { return m->moe_ep.ranks > 1; }

int ml_moe_forward_idle(ml_model *m, ml_layer *L) {
  if (!ep_on(m)) return 0;
  int64_t E = m->cfg.n_experts;
  routing r = {0, 0, E, m->cfg.top_k, calloc((size_t)E + 1, sizeof(int64_t)), NULL};
  float *none = scratch(m, 1, "idle rank's empty rows"); /* sent and received: 0 rows */
  int rc = r.off ? 0 : ml_err("out of host memory for the routing of %lld experts", (long long)E);
  if (!rc && !none) rc = -1;
  if (!rc) rc = ep_forward(m, L, &r, none, none);
  ml_moe_release(m, L); /* no backward follows */
  ml_be_free(m->be, none);
  routing_free(&r);
  return rc;
}

/* The sizes below (T·k·H, T·k·I, T·E) are those of the layer's saved
 * buffers ye, g/u/a and probs, which ml_model_begin allocated (model.c
 * sizes them with saturating products): they fit int64. R, the rows an
 * expert-parallel rank receives, is at most ranks · T·k. */

// h: [T, H] → y: [T, H] (=)
int ml_moe_forward(ml_model *m, ml_layer *L, const ml_act *h, float *y) {
  ml_layer_acts *a = &L->acts;
  const ml_moe *moe = &L->moe;
  int64_t T = h->B * h->s, H = m->cfg.hidden, k = m->cfg.top_k;
  ml_act lv;
  ML_TRY(ml_linear_forward(m->be, &moe->gate, h, NULL, a->probs, &lv));  // logits [T, E]
  ML_TRY(ml_be_sync(m->be));
  bool *taken = malloc(sizeof(bool) * (size_t)m->cfg.n_experts);
  if (!taken) return ml_err("out of host memory for the routing of %lld experts",
                            (long long)m->cfg.n_experts);
  int rc = modelled(m) ? 0 : route(m, L - m->layers, a->probs, a->top_e, a->top_w, T, taken);
  free(taken);
  ML_TRY(rc);
  if (m->aux.open && !modelled(m)) aux_add(m, a, h);
  int64_t t0, Td; /* the tokens dispatched: t0 .. t0 + Td − 1 */
  dispatched(m, T, &t0, &Td);
  routing r;
  ML_TRY(routing_of(m, L, t0, Td, &r));
  float *xe = scratch(m, Td * k * H, "gathered tokens");  // [Td·k, H] in expert order
  rc = xe ? 0 : -1;
  if (!rc && !modelled(m)) gather(&r, h->x, H, xe);
  if (!rc)
    rc = ep_on(m) ? ep_forward(m, L, &r, xe, a->ye)
                  : experts_forward(m, L, xe, r.off, 0, r.E, a->g, a->u, a->a, a->ye);
  if (!rc) rc = ml_be_sync(m->be);
  for (int64_t t = 0; !rc && !modelled(m) && t < Td; t++) { /* y_t = Σ_j w_tj · ye[slot(t, j)] */
    float *yt = y + (t0 + t) * H;
    memset(yt, 0, sizeof(float) * (size_t)H);
    for (int64_t j = 0; j < k; j++) {
      const float *src = a->ye + r.slot[t * k + j] * H;
      float w = a->top_w[(t0 + t) * k + j];
      for (int64_t c = 0; c < H; c++) yt[c] += w * src[c];
    }
  }
  // y: [Td, H] rows of this tp rank → [T, H] Replicate (all-gather over tp)
  if (!rc && m->moe_ep.slices > 1) rc = m->moe_ep.gather(m->moe_ep.gather_ctx, m->be, y, T, H);
  if (!rc) rc = ml_moe_shared_forward(m, L, h, y);  // y += z · shared(h), every row
  ml_be_free(m->be, xe);
  routing_free(&r);
  return rc;
}

/* For tokens t0 .. t0 + T − 1 of h's: d probs [T, E] (=) from the
 * routing weights' gradient dw [T, k]: through
 * the renormalization w_j = v_j / Σ_i v_i (dv_j = (dw_j − Σ_i dw_i w_i) /
 * Σ_i v_i) when norm_topk, else dv = dw, scattered onto the chosen experts
 * (topk's backward), plus the load-balancing loss's aux.grad · count_e on
 * a counted token (h's positions s per sequence); then the softmax's
 * backward in place: dlogit_e = p_e · (dp_e − Σ_f p_f dp_f). */
static void route_backward(const ml_model *m, const ml_layer_acts *a, const float *dw,
                           float *dlogits, int64_t t0, int64_t T, int64_t s) {
  int64_t E = m->cfg.n_experts, k = m->cfg.top_k;
  const ml_moe_aux *x = &m->aux;
  for (int64_t t = 0; t < T; t++) {
    int64_t u = t0 + t; /* the token in h */
    const float *p = a->probs + u * E, *tw = a->top_w + u * k, *te = a->top_e + u * k;
    const float *g = dw + t * k;
    float *d = dlogits + t * E, vsum = 0.0f, dot = 0.0f;
    memset(d, 0, sizeof(float) * (size_t)E);
    for (int64_t j = 0; j < k; j++) {
      vsum += p[(int64_t)te[j]];
      dot += g[j] * tw[j];
    }
    for (int64_t j = 0; j < k; j++)
      d[(int64_t)te[j]] += m->cfg.norm_topk ? (g[j] - dot) / vsum : g[j];
    if (x->grad != 0.0 && counted(x, u, s))
      for (int64_t e = 0; e < E; e++) d[e] += (float)(x->grad * x->sums[e]);
    float sd = 0.0f;
    for (int64_t e = 0; e < E; e++) sd += p[e] * d[e];
    for (int64_t e = 0; e < E; e++) d[e] = p[e] * (d[e] - sd);
  }
}

/* The per-choice gradients of r's tokens from dy [t0 + T, H]: dye [T·k,
 * H] rows in expert order, w_tj · dy_t; dw [T, k], dy_t · ye[slot(t, j)]. */
static void weigh_backward(const ml_model *m, const ml_layer_acts *a, const routing *r,
                           const float *dy, float *dye, float *dw) {
  int64_t H = m->cfg.hidden, k = r->k;
  for (int64_t t = 0; t < r->T; t++)
    for (int64_t j = 0; j < k; j++) {
      int64_t s = r->slot[t * k + j];
      const float *g = dy + (r->t0 + t) * H, *ye = a->ye + s * H;
      float w = a->top_w[(r->t0 + t) * k + j], dot = 0.0f, *d = dye + s * H;
      for (int64_t c = 0; c < H; c++) {
        d[c] = w * g[c];
        dot += g[c] * ye[c];
      }
      dw[t * k + j] = dot;
    }
}

/* The floats of the backward's scratch, for the Td tokens dispatched
 * (ml_moe_forward's): dye, xe, dxe [Td·k, H]; da, dg, du [Td·k, I]; dw [Td,
 * k]; dlogits [Td, E]. */
enum { BW_DYE, BW_XE, BW_DXE, BW_DA, BW_DG, BW_DU, BW_DW, BW_DLOGITS, BW_N };

// dy: [T, H] → dh: [T, H] (=)
int ml_moe_backward(ml_model *m, ml_layer *L, const ml_act *h, const float *dy, float *dh) {
  ml_layer_acts *a = &L->acts;
  int64_t T = h->B * h->s, H = m->cfg.hidden, I = m->cfg.moe_inter, k = m->cfg.top_k;
  int64_t E = m->cfg.n_experts, t0, Td;
  dispatched(m, T, &t0, &Td);
  int64_t TK = Td * k;
  const int64_t size[BW_N] = {TK * H, TK * H, TK * H, TK * I, TK * I, TK * I, TK, Td * E};
  int64_t total = 0, at[BW_N];
  for (int i = 0; i < BW_N; i++) {
    at[i] = total;
    total += (size[i] + 15) / 16 * 16; /* 64-byte aligned pieces */
  }
  routing r;
  ML_TRY(routing_of(m, L, t0, Td, &r));
  float *buf = scratch(m, total, "backward");
  if (!buf) {
    routing_free(&r);
    return -1;
  }
  float *p[BW_N];
  for (int i = 0; i < BW_N; i++) p[i] = buf + at[i];
  int rc = ml_be_sync(m->be);
  if (!rc) {
    if (!modelled(m)) weigh_backward(m, a, &r, dy, p[BW_DYE], p[BW_DW]);
    if (ep_on(m)) {
      rc = ep_backward(m, L, &r, p[BW_DYE], p[BW_DXE]);
    } else {
      if (!modelled(m)) gather(&r, h->x, H, p[BW_XE]);
      rc = experts_backward(m, L, r.off, 0, E, p[BW_DYE], p[BW_XE], a->a, a->g, a->u,
                            p[BW_DXE], p[BW_DA], p[BW_DG], p[BW_DU]);
    }
  }
  if (!rc) rc = ml_be_sync(m->be);
  for (int64_t t = 0; !rc && !modelled(m) && t < Td; t++) { /* dh_t = Σ_j dxe[slot(t, j)] */
    float *d = dh + (t0 + t) * H;
    memset(d, 0, sizeof(float) * (size_t)H);
    for (int64_t j = 0; j < k; j++) {
      const float *src = p[BW_DXE] + r.slot[t * k + j] * H;
      for (int64_t c = 0; c < H; c++) d[c] += src[c];
    }
  }
  /* dh += the shared expert's, every row (replicated over tp: the rows the all-gather below
   * brings from the other tp ranks hold the same contribution) */
  if (!rc) rc = ml_moe_shared_backward(m, L, h, dy, dh);
  if (!rc) {
    if (!modelled(m)) route_backward(m, a, p[BW_DW], p[BW_DLOGITS], t0, Td, h->s);
    /* the dispatched tokens' rows; under tp each rank's router gradient is then its chunk's
     * part, a Partial sum over tp (parallel/tp_walk.c sparse_block) */
    bool sliced = m->moe_ep.slices > 1;
    ml_act dl = sliced ? rows_view(p[BW_DLOGITS], 0, Td, E)
                       : (ml_act){p[BW_DLOGITS], h->B, h->S, h->s, E, E};
    ml_act hv = sliced ? rows_view(h->x, t0, Td, H) : *h;
    rc = ml_linear_backward(m->be, &L->moe.gate, &dl, &hv, NULL, dh + t0 * H, 1);  // += dl·W_gate
  }
  // dh: [Td, H] rows of this tp rank → [T, H] Replicate (all-gather over tp)
  if (!rc && m->moe_ep.slices > 1) rc = m->moe_ep.gather(m->moe_ep.gather_ctx, m->be, dh, T, H);
  ml_be_free(m->be, buf);
  routing_free(&r);
  return rc;
}
