/* Causal grouped-query attention as FlashAttention-2 computes it (Dao, 2023,
 * Algorithms 1 and 2), on blocks of queries against blocks of keys
 * (k_attn_block: ring attention's pieces; a whole sequence is one block).
 * No [S, S] tensor exists: queries go in tiles of TQ rows, keys in tiles
 * of TK, and each thread holds one tile of scores at a time.
 *
 * Forward, one task per (sequence, head, query tile): over the key tiles
 * the tile can see (the union of its rows' causal and sliding-window
 * ranges on global positions, so masked tiles are never visited), S =
 * scale·Q·K^T (a GEMM), the mask, the online softmax (running max m and
 * sum l per row in fp32, the accumulator O rescaled by exp(m − m') when the
 * max grows), O += P·V (a GEMM); at the end out = O / l, lse = m + log l,
 * or, accumulating, the online-softmax merge into the out and lse there.
 * The row kernel (the batch-invariant order, fixed_order, and any block of
 * at most K_ATTN_ROWS query rows: decode) has no GEMM: one task per
 * (sequence, kv head, its query heads, query rows), each key tile's keys
 * and values loaded once for the group's heads, each row's scores and P·V
 * in one fixed order (fwd_row_fixed).
 *
 * Backward, without atomics, in two passes (P = exp(scale·q·k − lse) from
 * the final lse, dP = dout·V^T, dS = P ⊙ (dP − D), D = rowsum(dout ⊙
 * out)): pass 1 per (sequence, head, query tile) computes D, P, dS and dq
 * += scale·dS·K, and stores P and dS; pass 2 per (sequence, kv head, key
 * tile) reads them back for the visible query tiles of the group's heads:
 * dv += P^T·dout, dk += scale·dS^T·Q. Each output row belongs to one task
 * of its pass. The stores of a long block exceed any fixed memory, so the
 * block goes in chunks of query tiles, each both passes (the stored
 * tiles, below).
 *
 * The products are sgemm on fp32 operands, or, given a k_attn_bf16, on
 * bf16 operands: the caller's rounded q, k, v, dout (in the block's
 * layouts or head-major, lp's strides: q_op, k_op), and P and dS rounded
 * per tile into the thread's scratch or the backward's store (bf16 for
 * the caller's tile GEMM, or fp32 holding bf16 values for sgemm); the
 * softmax, its backward and every accumulation stay fp32. One OpenMP
 * region runs the tasks with single-threaded GEMMs inside: per-tile
 * products lose more to threading than they gain.
 *
 * Paged keys (k_attn_block.kv_table, the KV cache's blocks; forward only):
 * a key row's address goes through the sequence's block table (k_at); the
 * fixed order loads rows one at a time anyway, the other order gathers a
 * tile's rows into the thread's scratch for its GEMMs; bf16 pools are read
 * exactly, fp32 pools under bf16 products rounded as read (kv_load). */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kernels/cpu/kernels.h"
#include "tensor/dtype.h"

enum { TQ = K_ATTN_TILE_Q, TK = K_ATTN_TILE_K, ALIGN = 16 /* floats: 64 bytes */, LANES = 8 };

/* Where an operand's rows lie, in elements: from one sequence to the
 * next, one row to the next, one head to the next. */
typedef struct layout {
  int64_t bs, row, head;
} layout;

/* One call: the block, the operands of its products (fp32 in the block's
 * layouts, or lp's rounded copies in lp's, esz bytes per element), row
 * strides. Paged keys (k_attn_block.kv_table): k, v are the pool, kesz
 * bytes per element (2: bf16; 4: fp32, rounded as read when lp is set). */
typedef struct attn {
  const k_attn_block *blk;
  const void *q, *k, *v, *dout;
  const k_attn_bf16 *lp;
  size_t esz, kesz;
  int64_t qr, kr; /* floats from one row of q (k) to the next: nh·hd (nkv·hd) */
  layout oq, ok;  /* the products' q and dout (oq), unpaged k and v (ok) */
  int64_t group;  /* query heads per kv head (k_attn_block.group) */
  int64_t off;    /* k_attn_block.head_off */
} attn;

static attn attn_of(const k_attn_block *blk, const float *q, const float *k, const float *v,
                    const float *dout, const k_attn_bf16 *lp) {
  attn a = {.blk = blk,
            .q = q,
            .k = k,
            .v = v,
            .dout = dout,
            .lp = lp,
            .esz = sizeof(float),
            .qr = blk->nh * blk->hd,
            .kr = blk->nkv * blk->hd,
            .group = blk->group ? blk->group : blk->nh / blk->nkv,
            .off = blk->head_off};
  a.oq = (layout){blk->q_bs, a.qr, blk->hd};
  a.ok = (layout){blk->k_bs, a.kr, blk->hd};
  if (lp) {
    a.q = lp->q, a.k = lp->k, a.v = lp->v, a.dout = lp->dout;
    a.esz = lp->packed ? sizeof(uint16_t) : sizeof(float);
    if (lp->q_row) a.oq = (layout){lp->q_bs, lp->q_row, lp->q_head};
    if (lp->k_row) a.ok = (layout){lp->k_bs, lp->k_row, lp->k_head};
  }
  a.kesz = a.esz;
  if (blk->kv_table) {
    a.k = k, a.v = v;
    a.kesz = blk->kv_bf16 ? sizeof(uint16_t) : sizeof(float);
  }
  return a;
}

// the kv head query head h reads
static inline int64_t kv_of(const attn *a, int64_t h) { return (h + a->off) / a->group; }

static const void *at(const void *base, int64_t off, size_t esz) {
  return (const char *)base + (size_t)off * esz;
}
/* offsets (elements) of query row i of head h, key row j of kv head g, in
 * sequence b, in the block's layouts (out, dq, dk, dv; the fp32 operands) */
static inline int64_t q_at(const attn *a, int64_t b, int64_t i, int64_t h) {
  return b * a->blk->q_bs + i * a->qr + h * a->blk->hd;
}
static inline int64_t k_at(const attn *a, int64_t b, int64_t j, int64_t g) {
  const k_attn_block *k = a->blk;
  if (k->kv_table) {
    int64_t row = k->kv_table[b * k->table_bs + j / k->kv_block] * k->kv_block + j % k->kv_block;
    return row * a->kr + g * k->hd;
  }
  return b * k->k_bs + j * a->kr + g * k->hd;
}
/* the same in the products' operands (oq: q, dout; ok: unpaged k, v; paged
 * keys: the pool's, k_at) */
static inline int64_t q_op(const attn *a, int64_t b, int64_t i, int64_t h) {
  return b * a->oq.bs + i * a->oq.row + h * a->oq.head;
}
static inline int64_t k_op(const attn *a, int64_t b, int64_t j, int64_t g) {
  if (a->blk->kv_table) return k_at(a, b, j, g);
  return b * a->ok.bs + j * a->ok.row + g * a->ok.head;
}
static inline int64_t lse_at(const attn *a, int64_t b, int64_t i, int64_t h) {
  return b * a->blk->l_bs + i * a->blk->nh + h;
}
/* out's row of query i, head h of sequence b: fp32, or bf16 (k_attn_block.out_bf16) */
static inline void *out_at(const attn *a, void *out, int64_t b, int64_t i, int64_t h) {
  return (char *)out + (size_t)q_at(a, b, i, h) * (a->blk->out_bf16 ? sizeof(uint16_t)
                                                                      : sizeof(float));
}

static inline int64_t clamp(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : x > hi ? hi : x;
}
static inline int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }

/* The keys (local indices) query row i sees: [key_lo, key_hi). Global
 * positions: query p = q_pos + i sees p' = k_pos + j iff p' <= p and,
 * with a window, p' > p − window. */
static inline int64_t key_lo(const k_attn_block *k, int64_t i) {
  if (k->window <= 0) return 0;
  return clamp(k->q_pos + i - k->window + 1 - k->k_pos, 0, k->sk);
}
static inline int64_t key_hi(const k_attn_block *k, int64_t i) {
  return clamp(k->q_pos + i + 1 - k->k_pos, 0, k->sk);
}
/* The query rows that see some key of [j0, j1): [query_lo, query_hi). */
static inline int64_t query_lo(const k_attn_block *k, int64_t j0) {
  return clamp(k->k_pos + j0 - k->q_pos, 0, k->sq);
}
static inline int64_t query_hi(const k_attn_block *k, int64_t j1) {
  if (k->window <= 0) return k->sq;
  return clamp(k->k_pos + j1 - 1 + k->window - k->q_pos, 0, k->sq);
}

/* C = alpha·op(A)·op(B) + beta·C on the operands' type: sgemm on fp32 (or
 * fp32 holding bf16 values), lp's GEMM on packed bf16. */
