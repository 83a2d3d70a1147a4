/* Forward-only passes keep one layer's activations (issue 31):
 * `mpiexec -n N test_forward_only FIXTURE TP`. Scoring (ml_engine_logprobs)
 * allocates its activations under ml_model.forward_only: one block shared by
 * every layer and no backward scratch, where a training geometry holds one
 * block per layer. Asserted on the backend's pool statistics (bytes in use,
 * not timings) and on the numbers:
 *  - the buffers a training reserve takes exceed the forward-only reserve's
 *    by at least (n_layers − 1) layer blocks (ml_model_act_bytes; the
 *    backward scratch comes on top);
 *  - the log-probs are bitwise the same from slim buffers and from a
 *    training geometry's (which serve a forward-only pass as they are),
 *    before and after a forward + backward has run on the latter (no
 *    optimizer step: the weights do not change);
 *  - a training geometry in place serves scoring without reallocating its
 *    activations (its layer blocks stay);
 *  - scoring allocates no training state: until the first training call
 *    every FSDP unit's gradient and AdamW moments are absent, and that call
 *    (ml_engine_zero_grad) takes exactly their bytes of the pool, 3 fp32
 *    arrays of each unit's grad_numel (engine.h ml_engine_train_state).
 * And an inference-only session under param_dtype bf16 (parallel/fsdp.h
 * inference_only):
 *  - its log-probs are bitwise (memcmp) a normal bf16 session's;
 *  - its units without a parameter kept in fp32 hold no fp32 shard, no
 *    gradient and no AdamW state, only their bf16 shard, and FSDP holds no
 *    gradient staging: opening it takes exactly 2 B per shard element of
 *    those units (4 B fp32 → 2 B bf16) and the normal session's staging
 *    (fp32: the largest unit's dp blocks of its gathered part, and one
 *    block) less of the pool than opening the normal session; on one rank
 *    the shard elements are the parameter count, Σ rows·cols over the
 *    checkpoint's tensors (no padding rows);
 *  - a training call fails naming inference_only and allocates nothing;
 *  - a reference policy captured in it scores bitwise the same, taking 2 B
 *    per shard element of those units (engine/reference.h). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/reference.h"
#include "engine/step.h"
#include "engine_run.h"
#include "parity_util.h"

static const char *g_fixture;
static int g_tp;

/* This rank's rows of the batch, scored: out [rows, S − 1]. */
static void score(run *r, const batch *bt, int64_t rows, int64_t row0, float *out) {
  if (ml_engine_logprobs(&r->e, bt->ids + row0 * bt->S, rows, bt->S, out))
    fail_msg("logprobs: %s", ml_error_msg());
}

/* Bytes in use that reserving [rows, S] for `forward_only` adds, from empty
 * activations (the pool counts the bytes asked for, backend/pool.c; the
 * engine's own residual stream and ids exist from the first reserve on). */
static size_t reserved_for(run *r, int64_t rows, int64_t S, bool forward_only) {
  ml_model_reset_acts(&r->e.model);
  ml_be_trim(r->e.be);
  size_t before = ml_be_memory_stats(r->e.be).in_use;
  if (ml_engine_reserve(&r->e, rows, S, forward_only, NULL))
    fail_msg("reserve: %s", ml_error_msg());
  return ml_be_memory_stats(r->e.be).in_use - before;
}

