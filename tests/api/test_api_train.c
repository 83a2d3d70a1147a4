/* test_api_train: meshlm_train_step. NLL, weighted NLL with unit weights,
 * clipped PG at ratio 1 and with shifted old log-probs (clip, dual clip,
 * k3 KL), token and sequence level, against double references from
 * meshlm_logprobs' values; the same global batch on the mesh and on one
 * rank; the schedule (warmup, linear decay) and step counts; the engine
 * options (ZeRO, prefetch, reshard, AC, the inf norm) through a session.
 * The suite, its meshes and its helpers: api_util.h. */
#define _XOPEN_SOURCE 700 /* M_PI (lr_want) */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api_util.h"

typedef struct ref_loss {
  double loss, kl, clip_fraction;
  double bound, kl_bound; /* on |engine − reference| */
  double dnorm;           /* the bound on ||Δ||₂, Δ = the step's log-probs − lp */
  double margin;          /* CLIPPED_PG: the nearest log-ratio to a branch boundary */
  int64_t tokens, sequences, clipped, dual;
} ref_loss;

/* The step's loss per the header's formulas, in double, from lp [all
 * predictions of g] (meshlm_logprobs' values), with its bound.
 *
 * The engine evaluates the same formulas (in double) on its training
 * forward's log-probs lp + Δ, with ||Δ||₂ <= dnorm = lp_tol(S)·||lp||₂
 * (two fp32 evaluations, tolerance.h §3), so |Δ_t| <= dnorm for every t.
 * Per masked token with weight w_t (1/N token level, 1/(n_k·K) sequence
 * level):
 *  - NLL / weighted NLL: ℓ is linear in lp with slope |A_t| (1 for NLL);
 *  - clipped PG: where the ratio is not clipped, ℓ = −A·e^(lp − old) moves
 *    by <= |A|·r·|Δ|·e^|Δ|; a clipped token's ℓ is constant in lp — provided
 *    no ratio crosses a clip boundary, asserted by margin > dnorm;
 *  - k3: β(e^(d−Δ) − e^d + Δ), d = ref − lp: <= β|1 − e^d||Δ| +
 *    β·e^d·Δ²·e^|Δ|/2.
 * Summed with Cauchy–Schwarz: e^dnorm·||w·s||₂·dnorm + e^dnorm/2·max(w β
 * e^d)·dnorm², s_t the slope above. Rounding: the engine's weights are
 * fp32 roundings of 1/norm (relative u each) and its sums and this
 * reference's are double (gamma64 of the token count and the dozen
 * operations per token, R2/R3/R5): (u + gamma64(N + 32))·Σ w|ℓ|. */
