/* test_api_topk: meshlm_score's entropy and top-k log-probs.
 *  - against the fixture's float64 transformers reference
 *    (tests/fixtures/llama_untied/scores.json, tools/gen_score_fixtures.py)
 *    on the world mesh (tp 2 × dp_shard 2 on four ranks: vocab parallelism
 *    over tp and the FSDP group; one rank alone) and on dp_shard = world
 *    (vocab parallelism over a four-rank FSDP group): the entropy, the top-k
 *    log-probs and ids, bounds from tolerance.h §3;
 *  - the log-probs meshlm_score writes bitwise meshlm_logprobs's, and a
 *    top-k entry of the next token bitwise its log-prob there;
 *  - k = vocab_size: every token once per position, best first
 *    (log-probs non-increasing), the top-5 a bitwise prefix of it; the mask;
 *  - the errors: topk out of range, missing arrays, struct_size;
 *  - the entropy bonus (meshlm_loss.entropy_coef): the step's loss is the
 *    same step's without it minus c·H̄, and step_result.entropy is H̄ as
 *    meshlm_score's entropies give it (normalised as the loss), token and
 *    sequence level. (Its gradient on the logits against a double
 *    reference: tests/unit/test_xent_scores.c.)
 * The suite, its meshes and its helpers: api_util.h. */

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api_util.h"

/* The fixture's sequences (expected.json input_ids) and scores.json. */
typedef struct ref {
  batch b;
  int64_t k;
  double *ent, *weight, *gaps, *lp; /* [P], [P], [P], [P, k] */
  int32_t *ids;              /* [P, k] */
} ref;

static json_t *load(const char *file) {
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", g_fixture, file);
  json_error_t err;
  json_t *j = json_load_file(path, 0, &err);
  if (!j) fail_msg("%s: %s", path, err.text);
  return j;
}

/* j[key][b][t] as a double */
static double at2(json_t *j, const char *key, int64_t b, int64_t t) {
  return json_real_value(json_array_get(json_array_get(json_object_get(j, key), b), t));
}

static ref ref_load(void) {
  ref r = {0};
  json_t *ex = load("expected.json"), *sc = load("scores.json");
  json_t *rows = json_object_get(ex, "input_ids");
  int64_t B = (int64_t)json_array_size(rows), S = (int64_t)json_array_size(json_array_get(rows, 0));
  int64_t *lens = xcalloc((size_t)B, sizeof *lens);
  for (int64_t b = 0; b < B; b++) lens[b] = S;
  r.b = batch_make(lens, B, 1);
  free(lens);
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < S; t++)
      r.b.tok[b * S + t] = (int32_t)json_integer_value(json_array_get(json_array_get(rows, b), t));
  r.k = json_integer_value(json_object_get(sc, "k"));
  int64_t P = r.b.npred;
  r.ent = xcalloc((size_t)P, sizeof *r.ent);
  r.weight = xcalloc((size_t)P, sizeof *r.weight);
  r.gaps = xcalloc((size_t)P, sizeof *r.gaps);
  r.lp = xcalloc((size_t)(P * r.k), sizeof *r.lp);
  r.ids = xcalloc((size_t)(P * r.k), sizeof *r.ids);
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < S - 1; t++) {
      int64_t i = b * (S - 1) + t;
      r.ent[i] = at2(sc, "entropy", b, t);
      r.weight[i] = at2(sc, "weight", b, t);
      r.gaps[i] = at2(sc, "gaps", b, t);
      json_t *li = json_array_get(json_array_get(json_object_get(sc, "topk_logprobs"), b), t);
      json_t *ii = json_array_get(json_array_get(json_object_get(sc, "topk_ids"), b), t);
      for (int64_t c = 0; c < r.k; c++) {
        r.lp[i * r.k + c] = json_real_value(json_array_get(li, c));
        r.ids[i * r.k + c] = (int32_t)json_integer_value(json_array_get(ii, c));
      }
    }
  json_decref(ex);
  json_decref(sc);
  return r;
}

