/* The engine's gradient under the per-token objectives:
 * `mpiexec -n N test_objective_grad FIXTURE TP` (dp_shard = N / TP).
 *
 * The logits' gradient of a target under any objective is −dL/dlp_t ·
 * (softmax − onehot) (parallel/objective.h), so the gradient of the
 * clipped policy-gradient loss (+ k3 KL) equals the gradient of a weighted
 * NLL whose advantages are A'_t = c_t / w_t, c_t = −dL/dlp_t computed in
 * double here from the current log-probs (ml_engine_logprobs) — the
 * chain rule the engine relies on, checked end to end:
 *  - test_pg_as_weighted_nll: (a) forward_backward_batch with CLIPPED_PG
 *    (ε 0.2/0.28, dual clip c = 3, with and without β = 0.1 KL; old/ref
 *    log-probs chosen so that tokens fall below, inside and above the clip
 *    range and beyond c, advantages of both signs) against (b) WEIGHTED_NLL
 *    with A'_t; the objective's sums (loss vs the reference, clipped and
 *    trained counts); on the mesh and on one rank (MPI_COMM_SELF), and the
 *    mesh's gradient against the one rank's;
 *  - test_nll_as_plain: the NLL objective with w = 1/global targets against
 *    ml_engine_forward_backward (the old path), bitwise;
 *  - test_packed_as_accumulated: three documents packed into one row (B =
 *    1, ml_engine_batch.docs, padding after them) against the same three
 *    sequences as micro-batches accumulated, under CLIPPED_PG + KL.
 * Bounds (tests/tolerance.h §3), each derived at its use. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "engine_run.h"
#include "parity_util.h"

static const char *g_fixture;
static int g_tp;

/* ---- the objective's inputs and its coefficient in double ------------------ */

/* The clipped objective of the tests: DAPO-style decoupled clip, dual clip. */
static ml_objective pg_objective(double beta) {
  return (ml_objective){ML_OBJ_CLIPPED_PG, 0.2, 0.28, 3.0, beta, false, NULL, NULL, 0.0};
}

/* Target k's advantage, log ratio log r = lp − old, and ref − lp: log r
 * far below (A < 0: clipped), below 1 − ε_low = 0.8, inside, above 1 +
 * ε_high = 1.28 (A > 0: clipped) and beyond c = 3 (A < 0: dual clip),
 * each at least 0.09 in log r from a kink (log 0.8, log 1.28, log 3), so
 * that rounding of lp (< 1e-4 between meshes) never moves a token across. */
static void pattern(int64_t k, float *A, double *lr, double *d) {
  static const float As[] = {-1.5f, 0.8f, -0.6f, 1.6f, 0.5f};
  static const double lrs[] = {-0.6, -0.35, -0.1, 0.05, 0.15, 0.5, 1.4};
  static const double ds[] = {-0.3, 0.25, 0.1};
  *A = As[k % 5];
  *lr = lrs[(3 * k) % 7];
  *d = ds[k % 3];
}

/* Where the clip passes no gradient through the ratio (ClippedPGLossFn's
 * torch.max / clamp / min subgradients). */
static int clipped_at(const ml_objective *o, double A, double r) {
  if (A > 0) return r > 1.0 + o->clip_high;
  if (A < 0) return r < 1.0 - o->clip_low || (o->clip_c > 1.0 && r > o->clip_c);
  return 0;
}

/* The reference in double at log-prob x (NeMo RL's formulas, meshlm.h):
 * ℓ, the coefficient c = −w·dℓ/dlp, and |dc/dlp|/w = |A|·r (unclipped) +
 * β·e^(ref − x), the coefficient's sensitivity to x. */
typedef struct coef {
  double loss, c, sens;
  int clipped;
} coef;

