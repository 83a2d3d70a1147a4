/* The batch-invariant GEMM (cpu.h ml_cpu_gemm_fixed): C (=|+=) A·B^T (+
 * bias) with one summation order per output element that depends on K
 * alone — never on M, N, the blocking or the thread count — so a token's
 * row of a linear layer's output is the same bit pattern whatever batch it
 * is computed in (vLLM's VLLM_BATCH_INVARIANT, Thinking Machines'
 * "Defeating Nondeterminism in LLM Inference": a matmul that never splits
 * its reduction by the shape of the call). The default path runs it too
 * for x·W^T of at most ML_CPU_GEMM_SMALL_M rows (cpu.h: decode, where it
 * streams W faster than oneDNN).
 *
 * The order: element (i, j) is
 * the dot product of row i of A and row j of B over k = 0 .. K−1 in 16
 * lanes, lane l the chain of fused multiply-adds over k ≡ l (mod 16) in
 * increasing k (starting from +0; the last partial chunk's missing lanes
 * add nothing), then the lanes summed as a fixed tree (l + l⊕8, then ⊕4,
 * ⊕2, ⊕1), then + bias[j] (fp32), then, accumulating, C + that. The AVX-512
 * kernel and the portable one (AVX2 or scalar, as the compiler vectorizes
 * its fmaf lanes) compute exactly these operations, so the bits are the
 * same on every x86-64 CPU. bf16 operands are widened to fp32 exactly;
 * their products are exact in fp32, and the order above is the one sum.
 *
 * Blocking (none of it changes an element's operations): register tiles of
 * mr ≤ 4 rows of A by nr = 4 rows of B (nr = 8 when at most 2 rows of A
 * are left), B's rows the outer loop so that each group of them is read
 * from memory once, prefetched one group ahead, and used by every row of A
 * in the block; rows of B past N repeated and their results dropped. At
 * most MB rows of A (decode: W streamed at memory bandwidth) each OpenMP thread
 * takes a contiguous part of B's rows; more, 64 × 64 output tiles, one
 * OpenMP task each (K never split), on packed panels with AVX-512 where B
 * is fp32: the task's A rows and each group of PR rows of B copied once
 * into contiguous chunk-major panels, zero-padded to whole chunks (the
 * masked loads' zeros: the same fused multiply-adds), so a register tile
 * streams its B panel from L1 and its A panel from L2 rather than eight
 * strided rows from L2. A product too small to pay for waking
 * the team runs on the calling thread (PAR_*, measured below). A bf16 A may
 * come widened to fp32 already (gemm.c does, once per call: the same
 * values, so the same products), leaving only B to widen in the loop. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "common/checked.h"

/* PR: rows of a packed panel (block_packed) */
enum { LANES = 16, MR = 4, NR = 4 /* reduce4 */, NRMAX = 8, MB = 64, NB = 64, PR = 4 };

/* The team wakes only for a product of N·K >= PAR_NK elements of B or
 * M·N·K >= PAR_MNK multiply-adds. Measured with bench/cpu_gemm_small.c (AMD
 * EPYC Zen 4, 2 threads against 1, OMP_WAIT_POLICY=passive, K 576, W cold):
 * waking the second thread costs ~40 µs; x·W^T at M 1 took 0.030 ms on one
 * thread against 0.069 on two for N 192 (fp32), 0.095 against 0.111 for N
 * 576 (fp32), 0.059 against 0.107 (bf16), and two threads won from N 1536
 * (0.22 against 0.24 ms fp32, 0.13 against 0.16 bf16); at N 576 two won
 * from M 8 (0.13 against 0.16 ms) and lost at M 4 (0.13 against 0.11). */
enum { PAR_NK = 1 << 19, PAR_MNK = 1 << 21 };

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FIXED_PACKED 1 /* the AVX-512 kernels, and the packed path of large M */
#include <immintrin.h>

/* 16 elements from k of a row (bf16 widened), lanes outside mask 0 */
static inline __m512 load16(const void *row, int64_t k, bool bf, __mmask16 m) {
  if (bf) {
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)row + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_maskz_loadu_ps(m, (const float *)row + k);
}

