#include "backend/backend.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "backend/profile.h"
#include "common/checked.h"
#include "common/status.h"

/* ---- properties ---------------------------------------------------------- */

bool ml_be_supports(const ml_backend *be, ml_op op) {
  return (unsigned)op < ML_OP_COUNT && (be->ops->supports & ML_OP_BIT(op)) != 0;
}
bool ml_be_host_memory(const ml_backend *be) { return be->ops->host_memory; }
int ml_be_host_peer(ml_backend *be, ml_backend **out) { return be->ops->host_peer(be, out); }

/* An operator be does not implement (ml_be_supports), asked of it by the
 * wrapper `call`: named, never reached. */
static int lacks(const ml_backend *be, const char *call) {
  return ml_err("backend '%s' does not implement %s (ml_be_supports); expected a device that "
                "does (--device cpu has every operator)",
                be->ops->name, call);
}
/* ... and, under MESHLM_OP_PROFILE=1, a boundary of the operator profile
 * (backend/profile.h) named after the wrapper. */
#define NEED(be, op)                                               \
  do {                                                             \
    if (!ml_be_supports((be), (op))) return lacks((be), __func__);  \
    if (ml_be_profile_on()) ml_be_profile_mark((be), __func__);     \
  } while (0)
/* A profile boundary of a memory operation (no capability to check). */
#define MARK(be)                                                   \
  do {                                                             \
    if (ml_be_profile_on()) ml_be_profile_mark((be), __func__);     \
  } while (0)

/* ---- memory -------------------------------------------------------------- */

static void *raw_device(void *be, size_t bytes) {
  return ((ml_backend *)be)->ops->alloc(be, bytes);
}
static void *raw_host(void *be, size_t bytes) {
  return ((ml_backend *)be)->ops->host_alloc(be, bytes);
}

void *ml_be_alloc_at(const char *file, int line, ml_backend *be, int host, int64_t count,
                     size_t elem, const char *what_fmt, ...) {
  va_list ap;
  va_start(ap, what_fmt);
  void *p = ml_alloc_checked_v(file, line, count, elem, host ? raw_host : raw_device, be,
                               what_fmt, ap);
  va_end(ap);
  return p;
}

void ml_be_free(ml_backend *be, void *p) { be->ops->free(be, p); }
void ml_be_host_free(ml_backend *be, void *p) { be->ops->host_free(be, p); }
void ml_be_trim(ml_backend *be) { be->ops->trim(be); }
ml_memory_stats ml_be_memory_stats(ml_backend *be) {
  ml_memory_stats s;
  be->ops->memory_stats(be, &s);
  return s;
}
void ml_be_reset_peak(ml_backend *be) { be->ops->reset_peak(be); }

int ml_be_copy(ml_backend *be, void *dst, const void *src, size_t bytes, ml_copy_kind kind) {
  MARK(be);
  return bytes ? be->ops->copy(be, dst, src, bytes, kind) : 0;
}
int ml_be_copy_async(ml_backend *be, void *dst, const void *src, size_t bytes,
                     ml_copy_kind kind) {
  if (kind == ML_COPY_D2D)
    return ml_err("ml_be_copy_async: a device-to-device copy; expected H2D or D2H");
  MARK(be);
  return bytes ? be->ops->copy_async(be, dst, src, bytes, kind) : 0;
}
int ml_be_copy2d(ml_backend *be, void *dst, size_t dpitch, const void *src, size_t spitch,
                 size_t width, size_t rows) {
  MARK(be);
  return width && rows ? be->ops->copy2d(be, dst, dpitch, src, spitch, width, rows) : 0;
}
int ml_be_zero(ml_backend *be, void *dst, size_t bytes) {
  MARK(be);
  return bytes ? be->ops->zero(be, dst, bytes) : 0;
}
int ml_be_convert(ml_backend *be, void *dst, ml_dtype dst_type, const void *src,
                  ml_dtype src_type, size_t n) {
  MARK(be);
  return n ? be->ops->convert(be, dst, dst_type, src, src_type, n) : 0;
}
int ml_be_round_bf16(ml_backend *be, float *x, size_t n) {
  MARK(be);
  return n ? be->ops->round_bf16(be, x, n) : 0;
}
int ml_be_round_bf16_to(ml_backend *be, const float *x, float *y, void *y16, size_t n) {
  MARK(be);
  return n ? be->ops->round_bf16_to(be, x, y, y16, n) : 0;
}
int ml_be_scatter_rows(ml_backend *be, void *dst, ml_dtype dst_type, const int32_t *rows,
                       const float *src, int64_t n, int64_t width) {
  MARK(be);
  if ((dst_type != ML_F32 && dst_type != ML_BF16) || n < 0 || width < 1)
    return ml_err("scatter rows: %lld rows of %lld into %s; expected n >= 0, width >= 1 and "
                  "F32 or BF16",
                  (long long)n, (long long)width, ml_dtype_name(dst_type));
  return n ? be->ops->scatter_rows(be, dst, dst_type, rows, src, n, width) : 0;
}

