/* Every operator of the backend seam (backend/backend.h) on the "cuda"
 * backend against the same call on the "cpu" backend, through the public
 * ml_be_* API only: inputs go to each backend's device memory with
 * ml_be_alloc + ml_be_copy(H2D), results come back with D2H (the CPU
 * backend's device memory is host memory). Random inputs of several shapes,
 * odd sizes among them (not multiples of 4, 32 or 128; T = 1, S = 1;
 * tensors crossing 2^16 elements). Exits 77 (skipped) when the cuda
 * backend cannot be created (no CUDA in the build, or no GPU).
 *
 * Tolerances. Where both backends perform the same correctly rounded
 * operations on the same operands (copies, conversions, the residual add,
 * scale, embedding lookups, row maxima, the target logit, max |g|, the
 * RoPE tables, which the CUDA backend takes from the CPU code), the
 * results must be bitwise equal and are compared so. Elsewhere each
 * backend is an fp32 evaluation of the same expression, in another order
 * or with other libm calls, and each is within its own bound of the exact
 * value; the two differ by at most the sum of both bounds, i.e. twice the
 * bound of tests/tolerance.h §1 for that kernel (the counts TOL_K_* follow
 * the CPU kernels, whose expressions the CUDA kernels repeat operation for
 * operation; a fused multiply-add that nvcc contracts rounds once where the
 * count has two, so the counts stay upper bounds). Libm: CUDA's expf,
 * exp2f, logf and tanhf are within 2 ulp and log (double) within 1 ulp
 * (CUDA C++ Programming Guide, "Mathematical Functions", max ulp error),
 * glibc's within R4's: TOL_LIBM's 4 roundings cover either. Sums of n
 * terms in any order: gamma_n·sum|terms| (R2), fp64 sums gamma64_n. bf16
 * GEMMs and attention products on the GPU run on tensor cores, whose
 * block-FMA accumulation counts sum_count(n) roundings for a sum of n
 * products (derived in cuda/op_bounds.h, with the bounds of the kernels the
 * CPU emulator tests share; attention's bound: cuda/attn_bound.h).
 * Each check prints its worst error/bound. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>  // after the headers it needs

#include "backend/backend.h"
#include "check_util.h"
#include "cuda/attn_bound.h"
#include "cuda/op_bounds.h"
#include "common/status.h"
#include "tensor/dtype.h"
#include "tolerance.h"

/* ---- the two backends and buffers on both -------------------------------- */

enum { CPU, GPU, SIDES };
static ml_backend *g_be[SIDES];

static const char *side_name(int s) { return g_be[s]->ops->name; }

static void ok(int rc, const char *what, int s) {
  if (rc) fail_msg("%s on %s: %s", what, side_name(s), ml_error_msg());
}

/* `bytes` of device memory on each backend. */
typedef struct dbuf {
  void *p[SIDES];
  size_t bytes;
} dbuf;

static dbuf dev_new(size_t bytes) {
  dbuf b = {{NULL, NULL}, bytes};
  for (int s = 0; s < SIDES; s++) {
    b.p[s] = ml_be_alloc(g_be[s], (int64_t)bytes, 1, "a test buffer");
    if (!b.p[s]) fail_msg("%s: %s", side_name(s), ml_error_msg());
  }
  return b;
}

/* host[bytes] to both backends (over the whole buffer). */
static void dev_set(const dbuf *b, const void *host) {
  for (int s = 0; s < SIDES; s++)
    ok(ml_be_copy(g_be[s], b->p[s], host, b->bytes, ML_COPY_H2D), "copy H2D", s);
}

static dbuf dev_from(const void *host, size_t bytes) {
  dbuf b = dev_new(bytes);
  dev_set(&b, host);
  return b;
}

/* Side s's buffer, copied to new host memory. */
static void *dev_get(const dbuf *b, int s) {
  void *h = malloc(b->bytes ? b->bytes : 1);
  ok(ml_be_copy(g_be[s], h, b->p[s], b->bytes, ML_COPY_D2H), "copy D2H", s);
  return h;
}

static void dev_free(dbuf *b) {
  for (int s = 0; s < SIDES; s++) ml_be_free(g_be[s], b->p[s]);
}

/* The two backends' copies of b bitwise equal. */
static void expect_same(const char *what, const dbuf *b) {
  unsigned char *c = dev_get(b, CPU), *g = dev_get(b, GPU);
  size_t at = 0;
  while (at < b->bytes && c[at] == g[at]) at++;
  printf("  %-44s %s\n", what, at == b->bytes ? "bitwise equal" : "DIFFERENT");
  if (at < b->bytes)
    fail_msg("%s: byte %zu differs (cpu 0x%02x, cuda 0x%02x)", what, at, c[at], g[at]);
  free(c), free(g);
}

/* On each backend, b bitwise equal to its own a: the same call with
 * aliased operands, which backend.h allows, is the same arithmetic. */
static void expect_own(const char *what, const dbuf *a, const dbuf *b) {
  for (int s = 0; s < SIDES; s++) {
    void *x = dev_get(a, s), *y = dev_get(b, s);
    bool same = a->bytes == b->bytes && !memcmp(x, y, a->bytes);
    free(x), free(y);
    if (!same) fail_msg("%s on %s: differs from the call without aliasing", what, side_name(s));
  }
  printf("  %-44s as without aliasing\n", what);
}

/* The CUDA floats of b within bound[i] of the CPU's (n floats). */
static void expect_close(const char *what, const dbuf *b, const double *bound, int64_t n) {
  float *c = dev_get(b, CPU), *g = dev_get(b, GPU);
  double *ref = dzeros(n);
  for (int64_t i = 0; i < n; i++) ref[i] = c[i];
  expect_within(what, g, ref, bound, n);
  free(c), free(g), free(ref);
}

static uint16_t *to_bf16(const float *x, int64_t n) {
  uint16_t *h = malloc(sizeof(uint16_t) * (size_t)(n ? n : 1));
  for (int64_t i = 0; i < n; i++) h[i] = ml_f32_to_bf16(x[i]);
  return h;
}

/* ---- memory: copy, copy2d, zero, stats ----------------------------------- */

/* H2D, D2D into an odd offset of another buffer, D2H: the bytes unchanged
 * on each backend (checked against the host original). */
static void test_copy(void **state) {
  (void)state;
  const size_t sizes[] = {1, 3, 4097, 4 * 65536 + 3};
  for (size_t c = 0; c < sizeof sizes / sizeof sizes[0]; c++) {
    size_t n = sizes[c];
    unsigned char *h = malloc(n);
    for (size_t i = 0; i < n; i++) h[i] = (unsigned char)rand_bits();
    dbuf a = dev_from(h, n), b = dev_new(n + 8);
    for (int s = 0; s < SIDES; s++) {
      ok(ml_be_copy(g_be[s], (char *)b.p[s] + 3, a.p[s], n, ML_COPY_D2D), "copy D2D", s);
      unsigned char *back = malloc(n);
      ok(ml_be_copy(g_be[s], back, (char *)b.p[s] + 3, n, ML_COPY_D2H), "copy D2H", s);
      if (memcmp(back, h, n)) fail_msg("copy of %zu bytes on %s changed them", n, side_name(s));
      free(back);
    }
    printf("  copy %-39zu bitwise equal\n", n);
    dev_free(&a), dev_free(&b), free(h);
  }
}

/* copy2d between buffers and compacting in place (dst <= src, dpitch <=
 * spitch, overlapping), against the host doing the same rows in increasing
 * order with memmove; every byte of the destination buffer compared. */
static void test_copy2d(void **state) {
  (void)state;
  typedef struct {
    size_t rows, width, spitch, dpitch, src_off, dst_off;
    bool inplace;
  } c2d;
  const c2d cases[] = {
      {37, 13, 20, 16, 0, 0, false},   {1, 5, 5, 5, 0, 3, false},
      {3000, 33, 40, 35, 4, 1, false}, {37, 13, 20, 13, 0, 0, true},
      {3000, 33, 41, 33, 7, 0, true},  {50, 8, 12, 12, 4, 0, true},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    c2d k = cases[c];
    size_t src_n = k.src_off + k.rows * k.spitch;
    size_t dst_n = k.inplace ? src_n : k.dst_off + k.rows * k.dpitch;
    unsigned char *hs = malloc(src_n), *hd = malloc(dst_n);
    for (size_t i = 0; i < src_n; i++) hs[i] = (unsigned char)rand_bits();
    for (size_t i = 0; i < dst_n; i++) hd[i] = (unsigned char)rand_bits();
    dbuf src = dev_from(hs, src_n), dst = k.inplace ? src : dev_from(hd, dst_n);
    unsigned char *want = k.inplace ? hs : hd;
    for (size_t r = 0; r < k.rows; r++)
      memmove(want + k.dst_off + r * k.dpitch, hs + k.src_off + r * k.spitch, k.width);
    for (int s = 0; s < SIDES; s++) {
      ok(ml_be_copy2d(g_be[s], (char *)dst.p[s] + k.dst_off, k.dpitch,
                      (char *)src.p[s] + k.src_off, k.spitch, k.width, k.rows),
         "copy2d", s);
      unsigned char *got = dev_get(&dst, s);
      if (memcmp(got, want, dst_n))
        fail_msg("copy2d case %zu on %s: the destination differs from memmove's", c,
                 side_name(s));
      free(got);
    }
    printf("  copy2d %zu rows x %zu of pitch %zu -> %zu%-10s bitwise equal\n", k.rows, k.width,
           k.spitch, k.dpitch, k.inplace ? " in place" : "");
    dev_free(&src);
    if (!k.inplace) dev_free(&dst);
    free(hs), free(hd);
  }
}