static ref_loss reference(const gbatch *g, const garr *a, const float *lp, const meshlm_loss *l) {
  const batch *b = &g->all;
  ref_loss R = {.margin = INFINITY};
  int64_t K = 0, S = 0;
  int64_t *nk = xcalloc((size_t)b->n, sizeof *nk);
  for (int64_t k = 0, p = 0; k < b->n; k++) {
    S = b->lens[k] > S ? b->lens[k] : S;
    for (int64_t t = 0; t < b->lens[k] - 1; t++, p++) nk[k] += !a->mask || a->mask[p];
    R.tokens += nk[k];
    K += nk[k] > 0;
  }
  R.sequences = b->n;
  R.dnorm = lp_tol(S) * l2(lp, b->npred);
  double lo = 1.0 - (double)l->ratio_clip_min, hi = 1.0 + (double)l->ratio_clip_max;
  double c = l->ratio_clip_c, beta = l->kl_penalty;
  double ws2 = 0, wk2 = 0, absl = 0, absk = 0, curv = 0;
  for (int64_t k = 0, p = 0; k < b->n; k++)
    for (int64_t t = 0; t < b->lens[k] - 1; t++, p++) {
      if (a->mask && !a->mask[p]) continue;
      double w = 1.0 / (l->sequence_level ? (double)nk[k] * (double)K : (double)R.tokens);
      float A = (a->tw ? a->tw[p] : 1.0f) * (a->sw ? a->sw[k] : 1.0f); /* as the engine: fp32 */
      double x = lp[p], ell, slope;
      if (l->kind == MESHLM_LOSS_NLL) {
        ell = -x;
        slope = 1.0;
      } else if (l->kind == MESHLM_LOSS_WEIGHTED_NLL) {
        ell = -(double)A * x;
        slope = fabs((double)A);
      } else {
        double d = x - (double)a->old[p], r = exp(d), rc = r < lo ? lo : r > hi ? hi : r;
        double l1 = -(double)A * r, l2v = -(double)A * rc;
        int flows = l1 >= l2v; /* torch.max: the unclipped branch */
        ell = flows ? l1 : l2v;
        if (c > 1.0 && A < 0.0f && -(double)A * c < ell) {
          ell = -(double)A * c;
          flows = 0;
          R.dual++;
        }
        R.clipped += !flows;
        slope = flows ? fabs((double)A) * r : 0.0;
        R.margin = fmin(R.margin, fmin(fabs(d - log(lo)), fabs(d - log(hi))));
        if (c > 1.0) R.margin = fmin(R.margin, fabs(d - log(c)));
      }
      double kslope = 0;
      if (l->kind != MESHLM_LOSS_NLL && beta > 0) {
        double d = (double)a->ref[p] - x, e = exp(d), k3 = beta * (e - d - 1.0);
        ell += k3;
        R.kl += w * k3;
        absk += w * fabs(k3);
        kslope = beta * fabs(1.0 - e);
        curv = fmax(curv, w * beta * e);
      }
      R.loss += w * ell;
      absl += w * fabs(ell);
      ws2 += (w * (slope + kslope)) * (w * (slope + kslope));
      wk2 += (w * kslope) * (w * kslope);
    }
  double ed = exp(R.dnorm), round = TOL_U + tol_gamma64((double)R.tokens + 32.0);
  R.bound = ed * sqrt(ws2) * R.dnorm + ed / 2.0 * curv * R.dnorm * R.dnorm + round * absl;
  R.kl_bound = ed * sqrt(wk2) * R.dnorm + ed / 2.0 * curv * R.dnorm * R.dnorm + round * absk;
  R.clip_fraction = R.tokens ? (double)R.clipped / (double)R.tokens : 0.0;
  free(nk);
  return R;
}

static void check_step(const char *what, const char *where, const meshlm_step_result *r,
                       const ref_loss *R, double lr) {
  printf("[rank %d] %s (%s): loss %.9g, reference %.9g, |diff| %.3g (bound %.3g); kl %.6g "
         "(%.6g); clip fraction %.4f (%lld dual); grad norm %.4g\n",
         g_rank, what, where, r->loss, R->loss, fabs(r->loss - R->loss), R->bound, r->kl, R->kl,
         r->clip_fraction, (long long)R->dual, r->grad_norm);
  if (!(fabs(r->loss - R->loss) <= R->bound))
    fail_msg("%s (%s): loss %.17g, reference %.17g", what, where, r->loss, R->loss);
  if (!(fabs(r->kl - R->kl) <= R->kl_bound))
    fail_msg("%s (%s): kl %.17g, reference %.17g", what, where, r->kl, R->kl);
  /* the same integer counts divided in double: exact */
  if (r->clip_fraction != R->clip_fraction)
    fail_msg("%s (%s): clip fraction %.17g, reference %.17g", what, where, r->clip_fraction,
             R->clip_fraction);
  assert_int_equal(r->tokens, R->tokens);
  assert_int_equal(r->sequences, R->sequences);
  assert_int_equal(r->step, 1);
  assert_int_equal(r->skipped, 0);
  assert_true(isfinite(r->grad_norm) && r->grad_norm > 0);
  assert_true(fabs(r->lr - lr) <= tol_schedule_abs(lr));
}

enum { OLD_NONE, OLD_SAME, OLD_SHIFTED };