/* The lanes' tree of four accumulators at once, the same additions as the
 * portable reduce16: s8[l] = v[l] + v[l+8] (two accumulators per add),
 * s4[l] = s8[l] + s8[l+4], s2[l] = s4[l] + s4[l+2], s2[0] + s2[1];
 * returns the four sums [a, b, c, d]. */
static inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
  /* 128-bit chunk x of s4: accumulator x's lanes s8[0..3] + s8[4..7] */
  __m512 s4 = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 s2 = _mm512_add_ps(s4, _mm512_shuffle_ps(s4, s4, _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 s1 = _mm512_add_ps(s2, _mm512_shuffle_ps(s2, s2, _MM_SHUFFLE(1, 1, 1, 1)));
  return _mm512_castps512_ps128(
      _mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), s1));
}

/* out[r][c] = row a[r] · row b[c] over K, r < mr, c < nr (4 or 8); each
 * chunk of the B rows also prefetches the rows `ahead` bytes further on
 * (the next rows the caller streams; 0: none). */
static inline __attribute__((always_inline)) void micro(int mr, int nr, bool abf, bool bbf,
                                                        int64_t K, const void *const *a,
                                                        const void *const *b, int64_t ahead,
                                                        float out[][NRMAX]) {
  __m512 acc[MR][NRMAX];
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
    for (int c = 0; c < nr; c++) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  const int64_t esz = bbf ? 2 : 4;
  for (; k + LANES <= K; k += LANES) { /* whole chunks (the accumulators stay in registers) */
    __m512 bv[NRMAX];
#pragma GCC unroll 8
    for (int c = 0; c < nr; c++) {
      if (ahead) _mm_prefetch((const char *)b[c] + k * esz + ahead, _MM_HINT_T0);
      bv[c] = load16(b[c], k, bbf, (__mmask16)0xFFFF);
      __asm__("" : "+v"(bv[c])); /* one load per chunk, not one per FMA (GCC folds it) */
    }
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
      __m512 av = load16(a[r], k, abf, (__mmask16)0xFFFF);
#pragma GCC unroll 8
      for (int c = 0; c < nr; c++) acc[r][c] = _mm512_fmadd_ps(av, bv[c], acc[r][c]);
    }
  }
  if (k < K) { /* the last partial chunk: its missing lanes load 0 and add +0 */
    __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
    __m512 bv[NRMAX];
#pragma GCC unroll 8
    for (int c = 0; c < nr; c++) bv[c] = load16(b[c], k, bbf, m);
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
      __m512 av = load16(a[r], k, abf, m);
#pragma GCC unroll 8
      for (int c = 0; c < nr; c++) acc[r][c] = _mm512_fmadd_ps(av, bv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 2
    for (int c = 0; c < nr; c += 4)
      _mm_storeu_ps(out[r] + c, reduce4(acc[r][c], acc[r][c + 1], acc[r][c + 2], acc[r][c + 3]));
}

/* A panel (the packed path): rows r0 .. r0+nr−1 of X [., K] (ld, bf16 or
 * fp32) into p [kc][PR][16] fp32, chunk-major, the panel's rows past nr 0
 * and the lanes of a partial last chunk 0 (the masked loads' 0), so a
 * register tile reads one contiguous stream, widened once. */
static void pack(const void *X, int64_t ld, bool bf, int64_t r0, int nr, int64_t K, float *p) {
  int64_t kc = (K + LANES - 1) / LANES;
  for (int r = 0; r < PR; r++) {
    const void *x = (const char *)X + (size_t)((r0 + (r < nr ? r : 0)) * ld) * (bf ? 2 : 4);
    for (int64_t c = 0; c < kc; c++) {
      int64_t k = c * LANES;
      __mmask16 m = K - k >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
      _mm512_store_ps(p + (c * PR + r) * LANES, r < nr ? load16(x, k, bf, m) : _mm512_setzero_ps());
    }
  }
}

/* out[r][c] = the documented order over packed panels a [kc][PR][16] and
 * b [kc][PR][16] (pack): micro's operations on the same values. */
static inline __attribute__((always_inline)) void micro_packed(int mr, int64_t kc, const float *a,
                                                               const float *b, float out[][NRMAX]) {
  __m512 acc[MR][NR];
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int c = 0; c < NR; c++) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; k++, a += PR * LANES, b += PR * LANES) {
    __m512 bv[NR];
#pragma GCC unroll 4
    for (int c = 0; c < NR; c++) bv[c] = _mm512_load_ps(b + c * LANES);
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
      __m512 av = _mm512_load_ps(a + r * LANES);
#pragma GCC unroll 4
      for (int c = 0; c < NR; c++) acc[r][c] = _mm512_fmadd_ps(av, bv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++)
    _mm_storeu_ps(out[r], reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

#else
#define FIXED_PACKED 0

static inline float elem(const void *row, int64_t k, bool bf) {
  return bf ? ml_bf16_to_f32(((const uint16_t *)row)[k]) : ((const float *)row)[k];
}

// the lanes' tree: (l + l+8), then +4, +2, +1
static inline float reduce16(const float *v) {
  float s8[8], s4[4], s2[2];
  for (int l = 0; l < 8; l++) s8[l] = v[l] + v[l + 8];
  for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
  for (int l = 0; l < 2; l++) s2[l] = s4[l] + s4[l + 2];
  return s2[0] + s2[1];
}

/* out[r][c] = row a[r] · row b[c] over K, r < mr, c < nr (the lanes as
 * above; `ahead`, the AVX-512 kernel's prefetch, unused) */
static inline __attribute__((always_inline)) void micro(int mr, int nr, bool abf, bool bbf,
                                                        int64_t K, const void *const *a,
                                                        const void *const *b, int64_t ahead,
                                                        float out[][NRMAX]) {
  (void)ahead;
  float acc[MR][NRMAX][LANES];
  memset(acc, 0, sizeof acc);
  for (int64_t k0 = 0; k0 < K; k0 += LANES) {
    int n = K - k0 >= LANES ? LANES : (int)(K - k0);
    for (int r = 0; r < mr; r++)
      for (int c = 0; c < nr; c++)
        for (int l = 0; l < n; l++)
          acc[r][c][l] = fmaf(elem(a[r], k0 + l, abf), elem(b[c], k0 + l, bbf), acc[r][c][l]);
  }
  for (int r = 0; r < mr; r++)
    for (int c = 0; c < nr; c++) out[r][c] = reduce16(acc[r][c]);
}

#endif

typedef struct fixed_args {
  const ml_gemm *g;
  const void *A, *B;
  int64_t lda, ldb;  /* elements */
  size_t aesz, besz; /* bytes per element of A, of B: 4 (fp32) or 2 (bf16) */
  const float *bias;
} fixed_args;

static const void *row_of(const void *base, int64_t r, int64_t ld, size_t esz) {
  return (const char *)base + (size_t)(r * ld) * esz;
}

// C[i, j0 .. j0+nc) from out[r][0 .. nc): + bias, then (=) or (+=); a bf16 C (=) rounded
// to nearest-even here, elementwise, so the order above still fixes its bits
static void store(const fixed_args *f, int64_t i, int64_t j0, int nc, const float *out) {
  if (f->g->c_bf16) {
    uint16_t *c = (uint16_t *)f->g->C + i * f->g->ldc + j0;
    for (int q = 0; q < nc; q++) c[q] = ml_f32_to_bf16(f->bias ? out[q] + f->bias[j0 + q] : out[q]);
    return;
  }
  float *c = (float *)f->g->C + i * f->g->ldc + j0;
  for (int q = 0; q < nc; q++) {
    float v = out[q];
    if (f->bias) v += f->bias[j0 + q];
    c[q] = f->g->accumulate ? c[q] + v : v;
  }
}

/* rows i0 .. i0+mr of A against rows j0 .. j0+nr of B (those past N
 * repeat the last one; their results are dropped), prefetching `ahead`
 * bytes past the B rows (0: none) */
static void tile(const fixed_args *f, int mr, int nr, int64_t i0, int64_t j0, int64_t ahead) {
  const ml_gemm *g = f->g;
  bool abf = f->aesz == sizeof(uint16_t), bbf = f->besz == sizeof(uint16_t);
  const void *a[MR], *b[NRMAX];
  for (int r = 0; r < mr; r++) a[r] = row_of(f->A, i0 + r, f->lda, f->aesz);
  for (int c = 0; c < nr; c++)
    b[c] = row_of(f->B, j0 + c < g->N ? j0 + c : g->N - 1, f->ldb, f->besz);
  float out[MR][NRMAX];
  /* the register tiles' shapes and dtypes as constants: the accumulators are registers */
#define MICRO(MR_, NR_) \
  case MR_ * 16 + NR_: \
    if (!bbf) micro(MR_, NR_, false, false, g->K, a, b, ahead, out); \
    else if (abf) micro(MR_, NR_, true, true, g->K, a, b, ahead, out); \
    else micro(MR_, NR_, false, true, g->K, a, b, ahead, out); \
    break;
  switch (mr * 16 + nr) {
    MICRO(4, 4) MICRO(3, 4) MICRO(2, 4) MICRO(1, 4) MICRO(2, 8) MICRO(1, 8)
  }
#undef MICRO
  int nc = g->N - j0 < nr ? (int)(g->N - j0) : nr;
  for (int r = 0; r < mr; r++) store(f, i0 + r, j0, nc, out[r]);
}

/* Rows i_lo .. i_hi of A against rows j_lo .. j_hi of B in register tiles,
 * B's rows the outer loop: each group of B rows is read from memory once
 * (prefetched one group ahead) and used by every row of A. */
static void block(const fixed_args *f, int64_t i_lo, int64_t i_hi, int64_t j_lo, int64_t j_hi) {
  int nr = i_hi - i_lo <= 2 ? NRMAX : NR; /* a tile's accumulators mr·nr <= 16 */
  int64_t ahead = (int64_t)nr * f->ldb * (int64_t)f->besz;
  for (int64_t j0 = j_lo; j0 < j_hi; j0 += nr) {
    int64_t i0 = i_lo, pf = ahead; /* the first A rows' pass prefetches the next group */
    for (; i0 + MR <= i_hi; i0 += MR, pf = 0) tile(f, MR, nr, i0, j0, pf);
    if (i0 < i_hi) tile(f, (int)(i_hi - i0), nr, i0, j0, pf);
  }
}

#if FIXED_PACKED
/* A thread's panels for the packed path: ap [MB / PR][kc][PR][16] (the A
 * block of rows a_of .. a_of+MB−1 packed; a_of −1: none yet), bp
 * [kc][PR][16] (one panel of B). */
typedef struct panels {
  float *ap, *bp;
  int64_t a_of;
} panels;

static panels panels_alloc(int64_t K) {
  int64_t kc = (K + LANES - 1) / LANES;
  size_t bp = (size_t)ml_mul_sat(kc, PR * LANES) * sizeof(float); /* a multiple of 64 */
  panels p = {.ap = aligned_alloc(64, bp * (MB / PR)), .bp = aligned_alloc(64, bp), .a_of = -1};
  return p;
}

static void panels_free(panels *p) {
  free(p->ap);
  free(p->bp);
}

/* `block` on packed panels: rows i_lo .. i_hi (<= MB) of A packed once
 * (kept while the thread's next task has the same rows), each panel of PR
 * rows of B packed (widened) once and used by every A panel from L1. The
 * same operations as block (micro_packed), so the same bits. */
static void block_packed(const fixed_args *f, panels *p, int64_t i_lo, int64_t i_hi, int64_t j_lo,
                         int64_t j_hi) {
  const ml_gemm *g = f->g;
  bool abf = f->aesz == sizeof(uint16_t), bbf = f->besz == sizeof(uint16_t);
  int64_t kc = (g->K + LANES - 1) / LANES, panel = kc * PR * LANES;
  if (p->a_of != i_lo) {
    for (int64_t i0 = i_lo; i0 < i_hi; i0 += PR)
      pack(f->A, f->lda, abf, i0, (int)(i_hi - i0 < PR ? i_hi - i0 : PR), g->K,
           p->ap + (i0 - i_lo) / PR * panel);
    p->a_of = i_lo;
  }
  float out[MR][NRMAX];
  for (int64_t j0 = j_lo; j0 < j_hi; j0 += NR) {
    int nc = j_hi - j0 < NR ? (int)(j_hi - j0) : NR;
    pack(f->B, f->ldb, bbf, j0, nc, g->K, p->bp);
    for (int64_t i0 = i_lo; i0 < i_hi; i0 += MR) {
      const float *a = p->ap + (i0 - i_lo) / PR * panel;
      int mr = i_hi - i0 < MR ? (int)(i_hi - i0) : MR;
      switch (mr) { /* the tile's rows as a constant: the accumulators are registers */
        case 4: micro_packed(4, kc, a, p->bp, out); break;
        case 3: micro_packed(3, kc, a, p->bp, out); break;
        case 2: micro_packed(2, kc, a, p->bp, out); break;
        default: micro_packed(1, kc, a, p->bp, out); break;
      }
      for (int r = 0; r < mr; r++) store(f, i0 + r, j0, nc, out[r]);
    }
  }
}
#endif

/* Rows of A beyond MB: MB × NB output tiles, one OpenMP task each (K never
 * split), on packed panels where B is fp32 (AVX-512; a bf16 B, or a thread
 * without the panels' memory, runs its tiles unpacked: the same
 * operations). */
static void tiles(const fixed_args *f) {
  const ml_gemm *g = f->g;
  int64_t mt = (g->M + MB - 1) / MB, nt = (g->N + NB - 1) / NB;
#pragma omp parallel
  {
#if FIXED_PACKED
    /* fp32 B only: a bf16 B read as it is streams half the bytes from L2, which measured as
       fast as its widened panels (bench/cpu_gemm_small.c, M 512, K 576: N 576 0.8x, N 1536
       1.05x the unpacked time; fp32 1.5x faster packed) */
    panels p = f->besz == sizeof(float) ? panels_alloc(g->K) : (panels){NULL, NULL, -1};
    bool packed = p.ap && p.bp;
#endif
#pragma omp for schedule(static)
    for (int64_t t = 0; t < mt * nt; t++) { /* consecutive tasks share A's rows */
      int64_t i_lo = t / nt * MB, j_lo = t % nt * NB;
      int64_t i_hi = i_lo + MB < g->M ? i_lo + MB : g->M;
      int64_t j_hi = j_lo + NB < g->N ? j_lo + NB : g->N;
#if FIXED_PACKED
      if (packed) {
        block_packed(f, &p, i_lo, i_hi, j_lo, j_hi);
        continue;
      }
#endif
      block(f, i_lo, i_hi, j_lo, j_hi);
    }
#if FIXED_PACKED
    panels_free(&p);
#endif
  }
}

int ml_cpu_gemm_fixed(const ml_gemm *g, const void *A, int64_t lda, bool a_bf16, const void *B,
                      int64_t ldb, bool b_bf16, const float *bias) {
  fixed_args f = {.g = g, .A = A, .B = B, .lda = lda, .ldb = ldb,
                  .aesz = a_bf16 ? sizeof(uint16_t) : sizeof(float),
                  .besz = b_bf16 ? sizeof(uint16_t) : sizeof(float), .bias = bias};
  bool team = g->N * g->K >= PAR_NK || g->M * g->N * g->K >= PAR_MNK;
  if (g->M <= MB) { /* one block of A's rows: each thread a contiguous part of B's rows */
#pragma omp parallel if (team)
    {
      int nth = omp_get_num_threads(), th = omp_get_thread_num();
      int64_t units = (g->N + NRMAX - 1) / NRMAX; /* whole register tiles a thread */
      int64_t lo = units * th / nth * NRMAX, hi = units * (th + 1) / nth * NRMAX;
      if (hi > g->N) hi = g->N;
      if (lo < hi) block(&f, 0, g->M, lo, hi);
    }
    return 0;
  }
  tiles(&f);
  return 0;
}