/* zero of an odd byte range inside a buffer: exactly that range cleared. */
static void test_zero(void **state) {
  (void)state;
  const size_t n = 4 * 70001, off = 13, len = 4 * 65536 + 5;
  unsigned char *h = malloc(n);
  for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(rand_bits() | 1);
  dbuf b = dev_from(h, n);
  memset(h + off, 0, len);
  for (int s = 0; s < SIDES; s++) {
    ok(ml_be_zero(g_be[s], (char *)b.p[s] + off, len), "zero", s);
    unsigned char *got = dev_get(&b, s);
    if (memcmp(got, h, n)) fail_msg("zero on %s: other bytes than [%zu, %zu)", side_name(s), off,
                                    off + len);
    free(got);
  }
  printf("  %-44s bitwise equal\n", "zero");
  dev_free(&b), free(h);
}

/* in_use counts the bytes requested (host staging not), peak follows it
 * until reset_peak, reserved covers it and trim gives cached blocks back;
 * count 0 gives valid, distinct pointers. */
static void test_memory_stats(void **state) {
  (void)state;
  for (int s = 0; s < SIDES; s++) {
    ml_backend *be = g_be[s];
    ml_memory_stats s0 = ml_be_memory_stats(be);
    void *p = ml_be_alloc(be, 1000, 3, "a test block");
    assert_non_null(p);
    ml_memory_stats s1 = ml_be_memory_stats(be);
    assert_int_equal(s1.in_use, s0.in_use + 3000);
    assert_true(s1.peak >= s1.in_use && s1.reserved >= s1.in_use);
    ml_be_free(be, p);
    ml_memory_stats s2 = ml_be_memory_stats(be);
    assert_int_equal(s2.in_use, s0.in_use);
    assert_true(s2.peak >= s0.in_use + 3000);
    ml_be_reset_peak(be);
    ml_memory_stats s3 = ml_be_memory_stats(be);
    assert_int_equal(s3.peak, s3.in_use);
    void *z1 = ml_be_alloc(be, 0, 4, "an empty block"), *z2 = ml_be_alloc(be, 0, 4, "another");
    assert_true(z1 && z2 && z1 != z2);
    ml_be_free(be, z1), ml_be_free(be, z2);
    void *h = ml_be_host_alloc(be, 1000, 3, "a staging block");
    assert_non_null(h);
    assert_int_equal(ml_be_memory_stats(be).in_use, s3.in_use); /* staging: not counted */
    ml_be_host_free(be, h);
    ml_be_trim(be);
    ml_memory_stats s4 = ml_be_memory_stats(be);
    assert_true(s4.in_use == s3.in_use && s4.reserved >= s4.in_use && s4.reserved <= s3.reserved);
    printf("  memory stats on %-28s consistent\n", side_name(s));
  }
}

/* ---- conversions --------------------------------------------------------- */

/* fp32 inputs: specials (±0, ±inf, quiet and signalling NaNs with payloads
 * and either sign, the largest finite value, which rounds to inf, the
 * smallest subnormal, ties to even both ways) then random bit patterns. */
static float *conv_inputs(int64_t n) {
  static const uint32_t special[] = {0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000,
                                     0xffc00001, 0x7f800001, 0xff812345, 0x7f7fffff, 0x00000001,
                                     0x3f808000, 0x3f818000, 0x3f80ffff, 0xbf7f8000};
  float *x = malloc(sizeof(float) * (size_t)n);
  for (int64_t i = 0; i < n; i++) {
    uint32_t u = i < (int64_t)(sizeof special / 4) ? special[i] : rand_bits();
    memcpy(&x[i], &u, 4);
  }
  return x;
}

static bool bf16_is_nan(uint16_t h) { return (h & 0x7f80) == 0x7f80 && (h & 0x7f); }

/* F32 -> BF16 (RNE), BF16 -> F32 (all 65536 patterns), F32 -> F32 (a
 * copy, also in place), round_bf16: bitwise equal, NaN stays NaN; round_bf16_to
 * bitwise round_bf16 and the conversion. */
static void test_convert(void **state) {
  (void)state;
  const int64_t n = 65536 + 77;
  float *x = conv_inputs(n);
  dbuf src = dev_from(x, sizeof(float) * (size_t)n), h = dev_new(sizeof(uint16_t) * (size_t)n);
  for (int s = 0; s < SIDES; s++)
    ok(ml_be_convert(g_be[s], h.p[s], ML_BF16, src.p[s], ML_F32, (size_t)n), "convert", s);
  expect_same("convert F32 -> BF16", &h);
  uint16_t *hb = dev_get(&h, GPU);
  for (int64_t i = 0; i < n; i++)
    if (isnan(x[i]) && !bf16_is_nan(hb[i]))
      fail_msg("convert F32 -> BF16: NaN %a became 0x%04x", (double)x[i], hb[i]);
  free(hb);
  /* every bf16 pattern (and a few more) back to fp32 */
  const int64_t nb = 65536 + 5;
  uint16_t *all = malloc(sizeof(uint16_t) * (size_t)nb);
  for (int64_t i = 0; i < nb; i++) all[i] = (uint16_t)i;
  dbuf b16 = dev_from(all, sizeof(uint16_t) * (size_t)nb), f = dev_new(sizeof(float) * nb);
  for (int s = 0; s < SIDES; s++)
    ok(ml_be_convert(g_be[s], f.p[s], ML_F32, b16.p[s], ML_BF16, (size_t)nb), "convert", s);
  expect_same("convert BF16 -> F32 (every pattern)", &f);
  /* the same type: a copy, also onto itself */
  dbuf c = dev_new(src.bytes);
  for (int s = 0; s < SIDES; s++) {
    ok(ml_be_convert(g_be[s], c.p[s], ML_F32, src.p[s], ML_F32, (size_t)n), "convert", s);
    ok(ml_be_convert(g_be[s], c.p[s], ML_F32, c.p[s], ML_F32, (size_t)n), "convert", s);
    float *got = dev_get(&c, s);
    if (memcmp(got, x, src.bytes)) fail_msg("convert F32 -> F32 on %s changed bits", side_name(s));
    free(got);
  }
  /* round_bf16 in place, from an odd offset too */
  for (int s = 0; s < SIDES; s++) {
    ok(ml_be_round_bf16(g_be[s], src.p[s], (size_t)n / 2), "round_bf16", s);
    ok(ml_be_round_bf16(g_be[s], (float *)src.p[s] + n / 2, (size_t)(n - n / 2)), "round", s);
  }
  expect_same("round_bf16", &src);
  float *r = dev_get(&src, GPU);
  for (int64_t i = 0; i < n; i++)
    if (isnan(x[i]) != isnan(r[i])) fail_msg("round_bf16: %a became %a", (double)x[i], r[i]);
  /* round_bf16_to from the unrounded x, from an odd offset too: y bitwise round_bf16's (r), its
   * bf16 copy the conversion's (hb); without the copy; and in place */
  dbuf x2 = dev_from(x, sizeof(float) * (size_t)n), y = dev_new(sizeof(float) * (size_t)n);
  dbuf y16 = dev_new(sizeof(uint16_t) * (size_t)n), y2 = dev_new(sizeof(float) * (size_t)n);
  for (int s = 0; s < SIDES; s++) {
    ok(ml_be_round_bf16_to(g_be[s], x2.p[s], y.p[s], y16.p[s], (size_t)n / 2), "round_to", s);
    ok(ml_be_round_bf16_to(g_be[s], (float *)x2.p[s] + n / 2, (float *)y.p[s] + n / 2,
                           (uint16_t *)y16.p[s] + n / 2, (size_t)(n - n / 2)), "round_to", s);
    ok(ml_be_round_bf16_to(g_be[s], x2.p[s], y2.p[s], NULL, (size_t)n), "round_to", s);
    ok(ml_be_round_bf16_to(g_be[s], x2.p[s], x2.p[s], NULL, (size_t)n), "round_to", s);
  }
  expect_same("round_bf16_to: y", &y);
  expect_same("  its bf16 copy", &y16);
  expect_same("  without the copy", &y2);
  expect_same("  in place", &x2);
  hb = dev_get(&h, GPU);
  for (int s = 0; s < SIDES; s++) {
    float *g = dev_get(&y, s), *g2 = dev_get(&y2, s), *gx = dev_get(&x2, s);
    uint16_t *g16 = dev_get(&y16, s);
    if (memcmp(g, r, src.bytes) || memcmp(g2, r, src.bytes) || memcmp(gx, r, src.bytes))
      fail_msg("round_bf16_to on %s: not round_bf16's values", side_name(s));
    if (memcmp(g16, hb, h.bytes)) fail_msg("round_bf16_to on %s: not the conversion", side_name(s));
    free(g), free(g2), free(gx), free(g16);
  }
  free(r), free(hb);
  dev_free(&x2), dev_free(&y), dev_free(&y16), dev_free(&y2);
  dev_free(&src), dev_free(&h), dev_free(&b16), dev_free(&f), dev_free(&c);
  free(x), free(all);
}

