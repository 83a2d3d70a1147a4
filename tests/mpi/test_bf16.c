/* Real bf16 compute (param_dtype bf16: bf16 GEMM operands, fp32
 * accumulation, as autocast(bfloat16) under FSDP2's MixedPrecisionPolicy)
 * on a fixture family, on 4 ranks:
 *  - against fp32 on one rank: the loss (issue 10's limit, tolerance.h
 *    §4), every gradient (tol_bf16) and the per-token log-probs (mean
 *    |Δ| within the limit); and that the rounding happened;
 *  - mesh parity in bf16: one rank against dp2 × tp2 on the loss, every
 *    gradient and the log-probs (tol_bf16_pair).
 * usage: test_bf16 FIXTURE */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#include "train_check.h"

static const char *g_fixture;

static void test_vs_fp32(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch bt;
  batch_make(&fx, 1, &bt);
  ml_engine_opts o16 = bf16_engine_opts();
  static run f32, b16;
  run_open(&f32, MPI_COMM_SELF, 1, 1, NULL, fx.dir);
  run_open(&b16, MPI_COMM_SELF, 1, 1, &o16, fx.dir);
  run_diff d = run_compare(&b16, &f32, &fx, &bt);
  tol_model tm = tol_model_of(&f32, bt.S, bt.B * bt.S);
  double tg = tol_bf16(&tm, TOL_GRADS, 0, 0), expect = tol_bf16_expected(&tm);
  if (rank0())
    printf("%s bf16 vs fp32: loss rel %.3g (limit %g), log-probs mean |diff| %.3g nats (limit "
           "%g; expected ~%.3g x |log-prob| %.3g), worst grad rel L2 %.3g (bound %.3g)\n",
           g_fixture, d.loss_rel, TOL_BF16_LOSS_LIMIT, d.logprob_mean_abs, TOL_BF16_LOGPROB_LIMIT,
           expect, d.loss_ref, d.grad_rel, tg);
  assert_true(d.loss_rel <= TOL_BF16_LOSS_LIMIT);
  assert_true(d.logprob_mean_abs <= TOL_BF16_LOGPROB_LIMIT);
  assert_true(d.grad_rel <= tg);
  assert_true(d.loss_rel > 0 && !d.grads_exact); /* the rounding did happen */
  run_close(&b16);
  run_close(&f32);
  batch_free(&bt);
  fixture_free(&fx);
}

static void test_mesh_parity(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch bt;
  batch_make(&fx, 2, &bt); /* one row per dp rank */
  ml_engine_opts o16 = bf16_engine_opts();
  static run one, mesh;
  run_open(&one, MPI_COMM_SELF, 1, 1, &o16, fx.dir);
  run_open(&mesh, MPI_COMM_WORLD, 1, 2, &o16, fx.dir);
  run_diff d = run_compare(&mesh, &one, &fx, &bt);
  tol_model tm = tol_model_of(&one, bt.S, bt.B * bt.S);
  double tl = tol_bf16_pair(&tm, TOL_LOSS), tg = tol_bf16_pair(&tm, TOL_GRADS);
  /* log-probs: each token's relative error within the loss bound, and
   * |log-prob| averages to the loss, so the mean |Δ| is within tl·loss */
  double tlp = tl * fabs(d.loss_ref);
  if (rank0())
    printf("%s bf16 dp2 x tp2 vs 1 rank: loss rel %.3g (bound %.3g), log-probs mean |diff| %.3g "
           "(bound %.3g), worst grad rel L2 %.3g (bound %.3g)\n",
           g_fixture, d.loss_rel, tl, d.logprob_mean_abs, tlp, d.grad_rel, tg);
  assert_true(d.loss_rel <= tl);
  assert_true(d.logprob_mean_abs <= tlp);
  assert_true(d.grad_rel <= tg);
  run_close(&mesh);
  run_close(&one);
  batch_free(&bt);
  fixture_free(&fx);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int size;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc != 2 || size != 4) {
    fprintf(stderr, "usage: mpiexec -n 4 test_bf16 FIXTURE\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  const struct CMUnitTest tests[] = {
      held_test(test_vs_fp32),
      held_test(test_mesh_parity),
  };
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
