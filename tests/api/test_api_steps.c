/* test_api_steps: the split steps and the custom objective. zero_grad +
 * forward_backward + optimizer_step = train_step bitwise (two steps, the
 * results and the weights after, as the next log-probs); a C objective
 * re-implementing NLL and CLIPPED_PG's unclipped branch through
 * MESHLM_LOSS_CUSTOM = the built-in: its gradients bitwise (the same fp64
 * arithmetic per target; under vocab parallelism each weight summed with
 * zeros over the group, exact), so the grad norm and the weights after;
 * its loss within the bound of custom_loss_close; eval_loss = forward_backward's
 * loss at the same weights and leaves the gradients alone; NaN in a
 * per-token input is a skipped step with its reason; an objective that
 * fails fails the call on every rank and skips the step (the reference
 * policy: test_api_reference.c). The suite, its meshes and its helpers:
 * api_util.h. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api_util.h"

/* This rank's share of g and a as a train batch (step_share's). */
static meshlm_train_batch share(meshlm_session *s, const gbatch *g, const garr *a) {
  meshlm_info in = info_of(s);
  slice sl = slice_of(g, in.dp_rank, in.dp_size);
  meshlm_train_batch tb = {.struct_size = sizeof tb, .seqs = sl.seqs};
  tb.token_mask = a->mask ? a->mask + sl.p0 : NULL;
  tb.token_weights = a->tw ? a->tw + sl.p0 : NULL;
  tb.seq_weights = a->sw ? a->sw + sl.s0 : NULL;
  tb.old_logprobs = a->old ? a->old + sl.p0 : NULL;
  tb.ref_logprobs = a->ref ? a->ref + sl.p0 : NULL;
  return tb;
}

/* The fields two equal steps agree on, bitwise. */
static void same_result(const meshlm_step_result *x, const meshlm_step_result *y,
                        const char *what) {
  printf("[rank %d] %s: loss %.17g / %.17g, grad norm %.17g / %.17g\n", g_rank, what, x->loss,
         y->loss, x->grad_norm, y->grad_norm);
  assert_memory_equal(&x->loss, &y->loss, sizeof x->loss);
  assert_memory_equal(&x->kl, &y->kl, sizeof x->kl);
  assert_memory_equal(&x->clip_fraction, &y->clip_fraction, sizeof x->clip_fraction);
  assert_memory_equal(&x->grad_norm, &y->grad_norm, sizeof x->grad_norm);
  assert_memory_equal(&x->lr, &y->lr, sizeof x->lr);
  assert_int_equal(x->tokens, y->tokens);
  assert_int_equal(x->sequences, y->sequences);
  assert_int_equal(x->step, y->step);
  assert_int_equal(x->skipped, y->skipped);
}

/* The clipped-PG case of the tests: advantages, old = lp shifted, ref. */
typedef struct pg_case {
  gbatch g;
  float *tw, *old, *ref;
  garr a;
} pg_case;

static pg_case pg_make(meshlm_session *s, uint64_t seed) {
  pg_case c = {.g = gbatch_make(seed)};
  int64_t n = c.g.all.npred;
  c.tw = xcalloc((size_t)n, sizeof *c.tw);
  c.old = xcalloc((size_t)n, sizeof *c.old);
  c.ref = xcalloc((size_t)n, sizeof *c.ref);
  global_lp(s, &c.g, NULL, c.old);
  rng_seed(seed);
  for (int64_t p = 0; p < n; p++) {
    c.tw[p] = (float)(2.0 * unif() - 1.0);
    c.ref[p] = c.old[p] + (float)(0.2 * unif() - 0.1);
    c.old[p] += (float)(0.6 * unif() - 0.3); /* ratios inside and beyond 1 ± 0.2 */
  }
  c.a = (garr){c.g.all.mask, c.tw, NULL, c.old, c.ref};
  return c;
}

static void pg_free(pg_case *c) {
  free(c->tw);
  free(c->old);
  free(c->ref);
  batch_free(&c->g.all);
}

