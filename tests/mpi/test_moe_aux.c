/* The load-balancing loss's tokens (model/moe.h ml_moe_aux_begin): `mpiexec -n 1
 * test_moe_aux FIXTURE` on a fixture with output_router_logits (qwen3_moe). Row 0 of the
 * fixture as one packed document (a), and as the same document followed by 8 tokens of
 * padding (b: the tokens from docs[ndocs] on, HF attention_mask 0), give the same loss
 * (NLL + router_aux_loss_coef · aux) and gradients within the pair bounds of
 * tests/tolerance.h §3: the padding is in no sum of the aux loss. The same 32 tokens as a
 * whole row (c: no documents, every token counts, as HF counts them without a mask) move
 * the gradients beyond that bound (the aux gradient reaches the router through the extra
 * tokens), so (b) would fail if the padding were counted.
 * The objective path (engine/step.h ml_step_accumulate with an ml_objective, as the library's
 * custom losses run) reports the same loss as the NLL path: the NLL objective with weights
 * 1 / targets plus the aux term, within the same pair bound (test_objective_loss). */
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

#include "engine/step.h"
#include "engine_run.h"
#include "parity_util.h"
#include "train_check.h"

enum { PAD = 8 };

static const char *g_fixture;

/* One forward/backward of ids/mask [1, S] (docs: NULL, or {0, n}: one document of n
 * tokens, the rest padding) from zeroed gradients: the loss, and *aux the aux term
 * alone (router_aux_loss_coef · aux). */
static double step(run *r, const int32_t *ids, const uint8_t *mask, int64_t S,
                   const int64_t *docs, int64_t targets, double *aux) {
  ml_engine_batch b = {.ids = ids, .mask = mask, .B = 1, .S = S, .docs = docs, .ndocs = 1};
  if (!docs) b.ndocs = 0;
  ml_loss_out nll;
  if (ml_engine_zero_grad(&r->e) ||
      ml_engine_forward_backward_batch(&r->e, &b, NULL, 1.0f / (float)targets, NULL, &nll))
    fail_msg("step: %s", ml_error_msg());
  *aux = r->e.model.cfg.aux_coef * r->e.model.aux.value;
  return nll.loss_sum / (double)targets + *aux;
}

static void test_padding(void **state) {
  (void)state;
  static fixture fx; /* held: static, see held.h */
  fixture_load(g_fixture, &fx);
  static run r;
  run_open(&r, MPI_COMM_SELF, 1, 1, NULL, fx.dir);
  assert_true(r.e.model.cfg.router_aux && fx.B >= 2);
  int64_t S = fx.S, Sp = S + PAD, targets = 0;
  int32_t ids[Sp];
  uint8_t mask[Sp];
  for (int64_t i = 0; i < Sp; i++) { /* row 0, then the first tokens of row 1: no target */
    ids[i] = fx.ids[i];
    mask[i] = i < S ? fx.mask[i] : 0;
    targets += mask[i];
  }
  const int64_t docs[2] = {0, S};
  double aux_a, aux_b, aux_c;
  double la = step(&r, ids, mask, S, docs, targets, &aux_a);
  float **ga = export_all(&r, ML_EXPORT_GRADS);
  double lb = step(&r, ids, mask, Sp, docs, targets, &aux_b);
  float **gb = export_all(&r, ML_EXPORT_GRADS);
  double lc = step(&r, ids, mask, Sp, NULL, targets, &aux_c);
  float **gc = export_all(&r, ML_EXPORT_GRADS);
  double worst = 0, worst_c = 0;
  for (int i = 0; i < r.e.model.n_params; i++) {
    const ml_param *p = ml_engine_export_param(&r.e, i);
    worst = fmax(worst, rel_l2(gb[i], ga[i], p->shape[0] * p->shape[1]));
    worst_c = fmax(worst_c, rel_l2(gc[i], ga[i], p->shape[0] * p->shape[1]));
  }
  tol_model tm = tol_model_of(&r, Sp, Sp);
  double tl = tol_model_pair(&tm, TOL_LOSS), tg = tol_model_pair(&tm, TOL_GRADS);
  printf("loss: document %.9g, + %d padding %.9g (rel %.3g, bound %.3g; aux term %.6g vs "
         "%.6g), as a whole row %.9g (aux term %.6g); grads rel L2 %.3g (bound %.3g), as a "
         "whole row %.3g\n",
         la, PAD, lb, fabs(lb - la) / fabs(la), tl, aux_b, aux_a, lc, aux_c, worst, tg, worst_c);
  assert_true(aux_a > 0);
  assert_true(fabs(lb - la) <= tl * fabs(la));
  assert_true(worst <= tg);
  /* counting the padding moves the gradients beyond the bound (b's check can fail) */
  assert_true(worst_c > tg);
  free_all(gc);
  free_all(gb);
  free_all(ga);
  run_close(&r);
  fixture_free(&fx);
}

/* ml_step_source's fill: the one batch of ctx. */
static int fill_one(void *ctx, int64_t m, ml_engine_batch *b) {
  (void)m;
  *b = *(const ml_engine_batch *)ctx;
  return 0;
}

static void test_objective_loss(void **state) {
  (void)state;
  static fixture fx; /* held: static, see held.h */
  fixture_load(g_fixture, &fx);
  static run r;
  run_open(&r, MPI_COMM_SELF, 1, 1, NULL, fx.dir);
  assert_true(r.e.model.cfg.router_aux);
  int64_t S = fx.S, targets = 0;
  for (int64_t i = 0; i < S; i++) targets += fx.mask[i];
  /* obj[i]: the inputs of target token i + 1 (engine.h), weight 1 / targets where it is one */
  ml_obj_in obj[S];
  for (int64_t i = 0; i < S; i++)
    obj[i] = (ml_obj_in){.w = i + 1 < S && fx.mask[i + 1] ? 1.0f / (float)targets : 0.0f,
                         .idx = -1};
  ml_engine_batch plain = {.ids = fx.ids, .mask = fx.mask, .B = 1, .S = S};
  ml_engine_batch with_obj = plain;
  with_obj.obj = obj;
  const ml_objective nll = {.kind = ML_OBJ_NLL};
  ml_step_source src = {.n_micro = 1, .fill = fill_one, .ctx = &plain, .global_targets = targets};
  ml_step_result a = {0}, b = {0};
  if (ml_engine_zero_grad(&r.e) || ml_step_accumulate(&r.e, &src, &a))
    fail_msg("NLL step: %s", ml_error_msg());
  double aux = r.e.model.cfg.aux_coef * r.e.model.aux.value;
  src.ctx = &with_obj;
  src.objective = &nll;
  if (ml_engine_zero_grad(&r.e) || ml_step_accumulate(&r.e, &src, &b))
    fail_msg("objective step: %s", ml_error_msg());
  tol_model tm = tol_model_of(&r, S, S);
  double tl = tol_model_pair(&tm, TOL_LOSS);
  printf("loss: NLL path %.9g, objective path %.9g (rel %.3g, bound %.3g); aux term %.6g\n",
         a.loss, b.loss, fabs(b.loss - a.loss) / fabs(a.loss), tl, aux);
  /* the aux term is above the bound: a path that left it out would fail */
  assert_true(aux > tl * fabs(a.loss));
  assert_true(fabs(b.loss - a.loss) <= tl * fabs(a.loss));
  run_close(&r);
  fixture_free(&fx);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  if (argc != 2) {
    fprintf(stderr, "usage: mpiexec -n 1 test_moe_aux FIXTURE\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  const struct CMUnitTest tests[] = {held_test(test_padding), held_test(test_objective_loss)};
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
