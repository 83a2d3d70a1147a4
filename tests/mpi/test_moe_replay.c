/* Router replay (model/moe.h; ml_model.route_record / route_replay): `mpiexec -n 1
 * test_moe_replay FIXTURE` on a MoE fixture with output_router_logits (qwen3_moe).
 * - test_same: replaying the routing a forward recorded computes bitwise the step that
 *   recorded it (loss and every gradient, memcmp).
 * - test_other: replaying another routing (each recorded expert shifted by one, mod E)
 *   changes the loss; the load-balancing loss's counts are the replayed routing's (exact
 *   integers, compared ==); and the router's gradient under that routing is the derivative
 *   of the replayed loss: the first sparse layer's gate gradient g against central finite
 *   differences of the loss along u = g / |g| (bound derived below). The same finite
 *   differences are beyond the bound from the gradient of the model's own routing, so the
 *   check fails if the gradient ignored the replayed experts.
 * - test_bad: a recorded expert out of range is refused with a message naming it. */
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

#include "engine_run.h"
#include "parallel/fsdp.h"
#include "parity_util.h"
#include "train_check.h"

static const char *g_fixture;

/* One forward/backward of row 0 of fx from zeroed gradients: the loss, NLL / targets +
 * router_aux_loss_coef · aux (test_moe_aux's step). */
static double step(run *r, const fixture *fx) {
  ml_engine_batch b = {.ids = fx->ids, .mask = fx->mask, .B = 1, .S = fx->S};
  int64_t targets = 0;
  for (int64_t i = 0; i < fx->S; i++) targets += fx->mask[i];
  ml_loss_out nll;
  if (ml_engine_zero_grad(&r->e) ||
      ml_engine_forward_backward_batch(&r->e, &b, NULL, 1.0f / (float)targets, NULL, &nll))
    fail_msg("step: %s", ml_error_msg());
  return nll.loss_sum / (double)targets + r->e.model.cfg.aux_coef * r->e.model.aux.value;
}

/* The routing buffer of row 0: [S, n_layers, top_k] int32, zeroed. */
static int32_t *routing_alloc(const run *r, const fixture *fx) {
  const ml_model_config *c = &r->e.model.cfg;
  int32_t *x = calloc((size_t)(fx->S * c->n_layers * c->top_k), sizeof(int32_t));
  if (!x) fail_msg("out of memory for the routing");
  return x;
}

/* The fixture loaded and a one-rank run opened on it. */
static void open_one(fixture *fx, run *r) {
  fixture_load(g_fixture, fx);
  run_open(r, MPI_COMM_SELF, 1, 1, NULL, fx->dir);
}

static void test_same(void **state) {
  (void)state;
  static fixture fx; /* held: static, see held.h */
  static run r;
  open_one(&fx, &r);
  int32_t *rec = routing_alloc(&r, &fx);
  r.e.model.route_record = rec;
  double l0 = step(&r, &fx);
  float **g0 = export_all(&r, ML_EXPORT_GRADS);
  r.e.model.route_record = NULL;
  r.e.model.route_replay = rec;
  double l1 = step(&r, &fx);
  float **g1 = export_all(&r, ML_EXPORT_GRADS);
  printf("loss %.17g, replayed %.17g\n", l0, l1);
  assert_memory_equal(&l0, &l1, sizeof l0);
  for (int i = 0; i < r.e.model.n_params; i++) {
    const ml_param *p = ml_engine_export_param(&r.e, i);
    assert_memory_equal(g0[i], g1[i], sizeof(float) * (size_t)(p->shape[0] * p->shape[1]));
  }
  r.e.model.route_replay = NULL;
  free_all(g1);
  free_all(g0);
  free(rec);
  run_close(&r);
  fixture_free(&fx);
}

/* The export index of parameter p. */
static int export_index(run *r, const ml_param *p) {
  for (int i = 0; i < r->e.model.n_params; i++)
    if (ml_engine_export_param(&r->e, i) == p) return i;
  fail_msg("parameter %s not exported", p->name);
  return -1;
}

