/* The former CPU attention kernel (src/kernels/cpu/attention.c before the
 * FlashAttention-2 kernel replaced it), kept verbatim but for its names as
 * the tests' reference: eager attention (HF eager_attention_forward) that
 * stores the probabilities P [B, nh, S, S]. test_kernels.c checks the new
 * kernel against it and against the double reference.
 *
 * Its own description: causal grouped-query attention with GEMMs on
 * strided per-head views. Rows go in blocks of BLOCK; each block multiplies
 * only against the keys it can see (causal, sliding window), skipping about
 * half of the S×S products for long sequences. One OpenMP region runs
 * independent blocks with single-threaded GEMMs inside: small per-head
 * products lose more to threading than they gain.
 *
 * Backward goes as FlashAttention-2 does, without atomics: pass 1 runs query
 * blocks of every head (dq and the row terms D = rowsum(P ⊙ dP)); pass 2
 * runs key blocks of every kv head (dk, dv summed over the group's heads),
 * recomputing dP for its block.
 *
 * The products are sgemm on fp32 operands, or, given an eager_bf16, the
 * same products on bf16 operands: the caller's rounded q, k, v, dout, the
 * forward's P tiles rounded into per-thread scratch, and the backward's P
 * and dS rounded by pass 1 into whole [S, S] buffers per head, which pass
 * 2 reads instead of recomputing dS; the softmax and its backward run in
 * fp32 either way. */
#include <cblas.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/kernels.h"
#include "tensor/dtype.h"
#include "unit/attention_exact.h"

enum { BLOCK = 128 };

/* The operands of the products: fp32 tensors (lp NULL), or lp's rounded
 * copies in the same layouts; esz bytes per element. */
typedef struct operands {
  const void *q, *k, *v, *dout;
  const eager_bf16 *lp;
  size_t esz;
} operands;

// one (batch, head) pair: its first rows (as the products read them) and row strides
typedef struct head_view {
  const void *q, *k, *v, *dout;  // q, dout: [S, hd] stride qs; k, v: [S, hd] stride ks
  float *P;                      // [S, S]
  int64_t S, hd, qs, ks;
  size_t esz;                    // bytes per operand element
  const eager_bf16 *lp;
  void *tile;                    // lp, forward: this thread's rounded P tile
  void *p16, *ds16;              // lp, backward: [S, S] P and dS rounded, as operands
} head_view;

typedef struct attn_dims {
  int64_t B, S, nh, nkv, hd;
} attn_dims;

static const void *at(const void *base, int64_t off, size_t esz) {
  return base ? (const char *)base + (size_t)off * esz : NULL;
}

// one dS scratch per thread: [min(S, BLOCK), S]
static int64_t dS_floats(int64_t S) { return (S < BLOCK ? S : BLOCK) * S; }

static head_view head_at(const float *P, const operands *op, attn_dims d, int64_t b, int64_t h) {
  int64_t g = h / (d.nh / d.nkv), qs = d.nh * d.hd, ks = d.nkv * d.hd;
  int64_t qo = b * d.S * qs + h * d.hd, ko = b * d.S * ks + g * d.hd;
  head_view hv = {.q = at(op->q, qo, op->esz),
                  .k = at(op->k, ko, op->esz),
                  .v = at(op->v, ko, op->esz),
                  .dout = at(op->dout, qo, op->esz),
                  .P = (float *)P + (b * d.nh + h) * d.S * d.S,
                  .S = d.S,
                  .hd = d.hd,
                  .qs = qs,
                  .ks = ks,
                  .esz = op->esz,
                  .lp = op->lp};
  if (op->lp && op->lp->scratch)
    hv.tile = (char *)op->lp->scratch +
              (size_t)omp_get_thread_num() * eager_attention_bf16_scratch(d.S, op->lp->packed);
  if (op->lp && op->lp->probs) {
    size_t at_head = (size_t)((b * d.nh + h) * d.S * d.S) * op->esz;
    hv.p16 = (char *)op->lp->probs + at_head;
    hv.ds16 = (char *)op->lp->dscores + at_head;
  }
  return hv;
}

/* C = alpha·op(A)·op(B) + beta·C on the operands' type: sgemm on fp32 (or
 * fp32 holding bf16 values), lp's GEMM on packed bf16. */
static int mm(const head_view *hv, bool ta, bool tb, int M, int N, int K, float alpha,
              const void *A, int lda, const void *B, int ldb, float beta, float *C, int ldc) {
  if (hv->lp && hv->lp->packed)
    return hv->lp->gemm(hv->lp->ctx, omp_get_thread_num(), ta, tb, M, N, K, alpha, A, lda, B,
                        ldb, beta, C, ldc);
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N,
              K, alpha, A, lda, B, ldb, beta, C, ldc);
  return 0;
}

