#include "parallel/objective.h"

#include <math.h>
#include <stdlib.h>

#include "common/checked.h"
#include "common/status.h"

/* ℓ and dℓ/dlp of the clipped surrogate (NeMo RL ClippedPGLossFn):
 * l1 = −A·r, l2 = −A·clamp(r, 1 − ε_low, 1 + ε_high), ℓ = max(l1, l2), and
 * where A < 0 with dual clip c: min(ℓ, −A·c). torch.maximum splits the
 * gradient of a tie, but a tie means clamp(r) = r (or A = 0), where both
 * branches have the slope −A·r; a strict l2 > l1 is a clipped ratio, whose
 * clamp passes no gradient, as does the constant −A·c. */
static double clipped_pg(const ml_objective *o, double A, double r, double *dl, int *clipped) {
  double lo = 1.0 - o->clip_low, hi = 1.0 + o->clip_high;
  double rc = r < lo ? lo : r > hi ? hi : r;
  double l1 = -A * r, l2 = -A * rc, l = l1 >= l2 ? l1 : l2;
  *dl = l1 >= l2 ? -A * r : 0.0;
  if (o->clip_c > 1.0 && A < 0.0 && -A * o->clip_c < l) {
    l = -A * o->clip_c;
    *dl = 0.0;
  }
  *clipped = *dl == 0.0 && A != 0.0;
  return l;
}

float ml_objective_token(const ml_objective *o, const ml_obj_in *in, float lp, ml_obj_sums *acc) {
  double w = in->w;
  if (w == 0.0) return 0.0f;
  double x = lp, A = in->adv, l, dl;
  int clipped = 0;
  switch (o->kind) {
  case ML_OBJ_WEIGHTED_NLL:
    l = -A * x;
    dl = -A;
    break;
  case ML_OBJ_CLIPPED_PG:
    l = clipped_pg(o, A, exp(x - (double)in->old_lp), &dl, &clipped);
    if (o->is_weighted) {
      l *= in->rho;
      dl *= in->rho;
    }
    break;
  case ML_OBJ_NLL:
  default:
    l = -x;
    dl = -1.0;
    break;
  }
  if (o->kind != ML_OBJ_NLL && o->kl_beta > 0.0) {
    /* k3 = e^d − d − 1 with d = ref − lp; dk3/dlp = 1 − e^d */
    double d = (double)in->ref_lp - x, e = exp(d), k3 = o->kl_beta * (e - d - 1.0);
    l += k3;
    dl += o->kl_beta * (1.0 - e);
    acc->kl += w * k3;
  }
  acc->loss += w * l;
  acc->trained++;
  acc->clipped += clipped;
  return (float)(-w * dl);
}

bool ml_objective_own_only(const ml_objective *o) { return o->kind == ML_OBJ_CUSTOM; }

/* CUSTOM: the trained targets (a target, weight in.w != 0) of [own0, own1)
 * compacted into one call of the caller's objective; every other weight 0. */
static int custom_chunk(const ml_objective *o, int64_t n, const float *lp, const ml_obj_in *in,
                        int64_t own0, int64_t own1, float *w, ml_obj_sums *acc) {
  int64_t m = 0;
  for (int64_t i = own0; i < own1; i++) m += w[i] != 0.0f && in[i].w != 0.0f;
  /* per target: lp (float), in, loss and grad (2 doubles); m <= n, a buffer's size */
  size_t each = sizeof(float) + sizeof(ml_obj_in) + 2 * sizeof(double);
  char *mem = m ? ml_malloc_array(m, each, "the objective's chunk (%lld targets)", (long long)m)
                : NULL;
  if (m && !mem) return -1;
  ml_obj_in *cin = (ml_obj_in *)mem;
  double *loss = (double *)(cin + m), *grad = loss + m;
  float *clp = (float *)(grad + m);
  int64_t j = 0;
  for (int64_t i = own0; i < own1; i++)
    if (w[i] != 0.0f && in[i].w != 0.0f) {
      cin[j] = in[i];
      clp[j++] = lp[i];
    }
  int rc = m ? o->fn(o->ctx, m, clp, cin, loss, grad) : 0;
  j = 0;
  for (int64_t i = 0; i < n; i++) {
    bool mine = i >= own0 && i < own1 && w[i] != 0.0f && in[i].w != 0.0f;
    w[i] = mine && rc == 0 ? (float)(-grad[j]) : 0.0f;
    if (mine && rc == 0) acc->loss += loss[j];
    j += mine;
  }
  acc->trained += m;
  free(mem);
  return rc;
}

int ml_objective_chunk(const ml_objective *o, int64_t n, const float *lp, const ml_obj_in *in,
                       int64_t own0, int64_t own1, float *w, ml_obj_sums *acc) {
  if (o->kind == ML_OBJ_CUSTOM) return custom_chunk(o, n, lp, in, own0, own1, w, acc);
  ml_obj_sums others = {0};
  for (int64_t i = 0; i < n; i++) {
    ml_obj_sums *a = i >= own0 && i < own1 ? acc : &others;
    w[i] = w[i] != 0.0f ? ml_objective_token(o, &in[i], lp[i], a) : 0.0f;
  }
  return 0;
}
