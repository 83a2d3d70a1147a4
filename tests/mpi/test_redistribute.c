/* Placement algebra: `mpiexec -n N test_redistribute`.
 * Every rank builds the same global [B, S, C] tensors (Partial: one addend
 * per rank) deterministically, computes the local result each transition
 * must produce with plain loops (torch.chunk shards), and compares bitwise:
 * values are multiples of 1/8 in [−2, 2], so sums over ranks are exact in
 * any order. Also: the forward/backward pairs of ARCHITECTURE.md §3 (backward kind
 * and the adjoint identity), ml_redistribute_cost against the counting
 * comm (padded byte counts), a group of one, ml_all_gather_padded (uneven
 * blocks over the equal-size all-gather), and the error cases.
 * Checks that fail on some ranks are collected and agreed on after the
 * collectives, so a failure never leaves other ranks waiting. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "counting_comm.h"
#include "held.h"
#include "parallel/redistribute.h"
#include "rank_report.h"
#include "tolerance.h"

/* ---- comms ---- */

/* The CPU backend the activations live on. */
static ml_backend *cpu(void) {
  static ml_backend *be;
  if (!be && ml_backend_get("cpu", 0, &be)) fail_msg("cpu backend: %s", ml_error_msg());
  return be;
}

static int64_t total_calls(ml_comm *c) {
  int64_t n = 0;
  for (int k = 0; k < ML_COLL_KINDS; k++) n += ml_comm_stats_of(c)->calls[k];
  return n;
}

/* ---- tensors ---- */

/* Multiples of 1/8 in [−2, 2], a hash of (seed, i). */
static float val(uint64_t seed, int64_t i) {
  uint64_t h = seed * 0x9E3779B97F4A7C15ull + (uint64_t)i * 0xBF58476D1CE4E5B9ull + 1;
  h ^= h >> 31;
  h *= 0x94D049BB133111EBull;
  h ^= h >> 29;
  return (float)((int)(h % 33) - 16) * 0.125f;
}

static void fill(float *x, int64_t n, uint64_t seed) {
  for (int64_t i = 0; i < n; i++) x[i] = val(seed, i);
}

enum { R, S1, S2, SM1, P, NPL };
static ml_placement pl_of(int k) {
  switch (k) {
    case R: return ml_replicate();
    case S1: return ml_shard(1);
    case S2: return ml_shard(2);
    case SM1: return ml_shard(-1);
    default: return ml_partial();
  }
}
static const char *pl_name(int k) {
  static const char *n[NPL] = {"R", "S(1)", "S(2)", "S(-1)", "P"};
  return n[k];
}

typedef struct shape {
  int64_t B, S, C;
} shape;

/* The global value of a tensor with placement k built from `seed`: the
 * sum over ranks q of addend seed + q (Partial), else tensor `seed`. */
static float *global_of(int k, uint64_t seed, shape sh, int t) {
  int64_t n = sh.B * sh.S * sh.C;
  float *X = calloc((size_t)n + 1, sizeof(float)), *tmp = malloc(sizeof(float) * ((size_t)n + 1));
  if (k != P) fill(X, n, seed);
  for (int q = 0; k == P && q < t; q++) {
    fill(tmp, n, seed + (uint64_t)q);
    for (int64_t i = 0; i < n; i++) X[i] += tmp[i];
  }
  free(tmp);
  return X;
}

/* The local view of global X under placement k (not P) on rank r of t:
 * plain loops over [B, S, C] with torch.chunk extents. Returns s and c. */
static void view_of(int k, const float *X, shape sh, int t, int r, float *out, int64_t *s,
                    int64_t *c) {
  int64_t s0 = 0, c0 = 0;
  *s = sh.S;
  *c = sh.C;
  if (k == S1) ml_chunk(sh.S, t, r, &s0, s);
  if (k == S2 || k == SM1) ml_chunk(sh.C, t, r, &c0, c);
  for (int64_t b = 0; b < sh.B; b++)
    for (int64_t i = 0; i < *s; i++)
      for (int64_t j = 0; j < *c; j++)
        out[(b * *s + i) * *c + j] = X[(b * sh.S + s0 + i) * sh.C + c0 + j];
}

