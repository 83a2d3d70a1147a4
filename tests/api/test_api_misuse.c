/* test_api_misuse: a failed session, bad shapes and arguments on one rank,
 * mismatched collective order, tp peers with different batches; each −1
 * on every rank and the session still usable (bitwise the same log-probs,
 * no step taken); the message names the rank the error arose on.
 * The suite, its meshes and its helpers: api_util.h. */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api_util.h"

static meshlm_session *failed_session(void) {
  char missing[4200];
  tmp_path(missing, sizeof missing, "no_such_model");
  meshlm_session *s = NULL;
  assert_int_equal(meshlm_open(missing, NULL, MPI_COMM_WORLD, &s), -1);
  assert_non_null(s);
  /* the checks below look for the calls' own message, not this one */
  assert_null(strstr(meshlm_error(s), "session is not open"));
  return s;
}

/* Every collective call on a session whose open failed: −1 and a message
 * that it is not open (no collective runs: each rank answers alone). */
static void test_failed_session(void **state) {
  (void)state;
  meshlm_session *s = failed_session();
  batch b = local_batch(0);
  meshlm_seqs q = seqs_of(&b);
  float *out = xcalloc((size_t)b.npred, sizeof *out);
  meshlm_train_batch tb = {.struct_size = sizeof tb, .seqs = q};
  meshlm_step_result r = {.struct_size = sizeof r};
  meshlm_sampling sp;
  meshlm_sampling_default(&sp);
  int32_t tok[64 * 32];
  int64_t lens[64];
  meshlm_info in = {.struct_size = sizeof in};
  weights none = {0};
  char dir[4200];
  tmp_path(dir, sizeof dir, "failed");
  expect_fail(s, meshlm_logprobs(s, &q, NULL, out, NULL), "session is not open", "logprobs");
  expect_fail(s, meshlm_train_step(s, &tb, NULL, &r), "session is not open", "train_step");
  expect_fail(s, meshlm_save(s, dir), "session is not open", "save");
  expect_fail(s, meshlm_resume(s, dir), "session is not open", "resume");
  expect_fail(s, meshlm_export(s, dir, MESHLM_DTYPE_F32), "session is not open", "export");
  expect_fail(s, meshlm_refit(s, -1, MESHLM_DTYPE_F32, keep_tensor, &none), "session is not open", "refit");
  expect_fail(s, meshlm_refit_into(s, -1, MESHLM_DTYPE_F32, (void *const *)out), "session is not open",
              "refit_into");
  expect_fail(s, meshlm_reload(s, g_fixture), "session is not open", "reload");
  expect_fail(s, meshlm_reload_tensors(s, 0, NULL), "session is not open", "reload_tensors");
  expect_fail(s, meshlm_generate(s, &q, &sp, tok, lens, NULL), "session is not open", "generate");
  expect_fail(s, meshlm_get_info(s, &in), "session is not open", "get_info");
  meshlm_close(s);
  free(out);
  batch_free(&b);
}

/* The non-collective calls on a failed session: −1 (num_weights −1), each
 * with its own message (the header: every call's error is the session's
 * message), not the open's left over. */
static void test_failed_session_local_calls(void **state) {
  (void)state;
  char missing[512] = "";
  meshlm_session *s = failed_session();
  meshlm_call_stats st = {.struct_size = sizeof st};
  meshlm_weight w = {.struct_size = sizeof w};
  if (meshlm_last_call_stats(s, &st) != -1 || !strstr(meshlm_error(s), "session is not open"))
    strcat(missing, " meshlm_last_call_stats");
  meshlm_close(s);
  s = failed_session();
  if (meshlm_num_weights(s) != -1 || !strstr(meshlm_error(s), "session is not open"))
    strcat(missing, " meshlm_num_weights");
  meshlm_close(s);
  s = failed_session();
  if (meshlm_weight_info(s, 0, &w) != -1 || !strstr(meshlm_error(s), "session is not open"))
    strcat(missing, " meshlm_weight_info");
  meshlm_close(s);
  if (missing[0])
    fail_msg("on a failed session these return -1 but leave the open's message instead of "
             "their own:%s", missing);
}

/* Bad arguments on one rank only (the last): −1 on every rank with a
 * message naming what was wrong; then the session works as before (the
 * same log-probs bitwise, no step). */
