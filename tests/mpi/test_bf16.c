/* Real bf16 compute (param_dtype bf16: bf16 GEMM operands, fp32
 * accumulation, as autocast(bfloat16) under FSDP2's MixedPrecisionPolicy)
 * on a fixture family, on 4 ranks:
 *  - against fp32 on one rank: the loss (issue 10's limit, tolerance.h
 *    §4), every gradient (tol_bf16) and the per-token log-probs (mean
 *    |Δ| within the limit); and that the rounding happened;
 *  - mesh parity in bf16: one rank against dp2 × tp2, and against dp2 ×
 *    cp2 (ring attention, whose K/V passes carry the bf16 k, v: parallel/
 *    cp.h), on the loss, every gradient and the log-probs (tol_bf16_pair:
 *    its sites hold on any mesh, whatever order the reductions take); and
 *    dp2 × cp2 with bf16 K/V bitwise against the same ring on fp32 q, k, v
 *    (the core's bf16_qkv cleared), as ml_attn_block.qkv_bf16 promises;
 *  - the persistent bf16 shard written by AdamW's pass (parallel/fsdp.h
 *    lp): bitwise the rounding an unshard would make, over clipped steps;
 *  - lazy zero_grad: zeros read before a backward, micro-batches
 *    accumulated bitwise as adds into zeros (1 rank and dp2 × tp2).
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
#include <string.h>

#include "parallel/fsdp.h"
#include "tensor/dtype.h"
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

/* One rank against the 4-rank mesh cp × tp (dp2 either way) in bf16. */
static void mesh_parity(int cp, int tp) {
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch bt;
  batch_make(&fx, 2, &bt); /* one row per dp rank */
  ml_engine_opts o16 = bf16_engine_opts();
  static run one, mesh;
  run_open(&one, MPI_COMM_SELF, 1, 1, &o16, fx.dir);
  run_open_mesh(&mesh, MPI_COMM_WORLD, 1, cp, tp, &o16, fx.dir, NULL, NULL);
  run_diff d = run_compare(&mesh, &one, &fx, &bt);
  if (cp > 1) {
    /* the ring took bf16 q, k, v (tp 1: no hook on o_proj's input) ... */
    assert_true(mesh.e.model.bf16_qkv && !mesh.e.model.bf16_att);
    /* ... and computes bitwise what it computes on fp32 q, k, v holding the same values (the
     * core not declaring them: fp32 K/V passes, each block rounding its operands to the same
     * bf16 values, ml_attn_block.qkv_bf16): loss, log-probs, gradients */
    static run f32kv;
    run_open_mesh(&f32kv, MPI_COMM_WORLD, 1, cp, tp, &o16, fx.dir, NULL, NULL);
    f32kv.e.model.attn_core.bf16_qkv = false;
    run_diff x = run_compare(&mesh, &f32kv, &fx, &bt);
    assert_false(f32kv.e.model.bf16_qkv);
    if (rank0())
      printf("%s bf16 dp2 x cp%d, bf16 vs fp32 K/V: loss rel %.3g, log-probs max |diff| %.3g, "
             "gradients %s\n", g_fixture, cp, x.loss_rel, x.logprob_max_abs,
             x.grads_exact ? "bitwise" : "differ");
    assert_true(x.loss_rel == 0 && x.logprob_max_abs == 0 && x.grads_exact);
    run_close(&f32kv);
  }
  tol_model tm = tol_model_of(&one, bt.S, bt.B * bt.S);
  double tl = tol_bf16_pair(&tm, TOL_LOSS), tg = tol_bf16_pair(&tm, TOL_GRADS);
  /* log-probs: each token's relative error within the loss bound, and
   * |log-prob| averages to the loss, so the mean |Δ| is within tl·loss */
  double tlp = tl * fabs(d.loss_ref);
  if (rank0())
    printf("%s bf16 dp2 x %s%d vs 1 rank: loss rel %.3g (bound %.3g), log-probs mean |diff| "
           "%.3g (bound %.3g), worst grad rel L2 %.3g (bound %.3g)\n",
           g_fixture, cp > 1 ? "cp" : "tp", cp > 1 ? cp : tp, d.loss_rel, tl,
           d.logprob_mean_abs, tlp, d.grad_rel, tg);
  assert_true(d.loss_rel <= tl);
  assert_true(d.logprob_mean_abs <= tlp);
  assert_true(d.grad_rel <= tg);
  run_close(&mesh);
  run_close(&one);
  batch_free(&bt);
  fixture_free(&fx);
}

