/* The CUDA backend's vtable (cuda.h): caching pools over cudaMalloc and
 * cudaMallocHost, one compute stream, cudaEvents, the kernels of
 * kernels/cuda and the cuBLASLt GEMM (gemm.c). */
#include "backend/cuda/cuda.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda_arch.h"
#include "backend/pool.h"
#include "common/checked.h"
#include "common/status.h"
#include "kernels/cuda/kernels.h"

/* The small results operators hand to the host (a loss sum and its count,
 * a norm partial, a flag) travel through one device slot and one pinned
 * host slot of this size. */
enum { RESULT_BYTES = 64 };

typedef struct cuda {
  int device;
  cudaStream_t stream;
  ml_pool *pool, *host;
  ml_cuda_gemm *gemm;
  void *result_dev, *result_host;
  cudaEvent_t *events; /* every event ml_be_event_record made, destroyed with the backend */
  size_t n_events, cap_events;
} cuda;

static cuda *impl(ml_backend *be) { return be->impl; }

int ml_cuda_check(int rc, const char *what) {
  if (rc == cudaSuccess) return 0;
  cudaError_t e = (cudaError_t)rc;
  return ml_err("cuda: %s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

int ml_cuda_launched(int rc, const char *op) {
  if (rc == cudaSuccess) return 0;
  const char *kernel = kc_failed_kernel();
  cudaError_t e = (cudaError_t)rc;
  if (!kernel) return ml_cuda_check(rc, op);
  return ml_err("cuda: %s: kernel %s: %s (%s)%s", op, kernel, cudaGetErrorName(e),
                cudaGetErrorString(e),
                getenv("CUDA_LAUNCH_BLOCKING") ? ""
                                               : " (or an earlier kernel's asynchronous error: "
                                                 "CUDA_LAUNCH_BLOCKING=1 tells them apart)");
}

/* ---- memory -------------------------------------------------------------- */

static void *raw_device(void *ctx, size_t bytes) {
  void *p = NULL;
  return cudaMalloc(&p, bytes ? bytes : 1) == cudaSuccess ? p : NULL;
}
static void raw_device_free(void *ctx, void *p) { cudaFree(p); }
static void *raw_pinned(void *ctx, size_t bytes) {
  void *p = NULL;
  return cudaMallocHost(&p, bytes ? bytes : 1) == cudaSuccess ? p : NULL;
}
static void raw_pinned_free(void *ctx, void *p) { cudaFreeHost(p); }

static void *cu_alloc(ml_backend *be, size_t bytes) {
  return ml_pool_alloc(impl(be)->pool, bytes);
}
static void cu_free(ml_backend *be, void *p) { ml_pool_free(impl(be)->pool, p); }
static void *cu_host_alloc(ml_backend *be, size_t bytes) {
  return ml_pool_alloc(impl(be)->host, bytes);
}
static void cu_host_free(ml_backend *be, void *p) { ml_pool_free(impl(be)->host, p); }
/* cudaFree waits for the device, so nothing in flight still uses a block. */
static void cu_trim(ml_backend *be) {
  ml_pool_trim(impl(be)->pool);
  ml_pool_trim(impl(be)->host);
}
static void cu_memory_stats(ml_backend *be, ml_memory_stats *out) {
  ml_pool_stats s = ml_pool_get_stats(impl(be)->pool), h = ml_pool_get_stats(impl(be)->host);
  *out = (ml_memory_stats){s.in_use, s.peak, s.reserved, h.in_use, h.peak,
                           s.raw_allocs, h.raw_allocs};
}
static void cu_reset_peak(ml_backend *be) {
  ml_pool_reset_peak(impl(be)->pool);
  ml_pool_reset_peak(impl(be)->host);
}
/* Pinned host memory is computed on by the CPU backend (kernels/cpu). */
static int cu_host_peer(ml_backend *be, ml_backend **out) {
  return ml_backend_get("cpu", 0, out);
}

/* Scratch for an operator's kernels: freed right after they are enqueued,
 * which is safe because every user of the pool runs on the one compute
 * stream, in order (a later request that reuses the block is enqueued
 * after them). */
static void *scratch(ml_backend *be, size_t bytes, const char *what) {
  return ml_be_alloc(be, (int64_t)(bytes ? bytes : 1), 1, "%s", what);
}

static int cu_sync(ml_backend *be) {
  return ml_cuda_check(cudaStreamSynchronize(impl(be)->stream), "cudaStreamSynchronize");
}

/* H2D and D2H wait for the copy: the host may reuse or read its side as
 * soon as the call returns (backend.h); D2D is only enqueued. */
static int cu_copy(ml_backend *be, void *dst, const void *src, size_t bytes, ml_copy_kind kind) {
  static const enum cudaMemcpyKind k[] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                                          cudaMemcpyDeviceToDevice};
  const char *s = src, *d = dst;
  if (kind == ML_COPY_D2D && d != s && d < s + bytes && s < d + bytes) {
    /* overlapping ranges (memmove's case): cudaMemcpy does not allow them */
    void *tmp = scratch(be, bytes, "an overlapping copy's staging buffer");
    if (!tmp) return -1;
    int rc = cu_copy(be, tmp, src, bytes, kind) || cu_copy(be, dst, tmp, bytes, kind);
    cu_free(be, tmp);
    return rc ? -1 : 0;
  }
  if (kind == ML_COPY_D2D && d == s) return 0;
  ML_TRY(ml_cuda_check(cudaMemcpyAsync(dst, src, bytes, k[kind], impl(be)->stream),
                       "cudaMemcpyAsync"));
  return kind == ML_COPY_D2D ? 0 : cu_sync(be);
}

/* H2D / D2H enqueued only: the caller records an event and syncs it
 * (ml_be_copy_async). */
static int cu_copy_async(ml_backend *be, void *dst, const void *src, size_t bytes,
                         ml_copy_kind kind) {
  enum cudaMemcpyKind k = kind == ML_COPY_H2D ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  return ml_cuda_check(cudaMemcpyAsync(dst, src, bytes, k, impl(be)->stream), "cudaMemcpyAsync");
}

static int cu_copy2d(ml_backend *be, void *dst, size_t dpitch, const void *src, size_t spitch,
                     size_t width, size_t rows) {
  cudaStream_t st = impl(be)->stream;
  const char *s = src, *s_end = s + (rows - 1) * spitch + width;
  char *d = dst, *d_end = d + (rows - 1) * dpitch + width;
  if (d < s_end && s < d_end) {
    /* an in-place compaction: cudaMemcpy2D does not allow overlap, so go
     * through a packed copy of the source rows */
    char *tmp = scratch(be, width * rows, "a copy2d staging buffer");
    if (!tmp) return -1;
    int rc = ml_cuda_check(cudaMemcpy2DAsync(tmp, width, src, spitch, width, rows,
                                             cudaMemcpyDeviceToDevice, st),
                           "cudaMemcpy2DAsync") ||
             ml_cuda_check(cudaMemcpy2DAsync(dst, dpitch, tmp, width, width, rows,
                                             cudaMemcpyDeviceToDevice, st),
                           "cudaMemcpy2DAsync");
    cu_free(be, tmp);
    return rc ? -1 : 0;
  }
  return ml_cuda_check(
      cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, cudaMemcpyDeviceToDevice, st),
      "cudaMemcpy2DAsync");
}

