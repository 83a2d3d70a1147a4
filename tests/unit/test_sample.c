/* The sampler (engine/sample.h) against an exact reference of
 * transformers' warpers, computed here in double with a sort (the
 * reference may sort; the sampler does not): TemperatureLogitsWarper
 * (scores / T), TopKLogitsWarper (scores below the top_k-th largest to
 * −inf), TopPLogitsWarper (ascending sort of the softmax, tokens whose
 * cumulative probability is <= 1 − top_p removed, the most probable kept),
 * MinPLogitsWarper (probabilities below min_p · the largest removed), then
 * the softmax of what is left.
 *
 * Statistics: D draws of one row, each from its own stream. A token of
 * reference probability p is drawn c ~ Binomial(D, p) times: mean D·p,
 * sigma = sqrt(D·p·(1 − p)). The bound is |c − D·p| <= 5·sigma, whose
 * two-sided normal tail is 5.7e-7 per token; over the <= 5 configurations x
 * 40 tokens checked, a correct sampler fails with probability < 1.2e-4 (and
 * the streams are fixed, so a run is reproducible). A token of reference
 * probability 0 is never drawn (asserted exactly). With D = 100000 a
 * warper that kept one wrong token of probability 0.01, or moved 0.01 of
 * mass between two tokens of p ~ 0.1, shifts a count by >= 1000 > 5·sigma
 * (<= 5·sqrt(100000·0.25) = 791). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/status.h"
#include "engine/sample.h"

enum { V = 40, D = 100000, CHUNK = 1000 };

/* Logits with structure: a few heavy tokens, a long tail, and (tie = 1)
 * tokens 7 and 11 equal to token 3 (ties at top_k's edge). */
static void make_logits(float *l, int tie) {
  for (int i = 0; i < V; i++) l[i] = (float)(2.5 * sin(0.9 * i) + 0.05 * i);
  if (tie) l[7] = l[11] = l[3];
}

static int by_value_desc(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x < y) - (x > y);
}

/* softmax of s [V] over the entries that are not −inf into p */
static void softmax(const double *s, double *p) {
  double mx = -INFINITY, sum = 0.0;
  for (int i = 0; i < V; i++) mx = fmax(mx, s[i]);
  for (int i = 0; i < V; i++) sum += p[i] = isinf(s[i]) ? 0.0 : exp(s[i] - mx);
  for (int i = 0; i < V; i++) p[i] /= sum;
}

/* The reference distribution p [V] of the warpers of s on logits l. */
static void reference(const float *l, const ml_sampler *s, double *p) {
  double sc[V], sorted[V];
  for (int i = 0; i < V; i++) sc[i] = (double)l[i] / s->temperature;
  if (s->top_k > 0 && s->top_k < V) {
    memcpy(sorted, sc, sizeof sc);
    qsort(sorted, V, sizeof *sorted, by_value_desc);
    for (int i = 0; i < V; i++)
      if (sc[i] < sorted[s->top_k - 1]) sc[i] = -INFINITY;
  }
  if (s->top_p < 1.0f) {
    double q[V];
    softmax(sc, q);
    /* cumulative probability, ascending, of the tokens up to and including i: the mass of
       the tokens lighter than i (no ties among the kept in these logits) plus q[i] */
    for (int i = 0; i < V; i++) {
      double cum = 0.0;
      for (int j = 0; j < V; j++)
        if (q[j] <= q[i]) cum += q[j];
      if (q[i] > 0.0 && cum <= 1.0 - s->top_p) sc[i] = -INFINITY;
    }
  }
  if (s->min_p > 0.0f) {
    double q[V], top = 0.0;
    softmax(sc, q);
    for (int i = 0; i < V; i++) top = fmax(top, q[i]);
    for (int i = 0; i < V; i++)
      if (q[i] < s->min_p * top) sc[i] = -INFINITY;
  }
  softmax(sc, p);
}

/* D draws against the reference: counts within 5 sigma, zero-probability
 * tokens never drawn; each draw's log-prob log_softmax(l)[tok] to the
 * rounding of its float result: |lp − exact| <= 2^-24·|exact| (the
 * double computation's own error ~1e-15 relative is far below). */