static coef reference(const ml_objective *o, const ml_obj_in *in, double x) {
  coef k = {0};
  double w = in->w, A = in->adv, r = exp(x - in->old_lp);
  double lo = 1.0 - o->clip_low, hi = 1.0 + o->clip_high;
  double l = fmax(-A * r, -A * fmin(fmax(r, lo), hi));
  if (o->clip_c > 1.0 && A < 0) l = fmin(l, -A * o->clip_c);
  k.clipped = clipped_at(o, A, r);
  double dl = k.clipped ? 0.0 : -A * r, sens = k.clipped ? 0.0 : fabs(A) * r;
  if (o->kl_beta > 0) {
    double d = (double)in->ref_lp - x, e = exp(d);
    l += o->kl_beta * (e - d - 1.0);
    dl += o->kl_beta * (1.0 - e);
    sens += o->kl_beta * e;
  }
  k.loss = w * l;
  k.c = -w * dl;
  k.sens = w * sens;
  return k;
}

/* ---- the runs ------------------------------------------------------------- */

static void open_on(run *r, MPI_Comm base, int tp, const fixture *fx) {
  ml_engine_opts opts = ml_engine_opts_default();
  run_open(r, base, 1, tp, &opts, fx->dir);
}

static int dp_size(const run *r) { return r->mesh.groups[ML_GROUP_DP].size; }
static int dp_rank(const run *r) { return r->mesh.groups[ML_GROUP_DP].rank; }

/* Zero the gradients, one forward/backward of eb under o (NULL: NLL of the
 * old path's 1/global_targets), the sums; fails the test on error. */
static ml_obj_sums fb(run *r, const ml_engine_batch *eb, const ml_objective *o, float scale) {
  ml_obj_sums s = {0};
  ml_loss_out nll;
  if (ml_engine_forward_backward_batch(&r->e, eb, o, scale, o ? &s : NULL, &nll))
    fail_msg("forward_backward_batch: %s", ml_error_msg());
  return s;
}

/* Worst rel L2 over the parameters of two exported gradient sets of r;
 * *exact: all bitwise equal. */
static double grads_diff(const run *r, float **a, float **b, bool *exact) {
  double worst = 0;
  *exact = true;
  for (int i = 0; i < r->e.model.n_params; i++) {
    const ml_param *p = ml_engine_export_param(&r->e, i);
    int64_t n = p->shape[0] * p->shape[1];
    worst = fmax(worst, rel_l2(a[i], b[i], n));
    if (memcmp(a[i], b[i], sizeof(float) * (size_t)n)) *exact = false;
  }
  return worst;
}

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size);
  if (!p) fail_msg("out of memory");
  hold(p, free);
  return p;
}
static void xfree(void *p) {
  unhold(p);
  free(p);
}

/* The objective's inputs of rows [B, S] (position i: the target i + 1)
 * from log-probs lp [B, S − 1]: w = 1/global targets where the mask has a
 * target, A, old = lp − log r, ref = lp + d from pattern(); k0 numbers
 * the first target (rows of one global batch numbered consistently). */
static void make_inputs(const int32_t *ids, const uint8_t *mask, int64_t B, int64_t S,
                        const float *lp, int64_t global_targets, int64_t k0, ml_obj_in *obj) {
  (void)ids;
  int64_t k = k0;
  for (int64_t b = 0; b < B; b++)
    for (int64_t i = 0; i + 1 < S; i++) {
      ml_obj_in *in = &obj[b * S + i];
      if (mask && !mask[b * S + i + 1]) continue;
      float A;
      double lr, d, x = lp[b * (S - 1) + i];
      pattern(k++, &A, &lr, &d);
      *in = (ml_obj_in){(float)(1.0 / (double)global_targets), A, (float)(x - lr),
                        (float)(x + d), -1, 1.0f};
    }
}

/* Over the targets of rows [B, S] with inputs obj, at log-probs lp: the
 * reference's loss sum, clipped count, coefficients (into c [B·S], 0
 * elsewhere), ‖sens‖₂² and ‖c‖₂² (accumulated), max |lp|. */
