/* Causal grouped-query attention (HF eager_attention_forward) with sgemm on
 * strided per-head views. Rows go in blocks of BLOCK; each block multiplies
 * only against the keys it can see (causal, sliding window), skipping about
 * half of the S×S products for long sequences. One OpenMP region runs
 * independent blocks with single-threaded sgemm inside: small per-head
 * products lose more to OpenBLAS threading than they gain.
 *
 * Backward goes as FlashAttention-2 does, without atomics: pass 1 runs query
 * blocks of every head (dq and the row terms D = rowsum(P ⊙ dP)); pass 2
 * runs key blocks of every kv head (dk, dv summed over the group's heads),
 * recomputing dP for its block. */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/kernels.h"

enum { BLOCK = 128 };

// one (batch, head) pair: its first rows and row strides
typedef struct head_view {
  const float *q, *k, *v, *dout;  // q, dout: [S, hd] stride qs; k, v: [S, hd] stride ks
  float *P;                       // [S, S]
  int64_t S, hd, qs, ks;
} head_view;

typedef struct attn_dims {
  int64_t B, S, nh, nkv, hd;
} attn_dims;

static head_view head_at(const float *q, const float *k, const float *v, const float *dout,
                         const float *P, attn_dims d, int64_t b, int64_t h) {
  int64_t g = h / (d.nh / d.nkv), qs = d.nh * d.hd, ks = d.nkv * d.hd;
  int64_t qo = b * d.S * qs + h * d.hd, ko = b * d.S * ks + g * d.hd;
  head_view hv = {.q = q + qo,
                  .k = k + ko,
                  .v = v + ko,
                  .dout = dout ? dout + qo : NULL,
                  .P = (float *)P + (b * d.nh + h) * d.S * d.S,
                  .S = d.S,
                  .hd = d.hd,
                  .qs = qs,
                  .ks = ks};
  return hv;
}

static inline int64_t block_end(int64_t i0, int64_t S) { return i0 + BLOCK < S ? i0 + BLOCK : S; }

// first key query i may see
static inline int64_t first_key(int64_t i, int64_t window) {
  return (window > 0 && i - window + 1 > 0) ? i - window + 1 : 0;
}

// Makes OpenBLAS single-threaded; returns its previous thread count.
static int blas_serial_begin(void) {
  int n = openblas_get_num_threads();
  openblas_set_num_threads(1);
  return n;
}

/* ---- forward ------------------------------------------------------------- */

// Pi: [S]; softmax over keys lo..i of the scores already there, 0 elsewhere
static void softmax_causal_row(float *Pi, int64_t i, int64_t lo, int64_t S) {
  float m = -INFINITY, sum = 0.0f;
  for (int64_t j = lo; j <= i; j++) m = Pi[j] > m ? Pi[j] : m;
  for (int64_t j = lo; j <= i; j++) Pi[j] -= m;
  k_expf(Pi + lo, Pi + lo, i + 1 - lo);
  for (int64_t j = lo; j <= i; j++) sum += Pi[j]; /* in key order */
  float inv = 1.0f / sum;
  for (int64_t j = lo; j <= i; j++) Pi[j] *= inv;
  memset(Pi, 0, (size_t)lo * sizeof(float));
  memset(Pi + i + 1, 0, (size_t)(S - i - 1) * sizeof(float));
}

// query rows i0..i1 of one head: P rows, then out rows [i1 - i0, hd] (stride qs)
static void fwd_block(head_view hv, float *out, int64_t i0, float scale, int64_t window) {
  int64_t S = hv.S, i1 = block_end(i0, S), j0 = first_key(i0, window);
  int M = (int)(i1 - i0), n = (int)(i1 - j0);
  float *Pb = hv.P + i0 * S + j0;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, n, (int)hv.hd, scale, hv.q + i0 * hv.qs,
              (int)hv.qs, hv.k + j0 * hv.ks, (int)hv.ks, 0.0f, Pb, (int)S);
  for (int64_t i = i0; i < i1; i++) softmax_causal_row(hv.P + i * S, i, first_key(i, window), S);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, (int)hv.hd, n, 1.0f, Pb, (int)S,
              hv.v + j0 * hv.ks, (int)hv.ks, 0.0f, out + i0 * hv.qs, (int)hv.qs);
}

