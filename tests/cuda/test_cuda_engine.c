/* The engine on the CUDA backend against the CPU backend, one rank, on a
 * fixture family: `mpiexec -n 1 test_cuda_engine FIXTURE`. Exits 77
 * (skipped) when the cuda backend cannot be created (no CUDA in the
 * build, or no GPU).
 *  - fp32: the per-token log-probs, the loss and every gradient of one
 *    forward/backward within the CUDA backend's acceptance limits
 *    (tolerance.h §6b: 1e-4 nats, 1e-5 relative, 1e-4 relative L2) and
 *    within §3's bound for two fp32 evaluations in different orders
 *    (tol_model_pair; the log-probs' rel L2); the grad norms (L2 and inf)
 *    of each run against its own gradients and across the backends
 *    within §6's triangle bounds (check_norms, train_check.h); then
 *    one training step (grad norm, clipping, AdamW) on each backend,
 *    checked against AdamW in double on the run's own state (§5,
 *    train_check.h), the parameters before it bitwise equal (the same
 *    checkpoint) and after it within the step's bound below; and the CUDA
 *    run's next forward/backward against the CPU on its stepped parameters
 *    (check_replay_one_rank), which catches a device copy left stale.
 *  - fp32 with cpu_offload on the CUDA run (FSDP2's CPUOffloadPolicy:
 *    shards in pinned host memory, the step on the CPU backend's kernels,
 *    parallel/fsdp.h): the same checks against the CPU run without it;
 *    the replay catches a device copy of a shard not refreshed from the
 *    host after the step.
 *  - bf16 (param_dtype bf16, as tests/mpi/test_bf16.c runs it): the CUDA
 *    run against the CPU in fp32 within that test's limits and bound
 *    (tolerance.h §4: TOL_BF16_LOSS_LIMIT, TOL_BF16_LOGPROB_LIMIT,
 *    tol_bf16), and against the CPU in bf16 within the same limits and
 *    bound: the two round at the same sites and differ only in the order
 *    of their fp32 sums, which §4 shows two orders below the bf16 sites,
 *    so they are no further apart than bf16 is from fp32 (§4's worst case
 *    for two bf16 runs, tol_bf16_pair, twice that, is printed beside); the
 *    grad norms as in fp32; one training step checked against AdamW in
 *    double;
 *  - packed documents (ml_engine_batch.docs: the varlen attention core,
 *    one block of the backend's block attention per document, forward and
 *    backward): the fixture's rows as the documents of one row, fp32, the
 *    log-probs and every gradient of one forward/backward against the CPU
 *    within §3's bounds (tol_model_pair), as the fp32 run's. */
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

#include "comm/comm_local.h"
#include "train_check.h"

static const char *g_fixture;
static ml_backend *g_cpu, *g_cuda;

/* The fixture on one rank of `be`: the CPU backend with the MPI comms, the
 * CUDA backend with comms that copy on the device (as src/cli/device.c). */
static void open_on(run *r, ml_backend *be, ml_engine_opts o, const fixture *fx) {
  o.backend = be;
  bool device = be != g_cpu;
  run_open_comm(r, MPI_COMM_SELF, 1, 1, &o, fx->dir, device ? ml_comm_local_make : NULL,
                device ? be : NULL);
}

/* One checked step (train_check.h: AdamW against double on the run's own
 * state) with the parameters before and after it exported. */
static const ml_adamw_cfg k_adam = {1e-3, 0.9, 0.999, 1e-8, 0.1};
static const double k_max_norm = 1.0;

static void step_export(run *r, const batch *bt, float ***p0, float ***p1) {
  *p0 = export_all(r, ML_EXPORT_PARAMS);
  double worst = 0;
  checked_step(r, bt, &k_adam, k_max_norm, &worst);
  printf("%s AdamW step on %s: worst error/bound vs AdamW in double %.3g\n", g_fixture,
         r->e.be->ops->name, worst);
  *p1 = export_all(r, ML_EXPORT_PARAMS);
}

/* The first step from bitwise equal parameters p0 (asserted): each update
 * is −lr·m̂/(sqrt(v̂) + eps) with m̂ = c·g, v̂ = (c·g)² (c the clip
 * coefficient), of magnitude < lr whatever g; p1 = p0·(1 − lr·wd) + update
 * in fp32 is within gamma_k·(|p0| + lr) of the exact value from the run's
 * own gradients, k = TOL_K_ADAMW_P + TOL_K_ADAMW_M + TOL_K_ADAMW_V (the
 * update's roundings and those of m and v, which reach it at most with
 * weight 1 and 1/2: tolerance.h §5 with m = v = 0 before). Hence |p1_a − p1_b| <= 2·lr +
 * 2·gamma_k·(|p0| + lr): AdamW's sign-like update makes no bound tighter
 * than 2·lr hold where |g| is near eps (train_check.h); the checked steps
 * and the replay are the sharp checks. */