typedef struct totals {
  double loss, c2, sens2, max_lp;
  int64_t clipped, trained;
} totals;

static void coefficients(const ml_objective *o, const uint8_t *mask, int64_t B, int64_t S,
                         const ml_obj_in *obj, const float *lp, double *c, totals *t) {
  for (int64_t b = 0; b < B; b++)
    for (int64_t i = 0; i + 1 < S; i++) {
      int64_t p = b * S + i;
      if (c) c[p] = 0;
      if ((mask && !mask[p + 1]) || obj[p].w == 0.0f) continue;
      double x = lp[b * (S - 1) + i];
      coef k = reference(o, &obj[p], x);
      if (c) c[p] = k.c;
      t->loss += k.loss;
      t->c2 += k.c * k.c;
      t->sens2 += k.sens * k.sens;
      t->clipped += k.clipped;
      t->trained++;
      t->max_lp = fmax(t->max_lp, fabs(x));
    }
}

/* ---- bounds ----------------------------------------------------------------- */

/* Two fp32 evaluations of one gradient whose objective coefficients
 * c_t(lp_t) are computed from log-probs that themselves differ by
 * rounding between the two (a mesh and one rank; packed and separate
 * rows): tolerance.h §3's pair bound for the gradients, which already
 * carries the forward's error into the backward's input (softmax − onehot
 * moves by the logits' errors), plus the objective's own dependence on
 * lp: |Δc_t| <= sens_t·|Δlp_t| (first order, sens_t = |dc_t/dlp_t| =
 * w(|A|r + βe^d)), |Δlp_t| <= pair(LOGPROBS)·|lp_t| (§3 read per token),
 * so the coefficient vector moves by a relative L2 of at most
 * (‖sens‖₂/‖c‖₂)·pair(LOGPROBS)·max|lp|, which M2 carries into the
 * gradients unamplified (the gradient is linear in c). */
static double pair_bound_pg(const tol_model *tm, const totals *t) {
  double rho = t->c2 > 0 ? sqrt(t->sens2 / t->c2) : 0.0;
  return tol_model_pair(tm, TOL_GRADS) +
         rho * tol_model_pair(tm, TOL_LOGPROBS) * fmax(1.0, t->max_lp);
}

/* Two evaluations of the same gradient on the same mesh from backward
 * inputs that differ only in the rounding of the coefficients: (a) fp32 of
 * the engine's c in double (1 rounding), (b) fp32 of A' = c/w (1), then
 * fp32 of w·A' (1), where the c of (b) is computed here from
 * ml_engine_logprobs' log-probs — the same kernels on the same batch in
 * the same order as the forward of (a) (bitwise equal log-probs,
 * tolerance.h §7), so the two c differ only by double roundings: |Δc_t| <=
 * 3u|c_t| (+ gamma64 terms). Everything after the coefficients is the
 * same sequence of operations, so tolerance.h §3's pair bound for the
 * gradients applies, with gamma_3 for the perturbed input. */
static double same_mesh_bound(const tol_model *tm) {
  return tol_model_pair(tm, TOL_GRADS) + tol_gamma(3.0) + tol_gamma64(64.0);
}

/* ---- test 1: CLIPPED_PG (+ KL) as WEIGHTED_NLL ------------------------------ */

/* The shared setup: fixture, global batch (rows: the fixture's, or one
 * per dp rank), its objective inputs from one rank's log-probs. */
typedef struct pg_case {
  fixture fx;
  batch b;
  ml_obj_in *obj; /* [B, S] */
} pg_case;