static int cu_zero(ml_backend *be, void *dst, size_t bytes) {
  return ml_cuda_check(cudaMemsetAsync(dst, 0, bytes, impl(be)->stream), "cudaMemsetAsync");
}

static int cu_convert(ml_backend *be, void *dst, ml_dtype dst_type, const void *src,
                      ml_dtype src_type, size_t n) {
  cudaStream_t st = impl(be)->stream;
  if (dst_type == src_type)
    return dst == src ? 0 : cu_copy(be, dst, src, n * ml_dtype_size(src_type), ML_COPY_D2D);
  int64_t len = (int64_t)n;
  if (src_type == ML_F32 && dst_type == ML_BF16)
    return ml_cuda_launched(kc_f32_to_bf16(st, src, dst, len), "convert F32 to BF16");
  if (src_type == ML_BF16 && dst_type == ML_F32)
    return ml_cuda_launched(kc_bf16_to_f32(st, src, dst, len), "convert BF16 to F32");
  if (src_type == ML_F32 && dst_type == ML_F16)
    return ml_cuda_launched(kc_f32_to_f16(st, src, dst, len), "convert F32 to F16");
  if (src_type == ML_F16 && dst_type == ML_F32)
    return ml_cuda_launched(kc_f16_to_f32(st, src, dst, len), "convert F16 to F32");
  return ml_err("convert %s to %s: expected fp32 and BF16 or F16", ml_dtype_name(src_type),
                ml_dtype_name(dst_type));
}

static int cu_scatter_rows(ml_backend *be, void *dst, ml_dtype dst_type, const int32_t *rows,
                           const float *src, int64_t n, int64_t width) {
  return ml_cuda_launched(kc_scatter_rows(impl(be)->stream, dst, dst_type == ML_BF16, rows, src, n,
                                          width),
                          "scatter rows");
}

static int cu_round_bf16(ml_backend *be, float *x, size_t n) {
  return ml_cuda_launched(kc_round_bf16(impl(be)->stream, x, (int64_t)n), "round to bf16");
}
static int cu_round_bf16_to(ml_backend *be, const float *x, float *y, void *y16, size_t n) {
  return ml_cuda_launched(kc_round_bf16_to(impl(be)->stream, x, y, y16, (int64_t)n),
                          "round to bf16 with a bf16 copy");
}

/* ---- ordering ------------------------------------------------------------ */

/* ev->impl: a cudaEvent made on first record and reused after; the
 * backend owns it (destroyed with the backend). */
static int cu_event_record(ml_backend *be, ml_event *ev) {
  cuda *c = impl(be);
  if (!ev->impl) {
    if (c->n_events == c->cap_events) {
      size_t cap = c->cap_events ? 2 * c->cap_events : 16;
      cudaEvent_t *grown = realloc(c->events, cap * sizeof *grown);
      if (!grown) return ml_err("out of memory growing the CUDA event table to %zu", cap);
      c->events = grown;
      c->cap_events = cap;
    }
    cudaEvent_t e;
    ML_TRY(ml_cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                         "cudaEventCreateWithFlags"));
    c->events[c->n_events++] = e;
    ev->impl = e;
  }
  return ml_cuda_check(cudaEventRecord((cudaEvent_t)ev->impl, c->stream), "cudaEventRecord");
}