/* A local activation of placement k from `seed` on rank r of t; x holds
 * exactly B·S·C floats (so overruns show under a sanitizer). */
static ml_act make_local(int k, uint64_t seed, shape sh, int t, int r) {
  int64_t n = sh.B * sh.S * sh.C;
  ml_act a = {malloc(sizeof(float) * ((size_t)n + (n == 0))), sh.B, sh.S, sh.S, sh.C, sh.C};
  if (k == P) {
    fill(a.x, n, seed + (uint64_t)r);
  } else {
    float *X = global_of(k, seed, sh, t);
    view_of(k, X, sh, t, r, a.x, &a.s, &a.c);
    free(X);
  }
  return a;
}

/* Exactly the scratch ml_redistribute_work asks for (+1: never empty). */
static float *work_for(shape sh, int t) {
  return malloc(sizeof(float) * ((size_t)ml_redistribute_work(sh.B, sh.S, sh.C, t) + 1));
}

/* ---- every transition, against plain loops, and its cost ---- */

static const shape g_shapes[] = {
    {3, 7, 5},   /* uneven: on 4 ranks S gives 2,2,2,1 and C gives 2,2,1,0 */
    {2, 8, 12},  /* even on 2 and 4 ranks (_block collectives) */
    {1, 7, 5},   /* B = 1 fast paths */
    {1, 8, 4},   /* B = 1, even */
    {2, 2, 3},   /* S < ranks: empty sequence shards */
    {2, 1, 1},   /* one token, one feature */
    {0, 4, 4},   /* no elements */
    {2, 33, 70}, /* larger, uneven on 4 ranks */
};
#define N_SHAPES (sizeof g_shapes / sizeof g_shapes[0])

/* Check the cost prediction for from → to against what c counted since the
 * last reset. */
static void check_cost(report *rep, ml_comm *c, int from, int to, shape sh) {
  ml_coll kinds[2];
  int64_t bytes[2];
  int n;
  if (ml_redistribute_cost(pl_of(from), pl_of(to), sh.B, sh.S, sh.C, c->size, kinds, bytes, &n)) {
    note(rep, "cost %s->%s: %s", pl_name(from), pl_name(to), ml_error_msg());
    return;
  }
  ml_comm_stats want = {{0}, {0}, 0}, *got = ml_comm_stats_of(c);
  for (int i = 0; i < n; i++) {
    want.calls[kinds[i]]++;
    want.bytes[kinds[i]] += bytes[i];
  }
  for (int k = 0; k < ML_COLL_KINDS; k++)
    if (want.calls[k] != got->calls[k] || want.bytes[k] != got->bytes[k])
      note(rep,
           "cost %s->%s [%lld,%lld,%lld] on %d ranks: %s predicted %lld calls %lld bytes, "
           "counted %lld calls %lld bytes",
           pl_name(from), pl_name(to), (long long)sh.B, (long long)sh.S, (long long)sh.C, c->size,
           ml_coll_name((ml_coll)k), (long long)want.calls[k], (long long)want.bytes[k],
           (long long)got->calls[k], (long long)got->bytes[k]);
}

/* Every from → to on every shape over comm c, bitwise against the local
 * view of the global value, with the cost vs the counting comm. */