static void test_bad_arguments(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_info in = info_of(s);
  batch b = local_batch(in.dp_rank);
  meshlm_seqs q = seqs_of(&b);
  size_t bytes = sizeof(float) * (size_t)b.npred;
  float *ref = xcalloc((size_t)b.npred, 4), *out = xcalloc((size_t)b.npred, 4);
  OK(s, meshlm_logprobs(s, &q, NULL, ref, NULL));
  int bad = g_rank == g_world - 1;
  int64_t *lens = xcalloc((size_t)b.n, sizeof *lens);
  int32_t *tok = xcalloc((size_t)(g_maxpos + 1 + b.ntok), sizeof *tok);
  char vocab_s[32], maxpos_s[32];
  snprintf(vocab_s, sizeof vocab_s, "%lld", (long long)g_vocab);
  snprintf(maxpos_s, sizeof maxpos_s, "%lld", (long long)(g_maxpos + 1));
  enum { NCASES = 9 };
  static const char *what[NCASES] = {"n = -1", "a length 0", "an id = vocab_size", "an id -1",
                                     "lens NULL", "tokens NULL", "the batch NULL",
                                     "a length > max_position_embeddings", "out NULL"};
  const char *needle[NCASES] = {"-1", "sequence 1", vocab_s, "-1", "NULL", "NULL", "NULL",
                                maxpos_s, "NULL"};
  for (int c = 0; c < NCASES; c++) {
    meshlm_seqs v = q;
    memcpy(lens, b.lens, sizeof *lens * (size_t)b.n);
    memcpy(tok, b.tok, sizeof *tok * (size_t)b.ntok);
    v.lens = lens;
    v.tokens = tok;
    float *o_ = out;
    const meshlm_seqs *arg = &v;
    switch (c) {
    case 0: v.n = -1; break;
    case 1: lens[1] = 0; break;
    case 2: tok[3] = (int32_t)g_vocab; break;
    case 3: tok[b.ntok - 1] = -1; break;
    case 4: v.lens = NULL; break;
    case 5: v.tokens = NULL; break;
    case 6: arg = NULL; break;
    case 7: lens[0] = g_maxpos + 1; break;
    case 8: o_ = NULL; break;
    }
    int rc = meshlm_logprobs(s, bad ? arg : &q, NULL, bad ? o_ : out, NULL);
    expect_fail(s, rc, needle[c], what[c]);
  }
  OK(s, meshlm_logprobs(s, &q, NULL, out, NULL));
  assert_memory_equal(out, ref, bytes);

  /* train_step: a bad length on one rank */
  memcpy(lens, b.lens, sizeof *lens * (size_t)b.n);
  lens[2] = 0;
  meshlm_train_batch tb = {.struct_size = sizeof tb, .seqs = q}, tbad = {.struct_size = sizeof tbad, .seqs = {q.n, lens, q.tokens}};
  meshlm_step_result r = {.struct_size = sizeof r};
  expect_fail(s, meshlm_train_step(s, bad ? &tbad : &tb, NULL, &r), "sequence 2",
              "train_step with a length 0");

  /* generate: sampling out of range, a prompt too long, on one rank (the fields' names:
   * test_bad_sampling) */
  meshlm_sampling good, sp;
  meshlm_sampling_default(&good);
  good.max_new_tokens = NEW;
  int32_t *gt = xcalloc((size_t)(b.n * 40), sizeof *gt);
  int64_t *gl = xcalloc((size_t)b.n, sizeof *gl);
  for (int c = 0; c < 5; c++) {
    sp = good;
    if (c == 0) sp.max_new_tokens = 0;
    if (c == 1) sp.temperature = 0.0f;
    if (c == 2) sp.top_p = 0.0f;
    if (c == 3) sp.top_p = 1.5f;
    if (c == 4) sp.eos_token_id = -3;
    expect_fail(s, meshlm_generate(s, &q, bad ? &sp : &good, gt, gl, NULL), NULL, "sampling");
  }
  memcpy(lens, b.lens, sizeof *lens * (size_t)b.n);
  lens[0] = g_maxpos - NEW + 1; /* prompt + max_new_tokens > max_position_embeddings */
  meshlm_seqs longp = {1, lens, tok};
  expect_fail(s, meshlm_generate(s, bad ? &longp : &q, &good, gt, gl, NULL), NULL,
              "generate, a prompt too long");
  expect_fail(s, meshlm_generate(s, &q, bad ? NULL : &good, gt, gl, NULL), NULL,
              "generate, sampling NULL");

  /* weights calls */
  char dir[4200], missing[4200];
  tmp_path(dir, sizeof dir, "bad_args");
  tmp_path(missing, sizeof missing, "no_such_checkpoint");
  weights w = weights_of(s);
  char root_s[32];
  snprintf(root_s, sizeof root_s, "root %d", g_world);
  expect_fail(s, meshlm_refit(s, g_world, MESHLM_DTYPE_F32, keep_tensor, &w), root_s,
              "refit, root = world");
  expect_fail(s, meshlm_refit(s, -1, (meshlm_dtype)9, keep_tensor, &w), "dtype", "refit dtype 9");
  expect_fail(s, meshlm_refit(s, -1, MESHLM_DTYPE_F32, bad ? NULL : keep_tensor, &w), NULL,
              "refit, no callback on a receiving rank");
  expect_fail(s, meshlm_export(s, dir, (meshlm_dtype)9), "dtype", "export dtype 9");
  expect_fail(s, meshlm_export(s, bad ? NULL : dir, MESHLM_DTYPE_F32), "dir", "export dir NULL");
  expect_fail(s, meshlm_save(s, bad ? NULL : dir), "dir", "save dir NULL");
  expect_fail(s, meshlm_resume(s, missing), "no_such_checkpoint", "resume, no checkpoint");
  expect_fail(s, meshlm_reload(s, bad ? NULL : g_fixture), "dir", "reload dir NULL");
  expect_fail(s, meshlm_reload(s, missing), "no_such_checkpoint", "reload, a missing directory");
  expect_fail(s, meshlm_reload_tensors(s, bad ? -1 : 0, NULL), "-1", "reload_tensors n -1");
  expect_fail(s, meshlm_reload_tensors(s, 1, NULL), "NULL", "reload_tensors NULL");
  weights_free(&w);

  /* nothing changed */
  assert_int_equal(info_of(s).step, 0);
  OK(s, meshlm_logprobs(s, &q, NULL, out, NULL));
  assert_memory_equal(out, ref, bytes);
  free(gt);
  free(gl);
  free(lens);
  free(tok);
  free(ref);
  free(out);
  batch_free(&b);
  meshlm_close(s);
}