static int cu_event_wait(ml_backend *be, ml_event *ev) {
  if (!ev->impl) return 0;
  return ml_cuda_check(cudaStreamWaitEvent(impl(be)->stream, (cudaEvent_t)ev->impl, 0),
                       "cudaStreamWaitEvent");
}

static int cu_event_sync(ml_backend *be, ml_event *ev) {
  if (!ev->impl) return 0;
  return ml_cuda_check(cudaEventSynchronize((cudaEvent_t)ev->impl), "cudaEventSynchronize");
}

/* ---- operators ----------------------------------------------------------- */

static int cu_gemm(ml_backend *be, const ml_gemm *g) { return ml_cuda_gemm_run(impl(be)->gemm, g); }
static int64_t cu_gemm_temp(ml_backend *be, const ml_gemm *g) { return ml_cuda_gemm_temp(g); }

static int cu_bias_grad(ml_backend *be, const float *dy, int64_t T, int64_t N, float *db) {
  void *work = scratch(be, kc_bias_grad_work(T, N), "the bias gradient's partial sums");
  if (!work) return -1;
  int rc = ml_cuda_launched(kc_bias_grad(impl(be)->stream, dy, T, N, db, work), "bias_grad");
  cu_free(be, work);
  return rc;
}

static int cu_add(ml_backend *be, float *y, const float *x, int64_t n) {
  return ml_cuda_launched(kc_add(impl(be)->stream, y, x, n), "add");
}

static int cu_add_bf16(ml_backend *be, float *y, const float *x, void *y16, int64_t n) {
  return ml_cuda_launched(kc_add_bf16(impl(be)->stream, y, x, y16, n), "add with a bf16 copy");
}

static int cu_add_grad(ml_backend *be, float *y, const float *x, int64_t n, bool overwrite,
                       bool round) {
  return ml_cuda_launched(kc_add_grad(impl(be)->stream, y, x, n, overwrite, round),
                          "add a reduced gradient");
}

static int cu_add_to(ml_backend *be, float *z, const float *y, const float *x, int64_t n) {
  return ml_cuda_launched(kc_add_to(impl(be)->stream, z, y, x, n), "add into another buffer");
}

static int cu_add_round_to(ml_backend *be, float *z, const float *y, const float *x, void *z16,
                           int64_t n) {
  return ml_cuda_launched(kc_add_round_to(impl(be)->stream, z, y, x, z16, n),
                          "add rounded to bf16");
}

static int cu_scale(ml_backend *be, float *x, int64_t n, float s) {
  return ml_cuda_launched(kc_scale(impl(be)->stream, x, n, s), "scale");
}

/* Norm and embedding weights: fp32 or bf16, read as they are. */
static int weight_type(const char *op, ml_dtype t) {
  if (t == ML_F32 || t == ML_BF16) return 0;
  return ml_err("%s: a %s weight; expected F32 or BF16", op, ml_dtype_name(t));
}

static int cu_rmsnorm_fwd(ml_backend *be, const float *x, const void *w, ml_dtype w_type,
                          float offset, float eps, float *y, float *rstd, int64_t T, int64_t H) {
  ML_TRY(weight_type("rmsnorm", w_type));
  return ml_cuda_launched(
      kc_rmsnorm_fwd(impl(be)->stream, x, w, w_type == ML_BF16, offset, eps, y, rstd, T, H),
      "rmsnorm forward");
}

static int cu_rmsnorm_fwd_bf16(ml_backend *be, const float *x, const void *w, ml_dtype w_type,
                               float offset, float eps, void *y, float *rstd, int64_t T,
                               int64_t H) {
  ML_TRY(weight_type("rmsnorm", w_type));
  return ml_cuda_launched(kc_rmsnorm_fwd_bf16(impl(be)->stream, x, w, w_type == ML_BF16, offset,
                                              eps, y, rstd, T, H),
                          "rmsnorm forward with a bf16 output");
}

static int cu_rmsnorm_bwd(ml_backend *be, const float *dy, const float *x, const void *w,
                          ml_dtype w_type, float offset, const float *rstd, float *dx, float *dw,
                          int64_t T, int64_t H) {
  ML_TRY(weight_type("rmsnorm", w_type));
  void *work = scratch(be, kc_rmsnorm_bwd_work(T, H), "the RMSNorm weight gradient's partials");
  if (!work) return -1;
  int rc = ml_cuda_launched(kc_rmsnorm_bwd(impl(be)->stream, dy, x, w, w_type == ML_BF16, offset,
                                           rstd, dx, dw, T, H, work),
                            "rmsnorm backward");
  cu_free(be, work);
  return rc;
}

/* The tables are the CPU backend's (computed in host memory, which is its
 * device memory), copied up: one definition of RoPE's frequencies. */
