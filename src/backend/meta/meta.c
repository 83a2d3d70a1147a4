/* The meta backend (meta.h): pool bookkeeping over fake addresses, no-op
 * operators. */
#include "backend/meta/meta.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/pool.h"
#include "common/checked.h"
#include "common/status.h"

/* Fake device addresses: from 2^52 up (non-canonical on x86-64, so never
 * mapped), aligned to 256 bytes; the range ends at 2^62. */
enum { ALIGN = 256 };
static const uintptr_t k_first = (uintptr_t)1 << 52, k_last = (uintptr_t)1 << 62;

typedef struct meta {
  ml_backend *like;
  ml_pool *pool;
  uintptr_t next; /* the next fake address */
  ml_backend_ops ops; /* k_meta_ops, with like's ML_OP_ATTENTION_VARLEN */
} meta;

static meta *impl(ml_backend *be) { return be->impl; }

static void *fake_alloc(void *ctx, size_t bytes) {
  meta *m = ctx;
  size_t size = bytes ? (bytes + ALIGN - 1) / ALIGN * ALIGN : ALIGN;
  if (bytes > k_last || size > k_last - m->next) return NULL; /* beyond the fake range */
  void *p = (void *)m->next;
  m->next += size;
  return p;
}
static void fake_free(void *ctx, void *p) {}

static void *meta_alloc(ml_backend *be, size_t bytes) {
  return ml_pool_alloc(impl(be)->pool, bytes);
}
static void meta_free(ml_backend *be, void *p) { ml_pool_free(impl(be)->pool, p); }
static void *meta_host_alloc(ml_backend *be, size_t bytes) { return malloc(bytes ? bytes : 1); }
static void meta_host_free(ml_backend *be, void *p) { free(p); }
static void meta_trim(ml_backend *be) { ml_pool_trim(impl(be)->pool); }
static void meta_memory_stats(ml_backend *be, ml_memory_stats *out) {
  ml_pool_stats s = ml_pool_get_stats(impl(be)->pool);
  *out = (ml_memory_stats){s.in_use, s.peak, s.reserved, 0, 0, s.raw_allocs, 0}; /* host: malloc */
}
static void meta_reset_peak(ml_backend *be) { ml_pool_reset_peak(impl(be)->pool); }
/* Nothing is computed: the host-side steps of cpu_offload are no-ops too. */
static int meta_host_peer(ml_backend *be, ml_backend **out) {
  *out = be;
  return 0;
}

/* Only host memory is real: a copy into it reads as zeros. */
static int meta_copy(ml_backend *be, void *dst, const void *src, size_t bytes,
                     ml_copy_kind kind) {
  if (kind == ML_COPY_D2H) memset(dst, 0, bytes);
  return 0;
}

/* The non-blocking copies of cpu_offload move the shards, which are never
 * read here: nothing is written (a model's offloaded gradients are not
 * touched, so planning one allocates no host pages for them). */
static int meta_copy_async(ml_backend *be, void *dst, const void *src, size_t bytes,
                           ml_copy_kind kind) {
  return 0;
}

static int meta_copy2d(ml_backend *be, void *dst, size_t dpitch, const void *src, size_t spitch,
                       size_t width, size_t rows) {
  return 0;
}
static int meta_zero(ml_backend *be, void *dst, size_t bytes) { return 0; }
static int meta_convert(ml_backend *be, void *dst, ml_dtype dst_type, const void *src,
                        ml_dtype src_type, size_t n) {
  return 0;
}
static int meta_round_bf16(ml_backend *be, float *x, size_t n) { return 0; }
static int meta_round_bf16_to(ml_backend *be, const float *x, float *y, void *y16, size_t n) {
  return 0;
}
static int meta_scatter_rows(ml_backend *be, void *dst, ml_dtype dst_type, const int32_t *rows,
                             const float *src, int64_t n, int64_t width) {
  return 0;
}
static int meta_event(ml_backend *be, ml_event *ev) { return 0; }
static int meta_sync(ml_backend *be) { return 0; }

/* The modelled backend's temporaries (ml_be_gemm_temp_blocks): its blocks
 * taken in its order, then given back. */