/* The loss with parameter p moved by h·u (u [numel]), restored after (1 rank: p's FSDP
 * chunk is all of it, [rows, cols] in the unit's fp32 shard). */
static double loss_at(run *r, const fixture *fx, const ml_param *p, const float *u,
                      int64_t numel, double h) {
  ml_fsdp *f = &r->e.fsdp;
  ml_fsdp_unit *unit = &f->units[ml_fsdp_unit_of(&r->e.model, p)];
  float *w = unit->shard + unit->shard_off[ml_fsdp_param_index(unit, p)];
  float *keep = malloc(sizeof(float) * (size_t)numel);
  if (!keep) fail_msg("out of memory");
  memcpy(keep, w, sizeof(float) * (size_t)numel);
  for (int64_t i = 0; i < numel; i++) w[i] = (float)((double)w[i] + h * u[i]);
  double l = step(r, fx);
  memcpy(w, keep, sizeof(float) * (size_t)numel);
  free(keep);
  return l;
}

static void test_other(void **state) {
  (void)state;
  static fixture fx; /* held: static, see held.h */
  static run r;
  open_one(&fx, &r);
  ml_model *m = &r.e.model;
  int64_t E = m->cfg.n_experts, k = m->cfg.top_k, nl = m->cfg.n_layers, S = fx.S;
  assert_true(m->cfg.router_aux && r.e.fsdp.opts.param_dtype == ML_F32);
  int32_t *rec = routing_alloc(&r, &fx), *other = routing_alloc(&r, &fx);
  m->route_record = rec;
  double l_own = step(&r, &fx);
  float **g_own = export_all(&r, ML_EXPORT_GRADS);
  m->route_record = NULL;
  /* shifted by one: still k distinct experts per token, none where it was */
  for (int64_t i = 0; i < S * nl * k; i++) other[i] = (int32_t)((rec[i] + 1) % E);
  m->route_replay = other;
  double l_rep = step(&r, &fx);
  float **g_rep = export_all(&r, ML_EXPORT_GRADS);
  assert_true(l_rep != l_own);

  /* the aux loss's counts: each expert's choices in the replayed routing, every sparse
   * layer, every token (a whole row: all count) */
  int64_t first = -1;
  for (int64_t e = 0; e < E; e++) {
    double n = 0;
    for (int64_t l = 0; l < nl; l++) {
      if (!m->layers[l].moe.gate.weight) continue;
      if (first < 0) first = l;
      for (int64_t t = 0; t < S; t++)
        for (int64_t j = 0; j < k; j++) n += other[(t * nl + l) * k + j] == e;
    }
    assert_true(m->aux.sums[e] == n);
  }
  assert_true(first >= 0);

  /* the router's gradient vs central differences along u = g / |g| */
  const ml_param *p = m->layers[first].moe.gate.weight;
  int idx = export_index(&r, p);
  int64_t numel = p->shape[0] * p->shape[1];
  double gn = 0, own = 0;
  for (int64_t i = 0; i < numel; i++) gn += (double)g_rep[idx][i] * g_rep[idx][i];
  gn = sqrt(gn);
  float *u = malloc(sizeof(float) * (size_t)numel);
  if (!u) fail_msg("out of memory");
  for (int64_t i = 0; i < numel; i++) {
    u[i] = (float)(g_rep[idx][i] / gn);
    own += (double)g_own[idx][i] * u[i];
  }
  /* Step h: the loss is smooth in the gate weights under a fixed routing (no top-k), so
   * the central difference D(h) = (L(h) − L(−h)) / 2h errs by truncation c·h² plus
   * rounding ≤ 2δ / 2h = δ/h, δ each loss's evaluation error. D(2h) − D(h) = 3c·h² ±
   * 1.5δ/h, so |D(h) − L'| ≤ |D(2h) − D(h)| + 3δ/h covers both (the truncation
   * overestimated 3×), plus the analytic gradient's own error. tolerance.h's worst-case
   * gamma_K (K = tol_model_k) would make δ/h exceed L' itself at any h whose truncation
   * is small, so δ follows the probabilistic rounding model tolerance.h §3-4 cite
   * (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019: independent zero-mean roundings):
   * |error| ≤ λ·sqrt(K)·u·|value| (to first order) with probability ≥ 1 −
   * 2K·exp(−λ²(1−u)²/2) (their Theorem 2.4; at λ = 7 and this model's K of a few
   * thousand, ~3e-7), for the loss (K of TOL_LOSS) and the gradient's norm (K of
   * TOL_GRADS). h = 5e-2
   * moves each of the E·H gate weights by ~h / sqrt(E·H) (~2e-3 on weights of ~2e-2):
   * small enough for the truncation, large enough that δ/h stays well below L'. */
  const double h = 5e-2, lambda = 7.0;
  double d1 = (loss_at(&r, &fx, p, u, numel, h) - loss_at(&r, &fx, p, u, numel, -h)) / (2 * h);
  double d2 =
      (loss_at(&r, &fx, p, u, numel, 2 * h) - loss_at(&r, &fx, p, u, numel, -2 * h)) / (4 * h);
  tol_model tm = tol_model_of(&r, S, S);
  double dl = lambda * sqrt(tol_model_k(&tm, TOL_LOSS)) * TOL_U * fabs(l_rep);
  double dg = lambda * sqrt(tol_model_k(&tm, TOL_GRADS)) * TOL_U * gn;
  double bound = fabs(d2 - d1) + 3 * dl / h + dg;
  printf("loss own %.9g, replayed %.9g; layer %lld gate: |g| %.9g, finite differences "
         "%.9g (2h: %.9g), bound %.3g; own routing's gradient along u %.9g\n",
         l_own, l_rep, (long long)first, gn, d1, d2, bound, own);
  assert_true(fabs(d1 - gn) <= bound);
  assert_true(fabs(d1 - own) > bound); /* the check tells the two routings apart */
  m->route_replay = NULL;
  free(u);
  free_all(g_rep);
  free_all(g_own);
  free(other);
  free(rec);
  run_close(&r);
  fixture_free(&fx);
}