static int mm(const attn *a, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
              const void *A, int64_t lda, const void *B, int64_t ldb, float beta, float *C,
              int64_t ldc) {
  if (a->lp && a->lp->packed)
    return a->lp->gemm(a->lp->ctx, omp_get_thread_num(), ta, tb, M, N, K, alpha, A, lda, B, ldb,
                       beta, C, ldc);
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              (int)M, (int)N, (int)K, alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
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

void k_attn_head_major(const void *src, bool src_bf16, int64_t B, int64_t bs, int64_t rows,
                       int64_t heads, int64_t hd, bool packed, void *dst) {
  int64_t n = B * heads * rows; /* dst's rows, in order: (b, h, i) */
  size_t esz = packed ? sizeof(uint16_t) : sizeof(float), sesz = src_bf16 ? 2 : 4;
#pragma omp parallel for if (K_PAR(n, n * hd))
  for (int64_t r = 0; r < n; r++) {
    int64_t i = r % rows, h = r / rows % heads, b = r / rows / heads;
    const char *s = (const char *)src + (size_t)(b * bs + (i * heads + h) * hd) * sesz;
    char *d = (char *)dst + (size_t)(r * hd) * esz;
    if (!src_bf16) round_row((const float *)s, d, hd, packed);
    else if (packed) memcpy(d, s, (size_t)hd * sizeof(uint16_t));
    else
      for (int64_t e = 0; e < hd; e++) ((float *)d)[e] = ml_bf16_to_f32(((const uint16_t *)s)[e]);
  }
}

/* A key or value row src [n] (a->kesz bytes an element) into dst in the
 * operands' form (dst_esz bytes an element: 2 packed bf16, 4 fp32): paged
 * fp32 keys under bf16 products rounded to bf16 here (unpaged ones come
 * rounded in lp's copies), bf16 into fp32 widened exactly, else copied. */
static void kv_load(const attn *a, const void *src, void *dst, int64_t n, size_t dst_esz) {
  if (a->blk->kv_table && a->lp && a->kesz == sizeof(float))
    round_row(src, dst, n, dst_esz == sizeof(uint16_t));
  else if (a->kesz == dst_esz)
    memcpy(dst, src, (size_t)n * dst_esz);
  else
    for (int64_t d = 0; d < n; d++) ((float *)dst)[d] = ml_bf16_to_f32(((const uint16_t *)src)[d]);
}

/* Key (or value: base) rows [j0, j0+n) of kv head g of sequence b as the
 * tile's products read them, *ld elements apart: in place (unpaged: ok.row),
 * or gathered from the pool's blocks into buf [n, hd] (paged: hd). */
static const void *kv_tile(const attn *a, const void *base, int64_t b, int64_t j0, int64_t n,
                           int64_t g, void *buf, int64_t *ld) {
  if (!a->blk->kv_table) {
    *ld = a->ok.row;
    return at(base, k_op(a, b, j0, g), a->esz);
  }
  int64_t hd = a->blk->hd;
  for (int64_t j = 0; j < n; j++)
    kv_load(a, at(base, k_at(a, b, j0 + j, g), a->kesz), (char *)buf + (size_t)(j * hd) * a->esz,
            hd, a->esz);
  *ld = hd;
  return buf;
}

/* Records an error of the OpenMP region's tasks. */
static void keep_first(int *rc, int r) {
  if (r) {
#pragma omp atomic write
    *rc = r;
  }
}

// Makes OpenBLAS single-threaded; returns its previous thread count.
static int blas_serial_begin(void) {
  int n = openblas_get_num_threads();
  openblas_set_num_threads(1);
  return n;
}

/* ---- row pieces (written in LANES independent lanes, which the compiler
 * turns into vector instructions; max is exact, sums any order: R2) ------ */

// max of x[n], n > 0
static float row_max(const float *x, int64_t n) {
  float acc[LANES];
  for (int l = 0; l < LANES; l++) acc[l] = -INFINITY;
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int l = 0; l < LANES; l++) acc[l] = x[j + l] > acc[l] ? x[j + l] : acc[l];
  for (; j < n; j++) acc[0] = x[j] > acc[0] ? x[j] : acc[0];
  float m = acc[0];
  for (int l = 1; l < LANES; l++) m = acc[l] > m ? acc[l] : m;
  return m;
}

// x[n] = exp(x[n] − c) in place; returns their sum (fp32)
static float exp_sum(float *x, int64_t n, float c) {
  for (int64_t j = 0; j < n; j++) x[j] -= c;
  k_expf(x, x, n);
  float acc[LANES] = {0};
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int l = 0; l < LANES; l++) acc[l] += x[j + l];
  for (; j < n; j++) acc[0] += x[j];
  float s = 0.0f;
  for (int l = 0; l < LANES; l++) s += acc[l];
  return s;
}

/* sum over d of dout[off + d]·out[d] in fp64, dout as the products read it
 * (fp32, fp32 holding bf16 values, or packed bf16: widened exactly) */
static double dot_dout_out(const attn *a, int64_t off, const float *out, int64_t hd) {
  if (a->lp && a->lp->packed) {
    const uint16_t *x = (const uint16_t *)a->dout + off;
    double s = 0.0;
    for (int64_t d = 0; d < hd; d++) s += (double)ml_bf16_to_f32(x[d]) * out[d];
    return s;
  }
  return k_dot_f64((const float *)a->dout + off, out, hd);
}

/* out's row at element off as fp32: in place, or a bf16 out
 * (k_attn_block.out_bf16) widened exactly into buf [hd], so D sums the same
 * products in the same order as over an fp32 out holding those values */
static const float *out_row(const attn *a, const void *out, int64_t off, float *buf,
                            int64_t hd) {
  if (!a->blk->out_bf16) return (const float *)out + off;
  const uint16_t *x = (const uint16_t *)out + off;
  for (int64_t d = 0; d < hd; d++) buf[d] = ml_bf16_to_f32(x[d]);
  return buf;
}

/* ---- per-thread scratch ----------------------------------------------------- */

/* floats of one thread's scratch: S and dS tiles [TQ, TK] (fp32), their
 * rounded copies (of the operands' type, at most 4 bytes an element), the
 * accumulator O [TQ, hd], the row terms m, l [TQ], and the fixed-order
 * forward's key tile transposed, value tile and queries in fp32 [hd, TK],
 * [TK, hd], [TQ, hd] */
static int64_t per_thread(int64_t hd) {
  int64_t n = 4 * TQ * TK + TQ * hd + 2 * TQ + 2 * TK * hd + TQ * hd;
  return (n + ALIGN - 1) / ALIGN * ALIGN;
}

typedef struct scratch {
  float *S, *dS, *O, *m, *l;
  void *Pt, *dSt; /* the rounded P and dS tiles (lp) */
  float *kT, *vt, *qf; /* fixed order: [hd, TK] keys transposed, [TK, hd] values, [TQ, hd]
                          queries (fp32) */
} scratch;

static scratch scratch_of(float *work, int64_t hd) {
  float *w = work + omp_get_thread_num() * per_thread(hd);
  scratch s = {.S = w, .dS = w + TQ * TK, .Pt = w + 2 * TQ * TK, .dSt = w + 3 * TQ * TK};
  s.O = w + 4 * TQ * TK;
  s.m = s.O + TQ * hd;
  s.l = s.m + TQ;
  s.kT = s.l + TQ;
  s.vt = s.kT + TK * hd;
  s.qf = s.vt + TK * hd;
  return s;
}

int64_t k_attention_tile_floats(int64_t hd) {
  int64_t n = 0;
  if (hd < 1 || hd > INT32_MAX ||
      __builtin_mul_overflow((int64_t)omp_get_max_threads(), per_thread(hd), &n))
    return INT64_MAX;
  return n;
}

/* ---- forward ------------------------------------------------------------------ */

/* One query row's part of a key tile: s [n] holds its scaled scores, keys
 * [lo, hi) of the tile visible (lo < hi). Updates the running max *m and
 * sum *l, rescales the row's accumulator o [hd] when the max grows, and
 * leaves in s the unnormalised probabilities exp(s − m) (0 where masked). */
static void softmax_row(float *s, int64_t n, int64_t lo, int64_t hi, float *m, float *l, float *o,
                        int64_t hd) {
  float mx = row_max(s + lo, hi - lo), mo = *m;
  if (mx > mo) {
    if (mo != -INFINITY) { /* else o and l are still 0 */
      float r = expf(mo - mx);
      *l *= r;
      for (int64_t d = 0; d < hd; d++) o[d] *= r;
    }
    *m = mx;
  }
  *l += exp_sum(s + lo, hi - lo, *m);
  memset(s, 0, (size_t)lo * sizeof(float));
  memset(s + hi, 0, (size_t)(n - hi) * sizeof(float));
}

/* The block's result for one row (o = O / l, lse = m + log l) written to
 * out, lse, or merged into them (accumulate): the attention over the union
 * of the keys, lse' = log(e^lse + e^lse_b), out' = w·out + w_b·out_b with
 * w = e^(lse − lse'), w_b = e^(lse_b − lse'). With k_attn_block.out_bf16
 * (never accumulating) out is bf16 and takes O / l rounded once. */
static void finish_row(const attn *a, const float *O, float m, float l, void *out_row,
                       float *lse, int64_t hd, bool accumulate) {
  bool bf = a->blk->out_bf16;
  if (l == 0.0f) { /* the row saw no key of the block */
    if (!accumulate) {
      memset(out_row, 0, (size_t)hd * (bf ? sizeof(uint16_t) : sizeof(float)));
      *lse = -INFINITY;
    }
    return;
  }
  float lb = m + logf(l), *out = out_row;
  if (bf) {
    uint16_t *y = out_row;
    for (int64_t d = 0; d < hd; d++) y[d] = ml_f32_to_bf16(O[d] / l);
    *lse = lb;
    return;
  }
  if (!accumulate || *lse == -INFINITY) {
    for (int64_t d = 0; d < hd; d++) out[d] = O[d] / l;
    *lse = lb;
    return;
  }
  float la = *lse, mx = la > lb ? la : lb;
  float ea = expf(la - mx), eb = expf(lb - mx), s = ea + eb, wa = ea / s, wb = eb / s;
  for (int64_t d = 0; d < hd; d++) out[d] = wa * out[d] + wb * (O[d] / l);
  *lse = mx + logf(s);
}

