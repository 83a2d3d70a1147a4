/* Per-token top-k of the logits over vocab shards and column tiles,
 * semantics of kernels/cpu/xent_topk.c (best first: larger logit, of equal
 * logits the lower global id; empty entries −inf, id −1; NaNs skipped).
 * One thread per token (grid-stride) keeps its list in val, id and scans
 * its row — simple and exact, not fast: the rows are not read coalesced
 * (a scoring path, not the training step's). */
#include <math.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

// whether (v, i) goes before the entry (w, j)
static __device__ __forceinline__ bool better(float v, int32_t i, float w, int32_t j) {
  return j < 0 || v > w || (v == w && i < j);
}

// (v, i) into the sorted list val, id [k] where it belongs, the last entry dropped
static __device__ void insert(float v, int32_t i, int64_t k, float *val, int32_t *id) {
  if (k == 0 || !better(v, i, val[k - 1], id[k - 1])) return;
  int64_t p = k - 1;
  for (; p > 0 && better(v, i, val[p - 1], id[p - 1]); p--) {
    val[p] = val[p - 1];
    id[p] = id[p - 1];
  }
  val[p] = v;
  id[p] = i;
}

static __global__ void topk_clear_kernel(int64_t n, float *val, int32_t *id) {
  for (int64_t i = kc_gtid(); i < n; i += kc_gstride()) val[i] = -INFINITY, id[i] = -1;
}

static __global__ void topk_online_kernel(const float *logits, int64_t T, int64_t V, int64_t v0,
                                          int64_t k, float *val, int32_t *id) {
  for (int64_t t = kc_gtid(); t < T; t += kc_gstride()) {
    const float *l = logits + t * V;
    for (int64_t j = 0; j < V; j++)
      if (!isnan(l[j])) insert(l[j], (int32_t)(v0 + j), k, val + t * k, id + t * k);
  }
}

static __global__ void topk_merge_kernel(int64_t P, int64_t T, int64_t k, const float *cval,
                                         const int32_t *cid, float *val, int32_t *id) {
  for (int64_t t = kc_gtid(); t < T; t += kc_gstride()) {
    for (int64_t j = 0; j < k; j++) val[t * k + j] = -INFINITY, id[t * k + j] = -1;
    for (int64_t p = 0; p < P; p++)
      for (int64_t j = 0; j < k; j++) {
        int64_t c = (p * T + t) * k + j;
        if (cid[c] >= 0) insert(cval[c], cid[c], k, val + t * k, id + t * k);
      }
  }
}

static __global__ void topk_logprobs_kernel(int64_t T, int64_t k, const float *M, const float *se,
                                            const float *val, const int32_t *id, float *lp) {
  for (int64_t c = kc_gtid(); c < T * k; c += kc_gstride()) {
    int64_t t = c / k;
    float d = val[c] - M[t];
    lp[c] = id[c] >= 0 ? (float)((double)d - log((double)se[t])) : -INFINITY;
  }
}

extern "C" cudaError_t kc_xent_topk_clear(cudaStream_t st, int64_t T, int64_t k, float *val,
                                          int32_t *id) {
  if (T <= 0 || k <= 0) return cudaSuccess;
  return KC_LAUNCH(topk_clear_kernel, kc_reduce_blocks(T * k), KC_THREADS, 0, st, T * k, val, id);
}

extern "C" cudaError_t kc_xent_topk_online(cudaStream_t st, const float *logits, int64_t T,
                                           int64_t V, int64_t v0, int64_t k, float *val,
                                           int32_t *id) {
  if (T <= 0 || k <= 0) return cudaSuccess;
  return KC_LAUNCH(topk_online_kernel, kc_reduce_blocks(T), KC_THREADS, 0, st, logits, T, V, v0, k,
                   val, id);
}

extern "C" cudaError_t kc_xent_topk_merge(cudaStream_t st, int64_t P, int64_t T, int64_t k,
                                          const float *cval, const int32_t *cid, float *val,
                                          int32_t *id) {
  if (T <= 0 || k <= 0) return cudaSuccess;
  return KC_LAUNCH(topk_merge_kernel, kc_reduce_blocks(T), KC_THREADS, 0, st, P, T, k, cval, cid,
                   val, id);
}

extern "C" cudaError_t kc_xent_topk_logprobs(cudaStream_t st, int64_t T, int64_t k,
                                             const float *M, const float *se, const float *val,
                                             const int32_t *id, float *lp) {
  if (T <= 0 || k <= 0) return cudaSuccess;
  return KC_LAUNCH(topk_logprobs_kernel, kc_reduce_blocks(T * k), KC_THREADS, 0, st, T, k, M, se,
                   val, id, lp);
}
