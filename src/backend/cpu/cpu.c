/* The CPU backend's vtable: memory from caching pools over malloc
 * (device = host memory; one pool for "device" tensors, one for host
 * staging, so the device's byte counts are those of the tensors),
 * synchronous ordering, and the operators of kernels/cpu, plus oneDNN's
 * matmul for the GEMM (gemm.c). */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "backend/pool.h"
#include "common/checked.h"
#include "common/status.h"
#include "kernels/cpu/kernels.h"

typedef struct cpu {
  ml_pool *pool, *host;
  ml_cpu_gemm *gemm;
  /* the attention kernels' per-thread tiles (k_attention_tile_floats),
   * kept like the GEMM's: a fixed per-process scratch, not the pool's */
  float *tiles;
  int64_t tiles_cap;
  bool invariant; /* ml_be_set_batch_invariant */
} cpu;

static cpu *impl(ml_backend *be) { return be->impl; }

/* ---- memory -------------------------------------------------------------- */

static void *raw_malloc(void *ctx, size_t bytes) { return malloc(bytes ? bytes : 1); }
static void raw_free(void *ctx, void *p) { free(p); }

static void *cpu_alloc(ml_backend *be, size_t bytes) {
  return ml_pool_alloc(impl(be)->pool, bytes);
}
static void cpu_free(ml_backend *be, void *p) { ml_pool_free(impl(be)->pool, p); }
static void *cpu_host_alloc(ml_backend *be, size_t bytes) {
  return ml_pool_alloc(impl(be)->host, bytes);
}
static void cpu_host_free(ml_backend *be, void *p) { ml_pool_free(impl(be)->host, p); }
static void cpu_trim(ml_backend *be) {
  ml_pool_trim(impl(be)->pool);
  ml_pool_trim(impl(be)->host);
}
static void cpu_memory_stats(ml_backend *be, ml_memory_stats *out) {
  ml_pool_stats s = ml_pool_get_stats(impl(be)->pool), h = ml_pool_get_stats(impl(be)->host);
  *out = (ml_memory_stats){s.in_use, s.peak, s.reserved, h.in_use, h.peak,
                           s.raw_allocs, h.raw_allocs};
}
static void cpu_reset_peak(ml_backend *be) {
  ml_pool_reset_peak(impl(be)->pool);
  ml_pool_reset_peak(impl(be)->host);
}
/* Its own memory is host memory: it computes on it. */
static int cpu_host_peer(ml_backend *be, ml_backend **out) {
  *out = be;
  return 0;
}

/* Memory passes over large buffers (FSDP's parameter and gradient
 * staging, residual copies) run in chunks on every OpenMP thread: one core
 * streams well below the memory bandwidth. */
enum { PASS_CHUNK = 1 << 18 /* bytes per task */, PASS_MIN = 4 * PASS_CHUNK };

static inline size_t chunk_len(size_t at, size_t n, size_t chunk) {
  return n - at < chunk ? n - at : chunk;
}

static int cpu_copy(ml_backend *be, void *dst, const void *src, size_t bytes, ml_copy_kind kind) {
  const char *s = src;
  char *d = dst;
  if (bytes < PASS_MIN || (d < s + bytes && s < d + bytes)) { /* small, or overlapping */
    memmove(dst, src, bytes); /* host and device are one memory */
    return 0;
  }
#pragma omp parallel for
  for (size_t at = 0; at < bytes; at += PASS_CHUNK)
    memcpy(d + at, s + at, chunk_len(at, bytes, PASS_CHUNK));
  return 0;
}

static int cpu_copy2d(ml_backend *be, void *dst, size_t dpitch, const void *src, size_t spitch,
                      size_t width, size_t rows) {
  for (size_t i = 0; i < rows; i++)
    memmove((char *)dst + i * dpitch, (const char *)src + i * spitch, width);
  return 0;
}

static int cpu_zero(ml_backend *be, void *dst, size_t bytes) {
  char *d = dst;
#pragma omp parallel for if (bytes >= PASS_MIN)
  for (size_t at = 0; at < bytes; at += PASS_CHUNK)
    memset(d + at, 0, chunk_len(at, bytes, PASS_CHUNK));
  return 0;
}

static int cpu_convert(ml_backend *be, void *dst, ml_dtype dst_type, const void *src,
                       ml_dtype src_type, size_t n) {
  if (dst_type == src_type) return cpu_copy(be, dst, src, n * ml_dtype_size(src_type), ML_COPY_D2D);
  ml_dtype other = src_type == ML_F32 ? dst_type : src_type;
  if ((src_type != ML_F32 && dst_type != ML_F32) || (other != ML_BF16 && other != ML_F16))
    return ml_err("convert %s to %s: expected fp32 and BF16 or F16", ml_dtype_name(src_type),
                  ml_dtype_name(dst_type));
  size_t chunk = PASS_CHUNK / sizeof(float), ds = ml_dtype_size(dst_type),
         ss = ml_dtype_size(src_type);
#pragma omp parallel for if (n * sizeof(float) >= PASS_MIN)
  for (size_t at = 0; at < n; at += chunk) { /* cannot fail: the types are checked */
    void *d = (char *)dst + at * ds;
    const void *s = (const char *)src + at * ss;
    size_t len = chunk_len(at, n, chunk);
    if (src_type == ML_F32) ml_convert_from_f32(dst_type, s, d, len);
    else ml_convert_to_f32(src_type, s, d, len);
  }
  return 0;
}