static int cu_rope_tables(ml_backend *be, double theta, int64_t hd, const ml_rope_scaling *sc,
                          int64_t seq_len, int64_t S, float *cos_t, float *sin_t) {
  ml_backend *cpu;
  ML_TRY(ml_backend_get("cpu", 0, &cpu));
  int64_t n = ml_mul_sat(S, hd / 2);
  float *t = ml_be_alloc(cpu, ml_mul_sat(n, 2), sizeof(float), "the RoPE tables [2, %lld, %lld]",
                         (long long)S, (long long)(hd / 2));
  if (!t) return -1;
  int rc = ml_be_rope_tables(cpu, theta, hd, sc, seq_len, S, t, t + n) ||
           cu_copy(be, cos_t, t, (size_t)n * sizeof(float), ML_COPY_H2D) ||
           cu_copy(be, sin_t, t + n, (size_t)n * sizeof(float), ML_COPY_H2D);
  ml_be_free(cpu, t);
  return rc ? -1 : 0;
}

static int cu_rope_fwd(ml_backend *be, float *x, const float *c, const float *s, int64_t B,
                       int64_t S, int64_t nh, int64_t hd) {
  return ml_cuda_launched(kc_rope_fwd(impl(be)->stream, x, c, s, B, S, nh, hd), "rope forward");
}

static int cu_rope_fwd_bf16(ml_backend *be, const float *x, void *y, const float *c,
                            const float *s, int64_t B, int64_t S, int64_t nh, int64_t hd) {
  return ml_cuda_launched(kc_rope_fwd_bf16(impl(be)->stream, x, y, c, s, B, S, nh, hd),
                          "rope forward with a bf16 output");
}

static int cu_rope_bwd(ml_backend *be, float *dx, const float *c, const float *s, int64_t B,
                       int64_t S, int64_t nh, int64_t hd) {
  return ml_cuda_launched(kc_rope_bwd(impl(be)->stream, dx, c, s, B, S, nh, hd), "rope backward");
}

static int cu_rope_bwd_bf16(ml_backend *be, const float *dx, void *y, const float *c,
                            const float *s, int64_t B, int64_t S, int64_t nh, int64_t hd) {
  return ml_cuda_launched(kc_rope_bwd_bf16(impl(be)->stream, dx, y, c, s, B, S, nh, hd),
                          "rope backward (bf16 output)");
}

/* FlashAttention-2 saves each query's log-sum-exp [B, nh, S]. */
static int64_t cu_attention_saved(ml_backend *be, int64_t B, int64_t S, int64_t nh) {
  return ml_mul_sat(ml_mul_sat(B, nh), S);
}

static size_t cu_attention_work(ml_backend *be, int64_t B, int64_t S, int64_t nh, int64_t nkv,
                                int64_t hd) {
  return kc_attention_bwd_work(B, S, nh, nkv, hd);
}

static int attention_compute(ml_dtype compute) {
  if (compute == ML_F32 || compute == ML_BF16) return 0;
  return ml_err("attention: compute dtype %s; expected F32 or BF16", ml_dtype_name(compute));
}

/* Attention's scratch from the pool, n bytes (kc_attention_stage_bytes,
 * kc_attention_block_stage_bytes): the bf16 copies of q, k, v (and dout)
 * its tiles are copied from, or a block's paged keys gathered; NULL when
 * n is 0. Freed right after the launch: the pool's next user is
 * stream-ordered after the attention kernels (as the GEMMs' operands,
 * gemm.c). */
static int attention_stage(ml_backend *be, size_t n, int64_t B, int64_t sq, int64_t sk,
                           int64_t nh, int64_t nkv, int64_t hd, bool dout, void **stage) {
  *stage = NULL;
  if (n == 0) return 0;
  if (n > (size_t)INT64_MAX)
    return ml_err("attention: the staged copies of q, k, v of B %lld, %lld queries, %lld keys, "
                  "%lld/%lld heads of %lld overflow 64 bits",
                  (long long)B, (long long)sq, (long long)sk, (long long)nh, (long long)nkv,
                  (long long)hd);
  *stage = ml_be_alloc(be, (int64_t)n, 1, "attention's staged copies of q, k, v%s",
                       dout ? " and dout" : "");
  return *stage ? 0 : -1;
}

static int cu_attention_fwd(ml_backend *be, const float *q, const float *k, const float *v,
                            float *out, float *lse, int64_t B, int64_t S, int64_t nh, int64_t nkv,
                            int64_t hd, float scale, int64_t window, ml_dtype compute) {
  void *stage;
  ML_TRY(attention_compute(compute));
  size_t n = compute == ML_BF16 ? kc_attention_stage_bytes(B, S, nh, nkv, hd, false) : 0;
  ML_TRY(attention_stage(be, n, B, S, S, nh, nkv, hd, false, &stage));
  int rc = ml_cuda_launched(kc_attention_fwd(impl(be)->stream, q, k, v, out, lse, B, S, nh, nkv,
                                             hd, scale, window, compute == ML_BF16, stage),
                            "attention forward");
  ml_be_free(be, stage);
  return rc;
}

static int cu_attention_bwd(ml_backend *be, const float *dout, const float *q, const float *k,
                            const float *v, const float *out, const float *lse, float *dq,
                            float *dk, float *dv, int64_t B, int64_t S, int64_t nh, int64_t nkv,
                            int64_t hd, float scale, int64_t window, ml_dtype compute,
                            void *work) {
  void *stage;
  ML_TRY(attention_compute(compute));
  size_t n = compute == ML_BF16 ? kc_attention_stage_bytes(B, S, nh, nkv, hd, true) : 0;
  ML_TRY(attention_stage(be, n, B, S, S, nh, nkv, hd, true, &stage));
  int rc = ml_cuda_launched(kc_attention_bwd(impl(be)->stream, dout, q, k, v, out, lse, dq, dk, dv,
                                             B, S, nh, nkv, hd, scale, window, compute == ML_BF16,
                                             work, stage),
                            "attention backward");
  ml_be_free(be, stage);
  return rc;
}