static void check_distribution(const float *l, const ml_sampler *s, uint64_t seed) {
  double p[V], mx = -INFINITY, se = 0.0;
  reference(l, s, p);
  for (int i = 0; i < V; i++) mx = fmax(mx, l[i]);
  for (int i = 0; i < V; i++) se += exp((double)l[i] - mx);
  int64_t count[V] = {0}, row_of[CHUNK] = {0};
  ml_rng rng[CHUNK];
  int32_t tok[CHUNK];
  float lp[CHUNK], *work = malloc(sizeof(float) * CHUNK * 2 * V);
  assert_non_null(work);
  for (int64_t d0 = 0; d0 < D; d0 += CHUNK) {
    for (int d = 0; d < CHUNK; d++) rng[d] = ml_rng_seed(seed + (uint64_t)(d0 + d));
    ml_sample_rows(l, row_of, CHUNK, V, s, rng, work, tok, lp);
    for (int d = 0; d < CHUNK; d++) {
      assert_true(tok[d] >= 0 && tok[d] < V);
      count[tok[d]]++;
      double exact = (double)l[tok[d]] - mx - log(se);
      assert_true(fabs(lp[d] - exact) <= ldexp(fabs(exact), -24));
    }
  }
  free(work);
  double worst = 0.0;
  for (int i = 0; i < V; i++) {
    if (p[i] == 0.0) {
      if (count[i] != 0)
        fail_msg("token %d: reference probability 0, drawn %lld times", i, (long long)count[i]);
      continue;
    }
    double sigma = sqrt((double)D * p[i] * (1.0 - p[i])), z = fabs(count[i] - D * p[i]) / sigma;
    worst = fmax(worst, z);
    if (z > 5.0)
      fail_msg("token %d: drawn %lld times of %d, the reference %.1f (p %.5f, %.2f sigma)", i,
               (long long)count[i], D, D * p[i], p[i], z);
  }
  printf("T %g top_k %lld top_p %g min_p %g: worst deviation %.2f sigma (bound 5)\n",
         (double)s->temperature, (long long)s->top_k, (double)s->top_p, (double)s->min_p, worst);
}

static void test_warpers(void **state) {
  (void)state;
  float l[V];
  make_logits(l, 0);
  const ml_sampler cases[] = {
      {.temperature = 1.0f, .top_p = 1.0f},
      {.temperature = 0.7f, .top_k = 5, .top_p = 1.0f},
      {.temperature = 1.3f, .top_p = 0.8f},
      {.temperature = 1.0f, .top_p = 1.0f, .min_p = 0.1f},
      {.temperature = 0.9f, .top_k = 12, .top_p = 0.85f, .min_p = 0.05f},
  };
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
    check_distribution(l, &cases[c], 1000 * (uint64_t)c);
}

/* top_k keeps every token tied with the k-th largest (TopKLogitsWarper's
 * `scores < kth` mask): tokens 3, 7, 11 tie; with top_k at the rank of the
 * first of them all three are kept. */
static void test_top_k_ties(void **state) {
  (void)state;
  float l[V];
  make_logits(l, 1);
  int64_t rank = 1; /* 1-based rank of token 3 among the logits, descending */
  for (int i = 0; i < V; i++) rank += l[i] > l[3];
  ml_sampler s = {.temperature = 1.0f, .top_k = rank, .top_p = 1.0f};
  double p[V];
  reference(l, &s, p);
  assert_true(p[3] > 0.0 && p[7] > 0.0 && p[11] > 0.0);
  check_distribution(l, &s, 77);
}

/* Greedy: the argmax, the lowest id on ties, whatever the stream; a
 * nucleus that keeps one token is the argmax too. */
static void test_greedy(void **state) {
  (void)state;
  float l[V];
  make_logits(l, 0);
  int arg = 0;
  for (int i = 1; i < V; i++) arg = l[i] > l[arg] ? i : arg;
  l[arg + 1 < V ? arg + 1 : arg - 1] = l[arg]; /* a tie with a neighbour */
  int lowest = arg + 1 < V ? arg : arg - 1;
  ml_sampler g = {.greedy = true};
  ml_rng rng = ml_rng_seed(3);
  int32_t tok;
  float lp;
  ml_sample_rows(l, NULL, 1, V, &g, &rng, NULL, &tok, &lp);
  assert_int_equal(tok, lowest);
  ml_sampler one = {.temperature = 1.0f, .top_p = 1e-6f};
  float work[2 * V];
  for (uint64_t seed = 0; seed < 50; seed++) {
    rng = ml_rng_seed(seed);
    ml_sample_rows(l, NULL, 1, V, &one, &rng, work, &tok, &lp);
    assert_true(tok == lowest || tok == (arg + 1 < V ? arg + 1 : arg)); /* the tied pair */
  }
}

/* Argument checks name the field, the value and the range. */
static void test_check(void **state) {
  (void)state;
  const struct {
    ml_sampler s;
    const char *want;
  } bad[] = {
      {{.temperature = 0.0f, .top_p = 1.0f}, "temperature 0"},
      {{.temperature = NAN, .top_p = 1.0f}, "temperature nan"},
      {{.temperature = 1.0f, .top_k = -2, .top_p = 1.0f}, "top_k -2"},
      {{.temperature = 1.0f, .top_p = 0.0f}, "top_p 0"},
      {{.temperature = 1.0f, .top_p = 1.0f, .min_p = -0.5f}, "min_p -0.5"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    ml_error_clear();
    assert_int_equal(ml_sampler_check(&bad[i].s, "test"), -1);
    if (!strstr(ml_error_msg(), bad[i].want))
      fail_msg("expected \"%s\" in \"%s\"", bad[i].want, ml_error_msg());
  }
  ml_sampler greedy = {.greedy = true};
  assert_int_equal(ml_sampler_check(&greedy, "test"), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_warpers),
      cmocka_unit_test(test_top_k_ties),
      cmocka_unit_test(test_greedy),
      cmocka_unit_test(test_check),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
