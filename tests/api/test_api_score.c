/* test_api_score: meshlm_logprobs and meshlm_last_call_stats.
 *  - logprobs of variable-length batches (a length-1 sequence included)
 *    against each sequence scored alone, with and without a mask, with
 *    several micro-batches and one, unshard_for_inference 0 and 1; each dp
 *    rank its own sequences, the reference on MPI_COMM_SELF.
 *  - meshlm_last_call_stats: micro-batches as planned; FSDP all-gathers
 *    per micro-batch with and without holding the parameters (dp_shard 4);
 *    the non-finite log-probs of a model with a NaN weight counted.
 * The suite, its meshes and its helpers: api_util.h. */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api_util.h"

/* ======================================================================= */
/* Log-probs of variable-length batches                                    */
/* ======================================================================= */

/* First-fit decreasing of `lens` into rows of `cap` tokens (the packing
 * the header and README describe): the number of micro-batches. */
static int64_t ffd_rows(const int64_t *lens, int64_t n, int64_t cap) {
  int64_t *l = xcalloc((size_t)n, sizeof *l), *fill = xcalloc((size_t)n, sizeof *fill), rows = 0;
  memcpy(l, lens, sizeof *l * (size_t)n);
  for (int64_t i = 1; i < n; i++) /* insertion sort, longest first */
    for (int64_t j = i; j > 0 && l[j] > l[j - 1]; j--) {
      int64_t t = l[j];
      l[j] = l[j - 1];
      l[j - 1] = t;
    }
  for (int64_t i = 0; i < n; i++) {
    int64_t j = 0;
    while (j < rows && fill[j] + l[i] > cap) j++;
    if (j == rows) fill[rows++] = 0;
    fill[j] += l[i];
  }
  free(l);
  free(fill);
  return rows;
}

/* Each sequence of b alone (n = 1 calls) on a one-rank session. */
static void score_alone(meshlm_session *self, const batch *b, float *out) {
  int rc = 0;
  for (int64_t k = 0; rc == 0 && k < b->n; k++) {
    meshlm_seqs one = {1, &b->lens[k], b->tok + tok_at(b, k)};
    float dummy;
    double sum = -1.0;
    float *o = b->lens[k] > 1 ? out + pred_at(b, k) : &dummy;
    rc = meshlm_logprobs(self, &one, NULL, o, &sum);
    if (rc == 0 && b->lens[k] == 1 && sum != 0.0) { /* no prediction: an empty sum */
      fprintf(stderr, "[rank %d] a length-1 sequence's seq_sums: %g\n", g_rank, sum);
      rc = -1;
    }
  }
  local_ok(self, rc, "scoring each sequence alone on MPI_COMM_SELF");
}

/* seq_sums against the test's own double sums of the same fp32 outputs:
 * both are sums of the same L − 1 values in double, each within
 * gamma64_{L−1}·Σ|out| of the exact sum in any order (R2). */
static void check_sums(const batch *b, const float *out, const double *sums) {
  for (int64_t k = 0, p = 0; k < b->n; p += b->lens[k] - 1, k++) {
    double s = 0, a = 0;
    for (int64_t t = 0; t < b->lens[k] - 1; t++) {
      s += out[p + t];
      a += fabs(out[p + t]);
    }
    if (fabs(sums[k] - s) > 2.0 * tol_gamma64((double)b->lens[k]) * a)
      fail_msg("seq_sums[%lld] = %.17g, the outputs sum to %.17g", (long long)k, sums[k], s);
  }
}