static void test_forward_only(void **state) {
  (void)state;
  static fixture fx; /* held: static, see held.h */
  fixture_load(g_fixture, &fx);
  int world;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  static batch bt;
  batch_make(&fx, world, &bt);
  static run r;
  ml_engine_opts eo = ml_engine_opts_default();
  run_open(&r, MPI_COMM_WORLD, 1, g_tp, &eo, fx.dir);
  int64_t dp = r.mesh.groups[ML_GROUP_DP].size, dp_rank = r.mesh.groups[ML_GROUP_DP].rank;
  int64_t rows = bt.B / dp, row0 = dp_rank * rows, n = rows * (bt.S - 1);
  float *slim = calloc((size_t)n, sizeof *slim), *wide = calloc((size_t)n, sizeof *wide);
  assert_non_null(slim);
  assert_non_null(wide);

  /* memory: L layer blocks and the backward scratch (training) against one block */
  reserved_for(&r, rows, bt.S, false); /* the engine's residual stream and ids */
  size_t fwd = reserved_for(&r, rows, bt.S, true);
  score(&r, &bt, rows, row0, slim);
  size_t train = reserved_for(&r, rows, bt.S, false);
  int64_t per_layer, work;
  ml_model_act_bytes(&r.e.model, rows, r.e.model.S, &per_layer, &work);
  int64_t L = r.e.model.cfg.n_layers;
  if (rank0())
    printf("%s: activations reserved %zu B training, %zu B forward-only (%lld layers x %lld B "
           "per layer)\n",
           g_fixture, train, fwd, (long long)L, (long long)per_layer);
  assert_true(L >= 2);
  assert_true(train >= fwd + (size_t)((L - 1) * per_layer));

  /* the training geometry serves scoring as it is (the same layer blocks), same numbers */
  const float *block1 = r.e.model.layers[1].acts.x_in;
  score(&r, &bt, rows, row0, wide);
  assert_memory_equal(wide, slim, sizeof(float) * (size_t)n);
  assert_false(r.e.model.acts_shared);
  assert_ptr_equal(r.e.model.layers[1].acts.x_in, block1);

  /* no training state yet; the first training call allocates exactly its bytes */
  int64_t train_bytes = 0;
  for (int u = 0; u < r.e.fsdp.n_units; u++) {
    const ml_fsdp_unit *unit = &r.e.fsdp.units[u];
    assert_null(unit->shard_grad);
    assert_null(unit->adam_m);
    assert_null(unit->adam_v);
    train_bytes += 3 * (int64_t)sizeof(float) * unit->grad_numel;
  }
  size_t held = ml_be_memory_stats(r.e.be).in_use;
  if (ml_engine_zero_grad(&r.e)) fail_msg("zero_grad: %s", ml_error_msg());
  size_t trained = ml_be_memory_stats(r.e.be).in_use;
  if (rank0())
    printf("%s: scoring held %zu B; the first zero_grad took %zu B (gradients and AdamW state "
           "%lld B)\n",
           g_fixture, held, trained - held, (long long)train_bytes);
  assert_true(train_bytes > 0);
  assert_int_equal(trained - held, (size_t)train_bytes);

  /* a training step, then scoring from slim buffers again = from the training ones */
  double loss;
  if (ml_engine_forward_backward(&r.e, bt.ids + row0 * bt.S, bt.mask + row0 * bt.S, rows, bt.S,
                                 bt.targets, &loss))
    fail_msg("forward_backward: %s", ml_error_msg());
  score(&r, &bt, rows, row0, wide);    /* on the step's buffers */
  reserved_for(&r, rows, bt.S, true); /* slim again */
  score(&r, &bt, rows, row0, slim);
  assert_memory_equal(wide, slim, sizeof(float) * (size_t)n);

  free(slim);
  free(wide);
  run_close(&r);
  batch_free(&bt);
  fixture_free(&fx);
}

/* Open r under eo (inference_only set as given), *opened: the pool's bytes
 * in use once open; then this rank's rows of bt scored into out. */
static void score_bf16(ml_engine_opts *eo, bool inference_only, const fixture *fx,
                       const batch *bt, float *out, size_t *opened, run *r) {
  eo->fsdp.inference_only = inference_only;
  run_open(r, MPI_COMM_WORLD, 1, g_tp, eo, fx->dir);
  *opened = ml_be_memory_stats(r->e.be).in_use;
  int64_t dp = r->mesh.groups[ML_GROUP_DP].size, dp_rank = r->mesh.groups[ML_GROUP_DP].rank;
  int64_t rows = bt->B / dp;
  score(r, bt, rows, dp_rank * rows, out);
}