// query rows i0.. (one tile) of head h of sequence b
static int fwd_tile(const attn *a, float *out, float *lse, bool accumulate, int64_t b, int64_t h,
                    int64_t i0, scratch w) {
  const k_attn_block *k = a->blk;
  int64_t hd = k->hd, M = min64(TQ, k->sq - i0), g = kv_of(a, h);
  int64_t jlo = key_lo(k, i0), jhi = key_hi(k, i0 + M - 1);
  for (int64_t r = 0; r < M; r++) w.m[r] = -INFINITY, w.l[r] = 0.0f;
  if (jlo < jhi) memset(w.O, 0, (size_t)(M * hd) * sizeof(float));
  const void *Q = at(a->q, q_op(a, b, i0, h), a->esz);
  for (int64_t j0 = jlo; j0 < jhi; j0 += TK) {
    int64_t n = min64(TK, jhi - j0), ldk, ldv;
    const void *K = kv_tile(a, a->k, b, j0, n, g, w.kT, &ldk);
    const void *V = kv_tile(a, a->v, b, j0, n, g, w.vt, &ldv);
    int rc = mm(a, false, true, M, n, hd, k->scale, Q, a->oq.row, K, ldk, 0.0f, w.S, n);
    if (rc) return rc;
    for (int64_t r = 0; r < M; r++) {
      float *s = w.S + r * n;
      int64_t lo = clamp(key_lo(k, i0 + r) - j0, 0, n), hi = clamp(key_hi(k, i0 + r) - j0, 0, n);
      if (lo < hi) softmax_row(s, n, lo, hi, &w.m[r], &w.l[r], w.O + r * hd, hd);
      else memset(s, 0, (size_t)n * sizeof(float));
      if (a->lp) round_row(s, (char *)w.Pt + (size_t)(r * n) * a->esz, n, a->lp->packed);
    }
    rc = mm(a, false, false, M, hd, n, 1.0f, a->lp ? w.Pt : (const void *)w.S, n, V, ldv, 1.0f,
            w.O, hd);
    if (rc) return rc;
  }
  for (int64_t r = 0; r < M; r++)
    finish_row(a, w.O + r * hd, w.m[r], w.l[r], out_at(a, out, b, i0 + r, h),
               lse + lse_at(a, b, i0 + r, h), hd, accumulate);
  return 0;
}

/* ---- forward in a fixed order (k_attn_block.fixed_order) -------------------- */

/* x[n] of an operand (fp32, fp32 holding bf16 values, or packed bf16) as fp32, exactly */
static void widen(const attn *a, const void *x, float *y, int64_t n) {
  if (a->esz == sizeof(float)) {
    memcpy(y, x, (size_t)n * sizeof(float));
    return;
  }
  for (int64_t d = 0; d < n; d++) y[d] = ml_bf16_to_f32(((const uint16_t *)x)[d]);
}

#if defined(__AVX512F__)
/* Lanes c·16 .. c·16+15 of a run of n elements that exist (c = 0 .. 3). */
static inline __mmask16 lanes(int64_t n, int c) {
  int64_t r = n - 16 * c;
  return r >= 16 ? (__mmask16)0xFFFF : r > 0 ? (__mmask16)((1u << r) - 1) : (__mmask16)0;
}
#endif

/* s[j] (=) the chain of fused multiply-adds over d = 0 .. hd−1 of
 * q[d]·kT[d·TK + j], from +0, for j in [lo, hi): the fixed order's scores
 * (before the scale). AVX-512: 64 keys' chains at once in registers
 * rather than s in memory at every d; the same operations. */
static void scores_fixed(const float *q, const float *kT, int64_t hd, int64_t lo, int64_t hi,
                         float *s) {
#if defined(__AVX512F__)
  for (int64_t j0 = lo; j0 < hi; j0 += 64) {
    int64_t n = min64(64, hi - j0);
    __mmask16 mk[4] = {lanes(n, 0), lanes(n, 1), lanes(n, 2), lanes(n, 3)};
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    for (int64_t d = 0; d < hd; d++) {
      __m512 qd = _mm512_set1_ps(q[d]);
      const float *kd = kT + d * TK + j0;
#pragma GCC unroll 4
      for (int c = 0; c < 4; c++)
        acc[c] = _mm512_fmadd_ps(qd, _mm512_maskz_loadu_ps(mk[c], kd + 16 * c), acc[c]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) _mm512_mask_storeu_ps(s + j0 + 16 * c, mk[c], acc[c]);
  }
#else
  for (int64_t j = lo; j < hi; j++) s[j] = 0.0f;
  for (int64_t d = 0; d < hd; d++) {
    const float *kd = kT + d * TK;
#pragma omp simd
    for (int64_t j = lo; j < hi; j++) s[j] = fmaf(q[d], kd[j], s[j]);
  }
#endif
}

/* o[d] (+=) the chain of fused multiply-adds over j = lo .. hi−1 (in
 * increasing order) of p[j]·vt[j·hd + d], onto o[d]: the fixed order's
 * P·V. AVX-512: 64 of o's elements at once in registers; the same
 * operations. */
static void pv_fixed(const float *p, const float *vt, int64_t hd, int64_t lo, int64_t hi,
                     float *o) {
#if defined(__AVX512F__)
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    int64_t n = min64(64, hd - d0);
    __mmask16 mk[4] = {lanes(n, 0), lanes(n, 1), lanes(n, 2), lanes(n, 3)};
    __m512 acc[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) acc[c] = _mm512_maskz_loadu_ps(mk[c], o + d0 + 16 * c);
    for (int64_t j = lo; j < hi; j++) {
      __m512 pj = _mm512_set1_ps(p[j]);
      const float *vj = vt + j * hd + d0;
#pragma GCC unroll 4
      for (int c = 0; c < 4; c++)
        acc[c] = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(mk[c], vj + 16 * c), acc[c]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) _mm512_mask_storeu_ps(o + d0 + 16 * c, mk[c], acc[c]);
  }
#else
  for (int64_t j = lo; j < hi; j++) {
    const float *vj = vt + j * hd;
    float pj = p[j];
#pragma omp simd
    for (int64_t d = 0; d < hd; d++) o[d] = fmaf(pj, vj[d], o[d]);
  }
#endif
}

/* One query row r of the tile (query i0 + r, q its fp32 copy [hd]) against
 * its keys in the tile at local keys [t0, t0+n) (kT, vt loaded): the keys
 * it sees there, [lo, hi) = its range ∩ the tile, a run fixed by its own
 * global position and the tile's. Scores s[j] = scale·(fma chain over d =
 * 0 .. hd−1 of q[d]·k[j][d]), the online softmax over the run as
 * softmax_row, P rounded to bf16 where the products are bf16, then o[d] =
 * fma(p_j, v[j][d], o[d]) for j in increasing order: no step depends on the
 * other rows, the block or the batch. */
static void fwd_row_fixed(const attn *a, const float *q, int64_t i, int64_t t0, int64_t n,
                          float *s, float *m, float *l, float *o, scratch w) {
  const k_attn_block *k = a->blk;
  int64_t hd = k->hd;
  int64_t lo = clamp(key_lo(k, i) - t0, 0, n), hi = clamp(key_hi(k, i) - t0, 0, n);
  if (lo >= hi) return;
  scores_fixed(q, w.kT, hd, lo, hi, s);
  for (int64_t j = lo; j < hi; j++) s[j] *= k->scale;
  softmax_row(s + lo, hi - lo, 0, hi - lo, m, l, o, hd);
  if (a->lp) round_row(s + lo, s + lo, hi - lo, false);
  pv_fixed(s, w.vt, hd, lo, hi, o);
}

#if defined(__AVX512F__)
/* dst[c·ldd + r] = src[r·lds + c] for r, c < 16: a 16 × 16 transpose in
 * registers (unpacks, then 128-bit lane shuffles). */
static void transpose16(const float *src, int64_t lds, float *dst, int64_t ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; i++) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
  for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + i * ldd, r[i]);
}
#endif

/* Key rows t0 .. t0+n−1 of kv head g of sequence b into w.kT [hd][TK]
 * (transposed) and their values into w.vt [n][hd], fp32 (kv_load's exact
 * values): 16 key rows at a time staged in w.dS (when [16, hd] fits it:
 * hd <= TQ·TK / 16) and transposed in registers (AVX-512), the rest one
 * at a time through w.dS. */
static void load_tile(const attn *a, int64_t b, int64_t g, int64_t t0, int64_t n, scratch w) {
  int64_t hd = a->blk->hd, j = 0;
  for (int64_t r = 0; r < n; r++)
    kv_load(a, at(a->v, k_op(a, b, t0 + r, g), a->kesz), w.vt + r * hd, hd, sizeof(float));
#if defined(__AVX512F__)
  for (; j + 16 <= n && 16 * hd <= TQ * TK; j += 16) {
    for (int64_t r = 0; r < 16; r++)
      kv_load(a, at(a->k, k_op(a, b, t0 + j + r, g), a->kesz), w.dS + r * hd, hd, sizeof(float));
    int64_t d = 0;
    for (; d + 16 <= hd; d += 16) transpose16(w.dS + d, hd, w.kT + d * TK + j, TK);
    for (; d < hd; d++)
      for (int64_t r = 0; r < 16; r++) w.kT[d * TK + j + r] = w.dS[r * hd + d];
  }
#endif
  for (; j < n; j++) {
    kv_load(a, at(a->k, k_op(a, b, t0 + j, g), a->kesz), w.dS, hd, sizeof(float));
    for (int64_t d = 0; d < hd; d++) w.kT[d * TK + j] = w.dS[d];
  }
}

/* The fixed-order forward of one task: query rows i0 .. i0+M−1 of the nq
 * query heads h0 .. h0+nq−1, which read one kv head g (GQA: a group's
 * heads share its keys), M·nq <= TQ. The key tiles start at global
 * positions that are multiples of TK (whatever the rows, so a KV-cache
 * step with one query walks the tiles a whole-sequence forward does);
 * each tile's keys and values are loaded once for all the task's rows and
 * heads, and each (row, head) is computed alone (fwd_row_fixed): its bits
 * depend neither on the task's other rows and heads nor on how the block
 * was cut into tasks. State u = r·nq + (h − h0). */