/* One run's (a)/(b) check; the gradients of (a) stay exported in *ga. */
static void check_run(run *r, pg_case *pc, const ml_objective *o, const char *name, float ***ga,
                      totals *tot_out) {
  int dp = dp_size(r), d = dp_rank(r);
  int64_t Bl = pc->b.B / dp, S = pc->b.S;
  const int32_t *ids = pc->b.ids + d * Bl * S;
  const uint8_t *mask = pc->b.mask + d * Bl * S;
  const ml_obj_in *obj = pc->obj + d * Bl * S;
  float *lp = xcalloc((size_t)(Bl * (S - 1)), sizeof *lp);
  if (ml_engine_logprobs(&r->e, ids, Bl, S, lp)) fail_msg("logprobs: %s", ml_error_msg());
  double *c = xcalloc((size_t)(Bl * S), sizeof *c);
  totals t = {0};
  coefficients(o, mask, Bl, S, obj, lp, c, &t);

  /* (a) the objective */
  ml_engine_batch eb = {.ids = ids, .mask = mask, .B = Bl, .S = S, .obj = obj};
  ml_engine_zero_grad(&r->e);
  ml_obj_sums sa = fb(r, &eb, o, 0.0f);
  float **g_a = export_all(r, ML_EXPORT_GRADS);

  /* (b) WEIGHTED_NLL with A' = c / w */
  ml_obj_in *objw = xcalloc((size_t)(Bl * S), sizeof *objw);
  for (int64_t p = 0; p < Bl * S; p++)
    if (obj[p].w != 0.0f)
      objw[p] = (ml_obj_in){obj[p].w, (float)(c[p] / (double)obj[p].w), NAN, NAN, -1, 1.0f};
  ml_objective wn = {ML_OBJ_WEIGHTED_NLL, 0, 0, 0, 0, false, NULL, NULL, 0.0};
  eb.obj = objw;
  ml_engine_zero_grad(&r->e);
  fb(r, &eb, &wn, 0.0f);
  float **g_b = export_all(r, ML_EXPORT_GRADS);

  bool exact;
  double e_ab = grads_diff(r, g_a, g_b, &exact);
  tol_model tm = tol_model_of(r, S, pc->b.B * S);
  double t_ab = same_mesh_bound(&tm);
  /* the sums of this rank's targets: every term is the reference's at the
   * same (bitwise) log-probs, computed in double on both sides (k3 and
   * the ratio: about 16 roundings with two exp, tolerance.h R4) */
  double l_abs = 0;
  for (int64_t p = 0; p < Bl * S; p++)
    if (obj[p].w != 0.0f) l_abs += obj[p].w * (5.0 * fabs(obj[p].adv) + 1.0); /* r <= e^1.4 */
  double t_loss = 2.0 * tol_gamma64(32.0) * l_abs, e_loss = fabs(sa.loss - t.loss);
  if (rank0() || e_ab > t_ab || e_loss > t_loss)
    printf("rank %d %s beta %.1f: PG vs weighted NLL grads rel L2 %.3g (bound %.3g)%s; loss sum "
         "%.9f vs reference %.9f (|err| %.3g, bound %.3g); clipped %lld / %lld trained\n",
         r->mesh.groups[ML_GROUP_WORLD].rank, name, o->kl_beta, e_ab, t_ab,
         exact ? ", bitwise" : "", sa.loss, t.loss, e_loss, t_loss, (long long)sa.clipped,
         (long long)sa.trained);
  assert_true(e_ab <= t_ab);
  assert_true(e_loss <= t_loss);
  assert_int_equal(sa.clipped, t.clipped);
  assert_int_equal(sa.trained, t.trained);
  assert_true(t.clipped > 0 && t.clipped < t.trained);
  free_all(g_b);
  xfree(objw);
  xfree(c);
  xfree(lp);
  *ga = g_a;
  *tot_out = t;
}

