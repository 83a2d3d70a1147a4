/* Parameters kept and computed in fp32 under param_dtype bf16
 * (engine/fp32_params.h: every MoE router, plus --fp32-params' patterns;
 * parallel/fsdp.h: the unit's fp32 part, NeMo Automodel's
 * fully_shard_by_dtype), on the world's ranks as FSDP over dp_shard (and
 * ep when given):
 *  - master bits: across 3 AdamW steps, each unit unsharded holds the
 *    named parameters as fp32 equal to the fp32 master weights (memcmp
 *    against the gathered shards), every other parameter as bf16 equal to
 *    the master rounded to nearest-even (memcmp);
 *  - router logits (one rank): each sparse layer's router probabilities
 *    against the softmax of fp32 h · fp32 W_gate^T computed in double on
 *    the saved router input and the master weight, within the fp32 bound
 *    derived below (a bf16 weight or input exceeds it by orders);
 *  - against fp32 on one rank: the loss, the log-probs (issue 10's limits)
 *    and every gradient (tol_bf16), as tests/mpi/test_bf16.c;
 *  - refusal (one rank): a pattern matching no parameter fails the open
 *    with one message naming the option and the pattern;
 *  - the grad norm from the partials each step's backward computes
 *    (engine/grad_norm.h) bitwise the one pass's, L2 and inf: fp32 parts,
 *    expert units over ep_shard, ZeRO-2, cpu_offload as launched.
 * usage: mpiexec -n N test_fp32_params FIXTURE [PATTERNS|-] [ep=E|zero=Z|offload]...
 * (PATTERNS: --fp32-params; "-": the routers alone; zero=Z: the ZeRO stage,
 * whose 1 and 2 keep the unsharded parameters between steps, re-gathered
 * after each: ml_fsdp_sync_params; offload: FSDP's cpu_offload) */
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

#include "engine/fp32_params.h"
#include "parallel/fsdp.h"
#include "tensor/dtype.h"
#include "train_check.h"

static const char *g_fixture;
static const char *g_patterns; /* NULL: the routers alone */
static int g_ep = 1;
static int g_zero = 3;
static bool g_offload;
static int g_world;

static ml_engine_opts fp32_opts(void) {
  ml_engine_opts o = bf16_engine_opts();
  o.fp32_params = g_patterns;
  o.fsdp.zero = g_zero;
  o.fsdp.cpu_offload = g_offload;
  return o;
}

static void open_world(run *r, const ml_engine_opts *o, const fixture *fx) {
  run_open_ep(r, MPI_COMM_WORLD, 1, 1, 1, g_ep, o, fx->dir, NULL, NULL);
}

/* The export index of parameter p (ml_engine_export_param's order). */
static int export_index(run *r, const ml_param *p) {
  for (int i = 0; i < r->e.model.n_params; i++)
    if (ml_engine_export_param(&r->e, i) == p) return i;
  fail_msg("%s is not exported", p->name);
  return -1;
}

/* Every unit unsharded in turn: its fp32 parameters hold the master bits
 * `master` (export order, global = local with tp 1), the others the
 * master rounded to bf16; the count of fp32 parameters seen and whether
 * one of their values is not a bf16 value (so that a bf16 gather would
 * have changed it). Collective over the world. */
static int check_gathered(run *r, float **master, bool *beyond_bf16) {
  ml_fsdp *f = &r->e.fsdp;
  int n32 = 0;
  for (int u = 0; u < f->n_units; u++) {
    if (ml_fsdp_unshard(f, u)) fail_msg("unshard %d: %s", u, ml_error_msg());
    const ml_fsdp_unit *unit = &f->units[u];
    for (int i = 0; i < unit->n; i++) {
      const ml_param *p = unit->params[i];
      if (unit->vocab[i]) continue; /* never gathered: read from the shard (ml_fsdp_rows) */
      const float *m = master[export_index(r, p)];
      size_t n = (size_t)(p->shape[0] * p->shape[1]);
      assert_non_null(p->data);
      if (p->fp32) {
        n32++;
        if (p->dtype != ML_F32) fail_msg("%s: gathered as %s; expected fp32", p->name,
                                         ml_dtype_name(p->dtype));
        if (memcmp(p->data, m, sizeof(float) * n))
          fail_msg("%s: gathered values differ from the fp32 master weights", p->name);
        for (size_t k = 0; k < n; k++)
          if (ml_bf16_to_f32(ml_f32_to_bf16(m[k])) != m[k]) *beyond_bf16 = true;
        continue;
      }
      if (p->dtype != ML_BF16) fail_msg("%s: gathered as %s; expected bf16", p->name,
                                        ml_dtype_name(p->dtype));
      uint16_t *want = malloc(sizeof(uint16_t) * n);
      if (!want) fail_msg("out of memory");
      for (size_t k = 0; k < n; k++) want[k] = ml_f32_to_bf16(m[k]);
      int diff = memcmp(p->data, want, sizeof(uint16_t) * n);
      free(want);
      if (diff) fail_msg("%s: gathered values differ from the master rounded to bf16", p->name);
    }
    ml_fsdp_reshard(f, u);
  }
  return n32;
}