/* ---- gemm ---------------------------------------------------------------- */

typedef struct gemm_case {
  int64_t M, N, K;
  bool ta, tb;
  int64_t pad; /* added to every leading dimension */
  ml_dtype a_type, b_type, bias_type, compute;
  bool bias, acc;
} gemm_case;

/* One operand of `rows` rows stored with leading dimension ld (>= its width), as `type`,
 * uniform in [-1, 1); *val gets the values the GEMM multiplies ([rows, ld]
 * fp32: rounded to bf16 under bf16 compute). */
static dbuf gemm_operand(int64_t rows, int64_t ld, ml_dtype type, ml_dtype compute, float **val) {
  int64_t n = rows * ld > 0 ? rows * ld : 1; /* K = 0: one element, never read */
  float *v = rand_buf(n, 1.0f);
  dbuf b;
  if (type == ML_BF16) {
    uint16_t *h = to_bf16(v, n);
    b = dev_from(h, sizeof(uint16_t) * (size_t)n);
    free(h);
  } else {
    b = dev_from(v, sizeof(float) * (size_t)n);
  }
  for (int64_t i = 0; i < n; i++)
    if (type == ML_BF16 || compute == ML_BF16) v[i] = ml_bf16_to_f32(ml_f32_to_bf16(v[i]));
  *val = v;
  return b;
}

/* C [M, N] of each backend: bound per element (gamma_{k_cpu} +
 * gamma_{k_gpu})·(sum_k |a·b| + |bias| + |C0| when accumulating), k = K + 2
 * roundings (the dot product, the bias, the accumulation: R2), the GPU's
 * dot product on tensor cores under bf16 compute (sum_count); K = 0 is C0
 * + bias, one correctly rounded addition on both: bitwise. Columns N..ldc
 * of C must stay as they were. */
static void gemm_run(const gemm_case *c) {
  int64_t M = c->M, N = c->N, K = c->K;
  int64_t ar = c->ta ? K : M, ac = c->ta ? M : K, br = c->tb ? N : K, bc = c->tb ? K : N;
  int64_t lda = ac + c->pad, ldb = bc + c->pad, ldc = N + c->pad;
  float *av, *bv, *biasv = rand_buf(N, 1.0f), *c0 = rand_buf(M * ldc, 1.0f);
  dbuf A = gemm_operand(ar, lda, c->a_type, c->compute, &av);
  dbuf B = gemm_operand(br, ldb, c->b_type, c->compute, &bv);
  dbuf bias;
  if (c->bias_type == ML_BF16) {
    uint16_t *h = to_bf16(biasv, N);
    bias = dev_from(h, sizeof(uint16_t) * (size_t)N);
    for (int64_t j = 0; j < N; j++) biasv[j] = ml_bf16_to_f32(h[j]);
    free(h);
  } else {
    bias = dev_from(biasv, sizeof(float) * (size_t)N);
  }
  dbuf C = dev_from(c0, sizeof(float) * (size_t)(M * ldc));
  for (int s = 0; s < SIDES; s++) {
    ml_gemm g = {c->ta, c->tb, M, N, K, A.p[s], c->a_type, lda, B.p[s], c->b_type, ldb,
                 C.p[s], ldc, c->acc, c->bias ? bias.p[s] : NULL, c->bias_type, c->compute, false,
                 false, false};
    ok(ml_be_gemm(g_be[s], &g), "gemm", s);
  }
  double kc = (double)K + 2.0, kg = sum_count((double)K, c->compute == ML_BF16) + 2.0;
  double tol = K == 0 ? 0.0 : tol_gamma(kc) + tol_gamma(kg);
  double *bound = dzeros(M * ldc);
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < N; j++) {
      double s = (c->bias ? fabs(biasv[j]) : 0.0) + (c->acc ? fabs(c0[i * ldc + j]) : 0.0);
      for (int64_t k = 0; k < K; k++)
        s += fabs((double)av[c->ta ? k * lda + i : i * lda + k] *
                  bv[c->tb ? j * ldb + k : k * ldb + j]);
      bound[i * ldc + j] = tol * s; /* the padding columns: bound 0, unchanged */
    }
  char what[96];
  snprintf(what, sizeof what, "gemm %lldx%lldx%lld %c%c %s%s%s%s%s", (long long)M, (long long)N,
           (long long)K, c->ta ? 'T' : 'N', c->tb ? 'T' : 'N',
           c->compute == ML_BF16 ? "bf16" : "fp32", c->a_type == ML_BF16 ? " A16" : "",
           c->b_type == ML_BF16 ? " B16" : "",
           c->bias ? (c->bias_type == ML_BF16 ? " bias16" : " bias") : "", c->acc ? " +=" : "");
  expect_close(what, &C, bound, M * ldc);
  float *cc = dev_get(&C, CPU);
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = N; j < ldc; j++)
      if (memcmp(&cc[i * ldc + j], &c0[i * ldc + j], 4)) fail_msg("%s: wrote past N", what);
  free(cc), free(bound), free(av), free(bv), free(biasv), free(c0);
  dev_free(&A), dev_free(&B), dev_free(&bias), dev_free(&C);
}

static void test_gemm(void **state) {
  (void)state;
  /* T = 1 rows, odd sizes, C crossing 2^16 elements, a long inner dim
   * (split-K), and K = 0 (an empty shard of the inner dim) */
  const int64_t shapes[][3] = {{1, 1, 1},      {1, 37, 19},   {7, 13, 5}, {65, 33, 129},
                               {130, 17, 257}, {300, 257, 3}, {3, 5, 5001}, {5, 9, 0}};
  int c = 0;
  for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++)
    for (int t = 0; t < 4; t++)
      for (int bf = 0; bf < 2; bf++, c++) {
        /* operand types, bias, accumulation and padding (0, 1, 5) cycle
         * with different periods, so that each meets every other */
        int pad = (c / 5) % 3;
        gemm_case g = {shapes[sh][0], shapes[sh][1], shapes[sh][2], t & 1, t >> 1,
                       pad == 0 ? 0 : pad == 1 ? 1 : 5, ML_F32, ML_F32, ML_F32,
                       bf ? ML_BF16 : ML_F32, c % 3 != 0, (c / 3) % 2 == 1};
        if (bf) {
          g.a_type = (c / 2) % 2 ? ML_BF16 : ML_F32;
          g.b_type = (c / 4) % 2 ? ML_BF16 : ML_F32;
        }
        g.bias_type = (c / 7) % 2 ? ML_BF16 : ML_F32;
        gemm_run(&g);
      }
  /* compute F32 with a bf16 operand, and a leading dimension below the
   * width, are refused by both, with a message */
  dbuf x = dev_new(64);
  for (int s = 0; s < SIDES; s++) {
    ml_gemm g = {false, false, 2, 2, 2, x.p[s], ML_BF16, 2, x.p[s], ML_F32, 2,
                 x.p[s], 2, false, NULL, ML_F32, ML_F32, false, false, false};
    for (int bad = 0; bad < 2; bad++) {
      if (bad) g.a_type = ML_F32, g.lda = 1;
      if (ml_be_gemm(g_be[s], &g) != -1 || !ml_error_msg()[0])
        fail_msg("gemm on %s accepted %s", side_name(s),
                 bad ? "lda 1 < K 2" : "a bf16 operand under fp32 compute");
      ml_error_clear();
    }
  }
  dev_free(&x);
}

/* db (+=) column sums of dy [T, N]: bias_grad_bounds (cuda/op_bounds.h). */
static void test_bias_grad(void **state) {
  (void)state;
  const int64_t shapes[][2] = {{1, 1}, {7, 13}, {300, 257}, {1000, 67}};
  for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
    int64_t T = shapes[c][0], N = shapes[c][1];
    float *dy = rand_buf(T * N, 1.0f), *db0 = rand_buf(N, 1.0f);
    dbuf d = dev_from(dy, sizeof(float) * (size_t)(T * N)), db = dev_from(db0, 4 * (size_t)N);
    for (int s = 0; s < SIDES; s++) ok(ml_be_bias_grad(g_be[s], d.p[s], T, N, db.p[s]), "db", s);
    double *bound = dzeros(N);
    bias_grad_bounds(dy, T, N, db0, bound);
    char what[64];
    snprintf(what, sizeof what, "bias_grad T=%lld N=%lld (+=)", (long long)T, (long long)N);
    expect_close(what, &db, bound, N);
    free(dy), free(db0), free(bound), dev_free(&d), dev_free(&db);
  }
}