static void test_pg_as_weighted_nll(void **state) {
  (void)state;
  static pg_case pc;
  static run one, mesh;
  fixture_load(g_fixture, &pc.fx);
  open_on(&mesh, MPI_COMM_WORLD, g_tp, &pc.fx);
  open_on(&one, MPI_COMM_SELF, 1, &pc.fx);
  int dp = dp_size(&mesh);
  batch_make(&pc.fx, pc.fx.B % dp ? dp : pc.fx.B, &pc.b);
  int64_t B = pc.b.B, S = pc.b.S;
  /* the inputs, from one rank's log-probs of the whole batch (the same on
   * every rank and for both runs) */
  float *lp1 = xcalloc((size_t)(B * (S - 1)), sizeof *lp1);
  if (ml_engine_logprobs(&one.e, pc.b.ids, B, S, lp1)) fail_msg("logprobs: %s", ml_error_msg());
  pc.obj = xcalloc((size_t)(B * S), sizeof *pc.obj);
  make_inputs(pc.b.ids, pc.b.mask, B, S, lp1, pc.b.targets, 0, pc.obj);
  for (int kl = 0; kl < 2; kl++) {
    ml_objective o = pg_objective(kl ? 0.1 : 0.0);
    float **g_one, **g_mesh;
    totals t_one, t_mesh;
    check_run(&one, &pc, &o, "one rank", &g_one, &t_one);
    check_run(&mesh, &pc, &o, "mesh", &g_mesh, &t_mesh);
    /* the mesh against one rank, both under the objective */
    bool exact;
    double e = grads_diff(&mesh, g_mesh, g_one, &exact);
    tol_model tm = tol_model_of(&mesh, S, B * S);
    double bound = pair_bound_pg(&tm, &t_one);
    if (rank0())
      printf("CLIPPED_PG beta %.1f, mesh (dp %d x tp %d) vs one rank: grads worst rel L2 %.3g "
             "(bound %.3g = pair %.3g + coefficient term)\n",
             o.kl_beta, dp, g_tp, e, bound, tol_model_pair(&tm, TOL_GRADS));
    assert_true(e <= bound);
    free_all(g_mesh);
    free_all(g_one);
  }
  xfree(pc.obj);
  xfree(lp1);
  run_close(&one);
  run_close(&mesh);
  batch_free(&pc.b);
  fixture_free(&pc.fx);
}

/* ---- test 2: the NLL objective is the old path --------------------------- */

/* NLL with w = 1.0f/(float)G on every target against
 * ml_engine_forward_backward, whose scale is that same fp32 value (G <
 * 2^24 is exact in fp32): the objective returns fl32(−w·(−1)) = w
 * exactly, so the backward's inputs are bitwise the same and so are the
 * gradients (the same kernels in the same order, tolerance.h §7). The loss: Σ w·(−lp) in double,
 * lp the fp32 log-prob the objective receives, against (Σ −lp)/G over
 * the double log-probs: each term's lp rounded to fp32 (u, R1; all terms
 * of one sign, so u relative to the sum), w's rounding (u, a common
 * factor), the double sums of T terms and the products: 2u + gamma64. */