/* x[n] rounded to bf16 into dst[n] of the operands' type: bf16, or fp32
 * holding the bf16 values. */
static void round_row(const float *x, void *dst, int64_t n, bool packed) {
  if (packed) {
    uint16_t *y = dst;
    for (int64_t j = 0; j < n; j++) y[j] = ml_f32_to_bf16(x[j]);
  } else {
    float *y = dst;
    for (int64_t j = 0; j < n; j++) y[j] = ml_bf16_to_f32(ml_f32_to_bf16(x[j]));
  }
}

/* Records an error of the OpenMP region's tasks. */
static void keep_first(int *rc, int r) {
  if (r) {
#pragma omp atomic write
    *rc = r;
  }
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

/* Row sums: in index order on the fp32 path (ordered: its results stay
 * what they always were), in SIMD lanes on the bf16 one (any order is
 * within the same bounds, R2). The row max is k_max (exact). */

// sum of x[n] in fp32
static float row_sum(const float *x, int64_t n, bool ordered) {
  float sum = 0.0f;
  int64_t j = 0;
#if defined(__AVX512F__)
  if (!ordered) {
    __m512 acc = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + j));
    sum = _mm512_reduce_add_ps(acc);
  }
#endif
  for (; j < n; j++) sum += x[j];
  return sum;
}

// sum of p[j]·d[j] over n in double
static double row_dot(const float *p, const float *d, int64_t n, bool ordered) {
  double dot = 0.0;
  int64_t j = 0;
#if defined(__AVX512F__)
  if (!ordered) {
    __m512d acc = _mm512_setzero_pd();
    for (; j + 8 <= n; j += 8)
      acc = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(p + j)),
                            _mm512_cvtps_pd(_mm256_loadu_ps(d + j)), acc);
    dot = _mm512_reduce_add_pd(acc);
  }
#endif
  for (; j < n; j++) dot += (double)p[j] * d[j];
  return dot;
}

// Pi: [S]; softmax over keys lo..i of the scores already there, 0 elsewhere
static void softmax_causal_row(float *Pi, int64_t i, int64_t lo, int64_t S, bool ordered) {
  float *x = Pi + lo;
  int64_t n = i + 1 - lo;
  float m = k_max(x, n);
  for (int64_t j = 0; j < n; j++) x[j] -= m;
  k_expf(x, x, n);
  float inv = 1.0f / row_sum(x, n, ordered);
  for (int64_t j = 0; j < n; j++) x[j] *= inv;
  memset(Pi, 0, (size_t)lo * sizeof(float));
  memset(Pi + i + 1, 0, (size_t)(S - i - 1) * sizeof(float));
}

// query rows i0..i1 of one head: P rows, then out rows [i1 - i0, hd] (stride qs)
static int fwd_block(head_view hv, float *out, int64_t i0, float scale, int64_t window) {
  int64_t S = hv.S, i1 = block_end(i0, S), j0 = first_key(i0, window);
  int M = (int)(i1 - i0), n = (int)(i1 - j0);
  float *Pb = hv.P + i0 * S + j0;
  int rc = mm(&hv, false, true, M, n, (int)hv.hd, scale, at(hv.q, i0 * hv.qs, hv.esz), (int)hv.qs,
              at(hv.k, j0 * hv.ks, hv.esz), (int)hv.ks, 0.0f, Pb, (int)S);
  if (rc) return rc;
  for (int64_t i = i0; i < i1; i++) {
    softmax_causal_row(hv.P + i * S, i, first_key(i, window), S, !hv.lp);
    if (hv.lp) /* the P·v operand, [M, n], rounded while the row is at hand */
      round_row(hv.P + i * S + j0, (char *)hv.tile + (size_t)((i - i0) * n) * hv.esz, n,
                hv.lp->packed);
  }
  const void *Pt = hv.lp ? hv.tile : (const void *)Pb;
  return mm(&hv, false, false, M, (int)hv.hd, n, 1.0f, Pt, hv.lp ? n : (int)S,
            at(hv.v, j0 * hv.ks, hv.esz), (int)hv.ks, 0.0f, out + i0 * hv.qs, (int)hv.qs);
}

static operands operands_of(const float *q, const float *k, const float *v, const float *dout,
                            const eager_bf16 *lp) {
  if (!lp) return (operands){q, k, v, dout, NULL, sizeof(float)};
  return (operands){lp->q, lp->k, lp->v, lp->dout, lp, lp->packed ? 2 : sizeof(float)};
}