/* y += x and x *= s: one correctly rounded operation each, from aligned and
 * odd offsets: bitwise; so are the add with a bf16 copy of its sums and the
 * add into another buffer (the same sums). */
static void test_add_scale(void **state) {
  (void)state;
  const int64_t sizes[] = {1, 5, 65536 + 2};
  for (size_t c = 0; c < sizeof sizes / sizeof sizes[0]; c++) {
    int64_t n = sizes[c];
    float *x = rand_buf(n, 3.0f), *y = rand_buf(n, 1.0f);
    dbuf dx = dev_from(x, 4 * (size_t)n), dy = dev_from(y, 4 * (size_t)n);
    for (int s = 0; s < SIDES; s++) {
      ok(ml_be_add(g_be[s], dy.p[s], dx.p[s], n), "add", s);
      ok(ml_be_add(g_be[s], (float *)dy.p[s] + 1, (float *)dx.p[s], n - 1), "add", s);
      ok(ml_be_scale(g_be[s], dx.p[s], n, 0.37f), "scale", s);
      ok(ml_be_scale(g_be[s], (float *)dx.p[s] + 1, n - 1, -1.7f), "scale", s);
    }
    char what[64];
    snprintf(what, sizeof what, "add n=%lld", (long long)n);
    expect_same(what, &dy);
    snprintf(what, sizeof what, "scale n=%lld", (long long)n);
    expect_same(what, &dx);
    /* the add with a bf16 copy of the sums: y as the add's, y16 those sums rounded, each side
     * bitwise (CPU = GPU) */
    dbuf by = dev_from(y, 4 * (size_t)n), bx = dev_from(x, 4 * (size_t)n);
    dbuf h = dev_new(2 * (size_t)n);
    for (int s = 0; s < SIDES; s++)
      ok(ml_be_add_bf16(g_be[s], by.p[s], bx.p[s], h.p[s], n), "add bf16", s);
    snprintf(what, sizeof what, "add bf16 n=%lld: y", (long long)n);
    expect_same(what, &by);
    expect_same("  its bf16 copy", &h);
    /* the add into another buffer (and onto x): bitwise the in-place add's sums, each side */
    dbuf tx = dev_from(x, 4 * (size_t)n), ty = dev_from(y, 4 * (size_t)n);
    dbuf tz = dev_new(4 * (size_t)n);
    for (int s = 0; s < SIDES; s++) {
      ok(ml_be_add_to(g_be[s], tz.p[s], ty.p[s], tx.p[s], n), "add_to", s);
      ok(ml_be_add_to(g_be[s], tx.p[s], ty.p[s], tx.p[s], n), "add_to", s);
    }
    snprintf(what, sizeof what, "add_to n=%lld", (long long)n);
    expect_same(what, &tz);
    expect_same("  onto x", &tx);
    for (int s = 0; s < SIDES; s++) {
      float *want = dev_get(&by, s), *got = dev_get(&tz, s), *onto = dev_get(&tx, s);
      if (memcmp(got, want, 4 * (size_t)n) || memcmp(onto, want, 4 * (size_t)n))
        fail_msg("add_to n=%lld on %s: not the add's sums", (long long)n, side_name(s));
      free(want), free(got), free(onto);
    }
    dev_free(&tx), dev_free(&ty), dev_free(&tz);
    free(x), free(y), dev_free(&dx), dev_free(&dy), dev_free(&by), dev_free(&bx), dev_free(&h);
  }
}

/* ---- rmsnorm ------------------------------------------------------------- */

/* Forward and backward (from the same inputs on both: the CPU's rstd)
 * within rmsnorm_fwd_bounds and rmsnorm_bwd_bounds (cuda/op_bounds.h). With
 * y aliasing x and dx aliasing dy (backend.h allows both), each backend
 * repeats its own results bitwise, as does the bf16-output forward rounded. */
static void test_rmsnorm(void **state) {
  (void)state;
  const int64_t shapes[][2] = {{1, 1}, {3, 7}, {5, 64}, {2, 1000}, {70, 1030}};
  const float eps = 1e-6f;
  for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++)
    for (int off = 0; off < 2; off++)
      for (int wb = 0; wb < 2; wb++) {
        int64_t T = shapes[sh][0], H = shapes[sh][1];
        float offset = (float)off;
        bool with_dw = (sh + (size_t)off + (size_t)wb) % 2 == 0;
        float *x = rand_buf(T * H, 2.0f), *w = rand_buf(H, 1.0f), *dy = rand_buf(T * H, 1.0f);
        float *dw0 = rand_buf(H, 1.0f);
        uint16_t *wh = to_bf16(w, H);
        if (wb)
          for (int64_t h = 0; h < H; h++) w[h] = ml_bf16_to_f32(wh[h]);
        ml_dtype wt = wb ? ML_BF16 : ML_F32;
        dbuf dxb = dev_from(x, 4 * (size_t)(T * H)), y = dev_new(4 * (size_t)(T * H));
        dbuf rstd = dev_new(4 * (size_t)T), ddy = dev_from(dy, 4 * (size_t)(T * H));
        dbuf dw = dev_from(dw0, 4 * (size_t)H), dxo = dev_new(4 * (size_t)(T * H));
        dbuf dwt = wb ? dev_from(wh, 2 * (size_t)H) : dev_from(w, 4 * (size_t)H);
        for (int s = 0; s < SIDES; s++)
          ok(ml_be_rmsnorm_fwd(g_be[s], dxb.p[s], dwt.p[s], wt, offset, eps, y.p[s], rstd.p[s],
                               T, H),
             "rmsnorm fwd", s);
        double *by = dzeros(T * H), *br = dzeros(T);
        rmsnorm_fwd_bounds(x, w, offset, eps, T, H, by, br);
        char what[96];
        snprintf(what, sizeof what, "rmsnorm T=%lld H=%lld off=%d %s", (long long)T,
                 (long long)H, off, wb ? "bf16 w" : "f32 w");
        expect_close(what, &y, by, T * H);
        expect_close("  rstd", &rstd, br, T);
        /* the bf16 output: on each backend bitwise its fp32 forward rounded (ml_be_convert), the
         * same rstd */
        dbuf yh = dev_new(2 * (size_t)(T * H)), yr = dev_new(2 * (size_t)(T * H));
        dbuf rh = dev_new(4 * (size_t)T);
        for (int s = 0; s < SIDES; s++) {
          ok(ml_be_rmsnorm_fwd_bf16(g_be[s], dxb.p[s], dwt.p[s], wt, offset, eps, yh.p[s],
                                    rh.p[s], T, H),
             "rmsnorm fwd bf16", s);
          ok(ml_be_convert(g_be[s], yr.p[s], ML_BF16, y.p[s], ML_F32, (size_t)(T * H)), "convert",
             s);
        }
        expect_own("  rmsnorm fwd bf16 = fwd rounded", &yr, &yh);
        expect_own("  rmsnorm fwd bf16's rstd", &rstd, &rh);
        dev_free(&yh), dev_free(&yr), dev_free(&rh);
        /* backward from the CPU's rstd on both */
        float *r = dev_get(&rstd, CPU);
        dev_set(&rstd, r);
        for (int s = 0; s < SIDES; s++)
          ok(ml_be_rmsnorm_bwd(g_be[s], ddy.p[s], dxb.p[s], dwt.p[s], wt, offset, rstd.p[s],
                               dxo.p[s], with_dw ? dw.p[s] : NULL, T, H),
             "rmsnorm bwd", s);
        double *bdx = dzeros(T * H), *bdw = dzeros(H);
        rmsnorm_bwd_bounds(dy, x, w, offset, r, dw0, T, H, bdx, bdw);
        expect_close("  rmsnorm dx", &dxo, bdx, T * H);
        if (with_dw)
          expect_close("  rmsnorm dw (+=)", &dw, bdw, H);
        else
          expect_same("  rmsnorm dw NULL: dw0 untouched", &dw);
        /* dx aliasing dy (dw from dw0 again), then y aliasing x */
        dbuf dw2 = dev_from(dw0, 4 * (size_t)H);
        for (int s = 0; s < SIDES; s++) {
          ok(ml_be_rmsnorm_bwd(g_be[s], ddy.p[s], dxb.p[s], dwt.p[s], wt, offset, rstd.p[s],
                               ddy.p[s], with_dw ? dw2.p[s] : NULL, T, H),
             "rmsnorm bwd in place", s);
          ok(ml_be_rmsnorm_fwd(g_be[s], dxb.p[s], dwt.p[s], wt, offset, eps, dxb.p[s],
                               rstd.p[s], T, H),
             "rmsnorm fwd in place", s);
        }
        expect_own("  rmsnorm bwd, dx aliasing dy", &dxo, &ddy);
        expect_own("  rmsnorm bwd, dw with dx aliasing dy", &dw, &dw2);
        expect_own("  rmsnorm fwd, y aliasing x", &y, &dxb);
        dev_free(&dw2);
        free(x), free(w), free(dy), free(dw0), free(wh), free(by), free(br), free(r);
        free(bdx), free(bdw);
        dev_free(&dxb), dev_free(&y), dev_free(&rstd), dev_free(&ddy), dev_free(&dw);
        dev_free(&dxo), dev_free(&dwt);
      }
}

