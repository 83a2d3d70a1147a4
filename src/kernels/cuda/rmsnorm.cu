/* RMSNorm forward and backward (HF LlamaRMSNorm; Gemma3RMSNorm's (1 + w)
 * when offset = 1), with the arithmetic of kernels/cpu/rmsnorm.c: row sums
 * in fp64, the rest in fp32 by the same expressions.
 *
 * One block per row (rows beyond the grid loop): each thread takes quads
 * of the row (common.cuh kc_ld4, vectorised when the row is aligned), adds
 * its terms in fp64, the block folds them (kc_block_reduce, a fixed tree),
 * then the same threads revisit the same quads to write the output; so y
 * may alias x and dx may alias dy. The bf16 forward stores each output
 * rounded to nearest-even (kc_f32_to_bf16) instead. dw is the two-pass column sum kc_colsum
 * (reduce.cu), launched before dx overwrites dy. */
#include <math.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

// rstd[t] = 1/sqrtf((float)(sum x^2 / H) + eps); y = (x·rstd)·(offset + w), or with y16 that
// value rounded to nearest-even into y16 [T, H] bf16 (y unused)
static __global__ void rmsnorm_fwd_kernel(const float *x, const void *w, bool w_bf16,
                                          float offset, float eps, float *y, uint16_t *y16,
                                          float *rstd, int64_t T, int64_t H) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const float *xr = x + t * H;
    double ss = 0.0;
    for (int64_t i = threadIdx.x * 4; i < H; i += blockDim.x * 4) {
      float v[4];
      kc_ld4(xr, i, H, v); /* zeros past H add nothing */
      for (int k = 0; k < 4; k++) ss += (double)v[k] * v[k];
    }
    ss = kc_block_reduce(ss, 0.0, kc_sum_op());
    float r = 1.0f / sqrtf((float)(ss / (double)H) + eps);
    if (threadIdx.x == 0) rstd[t] = r;
    for (int64_t i = threadIdx.x * 4; i < H; i += blockDim.x * 4) {
      float v[4], wv[4];
      kc_ld4(xr, i, H, v);
      kc_ld4w(w, w_bf16, 0, i, H, wv);
      for (int k = 0; k < 4; k++) v[k] = (v[k] * r) * (offset + wv[k]);
      if (y16) {
        uint16_t h[4];
        for (int k = 0; k < 4; k++) h[k] = kc_f32_to_bf16(v[k]);
        kc_st4h(y16 + t * H, i, H, h);
      } else {
        kc_st4(y + t * H, i, H, v);
      }
    }
  }
}

// dx = rstd·we·dy − x·c, c = (float)(dot·rstd³/H), dot = sum_h dy·we·x in fp64,
// we = offset + w (fp32)
static __global__ void rmsnorm_dx_kernel(const float *dy, const float *x, const void *w,
                                         bool w_bf16, float offset, const float *rstd, float *dx,
                                         int64_t T, int64_t H) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const float *dr = dy + t * H, *xr = x + t * H;
    float *dxr = dx + t * H;
    double dot = 0.0;
    for (int64_t i = threadIdx.x * 4; i < H; i += blockDim.x * 4) {
      float d[4], xv[4], wv[4];
      kc_ld4(dr, i, H, d); /* zeros past H add nothing */
      kc_ld4(xr, i, H, xv);
      kc_ld4w(w, w_bf16, 0, i, H, wv);
      for (int k = 0; k < 4; k++) dot += (double)d[k] * (offset + wv[k]) * xv[k];
    }
    dot = kc_block_reduce(dot, 0.0, kc_sum_op());
    float r = rstd[t];
    float c = (float)(dot * r * r * r / (double)H);
    for (int64_t i = threadIdx.x * 4; i < H; i += blockDim.x * 4) {
      float d[4], xv[4], wv[4], o[4];
      kc_ld4(dr, i, H, d);
      kc_ld4(xr, i, H, xv);
      kc_ld4w(w, w_bf16, 0, i, H, wv);
      for (int k = 0; k < 4; k++) o[k] = r * (offset + wv[k]) * d[k] - xv[k] * c;
      kc_st4(dxr, i, H, o);
    }
  }
}

// threads for rows of H: one quad each up to KC_THREADS, a whole number of warps
static unsigned row_threads(int64_t H) {
  int64_t q = (H + 3) / 4, t = (q + 31) / 32 * 32;
  return (unsigned)(t < 32 ? 32 : t < KC_THREADS ? t : KC_THREADS);
}

extern "C" cudaError_t kc_rmsnorm_fwd(cudaStream_t st, const float *x, const void *w, bool w_bf16,
                                      float offset, float eps, float *y, float *rstd, int64_t T,
                                      int64_t H) {
  if (T <= 0) return cudaSuccess;
  return KC_LAUNCH(rmsnorm_fwd_kernel, kc_row_grid(T), row_threads(H), 0, st, x, w, w_bf16, offset,
                   eps, y, (uint16_t *)NULL, rstd, T, H);
}

extern "C" cudaError_t kc_rmsnorm_fwd_bf16(cudaStream_t st, const float *x, const void *w,
                                           bool w_bf16, float offset, float eps, void *y,
                                           float *rstd, int64_t T, int64_t H) {
  if (T <= 0) return cudaSuccess;
  return KC_LAUNCH(rmsnorm_fwd_kernel, kc_row_grid(T), row_threads(H), 0, st, x, w, w_bf16, offset,
                   eps, (float *)NULL, (uint16_t *)y, rstd, T, H);
}

extern "C" size_t kc_rmsnorm_bwd_work(int64_t T, int64_t H) { return kc_colsum_work(T, H); }

extern "C" cudaError_t kc_rmsnorm_bwd(cudaStream_t st, const float *dy, const float *x,
                                      const void *w, bool w_bf16, float offset, const float *rstd,
                                      float *dx, float *dw, int64_t T, int64_t H, void *work) {
  if (T <= 0) return cudaSuccess;
  if (dw && H > 0) {
    cudaError_t e = kc_colsum(st, dy, x, rstd, T, H, dw, work); /* reads dy before dx */
    if (e != cudaSuccess) return e;
  }
  return KC_LAUNCH(rmsnorm_dx_kernel, kc_row_grid(T), row_threads(H), 0, st, dy, x, w, w_bf16,
                   offset, rstd, dx, T, H);
}