static void check_params_after_step(run *a, float **a0, float **b0, float **a1, float **b1) {
  double g = tol_gamma(TOL_K_ADAMW_P + TOL_K_ADAMW_M + TOL_K_ADAMW_V), lr = k_adam.lr;
  double worst = 0;
  for (int i = 0; i < a->e.model.n_params; i++) {
    const ml_param *p = ml_engine_export_param(&a->e, i);
    int64_t n = p->shape[0] * p->shape[1];
    if (memcmp(a0[i], b0[i], sizeof(float) * (size_t)n))
      fail_msg("%s: the parameters before the step differ between the backends", p->name);
    for (int64_t k = 0; k < n; k++) {
      double bound = TOL_FIRST_ORDER * (2.0 * lr + 2.0 * g * (fabs(a0[i][k]) + lr));
      double e = fabs((double)a1[i][k] - b1[i][k]);
      worst = fmax(worst, e / bound);
      if (e > bound)
        fail_msg("%s[%lld] after the step: cuda %.9g, cpu %.9g (bound %.3g)", p->name,
                 (long long)k, (double)a1[i][k], (double)b1[i][k], bound);
    }
  }
  printf("%s parameters after the step: worst |diff|/bound %.3g\n", g_fixture, worst);
}

/* The fp32 checks of the header, the CUDA run with cpu_offload or not. */
static void fp32_against_cpu(bool offload) {
  static fixture fx; /* held: static, see held.h */
  fixture_load(g_fixture, &fx);
  static batch bt;
  batch_make(&fx, fx.B, &bt);
  static run cpu, gpu;
  ml_engine_opts go = ml_engine_opts_default();
  go.fsdp.cpu_offload = offload;
  open_on(&cpu, g_cpu, ml_engine_opts_default(), &fx);
  open_on(&gpu, g_cuda, go, &fx);
  if (offload) printf("%s: the CUDA run with cpu_offload\n", g_fixture);
  run_diff d = run_compare(&gpu, &cpu, &fx, &bt);
  tol_model tm = tol_model_of(&cpu, bt.S, bt.B * bt.S);
  double tl = tol_model_pair(&tm, TOL_LOSS), tg = tol_model_pair(&tm, TOL_GRADS);
  double tlp = tol_model_pair(&tm, TOL_LOGPROBS);
  printf("%s fp32 cuda vs cpu: loss rel %.3g (limit %g, bound %.3g), log-probs max |diff| %.3g "
         "(limit %g), rel L2 %.3g (bound %.3g), worst grad rel L2 %.3g (limit %g, bound %.3g)\n",
         g_fixture, d.loss_rel, TOL_CUDA_LOSS_REL, tl, d.logprob_max_abs, TOL_CUDA_LOGPROB_ABS,
         d.logprob_rel_l2, tlp, d.grad_rel, TOL_CUDA_GRAD_REL, tg);
  assert_true(d.loss_rel <= TOL_CUDA_LOSS_REL && d.loss_rel <= tl);
  assert_true(d.logprob_max_abs <= TOL_CUDA_LOGPROB_ABS && d.logprob_rel_l2 <= tlp);
  assert_true(d.grad_rel <= TOL_CUDA_GRAD_REL && d.grad_rel <= tg);
  run *const runs[] = {&gpu};
  check_norms(&cpu, runs, 1);
  float **g0, **g1, **c0, **c1;
  step_export(&gpu, &bt, &g0, &g1);
  step_export(&cpu, &bt, &c0, &c1);
  check_params_after_step(&gpu, g0, c0, g1, c1);
  free_all(c1);
  free_all(c0);
  free_all(g1);
  free_all(g0);
  check_replay_one_rank(&gpu, &bt);
  run_close(&gpu);
  run_close(&cpu);
  batch_free(&bt);
  fixture_free(&fx);
}

static void test_fp32(void **state) {
  (void)state;
  fp32_against_cpu(false);
}

static void test_fp32_offload(void **state) {
  (void)state;
  fp32_against_cpu(true);
}

