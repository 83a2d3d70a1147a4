/* Drawing the next token of each row (sample.h). */
#include "engine/sample.h"

#include <math.h>

#include "common/status.h"

int ml_sampler_check(const ml_sampler *s, const char *who) {
  if (s->greedy) return 0;
  if (!(s->temperature > 0.0f && isfinite(s->temperature)))
    return ml_err("%s: temperature %g; expected a finite value > 0 (or greedy)", who,
                  (double)s->temperature);
  if (s->top_k < 0)
    return ml_err("%s: top_k %lld; expected >= 0 (0: off)", who, (long long)s->top_k);
  if (!(s->top_p > 0.0f && s->top_p <= 1.0f))
    return ml_err("%s: top_p %g; expected in (0, 1] (1: off)", who, (double)s->top_p);
  if (!(s->min_p >= 0.0f && s->min_p <= 1.0f))
    return ml_err("%s: min_p %g; expected in [0, 1] (0: off)", who, (double)s->min_p);
  return 0;
}

/* a [n] partitioned in place around v: [0, *hi) > v, [*hi, *lo) == v, [*lo, n) < v
 * (Dijkstra's three-way partition). */
static void partition3(float *a, int64_t n, float v, int64_t *hi, int64_t *lo) {
  int64_t h = 0, i = 0, l = n;
  while (i < l) {
    float x = a[i];
    if (x > v) {
      a[i++] = a[h];
      a[h++] = x;
    } else if (x < v) {
      a[i] = a[--l];
      a[l] = x;
    } else {
      i++;
    }
  }
  *hi = h;
  *lo = l;
}

/* The median of a's first, middle and last values: a deterministic pivot. */
static float pivot_of(const float *a, int64_t n) {
  float x = a[0], y = a[n / 2], z = a[n - 1];
  if (x > y) {
    float t = x;
    x = y;
    y = t;
  }
  return z < x ? x : z > y ? y : z;
}

/* The k-th largest of a [n] (1 <= k <= n), a reordered (quickselect). */
static float kth_largest(float *a, int64_t n, int64_t k) {
  for (;;) {
    int64_t hi, lo;
    float v = pivot_of(a, n);
    partition3(a, n, v, &hi, &lo);
    if (k <= hi) {
      n = hi; /* among the heavier */
    } else if (k <= lo) {
      return v;
    } else {
      a += lo;
      k -= lo;
      n -= lo;
    }
  }
}

static double mass(const float *a, int64_t n) {
  double m = 0.0;
  for (int64_t i = 0; i < n; i++) m += a[i];
  return m;
}

/* The lightest weight w* of a [n] (weights > 0, a reordered) such that the
 * weights strictly heavier than w* hold < target (0 < target): the
 * threshold of the nucleus, found by quickselect over mass. `heavier`
 * counts the mass known to lie above the remaining range. */
static float nucleus_threshold(float *a, int64_t n, double target) {
  double heavier = 0.0;
  for (;;) {
    int64_t hi, lo;
    float v = pivot_of(a, n);
    partition3(a, n, v, &hi, &lo);
    double above = heavier + mass(a, hi);
    if (above >= target) { /* v is cut: the threshold lies among the heavier, not empty as
                              heavier < target <= above */
      n = hi;
      continue;
    }
    double through = above + mass(a + hi, lo - hi);
    if (through >= target || lo == n) return v; /* every lighter one is cut */
    heavier = through;
    a += lo;
    n -= lo;
  }
}

/* One row: see ml_sample_rows; w, sel [V] scratch. */
static int32_t sample_row(const float *l, int64_t V, const ml_sampler *s, ml_rng *rng, float *w,
                          float *sel, float *lp) {
  int64_t arg = 0;
  for (int64_t i = 1; i < V; i++) arg = l[i] > l[arg] ? i : arg;
  double mx = l[arg], se = 0.0;
  /* at temperature 1 the weights are the log-sum-exp's terms: one pass of exp for both (the
     same doubles summed in the same order as the other pass: the same se) */
  bool unit = !s->greedy && s->temperature == 1.0f;
  for (int64_t i = 0; i < V; i++) {
    double e = exp((double)l[i] - mx);
    se += e;
    if (unit) w[i] = (float)e;
  }
  int64_t tok = arg;
  if (!s->greedy) {
    double inv_t = 1.0 / (double)s->temperature;
    for (int64_t i = 0; i < V && !unit; i++) w[i] = (float)exp(((double)l[i] - mx) * inv_t);
    /* every threshold keeps the heaviest token, whose weight is exp(0) = 1 */
    float tau = 0.0f;
    if (s->top_k > 0 && s->top_k < V) {
      for (int64_t i = 0; i < V; i++) sel[i] = w[i];
      tau = kth_largest(sel, V, s->top_k);
    }
    if (s->top_p < 1.0f) { /* over the tokens top_k kept, renormalised */
      int64_t n = 0;
      for (int64_t i = 0; i < V; i++)
        if (w[i] >= tau) sel[n++] = w[i];
      tau = nucleus_threshold(sel, n, (double)s->top_p * mass(sel, n));
    }
    /* min_p: p_i >= min_p · p_max, i.e. w_i >= min_p · 1 */
    if (s->min_p > tau) tau = s->min_p;
    double kept = 0.0;
    for (int64_t i = 0; i < V; i++)
      if (w[i] >= tau) kept += w[i];
    /* the walk adds the same weights in the same order, so it ends inside the kept mass;
       the heaviest token is kept, so a walk that rounding carried past the end keeps it */
    double u = ml_rng_uniform(rng) * kept, acc = 0.0;
    tok = arg;
    for (int64_t i = 0; i < V; i++) {
      if (w[i] < tau) continue;
      acc += w[i];
      if (u < acc) {
        tok = i;
        break;
      }
    }
  }
  *lp = (float)((double)l[tok] - mx - log(se));
  return (int32_t)tok;
}

void ml_sample_rows(const float *logits, const int64_t *row_of, int64_t draws, int64_t V,
                    const ml_sampler *s, ml_rng *rng, float *work, int32_t *tok, float *lp) {
#pragma omp parallel for schedule(dynamic, 1) if (draws > 1)
  for (int64_t d = 0; d < draws; d++) {
    float *w = work ? work + d * 2 * V : NULL;
    const float *l = logits + (row_of ? row_of[d] : d) * V;
    tok[d] = sample_row(l, V, s, &rng[d], w, w ? w + V : NULL, &lp[d]);
  }
}
