#define _XOPEN_SOURCE 700

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <ftw.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train_check.h"

double step_rows(run *r, const batch *b) {
  int dp = ml_mesh_comm(&r->mesh, ML_GROUP_DP)->size, d = ml_mesh_comm(&r->mesh, ML_GROUP_DP)->rank;
  if (b->B % dp) fail_msg("%lld rows do not split over %d dp ranks", (long long)b->B, dp);
  int64_t Bl = b->B / dp;
  double loss;
  ml_engine_zero_grad(&r->e);
  if (ml_engine_forward_backward(&r->e, b->ids + d * Bl * b->S, b->mask + d * Bl * b->S, Bl, b->S,
                                 b->targets, &loss))
    fail_msg("step: %s", ml_error_msg());
  return loss;
}

double worst_rel(run *ra, run *rb, ml_export_what what, bool *exact) {
  float **a = export_all(ra, what), **b = export_all(rb, what);
  double worst = 0;
  *exact = true;
  for (int i = 0; i < ra->e.model.n_params; i++) {
    const ml_param *p = ml_engine_export_param(&ra->e, i);
    int64_t n = p->shape[0] * p->shape[1];
    worst = fmax(worst, rel_l2(a[i], b[i], n));
    if (memcmp(a[i], b[i], sizeof(float) * (size_t)n)) *exact = false;
  }
  free_all(b);
  free_all(a);
  return worst;
}

/* The fixture batch's log-probs [B, S−1] from r (every rank scores the
 * whole batch: the engine's logprobs are per local batch). */
static double *run_logprobs(run *r, const fixture *fx) {
  int64_t n = fx->B * (fx->S - 1);
  float *lp = malloc(sizeof(float) * (size_t)n);
  double *out = malloc(sizeof(double) * (size_t)n);
  if (!lp || !out) fail_msg("logprobs: out of memory");
  if (ml_engine_logprobs(&r->e, fx->ids, fx->B, fx->S, lp))
    fail_msg("logprobs: %s", ml_error_msg());
  for (int64_t i = 0; i < n; i++) out[i] = lp[i];
  free(lp);
  return out;
}

run_diff run_compare(run *r, run *ref, const fixture *fx, const batch *bt) {
  run_diff d = {0};
  double l = step_rows(r, bt);
  d.loss_ref = step_rows(ref, bt);
  d.loss_rel = fabs(l - d.loss_ref) / fabs(d.loss_ref);
  d.grad_rel = worst_rel(r, ref, ML_EXPORT_GRADS, &d.grads_exact);
  double *lp = run_logprobs(r, fx), *lp_ref = run_logprobs(ref, fx);
  int64_t n = fx->B * (fx->S - 1);
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) {
    double e = fabs(lp[i] - lp_ref[i]);
    d.logprob_mean_abs += e;
    d.logprob_max_abs = fmax(d.logprob_max_abs, e);
    num += e * e;
    den += lp_ref[i] * lp_ref[i];
  }
  if (n) d.logprob_mean_abs /= (double)n;
  d.logprob_rel_l2 = den > 0 ? sqrt(num / den) : sqrt(num);
  free(lp_ref);
  free(lp);
  return d;
}

ml_engine_opts bf16_engine_opts(void) {
  ml_engine_opts o = ml_engine_opts_default();
  o.fsdp.param_dtype = ML_BF16;
  return o;
}

norms grad_norms(run *ra, run *rb) {
  float **a = export_all(ra, ML_EXPORT_GRADS), **b = export_all(rb, ML_EXPORT_GRADS);
  norms o = {0};
  double ss = 0, dd = 0;
  for (int i = 0; i < ra->e.model.n_params; i++) {
    const ml_param *p = ml_engine_export_param(&ra->e, i);
    int64_t n = p->shape[0] * p->shape[1];
    for (int64_t k = 0; k < n; k++) {
      double x = a[i][k], d = x - b[i][k]; /* exact: fp32 values in double */
      o.inf = fmax(o.inf, fabs(x));
      o.dinf = fmax(o.dinf, fabs(d));
      ss += x * x;
      dd += d * d;
    }
    o.n += n;
  }
  free_all(b);
  free_all(a);
  o.l2 = sqrt(ss);
  o.dl2 = sqrt(dd);
  return o;
}

double engine_norm(run *r, double type) {
  double v;
  if (ml_engine_grad_norm(&r->e, type, &v)) fail_msg("grad norm: %s", ml_error_msg());
  return v;
}

