/* Variable-length attention over packed sequences (varlen.h): the
 * backend's varlen attention, every document in one call, where it has one
 * (ML_OP_ATTENTION_VARLEN: the CPU's); else one block of its block
 * attention per document, on pointers offset to its first token (B = 1: a
 * document is one run of consecutive tokens; CUDA). The two give the same
 * bits: the varlen call's documents are those blocks (backend.h). */
#include "model/varlen.h"

#include "common/checked.h"
#include "common/status.h"

int ml_varlen_check(const ml_varlen *v, int64_t B, int64_t S) {
  int64_t n = v->ndocs, T = B * S;
  if (n < 0) return ml_err("varlen attention: %lld documents; expected >= 0", (long long)n);
  if (n == 0) return 0;
  if (!v->cu)
    return ml_err("varlen attention: %lld documents without offsets (cu NULL)", (long long)n);
  if (v->cu[0] != 0)
    return ml_err("varlen attention: cu[0] = %lld; expected 0 (the first document starts at "
                  "token 0)", (long long)v->cu[0]);
  for (int64_t d = 0; d < n; d++) {
    int64_t a = v->cu[d], b = v->cu[d + 1];
    if (b <= a)
      return ml_err("varlen attention: cu[%lld] = %lld after cu[%lld] = %lld; expected "
                    "increasing offsets (every document at least one token)",
                    (long long)(d + 1), (long long)b, (long long)d, (long long)a);
    if (b > T)
      return ml_err("varlen attention: document %lld ends at token %lld (cu[%lld] = %lld), "
                    "beyond the batch's %lld x %lld = %lld tokens",
                    (long long)d, (long long)(b - 1), (long long)(d + 1), (long long)b,
                    (long long)B, (long long)S, (long long)T);
    if (a / S != (b - 1) / S)
      return ml_err("varlen attention: document %lld (tokens %lld .. %lld) crosses the boundary "
                    "of rows %lld and %lld (%lld tokens a row); expected every document within "
                    "one row",
                    (long long)d, (long long)a, (long long)(b - 1), (long long)(a / S),
                    (long long)(a / S + 1), (long long)S);
    if (v->used && (v->used[d] < 0 || v->used[d] > b - a))
      return ml_err("varlen attention: used[%lld] = %lld; expected 0 .. %lld (the tokens of "
                    "document %lld's slot)",
                    (long long)d, (long long)v->used[d], (long long)(b - a), (long long)d);
  }
  return 0;
}

// the tokens of document d (its slot's first used[d])
static int64_t doc_len(const ml_varlen *v, int64_t d) {
  return v->used ? v->used[d] : v->cu[d + 1] - v->cu[d];
}

// whether the backend runs every document in one call
static bool one_call(const ml_varlen *v) { return ml_be_supports(v->be, ML_OP_ATTENTION_VARLEN); }

/* The whole batch and v's documents as the backend's varlen call takes
 * them (backend.h ml_attn_varlen) */
static ml_attn_varlen batch_of(const ml_varlen *v, const ml_attn_call *c) {
  return (ml_attn_varlen){
      .blk = {.B = c->B, .sq = c->S, .sk = c->S, .nh = c->nh, .nkv = c->nkv, .hd = c->hd,
              .q_bs = c->S * c->nh * c->hd, .k_bs = c->S * c->nkv * c->hd, .l_bs = c->S * c->nh,
              .scale = c->scale, .window = c->window, .group = c->group,
              .head_off = c->head_off, .out_bf16 = c->out_bf16, .qkv_bf16 = c->qkv_bf16},
      .ndocs = v->ndocs, .cu = v->cu, .used = v->used};
}

