/* FSDP2 semantics on 4 ranks: `mpiexec -n 4 test_fsdp FIXTURE [TP]`, TP (default 2) the
 * tensor-parallel size of the runs below that use one (1 for a mixture-of-experts fixture, whose
 * tp runs tests/mpi/CMakeLists.txt's parity_*_tp2 cover).
 *  - HSDP: dp_replicate=2 × dp_shard=2 against FSDP over 4 ranks (first-step
 *    loss and gradients within the pair bounds of tests/tolerance.h §3: the
 *    vocab-parallel loss splits each softmax sum over FSDP's group, 2 blocks
 *    against 4), also with tp=TP; grad norms (L2 and inf) against the same
 *    run's gradients and against one rank (§6); the replica all-reduce per
 *    unit and of the vocab rows; 3 AdamW steps of FSDP and HSDP each checked
 *    against AdamW in double (§5), then HSDP against one rank on its
 *    parameters.
 *  - Mixed precision: the units' bf16 all-gathers move exactly half the
 *    bytes of fp32, bf16 gradient reduction half their reduce-scatter bytes
 *    (the token path of vocab parallelism, parallel/vocab.h, moves ids and
 *    fp32 activations either way); loss and gradients within the bf16
 *    bounds of §4.
 *  - ZeRO-1/2 against ZeRO-3: ZeRO-2 bitwise after 3 AdamW steps (the same
 *    reduce-scatter and update), ZeRO-1 (all-reduce, another sum order)
 *    step by step against AdamW in double and then against one rank on its
 *    parameters; what each gathers per step (the vocab rows under none).
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
#include "train_check.h"

static const char *g_fixture;
static int g_tp = 2; /* the tp size of the runs with tensor parallelism */

static const ml_adamw_cfg k_adam = {1e-3, 0.9, 0.999, 1e-8, 0.1};

/* Three AdamW steps, each checked (train_check.h). */
static void train3(run *r, const batch *b) {
  double worst = 0;
  for (int s = 0; s < 3; s++) checked_step(r, b, &k_adam, 1.0, &worst);
  if (rank0()) printf("3 AdamW steps: worst error/bound vs AdamW in double %.3g\n", worst);
}

static int64_t calls(ml_comm *c, ml_coll k) { return ml_comm_stats_of(c)->calls[k]; }
static int64_t bytes(ml_comm *c, ml_coll k) { return ml_comm_stats_of(c)->bytes[k]; }

/* Bytes of one all-gather of a unit's fp32 part (engine/fp32_params.h: the
 * MoE routers stay fp32 under param_dtype bf16, each sparse layer's unit
 * gathering its router's chunks in a call of its own, parallel/fsdp.h),
 * the same for every unit that has one (the routers' shapes are one); 0
 * without. */
static int64_t fp32_part_bytes(const run *r) {
  int64_t n = 0;
  for (int u = 0; u < r->e.fsdp.n_units; u++) {
    int64_t k = r->e.fsdp.units[u].f32_numel;
    if (k && n && k != n) fail_msg("fp32 parts of %lld and %lld elements", (long long)n,
                                   (long long)k);
    n = k ? k : n;
  }
  return 4 * n * r->mesh.groups[ML_GROUP_DP_SHARD_CP].size;
}

/* Bytes of one all-gather of every unit's flat shard in fp32. */
static int64_t shard_bytes(const run *r) {
  int64_t n = 0;
  for (int u = 0; u < r->e.fsdp.n_units; u++) n += r->e.fsdp.units[u].shard_numel;
  return 4 * n;
}

/* What vocab parallelism (parallel/vocab.h) moves over dp_shard_cp in one
 * micro-batch of b split over the data-parallel ranks, fs = the group's
 * ranks, Tl = each one's tokens: all-gathers of the ids with their targets
 * (2·Tl int32 words), lm_head's input and the embedding's output gradient
 * (Tl·H fp32 each); reduce-scatters of the embedding's lookup and lm_head's
 * input gradient (Tl·H fp32 each); the counting comm's fs × that. */