static void transitions_on(ml_comm *c, report *rep) {
  int t = c->size, r = c->rank;
  for (size_t si = 0; si < N_SHAPES; si++) {
    shape sh = g_shapes[si];
    int64_t n = sh.B * sh.S * sh.C;
    float *want = malloc(sizeof(float) * ((size_t)n + 1)), *work = work_for(sh, t);
    for (int from = 0; from < NPL; from++)
      for (int to = 0; to < NPL; to++) {
        if (to == P && from != P) continue;
        uint64_t seed = 1000 * si + 10 * (uint64_t)from + (uint64_t)to;
        ml_act a = make_local(from, seed, sh, t, r);
        int64_t ws, wc;
        if (to == P) { /* Partial -> Partial: untouched */
          fill(want, n, seed + (uint64_t)r);
          ws = sh.S, wc = sh.C;
        } else {
          float *X = global_of(from, seed, sh, t);
          view_of(to, X, sh, t, r, want, &ws, &wc);
          free(X);
        }
        ml_comm_stats_reset(c);
        if (ml_redistribute(cpu(), c, pl_of(from), pl_of(to), &a, work)) {
          note(rep, "%s->%s: %s", pl_name(from), pl_name(to), ml_error_msg());
        } else if (a.s != ws || a.c != wc || a.B != sh.B || a.S != sh.S || a.C != sh.C) {
          note(rep, "%s->%s [%lld,%lld,%lld] rank %d: local [%lld,%lld], want [%lld,%lld]",
               pl_name(from), pl_name(to), (long long)sh.B, (long long)sh.S, (long long)sh.C, r,
               (long long)a.s, (long long)a.c, (long long)ws, (long long)wc);
        } else if (memcmp(a.x, want, sizeof(float) * (size_t)(sh.B * ws * wc)) != 0) {
          note(rep, "%s->%s [%lld,%lld,%lld] rank %d of %d: values differ", pl_name(from),
               pl_name(to), (long long)sh.B, (long long)sh.S, (long long)sh.C, r, t);
        }
        check_cost(rep, c, from, to, sh);
        free(a.x);
      }
    free(want);
    free(work);
  }
}

static void test_transitions(void **state) {
  (void)state;
  report rep = {0};
  ml_comm *c = counting(MPI_COMM_WORLD, "tp");
  transitions_on(c, &rep);
  ml_comm_destroy(c);
  agree(&rep, "failures");
}

/* A group of one: every transition leaves the data as is, full shapes, and
 * communicates nothing. */
static void test_group_of_one(void **state) {
  (void)state;
  report rep = {0};
  ml_comm *c = counting(MPI_COMM_SELF, "self");
  transitions_on(c, &rep);
  shape sh = {3, 7, 5};
  for (int from = 0; from < NPL; from++)
    for (int to = 0; to < P; to++) {
      ml_act a = make_local(from, 7, sh, 1, 0), b = make_local(from, 7, sh, 1, 0);
      ml_comm_stats_reset(c);
      if (ml_redistribute(cpu(), c, pl_of(from), pl_of(to), &a, NULL))
        note(&rep, "1 rank %s->%s: %s", pl_name(from), pl_name(to), ml_error_msg());
      else if (a.s != 7 || a.c != 5 || memcmp(a.x, b.x, sizeof(float) * 105) || total_calls(c))
        note(&rep, "1 rank %s->%s changed something", pl_name(from), pl_name(to));
      free(a.x);
      free(b.x);
    }
  ml_comm_destroy(c);
  agree(&rep, "failures");
}

/* ---- ARCHITECTURE.md §3: forward/backward pairs ---- */

/* <u, v> of global values from local views: the sum over ranks of local
 * dot products, Replicate against Replicate counted once. */