static int cpu_scatter_rows(ml_backend *be, void *dst, ml_dtype dst_type, const int32_t *rows,
                            const float *src, int64_t n, int64_t width) {
  size_t w = (size_t)width, ds = ml_dtype_size(dst_type);
  for (int64_t r = 0; r < n; r++) { /* a step's new rows: a few KiB, one thread */
    void *d = (char *)dst + (size_t)rows[r] * w * ds;
    if (dst_type == ML_F32) memcpy(d, src + (size_t)r * w, w * sizeof(float));
    else ml_convert_from_f32(dst_type, src + (size_t)r * w, d, w);
  }
  return 0;
}

static int cpu_round_bf16(ml_backend *be, float *x, size_t n) {
  ml_round_bf16(x, n);
  return 0;
}

static int cpu_round_bf16_to(ml_backend *be, const float *x, float *y, void *y16, size_t n) {
  k_round_bf16_to(x, y, y16, (int64_t)n);
  return 0;
}

/* ---- ordering: every call has completed when it returns ------------------ */

static int cpu_event_record(ml_backend *be, ml_event *ev) {
  ev->impl = NULL;
  return 0;
}
static int cpu_event_wait(ml_backend *be, ml_event *ev) { return 0; }
static int cpu_event_sync(ml_backend *be, ml_event *ev) { return 0; }
static int cpu_sync(ml_backend *be) { return 0; }

/* ---- operators ----------------------------------------------------------- */

static int cpu_gemm(ml_backend *be, const ml_gemm *g) { return ml_cpu_gemm_run(impl(be)->gemm, g); }
static int64_t cpu_gemm_temp(ml_backend *be, const ml_gemm *g) {
  return ml_cpu_gemm_temp(impl(be)->gemm, g);
}
static int cpu_gemm_temp_blocks(ml_backend *be, const ml_gemm *g,
                                int64_t bytes[ML_GEMM_TEMP_BLOCKS]) {
  return ml_cpu_gemm_temp_blocks(impl(be)->gemm, g, bytes);
}
/* the emulation reads fp32 operands (gemm.c operand) */
static bool cpu_gemm_exact_in_place(ml_backend *be) {
  return !ml_cpu_gemm_bf16_native(impl(be)->gemm);
}

static int cpu_bias_grad(ml_backend *be, const float *dy, int64_t T, int64_t N, float *db) {
  k_bias_grad(dy, T, N, db);
  return 0;
}

static int cpu_add(ml_backend *be, float *y, const float *x, int64_t n) {
  k_add(y, x, n);
  return 0;
}

static int cpu_add_grad(ml_backend *be, float *y, const float *x, int64_t n, bool overwrite,
                        bool round) {
  k_add_grad(y, x, n, overwrite, round);
  return 0;
}

static int cpu_add_bf16(ml_backend *be, float *y, const float *x, void *y16, int64_t n) {
  k_add_bf16(y, x, y16, n);
  return 0;
}

static int cpu_add_to(ml_backend *be, float *z, const float *y, const float *x, int64_t n) {
  k_add_to(z, y, x, n);
  return 0;
}

static int cpu_add_round_to(ml_backend *be, float *z, const float *y, const float *x, void *z16,
                            int64_t n) {
  k_add_round_to(z, y, x, z16, n);
  return 0;
}

static int cpu_scale(ml_backend *be, float *x, int64_t n, float s) {
  k_scale(x, n, s);
  return 0;
}

/* A norm weight as fp32: itself, or widened into pool scratch (*tmp). */
static int weight_f32(ml_backend *be, const void *w, ml_dtype type, int64_t n, const float **out,
                      float **tmp) {
  *tmp = NULL;
  *out = w;
  if (type == ML_F32) return 0;
  *tmp = ml_be_alloc(be, n, sizeof(float), "a widened norm weight [%lld]", (long long)n);
  if (!*tmp) return -1;
  ML_TRY(ml_convert_to_f32(type, w, *tmp, (size_t)n));
  *out = *tmp;
  return 0;
}

// the RMSNorm forward into y (fp32) or, y16 non-NULL, into y16 (bf16) on w as fp32
static int rmsnorm_fwd(ml_backend *be, const float *x, const void *w, ml_dtype w_type,
                       float offset, float eps, float *y, uint16_t *y16, float *rstd, int64_t T,
                       int64_t H) {
  const float *wf;
  float *tmp;
  ML_TRY(weight_f32(be, w, w_type, H, &wf, &tmp));
  if (y16) k_rmsnorm_fwd_bf16(x, wf, offset, eps, y16, rstd, T, H);
  else k_rmsnorm_fwd(x, wf, offset, eps, y, rstd, T, H);
  cpu_free(be, tmp);
  return 0;
}

static int cpu_rmsnorm_fwd(ml_backend *be, const float *x, const void *w, ml_dtype w_type,
                           float offset, float eps, float *y, float *rstd, int64_t T, int64_t H) {
  return rmsnorm_fwd(be, x, w, w_type, offset, eps, y, NULL, rstd, T, H);
}

