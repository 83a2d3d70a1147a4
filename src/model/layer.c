/* Decoder layer forward/backward (HF LlamaDecoderLayer):
 *   h1 = input_layernorm(x); x_mid = x + o_proj(attn(rope(q(h1)), rope(k(h1)), v(h1)))
 *   h2 = post_attention_layernorm(x_mid); out = x_mid + down(act(gate(h2)) · up(h2)) */
#include <math.h>
#include <string.h>

#include "common/status.h"
#include "kernels/cpu/kernels.h"
#include "model/linear.h"

static void add_inplace(float *y, const float *x, int64_t n) {
#pragma omp parallel for simd
  for (int64_t i = 0; i < n; i++) y[i] += x[i];
}

static void norm_fwd(const ml_rmsnorm *n, const float *x, float *y, float *rstd, int64_t T,
                     int64_t H) {
  k_rmsnorm_fwd(x, n->weight->data, n->offset, n->eps, y, rstd, T, H);
}

static void norm_bwd(const ml_rmsnorm *n, const float *dy, const float *x, const float *rstd,
                     float *dx, int64_t T, int64_t H) {
  k_rmsnorm_bwd(dy, x, n->weight->data, n->offset, rstd, dx,
                n->weight->grad, T, H);
}

// x: [T, H] in place (residual stream)
static int attention_forward(ml_model *m, ml_layer *L, float *x) {
  ml_layer_acts *a = &L->acts;
  int64_t B = m->B, S = m->S, T = B * S, H = m->cfg.hidden, hd = m->cfg.head_dim;
  int64_t nh = L->q_proj.weight->local[0] / hd, nkv = L->k_proj.weight->local[0] / hd;
  memcpy(a->x_in, x, sizeof(float) * (size_t)(T * H));
  norm_fwd(&L->input_layernorm, a->x_in, a->h1, a->rstd1, T, H);
  ML_TRY(ml_hook_run(L->q_proj.in_fwd, a->h1, T, H)); /* shared by q/k/v */
  ML_TRY(ml_linear_forward(&L->q_proj, a->h1, a->q, T));  // q: [T, nh·hd]
  ML_TRY(ml_linear_forward(&L->k_proj, a->h1, a->k, T));  // k: [T, nkv·hd]
  ML_TRY(ml_linear_forward(&L->v_proj, a->h1, a->v, T));  // v: [T, nkv·hd]
  k_rope_fwd(a->q, m->rope_cos, m->rope_sin, B, S, nh, hd);
  k_rope_fwd(a->k, m->rope_cos, m->rope_sin, B, S, nkv, hd);
  float scale = 1.0f / sqrtf((float)hd);
  k_attention_fwd(a->q, a->k, a->v, a->att, a->P, B, S, nh, nkv, hd, scale, 0);
  ML_TRY(ml_hook_run(L->o_proj.in_fwd, a->att, T, nh * hd));
  ML_TRY(ml_linear_forward(&L->o_proj, a->att, x, T));  // x: [T, H] attention output
  add_inplace(x, a->x_in, T * H);                       // residual
  memcpy(a->x_mid, x, sizeof(float) * (size_t)(T * H));
  return 0;
}

// x: [T, H] in place
static int mlp_forward(ml_model *m, ml_layer *L, float *x) {
  ml_layer_acts *a = &L->acts;
  int64_t T = m->B * m->S, H = m->cfg.hidden, I = L->gate_proj.weight->local[0];
  norm_fwd(&L->post_attention_layernorm, a->x_mid, a->h2, a->rstd2, T, H);
  ML_TRY(ml_hook_run(L->gate_proj.in_fwd, a->h2, T, H)); /* shared by gate/up */
  ML_TRY(ml_linear_forward(&L->gate_proj, a->h2, a->g, T));  // g: [T, I]
  ML_TRY(ml_linear_forward(&L->up_proj, a->h2, a->u, T));    // u: [T, I]
  k_glu_fwd(a->g, a->u, a->a, T * I, m->cfg.family->act);
  ML_TRY(ml_hook_run(L->down_proj.in_fwd, a->a, T, I));
  ML_TRY(ml_linear_forward(&L->down_proj, a->a, x, T));  // x: [T, H]
  add_inplace(x, a->x_mid, T * H);
  return 0;
}