static void test_logprobs_packing(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  /* one micro-batch (4096 tokens), several (12: the 33-token sequence alone, the others in
   * rows of <= 12), and several without holding the parameters */
  const int64_t caps[3] = {4096, 12, 12};
  meshlm_session *s[3];
  for (int i = 0; i < 3; i++) {
    o.micro_batch_tokens = caps[i];
    o.unshard_for_inference = i < 2;
    s[i] = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  }
  meshlm_session *self = open_ok(g_fixture, NULL, MPI_COMM_SELF);
  meshlm_info in = info_of(s[0]);
  batch b = local_batch(in.dp_rank); /* each dp rank its own sequences */
  meshlm_seqs q = seqs_of(&b);
  int64_t P = b.npred, S = 33;
  float *ref = xcalloc((size_t)P, sizeof *ref), *got[3], *m = xcalloc((size_t)P, sizeof *m);
  double *sums = xcalloc((size_t)b.n, sizeof *sums);
  score_alone(self, &b, ref);
  /* packing runs the same kernels per document; the GEMM and attention tilings over other
   * token counts (and the mesh's tp/FSDP split against one rank) sum in other orders:
   * tolerance.h §3, relative L2 over the batch's log-probs */
  double tol = lp_tol(S);
  for (int i = 0; i < 3; i++) {
    got[i] = xcalloc((size_t)P, sizeof *got[i]);
    OK(s[i], meshlm_logprobs(s[i], &q, NULL, got[i], sums));
    double err = rel_l2(got[i], ref, P);
    printf("[rank %d] logprobs, micro_batch_tokens %lld, hold %d vs alone: rel L2 %.3g (bound "
           "%.3g)\n", g_rank, (long long)caps[i], i < 2, err, tol);
    assert_true(err <= tol);
    check_sums(&b, got[i], sums);

    meshlm_call_stats st = {.struct_size = sizeof st};
    OK(s[i], meshlm_last_call_stats(s[i], &st));
    assert_int_equal(st.micro_batches, max_all(ffd_rows(b.lens, b.n, caps[i])));
    assert_int_equal(st.tokens - st.padding, b.ntok); /* every token computed once */
    assert_true(st.padding >= 0);
    if (g_world == 1) assert_int_equal(st.padding, 0); /* no padding on one rank */
    /* forward only: no gradient reduce-scatters; under vocab parallelism (FSDP's group > 1
     * rank) the embedding's lookup is one reduce-scatter per micro-batch
     * (src/parallel/vocab.h) */
    assert_int_equal(st.fsdp_reduce_scatters, in.dp_shard > 1 ? st.micro_batches : 0);
    assert_int_equal(st.cp_collectives, 0);
    assert_int_equal(st.dp_replicate_collectives, 0);
    if (in.tp == 1) assert_int_equal(st.tp_collectives, 0);
    else assert_true(st.tp_collectives > 0);

    /* a mask: masked-out entries are 0 and left out of the sums; the rest is the same
     * call's output (the mask selects outputs of the same computation: TOL_EXACT) */
    OK(s[i], meshlm_logprobs(s[i], &q, b.mask, m, sums));
    for (int64_t t = 0; t < P; t++) {
      if (!b.mask[t] && m[t] != 0.0f) fail_msg("masked-out entry %lld = %g", (long long)t, m[t]);
      if (b.mask[t] && memcmp(&m[t], &got[i][t], sizeof(float)) != 0)
        fail_msg("entry %lld: %.9g with the mask, %.9g without", (long long)t, m[t], got[i][t]);
    }
    check_sums(&b, m, sums);
  }
  /* unshard_for_inference 0 vs 1: the same micro-batches; all-gathers are copies, so the
   * kernels see the same parameters (TOL_EXACT) */
  assert_memory_equal(got[1], got[2], sizeof(float) * (size_t)P);

  /* a dp rank passing no sequences (n = 0, NULL arrays) while the others score theirs */
  meshlm_seqs none = {0, NULL, NULL};
  int empty = in.dp_size > 1 && in.dp_rank == 1;
  OK(s[1], meshlm_logprobs(s[1], empty ? &none : &q, NULL, empty ? NULL : m, NULL));
  if (!empty) assert_true(rel_l2(m, ref, P) <= tol);
  /* and every rank none */
  OK(s[0], meshlm_logprobs(s[0], &none, NULL, NULL, NULL));

  for (int i = 0; i < 3; i++) {
    meshlm_close(s[i]);
    free(got[i]);
  }
  meshlm_close(self);
  free(ref);
  free(m);
  free(sums);
  batch_free(&b);
}

/* ======================================================================= */
/* Call statistics: FSDP all-gathers per micro-batch                       */
/* ======================================================================= */

/* On dp_shard = world (tp 1: four FSDP ranks on four). The header: one
 * all-gather per FSDP unit (a decoder layer, the root: units = layers + 1)
 * per micro-batch, or per call under unshard_for_inference, and under
 * vocab parallelism (FSDP's group > 1 rank) k = 2 more per micro-batch
 * (the token ids, lm_head's input). Calls of 1 and 3 micro-batches:
 *   held:   units + k·mb       → Δ = 2k
 *   unheld: (units + k)·mb     → Δ = 2(units + k)
 * A one-rank FSDP group gathers nothing (each "gathered" unit is its shard)
 * and has no vocab parallelism: every count 0. */
