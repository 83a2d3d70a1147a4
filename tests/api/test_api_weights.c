/* test_api_weights: save / resume, export / reload(dir), refit (callback,
 * into buffers, F32 / BF16 / SOURCE) against the exported safetensors
 * bytes, reload_tensors (perturb and restore, unknown name), a refit
 * callback that stops; an inference-only bf16 session's weights (loaded,
 * reloaded, refused reads).
 * The suite, its meshes and its helpers: api_util.h. */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api_util.h"

/* Save → train → resume gives the saved weights back; export → train →
 * reload(dir) likewise, and a session opened from the export too. Every
 * comparison is bitwise: the weights are copies (checkpoint and export
 * bytes of fp32 values, read back) and the same mesh runs the same kernels
 * on them (TOL_EXACT). */
static void test_save_resume_export(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  o.lr = 1e-3;
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  gbatch g = gbatch_make(41);
  int64_t n = g.all.npred;
  size_t bytes = sizeof(float) * (size_t)n;
  float *saved = xcalloc((size_t)n, 4), *lp = xcalloc((size_t)n, 4);
  char ckpt[4200], exp[4200];
  tmp_path(ckpt, sizeof ckpt, "ckpt");
  tmp_path(exp, sizeof exp, "export");

  nll_step(s, &g);
  OK(s, meshlm_save(s, ckpt));
  global_lp(s, &g, NULL, saved);
  nll_step(s, &g);
  assert_int_equal(info_of(s).step, 2);
  global_lp(s, &g, NULL, lp);
  assert_true(memcmp(lp, saved, bytes) != 0);
  OK(s, meshlm_resume(s, ckpt));
  assert_int_equal(info_of(s).step, 1);
  global_lp(s, &g, NULL, lp);
  assert_memory_equal(lp, saved, bytes);

  OK(s, meshlm_export(s, exp, MESHLM_DTYPE_F32));
  nll_step(s, &g);
  global_lp(s, &g, NULL, lp);
  assert_true(memcmp(lp, saved, bytes) != 0);
  OK(s, meshlm_reload(s, exp));
  assert_int_equal(info_of(s).step, 2); /* reload keeps the step */
  global_lp(s, &g, NULL, lp);
  assert_memory_equal(lp, saved, bytes);
  meshlm_session *e = open_ok(exp, &o, MPI_COMM_WORLD);
  global_lp(e, &g, NULL, lp);
  assert_memory_equal(lp, saved, bytes);
  meshlm_close(e);
  meshlm_close(s);
  free(saved);
  free(lp);
  batch_free(&g.all);
}

/* refit against the exported safetensors: F32 byte for byte (to root 0 by
 * callback, to every rank into buffers), SOURCE = F32 for this fp32
 * fixture, BF16 = round-to-nearest-even of the F32 values (byte for byte
 * with a BF16 export). */
