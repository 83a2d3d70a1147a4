/* Root modules: embed_tokens (input side) and norm + lm_head (output side). */
#include <string.h>

#include "common/status.h"
#include "kernels/cpu/kernels.h"
#include "model/linear.h"

// ids: [T] → x: [T, H]
int ml_embed_forward(ml_model *m, const int32_t *ids, float *x) {
  const ml_embedding *e = &m->embed_tokens;
  const ml_param *w = e->weight;
  int64_t T = m->B * m->S, H = m->cfg.hidden;
  int64_t row0 = w->tp_dim == 0 ? w->tp_start : 0;
  k_embedding_fwd(ids, T, w->data, row0, w->local[0], H, e->scale, x);
  return ml_hook_run(e->out_fwd, x, T, H);
}

// dx: [T, H] → embedding weight grad (+=)
int ml_embed_backward(ml_model *m, const int32_t *ids, float *dx) {
  const ml_embedding *e = &m->embed_tokens;
  const ml_param *w = e->weight;
  int64_t T = m->B * m->S, H = m->cfg.hidden;
  int64_t row0 = w->tp_dim == 0 ? w->tp_start : 0;
  ML_TRY(ml_hook_run(e->out_bwd, dx, T, H));
  k_embedding_bwd(ids, T, dx, row0, w->local[0], H, e->scale, w->grad);
  return 0;
}

// x: [T, H] → xn_final [T, H]
int ml_head_begin(ml_model *m, const float *x) {
  int64_t T = m->B * m->S, H = m->cfg.hidden;
  memcpy(m->x_final, x, sizeof(float) * (size_t)(T * H));
  k_rmsnorm_fwd(m->x_final, m->norm.weight->data, m->norm.offset, m->norm.eps, m->xn_final,
                m->rstd_final, T, H);
  memset(m->dxn_final, 0, sizeof(float) * (size_t)(T * H));
  return ml_hook_run(m->lm_head.in_fwd, m->xn_final, T, H);
}

// logits: [nt, V_local]
int ml_head_forward(ml_model *m, int64_t t0, int64_t nt, float *logits) {
  return ml_linear_forward(&m->lm_head, m->xn_final + t0 * m->cfg.hidden, logits, nt);
}

// dlogits: [nt, V_local] → dxn_final[t0 : t0+nt] (=)
int ml_head_backward(ml_model *m, int64_t t0, int64_t nt, float *dlogits) {
  int64_t H = m->cfg.hidden;
  return ml_linear_backward(&m->lm_head, dlogits, m->xn_final + t0 * H, m->dxn_final + t0 * H, 0,
                            nt);
}

// dx: [T, H] (=)
int ml_head_end_backward(ml_model *m, float *dx) {
  int64_t T = m->B * m->S, H = m->cfg.hidden;
  ML_TRY(ml_hook_run(m->lm_head.in_bwd, m->dxn_final, T, H));
  k_rmsnorm_bwd(m->dxn_final, m->x_final, m->norm.weight->data, m->norm.offset, m->rstd_final, dx,
                m->norm.weight->grad, T, H);
  return 0;
}
