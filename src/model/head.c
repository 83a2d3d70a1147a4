/* Root modules: embed_tokens (input side) and norm + lm_head (output side). */
#include "common/status.h"
#include "model/linear.h"

ml_rows ml_param_rows(const ml_param *p) {
  return (ml_rows){p->data, p->dtype, p->grad, p->offset[0], p->local[0], p->local[1]};
}

// ids: [n] → y: [n, w->cols] (=)
int ml_embed_lookup(ml_model *m, const int32_t *ids, int64_t n, const ml_rows *w, float *y) {
  return ml_be_embedding_fwd(m->be, ids, n, w->data, w->dtype, w->row0, w->rows, w->cols,
                             m->embed_tokens.scale, y);
}

// dy: [n, w->cols] → w->grad (+=); nothing for a frozen weight (grad NULL)
int ml_embed_lookup_backward(ml_model *m, const int32_t *ids, int64_t n, const float *dy,
                             const ml_rows *w) {
  if (!w->grad) return 0;
  return ml_be_embedding_bwd(m->be, ids, n, dy, w->row0, w->rows, w->cols, m->embed_tokens.scale,
                             w->grad);
}

// x: [B, S, c] → [B, s_res, H]
int ml_embed_edge_forward(ml_model *m, float *x) {
  const ml_embedding *e = &m->embed_tokens;
  const ml_param *w = e->weight;
  int64_t H = m->cfg.hidden;
  ml_act v = ml_act_view(m, x, m->S, H, w->local[1]);
  ML_TRY(ml_hook_run(e->out.fwd, &v));
  if (v.c != H)
    return ml_err("%s: the residual stream needs all %lld features; the plan's layouts leave %lld",
                  w->name, (long long)H, (long long)v.c);
  if (v.s > m->s_res_cap)
    return ml_err("%s: the plan's layouts leave %lld positions per sequence on the residual "
                  "stream; its buffers hold %lld (ml_model.res_parts)",
                  w->name, (long long)v.s, (long long)m->s_res_cap);
  m->s_res = v.s;
  return 0;
}

// dx: [B, s_res, H] → [B, S, c]
int ml_embed_edge_backward(ml_model *m, float *dx) {
  const ml_embedding *e = &m->embed_tokens;
  const ml_param *w = e->weight;
  ml_act v = ml_act_view(m, dx, m->s_res, m->cfg.hidden, m->cfg.hidden);
  ML_TRY(ml_hook_run(e->out.bwd, &v));
  if (v.s != m->S || v.c != w->local[1])
    return ml_err("%s: the output gradient is [%lld positions, %lld features] after its edge; "
                  "expected [%lld, %lld]",
                  w->name, (long long)v.s, (long long)v.c, (long long)m->S,
                  (long long)w->local[1]);
  return 0;
}

// ids: [B, S] → x: [B, s_res, H]
int ml_embed_forward(ml_model *m, const int32_t *ids, float *x) {
  ml_rows w = ml_param_rows(m->embed_tokens.weight);
  ML_TRY(ml_embed_lookup(m, ids, m->B * m->S, &w, x));
  return ml_embed_edge_forward(m, x);
}

// dx: [B, s_res, H] → embedding weight grad (+=)
int ml_embed_backward(ml_model *m, const int32_t *ids, float *dx) {
  ML_TRY(ml_embed_edge_backward(m, dx));
  ml_rows w = ml_param_rows(m->embed_tokens.weight);
  return ml_embed_lookup_backward(m, ids, m->B * m->S, dx, &w);
}

// x: [B, s_res, H] → xn_final [B, S, c] (after lm_head's input edge)
int ml_head_begin(ml_model *m, const float *x) {
  int64_t Tr = m->B * m->s_res, H = m->cfg.hidden;
  const ml_param *w = m->norm.weight;
  ML_TRY(ml_be_copy(m->be, m->x_final, x, sizeof(float) * (size_t)(Tr * H), ML_COPY_D2D));
  ML_TRY(ml_be_rmsnorm_fwd(m->be, m->x_final, w->data, w->dtype, m->norm.offset, m->norm.eps,
                           m->xn_final, m->rstd_final, Tr, H));
  ML_TRY(ml_be_zero(m->be, m->dxn_final, sizeof(float) * (size_t)(m->B * m->S * H)));
  m->head_in = ml_act_view(m, m->xn_final, m->s_res, H, H);
  ML_TRY(ml_hook_run(m->lm_head.in.fwd, &m->head_in));
  if (m->head_in.s != m->S)
    return ml_err("lm_head: the loss scores every position, but this rank holds %lld of %lld; "
                  "expected lm_head input_layouts that gather the sequence",
                  (long long)m->head_in.s, (long long)m->S);
  return 0;
}

/* Rows t0 .. t0+nt−1 of a [B·S, c] buffer as a one-sequence view. */
static ml_act rows_view(float *x, int64_t t0, int64_t nt, int64_t C, int64_t c) {
  return (ml_act){x + t0 * c, 1, nt, nt, C, c};
}

// logits: [nt, V_local] (or [nt, V] after a gathering output edge)
int ml_head_forward(ml_model *m, int64_t t0, int64_t nt, float *logits) {
  const ml_act *h = &m->head_in;
  ml_act x = rows_view(h->x, t0, nt, h->C, h->c), y;
  ML_TRY(ml_linear_forward(m->be, &m->lm_head, &x, NULL, logits, &y));
  m->logits_c = y.c;
  return 0;
}