static int64_t vocab_bytes(const run *r, const batch *b, ml_coll k) {
  int64_t fs = r->mesh.groups[ML_GROUP_DP_SHARD_CP].size, H = r->e.model.cfg.hidden;
  int64_t Tl = b->B / r->mesh.groups[ML_GROUP_DP].size * b->S;
  assert_true(r->e.fsdp.vocab_parallel);
  return k == ML_COLL_ALL_GATHER ? 4 * fs * (2 * Tl + 2 * Tl * H) : 4 * fs * 2 * Tl * H;
}

static void test_hsdp(void **state) {
  (void)state;
  static fixture fx; /* held: static, see held.h */
  fixture_load(g_fixture, &fx);
  static batch bt;
  batch_make(&fx, 4, &bt);
  ml_engine_opts o = ml_engine_opts_default();
  static run one, fsdp, hsdp, hsdp_tp;
  run_open(&one, MPI_COMM_SELF, 1, 1, &o, fx.dir);
  run_open(&fsdp, MPI_COMM_WORLD, 1, 1, &o, fx.dir);
  run_open(&hsdp, MPI_COMM_WORLD, 2, 1, &o, fx.dir);
  run_open(&hsdp_tp, MPI_COMM_WORLD, 2, g_tp, &o, fx.dir);
  assert_int_equal(hsdp.mesh.dp_shard, 2);
  assert_int_equal(hsdp_tp.mesh.dp_shard, 2 / g_tp);
  double l1 = step_rows(&one, &bt), lf = step_rows(&fsdp, &bt);
  ml_mesh_stats_reset(&hsdp.mesh);
  double lh = step_rows(&hsdp, &bt), lht = step_rows(&hsdp_tp, &bt);
  tol_model tm = tol_model_of(&one, bt.S, bt.B * bt.S);
  double tl = tol_model_pair(&tm, TOL_LOSS), tg = tol_model_pair(&tm, TOL_GRADS);
  if (rank0())
    printf(
        "first-step loss: 1 rank %.17g, FSDP(4) %.17g, HSDP(2x2) %.17g, HSDP(2)xTP(%d) %.17g "
        "(rel HSDP vs FSDP %.3g, HSDPxTP vs 1 rank %.3g, bound %.3g)\n",
        l1, lf, lh, g_tp, lht, fabs(lh - lf) / fabs(lf), fabs(lht - l1) / fabs(l1), tl);
  /* two fp32 evaluations in different orders: each token's softmax sums
   * run over the vocab blocks of FSDP's group, 4 on FSDP, 2 on HSDP */
  assert_true(fabs(lh - lf) <= tl * fabs(lf));
  assert_true(fabs(lht - l1) <= tl * fabs(l1));
  /* the replica all-reduce: one per unit, and one of the root's vocab rows (complete on
   * each rank, reduced apart): the whole shard */
  int64_t units = hsdp.e.fsdp.n_units;
  ml_comm *rep = ml_mesh_comm(&hsdp.mesh, ML_GROUP_DP_REPLICATE);
  assert_int_equal(calls(rep, ML_COLL_ALL_REDUCE), units + 1);
  assert_int_equal(bytes(rep, ML_COLL_ALL_REDUCE), shard_bytes(&hsdp));
  /* the units' and vocab parallelism's two */
  assert_int_equal(calls(ml_mesh_comm(&hsdp.mesh, ML_GROUP_DP_SHARD_CP), ML_COLL_REDUCE_SCATTER),
                   units + 2);
  bool exact;
  double gh = worst_rel(&hsdp, &fsdp, ML_EXPORT_GRADS, &exact);
  double ght = worst_rel(&hsdp_tp, &one, ML_EXPORT_GRADS, &exact);
  if (rank0())
    printf("grads: HSDP vs FSDP rel L2 %.3g, HSDPxTP vs 1 rank %.3g (bound %.3g)\n", gh, ght, tg);
  assert_true(gh <= tg && ght <= tg);
  /* grad norms: every parameter once, whatever the mesh */
  run *const runs[] = {&fsdp, &hsdp, &hsdp_tp};
  check_norms(&one, runs, 3);
  train3(&fsdp, &bt);
  train3(&hsdp, &bt);
  check_replay_one_rank(&hsdp, &bt);
  run_close(&hsdp_tp);
  run_close(&hsdp);
  run_close(&fsdp);
  run_close(&one);
  batch_free(&bt);
  fixture_free(&fx);
}

