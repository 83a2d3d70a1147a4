/* FSDP2 semantics on 4 ranks: `mpiexec -n 4 test_fsdp FIXTURE`.
 *  - HSDP: dp_replicate=2 × dp_shard=2 against FSDP over 4 ranks (first-step
 *    loss bitwise equal: both sum the same per-rank loss sums over the same
 *    dp group; gradients and params after 3 AdamW steps within fp32
 *    rounding), also with tp=2; grad norms (L2 and inf) against one rank;
 *    the replica all-reduce per unit.
 *  - Mixed precision: bf16 all-gather moves exactly half the bytes of fp32,
 *    bf16 gradient reduction half the reduce-scatter bytes; loss and
 *    gradients within the bf16 tolerances below.
 *  - ZeRO-1/2 against ZeRO-3: the same params after 3 AdamW steps (ZeRO-2
 *    bitwise: the same reduce-scatter; ZeRO-1 all-reduces, another sum
 *    order), and what each gathers per step.
 *  - Prefetch depths and reshard policies change when the all-gathers run,
 *    never the arithmetic: gradients bitwise equal; all-gather counts. */
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

/* bf16 tolerances. bf16 keeps 8 significant bits: rounding a value moves
 * it by at most u = 2^-8 ≈ 3.9e-3 relative. With param_dtype bf16 every
 * weight and every unit input (the residual stream at each layer) carries
 * such an error, and the gradients are rounded once more. The errors have
 * random signs, so the loss (an average over tokens of a smooth function)
 * moves by O(u) relative at most, and in practice far less; gradients are
 * products of a few rounded factors per layer, so their relative L2 error
 * is a small multiple of u. Bounds: loss rel ≤ 2u ≈ 7.8e-3, gradients rel
 * L2 ≤ 8u ≈ 3.1e-2 (the worst parameter); measured values are printed. */
#define BF16_U (1.0 / 256.0)
#define BF16_LOSS_TOL (2 * BF16_U)
#define BF16_GRAD_TOL (8 * BF16_U)

static const char *g_fixture;

/* The fixture's batch repeated to 4 rows, so that 4 dp ranks each get one. */
typedef struct batch {
  int64_t B, S, targets;
  int32_t *ids;
  uint8_t *mask;
} batch;

static void batch_make(const fixture *fx, batch *b) {
  b->B = 4;
  b->S = fx->S;
  b->ids = malloc(sizeof(int32_t) * (size_t)(b->B * b->S));
  b->mask = malloc((size_t)(b->B * b->S));
  for (int64_t i = 0; i < b->B; i++) {
    memcpy(b->ids + i * b->S, fx->ids + (i % fx->B) * fx->S, sizeof(int32_t) * (size_t)fx->S);
    memcpy(b->mask + i * b->S, fx->mask + (i % fx->B) * fx->S, (size_t)fx->S);
  }
  b->targets = 0; /* as parity_util counts a fixture's targets */
  for (int64_t i = 0; i < b->B * b->S; i++) b->targets += b->mask[i];
}

static void batch_free(batch *b) {
  free(b->ids);
  free(b->mask);
}

/* One forward/backward of this dp rank's rows of the fixture batch. */
static double step(run *r, const batch *fx) {
  int dp = r->mesh.dp_comm->size, d = r->mesh.dp_comm->rank;
  int64_t Bl = fx->B / dp;
  double loss;
  ml_engine_zero_grad(&r->e);
  if (ml_engine_forward_backward(&r->e, fx->ids + d * Bl * fx->S, fx->mask + d * Bl * fx->S, Bl,
                                 fx->S, fx->targets, &loss))
    fail_msg("step: %s", ml_error_msg());
  return loss;
}

static void train3(run *r, const batch *fx) {
  ml_adamw_cfg adam = {1e-3, 0.9, 0.999, 1e-8, 0.1};
  for (int s = 0; s < 3; s++) {
    double norm;
    step(r, fx);
    if (ml_engine_grad_norm(&r->e, 2.0, &norm)) fail_msg("%s", ml_error_msg());
    ml_engine_clip(&r->e, norm, 1.0);
    if (ml_engine_adamw(&r->e, &adam)) fail_msg("%s", ml_error_msg());
  }
}

/* The worst rel L2 over parameters of a against b (exported tensors);
 * exact: whether every tensor is bitwise equal. */