static void test_bad(void **state) {
  (void)state;
  static fixture fx; /* held: static, see held.h */
  static run r;
  open_one(&fx, &r);
  int32_t *rec = routing_alloc(&r, &fx);
  int64_t nl = r.e.model.cfg.n_layers, k = r.e.model.cfg.top_k;
  for (int64_t i = 0; i < fx.S * nl * k; i++) rec[i] = (int32_t)(i % k);
  int64_t l = 0; /* the first sparse layer */
  while (l < nl && !r.e.model.layers[l].moe.gate.weight) l++;
  assert_true(l < nl);
  rec[l * k] = (int32_t)r.e.model.cfg.n_experts; /* token 0, layer l, choice 0 */
  r.e.model.route_replay = rec;
  ml_engine_batch b = {.ids = fx.ids, .mask = fx.mask, .B = 1, .S = fx.S};
  ml_loss_out nll;
  assert_int_equal(ml_engine_forward_backward_batch(&r.e, &b, NULL, 1.0f, NULL, &nll), -1);
  printf("refused: %s\n", ml_error_msg());
  char want[64];
  snprintf(want, sizeof want, "router replay: token 0 of layer %lld, choice 0", (long long)l);
  assert_non_null(strstr(ml_error_msg(), want));
  r.e.model.route_replay = NULL;
  free(rec);
  run_close(&r);
  fixture_free(&fx);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  if (argc != 2) {
    fprintf(stderr, "usage: mpiexec -n 1 test_moe_replay FIXTURE\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  const struct CMUnitTest tests[] = {held_test(test_same), held_test(test_other),
                                     held_test(test_bad)};
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