static int meta_gemm(ml_backend *be, const ml_gemm *g) {
  int64_t bytes[ML_GEMM_TEMP_BLOCKS];
  void *t[ML_GEMM_TEMP_BLOCKS] = {NULL};
  int n = ml_be_gemm_temp_blocks(impl(be)->like, g, bytes), rc = 0;
  for (int i = 0; i < n && !rc; i++)
    if (!(t[i] = ml_be_alloc(be, bytes[i], 1,
                             "the temporaries of a GEMM [%lld x %lld] x [%lld x %lld]",
                             (long long)g->M, (long long)g->K, (long long)g->K, (long long)g->N)))
      rc = -1;
  for (int i = 0; i < n; i++) ml_be_free(be, t[i]);
  return rc;
}
static bool meta_gemm_exact_in_place(ml_backend *be) {
  return ml_be_gemm_exact_in_place(impl(be)->like);
}
static int meta_bias_grad(ml_backend *be, const float *dy, int64_t T, int64_t N, float *db) {
  return 0;
}
static int meta_add(ml_backend *be, float *y, const float *x, int64_t n) { return 0; }
static int meta_add_bf16(ml_backend *be, float *y, const float *x, void *y16, int64_t n) {
  return 0;
}
static int meta_add_grad(ml_backend *be, float *y, const float *x, int64_t n, bool overwrite,
                         bool round) {
  return 0;
}
static int meta_add_to(ml_backend *be, float *z, const float *y, const float *x, int64_t n) {
  return 0;
}
static int meta_add_round_to(ml_backend *be, float *z, const float *y, const float *x, void *z16,
                             int64_t n) {
  return 0;
}
static int meta_scale(ml_backend *be, float *x, int64_t n, float s) { return 0; }
static int meta_rmsnorm_fwd(ml_backend *be, const float *x, const void *w, ml_dtype w_type,
                            float offset, float eps, float *y, float *rstd, int64_t T,
                            int64_t H) {
  return 0;
}
static int meta_rmsnorm_fwd_bf16(ml_backend *be, const float *x, const void *w, ml_dtype w_type,
                                 float offset, float eps, void *y, float *rstd, int64_t T,
                                 int64_t H) {
  return 0;
}
static int meta_rmsnorm_bwd(ml_backend *be, const float *dy, const float *x, const void *w,
                            ml_dtype w_type, float offset, const float *rstd, float *dx,
                            float *dw, int64_t T, int64_t H) {
  return 0;
}
static int meta_rope_tables(ml_backend *be, double theta, int64_t hd, const ml_rope_scaling *sc,
                            int64_t seq_len, int64_t S, float *cos_t, float *sin_t) {
  return 0;
}
static int meta_rope(ml_backend *be, float *x, const float *cos_t, const float *sin_t, int64_t B,
                     int64_t S, int64_t nheads, int64_t hd) {
  return 0;
}
static int meta_rope_bf16(ml_backend *be, const float *x, void *y, const float *cos_t,
                          const float *sin_t, int64_t B, int64_t S, int64_t nheads, int64_t hd) {
  return 0;
}
static int64_t meta_attention_saved(ml_backend *be, int64_t B, int64_t S, int64_t nh) {
  return ml_be_attention_saved(impl(be)->like, B, S, nh);
}
static size_t meta_attention_work(ml_backend *be, int64_t B, int64_t S, int64_t nh, int64_t nkv,
                                  int64_t hd) {
  return ml_be_attention_work(impl(be)->like, B, S, nh, nkv, hd);
}
/* The modelled backend's temporaries of an attention call
 * (ml_be_attention_temp_blocks): its blocks taken in its order, then
 * given back. */