static void fwd_group_fixed(const attn *a, float *out, float *lse, bool accumulate, int64_t b,
                            int64_t g, int64_t h0, int64_t nq, int64_t i0, int64_t M,
                            scratch w) {
  const k_attn_block *k = a->blk;
  int64_t hd = k->hd, U = M * nq;
  int64_t jlo = key_lo(k, i0), jhi = key_hi(k, i0 + M - 1);
  float *q = w.qf;
  for (int64_t u = 0; u < U; u++) {
    w.m[u] = -INFINITY, w.l[u] = 0.0f;
    memset(w.O + u * hd, 0, (size_t)hd * sizeof(float));
    widen(a, at(a->q, q_op(a, b, i0 + u / nq, h0 + u % nq), a->esz), q + u * hd, hd);
  }
  int64_t first = jlo < jhi ? (k->k_pos + jlo) / TK * TK : k->k_pos + jhi;
  for (int64_t G = first; G < k->k_pos + jhi; G += TK) {
    int64_t t0 = G - k->k_pos > jlo ? G - k->k_pos : jlo;
    int64_t t1 = min64(G + TK - k->k_pos, jhi), n = t1 - t0;
    load_tile(a, b, g, t0, n, w);
    for (int64_t u = 0; u < U; u++)
      fwd_row_fixed(a, q + u * hd, i0 + u / nq, t0, n, w.S, &w.m[u], &w.l[u], w.O + u * hd, w);
  }
  for (int64_t u = 0; u < U; u++) {
    int64_t i = i0 + u / nq, h = h0 + u % nq;
    finish_row(a, w.O + u * hd, w.m[u], w.l[u], out_at(a, out, b, i, h),
               lse + lse_at(a, b, i, h), hd, accumulate);
  }
}

/* The fixed-order forward's tasks: per sequence and kv head, its query
 * heads in chunks of hc (all of the group's when they fit a tile: hc =
 * min(group, TQ)) by query rows in tiles of rt = TQ / hc. */
typedef struct fixed_split {
  int64_t hc, rt, nc, nt; /* heads a chunk, rows a tile; chunks a kv head, row tiles */
} fixed_split;

static fixed_split fixed_split_of(const attn *a) {
  fixed_split f = {.hc = min64(a->group, TQ)};
  f.rt = TQ / f.hc;
  f.nc = (a->group + f.hc - 1) / f.hc;
  f.nt = (a->blk->sq + f.rt - 1) / f.rt;
  return f;
}

/* Task `task` of the fixed-order forward: the last row tiles first (they
 * see the most keys); heads of chunk c of kv head g that the block holds
 * (query head h reads kv head (h + off) / group). */
static void fwd_task_fixed(const attn *a, const fixed_split *f, int64_t task, float *out,
                           float *lse, bool accumulate, scratch w) {
  const k_attn_block *k = a->blk;
  int64_t t = f->nt - 1 - task % f->nt, rest = task / f->nt;
  int64_t c = rest % f->nc, bg = rest / f->nc, b = bg / k->nkv, g = bg % k->nkv;
  int64_t h0 = g * a->group - a->off + c * f->hc, h1 = h0 + f->hc;
  int64_t group_end = (g + 1) * a->group - a->off;
  if (h1 > group_end) h1 = group_end;
  if (h0 < 0) h0 = 0;
  if (h1 > k->nh) h1 = k->nh;
  int64_t i0 = t * f->rt;
  if (h0 < h1)
    fwd_group_fixed(a, out, lse, accumulate, b, g, h0, h1 - h0, i0, min64(f->rt, k->sq - i0), w);
}

/* The row kernel's tasks (fixed_order, or at most K_ATTN_ROWS query rows
 * a sequence) on the team when the block's multiply-adds reach
 * K_ATTN_PAR_MAC, else on the calling thread. */
static void fwd_rows(const attn *a, float *out, float *lse, bool accumulate, float *tiles) {
  const k_attn_block *blk = a->blk;
  fixed_split f = fixed_split_of(a);
  int64_t tasks = blk->B * blk->nkv * f.nc * f.nt;
  double macs = 2.0 * (double)blk->B * (double)blk->nh * (double)blk->sq * (double)blk->sk *
                (double)blk->hd; /* scores and P·V, every key counted */
#pragma omp parallel if (tasks > 1 && macs >= K_ATTN_PAR_MAC)
  {
    scratch w = scratch_of(tiles, blk->hd);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < tasks; task++)
      fwd_task_fixed(a, &f, task, out, lse, accumulate, w);
  }
}

int k_attention_block_fwd(const k_attn_block *blk, const float *q, const float *k, const float *v,
                          float *out, float *lse, bool accumulate, const k_attn_bf16 *lp,
                          float *tiles) {
  if (blk->B <= 0 || blk->sq <= 0) return 0;
  attn a = attn_of(blk, q, k, v, NULL, lp);
  if (blk->fixed_order || blk->sq <= K_ATTN_ROWS) {
    fwd_rows(&a, out, lse, accumulate, tiles);
    return 0;
  }
  int64_t nt = (blk->sq + TQ - 1) / TQ, tasks = blk->B * blk->nh * nt;
  int rc = 0;
  int blas_threads = blas_serial_begin();
#pragma omp parallel
  {
    scratch w = scratch_of(tiles, blk->hd);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < tasks; task++) {
      /* the last tiles first: they see the most keys */
      int64_t bh = task / nt, t = nt - 1 - task % nt;
      int64_t b = bh / blk->nh, h = bh % blk->nh;
      keep_first(&rc, fwd_tile(&a, out, lse, accumulate, b, h, t * TQ, w));
    }
  }
  openblas_set_num_threads(blas_threads);
  return rc;
}

/* ---- backward ----------------------------------------------------------------- */

/* Query rows i0..i0+M of head h against keys j0..j0+n: S and dS [M, n]
 * (rows ld floats apart) hold the scaled scores and the products dout·v^T
 * on entry; on exit S = P = exp(S − lse) and dS = P ⊙ (dP − D) (0 where
 * masked), D [M] the rows' terms; with lp also rounded into Pt and dSt
 * [M, n] (rows ldt elements apart, of the operands' type). */
static void probs_grads(const attn *a, const float *lse, const float *D, int64_t b, int64_t h,
                        int64_t i0, int64_t M, int64_t j0, int64_t n, float *S, float *dS,
                        int64_t ld, char *Pt, char *dSt, int64_t ldt) {
  const k_attn_block *k = a->blk;
  for (int64_t r = 0; r < M; r++) {
    float *s = S + r * ld, *ds = dS + r * ld, L = lse[lse_at(a, b, i0 + r, h)], Dr = D[r];
    int64_t lo = clamp(key_lo(k, i0 + r) - j0, 0, n), hi = clamp(key_hi(k, i0 + r) - j0, 0, n);
    if (L == -INFINITY || lo >= hi) lo = hi = 0; /* no key: P = 0 (lse −inf: none anywhere) */
    for (int64_t j = lo; j < hi; j++) s[j] -= L;
    k_expf(s + lo, s + lo, hi - lo);
    for (int64_t j = lo; j < hi; j++) ds[j] = s[j] * (ds[j] - Dr);
    memset(s, 0, (size_t)lo * sizeof(float));
    memset(ds, 0, (size_t)lo * sizeof(float));
    memset(s + hi, 0, (size_t)(n - hi) * sizeof(float));
    memset(ds + hi, 0, (size_t)(n - hi) * sizeof(float));
    if (a->lp) {
      size_t row = (size_t)(r * ldt) * a->esz;
      round_row(s, Pt + row, n, a->lp->packed);
      round_row(ds, dSt + row, n, a->lp->packed);
    }
  }
}

/* S (=) scale·q·k^T and dS (=) dout·v^T [M, n] (rows ld floats apart) for
 * query rows i0..i0+M of head h and keys j0..j0+n of kv head g */
static int scores_dp(const attn *a, int64_t b, int64_t h, int64_t g, int64_t i0, int64_t M,
                     int64_t j0, int64_t n, float *S, float *dS, int64_t ld) {
  const k_attn_block *k = a->blk;
  int64_t qo = q_op(a, b, i0, h), ko = k_op(a, b, j0, g);
  int rc = mm(a, false, true, M, n, k->hd, k->scale, at(a->q, qo, a->esz), a->oq.row,
              at(a->k, ko, a->esz), a->ok.row, 0.0f, S, ld);
  return rc ? rc
            : mm(a, false, true, M, n, k->hd, 1.0f, at(a->dout, qo, a->esz), a->oq.row,
                 at(a->v, ko, a->esz), a->ok.row, 0.0f, dS, ld);
}

