/* The per-token objectives (parallel/objective.h ml_objective_token)
 * against a double-precision reference written here from NeMo RL's loss
 * functions as include/meshlm/meshlm.h states them:
 *   NLL           ℓ = −lp
 *   WEIGHTED_NLL  ℓ = −A·lp
 *   CLIPPED_PG    r = exp(lp − old), ℓ = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)),
 *                 where A < 0 and c > 1: min(ℓ, −A·c)          (ClippedPGLossFn)
 *   + β·k3, k3 = exp(ref − lp) − (ref − lp) − 1 for WEIGHTED_NLL and CLIPPED_PG
 *                                             (calculate_kl_penalty_joschu2020).
 * For every case (ε_low ≠ ε_high, without and with the dual clip c = 3,
 * advantages of both signs and 0, ratios below, inside and above the clip
 * range and beyond c, β = 0 and 0.1, log-probs from −0.05 to −7):
 *  - the loss added to the sums is w·ℓ (and the kl sum w·β·k3) of the
 *    reference, within both sides' double rounding;
 *  - the returned coefficient is −w·dℓ/dlp from a central finite difference
 *    of the reference in double, within the bound derived at fd_bound;
 *    exactly 0 where the clip removes the gradient (β = 0);
 *  - the clipped and trained counts;
 *  - a target with w = 0 adds nothing (bitwise) and returns 0, whatever its
 *    other inputs (NaN). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>  // after the headers it needs

#include "parallel/objective.h"
#include "tolerance.h"

/* ---- the reference -------------------------------------------------------- */

/* NeMo RL's formulas, literally, in double. *kl: β·k3 (0 without it). */
static double ref_loss(const ml_objective *o, double A, double old, double ref, double x,
                       double *kl) {
  double l;
  switch (o->kind) {
  case ML_OBJ_NLL:
    l = -x;
    break;
  case ML_OBJ_WEIGHTED_NLL:
    l = -A * x;
    break;
  default: {
    double ratio = exp(x - old);
    double clamped = fmin(fmax(ratio, 1.0 - o->clip_low), 1.0 + o->clip_high);
    double loss1 = -A * ratio, loss2 = -A * clamped;
    l = fmax(loss1, loss2);
    if (o->clip_c > 1.0 && A < 0.0) l = fmin(l, -A * o->clip_c); /* dual clip */
  }
  }
  *kl = 0.0;
  if (o->kind != ML_OBJ_NLL && o->kl_beta > 0.0) {
    double d = ref - x;
    *kl = o->kl_beta * (exp(d) - d - 1.0);
  }
  return l + *kl;
}

/* Where the clip passes no gradient through the ratio (torch.max/clamp's
 * subgradients): A > 0 above 1 + ε_high, A < 0 below 1 − ε_low, and A < 0
 * above c under the dual clip. */
static int clipped_region(const ml_objective *o, double A, double r) {
  if (o->kind != ML_OBJ_CLIPPED_PG || A == 0.0) return 0;
  if (A > 0.0) return r > 1.0 + o->clip_high;
  return r < 1.0 - o->clip_low || (o->clip_c > 1.0 && r > o->clip_c);
}

/* Distance (in log r) from x to the nearest kink of ℓ: the clip bounds and c. */
static double kink_distance(const ml_objective *o, double lr) {
  double k[3] = {log(1.0 - o->clip_low), log(1.0 + o->clip_high),
                 o->clip_c > 1.0 ? log(o->clip_c) : INFINITY};
  double m = INFINITY;
  for (int i = 0; i < 3; i++) m = fmin(m, fabs(lr - k[i]));
  return m;
}

/* ---- bounds --------------------------------------------------------------- */

/* Roundings of one evaluation of ℓ (either side: ref_loss, or the double
 * arithmetic inside ml_objective_token), R3 with R4: r = exp(x − old): the
 * subtraction 1 (an absolute error u64|x − old| of the exponent, i.e. a
 * relative one of r: counted as |x − old| more), exp TOL_LIBM, −A·r 1,
 * clamp/max/min exact; k3: d 1 (|d| more through exp), exp TOL_LIBM, two
 * subtractions 2, β· 1; the sum 1, w· 1. Counted generously against the
 * |.|-evaluation labs() below. */
