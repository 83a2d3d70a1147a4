/* test_api_basics: meshlm_version, the three *_default functions,
 * meshlm_error(NULL), open and open_f, meshlm_get_info and the weight
 * table against config.json and the fixture's safetensors; open errors
 * (missing dir, NULL dir, tp not dividing the world, bad dtypes, device,
 * micro_batch_tokens, and on four ranks a bad option on one rank only)
 * each −1 with a session whose message names the field and that closes;
 * struct sizes: older callers' layouts (struct_size at the minimum) read
 * with defaults and written no further, sizes out of range refused.
 * The suite, its meshes and its helpers: api_util.h. */

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
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
  assert_int_equal(o.cpu_offload, 0);
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
  assert_int_equal(sp.n, 1);
  assert_int_equal(sp.top_k, 0);
  assert_true(sp.min_p == 0.0f);
  assert_int_equal(sp.n_stop, 0);
  assert_null(sp.stop_token_ids);
  assert_null(sp.max_new_tokens_per);
  assert_int_equal(sp.max_running, 0);
  assert_int_equal(sp.prefill_tokens, 0);

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
  meshlm_info in = {.struct_size = sizeof in};
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
  o.inference_only = 2;
  expect_open_fails(g_fixture, &o, "inference_only", "inference_only 2");

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
    meshlm_weight w = {.struct_size = sizeof w};
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
  meshlm_weight w = {.struct_size = sizeof w};
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
/* Struct sizes (meshlm.h "Struct sizes")                                  */
/* ======================================================================= */

/* An older caller's layouts: each struct up to its minimum (without the
 * fields appended during 0.1), as a program built against that header
 * declares it; the tests put guard bytes behind them. */
typedef struct old_call_stats {
  size_t struct_size;
  int64_t micro_batches, tokens, padding, fsdp_all_gathers, fsdp_reduce_scatters,
      fsdp_all_reduces, fsdp_bytes, tp_collectives, cp_collectives, dp_replicate_collectives;
} old_call_stats;
typedef struct old_info {
  size_t struct_size;
  int rank, world, dp_replicate, dp_shard, cp, tp, dp_rank, dp_size, cp_rank, tp_rank;
  int64_t vocab_size, hidden_size, num_layers, num_params;
  int32_t bos_token_id, eos_token_id;
  int64_t step;
} old_info;
typedef struct old_step_result {
  size_t struct_size;
  double loss, kl, clip_fraction, grad_norm, lr;
  int64_t tokens, sequences, step;
  int skipped;
} old_step_result;
_Static_assert(sizeof(old_call_stats) == offsetof(meshlm_call_stats, nonfinite_logprobs),
               "the old meshlm_call_stats: every field before nonfinite_logprobs");
_Static_assert(sizeof(old_info) == offsetof(meshlm_info, max_seq_len),
               "the old meshlm_info: every field before max_seq_len");
_Static_assert(offsetof(old_step_result, skipped) == offsetof(meshlm_step_result, skipped),
               "the old meshlm_step_result: every field before nonfinite_param");

#define GUARD 0xA5
/* Every byte of p[0, n) is still GUARD. */
static void assert_guard(const void *p, size_t n, const char *what) {
  for (size_t i = 0; i < n; i++)
    if (((const unsigned char *)p)[i] != GUARD)
      fail_msg("%s: byte %zu past the caller's struct_size written", what, i);
}

/* rc −1 and s's message names the struct and the sizes. */
static void expect_size_refused(meshlm_session *s, int rc, const char *type, size_t size,
                                size_t min, size_t max, const char *what) {
  char needle[200];
  snprintf(needle, sizeof needle, "%s.struct_size %zu; expected %zu (the first layout) .. %zu",
           type, size, min, max);
  expect_fail(s, rc, needle, what);
}

/* _init at the minimum size and out of range; meshlm_open with an old
 * meshlm_options (the rest defaulted) and with sizes out of range. */