/* ---- the stored tiles --------------------------------------------------------
 *
 * Pass 1 keeps what pass 2's products read, P and dS in their operand form
 * (lp: the rounded tiles Pt, dSt; else the fp32 S, dS), and pass 2 reads
 * them back instead of recomputing them (FlashAttention-2's five tile
 * products per tile pair, not seven, and one softmax backward). Item x =
 * (b·nh + h)·nt + t holds query tile t of head h of sequence b (rows t·TQ
 * .. t·TQ + M − 1, pass 1's tile): P then dS, each [M, W] (esz bytes an
 * element), over the keys [key_lo(t·TQ), key_hi(t·TQ + M − 1)) its rows
 * see (W their count, 0: none; keys a row does not see hold 0, as the
 * tiles do). Bounded memory: the block goes in chunks, runs [x0, x1) of
 * items in this order that fit the store, each chunk pass 1 then pass 2
 * (both parallel over the chunk's tasks). Pass 2 keeps its own tiles (key
 * tile j0 from 0 by TK, query tiles from query_lo(j0) by TQ: the order of
 * dk, dv's sums) and runs each of its tiles in the chunk holding the
 * tile's last row; its first rows may lie in the item before the chunk's
 * first (query_lo(j0) need not be a multiple of TQ: a block whose k_pos −
 * q_pos is not), so a chunk starting inside a head keeps that item (copied
 * to the front of the store). For a key tile the chunks then run the
 * group's heads in increasing order and each head's query tiles in
 * increasing order, as one pass over the whole block did: dk and dv sum
 * the same products in the same order whatever the chunks. The values are
 * pass 1's, one evaluation of each P and dS for dq, dk and dv alike. Where
 * pass 2 computed its own, in its tiles, they were not always the same
 * bits: a tile GEMM's value of an element depends on the tile's shape and
 * the element's place in it (OpenBLAS 0.3.21's sgemm on Zen 3, K = 8..64:
 * 8-12 % of the elements of an [M, N] tile differ from the same element of
 * a [64, 128] one, by its edge kernels), so dk, dv are bitwise the
 * recomputing kernel's only where the passes' tiles meet each element in
 * the same place: whole sequences without a window (pass 1's key tiles
 * start at 0, TK apart, its query tiles at 0, TQ apart, as pass 2's), not a
 * window (pass 1's key tiles start at key_lo(i0)) nor a block whose query
 * tiles of pass 2 start off TQ's multiples (k_pos − q_pos).
 *
 * Where the tiles live: on sgemm (fp32, and bf16 emulated on fp32 holding
 * bf16 values) the item is the working tile. Pass 1's tile pair is the
 * item's columns j0 − jlo .. j0 − jlo + n − 1, rows W apart: fp32, the
 * score GEMMs write S and dP there and probs_grads turns them into P and
 * dS in place; lp, S and dP stay fp32 in the scratch and probs_grads
 * rounds P and dS into the item; dq's GEMM reads dS there. Pass 2's tile
 * is read in place when its rows lie in one item and its keys in that
 * item's (whole sequences without a window: every tile but a key tile's
 * first, on the diagonal, when the key tile is wider than TQ: the item
 * ends at the diagonal); else fetch_tile gathers it, zero-padded, into the
 * scratch. sgemm's value of an element does not depend on lda or ldc nor
 * on the operands' alignment (OpenBLAS 0.3.21 packs A and B and
 * accumulates a block in registers: 20,000 random shapes up to 128, ld up
 * to 300 wider, offsets of 0..15 floats, bitwise alike), and the GEMMs'
 * (M, N, K) and operands are the same whether a tile is in place or in
 * the scratch, so dq, dk, dv are the same bits either way. On packed
 * bf16 (lp's GEMM: oneDNN's primitives, cached per thread by shape and
 * leading dimensions, 64 of them) pass 1 rounds into the scratch's dense
 * tiles and keep_tile copies them into the item, and pass 2 always
 * gathers: an ld of W, one per query tile, would make a primitive for each
 * W, more than the cache holds at a few thousand tokens. */

// query tile t's rows (returned) and the keys they see, [*jlo, *jlo + *W)
static int64_t tile_keys(const k_attn_block *k, int64_t t, int64_t *jlo, int64_t *W) {
  int64_t i0 = t * TQ, M = min64(TQ, k->sq - i0);
  *jlo = key_lo(k, i0);
  int64_t w = key_hi(k, i0 + M - 1) - *jlo;
  *W = w > 0 ? w : 0;
  return M;
}

// bytes of query tile t's item: P and dS [M, W], esz bytes an element
static int64_t item_bytes(const k_attn_block *k, int64_t t, size_t esz) {
  int64_t jlo, W, M = tile_keys(k, t, &jlo, &W);
  return 2 * M * W * (int64_t)esz;
}

// bytes (a 64-byte multiple) of a head's item offsets pre[nt + 1]: pre[t] before tile t's item
static size_t pre_bytes(int64_t nt) { return ((size_t)(nt + 1) * sizeof(int64_t) + 63) / 64 * 64; }

/* One chunk in the store: the kept item x0 − 1 (kept bytes, 0: none) at
 * base, then items x0 .. x1 − 1 in order. */
typedef struct chunk {
  char *base;
  const int64_t *pre;
  int64_t nt, x0, x1, kept;
} chunk;

// item x's bytes (x0 <= x < x1, or x0 − 1: the kept item)
static char *item_at(const chunk *c, int64_t x) {
  if (x < c->x0) return c->base;
  int64_t heads = x / c->nt - c->x0 / c->nt;
  return c->base + c->kept + heads * c->pre[c->nt] + c->pre[x % c->nt] - c->pre[c->x0 % c->nt];
}

/* The end of the chunk from x0, `used` bytes of the store taken (the kept
 * item): at least one item, then as many as fit cap. */
static int64_t chunk_end(const int64_t *pre, int64_t nt, int64_t X, int64_t x0, int64_t used,
                         int64_t cap) {
  int64_t x1 = x0;
  do {
    used += pre[x1 % nt + 1] - pre[x1 % nt];
    x1++;
  } while (x1 < X && used + pre[x1 % nt + 1] - pre[x1 % nt] <= cap);
  return x1;
}

size_t k_attention_bwd_work(const k_attn_block *blk, size_t budget) {
  if (blk->B <= 0 || blk->sq <= 0 || blk->sk <= 0) return 0;
  int64_t nt = (blk->sq + TQ - 1) / TQ, head = 0, least = 0, prev = 0;
  for (int64_t t = 0; t < nt; t++) {
    int64_t b = item_bytes(blk, t, sizeof(float));
    if (__builtin_add_overflow(head, b, &head)) return SIZE_MAX;
    if (prev + b > least) least = prev + b; /* an item and the one kept before it */
    prev = b;
  }
  int64_t whole = 0;
  if (__builtin_mul_overflow(blk->B, blk->nh, &whole) || __builtin_mul_overflow(whole, head, &whole))
    whole = INT64_MAX;
  size_t store = budget < (size_t)whole ? budget : (size_t)whole;
  if (store < (size_t)least) store = (size_t)least;
  size_t n = 64 + pre_bytes(nt); /* 64: the work's alignment, any on entry */
  return store > SIZE_MAX - n ? SIZE_MAX : n + store;
}

// whether the products go to lp's GEMM on packed bf16 (oneDNN's tiles)
static bool packed(const attn *a) { return a->lp && a->lp->packed; }

// rows [0, M) of C, N floats each, ld apart: 0
static void zero_rows(float *C, int64_t M, int64_t N, int64_t ld) {
  for (int64_t r = 0; r < M; r++) memset(C + r * ld, 0, (size_t)N * sizeof(float));
}

/* A backward product into its output tile C: added (+=), or, fresh (the
 * tile's first product under k_attn_block.bwd_overwrite), written (=) with
 * the bits of adding into zeros, 0 + the product (−0 becomes +0). sgemm:
 * beta 0, which OpenBLAS runs as its beta pass zeroing C, then the same
 * kernel adding alpha·op(A)·op(B) as beta 1 does (interface/gemm.c, the
 * level-3 driver; memcmp over random geometries, tests/unit/test_kernels.c
 * test_attention_bwd_overwrite). Packed bf16: the tile is zeroed and the
 * primitive accumulates as before — oneDNN's non-accumulating primitive is
 * another kernel, not assumed to give the same bits (the path needs
 * AVX512-BF16 or AMX: correct by construction, not run on AVX2 machines). */
static int mm_out(const attn *a, bool fresh, bool ta, int64_t M, int64_t N, int64_t K,
                  float alpha, const void *A, int64_t lda, const void *B, int64_t ldb, float *C,
                  int64_t ldc) {
  if (fresh && packed(a)) zero_rows(C, M, N, ldc);
  return mm(a, ta, false, M, N, K, alpha, A, lda, B, ldb, fresh && !packed(a) ? 0.0f : 1.0f, C,
            ldc);
}

/* Rows [0, M) of the packed bf16 tiles Pt, dSt [M, n] into item at column
 * c0 (item [M, W]) */
static void keep_tile(const attn *a, char *item, int64_t M, int64_t W, int64_t c0, int64_t n,
                      scratch w) {
  size_t e = a->esz, row = (size_t)n * e;
  char *iP = item + (size_t)c0 * e, *idS = iP + (size_t)(M * W) * e;
  for (int64_t r = 0; r < M; r++) {
    memcpy(iP + (size_t)(r * W) * e, (const char *)w.Pt + (size_t)r * row, row);
    memcpy(idS + (size_t)(r * W) * e, (const char *)w.dSt + (size_t)r * row, row);
  }
}

/* Pass 2's tile (query rows i0 .. i0+M−1 of head bh, b·nh + h, keys j0 ..
 * j0+n−1) in place in the chunk's items: when its rows lie in one item and
 * its keys in that item's, and the products are sgemm's; *P, *dS its first
 * elements, rows *ld (the item's W) apart. Else false. */
static bool item_tile(const attn *a, const chunk *c, int64_t bh, int64_t i0, int64_t M,
                      int64_t j0, int64_t n, const void **P, const void **dS, int64_t *ld) {
  int64_t t = i0 / TQ, jlo, W;
  if (packed(a) || (i0 + M - 1) / TQ != t) return false;
  int64_t Mt = tile_keys(a->blk, t, &jlo, &W);
  if (j0 < jlo || j0 + n > jlo + W) return false;
  size_t e = a->esz;
  const char *it = item_at(c, bh * c->nt + t) + (size_t)((i0 - t * TQ) * W + j0 - jlo) * e;
  *P = it, *dS = it + (size_t)(Mt * W) * e, *ld = W;
  return true;
}

/* P and dS of query rows i0 .. i0+M−1 of head bh (b·nh + h) at keys j0 ..
 * j0+n−1 from the chunk's items into the tiles pass 2's products read (lp:
 * Pt, dSt; else S, dS), [M, n]; keys outside a row's item 0 (unseen) */