/* The header: sampling fields out of range are named (as meshlm_sampling
 * names them), on every rank. */
static void test_bad_sampling(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  batch b = local_batch(info_of(s).dp_rank);
  meshlm_seqs q = seqs_of(&b);
  meshlm_sampling good, sp;
  meshlm_sampling_default(&good);
  good.max_new_tokens = NEW;
  int32_t *gt = xcalloc((size_t)(b.n * 40), sizeof *gt);
  int64_t *gl = xcalloc((size_t)b.n, sizeof *gl);
  static const char *field[5] = {"temperature", "top_p", "top_p", "eos_token_id",
                                 "max_new_tokens"};
  for (int c = 0; c < 5; c++) {
    sp = good;
    if (c == 0) sp.temperature = 0.0f;
    if (c == 1) sp.top_p = 0.0f;
    if (c == 2) sp.top_p = 1.5f;
    if (c == 3) sp.eos_token_id = -3;
    if (c == 4) sp.max_new_tokens = 0;
    expect_fail(s, meshlm_generate(s, &q, g_rank == g_world - 1 ? &sp : &good, gt, gl, NULL),
                field[c], field[c]);
  }
  free(gt);
  free(gl);
  batch_free(&b);
  meshlm_close(s);
}

/* The loss's fields and arrays (every rank, then one rank only). */
static void test_bad_loss(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  gbatch g = gbatch_make(51);
  int64_t n = g.all.npred;
  float *lp0 = xcalloc((size_t)n, 4), *lp = xcalloc((size_t)n, 4), *old = xcalloc((size_t)n, 4);
  uint8_t *zero = xcalloc((size_t)n, 1), *two = xcalloc((size_t)n, 1);
  memcpy(two, g.all.mask, (size_t)n);
  two[n - 1] = 2; /* any byte but 0/1 is refused, not read as true */
  global_lp(s, &g, NULL, lp0);
  memcpy(old, lp0, sizeof(float) * (size_t)n);
  meshlm_step_result r = {.struct_size = sizeof r};
  enum { NCASES = 10 };
  static const char *needle[NCASES] = {"kind", "ratio_clip_min", "ratio_clip_max", "ratio_clip_c",
                                       "kl_penalty", "kl_penalty", "old_logprobs",
                                       "ref_logprobs", "masked", "expected 0 or 1"};
  for (int once = 0; once <= 1; once++)
    for (int c = 0; c < NCASES; c++) {
      meshlm_loss l, good;
      meshlm_loss_default(&l);
      good = l;
      garr a = {g.all.mask, NULL, NULL, NULL, NULL};
      switch (c) {
      case 0: l.kind = (meshlm_loss_kind)7; break;
      case 1: l.ratio_clip_min = -0.1f; break;
      case 2: l.ratio_clip_max = NAN; break;
      case 3: l.ratio_clip_c = 0.5f; break;
      case 4: l.kl_penalty = -1.0f; break;
      case 5: l.kl_penalty = 0.1f; break; /* with NLL */
      case 6: l.kind = MESHLM_LOSS_CLIPPED_PG; break;
      case 7: l.kind = MESHLM_LOSS_WEIGHTED_NLL; l.kl_penalty = 0.1f; break;
      case 8: a.mask = zero; break;
      case 9: a.mask = two; break;
      }
      if (c == 8 && once) continue; /* "none in the global batch" needs every rank */
      int mine = !once || g_rank == g_world - 1;
      /* with `once` the other ranks pass a valid step of the same loss */
      garr ga = a;
      if (!mine) {
        l = c == 6 ? l : good;
        ga.old = old;
      }
      expect_fail(s, step_share(s, &g, mine ? &a : &ga, &l, &r), needle[c], needle[c]);
    }
  meshlm_info in = info_of(s);
  slice sl = slice_of(&g, in.dp_rank, in.dp_size);
  expect_fail(s, meshlm_logprobs(s, &sl.seqs, two + sl.p0, lp + sl.p0, NULL), "expected 0 or 1",
              "logprobs, mask entry 2");
  garr a = {g.all.mask, NULL, NULL, NULL, NULL};
  expect_fail(s, step_share(s, &g, &a, NULL, NULL), "NULL", "train_step, result NULL");
  expect_fail(s, meshlm_train_step(s, NULL, NULL, &r), "NULL", "train_step, batch NULL");
  assert_int_equal(info_of(s).step, 0);
  global_lp(s, &g, NULL, lp);
  assert_memory_equal(lp, lp0, sizeof(float) * (size_t)n);
  free(lp0);
  free(lp);
  free(old);
  free(zero);
  free(two);
  batch_free(&g.all);
  meshlm_close(s);
}