int ml_layer_forward(ml_model *m, int l, float *x) {
  ml_layer *L = &m->layers[l];
  ML_TRY(attention_forward(m, L, x));
  return mlp_forward(m, L, x);
}

// dx: [T, H] grad of the layer output in, grad of x_mid out
static int mlp_backward(ml_model *m, ml_layer *L, float *dx) {
  ml_layer_acts *a = &L->acts;
  int64_t T = m->B * m->S, H = m->cfg.hidden, I = L->gate_proj.weight->local[0];
  float *dtmp = m->scratch, *dh = dtmp + T * H, *da = dh + T * H;
  float *dg = da + T * I, *du = dg + T * I;
  memcpy(dtmp, dx, sizeof(float) * (size_t)(T * H));
  ML_TRY(ml_linear_backward(&L->down_proj, dtmp, a->a, da, 0, T));  // da: [T, I]
  ML_TRY(ml_hook_run(L->down_proj.in_bwd, da, T, I));
  k_glu_bwd(da, a->g, a->u, dg, du, T * I, m->cfg.family->act);
  ML_TRY(ml_linear_backward(&L->gate_proj, dg, a->h2, dh, 0, T));  // dh: [T, H]
  ML_TRY(ml_linear_backward(&L->up_proj, du, a->h2, dh, 1, T));
  ML_TRY(ml_hook_run(L->gate_proj.in_bwd, dh, T, H));
  norm_bwd(&L->post_attention_layernorm, dh, a->x_mid, a->rstd2, dh, T, H);
  add_inplace(dx, dh, T * H);  // residual: d x_mid
  return 0;
}

// dx: [T, H] grad of x_mid in, grad of the layer input out
static int attention_backward(ml_model *m, ml_layer *L, float *dx) {
  ml_layer_acts *a = &L->acts;
  int64_t B = m->B, S = m->S, T = B * S, H = m->cfg.hidden, hd = m->cfg.head_dim;
  int64_t nh = L->q_proj.weight->local[0] / hd, nkv = L->k_proj.weight->local[0] / hd;
  float *dtmp = m->scratch, *dh = dtmp + T * H, *datt = dh + T * H;
  float *dq = datt + T * nh * hd, *dk = dq + T * nh * hd, *dv = dk + T * nkv * hd;
  memcpy(dtmp, dx, sizeof(float) * (size_t)(T * H));
  ML_TRY(ml_linear_backward(&L->o_proj, dtmp, a->att, datt, 0, T));  // datt: [T, nh·hd]
  ML_TRY(ml_hook_run(L->o_proj.in_bwd, datt, T, nh * hd));
  float scale = 1.0f / sqrtf((float)hd);
  k_attention_bwd(datt, a->q, a->k, a->v, a->P, dq, dk, dv, B, S, nh, nkv, hd, scale);
  k_rope_bwd(dq, m->rope_cos, m->rope_sin, B, S, nh, hd);
  k_rope_bwd(dk, m->rope_cos, m->rope_sin, B, S, nkv, hd);
  ML_TRY(ml_linear_backward(&L->q_proj, dq, a->h1, dh, 0, T));  // dh: [T, H]
  ML_TRY(ml_linear_backward(&L->k_proj, dk, a->h1, dh, 1, T));
  ML_TRY(ml_linear_backward(&L->v_proj, dv, a->h1, dh, 1, T));
  ML_TRY(ml_hook_run(L->q_proj.in_bwd, dh, T, H));
  norm_bwd(&L->input_layernorm, dh, a->x_in, a->rstd1, dh, T, H);
  add_inplace(dx, dh, T * H);  // residual: d x_in
  return 0;
}

int ml_layer_backward(ml_model *m, int l, float *dx) {
  ml_layer *L = &m->layers[l];
  ML_TRY(mlp_backward(m, L, dx));
  return attention_backward(m, L, dx);
}
