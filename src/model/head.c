/* Root modules: embed_tokens (input side) and norm + lm_head (output side). */
#include "common/status.h"
#include "model/linear.h"

// ids: [B, S] → x: [B, s_res, H]
int ml_embed_forward(ml_model *m, const int32_t *ids, float *x) {
  const ml_embedding *e = &m->embed_tokens;
  const ml_param *w = e->weight;
  int64_t H = m->cfg.hidden;
  int64_t row0 = w->offset[0];
  ML_TRY(ml_be_embedding_fwd(m->be, ids, m->B * m->S, w->data, w->dtype, row0, w->local[0],
                             w->local[1], e->scale, x));
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

// dx: [B, s_res, H] → embedding weight grad (+=)
int ml_embed_backward(ml_model *m, const int32_t *ids, float *dx) {
  const ml_embedding *e = &m->embed_tokens;
  const ml_param *w = e->weight;
  int64_t row0 = w->offset[0];
  ml_act v = ml_act_view(m, dx, m->s_res, m->cfg.hidden, m->cfg.hidden);
  ML_TRY(ml_hook_run(e->out.bwd, &v));
  if (v.s != m->S || v.c != w->local[1])
    return ml_err("%s: the output gradient is [%lld positions, %lld features] after its edge; "
                  "expected [%lld, %lld]",
                  w->name, (long long)v.s, (long long)v.c, (long long)m->S,
                  (long long)w->local[1]);
  return ml_be_embedding_bwd(m->be, ids, m->B * m->S, dx, row0, w->local[0], w->local[1],
                             e->scale, w->grad);
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