/* ---- ordering ------------------------------------------------------------ */

int ml_be_event_record(ml_backend *be, ml_event *ev) { return be->ops->event_record(be, ev); }
int ml_be_event_wait(ml_backend *be, ml_event *ev) { return be->ops->event_wait(be, ev); }
int ml_be_event_sync(ml_backend *be, ml_event *ev) { return be->ops->event_sync(be, ev); }
int ml_be_sync(ml_backend *be) {
  MARK(be);
  return be->ops->sync(be);
}

/* ---- operators ----------------------------------------------------------- */

static int gemm_check(const ml_gemm *a) {
  bool types_ok = (a->a_type == ML_F32 || a->a_type == ML_BF16) &&
                  (a->b_type == ML_F32 || a->b_type == ML_BF16) &&
                  (a->compute == ML_F32 || a->compute == ML_BF16) &&
                  (!a->bias || a->bias_type == ML_F32 || a->bias_type == ML_BF16);
  if (!types_ok) return ml_err("GEMM: operand dtypes must be F32 or BF16");
  if (a->compute == ML_F32 && (a->a_type != ML_F32 || a->b_type != ML_F32))
    return ml_err("GEMM: a BF16 operand in an fp32 GEMM; expected fp32 operands (or compute "
                  "bf16)");
  if (a->c_bf16 && a->accumulate)
    return ml_err("GEMM: a bf16 output (c_bf16) cannot accumulate (C += would round C twice); "
                  "expected accumulate false or an fp32 C");
  int64_t a_cols = a->trans_a ? a->M : a->K, b_cols = a->trans_b ? a->K : a->N;
  if (a->M < 0 || a->N < 0 || a->K < 0 || a->lda < a_cols || a->ldb < b_cols || a->ldc < a->N)
    return ml_err("GEMM [%lld x %lld] x [%lld x %lld]: leading dimensions %lld, %lld, %lld are "
                  "smaller than the rows they hold",
                  (long long)a->M, (long long)a->K, (long long)a->K, (long long)a->N,
                  (long long)a->lda, (long long)a->ldb, (long long)a->ldc);
  return 0;
}

int ml_be_set_batch_invariant(ml_backend *be, bool on) {
  NEED(be, ML_OP_BATCH_INVARIANT);
  return be->ops->set_batch_invariant(be, on);
}

int ml_be_gemm(ml_backend *be, const ml_gemm *g) {
  if (!ml_be_supports(be, ML_OP_GEMM)) return lacks(be, __func__);
  ML_TRY(gemm_check(g));
  if (ml_be_profile_on()) { /* a GEMM's class is its shape: the profile tells which linear */
    char name[64];
    snprintf(name, sizeof name, "gemm %lldx%lldx%lld%s%s%s%s%s", (long long)g->M,
             (long long)g->N, (long long)g->K, g->compute == ML_BF16 ? " bf16" : "",
             g->c_bf16 ? " C bf16" : "", g->trans_a ? " tA" : "", g->trans_b ? " tB" : "",
             g->accumulate ? " acc" : "");
    ml_be_profile_mark(be, name);
  }
  return g->M == 0 || g->N == 0 ? 0 : be->ops->gemm(be, g);
}
int64_t ml_be_gemm_temp(ml_backend *be, const ml_gemm *g) {
  return g->M > 0 && g->N > 0 && be->ops->gemm_temp ? be->ops->gemm_temp(be, g) : 0;
}