int eager_attention_fwd(const float *q, const float *k, const float *v, float *out, float *P,
                        int64_t B, int64_t S, int64_t nh, int64_t nkv, int64_t hd, float scale,
                        int64_t window, const eager_bf16 *lp) {
  attn_dims d = {B, S, nh, nkv, hd};
  operands op = operands_of(q, k, v, NULL, lp);
  int64_t nblk = (S + BLOCK - 1) / BLOCK;
  int rc = 0;
  int blas_threads = blas_serial_begin();
#pragma omp parallel for schedule(dynamic)
  for (int64_t task = 0; task < B * nh * nblk; task++) {
    int64_t bh = task / nblk, b = bh / nh, h = bh % nh;
    keep_first(&rc, fwd_block(head_at(P, &op, d, b, h),
                              out + b * S * nh * hd + h * hd, (task % nblk) * BLOCK, scale,
                              window));
  }
  openblas_set_num_threads(blas_threads);
  return rc;
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

/* lp, pass 1: rows i0.. of P and of dS = P ⊙ (dP − D) rounded into the
 * head's operand buffers p16, ds16, columns j0..j0+n (Pb, dP [M, n]: P
 * with stride S, dP dense), and zeros from the block boundary at or below
 * j0 up to j0 (masked keys), so that pass 2's key blocks read only values
 * written here. */
static void lowp_rows(const head_view *hv, const float *Pb, const float *dP, const float *D,
                      int64_t i0, int64_t j0, int64_t M, int64_t n) {
  int64_t S = hv->S, a0 = j0 / BLOCK * BLOCK;
  bool packed = hv->lp->packed;
  for (int64_t r = 0; r < M; r++) {
    size_t row = (size_t)((i0 + r) * S + a0) * hv->esz, zeros = (size_t)(j0 - a0) * hv->esz;
    char *p = (char *)hv->p16 + row, *ds = (char *)hv->ds16 + row;
    memset(p, 0, zeros);
    memset(ds, 0, zeros);
    const float *pr = Pb + r * S, *dpr = dP + r * n;
    float d = D[r];
    if (packed) {
      uint16_t *pp = (uint16_t *)(p + zeros), *dd = (uint16_t *)(ds + zeros);
      for (int64_t j = 0; j < n; j++) {
        pp[j] = ml_f32_to_bf16(pr[j]);
        dd[j] = ml_f32_to_bf16(pr[j] * (dpr[j] - d));
      }
    } else {
      float *pp = (float *)(p + zeros), *dd = (float *)(ds + zeros);
      for (int64_t j = 0; j < n; j++) {
        pp[j] = ml_bf16_to_f32(ml_f32_to_bf16(pr[j]));
        dd[j] = ml_bf16_to_f32(ml_f32_to_bf16(pr[j] * (dpr[j] - d)));
      }
    }
  }
}

// pass 1, query rows i0..: D rows (=) and dq rows (=) (stride qs); dS: scratch [BLOCK, S]
static int bwd_query_block(head_view hv, float *dq, float *D, int64_t i0, float scale, float *dS) {
  int64_t S = hv.S, i1 = block_end(i0, S), j0 = first_live_key(hv.P, i0, i1, S);
  int M = (int)(i1 - i0), n = (int)(i1 - j0);
  const float *Pb = hv.P + i0 * S + j0;
  // dP = dout · v^T
  int rc = mm(&hv, false, true, M, n, (int)hv.hd, 1.0f, at(hv.dout, i0 * hv.qs, hv.esz),
              (int)hv.qs, at(hv.v, j0 * hv.ks, hv.esz), (int)hv.ks, 0.0f, dS, n);
  if (rc) return rc;
  for (int64_t r = 0; r < M; r++) D[i0 + r] = (float)row_dot(Pb + r * S, dS + r * n, n, !hv.lp);
  // dS = P ⊙ (dP − D); dq = scale · dS · k
  const void *dSt = dS;
  int ld = n;
  if (hv.lp) {
    lowp_rows(&hv, Pb, dS, D + i0, i0, j0, M, n);
    dSt = (const char *)hv.ds16 + (size_t)(i0 * S + j0) * hv.esz;
    ld = (int)S;
  } else {
    softmax_bwd(Pb, S, D + i0, dS, M, n);
  }
  return mm(&hv, false, false, M, (int)hv.hd, n, scale, dSt, ld, at(hv.k, j0 * hv.ks, hv.esz),
            (int)hv.ks, 0.0f, dq + i0 * hv.qs, (int)hv.qs);
}

// pass 2, key rows j0.. of one head: dk, dv rows (+=) (stride ks); D: [S]; dS: scratch [S, BLOCK]
static int bwd_key_block(head_view hv, const float *D, float *dk, float *dv, int64_t j0,
                         float scale, float *dS) {
  int64_t S = hv.S, j1 = block_end(j0, S), i1 = last_live_query(hv.P, j0, j1, S);
  int M = (int)(i1 - j0), n = (int)(j1 - j0);
  if (M == 0) return 0;
  const float *Pb = hv.P + j0 * S + j0;  // query rows j0..i1
  const void *dout = at(hv.dout, j0 * hv.qs, hv.esz), *q = at(hv.q, j0 * hv.qs, hv.esz);
  if (hv.lp) { /* P and dS of these rows, rounded, from pass 1 */
    size_t tile = (size_t)(j0 * S + j0) * hv.esz;
    int rc = mm(&hv, true, false, n, (int)hv.hd, M, 1.0f, (char *)hv.p16 + tile, (int)S, dout,
                (int)hv.qs, 1.0f, dv + j0 * hv.ks, (int)hv.ks);
    return rc ? rc
              : mm(&hv, true, false, n, (int)hv.hd, M, scale, (char *)hv.ds16 + tile, (int)S, q,
                   (int)hv.qs, 1.0f, dk + j0 * hv.ks, (int)hv.ks);
  }
  // dv += P^T · dout
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, (int)hv.hd, M, 1.0f, Pb, (int)S, dout,
              (int)hv.qs, 1.0f, dv + j0 * hv.ks, (int)hv.ks);
  // dS = P ⊙ (dout · v^T − D);  dk += scale · dS^T · q
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, n, (int)hv.hd, 1.0f, dout, (int)hv.qs,
              at(hv.v, j0 * hv.ks, hv.esz), (int)hv.ks, 0.0f, dS, n);
  softmax_bwd(Pb, S, D + j0, dS, M, n);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, (int)hv.hd, M, scale, dS, n, q,
              (int)hv.qs, 1.0f, dk + j0 * hv.ks, (int)hv.ks);
  return 0;
}