// n consecutive tokens of c's layouts as one whole-sequence block: q_pos = k_pos = 0
static ml_attn_block run_block(const ml_attn_call *c, int64_t n) {
  return (ml_attn_block){.B = 1, .sq = n, .sk = n, .nh = c->nh, .nkv = c->nkv, .hd = c->hd,
                         .q_bs = n * c->nh * c->hd, .k_bs = n * c->nkv * c->hd,
                         .l_bs = n * c->nh, .scale = c->scale, .window = c->window,
                         .group = c->group, .head_off = c->head_off,
                         .out_bf16 = c->out_bf16, .qkv_bf16 = c->qkv_bf16};
}

/* p advanced by i elements: bf16 (2 bytes) or fp32. The backend's block
 * calls take float pointers; under out_bf16 / qkv_bf16 they point at bf16. */
static const float *at(const float *p, int64_t i, bool bf16) {
  return (const float *)((const char *)p + i * (bf16 ? 2 : 4));
}
static float *at_out(float *p, int64_t i, bool bf16) {
  return (float *)((char *)p + i * (bf16 ? 2 : 4));
}

static int begin(const ml_varlen *v, const ml_attn_call *c) {
  if (!ml_be_supports(v->be, ML_OP_ATTENTION_BLOCK))
    return ml_err("varlen attention (packed documents): backend '%s' has no block attention; "
                  "expected one sequence per micro-batch on it",
                  v->be->ops->name);
  return ml_varlen_check(v, c->B, c->S);
}

/* Tokens t0 .. t0+n−1 that attend to nothing. A block of their queries
 * against one key placed after all of them (k_pos = n: causal, none sees
 * it) gives the backend's result for a row that sees no key: out 0, lse
 * −inf. */
static int fwd_padding(const ml_varlen *v, const ml_attn_call *c, int64_t t0, int64_t n,
                       float *out, float *lse) {
  if (n == 0) return 0;
  ml_attn_block blk = run_block(c, n);
  blk.sk = 1;
  blk.k_pos = n;
  int64_t qo = t0 * c->nh * c->hd;
  return ml_be_attention_block_fwd(v->be, &blk, at(c->q, qo, c->qkv_bf16), c->k, c->v,
                                   at_out(out, qo, c->out_bf16), lse + t0 * c->nh, false,
                                   c->compute);
}

static int64_t varlen_saved(void *ctx, int64_t B, int64_t S, int64_t nh) {
  return ml_mul_sat(ml_mul_sat(B, S), nh); /* lse [B, S, nh] */
}

// q [B, S, nh, hd], k, v [B, S, nkv, hd] → out [B, S, nh·hd], lse [B, S, nh]
static int varlen_fwd(void *ctx, const ml_attn_call *c, float *out, float *lse) {
  ml_varlen *v = ctx;
  ML_TRY(begin(v, c));
  if (one_call(v)) {
    ml_attn_varlen b = batch_of(v, c);
    return ml_be_attention_varlen_fwd(v->be, &b, c->q, c->k, c->v, out, lse, c->compute);
  }
  int64_t qr = c->nh * c->hd, kr = c->nkv * c->hd, end = 0;
  for (int64_t d = 0; d < v->ndocs; d++) {
    int64_t t0 = v->cu[d], n = doc_len(v, d);
    end = v->cu[d + 1];
    if (n > 0) {
      ml_attn_block blk = run_block(c, n);
      bool b = c->qkv_bf16;
      ML_TRY(ml_be_attention_block_fwd(v->be, &blk, at(c->q, t0 * qr, b), at(c->k, t0 * kr, b),
                                       at(c->v, t0 * kr, b), at_out(out, t0 * qr, c->out_bf16),
                                       lse + t0 * c->nh, false, c->compute));
    }
    ML_TRY(fwd_padding(v, c, t0 + n, end - t0 - n, out, lse));
  }
  return fwd_padding(v, c, end, c->B * c->S - end, out, lse);
}

/* v->work holds the varlen call's workspace, or the block workspace of
 * every document's backward (the backend's size for its longest one, taken
 * over all of them). */
