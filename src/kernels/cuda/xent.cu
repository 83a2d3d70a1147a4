/* Cross-entropy pieces on one vocab shard (Megatron
 * _VocabParallelCrossEntropy), semantics of kernels/cpu/xent.c: row max
 * skipping NaNs, sum of expf(l − mx) in fp64 rounded once, the target's
 * shifted logit, the log-probs tl − log(se) in fp64, and the gradient
 * w·(exp(l − mx)·(1/se)) − w at the target, in fp32.
 *
 * rowmax and sumexp_target: one block of XENT_THREADS per row (rows beyond
 * the grid loop), each a single pass over the row in quads (common.cuh
 * kc_ld4, vectorised when the row is aligned), folded by a fixed tree.
 * They stay two passes: sumexp needs the max reduced over the shards.
 * online / rebase: the fused classifier's per-tile log-sum-exp (one block
 * per row, as rowmax) and its move onto the reduced max (per token).
 * logprobs: block partials in `work`, one block folds them in order.
 * bwd: element-wise, grid (column quads, rows). */
#include <math.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

static constexpr int XENT_THREADS = 1024; /* one block per row; wide rows (V ~ 128k) */

// the target's column in this shard, or -1 when y is ignored or elsewhere
static __device__ __forceinline__ int64_t shard_col(int32_t y, int64_t v0, int64_t V) {
  return (y >= v0 && y < v0 + V) ? y - v0 : -1;
}

// mx[t] = max_j logits[t, j], NaNs skipped (−inf for an empty or all-NaN row)
static __global__ void rowmax_kernel(const float *logits, int64_t T, int64_t V, float *mx) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const float *l = logits + t * V;
    float m = -INFINITY;
#pragma unroll 4
    for (int64_t i = threadIdx.x * 4; i < V; i += blockDim.x * 4) {
      float v[4];
      kc_ld4(l, i, V, v);
      for (int k = 0; k < 4; k++)
        if (i + k < V) m = fmaxf(m, v[k]); /* fmaxf returns the non-NaN operand */
    }
    m = kc_block_reduce(m, -INFINITY, kc_max_op());
    if (threadIdx.x == 0) mx[t] = m;
  }
}

// se[t] = (float) sum_j expf(l[t, j] − mx[t]) in fp64; tl[t] = l[t, y − v0] − mx[t] or 0
static __global__ void sumexp_target_kernel(const float *logits, int64_t T, int64_t V, int64_t v0,
                                            const int32_t *y, const float *mx, float *se,
                                            float *tl) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const float *l = logits + t * V;
    float m = mx[t];
    double s = 0.0;
#pragma unroll 4
    for (int64_t i = threadIdx.x * 4; i < V; i += blockDim.x * 4) {
      float v[4];
      kc_ld4(l, i, V, v);
      for (int k = 0; k < 4; k++)
        if (i + k < V) s += expf(v[k] - m);
    }
    s = kc_block_reduce(s, 0.0, kc_sum_op());
    if (threadIdx.x == 0) {
      se[t] = (float)s;
      int64_t c = shard_col(y[t], v0, V);
      tl[t] = c >= 0 ? l[c] - m : 0.0f;
    }
  }
}

extern "C" cudaError_t kc_xent_rowmax(cudaStream_t st, const float *logits, int64_t T, int64_t V,
                                      float *mx) {
  if (T <= 0) return cudaSuccess;
  return KC_LAUNCH(rowmax_kernel, kc_row_grid(T), XENT_THREADS, 0, st, logits, T, V, mx);
}

extern "C" cudaError_t kc_xent_sumexp_target(cudaStream_t st, const float *logits, int64_t T,
                                             int64_t V, int64_t v0, const int32_t *y,
                                             const float *mx, float *se, float *tl) {
  if (T <= 0) return cudaSuccess;
  return KC_LAUNCH(sumexp_target_kernel, kc_row_grid(T), XENT_THREADS, 0, st, logits, T, V, v0, y,
                   mx, se, tl);
}

/* ---- the online log-sum-exp over column tiles (the fused classifier) --------
 * one block per row: the tile's max (fixed tree), the running sum moved to
 * the new max, then the tile's sum of expf in fp64 (fixed tree), rounded
 * once; one tile on a fresh row gives rowmax's and sumexp_target's values. */
static __global__ void online_kernel(const float *logits, int64_t T, int64_t V, int64_t v0,
                                     const int32_t *y, float *mx, float *se, float *tl) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const float *l = logits + t * V;
    float mt = -INFINITY;
    for (int64_t i = threadIdx.x * 4; i < V; i += blockDim.x * 4) {
      float v[4];
      kc_ld4(l, i, V, v);
      for (int k = 0; k < 4; k++)
        if (i + k < V) mt = fmaxf(mt, v[k]);
    }
    mt = kc_block_reduce(mt, -INFINITY, kc_max_op());
    float s0 = se[t], m0 = mx[t], m = s0 != 0.0f && m0 > mt ? m0 : mt; /* se = 0: first tile */
    double s = 0.0;
    for (int64_t i = threadIdx.x * 4; i < V; i += blockDim.x * 4) {
      float v[4];
      kc_ld4(l, i, V, v);
      for (int k = 0; k < 4; k++)
        if (i + k < V) s += expf(v[k] - m);
    }
    s = kc_block_reduce(s, 0.0, kc_sum_op());
    if (threadIdx.x == 0) {
      double r = s0 != 0.0f ? (double)s0 * exp((double)m0 - (double)m) : 0.0;
      se[t] = (float)(r + s);
      mx[t] = m;
      int64_t c = shard_col(y[t], v0, V);
      if (c >= 0) tl[t] = l[c];
    }
  }
}