static double k_eval(double x, double old, double ref) {
  return 2.0 * TOL_LIBM + 12.0 + fabs(x - old) + fabs(ref - x);
}

/* The |.|-evaluation of ℓ at x (every branch's magnitude, so that it
 * covers whichever branch either side takes). */
static double labs_at(const ml_objective *o, double A, double old, double ref, double x) {
  double r = exp(x - old), a = fabs(x) * (fabs(A) + 1.0);
  if (o->kind == ML_OBJ_CLIPPED_PG)
    a += fabs(A) * (r + 1.0 + o->clip_high + (o->clip_c > 1.0 ? o->clip_c : 0.0));
  if (o->kind != ML_OBJ_NLL && o->kl_beta > 0.0) {
    double d = ref - x;
    a += o->kl_beta * (exp(d) + fabs(d) + 1.0);
  }
  return a;
}

/* |ℓ'''| on [x − h, x + h] (no kink inside): the ratio branch −A·e^(x−old)
 * has ℓ''' = −A·r, the clipped branches are constant or linear (0), NLL
 * and weighted NLL are linear (0); k3 = e^(ref−x) − (ref − x) − 1 has
 * k3''' = −e^(ref−x). Each is monotone in x, so its sup is at an end. */
static double m3(const ml_objective *o, double A, double old, double ref, double x, double h,
                 int clipped) {
  double m = 0.0;
  if (o->kind == ML_OBJ_CLIPPED_PG && !clipped) m += fabs(A) * exp(x + h - old);
  if (o->kind != ML_OBJ_NLL && o->kl_beta > 0.0) m += o->kl_beta * exp(ref - (x - h));
  return m;
}

/* A central difference (L(x + h1) − L(x − h2))/(h1 + h2) of the reference
 * differs from L'(x) by at most tolerance.h §2's Taylor term (with exact
 * steps h1 = h2 = h: h²/6·sup|L'''|; the steps are exact in double here:
 * x is an fp32 value of magnitude < 2^3 and h = 2^-15, so x ± h needs fewer
 * than 53 bits) plus the rounding of the two evaluations divided by the
 * step, (E(x + h1) + E(x − h2))/(h1 + h2), E = gamma64(k_eval)·labs.
 * With h = 2^-15, |A| <= 2, r <= 4, β e^d <= 0.2: Taylor <= 1.5e-9, rounding
 * <= 1e-10 · labs — two orders below the fp32 rounding of the coefficient
 * (u ≈ 6e-8 relative), so the check resolves the coefficient to fp32. */
static double fd_bound(const ml_objective *o, double A, double old, double ref, double x,
                       double h1, double h2, int clipped) {
  double M3 = m3(o, A, old, ref, x, fmax(h1, h2), clipped);
  double E1 = tol_gamma64(k_eval(x + h1, old, ref)) * labs_at(o, A, old, ref, x + h1);
  double E2 = tol_gamma64(k_eval(x - h2, old, ref)) * labs_at(o, A, old, ref, x - h2);
  return tol_fd_taylor(h1, h2, 0.0, M3) + (E1 + E2) / (h1 + h2);
}

/* ---- the cases ------------------------------------------------------------ */

typedef struct worst {
  double loss, kl, coef; /* error / bound */
  int cases, clipped_cases, fd_cases;
} worst;