static void fetch_tile(const attn *a, const chunk *c, int64_t bh, int64_t i0, int64_t M,
                       int64_t j0, int64_t n, scratch w) {
  size_t e = a->esz;
  char *P = a->lp ? w.Pt : (void *)w.S, *dS = a->lp ? w.dSt : (void *)w.dS;
  for (int64_t r = 0; r < M; r++) {
    int64_t i = i0 + r, t = i / TQ, jlo, W, Mt = tile_keys(a->blk, t, &jlo, &W);
    int64_t c0 = clamp(j0 - jlo, 0, W), c1 = clamp(j0 + n - jlo, 0, W);
    int64_t d0 = c0 < c1 ? jlo + c0 - j0 : n, d1 = c0 < c1 ? jlo + c1 - j0 : n; /* in the tile */
    char *pr = P + (size_t)(r * n) * e, *dr = dS + (size_t)(r * n) * e;
    memset(pr, 0, (size_t)d0 * e), memset(dr, 0, (size_t)d0 * e);
    if (d0 < d1) {
      const char *it = item_at(c, bh * c->nt + t) + (size_t)((i - t * TQ) * W + c0) * e;
      memcpy(pr + (size_t)d0 * e, it, (size_t)(d1 - d0) * e);
      memcpy(dr + (size_t)d0 * e, it + (size_t)(Mt * W) * e, (size_t)(d1 - d0) * e);
    }
    memset(pr + (size_t)d1 * e, 0, (size_t)(n - d1) * e);
    memset(dr + (size_t)d1 * e, 0, (size_t)(n - d1) * e);
  }
}

/* pass 1, item x (query tile t of head h of sequence b): D [TQ] (=, in
 * w.m: unused backward), dq (+=; under bwd_overwrite =, 0 where the rows
 * see no key), the item filled */
static int bwd_query_tile(const attn *a, const chunk *c, const float *out, const float *lse,
                          float *dq, int64_t x, scratch w) {
  const k_attn_block *k = a->blk;
  int64_t t = x % c->nt, bh = x / c->nt, b = bh / k->nh, h = bh % k->nh, i0 = t * TQ;
  int64_t hd = k->hd, g = kv_of(a, h), jlo, W, M = tile_keys(k, t, &jlo, &W);
  float *Dt = w.m;
  for (int64_t r = 0; r < M; r++) /* O: unused backward */
    Dt[r] = (float)dot_dout_out(a, q_op(a, b, i0 + r, h),
                                out_row(a, out, q_at(a, b, i0 + r, h), w.O, hd), hd);
  char *item = item_at(c, x);
  size_t e = a->esz;
  bool pk = packed(a), fresh = k->bwd_overwrite;
  float *dqt = dq + q_at(a, b, i0, h);
  for (int64_t j0 = jlo; j0 < jlo + W; j0 += TK, fresh = false) {
    int64_t n = min64(TK, jlo + W - j0);
    /* the tile pair's P and dS as the products read them (rows ld apart):
     * in the item at column j0 − jlo, or packed in the scratch; S and dS in
     * fp32: the same tiles (fp32 products), or the scratch's (lp) */
    char *iP = item + (size_t)(j0 - jlo) * e, *idS = iP + (size_t)(M * W) * e;
    char *P = pk ? (char *)w.Pt : iP, *dS = pk ? (char *)w.dSt : idS;
    int64_t ld = pk ? n : W;
    float *S = a->lp ? w.S : (float *)P, *dSf = a->lp ? w.dS : (float *)dS;
    int64_t lds = a->lp ? n : ld;
    int rc = scores_dp(a, b, h, g, i0, M, j0, n, S, dSf, lds);
    if (rc) return rc;
    probs_grads(a, lse, Dt, b, h, i0, M, j0, n, S, dSf, lds, P, dS, ld);
    if (pk) keep_tile(a, item, M, W, j0 - jlo, n, w);
    rc = mm_out(a, fresh, false, M, hd, n, k->scale, dS, ld,
                at(a->k, k_op(a, b, j0, g), a->esz), a->ok.row, dqt, a->qr);
    if (rc) return rc;
  }
  if (fresh) zero_rows(dqt, M, hd, a->qr); /* no key tile */
  return 0;
}

/* Rows [0, M) of C (ldc apart) and the dense D [M, N]: D (=) C, or 0 when
 * zero; C (=) D (back). */
static void dense_in(float *D, const float *C, int64_t M, int64_t N, int64_t ldc, bool zero) {
  for (int64_t r = 0; r < M; r++)
    if (zero) memset(D + r * N, 0, (size_t)N * sizeof(float));
    else memcpy(D + r * N, C + r * ldc, (size_t)N * sizeof(float));
}
static void dense_out(const float *D, float *C, int64_t M, int64_t N, int64_t ldc) {
  for (int64_t r = 0; r < M; r++) memcpy(C + r * ldc, D + r * N, (size_t)N * sizeof(float));
}

/* pass 2, key rows j0.. (one tile) of kv head g of sequence b: dk, dv (+=)
 * over the group's heads in the chunk, each head's query tiles (pass 2's)
 * whose last row the chunk holds. Under bwd_overwrite the chunk holding
 * the pair's first item (its lowest head's tile 0: no chunk before it
 * reached the pair) writes them: its first products (=), or 0 when it has
 * none, and the chunks after it add. On packed bf16 the products add into
 * dense [n, hd] copies of the tile's dk, dv rows (the scratch's kT, vt,
 * unused backward; 0 where fresh, as mm_out zeroes), copied back at the
 * end: oneDNN 2.6's brgemm matmul takes a dense dst only (kernels.h
 * k_attn_bf16), and dk, dv are nkv·hd apart; the same sums, in the same
 * order, of the same products. */
static int bwd_key_tile(const attn *a, const chunk *c, float *dk, float *dv, int64_t b,
                        int64_t g, int64_t j0, scratch w) {
  const k_attn_block *k = a->blk;
  int64_t hd = k->hd, n = min64(TK, k->sk - j0), ko = k_at(a, b, j0, g), nt = c->nt;
  int64_t ilo = query_lo(k, j0), ihi = query_hi(k, j0 + n);
  int64_t h_lo = g * a->group - a->off, h_hi = h_lo + a->group;
  if (h_lo < 0) h_lo = 0;
  bool fresh = k->bwd_overwrite && (b * k->nh + h_lo) * nt >= c->x0, pk = packed(a);
  float *dkt = dk + ko, *dvt = dv + ko; /* the products' output tiles, ldo apart */
  int64_t ldo = a->kr;
  if (pk) {
    dense_in(w.kT, dkt, n, hd, ldo, fresh), dense_in(w.vt, dvt, n, hd, ldo, fresh);
    dkt = w.kT, dvt = w.vt, ldo = hd, fresh = false;
  }
  for (int64_t h = h_lo; h < h_hi && h < k->nh; h++) {
    int64_t bh = b * k->nh + h, x = bh * nt; /* the head's first item */
    int64_t ta = (c->x0 > x ? c->x0 : x) - x, tb = min64(c->x1, x + nt) - x;
    if (ta >= tb) continue;
    int64_t rlo = ta * TQ, rhi = min64(tb * TQ, k->sq); /* the chunk's rows of head h */
    for (int64_t i0 = ilo; i0 < ihi; i0 += TQ) {
      int64_t M = min64(TQ, ihi - i0), last = i0 + M - 1, qo = q_op(a, b, i0, h), ld = n;
      if (last < rlo) continue;
      if (last >= rhi) break;
      const void *P = a->lp ? w.Pt : (void *)w.S, *dS = a->lp ? w.dSt : (void *)w.dS;
      if (!item_tile(a, c, bh, i0, M, j0, n, &P, &dS, &ld)) fetch_tile(a, c, bh, i0, M, j0, n, w);
      int rc = mm_out(a, fresh, true, n, hd, M, 1.0f, P, ld, at(a->dout, qo, a->esz),
                      a->oq.row, dvt, ldo);
      if (!rc)
        rc = mm_out(a, fresh, true, n, hd, M, k->scale, dS, ld, at(a->q, qo, a->esz),
                    a->oq.row, dkt, ldo);
      if (rc) return rc;
      fresh = false;
    }
  }
  if (fresh) zero_rows(dv + ko, n, hd, a->kr), zero_rows(dk + ko, n, hd, a->kr); /* no query */
  if (pk) dense_out(w.kT, dk + ko, n, hd, a->kr), dense_out(w.vt, dv + ko, n, hd, a->kr);
  return 0;
}

/* Under bwd_overwrite, what no task writes: 0 in dq's rows (sq > 0) when
 * the block has no keys, dk's and dv's (sk > 0) when it has no queries, and
 * the rows of kv heads none of the block's query heads reads (head_off,
 * group). */
static void zero_unreached(const attn *a, float *dq, float *dk, float *dv) {
  const k_attn_block *k = a->blk;
  if (!k->bwd_overwrite || k->B <= 0) return;
  bool none = k->sq <= 0 || k->sk <= 0;
  int64_t g0 = none ? k->nkv : kv_of(a, 0), g1 = none ? 0 : kv_of(a, k->nh - 1);
  for (int64_t b = 0; b < k->B; b++) {
    if (none && k->sq > 0) zero_rows(dq + b * k->q_bs, k->sq, a->qr, a->qr);
    for (int64_t g = 0; g < k->nkv && k->sk > 0; g++)
      if (g < g0 || g > g1) {
        zero_rows(dk + k_at(a, b, 0, g), k->sk, k->hd, a->kr);
        zero_rows(dv + k_at(a, b, 0, g), k->sk, k->hd, a->kr);
      }
  }
}

