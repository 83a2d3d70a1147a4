/* kc_add_bias_rows (kernels.h): a bias broadcast over the rows of C, the
 * GEMM's epilogue when its inner dimension is empty (an empty torch.chunk
 * shard), where cuBLASLt is not called. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

// C: [M, N] (row stride ldc) += bias [N] on every row: blocks stride over
// the rows, threads over the columns
static __global__ void add_bias_rows(float *C, int64_t ldc, int64_t M, int64_t N,
                                     const float *bias) {
  for (int64_t r = blockIdx.x; r < M; r += gridDim.x)
    for (int64_t c = threadIdx.x; c < N; c += blockDim.x) C[r * ldc + c] += bias[c];
}

extern "C" cudaError_t kc_add_bias_rows(cudaStream_t st, float *C, int64_t ldc, int64_t M,
                                        int64_t N, const float *bias) {
  if (M <= 0 || N <= 0) return cudaSuccess;
  return KC_LAUNCH(add_bias_rows, kc_row_grid(M), KC_THREADS, 0, st, C, ldc, M, N, bias);
}