/* One first step of loss l on g from the fixture's weights: on the mesh
 * (each dp rank its part) and, on several ranks, on a one-rank session
 * with the whole global batch; both against the reference from the mesh's
 * meshlm_logprobs. old: none, = the current log-probs (ratio 1), or
 * shifted by ±0.05, ±0.5, +1.5 (inside, beyond the clips, beyond the dual
 * clip). ref_logprobs: lp + U(−0.3, 0.3) when l has a KL penalty. The
 * mesh's log-probs after the step go to `after` (NULL: not wanted). */
static ref_loss run_case(const char *what, const gbatch *g, const meshlm_loss *l, int old_kind,
                         const float *tw, const float *sw, meshlm_step_result *out,
                         float *after) {
  const double lr = 1e-3;
  meshlm_options o = mesh_opts();
  o.lr = lr;
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD), *one = NULL;
  if (g_world > 1) {
    meshlm_options_default(&o);
    o.lr = lr;
    one = open_ok(g_fixture, &o, MPI_COMM_SELF);
  }
  int64_t n = g->all.npred;
  float *lp = xcalloc((size_t)n, sizeof *lp), *old = NULL, *ref = NULL;
  global_lp(s, g, NULL, lp);
  static const double shifts[5] = {-0.5, -0.05, 0.05, 0.5, 1.5};
  rng_seed(4242);
  if (old_kind != OLD_NONE) {
    old = xcalloc((size_t)n, sizeof *old);
    for (int64_t t = 0; t < n; t++)
      old[t] = old_kind == OLD_SAME ? lp[t] : (float)((double)lp[t] - shifts[rnd() % 5]);
  }
  if (l->kl_penalty > 0) {
    ref = xcalloc((size_t)n, sizeof *ref);
    for (int64_t t = 0; t < n; t++) ref[t] = (float)((double)lp[t] + 0.6 * unif() - 0.3);
  }
  garr a = {g->all.mask, tw, sw, old, ref};
  ref_loss R = reference(g, &a, lp, l);
  if (l->kind == MESHLM_LOSS_CLIPPED_PG && !(R.margin > R.dnorm))
    fail_msg("%s: a log-ratio lies %.3g from a clip boundary, within the log-probs' bound %.3g",
             what, R.margin, R.dnorm);
  meshlm_step_result r = {.struct_size = sizeof r};
  OK(s, step_share(s, g, &a, l, &r));
  check_step(what, "mesh", &r, &R, lr);
  if (one) {
    meshlm_step_result r1 = {.struct_size = sizeof r1};
    garr a1 = a;
    local_ok(one, meshlm_train_step(one, &(meshlm_train_batch){sizeof(meshlm_train_batch), seqs_of(&g->all), a1.mask, a1.tw,
                                                                a1.sw, a1.old, a1.ref, NULL, NULL},
                                    l, &r1),
             "the step on one rank");
    check_step(what, "one rank, the whole global batch", &r1, &R, lr);
    meshlm_close(one);
  }
  assert_int_equal(info_of(s).step, 1);
  if (after) global_lp(s, g, NULL, after);
  if (out) *out = r;
  meshlm_close(s);
  free(lp);
  free(old);
  free(ref);
  return R;
}

/* Per-sequence advantages in ±[0.1, 1] and per-token weights in [0.5, 1.5]. */
static void advantages(const gbatch *g, float *sw, float *tw) {
  rng_seed(99);
  for (int64_t k = 0; k < g->all.n; k++)
    sw[k] = (float)((rnd() & 1 ? 1.0 : -1.0) * (0.1 + 0.9 * unif()));
  for (int64_t t = 0; tw && t < g->all.npred; t++) tw[t] = (float)(0.5 + unif());
}