static double worst_rel(run *ra, run *rb, ml_export_what what, bool *exact) {
  float **a = export_all(ra, what), **b = export_all(rb, what);
  double worst = 0;
  *exact = true;
  for (int i = 0; i < ra->e.model.n_params; i++) {
    const ml_param *p = ml_engine_export_param(&ra->e, i);
    int64_t n = p->shape[0] * p->shape[1];
    worst = fmax(worst, rel_l2(a[i], b[i], n));
    if (memcmp(a[i], b[i], sizeof(float) * (size_t)n)) *exact = false;
  }
  free_all(a, ra->e.model.n_params);
  free_all(b, rb->e.model.n_params);
  return worst;
}

static int64_t calls(ml_comm *c, ml_coll k) { return ml_comm_stats_of(c)->calls[k]; }
static int64_t bytes(ml_comm *c, ml_coll k) { return ml_comm_stats_of(c)->bytes[k]; }

/* Bytes of one all-gather of every unit's flat shard in fp32. */
static int64_t shard_bytes(const run *r) {
  int64_t n = 0;
  for (int u = 0; u < r->e.fsdp.n_units; u++) n += r->e.fsdp.units[u].shard_numel;
  return 4 * n;
}

static void test_hsdp(void **state) {
  (void)state;
  fixture fx;
  fixture_load(g_fixture, &fx);
  batch bt;
  batch_make(&fx, &bt);
  ml_engine_opts o = ml_engine_opts_default();
  run one, fsdp, hsdp, hsdp_tp;
  run_open(&one, MPI_COMM_SELF, 1, 1, &o, fx.dir);
  run_open(&fsdp, MPI_COMM_WORLD, 1, 1, &o, fx.dir);
  run_open(&hsdp, MPI_COMM_WORLD, 2, 1, &o, fx.dir);
  run_open(&hsdp_tp, MPI_COMM_WORLD, 2, 2, &o, fx.dir);
  assert_int_equal(hsdp.mesh.dp_shard, 2);
  assert_int_equal(hsdp_tp.mesh.dp_shard, 1);
  double l1 = step(&one, &bt), lf = step(&fsdp, &bt);
  ml_mesh_stats_reset(&hsdp.mesh);
  double lh = step(&hsdp, &bt), lht = step(&hsdp_tp, &bt);
  if (rank0())
    printf("first-step loss: 1 rank %.17g, FSDP(4) %.17g, HSDP(2x2) %.17g, HSDP(2)xTP(2) %.17g\n",
           l1, lf, lh, lht);
  assert_true(lh == lf); /* bitwise */
  assert_true(fabs(lht - l1) <= 1e-6 * fabs(l1));
  /* the replica all-reduce: one per unit, the whole shard */
  int64_t units = hsdp.e.fsdp.n_units;
  assert_int_equal(calls(hsdp.mesh.dp_replicate_comm, ML_COLL_ALL_REDUCE), units);
  assert_int_equal(bytes(hsdp.mesh.dp_replicate_comm, ML_COLL_ALL_REDUCE), shard_bytes(&hsdp));
  assert_int_equal(calls(hsdp.mesh.dp_shard_comm, ML_COLL_REDUCE_SCATTER), units);
  bool exact;
  double gh = worst_rel(&hsdp, &fsdp, ML_EXPORT_GRADS, &exact);
  double ght = worst_rel(&hsdp_tp, &one, ML_EXPORT_GRADS, &exact);
  if (rank0()) printf("grads: HSDP vs FSDP rel L2 %.3g, HSDPxTP vs 1 rank %.3g\n", gh, ght);
  assert_true(gh <= 1e-5 && ght <= 1e-5);
  /* grad norms: every parameter once, whatever the mesh */
  run *runs[] = {&fsdp, &hsdp, &hsdp_tp};
  for (int t = 0; t < 2; t++) {
    double type = t ? INFINITY : 2.0, ref, got;
    if (ml_engine_grad_norm(&one.e, type, &ref)) fail_msg("%s", ml_error_msg());
    for (int k = 0; k < 3; k++) {
      if (ml_engine_grad_norm(&runs[k]->e, type, &got)) fail_msg("%s", ml_error_msg());
      if (rank0()) printf("grad norm %s: 1 rank %.9g, mesh %d %.9g\n", t ? "inf" : "L2", ref, k, got);
      assert_true(fabs(got - ref) <= 1e-6 * ref);
    }
  }
  train3(&fsdp, &bt);
  train3(&hsdp, &bt);
  double ph = worst_rel(&hsdp, &fsdp, ML_EXPORT_PARAMS, &exact);
  if (rank0()) printf("params after 3 AdamW steps: HSDP vs FSDP rel L2 %.3g\n", ph);
  assert_true(ph <= 1e-5);
  run_close(&hsdp_tp);
  run_close(&hsdp);
  run_close(&fsdp);
  run_close(&one);
  batch_free(&bt);
  fixture_free(&fx);
}