static void test_call_stats(void **state) {
  (void)state;
  meshlm_options o;
  meshlm_options_default(&o);
  o.micro_batch_tokens = 16;
  static const int64_t la[] = {8, 8}, lb[] = {16, 16, 16}; /* 1 and 3 rows of 16 */
  batch a = batch_make(la, 2, 70 + (uint64_t)g_rank), b = batch_make(lb, 3, 80 + (uint64_t)g_rank);
  float *out = xcalloc((size_t)b.npred, sizeof *out);
  int64_t units = g_layers + 1, k = g_world > 1 ? 2 : 0;
  for (int hold = 1; hold >= 0; hold--) {
    o.unshard_for_inference = hold;
    meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
    meshlm_info in = info_of(s);
    assert_int_equal(in.dp_shard, g_world);
    meshlm_call_stats sa = {.struct_size = sizeof sa}, sb = {.struct_size = sizeof sb};
    meshlm_seqs qa = seqs_of(&a), qb = seqs_of(&b);
    OK(s, meshlm_logprobs(s, &qa, NULL, out, NULL));
    OK(s, meshlm_last_call_stats(s, &sa));
    OK(s, meshlm_logprobs(s, &qb, NULL, out, NULL));
    OK(s, meshlm_last_call_stats(s, &sb));
    printf("[rank %d] hold %d: all-gathers %lld (1 micro-batch), %lld (3); units %lld, k %lld\n",
           g_rank, hold, (long long)sa.fsdp_all_gathers, (long long)sb.fsdp_all_gathers,
           (long long)units, (long long)k);
    assert_int_equal(sa.micro_batches, 1);
    assert_int_equal(sb.micro_batches, 3);
    /* every rank's rows equally long: no padding */
    assert_int_equal(sa.tokens, 16);
    assert_int_equal(sb.tokens, 48);
    assert_int_equal(sa.padding, 0);
    assert_int_equal(sb.padding, 0);
    if (g_world == 1) {
      assert_int_equal(sa.fsdp_all_gathers, 0);
      assert_int_equal(sb.fsdp_all_gathers, 0);
      assert_int_equal(sb.fsdp_bytes, 0);
    } else {
      int64_t want_a = hold ? units + k : units + k, want_b = hold ? units + 3 * k : 3 * (units + k);
      assert_int_equal(sb.fsdp_all_gathers - sa.fsdp_all_gathers,
                       hold ? 2 * k : 2 * (units + k));
      assert_int_equal(sa.fsdp_all_gathers, want_a);
      assert_int_equal(sb.fsdp_all_gathers, want_b);
      assert_true(sb.fsdp_bytes > sa.fsdp_bytes);
    }
    /* besides (src/parallel/vocab.h): the embedding lookup's reduce-scatter per
     * micro-batch, and the vocab-parallel log-softmax's statistics all-reduced over the
     * group, the same per micro-batch of the same length; no gradient reduce-scatters */
    assert_int_equal(sa.fsdp_reduce_scatters, k ? 1 : 0);
    assert_int_equal(sb.fsdp_reduce_scatters, k ? 3 : 0);
    assert_int_equal(sb.fsdp_all_reduces, 3 * sa.fsdp_all_reduces);
    if (k) assert_true(sa.fsdp_all_reduces > 0);
    else assert_int_equal(sa.fsdp_all_reduces, 0);
    for (int i = 0; i < 2; i++) {
      const meshlm_call_stats *st = i ? &sb : &sa;
      assert_int_equal(st->tp_collectives, 0);
      assert_int_equal(st->cp_collectives, 0);
      assert_int_equal(st->dp_replicate_collectives, 0);
    }
    meshlm_close(s);
  }
  free(out);
  batch_free(&a);
  batch_free(&b);
}

/* A NaN in row 0 of lm_head.weight (written by rank 0 into an export,
 * reloaded): every log-prob is NaN; meshlm_last_call_stats counts the
 * unmasked ones (the masked are 0), and 0 again at the fixture's weights. */
static void test_nonfinite_logprobs(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  char dir[4200], path[4300];
  tmp_path(dir, sizeof dir, "nan_lm_head");
  OK(s, meshlm_export(s, dir, MESHLM_DTYPE_F32));
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  if (g_rank == 0) {
    st_file f;
    st_open(path, &f);
    const char *dt;
    int nd;
    int64_t shape[2];
    size_t nb;
    const unsigned char *w = st_tensor(&f, "lm_head.weight", &dt, &nd, shape, &nb);
    if (!w || strcmp(dt, "F32") != 0) fail_msg("%s: no F32 lm_head.weight", path);
    float nan = NAN;
    memcpy(f.buf + (w - f.buf), &nan, sizeof nan);
    FILE *fp = fopen(path, "wb");
    if (!fp || fwrite(f.buf, 1, f.size, fp) != f.size || fclose(fp) != 0)
      fail_msg("cannot write %s", path);
    st_close(&f);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  OK(s, meshlm_reload(s, dir));
  batch b = local_batch(info_of(s).dp_rank);
  meshlm_seqs q = seqs_of(&b);
  uint8_t *mask = xcalloc((size_t)b.npred, 1);
  int64_t unmasked = 0;
  for (int64_t t = 0; t < b.npred; t++) unmasked += mask[t] = t % 3 != 0;
  float *out = xcalloc((size_t)b.npred, sizeof *out);
  meshlm_call_stats st = {.struct_size = sizeof st};
  OK(s, meshlm_logprobs(s, &q, mask, out, NULL));
  OK(s, meshlm_last_call_stats(s, &st));
  for (int64_t t = 0; t < b.npred; t++)
    if (mask[t] ? !isnan(out[t]) : out[t] != 0.0f)
      fail_msg("entry %lld (mask %d): %g", (long long)t, mask[t], (double)out[t]);
  assert_int_equal(st.nonfinite_logprobs, unmasked);
  OK(s, meshlm_reload(s, g_fixture));
  OK(s, meshlm_logprobs(s, &q, NULL, out, NULL));
  OK(s, meshlm_last_call_stats(s, &st));
  assert_int_equal(st.nonfinite_logprobs, 0);
  free(mask);
  free(out);
  batch_free(&b);
  meshlm_close(s);
}

/* ======================================================================= */

int main(int argc, char **argv) {
  api_init(&argc, &argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_logprobs_packing),
      cmocka_unit_test(test_call_stats),
      cmocka_unit_test(test_nonfinite_logprobs),
  };
  return api_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