/* backend.h's ml_attn_block as the kernels take it (the same fields) */
static kc_attn_block kc_block(const ml_attn_block *b) {
  return (kc_attn_block){.B = b->B, .sq = b->sq, .sk = b->sk, .nh = b->nh, .nkv = b->nkv,
                         .hd = b->hd, .q_pos = b->q_pos, .k_pos = b->k_pos, .q_bs = b->q_bs,
                         .k_bs = b->k_bs, .l_bs = b->l_bs, .scale = b->scale,
                         .window = b->window, .group = b->group, .head_off = b->head_off,
                         .kv_table = b->kv_table, .kv_block = b->kv_block,
                         .table_bs = b->table_bs, .kv_bf16 = b->kv_bf16,
                         .out_bf16 = b->out_bf16, .qkv_bf16 = b->qkv_bf16,
                         .bwd_overwrite = b->bwd_overwrite};
}

/* A block call's kernel arguments *b and its stage (attention_stage). */
static int block_begin(ml_backend *be, const ml_attn_block *blk, ml_dtype compute, bool dout,
                       kc_attn_block *b, void **stage) {
  ML_TRY(attention_compute(compute));
  *b = kc_block(blk);
  return attention_stage(be, kc_attention_block_stage_bytes(b, compute == ML_BF16, dout), b->B,
                         b->sq, b->sk, b->nh, b->nkv, b->hd, dout, stage);
}

static int cu_attention_block_fwd(ml_backend *be, const ml_attn_block *blk, const float *q,
                                  const float *k, const float *v, float *out, float *lse,
                                  bool accumulate, ml_dtype compute) {
  kc_attn_block b;
  void *stage;
  ML_TRY(block_begin(be, blk, compute, false, &b, &stage));
  int rc = ml_cuda_launched(kc_attention_block_fwd(impl(be)->stream, &b, q, k, v, out, lse,
                                                   accumulate, compute == ML_BF16, stage),
                            "block attention forward");
  ml_be_free(be, stage);
  return rc;
}

static size_t cu_attention_block_work(ml_backend *be, const ml_attn_block *blk) {
  kc_attn_block b = kc_block(blk);
  return kc_attention_block_work(&b);
}

static int cu_attention_block_bwd(ml_backend *be, const ml_attn_block *blk, const float *dout,
                                  const float *q, const float *k, const float *v,
                                  const float *out, const float *lse, float *dq, float *dk,
                                  float *dv, ml_dtype compute, void *work) {
  kc_attn_block b;
  void *stage;
  ML_TRY(block_begin(be, blk, compute, true, &b, &stage));
  int rc = ml_cuda_launched(kc_attention_block_bwd(impl(be)->stream, &b, dout, q, k, v, out, lse,
                                                   dq, dk, dv, compute == ML_BF16, work, stage),
                            "block attention backward");
  ml_be_free(be, stage);
  return rc;
}

static int cu_glu_fwd(ml_backend *be, const float *g, const float *u, float *h, int64_t n,
                      ml_glu_act act) {
  return ml_cuda_launched(kc_glu_fwd(impl(be)->stream, g, u, h, n, act), "glu forward");
}

static int cu_glu_bwd(ml_backend *be, const float *dh, const float *g, const float *u, float *dg,
                      float *du, int64_t n, ml_glu_act act) {
  return ml_cuda_launched(kc_glu_bwd(impl(be)->stream, dh, g, u, dg, du, n, act), "glu backward");
}

static int cu_glu_fwd_bf16(ml_backend *be, const void *g, const void *u, void *h,
                           ml_dtype h_type, int64_t n, ml_glu_act act) {
  return ml_cuda_launched(kc_glu_fwd_bf16(impl(be)->stream, g, u, h, h_type == ML_BF16, n, act),
                          "glu forward (bf16 inputs)");
}

static int cu_glu_bwd_bf16(ml_backend *be, const float *dh, const void *g, const void *u,
                           void *dg, void *du, ml_dtype d_type, int64_t n, ml_glu_act act) {
  return ml_cuda_launched(kc_glu_bwd_bf16(impl(be)->stream, dh, g, u, dg, du, d_type == ML_BF16,
                                          n, act),
                          "glu backward (bf16 inputs)");
}

static int cu_embedding_fwd(ml_backend *be, const int32_t *ids, int64_t T, const void *W,
                            ml_dtype w_type, int64_t row0, int64_t rows, int64_t H, float scale,
                            float *out) {
  ML_TRY(weight_type("embedding", w_type));
  return ml_cuda_launched(
      kc_embedding_fwd(impl(be)->stream, ids, T, W, w_type == ML_BF16, row0, rows, H, scale, out),
      "embedding forward");
}

static int cu_embedding_bwd(ml_backend *be, const int32_t *ids, int64_t T, const float *dout,
                            int64_t row0, int64_t rows, int64_t H, float scale, float *dW) {
  void *work = scratch(be, kc_embedding_bwd_work(T), "the embedding backward's token order");
  if (!work) return -1;
  int rc = ml_cuda_launched(
      kc_embedding_bwd(impl(be)->stream, ids, T, dout, row0, rows, H, scale, dW, work),
      "embedding backward");
  cu_free(be, work);
  return rc;
}