static int cpu_rmsnorm_fwd_bf16(ml_backend *be, const float *x, const void *w, ml_dtype w_type,
                                float offset, float eps, void *y, float *rstd, int64_t T,
                                int64_t H) {
  return rmsnorm_fwd(be, x, w, w_type, offset, eps, NULL, y, rstd, T, H);
}

static int cpu_rmsnorm_bwd(ml_backend *be, const float *dy, const float *x, const void *w,
                           ml_dtype w_type, float offset, const float *rstd, float *dx, float *dw,
                           int64_t T, int64_t H) {
  const float *wf;
  float *tmp;
  ML_TRY(weight_f32(be, w, w_type, H, &wf, &tmp));
  k_rmsnorm_bwd(dy, x, wf, offset, rstd, dx, dw, T, H);
  cpu_free(be, tmp);
  return 0;
}

static int cpu_rope_tables(ml_backend *be, double theta, int64_t hd, const ml_rope_scaling *sc,
                           int64_t seq_len, int64_t S, float *cos_t, float *sin_t) {
  float *inv = ml_be_alloc(be, hd / 2, sizeof(float), "the RoPE frequencies [%lld]",
                           (long long)(hd / 2));
  if (!inv) return -1;
  double scale = k_rope_inv_freq(theta, hd, sc, seq_len, inv);
  k_rope_tables(inv, (float)scale, hd, S, cos_t, sin_t);
  cpu_free(be, inv);
  return 0;
}

static int cpu_rope_fwd(ml_backend *be, float *x, const float *c, const float *s, int64_t B,
                        int64_t S, int64_t nh, int64_t hd) {
  k_rope_fwd(x, c, s, B, S, nh, hd);
  return 0;
}

static int cpu_rope_fwd_bf16(ml_backend *be, const float *x, void *y, const float *c,
                             const float *s, int64_t B, int64_t S, int64_t nh, int64_t hd) {
  k_rope_fwd_bf16(x, y, c, s, B, S, nh, hd);
  return 0;
}

static int cpu_rope_bwd(ml_backend *be, float *dx, const float *c, const float *s, int64_t B,
                        int64_t S, int64_t nh, int64_t hd) {
  k_rope_bwd(dx, c, s, B, S, nh, hd);
  return 0;
}

static int cpu_rope_bwd_bf16(ml_backend *be, const float *dx, void *y, const float *c,
                             const float *s, int64_t B, int64_t S, int64_t nh, int64_t hd) {
  k_rope_bwd_bf16(dx, y, c, s, B, S, nh, hd);
  return 0;
}

/* The CPU's attention is FlashAttention-2's (kernels/cpu/attention.c): it
 * saves each query's log-sum-exp, [B][S, nh] (ml_attn_block's lse layout). */
static int64_t cpu_attention_saved(ml_backend *be, int64_t B, int64_t S, int64_t nh) {
  return ml_mul_sat(ml_mul_sat(B, S), nh);
}

// a whole sequence as one block: q_pos = k_pos = 0, sq = sk = S
static k_attn_block whole(int64_t B, int64_t S, int64_t nh, int64_t nkv, int64_t hd, float scale,
                          int64_t window) {
  return (k_attn_block){.B = B,
                        .sq = S,
                        .sk = S,
                        .nh = nh,
                        .nkv = nkv,
                        .hd = hd,
                        .q_bs = S * nh * hd,
                        .k_bs = S * nkv * hd,
                        .l_bs = S * nh,
                        .scale = scale,
                        .window = window};
}

/* The backward's workspace (the caller's): its stored tiles, at most
 * K_ATTN_BWD_STORE bytes of them (kernels.h) */
static size_t cpu_attention_work(ml_backend *be, int64_t B, int64_t S, int64_t nh, int64_t nkv,
                                 int64_t hd) {
  k_attn_block blk = whole(B, S, nh, nkv, hd, 1.0f, 0);
  return k_attention_bwd_work(&blk, K_ATTN_BWD_STORE);
}

/* The kernels' tiles for head size hd, grown on first need. */
static float *attention_tiles(ml_backend *be, int64_t hd) {
  cpu *c = impl(be);
  int64_t n = k_attention_tile_floats(hd);
  if (n <= c->tiles_cap) return c->tiles;
  if (n > (int64_t)(SIZE_MAX / sizeof(float)) - 64) {
    ml_err("attention: the tiles for head_dim %lld overflow", (long long)hd);
    return NULL;
  }
  size_t bytes = ((size_t)n * sizeof(float) + 63) / 64 * 64; /* aligned_alloc's rule */
  float *t = aligned_alloc(64, bytes);
  if (!t) {
    ml_err("attention: out of memory for its tiles (%zu bytes)", bytes);
    return NULL;
  }
  free(c->tiles);
  c->tiles = t;
  c->tiles_cap = n;
  return t;
}

