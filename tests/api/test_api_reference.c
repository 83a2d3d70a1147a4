/* test_api_reference: the reference policy in the same session
 * (meshlm_set_reference, meshlm_reference_logprobs) — its log-probs are
 * those of a session opened on the captured weights, bitwise, after the
 * policy trained away from them; the policy is left as it was (its
 * log-probs, and the next step's loss and grad norm, bitwise those of a
 * session that never scored the reference); the reference moves with a
 * second capture; without one the call fails with a message. Under ZeRO-3
 * and ZeRO-2 (persistent unsharded parameters, re-gathered around the
 * swap), fp32 and bf16, with CPU offload. Every comparison is bitwise: the
 * same weights on the same mesh run the same kernels (TOL_EXACT).
 * The suite, its meshes and its helpers: api_util.h. */

#include <stdlib.h>
#include <string.h>

#include "api_util.h"

static void one_step(meshlm_session *s, const gbatch *g, meshlm_step_result *r) {
  *r = (meshlm_step_result){.struct_size = sizeof *r};
  garr a = {0};
  OK(s, step_share(s, g, &a, NULL, r));
}

/* `o`'s policy and a twin that never touches the reference take the same
 * steps; the reference scored between them equals a fresh session's. */
static void check_reference(meshlm_options o) {
  o.lr = 1e-3;
  gbatch g = gbatch_make(53);
  int64_t n = g.all.npred;
  size_t bytes = sizeof(float) * (size_t)n;
  float *init = xcalloc((size_t)n, 4), *ref = xcalloc((size_t)n, 4), *a = xcalloc((size_t)n, 4),
        *b = xcalloc((size_t)n, 4);
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_session *twin = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  global_lp(s, &g, NULL, init);

  expect_fail(s, meshlm_reference_logprobs(s, &(meshlm_seqs){0}, NULL, NULL, NULL),
              "no reference policy", "reference_logprobs before set_reference");
  OK(s, meshlm_set_reference(s)); /* the initial weights */
  meshlm_step_result rs, rt;
  for (int k = 0; k < 2; k++) {
    one_step(s, &g, &rs);
    one_step(twin, &g, &rt);
    global_ref_lp(s, &g, ref);
    assert_memory_equal(ref, init, bytes); /* = the session opened on the initial weights */
    global_lp(s, &g, NULL, a);
    global_lp(twin, &g, NULL, b);
    assert_memory_equal(a, b, bytes);          /* the policy untouched */
    assert_true(memcmp(a, init, bytes) != 0);  /* and it moved away from the reference */
  }
  one_step(s, &g, &rs); /* the optimizer state and weights after the swaps: the twin's */
  one_step(twin, &g, &rt);
  assert_memory_equal(&rs.loss, &rt.loss, sizeof rs.loss);
  assert_memory_equal(&rs.grad_norm, &rt.grad_norm, sizeof rs.grad_norm);

  OK(s, meshlm_set_reference(s)); /* moved: the policy's weights now */
  global_lp(s, &g, NULL, a);
  global_ref_lp(s, &g, ref);
  assert_memory_equal(ref, a, bytes);

  meshlm_close(twin);
  meshlm_close(s);
  free(init);
  free(ref);
  free(a);
  free(b);
  batch_free(&g.all);
}

static void test_reference_zero3(void **state) {
  (void)state;
  check_reference(mesh_opts());
}

static void test_reference_zero2_bf16(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  o.zero = 2;
  o.param_dtype = MESHLM_DTYPE_BF16;
  check_reference(o);
}

static void test_reference_offload(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  o.cpu_offload = 1;
  check_reference(o);
}

int main(int argc, char **argv) {
  api_init(&argc, &argv);
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_reference_zero3),
                                     cmocka_unit_test(test_reference_zero2_bf16),
                                     cmocka_unit_test(test_reference_offload)};
  return api_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
