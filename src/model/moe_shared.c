/* The sparse block's shared expert (model/moe_shared.h): its MLP and gate on
 * the backend's GEMMs and GLU, the sigmoid and the gated sum on the host. */
#include "model/moe_shared.h"

#include <math.h>
#include <string.h>

#include "common/status.h"
#include "model/linear.h"

/* The view of buffer x as h's tokens with c features. */
static ml_act like(const ml_act *h, float *x, int64_t c) {
  return (ml_act){x, h->B, h->S, h->s, c, c};
}

// h: [T, H] → y: [T, H] (+=)
int ml_moe_shared_forward(ml_model *m, ml_layer *L, const ml_act *h, float *y) {
  const ml_moe *moe = &L->moe;
  if (!moe->shared_gate.weight) return 0;
  ml_layer_acts *a = &L->acts;
  int64_t T = h->B * h->s, H = m->cfg.hidden, Is = m->cfg.shared_inter;
  ml_act v;
  ML_TRY(ml_linear_forward(m->be, &moe->shared[0], h, NULL, a->sg, &v));  // sg: [T, I_s]
  ML_TRY(ml_linear_forward(m->be, &moe->shared[1], h, NULL, a->su, &v));  // su: [T, I_s]
  ML_TRY(ml_be_glu_fwd(m->be, a->sg, a->su, a->sa, T * Is, m->cfg.family->act));  // sa: [T, I_s]
  ml_act av = like(h, a->sa, Is);
  ML_TRY(ml_linear_forward(m->be, &moe->shared[2], &av, NULL, a->sy, &v));  // sy: [T, H]
  ML_TRY(ml_linear_forward(m->be, &moe->shared_gate, h, NULL, a->sz, &v));  // sz: [T, 1] logits
  ML_TRY(ml_be_sync(m->be));
  if (!ml_be_host_memory(m->be)) return 0; /* the meta backend: sizes only */
  for (int64_t t = 0; t < T; t++) { /* z_t = sigmoid(logit_t); y_t += z_t · sy_t */
    float z = 1.0f / (1.0f + expf(-a->sz[t])), *yt = y + t * H;
    const float *st = a->sy + t * H;
    a->sz[t] = z;
    for (int64_t c = 0; c < H; c++) yt[c] += z * st[c];
  }
  return 0;
}

/* The floats of the backward's scratch: ds [T, H]; da, dg, du [T, I_s]; dz [T]. */
enum { SB_DS, SB_DA, SB_DG, SB_DU, SB_DZ, SB_N };

// dy: [T, H] → dh: [T, H] (+=)
int ml_moe_shared_backward(ml_model *m, ml_layer *L, const ml_act *h, const float *dy, float *dh) {
  ml_moe *moe = &L->moe;
  if (!moe->shared_gate.weight) return 0;
  const ml_layer_acts *a = &L->acts;
  int64_t T = h->B * h->s, H = m->cfg.hidden, Is = m->cfg.shared_inter;
  const int64_t size[SB_N] = {T * H, T * Is, T * Is, T * Is, T};
  int64_t total = 0, at[SB_N];
  for (int i = 0; i < SB_N; i++) {
    at[i] = total;
    total += (size[i] + 15) / 16 * 16; /* 64-byte aligned pieces */
  }
  float *buf = ml_be_alloc(m->be, total, sizeof(float),
                           "the shared expert's backward (%lld floats)", (long long)total);
  if (!buf) return -1;
  float *ds = buf + at[SB_DS], *da = buf + at[SB_DA], *dg = buf + at[SB_DG];
  float *du = buf + at[SB_DU], *dz = buf + at[SB_DZ];
  int rc = ml_be_sync(m->be);
  /* dz_t = (dy_t · sy_t) · z_t (1 − z_t) (sigmoid's backward); ds_t = z_t · dy_t */
  for (int64_t t = 0; !rc && ml_be_host_memory(m->be) && t < T; t++) {
    const float *g = dy + t * H, *st = a->sy + t * H;
    float z = a->sz[t], dot = 0.0f, *d = ds + t * H;
    for (int64_t c = 0; c < H; c++) {
      dot += g[c] * st[c];
      d[c] = z * g[c];
    }
    dz[t] = dot * z * (1.0f - z);
  }
  ml_act dsv = like(h, ds, H), av = like(h, a->sa, Is), dgv = like(h, dg, Is);
  ml_act duv = like(h, du, Is), dzv = like(h, dz, 1);
  if (!rc) rc = ml_linear_backward(m->be, &moe->shared[2], &dsv, &av, NULL, da, 0);  // da: [T, I_s]
  if (!rc) rc = ml_be_glu_bwd(m->be, da, a->sg, a->su, dg, du, T * Is, m->cfg.family->act);
  if (!rc) rc = ml_linear_backward(m->be, &moe->shared[0], &dgv, h, NULL, dh, 1);  // dh +=
  if (!rc) rc = ml_linear_backward(m->be, &moe->shared[1], &duv, h, NULL, dh, 1);  // dh +=
  if (!rc) rc = ml_linear_backward(m->be, &moe->shared_gate, &dzv, h, NULL, dh, 1);  // dh +=
  if (!rc) rc = ml_be_sync(m->be);
  ml_be_free(m->be, buf);
  return rc;
}
