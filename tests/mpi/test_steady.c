/* A steady-state training step takes no memory from the system (issue 30):
 * `mpiexec -n N test_steady FIXTURE TP`. ml_step_run (the step of the CLI and
 * of the library) with two micro-batches of equal shape per step, in fp32
 * and in bf16 (param_dtype): the first steps allocate the activations,
 * FSDP's unsharded units, the loss's chunks and AdamW's state; from then
 * on the backend's pools serve every request from their cache, so two more
 * steps leave their counts of blocks taken from the system unchanged
 * (ml_memory_stats raw_allocs, host_raw_allocs: pool statistics, not
 * timings). The minor page faults of each step (getrusage ru_minflt) are
 * printed, not asserted: the OpenMP runtime, MPI and the C library touch
 * pages of their own.
 *
 * The grad norm from the partials computed during the last micro-batch's
 * backward (engine/grad_norm.h) against the one pass over the gradients
 * after backward: bitwise (memcmp), L2 and inf, on the same 2-micro-batch
 * steps (so the partials of the first micro-batch's accumulation count),
 * in fp32 with sequence parallelism under tp (Partial norm gradients: their
 * partials after the tp step), in bf16 with frozen parameters, and under
 * cpu_offload (every partial at the end of backward); on 4 ranks the bf16
 * case is HSDP (2 replicas x tp 2). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <mpi.h>
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <sys/resource.h>

#include "engine/step.h"
#include "engine_run.h"
#include "parity_util.h"
#include "train_check.h"

enum { WARM = 2, STEADY = 2, MICRO = 2 };

static const char *g_fixture;
static int g_tp;

/* Every micro-batch of this rank: its dp rank's rows of the batch. */
typedef struct micro {
  const batch *b;
  int64_t rows, row0; /* this rank's rows, its first */
} micro;

static int fill(void *ctx, int64_t m, ml_engine_batch *out) {
  (void)m;
  const micro *mb = ctx;
  int64_t at = mb->row0 * mb->b->S;
  *out = (ml_engine_batch){.ids = mb->b->ids + at, .mask = mb->b->mask + at, .B = mb->rows,
                           .S = mb->b->S};
  return 0;
}

static long minflt(void) {
  struct rusage ru;
  return getrusage(RUSAGE_SELF, &ru) == 0 ? ru.ru_minflt : -1;
}

static void steady(ml_dtype param_dtype) {
  static fixture fx; /* held: static, see held.h */
  fixture_load(g_fixture, &fx);
  int world;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  static batch bt;
  batch_make(&fx, world, &bt);
  ml_engine_opts eo = param_dtype == ML_BF16 ? bf16_engine_opts() : ml_engine_opts_default();
  static run r;
  run_open(&r, MPI_COMM_WORLD, 1, g_tp, &eo, fx.dir);
  int64_t dp = r.mesh.groups[ML_GROUP_DP].size, dp_rank = r.mesh.groups[ML_GROUP_DP].rank;
  micro mb = {&bt, bt.B / dp, dp_rank * (bt.B / dp)};
  ml_step_opts so = {.schedule = {ML_LR_CONSTANT, 1e-3, 0, 0, WARM + STEADY},
                     .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1,
                     .max_grad_norm = 1.0, .norm_type = 2.0};
  ml_step_source src = {.n_micro = MICRO, .fill = fill, .ctx = &mb,
                        .global_targets = MICRO * bt.targets};
  ml_memory_stats warm = {0};
  for (int64_t k = 0; k < WARM + STEADY; k++) {
    if (k == WARM) warm = ml_be_memory_stats(r.e.be);
    long f0 = minflt();
    ml_step_result res;
    if (ml_step_run(&r.e, &so, k, &src, &res))
      fail_msg("step %lld: %s", (long long)k + 1, ml_error_msg());
    if (rank0())
      printf("%s step %lld: loss %.6f, %ld minor page faults\n", ml_dtype_name(param_dtype),
             (long long)k + 1, res.loss, minflt() - f0);
  }
  ml_memory_stats now = ml_be_memory_stats(r.e.be);
  if (rank0())
    printf("%s: pool blocks from the system after step %d: %llu device, %llu host\n",
           ml_dtype_name(param_dtype), WARM, (unsigned long long)warm.raw_allocs,
           (unsigned long long)warm.host_raw_allocs);
  assert_true(warm.raw_allocs > 0);
  assert_int_equal(now.raw_allocs, warm.raw_allocs);
  assert_int_equal(now.host_raw_allocs, warm.host_raw_allocs);
  assert_int_equal(now.reserved, warm.reserved);
  run_close(&r);
  batch_free(&bt);
  fixture_free(&fx);
}

/* A run of the fixture for the norm check: opts, replicas dpr. */
static void norm_check(const ml_engine_opts *eo, int dpr, const char *what) {
  static fixture fx; /* held: static, see held.h */
  fixture_load(g_fixture, &fx);
  int world;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  static batch bt;
  batch_make(&fx, world, &bt);
  static run r;
  run_open(&r, MPI_COMM_WORLD, dpr, g_tp, eo, fx.dir);
  int64_t dp = r.mesh.groups[ML_GROUP_DP].size, dp_rank = r.mesh.groups[ML_GROUP_DP].rank;
  micro mb = {&bt, bt.B / dp, dp_rank * (bt.B / dp)};
  const double types[] = {2.0, INFINITY};
  for (int t = 0; t < 2; t++) {
    ml_step_source src = {.n_micro = MICRO, .fill = fill, .ctx = &mb,
                          .global_targets = MICRO * bt.targets, .norm_type = types[t]};
    ml_step_result res;
    if (ml_engine_zero_grad(&r.e) || ml_step_accumulate(&r.e, &src, &res))
      fail_msg("%s: %s", what, ml_error_msg());
    check_norm_partials(&r, types[t], what);
  }
  run_close(&r);
  batch_free(&bt);
  fixture_free(&fx);
}

static void test_norm_partials(void **state) {
  (void)state;
  int world;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  ml_engine_opts fp32 = ml_engine_opts_default();
  fp32.sequence_parallel = g_tp > 1;
  norm_check(&fp32, 1, "fp32");
  ml_engine_opts bf16 = bf16_engine_opts();
  bf16.freeze = "*.layers.0.mlp.*";
  norm_check(&bf16, world / g_tp >= 2 ? 2 : 1, "bf16, frozen");
  ml_engine_opts off = ml_engine_opts_default();
  off.fsdp.cpu_offload = true;
  norm_check(&off, 1, "cpu_offload");
}

static void test_steady_fp32(void **state) {
  (void)state;
  steady(ML_F32);
}

static void test_steady_bf16(void **state) {
  (void)state;
  steady(ML_BF16);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  if (argc != 3 || atoi(argv[2]) < 1) {
    fprintf(stderr, "usage: mpiexec -n N test_steady FIXTURE TP\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  g_tp = atoi(argv[2]);
  const struct CMUnitTest tests[] = {held_test(test_steady_fp32), held_test(test_steady_bf16),
                                     held_test(test_norm_partials)};
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
