/* The backend seam's capabilities and its device registry (backend.h):
 *  - ml_be_supports on the cpu and meta backends (every operator), on a
 *    backend that declares one operator less (false, and the call of it
 *    fails naming the backend and the operator instead of reaching the
 *    slot), and for an op outside the enum;
 *  - ml_be_host_memory: the CPU backend's device memory is host memory, the
 *    meta backend's is not;
 *  - the registry: its names (cpu first, NULL-terminated), lookups, what
 *    each device says of itself, the known-names list, ml_backend_get of an
 *    unknown name (the message lists the known ones) and of cuda (a backend
 *    without block attention where it starts, else a message naming it),
 *    and one backend per device whatever the local rank asked with. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "backend/backend.h"
#include "backend/meta/meta.h"
#include "common/status.h"
#include "noblock.h"

static ml_backend *cpu_backend(void) {
  ml_backend *be = NULL;
  if (ml_backend_get("cpu", 0, &be)) fail_msg("cpu backend: %s", ml_error_msg());
  return be;
}

static void expect_error(const char *want) {
  if (!strstr(ml_error_msg(), want))
    fail_msg("expected a message with \"%s\"; got \"%s\"", want, ml_error_msg());
  ml_error_clear();
}

static void test_cpu_and_meta_support_every_op(void **state) {
  ml_backend *cpu = cpu_backend(), *meta = NULL;
  assert_int_equal(ml_backend_meta_create(cpu, &meta), 0);
  for (int op = 0; op < ML_OP_COUNT; op++) {
    assert_true(ml_be_supports(cpu, (ml_op)op));
    assert_true(ml_be_supports(meta, (ml_op)op));
  }
  assert_false(ml_be_supports(cpu, ML_OP_COUNT));
  assert_false(ml_be_supports(cpu, (ml_op)-1));
  assert_true(ml_be_host_memory(cpu));
  assert_false(ml_be_host_memory(meta));
  ml_backend_meta_destroy(meta);
}

/* A backend that declares no block attention: it says so, and the calls
 * fail (or size 0) without reaching its slots (set: the declaration, not
 * the slot, decides). */
static void test_undeclared_op(void **state) {
  ml_backend_ops ops;
  ml_backend fake = noblock_backend(cpu_backend(), &ops);
  assert_false(ml_be_supports(&fake, ML_OP_ATTENTION_BLOCK));
  assert_true(ml_be_supports(&fake, ML_OP_ATTENTION));
  ml_attn_block blk = {.B = 1, .sq = 4, .sk = 4, .nh = 1, .nkv = 1, .hd = 4, .q_bs = 4,
                       .k_bs = 4, .l_bs = 4, .scale = 0.5f};
  assert_int_equal(ml_be_attention_block_work(&fake, &blk), 0);
  ml_error_clear();
  assert_int_equal(ml_be_attention_block_fwd(&fake, &blk, NULL, NULL, NULL, NULL, NULL, false,
                                             ML_F32),
                   -1);
  expect_error("backend 'noblock' does not implement ml_be_attention_block_fwd");
  assert_int_equal(ml_be_attention_block_bwd(&fake, &blk, NULL, NULL, NULL, NULL, NULL, NULL,
                                             NULL, NULL, NULL, ML_F32, NULL),
                   -1);
  expect_error("backend 'noblock' does not implement ml_be_attention_block_bwd");
}

static void test_registry(void **state) {
  const char *const *names = ml_device_names();
  assert_string_equal(names[0], "cpu");
  assert_string_equal(names[1], "cuda");
  assert_null(names[2]);
  assert_string_equal(ml_device_list(), "cpu, cuda");
  assert_int_equal(ml_device_find("cpu"), 0);
  assert_int_equal(ml_device_find("cuda"), 1);
  assert_int_equal(ml_device_find("tpu"), -1);
  assert_int_equal(ml_device_find("CPU"), -1);
  for (int i = 0; names[i]; i++) {
    ml_device_info d = ml_device_at(i);
    assert_string_equal(d.name, names[i]);
    assert_true(d.description && d.description[0]);
  }
  assert_true(ml_device_at(0).available);
#ifdef ML_HAVE_CUDA
  assert_true(ml_device_at(1).available);
#else
  assert_false(ml_device_at(1).available);
#endif
}

static void test_get(void **state) {
  ml_backend *be = NULL, *again = NULL;
  ml_error_clear();
  assert_int_equal(ml_backend_get("tpu", 0, &be), -1);
  expect_error("device 'tpu': unknown; expected one of cpu, cuda");
  /* one CPU backend for the process, whatever the local rank */
  assert_int_equal(ml_backend_get("cpu", 0, &be), 0);
  assert_int_equal(ml_backend_get("cpu", 3, &again), 0);
  assert_ptr_equal(be, again);
  assert_string_equal(be->ops->name, "cpu");
  /* cuda: block attention but no batch-invariant mode, on GPU memory, where
   * a GPU is; else the reason, naming the device */
  if (ml_backend_get("cuda", 0, &be) == 0) {
    assert_false(ml_be_host_memory(be));
    assert_true(ml_be_supports(be, ML_OP_ATTENTION_BLOCK));
    assert_false(ml_be_supports(be, ML_OP_BATCH_INVARIANT));
    assert_true(ml_be_supports(be, ML_OP_GEMM));
  } else {
#ifdef ML_HAVE_CUDA
    expect_error("device 'cuda': ");
#else
    expect_error("device 'cuda': this build has no CUDA backend");
#endif
  }
}

static int release_backends(void **state) {
  ml_backend_release_all();
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cpu_and_meta_support_every_op),
      cmocka_unit_test(test_undeclared_op),
      cmocka_unit_test(test_registry),
      cmocka_unit_test(test_get),
  };
  return cmocka_run_group_tests(tests, NULL, release_backends);
}