static void test_bf16(void **state) {
  (void)state;
  fixture fx;
  fixture_load(g_fixture, &fx);
  batch bt;
  batch_make(&fx, &bt);
  ml_engine_opts o32 = ml_engine_opts_default(), o16 = o32, o16r = o32;
  o16.fsdp.param_dtype = ML_BF16;
  o16r.fsdp.param_dtype = ML_BF16;
  o16r.fsdp.reduce_dtype = ML_BF16;
  o16r.output_dtype = ML_BF16;
  run a, b, c;
  run_open(&a, MPI_COMM_WORLD, 1, 1, &o32, fx.dir);
  run_open(&b, MPI_COMM_WORLD, 1, 1, &o16, fx.dir);
  run_open(&c, MPI_COMM_WORLD, 1, 1, &o16r, fx.dir);
  run *runs[] = {&a, &b, &c};
  double loss[3];
  for (int k = 0; k < 3; k++) {
    ml_mesh_stats_reset(&runs[k]->mesh);
    loss[k] = step(runs[k], &bt);
  }
  ml_comm *dps[] = {a.mesh.dp_shard_comm, b.mesh.dp_shard_comm, c.mesh.dp_shard_comm};
  int64_t ag32 = bytes(dps[0], ML_COLL_ALL_GATHER), rs32 = bytes(dps[0], ML_COLL_REDUCE_SCATTER);
  if (rank0())
    printf("dp_shard bytes per step: fp32 all-gather %lld, reduce-scatter %lld; bf16 params "
           "all-gather %lld, reduce-scatter %lld; bf16 params + reduce all-gather %lld, "
           "reduce-scatter %lld\n",
           (long long)ag32, (long long)rs32, (long long)bytes(dps[1], ML_COLL_ALL_GATHER),
           (long long)bytes(dps[1], ML_COLL_REDUCE_SCATTER),
           (long long)bytes(dps[2], ML_COLL_ALL_GATHER),
           (long long)bytes(dps[2], ML_COLL_REDUCE_SCATTER));
  assert_int_equal(2 * bytes(dps[1], ML_COLL_ALL_GATHER), ag32);
  assert_int_equal(bytes(dps[1], ML_COLL_REDUCE_SCATTER), rs32);
  assert_int_equal(2 * bytes(dps[2], ML_COLL_ALL_GATHER), ag32);
  assert_int_equal(2 * bytes(dps[2], ML_COLL_REDUCE_SCATTER), rs32);
  for (int k = 1; k < 3; k++) {
    bool exact;
    double lrel = fabs(loss[k] - loss[0]) / fabs(loss[0]);
    double g = worst_rel(runs[k], &a, ML_EXPORT_GRADS, &exact);
    if (rank0())
      printf("%s vs fp32: loss %.9g vs %.9g (rel %.3g, bound %.3g), worst grad rel L2 %.3g "
             "(bound %.3g)\n",
             k == 1 ? "bf16 params" : "bf16 params+reduce+output", loss[k], loss[0], lrel,
             BF16_LOSS_TOL, g, BF16_GRAD_TOL);
    assert_true(lrel <= BF16_LOSS_TOL);
    assert_true(g <= BF16_GRAD_TOL);
    assert_true(lrel > 0); /* the rounding did happen */
  }
  for (int k = 2; k >= 0; k--) run_close(runs[k]);
  batch_free(&bt);
  fixture_free(&fx);
}