/* k_attn_bf16's products: the GEMM's tiles. */
static int tile_gemm(void *ctx, int thread, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                     float alpha, const void *A, int64_t lda, const void *B, int64_t ldb,
                     float beta, float *C, int64_t ldc) {
  return ml_cpu_gemm_tile(ctx, thread, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// elements of a head-major copy of B sequences of rows × heads × hd (saturating at ML_SAT)
static int64_t copy_elems(int64_t B, int64_t rows, int64_t heads, int64_t hd) {
  return ml_mul_sat(ml_mul_sat(B, heads), ml_mul_sat(rows, hd));
}

/* x, B sequences of `rows` rows of `heads` heads of hd (its block's
 * layout: rows heads·hd apart, sequences bs apart), as the bf16 products
 * read it, in one pass (k_attn_head_major): head-major [B][heads][rows][hd]
 * in pool memory (*out = *mem), bf16 when packed, else fp32 holding the
 * bf16 values; fp32 x rounded to bf16, bf16 x (x_bf16:
 * ml_attn_block.qkv_bf16) copied, or widened exactly for the emulation's
 * sgemm. *lay: its strides (bs, row, head) as k_attn_bf16 names them.
 * NULL x: nothing. */
static int rounded(ml_backend *be, const void *x, bool x_bf16, int64_t B, int64_t bs,
                   int64_t rows, int64_t heads, int64_t hd, bool packed, const void **out,
                   void **mem, int64_t lay[3]) {
  *out = *mem = NULL;
  if (!x) return 0;
  int64_t n = copy_elems(B, rows, heads, hd);
  *mem = ml_be_alloc(be, n, packed ? sizeof(uint16_t) : sizeof(float),
                     "an attention operand rounded to bf16 [%lld]", (long long)n);
  if (!*mem) return -1;
  *out = *mem;
  k_attn_head_major(x, x_bf16, B, bs, rows, heads, hd, packed, *mem);
  lay[0] = copy_elems(1, rows, heads, hd), lay[1] = hd, lay[2] = rows * hd;
  return 0;
}

/* One call's operands in `compute`: NULL *lp for fp32; for bf16, q, k, v,
 * dout rounded head-major (rounded(): every tile GEMM operand dense, as
 * oneDNN's brgemm matmul takes them, kernels.h k_attn_bf16), in pool
 * memory that attention_end frees; paged k, v are not: the kernel rounds
 * them as it reads the blocks; the kernels round P and dS per tile
 * themselves. */
typedef struct attn_lowp {
  k_attn_bf16 lp;
  void *mem[4];
} attn_lowp;

static void attention_end(ml_backend *be, attn_lowp *a) {
  for (int i = 0; i < 4; i++) cpu_free(be, a->mem[i]);
}

static int attention_begin(ml_backend *be, ml_dtype compute, const k_attn_block *blk,
                           const float *q, const float *k, const float *v, const float *dout,
                           attn_lowp *a, const k_attn_bf16 **lp) {
  memset(a, 0, sizeof *a);
  *lp = NULL;
  if (compute == ML_F32) return 0;
  if (compute != ML_BF16)
    return ml_err("attention: compute dtype %s; expected F32 or BF16", ml_dtype_name(compute));
  ml_cpu_gemm *g = impl(be)->gemm;
  bool packed = ml_cpu_gemm_bf16_native(g), qkv = blk->qkv_bf16;
  const float *pk = blk->kv_table ? NULL : k, *pv = blk->kv_table ? NULL : v;
  int64_t ql[3] = {0}, kl[3] = {0}, B = blk->B, hd = blk->hd;
  a->lp = (k_attn_bf16){.packed = packed, .gemm = tile_gemm, .ctx = g};
  int rc =
      (packed && ml_cpu_gemm_tiles_reserve(g, omp_get_max_threads())) ||
      rounded(be, q, qkv, B, blk->q_bs, blk->sq, blk->nh, hd, packed, &a->lp.q, &a->mem[0], ql) ||
      rounded(be, pk, qkv, B, blk->k_bs, blk->sk, blk->nkv, hd, packed, &a->lp.k, &a->mem[1],
              kl) ||
      rounded(be, pv, qkv, B, blk->k_bs, blk->sk, blk->nkv, hd, packed, &a->lp.v, &a->mem[2],
              kl) ||
      rounded(be, dout, false, B, blk->q_bs, blk->sq, blk->nh, hd, packed, &a->lp.dout,
              &a->mem[3], ql);
  if (rc) {
    attention_end(be, a);
    return -1;
  }
  a->lp.q_bs = ql[0], a->lp.q_row = ql[1], a->lp.q_head = ql[2];
  a->lp.k_bs = kl[0], a->lp.k_row = kl[1], a->lp.k_head = kl[2];
  *lp = &a->lp;
  return 0;
}

/* The pool blocks of attention_begin's copies (backend.h
 * ml_be_attention_temp_blocks), in its order: q, unpaged k and v, dout
 * (backward). */
static int attention_temp_blocks(ml_backend *be, const k_attn_block *blk, ml_dtype compute,
                                 bool bwd, int64_t bytes[ML_ATTN_TEMP_BLOCKS]) {
  if (compute != ML_BF16) return 0;
  int64_t esz = ml_cpu_gemm_bf16_native(impl(be)->gemm) ? sizeof(uint16_t) : sizeof(float);
  int64_t q = ml_mul_sat(copy_elems(blk->B, blk->sq, blk->nh, blk->hd), esz), n = 0;
  int64_t k = ml_mul_sat(copy_elems(blk->B, blk->sk, blk->nkv, blk->hd), esz);
  bytes[n++] = q;
  if (!blk->kv_table) bytes[n++] = k, bytes[n++] = k;
  if (bwd) bytes[n++] = q;
  return (int)n;
}

/* A kernel's result: the first failure of its tiles, reported here. */
static int attention_result(ml_backend *be, int rc) {
  if (!rc) return 0;
  ML_TRY(ml_cpu_gemm_tiles_check(impl(be)->gemm));
  return ml_err("attention: a bf16 product failed");
}

static int block_fwd(ml_backend *be, const k_attn_block *blk, const float *q, const float *k,
                     const float *v, float *out, float *lse, bool accumulate, ml_dtype compute) {
  float *tiles = attention_tiles(be, blk->hd);
  if (!tiles) return -1;
  attn_lowp a;
  const k_attn_bf16 *lp;
  ML_TRY(attention_begin(be, compute, blk, q, k, v, NULL, &a, &lp));
  k_attn_block b = *blk;
  b.fixed_order = impl(be)->invariant;
  int rc = k_attention_block_fwd(&b, q, k, v, out, lse, accumulate, lp, tiles);
  attention_end(be, &a);
  return attention_result(be, rc);
}

// work: work_bytes of the caller's workspace (the size the backend gave it)
static int block_bwd(ml_backend *be, const k_attn_block *blk, const float *dout, const float *q,
                     const float *k, const float *v, const float *out, const float *lse,
                     float *dq, float *dk, float *dv, ml_dtype compute, void *work,
                     size_t work_bytes) {
  float *tiles = attention_tiles(be, blk->hd);
  if (!tiles) return -1;
  attn_lowp a;
  const k_attn_bf16 *lp;
  ML_TRY(attention_begin(be, compute, blk, q, k, v, dout, &a, &lp));
  int rc = k_attention_block_bwd(blk, dout, q, k, v, out, lse, dq, dk, dv, lp, work, work_bytes,
                                 tiles);
  attention_end(be, &a);
  return attention_result(be, rc);
}

static k_attn_block block_of(const ml_attn_block *b) {
  return (k_attn_block){.B = b->B, .sq = b->sq, .sk = b->sk, .nh = b->nh, .nkv = b->nkv,
                        .hd = b->hd, .q_pos = b->q_pos, .k_pos = b->k_pos, .q_bs = b->q_bs,
                        .k_bs = b->k_bs, .l_bs = b->l_bs, .scale = b->scale,
                        .window = b->window, .group = b->group, .head_off = b->head_off,
                        .kv_table = b->kv_table, .kv_block = b->kv_block,
                        .table_bs = b->table_bs, .kv_bf16 = b->kv_bf16,
                        .out_bf16 = b->out_bf16, .qkv_bf16 = b->qkv_bf16,
                        .bwd_overwrite = b->bwd_overwrite};
}

static int cpu_attention_fwd(ml_backend *be, const float *q, const float *k, const float *v,
                             float *out, float *lse, int64_t B, int64_t S, int64_t nh,
                             int64_t nkv, int64_t hd, float scale, int64_t window,
                             ml_dtype compute) {
  k_attn_block blk = whole(B, S, nh, nkv, hd, scale, window);
  return block_fwd(be, &blk, q, k, v, out, lse, false, compute);
}

static int cpu_attention_bwd(ml_backend *be, const float *dout, const float *q, const float *k,
                             const float *v, const float *out, const float *lse, float *dq,
                             float *dk, float *dv, int64_t B, int64_t S, int64_t nh, int64_t nkv,
                             int64_t hd, float scale, int64_t window, ml_dtype compute,
                             void *work) {
  k_attn_block blk = whole(B, S, nh, nkv, hd, scale, window);
  blk.bwd_overwrite = true; /* dq, dk, dv (=) */
  return block_bwd(be, &blk, dout, q, k, v, out, lse, dq, dk, dv, compute, work,
                   cpu_attention_work(be, B, S, nh, nkv, hd));
}

static int cpu_attention_block_fwd(ml_backend *be, const ml_attn_block *b, const float *q,
                                   const float *k, const float *v, float *out, float *lse,
                                   bool accumulate, ml_dtype compute) {
  k_attn_block blk = block_of(b);
  return block_fwd(be, &blk, q, k, v, out, lse, accumulate, compute);
}

/* The bound over every block of b's sizes (each query seeing each key, the
 * most the stored tiles take), not b's geometry alone: one size serves
 * every block of these sizes (ring attention's steps, parallel/cp.c, and
 * varlen's documents, model/varlen.c, size one workspace for all). */
static size_t cpu_attention_block_work(ml_backend *be, const ml_attn_block *b) {
  k_attn_block blk = block_of(b);
  blk.q_pos = blk.sk, blk.k_pos = 0, blk.window = 0; /* every key before every query */
  return k_attention_bwd_work(&blk, K_ATTN_BWD_STORE);
}

static int cpu_attention_block_bwd(ml_backend *be, const ml_attn_block *b, const float *dout,
                                   const float *q, const float *k, const float *v,
                                   const float *out, const float *lse, float *dq, float *dk,
                                   float *dv, ml_dtype compute, void *work) {
  k_attn_block blk = block_of(b);
  return block_bwd(be, &blk, dout, q, k, v, out, lse, dq, dk, dv, compute, work,
                   cpu_attention_block_work(be, b));
}

static int cpu_attention_temp_blocks(ml_backend *be, const ml_attn_block *b, ml_dtype compute,
                                     bool bwd, int64_t bytes[ML_ATTN_TEMP_BLOCKS]) {
  k_attn_block blk = block_of(b);
  return attention_temp_blocks(be, &blk, compute, bwd, bytes);
}

/* Varlen attention (backend.h ml_attn_varlen): one attention_begin for the
 * whole batch (the bf16 operands' head-major copies of all B·S tokens: the
 * blocks of ml_be_attention_temp_blocks(vl->blk)), then every document's
 * tasks in the kernel's one region (kernels.h k_attention_varlen_fwd). */
static k_attn_docs docs_of(const ml_attn_varlen *vl) {
  return (k_attn_docs){.n = vl->ndocs, .cu = vl->cu, .used = vl->used};
}

static int cpu_attention_varlen_fwd(ml_backend *be, const ml_attn_varlen *vl, const float *q,
                                    const float *k, const float *v, float *out, float *lse,
                                    ml_dtype compute) {
  float *tiles = attention_tiles(be, vl->blk.hd);
  if (!tiles) return -1;
  /* the kernel's task offsets, n + 1 int64s: host scratch, as the tiles (not the pool's) */
  int64_t *first = malloc(sizeof(int64_t) * (size_t)(vl->ndocs + 1));
  if (!first)
    return ml_err("varlen attention: out of memory for the offsets of %lld documents",
                  (long long)vl->ndocs);
  k_attn_block blk = block_of(&vl->blk);
  blk.fixed_order = impl(be)->invariant;
  k_attn_docs docs = docs_of(vl);
  attn_lowp a;
  const k_attn_bf16 *lp;
  int rc = attention_begin(be, compute, &blk, q, k, v, NULL, &a, &lp);
  if (!rc) {
    rc = k_attention_varlen_fwd(&blk, &docs, q, k, v, out, lse, lp, tiles, first);
    attention_end(be, &a);
    rc = attention_result(be, rc);
  }
  free(first);
  return rc;
}

static size_t cpu_attention_varlen_work(ml_backend *be, const ml_attn_varlen *vl) {
  k_attn_block blk = block_of(&vl->blk);
  k_attn_docs docs = docs_of(vl);
  return k_attention_varlen_bwd_work(&blk, &docs, K_ATTN_BWD_STORE);
}

static int cpu_attention_varlen_bwd(ml_backend *be, const ml_attn_varlen *vl, const float *dout,
                                    const float *q, const float *k, const float *v,
                                    const float *out, const float *lse, float *dq, float *dk,
                                    float *dv, ml_dtype compute, void *work) {
  float *tiles = attention_tiles(be, vl->blk.hd);
  if (!tiles) return -1;
  k_attn_block blk = block_of(&vl->blk);
  blk.bwd_overwrite = true;
  k_attn_docs docs = docs_of(vl);
  attn_lowp a;
  const k_attn_bf16 *lp;
  ML_TRY(attention_begin(be, compute, &blk, q, k, v, dout, &a, &lp));
  int rc = k_attention_varlen_bwd(&blk, &docs, dout, q, k, v, out, lse, dq, dk, dv, lp, work,
                                  cpu_attention_varlen_work(be, vl), tiles);
  attention_end(be, &a);
  return attention_result(be, rc);
}

static int cpu_glu_fwd(ml_backend *be, const float *g, const float *u, float *h, int64_t n,
                       ml_glu_act act) {
  k_glu_fwd(g, u, h, n, act);
  return 0;
}

static int cpu_glu_bwd(ml_backend *be, const float *dh, const float *g, const float *u, float *dg,
                       float *du, int64_t n, ml_glu_act act) {
  k_glu_bwd(dh, g, u, dg, du, n, act);
  return 0;
}

static int cpu_glu_fwd_bf16(ml_backend *be, const void *g, const void *u, void *h,
                            ml_dtype h_type, int64_t n, ml_glu_act act) {
  k_glu_fwd_bf16(g, u, h, h_type == ML_BF16, n, act);
  return 0;
}

static int cpu_glu_bwd_bf16(ml_backend *be, const float *dh, const void *g, const void *u,
                            void *dg, void *du, ml_dtype d_type, int64_t n, ml_glu_act act) {
  k_glu_bwd_bf16(dh, g, u, dg, du, d_type == ML_BF16, n, act);
  return 0;
}

static int cpu_embedding_fwd(ml_backend *be, const int32_t *ids, int64_t T, const void *W,
                             ml_dtype w_type, int64_t row0, int64_t rows, int64_t H, float scale,
                             float *out) {
  if (w_type != ML_F32 && w_type != ML_BF16)
    return ml_err("embedding: a %s weight; expected F32 or BF16", ml_dtype_name(w_type));
  k_embedding_fwd(ids, T, W, w_type == ML_BF16, row0, rows, H, scale, out);
  return 0;
}

static int cpu_embedding_bwd(ml_backend *be, const int32_t *ids, int64_t T, const float *dout,
                             int64_t row0, int64_t rows, int64_t H, float scale, float *dW) {
  k_embedding_bwd(ids, T, dout, row0, rows, H, scale, dW);
  return 0;
}

static int cpu_xent_rowmax(ml_backend *be, const float *logits, int64_t T, int64_t V, float *mx) {
  k_xent_rowmax(logits, T, V, mx);
  return 0;
}

static int cpu_xent_sumexp_target(ml_backend *be, const float *logits, int64_t T, int64_t V,
                                  int64_t v0, const int32_t *y, const float *mx, float *se,
                                  float *tl) {
  k_xent_sumexp_target(logits, T, V, v0, y, mx, se, tl);
  return 0;
}

static int cpu_xent_online(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                           const int32_t *y, float *mx, float *se, float *tl) {
  k_xent_online(logits, T, V, v0, y, mx, se, tl);
  return 0;
}

static int cpu_xent_rebase(ml_backend *be, int64_t T, int64_t V, int64_t v0, const int32_t *y,
                           const float *mx, const float *M, float *se, float *tl) {
  k_xent_rebase(T, V, v0, y, mx, M, se, tl);
  return 0;
}

static int cpu_xent_logprobs(ml_backend *be, const float *se, const float *tl, const int32_t *y,
                             int64_t T, float scale, float *logprobs, float *w, double *sums) {
  k_xent_logprobs(se, tl, y, T, scale, logprobs, w, sums);
  return 0;
}

static int cpu_xent_bwd(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                        const int32_t *y, const float *mx, const float *se, const float *w,
                        float *dlogits) {
  k_xent_bwd(logits, T, V, v0, y, mx, se, w, dlogits);
  return 0;
}

static int cpu_xent_entropy_sum(ml_backend *be, const float *logits, int64_t T, int64_t V,
                                const float *mx, float *sl) {
  k_xent_entropy_sum(logits, T, V, mx, sl);
  return 0;
}

static int cpu_xent_entropy_online(ml_backend *be, const float *logits, int64_t T, int64_t V,
                                   const float *mx, const float *se, float *sl) {
  k_xent_entropy_online(logits, T, V, mx, se, sl);
  return 0;
}

static int cpu_xent_entropy_rebase(ml_backend *be, int64_t T, const float *mx, const float *M,
                                   const float *se, float *sl) {
  k_xent_entropy_rebase(T, mx, M, se, sl);
  return 0;
}

static int cpu_xent_entropy(ml_backend *be, const float *se, const float *sl, int64_t T,
                            float *ent) {
  k_xent_entropy(se, sl, T, ent);
  return 0;
}

static int cpu_xent_topk_clear(ml_backend *be, int64_t T, int64_t k, float *val, int32_t *id) {
  k_xent_topk_clear(T, k, val, id);
  return 0;
}

static int cpu_xent_topk_online(ml_backend *be, const float *logits, int64_t T, int64_t V,
                                int64_t v0, int64_t k, float *val, int32_t *id) {
  k_xent_topk_online(logits, T, V, v0, k, val, id);
  return 0;
}

static int cpu_xent_topk_merge(ml_backend *be, int64_t P, int64_t T, int64_t k, const float *cval,
                               const int32_t *cid, float *val, int32_t *id) {
  k_xent_topk_merge(P, T, k, cval, cid, val, id);
  return 0;
}

static int cpu_xent_topk_logprobs(ml_backend *be, int64_t T, int64_t k, const float *M,
                                  const float *se, const float *val, const int32_t *id, float *lp) {
  k_xent_topk_logprobs(T, k, M, se, val, id, lp);
  return 0;
}

static int cpu_xent_bwd_entropy(ml_backend *be, const float *logits, int64_t T, int64_t V,
                                int64_t v0, const int32_t *y, const float *mx, const float *se,
                                const float *w, const float *H, const float *ew, float *dlogits) {
  k_xent_bwd_entropy(logits, T, V, v0, y, mx, se, w, H, ew, dlogits);
  return 0;
}

static int cpu_adamw(ml_backend *be, float *p, float *g, float *m, float *v, uint16_t *p_bf16,
                     int64_t n, float grad_scale, double lr, double b1, double b2, double eps,
                     double wd, int64_t step) {
  k_adamw_step(p, g, m, v, p_bf16, n, grad_scale, lr, b1, b2, eps, wd, step);
  return 0;
}

static int cpu_norm_partials(ml_backend *be, const ml_norm_seg *segs, int k, ml_norm_kind kind,
                             double *out) {
  k_norm_partials(segs, k, kind, out);
  return 0;
}

static int cpu_norm_partial(ml_backend *be, const float *g, int64_t n, ml_norm_kind kind,
                            double *out) {
  return cpu_norm_partials(be, &(ml_norm_seg){g, n}, 1, kind, out);
}

static int cpu_find_nonfinite(ml_backend *be, const float *g, int64_t n, bool *found) {
  *found = k_has_nonfinite(g, n);
  return 0;
}

/* The GEMMs of the forward's layout on the fixed-order kernel and the
 * attention forwards in the fixed order (backend.h). */
static int cpu_set_batch_invariant(ml_backend *be, bool on) {
  impl(be)->invariant = on;
  ml_cpu_gemm_set_fixed(impl(be)->gemm, on);
  return 0;
}

static void cpu_destroy(ml_backend *be) {
  if (!be) return;
  cpu *c = impl(be);
  if (c) {
    ml_cpu_gemm_destroy(c->gemm);
    free(c->tiles);
    ml_pool_destroy(c->pool);
    ml_pool_destroy(c->host);
    free(c);
  }
  free(be);
}

static const ml_backend_ops k_cpu_ops = {
    .name = "cpu",
    .host_memory = true,
    .supports = ML_OPS_ALL,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_host_free,
    .copy = cpu_copy,
    .copy_async = cpu_copy,
    .zero = cpu_zero,
    .copy2d = cpu_copy2d,
    .convert = cpu_convert,
    .scatter_rows = cpu_scatter_rows,
    .round_bf16 = cpu_round_bf16,
    .round_bf16_to = cpu_round_bf16_to,
    .trim = cpu_trim,
    .memory_stats = cpu_memory_stats,
    .reset_peak = cpu_reset_peak,
    .event_record = cpu_event_record,
    .event_wait = cpu_event_wait,
    .event_sync = cpu_event_sync,
    .host_peer = cpu_host_peer,
    .sync = cpu_sync,
    .gemm = cpu_gemm,
    .gemm_temp = cpu_gemm_temp,
    .gemm_temp_blocks = cpu_gemm_temp_blocks,
    .gemm_exact_in_place = cpu_gemm_exact_in_place,
    .bias_grad = cpu_bias_grad,
    .add = cpu_add,
    .add_bf16 = cpu_add_bf16,
    .add_grad = cpu_add_grad,
    .add_to = cpu_add_to,
    .add_round_to = cpu_add_round_to,
    .scale = cpu_scale,
    .rmsnorm_fwd = cpu_rmsnorm_fwd,
    .rmsnorm_bwd = cpu_rmsnorm_bwd,
    .rmsnorm_fwd_bf16 = cpu_rmsnorm_fwd_bf16,
    .rope_tables = cpu_rope_tables,
    .rope_fwd = cpu_rope_fwd,
    .rope_bwd = cpu_rope_bwd,
    .rope_fwd_bf16 = cpu_rope_fwd_bf16,
    .rope_bwd_bf16 = cpu_rope_bwd_bf16,
    .attention_saved = cpu_attention_saved,
    .attention_work = cpu_attention_work,
    .attention_fwd = cpu_attention_fwd,
    .attention_block_fwd = cpu_attention_block_fwd,
    .attention_block_work = cpu_attention_block_work,
    .attention_temp_blocks = cpu_attention_temp_blocks,
    .attention_block_bwd = cpu_attention_block_bwd,
    .attention_varlen_fwd = cpu_attention_varlen_fwd,
    .attention_varlen_work = cpu_attention_varlen_work,
    .attention_varlen_bwd = cpu_attention_varlen_bwd,
    .attention_bwd = cpu_attention_bwd,
    .glu_fwd = cpu_glu_fwd,
    .glu_bwd = cpu_glu_bwd,
    .glu_fwd_bf16 = cpu_glu_fwd_bf16,
    .glu_bwd_bf16 = cpu_glu_bwd_bf16,
    .embedding_fwd = cpu_embedding_fwd,
    .embedding_bwd = cpu_embedding_bwd,
    .xent_rowmax = cpu_xent_rowmax,
    .xent_sumexp_target = cpu_xent_sumexp_target,
    .xent_online = cpu_xent_online,
    .xent_rebase = cpu_xent_rebase,
    .xent_logprobs = cpu_xent_logprobs,
    .xent_bwd = cpu_xent_bwd,
    .xent_entropy_sum = cpu_xent_entropy_sum,
    .xent_entropy_online = cpu_xent_entropy_online,
    .xent_entropy_rebase = cpu_xent_entropy_rebase,
    .xent_entropy = cpu_xent_entropy,
    .xent_topk_clear = cpu_xent_topk_clear,
    .xent_topk_online = cpu_xent_topk_online,
    .xent_topk_merge = cpu_xent_topk_merge,
    .xent_topk_logprobs = cpu_xent_topk_logprobs,
    .xent_bwd_entropy = cpu_xent_bwd_entropy,
    .adamw = cpu_adamw,
    .norm_partial = cpu_norm_partial,
    .find_nonfinite = cpu_find_nonfinite,
    .destroy = cpu_destroy,
    .set_batch_invariant = cpu_set_batch_invariant,
    .norm_partials = cpu_norm_partials,
};

int ml_backend_cpu_create(ml_backend **out) {
  ml_backend *be = ml_calloc(1, sizeof *be, "the CPU backend");
  cpu *c = ml_calloc(1, sizeof *c, "the CPU backend");
  if (!be || !c) {
    free(be);
    free(c);
    return -1;
  }
  be->ops = &k_cpu_ops;
  be->impl = c;
  c->pool = ml_pool_create((ml_pool_raw){raw_malloc, raw_free, NULL});
  c->host = ml_pool_create((ml_pool_raw){raw_malloc, raw_free, NULL});
  if (!c->pool || !c->host) {
    cpu_destroy(be);
    return ml_err("out of memory creating the CPU backend's pool");
  }
  if (ml_cpu_gemm_create(be, &c->gemm)) {
    cpu_destroy(be);
    return -1;
  }
  *out = be;
  return 0;
}
