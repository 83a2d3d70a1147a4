/* LR schedule (engine/schedule.h) against torch's LambdaLR driven by the
 * transformers schedule functions named in schedule.h.
 *
 * The table is the output of tools/gen_schedule_fixture.py (torch 2.15,
 * transformers 5.23): for each case, the learning rate the optimizer used
 * at steps k = 0..T-1. Derivation, with N = T - 1 the last step:
 *   warmup k < W:  lr·k/W            e.g. W = 3: 0, lr/3, 2·lr/3
 *   cosine:        min + (lr - min)·½(1 + cos(π (k - W)/(N - W)))
 *                  e.g. lr 1e-3, min 1e-4, W 3, T 10, k 4: p = 1/6,
 *                  ½(1 + cos(π/6)) = 0.9330127, 1e-4 + 9e-4·0.9330127 =
 *                  9.3971143e-4; k = 9 (the last step): p = 1 → min
 *   linear:        min + (lr - min)·(1 - (k - W)/(N - W))
 *                  e.g. k 4: 1e-4 + 9e-4·5/6 = 8.5e-4
 *   constant:      lr after the warmup
 * Values agree to rounding (the references compute lr·factor, the C code
 * min + (lr - min)·f): within tol_schedule_abs(lr), derived in
 * tests/tolerance.h §7 (about 10 double roundings of quantities <= lr on
 * each side). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "tolerance.h"
#include "engine/schedule.h"

enum { MAX_STEPS = 10 };

typedef struct sched_case {
  ml_lr_decay decay;
  double lr, min_lr;
  int64_t warmup, total;
  double want[MAX_STEPS];
} sched_case;

static const sched_case k_cases[] = {
    /* tools/gen_schedule_fixture.py, torch 2.15.0+cu132 */
    /* clang-format off */
    {ML_LR_CONSTANT, 0.001, 0.0, 3, 10,
     {0, 0.00033333333333333332, 0.00066666666666666664,
      0.001, 0.001, 0.001,
      0.001, 0.001, 0.001,
      0.001}},
    {ML_LR_LINEAR, 0.001, 0.0001, 3, 10,
     {0, 0.00033333333333333332, 0.00066666666666666664,
      0.001, 0.00084999999999999995, 0.0007000000000000001,
      0.00055000000000000003, 0.00040000000000000002, 0.00024999999999999995,
      0.0001}},
    {ML_LR_COSINE, 0.001, 0.0001, 3, 10,
     {0, 0.00033333333333333332, 0.00066666666666666664,
      0.001, 0.00093971143170299744, 0.00077500000000000008,
      0.00055000000000000003, 0.00032500000000000015, 0.00016028856829700258,
      0.0001}},
    {ML_LR_COSINE, 0.002, 0.0, 0, 6,
     {0.002, 0.0018090169943749475, 0.0013090169943749475,
      0.00069098300562505266, 0.00019098300562505265, 0}},
    {ML_LR_LINEAR, 0.0005, 0.0, 1, 5,
     {0, 0.00050000000000000001, 0.00033333333333333338,
      0.00016666666666666669, 0}},
    {ML_LR_LINEAR, 0.001, 1e-05, 4, 4,
     {0, 0.00025000000000000001, 0.00050000000000000001,
      0.00075000000000000002}},
    {ML_LR_COSINE, 0.0003, 3e-05, 0, 1,
     {0.00029999999999999997}},
    /* clang-format on */
};

static void test_against_torch(void **state) {
  for (size_t c = 0; c < sizeof k_cases / sizeof *k_cases; c++) {
    const sched_case *k = &k_cases[c];
    ml_lr_schedule s = {k->decay, k->lr, k->min_lr, k->warmup, k->total};
    for (int64_t step = 0; step < k->total; step++) {
      double got = ml_lr_at(&s, step), want = k->want[step];
      if (fabs(got - want) > tol_schedule_abs(k->lr))
        fail_msg("case %zu step %lld: lr %.17g, torch %.17g (bound %.3g)", c, (long long)step, got,
                 want, tol_schedule_abs(k->lr));
    }
  }
}

/* Pure in the step: a resumed run asks for step 7 directly and gets what
 * the uninterrupted run used; past the end the schedule holds. */
static void test_pure_and_past_the_end(void **state) {
  ml_lr_schedule s = {ML_LR_COSINE, 1e-3, 1e-4, 3, 10};
  double first = ml_lr_at(&s, 7);
  for (int64_t k = 0; k < 10; k++) (void)ml_lr_at(&s, k);
  assert_true(ml_lr_at(&s, 7) == first);
  assert_true(ml_lr_at(&s, 9) == 1e-4);
  assert_true(ml_lr_at(&s, 25) == 1e-4);
  s.decay = ML_LR_LINEAR;
  assert_true(ml_lr_at(&s, 25) == 1e-4);
  s.decay = ML_LR_CONSTANT;
  assert_true(ml_lr_at(&s, 25) == 1e-3);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_against_torch),
      cmocka_unit_test(test_pure_and_past_the_end),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