static double pairing(const ml_act *u, int pu, const ml_act *v, int pv, int t) {
  double d = 0, all = 0;
  for (int64_t i = 0; i < u->B * u->s * u->c; i++) d += (double)u->x[i] * v->x[i];
  MPI_Allreduce(&d, &all, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return pu == R && pv == R ? all / t : all;
}

typedef struct pair {
  int from, to, grad; /* forward from -> to; the grad arrives as `grad` */
  int bwd;            /* backward collective: an ml_coll, or -1 for none */
} pair;

static void test_backward_pairs(void **state) {
  (void)state;
  static const pair pairs[] = {
      {S1, R, P, ML_COLL_REDUCE_SCATTER}, /* Shard -> Replicate: all-gather / reduce-scatter */
      {S2, R, P, ML_COLL_REDUCE_SCATTER},
      {SM1, R, P, ML_COLL_REDUCE_SCATTER},
      {S1, R, R, -1}, /* ... grad already Replicate: slice */
      {SM1, R, R, -1},
      {P, R, R, -1}, /* Partial -> Replicate: all-reduce / none */
      {P, R, P, ML_COLL_ALL_REDUCE},
      {P, S1, S1, ML_COLL_ALL_GATHER}, /* Partial -> Shard: reduce-scatter / all-gather */
      {P, SM1, SM1, ML_COLL_ALL_GATHER},
      {R, S1, S1, ML_COLL_ALL_GATHER}, /* Replicate -> Shard: slice / all-gather */
      {R, S2, S2, ML_COLL_ALL_GATHER},
      {R, R, P, ML_COLL_ALL_REDUCE}, /* Replicate input to a sharded weight: Megatron f */
      {S1, SM1, SM1, ML_COLL_ALL_GATHER},
      {SM1, S1, S1, ML_COLL_ALL_GATHER},
      {S1, S1, S1, -1},
  };
  report rep = {0};
  ml_comm *c = counting(MPI_COMM_WORLD, "tp");
  int t = c->size, r = c->rank;
  const shape shapes[] = {{3, 7, 5}, {2, 8, 12}, {1, 5, 9}};
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
    shape sh = shapes[si];
    float *work = work_for(sh, t);
    for (size_t pi = 0; pi < sizeof pairs / sizeof pairs[0]; pi++) {
      pair pr = pairs[pi];
      int back_to = pr.from == P ? R : pr.from;
      ml_act x = make_local(pr.from, 100 + pi, sh, t, r),
             fx = make_local(pr.from, 100 + pi, sh, t, r);
      ml_act y = make_local(pr.grad, 500 + pi, sh, t, r),
             gy = make_local(pr.grad, 500 + pi, sh, t, r);
      if (ml_redistribute(cpu(), c, pl_of(pr.from), pl_of(pr.to), &fx, work))
        note(&rep, "forward %s->%s: %s", pl_name(pr.from), pl_name(pr.to), ml_error_msg());
      ml_comm_stats_reset(c);
      if (ml_redistribute(cpu(), c, pl_of(pr.grad), pl_of(back_to), &gy, work))
        note(&rep, "backward %s->%s: %s", pl_name(pr.grad), pl_name(back_to), ml_error_msg());
      ml_comm_stats *st = ml_comm_stats_of(c);
      int64_t calls = total_calls(c);
      bool kind_ok = pr.bwd < 0 ? calls == 0 : calls == 1 && st->calls[pr.bwd] == 1;
      if (t > 1 && !kind_ok)
        note(&rep, "backward of %s->%s (grad %s): %lld collectives, want %s", pl_name(pr.from),
             pl_name(pr.to), pl_name(pr.grad), (long long)calls,
             pr.bwd < 0 ? "none" : ml_coll_name((ml_coll)pr.bwd));
      double lhs = pairing(&fx, pr.to, &y, pr.grad, t);
      double rhs = pairing(&x, pr.from, &gy, back_to, t);
      /* exact (tests/tolerance.h TOL_EXACT): every value is a multiple of
       * 1/8 of magnitude <= 2t, so the collectives' fp32 sums are exact in
       * any order, each product is a multiple of 1/64 and the pairings'
       * sums (<= 4620 terms of magnitude <= 64 per rank, 4 ranks) stay far
       * below 2^53 units of 1/64 in double; dividing t·d by t returns d */
      if (fabs(lhs - rhs) > TOL_EXACT)
        note(&rep, "adjoint %s->%s (grad %s) [%lld,%lld,%lld]: <F x, y> = %.17g, <x, G y> = %.17g",
             pl_name(pr.from), pl_name(pr.to), pl_name(pr.grad), (long long)sh.B, (long long)sh.S,
             (long long)sh.C, lhs, rhs);
      free(x.x);
      free(fx.x);
      free(y.x);
      free(gy.x);
    }
    free(work);
  }
  ml_comm_destroy(c);
  agree(&rep, "failures");
}

