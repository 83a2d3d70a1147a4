/* Per-token entropy pieces over vocab shards and column tiles, semantics
 * of kernels/cpu/xent_entropy.c: sl = Σ expf(l − m)·(l − m) in fp64 about
 * the reduced max (entropy_sum) or the running one (entropy_online, moved
 * as sl·e^d + d·se·e^d), rounded once; rebase onto the reduced max; the
 * entropy log(se) − sl/se in fp64. sum and online: one block of
 * XENT_THREADS per row (rows beyond the grid loop), the row in quads
 * (common.cuh kc_ld4), folded by a fixed tree; rebase and the entropy: per
 * token, grid-stride. */
#include <math.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

static constexpr int XENT_THREADS = 1024; /* one block per row, as xent.cu's */

/* online: mx, se the running statistics before this tile (se = 0: none) and
 * sl moved onto the new max; else sl = the sum about mx */
static __global__ void entropy_sum_kernel(const float *logits, int64_t T, int64_t V,
                                          const float *mx, const float *se, float *sl,
                                          bool online) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const float *l = logits + t * V;
    float m = mx[t], s0 = online ? se[t] : 0.0f;
    if (online) {
      float mt = -INFINITY;
      for (int64_t i = threadIdx.x * 4; i < V; i += blockDim.x * 4) {
        float v[4];
        kc_ld4(l, i, V, v);
        for (int k = 0; k < 4; k++)
          if (i + k < V) mt = fmaxf(mt, v[k]);
      }
      mt = kc_block_reduce(mt, -INFINITY, kc_max_op());
      m = s0 != 0.0f && m > mt ? m : mt;
    }
    double s = 0.0;
    for (int64_t i = threadIdx.x * 4; i < V; i += blockDim.x * 4) {
      float v[4];
      kc_ld4(l, i, V, v);
      for (int k = 0; k < 4; k++)
        if (i + k < V) {
          float d = v[k] - m, e = expf(d);
          s += e != 0.0f ? (double)e * d : 0.0;
        }
    }
    s = kc_block_reduce(s, 0.0, kc_sum_op());
    if (threadIdx.x == 0) {
      double d = (double)mx[t] - (double)m;
      double r = s0 != 0.0f ? exp(d) * ((double)sl[t] + d * (double)s0) : 0.0;
      sl[t] = (float)(r + s);
    }
  }
}

static __global__ void entropy_rebase_kernel(int64_t T, const float *mx, const float *M,
                                             const float *se, float *sl) {
  for (int64_t t = kc_gtid(); t < T; t += kc_gstride()) {
    double d = (double)mx[t] - (double)M[t];
    sl[t] = se[t] != 0.0f ? (float)(exp(d) * ((double)sl[t] + d * (double)se[t])) : 0.0f;
  }
}

static __global__ void entropy_kernel(const float *se, const float *sl, int64_t T, float *ent) {
  for (int64_t t = kc_gtid(); t < T; t += kc_gstride())
    ent[t] = (float)(log((double)se[t]) - (double)sl[t] / se[t]);
}

extern "C" cudaError_t kc_xent_entropy_sum(cudaStream_t st, const float *logits, int64_t T,
                                           int64_t V, const float *mx, float *sl) {
  if (T <= 0) return cudaSuccess;
  return KC_LAUNCH(entropy_sum_kernel, kc_row_grid(T), XENT_THREADS, 0, st, logits, T, V, mx,
                   (const float *)nullptr, sl, false);
}

extern "C" cudaError_t kc_xent_entropy_online(cudaStream_t st, const float *logits, int64_t T,
                                              int64_t V, const float *mx, const float *se,
                                              float *sl) {
  if (T <= 0) return cudaSuccess;
  return KC_LAUNCH(entropy_sum_kernel, kc_row_grid(T), XENT_THREADS, 0, st, logits, T, V, mx, se,
                   sl, true);
}

extern "C" cudaError_t kc_xent_entropy_rebase(cudaStream_t st, int64_t T, const float *mx,
                                              const float *M, const float *se, float *sl) {
  if (T <= 0) return cudaSuccess;
  return KC_LAUNCH(entropy_rebase_kernel, kc_reduce_blocks(T), KC_THREADS, 0, st, T, mx, M, se,
                   sl);
}

extern "C" cudaError_t kc_xent_entropy(cudaStream_t st, const float *se, const float *sl,
                                       int64_t T, float *ent) {
  if (T <= 0) return cudaSuccess;
  return KC_LAUNCH(entropy_kernel, kc_reduce_blocks(T), KC_THREADS, 0, st, se, sl, T, ent);
}

/* ---- the entropy bonus's backward: element-wise, grid (column quads, rows),
 * as xent.cu's xent_bwd; each row's log(se) − H formed in fp64 and rounded
 * once, as the CPU's */
static __global__ void bwd_entropy_kernel(const float *logits, int64_t T, int64_t V, int64_t v0,
                                          const int32_t *y, const float *mx, const float *se,
                                          const float *w, const float *H, const float *ew,
                                          float *dlogits) {
  int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (i >= V) return;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    float m = mx[t], inv = 1.0f / se[t], wt = w[t], et = ew[t], v[4];
    float c = (float)(log((double)se[t]) - (double)H[t]);
    int64_t col = y[t] >= v0 && y[t] < v0 + V ? y[t] - v0 : -1;
    kc_ld4(logits + t * V, i, V, v);
    for (int k = 0; k < 4; k++) {
      float z = v[k] - m, p = expf(z) * inv;
      v[k] = wt * p + et * (p != 0.0f ? p * (z - c) : 0.0f); /* l = −inf: 0, not 0·inf */
      if (i + k == col) v[k] -= wt;
    }
    kc_st4(dlogits + t * V, i, V, v);
  }
}

extern "C" cudaError_t kc_xent_bwd_entropy(cudaStream_t st, const float *logits, int64_t T,
                                           int64_t V, int64_t v0, const int32_t *y,
                                           const float *mx, const float *se, const float *w,
                                           const float *H, const float *ew, float *dlogits) {
  if (T <= 0 || V <= 0) return cudaSuccess;
  int64_t cols = (V + 4 * KC_THREADS - 1) / (4 * KC_THREADS);
  if (cols > INT32_MAX) return cudaErrorInvalidValue;
  dim3 grid((unsigned)cols, kc_row_grid(T));
  return KC_LAUNCH(bwd_entropy_kernel, grid, KC_THREADS, 0, st, logits, T, V, v0, y, mx, se, w, H,
                   ew, dlogits);
}