static void test_split_is_train_step(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *a = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_session *b = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  pg_case c = pg_make(a, 41);
  meshlm_loss l;
  meshlm_loss_default(&l);
  l.kind = MESHLM_LOSS_CLIPPED_PG;
  l.ratio_clip_c = 3.0f;
  l.kl_penalty = 0.05f;
  for (int k = 0; k < 2; k++) {
    l.sequence_level = k;
    meshlm_step_result ra = {.struct_size = sizeof ra}, rb = ra, fb = ra;
    OK(a, step_share(a, &c.g, &c.a, &l, &ra));
    meshlm_train_batch tb = share(b, &c.g, &c.a);
    OK(b, meshlm_zero_grad(b));
    OK(b, meshlm_forward_backward(b, &tb, &l, &fb));
    OK(b, meshlm_optimizer_step(b, &rb));
    same_result(&ra, &rb, k ? "train_step / split, sequence level" : "train_step / split");
    assert_memory_equal(&ra.loss, &fb.loss, sizeof ra.loss);
    assert_true(fb.grad_norm == 0.0 && fb.skipped == 0);
  }
  int64_t n = c.g.all.npred;
  float *la = xcalloc((size_t)n, sizeof *la), *lb = xcalloc((size_t)n, sizeof *lb);
  global_lp(a, &c.g, NULL, la);
  global_lp(b, &c.g, NULL, lb);
  assert_memory_equal(la, lb, sizeof *la * (size_t)n); /* the weights after two steps */
  free(la);
  free(lb);
  meshlm_close(a);
  meshlm_close(b);
  pg_free(&c);
}

/* The C objectives: NLL (ℓ = −lp, dℓ/dlp = −1) and the clipped surrogate's
 * unclipped branch (ℓ = −A·e^(lp − old)), each term times its weight, in
 * the order of operations of parallel/objective.c. ctx: the pg_case's
 * advantages and old log-probs, of this rank's share (index). */
typedef struct obj_ctx {
  const float *tw, *old;
  int64_t calls, terms; /* calls, and targets seen, since the last reset */
  double abs_sum;       /* Σ |loss term| of them */
} obj_ctx;

static int nll_fn(void *ctx, const meshlm_objective_chunk *c) {
  obj_ctx *o = ctx;
  o->calls++;
  for (int64_t i = 0; i < c->n; i++) {
    double w = c->weight[i], x = c->logprobs[i];
    c->loss[i] = w * -x;
    c->grad[i] = w * -1.0;
    o->abs_sum += fabs(c->loss[i]);
  }
  o->terms += c->n;
  return 0;
}

static int pg_fn(void *ctx, const meshlm_objective_chunk *c) {
  obj_ctx *o = ctx;
  o->calls++;
  for (int64_t i = 0; i < c->n; i++) {
    double w = c->weight[i], x = c->logprobs[i], A = o->tw[c->index[i]];
    double r = exp(x - (double)o->old[c->index[i]]);
    c->loss[i] = w * (-A * r);
    c->grad[i] = w * (-A * r);
    o->abs_sum += fabs(c->loss[i]);
  }
  o->terms += c->n;
  return 0;
}

/* The built-in's step x and the custom one's y: the gradient weights are
 * the same fp32 numbers (−w·dℓ, one product, rounded once either way), so
 * grad norm and the rest are bitwise; the loss is a fp64 sum of the same
 * N terms w·ℓ, which the built-in may fuse into its accumulation
 * (acc += w·ℓ as one fma under -march=native: no rounding of the product)
 * while the custom one's are rounded before: each sum is within
 * gamma64(N + 1)·Σ|w·ℓ| of the exact one (recursive summation, one more
 * rounding per term at most, R2), so they differ by at most twice that.
 * Σ|w·ℓ| and N over the global batch: the callback's, summed over the
 * data ranks (tp rank 0 of each). */