static void test_refit(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  o.lr = 1e-3;
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  gbatch g = gbatch_make(42);
  nll_step(s, &g); /* weights other than the fixture's */
  char e32[4200], e16[4200], path[4300];
  tmp_path(e32, sizeof e32, "refit_f32");
  tmp_path(e16, sizeof e16, "refit_bf16");
  OK(s, meshlm_export(s, e32, MESHLM_DTYPE_F32));
  OK(s, meshlm_export(s, e16, MESHLM_DTYPE_BF16));
  st_file f32, f16;
  snprintf(path, sizeof path, "%s/model.safetensors", e32);
  st_open(path, &f32);
  snprintf(path, sizeof path, "%s/model.safetensors", e16);
  st_open(path, &f16);

  weights w = weights_of(s);
  /* to root 0, by callback: rank 0 receives every tensor in weight order, the others none */
  OK(s, meshlm_refit(s, 0, MESHLM_DTYPE_F32, keep_tensor, &w));
  assert_int_equal(w.calls, g_rank == 0 ? w.n : 0);
  for (int64_t i = 0; g_rank == 0 && i < w.n; i++) {
    const char *dt;
    int nd;
    int64_t sh[2];
    size_t nb;
    const void *d = st_tensor(&f32, w.name[i], &dt, &nd, sh, &nb);
    if (!d) fail_msg("'%s' is not in the export", w.name[i]);
    assert_string_equal(dt, "F32");
    assert_int_equal(w.dtype[i], MESHLM_DTYPE_F32);
    assert_int_equal(w.nbytes[i], nb);
    if (memcmp(w.data[i], d, nb) != 0) fail_msg("refit '%s' differs from the export", w.name[i]);
  }
  /* SOURCE on every rank (root −1): F32 for this fixture, the same bytes */
  weights_clear(&w);
  OK(s, meshlm_refit(s, -1, MESHLM_DTYPE_SOURCE, keep_tensor, &w));
  assert_int_equal(w.calls, w.n);
  /* into buffers, on every rank, F32 and BF16 */
  weights b32 = weights_of(s), b16 = weights_of(s);
  weights_alloc(&b32, MESHLM_DTYPE_F32);
  weights_alloc(&b16, MESHLM_DTYPE_BF16);
  OK(s, meshlm_refit_into(s, -1, MESHLM_DTYPE_F32, b32.data));
  OK(s, meshlm_refit_into(s, -1, MESHLM_DTYPE_BF16, b16.data));
  for (int64_t i = 0; i < w.n; i++) {
    const char *dt;
    int nd;
    int64_t sh[2];
    size_t nb, nb16;
    const float *d = st_tensor(&f32, w.name[i], &dt, &nd, sh, &nb);
    const uint16_t *h = st_tensor(&f16, w.name[i], &dt, &nd, sh, &nb16);
    assert_non_null(d);
    assert_non_null(h);
    assert_string_equal(dt, "BF16");
    assert_int_equal(w.dtype[i], MESHLM_DTYPE_F32);
    assert_memory_equal(w.data[i], d, nb);
    assert_memory_equal(b32.data[i], d, nb);
    assert_int_equal(b16.nbytes[i], nb16);
    assert_memory_equal(b16.data[i], h, nb16);
    const uint16_t *got = b16.data[i];
    for (int64_t j = 0; j < numel(&w.w[i]); j++)
      if (got[j] != bf16_rne(d[j]))
        fail_msg("'%s'[%lld]: bf16 0x%04x, round-to-nearest-even of %.9g is 0x%04x", w.name[i],
                 (long long)j, got[j], d[j], bf16_rne(d[j]));
  }
  /* root 0 only: buffers may be NULL elsewhere */
  weights_alloc(&b32, MESHLM_DTYPE_F32);
  OK(s, meshlm_refit_into(s, 0, MESHLM_DTYPE_F32, g_rank == 0 ? b32.data : NULL));
  for (int64_t i = 0; g_rank == 0 && i < w.n; i++)
    assert_memory_equal(b32.data[i], w.data[i], b32.nbytes[i]);
  st_close(&f32);
  st_close(&f16);
  weights_free(&w);
  weights_free(&b32);
  weights_free(&b16);
  meshlm_close(s);
  batch_free(&g.all);
}

/* reload_tensors: perturbed tensors change the log-probs, the originals
 * restore them bitwise (copies of the same values, TOL_EXACT); BF16 data
 * is widened exactly; an unknown name or a wrong shape fails naming it;
 * a refit callback that stops fails every rank. */