/* One target through ml_objective_token against the reference. */
static void check_token(const ml_objective *o, float w, float A, float x, double log_r,
                        double d_ref, worst *wst) {
  ml_obj_in in = {w, A, 0.0f, 0.0f, -1, 1.0f};
  in.old_lp = (float)((double)x - log_r);
  in.ref_lp = (float)((double)x + d_ref);
  double old = in.old_lp, ref = in.ref_lp, xd = x, Ad = A, wd = w;
  double r = exp(xd - old); /* the ratio the inputs actually give (after rounding) */
  int clipped = clipped_region(o, Ad, r);

  ml_obj_sums acc = {0};
  float coef = ml_objective_token(o, &in, x, &acc);

  /* the sums */
  double kl_ref, l_ref = ref_loss(o, Ad, old, ref, xd, &kl_ref);
  double tl = TOL_FIRST_ORDER * 2.0 * tol_gamma64(k_eval(xd, old, ref)) * wd *
              labs_at(o, Ad, old, ref, xd);
  double el = fabs(acc.loss - wd * l_ref), ek = fabs(acc.kl - wd * kl_ref);
  if (el > tl || ek > tl)
    fail_msg("kind %d clip (%g, %g, c %g) beta %g, A %g, x %g, log r %g: loss %.17g vs "
             "reference %.17g, kl %.17g vs %.17g (bound %.3g)",
             (int)o->kind, o->clip_low, o->clip_high, o->clip_c, o->kl_beta, Ad, xd, log_r,
             acc.loss, wd * l_ref, acc.kl, wd * kl_ref, tl);
  wst->loss = fmax(wst->loss, el / tl);
  wst->kl = fmax(wst->kl, ek / tl);
  assert_int_equal(acc.trained, 1);
  assert_int_equal(acc.clipped, clipped);
  if (o->kind == ML_OBJ_NLL || o->kl_beta == 0.0) assert_true(acc.kl == 0.0);

  /* the coefficient: exactly 0 where the clip removes the gradient (no KL) */
  if (clipped && o->kl_beta == 0.0) {
    if (coef != 0.0f)
      fail_msg("kind %d, A %g, r %g (clipped): coefficient %.9g, expected exactly 0",
               (int)o->kind, Ad, r, (double)coef);
    wst->clipped_cases++;
  }
  /* −w·dℓ/dlp by a central difference away from the kinks */
  double lr = xd - old;
  if (o->kind != ML_OBJ_CLIPPED_PG || kink_distance(o, lr) > 1e-3) {
    double h = 0x1p-15, h1 = (xd + h) - xd, h2 = xd - (xd - h), kp, km;
    double fd = (ref_loss(o, Ad, old, ref, xd + h1, &kp) - ref_loss(o, Ad, old, ref, xd - h2, &km)) /
                (h1 + h2);
    double want = -wd * fd;
    /* the implementation's dℓ in double (its own roundings against the
     * |.|-evaluation of the derivative: |A|·r + |A| + 1 + β(e^d + 1)), the
     * FD's error, and the conversion of −w·dℓ to fp32 (R1: u·|coef|) */
    double dabs = fabs(Ad) * (r + 1.0) + 1.0 + o->kl_beta * (exp(ref - xd) + 1.0);
    double tc = TOL_FIRST_ORDER * (wd * fd_bound(o, Ad, old, ref, xd, h1, h2, clipped) +
                                   wd * tol_gamma64(k_eval(xd, old, ref)) * dabs +
                                   TOL_U * fabs((double)coef));
    double ec = fabs((double)coef - want);
    if (ec > tc)
      fail_msg("kind %d clip (%g, %g, c %g) beta %g, w %g, A %g, x %g, r %g: coefficient "
               "%.9g, -w dL/dlp by central difference %.12g (|err| %.3g > bound %.3g)",
               (int)o->kind, o->clip_low, o->clip_high, o->clip_c, o->kl_beta, wd, Ad, xd, r,
               (double)coef, want, ec, tc);
    wst->coef = fmax(wst->coef, ec / tc);
    wst->fd_cases++;
  }
  wst->cases++;
}

/* Every combination for objective o. */
static void sweep(const ml_objective *o, worst *wst) {
  static const float ws[] = {1.0f, 1.0f / 37.0f};
  static const float As[] = {-1.5f, -0.4f, 0.0f, 0.7f, 2.0f};
  static const float xs[] = {-0.05f, -2.5f, -7.0f};
  /* log r: far below, below (r 0.74 < 0.8), inside, at 1, inside (1.22 <
   * 1.28), above (1.49), beyond c = 3 (3.67) */
  static const double lrs[] = {-1.0, -0.3, -0.1, 0.0, 0.2, 0.4, 1.3};
  static const double ds[] = {-0.5, 0.3};
  for (size_t a = 0; a < sizeof ws / sizeof *ws; a++)
    for (size_t b = 0; b < sizeof As / sizeof *As; b++)
      for (size_t c = 0; c < sizeof xs / sizeof *xs; c++)
        for (size_t e = 0; e < sizeof lrs / sizeof *lrs; e++)
          for (size_t f = 0; f < sizeof ds / sizeof *ds; f++)
            check_token(o, ws[a], As[b], xs[c], lrs[e], ds[f], wst);
}