/* ---- rope ---------------------------------------------------------------- */

/* Tables: bitwise (the CUDA backend computes them with the CPU's code and
 * copies them up, cuda.c). Rotation from the same tables, forward and
 * backward: rope_bounds (cuda/op_bounds.h). */
static void test_rope(void **state) {
  (void)state;
  static const ml_rope_scaling scs[] = {
      {.type = ML_ROPE_DEFAULT},
      {.type = ML_ROPE_LINEAR, .factor = 4.0},
      {.type = ML_ROPE_LLAMA3, .factor = 8.0, .low_freq_factor = 1.0, .high_freq_factor = 4.0,
       .original_max_positions = 8192.0},
      /* an attention factor (0.1 ln 4 + 1) scales the tables */
      {.type = ML_ROPE_YARN, .factor = 4.0, .original_max_positions = 16.0,
       .max_positions = 64.0, .truncate = true}};
  static const char *names[] = {"default", "linear", "llama3", "yarn"};
  const double thetas[] = {10000.0, 1e6, 500000.0, 10000.0};
  const int64_t dims[][3] = {{1, 1, 64}, {2, 37, 72}, {2, 300, 72}, {3, 5, 6}, {1, 130, 256}};
  for (int sc = 0; sc < 4; sc++)
    for (size_t d = 0; d < sizeof dims / sizeof dims[0]; d++) {
      int64_t B = dims[d][0], S = dims[d][1], hd = dims[d][2], nh = 3, half = hd / 2;
      dbuf cs = dev_new(4 * (size_t)(S * half)), sn = dev_new(4 * (size_t)(S * half));
      for (int s = 0; s < SIDES; s++)
        ok(ml_be_rope_tables(g_be[s], thetas[sc], hd, &scs[sc], S, S, cs.p[s], sn.p[s]), "rope", s);
      char what[96];
      snprintf(what, sizeof what, "rope tables %s S=%lld hd=%lld",
               names[sc], (long long)S, (long long)hd);
      expect_same(what, &cs);
      expect_same("  rope sin table", &sn);
      float *ct = dev_get(&cs, CPU), *st = dev_get(&sn, CPU);
      int64_t n = B * S * nh * hd;
      float *x = rand_buf(n, 2.0f);
      dbuf fx = dev_from(x, 4 * (size_t)n), bx = dev_from(x, 4 * (size_t)n);
      for (int s = 0; s < SIDES; s++) {
        ok(ml_be_rope_fwd(g_be[s], fx.p[s], cs.p[s], sn.p[s], B, S, nh, hd), "rope fwd", s);
        ok(ml_be_rope_bwd(g_be[s], bx.p[s], cs.p[s], sn.p[s], B, S, nh, hd), "rope bwd", s);
      }
      double *bound = dzeros(n);
      rope_bounds(x, ct, st, B, S, nh, hd, bound);
      expect_close("  rope fwd", &fx, bound, n);
      expect_close("  rope bwd", &bx, bound, n);
      /* the bf16 output: on each backend bitwise its fp32 forward rounded (ml_be_convert) */
      dbuf hx = dev_from(x, 4 * (size_t)n), yh = dev_new(2 * (size_t)n);
      dbuf yr = dev_new(2 * (size_t)n);
      for (int s = 0; s < SIDES; s++) {
        ok(ml_be_rope_fwd_bf16(g_be[s], hx.p[s], yh.p[s], cs.p[s], sn.p[s], B, S, nh, hd),
           "rope fwd bf16", s);
        ok(ml_be_convert(g_be[s], yr.p[s], ML_BF16, fx.p[s], ML_F32, (size_t)n), "convert", s);
      }
      expect_own("  rope fwd bf16 = fwd rounded", &yr, &yh);
      free(ct), free(st), free(x), free(bound);
      dev_free(&cs), dev_free(&sn), dev_free(&fx), dev_free(&bx);
      dev_free(&hx), dev_free(&yh), dev_free(&yr);
    }
}

/* ---- attention ----------------------------------------------------------- */

typedef struct attn_case {
  int64_t B, S, nh, nkv, hd, window;
} attn_case;

/* Bounds on |cuda − cpu| for out, dq, dk, dv: attn_bound (cuda/attn_bound.h
 * derives it; its lse bound is not used here). */

/* Forward and backward on both backends, each with its own saved and work
 * sizes, the backward given that backend's out and saved; dq, dk, dv
 * prefilled (=, not +=). */
static void attn_run(const attn_case *c, bool bf16) {
  int64_t B = c->B, S = c->S, nh = c->nh, nkv = c->nkv, hd = c->hd;
  int64_t nq = B * S * nh * hd, nk = B * S * nkv * hd;
  float scale = 1.0f / sqrtf((float)hd);
  ml_dtype compute = bf16 ? ML_BF16 : ML_F32;
  float *q = rand_buf(nq, 1.0f), *k = rand_buf(nk, 1.0f), *v = rand_buf(nk, 1.0f);
  float *dout = rand_buf(nq, 1.0f), *fill = const_buf(nq, 9.0f);
  dbuf dq_ = dev_from(q, 4 * (size_t)nq), dk_ = dev_from(k, 4 * (size_t)nk);
  dbuf dv_ = dev_from(v, 4 * (size_t)nk), ddo = dev_from(dout, 4 * (size_t)nq);
  dbuf out = dev_new(4 * (size_t)nq), gq = dev_from(fill, 4 * (size_t)nq);
  dbuf gk = dev_from(fill, 4 * (size_t)nk), gv = dev_from(fill, 4 * (size_t)nk);
  for (int s = 0; s < SIDES; s++) {
    ml_backend *be = g_be[s];
    int64_t ns = ml_be_attention_saved(be, B, S, nh);
    size_t nw = ml_be_attention_work(be, B, S, nh, nkv, hd);
    float *saved = ml_be_alloc(be, ns, sizeof(float), "attention saved");
    void *work = ml_be_alloc(be, (int64_t)nw, 1, "attention work");
    if (!saved || !work) fail_msg("%s: %s", side_name(s), ml_error_msg());
    ok(ml_be_attention_fwd(be, dq_.p[s], dk_.p[s], dv_.p[s], out.p[s], saved, B, S, nh, nkv, hd,
                           scale, c->window, compute),
       "attention fwd", s);
    ok(ml_be_attention_bwd(be, ddo.p[s], dq_.p[s], dk_.p[s], dv_.p[s], out.p[s], saved, gq.p[s],
                           gk.p[s], gv.p[s], B, S, nh, nkv, hd, scale, c->window, compute, work),
       "attention bwd", s);
    ml_be_free(be, saved), ml_be_free(be, work);
  }
  /* the bounds on the operands as the products read them */
  float *qr = bf16 ? bf16_rounded(q, nq) : q, *kr = bf16 ? bf16_rounded(k, nk) : k;
  float *vr = bf16 ? bf16_rounded(v, nk) : v, *dor = bf16 ? bf16_rounded(dout, nq) : dout;
  attn_bounds bd = attn_bound(B, S, nh, nkv, hd, c->window, qr, kr, vr, dor, scale, bf16);
  if (bf16) free(qr), free(kr), free(vr), free(dor);
  char what[112];
  snprintf(what, sizeof what, "attention %s B=%lld S=%lld nh=%lld nkv=%lld hd=%lld w=%lld out",
           bf16 ? "bf16" : "fp32", (long long)B, (long long)S, (long long)nh, (long long)nkv,
           (long long)hd, (long long)c->window);
  expect_close(what, &out, bd.out, nq);
  expect_close("  attention dq", &gq, bd.dq, nq);
  expect_close("  attention dk (=)", &gk, bd.dk, nk);
  expect_close("  attention dv (=)", &gv, bd.dv, nk);
  attn_bounds_free(&bd);
  free(q), free(k), free(v), free(dout), free(fill);
  dev_free(&dq_), dev_free(&dk_), dev_free(&dv_), dev_free(&ddo), dev_free(&out);
  dev_free(&gq), dev_free(&gk), dev_free(&gv);
}

