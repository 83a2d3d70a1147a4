/* kc_add_bias_rows (kernels.h): a bias broadcast over the rows of C, the
 * GEMM's epilogue when its inner dimension is empty (an empty torch.chunk
 * shard), where cuBLASLt is not called. */
#include "kernels/cuda/kernels.h"

// C: [M, N] (row stride ldc) += bias [N] on every row; one thread per element
__global__ void add_bias_rows(float *C, int64_t ldc, int64_t M, int64_t N, const float *bias) {
  int64_t n = M * N, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    int64_t r = i / N, c = i % N;
    C[r * ldc + c] += bias[c];
  }
}

extern "C" cudaError_t kc_add_bias_rows(cudaStream_t st, float *C, int64_t ldc, int64_t M,
                                        int64_t N, const float *bias) {
  if (M <= 0 || N <= 0) return cudaSuccess;
  int64_t n = M * N, threads = 256, blocks = (n + threads - 1) / threads;
  add_bias_rows<<<(unsigned)(blocks < 65536 ? blocks : 65536), (unsigned)threads, 0, st>>>(
      C, ldc, M, N, bias);
  return cudaGetLastError();
}
