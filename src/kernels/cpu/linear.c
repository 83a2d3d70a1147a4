/* Linear layer: y = x·W^T + b with OpenBLAS sgemm (row-major). */
#include <cblas.h>
#include <string.h>

#include "kernels/cpu/kernels.h"

enum { COLS_PER_TASK = 256 };

// y: [T, out] = x: [T, in] · W: [out, in]^T (+ b: [out])
void k_linear_fwd(const float *x, const float *W, const float *b, float *y, int64_t T, int64_t in,
                  int64_t out) {
  float beta = 0.0f;
  if (b) {
#pragma omp parallel for
    for (int64_t t = 0; t < T; t++) memcpy(y + t * out, b, (size_t)out * sizeof(float));
    beta = 1.0f;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)T, (int)out, (int)in, 1.0f, x, (int)in,
              W, (int)in, beta, y, (int)out);
}

// db: [out] += column sums of dy: [T, out]; threads own disjoint column ranges
static void colsum_acc(const float *dy, float *db, int64_t T, int64_t out) {
#pragma omp parallel for
  for (int64_t c0 = 0; c0 < out; c0 += COLS_PER_TASK) {
    int64_t n = out - c0 < COLS_PER_TASK ? out - c0 : COLS_PER_TASK;
    double acc[COLS_PER_TASK] = {0};
    for (int64_t t = 0; t < T; t++)
      for (int64_t j = 0; j < n; j++) acc[j] += dy[t * out + c0 + j];
    for (int64_t j = 0; j < n; j++) db[c0 + j] += (float)acc[j];
  }
}

// dx: [T, in] (= or +=) dy: [T, out] · W: [out, in]; dW: [out, in] += dy^T · x
void k_linear_bwd(const float *dy, const float *x, const float *W, float *dx, int dx_accumulate,
                  float *dW, float *db, int64_t T, int64_t in, int64_t out) {
  if (dx)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)T, (int)in, (int)out, 1.0f, dy,
                (int)out, W, (int)in, dx_accumulate ? 1.0f : 0.0f, dx, (int)in);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)out, (int)in, (int)T, 1.0f, dy,
              (int)out, x, (int)in, 1.0f, dW, (int)in);
  if (db) colsum_acc(dy, db, T, out);
}