static void test_train_nll(void **state) {
  (void)state;
  gbatch g = gbatch_make(31);
  int64_t n = g.all.npred;
  float *after_nll = xcalloc((size_t)n, sizeof(float)), *after_w = xcalloc((size_t)n, 4);
  float *ones = xcalloc((size_t)n, sizeof(float)), *sones = xcalloc((size_t)g.all.n, 4);
  for (int64_t t = 0; t < n; t++) ones[t] = 1.0f;
  for (int64_t k = 0; k < g.all.n; k++) sones[k] = 1.0f;
  meshlm_loss l;
  meshlm_loss_default(&l);
  meshlm_step_result r_nll = {.struct_size = sizeof r_nll}, r_w = {.struct_size = sizeof r_w};
  /* NLL: the mean of −log-probs over the masked predictions of the global batch */
  ref_loss R = run_case("NLL", &g, &l, OLD_NONE, NULL, NULL, &r_nll, after_nll);
  assert_true(r_nll.kl == 0.0 && r_nll.clip_fraction == 0.0);
  l.sequence_level = 1;
  run_case("NLL, sequence level", &g, &l, OLD_NONE, NULL, NULL, NULL, NULL);
  /* weighted NLL with every weight 1: −A·lp with A = 1·1 (fp32, exact, R1) is −lp and its
   * slope −A = −1 exactly, so the same operations run on the same values as NLL's: the loss,
   * and the log-probs after the step, bitwise (TOL_EXACT; MPI's reductions are deterministic
   * for the same inputs on the same communicator size) */
  l.sequence_level = 0;
  l.kind = MESHLM_LOSS_WEIGHTED_NLL;
  R = run_case("weighted NLL, weights 1", &g, &l, OLD_NONE, ones, sones, &r_w, after_w);
  assert_true(r_w.loss == r_nll.loss);
  assert_true(r_w.grad_norm == r_nll.grad_norm);
  assert_memory_equal(after_w, after_nll, sizeof(float) * (size_t)n);
  (void)R;
  free(after_nll);
  free(after_w);
  free(ones);
  free(sones);
  batch_free(&g.all);
}

static void test_train_clipped_pg(void **state) {
  (void)state;
  gbatch g = gbatch_make(32);
  float *sw = xcalloc((size_t)g.all.n, sizeof *sw), *tw = xcalloc((size_t)g.all.npred, 4);
  advantages(&g, sw, tw);
  meshlm_loss l;
  meshlm_loss_default(&l);
  l.kind = MESHLM_LOSS_CLIPPED_PG;
  /* ratio 1: loss = −Σ A / N (token level), −Σ_k A_k / K over sequences with a masked
   * prediction (sequence level); nothing clipped */
  for (int seq = 0; seq <= 1; seq++) {
    l.sequence_level = seq;
    meshlm_step_result r = {.struct_size = sizeof r};
    ref_loss R = run_case(seq ? "clipped PG, ratio 1, sequence level" : "clipped PG, ratio 1",
                          &g, &l, OLD_SAME, NULL, sw, &r, NULL);
    double closed = 0, absa = 0;
    int64_t K = 0;
    for (int64_t k = 0, p = 0; k < g.all.n; k++) {
      int64_t nk = 0;
      for (int64_t t = 0; t < g.all.lens[k] - 1; t++, p++) nk += g.all.mask[p];
      K += nk > 0;
      closed -= seq ? (nk > 0 ? sw[k] : 0.0) : (double)nk * sw[k];
      absa += seq ? fabs(sw[k]) : (double)nk * fabs(sw[k]);
    }
    double norm = seq ? (double)K : (double)R.tokens;
    closed /= norm;
    /* the reference at r = e^0 = 1 is this closed form up to double rounding (R2, R5) */
    assert_true(fabs(R.loss - closed) <= tol_gamma64((double)R.tokens + 8.0) * absa / norm);
    assert_true(fabs(r.loss - closed) <= R.bound + tol_gamma64((double)R.tokens + 8.0) * absa / norm);
    assert_true(r.clip_fraction == 0.0);
    assert_int_equal(R.clipped, 0);
  }
  /* shifted old log-probs: ratios inside and beyond [1 − ε_low, 1 + ε_high], beyond the dual
   * clip c = 3, per-token weights, and a k3 KL penalty to reference log-probs */
  l.sequence_level = 0;
  l.ratio_clip_min = 0.2f;
  l.ratio_clip_max = 0.28f;
  l.ratio_clip_c = 3.0f;
  l.kl_penalty = 0.05f;
  meshlm_step_result r = {.struct_size = sizeof r};
  ref_loss R = run_case("clipped PG, shifted, dual clip, KL", &g, &l, OLD_SHIFTED, tw, sw, &r,
                        NULL);
  assert_true(R.clipped > 0 && R.clipped < R.tokens); /* the case clips some, not all */
  assert_true(R.dual > 0);
  assert_true(r.kl > 0);
  l.sequence_level = 1;
  l.ratio_clip_c = 0.0f;
  l.kl_penalty = 0.0f;
  R = run_case("clipped PG, shifted, sequence level", &g, &l, OLD_SHIFTED, NULL, sw, &r, NULL);
  assert_true(R.clipped > 0 && R.clipped < R.tokens);
  assert_true(r.kl == 0.0);
  free(sw);
  free(tw);
  batch_free(&g.all);
}