static void test_mesh_parity(void **state) {
  (void)state;
  mesh_parity(1, 2);
  mesh_parity(2, 1);
}

/* Every unit's persistent bf16 shard of r: present (param_dtype bf16,
 * training), current, and bit for bit ml_convert_from_f32 of its fp32
 * shard (the CPU backend's shards are host memory). */
static void check_lp(run *r) {
  for (int u = 0; u < r->e.fsdp.n_units; u++) {
    const ml_fsdp_unit *unit = &r->e.fsdp.units[u];
    assert_non_null(unit->lp);
    assert_true(unit->lp_fresh);
    uint16_t *want = malloc(sizeof(uint16_t) * (size_t)unit->shard_numel);
    assert_non_null(want);
    assert_int_equal(ml_convert_from_f32(ML_BF16, unit->shard, want, (size_t)unit->shard_numel), 0);
    assert_memory_equal(unit->lp, want, sizeof(uint16_t) * (size_t)unit->shard_numel);
    free(want);
  }
}

/* Three clipped AdamW steps of `a`, whose persistent bf16 shards AdamW's
 * pass keeps current, against `b`, whose shards are marked stale before
 * each step (ml_fsdp_params_changed: the step's first unshard rounds them
 * from the fp32 masters, as every unshard did before): the same rounding
 * of the same values, so losses, gradients and weights bitwise equal. */
static void persistent_case(run *a, run *b, const batch *bt) {
  const ml_adamw_cfg c = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                          .weight_decay = 0.1};
  for (int s = 0; s < 3; s++) {
    ml_fsdp_params_changed(&b->e.fsdp);
    double la = step_rows(a, bt), lb = step_rows(b, bt), na, nb;
    assert_memory_equal(&la, &lb, sizeof la);
    bool exact;
    worst_rel(a, b, ML_EXPORT_GRADS, &exact);
    assert_true(exact);
    if (ml_engine_grad_norm(&a->e, 2.0, &na) || ml_engine_grad_norm(&b->e, 2.0, &nb))
      fail_msg("grad norm: %s", ml_error_msg());
    assert_memory_equal(&na, &nb, sizeof na);
    /* max_norm below the norm: the clipped (grad_scale) pass */
    if (ml_engine_clip_adamw(&a->e, na, 0.5 * na, &c) ||
        ml_engine_clip_adamw(&b->e, nb, 0.5 * nb, &c))
      fail_msg("adamw: %s", ml_error_msg());
    worst_rel(a, b, ML_EXPORT_PARAMS, &exact);
    assert_true(exact);
    check_lp(a);
  }
}

static void test_persistent_shard(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch bt;
  batch_make(&fx, 2, &bt); /* one row per dp rank */
  ml_engine_opts o16 = bf16_engine_opts();
  static run a, b;
  run_open(&a, MPI_COMM_SELF, 1, 1, &o16, fx.dir);
  run_open(&b, MPI_COMM_SELF, 1, 1, &o16, fx.dir);
  persistent_case(&a, &b, &bt);
  run_close(&b);
  run_close(&a);
  run_open(&a, MPI_COMM_WORLD, 1, 2, &o16, fx.dir); /* dp2 x tp2 */
  run_open(&b, MPI_COMM_WORLD, 1, 2, &o16, fx.dir);
  persistent_case(&a, &b, &bt);
  run_close(&b);
  run_close(&a);
  batch_free(&bt);
  fixture_free(&fx);
}

static uint32_t float_bits(float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  return u;
}

