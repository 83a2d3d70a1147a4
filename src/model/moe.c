/* The sparse MoE block (model/moe.h): routing on the host, one GEMM per
 * expert over its gathered tokens on the backend. */
#include "model/moe.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "model/linear.h"

int ml_moe_check(const ml_model *m, const char *device) {
  if (m->cfg.n_experts == 0 || ml_be_host_memory(m->be)) return 0;
  return ml_err("backend '%s': %s's mixture-of-experts layers run on the CPU backend only (their "
                "routing reads host memory; `meshlm plan`'s meta backend does not model them "
                "yet); expected --device cpu",
                device, m->cfg.family->architecture);
}

/* Where each (token, choice) of a layer goes: the choices routed to
 * expert e are rows off[e] .. off[e + 1] − 1 of the gathered buffers, in
 * token order then choice order; slot[t·k + j] is the row of choice j of
 * token t. Host memory. */
typedef struct routing {
  int64_t T, E, k;
  int64_t *off;  /* [E + 1] */
  int64_t *slot; /* [T · k] */
} routing;

static void routing_free(routing *r) {
  free(r->off);
  free(r->slot);
}

/* The rows of each expert from L's saved top_e (a counting sort). */
static int routing_of(const ml_model *m, const ml_layer *L, int64_t T, routing *r) {
  int64_t E = m->cfg.n_experts, k = m->cfg.top_k;
  *r = (routing){T, E, k, calloc((size_t)E + 1, sizeof(int64_t)),
                 malloc(sizeof(int64_t) * (size_t)(T * k))};
  if (!r->off || !r->slot) {
    routing_free(r);
    return ml_err("out of host memory for the routing of %lld tokens to %lld experts",
                  (long long)T, (long long)E);
  }
  const float *top_e = L->acts.top_e;
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
 * each token's top k (torch.topk's descending order; exact ties by the
 * lower index: model/moe.h)
 * into top_e / top_w, renormalized when norm_topk. taken: [E] host scratch. */
