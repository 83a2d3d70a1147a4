/* test_api_basics: meshlm_version, the three *_default functions,
 * meshlm_error(NULL), open and open_f, meshlm_get_info and the weight
 * table against config.json and the fixture's safetensors; open errors
 * (missing dir, NULL dir, tp not dividing the world, bad dtypes, device,
 * micro_batch_tokens, and on four ranks a bad option on one rank only)
 * each −1 with a session whose message names the field and that closes.
 * The suite, its meshes and its helpers: api_util.h. */

#include <stdio.h>
#include <string.h>

#include "api_util.h"

static void test_version_defaults(void **state) {
  (void)state;
  char want[64];
  snprintf(want, sizeof want, "%d.%d.%d", MESHLM_VERSION_MAJOR, MESHLM_VERSION_MINOR,
           MESHLM_VERSION_PATCH);
  assert_string_equal(meshlm_version(), want);

  meshlm_options o;
  memset(&o, 0xA5, sizeof o);
  meshlm_options_default(&o);
  assert_int_equal(o.dp_replicate, 1);
  assert_int_equal(o.cp, 1);
  assert_int_equal(o.tp, 1);
  assert_string_equal(o.device, "cpu");
  assert_true(o.parallel_plan == NULL || strcmp(o.parallel_plan, "auto") == 0);
  assert_int_equal(o.sequence_parallel, 0);
  assert_int_equal(o.param_dtype, MESHLM_DTYPE_F32);
  assert_int_equal(o.reduce_dtype, MESHLM_DTYPE_F32);
  assert_int_equal(o.ac, MESHLM_AC_NONE);
  /* the documented literals, compared exactly (the same double constants) */
  assert_true(o.lr == 1e-5 && o.min_lr == 0.0 && o.beta1 == 0.9 && o.beta2 == 0.999);
  assert_true(o.eps == 1e-8 && o.weight_decay == 0.01 && o.max_grad_norm == 1.0);
  assert_int_equal(o.schedule, MESHLM_LR_CONSTANT);
  assert_int_equal(o.warmup_steps, 0);
  assert_int_equal(o.total_steps, 1);
  assert_int_equal(o.micro_batch_tokens, 4096);
  assert_int_equal(o.unshard_for_inference, 1);
  assert_int_equal(o.output_dtype, MESHLM_DTYPE_F32);
  assert_int_equal(o.reshard_after_forward, MESHLM_RESHARD_DEFAULT);
  assert_int_equal(o.zero, 3);
  assert_int_equal(o.prefetch_forward, 1);
  assert_int_equal(o.prefetch_backward, 2);
  assert_true(o.grad_norm_type == 2.0);

  meshlm_loss l;
  memset(&l, 0xA5, sizeof l);
  meshlm_loss_default(&l);
  assert_int_equal(l.kind, MESHLM_LOSS_NLL);
  assert_int_equal(l.sequence_level, 0);
  assert_true(l.ratio_clip_min == 0.2f && l.ratio_clip_max == 0.2f);
  assert_true(l.ratio_clip_c == 0.0f && l.kl_penalty == 0.0f);

  meshlm_sampling sp;
  memset(&sp, 0xA5, sizeof sp);
  meshlm_sampling_default(&sp);
  assert_int_equal(sp.max_new_tokens, 32);
  assert_true(sp.temperature == 1.0f && sp.top_p == 1.0f);
  assert_int_equal(sp.greedy, 0);
  assert_int_equal(sp.eos_token_id, -1);
  assert_int_equal(sp.seed, 0);

  assert_non_null(meshlm_error(NULL));
  meshlm_close(NULL); /* s may be NULL */
}

/* meshlm_open fails: −1, a session that names `needle` and that closes. */
static void expect_open_fails(const char *dir, const meshlm_options *o, const char *needle,
                              const char *what) {
  meshlm_session *s = NULL;
  int rc = meshlm_open(dir, o, MPI_COMM_WORLD, &s);
  if (!s) fail_msg("%s: meshlm_open handed out no session", what);
  expect_fail(s, rc, needle, what);
  meshlm_info in;
  assert_int_equal(meshlm_get_info(s, &in), -1);
  meshlm_close(s);
}

static void test_open_errors(void **state) {
  (void)state;
  char missing[4200];
  tmp_path(missing, sizeof missing, "no_such_model");
  meshlm_options o;
  meshlm_options_default(&o);
  expect_open_fails(missing, &o, "no_such_model", "a missing model directory");
  expect_open_fails(NULL, &o, "model_dir", "model_dir NULL");

  o.tp = g_world == 1 ? 2 : 3; /* divides neither 1 nor 4 */
  expect_open_fails(g_fixture, &o, "tp", "tp not dividing the world");
  meshlm_options_default(&o);
  o.tp = 0;
  expect_open_fails(g_fixture, &o, "tp", "tp 0");

  meshlm_options_default(&o);
  o.param_dtype = (meshlm_dtype)7;
  expect_open_fails(g_fixture, &o, "param_dtype", "param_dtype 7");
  meshlm_options_default(&o);
  o.reduce_dtype = MESHLM_DTYPE_SOURCE;
  expect_open_fails(g_fixture, &o, "reduce_dtype", "reduce_dtype SOURCE");

  meshlm_options_default(&o);
  o.device = "tpu";
  expect_open_fails(g_fixture, &o, "device", "device tpu");
  o.device = NULL;
  expect_open_fails(g_fixture, &o, "device", "device NULL");

  meshlm_options_default(&o);
  o.zero = 4;
  expect_open_fails(g_fixture, &o, "zero", "zero 4");
  meshlm_options_default(&o);
  o.grad_norm_type = 1.0;
  expect_open_fails(g_fixture, &o, "grad_norm_type", "grad_norm_type 1");
  meshlm_options_default(&o);
  o.output_dtype = MESHLM_DTYPE_SOURCE;
  expect_open_fails(g_fixture, &o, "output_dtype", "output_dtype SOURCE");

  meshlm_options_default(&o);
  o.micro_batch_tokens = 0;
  expect_open_fails(g_fixture, &o, "micro_batch_tokens", "micro_batch_tokens 0");
  o.micro_batch_tokens = -5;
  expect_open_fails(g_fixture, &o, "micro_batch_tokens", "micro_batch_tokens -5");

  /* one rank's option only: every rank fails with its message */
  meshlm_options_default(&o);
  if (g_rank == g_world - 1) o.micro_batch_tokens = 0;
  expect_open_fails(g_fixture, &o, "micro_batch_tokens", "micro_batch_tokens 0 on one rank");
}