/* forward_backward of this dp rank's rows of b, accumulating (no zero_grad). */
static void accumulate_rows(run *r, const batch *b) {
  ml_comm *dp = ml_mesh_comm(&r->mesh, ML_GROUP_DP);
  int64_t Bl = b->B / dp->size, at = dp->rank * Bl * b->S;
  double loss;
  if (ml_engine_forward_backward(&r->e, b->ids + at, b->mask + at, Bl, b->S, b->targets, &loss))
    fail_msg("forward_backward: %s", ml_error_msg());
}

/* Every exported gradient bitwise +0 (zero_grad's, read before a backward). */
static void assert_zero_grads(run *r) {
  float **g = export_all(r, ML_EXPORT_GRADS);
  for (int i = 0; i < r->e.model.n_params; i++) {
    const ml_param *p = ml_engine_export_param(&r->e, i);
    for (int64_t k = 0; k < p->shape[0] * p->shape[1]; k++)
      if (float_bits(g[i][k]) != 0) fail_msg("%s[%lld] = %a after zero_grad", p->name, (long long)k, g[i][k]);
  }
  free_all(g);
}

/* Lazy zero_grad (parallel/fsdp.h ml_fsdp_zero_grads: the first reduction
 * after it writes shard_grad, as 0 + g): the gradients read as +0 after
 * zero_grad, before any backward (the first one, and after a step that
 * left gradients there); two accumulated micro-batches are bitwise g1 + g2
 * in fp32 (shard_grad = 0 + g1, then += g2: the add into zeros), g2 the
 * second micro-batch's gradient after a zero_grad, which is itself bitwise
 * what that backward reduced (not added onto the previous gradients).
 * bf16 param_dtype: the reductions' paths (the round in the add on one rank,
 * in the staging copy on dp2 × tp2), whose gradients the backward does not
 * accumulate in place. */
static void lazy_zero_case(run *r, const batch *b1, const batch *b2) {
  ml_engine_zero_grad(&r->e);
  assert_zero_grads(r);
  accumulate_rows(r, b1);
  float **g1 = export_all(r, ML_EXPORT_GRADS);
  accumulate_rows(r, b2);
  float **g12 = export_all(r, ML_EXPORT_GRADS);
  ml_engine_zero_grad(&r->e);
  accumulate_rows(r, b2);
  float **g2 = export_all(r, ML_EXPORT_GRADS);
  for (int i = 0; i < r->e.model.n_params; i++) {
    const ml_param *p = ml_engine_export_param(&r->e, i);
    for (int64_t k = 0; k < p->shape[0] * p->shape[1]; k++) {
      float want = g1[i][k] + g2[i][k];
      if (float_bits(g12[i][k]) != float_bits(want))
        fail_msg("%s[%lld]: accumulated %a, expected %a + %a", p->name, (long long)k, g12[i][k],
                 g1[i][k], g2[i][k]);
    }
  }
  free_all(g2);
  free_all(g12);
  free_all(g1);
  ml_engine_zero_grad(&r->e);
  assert_zero_grads(r);
}

static void test_lazy_zero_grad(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch b1, b2;
  batch_make(&fx, 2, &b1); /* one row per dp rank */
  batch_make(&fx, 2, &b2);
  for (int i = 0; i < 2; i++) { /* b1's rows swapped: another micro-batch */
    memcpy(b2.ids + i * b2.S, b1.ids + (1 - i) * b1.S, sizeof(int32_t) * (size_t)b1.S);
    memcpy(b2.mask + i * b2.S, b1.mask + (1 - i) * b1.S, (size_t)b1.S);
  }
  ml_engine_opts o16 = bf16_engine_opts();
  static run r;
  run_open(&r, MPI_COMM_SELF, 1, 1, &o16, fx.dir);
  lazy_zero_case(&r, &b1, &b2);
  run_close(&r);
  run_open(&r, MPI_COMM_WORLD, 1, 2, &o16, fx.dir); /* dp2 x tp2 */
  lazy_zero_case(&r, &b1, &b2);
  run_close(&r);
  batch_free(&b2);
  batch_free(&b1);
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
      held_test(test_persistent_shard),
      held_test(test_lazy_zero_grad),
  };
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