/* ---- uneven blocks over the equal-size all-gather ---- */

/* Rank q holds counts[q] floats (empty blocks included), padded to the
 * largest: every block arrives at q·chunk, followed by zeros; one
 * all-gather of size·chunk·4 bytes. */
static void test_all_gather_padded(void **state) {
  (void)state;
  report rep = {0};
  ml_comm *c = counting(MPI_COMM_WORLD, "tp");
  int t = c->size, r = c->rank;
  size_t *counts = calloc((size_t)t, sizeof(size_t)), chunk = 0;
  for (int q = 0; q < t; q++) {
    counts[q] = (size_t)((q * 5 + 3) % 4); /* 3, 0, 1, 2, ...: includes empty blocks */
    chunk = counts[q] > chunk ? counts[q] : chunk;
  }
  float *send = malloc(sizeof(float) * chunk), *recv = malloc(sizeof(float) * chunk * (size_t)t);
  fill(send, (int64_t)chunk, 77 + (uint64_t)r); /* garbage past counts[r]: must become zeros */
  ml_comm_stats_reset(c);
  if (ml_all_gather_padded(cpu(), c, send, counts[r], chunk, recv)) note(&rep, "%s", ml_error_msg());
  for (int q = 0; q < t; q++)
    for (size_t j = 0; j < chunk; j++) {
      float want = j < counts[q] ? val(77 + (uint64_t)q, (int64_t)j) : 0.0f;
      if (recv[(size_t)q * chunk + j] != want)
        note(&rep, "block %d [%zu] = %g, want %g", q, j, recv[(size_t)q * chunk + j], want);
    }
  ml_comm_stats *st = ml_comm_stats_of(c);
  if (st->calls[ML_COLL_ALL_GATHER] != 1 ||
      st->bytes[ML_COLL_ALL_GATHER] != (int64_t)((size_t)t * chunk * 4))
    note(&rep, "counted %lld calls %lld bytes, want 1 and %zu",
         (long long)st->calls[ML_COLL_ALL_GATHER], (long long)st->bytes[ML_COLL_ALL_GATHER],
         (size_t)t * chunk * 4);
  free(send);
  free(recv);
  free(counts);
  ml_comm_destroy(c);
  agree(&rep, "failures");
}

/* ---- bad requests ---- */

/* Expect ml_redistribute to fail naming every string in `needles`, leaving
 * the shape as is and communicating nothing. */
static void expect_error(report *rep, ml_comm *c, ml_placement from, ml_placement to, ml_act *a,
                         float *work, const char *what, const char *n1, const char *n2) {
  int64_t s = a->s, cc = a->c;
  ml_error_clear();
  ml_comm_stats_reset(c);
  if (ml_redistribute(cpu(), c, from, to, a, work) == 0) {
    note(rep, "%s: accepted", what);
    return;
  }
  const char *m = ml_error_msg();
  if (!strstr(m, n1) || (n2 && !strstr(m, n2)))
    note(rep, "%s: message '%s' lacks '%s' / '%s'", what, m, n1, n2 ? n2 : "");
  if (a->s != s || a->c != cc || total_calls(c)) note(rep, "%s: changed the activation", what);
}