static void test_reload_tensors(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  gbatch g = gbatch_make(43);
  int64_t n = g.all.npred;
  size_t bytes = sizeof(float) * (size_t)n;
  float *lp0 = xcalloc((size_t)n, 4), *lp = xcalloc((size_t)n, 4);
  global_lp(s, &g, NULL, lp0);
  weights w = weights_of(s);
  weights_alloc(&w, MESHLM_DTYPE_F32);
  OK(s, meshlm_refit_into(s, -1, MESHLM_DTYPE_F32, w.data));

  meshlm_tensor *all = xcalloc((size_t)w.n, sizeof *all);
  for (int64_t i = 0; i < w.n; i++)
    all[i] = (meshlm_tensor){sizeof all[i], w.name[i], MESHLM_DTYPE_F32, w.w[i].ndim,
                             {w.w[i].shape[0], w.w[i].shape[1]}, w.data[i]};
  /* two tensors perturbed: the first and the last of the table */
  int64_t pick[2] = {0, w.n - 1};
  meshlm_tensor t[2];
  float *pert[2];
  for (int j = 0; j < 2; j++) {
    int64_t i = pick[j], m = numel(&w.w[i]);
    pert[j] = xcalloc((size_t)m, sizeof(float));
    for (int64_t e = 0; e < m; e++) pert[j][e] = ((float *)w.data[i])[e] * 1.25f + 0.01f;
    t[j] = all[i];
    t[j].data = pert[j];
  }
  OK(s, meshlm_reload_tensors(s, 2, t));
  global_lp(s, &g, NULL, lp);
  double moved = rel_l2(lp, lp0, n);
  printf("[rank %d] reload_tensors: perturbed log-probs moved by rel L2 %.3g (rounding bound "
         "%.3g)\n", g_rank, moved, lp_tol(21));
  assert_true(moved > lp_tol(21)); /* more than any rounding could */
  OK(s, meshlm_reload_tensors(s, w.n, all));
  global_lp(s, &g, NULL, lp);
  assert_memory_equal(lp, lp0, bytes);
  assert_int_equal(info_of(s).step, 0);

  /* BF16 data: kept as its exact fp32 widening */
  uint16_t *h = xcalloc((size_t)numel(&w.w[0]), 2);
  for (int64_t e = 0; e < numel(&w.w[0]); e++) h[e] = bf16_rne(((float *)w.data[0])[e]);
  meshlm_tensor tb = all[0];
  tb.dtype = MESHLM_DTYPE_BF16;
  tb.data = h;
  OK(s, meshlm_reload_tensors(s, 1, &tb));
  weights back = weights_of(s);
  weights_alloc(&back, MESHLM_DTYPE_F32);
  OK(s, meshlm_refit_into(s, -1, MESHLM_DTYPE_F32, back.data));
  for (int64_t e = 0; e < numel(&w.w[0]); e++) {
    uint32_t u = (uint32_t)h[e] << 16;
    float want;
    memcpy(&want, &u, sizeof want);
    assert_true(((float *)back.data[0])[e] == want);
  }
  for (int64_t i = 1; i < w.n; i++) assert_memory_equal(back.data[i], w.data[i], w.nbytes[i]);
  OK(s, meshlm_reload_tensors(s, 1, &all[0]));
  global_lp(s, &g, NULL, lp);
  assert_memory_equal(lp, lp0, bytes);

  /* an unknown name; a wrong shape: both named, nothing changed */
  meshlm_tensor bad = all[0];
  bad.name = "model.layers.99.mlp.nonexistent.weight";
  expect_fail(s, meshlm_reload_tensors(s, 1, &bad), "model.layers.99.mlp.nonexistent.weight",
              "reload_tensors, an unknown name");
  bad = all[w.n - 1];
  bad.shape[0] -= 1;
  int rc = meshlm_reload_tensors(s, 1, &bad);
  expect_fail(s, rc, w.name[w.n - 1], "reload_tensors, a wrong shape");
  char shape_s[96];
  snprintf(shape_s, sizeof shape_s, "[%lld, %lld]; expected [%lld, %lld]",
           (long long)bad.shape[0], (long long)bad.shape[1], (long long)w.w[w.n - 1].shape[0],
           (long long)w.w[w.n - 1].shape[1]);
  expect_fail(s, rc, shape_s, "reload_tensors, a wrong shape");
  /* a NaN (F32) or an inf (BF16) on the last rank: refused on every rank naming the tensor
   * and the first index */
  int64_t m = numel(&w.w[w.n - 1]);
  float *nan_t = xcalloc((size_t)m, sizeof *nan_t);
  memcpy(nan_t, w.data[w.n - 1], sizeof *nan_t * (size_t)m);
  nan_t[m - 1] = nan_t[m - 2] = NAN;
  bad = all[w.n - 1];
  bad.data = nan_t;
  char at[64];
  snprintf(at, sizeof at, "index %lld", (long long)(m - 2));
  rc = meshlm_reload_tensors(s, 1, g_rank == g_world - 1 ? &bad : &all[w.n - 1]);
  expect_fail(s, rc, w.name[w.n - 1], "reload_tensors, a NaN");
  expect_fail(s, rc, at, "reload_tensors, a NaN");
  h[1] = 0xff80; /* -inf */
  rc = meshlm_reload_tensors(s, 1, g_rank == g_world - 1 ? &tb : &all[0]);
  expect_fail(s, rc, w.name[0], "reload_tensors, a bf16 -inf");
  expect_fail(s, rc, "index 1 ", "reload_tensors, a bf16 -inf");
  free(nan_t);
  global_lp(s, &g, NULL, lp);
  assert_memory_equal(lp, lp0, bytes);

  /* a refit callback that stops: at the first tensor on root 0; at the third on the last
   * rank of a refit to every rank. Every rank fails; nothing changed. */
  weights c = weights_of(s);
  c.stop_at = g_rank == 0 ? 0 : -1;
  expect_fail(s, meshlm_refit(s, 0, MESHLM_DTYPE_F32, keep_tensor, &c),
              "stopped by the callback", "refit stopped at root 0");
  weights_clear(&c);
  c.stop_at = g_rank == g_world - 1 ? 2 : -1;
  expect_fail(s, meshlm_refit(s, -1, MESHLM_DTYPE_BF16, keep_tensor, &c),
              "stopped by the callback", "refit stopped on the last rank");
  weights_clear(&c);
  c.stop_at = -1;
  OK(s, meshlm_refit(s, -1, MESHLM_DTYPE_F32, keep_tensor, &c));
  for (int64_t i = 0; i < w.n; i++) assert_memory_equal(c.data[i], w.data[i], w.nbytes[i]);
  global_lp(s, &g, NULL, lp);
  assert_memory_equal(lp, lp0, bytes);

  weights_free(&c);
  weights_free(&back);
  free(h);
  free(pert[0]);
  free(pert[1]);
  free(all);
  weights_free(&w);
  free(lp0);
  free(lp);
  meshlm_close(s);
  batch_free(&g.all);
}