int k_attention_block_bwd(const k_attn_block *blk, const float *dout, const float *q,
                          const float *k, const float *v, const float *out, const float *lse,
                          float *dq, float *dk, float *dv, const k_attn_bf16 *lp, void *work,
                          size_t work_bytes, float *tiles) {
  if (blk->B <= 0) return 0;
  if (work_bytes < k_attention_bwd_work(blk, 0)) return -1;
  attn a = attn_of(blk, q, k, v, dout, lp);
  zero_unreached(&a, dq, dk, dv);
  if (blk->sq <= 0 || blk->sk <= 0) return 0;
  int64_t nt = (blk->sq + TQ - 1) / TQ, nk = (blk->sk + TK - 1) / TK, X = blk->B * blk->nh * nt;
  char *w0 = (char *)(((uintptr_t)work + 63) / 64 * 64);
  int64_t *pre = (int64_t *)w0;
  char *base = w0 + pre_bytes(nt);
  size_t room = work_bytes - (size_t)(base - (char *)work);
  int64_t cap = room > (size_t)INT64_MAX ? INT64_MAX : (int64_t)room;
  pre[0] = 0;
  for (int64_t t = 0; t < nt; t++) pre[t + 1] = pre[t] + item_bytes(blk, t, a.esz);
  int rc = 0;
  int blas_threads = blas_serial_begin();
#pragma omp parallel
  {
    scratch w = scratch_of(tiles, blk->hd);
    chunk c = {.base = base, .pre = pre, .nt = nt};
    while (c.x1 < X) {
      int64_t x0 = c.x1, kept = x0 % nt ? pre[x0 % nt] - pre[x0 % nt - 1] : 0;
      const char *from = kept ? item_at(&c, x0 - 1) : NULL; /* in the previous chunk */
#pragma omp single
      if (kept) memmove(base, from, (size_t)kept);
      c.x0 = x0, c.x1 = chunk_end(pre, nt, X, x0, kept, cap), c.kept = kept;
#pragma omp for schedule(dynamic)
      for (int64_t task = 0; task < c.x1 - c.x0; task++) /* the longest rows first */
        keep_first(&rc, bwd_query_tile(&a, &c, out, lse, dq, c.x1 - 1 - task, w));
      /* implicit barrier: pass 2 reads the chunk's items; its (sequence, kv head) pairs */
      int64_t p0 = (c.x0 / nt / blk->nh) * blk->nkv + kv_of(&a, c.x0 / nt % blk->nh);
      int64_t p1 = ((c.x1 - 1) / nt / blk->nh) * blk->nkv + kv_of(&a, (c.x1 - 1) / nt % blk->nh);
#pragma omp for schedule(dynamic)
      for (int64_t task = 0; task < (p1 - p0 + 1) * nk; task++) {
        int64_t p = p0 + task / nk; /* the first key tiles, seen by the most queries, first */
        keep_first(&rc, bwd_key_tile(&a, &c, dk, dv, p / blk->nkv, p % blk->nkv,
                                     (task % nk) * TK, w));
      }  // implicit barrier: the next chunk overwrites the store
    }
  }
  openblas_set_num_threads(blas_threads);
  return rc;
}

/* ---- packed documents (varlen) ----------------------------------------------
 *
 * Every document of the batch in one call: document d is the block of its
 * own tokens (B = 1, q_pos = k_pos = 0, sq = sk = its length) on the
 * operands offset to its first token — the block a per-document call runs
 * — and its tasks are that block's tasks, run by the same functions
 * (fwd_tile / fwd_task_fixed, bwd_query_tile, bwd_key_tile) with the same
 * tiles from its first token, so each of its rows gets the same products
 * in the same order: only which thread runs them, and when, differs. */

// tokens of document d (seqused, else its slot)
static int64_t doc_len(const k_attn_docs *docs, int64_t d) {
  return docs->used ? docs->used[d] : docs->cu[d + 1] - docs->cu[d];
}

/* Document d of the batch as a block of its own: its geometry, its
 * operands' pointers (and lp's) at its first token. Built in place: a
 * points at blk and lp. */
typedef struct doc_view {
  k_attn_block blk;
  k_attn_bf16 lp;
  attn a;
  int64_t qo, ko, lo; /* its first token's offsets (elements) in q, out, dq; k, dk; lse */
  const float *q, *k, *v; /* the caller's q, k, v there (bf16 elements under qkv_bf16) */
} doc_view;

static const void *shift(const void *p, int64_t elems, size_t esz) {
  return p ? (const char *)p + (size_t)elems * esz : NULL;
}

static void doc_view_init(doc_view *v, const k_attn_block *whole, const k_attn_docs *docs,
                          int64_t d, const float *q, const float *k, const float *vv,
                          const float *dout, const k_attn_bf16 *lp) {
  int64_t t0 = docs->cu[d], n = doc_len(docs, d), qr = whole->nh * whole->hd;
  int64_t kr = whole->nkv * whole->hd, row = t0 / whole->sq, pos = t0 % whole->sq;
  v->blk = *whole;
  v->blk.B = 1, v->blk.sq = v->blk.sk = n;
  v->blk.bwd_overwrite = true; /* a document's only block: its rows (=) */
  v->blk.q_bs = n * qr, v->blk.k_bs = n * kr, v->blk.l_bs = n * whole->nh;
  v->qo = t0 * qr, v->ko = t0 * kr, v->lo = t0 * whole->nh;
  size_t in = whole->qkv_bf16 ? sizeof(uint16_t) : sizeof(float);
  if (lp) {
    /* lp's copies of the whole batch: the document's rows from its first */
    size_t e = lp->packed ? sizeof(uint16_t) : sizeof(float);
    int64_t qa = lp->q_row ? row * lp->q_bs + pos * lp->q_row : v->qo;
    int64_t ka = lp->k_row ? row * lp->k_bs + pos * lp->k_row : v->ko;
    v->lp = *lp;
    v->lp.q = shift(lp->q, qa, e), v->lp.dout = shift(lp->dout, qa, e);
    v->lp.k = shift(lp->k, ka, e), v->lp.v = shift(lp->v, ka, e);
  }
  v->q = shift(q, v->qo, in), v->k = shift(k, v->ko, in), v->v = shift(vv, v->ko, in);
  v->a = attn_of(&v->blk, v->q, v->k, v->v, dout ? dout + v->qo : NULL, lp ? &v->lp : NULL);
}

// whether document d's forward takes the row kernel (as k_attention_block_fwd decides)
static bool doc_rows(const k_attn_block *whole, int64_t n) {
  return whole->fixed_order || n <= K_ATTN_ROWS;
}

// forward tasks of document v (its block's, as k_attention_block_fwd cuts it)
static int64_t doc_fwd_tasks(const k_attn_block *whole, const doc_view *v) {
  int64_t n = v->blk.sq;
  if (n <= 0) return 0;
  if (doc_rows(whole, n)) {
    fixed_split f = fixed_split_of(&v->a);
    return v->blk.nkv * f.nc * f.nt;
  }
  return whole->nh * ((n + TQ - 1) / TQ);
}

// the document holding task x: the last d with first[d] <= x (first increasing to first[n])
static int64_t doc_of_task(const int64_t *first, int64_t n, int64_t x) {
  int64_t lo = 0, hi = n; /* first[lo] <= x < first[hi] */
  while (hi - lo > 1) {
    int64_t mid = lo + (hi - lo) / 2;
    if (first[mid] <= x) lo = mid;
    else hi = mid;
  }
  return lo;
}

/* Gap d (0 <= d <= n) of the batch's T tokens, tokens [*a, *b) outside
 * every document: document d's slot after its used tokens (d < n), or the
 * tokens after the last slot (d = n; cu[0] = 0). */
static void doc_gap(const k_attn_docs *docs, int64_t T, int64_t d, int64_t *a, int64_t *b) {
  bool slot = d < docs->n;
  *a = slot ? docs->cu[d] + doc_len(docs, d) : docs->n ? docs->cu[docs->n] : 0;
  *b = slot ? docs->cu[d + 1] : T;
}

/* The tokens outside every document (a slot's tail, from cu[n] on): out 0,
 * lse −inf, as a block's row that sees no key (finish_row). */
static void fwd_padding(const k_attn_block *whole, const k_attn_docs *docs, float *out,
                        float *lse) {
  int64_t T = whole->B * whole->sq, qr = whole->nh * whole->hd, a, b;
  size_t e = whole->out_bf16 ? sizeof(uint16_t) : sizeof(float);
  for (int64_t d = 0; d <= docs->n; d++) {
    doc_gap(docs, T, d, &a, &b);
    if (a >= b) continue;
    memset((char *)out + (size_t)(a * qr) * e, 0, (size_t)((b - a) * qr) * e);
    for (int64_t i = a * whole->nh; i < b * whole->nh; i++) lse[i] = -INFINITY;
  }
}

int k_attention_varlen_fwd(const k_attn_block *blk, const k_attn_docs *docs, const float *q,
                           const float *k, const float *v, float *out, float *lse,
                           const k_attn_bf16 *lp, float *tiles, int64_t *first) {
  if (blk->B <= 0 || blk->sq <= 0) return 0;
  fwd_padding(blk, docs, out, lse);
  first[0] = 0;
  for (int64_t d = 0; d < docs->n; d++) {
    doc_view dc;
    doc_view_init(&dc, blk, docs, d, q, k, v, NULL, lp);
    first[d + 1] = first[d] + doc_fwd_tasks(blk, &dc);
  }
  int64_t tasks = first[docs->n];
  int rc = 0;
  int blas_threads = blas_serial_begin();
#pragma omp parallel if (tasks > 1)
  {
    scratch w = scratch_of(tiles, blk->hd);
#pragma omp for schedule(dynamic)
    for (int64_t x = 0; x < tasks; x++) {
      int64_t d = doc_of_task(first, docs->n, x), task = x - first[d];
      doc_view dc;
      doc_view_init(&dc, blk, docs, d, q, k, v, NULL, lp);
      float *o = (float *)shift(out, dc.qo, blk->out_bf16 ? sizeof(uint16_t) : sizeof(float));
      if (doc_rows(blk, dc.blk.sq)) {
        fixed_split f = fixed_split_of(&dc.a);
        fwd_task_fixed(&dc.a, &f, task, o, lse + dc.lo, false, w);
        continue;
      }
      /* as k_attention_block_fwd's tasks: the document's last tiles first */
      int64_t nt = (dc.blk.sq + TQ - 1) / TQ, h = task / nt, t = nt - 1 - task % nt;
      keep_first(&rc, fwd_tile(&dc.a, o, lse + dc.lo, false, 0, h, t * TQ, w));
    }
  }
  openblas_set_num_threads(blas_threads);
  return rc;
}