static void test_errors(void **state) {
  (void)state;
  report rep = {0};
  ml_comm *c = counting(MPI_COMM_WORLD, "tp");
  int t = c->size, r = c->rank;
  shape sh = {3, 7, 5};
  float *work = work_for(sh, t);
  ml_act rep_act = make_local(R, 1, sh, t, r), seq = make_local(S1, 1, sh, t, r);
  ml_act feat = make_local(SM1, 1, sh, t, r);
  expect_error(&rep, c, ml_replicate(), ml_partial(), &rep_act, work, "R->P", "Replicate()",
               "Partial(sum)");
  expect_error(&rep, c, ml_shard(1), ml_partial(), &seq, work, "S1->P", "Shard(1)", "Partial(sum)");
  expect_error(&rep, c, ml_replicate(), ml_shard(0), &rep_act, work, "R->S0", "Shard(0)", NULL);
  expect_error(&rep, c, ml_shard(0), ml_replicate(), &rep_act, work, "S0->R", "Shard(0)", NULL);
  expect_error(&rep, c, ml_shard(-3), ml_replicate(), &rep_act, work, "S-3->R", "Shard(-3)", NULL);
  expect_error(&rep, c, ml_replicate(), ml_shard(3), &rep_act, work, "R->S3", "Shard(3)", NULL);
  /* Local views that do not match the source placement (on every rank
   * when there are several: no chunk of S = 7 or C = 5 is whole). */
  if (t > 1) {
    expect_error(&rep, c, ml_shard(1), ml_replicate(), &rep_act, work, "R view as S1", "Shard(1)",
                 "expected local");
    expect_error(&rep, c, ml_shard(-1), ml_shard(1), &rep_act, work, "R view as S-1", "Shard(-1)",
                 "[3, 7, 5]");
    expect_error(&rep, c, ml_replicate(), ml_shard(1), &seq, work, "S1 view as R", "Replicate()",
                 "expected local [3, 7, 5]");
    expect_error(&rep, c, ml_partial(), ml_replicate(), &feat, work, "S-1 view as P",
                 "Partial(sum)", "expected local [3, 7, 5]");
  }
  ml_act wrong = rep_act;
  wrong.c = 4;
  expect_error(&rep, c, ml_replicate(), ml_shard(1), &wrong, work, "R with c != C", "[3, 7, 4]",
               "expected local [3, 7, 5]");
  ml_act neg = rep_act;
  neg.B = -1;
  expect_error(&rep, c, ml_replicate(), ml_shard(1), &neg, work, "B < 0", "negative", NULL);
  /* A transition that communicates needs scratch. */
  if (t > 1) {
    expect_error(&rep, c, ml_shard(1), ml_replicate(), &seq, NULL, "no work", "work buffer", NULL);
    expect_error(&rep, c, ml_partial(), ml_shard(1), &rep_act, rep_act.x, "work = x",
                 "does not overlap", NULL);
  }
  /* ... and Replicate -> Shard does not. */
  ml_comm_stats_reset(c);
  if (ml_redistribute(cpu(), c, ml_replicate(), ml_shard(-1), &rep_act, NULL) || total_calls(c))
    note(&rep, "R->S-1 without work: %s", ml_error_msg());
  /* The cost function refuses the same requests. */
  ml_coll k[2];
  int64_t b[2];
  int n = 7;
  ml_error_clear();
  if (ml_redistribute_cost(ml_replicate(), ml_partial(), 3, 7, 5, t, k, b, &n) == 0 || n != 0)
    note(&rep, "cost R->P accepted");
  if (ml_redistribute_cost(ml_shard(0), ml_replicate(), 3, 7, 5, t, k, b, &n) == 0)
    note(&rep, "cost S0->R accepted");
  ml_error_clear();
  if (ml_redistribute_cost(ml_shard(1), ml_replicate(), 3, 7, 5, 0, k, b, &n) == 0 ||
      !strstr(ml_error_msg(), "group size 0"))
    note(&rep, "cost with 0 ranks: '%s'", ml_error_msg());
  free(rep_act.x);
  free(seq.x);
  free(feat.x);
  free(work);
  ml_comm_destroy(c);
  agree(&rep, "failures");
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_all_gather_padded), cmocka_unit_test(test_transitions),
      cmocka_unit_test(test_group_of_one),     cmocka_unit_test(test_backward_pairs),
      cmocka_unit_test(test_errors),
  };
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
