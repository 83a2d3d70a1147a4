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
 * pages of their own. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <mpi.h>
#include <stdio.h>
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
  const struct CMUnitTest tests[] = {held_test(test_steady_fp32), held_test(test_steady_bf16)};
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