/* transformers' get_{constant,linear,cosine}_schedule_with_warmup with
 * min_lr reached at step total − 1 (the header), in double. */
static double lr_want(meshlm_schedule sch, double lr, double min_lr, int64_t warm, int64_t total,
                      int64_t k) {
  if (k < warm) return lr * (double)k / (double)warm;
  if (sch == MESHLM_LR_CONSTANT) return lr;
  int64_t span = total - 1 - warm;
  double p = fmin(1.0, (double)(k - warm) / (double)(span > 1 ? span : 1));
  double f = sch == MESHLM_LR_LINEAR ? 1.0 - p : 0.5 * (1.0 + cos(M_PI * p));
  return min_lr + (lr - min_lr) * f;
}

static void test_schedule(void **state) {
  (void)state;
  gbatch g = gbatch_make(33);
  int64_t n = g.all.npred;
  float *lp0 = xcalloc((size_t)n, sizeof *lp0), *lp = xcalloc((size_t)n, sizeof *lp);
  garr a = {g.all.mask, NULL, NULL, NULL, NULL};
  const meshlm_schedule kinds[2] = {MESHLM_LR_LINEAR, MESHLM_LR_COSINE};
  const int64_t warm[2] = {2, 0}, total[2] = {5, 4}, steps[2] = {6, 4};
  for (int i = 0; i < 2; i++) {
    meshlm_options o = mesh_opts();
    o.lr = 1e-3;
    o.min_lr = 1e-4;
    o.schedule = kinds[i];
    o.warmup_steps = warm[i];
    o.total_steps = total[i];
    meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
    global_lp(s, &g, NULL, lp0);
    for (int64_t k = 0; k < steps[i]; k++) {
      meshlm_step_result r = {.struct_size = sizeof r};
      OK(s, step_share(s, &g, &a, NULL, &r));
      double want = lr_want(kinds[i], o.lr, o.min_lr, warm[i], total[i], k);
      printf("[rank %d] schedule %d step %lld: lr %.9g (want %.9g)\n", g_rank, (int)kinds[i],
             (long long)k, r.lr, want);
      assert_true(fabs(r.lr - want) <= tol_schedule_abs(o.lr));
      assert_int_equal(r.step, k + 1);
      assert_int_equal(info_of(s).step, k + 1);
      global_lp(s, &g, NULL, lp);
      if (warm[i] > 0 && k == 0) {
        /* lr 0 (warmup's first step): AdamW's p·(1 − 0·wd) − 0·update is p exactly (R1),
         * so the log-probs are bitwise those before */
        assert_true(r.lr == 0.0);
        assert_memory_equal(lp, lp0, sizeof(float) * (size_t)n);
      } else if (k == 1) {
        assert_true(memcmp(lp, lp0, sizeof(float) * (size_t)n) != 0);
      }
    }
    meshlm_close(s);
  }
  free(lp0);
  free(lp);
  batch_free(&g.all);
}

/* The engine options the CLI's flags set reach a session too: under ZeRO-2
 * without prefetch, every unit resharded and the MLP recomputed, the
 * first step's loss (a forward of the same weights) is bitwise the
 * default session's; the inf norm of the gradient lies in [‖g‖₂ / √N,
 * ‖g‖₂) of the L2 session's (N parameters; < as long as more than one
 * gradient entry is nonzero). A non-finite gradient skips the step and is
 * named. */
