/* Cross-entropy pieces on one vocab shard (Megatron _VocabParallelCrossEntropy),
 * and the online log-sum-exp over its column tiles (Milakov & Gimelshein,
 * "Online normalizer calculation for softmax", 2018; the fused classifier
 * of parallel/loss.h). Exponentials come from k_expf (vectorized, expf's
 * values). */
#include <math.h>

#include "kernels/cpu/kernels.h"

enum { CHUNK = 512, LANES = 8 };

// the target's column in this shard, or -1 when y is ignored or elsewhere
static inline int64_t shard_col(int32_t y, int64_t v0, int64_t V) {
  return (y >= v0 && y < v0 + V) ? y - v0 : -1;
}

// logits: [T, V]; mx: [T]
void k_xent_rowmax(const float *logits, int64_t T, int64_t V, float *mx) {
#pragma omp parallel for if (K_PAR(T, T * V))
  for (int64_t t = 0; t < T; t++) mx[t] = k_max(logits + t * V, V);
}

// sum of expf(l[n] - m) in double, LANES partial sums (any order: R2)
static double sumexp(const float *l, int64_t n, float m) {
  double acc[LANES] = {0};
  float e[CHUNK];
  for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
    int64_t c = n - c0 < CHUNK ? n - c0 : CHUNK, j = 0;
    for (int64_t k = 0; k < c; k++) e[k] = l[c0 + k] - m;
    k_expf(e, e, c);
    for (; j + LANES <= c; j += LANES)
      for (int k = 0; k < LANES; k++) acc[k] += e[j + k];
    for (; j < c; j++) acc[0] += e[j];
  }
  double s = 0.0;
  for (int k = 0; k < LANES; k++) s += acc[k];
  return s;
}

// se, tl: [T]
void k_xent_sumexp_target(const float *logits, int64_t T, int64_t V, int64_t v0, const int32_t *y,
                          const float *mx, float *se, float *tl) {
#pragma omp parallel for if (K_PAR(T, T * V))
  for (int64_t t = 0; t < T; t++) {
    const float *l = logits + t * V;
    se[t] = (float)sumexp(l, V, mx[t]);
    int64_t c = shard_col(y[t], v0, V);
    tl[t] = c >= 0 ? l[c] - mx[t] : 0.0f;
  }
}

// logits: [T, V] one tile of columns v0 .. v0+V−1; mx, se, tl: [T] updated
void k_xent_online(const float *logits, int64_t T, int64_t V, int64_t v0, const int32_t *y,
                   float *mx, float *se, float *tl) {
#pragma omp parallel for if (K_PAR(T, T * V))
  for (int64_t t = 0; t < T; t++) {
    const float *l = logits + t * V;
    /* se = 0: no tile yet (after one, se >= 1: the max's own term), mx not read */
    float s0 = se[t], m0 = mx[t], mt = k_max(l, V), m = s0 != 0.0f && m0 > mt ? m0 : mt;
    /* the sum so far moved to the new max (none before the first tile: exactly sumexp's) */
    double s = s0 != 0.0f ? (double)s0 * exp((double)m0 - (double)m) : 0.0;
    se[t] = (float)(s + sumexp(l, V, m));
    mx[t] = m;
    int64_t c = shard_col(y[t], v0, V);
    if (c >= 0) tl[t] = l[c];
  }
}

// mx, M, se, tl: [T]
void k_xent_rebase(int64_t T, int64_t V, int64_t v0, const int32_t *y, const float *mx,
                   const float *M, float *se, float *tl) {
#pragma omp parallel for if (K_PAR(T, T))
  for (int64_t t = 0; t < T; t++) {
    /* exp(0) = 1 where this rank holds the max: se unchanged */
    se[t] = se[t] != 0.0f ? (float)((double)se[t] * exp((double)mx[t] - (double)M[t])) : 0.0f;
    tl[t] = shard_col(y[t], v0, V) >= 0 ? tl[t] - M[t] : 0.0f;
  }
}

// se, tl, y, logprobs, w: [T]; the loss sum in fp64 as the token loop always was
void k_xent_logprobs(const float *se, const float *tl, const int32_t *y, int64_t T, float scale,
                     float *logprobs, float *w, double *sums) {
  for (int64_t t = 0; t < T; t++) {
    int valid = y[t] >= 0;
    double lp = valid ? (double)tl[t] - log((double)se[t]) : 0.0;
    if (logprobs) logprobs[t] = (float)lp;
    sums[0] -= lp;
    sums[1] += valid;
    w[t] = valid ? scale : 0.0f;
  }
}

// dlogits: [T, V] = w[t]·(softmax − onehot); may alias logits
void k_xent_bwd(const float *logits, int64_t T, int64_t V, int64_t v0, const int32_t *y,
                const float *mx, const float *se, const float *w, float *dlogits) {
#pragma omp parallel for if (K_PAR(T, T * V))
  for (int64_t t = 0; t < T; t++) {
    const float *l = logits + t * V;
    float *d = dlogits + t * V;
    float m = mx[t], inv = 1.0f / se[t], wt = w[t];
    for (int64_t j = 0; j < V; j++) d[j] = l[j] - m;
    k_expf(d, d, V);
    for (int64_t j = 0; j < V; j++) d[j] = wt * (d[j] * inv);
    int64_t c = shard_col(y[t], v0, V);
    if (c >= 0) d[c] -= wt;
  }
}