static void test_master_bits(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch bt;
  batch_make(&fx, g_world, &bt);
  ml_engine_opts o = fp32_opts();
  static run r;
  open_world(&r, &o, &fx);
  int want;
  int64_t numel;
  ml_fp32_params_count(&r.e.model, &want, &numel);
  assert_true(want > 0);
  ml_adamw_cfg adam = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
  bool beyond = false;
  for (int step = 0; step < 3; step++) {
    double type = step == 1 ? INFINITY : 2.0;
    ml_engine_norm_ahead(&r.e, type); /* the norm's partials in the backward (grad_norm.h) */
    step_rows(&r, &bt);
    check_norm_partials(&r, type, g_fixture);
    if (ml_engine_adamw(&r.e, &adam)) fail_msg("adamw: %s", ml_error_msg());
    float **master = export_all(&r, ML_EXPORT_PARAMS);
    int seen = check_gathered(&r, master, &beyond);
    free_all(master);
    assert_int_equal(seen, want); /* none of them vocab-parallel in these runs */
  }
  assert_true(beyond); /* the bits a bf16 gather would have lost are there */
  if (rank0())
    printf("%s: %d fp32 parameters (%lld elements) gathered as their fp32 master bits over 3 "
           "steps, the others as bf16\n", g_fixture, want, (long long)numel);
  run_close(&r);
  batch_free(&bt);
  fixture_free(&fx);
}

/* The bound of router probability p_te computed by meshlm against the
 * exact softmax of the exact logits l = h·W^T (h and W as stored):
 *  - the logits: an fp32 dot product of H terms, |Δl_te| <= gamma_H ·
 *    a_te with a_te = Σ_k |h_tk W_ek| (tolerance.h R2); δ_t = that
 *    bound's max over e;
 *  - softmax's sensitivity: logits moved by at most δ move each p by a
 *    factor within [e^{-2δ}, e^{2δ}] (p_e ∝ e^{l_e}, normalised);
 *  - its fp32 evaluation (model/moe.c route): l − mx rounds with relative
 *    u, an absolute u·R on the exponent (R: the row's logit range), so a
 *    relative u·R on exp; expf (R4: TOL_LIBM roundings); a sum of E
 *    positive terms (gamma_{E−1}) of such exps; one division: gamma of
 *    2R + 2·TOL_LIBM + E roundings over numerator and denominator;
 *  - the double reference: gamma64 of H + E + 2·TOL_LIBM (R5).
 * Relative to p_te. A bf16 W (or h) moves l by ~2^-9·a_te: 2^15/H times
 * gamma_H·a_te. */
static double router_bound(double delta, double range, double H, double E) {
  double soft = expm1(2.0 * delta), eval = tol_gamma(2.0 * range + 2.0 * TOL_LIBM + E);
  return soft + eval + soft * eval + tol_gamma64(H + E + 2.0 * TOL_LIBM);
}

static void test_router_logits(void **state) {
  (void)state;
  if (g_world > 1) skip();
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch bt;
  batch_make(&fx, 1, &bt);
  ml_engine_opts o = fp32_opts();
  static run r;
  run_open(&r, MPI_COMM_SELF, 1, 1, &o, fx.dir);
  if (r.e.model.cfg.n_experts == 0) { /* a dense model: no router */
    run_close(&r);
    batch_free(&bt);
    fixture_free(&fx);
    skip();
  }
  step_rows(&r, &bt); /* the training forward keeps every layer's router input and probs */
  float **master = export_all(&r, ML_EXPORT_PARAMS);
  const ml_model *m = &r.e.model;
  int64_t H = m->cfg.hidden, E = m->cfg.n_experts, layers = 0;
  double worst = 0.0;
  for (int64_t l = 0; l < m->cfg.n_layers; l++) {
    const ml_layer *L = &m->layers[l];
    if (!L->moe.gate.weight) continue;
    layers++;
    const float *W = master[export_index(&r, L->moe.gate.weight)], *h = L->acts.in_gu.x;
    int64_t T = L->acts.in_gu.B * L->acts.in_gu.s;
    assert_int_equal(L->acts.in_gu.c, H);
    for (int64_t t = 0; t < T; t++) {
      double lg[256], a_max = 0.0, mx = -INFINITY, mn = INFINITY, sum = 0.0;
      assert_true(E <= 256);
      for (int64_t e = 0; e < E; e++) {
        double s = 0.0, a = 0.0;
        for (int64_t k = 0; k < H; k++) {
          s += (double)h[t * H + k] * W[e * H + k];
          a += fabs((double)h[t * H + k] * W[e * H + k]);
        }
        lg[e] = s;
        a_max = fmax(a_max, a);
        mx = fmax(mx, s);
        mn = fmin(mn, s);
      }
      for (int64_t e = 0; e < E; e++) sum += exp(lg[e] - mx);
      double bound = router_bound(tol_gamma((double)H) * a_max, mx - mn, (double)H, (double)E);
      for (int64_t e = 0; e < E; e++) {
        double ref = exp(lg[e] - mx) / sum, got = L->acts.probs[t * E + e];
        double rel = fabs(got - ref) / ref;
        worst = fmax(worst, rel / bound);
        if (rel > bound)
          fail_msg("layer %lld token %lld expert %lld: router probability %.9g, fp32 logits "
                   "give %.9g (relative %.3g > bound %.3g)",
                   (long long)l, (long long)t, (long long)e, got, ref, rel, bound);
      }
    }
  }
  assert_true(layers > 0);
  printf("%s: router probabilities of %lld sparse layers within the fp32 bound (worst %.3g of "
         "it)\n", g_fixture, (long long)layers, worst);
  free_all(master);
  run_close(&r);
  batch_free(&bt);
  fixture_free(&fx);
}