/* The fixture's tensors against meshlm_weight_info: the same names (the
 * untied Llama trains every tensor), shapes, and its dtype. */
static void check_weight_table(meshlm_session *s, int64_t *params) {
  char path[4200];
  snprintf(path, sizeof path, "%s/model.safetensors", g_fixture);
  st_file f;
  st_open(path, &f);
  int64_t n = meshlm_num_weights(s), in_file = 0;
  const char *key;
  json_t *val;
  json_object_foreach(f.hdr, key, val) in_file += strcmp(key, "__metadata__") != 0;
  assert_int_equal(n, in_file);
  *params = 0;
  for (int64_t i = 0; i < n; i++) {
    meshlm_weight w;
    OK(s, meshlm_weight_info(s, i, &w));
    const char *dt;
    int nd;
    int64_t sh[2];
    size_t nb;
    if (!st_tensor(&f, w.name, &dt, &nd, sh, &nb))
      fail_msg("weight %lld '%s' is not in the fixture", (long long)i, w.name);
    assert_int_equal(w.ndim, nd);
    assert_int_equal(w.shape[0], sh[0]);
    if (nd == 2) assert_int_equal(w.shape[1], sh[1]);
    assert_int_equal(w.dtype, strcmp(dt, "BF16") == 0 ? MESHLM_DTYPE_BF16 : MESHLM_DTYPE_F32);
    *params += numel(&w);
  }
  st_close(&f);
  meshlm_weight w;
  expect_fail(s, meshlm_weight_info(s, n, &w), "index", "meshlm_weight_info(n)");
  expect_fail(s, meshlm_weight_info(s, -1, &w), "index", "meshlm_weight_info(-1)");
}

static void test_open_info(void **state) {
  (void)state;
  /* NULL options: one rank's mesh, 1 × world × 1 × 1 */
  meshlm_session *s = open_ok(g_fixture, NULL, MPI_COMM_WORLD);
  meshlm_info in = info_of(s);
  assert_int_equal(in.rank, g_rank);
  assert_int_equal(in.world, g_world);
  assert_int_equal(in.dp_replicate, 1);
  assert_int_equal(in.dp_shard, g_world);
  assert_int_equal(in.cp, 1);
  assert_int_equal(in.tp, 1);
  assert_int_equal(in.dp_rank, g_rank);
  assert_int_equal(in.dp_size, g_world);
  assert_int_equal(in.cp_rank, 0);
  assert_int_equal(in.tp_rank, 0);
  assert_int_equal(in.vocab_size, g_vocab);
  assert_int_equal(in.hidden_size, g_hidden);
  assert_int_equal(in.num_layers, g_layers);
  assert_int_equal(in.bos_token_id, g_bos);
  assert_int_equal(in.eos_token_id, g_eos);
  assert_int_equal(in.step, 0);
  assert_string_equal(meshlm_error(s), ""); /* no error so far */
  int64_t params;
  check_weight_table(s, &params);
  assert_int_equal(in.num_params, params);
  meshlm_close(s);

  /* the mesh: tp fastest */
  meshlm_options o = mesh_opts();
  s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  in = info_of(s);
  assert_int_equal(in.tp, o.tp);
  assert_int_equal(in.dp_shard, g_world / o.tp);
  assert_int_equal(in.tp_rank, g_rank % o.tp);
  assert_int_equal(in.dp_rank, g_rank / o.tp);
  assert_int_equal(in.dp_size, g_world / o.tp);
  meshlm_close(s);

  /* open_f: comm_f < 0 is the world, else the Fortran handle's communicator */
  OK(s, meshlm_open_f(g_fixture, NULL, -1, &s));
  assert_int_equal(info_of(s).world, g_world);
  meshlm_close(s);
  OK(s, meshlm_open_f(g_fixture, NULL, (int64_t)MPI_Comm_c2f(MPI_COMM_SELF), &s));
  in = info_of(s);
  assert_int_equal(in.world, 1);
  assert_int_equal(in.rank, 0);
  meshlm_close(s);
}

/* ======================================================================= */

int main(int argc, char **argv) {
  api_init(&argc, &argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_version_defaults),
      cmocka_unit_test(test_open_errors),
      cmocka_unit_test(test_open_info),
  };
  return api_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