static void ref_free(ref *r) {
  batch_free(&r->b);
  free(r->ent);
  free(r->weight);
  free(r->gaps);
  free(r->lp);
  free(r->ids);
}

typedef struct scored {
  float *lp, *ent, *tlp;
  int32_t *tid;
  double *sums;
} scored;

static scored score_ok(meshlm_session *s, const batch *b, const uint8_t *mask, int32_t k) {
  scored o = {xcalloc((size_t)b->npred, sizeof(float)), xcalloc((size_t)b->npred, sizeof(float)),
              xcalloc((size_t)(b->npred * k), sizeof(float)),
              xcalloc((size_t)(b->npred * k), sizeof(int32_t)),
              xcalloc((size_t)b->n, sizeof(double))};
  meshlm_scores req = {.struct_size = sizeof req, .logprobs = o.lp, .seq_sums = o.sums,
                       .entropy = o.ent, .topk = k, .topk_logprobs = o.tlp, .topk_ids = o.tid};
  meshlm_seqs q = seqs_of(b);
  OK(s, meshlm_score(s, &q, mask, &req));
  return o;
}

static void scored_free(scored *o) {
  free(o->lp);
  free(o->ent);
  free(o->tlp);
  free(o->tid);
  free(o->sums);
}

/* Each list best first: log-probs non-increasing (the logits' order,
 * equal logits by id — two logits a rounding apart may give one log-prob,
 * so the ids of equal log-probs are not ordered; the tie rule on equal
 * logits: tests/unit/test_xent_scores.c). */
static void assert_sorted(const scored *o, int64_t P, int64_t k) {
  for (int64_t i = 0; i < P; i++)
    for (int64_t c = 1; c < k; c++) assert_true(o->tlp[i * k + c - 1] >= o->tlp[i * k + c]);
}

/* On session s (what: its mesh): the reference checks of the header. */
static void against_reference(meshlm_session *s, const char *what) {
  ref r = ref_load();
  int64_t P = r.b.npred, k = r.k, S = r.b.lens[0];
  scored o = score_ok(s, &r.b, NULL, (int32_t)k);
  /* meshlm_logprobs on the same session: the same forward, bit for bit */
  float *lp = xcalloc((size_t)P, sizeof *lp);
  meshlm_seqs q = seqs_of(&r.b);
  OK(s, meshlm_logprobs(s, &q, NULL, lp, NULL));
  assert_memory_equal(lp, o.lp, sizeof *lp * (size_t)P);
  assert_sorted(&o, P, k);
  /* tolerance.h §3: meshlm's log-probs within eps (relative) of the
   * reference's, every vocabulary entry through the same chain as the
   * targets' (lm_head, log-softmax) */
  tol_model m = g_sizes;
  m.seq = (double)S;
  double eps = tol_model_vs_ref(&m, TOL_LOGPROBS);
  /* the entropy: dH/dlog p_v = −p_v(1 + log p_v), so log-prob errors of at
   * most eps·|log p_v| move H by at most eps·weight (scores.json, first
   * order); its own roundings, of two same-signed terms log(se) and −sl/se
   * (xent_entropy.c): sl a sum of V terms, each an expf (TOL_LIBM) of a
   * rounded difference times it, log and the quotient: relative
   * gamma(V + 2·TOL_LIBM + 4) of H */
  double dn = 0, wn = 0, hn = 0;
  for (int64_t i = 0; i < P; i++) {
    double d = o.ent[i] - r.ent[i];
    dn += d * d;
    wn += r.weight[i] * r.weight[i];
    hn += r.ent[i] * r.ent[i];
  }
  double hb = eps * sqrt(wn) + tol_gamma(g_sizes.vocab + 2.0 * TOL_LIBM + 4.0) * sqrt(hn);
  /* the top-k log-probs: the c-th largest of perturbed values moves by
   * at most the largest perturbation, so rank by rank within eps of the
   * reference whatever the ids (ties included). The ids: a position's
   * order is rounding-proof where its k + 1 best differ by more than both
   * sides' errors, 2·eps·|log p| <= 2·eps·lmax (scores.json gaps): there
   * they are the reference's exactly (at least one such position, so that
   * the check bites) */
  double lmax = 0, ln = 0, lr = 0;
  for (int64_t i = 0; i < P * k; i++) {
    lmax = fabs(r.lp[i]) > lmax ? fabs(r.lp[i]) : lmax;
    double d = o.tlp[i] - r.lp[i];
    ln += d * d;
    lr += r.lp[i] * r.lp[i];
  }
  int64_t fixed = 0, same = 0;
  for (int64_t i = 0; i < P; i++) {
    if (!(r.gaps[i] > 2.0 * eps * lmax)) continue;
    fixed++;
    same += !memcmp(&o.tid[i * k], &r.ids[i * k], sizeof(int32_t) * (size_t)k);
  }
  printf("[rank %d] %s: entropy |d|_2 %.3g (bound %.3g); top-%lld log-probs rel L2 %.3g "
         "(bound %.3g); ids as the reference's at %lld of the %lld rounding-proof positions (of "
         "%lld)\n",
         g_rank, what, sqrt(dn), hb, (long long)k, sqrt(ln / lr), eps, (long long)same,
         (long long)fixed, (long long)P);
  assert_true(sqrt(dn) <= hb);
  assert_true(sqrt(ln / lr) <= eps);
  assert_true(fixed > 0);
  assert_int_equal(same, fixed);
  free(lp);
  scored_free(&o);
  ref_free(&r);
}

