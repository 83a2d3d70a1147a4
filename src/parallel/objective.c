#include "parallel/objective.h"

#include <math.h>

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