/* Rank 0 calls meshlm_logprobs while the others call meshlm_train_step:
 * −1 on every rank naming both calls, nothing run. */
static void test_collective_order(void **state) {
  (void)state;
  if (g_world == 1) skip();
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_info in = info_of(s);
  batch b = local_batch(in.dp_rank);
  meshlm_seqs q = seqs_of(&b);
  float *ref = xcalloc((size_t)b.npred, 4), *out = xcalloc((size_t)b.npred, 4);
  OK(s, meshlm_logprobs(s, &q, NULL, ref, NULL));
  meshlm_train_batch tb = {.struct_size = sizeof tb, .seqs = q};
  meshlm_step_result r = {.struct_size = sizeof r};
  int rc = g_rank == 0 ? meshlm_logprobs(s, &q, NULL, out, NULL)
                       : meshlm_train_step(s, &tb, NULL, &r);
  expect_fail(s, rc, "meshlm_logprobs", "mismatched collective order");
  expect_fail(s, rc, "meshlm_train_step", "mismatched collective order");
  /* and another pair: save on the last rank, export elsewhere */
  char dir[4200];
  tmp_path(dir, sizeof dir, "order");
  rc = g_rank == g_world - 1 ? meshlm_save(s, dir) : meshlm_export(s, dir, MESHLM_DTYPE_F32);
  expect_fail(s, rc, "meshlm_save", "save vs export");
  expect_fail(s, rc, "meshlm_export", "save vs export");
  assert_int_equal(info_of(s).step, 0);
  OK(s, meshlm_logprobs(s, &q, NULL, out, NULL));
  assert_memory_equal(out, ref, sizeof(float) * (size_t)b.npred);
  free(ref);
  free(out);
  batch_free(&b);
  meshlm_close(s);
}

