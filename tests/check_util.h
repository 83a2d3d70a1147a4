/* Helpers of the single-process numerical tests (tests/unit/test_kernels.c,
 * tests/cuda/test_cuda_ops.c): a fixed-seed random source, buffers, and
 * the per-element comparison against a bound that prints its worst
 * error/bound. Include after <cmocka.h> (failures go through fail_msg). */
#ifndef ML_CHECK_UTIL_H
#define ML_CHECK_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

// uniform in [-1, 1)
static inline float frand(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (float)((double)(rng_state >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static inline float *rand_buf(int64_t n, float scale) {
  float *a = malloc((size_t)n * sizeof(float));
  for (int64_t i = 0; i < n; i++) a[i] = scale * frand();
  return a;
}

static inline double *dzeros(int64_t n) { return calloc((size_t)n, sizeof(double)); }

/* |got_i − ref_i| <= bound_i for every i (a zero bound demands equality);
 * prints the worst error/bound. */
static inline void expect_within(const char *what, const float *got, const double *ref,
                                 const double *bound, int64_t n) {
  double worst = 0.0;
  int64_t at = -1;
  for (int64_t i = 0; i < n; i++) {
    double e = fabs((double)got[i] - ref[i]),
           r = bound[i] > 0 ? e / bound[i] : (e > 0 ? INFINITY : 0);
    if (r > worst) worst = r, at = i;
  }
  printf("  %-44s worst error/bound %.3g\n", what, worst);
  if (worst > 1.0)
    fail_msg("%s: element %lld is %.9g, reference %.17g, bound %.3g", what, (long long)at,
             (double)got[at], ref[at], bound[at]);
}

#endif