static void test_bf16(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch bt;
  batch_make(&fx, 1, &bt); /* as test_bf16.c */
  static run c32, c16, g16;
  open_on(&c32, g_cpu, ml_engine_opts_default(), &fx);
  open_on(&c16, g_cpu, bf16_engine_opts(), &fx);
  open_on(&g16, g_cuda, bf16_engine_opts(), &fx);
  tol_model tm = tol_model_of(&c32, bt.S, bt.B * bt.S);
  /* against fp32: test_bf16.c's test_vs_fp32 */
  run_diff d = run_compare(&g16, &c32, &fx, &bt);
  double tg = tol_bf16(&tm, TOL_GRADS, 0, 0), expect = tol_bf16_expected(&tm);
  printf("%s cuda bf16 vs cpu fp32: loss rel %.3g (limit %g), log-probs mean |diff| %.3g nats "
         "(limit %g; expected ~%.3g x |log-prob| %.3g), worst grad rel L2 %.3g (bound %.3g)\n",
         g_fixture, d.loss_rel, TOL_BF16_LOSS_LIMIT, d.logprob_mean_abs, TOL_BF16_LOGPROB_LIMIT,
         expect, d.loss_ref, d.grad_rel, tg);
  assert_true(d.loss_rel <= TOL_BF16_LOSS_LIMIT);
  assert_true(d.logprob_mean_abs <= TOL_BF16_LOGPROB_LIMIT);
  assert_true(d.grad_rel <= tg);
  assert_true(d.loss_rel > 0 && !d.grads_exact); /* the rounding did happen */
  /* against the CPU in bf16: the same limits and bound */
  d = run_compare(&g16, &c16, &fx, &bt);
  printf("%s cuda bf16 vs cpu bf16: loss rel %.3g (limit %g; pair bound %.3g), log-probs mean "
         "|diff| %.3g (limit %g), worst grad rel L2 %.3g (bound %.3g; pair bound %.3g)\n",
         g_fixture, d.loss_rel, TOL_BF16_LOSS_LIMIT, tol_bf16_pair(&tm, TOL_LOSS),
         d.logprob_mean_abs, TOL_BF16_LOGPROB_LIMIT, d.grad_rel, tg,
         tol_bf16_pair(&tm, TOL_GRADS));
  assert_true(d.loss_rel <= TOL_BF16_LOSS_LIMIT);
  assert_true(d.logprob_mean_abs <= TOL_BF16_LOGPROB_LIMIT);
  assert_true(d.grad_rel <= tg);
  run *const runs[] = {&g16};
  check_norms(&c16, runs, 1);
  double worst = 0;
  checked_step(&g16, &bt, &k_adam, k_max_norm, &worst);
  printf("%s AdamW step on cuda (bf16): worst error/bound vs AdamW in double %.3g\n", g_fixture,
         worst);
  run_close(&g16);
  run_close(&c16);
  run_close(&c32);
  batch_free(&bt);
  fixture_free(&fx);
}

/* One forward/backward of the fixture's rows packed as documents of one
 * row; out: the log-probs [S − 1] of the same batch. */
static void packed_step(run *r, const fixture *fx, const int64_t *docs, float *out) {
  ml_engine_batch b = {.ids = fx->ids, .B = 1, .S = fx->B * fx->S, .docs = docs, .ndocs = fx->B};
  ml_loss_out nll = {0};
  ml_engine_zero_grad(&r->e);
  if (ml_engine_forward_backward_batch(&r->e, &b, NULL, 1.0f / (float)(fx->B * (fx->S - 1)),
                                       NULL, &nll) ||
      ml_engine_logprobs_batch(&r->e, &b, out))
    fail_msg("packed documents on %s: %s", r->e.be->ops->name, ml_error_msg());
}

static void test_packed(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static run cpu, gpu;
  open_on(&cpu, g_cpu, ml_engine_opts_default(), &fx);
  open_on(&gpu, g_cuda, ml_engine_opts_default(), &fx);
  int64_t S = fx.B * fx.S, docs[65];
  if (fx.B > 64) fail_msg("%lld rows: at most 64 documents here", (long long)fx.B);
  for (int64_t d = 0; d <= fx.B; d++) docs[d] = d * fx.S;
  float *lg = calloc((size_t)S, sizeof(float)), *lc = calloc((size_t)S, sizeof(float));
  if (!lg || !lc) fail_msg("out of memory");
  packed_step(&gpu, &fx, docs, lg);
  packed_step(&cpu, &fx, docs, lc);
  bool exact;
  double grad = worst_rel(&gpu, &cpu, ML_EXPORT_GRADS, &exact), lp = rel_l2(lg, lc, S - 1);
  tol_model tm = tol_model_of(&cpu, fx.S, S);
  double tg = tol_model_pair(&tm, TOL_GRADS), tlp = tol_model_pair(&tm, TOL_LOGPROBS);
  printf("%s packed documents (%lld of %lld tokens), fp32 cuda vs cpu: log-probs rel L2 %.3g "
         "(bound %.3g), worst grad rel L2 %.3g (bound %.3g)\n",
         g_fixture, (long long)fx.B, (long long)fx.S, lp, tlp, grad, tg);
  assert_true(lp <= tlp);
  assert_true(grad <= tg);
  free(lg);
  free(lc);
  run_close(&gpu);
  run_close(&cpu);
  fixture_free(&fx);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: mpiexec -n 1 test_cuda_engine FIXTURE\n");
    return 2;
  }
  g_fixture = argv[1];
  if (ml_backend_get("cuda", 0, &g_cuda)) {
    printf("skipped: no GPU (%s)\n", ml_error_msg());
    return 77;
  }
  if (ml_backend_get("cpu", 0, &g_cpu)) {
    fprintf(stderr, "cpu backend: %s\n", ml_error_msg());
    return 1;
  }
  MPI_Init(&argc, &argv);
  const struct CMUnitTest tests[] = {
      held_test(test_fp32),
      held_test(test_fp32_offload),
      held_test(test_bf16),
      held_test(test_packed),
  };
  int rc = held_finish(cmocka_run_group_tests(tests, NULL, NULL));
  ml_backend_release_all();
  return rc;
}