static void test_bf16(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch bt;
  batch_make(&fx, 4, &bt);
  ml_engine_opts o32 = ml_engine_opts_default(), o16 = o32, o16r = o32;
  o16.fsdp.param_dtype = ML_BF16;
  o16r.fsdp.param_dtype = ML_BF16;
  o16r.fsdp.reduce_dtype = ML_BF16;
  o16r.output_dtype = ML_BF16;
  static run a, b, c, d;
  run_open(&a, MPI_COMM_WORLD, 1, 1, &o32, fx.dir);
  run_open(&b, MPI_COMM_WORLD, 1, 1, &o16, fx.dir);
  run_open(&c, MPI_COMM_WORLD, 1, 1, &o16r, fx.dir);
  run_open(&d, MPI_COMM_WORLD, 2, 1, &o16r, fx.dir); /* HSDP: bf16 replica all-reduces too */
  run *runs[] = {&a, &b, &c, &d};
  const char *what[] = {"fp32", "bf16 params", "bf16 params+reduce+output",
                        "HSDP(2x2) bf16 params+reduce+output"};
  double loss[4];
  for (int k = 0; k < 4; k++) {
    ml_mesh_stats_reset(&runs[k]->mesh);
    loss[k] = step_rows(runs[k], &bt);
  }
  ml_comm *dps[] = {ml_mesh_comm(&a.mesh, ML_GROUP_DP_SHARD_CP),
                    ml_mesh_comm(&b.mesh, ML_GROUP_DP_SHARD_CP),
                    ml_mesh_comm(&c.mesh, ML_GROUP_DP_SHARD_CP)};
  int64_t ag32 = bytes(dps[0], ML_COLL_ALL_GATHER), rs32 = bytes(dps[0], ML_COLL_REDUCE_SCATTER);
  if (rank0())
    printf("dp_shard bytes per step: fp32 all-gather %lld, reduce-scatter %lld; bf16 params "
           "all-gather %lld, reduce-scatter %lld; bf16 params + reduce all-gather %lld, "
           "reduce-scatter %lld\n",
           (long long)ag32, (long long)rs32, (long long)bytes(dps[1], ML_COLL_ALL_GATHER),
           (long long)bytes(dps[1], ML_COLL_REDUCE_SCATTER),
           (long long)bytes(dps[2], ML_COLL_ALL_GATHER),
           (long long)bytes(dps[2], ML_COLL_REDUCE_SCATTER));
  /* the units' parts halve, but for their fp32 parts (the routers), gathered in calls of their
   * own at 4 B an element: twice a unit's bf16 gather, 2·dp·(2(g − f) + 4f), is its fp32 gather,
   * 4·dp·g, plus one fp32-part call's bytes 4·dp·f; the token path does not depend on the
   * dtypes */
  int64_t vag = vocab_bytes(&a, &bt, ML_COLL_ALL_GATHER);
  int64_t vrs = vocab_bytes(&a, &bt, ML_COLL_REDUCE_SCATTER);
  int64_t b32 = fp32_part_bytes(&b), ag_calls = ml_comm_stats_of(dps[0])->calls[ML_COLL_ALL_GATHER];
  for (int k = 1; k <= 2; k++) {
    int64_t extra = ml_comm_stats_of(dps[k])->calls[ML_COLL_ALL_GATHER] - ag_calls;
    assert_true(b32 > 0 || extra == 0);
    assert_int_equal(2 * (bytes(dps[k], ML_COLL_ALL_GATHER) - vag), ag32 - vag + extra * b32);
  }
  assert_int_equal(bytes(dps[1], ML_COLL_REDUCE_SCATTER), rs32);
  assert_int_equal(2 * (bytes(dps[2], ML_COLL_REDUCE_SCATTER) - vrs), rs32 - vrs);
  tol_model tm = tol_model_of(&a, bt.S, bt.B * bt.S);
  for (int k = 1; k < 4; k++) {
    bool exact;
    /* bf16 reduction: one rounding per hop of the dp_shard reduce-scatter
     * and of the replicas' all-reduce (the vocab rows' gradient, complete
     * on each rank: one, then the replicas' hops); output_dtype bf16: the
     * logits once */
    bool r16 = k >= 2;
    double hops = r16 ? runs[k]->mesh.dp_shard - 1 + runs[k]->mesh.dp_replicate - 1 : 0;
    double tl = tol_bf16(&tm, TOL_LOSS, 0, r16), tg = tol_bf16(&tm, TOL_GRADS, hops, r16);
    double lrel = fabs(loss[k] - loss[0]) / fabs(loss[0]);
    double g = worst_rel(runs[k], &a, ML_EXPORT_GRADS, &exact);
    if (rank0())
      printf(
          "%s vs fp32: loss %.9g vs %.9g (rel %.3g, bound %.3g), worst grad rel L2 %.3g "
          "(bound %.3g)\n",
          what[k], loss[k], loss[0], lrel, tl, g, tg);
    assert_true(lrel <= tl);
    assert_true(g <= tg);
    assert_true(lrel > 0); /* the rounding did happen */
  }
  for (int k = 3; k >= 0; k--) run_close(runs[k]);
  batch_free(&bt);
  fixture_free(&fx);
}

