/* Which GPUs a build has code for (backend/cuda_arch.h, issue 27): the CUDA
 * backend refuses a device whose compute capability CMAKE_CUDA_ARCHITECTURES
 * does not cover, rather than failing at its first kernel launch. Plain C,
 * so it runs without a GPU. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "backend/cuda_arch.h"
#include "common/status.h"

static void test_default_sm90(void **state) {
  /* "90" is SASS sm_90 plus PTX compute_90: H100/H200 (9.0) and, by PTX, newer chips */
  assert_int_equal(ml_cuda_arch_covers("90", 9, 0), 1);
  assert_int_equal(ml_cuda_arch_covers("90", 10, 0), 1);
  assert_int_equal(ml_cuda_arch_covers("90", 12, 0), 1);
  assert_int_equal(ml_cuda_arch_covers("90", 8, 0), 0); /* A100 */
  assert_int_equal(ml_cuda_arch_covers("90", 8, 9), 0); /* L4, RTX 40xx */
}

static void test_real_and_virtual(void **state) {
  /* SASS alone: the same major, a minor not above the device's */
  assert_int_equal(ml_cuda_arch_covers("90-real", 9, 0), 1);
  assert_int_equal(ml_cuda_arch_covers("90-real", 10, 0), 0);
  assert_int_equal(ml_cuda_arch_covers("86-real", 8, 9), 1);
  assert_int_equal(ml_cuda_arch_covers("86-real", 8, 0), 0);
  /* PTX alone: any capability at or above it */
  assert_int_equal(ml_cuda_arch_covers("80-virtual", 9, 0), 1);
  assert_int_equal(ml_cuda_arch_covers("80-virtual", 7, 5), 0);
  /* a list: any entry */
  assert_int_equal(ml_cuda_arch_covers("80-real,90-real", 8, 0), 1);
  assert_int_equal(ml_cuda_arch_covers("80-real,90-real", 9, 0), 1);
  assert_int_equal(ml_cuda_arch_covers("80-real,90-real", 10, 0), 0);
  assert_int_equal(ml_cuda_arch_covers("all", 7, 0), 1);
  assert_int_equal(ml_cuda_arch_covers("all-major", 12, 0), 1);
}

static void test_variants(void **state) {
  /* arch-specific (a): that capability only, and never as PTX for a newer one */
  assert_int_equal(ml_cuda_arch_covers("90a", 9, 0), 1);
  assert_int_equal(ml_cuda_arch_covers("90a", 10, 0), 0);
  assert_int_equal(ml_cuda_arch_covers("100a-real", 10, 3), 0);
  /* family-specific (f): the family's later minors */
  assert_int_equal(ml_cuda_arch_covers("100f", 10, 3), 1);
  assert_int_equal(ml_cuda_arch_covers("100f", 12, 0), 0);
}

static void test_unreadable(void **state) {
  const char *lists[] = {"sm_90", "90-fake", "9", "90,native", "90b"};
  for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++) {
    ml_error_clear();
    assert_int_equal(ml_cuda_arch_covers(lists[i], 9, 0), -1);
    assert_non_null(strstr(ml_error_msg(), "cannot read the entry"));
    assert_non_null(strstr(ml_error_msg(), lists[i]));
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_default_sm90),
      cmocka_unit_test(test_real_and_virtual),
      cmocka_unit_test(test_variants),
      cmocka_unit_test(test_unreadable),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
