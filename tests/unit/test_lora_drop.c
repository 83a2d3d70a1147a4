/* LoRA dropout (model/lora_drop.h) on one adapted linear (model/linear.c):
 *  - the mask's statistics: over N = 2^20 elements the number dropped is
 *    c ~ Binomial(N, p) if the draws are uniform and independent; the
 *    bound |c − N·p| <= 6·sigma, sigma = sqrt(N·p·(1 − p)) (N·p·(1 − p) >=
 *    9.4e4 here, so the normal approximation holds; its two-sided tail is
 *    2e-9 per check, and the key is fixed, so a run is reproducible). Two
 *    keys (the next micro-batch) agree on an element with probability
 *    q = p² + (1 − p)² if independent: the same 6-sigma bound with q;
 *  - forward and backward against a double reference that applies the same
 *    mask explicitly (drawn here from ml_lora_drop_keep at the global
 *    coordinates the linear's view stands for: rows from row0, positions
 *    through row_pos as context parallelism's pieces, features from
 *    lora_A's offset as a tensor-parallel Shard(1) input):
 *      y  = x·W^T + s·((x⊙m/(1−p))·A^T)·B^T,
 *      dB = s·dy^T·u, u = (x⊙m/(1−p))·A^T;  du = s·dy·B;
 *      dA = du^T·(x⊙m/(1−p));  dx = dy·W + (du·A)⊙m/(1−p),
 *    each element within tol_vs_double(k, k) of its |.|-evaluation (R3),
 *    k = in + out + r + T + 6: the longest rounding path of any output (the
 *    sum of every dot length it goes through plus the scalings, the masked
 *    input's one, and the adds) is below it;
 *  - p = 0, or an inactive context (scoring, generation), is bitwise the
 *    linear without a dropout context (memcmp). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tolerance.h"
#include "backend/backend.h"
#include "common/rng.h"
#include "common/status.h"
#include "model/linear.h"
#include "model/lora_drop.h"

enum { B = 2, S = 4, T = B * S, IN = 7, IN_GLOBAL = 20, F0 = 3, OUT = 5, R = 3 };
static const int64_t k_pos[S] = {1, 3, 4, 6}; /* a cp piece's positions in rows of 8 */
#define ROW_LEN 8
#define ROW0 2
#define SCALE 2.0f
#define LIN_ID 3

static ml_backend *cpu(void) {
  static ml_backend *be;
  if (!be && ml_backend_get("cpu", 0, &be)) fail_msg("cpu backend: %s", ml_error_msg());
  return be;
}

static void fill(float *v, int64_t n, uint64_t seed) {
  ml_rng r = ml_rng_seed(seed);
  for (int64_t i = 0; i < n; i++) v[i] = (float)(2.0 * ml_rng_uniform(&r) - 1.0);
}

/* The adapted linear and its tensors (host memory: the CPU backend's). */
typedef struct setup {
  float x[T * IN], w[OUT * IN], a[R * IN], b[OUT * R], dy[T * OUT];
  float ga[R * IN], gb[OUT * R], dx[T * IN], y[T * OUT];
  ml_param pw, pa, pb;
  ml_linear lin;
  ml_lora_dropout ctx;
} setup;

static void setup_make(setup *s, const ml_lora_dropout *ctx) {
  memset(s, 0, sizeof *s);
  fill(s->x, T * IN, 1), fill(s->w, OUT * IN, 2), fill(s->a, R * IN, 3), fill(s->b, OUT * R, 4);
  fill(s->dy, T * OUT, 5);
  s->pw = (ml_param){.name = "w", .ndim = 2, .shape = {OUT, IN_GLOBAL}, .local = {OUT, IN},
                     .offset = {0, F0}, .data = s->w, .dtype = ML_F32};
  s->pa = (ml_param){.name = "lora_A", .ndim = 2, .shape = {R, IN_GLOBAL}, .local = {R, IN},
                     .offset = {0, F0}, .data = s->a, .dtype = ML_F32, .grad = s->ga,
                     .adapter = true};
  s->pb = (ml_param){.name = "lora_B", .ndim = 2, .shape = {OUT, R}, .local = {OUT, R},
                     .data = s->b, .dtype = ML_F32, .grad = s->gb, .adapter = true};
  if (ctx) s->ctx = *ctx;
  s->lin = (ml_linear){.weight = &s->pw, .lora_a = &s->pa, .lora_b = &s->pb,
                       .lora_scale = SCALE, .lora_drop = ctx ? &s->ctx : NULL,
                       .lora_id = LIN_ID};
}