static void test_zero(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch bt;
  batch_make(&fx, 4, &bt);
  static run r[3];
  for (int z = 1; z <= 3; z++) {
    ml_engine_opts o = ml_engine_opts_default();
    o.fsdp.zero = z;
    run_open(&r[z - 1], MPI_COMM_WORLD, 1, g_tp, &o, fx.dir);
  }
  int64_t units = r[2].e.fsdp.n_units;
  for (int z = 1; z <= 3; z++) {
    run *x = &r[z - 1];
    ml_mesh_stats_reset(&x->mesh);
    step_rows(x, &bt);
    ml_comm *dps = ml_mesh_comm(&x->mesh, ML_GROUP_DP_SHARD_CP);
    int64_t ag = calls(dps, ML_COLL_ALL_GATHER), rs = calls(dps, ML_COLL_REDUCE_SCATTER),
            ar = calls(dps, ML_COLL_ALL_REDUCE);
    if (rank0())
      printf("ZeRO-%d step: dp_shard all-gather %lld, reduce-scatter %lld, all-reduce %lld\n", z,
             (long long)ag, (long long)rs, (long long)ar);
    /* the units', then vocab parallelism's: all-gathers of the tokens, lm_head's input and
     * the embedding's gradient, reduce-scatters of the lookup and lm_head's input gradient,
     * the loss's two all-reduces (one logits chunk) */
    assert_int_equal(ag, (z == 3 ? 2 * units - 2 : 0) + 3);
    assert_int_equal(rs, (z == 1 ? 0 : units) + 2);
    assert_int_equal(ar, (z == 1 ? units : 0) + 2);
  }
  for (int z = 1; z <= 3; z++) train3(&r[z - 1], &bt);
  bool exact2;
  double d2 = worst_rel(&r[1], &r[2], ML_EXPORT_PARAMS, &exact2);
  if (rank0())
    printf("params after 3 AdamW steps vs ZeRO-3: ZeRO-2 rel L2 %.3g (bitwise %d)\n", d2, exact2);
  /* bitwise (TOL_EXACT): ZeRO-2 reduce-scatters like ZeRO-3 and updates the
   * same shards; its persistent unsharded copy is the all-gather ZeRO-3
   * repeats, so every step computes on the same values */
  assert_true(exact2);
  /* the same with bf16 parameters, where ZeRO-2 keeps the bf16 copies (the
   * gathered units and the vocab rows) between steps: rounded again from
   * the updated shards after each step, never stale */
  static run h[2];
  for (int k = 0; k < 2; k++) {
    ml_engine_opts o = ml_engine_opts_default();
    o.fsdp.zero = 2 + k;
    o.fsdp.param_dtype = ML_BF16;
    run_open(&h[k], MPI_COMM_WORLD, 1, g_tp, &o, fx.dir);
    train3(&h[k], &bt);
  }
  bool exact16;
  double d16 = worst_rel(&h[0], &h[1], ML_EXPORT_PARAMS, &exact16);
  if (rank0())
    printf("bf16 params after 3 AdamW steps: ZeRO-2 vs ZeRO-3 rel L2 %.3g (bitwise %d)\n", d16,
           exact16);
  assert_true(exact16);
  for (int k = 1; k >= 0; k--) run_close(&h[k]);
  /* ZeRO-1 sums in another order (all-reduce), so only each step's update
   * (train3) and its unsharded copy (here) can be checked */
  check_replay_one_rank(&r[0], &bt);
  for (int z = 3; z >= 1; z--) run_close(&r[z - 1]);
  batch_free(&bt);
  fixture_free(&fx);
}