static void route(const ml_model *m, float *probs, float *top_e, float *top_w, int64_t T,
                  bool *taken) {
  int64_t E = m->cfg.n_experts, k = m->cfg.top_k;
  for (int64_t t = 0; t < T; t++) {
    float *p = probs + t * E, mx = p[0], sum = 0.0f;
    for (int64_t e = 1; e < E; e++) mx = p[e] > mx ? p[e] : mx;
    for (int64_t e = 0; e < E; e++) sum += p[e] = expf(p[e] - mx);
    for (int64_t e = 0; e < E; e++) p[e] /= sum;
    float *te = top_e + t * k, *tw = top_w + t * k, wsum = 0.0f;
    memset(taken, 0, sizeof(bool) * (size_t)E);
    for (int64_t j = 0; j < k; j++) { /* the largest not taken yet, the lower index on ties */
      int64_t best = -1;
      for (int64_t e = 0; e < E; e++)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = true;
      te[j] = (float)best;
      tw[j] = p[best];
      wsum += p[best];
    }
    if (m->cfg.norm_topk)
      for (int64_t j = 0; j < k; j++) tw[j] /= wsum;
  }
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

/* The counted tokens of h [B, s] into the aux sums: each one's k choices,
 * its probabilities, one row. */
static void aux_add(ml_model *m, const ml_layer_acts *a, const ml_act *h) {
  ml_moe_aux *x = &m->aux;
  int64_t E = m->cfg.n_experts, k = m->cfg.top_k, T = h->B * h->s;
  for (int64_t t = 0; t < T; t++) {
    if (t % h->s >= x->valid) continue;
    for (int64_t j = 0; j < k; j++) x->sums[(int64_t)a->top_e[t * k + j]] += 1.0;
    for (int64_t e = 0; e < E; e++) x->sums[E + e] += a->probs[t * E + e];
    x->sums[2 * E] += 1.0;
  }
}

/* dst [T·k, cols] rows in expert order = src [T, cols] row t for each of
 * its choices. */
static void gather(const routing *r, const float *src, int64_t cols, float *dst) {
  for (int64_t t = 0; t < r->T; t++)
    for (int64_t j = 0; j < r->k; j++)
      memcpy(dst + r->slot[t * r->k + j] * cols, src + t * cols, sizeof(float) * (size_t)cols);
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

/* The sizes below (T·k·H, T·k·I, T·E) are those of the layer's saved
 * buffers ye, g/u/a and probs, which ml_model_begin allocated (model.c
 * sizes them with saturating products): they fit int64. */

// h: [T, H] → y: [T, H] (=)
int ml_moe_forward(ml_model *m, ml_layer *L, const ml_act *h, float *y) {
  ml_layer_acts *a = &L->acts;
  const ml_moe *moe = &L->moe;
  int64_t T = h->B * h->s, H = m->cfg.hidden, I = m->cfg.moe_inter, k = m->cfg.top_k;
  ml_act lv;
  ML_TRY(ml_linear_forward(m->be, &moe->gate, h, NULL, a->probs, &lv));  // logits [T, E]
  ML_TRY(ml_be_sync(m->be));
  bool *taken = malloc(sizeof(bool) * (size_t)m->cfg.n_experts);
  if (!taken) return ml_err("out of host memory for the routing of %lld experts",
                            (long long)m->cfg.n_experts);
  route(m, a->probs, a->top_e, a->top_w, T, taken);
  free(taken);
  if (m->aux.open) aux_add(m, a, h);
  routing r;
  ML_TRY(routing_of(m, L, T, &r));
  float *xe = scratch(m, T * k * H, "gathered tokens");  // [T·k, H] in expert order
  int rc = xe ? 0 : -1;
  if (!rc) gather(&r, h->x, H, xe);
  for (int64_t e = 0; !rc && e < r.E; e++) {
    int64_t r0 = r.off[e], n = r.off[e + 1] - r0;
    if (n == 0) continue;
    ml_act x = rows_view(xe, r0, n, H), out;
    rc = ml_linear_forward(m->be, &moe->experts[3 * e], &x, NULL, a->g + r0 * I, &out);
    if (!rc) rc = ml_linear_forward(m->be, &moe->experts[3 * e + 1], &x, NULL, a->u + r0 * I, &out);
  }
  // a: [T·k, I] = act(g) · u
  if (!rc) rc = ml_be_glu_fwd(m->be, a->g, a->u, a->a, T * k * I, m->cfg.family->act);
  for (int64_t e = 0; !rc && e < r.E; e++) {
    int64_t r0 = r.off[e], n = r.off[e + 1] - r0;
    if (n == 0) continue;
    ml_act x = rows_view(a->a, r0, n, I), out;
    rc = ml_linear_forward(m->be, &moe->experts[3 * e + 2], &x, NULL, a->ye + r0 * H, &out);
  }
  if (!rc) rc = ml_be_sync(m->be);
  for (int64_t t = 0; !rc && t < T; t++) { /* y_t = Σ_j w_tj · ye[slot(t, j)], j in order */
    float *yt = y + t * H;
    memset(yt, 0, sizeof(float) * (size_t)H);
    for (int64_t j = 0; j < k; j++) {
      const float *src = a->ye + r.slot[t * k + j] * H;
      float w = a->top_w[t * k + j];
      for (int64_t c = 0; c < H; c++) yt[c] += w * src[c];
    }
  }
  ml_be_free(m->be, xe);
  routing_free(&r);
  return rc;
}

/* d probs [T, E] (=) from the routing weights' gradient dw [T, k]: through
 * the renormalization w_j = v_j / Σ_i v_i (dv_j = (dw_j − Σ_i dw_i w_i) /
 * Σ_i v_i) when norm_topk, else dv = dw, scattered onto the chosen experts
 * (topk's backward), plus the load-balancing loss's aux.grad · count_e on
 * a counted token (h's positions s per sequence); then the softmax's
 * backward in place: dlogit_e = p_e · (dp_e − Σ_f p_f dp_f). */
static void route_backward(const ml_model *m, const ml_layer_acts *a, const float *dw,
                           float *dlogits, int64_t T, int64_t s) {
  int64_t E = m->cfg.n_experts, k = m->cfg.top_k;
  const ml_moe_aux *x = &m->aux;
  for (int64_t t = 0; t < T; t++) {
    const float *p = a->probs + t * E, *tw = a->top_w + t * k, *te = a->top_e + t * k;
    const float *g = dw + t * k;
    float *d = dlogits + t * E, vsum = 0.0f, dot = 0.0f;
    memset(d, 0, sizeof(float) * (size_t)E);
    for (int64_t j = 0; j < k; j++) {
      vsum += p[(int64_t)te[j]];
      dot += g[j] * tw[j];
    }
    for (int64_t j = 0; j < k; j++)
      d[(int64_t)te[j]] += m->cfg.norm_topk ? (g[j] - dot) / vsum : g[j];
    if (x->grad != 0.0 && t % s < x->valid)
      for (int64_t e = 0; e < E; e++) d[e] += (float)(x->grad * x->sums[e]);
    float sd = 0.0f;
    for (int64_t e = 0; e < E; e++) sd += p[e] * d[e];
    for (int64_t e = 0; e < E; e++) d[e] = p[e] * (d[e] - sd);
  }
}

/* The per-choice gradients from dy [T, H]: dye [T·k, H] rows in expert
 * order, w_tj · dy_t; dw [T, k], dy_t · ye[slot(t, j)]. */
static void weigh_backward(const ml_model *m, const ml_layer_acts *a, const routing *r,
                           const float *dy, float *dye, float *dw) {
  int64_t H = m->cfg.hidden, k = r->k;
  for (int64_t t = 0; t < r->T; t++)
    for (int64_t j = 0; j < k; j++) {
      int64_t s = r->slot[t * k + j];
      const float *g = dy + t * H, *ye = a->ye + s * H;
      float w = a->top_w[t * k + j], dot = 0.0f, *d = dye + s * H;
      for (int64_t c = 0; c < H; c++) {
        d[c] = w * g[c];
        dot += g[c] * ye[c];
      }
      dw[t * k + j] = dot;
    }
}

/* The experts' backward over their rows: dye [T·k, H] in, dxe [T·k, H]
 * (=) the gradient of the gathered tokens xe out; da, dg, du [T·k, I]
 * scratch; weight gradients (+=). */
static int experts_backward(ml_model *m, ml_layer *L, const routing *r, float *dye,
                            const float *xe, float *dxe, float *da, float *dg, float *du) {
  ml_layer_acts *a = &L->acts;
  int64_t H = m->cfg.hidden, I = m->cfg.moe_inter, k = r->k, T = r->T;
  for (int64_t e = 0; e < r->E; e++) {
    int64_t r0 = r->off[e], n = r->off[e + 1] - r0;
    if (n == 0) continue;
    ml_act dy = rows_view(dye, r0, n, H), x = rows_view(a->a, r0, n, I);
    ML_TRY(ml_linear_backward(m->be, &L->moe.experts[3 * e + 2], &dy, &x, NULL, da + r0 * I, 0));
  }
  ML_TRY(ml_be_glu_bwd(m->be, da, a->g, a->u, dg, du, T * k * I, m->cfg.family->act));
  for (int64_t e = 0; e < r->E; e++) {
    int64_t r0 = r->off[e], n = r->off[e + 1] - r0;
    if (n == 0) continue;
    ml_act x = rows_view((float *)xe, r0, n, H);
    ml_act dgv = rows_view(dg, r0, n, I), duv = rows_view(du, r0, n, I);
    ML_TRY(ml_linear_backward(m->be, &L->moe.experts[3 * e], &dgv, &x, NULL, dxe + r0 * H, 0));
    ML_TRY(ml_linear_backward(m->be, &L->moe.experts[3 * e + 1], &duv, &x, NULL, dxe + r0 * H, 1));
  }
  return 0;
}

/* The floats of the backward's scratch: dye, xe, dxe [T·k, H]; da, dg, du
 * [T·k, I]; dw [T, k]; dlogits [T, E]. */
enum { BW_DYE, BW_XE, BW_DXE, BW_DA, BW_DG, BW_DU, BW_DW, BW_DLOGITS, BW_N };

// dy: [T, H] → dh: [T, H] (=)
int ml_moe_backward(ml_model *m, ml_layer *L, const ml_act *h, const float *dy, float *dh) {
  ml_layer_acts *a = &L->acts;
  int64_t T = h->B * h->s, H = m->cfg.hidden, I = m->cfg.moe_inter, k = m->cfg.top_k;
  int64_t E = m->cfg.n_experts, TK = T * k;
  const int64_t size[BW_N] = {TK * H, TK * H, TK * H, TK * I, TK * I, TK * I, TK, T * E};
  int64_t total = 0, at[BW_N];
  for (int i = 0; i < BW_N; i++) {
    at[i] = total;
    total += (size[i] + 15) / 16 * 16; /* 64-byte aligned pieces */
  }
  routing r;
  ML_TRY(routing_of(m, L, T, &r));
  float *buf = scratch(m, total, "backward");
  if (!buf) {
    routing_free(&r);
    return -1;
  }
  float *p[BW_N];
  for (int i = 0; i < BW_N; i++) p[i] = buf + at[i];
  int rc = ml_be_sync(m->be);
  if (!rc) {
    weigh_backward(m, a, &r, dy, p[BW_DYE], p[BW_DW]);
    gather(&r, h->x, H, p[BW_XE]);
    rc = experts_backward(m, L, &r, p[BW_DYE], p[BW_XE], p[BW_DXE], p[BW_DA], p[BW_DG],
                          p[BW_DU]);
  }
  if (!rc) rc = ml_be_sync(m->be);
  for (int64_t t = 0; !rc && t < T; t++) { /* dh_t = Σ_j dxe[slot(t, j)], j in order */
    float *d = dh + t * H;
    memset(d, 0, sizeof(float) * (size_t)H);
    for (int64_t j = 0; j < k; j++) {
      const float *src = p[BW_DXE] + r.slot[t * k + j] * H;
      for (int64_t c = 0; c < H; c++) d[c] += src[c];
    }
  }
  if (!rc) {
    route_backward(m, a, p[BW_DW], p[BW_DLOGITS], T, h->s);
    ml_act dl = {p[BW_DLOGITS], h->B, h->S, h->s, E, E};
    rc = ml_linear_backward(m->be, &L->moe.gate, &dl, h, NULL, dh, 1);  // dh += dlogits · W_gate
  }
  ml_be_free(m->be, buf);
  routing_free(&r);
  return rc;
}