static __global__ void rebase_kernel(int64_t T, int64_t V, int64_t v0, const int32_t *y,
                                     const float *mx, const float *M, float *se, float *tl) {
  for (int64_t t = kc_gtid(); t < T; t += kc_gstride()) {
    float s = se[t];
    se[t] = s != 0.0f ? (float)((double)s * exp((double)mx[t] - (double)M[t])) : 0.0f;
    tl[t] = shard_col(y[t], v0, V) >= 0 ? tl[t] - M[t] : 0.0f;
  }
}

extern "C" cudaError_t kc_xent_online(cudaStream_t st, const float *logits, int64_t T, int64_t V,
                                      int64_t v0, const int32_t *y, float *mx, float *se,
                                      float *tl) {
  if (T <= 0) return cudaSuccess;
  return KC_LAUNCH(online_kernel, kc_row_grid(T), XENT_THREADS, 0, st, logits, T, V, v0, y, mx,
                   se, tl);
}

extern "C" cudaError_t kc_xent_rebase(cudaStream_t st, int64_t T, int64_t V, int64_t v0,
                                      const int32_t *y, const float *mx, const float *M, float *se,
                                      float *tl) {
  if (T <= 0) return cudaSuccess;
  return KC_LAUNCH(rebase_kernel, kc_reduce_blocks(T), KC_THREADS, 0, st, T, V, v0, y, mx, M, se,
                   tl);
}

/* ---- log-probs and the loss sums -------------------------------------------
 * kc_reduce_blocks(T) blocks stride over the tokens; block b writes its
 * fp64 log-prob sum to lsum[b] and its target count to cnt[b] (work: the
 * nb of each, lsum then cnt); one block folds them in a fixed tree. */

extern "C" size_t kc_xent_logprobs_work(int64_t T) {
  return (size_t)kc_reduce_blocks(T) * (sizeof(double) + sizeof(long long));
}

static __global__ void logprobs_kernel(const float *se, const float *tl, const int32_t *y,
                                       int64_t T, float scale, float *logprobs, float *w,
                                       double *lsum, long long *cnt) {
  double s = 0.0;
  long long c = 0;
  for (int64_t t = kc_gtid(); t < T; t += kc_gstride()) {
    bool valid = y[t] >= 0;
    double lp = valid ? (double)tl[t] - log((double)se[t]) : 0.0;
    if (logprobs) logprobs[t] = (float)lp;
    w[t] = valid ? scale : 0.0f;
    s += lp;
    c += valid;
  }
  s = kc_block_reduce(s, 0.0, kc_sum_op());
  c = kc_block_reduce(c, 0LL, kc_sum_op());
  if (threadIdx.x == 0) lsum[blockIdx.x] = s, cnt[blockIdx.x] = c;
}

// sums[0] −= the sum of the nb partial log-prob sums, sums[1] += their targets
static __global__ void logprobs_final(const double *lsum, const long long *cnt, int nb,
                                      double *sums) {
  bool in = (int)threadIdx.x < nb;
  double s = kc_block_reduce(in ? lsum[threadIdx.x] : 0.0, 0.0, kc_sum_op());
  long long c = kc_block_reduce(in ? cnt[threadIdx.x] : 0LL, 0LL, kc_sum_op());
  if (threadIdx.x == 0) sums[0] -= s, sums[1] += (double)c;
}

extern "C" cudaError_t kc_xent_logprobs(cudaStream_t st, const float *se, const float *tl,
                                        const int32_t *y, int64_t T, float scale, float *logprobs,
                                        float *w, double *sums, void *work) {
  if (T <= 0) return cudaSuccess; /* nothing counted: the sums stay */
  int nb = kc_reduce_blocks(T);
  double *lsum = (double *)work;
  long long *cnt = (long long *)(lsum + nb);
  cudaError_t e = KC_LAUNCH(logprobs_kernel, nb, KC_THREADS, 0, st, se, tl, y, T, scale, logprobs,
                            w, lsum, cnt);
  if (e != cudaSuccess) return e;
  return KC_LAUNCH(logprobs_final, 1, KC_RED_BLOCKS, 0, st, lsum, cnt, nb, sums);
}

/* ---- backward -------------------------------------------------------------- */

// dlogits[t, j] = w·(expf(l − mx)·(1/se)), then − w at the target (two roundings,
// as the CPU's separate subtraction); each element read and written by one thread
static __global__ void xent_bwd_kernel(const float *logits, int64_t T, int64_t V, int64_t v0,
                                       const int32_t *y, const float *mx, const float *se,
                                       const float *w, float *dlogits) {
  int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (i >= V) return;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    float m = mx[t], inv = 1.0f / se[t], wt = w[t], v[4];
    int64_t c = shard_col(y[t], v0, V);
    kc_ld4(logits + t * V, i, V, v);
    for (int k = 0; k < 4; k++) {
      v[k] = wt * (expf(v[k] - m) * inv);
      if (i + k == c) v[k] -= wt;
    }
    kc_st4(dlogits + t * V, i, V, v);
  }
}

extern "C" cudaError_t kc_xent_bwd(cudaStream_t st, const float *logits, int64_t T, int64_t V,
                                   int64_t v0, const int32_t *y, const float *mx, const float *se,
                                   const float *w, float *dlogits) {
  if (T <= 0 || V <= 0) return cudaSuccess;
  int64_t cols = (V + 4 * KC_THREADS - 1) / (4 * KC_THREADS);
  if (cols > INT32_MAX) return cudaErrorInvalidValue;
  dim3 grid((unsigned)cols, kc_row_grid(T));
  return KC_LAUNCH(xent_bwd_kernel, grid, KC_THREADS, 0, st, logits, T, V, v0, y, mx, se, w,
                   dlogits);
}
