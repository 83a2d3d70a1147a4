/* The entropy and top-k of the fused classifier over vocabulary tiles
 * (parallel/loss.c tiled_stats: entropy_online / topk_online per tile,
 * the rebase, the merge over tp and the FSDP group) against the unfused
 * computation (whole rows, Megatron's two passes), on 4 ranks: one rank
 * (MPI_COMM_SELF on each) and dp2 × tp2 (vocab parallelism over tp and the
 * FSDP group), the same engine with a tile budget of TILE_FLOATS logits
 * (token blocks of 16, tiles of 16 columns) against the default budget.
 * Each scores one fixture row with k = vocab_size (every log-prob of
 * every position, best first):
 *  - the ranked log-probs within tolerance.h §3's pair bound with the
 *    online log-sum-exp's roundings (tol_model.vocab_tiles): the c-th
 *    largest of perturbed values moves by at most the largest perturbation;
 *  - the ids where the unfused order is rounding-proof (neighbours among
 *    the 6 best further apart than both sides' errors) equal, and at least
 *    one such position;
 *  - the entropy: log-prob errors of eps·|lp_v| move H by at most
 *    eps·Σ p|lp||1 + lp| (dH/dlp_v = −p_v(1 + lp_v), first order; the
 *    weights from the unfused full lists in double), plus each side's own
 *    roundings of log(se) − sl/se (test_xent_scores.c's derivation: the
 *    same-signed sums, relative gamma(V + 2·TOL_LIBM + 4 + the largest
 *    |l − max|) and the tiles' moves). usage: test_scores FIXTURE */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "parallel/loss.h"
#include "train_check.h"

enum { TILE_FLOATS = 256, TOPK = 6 };

static const char *g_fixture;

typedef struct scores {
  float *ent, *lp;
  int32_t *id;
} scores;

/* Row 0 of fx scored with k = V on r. */
static scores score(run *r, const fixture *fx) {
  int64_t P = fx->S - 1, V = r->e.model.cfg.vocab;
  scores s = {calloc((size_t)P, sizeof(float)), calloc((size_t)(P * V), sizeof(float)),
              calloc((size_t)(P * V), sizeof(int32_t))};
  ml_engine_batch b = {.ids = fx->ids, .B = 1, .S = fx->S};
  ml_engine_scores want = {.entropy = s.ent, .topk = V, .topk_logprobs = s.lp, .topk_ids = s.id};
  if (ml_engine_scores_batch(&r->e, &b, &want)) fail_msg("scores: %s", ml_error_msg());
  return s;
}

static void scores_free(scores *s) {
  free(s->ent);
  free(s->lp);
  free(s->id);
}

static void compare(MPI_Comm base, int tp, const char *what) {
  static fixture fx;
  fixture_load(g_fixture, &fx);
  ml_engine_opts fused = ml_engine_opts_default();
  fused.loss_tile_floats = TILE_FLOATS;
  static run f, u;
  run_open(&f, base, 1, tp, &fused, fx.dir);
  run_open(&u, base, 1, tp, NULL, fx.dir);
  int64_t P = fx.S - 1, V = u.e.model.cfg.vocab;
  ml_loss_tiles t = ml_loss_tiling(fx.S, V, 1, true, TILE_FLOATS);
  assert_true(t.block < fx.S && t.cols < V); /* tiled, in blocks */
  tol_model tm = tol_model_of(&u, fx.S, fx.S);
  tm.vocab_tiles = ceil((double)V / (double)t.cols);
  double eps = tol_model_pair(&tm, TOL_LOGPROBS);
  scores a = score(&f, &fx), b = score(&u, &fx);
  double dn = 0, rn = 0, lmax = 0, wn = 0, hn = 0, en = 0, dmax = 0;
  for (int64_t i = 0; i < P * V; i++) {
    double d = (double)a.lp[i] - b.lp[i];
    dn += d * d, rn += (double)b.lp[i] * b.lp[i];
    if (i % V < TOPK) lmax = fmax(lmax, fabs(b.lp[i]));
  }
  int64_t fixed = 0, same = 0;
  for (int64_t p = 0; p < P; p++) {
    double w = 0, gap = INFINITY;
    for (int64_t c = 0; c < V; c++) {
      double lp = b.lp[p * V + c];
      w += exp(lp) * fabs(lp) * fabs(1.0 + lp);
      if (c + 1 < TOPK) gap = fmin(gap, lp - b.lp[p * V + c + 1]);
    }
    dmax = fmax(dmax, -b.lp[p * V + V - 1]); /* |l − max| <= |lp| */
    wn += w * w;
    double d = (double)a.ent[p] - b.ent[p];
    en += d * d, hn += (double)b.ent[p] * b.ent[p];
    if (gap > 2.0 * eps * lmax) {
      fixed++;
      same += !memcmp(&a.id[p * V], &b.id[p * V], sizeof(int32_t) * TOPK);
    }
  }
  double own = 2.0 * (tol_gamma(V + 2.0 * TOL_LIBM + 4.0 + dmax) + tol_xent_online(tm.vocab_tiles));
  double hb = eps * sqrt(wn) + 3.0 * own * sqrt(hn);
  if (rank0())
    printf("%s %s: ranked log-probs rel L2 %.3g (bound %.3g); entropy |d|_2 %.3g (bound %.3g); "
           "top-%d ids equal at %lld of %lld rounding-proof positions (of %lld)\n",
           g_fixture, what, sqrt(dn / rn), eps, sqrt(en), hb, TOPK, (long long)same,
           (long long)fixed, (long long)P);
  assert_true(sqrt(dn / rn) <= eps);
  assert_true(sqrt(en) <= hb);
  assert_true(fixed > 0);
  assert_int_equal(same, fixed);
  scores_free(&a);
  scores_free(&b);
  run_close(&u);
  run_close(&f);
  fixture_free(&fx);
}

static void test_one_rank(void **state) {
  (void)state;
  compare(MPI_COMM_SELF, 1, "fused vs unfused, 1 rank");
}

static void test_mesh(void **state) {
  (void)state;
  compare(MPI_COMM_WORLD, 2, "fused vs unfused, dp2 x tp2");
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int size;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc != 2 || size != 4) {
    fprintf(stderr, "usage: mpiexec -n 4 test_scores FIXTURE\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  const struct CMUnitTest tests[] = {
      held_test(test_one_rank),
      held_test(test_mesh),
  };
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