static void test_inference_only(void **state) {
  (void)state;
  static fixture fx; /* held: static, see held.h */
  fixture_load(g_fixture, &fx);
  int world;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  static batch bt;
  batch_make(&fx, world, &bt);
  ml_engine_opts eo = ml_engine_opts_default();
  eo.fsdp.param_dtype = ML_BF16;
  int64_t dp = world / g_tp, n = bt.B / dp * (bt.S - 1);
  float *want = calloc((size_t)n, sizeof *want), *got = calloc((size_t)n, sizeof *got);
  assert_non_null(want);
  assert_non_null(got);
  static run r;
  size_t normal, inference;
  score_bf16(&eo, false, &fx, &bt, want, &normal, &r);
  /* the normal session's gradient staging (parallel/fsdp.h comm_buf, grad_buf: bf16 gradients
   * are rounded, so always staged), fp32: every unit's dp blocks of its gathered part, and one */
  int64_t staged = 0, gathered = 0;
  for (int u = 0; u < r.e.fsdp.n_units; u++) {
    const ml_fsdp_unit *unit = &r.e.fsdp.units[u];
    int64_t all = unit->gather_numel * unit->dp->size;
    staged = all > staged ? all : staged;
    gathered = unit->gather_numel > gathered ? unit->gather_numel : gathered;
  }
  int64_t staging = 4 * (staged + gathered);
  run_close(&r);
  score_bf16(&eo, true, &fx, &bt, got, &inference, &r);
  assert_memory_equal(got, want, sizeof(float) * (size_t)n);

  /* the bf16-only units: no fp32 shard, no training state; 2 B per shard element saved */
  int64_t saved = 0, elems = 0, lp_only = 0;
  for (int u = 0; u < r.e.fsdp.n_units; u++) {
    const ml_fsdp_unit *unit = &r.e.fsdp.units[u];
    bool f32 = false;
    for (int i = 0; i < unit->n; i++) f32 = f32 || unit->params[i]->fp32;
    assert_int_equal(unit->lp_only, !f32);
    assert_null(unit->shard_grad);
    elems += unit->shard_numel;
    if (!unit->lp_only) continue;
    assert_null(unit->shard);
    assert_non_null(unit->lp);
    lp_only++;
    saved += 2 * unit->shard_numel;
  }
  if (world == 1) { /* one rank: the shards are the checkpoint's tensors, unpadded */
    int64_t params = 0;
    for (int i = 0; i < r.e.model.n_params; i++)
      params += r.e.model.params[i].shape[0] * r.e.model.params[i].shape[1];
    assert_int_equal(elems, params);
  }
  if (rank0())
    printf("%s: bf16 session open %zu B, inference-only %zu B (%lld of %d units bf16 alone, "
           "%lld shard elements)\n",
           g_fixture, normal, inference, (long long)lp_only, r.e.fsdp.n_units, (long long)elems);
  assert_true(lp_only > 0);
  assert_null(r.e.fsdp.comm_buf);
  assert_null(r.e.fsdp.grad_buf);
  assert_int_equal(normal - inference, (size_t)(saved + staging));

  /* training refused, naming the option, nothing allocated */
  size_t held = ml_be_memory_stats(r.e.be).in_use; /* with the pass's activations */
  assert_int_not_equal(ml_engine_zero_grad(&r.e), 0);
  assert_non_null(strstr(ml_error_msg(), "inference_only"));
  ml_error_clear();
  assert_int_equal(ml_be_memory_stats(r.e.be).in_use, held);

  /* a reference policy: bf16 for those units, the same log-probs */
  int64_t ref_bytes = 0;
  for (int u = 0; u < r.e.fsdp.n_units; u++)
    ref_bytes += (r.e.fsdp.units[u].lp_only ? 2 : 4) * r.e.fsdp.units[u].shard_numel;
  if (ml_engine_reference_set(&r.e)) fail_msg("reference: %s", ml_error_msg());
  assert_int_equal(ml_be_memory_stats(r.e.be).in_use - held, (size_t)ref_bytes);
  assert_int_equal(ml_engine_reference_bytes(&r.e), (size_t)ref_bytes);
  if (ml_engine_reference_swap(&r.e)) fail_msg("swap: %s", ml_error_msg());
  int64_t rows = bt.B / dp, row0 = r.mesh.groups[ML_GROUP_DP].rank * rows;
  memset(got, 0, sizeof(float) * (size_t)n);
  score(&r, &bt, rows, row0, got);
  assert_memory_equal(got, want, sizeof(float) * (size_t)n);
  if (ml_engine_reference_swap(&r.e)) fail_msg("swap back: %s", ml_error_msg());
  memset(got, 0, sizeof(float) * (size_t)n);
  score(&r, &bt, rows, row0, got);
  assert_memory_equal(got, want, sizeof(float) * (size_t)n);

  free(want);
  free(got);
  run_close(&r);
  batch_free(&bt);
  fixture_free(&fx);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  if (argc != 3 || atoi(argv[2]) < 1) {
    fprintf(stderr, "usage: mpiexec -n N test_forward_only FIXTURE TP\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  g_tp = atoi(argv[2]);
  const struct CMUnitTest tests[] = {held_test(test_forward_only),
                                     held_test(test_inference_only)};
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