static void test_reference_world(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  against_reference(s, g_world > 1 ? "tp 2 x dp_shard 2" : "one rank");
  meshlm_close(s);
}

static void test_reference_fsdp_group(void **state) {
  (void)state;
  meshlm_options o;
  meshlm_options_default(&o);
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  against_reference(s, g_world > 1 ? "dp_shard 4" : "one rank, dp_shard 1");
  meshlm_close(s);
}

/* tp 2 × dp_replicate 2 on four ranks (the logits vocab-sharded over tp
 * only: no FSDP group to split over) and dp_replicate = world (no vocab
 * parallelism: every rank its whole rows). */
static void test_reference_replicate(void **state) {
  (void)state;
  meshlm_options o;
  meshlm_options_default(&o);
  o.tp = g_world % 2 == 0 ? 2 : 1;
  o.dp_replicate = g_world / o.tp;
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  against_reference(s, g_world > 1 ? "tp 2 x dp_replicate 2" : "one rank, dp_replicate 1");
  meshlm_close(s);
  o.tp = 1;
  o.dp_replicate = g_world;
  s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  against_reference(s, g_world > 1 ? "dp_replicate 4" : "one rank, dp_replicate 1");
  meshlm_close(s);
}

/* k = vocab_size: each position's list is a permutation of the vocabulary
 * (the merge over the shards loses and repeats nothing), best first, the
 * next token's entry bitwise its log-prob (the same fp32 logit − max, then
 * − log(se) in fp64); the top-5 call's lists are its prefixes bit for bit
 * (one total order); with a mask, the masked entries are 0 / −1 and the
 * others unchanged. */