/* Rank 0 closes while the others call meshlm_logprobs: their call fails
 * naming both, a later collective call fails at once naming rank 0, and
 * their meshlm_close returns (it used to wait for rank 0 forever: the
 * CTest timeout fails a hang). */
static void test_close_during_call(void **state) {
  (void)state;
  if (g_world == 1) skip();
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  batch b = local_batch(info_of(s).dp_rank);
  meshlm_seqs q = seqs_of(&b);
  float *out = xcalloc((size_t)b.npred, 4);
  if (g_rank == 0) {
    meshlm_close(s);
  } else {
    expect_fail(s, meshlm_logprobs(s, &q, NULL, out, NULL), "meshlm_close",
                "logprobs while rank 0 closes");
    expect_fail(s, meshlm_logprobs(s, &q, NULL, out, NULL), "rank 0 closed the session",
                "logprobs after rank 0 closed");
    meshlm_close(s);
  }
  free(out);
  batch_free(&b);
}

/* The tp peers of a dp rank pass different batches: −1 naming it. */
static void test_tp_peers_differ(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  if (o.tp == 1) skip();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_info in = info_of(s);
  batch b = local_batch(in.dp_rank), c = local_batch(in.dp_rank);
  if (in.tp_rank == 1) c.tok[c.ntok - 1] = (c.tok[c.ntok - 1] + 1) % (int32_t)g_vocab;
  meshlm_seqs q = seqs_of(&b), qc = seqs_of(&c), fewer = {b.n - 1, b.lens, b.tok};
  float *ref = xcalloc((size_t)b.npred, 4), *out = xcalloc((size_t)b.npred, 4);
  OK(s, meshlm_logprobs(s, &q, NULL, ref, NULL));
  expect_fail(s, meshlm_logprobs(s, &qc, NULL, out, NULL), "different batches",
              "tp peers with different tokens");
  expect_fail(s, meshlm_logprobs(s, in.tp_rank == 1 ? &fewer : &q, NULL, out, NULL),
              "different batches", "tp peers with different counts");
  meshlm_train_batch tb = {.struct_size = sizeof tb, .seqs = qc};
  meshlm_step_result r = {.struct_size = sizeof r};
  expect_fail(s, meshlm_train_step(s, &tb, NULL, &r), "different batches",
              "train_step, tp peers with different tokens");
  assert_int_equal(info_of(s).step, 0);
  OK(s, meshlm_logprobs(s, &q, NULL, out, NULL));
  assert_memory_equal(out, ref, sizeof(float) * (size_t)b.npred);
  free(ref);
  free(out);
  batch_free(&b);
  batch_free(&c);
  meshlm_close(s);
}

/* The header: meshlm_error's message "names the world rank it arose on". */
static void test_error_names_rank(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_info in = info_of(s);
  batch b = local_batch(in.dp_rank);
  if (g_rank == g_world - 1) b.lens[1] = 0;
  meshlm_seqs q = seqs_of(&b);
  float *out = xcalloc((size_t)b.npred + 1, 4);
  char want[32];
  snprintf(want, sizeof want, "rank %d", g_world - 1);
  expect_fail(s, meshlm_logprobs(s, &q, NULL, out, NULL), want, "a length 0 on the last rank");
  free(out);
  batch_free(&b);
  meshlm_close(s);
}

/* ======================================================================= */

int main(int argc, char **argv) {
  api_init(&argc, &argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_failed_session),
      cmocka_unit_test(test_failed_session_local_calls),
      cmocka_unit_test(test_bad_arguments),
      cmocka_unit_test(test_bad_sampling),
      cmocka_unit_test(test_bad_loss),
      cmocka_unit_test(test_collective_order),
      cmocka_unit_test(test_close_during_call),
      cmocka_unit_test(test_tp_peers_differ),
      cmocka_unit_test(test_error_names_rank),
  };
  return api_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