void k_attention_fwd(const float *q, const float *k, const float *v, float *out, float *P,
                     int64_t B, int64_t S, int64_t nh, int64_t nkv, int64_t hd, float scale,
                     int64_t window) {
  attn_dims d = {B, S, nh, nkv, hd};
  int64_t nblk = (S + BLOCK - 1) / BLOCK;
  int blas_threads = blas_serial_begin();
#pragma omp parallel for schedule(dynamic)
  for (int64_t task = 0; task < B * nh * nblk; task++) {
    int64_t bh = task / nblk, b = bh / nh, h = bh % nh;
    fwd_block(head_at(q, k, v, NULL, P, d, b, h), out + b * S * nh * hd + h * hd,
              (task % nblk) * BLOCK, scale, window);
  }
  openblas_set_num_threads(blas_threads);
}

/* ---- backward ------------------------------------------------------------ */

// first column where a row i0..i1-1 of P is nonzero: keys before it carry no
// probability, hence no gradient (this recovers the sliding window)
static int64_t first_live_key(const float *P, int64_t i0, int64_t i1, int64_t S) {
  int64_t j0 = i0;
  for (int64_t i = i0; i < i1; i++)
    for (int64_t j = 0; j < j0; j++)
      if (P[i * S + j] != 0.0f) {
        j0 = j;
        break;
      }
  return j0;
}

// one past the last row at or after j0 whose columns j0..j1-1 of P are nonzero
static int64_t last_live_query(const float *P, int64_t j0, int64_t j1, int64_t S) {
  for (int64_t i = S - 1; i >= j0; i--)
    for (int64_t j = j0; j < j1; j++)
      if (P[i * S + j] != 0.0f) return i + 1;
  return j0;
}

// dS: [M, n] holds dP on entry, P ⊙ (dP − D) on exit; Pb: [M, n] stride S; D: [M]
static void softmax_bwd(const float *Pb, int64_t S, const float *D, float *dS, int64_t M,
                        int64_t n) {
  for (int64_t r = 0; r < M; r++)
    for (int64_t j = 0; j < n; j++) dS[r * n + j] = Pb[r * S + j] * (dS[r * n + j] - D[r]);
}

// pass 1, query rows i0..: D rows (=) and dq rows (=) (stride qs); dS: scratch [BLOCK, S]
static void bwd_query_block(head_view hv, float *dq, float *D, int64_t i0, float scale, float *dS) {
  int64_t S = hv.S, i1 = block_end(i0, S), j0 = first_live_key(hv.P, i0, i1, S);
  int M = (int)(i1 - i0), n = (int)(i1 - j0);
  const float *Pb = hv.P + i0 * S + j0;
  // dP = dout · v^T
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, n, (int)hv.hd, 1.0f, hv.dout + i0 * hv.qs,
              (int)hv.qs, hv.v + j0 * hv.ks, (int)hv.ks, 0.0f, dS, n);
  for (int64_t r = 0; r < M; r++) {
    double dot = 0.0;
    for (int64_t j = 0; j < n; j++) dot += (double)Pb[r * S + j] * dS[r * n + j];
    D[i0 + r] = (float)dot;
  }
  softmax_bwd(Pb, S, D + i0, dS, M, n);
  // dq = scale · dS · k
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, (int)hv.hd, n, scale, dS, n,
              hv.k + j0 * hv.ks, (int)hv.ks, 0.0f, dq + i0 * hv.qs, (int)hv.qs);
}