static void test_zero(void **state) {
  (void)state;
  fixture fx;
  fixture_load(g_fixture, &fx);
  batch bt;
  batch_make(&fx, &bt);
  run r[3];
  for (int z = 1; z <= 3; z++) {
    ml_engine_opts o = ml_engine_opts_default();
    o.fsdp.zero = z;
    run_open(&r[z - 1], MPI_COMM_WORLD, 1, 2, &o, fx.dir);
  }
  int64_t units = r[2].e.fsdp.n_units;
  for (int z = 1; z <= 3; z++) {
    run *x = &r[z - 1];
    ml_mesh_stats_reset(&x->mesh);
    step(x, &bt);
    ml_comm *dps = x->mesh.dp_shard_comm;
    int64_t ag = calls(dps, ML_COLL_ALL_GATHER), rs = calls(dps, ML_COLL_REDUCE_SCATTER),
            ar = calls(dps, ML_COLL_ALL_REDUCE);
    if (rank0())
      printf("ZeRO-%d step: dp_shard all-gather %lld, reduce-scatter %lld, all-reduce %lld\n", z,
             (long long)ag, (long long)rs, (long long)ar);
    assert_int_equal(ag, z == 3 ? 2 * units - 2 : 0);
    assert_int_equal(rs, z == 1 ? 0 : units);
    assert_int_equal(ar, z == 1 ? units : 0);
  }
  for (int z = 1; z <= 3; z++) train3(&r[z - 1], &bt);
  bool exact2, exact1;
  double d2 = worst_rel(&r[1], &r[2], ML_EXPORT_PARAMS, &exact2);
  double d1 = worst_rel(&r[0], &r[2], ML_EXPORT_PARAMS, &exact1);
  if (rank0())
    printf("params after 3 AdamW steps vs ZeRO-3: ZeRO-2 rel L2 %.3g (bitwise %d), ZeRO-1 %.3g\n",
           d2, exact2, d1);
  assert_true(exact2);
  assert_true(d1 <= 1e-5);
  for (int z = 3; z >= 1; z--) run_close(&r[z - 1]);
  batch_free(&bt);
  fixture_free(&fx);
}

static void test_prefetch_reshard(void **state) {
  (void)state;
  fixture fx;
  fixture_load(g_fixture, &fx);
  batch bt;
  batch_make(&fx, &bt);
  enum { N = 5 };
  ml_engine_opts o[N];
  for (int k = 0; k < N; k++) o[k] = ml_engine_opts_default();
  o[1].fsdp.prefetch_forward = o[1].fsdp.prefetch_backward = 0;
  o[2].fsdp.prefetch_forward = o[2].fsdp.prefetch_backward = 3;
  o[3].fsdp.reshard_after_forward = ML_RESHARD_ALWAYS;
  o[4].fsdp.reshard_after_forward = ML_RESHARD_NEVER;
  const char *what[N] = {"default", "no prefetch", "prefetch 3/3", "reshard always",
                         "reshard never"};
  run r[N];
  double loss[N];
  for (int k = 0; k < N; k++) {
    run_open(&r[k], MPI_COMM_WORLD, 1, 1, &o[k], fx.dir);
    ml_mesh_stats_reset(&r[k].mesh);
    loss[k] = step(&r[k], &bt);
  }
  int64_t units = r[0].e.fsdp.n_units;
  /* forward gathers every unit; backward those resharded after forward:
   * the layers but the last by default, every layer (ALWAYS), none (NEVER) */
  int64_t want_ag[N] = {2 * units - 2, 2 * units - 2, 2 * units - 2, 2 * units - 1, units};
  for (int k = 0; k < N; k++) {
    ml_comm *dps = r[k].mesh.dp_shard_comm;
    int64_t ag = calls(dps, ML_COLL_ALL_GATHER);
    bool exact = true;
    if (k) worst_rel(&r[k], &r[0], ML_EXPORT_GRADS, &exact);
    if (rank0())
      printf("%-14s loss %.17g, all-gathers %lld, comm wait %.3f ms, grads bitwise %d\n", what[k],
             loss[k], (long long)ag, 1e3 * ml_comm_stats_of(dps)->wait_s, exact);
    assert_int_equal(ag, want_ag[k]);
    assert_true(loss[k] == loss[0]);
    assert_true(exact);
  }
  for (int k = N - 1; k >= 0; k--) run_close(&r[k]);
  batch_free(&bt);
  fixture_free(&fx);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int size;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc != 2 || size != 4) {
    fprintf(stderr, "usage: mpiexec -n 4 test_fsdp FIXTURE\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_hsdp),
      cmocka_unit_test(test_bf16),
      cmocka_unit_test(test_zero),
      cmocka_unit_test(test_prefetch_reshard),
  };
  int failed = cmocka_run_group_tests(tests, NULL, NULL);
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any ? 1 : 0;
}