/* Forward then backward (dx overwritten, the adapters' gradients from 0). */
static void run_linear(setup *s) {
  ml_act x = {s->x, B, S, S, IN_GLOBAL, IN}, y, dy;
  if (ml_linear_forward(cpu(), &s->lin, &x, NULL, s->y, &y)) fail_msg("%s", ml_error_msg());
  dy = (ml_act){s->dy, B, S, S, OUT, OUT};
  if (ml_linear_backward(cpu(), &s->lin, &dy, &x, NULL, s->dx, 0))
    fail_msg("%s", ml_error_msg());
}

static void test_mask_stats(void **state) {
  (void)state;
  const int64_t rows = 1024, cols = 1024;
  const double N = (double)(rows * cols);
  static const double ps[] = {0.1, 0.5, 0.9};
  for (size_t k = 0; k < sizeof ps / sizeof ps[0]; k++) {
    double p = ps[k], q = p * p + (1 - p) * (1 - p);
    uint64_t key = ml_rng_hash(ml_rng_hash(7, 11), 0), next = ml_rng_hash(ml_rng_hash(7, 11), 1);
    double dropped = 0, agree = 0;
    for (int64_t g = 0; g < rows; g++)
      for (int64_t f = 0; f < cols; f++) {
        bool a = ml_lora_drop_keep(key, g, f, cols, p), b = ml_lora_drop_keep(next, g, f, cols, p);
        dropped += !a;
        agree += a == b;
      }
    double sd = sqrt(N * p * (1 - p)), sq = sqrt(N * q * (1 - q));
    printf("p %.1f: dropped %.0f of %.0f (expected %.0f, 6 sigma %.0f); two keys agree on %.0f "
           "(expected %.0f, 6 sigma %.0f)\n", p, dropped, N, N * p, 6 * sd, agree, N * q, 6 * sq);
    assert_true(fabs(dropped - N * p) <= 6 * sd);
    assert_true(fabs(agree - N * q) <= 6 * sq);
  }
}

/* |got − ref| <= tol·abs elementwise. */
static void expect_close(const char *what, const float *got, const double *ref,
                         const double *abs, double tol, int64_t n) {
  double worst = 0;
  for (int64_t i = 0; i < n; i++) {
    double d = fabs((double)got[i] - ref[i]), bound = tol * abs[i];
    if (d > bound) fail_msg("%s[%lld]: %.9g, reference %.9g (bound %.3g)", what, (long long)i,
                            (double)got[i], ref[i], bound);
    if (bound > 0) worst = fmax(worst, d / bound);
  }
  printf("%s: worst %.3g of the bound\n", what, worst);
}