static void test_vs_fp32(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch bt;
  batch_make(&fx, g_world, &bt);
  ml_engine_opts o = fp32_opts();
  static run f32, b16;
  run_open(&f32, MPI_COMM_SELF, 1, 1, NULL, fx.dir);
  open_world(&b16, &o, &fx);
  run_diff d = run_compare(&b16, &f32, &fx, &bt);
  tol_model tm = tol_model_of(&f32, bt.S, bt.B * bt.S);
  double tg = tol_bf16(&tm, TOL_GRADS, 0, 0); /* fewer bf16 sites than it counts: a bound */
  if (rank0())
    printf("%s bf16 (fp32 routers%s%s) on %d rank(s) vs fp32 on one: loss rel %.3g (limit %g), "
           "log-probs mean |diff| %.3g (limit %g), worst grad rel L2 %.3g (bound %.3g)\n",
           g_fixture, g_patterns ? ", " : "", g_patterns ? g_patterns : "", g_world, d.loss_rel,
           TOL_BF16_LOSS_LIMIT, d.logprob_mean_abs, TOL_BF16_LOGPROB_LIMIT, d.grad_rel, tg);
  assert_true(d.loss_rel <= TOL_BF16_LOSS_LIMIT);
  assert_true(d.logprob_mean_abs <= TOL_BF16_LOGPROB_LIMIT);
  assert_true(d.grad_rel <= tg);
  assert_true(d.loss_rel > 0 && !d.grads_exact); /* the bf16 rounding did happen */
  run_close(&b16);
  run_close(&f32);
  batch_free(&bt);
  fixture_free(&fx);
}

static void test_refused(void **state) {
  (void)state;
  if (g_world > 1) skip();
  static fixture fx;
  fixture_load(g_fixture, &fx);
  ml_engine_opts o = bf16_engine_opts();
  o.fp32_params = "model.norm.weight, model.nope.*";
  ml_mesh mesh;
  ml_engine e;
  memset(&e, 0, sizeof e);
  if (ml_mesh_create(MPI_COMM_SELF, 1, 0, 1, 1, NULL, NULL, &mesh))
    fail_msg("mesh: %s", ml_error_msg());
  int rc = ml_engine_open(&e, &mesh, fx.dir, &o);
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", ml_error_msg());
  ml_engine_close(&e);
  ml_mesh_destroy(&mesh);
  assert_int_not_equal(rc, 0);
  printf("refused: %s\n", msg);
  assert_non_null(strstr(msg, "fp32_params (--fp32-params): pattern 'model.nope.*' matches no "
                              "parameter"));
  fixture_free(&fx);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_size(MPI_COMM_WORLD, &g_world);
  if (argc < 2) {
    fprintf(stderr, "usage: mpiexec -n N test_fp32_params FIXTURE [PATTERNS|-] "
                    "[ep=E|zero=Z|offload]...\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  if (argc > 2 && strcmp(argv[2], "-")) g_patterns = argv[2];
  for (int i = 3; i < argc; i++) {
    if (!strncmp(argv[i], "ep=", 3) && atoi(argv[i] + 3) >= 1) g_ep = atoi(argv[i] + 3);
    else if (!strncmp(argv[i], "zero=", 5) && atoi(argv[i] + 5) >= 1) g_zero = atoi(argv[i] + 5);
    else if (!strcmp(argv[i], "offload")) g_offload = true;
    else {
      fprintf(stderr, "test_fp32_params: unknown option '%s'\n", argv[i]);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  const struct CMUnitTest tests[] = {
      held_test(test_master_bits),
      held_test(test_router_logits),
      held_test(test_vs_fp32),
      held_test(test_refused),
  };
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