static int cu_xent_rowmax(ml_backend *be, const float *logits, int64_t T, int64_t V, float *mx) {
  return ml_cuda_launched(kc_xent_rowmax(impl(be)->stream, logits, T, V, mx),
                          "cross-entropy row max");
}

static int cu_xent_sumexp_target(ml_backend *be, const float *logits, int64_t T, int64_t V,
                                 int64_t v0, const int32_t *y, const float *mx, float *se,
                                 float *tl) {
  return ml_cuda_launched(kc_xent_sumexp_target(impl(be)->stream, logits, T, V, v0, y, mx, se, tl),
                          "cross-entropy sum of exponentials");
}

static int cu_xent_online(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                          const int32_t *y, float *mx, float *se, float *tl) {
  return ml_cuda_launched(kc_xent_online(impl(be)->stream, logits, T, V, v0, y, mx, se, tl),
                          "cross-entropy online log-sum-exp");
}

static int cu_xent_rebase(ml_backend *be, int64_t T, int64_t V, int64_t v0, const int32_t *y,
                          const float *mx, const float *M, float *se, float *tl) {
  return ml_cuda_launched(kc_xent_rebase(impl(be)->stream, T, V, v0, y, mx, M, se, tl),
                          "cross-entropy rebase");
}

/* The result slot's `bytes` to the host, after the stream has run. */
static int fetch_result(ml_backend *be, size_t bytes) {
  cuda *c = impl(be);
  ML_TRY(ml_cuda_check(cudaMemcpyAsync(c->result_host, c->result_dev, bytes,
                                       cudaMemcpyDeviceToHost, c->stream),
                       "cudaMemcpyAsync"));
  return cu_sync(be);
}

static int cu_xent_logprobs(ml_backend *be, const float *se, const float *tl, const int32_t *y,
                            int64_t T, float scale, float *logprobs, float *w, double *sums) {
  cuda *c = impl(be);
  void *work = scratch(be, kc_xent_logprobs_work(T), "the log-probs' partial sums");
  if (!work) return -1;
  int rc = ml_cuda_launched(kc_xent_logprobs(c->stream, se, tl, y, T, scale, logprobs, w, sums, work),
                            "cross-entropy log-probs");
  cu_free(be, work);
  return rc;
}

static int cu_xent_bwd(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                       const int32_t *y, const float *mx, const float *se, const float *w,
                       float *dlogits) {
  return ml_cuda_launched(kc_xent_bwd(impl(be)->stream, logits, T, V, v0, y, mx, se, w, dlogits),
                          "cross-entropy backward");
}

static int cu_xent_entropy_sum(ml_backend *be, const float *logits, int64_t T, int64_t V,
                               const float *mx, float *sl) {
  return ml_cuda_launched(kc_xent_entropy_sum(impl(be)->stream, logits, T, V, mx, sl),
                          "entropy sum");
}

static int cu_xent_entropy_online(ml_backend *be, const float *logits, int64_t T, int64_t V,
                                  const float *mx, const float *se, float *sl) {
  return ml_cuda_launched(kc_xent_entropy_online(impl(be)->stream, logits, T, V, mx, se, sl),
                          "entropy online sum");
}

static int cu_xent_entropy_rebase(ml_backend *be, int64_t T, const float *mx, const float *M,
                                  const float *se, float *sl) {
  return ml_cuda_launched(kc_xent_entropy_rebase(impl(be)->stream, T, mx, M, se, sl),
                          "entropy rebase");
}

static int cu_xent_entropy(ml_backend *be, const float *se, const float *sl, int64_t T,
                           float *ent) {
  return ml_cuda_launched(kc_xent_entropy(impl(be)->stream, se, sl, T, ent), "entropy");
}

static int cu_xent_topk_clear(ml_backend *be, int64_t T, int64_t k, float *val, int32_t *id) {
  return ml_cuda_launched(kc_xent_topk_clear(impl(be)->stream, T, k, val, id), "top-k clear");
}

static int cu_xent_topk_online(ml_backend *be, const float *logits, int64_t T, int64_t V,
                               int64_t v0, int64_t k, float *val, int32_t *id) {
  return ml_cuda_launched(kc_xent_topk_online(impl(be)->stream, logits, T, V, v0, k, val, id),
                          "top-k of a tile");
}

static int cu_xent_topk_merge(ml_backend *be, int64_t P, int64_t T, int64_t k, const float *cval,
                              const int32_t *cid, float *val, int32_t *id) {
  return ml_cuda_launched(kc_xent_topk_merge(impl(be)->stream, P, T, k, cval, cid, val, id),
                          "top-k merge");
}

static int cu_xent_topk_logprobs(ml_backend *be, int64_t T, int64_t k, const float *M,
                                 const float *se, const float *val, const int32_t *id, float *lp) {
  return ml_cuda_launched(kc_xent_topk_logprobs(impl(be)->stream, T, k, M, se, val, id, lp),
                          "top-k log-probs");
}