int ml_be_gemm_temp_blocks(ml_backend *be, const ml_gemm *g, int64_t bytes[ML_GEMM_TEMP_BLOCKS]) {
  if (g->M > 0 && g->N > 0 && be->ops->gemm_temp_blocks)
    return be->ops->gemm_temp_blocks(be, g, bytes);
  bytes[0] = ml_be_gemm_temp(be, g);
  return bytes[0] > 0;
}
bool ml_be_gemm_exact_in_place(ml_backend *be) {
  return be->ops->gemm_exact_in_place && be->ops->gemm_exact_in_place(be);
}
int ml_be_bias_grad(ml_backend *be, const float *dy, int64_t T, int64_t N, float *db) {
  NEED(be, ML_OP_BIAS_GRAD);
  return be->ops->bias_grad(be, dy, T, N, db);
}
int ml_be_add(ml_backend *be, float *y, const float *x, int64_t n) {
  NEED(be, ML_OP_ADD);
  return be->ops->add(be, y, x, n);
}
int ml_be_add_grad(ml_backend *be, float *y, const float *x, int64_t n, bool overwrite,
                   bool round) {
  NEED(be, ML_OP_ADD);
  return n > 0 ? be->ops->add_grad(be, y, x, n, overwrite, round) : 0;
}
int ml_be_add_bf16(ml_backend *be, float *y, const float *x, void *y16, int64_t n) {
  NEED(be, ML_OP_ADD);
  return be->ops->add_bf16(be, y, x, y16, n);
}
int ml_be_add_to(ml_backend *be, float *z, const float *y, const float *x, int64_t n) {
  NEED(be, ML_OP_ADD);
  return be->ops->add_to(be, z, y, x, n);
}
int ml_be_add_round_to(ml_backend *be, float *z, const float *y, const float *x, void *z16,
                       int64_t n) {
  NEED(be, ML_OP_ADD);
  return be->ops->add_round_to(be, z, y, x, z16, n);
}
int ml_be_scale(ml_backend *be, float *x, int64_t n, float s) {
  NEED(be, ML_OP_SCALE);
  return be->ops->scale(be, x, n, s);
}
int ml_be_rmsnorm_fwd(ml_backend *be, const float *x, const void *w, ml_dtype w_type,
                      float offset, float eps, float *y, float *rstd, int64_t T, int64_t H) {
  NEED(be, ML_OP_RMSNORM);
  return be->ops->rmsnorm_fwd(be, x, w, w_type, offset, eps, y, rstd, T, H);
}
int ml_be_rmsnorm_fwd_bf16(ml_backend *be, const float *x, const void *w, ml_dtype w_type,
                           float offset, float eps, void *y, float *rstd, int64_t T, int64_t H) {
  NEED(be, ML_OP_RMSNORM);
  return be->ops->rmsnorm_fwd_bf16(be, x, w, w_type, offset, eps, y, rstd, T, H);
}
int ml_be_rmsnorm_bwd(ml_backend *be, const float *dy, const float *x, const void *w,
                      ml_dtype w_type, float offset, const float *rstd, float *dx, float *dw,
                      int64_t T, int64_t H) {
  NEED(be, ML_OP_RMSNORM);
  return be->ops->rmsnorm_bwd(be, dy, x, w, w_type, offset, rstd, dx, dw, T, H);
}
int ml_be_rope_tables(ml_backend *be, double theta, int64_t hd, const ml_rope_scaling *sc,
                      int64_t seq_len, int64_t S, float *cos_t, float *sin_t) {
  NEED(be, ML_OP_ROPE);
  return be->ops->rope_tables(be, theta, hd, sc, seq_len, S, cos_t, sin_t);
}
int ml_be_rope_fwd(ml_backend *be, float *x, const float *cos_t, const float *sin_t, int64_t B,
                   int64_t S, int64_t nheads, int64_t hd) {
  NEED(be, ML_OP_ROPE);
  return be->ops->rope_fwd(be, x, cos_t, sin_t, B, S, nheads, hd);
}
int ml_be_rope_bwd(ml_backend *be, float *dx, const float *cos_t, const float *sin_t, int64_t B,
                   int64_t S, int64_t nheads, int64_t hd) {
  NEED(be, ML_OP_ROPE);
  return be->ops->rope_bwd(be, dx, cos_t, sin_t, B, S, nheads, hd);
}
int ml_be_rope_fwd_bf16(ml_backend *be, const float *x, void *y, const float *cos_t,
                        const float *sin_t, int64_t B, int64_t S, int64_t nheads, int64_t hd) {
  NEED(be, ML_OP_ROPE);
  return be->ops->rope_fwd_bf16(be, x, y, cos_t, sin_t, B, S, nheads, hd);
}
int ml_be_rope_bwd_bf16(ml_backend *be, const float *dx, void *y, const float *cos_t,
                        const float *sin_t, int64_t B, int64_t S, int64_t nheads, int64_t hd) {
  NEED(be, ML_OP_ROPE);
  return be->ops->rope_bwd_bf16(be, dx, y, cos_t, sin_t, B, S, nheads, hd);
}
int ml_be_attention_fwd(ml_backend *be, const float *q, const float *k, const float *v,
                        float *out, float *saved, int64_t B, int64_t S, int64_t nh, int64_t nkv,
                        int64_t hd, float scale, int64_t window, ml_dtype compute) {
  NEED(be, ML_OP_ATTENTION);
  return be->ops->attention_fwd(be, q, k, v, out, saved, B, S, nh, nkv, hd, scale, window,
                                compute);
}
int64_t ml_be_attention_saved(ml_backend *be, int64_t B, int64_t S, int64_t nh) {
  return ml_be_supports(be, ML_OP_ATTENTION) ? be->ops->attention_saved(be, B, S, nh) : 0;
}
size_t ml_be_attention_work(ml_backend *be, int64_t B, int64_t S, int64_t nh, int64_t nkv,
                            int64_t hd) {
  return ml_be_supports(be, ML_OP_ATTENTION) ? be->ops->attention_work(be, B, S, nh, nkv, hd) : 0;
}
int ml_be_attention_bwd(ml_backend *be, const float *dout, const float *q, const float *k,
                        const float *v, const float *out, const float *saved, float *dq,
                        float *dk, float *dv, int64_t B, int64_t S, int64_t nh, int64_t nkv,
                        int64_t hd, float scale, int64_t window, ml_dtype compute, void *work) {
  NEED(be, ML_OP_ATTENTION);
  return be->ops->attention_bwd(be, dout, q, k, v, out, saved, dq, dk, dv, B, S, nh, nkv, hd,
                                scale, window, compute, work);
}
/* ml_attn_block.qkv_bf16's conditions: bf16 products, unpaged keys. */
static int check_qkv_bf16(const ml_attn_block *blk, ml_dtype compute, const char *what) {
  if (!blk->qkv_bf16 || (compute == ML_BF16 && !blk->kv_table)) return 0;
  return ml_err("%s: bf16 q, k, v (qkv_bf16) with compute %s%s; expected compute BF16 and "
                "unpaged keys",
                what, ml_dtype_name(compute), blk->kv_table ? " and paged keys" : "");
}
int ml_be_attention_block_fwd(ml_backend *be, const ml_attn_block *blk, const float *q,
                              const float *k, const float *v, float *out, float *lse,
                              bool accumulate, ml_dtype compute) {
  NEED(be, ML_OP_ATTENTION_BLOCK);
  if (blk->kv_table && (blk->kv_block < 1 || blk->table_bs < (blk->sk + blk->kv_block - 1) /
                                                                  blk->kv_block))
    return ml_err("block attention: paged keys in blocks of kv_block %lld with table_bs %lld "
                  "entries a sequence; expected kv_block >= 1 and table_bs >= %lld (sk %lld)",
                  (long long)blk->kv_block, (long long)blk->table_bs,
                  blk->kv_block < 1 ? 1LL
                                    : (long long)((blk->sk + blk->kv_block - 1) / blk->kv_block),
                  (long long)blk->sk);
  ML_TRY(check_qkv_bf16(blk, compute, "block attention"));
  if (blk->out_bf16 && (accumulate || compute != ML_BF16))
    return ml_err("block attention: a bf16 out (out_bf16) with accumulate %s and compute %s; "
                  "expected accumulate false and compute BF16",
                  accumulate ? "true" : "false", ml_dtype_name(compute));
  return be->ops->attention_block_fwd(be, blk, q, k, v, out, lse, accumulate, compute);
}
size_t ml_be_attention_block_work(ml_backend *be, const ml_attn_block *blk) {
  return ml_be_supports(be, ML_OP_ATTENTION_BLOCK) ? be->ops->attention_block_work(be, blk) : 0;
}
int ml_be_attention_temp_blocks(ml_backend *be, const ml_attn_block *blk, ml_dtype compute,
                                bool bwd, int64_t bytes[ML_ATTN_TEMP_BLOCKS]) {
  if (!be->ops->attention_temp_blocks) return 0;
  return be->ops->attention_temp_blocks(be, blk, compute, bwd, bytes);
}
int ml_be_attention_block_bwd(ml_backend *be, const ml_attn_block *blk, const float *dout,
                              const float *q, const float *k, const float *v, const float *out,
                              const float *lse, float *dq, float *dk, float *dv,
                              ml_dtype compute, void *work) {
  NEED(be, ML_OP_ATTENTION_BLOCK);
  if (blk->kv_table)
    return ml_err("block attention backward: paged keys (kv_table set); expected keys at k_bs "
                  "(the paged KV cache is forward only)");
  ML_TRY(check_qkv_bf16(blk, compute, "block attention backward"));
  if (blk->out_bf16 && compute != ML_BF16)
    return ml_err("block attention backward: a bf16 out (out_bf16) with compute %s; expected "
                  "BF16",
                  ml_dtype_name(compute));
  return be->ops->attention_block_bwd(be, blk, dout, q, k, v, out, lse, dq, dk, dv, compute,
                                      work);
}
/* vl's batch as the varlen calls take it (backend.h ml_attn_varlen); the
 * documents themselves are model/varlen.h's, checked there. */