static void test_explicit_mask(void **state) {
  (void)state;
  const double p = 0.3, inv = 1.0 / (1.0 - p);
  ml_lora_dropout ctx = {.p = p, .active = true, .key = ml_rng_hash(ml_rng_hash(5, 2), 1),
                         .row0 = ROW0, .row_len = ROW_LEN, .row_pos = k_pos};
  static setup s;
  setup_make(&s, &ctx);
  run_linear(&s);
  /* the reference, in double, with the mask drawn at the global coordinates */
  uint64_t key = ml_rng_hash(ctx.key, LIN_ID);
  static double m[T][IN], xd[T][IN], axd[T][IN], u[T][R], au[T][R], du[T][R], adu[T][R];
  static double y[T][OUT], ay[T][OUT], gb[OUT][R], agb[OUT][R], ga[R][IN], aga[R][IN];
  static double dx[T][IN], adx[T][IN];
  int kept = 0;
  for (int t = 0; t < T; t++)
    for (int j = 0; j < IN; j++) {
      int64_t g = (ROW0 + t / S) * ROW_LEN + k_pos[t % S];
      m[t][j] = ml_lora_drop_keep(key, g, F0 + j, IN_GLOBAL, p) ? inv : 0.0;
      kept += m[t][j] != 0;
      xd[t][j] = s.x[t * IN + j] * m[t][j];
      axd[t][j] = fabs(xd[t][j]);
    }
  assert_true(kept > 0 && kept < T * IN); /* the mask both keeps and drops here */
  for (int t = 0; t < T; t++)
    for (int q = 0; q < R; q++) {
      u[t][q] = au[t][q] = du[t][q] = adu[t][q] = 0;
      for (int j = 0; j < IN; j++) {
        u[t][q] += xd[t][j] * s.a[q * IN + j];
        au[t][q] += axd[t][j] * fabs(s.a[q * IN + j]);
      }
      for (int o = 0; o < OUT; o++) {
        du[t][q] += SCALE * s.dy[t * OUT + o] * s.b[o * R + q];
        adu[t][q] += SCALE * fabs(s.dy[t * OUT + o] * s.b[o * R + q]);
      }
    }
  for (int t = 0; t < T; t++)
    for (int o = 0; o < OUT; o++) {
      y[t][o] = ay[t][o] = 0;
      for (int j = 0; j < IN; j++) {
        y[t][o] += s.x[t * IN + j] * s.w[o * IN + j];
        ay[t][o] += fabs(s.x[t * IN + j] * s.w[o * IN + j]);
      }
      for (int q = 0; q < R; q++) {
        y[t][o] += SCALE * u[t][q] * s.b[o * R + q];
        ay[t][o] += SCALE * au[t][q] * fabs(s.b[o * R + q]);
      }
    }
  for (int o = 0; o < OUT; o++)
    for (int q = 0; q < R; q++) {
      gb[o][q] = agb[o][q] = 0;
      for (int t = 0; t < T; t++) {
        gb[o][q] += s.dy[t * OUT + o] * SCALE * u[t][q];
        agb[o][q] += fabs(s.dy[t * OUT + o]) * SCALE * au[t][q];
      }
    }
  for (int q = 0; q < R; q++)
    for (int j = 0; j < IN; j++) {
      ga[q][j] = aga[q][j] = 0;
      for (int t = 0; t < T; t++) {
        ga[q][j] += du[t][q] * xd[t][j];
        aga[q][j] += adu[t][q] * axd[t][j];
      }
    }
  for (int t = 0; t < T; t++)
    for (int j = 0; j < IN; j++) {
      double l = 0, al = 0;
      dx[t][j] = adx[t][j] = 0;
      for (int o = 0; o < OUT; o++) {
        dx[t][j] += s.dy[t * OUT + o] * s.w[o * IN + j];
        adx[t][j] += fabs(s.dy[t * OUT + o] * s.w[o * IN + j]);
      }
      for (int q = 0; q < R; q++) {
        l += du[t][q] * s.a[q * IN + j];
        al += adu[t][q] * fabs(s.a[q * IN + j]);
      }
      dx[t][j] += l * m[t][j];
      adx[t][j] += al * m[t][j];
    }
  double k = IN + OUT + R + T + 6, tol = tol_vs_double(k, k);
  expect_close("y", s.y, &y[0][0], &ay[0][0], tol, T * OUT);
  expect_close("dB", s.gb, &gb[0][0], &agb[0][0], tol, OUT * R);
  expect_close("dA", s.ga, &ga[0][0], &aga[0][0], tol, R * IN);
  expect_close("dx", s.dx, &dx[0][0], &adx[0][0], tol, T * IN);
}

/* p = 0 (active) and p > 0 inactive: bitwise the linear with no dropout context. */
static void test_off_bitwise(void **state) {
  (void)state;
  static setup none, zero, idle;
  ml_lora_dropout z = {.p = 0, .active = true, .key = 9, .row_len = S},
                  off = {.p = 0.5, .active = false, .key = 9, .row_len = S};
  setup_make(&none, NULL);
  setup_make(&zero, &z);
  setup_make(&idle, &off);
  run_linear(&none);
  run_linear(&zero);
  run_linear(&idle);
  const setup *c[2] = {&zero, &idle};
  for (int i = 0; i < 2; i++) {
    assert_memory_equal(c[i]->y, none.y, sizeof none.y);
    assert_memory_equal(c[i]->dx, none.dx, sizeof none.dx);
    assert_memory_equal(c[i]->ga, none.ga, sizeof none.ga);
    assert_memory_equal(c[i]->gb, none.gb, sizeof none.gb);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_mask_stats),
      cmocka_unit_test(test_explicit_mask),
      cmocka_unit_test(test_off_bitwise),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