/* Causal and windowed (a window below 64 and one above), GQA ratios 1, 3
 * and 4, head dims 64, 128, 256 and 72, S not a multiple of 64, S = 1. */
static void test_attention(void **state) {
  (void)state;
  const attn_case cases[] = {
      {2, 77, 3, 1, 64, 0},   {1, 130, 4, 1, 128, 0}, {1, 70, 2, 2, 256, 0},
      {2, 45, 6, 2, 72, 0},   {1, 100, 4, 4, 64, 17}, {1, 200, 4, 1, 64, 90},
      {3, 1, 3, 1, 64, 0},    {1, 33, 3, 3, 72, 5},   {1, 1, 4, 4, 256, 1},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
    for (int bf = 0; bf < 2; bf++) attn_run(&cases[c], bf);
}

/* bf16 q, k, v (ml_attn_block.qkv_bf16: ml_model_bf16_qkv's attention) on
 * each backend: block attention over whole sequences with bf16 products, a
 * bf16 out in every other case (ml_model_bf16_att), given q, k, v in bf16
 * and given fp32 q, k, v holding the same values: out, lse, dq, dk, dv
 * bitwise the same (the products read the same operands). */
static void test_attention_bf16_qkv(void **state) {
  (void)state;
  const attn_case cases[] = {{2, 77, 3, 1, 64, 0}, {1, 130, 4, 1, 128, 0}, {2, 45, 6, 2, 72, 0},
                             {1, 200, 4, 1, 64, 90}, {3, 1, 3, 1, 64, 0}, {1, 70, 2, 2, 256, 0}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    const attn_case *a = &cases[c];
    int64_t B = a->B, S = a->S, nh = a->nh, nkv = a->nkv, hd = a->hd;
    int64_t nq = B * S * nh * hd, nk = B * S * nkv * hd, nl = B * S * nh;
    ml_attn_block blk = {.B = B, .sq = S, .sk = S, .nh = nh, .nkv = nkv, .hd = hd,
                         .q_bs = S * nh * hd, .k_bs = S * nkv * hd, .l_bs = S * nh,
                         .scale = 1.0f / sqrtf((float)hd), .window = a->window,
                         .out_bf16 = c % 2 == 1};
    ml_attn_block bq = blk;
    bq.qkv_bf16 = true;
    float *x[3] = {rand_buf(nq, 1.0f), rand_buf(nk, 1.0f), rand_buf(nk, 1.0f)};
    float *dout = rand_buf(nq, 1.0f);
    dbuf f[3], h[3], o[2], l[2], g[2][3];
    int64_t n3[3] = {nq, nk, nk};
    for (int t = 0; t < 3; t++) {
      uint16_t *xh = to_bf16(x[t], n3[t]);
      float *xr = bf16_rounded(x[t], n3[t]);
      f[t] = dev_from(xr, 4 * (size_t)n3[t]), h[t] = dev_from(xh, 2 * (size_t)n3[t]);
      free(xh), free(xr);
    }
    dbuf ddo = dev_from(dout, 4 * (size_t)nq);
    for (int r = 0; r < 2; r++) {
      o[r] = dev_new((blk.out_bf16 ? 2 : 4) * (size_t)nq), l[r] = dev_new(4 * (size_t)nl);
      for (int t = 0; t < 3; t++) {
        g[r][t] = dev_new(4 * (size_t)n3[t]);
        for (int s = 0; s < SIDES; s++)
          ok(ml_be_zero(g_be[s], g[r][t].p[s], g[r][t].bytes), "zero", s);
      }
    }
    for (int s = 0; s < SIDES; s++) {
      ml_backend *be = g_be[s];
      void *work = ml_be_alloc(be, (int64_t)ml_be_attention_block_work(be, &blk), 1, "work");
      if (!work) fail_msg("%s: %s", side_name(s), ml_error_msg());
      for (int r = 0; r < 2; r++) { /* r 0: fp32 q, k, v of bf16 values; 1: bf16 */
        const dbuf *in = r ? h : f;
        ok(ml_be_attention_block_fwd(be, r ? &bq : &blk, in[0].p[s], in[1].p[s], in[2].p[s],
                                     o[r].p[s], l[r].p[s], false, ML_BF16),
           "block attention fwd", s);
        ok(ml_be_attention_block_bwd(be, r ? &bq : &blk, ddo.p[s], in[0].p[s], in[1].p[s],
                                     in[2].p[s], o[r].p[s], l[r].p[s], g[r][0].p[s], g[r][1].p[s],
                                     g[r][2].p[s], ML_BF16, work),
           "block attention bwd", s);
      }
      ml_be_free(be, work);
    }
    printf("  bf16 q, k, v B=%lld S=%lld nh=%lld nkv=%lld hd=%lld w=%lld%s\n", (long long)B,
           (long long)S, (long long)nh, (long long)nkv, (long long)hd, (long long)a->window,
           blk.out_bf16 ? " (bf16 out)" : "");
    expect_own("  out", &o[0], &o[1]);
    expect_own("  lse", &l[0], &l[1]);
    expect_own("  dq", &g[0][0], &g[1][0]);
    expect_own("  dk", &g[0][1], &g[1][1]);
    expect_own("  dv", &g[0][2], &g[1][2]);
    for (int t = 0; t < 3; t++) free(x[t]), dev_free(&f[t]), dev_free(&h[t]);
    for (int r = 0; r < 2; r++) {
      dev_free(&o[r]), dev_free(&l[r]);
      for (int t = 0; t < 3; t++) dev_free(&g[r][t]);
    }
    free(dout), dev_free(&ddo);
  }
}

/* ---- gated activation ---------------------------------------------------- */

/* h, dg, du within glu_bounds (cuda/op_bounds.h: tolerance.h §1 GLU). */
static void test_glu(void **state) {
  (void)state;
  const int64_t sizes[] = {1, 7, 65536 + 3};
  for (int act = 0; act < 2; act++)
    for (size_t c = 0; c < sizeof sizes / sizeof sizes[0]; c++) {
      int64_t n = sizes[c];
      ml_glu_act a = act ? ML_GLU_GELU_TANH : ML_GLU_SILU;
      float *g = rand_buf(n, 8.0f), *u = rand_buf(n, 1.0f), *dh = rand_buf(n, 1.0f);
      dbuf G = dev_from(g, 4 * (size_t)n), U = dev_from(u, 4 * (size_t)n);
      dbuf DH = dev_from(dh, 4 * (size_t)n), H = dev_new(4 * (size_t)n);
      dbuf DG = dev_new(4 * (size_t)n), DU = dev_new(4 * (size_t)n);
      for (int s = 0; s < SIDES; s++) {
        ok(ml_be_glu_fwd(g_be[s], G.p[s], U.p[s], H.p[s], n, a), "glu fwd", s);
        ok(ml_be_glu_bwd(g_be[s], DH.p[s], G.p[s], U.p[s], DG.p[s], DU.p[s], n, a), "glu bwd", s);
      }
      double *bh = dzeros(n), *bg = dzeros(n), *bu = dzeros(n);
      glu_bounds(g, u, dh, n, a != ML_GLU_SILU, bh, bg, bu);
      char what[64];
      snprintf(what, sizeof what, "glu %s n=%lld h", act ? "gelu_tanh" : "silu", (long long)n);
      expect_close(what, &H, bh, n);
      expect_close("  glu dg", &DG, bg, n);
      expect_close("  glu du", &DU, bu, n);
      free(g), free(u), free(dh), free(bh), free(bg), free(bu);
      dev_free(&G), dev_free(&U), dev_free(&DH), dev_free(&H), dev_free(&DG), dev_free(&DU);
    }
}

/* ---- embedding ----------------------------------------------------------- */

/* Forward: scale·W[id − row0] is one product (or 0): bitwise. Backward
 * (+=): emb_bwd_sums, emb_bwd_bound (cuda/op_bounds.h). */
static void test_embedding(void **state) {
  (void)state;
  const int64_t row0 = 20, rows = 50, Hs[] = {1, 7, 260}, T = 300;
  const float scale = 2.5f;
  int32_t *ids = malloc(sizeof(int32_t) * T);
  for (int64_t t = 0; t < T; t++) {
    uint32_t r = rand_bits() % 100;
    /* ids outside [row0, row0 + rows) below, above and −1; repeats (few
     * distinct ids in range) */
    ids[t] = r < 10 ? -1 : r < 20 ? (int32_t)(rand_bits() % row0)
                   : r < 30 ? (int32_t)(row0 + rows + rand_bits() % 1000)
                            : (int32_t)(row0 + rand_bits() % 12);
  }
  dbuf did = dev_from(ids, sizeof(int32_t) * T);
  for (size_t hc = 0; hc < sizeof Hs / sizeof Hs[0]; hc++)
    for (int wb = 0; wb < 2; wb++) {
      int64_t H = Hs[hc];
      float *W = rand_buf(rows * H, 1.0f), *dout = rand_buf(T * H, 1.0f);
      float *dW0 = rand_buf(rows * H, 1.0f), *junk = malloc(sizeof(float) * (size_t)(T * H));
      for (int64_t i = 0; i < T * H; i++) junk[i] = NAN;
      uint16_t *Wh = to_bf16(W, rows * H);
      dbuf dw = wb ? dev_from(Wh, 2 * (size_t)(rows * H)) : dev_from(W, 4 * (size_t)(rows * H));
      dbuf out = dev_from(junk, 4 * (size_t)(T * H)), dd = dev_from(dout, 4 * (size_t)(T * H));
      dbuf dW = dev_from(dW0, 4 * (size_t)(rows * H));
      for (int s = 0; s < SIDES; s++) {
        ok(ml_be_embedding_fwd(g_be[s], did.p[s], T, dw.p[s], wb ? ML_BF16 : ML_F32, row0, rows,
                               H, scale, out.p[s]),
           "embedding fwd", s);
        ok(ml_be_embedding_bwd(g_be[s], did.p[s], T, dd.p[s], row0, rows, H, scale, dW.p[s]),
           "embedding bwd", s);
      }
      char what[64];
      snprintf(what, sizeof what, "embedding fwd H=%lld %s", (long long)H, wb ? "bf16" : "f32");
      expect_same(what, &out);
      double *bound = dzeros(rows * H);
      int64_t *cnt = calloc((size_t)rows, sizeof(int64_t));
      emb_bwd_sums(ids, T, dout, row0, rows, H, scale, bound, cnt);
      for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < H; h++)
          bound[r * H + h] = emb_bwd_bound(cnt[r], fabs(dW0[r * H + h]) + bound[r * H + h]);
      expect_close("  embedding bwd (+=, repeated ids)", &dW, bound, rows * H);
      free(W), free(dout), free(dW0), free(junk), free(Wh), free(bound), free(cnt);
      dev_free(&dw), dev_free(&out), dev_free(&dd), dev_free(&dW);
    }
  dev_free(&did), free(ids);
}

