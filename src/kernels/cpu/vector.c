/* Elementwise and reduction kernels of the engine: the residual add,
 * gradient clipping, grad-norm partials and the bias gradient. */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>

#include "kernels/cpu/kernels.h"

enum { SUM_CHUNK = 1 << 14, LANES = 8 };

float k_max(const float *x, int64_t n) {
  float m = -INFINITY;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (; j + 16 <= n; j += 16) vm = _mm512_max_ps(_mm512_loadu_ps(x + j), vm);
  m = _mm512_reduce_max_ps(vm);
#endif
  for (; j < n; j++) m = x[j] > m ? x[j] : m;
  return m;
}

double k_dot_f64(const float *x, const float *y, int64_t n) {
  double acc[LANES] = {0}, s = 0.0;
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int k = 0; k < LANES; k++) acc[k] += (double)x[j + k] * y[j + k];
  for (; j < n; j++) acc[0] += (double)x[j] * y[j];
  for (int k = 0; k < LANES; k++) s += acc[k];
  return s;
}

// y, x: [n]
void k_add(float *y, const float *x, int64_t n) {
#pragma omp parallel for simd if (K_PAR(n, n))
  for (int64_t i = 0; i < n; i++) y[i] += x[i];
}

// x: [n]
void k_scale(float *x, int64_t n, float s) {
#pragma omp parallel for simd if (K_PAR(n, n))
  for (int64_t i = 0; i < n; i++) x[i] *= s;
}

double k_sumsq(const float *g, int64_t n) {
  double s = 0.0;
#pragma omp parallel for reduction(+ : s)
  for (int64_t c0 = 0; c0 < n; c0 += SUM_CHUNK)
    s += k_dot_f64(g + c0, g + c0, n - c0 < SUM_CHUNK ? n - c0 : SUM_CHUNK);
  return s;
}

double k_absmax(const float *g, int64_t n) {
  double s = 0.0;
#pragma omp parallel for reduction(max : s)
  for (int64_t k = 0; k < n; k++) s = fmax(s, isnan(g[k]) ? INFINITY : fabs((double)g[k]));
  return s;
}

int k_has_nonfinite(const float *g, int64_t n) {
  int found = 0;
#pragma omp parallel for reduction(| : found)
  for (int64_t k = 0; k < n; k++) found |= !isfinite(g[k]);
  return found;
}

int64_t k_col_width(int64_t N) {
  int64_t threads = omp_get_max_threads(), w = (N + threads - 1) / threads;
  w = (w + K_COL_ALIGN - 1) / K_COL_ALIGN * K_COL_ALIGN;
  return w < K_COL_ALIGN ? K_COL_ALIGN : w > K_COL_MAX ? K_COL_MAX : w;
}

// db: [N] += column sums of dy: [T, N]; threads own disjoint column runs
void k_bias_grad(const float *dy, int64_t T, int64_t N, float *db) {
  int64_t width = k_col_width(N);
#pragma omp parallel for if (K_PAR((N + width - 1) / width, T * N))
  for (int64_t c0 = 0; c0 < N; c0 += width) {
    int64_t n = N - c0 < width ? N - c0 : width;
    double acc[K_COL_MAX] = {0};
    for (int64_t t = 0; t < T; t++)
      for (int64_t j = 0; j < n; j++) acc[j] += dy[t * N + c0 + j];
    for (int64_t j = 0; j < n; j++) db[c0 + j] += (float)acc[j];
  }
}