static void test_nll_as_plain(void **state) {
  (void)state;
  static fixture fx;
  static batch b;
  static run mesh;
  fixture_load(g_fixture, &fx);
  open_on(&mesh, MPI_COMM_WORLD, g_tp, &fx);
  int dp = dp_size(&mesh), d = dp_rank(&mesh);
  batch_make(&fx, fx.B % dp ? dp : fx.B, &b);
  int64_t Bl = b.B / dp, S = b.S;
  const int32_t *ids = b.ids + d * Bl * S;
  const uint8_t *mask = b.mask + d * Bl * S;
  ml_obj_in *obj = xcalloc((size_t)(Bl * S), sizeof *obj);
  for (int64_t p = 0; p < Bl * S; p++) {
    int tgt = (p % S) + 1 < S && mask[p + 1];
    /* garbage in the fields NLL does not read */
    obj[p] = (ml_obj_in){tgt ? 1.0f / (float)b.targets : 0.0f, NAN, NAN, NAN, -1, 1.0f};
  }
  double loss_old;
  ml_engine_zero_grad(&mesh.e);
  if (ml_engine_forward_backward(&mesh.e, ids, mask, Bl, S, b.targets, &loss_old))
    fail_msg("forward_backward: %s", ml_error_msg());
  float **g_old = export_all(&mesh, ML_EXPORT_GRADS);
  ml_objective nll = {ML_OBJ_NLL, 0, 0, 0, 0, false, NULL, NULL, 0.0};
  ml_engine_batch eb = {.ids = ids, .mask = mask, .B = Bl, .S = S, .obj = obj};
  ml_engine_zero_grad(&mesh.e);
  ml_obj_sums s = fb(&mesh, &eb, &nll, 0.0f);
  float **g_new = export_all(&mesh, ML_EXPORT_GRADS);
  double v = s.loss; /* this rank's targets' share of the mean: summed over the dp ranks */
  if (ml_host_all_reduce_f64(ml_mesh_host(&mesh.mesh, ML_GROUP_DP), &v, 1, ML_RED_SUM))
    fail_msg("all-reduce: %s", ml_error_msg());
  bool exact;
  double e = grads_diff(&mesh, g_new, g_old, &exact);
  double tl = TOL_FIRST_ORDER * (2.0 * TOL_U + tol_gamma64(2.0 * (double)b.targets + 4.0)),
         el = fabs(v - loss_old) / loss_old;
  if (rank0())
    printf("NLL objective vs forward_backward (dp %d x tp %d): grads worst rel L2 %.3g (%s; "
           "bound 0); loss %.12f vs %.12f (rel %.3g, bound %.3g)\n",
           dp, g_tp, e, exact ? "bitwise" : "NOT bitwise", v, loss_old, el, tl);
  assert_true(exact);
  assert_true(el <= tl);
  free_all(g_new);
  free_all(g_old);
  xfree(obj);
  run_close(&mesh);
  batch_free(&b);
  fixture_free(&fx);
}

/* ---- test 3: packed documents against micro-batches accumulated ----------- */

/* Each dp rank packs three documents cut from its fixture row (lengths
 * 10, 8, 6 of the row's S = 24 tokens) into one row of S + 2 positions
 * (2 padding), and runs them again as three micro-batches (B = 1, S = the
 * document's length) accumulated; CLIPPED_PG + KL with inputs from the
 * separate documents' log-probs, w = 1/(all dp ranks' targets). The two
 * are fp32 evaluations of one gradient in different orders (the GEMMs see
 * other row counts; the varlen attention core is bitwise each document's
 * alone, tests/unit/test_varlen.c), with log-probs that may differ by
 * rounding: pair_bound_pg. */