double check_norm_partials(run *r, double type, const char *what) {
  if (r->e.norm.have != type) /* the backward computed none for this norm */
    fail_msg("%s: no grad-norm partials held for norm type %g", what, type);
  double held = engine_norm(r, type);
  if (r->e.norm.have != 0) fail_msg("%s: the grad norm left its partials held", what);
  double pass = engine_norm(r, type);
  if (rank0()) printf("%s norm %g: %.17g (partials), %.17g (pass)\n", what, type, held, pass);
  assert_true(held > 0);
  assert_memory_equal(&held, &pass, sizeof held);
  return held;
}

void check_norms(run *ref, run *const *runs, int n) {
  norms self = grad_norms(ref, ref);
  double t1 = tol_norm2_rel((double)self.n);
  double inf1 = engine_norm(ref, INFINITY), l21 = engine_norm(ref, 2.0);
  assert_true(fabs(inf1 - self.inf) <= TOL_EXACT);
  assert_true(fabs(l21 - self.l2) <= 2 * t1 * self.l2 / (1 - t1));
  for (int k = 0; k < n; k++) {
    norms d = grad_norms(runs[k], ref);
    double inf = engine_norm(runs[k], INFINITY), l2 = engine_norm(runs[k], 2.0);
    norms own = grad_norms(runs[k], runs[k]);
    if (rank0())
      printf(
          "grad norm inf: reference %.9g, run %d %.9g (|diff| %.3g <= max|grad diff| %.3g); "
          "L2: reference %.9g, run %.9g (|diff| %.3g <= ‖grad diff‖ %.3g)\n",
          inf1, k, inf, fabs(inf - inf1), d.dinf, l21, l2, fabs(l2 - l21), d.dl2);
    /* the engine's norms are those of its own gradients */
    assert_true(fabs(inf - own.inf) <= TOL_EXACT);
    assert_true(fabs(l2 - own.l2) <= 2 * t1 * own.l2 / (1 - t1));
    /* and differ from ref's by at most what the gradients do; each L2
     * value (engine norms, ‖a − b‖ here) is within t1 of its exact value */
    assert_true(fabs(inf - inf1) <= d.dinf);
    assert_true(fabs(l2 - l21) <= (d.dl2 + t1 * (l2 + l21)) / (1 - t1));
  }
}

/* |got - want| against bound, folded into *worst; the first violation is
 * described in msg. */
static void within(double got, double want, double bound, double *worst, char *msg, size_t cap,
                   const char *what, const char *name, int64_t k) {
  double err = fabs(got - want), ratio = bound > 0 ? err / bound : (err > 0 ? INFINITY : 0);
  if (ratio > *worst) *worst = ratio;
  if (err > bound && !msg[0])
    snprintf(msg, cap, "%s of %s[%lld]: %.9g, AdamW in double %.9g (error %.3g, bound %.3g)", what,
             name, (long long)k, got, want, err, bound);
}

double checked_step(run *r, const batch *b, const ml_adamw_cfg *c, double max_norm, double *worst) {
  float **p0 = export_all(r, ML_EXPORT_PARAMS), **m0 = export_all(r, ML_EXPORT_EXP_AVG);
  float **v0 = export_all(r, ML_EXPORT_EXP_AVG_SQ);
  double loss = step_rows(r, b), norm;
  if (ml_engine_grad_norm(&r->e, 2.0, &norm)) fail_msg("grad norm: %s", ml_error_msg());
  float **g = export_all(r, ML_EXPORT_GRADS);
  ml_engine_clip(&r->e, norm, max_norm);
  if (ml_engine_adamw(&r->e, c)) fail_msg("adamw: %s", ml_error_msg());
  float **p1 = export_all(r, ML_EXPORT_PARAMS), **m1 = export_all(r, ML_EXPORT_EXP_AVG);
  float **v1 = export_all(r, ML_EXPORT_EXP_AVG_SQ);
  /* the clip coefficient as ml_engine_clip applies it (torch's
   * clip_grad_norm_: max_norm / (norm + 1e-6), only when below 1) */
  double coef = max_norm / (norm + 1e-6);
  double cf = max_norm > 0 && coef < 1.0 ? (double)(float)coef : 1.0;
  double t = (double)r->e.step, w = 0;
  char msg[512] = "";
  for (int i = 0; i < r->e.model.n_params; i++) {
    const ml_param *p = ml_engine_export_param(&r->e, i);
    int64_t n = p->shape[0] * p->shape[1];
    for (int64_t k = 0; k < n; k++) {
      tol_adamw s = {p0[i][k], m0[i][k], v0[i][k], 0, 0, 0};
      s = tol_adamw_step(s, (double)g[i][k] * cf, c->lr, c->beta1, c->beta2, c->eps,
                         c->weight_decay, t);
      within(m1[i][k], s.m, s.bm, &w, msg, sizeof msg, "exp_avg", p->name, k);
      within(v1[i][k], s.v, s.bv, &w, msg, sizeof msg, "exp_avg_sq", p->name, k);
      within(p1[i][k], s.p, s.bp, &w, msg, sizeof msg, "param", p->name, k);
    }
  }
  free_all(v1);
  free_all(m1);
  free_all(p1);
  free_all(g);
  free_all(v0);
  free_all(m0);
  free_all(p0);
  if (msg[0]) fail_msg("AdamW step %lld: %s", (long long)r->e.step, msg);
  if (worst) *worst = fmax(*worst, w);
  return loss;
}