static void test_struct_sizes_in(void **state) {
  (void)state;
  const size_t omin = offsetof(meshlm_options, grad_norm_type);
  struct {
    meshlm_options o;
    unsigned char guard[8];
  } ob;
  memset(&ob, GUARD, sizeof ob);
  assert_int_equal(meshlm_options_init(&ob.o, omin), 0);
  assert_int_equal(ob.o.struct_size, omin);
  assert_int_equal(ob.o.micro_batch_tokens, 4096);
  assert_guard((char *)&ob + omin, sizeof ob - omin, "meshlm_options_init at the minimum");
  meshlm_options bad;
  memset(&bad, GUARD, sizeof bad);
  assert_int_equal(meshlm_options_init(&bad, omin - 1), -1);
  assert_int_equal(bad.struct_size, omin - 1); /* only struct_size, which meshlm_open refuses */
  assert_guard((char *)&bad + sizeof(size_t), sizeof bad - sizeof(size_t), "a refused _init");
  meshlm_loss l;
  assert_int_equal(meshlm_loss_init(&l, sizeof l + 8), -1);
  meshlm_sampling sp;
  assert_int_equal(meshlm_sampling_init(&sp, offsetof(meshlm_sampling, n) - 1), -1);

  /* past the old size: bytes that, read, would be refused (dtype −1, zero −1) */
  meshlm_options o;
  memset(&o, 0xFF, sizeof o);
  memcpy(&o, &ob.o, omin);
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_close(s);
  size_t sizes[3] = {0, omin - 8, sizeof o + 8};
  for (int k = 0; k < 3; k++) {
    meshlm_options_default(&o);
    o.struct_size = sizes[k];
    s = NULL;
    int rc = meshlm_open(g_fixture, &o, MPI_COMM_WORLD, &s);
    expect_size_refused(s, rc, "meshlm_options", sizes[k], omin, sizeof o, "meshlm_open");
    meshlm_close(s);
  }
}

/* Old output layouts written up to their size, nothing past it; input and
 * output structs of each call refused out of range, before anything runs. */
