/* expf over arrays, 16 lanes at a time on AVX-512 CPUs, with the results of
 * glibc's scalar expf bit for bit, so that a kernel which moves its expf
 * calls here computes what it computed before.
 *
 * glibc (2.28 and later, sysdeps/ieee754/flt-32/e_expf.c; on x86-64 the
 * FMA build __expf_fma, which its ifunc picks on every AVX-512 CPU)
 * evaluates exp(x) = 2^(k/32) · 2^(r/32) in double: z = x·32/ln2 rounded
 * to the integer k by adding 1.5·2^52, r = z − k, 2^(k/32) from a 32-entry
 * table of 2^(i/32) with k's high bits added to the exponent field, and a
 * cubic in r; one rounding to float at the end (at most 0.502 ulp from
 * exp(x)). The lanes below repeat those double operations and the FMAs
 * that build contracts (the same operands, the same single roundings), so
 * every result equals expf's. Inputs of magnitude >= 88 (over- and
 * underflow, inf, NaN), where expf takes other branches, go to expf
 * itself. On AVX2 + FMA CPUs without AVX-512 (Zen 2/3, where glibc's ifunc
 * picks the same __expf_fma) the same lanes run 8 at a time, the table
 * read by a gather; elsewhere every element is an expf call. */
#include <math.h>

#include "kernels/cpu/kernels.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

/* bits of 2^(i/32) (nearest double) minus i << 47, i = 0..31: adding
 * k << 47 for k ≡ i (mod 32) gives the bits of 2^(k/32) */
static const uint64_t EXP2_TAB[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
};

/* expf's constants: 32/ln2, the rounding shift 1.5·2^52, the cubic's */
#define EXP_INV_LN2_N 0x1.71547652b82fep+5
#define EXP_SHIFT 0x1.8p52
#define EXP_C0 0x1.c6af84b912394p-20
#define EXP_C1 0x1.ebfce50fac4f3p-13
#define EXP_C2 0x1.62e42ff0c52d6p-6
/* |x| >= 88, inf or NaN: the exponent field with the top mantissa bits of
 * a float's bits >> 20 (sign dropped) at least this */
#define EXP_BIG 0x42b
#endif

#if defined(__AVX512F__)

// 8 lanes of expf's double evaluation, before its final rounding to float
static inline __m512d exp_lanes(__m256 x) {
  const __m512d inv_ln2_n = _mm512_set1_pd(EXP_INV_LN2_N), shift = _mm512_set1_pd(EXP_SHIFT);
  const __m512d c0 = _mm512_set1_pd(EXP_C0), c1 = _mm512_set1_pd(EXP_C1);
  const __m512d c2 = _mm512_set1_pd(EXP_C2);
  __m512d xd = _mm512_cvtps_pd(x);
  __m512d kd = _mm512_fmadd_pd(inv_ln2_n, xd, shift); /* k in the low bits */
  __m512i ki = _mm512_castpd_si512(kd);
  kd = _mm512_sub_pd(kd, shift);
  __m512d r = _mm512_fmsub_pd(inv_ln2_n, xd, kd);
  __m512i i = _mm512_and_si512(ki, _mm512_set1_epi64(31));
  const __m512i *tab = (const __m512i *)EXP2_TAB;
  __m512i lo = _mm512_permutex2var_epi64(_mm512_loadu_si512(tab), i, _mm512_loadu_si512(tab + 1));
  __m512i hi =
      _mm512_permutex2var_epi64(_mm512_loadu_si512(tab + 2), i, _mm512_loadu_si512(tab + 3));
  __m512i t = _mm512_mask_blend_epi64(_mm512_test_epi64_mask(i, _mm512_set1_epi64(16)), lo, hi);
  __m512d s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64(ki, 47)));
  __m512d z = _mm512_fmadd_pd(c0, r, c1);
  __m512d r2 = _mm512_mul_pd(r, r);
  __m512d y = _mm512_fmadd_pd(c2, r, _mm512_set1_pd(1.0));
  y = _mm512_fmadd_pd(z, r2, y);
  return _mm512_mul_pd(y, s);
}