/* ---- cross-entropy ------------------------------------------------------- */

/* ml_be_xent_logprobs on side s with scale 0.5, its sums [2] in that side's
 * device memory starting from h (host) and copied back into h. */
static int xent_logprobs_sums(int s, const void *se, const void *tl, const void *y, int64_t T,
                              void *lp, void *w, double h[2]) {
  double *d = ml_be_alloc(g_be[s], 2, sizeof(double), "the loss sums");
  int rc = !d || ml_be_copy(g_be[s], d, h, 2 * sizeof(double), ML_COPY_H2D) ||
           ml_be_xent_logprobs(g_be[s], se, tl, y, T, 0.5f, lp, w, d) ||
           ml_be_copy(g_be[s], h, d, 2 * sizeof(double), ML_COPY_D2H);
  ml_be_free(g_be[s], d);
  return rc ? -1 : 0;
}

/* The shard [v0, v0 + V) of a vocabulary; targets in it, outside it on
 * both sides, and −1. Bounds: xent_se_bounds, xent_logprob_bounds,
 * xent_bwd_bounds (cuda/op_bounds.h); with logprobs NULL, each backend's own
 * sums again. */
static void test_xent(void **state) {
  (void)state;
  const int64_t Vs[] = {5, 1000, 70001}, T = 7, v0 = 100;
  for (size_t c = 0; c < sizeof Vs / sizeof Vs[0]; c++) {
    int64_t V = Vs[c], n = T * V;
    int32_t y[7] = {(int32_t)v0, (int32_t)(v0 + V - 1), -1, (int32_t)(v0 + V / 2), 3,
                    (int32_t)(v0 + V + 7), (int32_t)(v0 + 1)};
    float *lg = rand_buf(n, 6.0f);
    dbuf L = dev_from(lg, 4 * (size_t)n), Y = dev_from(y, sizeof y), MX = dev_new(4 * T);
    dbuf SE = dev_new(4 * T), TL = dev_new(4 * T), LP = dev_new(4 * T), W = dev_new(4 * T);
    for (int s = 0; s < SIDES; s++) ok(ml_be_xent_rowmax(g_be[s], L.p[s], T, V, MX.p[s]), "mx", s);
    char what[64];
    snprintf(what, sizeof what, "xent rowmax V=%lld", (long long)V);
    expect_same(what, &MX);
    float *mx = dev_get(&MX, CPU);
    for (int s = 0; s < SIDES; s++)
      ok(ml_be_xent_sumexp_target(g_be[s], L.p[s], T, V, v0, Y.p[s], MX.p[s], SE.p[s], TL.p[s]),
         "sumexp", s);
    expect_same("  xent target logit", &TL);
    double bse[7], blp[7];
    xent_se_bounds(lg, T, V, mx, bse);
    expect_close("  xent sum of exponentials", &SE, bse, T);
    float *se = dev_get(&SE, CPU), *tl = dev_get(&TL, CPU);
    dev_set(&SE, se);
    double loss[SIDES];
    int64_t count[SIDES];
    for (int s = 0; s < SIDES; s++) { /* the sums accumulate in device memory */
      double h[2] = {1.25, 3.0};
      ok(xent_logprobs_sums(s, SE.p[s], TL.p[s], Y.p[s], T, LP.p[s], W.p[s], h), "logprobs", s);
      loss[s] = h[0], count[s] = (int64_t)h[1];
    }
    double loss_b = xent_logprob_bounds(se, tl, y, T, 1.25, blp);
    expect_close("  xent log-probs", &LP, blp, T);
    expect_same("  xent weights", &W);
    printf("  %-44s |diff| %.3g, bound %.3g; count %lld, %lld\n", "xent loss_sum (host)",
           fabs(loss[GPU] - loss[CPU]), loss_b, (long long)count[GPU], (long long)count[CPU]);
    assert_true(fabs(loss[GPU] - loss[CPU]) <= loss_b);
    assert_int_equal(count[GPU], count[CPU]);
    int64_t targets = 0; /* y >= 0, in this shard or not: global targets */
    for (int64_t t = 0; t < T; t++) targets += y[t] >= 0;
    assert_int_equal(count[CPU], 3 + targets);
    /* without the log-probs (NULL): each backend's own sums and weights */
    for (int s = 0; s < SIDES; s++) {
      double h[2] = {1.25, 3.0};
      ok(xent_logprobs_sums(s, SE.p[s], TL.p[s], Y.p[s], T, NULL, W.p[s], h), "logprobs", s);
      double l2 = h[0];
      int64_t c2 = (int64_t)h[1];
      if (l2 != loss[s] || c2 != count[s])
        fail_msg("xent logprobs NULL on %s: loss_sum %.17g, count %lld; with them %.17g, %lld",
                 side_name(s), l2, (long long)c2, loss[s], (long long)count[s]);
    }
    expect_same("  xent weights (log-probs NULL)", &W);
    float *w = dev_get(&W, CPU);
    /* backward, in place on the logits (dlogits may alias them) */
    for (int s = 0; s < SIDES; s++)
      ok(ml_be_xent_bwd(g_be[s], L.p[s], T, V, v0, Y.p[s], MX.p[s], SE.p[s], W.p[s], L.p[s]),
         "xent bwd", s);
    double *bd = dzeros(n);
    xent_bwd_bounds(lg, T, V, v0, y, mx, se, w, bd);
    expect_close("  xent bwd (in place)", &L, bd, n);
    free(lg), free(mx), free(se), free(tl), free(w), free(bd);
    dev_free(&L), dev_free(&Y), dev_free(&MX), dev_free(&SE), dev_free(&TL), dev_free(&LP);
    dev_free(&W);
  }
}

/* ---- AdamW --------------------------------------------------------------- */

/* Four steps from the same state with the same gradients (some near eps,
 * where the update is ill-conditioned): both backends within the bounds
 * tolerance.h §5 carries along the exact trajectory in double
 * (tol_adamw_step), so within twice them of each other after every step. */