/* The backward's workspace: the documents' records, their item offsets
 * (each document's pre, as k_attention_block_bwd's), then the store that
 * a group of consecutive documents shares, each document's items whole
 * (one chunk, no kept item). */
typedef struct doc_rec {
  int64_t pre;   /* its item offsets' place in the pre area (int64s) */
  int64_t store; /* its items' first byte in the store (in its group) */
  int64_t t1, t2; /* its group's pass-1 and pass-2 tasks before its own */
} doc_rec;

// 64-byte multiple of n bytes, saturating
static int64_t round64(int64_t n) { return n > INT64_MAX - 63 ? INT64_MAX : (n + 63) / 64 * 64; }

/* The varlen workspace's parts for blk, docs: records and pre area bytes
 * (*head), the store's bytes with a budget (*store); false on overflow. */
static bool varlen_parts(const k_attn_block *blk, const k_attn_docs *docs, size_t budget,
                         int64_t *head, int64_t *store) {
  int64_t pre = 0, all = 0, least = 0;
  for (int64_t d = 0; d < docs->n; d++) {
    doc_view dc;
    doc_view_init(&dc, blk, docs, d, NULL, NULL, NULL, NULL, NULL);
    int64_t nt = (dc.blk.sq + TQ - 1) / TQ;
    size_t whole = k_attention_bwd_work(&dc.blk, SIZE_MAX);
    size_t alone = k_attention_bwd_work(&dc.blk, 0);
    if (whole > INT64_MAX || alone > INT64_MAX || __builtin_add_overflow(pre, nt + 1, &pre) ||
        __builtin_add_overflow(all, (int64_t)whole, &all))
      return false;
    if ((int64_t)alone > least) least = (int64_t)alone;
  }
  if (docs->n > INT64_MAX / (int64_t)sizeof(doc_rec) || pre > INT64_MAX / 8) return false;
  *head = round64(docs->n * (int64_t)sizeof(doc_rec)) + round64(pre * 8);
  *store = budget < (size_t)all ? (int64_t)budget : all;
  if (*store < least) *store = least;
  return *head < INT64_MAX - 64 - *store;
}

size_t k_attention_varlen_bwd_work(const k_attn_block *blk, const k_attn_docs *docs,
                                   size_t budget) {
  int64_t head, store;
  if (blk->B <= 0 || blk->sq <= 0) return 0;
  if (!varlen_parts(blk, docs, budget, &head, &store)) return SIZE_MAX;
  return (size_t)(64 + head + store);
}

/* Zeroes dq, dk, dv of the tokens outside every document (no task writes
 * them), and, under bwd_overwrite, each document's unreached rows
 * (zero_unreached). */
static void bwd_padding(const k_attn_block *blk, const k_attn_docs *docs, float *dq, float *dk,
                        float *dv) {
  int64_t T = blk->B * blk->sq, qr = blk->nh * blk->hd, kr = blk->nkv * blk->hd, a, b;
  for (int64_t d = 0; d <= docs->n; d++) {
    doc_gap(docs, T, d, &a, &b);
    if (a >= b) continue;
    memset(dq + a * qr, 0, (size_t)((b - a) * qr) * sizeof(float));
    memset(dk + a * kr, 0, (size_t)((b - a) * kr) * sizeof(float));
    memset(dv + a * kr, 0, (size_t)((b - a) * kr) * sizeof(float));
  }
}

// document d's chunk: its items whole, at its place in the store
static chunk doc_chunk(const doc_view *v, const doc_rec *r, const int64_t *pre_area, char *store) {
  int64_t nt = (v->blk.sq + TQ - 1) / TQ;
  return (chunk){.base = store + r->store, .pre = pre_area + r->pre, .nt = nt, .x0 = 0,
                 .x1 = v->blk.nh * nt, .kept = 0};
}

// pass 2's (kv head, key tile) tasks of a document: the kv heads its query heads read
static int64_t doc_key_tasks(const doc_view *v, int64_t *g0) {
  *g0 = kv_of(&v->a, 0);
  return (kv_of(&v->a, v->blk.nh - 1) - *g0 + 1) * ((v->blk.sk + TK - 1) / TK);
}

/* The document of documents d0 .. d1−1 holding pass-1 task x (pass 2's:
 * p2): the last d with its group's tasks before it <= x. */
static int64_t rec_of(const doc_rec *rec, int64_t d0, int64_t d1, int64_t x, bool p2) {
  int64_t lo = d0, hi = d1; /* rec[lo] <= x < rec[hi] (hi: past the group) */
  while (hi - lo > 1) {
    int64_t mid = lo + (hi - lo) / 2;
    if ((p2 ? rec[mid].t2 : rec[mid].t1) <= x) lo = mid;
    else hi = mid;
  }
  return lo;
}

int k_attention_varlen_bwd(const k_attn_block *blk, const k_attn_docs *docs, const float *dout,
                           const float *q, const float *k, const float *v, const float *out,
                           const float *lse, float *dq, float *dk, float *dv,
                           const k_attn_bf16 *lp, void *work, size_t work_bytes, float *tiles) {
  if (blk->B <= 0 || blk->sq <= 0) return 0;
  int64_t head, cap;
  if (!varlen_parts(blk, docs, K_ATTN_BWD_STORE, &head, &cap) ||
      work_bytes < k_attention_varlen_bwd_work(blk, docs, 0))
    return -1;
  bwd_padding(blk, docs, dq, dk, dv);
  char *w0 = (char *)(((uintptr_t)work + 63) / 64 * 64);
  doc_rec *rec = (doc_rec *)w0;
  int64_t *pre_area = (int64_t *)(w0 + round64(docs->n * (int64_t)sizeof(doc_rec)));
  char *store = w0 + head;
  size_t room = work_bytes - (size_t)(store - (char *)work);
  cap = room > (size_t)INT64_MAX ? INT64_MAX : (int64_t)room;
  size_t oe = blk->out_bf16 ? sizeof(uint16_t) : sizeof(float);
  int rc = 0;
  /* groups of consecutive documents whose items fit the store together;
   * a document that does not fit alone runs alone, in chunks */
  for (int64_t d0 = 0, pre = 0; d0 < docs->n && !rc;) {
    int64_t d1 = d0, used = 0, t1 = 0, t2 = 0;
    for (; d1 < docs->n; d1++) {
      doc_view dc;
      doc_view_init(&dc, blk, docs, d1, q, k, v, dout, lp);
      int64_t nt = (dc.blk.sq + TQ - 1) / TQ, g0;
      int64_t *p = pre_area + pre; /* its item offsets (the pre area has room for all) */
      p[0] = 0;
      for (int64_t t = 0; t < nt; t++) p[t + 1] = p[t] + item_bytes(&dc.blk, t, dc.a.esz);
      int64_t bytes = p[nt] * dc.blk.nh;
      if (used + bytes > cap) break;
      rec[d1] = (doc_rec){.pre = pre, .store = used, .t1 = t1, .t2 = t2};
      zero_unreached(&dc.a, dq + dc.qo, dk + dc.ko, dv + dc.ko);
      used += bytes, pre += nt + 1;
      if (dc.blk.sq > 0) t1 += dc.blk.nh * nt, t2 += doc_key_tasks(&dc, &g0);
    }
    if (d1 == d0) { /* document d0 alone: k_attention_block_bwd's chunks over the store */
      doc_view dc;
      doc_view_init(&dc, blk, docs, d0, q, k, v, dout, lp);
      rc = k_attention_block_bwd(&dc.blk, dout + dc.qo, dc.q, dc.k, dc.v,
                                 shift(out, dc.qo, oe), lse + dc.lo, dq + dc.qo, dk + dc.ko,
                                 dv + dc.ko, lp ? &dc.lp : NULL, store, (size_t)cap, tiles);
      d0++;
      continue;
    }
    int blas_threads = blas_serial_begin();
#pragma omp parallel if (t1 > 1)
    {
      scratch w = scratch_of(tiles, blk->hd);
      /* pass 1 over the group's (document, head, query tile) items, the
       * longest rows of each document first */
#pragma omp for schedule(dynamic)
      for (int64_t x = 0; x < t1; x++) {
        int64_t d = rec_of(rec, d0, d1, x, false);
        doc_view dc;
        doc_view_init(&dc, blk, docs, d, q, k, v, dout, lp);
        chunk c = doc_chunk(&dc, &rec[d], pre_area, store);
        keep_first(&rc, bwd_query_tile(&dc.a, &c, shift(out, dc.qo, oe), lse + dc.lo,
                                       dq + dc.qo, c.x1 - 1 - (x - rec[d].t1), w));
      }
      /* implicit barrier: pass 2 over the group's (document, kv head, key tile) */
#pragma omp for schedule(dynamic)
      for (int64_t x = 0; x < t2; x++) {
        int64_t d = rec_of(rec, d0, d1, x, true), g0;
        doc_view dc;
        doc_view_init(&dc, blk, docs, d, q, k, v, dout, lp);
        chunk c = doc_chunk(&dc, &rec[d], pre_area, store);
        int64_t task = x - rec[d].t2, nk = (dc.blk.sk + TK - 1) / TK;
        doc_key_tasks(&dc, &g0);
        keep_first(&rc, bwd_key_tile(&dc.a, &c, dk + dc.ko, dv + dc.ko, 0, g0 + task / nk,
                                     (task % nk) * TK, w));
      }
    }
    openblas_set_num_threads(blas_threads);
    d0 = d1;
  }
  return rc;
}