static int check_varlen(const ml_attn_varlen *vl, ml_dtype compute, const char *what) {
  const ml_attn_block *b = &vl->blk;
  if (b->kv_table || b->q_pos || b->k_pos || b->sq != b->sk || b->q_bs != b->sq * b->nh * b->hd ||
      b->k_bs != b->sk * b->nkv * b->hd || b->l_bs != b->sq * b->nh)
    return ml_err("%s: the batch block (sq %lld, sk %lld, q_pos %lld, k_pos %lld, q_bs %lld, "
                  "k_bs %lld, l_bs %lld%s); expected B rows of S = sq = sk tokens from position "
                  "0 in the [B, S] layouts, unpaged",
                  what, (long long)b->sq, (long long)b->sk, (long long)b->q_pos,
                  (long long)b->k_pos, (long long)b->q_bs, (long long)b->k_bs,
                  (long long)b->l_bs, b->kv_table ? ", paged keys" : "");
  if (vl->ndocs < 0 || (vl->ndocs > 0 && !vl->cu))
    return ml_err("%s: %lld documents%s; expected >= 0 with their offsets (cu)", what,
                  (long long)vl->ndocs, vl->cu ? "" : " and cu NULL");
  ML_TRY(check_qkv_bf16(b, compute, what));
  if (b->out_bf16 && compute != ML_BF16)
    return ml_err("%s: a bf16 out (out_bf16) with compute %s; expected BF16", what,
                  ml_dtype_name(compute));
  return 0;
}
int ml_be_attention_varlen_fwd(ml_backend *be, const ml_attn_varlen *vl, const float *q,
                               const float *k, const float *v, float *out, float *lse,
                               ml_dtype compute) {
  NEED(be, ML_OP_ATTENTION_VARLEN);
  ML_TRY(check_varlen(vl, compute, "varlen attention"));
  return be->ops->attention_varlen_fwd(be, vl, q, k, v, out, lse, compute);
}
size_t ml_be_attention_varlen_work(ml_backend *be, const ml_attn_varlen *vl) {
  return ml_be_supports(be, ML_OP_ATTENTION_VARLEN) ? be->ops->attention_varlen_work(be, vl) : 0;
}
int ml_be_attention_varlen_bwd(ml_backend *be, const ml_attn_varlen *vl, const float *dout,
                               const float *q, const float *k, const float *v, const float *out,
                               const float *lse, float *dq, float *dk, float *dv,
                               ml_dtype compute, void *work) {
  NEED(be, ML_OP_ATTENTION_VARLEN);
  ML_TRY(check_varlen(vl, compute, "varlen attention backward"));
  return be->ops->attention_varlen_bwd(be, vl, dout, q, k, v, out, lse, dq, dk, dv, compute,
                                       work);
}
int ml_be_glu_fwd(ml_backend *be, const float *g, const float *u, float *h, int64_t n,
                  ml_glu_act act) {
  NEED(be, ML_OP_GLU);
  return be->ops->glu_fwd(be, g, u, h, n, act);
}
int ml_be_glu_bwd(ml_backend *be, const float *dh, const float *g, const float *u, float *dg,
                  float *du, int64_t n, ml_glu_act act) {
  NEED(be, ML_OP_GLU);
  return be->ops->glu_bwd(be, dh, g, u, dg, du, n, act);
}
int ml_be_glu_fwd_bf16(ml_backend *be, const void *g, const void *u, void *h, ml_dtype h_type,
                       int64_t n, ml_glu_act act) {
  NEED(be, ML_OP_GLU);
  if (h_type != ML_F32 && h_type != ML_BF16)
    return ml_err("GLU forward on bf16 inputs: output dtype %s; expected F32 or BF16",
                  ml_dtype_name(h_type));
  return be->ops->glu_fwd_bf16(be, g, u, h, h_type, n, act);
}
int ml_be_glu_bwd_bf16(ml_backend *be, const float *dh, const void *g, const void *u, void *dg,
                       void *du, ml_dtype d_type, int64_t n, ml_glu_act act) {
  NEED(be, ML_OP_GLU);
  if (d_type != ML_F32 && d_type != ML_BF16)
    return ml_err("GLU backward on bf16 inputs: output dtype %s; expected F32 or BF16",
                  ml_dtype_name(d_type));
  return be->ops->glu_bwd_bf16(be, dh, g, u, dg, du, d_type, n, act);
}
int ml_be_embedding_fwd(ml_backend *be, const int32_t *ids, int64_t T, const void *W,
                        ml_dtype w_type, int64_t row0, int64_t rows, int64_t H, float scale,
                        float *out) {
  NEED(be, ML_OP_EMBEDDING);
  return be->ops->embedding_fwd(be, ids, T, W, w_type, row0, rows, H, scale, out);
}
int ml_be_embedding_bwd(ml_backend *be, const int32_t *ids, int64_t T, const float *dout,
                        int64_t row0, int64_t rows, int64_t H, float scale, float *dW) {
  NEED(be, ML_OP_EMBEDDING);
  return be->ops->embedding_bwd(be, ids, T, dout, row0, rows, H, scale, dW);
}
int ml_be_xent_rowmax(ml_backend *be, const float *logits, int64_t T, int64_t V, float *mx) {
  NEED(be, ML_OP_XENT);
  return be->ops->xent_rowmax(be, logits, T, V, mx);
}
int ml_be_xent_sumexp_target(ml_backend *be, const float *logits, int64_t T, int64_t V,
                             int64_t v0, const int32_t *y, const float *mx, float *se,
                             float *tl) {
  NEED(be, ML_OP_XENT);
  return be->ops->xent_sumexp_target(be, logits, T, V, v0, y, mx, se, tl);
}
int ml_be_xent_online(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                      const int32_t *y, float *mx, float *se, float *tl) {
  NEED(be, ML_OP_XENT);
  return be->ops->xent_online(be, logits, T, V, v0, y, mx, se, tl);
}
int ml_be_xent_rebase(ml_backend *be, int64_t T, int64_t V, int64_t v0, const int32_t *y,
                      const float *mx, const float *M, float *se, float *tl) {
  NEED(be, ML_OP_XENT);
  return be->ops->xent_rebase(be, T, V, v0, y, mx, M, se, tl);
}
int ml_be_xent_logprobs(ml_backend *be, const float *se, const float *tl, const int32_t *y,
                        int64_t T, float scale, float *logprobs, float *w, double *sums) {
  NEED(be, ML_OP_XENT);
  return be->ops->xent_logprobs(be, se, tl, y, T, scale, logprobs, w, sums);
}
int ml_be_xent_bwd(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                   const int32_t *y, const float *mx, const float *se, const float *w,
                   float *dlogits) {
  NEED(be, ML_OP_XENT);
  return be->ops->xent_bwd(be, logits, T, V, v0, y, mx, se, w, dlogits);
}
int ml_be_xent_entropy_sum(ml_backend *be, const float *logits, int64_t T, int64_t V,
                           const float *mx, float *sl) {
  NEED(be, ML_OP_ENTROPY);
  return be->ops->xent_entropy_sum(be, logits, T, V, mx, sl);
}
int ml_be_xent_entropy_online(ml_backend *be, const float *logits, int64_t T, int64_t V,
                              const float *mx, const float *se, float *sl) {
  NEED(be, ML_OP_ENTROPY);
  return be->ops->xent_entropy_online(be, logits, T, V, mx, se, sl);
}
int ml_be_xent_entropy_rebase(ml_backend *be, int64_t T, const float *mx, const float *M,
                              const float *se, float *sl) {
  NEED(be, ML_OP_ENTROPY);
  return be->ops->xent_entropy_rebase(be, T, mx, M, se, sl);
}
int ml_be_xent_entropy(ml_backend *be, const float *se, const float *sl, int64_t T, float *ent) {
  NEED(be, ML_OP_ENTROPY);
  return be->ops->xent_entropy(be, se, sl, T, ent);
}
int ml_be_xent_topk_clear(ml_backend *be, int64_t T, int64_t k, float *val, int32_t *id) {
  NEED(be, ML_OP_TOPK);
  return be->ops->xent_topk_clear(be, T, k, val, id);
}
int ml_be_xent_topk_online(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                           int64_t k, float *val, int32_t *id) {
  NEED(be, ML_OP_TOPK);
  return be->ops->xent_topk_online(be, logits, T, V, v0, k, val, id);
}
int ml_be_xent_topk_merge(ml_backend *be, int64_t P, int64_t T, int64_t k, const float *cval,
                          const int32_t *cid, float *val, int32_t *id) {
  NEED(be, ML_OP_TOPK);
  return be->ops->xent_topk_merge(be, P, T, k, cval, cid, val, id);
}
int ml_be_xent_topk_logprobs(ml_backend *be, int64_t T, int64_t k, const float *M, const float *se,
                             const float *val, const int32_t *id, float *lp) {
  NEED(be, ML_OP_TOPK);
  return be->ops->xent_topk_logprobs(be, T, k, M, se, val, id, lp);
}
int ml_be_xent_bwd_entropy(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                           const int32_t *y, const float *mx, const float *se, const float *w,
                           const float *H, const float *ew, float *dlogits) {
  NEED(be, ML_OP_ENTROPY);
  return be->ops->xent_bwd_entropy(be, logits, T, V, v0, y, mx, se, w, H, ew, dlogits);
}
int ml_be_adamw(ml_backend *be, float *p, float *g, float *m, float *v, uint16_t *p_bf16,
                int64_t n, float grad_scale, double lr, double b1, double b2, double eps,
                double wd, int64_t step) {
  NEED(be, ML_OP_ADAMW);
  return be->ops->adamw(be, p, g, m, v, p_bf16, n, grad_scale, lr, b1, b2, eps, wd, step);
}
int ml_be_norm_partial(ml_backend *be, const float *g, int64_t n, ml_norm_kind kind,
                       double *out) {
  NEED(be, ML_OP_NORM_PARTIAL);
  return be->ops->norm_partial(be, g, n, kind, out);
}
int ml_be_norm_partials(ml_backend *be, const ml_norm_seg *segs, int k, ml_norm_kind kind,
                        double *out) {
  NEED(be, ML_OP_NORM_PARTIAL);
  if (k < 0) return ml_err("grad-norm partials: %d pieces; expected >= 0", k);
  for (int s = 0; s < k; s++)
    if (segs[s].n < 0)
      return ml_err("grad-norm partials: piece %d has %lld elements; expected >= 0", s,
                    (long long)segs[s].n);
  return be->ops->norm_partials(be, segs, k, kind, out);
}
int ml_be_find_nonfinite(ml_backend *be, const float *g, int64_t n, bool *found) {
  NEED(be, ML_OP_FIND_NONFINITE);
  return be->ops->find_nonfinite(be, g, n, found);
}
