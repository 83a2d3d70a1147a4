/* The row-major GEMM of backend.h's ml_gemm as the column-major GEMM that
 * cuBLASLt computes: the one mapping backend/cuda/gemm.c uses, free of CUDA
 * so that a test checks it on the CPU (tools/cuda_emu/test_gemm_map.c runs
 * it through cblas_sgemm in column-major against the row-major product).
 *
 * A row-major [r, c] matrix with stride ld is the column-major [c, r]
 * matrix with the same ld, so C [M, N] = op(A)·op(B) row-major is
 * C^T [N, M] = op(B)^T·op(A)^T column-major: cuBLASLt's A is our B
 * (transposed iff trans_b), its B is our A (transposed iff trans_a), m = N,
 * n = M, k = K, and the bias epilogue's vector (one value per row of the
 * column-major D) is our [N]. */
#ifndef ML_BACKEND_CUDA_GEMM_MAP_H
#define ML_BACKEND_CUDA_GEMM_MAP_H

#include <stdint.h>

#include "backend/backend.h"

/* cuBLASLt's D [m, n] = op(A') [m, k] · op(B') [k, n], column-major; each
 * operand's layout as stored (rows, cols, leading dimension). No padding
 * between the fields. */
typedef struct ml_lt_gemm {
  int64_t m, n, k;
  int64_t a_rows, a_cols, lda; /* A' = our B */
  int64_t b_rows, b_cols, ldb; /* B' = our A */
  int64_t c_rows, c_cols, ldc; /* C = D */
  int trans_a, trans_b;        /* op(A'), op(B') transposed */
} ml_lt_gemm;

static inline ml_lt_gemm ml_lt_gemm_of(const ml_gemm *g) {
  ml_lt_gemm l;
  l.m = g->N, l.n = g->M, l.k = g->K;
  l.trans_a = g->trans_b, l.trans_b = g->trans_a;
  /* A' = our B: op N: [N, K] column-major (our [K, N] row-major); op T: stored [K, N] */
  l.a_rows = g->trans_b ? g->K : g->N, l.a_cols = g->trans_b ? g->N : g->K, l.lda = g->ldb;
  /* B' = our A: op N: [K, M]; op T: stored [M, K] */
  l.b_rows = g->trans_a ? g->M : g->K, l.b_cols = g->trans_a ? g->K : g->M, l.ldb = g->lda;
  l.c_rows = g->N, l.c_cols = g->M, l.ldc = g->ldc;
  return l;
}

/* cuBLASLt's A' and B' operands for our A and B (as the GEMM reads them:
 * after any bf16 rounding). */
static inline void ml_lt_operands(const void *A, const void *B, const void **lt_a,
                                  const void **lt_b) {
  *lt_a = B;
  *lt_b = A;
}

#endif