static int attention_temps(ml_backend *be, const ml_attn_block *blk, ml_dtype compute, bool bwd) {
  int64_t bytes[ML_ATTN_TEMP_BLOCKS];
  void *t[ML_ATTN_TEMP_BLOCKS] = {NULL};
  int n = ml_be_attention_temp_blocks(impl(be)->like, blk, compute, bwd, bytes), rc = 0;
  for (int i = 0; i < n && !rc; i++)
    if (!(t[i] = ml_be_alloc(be, bytes[i], 1, "an attention operand copy [%lld B]",
                             (long long)bytes[i])))
      rc = -1;
  for (int i = 0; i < n; i++) ml_be_free(be, t[i]);
  return rc;
}
// a whole sequence as one block (the sizes attention_temps reads)
static ml_attn_block whole(int64_t B, int64_t S, int64_t nh, int64_t nkv, int64_t hd) {
  return (ml_attn_block){.B = B, .sq = S, .sk = S, .nh = nh, .nkv = nkv, .hd = hd};
}
static int meta_attention_fwd(ml_backend *be, const float *q, const float *k, const float *v,
                              float *out, float *saved, int64_t B, int64_t S, int64_t nh,
                              int64_t nkv, int64_t hd, float scale, int64_t window,
                              ml_dtype compute) {
  ml_attn_block blk = whole(B, S, nh, nkv, hd);
  return attention_temps(be, &blk, compute, false);
}
static int meta_attention_bwd(ml_backend *be, const float *dout, const float *q, const float *k,
                              const float *v, const float *out, const float *saved, float *dq,
                              float *dk, float *dv, int64_t B, int64_t S, int64_t nh,
                              int64_t nkv, int64_t hd, float scale, int64_t window,
                              ml_dtype compute, void *work) {
  ml_attn_block blk = whole(B, S, nh, nkv, hd);
  return attention_temps(be, &blk, compute, true);
}
static int meta_attention_block_fwd(ml_backend *be, const ml_attn_block *blk, const float *q,
                                    const float *k, const float *v, float *out, float *lse,
                                    bool accumulate, ml_dtype compute) {
  return attention_temps(be, blk, compute, false);
}
static size_t meta_attention_block_work(ml_backend *be, const ml_attn_block *blk) {
  return ml_be_attention_block_work(impl(be)->like, blk);
}
static int meta_attention_block_bwd(ml_backend *be, const ml_attn_block *blk, const float *dout,
                                    const float *q, const float *k, const float *v,
                                    const float *out, const float *lse, float *dq, float *dk,
                                    float *dv, ml_dtype compute, void *work) {
  return attention_temps(be, blk, compute, true);
}
/* Varlen attention: the modelled backend's temporaries of one call on the
 * whole batch (backend.h ml_be_attention_varlen_fwd) */