// pass 2, key rows j0.. of one head: dk, dv rows (+=) (stride ks); D: [S]; dS: scratch [S, BLOCK]
static void bwd_key_block(head_view hv, const float *D, float *dk, float *dv, int64_t j0,
                          float scale, float *dS) {
  int64_t S = hv.S, j1 = block_end(j0, S), i1 = last_live_query(hv.P, j0, j1, S);
  int M = (int)(i1 - j0), n = (int)(j1 - j0);
  if (M == 0) return;
  const float *Pb = hv.P + j0 * S + j0, *dout = hv.dout + j0 * hv.qs;  // query rows j0..i1
  // dv += P^T · dout
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, (int)hv.hd, M, 1.0f, Pb, (int)S, dout,
              (int)hv.qs, 1.0f, dv + j0 * hv.ks, (int)hv.ks);
  // dS = P ⊙ (dout · v^T − D);  dk += scale · dS^T · q
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, n, (int)hv.hd, 1.0f, dout, (int)hv.qs,
              hv.v + j0 * hv.ks, (int)hv.ks, 0.0f, dS, n);
  softmax_bwd(Pb, S, D + j0, dS, M, n);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, (int)hv.hd, M, scale, dS, n,
              hv.q + j0 * hv.qs, (int)hv.qs, 1.0f, dk + j0 * hv.ks, (int)hv.ks);
}

// pass 2 task: key rows j0.. of kv head g, over the heads of its group
static void bwd_kv_task(const float *dout, const float *q, const float *k, const float *v,
                        const float *P, const float *D, float *dk, float *dv, attn_dims d,
                        int64_t b, int64_t g, int64_t j0, float scale, float *dS) {
  int64_t ks = d.nkv * d.hd, ko = b * d.S * ks + g * d.hd, group = d.nh / d.nkv;
  for (int64_t j = j0; j < block_end(j0, d.S); j++) {
    memset(dk + ko + j * ks, 0, (size_t)d.hd * sizeof(float));
    memset(dv + ko + j * ks, 0, (size_t)d.hd * sizeof(float));
  }
  for (int64_t h = g * group; h < (g + 1) * group; h++)
    bwd_key_block(head_at(q, k, v, dout, P, d, b, h), D + (b * d.nh + h) * d.S, dk + ko, dv + ko,
                  j0, scale, dS);
}

// one dS scratch per thread: [min(S, BLOCK), S]
static int64_t dS_floats(int64_t S) { return (S < BLOCK ? S : BLOCK) * S; }

int64_t k_attention_bwd_work(int64_t B, int64_t S, int64_t nh) {
  int64_t a = 0, b = 0, n = 0;
  if (__builtin_mul_overflow(B, nh, &a) || __builtin_mul_overflow(a, S, &a) ||
      __builtin_mul_overflow((int64_t)omp_get_max_threads(), dS_floats(S), &b) ||
      __builtin_add_overflow(a, b, &n))
    return INT64_MAX;
  return n;
}

void k_attention_bwd(const float *dout, const float *q, const float *k, const float *v,
                     const float *P, float *dq, float *dk, float *dv, int64_t B, int64_t S,
                     int64_t nh, int64_t nkv, int64_t hd, float scale, float *work) {
  attn_dims d = {B, S, nh, nkv, hd};
  int64_t nblk = (S + BLOCK - 1) / BLOCK, scratch = dS_floats(S);
  // D: [B, nh, S], then one dS scratch per thread
  float *D = work, *dS = D + B * nh * S;
  int blas_threads = blas_serial_begin();
#pragma omp parallel
  {
    float *mine = dS + omp_get_thread_num() * scratch;
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < B * nh * nblk; task++) {
      int64_t bh = task / nblk, b = bh / nh, h = bh % nh;
      bwd_query_block(head_at(q, k, v, dout, P, d, b, h), dq + b * S * nh * hd + h * hd, D + bh * S,
                      (task % nblk) * BLOCK, scale, mine);
    }  // implicit barrier: pass 2 reads every D
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < B * nkv * nblk; task++) {
      int64_t bg = task / nblk;
      bwd_kv_task(dout, q, k, v, P, D, dk, dv, d, bg / nkv, bg % nkv, (task % nblk) * BLOCK, scale,
                  mine);
    }
  }
  openblas_set_num_threads(blas_threads);
}
