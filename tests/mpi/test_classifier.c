/* The fused classifier (parallel/loss.h) against the unfused one on a
 * fixture family, on 4 ranks: the same engine with a tile budget of
 * TILE_FLOATS logits (token blocks of 16, vocab tiles of 16 columns: the
 * online log-sum-exp over several tiles, lm_head's weight gradient per tile
 * and block) against the default budget (whole rows of the batch in one
 * block: the unfused computation, Megatron's two passes):
 *  - fp32 on one rank and on dp2 × tp2 (vocab parallelism over the FSDP
 *    group and tp): the loss, every gradient and the log-probs within the
 *    pair bound of tolerance.h §3 with the online log-sum-exp's roundings
 *    counted (tol_model.vocab_tiles);
 *  - bf16 mesh parity: the fused classifier on dp2 × tp2 against the
 *    unfused one on one rank (tol_bf16_pair: the same rounding sites — the
 *    block's input and each tile's gradient rounded once, as lm_head's
 *    linear rounds them — and fp32 reordering inside).
 * The kernels' same-order case (one tile = the unfused statistics, bit for
 * bit) is tests/unit/test_kernels.c's. usage: test_classifier FIXTURE */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#include "train_check.h"

enum { TILE_FLOATS = 256 };

static const char *g_fixture;

/* The fixture's model sizes with the fused classifier's tiles per row. */
static tol_model tiled_model(const run *r, const batch *bt) {
  tol_model tm = tol_model_of(r, bt->S, bt->B * bt->S);
  ml_loss_tiles t = ml_loss_tiling(bt->B * bt->S, r->e.model.cfg.vocab, 1, true, TILE_FLOATS);
  assert_true(t.block < bt->B * bt->S && t.cols < r->e.model.cfg.vocab); /* tiled, in blocks */
  tm.vocab_tiles = ceil((double)r->e.model.cfg.vocab / (double)t.cols);
  return tm;
}

static void check(const char *what, const run_diff *d, const tol_model *tm, double (*pair)(
                  const tol_model *, tol_quantity)) {
  double tl = pair(tm, TOL_LOSS), tg = pair(tm, TOL_GRADS), tp = pair(tm, TOL_LOGPROBS);
  if (rank0())
    printf("%s %s: loss rel %.3g (bound %.3g), log-probs rel L2 %.3g (bound %.3g), worst grad "
           "rel L2 %.3g (bound %.3g)\n",
           g_fixture, what, d->loss_rel, tl, d->logprob_rel_l2, tp, d->grad_rel, tg);
  assert_true(d->loss_rel <= tl);
  assert_true(d->logprob_rel_l2 <= tp);
  assert_true(d->grad_rel <= tg);
}

static void fp32_on(MPI_Comm base, int tp, const char *what) {
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch bt;
  batch_make(&fx, 2, &bt); /* one row per dp rank */
  ml_engine_opts fused = ml_engine_opts_default();
  fused.loss_tile_floats = TILE_FLOATS;
  static run f, u;
  run_open(&f, base, 1, tp, &fused, fx.dir);
  run_open(&u, base, 1, tp, NULL, fx.dir);
  run_diff d = run_compare(&f, &u, &fx, &bt);
  tol_model tm = tiled_model(&u, &bt);
  check(what, &d, &tm, tol_model_pair);
  run_close(&u);
  run_close(&f);
  batch_free(&bt);
  fixture_free(&fx);
}

static void test_fp32_one_rank(void **state) {
  (void)state;
  fp32_on(MPI_COMM_SELF, 1, "fp32 fused vs unfused, 1 rank");
}

static void test_fp32_mesh(void **state) {
  (void)state;
  fp32_on(MPI_COMM_WORLD, 2, "fp32 fused vs unfused, dp2 x tp2");
}

static void test_bf16_mesh_parity(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch bt;
  batch_make(&fx, 2, &bt);
  ml_engine_opts o16 = bf16_engine_opts(), fused = bf16_engine_opts();
  fused.loss_tile_floats = TILE_FLOATS;
  static run one, mesh;
  run_open(&one, MPI_COMM_SELF, 1, 1, &o16, fx.dir);
  run_open(&mesh, MPI_COMM_WORLD, 1, 2, &fused, fx.dir);
  run_diff d = run_compare(&mesh, &one, &fx, &bt);
  tol_model tm = tiled_model(&one, &bt);
  check("bf16 fused dp2 x tp2 vs unfused 1 rank", &d, &tm, tol_bf16_pair);
  run_close(&mesh);
  run_close(&one);
  batch_free(&bt);
  fixture_free(&fx);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int size;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc != 2 || size != 4) {
    fprintf(stderr, "usage: mpiexec -n 4 test_classifier FIXTURE\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  const struct CMUnitTest tests[] = {
      held_test(test_fp32_one_rank),
      held_test(test_fp32_mesh),
      held_test(test_bf16_mesh_parity),
  };
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