static void test_struct_sizes_calls(void **state) {
  (void)state;
  meshlm_session *s = open_ok(g_fixture, NULL, MPI_COMM_WORLD);
  meshlm_info full = info_of(s);
  struct {
    old_info i;
    unsigned char guard[16];
  } oi;
  memset(&oi, GUARD, sizeof oi);
  oi.i.struct_size = sizeof oi.i;
  OK(s, meshlm_get_info(s, (meshlm_info *)&oi.i));
  assert_int_equal(oi.i.struct_size, sizeof oi.i);
  assert_memory_equal((char *)&oi.i + sizeof(size_t), (char *)&full + sizeof(size_t),
                      sizeof oi.i - sizeof(size_t));
  assert_guard(oi.guard, sizeof oi.guard, "meshlm_get_info, old meshlm_info");

  int64_t lens[1] = {4};
  int32_t ids[4] = {1, 2, 3, 4};
  meshlm_seqs q = {1, lens, ids};
  float lp[3];
  OK(s, meshlm_logprobs(s, &q, NULL, lp, NULL));
  meshlm_call_stats cs = {.struct_size = sizeof cs};
  OK(s, meshlm_last_call_stats(s, &cs));
  struct {
    old_call_stats c;
    unsigned char guard[16];
  } oc;
  memset(&oc, GUARD, sizeof oc);
  oc.c.struct_size = sizeof oc.c;
  OK(s, meshlm_last_call_stats(s, (meshlm_call_stats *)&oc.c));
  assert_int_equal(oc.c.micro_batches, 1);
  assert_memory_equal(&oc.c.micro_batches, &cs.micro_batches, sizeof oc.c - sizeof(size_t));
  assert_guard(oc.guard, sizeof oc.guard, "meshlm_last_call_stats, old meshlm_call_stats");

  meshlm_train_batch tb = {.struct_size = sizeof tb, .seqs = q};
  struct {
    old_step_result r;
    unsigned char guard[16];
  } orr;
  memset(&orr, GUARD, sizeof orr);
  orr.r.struct_size = sizeof orr.r;
  OK(s, meshlm_train_step(s, &tb, NULL, (meshlm_step_result *)&orr.r));
  assert_int_equal(orr.r.step, 1);
  assert_int_equal(orr.r.tokens, 3 * g_world);
  assert_int_equal(orr.r.skipped, 0);
  assert_guard(orr.guard, sizeof orr.guard, "meshlm_train_step, old meshlm_step_result");

  /* out of range: refused naming the struct and both sizes */
  const size_t imin = offsetof(meshlm_info, max_seq_len);
  meshlm_info in = {.struct_size = imin - 1};
  expect_size_refused(s, meshlm_get_info(s, &in), "meshlm_info", imin - 1, imin, sizeof in,
                      "get_info, too small");
  in.struct_size = sizeof in + 8;
  expect_size_refused(s, meshlm_get_info(s, &in), "meshlm_info", sizeof in + 8, imin, sizeof in,
                      "get_info, too large");
  const size_t cmin = offsetof(meshlm_call_stats, nonfinite_logprobs);
  cs.struct_size = 0;
  expect_fail(s, meshlm_last_call_stats(s, &cs), "struct_size not set", "call stats, size 0");
  cs.struct_size = sizeof cs + 1;
  expect_size_refused(s, meshlm_last_call_stats(s, &cs), "meshlm_call_stats", sizeof cs + 1,
                      cmin, sizeof cs, "call stats, too large");
  meshlm_step_result r = {.struct_size = sizeof r + 8};
  const size_t rmin = offsetof(meshlm_step_result, nonfinite_param);
  expect_size_refused(s, meshlm_train_step(s, &tb, NULL, &r), "meshlm_step_result",
                      sizeof r + 8, rmin, sizeof r, "train_step, result too large");
  r.struct_size = sizeof r;
  const size_t bmin = offsetof(meshlm_train_batch, generation_logprobs);
  tb.struct_size = bmin - 8;
  expect_size_refused(s, meshlm_train_step(s, &tb, NULL, &r), "meshlm_train_batch", bmin - 8,
                      bmin, sizeof tb, "train_step, batch too small");
  assert_int_equal(info_of(s).step, 1); /* no step taken */
  meshlm_sampling sp;
  meshlm_sampling_default(&sp);
  sp.struct_size = offsetof(meshlm_sampling, n) - 4;
  int32_t out_tok[32];
  int64_t out_len[1];
  expect_size_refused(s, meshlm_generate(s, &q, &sp, out_tok, out_len, NULL), "meshlm_sampling",
                      offsetof(meshlm_sampling, n) - 4, offsetof(meshlm_sampling, n), sizeof sp,
                      "generate, sampling too small");
  meshlm_weight w = {.struct_size = sizeof w + 8};
  expect_size_refused(s, meshlm_weight_info(s, 0, &w), "meshlm_weight", sizeof w + 8, sizeof w,
                      sizeof w, "weight_info, too large");
  w.struct_size = sizeof w;
  OK(s, meshlm_weight_info(s, 0, &w));
  int64_t numel = w.shape[0] * (w.ndim == 2 ? w.shape[1] : 1);
  float *zeros = calloc((size_t)numel, sizeof *zeros);
  assert_non_null(zeros);
  meshlm_tensor t[2] = {{sizeof t[0], w.name, MESHLM_DTYPE_F32, w.ndim,
                         {w.shape[0], w.shape[1]}, zeros}};
  t[1] = t[0];
  t[0].struct_size = sizeof t[0] - 8;
  expect_size_refused(s, meshlm_reload_tensors(s, 1, t), "meshlm_tensor", sizeof t[0] - 8,
                      sizeof t[0], sizeof t[0], "reload_tensors, too small");
  t[0].struct_size = sizeof t[0];
  t[1].struct_size = 8;
  expect_fail(s, meshlm_reload_tensors(s, 2, t), "tensor 1's struct_size 8; expected tensors[0]'s",
              "reload_tensors, mixed layouts");
  free(zeros);
  meshlm_close(s);
}

/* ======================================================================= */

int main(int argc, char **argv) {
  api_init(&argc, &argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_version_defaults),
      cmocka_unit_test(test_open_errors),
      cmocka_unit_test(test_open_info),
      cmocka_unit_test(test_struct_sizes_in),
      cmocka_unit_test(test_struct_sizes_calls),
  };
  return api_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