static void test_adamw(void **state) {
  (void)state;
  const int64_t sizes[] = {1, 5, 70001};
  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1;
  for (size_t c = 0; c < sizeof sizes / sizeof sizes[0]; c++) {
    int64_t n = sizes[c];
    float *p = rand_buf(n, 1.0f), *zero = const_buf(n, 0.0f);
    tol_adamw *ex = malloc(sizeof(tol_adamw) * (size_t)n);
    for (int64_t i = 0; i < n; i++) ex[i] = (tol_adamw){p[i], 0, 0, 0, 0, 0};
    dbuf P = dev_from(p, 4 * (size_t)n), M = dev_from(zero, 4 * (size_t)n);
    dbuf Vv = dev_from(zero, 4 * (size_t)n), G = dev_new(4 * (size_t)n);
    double *bp = dzeros(n), *bm = dzeros(n), *bv = dzeros(n);
    for (int64_t step = 1; step <= 4; step++) {
      float *g = rand_buf(n, 1e-2f);
      for (int64_t i = 0; i < n; i += 7) g[i] *= 1e-6f; /* |g| ~ eps */
      dev_set(&G, g);
      for (int s = 0; s < SIDES; s++)
        ok(ml_be_adamw(g_be[s], P.p[s], G.p[s], M.p[s], Vv.p[s], NULL, n, 1.0f, lr, b1, b2, eps,
                       wd, step),
           "adamw", s);
      for (int64_t i = 0; i < n; i++) {
        ex[i] = tol_adamw_step(ex[i], g[i], lr, b1, b2, eps, wd, (double)step);
        bp[i] = 2.0 * ex[i].bp, bm[i] = 2.0 * ex[i].bm, bv[i] = 2.0 * ex[i].bv;
      }
      char what[64];
      snprintf(what, sizeof what, "adamw n=%lld step %lld p", (long long)n, (long long)step);
      expect_close(what, &P, bp, n);
      expect_close("  adamw exp_avg", &M, bm, n);
      expect_close("  adamw exp_avg_sq", &Vv, bv, n);
      free(g);
    }
    free(p), free(zero), free(ex), free(bp), free(bm), free(bv);
    dev_free(&P), dev_free(&M), dev_free(&Vv), dev_free(&G);
  }
}

/* ---- norms and non-finite search ----------------------------------------- */

/* SUMSQ: fp64 sums of the exact squares, any order: 2·gamma64_n·sum g²
 * between them. ABSMAX: exact, equal to max |g| on the host; a NaN gives
 * +inf on both. An empty shard (a rank's empty torch.chunk): 0 for both. */
static void test_norm_partial(void **state) {
  (void)state;
  dbuf E = dev_new(0);
  for (int s = 0; s < SIDES; s++) {
    double o[2] = {-1.0, -1.0};
    ok(ml_be_norm_partial(g_be[s], E.p[s], 0, ML_NORM_SUMSQ, &o[0]), "sumsq", s);
    ok(ml_be_norm_partial(g_be[s], E.p[s], 0, ML_NORM_ABSMAX, &o[1]), "absmax", s);
    if (o[0] != 0.0 || o[1] != 0.0)
      fail_msg("norm_partial of nothing on %s: sumsq %g, absmax %g", side_name(s), o[0], o[1]);
  }
  dev_free(&E);
  const int64_t sizes[] = {1, 1000, 70001};
  for (size_t c = 0; c < sizeof sizes / sizeof sizes[0]; c++) {
    int64_t n = sizes[c];
    float *g = rand_buf(n, 3.0f);
    double ss = 0, mx = 0, out[SIDES][2];
    for (int64_t i = 0; i < n; i++) ss += (double)g[i] * g[i], mx = fmax(mx, fabs(g[i]));
    dbuf G = dev_from(g, 4 * (size_t)n);
    for (int s = 0; s < SIDES; s++) {
      ok(ml_be_norm_partial(g_be[s], G.p[s], n, ML_NORM_SUMSQ, &out[s][0]), "sumsq", s);
      ok(ml_be_norm_partial(g_be[s], G.p[s], n, ML_NORM_ABSMAX, &out[s][1]), "absmax", s);
    }
    double b = 2.0 * tol_gamma64((double)n) * ss;
    printf("  norm_partial n=%-30lld sumsq |diff| %.3g (bound %.3g), absmax %s\n", (long long)n,
           fabs(out[GPU][0] - out[CPU][0]), b, out[GPU][1] == mx ? "equal" : "DIFFERENT");
    assert_true(fabs(out[GPU][0] - out[CPU][0]) <= b);
    assert_true(out[GPU][1] == mx && out[CPU][1] == mx);
    g[n / 2] = NAN;
    dev_set(&G, g);
    for (int s = 0; s < SIDES; s++) {
      ok(ml_be_norm_partial(g_be[s], G.p[s], n, ML_NORM_ABSMAX, &out[s][1]), "absmax", s);
      assert_true(isinf(out[s][1]) && out[s][1] > 0);
    }
    free(g), dev_free(&G);
  }
}

/* The partials of many pieces left on the device (ml_be_norm_partials):
 * on each backend bitwise its own ml_be_norm_partial of each piece; 40
 * pieces of one buffer (more than kc_norm_segs' 32 per launch pair, empty
 * ones among them, one holding a NaN). */
static void test_norm_partials(void **state) {
  (void)state;
  enum { K = 40 };
  int64_t at[K], len[K], n = 0;
  for (int k = 0; k < K; k++) {
    at[k] = n;
    len[k] = k % 7 == 3 ? 0 : k == 5 ? 70001 : (k * 37) % 301 + 1;
    n += len[k];
  }
  float *g = rand_buf(n, 3.0f);
  g[at[6] + 1] = NAN;
  dbuf G = dev_from(g, 4 * (size_t)n), O = dev_new(sizeof(double) * K);
  for (int kind = 0; kind < 2; kind++) {
    ml_norm_kind nk = kind ? ML_NORM_ABSMAX : ML_NORM_SUMSQ;
    for (int s = 0; s < SIDES; s++) {
      ml_norm_seg seg[K];
      double want[K];
      for (int k = 0; k < K; k++) {
        seg[k] = (ml_norm_seg){(const float *)G.p[s] + at[k], len[k]};
        ok(ml_be_norm_partial(g_be[s], seg[k].g, len[k], nk, &want[k]), "norm_partial", s);
      }
      ok(ml_be_norm_partials(g_be[s], seg, K, nk, O.p[s]), "norm_partials", s);
      double *got = dev_get(&O, s);
      bool same = !memcmp(got, want, sizeof want);
      free(got);
      printf("  norm_partials %s of %d pieces on %-12s %s\n", kind ? "absmax" : "sumsq", K,
             side_name(s), same ? "bitwise its norm_partial's" : "DIFFERENT");
      assert_true(same);
    }
  }
  free(g), dev_free(&G), dev_free(&O);
}

/* ±inf, NaN (first, middle, last element) or none: the same answer; an
 * empty buffer holds none. */
static void test_find_nonfinite(void **state) {
  (void)state;
  dbuf E = dev_new(0);
  for (int s = 0; s < SIDES; s++) {
    bool found = true;
    ok(ml_be_find_nonfinite(g_be[s], E.p[s], 0, &found), "find_nonfinite", s);
    if (found) fail_msg("find_nonfinite of nothing on %s: found", side_name(s));
  }
  dev_free(&E);
  const int64_t sizes[] = {1, 65536 + 5};
  for (size_t c = 0; c < sizeof sizes / sizeof sizes[0]; c++) {
    int64_t n = sizes[c];
    for (int k = 0; k < 4; k++) {
      float *g = rand_buf(n, 1e30f);
      const float bad[] = {0, INFINITY, -INFINITY, NAN};
      int64_t at[] = {0, n - 1, 0, n / 2};
      if (k) g[at[k]] = bad[k];
      dbuf G = dev_from(g, 4 * (size_t)n);
      for (int s = 0; s < SIDES; s++) {
        bool found = !k;
        ok(ml_be_find_nonfinite(g_be[s], G.p[s], n, &found), "find_nonfinite", s);
        if (found != (k != 0))
          fail_msg("find_nonfinite n=%lld case %d on %s: %d", (long long)n, k, side_name(s),
                   found);
      }
      free(g), dev_free(&G);
    }
    printf("  find_nonfinite n=%-27lld +inf, -inf, NaN, none: equal\n", (long long)n);
  }
}

int main(void) {
  if (ml_backend_get("cuda", 0, &g_be[GPU])) {
    printf("skipped: no GPU (%s)\n", ml_error_msg());
    return 77;
  }
  if (ml_backend_get("cpu", 0, &g_be[CPU])) {
    fprintf(stderr, "cpu backend: %s\n", ml_error_msg());
    return 1;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_copy),         cmocka_unit_test(test_copy2d),
      cmocka_unit_test(test_zero),         cmocka_unit_test(test_memory_stats),
      cmocka_unit_test(test_convert),      cmocka_unit_test(test_gemm),
      cmocka_unit_test(test_bias_grad),    cmocka_unit_test(test_add_scale),
      cmocka_unit_test(test_rmsnorm),      cmocka_unit_test(test_rope),
      cmocka_unit_test(test_attention),    cmocka_unit_test(test_attention_bf16_qkv),
      cmocka_unit_test(test_glu),
      cmocka_unit_test(test_embedding),    cmocka_unit_test(test_xent),
      cmocka_unit_test(test_adamw),        cmocka_unit_test(test_norm_partial),
      cmocka_unit_test(test_norm_partials),
      cmocka_unit_test(test_find_nonfinite),
  };
  int rc = cmocka_run_group_tests(tests, NULL, NULL);
  ml_backend_release_all();
  return rc;
}