static int meta_attention_varlen_fwd(ml_backend *be, const ml_attn_varlen *vl, const float *q,
                                     const float *k, const float *v, float *out, float *lse,
                                     ml_dtype compute) {
  return attention_temps(be, &vl->blk, compute, false);
}
static size_t meta_attention_varlen_work(ml_backend *be, const ml_attn_varlen *vl) {
  return ml_be_attention_varlen_work(impl(be)->like, vl);
}
static int meta_attention_varlen_bwd(ml_backend *be, const ml_attn_varlen *vl, const float *dout,
                                     const float *q, const float *k, const float *v,
                                     const float *out, const float *lse, float *dq, float *dk,
                                     float *dv, ml_dtype compute, void *work) {
  return attention_temps(be, &vl->blk, compute, true);
}
static int meta_glu_fwd(ml_backend *be, const float *g, const float *u, float *h, int64_t n,
                        ml_glu_act act) {
  return 0;
}
static int meta_glu_bwd(ml_backend *be, const float *dh, const float *g, const float *u,
                        float *dg, float *du, int64_t n, ml_glu_act act) {
  return 0;
}
static int meta_glu_fwd_bf16(ml_backend *be, const void *g, const void *u, void *h,
                             ml_dtype h_type, int64_t n, ml_glu_act act) {
  return 0;
}
static int meta_glu_bwd_bf16(ml_backend *be, const float *dh, const void *g, const void *u,
                             void *dg, void *du, ml_dtype d_type, int64_t n, ml_glu_act act) {
  return 0;
}
static int meta_embedding_fwd(ml_backend *be, const int32_t *ids, int64_t T, const void *W,
                              ml_dtype w_type, int64_t row0, int64_t rows, int64_t H,
                              float scale, float *out) {
  return 0;
}
static int meta_embedding_bwd(ml_backend *be, const int32_t *ids, int64_t T, const float *dout,
                              int64_t row0, int64_t rows, int64_t H, float scale, float *dW) {
  return 0;
}
static int meta_xent_rowmax(ml_backend *be, const float *logits, int64_t T, int64_t V,
                            float *mx) {
  return 0;
}
static int meta_xent_sumexp_target(ml_backend *be, const float *logits, int64_t T, int64_t V,
                                   int64_t v0, const int32_t *y, const float *mx, float *se,
                                   float *tl) {
  return 0;
}
static int meta_xent_online(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                            const int32_t *y, float *mx, float *se, float *tl) {
  return 0;
}
static int meta_xent_rebase(ml_backend *be, int64_t T, int64_t V, int64_t v0, const int32_t *y,
                            const float *mx, const float *M, float *se, float *tl) {
  return 0;
}
static int meta_xent_logprobs(ml_backend *be, const float *se, const float *tl, const int32_t *y,
                              int64_t T, float scale, float *logprobs, float *w, double *sums) {
  return 0; /* the sums stay as they were: no token is scored */
}
static int meta_xent_bwd(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                         const int32_t *y, const float *mx, const float *se, const float *w,
                         float *dlogits) {
  return 0;
}
static int meta_xent_entropy_sum(ml_backend *be, const float *logits, int64_t T, int64_t V,
                                 const float *mx, float *sl) {
  return 0;
}
static int meta_xent_entropy_online(ml_backend *be, const float *logits, int64_t T, int64_t V,
                                    const float *mx, const float *se, float *sl) {
  return 0;
}
static int meta_xent_entropy_rebase(ml_backend *be, int64_t T, const float *mx, const float *M,
                                    const float *se, float *sl) {
  return 0;
}
static int meta_xent_entropy(ml_backend *be, const float *se, const float *sl, int64_t T,
                             float *ent) {
  return 0;
}
static int meta_xent_topk_clear(ml_backend *be, int64_t T, int64_t k, float *val, int32_t *id) {
  return 0;
}
static int meta_xent_topk_online(ml_backend *be, const float *logits, int64_t T, int64_t V,
                                 int64_t v0, int64_t k, float *val, int32_t *id) {
  return 0;
}
static int meta_xent_topk_merge(ml_backend *be, int64_t P, int64_t T, int64_t k, const float *cval,
                                const int32_t *cid, float *val, int32_t *id) {
  return 0;
}
static int meta_xent_topk_logprobs(ml_backend *be, int64_t T, int64_t k, const float *M,
                                   const float *se, const float *val, const int32_t *id,
                                   float *lp) {
  return 0;
}
static int meta_xent_bwd_entropy(ml_backend *be, const float *logits, int64_t T, int64_t V,
                                 int64_t v0, const int32_t *y, const float *mx, const float *se,
                                 const float *w, const float *H, const float *ew, float *dlogits) {
  return 0;
}
static int meta_adamw(ml_backend *be, float *p, float *g, float *m, float *v, uint16_t *p_bf16,
                      int64_t n, float grad_scale, double lr, double b1, double b2, double eps,
                      double wd, int64_t step) {
  return 0;
}
static int meta_norm_partial(ml_backend *be, const float *g, int64_t n, ml_norm_kind kind,
                             double *out) {
  *out = 0.0;
  return 0;
}
/* out is a meta address no one may write: nothing to do. */
static int meta_norm_partials(ml_backend *be, const ml_norm_seg *segs, int k, ml_norm_kind kind,
                              double *out) {
  return 0;
}
/* Nothing is computed: no order to fix. */
static int meta_set_batch_invariant(ml_backend *be, bool on) { return 0; }

static int meta_find_nonfinite(ml_backend *be, const float *g, int64_t n, bool *found) {
  *found = false;
  return 0;
}