static int reserve_work(ml_varlen *v, const ml_attn_call *c) {
  size_t need = 0;
  if (one_call(v)) {
    ml_attn_varlen b = batch_of(v, c);
    need = ml_be_attention_varlen_work(v->be, &b);
  } else {
    for (int64_t d = 0; d < v->ndocs; d++) {
      ml_attn_block blk = run_block(c, doc_len(v, d));
      size_t w = ml_be_attention_block_work(v->be, &blk);
      if (w > need) need = w;
    }
  }
  if (v->work && need <= v->work_bytes) return 0;
  ml_be_free(v->be, v->work);
  v->work_bytes = 0;
  v->work = ml_be_alloc(v->be, need > (size_t)ML_SAT ? ML_SAT : (int64_t)need, 1,
                        "the varlen attention's block workspace (%zu bytes)", need);
  if (!v->work) return -1;
  v->work_bytes = need;
  return 0;
}

/* Tokens t0 .. t0+n−1 that attend to nothing: dq, dk, dv 0 (no block
 * writes them). */
static int zero_padding(const ml_varlen *v, const ml_attn_call *c, int64_t t0, int64_t n,
                        float *dq, float *dk, float *dv) {
  if (n == 0) return 0;
  int64_t qr = c->nh * c->hd, kr = c->nkv * c->hd;
  size_t nq = sizeof(float) * (size_t)(n * qr), nk = sizeof(float) * (size_t)(n * kr);
  ML_TRY(ml_be_zero(v->be, dq + t0 * qr, nq));
  ML_TRY(ml_be_zero(v->be, dk + t0 * kr, nk));
  return ml_be_zero(v->be, dv + t0 * kr, nk);
}

// dout [B, S, nh·hd] → dq [B, S, nh, hd], dk, dv [B, S, nkv, hd] (=)
static int varlen_bwd(void *ctx, const ml_attn_call *c, const float *dout, const float *out,
                      const float *lse, float *dq, float *dk, float *dv) {
  ml_varlen *v = ctx;
  ML_TRY(begin(v, c));
  int64_t T = c->B * c->S, qr = c->nh * c->hd, kr = c->nkv * c->hd, end = 0;
  ML_TRY(reserve_work(v, c));
  if (one_call(v)) {
    ml_attn_varlen b = batch_of(v, c);
    return ml_be_attention_varlen_bwd(v->be, &b, dout, c->q, c->k, c->v, out, lse, dq, dk, dv,
                                      c->compute, v->work);
  }
  for (int64_t d = 0; d < v->ndocs; d++) {
    int64_t t0 = v->cu[d], n = doc_len(v, d), qo = t0 * qr, ko = t0 * kr;
    end = v->cu[d + 1];
    if (n > 0) {
      ml_attn_block blk = run_block(c, n);
      blk.bwd_overwrite = true; /* the document's only block: its rows (=) */
      bool b = c->qkv_bf16;
      ML_TRY(ml_be_attention_block_bwd(v->be, &blk, dout + qo, at(c->q, qo, b), at(c->k, ko, b),
                                       at(c->v, ko, b), at(out, qo, c->out_bf16),
                                       lse + t0 * c->nh, dq + qo, dk + ko, dv + ko, c->compute,
                                       v->work));
    }
    ML_TRY(zero_padding(v, c, t0 + n, end - t0 - n, dq, dk, dv));
  }
  return zero_padding(v, c, end, T - end, dq, dk, dv);
}

ml_attn_core ml_varlen_core(ml_varlen *v) {
  return (ml_attn_core){.saved = varlen_saved, .fwd = varlen_fwd, .bwd = varlen_bwd, .ctx = v,
                        .bf16_qkv = true, .bf16_out = true};
}

void ml_varlen_destroy(ml_varlen *v) {
  if (v->work) ml_be_free(v->be, v->work);
  v->work = NULL;
  v->work_bytes = 0;
}