static void custom_loss_close(meshlm_session *s, obj_ctx *o, const meshlm_step_result *x,
                              const meshlm_step_result *y, const char *what) {
  meshlm_info in = info_of(s);
  double v[2] = {in.tp_rank == 0 ? o->abs_sum : 0.0, in.tp_rank == 0 ? (double)o->terms : 0.0};
  MPI_Allreduce(MPI_IN_PLACE, v, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  double bound = 2.0 * tol_gamma64(v[1] + 1.0) * v[0];
  printf("[rank %d] %s: loss %.17g / %.17g (|diff| %.3g, bound %.3g), grad norm %.17g / %.17g\n",
         g_rank, what, x->loss, y->loss, fabs(x->loss - y->loss), bound, x->grad_norm,
         y->grad_norm);
  assert_true(fabs(x->loss - y->loss) <= bound);
  meshlm_step_result yy = *y;
  yy.loss = x->loss;
  same_result(x, &yy, what);
  o->abs_sum = 0.0;
  o->terms = 0;
}

static int failing_fn(void *ctx, const meshlm_objective_chunk *c) {
  (void)ctx;
  (void)c;
  return 7;
}

static void test_custom_is_builtin(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *a = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_session *b = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  pg_case c = pg_make(a, 42);
  meshlm_info in = info_of(b);
  slice sl = slice_of(&c.g, in.dp_rank, in.dp_size);
  obj_ctx ctx = {c.tw + sl.p0, c.old + sl.p0, 0, 0, 0.0};
  meshlm_loss lb, lc;
  meshlm_loss_default(&lb);
  meshlm_loss_default(&lc);
  lc.kind = MESHLM_LOSS_CUSTOM;
  lc.objective = nll_fn;
  lc.objective_ctx = &ctx;
  for (int k = 0; k < 2; k++) { /* NLL, token then sequence level */
    lb.sequence_level = lc.sequence_level = k;
    meshlm_step_result ra = {.struct_size = sizeof ra}, rb = ra;
    OK(a, step_share(a, &c.g, &c.a, &lb, &ra));
    OK(b, step_share(b, &c.g, &c.a, &lc, &rb));
    custom_loss_close(b, &ctx, &ra, &rb,
                      k ? "NLL / custom NLL, sequence level" : "NLL / custom NLL");
  }
  assert_true(ctx.calls > 0 || sl.npred == 0);
  /* the clipped surrogate with clips that never bind (ratios within e^±0.3 ⊂ [1 − 0.9, 1 + 9]):
     its unclipped branch */
  lb.kind = MESHLM_LOSS_CLIPPED_PG;
  lb.sequence_level = lc.sequence_level = 0;
  lb.ratio_clip_min = 0.9f;
  lb.ratio_clip_max = 9.0f;
  lc.objective = pg_fn;
  meshlm_step_result ra = {.struct_size = sizeof ra}, rb = ra;
  OK(a, step_share(a, &c.g, &c.a, &lb, &ra));
  OK(b, step_share(b, &c.g, &c.a, &lc, &rb));
  custom_loss_close(b, &ctx, &ra, &rb, "clipped PG / custom surrogate");
  int64_t n = c.g.all.npred;
  float *la = xcalloc((size_t)n, sizeof *la), *lbuf = xcalloc((size_t)n, sizeof *lbuf);
  global_lp(a, &c.g, NULL, la);
  global_lp(b, &c.g, NULL, lbuf);
  assert_memory_equal(la, lbuf, sizeof *la * (size_t)n);
  free(la);
  free(lbuf);

  /* a failing objective: the call fails on every rank after its passes, the step skipped */
  lc.objective = failing_fn;
  meshlm_step_result rf = {.struct_size = sizeof rf};
  expect_fail(b, step_share(b, &c.g, &c.a, &lc, &rf), "loss.objective", "a failing objective");
  assert_int_equal(rf.skipped, 1);
  assert_non_null(strstr(rf.skip_reason, "loss.objective"));
  OK(b, step_share(b, &c.g, &c.a, &lb, &rb)); /* the session goes on */
  meshlm_close(a);
  meshlm_close(b);
  pg_free(&c);
}

static void test_eval_loss(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *a = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_session *b = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  pg_case c = pg_make(a, 43);
  meshlm_loss l;
  meshlm_loss_default(&l);
  l.kind = MESHLM_LOSS_CLIPPED_PG;
  l.kl_penalty = 0.05f;
  meshlm_train_batch tb = share(b, &c.g, &c.a);
  meshlm_step_result ev = {.struct_size = sizeof ev}, fb = ev, ra = ev, rb = ev;
  /* on b: eval first (no gradient), then the step; on a: the step alone */
  OK(b, meshlm_eval_loss(b, &tb, &l, &ev));
  OK(b, meshlm_zero_grad(b));
  OK(b, meshlm_forward_backward(b, &tb, &l, &fb));
  OK(b, meshlm_eval_loss(b, &tb, &l, &ev)); /* between backward and step: no effect */
  OK(b, meshlm_optimizer_step(b, &rb));
  OK(a, step_share(a, &c.g, &c.a, &l, &ra));
  printf("[rank %d] eval %.17g, forward_backward %.17g\n", g_rank, ev.loss, fb.loss);
  assert_memory_equal(&ev.loss, &fb.loss, sizeof ev.loss);
  assert_memory_equal(&ev.kl, &fb.kl, sizeof ev.kl);
  assert_int_equal(ev.tokens, fb.tokens);
  same_result(&ra, &rb, "train_step / eval + split");
  meshlm_close(a);
  meshlm_close(b);
  pg_free(&c);
}

static void test_nan_input_skips(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  pg_case c = pg_make(s, 44);
  int64_t n = c.g.all.npred, p = 0;
  while (!c.g.all.mask[p]) p++; /* the first masked prediction (dp rank 0's share) */
  float *before = xcalloc((size_t)n, sizeof *before), *after = xcalloc((size_t)n, 4);
  global_lp(s, &c.g, NULL, before);
  meshlm_loss l;
  meshlm_loss_default(&l);
  l.kind = MESHLM_LOSS_CLIPPED_PG;
  float keep = c.old[p];
  c.old[p] = NAN; /* its ratio is NaN: the clipped surrogate passes no gradient, the loss NaN */
  meshlm_step_result r = {.struct_size = sizeof r};
  OK(s, step_share(s, &c.g, &c.a, &l, &r));
  printf("[rank %d] NaN old_logprobs: loss %g, grad norm %g, skipped %d: %s\n", g_rank, r.loss,
         r.grad_norm, r.skipped, r.skip_reason);
  assert_int_equal(r.skipped, 1);
  assert_int_equal(r.step, 1);
  assert_non_null(strstr(r.skip_reason, "the loss is not finite"));
  if (info_of(s).dp_rank == 0) assert_non_null(strstr(r.skip_reason, "old_logprobs["));
  global_lp(s, &c.g, NULL, after);
  assert_memory_equal(before, after, sizeof *before * (size_t)n); /* no update */
  /* the same through the split steps: forward_backward reports it, optimizer_step skips */
  meshlm_train_batch tb = share(s, &c.g, &c.a);
  OK(s, meshlm_zero_grad(s));
  OK(s, meshlm_forward_backward(s, &tb, &l, &r));
  assert_int_equal(r.skipped, 1);
  c.old[p] = keep;
  OK(s, meshlm_forward_backward(s, &tb, &l, &r)); /* a finite call after it */
  assert_int_equal(r.skipped, 0);
  OK(s, meshlm_optimizer_step(s, &r));
  assert_int_equal(r.skipped, 1);
  assert_non_null(strstr(r.skip_reason, "the loss is not finite"));
  assert_int_equal(r.step, 2);
  global_lp(s, &c.g, NULL, after);
  assert_memory_equal(before, after, sizeof *before * (size_t)n);
  free(before);
  free(after);
  meshlm_close(s);
  pg_free(&c);
}

int main(int argc, char **argv) {
  api_init(&argc, &argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_split_is_train_step),
      cmocka_unit_test(test_custom_is_builtin),
      cmocka_unit_test(test_eval_loss),
      cmocka_unit_test(test_nan_input_skips),
  };
  return api_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