static const ml_backend_ops k_meta_ops = {
    .name = "meta",
    .host_memory = false,
    .supports = ML_OPS_ALL,
    .alloc = meta_alloc,
    .free = meta_free,
    .host_alloc = meta_host_alloc,
    .host_free = meta_host_free,
    .copy = meta_copy,
    .copy_async = meta_copy_async,
    .zero = meta_zero,
    .copy2d = meta_copy2d,
    .convert = meta_convert,
    .scatter_rows = meta_scatter_rows,
    .round_bf16 = meta_round_bf16,
    .round_bf16_to = meta_round_bf16_to,
    .trim = meta_trim,
    .memory_stats = meta_memory_stats,
    .reset_peak = meta_reset_peak,
    .event_record = meta_event,
    .event_wait = meta_event,
    .event_sync = meta_event,
    .host_peer = meta_host_peer,
    .sync = meta_sync,
    .gemm = meta_gemm,
    .gemm_exact_in_place = meta_gemm_exact_in_place,
    .bias_grad = meta_bias_grad,
    .add = meta_add,
    .add_bf16 = meta_add_bf16,
    .add_grad = meta_add_grad,
    .add_to = meta_add_to,
    .add_round_to = meta_add_round_to,
    .scale = meta_scale,
    .rmsnorm_fwd = meta_rmsnorm_fwd,
    .rmsnorm_bwd = meta_rmsnorm_bwd,
    .rmsnorm_fwd_bf16 = meta_rmsnorm_fwd_bf16,
    .rope_tables = meta_rope_tables,
    .rope_fwd = meta_rope,
    .rope_bwd = meta_rope,
    .rope_fwd_bf16 = meta_rope_bf16,
    .rope_bwd_bf16 = meta_rope_bf16,
    .attention_saved = meta_attention_saved,
    .attention_work = meta_attention_work,
    .attention_fwd = meta_attention_fwd,
    .attention_bwd = meta_attention_bwd,
    .attention_block_fwd = meta_attention_block_fwd,
    .attention_block_work = meta_attention_block_work,
    .attention_block_bwd = meta_attention_block_bwd,
    .attention_varlen_fwd = meta_attention_varlen_fwd,
    .attention_varlen_work = meta_attention_varlen_work,
    .attention_varlen_bwd = meta_attention_varlen_bwd,
    .glu_fwd = meta_glu_fwd,
    .glu_bwd = meta_glu_bwd,
    .glu_fwd_bf16 = meta_glu_fwd_bf16,
    .glu_bwd_bf16 = meta_glu_bwd_bf16,
    .embedding_fwd = meta_embedding_fwd,
    .embedding_bwd = meta_embedding_bwd,
    .xent_rowmax = meta_xent_rowmax,
    .xent_sumexp_target = meta_xent_sumexp_target,
    .xent_online = meta_xent_online,
    .xent_rebase = meta_xent_rebase,
    .xent_logprobs = meta_xent_logprobs,
    .xent_bwd = meta_xent_bwd,
    .xent_entropy_sum = meta_xent_entropy_sum,
    .xent_entropy_online = meta_xent_entropy_online,
    .xent_entropy_rebase = meta_xent_entropy_rebase,
    .xent_entropy = meta_xent_entropy,
    .xent_topk_clear = meta_xent_topk_clear,
    .xent_topk_online = meta_xent_topk_online,
    .xent_topk_merge = meta_xent_topk_merge,
    .xent_topk_logprobs = meta_xent_topk_logprobs,
    .xent_bwd_entropy = meta_xent_bwd_entropy,
    .adamw = meta_adamw,
    .norm_partial = meta_norm_partial,
    .find_nonfinite = meta_find_nonfinite,
    .destroy = ml_backend_meta_destroy,
    .set_batch_invariant = meta_set_batch_invariant,
    .norm_partials = meta_norm_partials,
};

int ml_backend_meta_create(ml_backend *like, ml_backend **out) {
  ml_backend *be = ml_calloc(1, sizeof *be, "the meta backend");
  meta *m = ml_calloc(1, sizeof *m, "the meta backend");
  if (!be || !m) {
    free(be);
    free(m);
    return -1;
  }
  /* varlen attention only where `like` has it: without it the model runs
   * a block per document, whose workspace and temporaries differ */
  m->ops = k_meta_ops;
  if (!ml_be_supports(like, ML_OP_ATTENTION_VARLEN))
    m->ops.supports &= ~ML_OP_BIT(ML_OP_ATTENTION_VARLEN);
  be->ops = &m->ops;
  be->impl = m;
  m->like = like;
  m->next = k_first;
  m->pool = ml_pool_create((ml_pool_raw){fake_alloc, fake_free, m});
  if (!m->pool) {
    ml_backend_meta_destroy(be);
    return ml_err("out of memory creating the meta backend's pool");
  }
  *out = be;
  return 0;
}

void ml_backend_meta_destroy(ml_backend *be) {
  if (!be) return;
  if (be->impl) ml_pool_destroy(impl(be)->pool);
  free(be->impl);
  free(be);
}