/* ======================================================================= */

/* An inference-only bf16 session (meshlm_options.inference_only: its
 * weights in bf16 alone) against a normal bf16 session on the same mesh:
 * the same log-probs bitwise (memcmp; the same bf16 values gathered: each
 * rounded once, there at load, here at every unshard of the fp32 masters),
 * before and after the same reload_tensors (a perturbed tensor: rounded
 * once into its bf16 weights), its reference policy's log-probs and its
 * greedy generation too; training, export, refit and a generation replica
 * refused on it, naming inference_only. */
static void test_inference_only(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  o.param_dtype = MESHLM_DTYPE_BF16;
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  o.inference_only = 1;
  meshlm_session *q = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  gbatch g = gbatch_make(47);
  int64_t n = g.all.npred;
  size_t bytes = sizeof(float) * (size_t)n;
  float *want = xcalloc((size_t)n, 4), *got = xcalloc((size_t)n, 4), *lp0 = xcalloc((size_t)n, 4);
  global_lp(s, &g, NULL, lp0);
  global_lp(q, &g, NULL, got);
  assert_memory_equal(got, lp0, bytes);

  /* the first tensor perturbed into both (its values from the normal session's masters) */
  weights w = weights_of(s);
  weights_alloc(&w, MESHLM_DTYPE_F32);
  OK(s, meshlm_refit_into(s, -1, MESHLM_DTYPE_F32, w.data));
  int64_t m = numel(&w.w[0]);
  float *pert = xcalloc((size_t)m, sizeof(float));
  for (int64_t e = 0; e < m; e++) pert[e] = ((float *)w.data[0])[e] * 1.25f + 0.01f;
  meshlm_tensor t = {sizeof t, w.name[0], MESHLM_DTYPE_F32, w.w[0].ndim,
                     {w.w[0].shape[0], w.w[0].shape[1]}, pert};
  OK(s, meshlm_reload_tensors(s, 1, &t));
  OK(q, meshlm_reload_tensors(q, 1, &t));
  global_lp(s, &g, NULL, want);
  global_lp(q, &g, NULL, got);
  assert_memory_equal(got, want, bytes);
  assert_true(memcmp(want, lp0, bytes) != 0); /* the reload changed them */
  OK(q, meshlm_set_reference(q));
  memset(got, 0, bytes);
  global_ref_lp(q, &g, got);
  assert_memory_equal(got, want, bytes);

  /* greedy generation on the policy's mesh (the vocab-parallel rows from the bf16 weights
   * under dp > 1): the same tokens and log-probs bitwise; the replica needs fp32 masters */
  meshlm_info in = info_of(q);
  slice sl = slice_of(&g, in.dp_rank, in.dp_size);
  meshlm_sampling sp;
  meshlm_sampling_default(&sp);
  sp.greedy = 1;
  sp.max_new_tokens = 4;
  size_t cells = (size_t)(sl.seqs.n * sp.max_new_tokens);
  int32_t *tok[2] = {xcalloc(cells, sizeof(int32_t)), xcalloc(cells, sizeof(int32_t))};
  int64_t *len[2] = {xcalloc((size_t)sl.seqs.n, sizeof(int64_t)),
                     xcalloc((size_t)sl.seqs.n, sizeof(int64_t))};
  float *glp[2] = {xcalloc(cells, sizeof(float)), xcalloc(cells, sizeof(float))};
  OK(s, meshlm_generate(s, &sl.seqs, &sp, tok[0], len[0], glp[0]));
  OK(q, meshlm_generate(q, &sl.seqs, &sp, tok[1], len[1], glp[1]));
  assert_memory_equal(tok[1], tok[0], cells * sizeof(int32_t));
  assert_memory_equal(len[1], len[0], (size_t)sl.seqs.n * sizeof(int64_t));
  assert_memory_equal(glp[1], glp[0], cells * sizeof(float));
  sp.replica = 1;
  expect_fail(q, meshlm_generate(q, &sl.seqs, &sp, tok[1], len[1], NULL), "inference_only",
              "generation on a replica of an inference-only bf16 session");
  for (int k = 0; k < 2; k++) {
    free(tok[k]);
    free(len[k]);
    free(glp[k]);
  }

  meshlm_step_result r = {.struct_size = sizeof r};
  expect_fail(q, step_share(q, &g, &(garr){0}, NULL, &r),
              "inference_only", "train_step on an inference-only session");
  expect_fail(q, meshlm_zero_grad(q), "inference_only", "zero_grad on an inference-only session");
  char dir[4200];
  tmp_path(dir, sizeof dir, "inference_only_export");
  expect_fail(q, meshlm_export(q, dir, MESHLM_DTYPE_BF16), "inference_only",
              "export of an inference-only bf16 session");
  expect_fail(q, meshlm_refit_into(q, -1, MESHLM_DTYPE_F32, w.data), "inference_only",
              "refit of an inference-only bf16 session");
  global_lp(q, &g, NULL, got); /* still scoring, unchanged */
  assert_memory_equal(got, want, bytes);
  weights_free(&w);
  free(pert);
  free(want);
  free(got);
  free(lp0);
  batch_free(&g.all);
  meshlm_close(q);
  meshlm_close(s);
}

int main(int argc, char **argv) {
  api_init(&argc, &argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_save_resume_export),
      cmocka_unit_test(test_refit),
      cmocka_unit_test(test_reload_tensors),
      cmocka_unit_test(test_inference_only),
  };
  return api_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