static void test_engine_options(void **state) {
  (void)state;
  gbatch g = gbatch_make(51);
  garr a = {g.all.mask, NULL, NULL, NULL, NULL};
  meshlm_options o = mesh_opts();
  meshlm_step_result r2 = {.struct_size = sizeof r2}, rinf = {.struct_size = sizeof rinf};
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  OK(s, step_share(s, &g, &a, NULL, &r2));
  double n_params = (double)info_of(s).num_params;
  meshlm_close(s);
  o.zero = 2;
  o.prefetch_forward = o.prefetch_backward = 0;
  o.reshard_after_forward = MESHLM_RESHARD_ALWAYS;
  o.ac = MESHLM_AC_MLP;
  o.grad_norm_type = INFINITY;
  s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  OK(s, step_share(s, &g, &a, NULL, &rinf));
  meshlm_close(s);
  printf("[rank %d] grad norm L2 %.9g, inf %.9g\n", g_rank, r2.grad_norm, rinf.grad_norm);
  assert_true(rinf.loss == r2.loss);
  assert_true(rinf.grad_norm < r2.grad_norm && rinf.grad_norm >= r2.grad_norm / sqrt(n_params));
  assert_int_equal(rinf.skipped, 0);
  assert_string_equal(rinf.nonfinite_param, "");

  /* an lr of 1e38 makes the weights ±1e38 (AdamW's first update is lr·sign(g)), the next
     forward overflows: that step is skipped, its first non-finite gradient named */
  o = mesh_opts();
  o.lr = 1e38;
  o.max_grad_norm = 0;
  s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  OK(s, step_share(s, &g, &a, NULL, &r2));
  assert_int_equal(r2.skipped, 0);
  OK(s, step_share(s, &g, &a, NULL, &rinf));
  printf("[rank %d] after lr 1e38: grad norm %g, skipped %d, %s\n", g_rank, rinf.grad_norm,
         rinf.skipped, rinf.nonfinite_param);
  assert_int_equal(rinf.skipped, 1);
  assert_true(strncmp(rinf.nonfinite_param, "model.", 6) == 0 ||
              strncmp(rinf.nonfinite_param, "lm_head.", 8) == 0);
  assert_int_equal(rinf.step, 2);
  meshlm_close(s);
  batch_free(&g.all);
}

/* meshlm_options.cpu_offload (FSDP2's CPUOffloadPolicy): two steps give
 * bitwise the losses and grad norms of the same session without it (the
 * CPU backend: the same kernels on the host pool's shards). */
static void test_cpu_offload(void **state) {
  (void)state;
  gbatch g = gbatch_make(52);
  garr a = {g.all.mask, NULL, NULL, NULL, NULL};
  meshlm_step_result r[2][2];
  for (int off = 0; off < 2; off++) {
    meshlm_options o = mesh_opts();
    o.cpu_offload = off;
    meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
    for (int k = 0; k < 2; k++) {
      r[off][k] = (meshlm_step_result){.struct_size = sizeof r[off][k]};
      OK(s, step_share(s, &g, &a, NULL, &r[off][k]));
    }
    meshlm_close(s);
  }
  for (int k = 0; k < 2; k++) {
    printf("[rank %d] step %d: loss %.17g / %.17g, grad norm %.17g / %.17g (offloaded / not)\n",
           g_rank, k + 1, r[1][k].loss, r[0][k].loss, r[1][k].grad_norm, r[0][k].grad_norm);
    assert_true(r[1][k].loss == r[0][k].loss && r[1][k].grad_norm == r[0][k].grad_norm);
  }
  batch_free(&g.all);
}

/* ======================================================================= */

int main(int argc, char **argv) {
  api_init(&argc, &argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_train_nll),
      cmocka_unit_test(test_train_clipped_pg),
      cmocka_unit_test(test_schedule),
      cmocka_unit_test(test_engine_options),
      cmocka_unit_test(test_cpu_offload),
  };
  return api_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