static void test_packed_as_accumulated(void **state) {
  (void)state;
  static fixture fx;
  static run mesh;
  fixture_load(g_fixture, &fx);
  open_on(&mesh, MPI_COMM_WORLD, g_tp, &fx);
  if (!ml_engine_can_pack(&mesh.e)) {
    run_close(&mesh);
    fixture_free(&fx);
    skip();
  }
  int dp = dp_size(&mesh), d = dp_rank(&mesh);
  enum { NDOC = 3, PAD = 2 };
  const int64_t lens[NDOC] = {10, 8, 6};
  int64_t S = 0;
  for (int i = 0; i < NDOC; i++) S += lens[i];
  if (S > fx.S) fail_msg("fixture rows of %lld tokens; need %lld", (long long)fx.S, (long long)S);
  int64_t Sp = S + PAD, docs[NDOC + 1] = {0};
  for (int i = 0; i < NDOC; i++) docs[i + 1] = docs[i] + lens[i];
  const int32_t *row = fx.ids + (d % fx.B) * fx.S;
  int32_t *ids = xcalloc((size_t)Sp, sizeof *ids); /* padding: id 0 */
  memcpy(ids, row, sizeof(int32_t) * (size_t)S);
  int64_t G = (int64_t)dp * (S - NDOC); /* every document's targets on every dp rank */
  ml_objective o = pg_objective(0.1);

  /* inputs: each document's log-probs alone, numbered over the row */
  ml_obj_in *obj = xcalloc((size_t)Sp, sizeof *obj);
  float *lp = xcalloc((size_t)Sp, sizeof *lp);
  totals t = {0};
  for (int i = 0; i < NDOC; i++) {
    if (ml_engine_logprobs(&mesh.e, ids + docs[i], 1, lens[i], lp + docs[i]))
      fail_msg("logprobs: %s", ml_error_msg());
    make_inputs(ids + docs[i], NULL, 1, lens[i], lp + docs[i], G, docs[i] - i, obj + docs[i]);
    coefficients(&o, NULL, 1, lens[i], obj + docs[i], lp + docs[i], NULL, &t);
  }

  /* the three documents as micro-batches, accumulated */
  ml_engine_zero_grad(&mesh.e);
  ml_obj_sums s_sep = {0};
  for (int i = 0; i < NDOC; i++) {
    ml_engine_batch eb = {.ids = ids + docs[i], .B = 1, .S = lens[i], .obj = obj + docs[i]};
    ml_obj_sums s = fb(&mesh, &eb, &o, 0.0f);
    s_sep.loss += s.loss, s_sep.clipped += s.clipped, s_sep.trained += s.trained;
  }
  float **g_sep = export_all(&mesh, ML_EXPORT_GRADS);
  /* one packed row */
  ml_engine_batch eb = {.ids = ids, .B = 1, .S = Sp, .docs = docs, .ndocs = NDOC, .obj = obj};
  ml_engine_zero_grad(&mesh.e);
  ml_obj_sums s_pack = fb(&mesh, &eb, &o, 0.0f);
  float **g_pack = export_all(&mesh, ML_EXPORT_GRADS);

  bool exact;
  double e = grads_diff(&mesh, g_pack, g_sep, &exact);
  tol_model tm = tol_model_of(&mesh, Sp, (int64_t)dp * Sp);
  double bound = pair_bound_pg(&tm, &t);
  /* the loss sums: the same terms at log-probs within pair(LOGPROBS)·|lp|,
   * |Δℓ_t| <= sens_t·|Δlp_t| (c's own sensitivity is ℓ's slope bound) */
  double tl = sqrt(t.sens2) * sqrt((double)t.trained) * tol_model_pair(&tm, TOL_LOGPROBS) *
                  fmax(1.0, t.max_lp) +
              tol_gamma64(64.0) * fabs(s_sep.loss);
  double el = fabs(s_pack.loss - s_sep.loss);
  if (rank0())
    printf("packed (3 documents + %d padding, dp %d x tp %d) vs 3 micro-batches accumulated: "
           "grads worst rel L2 %.3g (bound %.3g)%s; loss sum %.9f vs %.9f (|err| %.3g, bound "
           "%.3g); clipped %lld / %lld\n",
           PAD, dp, g_tp, e, bound, exact ? ", bitwise" : "", s_pack.loss, s_sep.loss, el, tl,
           (long long)s_pack.clipped, (long long)s_pack.trained);
  assert_true(e <= bound);
  assert_true(el <= tl);
  assert_int_equal(s_pack.trained, S - NDOC);
  assert_int_equal(s_sep.trained, S - NDOC);
  assert_int_equal(s_pack.clipped, s_sep.clipped);
  assert_int_equal(s_pack.clipped, t.clipped);
  free_all(g_pack);
  free_all(g_sep);
  xfree(lp);
  xfree(obj);
  xfree(ids);
  run_close(&mesh);
  fixture_free(&fx);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  if (argc != 3) {
    fprintf(stderr, "usage: test_objective_grad FIXTURE TP\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  g_tp = atoi(argv[2]);
  const struct CMUnitTest tests[] = {
      held_test(test_pg_as_weighted_nll),
      held_test(test_nll_as_plain),
      held_test(test_packed_as_accumulated),
  };
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