static void test_prefetch_reshard(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch bt;
  batch_make(&fx, 4, &bt);
  enum { N = 5 };
  ml_engine_opts o[N];
  for (int k = 0; k < N; k++) o[k] = ml_engine_opts_default();
  o[1].fsdp.prefetch_forward = o[1].fsdp.prefetch_backward = 0;
  o[2].fsdp.prefetch_forward = o[2].fsdp.prefetch_backward = 3;
  o[3].fsdp.reshard_after_forward = ML_RESHARD_ALWAYS;
  o[4].fsdp.reshard_after_forward = ML_RESHARD_NEVER;
  const char *what[N] = {"default", "no prefetch", "prefetch 3/3", "reshard always",
                         "reshard never"};
  static run r[N];
  double loss[N];
  for (int k = 0; k < N; k++) {
    run_open(&r[k], MPI_COMM_WORLD, 1, 1, &o[k], fx.dir);
    ml_mesh_stats_reset(&r[k].mesh);
    loss[k] = step_rows(&r[k], &bt);
  }
  int64_t units = r[0].e.fsdp.n_units;
  /* forward gathers every unit; backward those resharded after forward:
   * the layers but the last by default, every layer (ALWAYS), none (NEVER);
   * vocab parallelism's 3 (tokens, lm_head's input, the embedding's
   * gradient) under every policy */
  int64_t want_ag[N] = {2 * units + 1, 2 * units + 1, 2 * units + 1, 2 * units + 2, units + 3};
  for (int k = 0; k < N; k++) {
    ml_comm *dps = ml_mesh_comm(&r[k].mesh, ML_GROUP_DP_SHARD_CP);
    int64_t ag = calls(dps, ML_COLL_ALL_GATHER);
    bool exact = true;
    if (k) worst_rel(&r[k], &r[0], ML_EXPORT_GRADS, &exact);
    if (rank0())
      printf("%-14s loss %.17g, all-gathers %lld, comm wait %.3f ms, grads bitwise %d\n", what[k],
             loss[k], (long long)ag, 1e3 * ml_comm_stats_of(dps)->wait_s, exact);
    assert_int_equal(ag, want_ag[k]);
    /* bitwise (TOL_EXACT): a policy moves the all-gathers in time; the
     * gathered values and every kernel's inputs and order stay the same */
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
  g_tp = argc == 3 ? atoi(argv[2]) : 2;
  if (argc < 2 || argc > 3 || size != 4 || (g_tp != 1 && g_tp != 2)) {
    fprintf(stderr, "usage: mpiexec -n 4 test_fsdp FIXTURE [TP: 1 or 2]\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  const struct CMUnitTest tests[] = {
      held_test(test_hsdp),
      held_test(test_bf16),
      held_test(test_zero),
      held_test(test_prefetch_reshard),
  };
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