static void test_full_vocabulary(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  static const int64_t lens[] = {9, 1, 14};
  batch b = batch_make(lens, 3, 7);
  int32_t V = (int32_t)g_vocab, k = 5;
  scored full = score_ok(s, &b, NULL, V), top = score_ok(s, &b, NULL, k);
  assert_sorted(&full, b.npred, V);
  char *seen = xcalloc((size_t)V, 1);
  for (int64_t q = 0; q < b.n; q++)
    for (int64_t t = 0; t + 1 < b.lens[q]; t++) {
      int64_t i = pred_at(&b, q) + t, c = 0;
      while (c < V && full.tid[i * V + c] != b.tok[tok_at(&b, q) + t + 1]) c++;
      assert_true(c < V);
      assert_memory_equal(&full.tlp[i * V + c], &full.lp[i], sizeof(float));
    }
  for (int64_t i = 0; i < b.npred; i++) {
    memset(seen, 0, (size_t)V);
    for (int64_t c = 0; c < V; c++) {
      int32_t id = full.tid[i * V + c];
      assert_true(id >= 0 && id < V && !seen[id]);
      seen[id] = 1;
    }
    assert_memory_equal(&full.tlp[i * V], &top.tlp[i * k], sizeof(float) * (size_t)k);
    assert_memory_equal(&full.tid[i * V], &top.tid[i * k], sizeof(int32_t) * (size_t)k);
  }
  scored masked = score_ok(s, &b, b.mask, k);
  for (int64_t i = 0; i < b.npred; i++) {
    bool on = b.mask[i];
    assert_true(on ? masked.ent[i] == top.ent[i] : masked.ent[i] == 0.0f);
    for (int64_t c = 0; c < k; c++) {
      assert_true(on ? masked.tid[i * k + c] == top.tid[i * k + c] : masked.tid[i * k + c] == -1);
      assert_true(on ? masked.tlp[i * k + c] == top.tlp[i * k + c]
                     : masked.tlp[i * k + c] == 0.0f);
    }
  }
  free(seen);
  scored_free(&masked);
  scored_free(&top);
  scored_free(&full);
  batch_free(&b);
  meshlm_close(s);
}

static void test_errors(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  static const int64_t lens[] = {5};
  batch b = batch_make(lens, 1, 3);
  meshlm_seqs q = seqs_of(&b);
  float lp[4], tlp[8];
  int32_t tid[8];
  meshlm_scores r = {.struct_size = sizeof r, .logprobs = lp, .topk = -1};
  expect_fail(s, meshlm_score(s, &q, NULL, &r), "topk -1; expected 0 .. vocab_size",
              "topk -1");
  r.topk = (int32_t)g_vocab + 1;
  expect_fail(s, meshlm_score(s, &q, NULL, &r), "expected 0 .. vocab_size", "topk > V");
  r.topk = 2;
  expect_fail(s, meshlm_score(s, &q, NULL, &r), "topk_logprobs or topk_ids NULL", "no arrays");
  r.topk_logprobs = tlp;
  r.topk_ids = tid;
  r.struct_size = 8;
  expect_fail(s, meshlm_score(s, &q, NULL, &r), "meshlm_scores.struct_size 8", "struct_size");
  expect_fail(s, meshlm_score(s, &q, NULL, NULL), "meshlm_score: out is NULL", "out NULL");
  r.struct_size = sizeof r;
  OK(s, meshlm_score(s, &q, NULL, &r)); /* the session still works */
  batch_free(&b);
  meshlm_close(s);
}

/* H̄ of g's masked predictions at s's weights, normalised as the loss (seq:
 * sequence level), and its bound against a training forward's: each H_t
 * within eps·Σ p|lp||1 + lp| (the pair bound eps of two fp32 forwards,
 * propagated as at against_reference; the weights from k = V lists) plus
 * both sides' own roundings (2·gamma(V + 2·TOL_LIBM + 4 + max|lp|)·H_t),
 * averaged with the same nonnegative weights. */