static char g_replay_dir[64];

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb, (void)flag, (void)ftw;
  return remove(p);
}

/* Remove the replay checkpoint (rank 0 made it) once every rank is done. */
static void replay_dir_release(void *p) {
  (void)p;
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank0() && g_replay_dir[0]) nftw(g_replay_dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
  g_replay_dir[0] = 0;
}

void check_replay_one_rank(run *r, const batch *b) {
  if (rank0()) {
    snprintf(g_replay_dir, sizeof g_replay_dir, "/tmp/ml_replay_XXXXXX");
    if (!mkdtemp(g_replay_dir)) g_replay_dir[0] = 0;
  }
  MPI_Bcast(g_replay_dir, sizeof g_replay_dir, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (!g_replay_dir[0]) fail_msg("replay: no temporary directory");
  hold(g_replay_dir, replay_dir_release);
  if (ml_engine_save_hf(&r->e, g_replay_dir, ML_EXPORT_DTYPE_F32)) fail_msg("save_hf: %s", ml_error_msg());
  MPI_Barrier(MPI_COMM_WORLD); /* rank 0 has written it */
  static run one;              /* held: static, see held.h */
  run_open(&one, MPI_COMM_SELF, 1, 1, NULL, g_replay_dir);
  double lm = step_rows(r, b), l1 = step_rows(&one, b);
  tol_model tm = tol_model_of(r, b->S, b->B * b->S);
  double tl = tol_model_pair(&tm, TOL_LOSS), tg = tol_model_pair(&tm, TOL_GRADS);
  double el = fabs(lm - l1) / fabs(l1), eg = 0;
  if (one.e.model.n_params != r->e.model.n_params)
    fail_msg("replay: %d parameters on one rank, %d on the mesh", one.e.model.n_params,
             r->e.model.n_params);
  float **gm = export_all(r, ML_EXPORT_GRADS), **g1 = export_all(&one, ML_EXPORT_GRADS);
  char msg[512] = "";
  for (int i = 0; i < r->e.model.n_params; i++) {
    const ml_param *pm = ml_engine_export_param(&r->e, i), *p1 = ml_engine_export_param(&one.e, i);
    if (pm->shape[0] != p1->shape[0] || pm->shape[1] != p1->shape[1]) {
      snprintf(msg, sizeof msg, "parameter %d: %s on the mesh, %s on one rank, other shapes", i,
               pm->name, p1->name);
      break;
    }
    double e = rel_l2(gm[i], g1[i], pm->shape[0] * pm->shape[1]);
    eg = fmax(eg, e);
    if (e > tg && !msg[0])
      snprintf(msg, sizeof msg, "%s: grad rel L2 %.3g (bound %.3g)", pm->name, e, tg);
  }
  free_all(g1);
  free_all(gm);
  if (rank0())
    printf(
        "same parameters on one rank: loss rel %.3g (bound %.3g), worst grad rel L2 %.3g "
        "(bound %.3g)\n",
        el, tl, eg, tg);
  if (msg[0]) fail_msg("replay on one rank: %s", msg);
  if (el > tl)
    fail_msg("replay on one rank: loss %.17g, mesh %.17g (rel %.3g, bound %.3g)", l1, lm, el, tl);
  run_close(&one);
  unhold(g_replay_dir);
  replay_dir_release(NULL);
}
