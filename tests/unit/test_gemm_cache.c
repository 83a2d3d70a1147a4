/* oneDNN's process-wide primitive cache under the CPU backend
 * (backend/cpu/gemm.c, ml_cpu_gemm_onednn_cache_bound): creating the
 * backend bounds it at ML_CPU_GEMM_ONEDNN_CACHE entries (oneDNN's default,
 * 1024, let a run whose GEMM shapes follow the data grow by a primitive per
 * new shape), and a capacity the environment sets is left as the user set
 * it. */
#include <oneapi/dnnl/dnnl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>  // after the headers it needs

#include "backend/cpu/cpu.h"

static int capacity(void) {
  int c = -1;
  assert_int_equal(dnnl_get_primitive_cache_capacity(&c), dnnl_success);
  return c;
}

static void test_bounded(void **state) {
  assert_int_equal(dnnl_set_primitive_cache_capacity(1024), dnnl_success); /* oneDNN's default */
  ml_backend *be = NULL;
  assert_int_equal(ml_backend_cpu_create(&be), 0);
  assert_int_equal(capacity(), ML_CPU_GEMM_ONEDNN_CACHE);
  be->ops->destroy(be);
}

static void test_user_setting_stands(void **state) {
  assert_int_equal(dnnl_set_primitive_cache_capacity(7), dnnl_success); /* as the env would */
  assert_int_equal(setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7", 1), 0);
  assert_int_equal(ml_cpu_gemm_onednn_cache_bound(), 0);
  assert_int_equal(capacity(), 7);
  assert_int_equal(unsetenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY"), 0);
  assert_int_equal(ml_cpu_gemm_onednn_cache_bound(), 0);
  assert_int_equal(capacity(), ML_CPU_GEMM_ONEDNN_CACHE);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bounded),
      cmocka_unit_test(test_user_setting_stands),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
