/* What the C benchmark programs under bench/ share: a wall clock, a
 * comparison for qsort's medians, and random normal data (bench/METHOD's
 * rule: never zeros). Header-only: each program is one file. */
#ifndef ML_BENCH_UTIL_H
#define ML_BENCH_UTIL_H

#include <math.h>
#include <stdint.h>
#include <time.h>

/* Seconds on CLOCK_MONOTONIC. */
static inline double bench_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* qsort's comparison of two doubles, ascending. */
static inline int bench_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* n standard normal floats (Box–Muller over a 64-bit LCG: data, not statistics). */
static inline void bench_normal_fill(float *x, int64_t n, uint64_t seed) {
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (int64_t i = 0; i < n; i += 2) {
    double u[2];
    for (int j = 0; j < 2; j++) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      u[j] = ((double)(s >> 11) + 0.5) / 9007199254740992.0; /* (0, 1) */
    }
    double r = sqrt(-2.0 * log(u[0])), a = 6.283185307179586 * u[1];
    x[i] = (float)(r * cos(a));
    if (i + 1 < n) x[i + 1] = (float)(r * sin(a));
  }
}

#endif
