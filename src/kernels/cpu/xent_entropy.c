/* Per-token entropy of the softmax over vocab shards and column tiles,
 * never over full-vocabulary logits (the fused classifier of
 * parallel/loss.h): H = lse − Σ_v p_v·l_v = log(se) − sl / se with, about a
 * max m, se = Σ exp(l − m) (kernels/cpu/xent.c) and sl = Σ exp(l − m)·(l −
 * m) <= 0, both in fp64 per tile and rounded once to fp32 as se is. The
 * shifted form keeps sl and log(se) of one sign (no cancellation); moving
 * the sums to a larger max m' (d = m − m' <= 0): se' = e^d·se, sl' =
 * e^d·(sl + d·se). Exponentials come from k_expf (expf's values). */
#include <math.h>

#include "kernels/cpu/kernels.h"

enum { CHUNK = 512, LANES = 8 };

/* Σ expf(l[j] − m)·(l[j] − m) in fp64, LANES partial sums (any order: R2);
 * a term whose exponential underflows (l = −inf included) adds 0. */
static double sum_shifted(const float *l, int64_t n, float m) {
  double acc[LANES] = {0};
  float d[CHUNK], e[CHUNK];
  for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
    int64_t c = n - c0 < CHUNK ? n - c0 : CHUNK, j = 0;
    for (int64_t k = 0; k < c; k++) d[k] = l[c0 + k] - m;
    k_expf(d, e, c);
    for (; j + LANES <= c; j += LANES)
      for (int k = 0; k < LANES; k++)
        acc[k] += e[j + k] != 0.0f ? (double)e[j + k] * d[j + k] : 0.0;
    for (; j < c; j++) acc[0] += e[j] != 0.0f ? (double)e[j] * d[j] : 0.0;
  }
  double s = 0.0;
  for (int k = 0; k < LANES; k++) s += acc[k];
  return s;
}

// logits: [T, V]; mx, sl: [T]
void k_xent_entropy_sum(const float *logits, int64_t T, int64_t V, const float *mx, float *sl) {
#pragma omp parallel for if (K_PAR(T, T * V))
  for (int64_t t = 0; t < T; t++) sl[t] = (float)sum_shifted(logits + t * V, V, mx[t]);
}

// logits: [T, V] one tile; mx, se (before k_xent_online), sl: [T]
void k_xent_entropy_online(const float *logits, int64_t T, int64_t V, const float *mx,
                           const float *se, float *sl) {
#pragma omp parallel for if (K_PAR(T, T * V))
  for (int64_t t = 0; t < T; t++) {
    const float *l = logits + t * V;
    /* the new running max as k_xent_online forms it (se = 0: no tile yet) */
    float s0 = se[t], m0 = mx[t], mt = k_max(l, V), m = s0 != 0.0f && m0 > mt ? m0 : mt;
    double d = (double)m0 - (double)m; /* exact: two floats, d <= 0 */
    double r = s0 != 0.0f ? exp(d) * ((double)sl[t] + d * (double)s0) : 0.0;
    sl[t] = (float)(r + sum_shifted(l, V, m));
  }
}

// mx, M, se (before k_xent_rebase), sl: [T]
void k_xent_entropy_rebase(int64_t T, const float *mx, const float *M, const float *se,
                           float *sl) {
#pragma omp parallel for if (K_PAR(T, T))
  for (int64_t t = 0; t < T; t++) {
    double d = (double)mx[t] - (double)M[t];
    sl[t] = se[t] != 0.0f ? (float)(exp(d) * ((double)sl[t] + d * (double)se[t])) : 0.0f;
  }
}

// se, sl, ent: [T]
void k_xent_entropy(const float *se, const float *sl, int64_t T, float *ent) {
  for (int64_t t = 0; t < T; t++) ent[t] = (float)(log((double)se[t]) - (double)sl[t] / se[t]);
}

/* ---- the entropy bonus's backward ------------------------------------------ */

// dlogits: [T, V] = w·(softmax − onehot) + ew·p·(log p + H); may alias logits
void k_xent_bwd_entropy(const float *logits, int64_t T, int64_t V, int64_t v0, const int32_t *y,
                        const float *mx, const float *se, const float *w, const float *H,
                        const float *ew, float *dlogits) {
#pragma omp parallel for if (K_PAR(T, T * V))
  for (int64_t t = 0; t < T; t++) {
    const float *l = logits + t * V;
    float *d = dlogits + t * V;
    float m = mx[t], inv = 1.0f / se[t], wt = w[t], et = ew[t];
    /* log p_j + H = (l_j − m) − (log se − H): the constant once per row */
    float c = (float)(log((double)se[t]) - (double)H[t]);
    for (int64_t j = 0; j < V; j++) d[j] = l[j] - m;
    for (int64_t j = 0; j < V; j++) {
      float z = d[j], p = expf(z) * inv;
      d[j] = wt * p + et * (p != 0.0f ? p * (z - c) : 0.0f); /* l = −inf: 0, not 0·inf */
    }
    int64_t col = y[t] >= v0 && y[t] < v0 + V ? y[t] - v0 : -1;
    if (col >= 0) d[col] -= wt;
  }
}
