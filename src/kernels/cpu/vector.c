/* Elementwise and reduction kernels of the engine: the residual add (and
 * its bf16 copy of the sum, or into another buffer), the bf16 cast of a
 * unit's input with its bf16 copy, gradient clipping, grad-norm partials and the bias gradient. */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>

#include "kernels/cpu/kernels.h"
#include "tensor/dtype.h"

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

/* y, x: [n]. One loop per case, each the add it replaces (y += x, or into
 * zeros: 0 + x, not x, so −0 → +0). */
void k_add_grad(float *y, const float *x, int64_t n, bool overwrite, bool round) {
  if (!overwrite && !round) {
    k_add(y, x, n);
  } else if (!overwrite) {
#pragma omp parallel for simd if (K_PAR(n, n))
    for (int64_t i = 0; i < n; i++) y[i] += ml_bf16_to_f32(ml_f32_to_bf16(x[i]));
  } else if (!round) {
#pragma omp parallel for simd if (K_PAR(n, n))
    for (int64_t i = 0; i < n; i++) y[i] = 0.0f + x[i];
  } else {
    /* a zero GCC cannot fold into the rounding's NaN branch: with the constant it leaves
     * control flow in the loop and does not vectorize it */
    static volatile const float zero_v = 0.0f;
    const float zero = zero_v;
#pragma omp parallel for simd if (K_PAR(n, n))
    for (int64_t i = 0; i < n; i++) y[i] = zero + ml_bf16_to_f32(ml_f32_to_bf16(x[i]));
  }
}

// y, x, y16: [n]
void k_add_bf16(float *y, const float *x, uint16_t *y16, int64_t n) {
#pragma omp parallel for simd if (K_PAR(n, n))
  for (int64_t i = 0; i < n; i++) {
    float s = y[i] + x[i];
    y[i] = s;
    y16[i] = ml_f32_to_bf16(s);
  }
}

// z, y, x: [n]
void k_add_to(float *z, const float *y, const float *x, int64_t n) {
#pragma omp parallel for simd if (K_PAR(n, n))
  for (int64_t i = 0; i < n; i++) z[i] = y[i] + x[i];
}

// z, y, x, z16: [n]
void k_add_round_to(float *z, const float *y, const float *x, uint16_t *z16, int64_t n) {
  if (!z16) {
#pragma omp parallel for simd if (K_PAR(n, n))
    for (int64_t i = 0; i < n; i++) z[i] = ml_bf16_to_f32(ml_f32_to_bf16(y[i] + x[i]));
    return;
  }
#pragma omp parallel for simd if (K_PAR(n, n))
  for (int64_t i = 0; i < n; i++) {
    uint16_t h = ml_f32_to_bf16(y[i] + x[i]);
    z[i] = ml_bf16_to_f32(h);
    z16[i] = h;
  }
}

// x, y, y16: [n]
void k_round_bf16_to(const float *x, float *y, uint16_t *y16, int64_t n) {
  if (!y16) {
#pragma omp parallel for simd if (K_PAR(n, n))
    for (int64_t i = 0; i < n; i++) y[i] = ml_bf16_to_f32(ml_f32_to_bf16(x[i]));
    return;
  }
#pragma omp parallel for simd if (K_PAR(n, n))
  for (int64_t i = 0; i < n; i++) {
    uint16_t h = ml_f32_to_bf16(x[i]);
    y[i] = ml_bf16_to_f32(h);
    y16[i] = h;
  }
}

// x: [n]
void k_scale(float *x, int64_t n, float s) {
#pragma omp parallel for simd if (K_PAR(n, n))
  for (int64_t i = 0; i < n; i++) x[i] *= s;
}

/* One chunk's partial: sum of g² (k_dot_f64's lanes) or max |g|, NaN as +inf. */
static double chunk_partial(const float *g, int64_t n, ml_norm_kind kind) {
  if (kind == ML_NORM_SUMSQ) return k_dot_f64(g, g, n);
  double m = 0.0;
  for (int64_t j = 0; j < n; j++) m = fmax(m, isnan(g[j]) ? INFINITY : fabs((double)g[j]));
  return m;
}

/* The segments' chunks of SUM_CHUNK floats, flattened, go through windows of
 * NORM_WINDOW chunks: one parallel region per window computes each chunk's
 * partial, then the calling thread folds them into their segments in chunk
 * order. */
void k_norm_partials(const ml_norm_seg *segs, int k, ml_norm_kind kind, double *out) {
  enum { NORM_WINDOW = 1024 };
  struct { int s; int64_t off, len; } w[NORM_WINDOW];
  double part[NORM_WINDOW];
  int s = 0;
  int64_t off = 0;
  for (int i = 0; i < k; i++) out[i] = 0.0;
  while (s < k) {
    int m = 0;
    int64_t floats = 0;
    for (; s < k && m < NORM_WINDOW; m++) { /* the next chunk: segment s from off */
      while (s < k && off >= segs[s].n) s++, off = 0;
      if (s == k) break;
      int64_t len = segs[s].n - off < SUM_CHUNK ? segs[s].n - off : SUM_CHUNK;
      w[m].s = s, w[m].off = off, w[m].len = len;
      floats += len, off += len;
    }
#pragma omp parallel for if (K_PAR(m, floats))
    for (int c = 0; c < m; c++) part[c] = chunk_partial(segs[w[c].s].g + w[c].off, w[c].len, kind);
    for (int c = 0; c < m; c++)
      out[w[c].s] = kind == ML_NORM_SUMSQ ? out[w[c].s] + part[c] : fmax(out[w[c].s], part[c]);
  }
}

int k_has_nonfinite(const float *g, int64_t n) {
  int found = 0;
#pragma omp parallel for reduction(| : found) if (K_PAR(n, n))
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