static void report(const char *what, const worst *w) {
  printf("  %-40s %4d cases (%3d by central difference, %3d clipped exactly 0): worst "
         "error/bound loss %.3g, kl %.3g, coefficient %.3g\n",
         what, w->cases, w->fd_cases, w->clipped_cases, w->loss, w->kl, w->coef);
}

static void test_nll(void **state) {
  (void)state;
  for (int kl = 0; kl < 2; kl++) {
    /* β is documented for WEIGHTED_NLL and CLIPPED_PG only: NLL ignores it */
    ml_objective o = {ML_OBJ_NLL, 0.2, 0.28, 0.0, kl ? 0.1 : 0.0, false, NULL, NULL, 0.0};
    worst w = {0};
    sweep(&o, &w);
    report(kl ? "NLL (beta 0.1 set: ignored)" : "NLL", &w);
  }
}

static void test_weighted_nll(void **state) {
  (void)state;
  for (int kl = 0; kl < 2; kl++) {
    ml_objective o = {ML_OBJ_WEIGHTED_NLL, 0.2, 0.28, 0.0, kl ? 0.1 : 0.0, false, NULL, NULL, 0.0};
    worst w = {0};
    sweep(&o, &w);
    report(kl ? "WEIGHTED_NLL + k3 (beta 0.1)" : "WEIGHTED_NLL", &w);
  }
}

static void test_clipped_pg(void **state) {
  (void)state;
  for (int dual = 0; dual < 2; dual++)
    for (int kl = 0; kl < 2; kl++) {
      ml_objective o = {ML_OBJ_CLIPPED_PG, 0.2,   0.28, dual ? 3.0 : 0.0, kl ? 0.1 : 0.0,
                        false,             NULL,  NULL, 0.0};
      worst w = {0};
      sweep(&o, &w);
      char what[64];
      snprintf(what, sizeof what, "CLIPPED_PG eps 0.2/0.28%s%s", dual ? ", c 3" : "",
               kl ? " + k3 (beta 0.1)" : "");
      report(what, &w);
      if (!kl) assert_true(w.clipped_cases > 0);
    }
}

/* The regions, case by case, with the values NeMo's formula gives by hand
 * (A = ±1, ε 0.2/0.28, c 3, w 1, β 0): ℓ, the coefficient −dℓ/dlp = A·r
 * where the ratio passes the gradient, and whether it counts as clipped. */
static void test_regions_by_hand(void **state) {
  (void)state;
  ml_objective o = {ML_OBJ_CLIPPED_PG, 0.2, 0.28, 3.0, 0.0, false, NULL, NULL, 0.0};
  struct {
    float A;
    double lr;
    double loss; /* closed form */
    int grad;    /* gradient flows (coef = A·r) */
    int clipped;
  } cs[] = {
      {1.0f, log(0.5), -0.5, 1, 0},   /* A > 0, r < 1 − ε_low: −A·r > −A·0.8, unclipped */
      {1.0f, log(1.1), -1.1, 1, 0},   /* inside */
      {1.0f, log(1.5), -1.28, 0, 1},  /* A > 0, r > 1 + ε_high: −A·1.28, clipped */
      {-1.0f, log(0.5), 0.8, 0, 1},   /* A < 0, r < 1 − ε_low: −A·0.8, clipped */
      {-1.0f, log(1.1), 1.1, 1, 0},   /* inside */
      {-1.0f, log(1.5), 1.5, 1, 0},   /* A < 0, 1.28 < r < c: −A·r (max), unclipped */
      {-1.0f, log(4.0), 3.0, 0, 1},   /* A < 0, r > c: dual clip −A·c, clipped */
  };
  for (size_t i = 0; i < sizeof cs / sizeof *cs; i++) {
    ml_obj_in in = {1.0f, cs[i].A, 0.0f, 0.0f, -1, 1.0f};
    float x = -1.0f;
    in.old_lp = (float)(x - cs[i].lr);
    double r = exp((double)x - in.old_lp);
    double want_loss = cs[i].loss * (cs[i].grad ? r / exp(cs[i].lr) : 1.0);
    ml_obj_sums acc = {0};
    float coef = ml_objective_token(&o, &in, x, &acc);
    double want_coef = cs[i].grad ? cs[i].A * r : 0.0;
    printf("  A %+g r %.3f: loss %.9f (want %.9f), coefficient %.9g (want %.9g), clipped %lld\n",
           (double)cs[i].A, r, acc.loss, want_loss, (double)coef, want_coef,
           (long long)acc.clipped);
    /* both closed forms in double: their roundings (k_eval) against the |.|-evaluation */
    double tl = 2.0 * tol_gamma64(k_eval(x, in.old_lp, 0.0)) * labs_at(&o, cs[i].A, in.old_lp, 0.0, x);
    assert_true(fabs(acc.loss - want_loss) <= tl);
    assert_true(fabs((double)coef - want_coef) <= 4.0 * TOL_U * fabs(want_coef));
    if (!cs[i].grad) assert_true(coef == 0.0f);
    assert_int_equal(acc.clipped, cs[i].clipped);
  }
}

