/* The entropy bonus's gradient through the engine, against a double
 * reference: `mpiexec -n 1 test_entropy_grad FIXTURE` (an untied lm_head).
 *
 * With entropy_coef c the logits' gradient gains c·w_t·p(log p + H_t)
 * (dH/dl = −p(log p + H)), so lm_head's weight gradient gains G[v, :] =
 * Σ_t c·w_t·p_tv(log p_tv + H_t)·x_t, x_t lm_head's input. The engine's
 * lm_head gradient with c minus the one without (the same forward) is
 * compared with G computed in double from x (the final norm's output the
 * engine's forward leaves in head_in) and lm_head's weights, for the NLL
 * objective at token level (w_t = 1/targets), whole rows and the fused
 * classifier's vocabulary tiles (a 256-logit budget: the online path and
 * the backward tile by tile).
 *
 * Bound (tests/tolerance.h §3, relative L2): each fp32 gradient A (with c)
 * and B (without) is within gamma(K)·‖A‖ (‖B‖) of its exact value, K the
 * forward to the log-softmax (tol_model_k, TOL_LOGPROBS, with the tiles'
 * moves), the entropy's sums (V + 2·TOL_LIBM + 4), the logits' gradient
 * (TOL_K_XENT_BWD + 5: the bonus term's product, bracket and sum) and the
 * weight gradient's sum over the T tokens (a signed reduction:
 * tol_signed(T + 1)); the reference's own, gamma64(K), and x read from a
 * forward-only pass, the same kernels as the training forward's. So
 * ‖(A − B) − G‖ <= gamma(K)(‖A‖ + ‖B‖) + gamma64(K)‖G‖. */
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

#include "ckpt/save.h"
#include "parallel/loss.h"
#include "train_check.h"

static const char *g_fixture;

/* The export index of parameter `name`. */
static int param_index(const run *r, const char *name) {
  for (int i = 0; i < r->e.model.n_params; i++)
    if (!strcmp(ml_engine_export_param(&r->e, i)->name, name)) return i;
  fail_msg("no parameter %s", name);
  return -1;
}

/* lm_head's weight gradient of one forward + backward under `o`. */
static float *head_grad(run *r, const ml_engine_batch *eb, const ml_objective *o, int li,
                        size_t n) {
  if (ml_engine_zero_grad(&r->e)) fail_msg("zero_grad: %s", ml_error_msg());
  ml_obj_sums s = {0};
  ml_loss_out nll;
  if (ml_engine_forward_backward_batch(&r->e, eb, o, 0.0f, &s, &nll))
    fail_msg("forward_backward: %s", ml_error_msg());
  float **g = export_all(r, ML_EXPORT_GRADS), *out = malloc(sizeof(float) * n);
  memcpy(out, g[li], sizeof(float) * n);
  free_all(g);
  return out;
}

static void check(int64_t tile_floats, const char *what) {
  static fixture fx;
  fixture_load(g_fixture, &fx);
  ml_engine_opts eo = ml_engine_opts_default();
  eo.loss_tile_floats = tile_floats;
  static run r;
  run_open(&r, MPI_COMM_SELF, 1, 1, &eo, fx.dir);
  const ml_model_config *cfg = &r.e.model.cfg;
  int64_t S = fx.S, T = S - 1, V = cfg->vocab, Hd = cfg->hidden;
  int li = param_index(&r, "lm_head.weight");
  size_t n = (size_t)(V * Hd);
  ml_obj_in *in = calloc((size_t)S, sizeof *in);
  for (int64_t t = 0; t < T; t++) in[t].w = (float)(1.0 / (double)T);
  ml_engine_batch eb = {.ids = fx.ids, .B = 1, .S = S, .obj = in};
  const double c = 0.375; /* exact in fp32 */
  ml_objective o0 = {.kind = ML_OBJ_NLL}, oc = o0;
  oc.entropy_coef = c;
  float *A = head_grad(&r, &eb, &oc, li, n), *B = head_grad(&r, &eb, &o0, li, n);
  /* x: the forward's lm_head input [S, H]; W: lm_head's weights [V, H] */
  float *lp = malloc(sizeof(float) * (size_t)T);
  if (ml_engine_logprobs(&r.e, fx.ids, 1, S, lp)) fail_msg("logprobs: %s", ml_error_msg());
  assert_int_equal(r.e.model.head_in.c, Hd);
  const float *x = r.e.model.head_in.x;
  float **P = export_all(&r, ML_EXPORT_PARAMS);
  const float *W = P[li];
  double *G = calloc(n, sizeof *G), *l = malloc(sizeof(double) * (size_t)V);
  for (int64_t t = 0; t < T; t++) {
    double m = -INFINITY, s = 0, H = 0;
    for (int64_t v = 0; v < V; v++) {
      double z = 0;
      for (int64_t h = 0; h < Hd; h++) z += (double)x[t * Hd + h] * W[v * Hd + h];
      l[v] = z;
      m = fmax(m, z);
    }
    for (int64_t v = 0; v < V; v++) s += exp(l[v] - m);
    for (int64_t v = 0; v < V; v++) {
      double lpv = l[v] - m - log(s);
      H -= exp(lpv) * lpv;
    }
    for (int64_t v = 0; v < V; v++) {
      double lpv = l[v] - m - log(s), g = c * in[t].w * exp(lpv) * (lpv + H);
      for (int64_t h = 0; h < Hd; h++) G[v * Hd + h] += g * x[t * Hd + h];
    }
  }
  double dn = 0, an = 0, bn = 0, gn = 0;
  for (size_t i = 0; i < n; i++) {
    double d = ((double)A[i] - B[i]) - G[i];
    dn += d * d, an += (double)A[i] * A[i], bn += (double)B[i] * B[i], gn += G[i] * G[i];
  }
  tol_model tm = tol_model_of(&r, S, T);
  ml_loss_tiles tiles = ml_loss_tiling(S, V, 1, true, tile_floats);
  tm.vocab_tiles = tiles.cols < V ? ceil((double)V / (double)tiles.cols) : 1.0;
  double K = tol_model_k(&tm, TOL_LOGPROBS) + V + 2.0 * TOL_LIBM + 4.0 + TOL_K_XENT_BWD + 5.0 +
             tol_signed((double)T + 1.0);
  double bound = tol_gamma(K) * (sqrt(an) + sqrt(bn)) + tol_gamma64(K) * sqrt(gn);
  printf("%s %s: ||(A - B) - G|| %.3g, bound %.3g (||G|| %.3g, ||A|| %.3g, vocab tiles %g)\n",
         g_fixture, what, sqrt(dn), bound, sqrt(gn), sqrt(an), tm.vocab_tiles);
  assert_true(sqrt(gn) > 0);
  assert_true(sqrt(dn) <= bound);
  free_all(P);
  free(G), free(l), free(lp), free(A), free(B), free(in);
  run_close(&r);
  fixture_free(&fx);
}

static void test_whole_rows(void **state) {
  (void)state;
  check(0, "whole rows");
}

static void test_tiles(void **state) {
  (void)state;
  check(256, "vocabulary tiles");
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  if (argc != 2) {
    fprintf(stderr, "usage: test_entropy_grad FIXTURE\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  const struct CMUnitTest tests[] = {
      held_test(test_whole_rows),
      held_test(test_tiles),
  };
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
