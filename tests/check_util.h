/* Helpers of the single-process numerical tests (tests/unit/test_kernels.c,
 * tests/cuda/test_cuda_ops.c): a fixed-seed random source, buffers, bf16
 * rounding, and the per-element comparison against a bound that prints its
 * worst error/bound. Include after <cmocka.h> (failures go through
 * fail_msg). */
#ifndef ML_CHECK_UTIL_H
#define ML_CHECK_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "tensor/dtype.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

// the next state of the xorshift64 generator
static inline uint64_t rand_next(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

// uniform in [-1, 1)
static inline float frand(void) {
  return (float)((double)(rand_next() >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

// 32 random bits (bit patterns, bytes, indices)
static inline uint32_t rand_bits(void) { return (uint32_t)(rand_next() >> 32); }

static inline float *rand_buf(int64_t n, float scale) {
  float *a = malloc((size_t)n * sizeof(float));
  for (int64_t i = 0; i < n; i++) a[i] = scale * frand();
  return a;
}

static inline float *const_buf(int64_t n, float c) {
  float *a = malloc((size_t)n * sizeof(float));
  for (int64_t i = 0; i < n; i++) a[i] = c;
  return a;
}

static inline double *dzeros(int64_t n) { return calloc((size_t)n, sizeof(double)); }

/* x[n] rounded to bf16 (nearest-even), as fp32: the values the bf16 GEMMs
 * and attention products multiply. */
static inline float *bf16_rounded(const float *x, int64_t n) {
  float *r = malloc(sizeof(float) * (size_t)(n ? n : 1));
  for (int64_t i = 0; i < n; i++) r[i] = ml_bf16_to_f32(ml_f32_to_bf16(x[i]));
  return r;
}

/* |got_i − ref_i| <= bound_i for every i (a zero bound demands equality; a
 * NaN on either side is never within a bound); prints the worst
 * error/bound. */
static inline void expect_within(const char *what, const float *got, const double *ref,
                                 const double *bound, int64_t n) {
  double worst = 0.0;
  int64_t at = -1;
  for (int64_t i = 0; i < n; i++) {
    double e = fabs((double)got[i] - ref[i]);
    double r = isnan(e) ? INFINITY : bound[i] > 0 ? e / bound[i] : (e > 0 ? INFINITY : 0);
    if (r > worst) worst = r, at = i;
  }
  printf("  %-44s worst error/bound %.3g\n", what, worst);
  if (worst > 1.0)
    fail_msg("%s: element %lld is %.9g, reference %.17g, bound %.3g", what, (long long)at,
             (double)got[at], ref[at], bound[at]);
}

#endif