/* w = 0: nothing added (bitwise), 0 returned, the other inputs unread. */
static void test_zero_weight(void **state) {
  (void)state;
  ml_obj_kind kinds[] = {ML_OBJ_NLL, ML_OBJ_WEIGHTED_NLL, ML_OBJ_CLIPPED_PG};
  for (int k = 0; k < 3; k++)
    for (int kl = 0; kl < 2; kl++) {
      ml_objective o = {kinds[k], 0.2, 0.28, 3.0, kl ? 0.1 : 0.0, false, NULL, NULL, 0.0};
      ml_obj_in in = {0.0f, NAN, NAN, NAN, -1, 1.0f};
      ml_obj_sums acc = {1.25, 0.5, 7, 3, 0.0}, before = acc;
      float coef = ml_objective_token(&o, &in, NAN, &acc);
      assert_true(coef == 0.0f && !signbit(coef));
      assert_memory_equal(&acc, &before, sizeof acc);
      in = (ml_obj_in){0.0f, 2.0f, -1.0f, -1.0f, -1, 1.0f};
      coef = ml_objective_token(&o, &in, -3.0f, &acc);
      assert_true(coef == 0.0f);
      assert_memory_equal(&acc, &before, sizeof acc);
    }
}

/* Sums accumulate over targets (+=), in double. */
static void test_accumulates(void **state) {
  (void)state;
  ml_objective o = {ML_OBJ_CLIPPED_PG, 0.2, 0.28, 3.0, 0.1, false, NULL, NULL, 0.0};
  ml_obj_in in[3] = {{0.25f, 1.0f, -1.0f, -1.2f, -1, 1.0f},
                     {0.25f, -1.0f, 0.0f, -0.7f, -1, 1.0f},  /* r = e^-1 < 0.8, A < 0: clipped */
                     {0.5f, 0.5f, -2.0f, -2.0f, -1, 1.0f}};
  float x[3] = {-1.1f, -1.0f, -2.0f};
  ml_obj_sums acc = {0};
  double want = 0, want_kl = 0;
  for (int i = 0; i < 3; i++) {
    ml_obj_sums one = {0};
    ml_objective_token(&o, &in[i], x[i], &one);
    ml_objective_token(&o, &in[i], x[i], &acc);
    want += one.loss;
    want_kl += one.kl;
  }
  assert_true(fabs(acc.loss - want) <= tol_gamma64(4.0) * 4.0 * fabs(want));
  assert_true(fabs(acc.kl - want_kl) <= tol_gamma64(4.0) * 4.0 * fabs(want_kl));
  assert_int_equal(acc.trained, 3);
  assert_int_equal(acc.clipped, 1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_nll),          cmocka_unit_test(test_weighted_nll),
      cmocka_unit_test(test_clipped_pg),   cmocka_unit_test(test_regions_by_hand),
      cmocka_unit_test(test_zero_weight),  cmocka_unit_test(test_accumulates),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