// expf of 16 lanes
static inline __m512 expf16(__m512 x) {
  __m256 lo = _mm512_cvtpd_ps(exp_lanes(_mm512_castps512_ps256(x)));
  __m256 hi = _mm512_cvtpd_ps(exp_lanes(_mm256_castpd_ps(_mm512_extractf64x4_pd(
      _mm512_castps_pd(x), 1))));
  __m512 y = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
  /* |x| >= 88 (exponent field with the top mantissa bits >= 0x42b), inf, NaN */
  __m512i top = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 20),
                                 _mm512_set1_epi32(0x7ff));
  __mmask16 big = _mm512_cmpge_epu32_mask(top, _mm512_set1_epi32(EXP_BIG));
  if (big) {
    float xs[16], ys[16];
    _mm512_storeu_ps(xs, x);
    _mm512_storeu_ps(ys, y);
    for (int l = 0; l < 16; l++)
      if (big >> l & 1) ys[l] = expf(xs[l]);
    y = _mm512_loadu_ps(ys);
  }
  return y;
}

#elif defined(__AVX2__) && defined(__FMA__)

// 4 lanes of expf's double evaluation, before its final rounding to float
static inline __m256d exp_lanes(__m128 x) {
  const __m256d inv_ln2_n = _mm256_set1_pd(EXP_INV_LN2_N), shift = _mm256_set1_pd(EXP_SHIFT);
  __m256d xd = _mm256_cvtps_pd(x);
  __m256d kd = _mm256_fmadd_pd(inv_ln2_n, xd, shift); /* k in the low bits */
  __m256i ki = _mm256_castpd_si256(kd);
  kd = _mm256_sub_pd(kd, shift);
  __m256d r = _mm256_fmsub_pd(inv_ln2_n, xd, kd);
  __m256i i = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
  __m256i t = _mm256_i64gather_epi64((const long long *)EXP2_TAB, i, 8);
  __m256d s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64(ki, 47)));
  __m256d z = _mm256_fmadd_pd(_mm256_set1_pd(EXP_C0), r, _mm256_set1_pd(EXP_C1));
  __m256d r2 = _mm256_mul_pd(r, r);
  __m256d y = _mm256_fmadd_pd(_mm256_set1_pd(EXP_C2), r, _mm256_set1_pd(1.0));
  y = _mm256_fmadd_pd(z, r2, y);
  return _mm256_mul_pd(y, s);
}

// expf of 8 lanes
static inline __m256 expf8(__m256 x) {
  __m128 lo = _mm256_cvtpd_ps(exp_lanes(_mm256_castps256_ps128(x)));
  __m128 hi = _mm256_cvtpd_ps(exp_lanes(_mm256_extractf128_ps(x, 1)));
  __m256 y = _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
  /* the field is at most 0x7ff, so a signed compare is the unsigned one */
  __m256i top = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 20),
                                 _mm256_set1_epi32(0x7ff));
  int big = _mm256_movemask_ps(
      _mm256_castsi256_ps(_mm256_cmpgt_epi32(top, _mm256_set1_epi32(EXP_BIG - 1))));
  if (big) {
    float xs[8], ys[8];
    _mm256_storeu_ps(xs, x);
    _mm256_storeu_ps(ys, y);
    for (int l = 0; l < 8; l++)
      if (big >> l & 1) ys[l] = expf(xs[l]);
    y = _mm256_loadu_ps(ys);
  }
  return y;
}
#endif

void k_expf(const float *x, float *y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, expf16(_mm512_loadu_ps(x + i)));
  if (i < n) { /* the last 1..15: masked lanes (the others compute expf(0), unstored) */
    __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(y + i, m, expf16(_mm512_maskz_loadu_ps(m, x + i)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, expf8(_mm256_loadu_ps(x + i)));
  for (; i < n; i++) y[i] = expf(x[i]); /* the last 1..7 */
#else
  for (; i < n; i++) y[i] = expf(x[i]);
#endif
}