static int cu_xent_bwd_entropy(ml_backend *be, const float *logits, int64_t T, int64_t V,
                               int64_t v0, const int32_t *y, const float *mx, const float *se,
                               const float *w, const float *H, const float *ew, float *dlogits) {
  return ml_cuda_launched(
      kc_xent_bwd_entropy(impl(be)->stream, logits, T, V, v0, y, mx, se, w, H, ew, dlogits),
      "entropy bonus backward");
}

static int cu_adamw(ml_backend *be, float *p, float *g, float *m, float *v, uint16_t *p_bf16,
                    int64_t n, float grad_scale, double lr, double b1, double b2, double eps,
                    double wd, int64_t step) {
  return ml_cuda_launched(
      kc_adamw(impl(be)->stream, p, g, m, v, p_bf16, n, grad_scale, lr, b1, b2, eps, wd, step),
      "AdamW");
}

static int cu_norm_partial(ml_backend *be, const float *g, int64_t n, ml_norm_kind kind,
                           double *out) {
  cuda *c = impl(be);
  void *work = scratch(be, kc_reduce_work(n), "the grad-norm partial sums");
  if (!work) return -1;
  cudaError_t e = kind == ML_NORM_ABSMAX ? kc_absmax(c->stream, g, n, c->result_dev, work)
                                         : kc_sumsq(c->stream, g, n, c->result_dev, work);
  cu_free(be, work);
  ML_TRY(ml_cuda_launched(e, "grad-norm partial") || fetch_result(be, sizeof(double)));
  memcpy(out, c->result_host, sizeof *out);
  return 0;
}

/* Pieces in groups of PARTS_GROUP (kc_norm_segs' arrays on the stack), no
 * stream sync: the results stay on the device until the caller copies them. */
enum { PARTS_GROUP = 64 };
static int cu_norm_partials(ml_backend *be, const ml_norm_seg *segs, int k, ml_norm_kind kind,
                            double *out) {
  for (int at = 0; at < k; at += PARTS_GROUP) {
    int m = k - at < PARTS_GROUP ? k - at : PARTS_GROUP;
    const float *g[PARTS_GROUP];
    int64_t n[PARTS_GROUP];
    for (int s = 0; s < m; s++) {
      g[s] = segs[at + s].g;
      n[s] = segs[at + s].n;
    }
    void *work = scratch(be, kc_norm_segs_work(n, m), "the grad-norm partials' block sums");
    if (!work) return -1;
    cudaError_t e = kc_norm_segs(impl(be)->stream, g, n, m, kind == ML_NORM_ABSMAX, out + at, work);
    cu_free(be, work);
    ML_TRY(ml_cuda_launched(e, "grad-norm partials"));
  }
  return 0;
}

static int cu_find_nonfinite(ml_backend *be, const float *g, int64_t n, bool *found) {
  cuda *c = impl(be);
  void *work = scratch(be, kc_reduce_work(n), "the non-finite search's partials");
  if (!work) return -1;
  cudaError_t e = kc_has_nonfinite(c->stream, g, n, c->result_dev, work);
  cu_free(be, work);
  ML_TRY(ml_cuda_launched(e, "non-finite search") || fetch_result(be, sizeof(int)));
  int flag;
  memcpy(&flag, c->result_host, sizeof flag);
  *found = flag != 0;
  return 0;
}

static void cu_destroy(ml_backend *be) {
  if (!be) return;
  cuda *c = impl(be);
  if (c) {
    if (c->stream) cudaStreamSynchronize(c->stream);
    ml_cuda_gemm_destroy(c->gemm);
    ml_pool_destroy(c->pool);
    ml_pool_destroy(c->host);
    if (c->result_dev) cudaFree(c->result_dev);
    if (c->result_host) cudaFreeHost(c->result_host);
    for (size_t i = 0; i < c->n_events; i++) cudaEventDestroy(c->events[i]);
    free(c->events);
    if (c->stream) cudaStreamDestroy(c->stream);
    free(c);
  }
  free(be);
}