// dlogits: [nt, V(_local)] → dxn_final[t0 : t0+nt] (=)
int ml_head_backward(ml_model *m, int64_t t0, int64_t nt, float *dlogits) {
  const ml_act *h = &m->head_in;
  ml_act x = rows_view(h->x, t0, nt, h->C, h->c);
  /* the gradient arrives in the layout the output edge produced */
  ml_act dy = {dlogits, 1, nt, nt, m->lm_head.weight->shape[0], m->logits_c};
  return ml_linear_backward(m->be, &m->lm_head, &dy, &x, NULL, m->dxn_final + t0 * h->c, 0);
}

// dx: [B, s_res, H] (=)
int ml_head_end_backward(ml_model *m, float *dx) {
  int64_t Tr = m->B * m->s_res, H = m->cfg.hidden;
  ml_act d = m->head_in;
  d.x = m->dxn_final;
  ML_TRY(ml_hook_run(m->lm_head.in.bwd, &d));
  if (d.s != m->s_res || d.c != H)
    return ml_err("lm_head: the input gradient is [%lld positions, %lld features] after its "
                  "edge; expected [%lld, %lld]",
                  (long long)d.s, (long long)d.c, (long long)m->s_res, (long long)H);
  const ml_param *w = m->norm.weight;
  return ml_be_rmsnorm_bwd(m->be, m->dxn_final, m->x_final, w->data, w->dtype, m->norm.offset,
                           m->rstd_final, dx, w->grad, Tr, H);
}

/* lm_head as a Linear over the rows w (a copy of its weight's description
 * in *p, pointed at them), without its edges; lm_head has no bias. */
static ml_linear rows_linear(const ml_model *m, const ml_rows *w, ml_param *p) {
  *p = *m->lm_head.weight;
  p->data = (void *)w->data; /* read only: the GEMMs' operand */
  p->dtype = w->dtype;
  p->grad = w->grad;
  p->offset[0] = w->row0;
  p->local[0] = w->rows;
  return (ml_linear){.weight = p, .bias_in_forward = true};
}

// logits: [nt, w->rows] = x: [nt, c] · W_rows^T
int ml_head_logits(ml_model *m, const float *x, int64_t nt, const ml_rows *w, float *logits) {
  ml_param p;
  ml_linear lin = rows_linear(m, w, &p);
  ml_act xv = rows_view((float *)x, 0, nt, w->cols, w->cols), y;
  return ml_linear_forward(m->be, &lin, &xv, NULL, logits, &y);
}

// dlogits: [nt, w->rows] → dx: [nt, c] (=), w->grad (+=)
int ml_head_logits_backward(ml_model *m, const float *x, int64_t nt, const ml_rows *w,
                            float *dlogits, float *dx) {
  ml_param p;
  ml_linear lin = rows_linear(m, w, &p);
  ml_act xv = rows_view((float *)x, 0, nt, w->cols, w->cols);
  ml_act dy = {dlogits, 1, nt, nt, p.shape[0], w->rows};
  return ml_linear_backward(m->be, &lin, &dy, &xv, NULL, dx, 0);
}

/* Rows r0 .. of w as a GEMM operand. */
static const void *rows_at(const ml_rows *w, int64_t r0) {
  return (const char *)w->data + (size_t)(r0 * w->cols) * ml_dtype_size(w->dtype);
}

// logits: [nt, n] = x: [nt, c] · W[r0 : r0+n]^T
int ml_head_tile_logits(ml_model *m, const ml_rows *w, ml_tile_in x, int64_t nt, int64_t r0,
                        int64_t n, float *logits) {
  int64_t c = w->cols;
  ml_gemm g = {.trans_b = true, .M = nt, .N = n, .K = c, .A = x.p, .a_type = x.type, .lda = c,
               .a_exact = x.exact, .B = rows_at(w, r0), .b_type = w->dtype, .ldb = c,
               .C = logits, .ldc = n, .compute = w->dtype};
  return ml_be_gemm(m->be, &g);
}

// dlogits: [nt, n] → dx: [nt, c] (= or +=), W.grad[r0 : r0+n] (+=, unless grad is NULL)
int ml_head_tile_backward(ml_model *m, const ml_rows *w, ml_tile_in x, int64_t nt, int64_t r0,
                          int64_t n, ml_tile_in dl, float *dx, bool accumulate) {
  int64_t c = w->cols;
  // dx: [nt, c] (= or +=) dlogits: [nt, n] · W[r0 : r0+n]: [n, c]
  ml_gemm gx = {.M = nt, .N = c, .K = n, .A = dl.p, .a_type = dl.type, .lda = n,
                .a_exact = dl.exact, .B = rows_at(w, r0), .b_type = w->dtype, .ldb = c,
                .C = dx, .ldc = c, .accumulate = accumulate, .compute = w->dtype};
  ML_TRY(ml_be_gemm(m->be, &gx));
  // dW[r0 : r0+n]: [n, c] += dlogits^T: [n, nt] · x: [nt, c]; none when frozen (grad NULL)
  if (!w->grad) return 0;
  ml_gemm gw = {.trans_a = true, .M = n, .N = c, .K = nt, .A = dl.p, .a_type = dl.type,
                .lda = n, .a_exact = dl.exact, .B = x.p, .b_type = x.type, .ldb = c,
                .b_exact = x.exact, .C = w->grad + r0 * c, .ldc = c, .accumulate = true,
                .compute = w->dtype};
  return ml_be_gemm(m->be, &gw);
}