// pass 2 task: key rows j0.. of kv head g, over the heads of its group
static int bwd_kv_task(const float *P, const operands *op, const float *D, float *dk, float *dv,
                       attn_dims d, int64_t b, int64_t g, int64_t j0, float scale, float *dS) {
  int64_t ks = d.nkv * d.hd, ko = b * d.S * ks + g * d.hd, group = d.nh / d.nkv;
  for (int64_t j = j0; j < block_end(j0, d.S); j++) {
    memset(dk + ko + j * ks, 0, (size_t)d.hd * sizeof(float));
    memset(dv + ko + j * ks, 0, (size_t)d.hd * sizeof(float));
  }
  int rc = 0;
  for (int64_t h = g * group; h < (g + 1) * group && !rc; h++)
    rc = bwd_key_block(head_at(P, op, d, b, h), D + (b * d.nh + h) * d.S, dk + ko,
                       dv + ko, j0, scale, dS);
  return rc;
}

size_t eager_attention_bf16_scratch(int64_t S, bool packed) {
  return (size_t)dS_floats(S) * (packed ? sizeof(uint16_t) : sizeof(float));
}

int64_t eager_attention_bwd_work(int64_t B, int64_t S, int64_t nh) {
  int64_t a = 0, b = 0, n = 0;
  if (__builtin_mul_overflow(B, nh, &a) || __builtin_mul_overflow(a, S, &a) ||
      __builtin_mul_overflow((int64_t)omp_get_max_threads(), dS_floats(S), &b) ||
      __builtin_add_overflow(a, b, &n))
    return INT64_MAX;
  return n;
}

int eager_attention_bwd(const float *dout, const float *q, const float *k, const float *v,
                        const float *P, float *dq, float *dk, float *dv, int64_t B, int64_t S,
                        int64_t nh, int64_t nkv, int64_t hd, float scale, float *work,
                        const eager_bf16 *lp) {
  attn_dims d = {B, S, nh, nkv, hd};
  operands op = operands_of(q, k, v, dout, lp);
  int64_t nblk = (S + BLOCK - 1) / BLOCK, scratch = dS_floats(S);
  // D: [B, nh, S], then one dS scratch per thread
  float *D = work, *dS = D + B * nh * S;
  int rc = 0;
  int blas_threads = blas_serial_begin();
#pragma omp parallel
  {
    float *mine = dS + omp_get_thread_num() * scratch;
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < B * nh * nblk; task++) {
      int64_t bh = task / nblk, b = bh / nh, h = bh % nh;
      keep_first(&rc, bwd_query_block(head_at(P, &op, d, b, h),
                                      dq + b * S * nh * hd + h * hd, D + bh * S,
                                      (task % nblk) * BLOCK, scale, mine));
    }  // implicit barrier: pass 2 reads every D
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < B * nkv * nblk; task++) {
      int64_t bg = task / nblk;
      keep_first(&rc, bwd_kv_task(P, &op, D, dk, dv, d, bg / nkv, bg % nkv, (task % nblk) * BLOCK,
                                  scale, mine));
    }
  }
  openblas_set_num_threads(blas_threads);
  return rc;
}