static double mean_entropy(meshlm_session *s, const gbatch *g, bool seq, double *bound) {
  const batch *b = &g->all;
  int32_t V = (int32_t)g_vocab;
  scored o = score_ok(s, b, NULL, V);
  tol_model m = g_sizes;
  for (int64_t q = 0; q < b->n; q++) m.seq = fmax(m.seq, (double)b->lens[q]); /* keys per query */
  double eps = tol_model_pair(&m, TOL_LOGPROBS), num = 0, bnum = 0, den = 0;
  for (int64_t q = 0; q < b->n; q++) {
    double sn = 0, sb = 0, sd = 0;
    for (int64_t t = 0; t + 1 < b->lens[q]; t++) {
      int64_t i = pred_at(b, q) + t;
      if (!b->mask[i]) continue;
      double w = 0, lmax = 0;
      for (int64_t c = 0; c < V; c++) {
        double lp = o.tlp[i * V + c];
        w += exp(lp) * fabs(lp) * fabs(1.0 + lp);
        lmax = fmax(lmax, fabs(lp));
      }
      sn += o.ent[i];
      sb += eps * w + 2.0 * tol_gamma(V + 2.0 * TOL_LIBM + 4.0 + lmax) * o.ent[i];
      sd += 1.0;
    }
    if (seq && sd > 0) num += sn / sd, bnum += sb / sd, den += 1.0;
    if (!seq) num += sn, bnum += sb, den += sd;
  }
  scored_free(&o);
  *bound = bnum / den;
  return num / den;
}

static void test_entropy_bonus(void **state) {
  (void)state;
  gbatch g = gbatch_make(41);
  garr a = {g.all.mask, NULL, NULL, NULL, NULL};
  meshlm_options o = mesh_opts();
  const double coef = (double)0.3f; /* the loss field is a float */
  for (int seq = 0; seq < 2; seq++) {
    meshlm_session *plain = open_ok(g_fixture, &o, MPI_COMM_WORLD);
    meshlm_session *bonus = open_ok(g_fixture, &o, MPI_COMM_WORLD);
    double hb, h = mean_entropy(bonus, &g, seq, &hb);
    meshlm_loss l;
    meshlm_loss_default(&l);
    l.sequence_level = seq;
    meshlm_step_result r0 = {.struct_size = sizeof r0}, r1 = {.struct_size = sizeof r1};
    OK(plain, step_share(plain, &g, &a, &l, &r0));
    l.entropy_coef = (float)coef;
    OK(bonus, step_share(bonus, &g, &a, &l, &r1));
    /* the objective's terms are the same (the same forward) and summed in
     * fp64 with −c·w·H interleaved: within gamma64(2n + 2) of their
     * absolute sum (R2), n the masked predictions */
    double lb = tol_gamma64(2.0 * (double)g.all.npred + 2.0) * (fabs(r0.loss) + coef * r1.entropy);
    double dl = fabs(r1.loss + coef * r1.entropy - r0.loss);
    printf("[rank %d] entropy bonus c = %g (%s level): loss %.9g = %.9g − c·%.9g (|d| %.3g, "
           "bound %.3g); entropy vs scoring %.9g (|d| %.3g, bound %.3g); without it %g\n",
           g_rank, coef, seq ? "sequence" : "token", r1.loss, r0.loss, r1.entropy, dl, lb, h,
           fabs(r1.entropy - h), hb, r0.entropy);
    assert_true(dl <= lb);
    assert_true(fabs(r1.entropy - h) <= hb);
    assert_true(r0.entropy == 0.0);
    meshlm_close(bonus);
    meshlm_close(plain);
  }
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_loss l;
  meshlm_loss_default(&l);
  l.entropy_coef = NAN;
  meshlm_step_result r = {.struct_size = sizeof r};
  expect_fail(s, step_share(s, &g, &a, &l, &r), "loss.entropy_coef nan; expected a finite",
              "entropy_coef NaN");
  meshlm_close(s);
  batch_free(&g.all);
}

int main(int argc, char **argv) {
  api_init(&argc, &argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_reference_world),
      cmocka_unit_test(test_reference_fsdp_group),
      cmocka_unit_test(test_reference_replicate),
      cmocka_unit_test(test_full_vocabulary),
      cmocka_unit_test(test_errors),
      cmocka_unit_test(test_entropy_bonus),
  };
  return api_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