static const ml_backend_ops k_cuda_ops = {
    .name = "cuda",
    .host_memory = false,
    /* no varlen attention: packed documents run a block per document */
    .supports = ML_OPS_ALL & ~ML_OP_BIT(ML_OP_BATCH_INVARIANT) &
                ~ML_OP_BIT(ML_OP_ATTENTION_VARLEN),
    .alloc = cu_alloc,
    .free = cu_free,
    .host_alloc = cu_host_alloc,
    .host_free = cu_host_free,
    .copy = cu_copy,
    .copy_async = cu_copy_async,
    .zero = cu_zero,
    .copy2d = cu_copy2d,
    .convert = cu_convert,
    .scatter_rows = cu_scatter_rows,
    .round_bf16 = cu_round_bf16,
    .round_bf16_to = cu_round_bf16_to,
    .trim = cu_trim,
    .memory_stats = cu_memory_stats,
    .reset_peak = cu_reset_peak,
    .event_record = cu_event_record,
    .event_wait = cu_event_wait,
    .event_sync = cu_event_sync,
    .host_peer = cu_host_peer,
    .sync = cu_sync,
    .gemm = cu_gemm,
    .gemm_temp = cu_gemm_temp,
    .bias_grad = cu_bias_grad,
    .add = cu_add,
    .add_bf16 = cu_add_bf16,
    .add_grad = cu_add_grad,
    .add_to = cu_add_to,
    .add_round_to = cu_add_round_to,
    .scale = cu_scale,
    .rmsnorm_fwd = cu_rmsnorm_fwd,
    .rmsnorm_bwd = cu_rmsnorm_bwd,
    .rmsnorm_fwd_bf16 = cu_rmsnorm_fwd_bf16,
    .rope_tables = cu_rope_tables,
    .rope_fwd = cu_rope_fwd,
    .rope_bwd = cu_rope_bwd,
    .rope_fwd_bf16 = cu_rope_fwd_bf16,
    .rope_bwd_bf16 = cu_rope_bwd_bf16,
    .attention_saved = cu_attention_saved,
    .attention_work = cu_attention_work,
    .attention_fwd = cu_attention_fwd,
    .attention_bwd = cu_attention_bwd,
    .attention_block_fwd = cu_attention_block_fwd,
    .attention_block_work = cu_attention_block_work,
    .attention_block_bwd = cu_attention_block_bwd,
    .glu_fwd = cu_glu_fwd,
    .glu_bwd = cu_glu_bwd,
    .glu_fwd_bf16 = cu_glu_fwd_bf16,
    .glu_bwd_bf16 = cu_glu_bwd_bf16,
    .embedding_fwd = cu_embedding_fwd,
    .embedding_bwd = cu_embedding_bwd,
    .xent_rowmax = cu_xent_rowmax,
    .xent_sumexp_target = cu_xent_sumexp_target,
    .xent_online = cu_xent_online,
    .xent_rebase = cu_xent_rebase,
    .xent_logprobs = cu_xent_logprobs,
    .xent_bwd = cu_xent_bwd,
    .xent_entropy_sum = cu_xent_entropy_sum,
    .xent_entropy_online = cu_xent_entropy_online,
    .xent_entropy_rebase = cu_xent_entropy_rebase,
    .xent_entropy = cu_xent_entropy,
    .xent_topk_clear = cu_xent_topk_clear,
    .xent_topk_online = cu_xent_topk_online,
    .xent_topk_merge = cu_xent_topk_merge,
    .xent_topk_logprobs = cu_xent_topk_logprobs,
    .xent_bwd_entropy = cu_xent_bwd_entropy,
    .adamw = cu_adamw,
    .norm_partial = cu_norm_partial,
    .find_nonfinite = cu_find_nonfinite,
    .norm_partials = cu_norm_partials,
    .destroy = cu_destroy,
};

void *ml_cuda_stream(const ml_backend *be) {
  return be->ops == &k_cuda_ops ? ((const cuda *)be->impl)->stream : NULL;
}

int ml_cuda_device(const ml_backend *be) {
  return be->ops == &k_cuda_ops ? ((const cuda *)be->impl)->device : -1;
}

/* The device this process drives (cuda.h). */
static int pick_device(int local_rank, int *device) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count < 1)
    return ml_err("device 'cuda': no CUDA GPU is visible (cudaGetDeviceCount: %s); expected an "
                  "NVIDIA GPU with a driver for CUDA 13",
                  e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
  *device = local_rank > 0 ? local_rank % count : 0;
  struct cudaDeviceProp prop;
  ML_TRY(ml_cuda_check(cudaGetDeviceProperties(&prop, *device), "cudaGetDeviceProperties"));
  int covered = ml_cuda_arch_covers(ML_CUDA_ARCHS, prop.major, prop.minor);
  if (covered < 0) return -1;
  if (!covered)
    return ml_err("device 'cuda': GPU %d (%s) has compute capability %d.%d, which this build has "
                  "no code for: its kernels were built for CUDA architectures %s "
                  "(CMAKE_CUDA_ARCHITECTURES; rebuild with one that covers sm_%d%d)",
                  *device, prop.name, prop.major, prop.minor, ML_CUDA_ARCHS, prop.major,
                  prop.minor);
  return ml_cuda_check(cudaSetDevice(*device), "cudaSetDevice");
}

int ml_backend_cuda_create(int local_rank, ml_backend **out) {
  int device;
  ML_TRY(pick_device(local_rank, &device));
  ml_backend *be = ml_calloc(1, sizeof *be, "the CUDA backend");
  cuda *c = ml_calloc(1, sizeof *c, "the CUDA backend");
  if (!be || !c) {
    free(be);
    free(c);
    return -1;
  }
  be->ops = &k_cuda_ops;
  be->impl = c;
  c->device = device;
  int rc = ml_cuda_check(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking),
                         "cudaStreamCreateWithFlags");
  if (rc == 0) {
    c->pool = ml_pool_create((ml_pool_raw){raw_device, raw_device_free, NULL});
    c->host = ml_pool_create((ml_pool_raw){raw_pinned, raw_pinned_free, NULL});
    if (!c->pool || !c->host) rc = ml_err("out of memory creating the CUDA backend's pools");
  }
  if (rc == 0)
    rc = ml_cuda_check(cudaMalloc(&c->result_dev, RESULT_BYTES), "cudaMalloc") ||
         ml_cuda_check(cudaMallocHost(&c->result_host, RESULT_BYTES), "cudaMallocHost");
  if (rc == 0) rc = ml_cuda_gemm_create(be, c->stream, &c->gemm);
  if (rc != 0) {
    cu_destroy(be);
    return -1;
  }
  *out = be;
  return 0;
}
