/* CPU kernels against naive double-precision references, central finite
 * differences of sum(dy ⊙ f(x)), and literal values from torch/transformers.
 * Every comparison is per element against a bound derived in
 * tests/tolerance.h (§1 kernels, §2 finite differences, §5 AdamW): the
 * references compute, beside each value, the |.|-evaluation (or the
 * first-order error terms) the bound is a multiple of. Each check prints
 * its worst error/bound. */
#include <math.h>
#include <omp.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>  // after the headers it needs
#include <cblas.h>

#include "check_util.h"
#include "common/status.h"
#include "kernels/cpu/kernels.h"
#include "model/linear.h"
#include "tensor/dtype.h"
#include "tolerance.h"
#include "unit/attention_exact.h"

/* ---- helpers ------------------------------------------------------------ */

static void expect_within_d(const char *what, const double *got, const double *ref,
                            const double *bound, int64_t n) {
  double worst = 0.0;
  for (int64_t i = 0; i < n; i++) {
    double e = fabs(got[i] - ref[i]);
    worst = fmax(worst, bound[i] > 0 ? e / bound[i] : (e > 0 ? INFINITY : 0));
  }
  printf("  %-44s worst error/bound %.3g\n", what, worst);
  assert_true(worst <= 1.0);
}

/* bound_i = tol · (|base| + abs_i): a result accumulated onto `base`. */
static double *scaled(const double *abs, double base, double tol, int64_t n) {
  double *b = dzeros(n);
  for (int64_t i = 0; i < n; i++) b[i] = tol * (fabs(base) + abs[i]);
  return b;
}

/* ref_i + base */
static double *shifted(const double *ref, double base, int64_t n) {
  double *s = dzeros(n);
  for (int64_t i = 0; i < n; i++) s[i] = ref[i] + base;
  return s;
}

/* got vs ref (+ base) with bound tol·(|base| + abs), freeing the temporaries. */
static void expect_acc(const char *what, const float *got, const double *ref, const double *abs,
                       double base, double tol, int64_t n) {
  double *r = shifted(ref, base, n), *b = scaled(abs, base, tol, n);
  expect_within(what, got, r, b, n);
  free(r), free(b);
}

/* ---- finite differences (tolerance.h §2) ---------------------------------- */

/* Bounds on |L''| and |L'''| along coordinate i (of the perturbed tensor)
 * over the whole step; NULL: L is linear along every coordinate. */
typedef void (*fd_derivs)(void *ctx, int64_t i, double *M2, double *M3);

typedef struct fd_spec {
  /* L = sum dy·y over the double forward on the current (fp32) inputs,
   * A = sum |dy|·(|.|-evaluation of y), S = sum |dy·y| */
  void (*loss)(void *ctx, double *L, double *A, double *S);
  void (*at)(void *ctx, int64_t i); /* before coordinate i, or NULL */
  fd_derivs derivs;
  double k64; /* roundings of one output of the double forward */
  double n;   /* terms of L's sum, at most */
  void *ctx, *dctx;
} fd_spec;

/* For every `stride`-th coordinate of x[nx]: the central difference of L
 * against the kernel's gradient grad, within the Taylor remainder, the
 * rounding of the two L values and the kernel gradient's own bound gbound
 * (tolerance.h §2). The double forward stands in for the fp32 one, which
 * the forward checks tie to it element by element. */
static void fd_check(const char *what, const fd_spec *f, float *x, int64_t nx, int64_t stride,
                     const float *grad, const double *gbound, float eps) {
  double worst = 0.0;
  for (int64_t i = 0; i < nx; i += stride) {
    if (f->at) f->at(f->ctx, i);
    float xi = x[i], xp = xi + eps, xm = xi - eps;
    double L[2], A[2], S[2];
    for (int s = 0; s < 2; s++) {
      x[i] = s ? xm : xp;
      f->loss(f->ctx, &L[s], &A[s], &S[s]);
    }
    x[i] = xi;
    double h1 = (double)xp - xi, h2 = (double)xi - xm, fd = (L[0] - L[1]) / (h1 + h2);
    double M2 = 0.0, M3 = 0.0;
    if (f->derivs) f->derivs(f->dctx, i, &M2, &M3);
    double taylor = tol_fd_taylor(h1, h2, M2, M3);
    double round = (tol_gamma64(f->k64) * (A[0] + A[1]) + tol_gamma64(f->n) * (S[0] + S[1]) +
                    tol_gamma64(2.0) * (fabs(L[0]) + fabs(L[1]))) /
                   (h1 + h2);
    double bound = TOL_FIRST_ORDER * (taylor + round + gbound[i]);
    double e = fabs(grad[i] - fd);
    worst = fmax(worst, e / bound);
    if (e > bound)
      fail_msg(
          "%s: coordinate %lld: gradient %.9g, central difference %.9g (bound %.3g: Taylor "
          "%.3g, rounding %.3g, gradient %.3g)",
          what, (long long)i, (double)grad[i], fd, bound, taylor, round, gbound[i]);
  }
  printf("  %-44s worst error/bound %.3g\n", what, worst);
}

/* A double forward ref(ctx, y, ya) weighted by dy[ny], as fd_spec.loss. */
typedef void (*ref_fwd)(void *ctx, double *y, double *ya);
typedef struct fd_fwd {
  ref_fwd run;
  void *ctx;
  const float *dy;
  int64_t ny;
} fd_fwd;

static void fd_fwd_loss(void *c, double *L, double *A, double *S) {
  fd_fwd *f = c;
  double *y = dzeros(f->ny), *ya = dzeros(f->ny);
  f->run(f->ctx, y, ya);
  *L = *A = *S = 0.0;
  for (int64_t j = 0; j < f->ny; j++) {
    *L += f->dy[j] * y[j];
    *A += fabs(f->dy[j]) * ya[j];
    *S += fabs(f->dy[j] * y[j]);
  }
  free(y), free(ya);
}

/* ---- linear: model/linear.c's GEMMs on the CPU backend -------------------- */

typedef struct linear_ctx {
  float *x, *W, *b;
  int64_t T, in, out;
} linear_ctx;

static ml_backend *cpu_backend(void) {
  static ml_backend *be;
  if (!be && ml_backend_get("cpu", 0, &be)) fail_msg("cpu backend: %s", ml_error_msg());
  return be;
}

/* The nn.Linear of l with W (and b) held in `dtype` (F32, or BF16: the
 * GEMMs then run on bf16 operands), its grads in dW, db; *store keeps the
 * bf16 copies (free after use). */
typedef struct linear_mod {
  ml_param w, b;
  ml_linear lin;
  uint16_t *store;
} linear_mod;

static void linear_mod_make(const linear_ctx *l, ml_dtype dtype, float *dW, float *db,
                            linear_mod *m) {
  memset(m, 0, sizeof *m);
  m->w = (ml_param){.ndim = 2, .shape = {l->out, l->in}, .local = {l->out, l->in},
                    .data = l->W, .dtype = dtype, .grad = dW};
  m->b = (ml_param){.ndim = 1, .shape = {l->out, 1}, .local = {l->out, 1}, .data = l->b,
                    .dtype = dtype, .grad = db};
  if (dtype == ML_BF16) {
    m->store = malloc(sizeof(uint16_t) * (size_t)(l->out * (l->in + 1)));
    ml_convert_from_f32(ML_BF16, l->W, m->store, (size_t)(l->out * l->in));
    m->w.data = m->store;
    if (l->b) ml_convert_from_f32(ML_BF16, l->b, m->store + l->out * l->in, (size_t)l->out);
    m->b.data = m->store + l->out * l->in;
  }
  m->lin = (ml_linear){.weight = &m->w, .bias = l->b ? &m->b : NULL, .bias_in_forward = true};
  snprintf(m->w.name, sizeof m->w.name, "test.weight");
}

static void linear_fwd(const linear_ctx *l, ml_dtype dtype, float *y) {
  linear_mod m;
  linear_mod_make(l, dtype, NULL, NULL, &m);
  ml_act x = {l->x, 1, l->T, l->T, l->in, l->in}, yv;
  if (ml_linear_forward(cpu_backend(), &m.lin, &x, NULL, y, &yv))
    fail_msg("linear: %s", ml_error_msg());
  free(m.store);
}

/* dx (= or += when dx_acc; NULL: skipped), dW and db (+=; db NULL: no bias). */
static void linear_bwd(const linear_ctx *l, ml_dtype dtype, const float *dy, float *dx, int dx_acc,
                       float *dW, float *db) {
  linear_ctx c = *l;
  if (!db) c.b = NULL;
  linear_mod m;
  linear_mod_make(&c, dtype, dW, db, &m);
  float *g = malloc(sizeof(float) * (size_t)(l->T * l->out));
  memcpy(g, dy, sizeof(float) * (size_t)(l->T * l->out)); /* the output edge may clobber it */
  ml_act x = {l->x, 1, l->T, l->T, l->in, l->in}, gv = {g, 1, l->T, l->T, l->out, l->out};
  if (ml_linear_backward(cpu_backend(), &m.lin, &gv, &x, NULL, dx, dx_acc))
    fail_msg("linear backward: %s", ml_error_msg());
  free(g);
  free(m.store);
}

// y: [T, out] = x·W^T + b in double, ya = |b| + |x|·|W|^T
static void linear_ref(void *c, double *y, double *ya) {
  const linear_ctx *l = c;
  for (int64_t t = 0; t < l->T; t++)
    for (int64_t o = 0; o < l->out; o++) {
      double s = l->b ? l->b[o] : 0.0, a = l->b ? fabs(l->b[o]) : 0.0;
      for (int64_t i = 0; i < l->in; i++) {
        s += (double)l->x[t * l->in + i] * l->W[o * l->in + i];
        a += fabs((double)l->x[t * l->in + i] * l->W[o * l->in + i]);
      }
      y[t * l->out + o] = s;
      ya[t * l->out + o] = a;
    }
}

static void test_linear_fwd(void **state) {
  (void)state;
  int64_t T = 7, in = 13, out = 9;
  linear_ctx l = {rand_buf(T * in, 1), rand_buf(out * in, 1), rand_buf(out, 1), T, in, out};
  float *y = malloc((size_t)(T * out) * sizeof(float));
  double *ref = dzeros(T * out), *abs = dzeros(T * out);
  for (int with_bias = 0; with_bias < 2; with_bias++) {
    linear_ctx c = l;
    c.b = with_bias ? l.b : NULL;
    linear_fwd(&c, ML_F32, y);
    linear_ref(&c, ref, abs);
    /* a dot product of length in, + the bias (R2) */
    expect_acc(with_bias ? "linear fwd (bias)" : "linear fwd", y, ref, abs, 0.0,
               tol_vs_double((double)(in + with_bias), (double)(in + 1)), T * out);
  }
  free(l.x), free(l.W), free(l.b), free(y), free(ref), free(abs);
}

static void test_linear_bwd(void **state) {
  (void)state;
  int64_t T = 6, in = 11, out = 5;
  linear_ctx l = {rand_buf(T * in, 1), rand_buf(out * in, 1), rand_buf(out, 1), T, in, out};
  float *dy = rand_buf(T * out, 1), *dx = const_buf(T * in, 0.25f);
  float *dW = const_buf(out * in, 0.5f), *db = const_buf(out, -0.5f);
  double *rdx = dzeros(T * in), *rdW = dzeros(out * in), *rdb = dzeros(out);
  double *adx = dzeros(T * in), *adW = dzeros(out * in), *adb = dzeros(out);
  for (int64_t t = 0; t < T; t++)
    for (int64_t o = 0; o < out; o++) {
      double g = dy[t * out + o];
      rdb[o] += g;
      adb[o] += fabs(g);
      for (int64_t i = 0; i < in; i++) {
        rdx[t * in + i] += g * l.W[o * in + i];
        adx[t * in + i] += fabs(g * l.W[o * in + i]);
        rdW[o * in + i] += g * l.x[t * in + i];
        adW[o * in + i] += fabs(g * l.x[t * in + i]);
      }
    }
  /* dx: dot length out (+1 accumulating); dW: length T + 1; db: double
   * column sums converted and added (TOL_K_LINEAR_DB) */
  double tdx = tol_vs_double((double)out + 1, (double)out),
         tdW = tol_vs_double((double)T + 1, (double)T);
  double tdb = tol_vs_double(TOL_K_LINEAR_DB, (double)T + 1);
  linear_bwd(&l, ML_F32, dy, dx, 1, dW, db);
  expect_acc("linear bwd dx (+=)", dx, rdx, adx, 0.25, tdx, T * in);
  expect_acc("linear bwd dW (+=)", dW, rdW, adW, 0.5, tdW, out * in);
  expect_acc("linear bwd db (+=)", db, rdb, adb, -0.5, tdb, out);
  // dx overwritten, dW accumulates a second time, db skipped
  linear_bwd(&l, ML_F32, dy, dx, 0, dW, NULL);
  expect_acc("linear bwd dx (=)", dx, rdx, adx, 0.0, tol_vs_double((double)out, (double)out),
             T * in);
  for (int64_t i = 0; i < out * in; i++) rdW[i] *= 2.0, adW[i] *= 2.0;
  /* one sum of 2T + 1 terms with an intermediate rounding */
  expect_acc("linear bwd dW twice", dW, rdW, adW, 0.5, tol_vs_double(2.0 * T + 2, 2.0 * T + 1),
             out * in);
  expect_acc("linear bwd db untouched", db, rdb, adb, -0.5, tdb, out);
  for (int64_t i = 0; i < out * in; i++) rdW[i] /= 2.0, adW[i] /= 2.0;
  linear_bwd(&l, ML_F32, dy, NULL, 0, dW, NULL);  // dx skipped
  memset(dW, 0, (size_t)(out * in) * sizeof(float));
  memset(db, 0, (size_t)out * sizeof(float));
  linear_bwd(&l, ML_F32, dy, dx, 0, dW, db);
  /* L is linear in x, W and b: no Taylor remainder */
  fd_fwd fw = {linear_ref, &l, dy, T * out};
  fd_spec f = {fd_fwd_loss, NULL, NULL, (double)in + 1, (double)(T * out), &fw, NULL};
  double *gdx = scaled(adx, 0, tol_vs_double((double)out, 0), T * in);
  double *gdW = scaled(adW, 0, tol_vs_double((double)T + 1, 0), out * in);
  double *gdb = scaled(adb, 0, tol_vs_double(TOL_K_LINEAR_DB, (double)T + 1), out);
  fd_check("linear dx vs fd", &f, l.x, T * in, 1, dx, gdx, 1e-2f);
  fd_check("linear dW vs fd", &f, l.W, out * in, 1, dW, gdW, 1e-2f);
  fd_check("linear db vs fd", &f, l.b, out, 1, db, gdb, 1e-2f);
  free(gdx), free(gdW), free(gdb);
  free(l.x), free(l.W), free(l.b), free(dy), free(dx), free(dW), free(db);
  free(rdx), free(rdW), free(rdb), free(adx), free(adW), free(adb);
}

/* bf16 GEMMs (autocast): every operand rounded to bf16, products exact in
 * fp32 (8-bit significands), sums in fp32 — so against the double
 * reference on the rounded operands the bound is section 1's fp32 dot
 * product, and the rounding itself shows against the unrounded one. */
static void test_linear_bf16(void **state) {
  (void)state;
  int64_t T = 7, in = 13, out = 9;
  linear_ctx l = {rand_buf(T * in, 1), rand_buf(out * in, 1), rand_buf(out, 1), T, in, out};
  linear_ctx r = {bf16_rounded(l.x, T * in), bf16_rounded(l.W, out * in), bf16_rounded(l.b, out),
                  T, in, out};
  float *y = malloc(sizeof(float) * (size_t)(T * out));
  double *ref = dzeros(T * out), *abs = dzeros(T * out);
  linear_fwd(&l, ML_BF16, y);
  linear_ref(&r, ref, abs);
  expect_acc("linear fwd bf16 (bias)", y, ref, abs, 0.0, tol_vs_double((double)in + 1, in + 1.0),
             T * out);
  /* backward: dy rounded for both GEMMs; db sums the fp32 dy */
  float *dy = rand_buf(T * out, 1), *dyr = bf16_rounded(dy, T * out);
  float *dx = const_buf(T * in, 0.0f), *dW = const_buf(out * in, 0.0f), *db = const_buf(out, 0.0f);
  double *rdx = dzeros(T * in), *adx = dzeros(T * in), *rdW = dzeros(out * in),
         *adW = dzeros(out * in);
  for (int64_t t = 0; t < T; t++)
    for (int64_t o = 0; o < out; o++)
      for (int64_t i = 0; i < in; i++) {
        double g = dyr[t * out + o];
        rdx[t * in + i] += g * r.W[o * in + i];
        adx[t * in + i] += fabs(g * r.W[o * in + i]);
        rdW[o * in + i] += g * r.x[t * in + i];
        adW[o * in + i] += fabs(g * r.x[t * in + i]);
      }
  linear_bwd(&l, ML_BF16, dy, dx, 0, dW, db);
  expect_acc("linear bwd bf16 dx", dx, rdx, adx, 0.0, tol_vs_double((double)out, (double)out),
             T * in);
  expect_acc("linear bwd bf16 dW (+= 0)", dW, rdW, adW, 0.0, tol_vs_double(T + 1.0, (double)T),
             out * in);
  /* the rounding happened: the fp32 GEMM on the unrounded operands differs */
  float *y32 = malloc(sizeof(float) * (size_t)(T * out));
  linear_fwd(&l, ML_F32, y32);
  assert_true(memcmp(y, y32, sizeof(float) * (size_t)(T * out)) != 0);
  free(y32), free(y), free(ref), free(abs), free(dy), free(dyr), free(dx), free(dW), free(db);
  free(rdx), free(adx), free(rdW), free(adW);
  free(l.x), free(l.W), free(l.b), free(r.x), free(r.W), free(r.b);
}

/* A bf16 linear's input rounded once for the GEMMs that share it (model/linear.h ml_xr):
 * by ml_linear_round_input, or a bf16 copy as it is or widened once (ml_linear_operand_bf16:
 * fp32 holding bf16 values, read in place where the emulation does so) — the forward and both
 * backward GEMMs bitwise those that round the fp32 input themselves (xr NULL); and dy given in
 * bf16 (ml_linear_backward_bf16, which widens it once for both GEMMs where the emulation reads
 * exact fp32 in place) bitwise the fp32 dy's backward. Bitwise: rounding a bf16 value, and
 * widening one, is exact, and every path computes the same products in the same order. */
static void test_linear_operands(void **state) {
  (void)state;
  ml_backend *be = cpu_backend();
  int64_t T = 7, in = 13, out = 9;
  linear_ctx l = {rand_buf(T * in, 1), rand_buf(out * in, 1), NULL, T, in, out};
  float *dy = rand_buf(T * out, 1);
  uint16_t *x16 = malloc(sizeof(uint16_t) * (size_t)(T * in)),
           *dy16 = malloc(sizeof(uint16_t) * (size_t)(T * out));
  ml_convert_from_f32(ML_BF16, l.x, x16, (size_t)(T * in));
  ml_convert_from_f32(ML_BF16, dy, dy16, (size_t)(T * out));
  size_t ny = sizeof(float) * (size_t)(T * out), nx = sizeof(float) * (size_t)(T * in),
         nw = sizeof(float) * (size_t)(out * in);
  float *y[4], *dx[4], *dW[4];
  ml_act x = {l.x, 1, T, T, in, in}, yv;
  for (int path = 0; path < 4; path++) { /* none, round_input, bf16 as is, widened; dy16 on 3 */
    y[path] = malloc(ny), dx[path] = malloc(nx), dW[path] = const_buf(out * in, 0.0f);
    linear_mod m;
    linear_mod_make(&l, ML_BF16, dW[path], NULL, &m);
    ml_xr xr = {0};
    if (path == 1 && ml_linear_round_input(be, &m.lin, &x, &xr)) fail_msg("%s", ml_error_msg());
    if (path == 2) xr.p = x16;
    if (path == 3 && ml_linear_operand_bf16(be, x16, T, in, &xr))
      fail_msg("%s", ml_error_msg());
    /* where the emulation reads exact fp32 in place, the widened or rounded copy is fp32 */
    if (path == 1 || path == 3) assert_int_equal(xr.f32, ml_be_gemm_exact_in_place(be));
    if (ml_linear_forward(be, &m.lin, &x, path ? &xr : NULL, y[path], &yv))
      fail_msg("linear forward, path %d: %s", path, ml_error_msg());
    float *g = malloc(ny);
    memcpy(g, dy, ny);
    ml_act gv = {path == 3 ? (float *)dy16 : g, 1, T, T, out, out};
    int rc = path == 3 ? ml_linear_backward_bf16(be, &m.lin, &gv, &x, &xr, dx[path], 0)
                       : ml_linear_backward(be, &m.lin, &gv, &x, path ? &xr : NULL, dx[path], 0);
    if (rc) fail_msg("linear backward, path %d: %s", path, ml_error_msg());
    ml_linear_operand_free(be, &xr);
    free(g);
    free(m.store);
    if (!path) continue;
    if (memcmp(y[path], y[0], ny) || memcmp(dx[path], dx[0], nx) || memcmp(dW[path], dW[0], nw))
      fail_msg("path %d: y %s, dx %s, dW %s the GEMMs' own rounding's (bitwise expected)", path,
               memcmp(y[path], y[0], ny) ? "differs from" : "is",
               memcmp(dx[path], dx[0], nx) ? "differs from" : "is",
               memcmp(dW[path], dW[0], nw) ? "differs from" : "is");
  }
  for (int path = 0; path < 4; path++) free(y[path]), free(dx[path]), free(dW[path]);
  free(x16), free(dy16), free(dy), free(l.x), free(l.W);
}

/* K = 0 (a rank holding an empty torch.chunk of the inner dim): C = bias
 * or 0, or C += bias when accumulating; exactly, in either dtype. */
static void test_gemm_empty_inner(void **state) {
  (void)state;
  float C[6], bias[3] = {1.5f, -2.0f, 0.25f};
  for (int bf16 = 0; bf16 < 2; bf16++)
    for (int acc = 0; acc < 2; acc++) {
      for (int i = 0; i < 6; i++) C[i] = 7.0f;
      ml_gemm g = {.M = 2, .N = 3, .K = 0, .A = C, .a_type = ML_F32, .lda = 0, .B = C,
                   .b_type = ML_F32, .ldb = 3, .C = C, .ldc = 3, .accumulate = acc,
                   .bias = bias, .bias_type = ML_F32, .compute = bf16 ? ML_BF16 : ML_F32};
      assert_int_equal(ml_be_gemm(cpu_backend(), &g), 0);
      for (int i = 0; i < 6; i++) assert_true(C[i] == (acc ? 7.0f : 0.0f) + bias[i % 3]);
      g.bias = NULL;
      assert_int_equal(ml_be_gemm(cpu_backend(), &g), 0);
      for (int i = 0; i < 6; i++)
        assert_true(C[i] == (acc ? 7.0f + bias[i % 3] : 0.0f)); /* unchanged, or 0 */
    }
}

// x [n] rounded to bf16 (bf16 bits)
static uint16_t *bf16_copy(const float *x, int64_t n) {
  uint16_t *y = malloc((size_t)n * sizeof *y);
  for (int64_t i = 0; i < n; i++) y[i] = ml_f32_to_bf16(x[i]);
  return y;
}

/* ---- rmsnorm --------------------------------------------------------------- */

typedef struct rms_ctx {
  float *x, *w, *rstd;
  float w_offset, eps;
  int64_t T, H;
  const float *dy; /* for the finite-difference derivative bounds */
} rms_ctx;

static void rms_run(const rms_ctx *r, float *y) {
  k_rmsnorm_fwd(r->x, r->w, r->w_offset, r->eps, y, r->rstd, r->T, r->H);
}

// y = x / sqrt(mean x² + eps) · (w_offset + w) in double, its |.|-evaluation
// (|x|·rstd·(|w_offset| + |w|)) and rstd
static void rms_ref_full(const rms_ctx *r, double *y, double *ya, double *rstd) {
  for (int64_t t = 0; t < r->T; t++) {
    double ss = 0.0;
    for (int64_t h = 0; h < r->H; h++) ss += (double)r->x[t * r->H + h] * r->x[t * r->H + h];
    double rs = 1.0 / sqrt(ss / (double)r->H + r->eps);
    if (rstd) rstd[t] = rs;
    for (int64_t h = 0; h < r->H; h++) {
      double x = r->x[t * r->H + h];
      y[t * r->H + h] = x * rs * (r->w_offset + (double)r->w[h]);
      ya[t * r->H + h] = fabs(x) * rs * (fabs(r->w_offset) + fabs(r->w[h]));
    }
  }
}

static void rms_ref(void *c, double *y, double *ya) { rms_ref_full(c, y, ya, NULL); }

// dx, dw of sum(dy ⊙ y) in double, with their |.|-evaluations
static void rms_ref_bwd(const rms_ctx *r, const float *dy, double *dx, double *dw, double *adx,
                        double *adw) {
  double *y = dzeros(r->T * r->H), *ya = dzeros(r->T * r->H), *rs = dzeros(r->T);
  rms_ref_full(r, y, ya, rs);
  for (int64_t t = 0; t < r->T; t++) {
    const float *x = r->x + t * r->H, *d = dy + t * r->H;
    double dot = 0.0, adot = 0.0;
    for (int64_t h = 0; h < r->H; h++) {
      dot += d[h] * (r->w_offset + (double)r->w[h]) * x[h];
      adot += fabs(d[h] * x[h]) * (fabs(r->w_offset) + fabs(r->w[h]));
    }
    double r3 = rs[t] * rs[t] * rs[t];
    for (int64_t h = 0; h < r->H; h++) {
      double we = r->w_offset + (double)r->w[h], wa = fabs(r->w_offset) + fabs(r->w[h]);
      dx[t * r->H + h] = rs[t] * we * d[h] - x[h] * r3 * dot / (double)r->H;
      adx[t * r->H + h] = rs[t] * wa * fabs(d[h]) + fabs(x[h]) * r3 * adot / (double)r->H;
      dw[h] += d[h] * x[h] * rs[t];
      adw[h] += fabs(d[h] * x[h]) * rs[t];
    }
  }
  free(y), free(ya), free(rs);
}

/* tolerance.h §2: along x_ti, |L^(k)| <= (qH)^(-k/2)(|a|·sqrt(H)·sup|psi^(k)| +
 * |b|·q^(-1/2)·sup|phi^(k)|) with q = sum_{h != i} x_h²/H + eps, a = dy·we at
 * i, b = sum_{h != i} dy·we·x. */
static void rms_derivs_x(void *c, int64_t idx, double *M2, double *M3) {
  const rms_ctx *r = c;
  int64_t t = idx / r->H, i = idx % r->H;
  const float *x = r->x + t * r->H, *d = r->dy + t * r->H;
  double q = r->eps, a = d[i] * (r->w_offset + (double)r->w[i]), b = 0.0, H = (double)r->H;
  for (int64_t h = 0; h < r->H; h++)
    if (h != i) {
      q += (double)x[h] * x[h] / H;
      b += d[h] * (r->w_offset + (double)r->w[h]) * x[h];
    }
  double qH = q * H;
  *M2 = (fabs(a) * sqrt(H) * TOL_SUP_PSI_D2 + fabs(b) / sqrt(q) * TOL_SUP_PHI_D2) / qH;
  *M3 = (fabs(a) * sqrt(H) * TOL_SUP_PSI_D3 + fabs(b) / sqrt(q) * TOL_SUP_PHI_D3) / (qH * sqrt(qH));
}

/* k_rmsnorm_fwd_bf16 on r: y16 bitwise y (k_rmsnorm_fwd's output on r) rounded
 * (ml_f32_to_bf16), the same rstd bitwise, x only read. */
static void rms_bf16_out(const rms_ctx *r, const float *y) {
  int64_t n = r->T * r->H;
  uint16_t *y16 = malloc((size_t)n * sizeof *y16), *want = bf16_copy(y, n);
  float *rstd = malloc((size_t)r->T * sizeof(float)), *x = malloc((size_t)n * sizeof(float));
  memcpy(x, r->x, (size_t)n * sizeof(float));
  k_rmsnorm_fwd_bf16(r->x, r->w, r->w_offset, r->eps, y16, rstd, r->T, r->H);
  assert_memory_equal(y16, want, (size_t)n * sizeof *y16);
  assert_memory_equal(rstd, r->rstd, (size_t)r->T * sizeof(float));
  assert_memory_equal(x, r->x, (size_t)n * sizeof(float));
  free(y16), free(want), free(rstd), free(x);
}

static void test_rmsnorm_fwd(void **state) {
  (void)state;
  int64_t T = 6, H = 37;
  for (int gemma = 0; gemma < 2; gemma++) {
    rms_ctx r = {
        rand_buf(T * H, 2), rand_buf(H, 1), malloc(T * sizeof(float)), gemma, 1e-6f, T, H, NULL};
    double *ref = dzeros(T * H), *abs = dzeros(T * H), *rrs = dzeros(T);
    rms_ref_full(&r, ref, abs, rrs);
    float *y = malloc((size_t)(T * H) * sizeof(float));
    rms_run(&r, y);
    double ty = tol_vs_double(TOL_K_RMS_FWD, (double)H + TOL_K_RMS_FWD);
    expect_acc(gemma ? "rmsnorm fwd (w_offset 1)" : "rmsnorm fwd", y, ref, abs, 0.0, ty, T * H);
    expect_acc("rmsnorm rstd", r.rstd, rrs, rrs, 0.0,
               tol_vs_double(TOL_K_RMS_RSTD, (double)H + TOL_K_RMS_RSTD), T);
    rms_bf16_out(&r, y);
    /* and on ties: x = ±1 and eps 0 give rstd 1 exactly, so y = ±(w_offset + w), set to
     * 1 + 2^-8 and 1 + 3·2^-8, halfway between bf16 neighbours (even: 1 and 1 + 2^-6) */
    float *x0 = malloc((size_t)(T * H) * sizeof(float)), *w0 = malloc((size_t)H * sizeof(float));
    memcpy(x0, r.x, (size_t)(T * H) * sizeof(float));
    memcpy(w0, r.w, (size_t)H * sizeof(float));
    for (int64_t h = 0; h < H; h++) {
      r.x[h] = h % 3 ? 1.0f : -1.0f;
      r.w[h] = 1.0f + (h % 2 ? 0x1p-8f : 0x3p-8f) - r.w_offset; /* exact */
    }
    r.eps = 0.0f;
    rms_run(&r, y);
    for (int64_t h = 0; h < H; h++) assert_true(fabsf(y[h]) == 1.0f + (h % 2 ? 0x1p-8f : 0x3p-8f));
    assert_int_equal(ml_f32_to_bf16(1.0f + 0x3p-8f), 0x3f82); /* to even, not truncated */
    assert_int_equal(ml_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80); /* nor away from zero */
    rms_bf16_out(&r, y);
    memcpy(r.x, x0, (size_t)(T * H) * sizeof(float));
    memcpy(r.w, w0, (size_t)H * sizeof(float));
    r.eps = 1e-6f;
    free(x0), free(w0);
    k_rmsnorm_fwd(r.x, r.w, r.w_offset, r.eps, r.x, r.rstd, T, H);  // y aliases x
    expect_acc("rmsnorm fwd in place", r.x, ref, abs, 0.0, ty, T * H);
    free(r.x), free(r.w), free(r.rstd), free(ref), free(abs), free(rrs), free(y);
  }
}

static void test_rmsnorm_bwd(void **state) {
  (void)state;
  int64_t T = 5, H = 19;
  for (int gemma = 0; gemma < 2; gemma++) {
    float *dy = rand_buf(T * H, 1);
    rms_ctx r = {
        rand_buf(T * H, 2), rand_buf(H, 1), malloc(T * sizeof(float)), gemma, 1e-5f, T, H, dy};
    float *dx = malloc((size_t)(T * H) * sizeof(float));
    float *dw = const_buf(H, 0.5f), *y = malloc((size_t)(T * H) * sizeof(float));
    double *rdx = dzeros(T * H), *rdw = dzeros(H), *adx = dzeros(T * H), *adw = dzeros(H);
    rms_ref_bwd(&r, dy, rdx, rdw, adx, adw);
    rms_run(&r, y);
    k_rmsnorm_bwd(dy, r.x, r.w, r.w_offset, r.rstd, dx, dw, T, H);
    double tdx = tol_vs_double(TOL_K_RMS_DX, (double)H + TOL_K_RMS_DX);
    double tdw = tol_vs_double(TOL_K_RMS_DW, (double)(H + T) + TOL_K_RMS_DW);
    expect_acc("rmsnorm bwd dx vs ref", dx, rdx, adx, 0.0, tdx, T * H);
    expect_acc("rmsnorm bwd dw (+=) vs ref", dw, rdw, adw, 0.5, tdw, H);
    for (int64_t h = 0; h < H; h++) dw[h] -= 0.5f;
    /* dw - 0.5 is exact (Sterbenz when dw is within a factor 2 of 0.5;
     * otherwise one more rounding, at most u·|dw|, inside tdw's slack of
     * the added 0.5 term) */
    double *gdx = scaled(adx, 0, tdx, T * H), *gdw = scaled(adw, 1.0, tdw, H);
    fd_fwd ff = {rms_ref, &r, dy, T * H};
    fd_spec fx = {fd_fwd_loss, NULL, rms_derivs_x, (double)H + 8, (double)(T * H), &ff, &r};
    fd_spec fw = {fd_fwd_loss,     NULL, NULL, (double)H + 8,
                  (double)(T * H), &ff,  NULL}; /* linear in w */
    fd_check("rmsnorm dx vs fd", &fx, r.x, T * H, 1, dx, gdx, 1e-2f);
    fd_check("rmsnorm dw vs fd", &fw, r.w, H, 1, dw, gdw, 1e-2f);
    rms_run(&r, y);  // restore rstd of the unperturbed input
    k_rmsnorm_bwd(dy, r.x, r.w, r.w_offset, r.rstd, dy, NULL, T, H);  // dx aliases dy
    expect_acc("rmsnorm bwd in place, dw NULL", dy, rdx, adx, 0.0, tdx, T * H);
    free(gdx), free(gdw);
    free(r.x), free(r.w), free(r.rstd), free(dy), free(dx), free(dw), free(y);
    free(rdx), free(rdw), free(adx), free(adw);
  }
}

/* ---- rope ------------------------------------------------------------------ */


// HF _compute_llama3_parameters in double
static double llama3_ref(double f, double factor, double lo, double hi, double old) {
  double wavelen = 2.0 * M_PI / f, low_wl = old / lo, high_wl = old / hi;
  if (wavelen > low_wl) return f / factor;
  if (wavelen < high_wl) return f;
  double smooth = (old / wavelen - lo) / (hi - lo);
  return (1.0 - smooth) * f / factor + smooth * f;
}

/* relative: |got_i - ref_i| <= tol·|ref_i| */
static void expect_rel(const char *what, const float *got, const double *ref, double tol,
                       int64_t n) {
  double *abs = dzeros(n);
  for (int64_t i = 0; i < n; i++) abs[i] = fabs(ref[i]);
  expect_acc(what, got, ref, abs, 0.0, tol, n);
  free(abs);
}

static void test_rope_inv_freq(void **state) {
  (void)state;
  enum { HD = 16 };
  float inv[HD / 2];
  double ref[HD / 2];
  assert_true(k_rope_inv_freq(10000.0, HD, NULL, 1, inv) == 1.0);
  for (int i = 0; i < HD / 2; i++) ref[i] = 1.0 / pow(10000.0, 2.0 * i / HD);
  expect_rel("rope inv_freq default", inv, ref, tol_inv_freq_rel(10000.0), HD / 2);
  ml_rope_scaling lin = {.type = ML_ROPE_LINEAR, .factor = 4.0};
  assert_true(k_rope_inv_freq(10000.0, HD, &lin, 1, inv) == 1.0);
  for (int i = 0; i < HD / 2; i++) ref[i] /= 4.0;
  expect_rel("rope inv_freq linear", inv, ref, tol_inv_freq_rel(10000.0), HD / 2);
  // transformers 5.23 llama3 inv_freq (theta 5e5, factor 8, low 1, high 4)
  static const double hf[2][HD / 2] = {
      {0x1p+0, 0x1.8d276p-3, 0x1.34119p-5, 0x1.ddee9ep-8, 0x1.132ba4p-11, 0x1.1f91fp-15,
       0x1.be2188p-18, 0x1.5a0f4ep-20},
      {0x1p+0, 0x1.453c18p-4, 0x1.34119p-8, 0x1.ddee9ep-11, 0x1.72ba42p-13, 0x1.1f91fp-15,
       0x1.be2188p-18, 0x1.5a0f4ep-20}};
  static const double originals[2] = {8192.0, 64.0};
  double tl3 = tol_llama3_rel(500000.0, 8.0, 1.0, 4.0);
  for (int c = 0; c < 2; c++) {
    ml_rope_scaling l3 = {.type = ML_ROPE_LLAMA3, .factor = 8.0, .low_freq_factor = 1.0,
                          .high_freq_factor = 4.0, .original_max_positions = originals[c]};
    assert_true(k_rope_inv_freq(500000.0, HD, &l3, 1, inv) == 1.0);
    for (int i = 0; i < HD / 2; i++)
      ref[i] = llama3_ref(1.0 / pow(500000.0, 2.0 * i / HD), 8.0, 1.0, 4.0, originals[c]);
    expect_rel(c ? "rope llama3 (original 64) vs double" : "rope llama3 (original 8192) vs double",
               inv, ref, tl3, HD / 2);
    /* transformers computes the same formula in fp32 (its own pow): both
     * within tl3 of the exact value */
    double *h = dzeros(HD / 2);
    for (int i = 0; i < HD / 2; i++) h[i] = hf[c][i];
    expect_rel("rope llama3 vs transformers", inv, h, 2.0 * tl3, HD / 2);
    free(h);
  }
}

/* transformers 5.23 ROPE_INIT_FUNCTIONS[type](config, seq_len=...) of a
 * head_dim 16 config: inv_freq (fp32) and attention factor; each fp32
 * evaluation within the type's bound (tolerance.h) of the exact value, so
 * meshlm's within twice it of transformers'. */
typedef struct hf_rope_case {
  const char *what;
  double theta;
  ml_rope_scaling sc;
  int64_t seq_len;
  double lo, hi; /* yarn: its correction range (find_correction_range) */
  const float *shorts, *longs; /* longrope */
  double attention_factor, inv_freq[8];
} hf_rope_case;

static void test_rope_scalings(void **state) {
  (void)state;
  enum { HD = 16 };
  static const float shorts[8] = {1.0f, 1.1f, 1.2f, 1.3f, 1.4f, 1.5f, 1.6f, 1.7f};
  static const float longs[8] = {1.5f, 2.0f, 2.5f, 3.0f, 3.5f, 4.0f, 4.5f, 5.0f};
  static const float ones[8] = {1, 1, 1, 1, 1, 1, 1, 1}, twos[8] = {2, 2, 2, 2, 2, 2, 2, 2};
  /* llama_yarn's correction range, untruncated: [0, 16 ln(16 / (0.5·2π)) / (2 ln 1e4)] */
  const double fx_hi = 0x1.69f7fc7b1222p+0;
  static hf_rope_case cases[] = {
      /* dynamic_rope_update past max_position_embeddings 16: seq_len 24 */
      {"dynamic (seq 24 > 16)", 1e4, {.type = ML_ROPE_DYNAMIC, .factor = 2, .max_positions = 16},
       24, 0, 0, NULL, NULL, 1.0,
       {0x1p+0, 0x1.2549f6p-2, 0x1.500266p-4, 0x1.80f3d4p-6, 0x1.b9064cp-8, 0x1.f943ap-10,
        0x1.216e32p-11, 0x1.4b96cp-13}},
      {"dynamic (seq 100000 > 4096)", 5e5,
       {.type = ML_ROPE_DYNAMIC, .factor = 8, .max_positions = 4096}, 100000, 0, 0, NULL, NULL, 1.0,
       {0x1p+0, 0x1.77d7b2p-4, 0x1.13e4d2p-7, 0x1.950ca4p-11, 0x1.295566p-14, 0x1.b4869ep-18,
        0x1.40707ep-21, 0x1.d672c8p-25}},
      {"yarn (llama_yarn's)", 1e4,
       {.type = ML_ROPE_YARN, .factor = 4, .original_max_positions = 16, .max_positions = 64,
        .beta_fast = 8, .beta_slow = 0.5, .truncate = false},
       1, 0, 0 /* set below */, NULL, NULL, 0x1.237d37fe5d298p+0,
       {0x1p+0, 0x1.301ba8p-3, 0x1.99999ap-6, 0x1.030dc6p-7, 0x1.47ae14p-9, 0x1.9e7c7p-11,
        0x1.0624dep-12, 0x1.4b96cp-14}},
      {"yarn (mscale 1, mscale_all_dim 0.707)", 1e4,
       {.type = ML_ROPE_YARN, .factor = 8, .original_max_positions = 4096, .max_positions = 32768,
        .mscale = 1.0, .mscale_all_dim = 0.707, .truncate = true},
       1, 2, 6, NULL, NULL, 0x1.0d992a365ebecp+0,
       {0x1p+0, 0x1.43d136p-2, 0x1.99999ap-4, 0x1.94c584p-6, 0x1.70a3d6p-8, 0x1.1cf58cp-10,
        0x1.0624dep-13, 0x1.4b96cp-15}},
      {"yarn (no factor: 16384 / 4096)", 1e6,
       {.type = ML_ROPE_YARN, .original_max_positions = 4096, .max_positions = 16384,
        .truncate = true},
       1, 1, 4, NULL, NULL, 0x1.237d37fe5d298p+0,
       {0x1p+0, 0x1.6c310ep-3, 0x1.8494a8p-6, 0x1.708938p-9, 0x1.0624dep-12, 0x1.74eea6p-15,
        0x1.094564p-17, 0x1.796182p-20}},
      {"longrope (seq 16: short)", 1e4,
       {.type = ML_ROPE_LONGROPE, .original_max_positions = 16, .max_positions = 64}, 16, 0, 0,
       shorts, longs, 0x1.3988e1409212ep+0,
       {0x1p+0, 0x1.266118p-2, 0x1.555556p-4, 0x1.8e8b58p-6, 0x1.d41d42p-8, 0x1.1452f6p-9,
        0x1.47ae14p-11, 0x1.861ac2p-13}},
      {"longrope (seq 17: long)", 1e4,
       {.type = ML_ROPE_LONGROPE, .original_max_positions = 16, .max_positions = 64}, 17, 0, 0,
       shorts, longs, 0x1.3988e1409212ep+0,
       {0x1.555556p-1, 0x1.43d136p-3, 0x1.47ae14p-5, 0x1.5967bp-7, 0x1.767dcep-9, 0x1.9e7c7p-11,
        0x1.d208a6p-13, 0x1.094566p-14}},
      {"longrope (attention_factor 1.25)", 1e4,
       {.type = ML_ROPE_LONGROPE, .factor = 2, .attention_factor = 1.25,
        .original_max_positions = 16, .max_positions = 64},
       17, 0, 0, ones, twos, 1.25,
       {0x1p-1, 0x1.43d136p-3, 0x1.99999ap-5, 0x1.030dc6p-6, 0x1.47ae14p-8, 0x1.9e7c7p-10,
        0x1.0624dep-11, 0x1.4b96cp-13}},
  };
  cases[2].hi = fx_hi;
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    hf_rope_case *k = &cases[c];
    ml_rope_scaling *sc = &k->sc;
    double tol = tol_yarn_rel(k->theta, sc->factor ? sc->factor : 4.0, HD, k->lo, k->hi);
    if (sc->type == ML_ROPE_DYNAMIC)
      tol = tol_dynamic_rel(k->theta, sc->factor, (double)k->seq_len, sc->max_positions, HD);
    if (sc->type == ML_ROPE_LONGROPE) {
      tol = tol_longrope_rel(k->theta);
      memcpy(sc->short_factor, k->shorts, sizeof shorts);
      memcpy(sc->long_factor, k->longs, sizeof longs);
    }
    float inv[HD / 2];
    double af = k_rope_inv_freq(k->theta, HD, sc, k->seq_len, inv);
    print_message("%s: attention factor %.17g (transformers %.17g)\n", k->what, af,
                  k->attention_factor);
    assert_true(fabs(af - k->attention_factor) <=
                TOL_ROPE_ATTENTION_FACTOR_REL * k->attention_factor);
    double *h = dzeros(HD / 2);
    for (int i = 0; i < HD / 2; i++) h[i] = k->inv_freq[i];
    expect_rel(k->what, inv, h, 2.0 * tol, HD / 2);
    free(h);
  }
  /* up to max_position_embeddings dynamic is the default RoPE, bit for bit */
  ml_rope_scaling dyn = {.type = ML_ROPE_DYNAMIC, .factor = 2, .max_positions = 16};
  float a[HD / 2], b[HD / 2];
  k_rope_inv_freq(1e4, HD, &dyn, 16, a);
  k_rope_inv_freq(1e4, HD, NULL, 16, b);
  assert_memory_equal(a, b, sizeof a);
}

static void test_rope_tables(void **state) {
  (void)state;
  int64_t hd = 12, S = 300, half = hd / 2;
  float inv[6], *c = malloc((size_t)(S * half) * sizeof(float)),
                *s = malloc((size_t)(S * half) * sizeof(float));
  double *rc = dzeros(S * half), *rs = dzeros(S * half), *bound = dzeros(S * half);
  k_rope_inv_freq(10000.0, hd, NULL, S, inv);
  k_rope_tables(inv, 1.0f, hd, S, c, s);
  for (int64_t p = 0; p < S; p++)
    for (int64_t i = 0; i < half; i++) {
      double a = (float)p * inv[i];  // the kernel's fp32 angle
      rc[p * half + i] = cos(a);
      rs[p * half + i] = sin(a);
      bound[p * half + i] = TOL_ROPE_TABLE_ABS;
    }
  expect_within("rope tables cos (abs)", c, rc, bound, S * half);
  expect_within("rope tables sin (abs)", s, rs, bound, S * half);
  free(c), free(s), free(rc), free(rs), free(bound);
}

// x: [B*S, nh, hd] rotated by dir·angle in double; ya its |.|-evaluation
static void rope_ref(const float *x, const float *c, const float *s, int64_t B, int64_t S,
                     int64_t nh, int64_t hd, double dir, double *y, double *ya) {
  int64_t half = hd / 2;
  for (int64_t t = 0; t < B * S; t++)
    for (int64_t h = 0; h < nh; h++)
      for (int64_t i = 0; i < half; i++) {
        int64_t o = (t * nh + h) * hd + i, p = (t % S) * half + i;
        double x1 = x[o], x2 = x[o + half], sn = dir * s[p];
        y[o] = x1 * c[p] - x2 * sn;
        y[o + half] = x2 * c[p] + x1 * sn;
        ya[o] = fabs(x1 * c[p]) + fabs(x2 * sn);
        ya[o + half] = fabs(x2 * c[p]) + fabs(x1 * sn);
      }
}

static void test_rope_apply(void **state) {
  (void)state;
  int64_t B = 2, S = 5, nh = 3, hd = 8, n = B * S * nh * hd;
  float inv[4], c[5 * 4], s[5 * 4];
  k_rope_inv_freq(10000.0, hd, NULL, S, inv);
  k_rope_tables(inv, 1.0f, hd, S, c, s);
  float *x = rand_buf(n, 1), *y = malloc((size_t)n * sizeof(float)), *g = rand_buf(n, 1);
  float *dx = malloc((size_t)n * sizeof(float));
  double *ref = dzeros(n), *ya = dzeros(n), *dxa = dzeros(n);
  double t2 = tol_vs_double(TOL_K_ROPE, TOL_K_ROPE);
  memcpy(y, x, (size_t)n * sizeof(float));
  k_rope_fwd(y, c, s, B, S, nh, hd);
  rope_ref(x, c, s, B, S, nh, hd, 1.0, ref, ya);
  expect_acc("rope fwd", y, ref, ya, 0.0, t2, n);
  /* the bf16 output (ml_be_rope_fwd_bf16): bitwise the fp32 rotation rounded, x only read */
  float *xr = malloc((size_t)n * sizeof(float));
  uint16_t *yh = malloc((size_t)n * sizeof(uint16_t)), *yr = bf16_copy(y, n);
  memcpy(xr, x, (size_t)n * sizeof(float));
  k_rope_fwd_bf16(xr, yh, c, s, B, S, nh, hd);
  assert_memory_equal(yh, yr, (size_t)n * sizeof(uint16_t));
  assert_memory_equal(xr, x, (size_t)n * sizeof(float));
  free(xr), free(yh), free(yr);
  memcpy(dx, g, (size_t)n * sizeof(float));
  k_rope_bwd(dx, c, s, B, S, nh, hd);
  rope_ref(g, c, s, B, S, nh, hd, -1.0, ref, dxa);
  expect_acc("rope bwd", dx, ref, dxa, 0.0, t2, n);
  /* <rope(x), g> = <x, rope_bwd(g)> exactly for the rotation by the fp32
   * tables; the computed sides differ by the outputs' errors weighted by
   * the other factor, and the double sums' rounding (R2) */
  double lhs = 0.0, rhs = 0.0, bound = 0.0, sa = 0.0;
  for (int64_t i = 0; i < n; i++) {
    lhs += (double)y[i] * g[i], rhs += (double)x[i] * dx[i];
    bound += t2 * (fabs(g[i]) * ya[i] + fabs(x[i]) * dxa[i]);
    sa += fabs((double)y[i] * g[i]) + fabs((double)x[i] * dx[i]);
  }
  bound = TOL_FIRST_ORDER * (bound + tol_gamma64((double)n) * sa);
  double d = lhs - rhs, zero = 0.0;
  expect_within_d("rope bwd is the adjoint", &d, &zero, &bound, 1);
  /* the bf16 output: bitwise dx (the fp32 backward) rounded, g untouched; g's first head of
   * position 0 (cos 1, sin 0: an exact rotation) holds ties to even */
  for (int64_t i = 0; i < hd; i++) g[i] = 1.0f + (i % 2 ? 0x1p-8f : 0x3p-8f);
  memcpy(dx, g, (size_t)n * sizeof(float));
  k_rope_bwd(dx, c, s, B, S, nh, hd);
  float *gc = malloc((size_t)n * sizeof(float));
  uint16_t *y16 = malloc((size_t)n * 2), *r16 = malloc((size_t)n * 2);
  memcpy(gc, g, (size_t)n * sizeof(float));
  ml_convert_from_f32(ML_BF16, dx, r16, (size_t)n);
  k_rope_bwd_bf16(g, y16, c, s, B, S, nh, hd);
  if (memcmp(y16, r16, (size_t)n * 2)) fail_msg("rope bwd bf16: differs from bwd rounded");
  if (memcmp(g, gc, (size_t)n * sizeof(float))) fail_msg("rope bwd bf16: its input changed");
  free(gc), free(y16), free(r16);
  free(x), free(y), free(g), free(dx), free(ref), free(ya), free(dxa);
}

/* ---- expf --------------------------------------------------------------------- */

/* k_expf against libm's expf, bitwise: on glibc (2.28+, the FMA build its
 * ifunc picks with AVX-512) the vector lanes repeat expf's operations
 * (expf.c), so TOL_EXACT; under another libm the bound is the 1 ulp R4
 * grants expf itself. Inputs: every 251st bit pattern (all signs, NaNs,
 * infinities, subnormals, the overflow and underflow branches), then
 * lengths 0..40 for the vector tails. */
static void expect_expf(const float *x, int64_t n) {
  float *y = malloc((size_t)(n ? n : 1) * sizeof(float));
  k_expf(x, y, n);
  for (int64_t i = 0; i < n; i++) {
    float want = expf(x[i]);
#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 28)
    bool ok = memcmp(&want, &y[i], sizeof want) == 0;
#else
    bool ok = (isnan(want) && isnan(y[i])) || want == y[i] ||
              fabsf(want - y[i]) <= fabsf(nextafterf(want, INFINITY) - want);
#endif
    if (!ok) fail_msg("k_expf(%a) = %a, expf gives %a", (double)x[i], (double)y[i], (double)want);
  }
  free(y);
}

static void test_expf(void **state) {
  (void)state;
  int64_t n = (int64_t)(0x100000000ull / 251) + 1;
  float *x = malloc((size_t)n * sizeof(float));
  for (int64_t i = 0; i < n; i++) {
    uint32_t u = (uint32_t)(i * 251);
    memcpy(&x[i], &u, sizeof u);
  }
  expect_expf(x, n);
  for (int64_t len = 0; len <= 40; len++) expect_expf(x + 1000 * len, len);
  printf("  %-44s %lld inputs, all equal\n", "k_expf vs expf", (long long)n);
  free(x);
}

/* k_add_bf16: y bitwise k_add's, y16 bitwise its sums rounded (ml_f32_to_bf16), on an odd
 * length and one past K_PAR_MIN (threads); ties 1 + 2^-8 and 1 + 3·2^-8 (sums exact) go to
 * even: 1 and 1 + 2^-6. */
static void test_add_bf16(void **state) {
  (void)state;
  const int64_t sizes[] = {37, K_PAR_MIN + 3};
  for (int c = 0; c < 2; c++) {
    int64_t n = sizes[c];
    float *x = rand_buf(n, 3.0f), *y = rand_buf(n, 1.0f);
    for (int i = 0; i < 4; i++) y[i] = 1.0f, x[i] = i % 2 ? 0x1p-8f : 0x3p-8f;
    float *yr = malloc((size_t)n * sizeof(float));
    memcpy(yr, y, (size_t)n * sizeof(float));
    uint16_t *y16 = malloc((size_t)n * sizeof *y16);
    k_add(yr, x, n);
    k_add_bf16(y, x, y16, n);
    uint16_t *want = bf16_copy(yr, n);
    assert_memory_equal(y, yr, (size_t)n * sizeof(float));
    assert_memory_equal(y16, want, (size_t)n * sizeof *y16);
    for (int i = 0; i < 4; i++) assert_int_equal(y16[i], i % 2 ? 0x3f80 : 0x3f82);
    free(x), free(y), free(yr), free(y16), free(want);
  }
}

/* k_add_to: z = y + x bitwise k_add's sums, out of place and onto either operand (z = x,
 * z = y), on an odd length and one past K_PAR_MIN (threads). */
static void test_add_to(void **state) {
  (void)state;
  const int64_t sizes[] = {37, K_PAR_MIN + 3};
  for (int c = 0; c < 2; c++) {
    int64_t n = sizes[c];
    size_t bytes = (size_t)n * sizeof(float);
    float *x = rand_buf(n, 3.0f), *y = rand_buf(n, 1.0f), *want = malloc(bytes);
    float *z = malloc(bytes), *zx = malloc(bytes), *zy = malloc(bytes);
    y[0] = -0.0f, x[0] = -0.0f; /* -0 + -0 = -0, kept */
    memcpy(want, y, bytes);
    k_add(want, x, n);
    memcpy(zx, x, bytes), memcpy(zy, y, bytes);
    k_add_to(z, y, x, n);
    k_add_to(zx, y, zx, n);
    k_add_to(zy, zy, x, n);
    assert_memory_equal(z, want, bytes);
    assert_memory_equal(zx, want, bytes);
    assert_memory_equal(zy, want, bytes);
    free(x), free(y), free(want), free(z), free(zx), free(zy);
  }
}

/* k_round_bf16_to: y bitwise ml_round_bf16 of a copy of x, y16 bitwise x converted
 * (ml_f32_to_bf16) and so the rounded y converted too; with y16 NULL, and in place (y = x).
 * Inputs: ties to even both ways (1 + 2^-8 -> 1, 1 + 3·2^-8 -> 1 + 2^-6), ±0, ±inf, NaNs
 * (quiet, signalling, negative: canonical 0x7fc0), the largest finite value (-> inf), the
 * smallest subnormal, then random bit patterns; an odd length and one past K_PAR_MIN. */
static void test_round_bf16_to(void **state) {
  (void)state;
  static const uint32_t special[] = {0x3f808000, 0x3f818000, 0x00000000, 0x80000000,
                                     0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001,
                                     0xff812345, 0x7f7fffff, 0x00000001, 0x3f80ffff};
  const int64_t sizes[] = {37, K_PAR_MIN + 3};
  uint32_t bits = 12345u;
  for (int c = 0; c < 2; c++) {
    int64_t n = sizes[c];
    size_t bytes = (size_t)n * sizeof(float), hbytes = (size_t)n * sizeof(uint16_t);
    float *x = malloc(bytes), *want = malloc(bytes), *y = malloc(bytes), *z = malloc(bytes);
    for (int64_t i = 0; i < n; i++) {
      bits = bits * 1664525u + 1013904223u; /* an LCG: every exponent and mantissa */
      uint32_t u = i < (int64_t)(sizeof special / sizeof special[0]) ? special[i] : bits;
      memcpy(&x[i], &u, sizeof u);
    }
    memcpy(want, x, bytes);
    ml_round_bf16(want, (size_t)n);
    uint16_t *want16 = bf16_copy(x, n), *again16 = bf16_copy(want, n), *y16 = malloc(hbytes);
    assert_memory_equal(want16, again16, hbytes); /* the rounding is idempotent */
    assert_int_equal(want16[0], 0x3f80), assert_int_equal(want16[1], 0x3f82);
    k_round_bf16_to(x, y, y16, n);
    assert_memory_equal(y, want, bytes);
    assert_memory_equal(y16, want16, hbytes);
    memset(y, 0, bytes);
    k_round_bf16_to(x, y, NULL, n);
    assert_memory_equal(y, want, bytes);
    memcpy(z, x, bytes);
    memset(y16, 0, hbytes);
    k_round_bf16_to(z, z, y16, n);
    assert_memory_equal(z, want, bytes);
    assert_memory_equal(y16, want16, hbytes);
    free(x), free(want), free(y), free(z), free(want16), free(again16), free(y16);
  }
}

/* y[i], x[i] (i < n): the bit patterns pairs[i] for i < np, then an LCG's (*bits its state:
 * every exponent and mantissa). */
static void fill_pairs(float *y, float *x, int64_t n, const uint32_t (*pairs)[2], int64_t np,
                       uint32_t *bits) {
  for (int64_t i = 0; i < n; i++) {
    uint32_t u[2];
    for (int k = 0; k < 2; k++) {
      *bits = *bits * 1664525u + 1013904223u;
      u[k] = i < np ? pairs[i][k] : *bits;
    }
    memcpy(&y[i], &u[0], 4), memcpy(&x[i], &u[1], 4);
  }
}

/* k_add_grad: bitwise the passes it fuses (parallel/fsdp_grads.c add_grad): ml_round_bf16 of a
 * copy of x (round), then k_add into y, or into zeros (overwrite: y, filled with a NaN, is not
 * read), up to the payload of a NaN + NaN. Pairs (y, x) first: −0 into zeros (+0, as 0 + −0;
 * −0 + −0 = −0 when added), a tie
 * (1 + 2^-8: rounded to 1), inf + −inf, a signalling NaN, the smallest subnormal (rounded to
 * 0), the largest finite value (rounded to inf); then random bit patterns; an odd length and
 * one past K_PAR_MIN. */
static void test_add_grad(void **state) {
  (void)state;
  static const uint32_t pairs[][2] = {{0x80000000, 0x80000000}, {0x3f800000, 0x3b800000},
                                      {0x7f800000, 0xff800000}, {0x3f800000, 0x7f800001},
                                      {0x3f800000, 0x00000001}, {0x00000000, 0x7f7fffff}};
  enum { NP = sizeof pairs / sizeof pairs[0] };
  const int64_t sizes[] = {37, K_PAR_MIN + 3};
  uint32_t bits = 4242u;
  for (int c = 0; c < 2; c++) {
    int64_t n = sizes[c];
    size_t bytes = (size_t)n * sizeof(float);
    float *x = malloc(bytes), *y = malloc(bytes), *xr = malloc(bytes), *want = malloc(bytes),
          *z = malloc(bytes);
    fill_pairs(y, x, n, pairs, NP, &bits);
    for (int mode = 0; mode < 4; mode++) {
      bool overwrite = mode & 1, round = mode & 2;
      memcpy(xr, x, bytes);
      if (round) ml_round_bf16(xr, (size_t)n);
      if (overwrite) memset(want, 0, bytes);
      else memcpy(want, y, bytes);
      k_add(want, xr, n);
      if (overwrite)
        for (int64_t i = 0; i < n; i++) z[i] = NAN;
      else memcpy(z, y, bytes);
      k_add_grad(z, x, n, overwrite, round);
      for (int64_t i = 0; i < n; i++) /* NaN + NaN: a NaN, whose payload the compiler picks */
        if (!overwrite && isnan(y[i]) && isnan(x[i])) {
          assert_true(isnan(z[i]));
          z[i] = want[i];
        }
      assert_memory_equal(z, want, bytes);
      uint32_t z0;
      memcpy(&z0, &z[0], 4);
      assert_int_equal(z0, overwrite ? 0x00000000u : 0x80000000u); /* 0 + −0, −0 + −0 */
    }
    free(x), free(y), free(xr), free(want), free(z);
  }
}

/* k_add_round_to: z bitwise k_add_to then k_round_bf16_to of z in place, z16 bitwise its copy;
 * out of place, onto either operand (z = y, z = x), with z16 NULL. Pairs first, each sum's
 * bf16 written out: ties to even both signs (1 + 2^-8 -> 1, 1 + 3·2^-8 -> 1 + 2^-6, -1 - 2^-8
 * -> -1), -0 + -0 = -0, +0 + -0 = +0, inf + 1, inf + -inf (NaN), a signalling NaN, the
 * largest finite value (-> inf), a sum that overflows fp32, the smallest subnormal (-> 0),
 * a subnormal tie (-> even); then random bit patterns; an odd length and one past K_PAR_MIN. */
static void test_add_round_to(void **state) {
  (void)state;
  static const uint32_t pairs[][2] = {
      {0x3f800000, 0x3b800000}, {0x3f800000, 0x3c400000}, {0xbf800000, 0xbb800000},
      {0x80000000, 0x80000000}, {0x00000000, 0x80000000}, {0x7f800000, 0x3f800000},
      {0x7f800000, 0xff800000}, {0x7f800001, 0x00000000}, {0x7f7fffff, 0x00000000},
      {0x7f7f0000, 0x7f7f0000}, {0x00000001, 0x00000000}, {0x00010000, 0x00008000}};
  static const uint16_t sums[] = {0x3f80, 0x3f82, 0xbf80, 0x8000, 0x0000, 0x7f80,
                                  0,      0,      0x7f80, 0x7f80, 0x0000, 0x0002};
  enum { NP = sizeof pairs / sizeof pairs[0] };
  const int64_t sizes[] = {37, K_PAR_MIN + 3};
  uint32_t bits = 777u;
  for (int c = 0; c < 2; c++) {
    int64_t n = sizes[c];
    size_t bytes = (size_t)n * sizeof(float), hbytes = (size_t)n * sizeof(uint16_t);
    float *x = malloc(bytes), *y = malloc(bytes), *want = malloc(bytes), *z = malloc(bytes);
    uint16_t *want16 = malloc(hbytes), *z16 = malloc(hbytes);
    fill_pairs(y, x, n, pairs, NP, &bits);
    k_add_to(want, y, x, n);
    k_round_bf16_to(want, want, want16, n);
    for (int i = 0; i < NP; i++)
      if (i == 6 || i == 7) assert_true((want16[i] & 0x7f80) == 0x7f80 && (want16[i] & 0x7f));
      else assert_int_equal(want16[i], sums[i]);
    k_add_round_to(z, y, x, z16, n);
    assert_memory_equal(z, want, bytes);
    assert_memory_equal(z16, want16, hbytes);
    memset(z, 0, bytes);
    k_add_round_to(z, y, x, NULL, n);
    assert_memory_equal(z, want, bytes);
    memcpy(z, y, bytes), memset(z16, 0, hbytes);
    k_add_round_to(z, z, x, z16, n); /* z = y */
    assert_memory_equal(z, want, bytes);
    assert_memory_equal(z16, want16, hbytes);
    memcpy(z, x, bytes);
    k_add_round_to(z, y, z, NULL, n); /* z = x */
    assert_memory_equal(z, want, bytes);
    free(x), free(y), free(want), free(z), free(want16), free(z16);
  }
}

/* ---- attention ---------------------------------------------------------------- */

typedef struct attn_ctx {
  float *q, *k, *v, *P; /* P: the exact kernel's probabilities [B, nh, S, S] */
  int64_t B, S, nh, nkv, hd, window;
  float scale;
  const float *dout; /* finite differences: the loss weights */
  /* finite differences: the rows [i0, i1) of heads [h0, h1) of batch b0
   * that a perturbed coordinate can change */
  int64_t b0, h0, h1, i0, i1;
  /* the relative error of P and dS as the products read them: 0 (fp32), or
   * TOL_U_BF16 (bf16 products: both rounded to bf16, nearest) */
  double lowp;
  /* the kernel the reference bounds: the exact one (eager attention,
   * tests/unit/attention_exact.c: false) or FlashAttention-2's (true),
   * whose rows go through at most `rescales` online-softmax steps (key
   * tiles and block merges, each rescaling the running sum and output) */
  bool flash;
  double rescales;
  float *lse; /* the flash kernel's log-sum-exp [B][S, nh] */
  bool fixed; /* the flash kernel's forward in the batch-invariant order (fixed_order) */
} attn_ctx;

static k_attn_block attn_whole(const attn_ctx *a) {
  return (k_attn_block){.B = a->B, .sq = a->S, .sk = a->S, .nh = a->nh, .nkv = a->nkv,
                        .hd = a->hd, .q_bs = a->S * a->nh * a->hd, .k_bs = a->S * a->nkv * a->hd,
                        .l_bs = a->S * a->nh, .scale = a->scale, .window = a->window,
                        .fixed_order = a->fixed};
}

// the same whole-sequence block as the backend's ml_be_attention_block_* take it
static ml_attn_block attn_whole_be(const attn_ctx *a) {
  return (ml_attn_block){.B = a->B, .sq = a->S, .sk = a->S, .nh = a->nh, .nkv = a->nkv,
                         .hd = a->hd, .q_bs = a->S * a->nh * a->hd, .k_bs = a->S * a->nkv * a->hd,
                         .l_bs = a->S * a->nh, .scale = a->scale, .window = a->window};
}

// the kernels' tiles (64-byte aligned, as the backend holds them)
static float *attn_tiles(int64_t hd) {
  size_t bytes = (size_t)k_attention_tile_floats(hd) * sizeof(float);
  return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

// key tiles of the flash kernel over S keys
static double key_tiles(int64_t S) { return (double)((S + K_ATTN_TILE_K - 1) / K_ATTN_TILE_K); }

// the flash kernel on the whole sequences: out, a->lse
static void attn_run(attn_ctx *a, float *out) {
  k_attn_block blk = attn_whole(a);
  float *tiles = attn_tiles(a->hd);
  assert_int_equal(k_attention_block_fwd(&blk, a->q, a->k, a->v, out, a->lse, false, NULL, tiles),
                   0);
  free(tiles);
}

// its backward: dq, dk, dv (=)
static void attn_run_bwd(attn_ctx *a, const float *dout, const float *out, float *dq, float *dk,
                         float *dv) {
  k_attn_block blk = attn_whole(a);
  int64_t nq = a->B * a->S * a->nh * a->hd, nk = a->B * a->S * a->nkv * a->hd;
  memset(dq, 0, (size_t)nq * sizeof(float));
  memset(dk, 0, (size_t)nk * sizeof(float));
  memset(dv, 0, (size_t)nk * sizeof(float));
  size_t wb = k_attention_bwd_work(&blk, K_ATTN_BWD_STORE);
  float *tiles = attn_tiles(a->hd);
  void *work = malloc(wb);
  assert_int_equal(k_attention_block_bwd(&blk, dout, a->q, a->k, a->v, out, a->lse, dq, dk, dv,
                                         NULL, work, wb, tiles),
                   0);
  free(tiles), free(work);
}

// the exact kernel: out, a->P
static void attn_run_exact(attn_ctx *a, float *out) {
  assert_int_equal(eager_attention_fwd(a->q, a->k, a->v, out, a->P, a->B, a->S, a->nh, a->nkv,
                                       a->hd, a->scale, a->window, NULL),
                   0);
}

static int visible(int64_t i, int64_t j, int64_t window) {
  return j <= i && (window <= 0 || j > i - window);
}

/* Per-element results and bounds of the double reference (tolerance.h §1,
 * attention; first order, made strict by TOL_FIRST_ORDER). */
typedef struct attn_ref_out {
  double *out, *out_b, *out_a; /* [nq]: value, bound, sum_j P|v| */
  double *P, *P_b;             /* [B, nh, S, S] */
  double *lse, *lse_b;         /* [B][S, nh] */
  double *dq, *dq_b, *dk, *dk_b, *dv, *dv_b;
} attn_ref_out;

static attn_ref_out attn_ref_alloc(const attn_ctx *a) {
  int64_t nq = a->B * a->S * a->nh * a->hd, nk = a->B * a->S * a->nkv * a->hd;
  int64_t np = a->B * a->nh * a->S * a->S, nl = a->B * a->S * a->nh;
  attn_ref_out o = {dzeros(nq), dzeros(nq), dzeros(nq), dzeros(np), dzeros(np), dzeros(nl),
                    dzeros(nl), dzeros(nq), dzeros(nq), dzeros(nk), dzeros(nk), dzeros(nk),
                    dzeros(nk)};
  return o;
}

static void attn_ref_free(attn_ref_out *o) {
  free(o->out), free(o->out_b), free(o->out_a), free(o->P), free(o->P_b), free(o->lse);
  free(o->lse_b), free(o->dq), free(o->dq_b), free(o->dk), free(o->dk_b), free(o->dv);
  free(o->dv_b);
}

/* The double reference of rows [i0, i1) of heads [h0, h1) of batch b (all
 * when h1 == 0); with dout also dq, dk, dv (+=) and all bounds, for the
 * kernel a->flash names. The double arithmetic's own error is bounded by
 * gamma64 of K64 roundings of the same |.|-evaluations. */
static void attn_ref_rows(const attn_ctx *a, const float *dout, attn_ref_out *o, int64_t b0,
                          int64_t b1, int64_t h0, int64_t h1, int64_t i0, int64_t i1) {
  int64_t S = a->S, hd = a->hd, group = a->nh / a->nkv;
  double R = a->flash ? a->rescales : 0.0; /* online-softmax steps: a sum of S gets R more terms */
  double *s = dzeros(S), *sa = dzeros(S), *p = dzeros(S), *dp = dzeros(S), *dpa = dzeros(S);
  double u = TOL_U, gs = tol_gamma((double)S + R);
  double gsg1 = tol_gamma((double)(S * group) + 1 + R * group);
  for (int64_t b = b0; b < b1; b++)
    for (int64_t h = h0; h < h1; h++)
      for (int64_t i = i0; i < i1; i++) {
        int64_t g = h / group, qo = ((b * S + i) * a->nh + h) * hd, lo = (b * S + i) * a->nh + h;
        const float *qi = a->q + qo;
        double m = -INFINITY, sum = 0.0, maxd = 0.0, maxsm = 0.0, smax = 0.0;
        int64_t nvis = 0;
        for (int64_t j = 0; j < S; j++) {
          const float *kj = a->k + ((b * S + j) * a->nkv + g) * hd;
          double dot = 0.0, adot = 0.0;
          for (int64_t d = 0; d < hd; d++)
            dot += (double)qi[d] * kj[d], adot += fabs((double)qi[d] * kj[d]);
          s[j] = a->scale * dot;
          sa[j] = a->scale * adot;
          if (visible(i, j, a->window)) {
            m = fmax(m, s[j]);
            maxd = fmax(maxd, tol_gamma((double)hd + 1) * sa[j]);
            smax = fmax(smax, sa[j]);
            nvis++;
          }
        }
        for (int64_t j = 0; j < S; j++) {
          p[j] = visible(i, j, a->window) ? exp(s[j] - m) : 0.0;
          if (p[j] > 0) maxsm = fmax(maxsm, fabs(s[j] - m));
          sum += p[j];
        }
        for (int64_t j = 0; j < S; j++) p[j] /= sum;
        /* relative error of every P_ij as the forward weighs it, and the
         * reference's own; flash: each of the R rescales exp(m − m') (|m −
         * m'| <= max|s − m|) multiplies the running sum and the output by a
         * factor off by u·max|s − m| + (TOL_LIBM + 2)u: once each */
        double epsP = 2.0 * (2.0 * maxd + u * maxsm + TOL_LIBM * u) + tol_gamma((double)nvis) +
                      2.0 * u + 2.0 * R * (u * maxsm + (TOL_LIBM + 2.0) * u);
        double e64 = tol_gamma64(4.0 * ((double)hd + 1) * (1.0 + smax) + 3.0 * S + 20.0);
        /* flash: lse = m + logf(l), m off by max d, log l by l's relative
         * error (within eps_P), logf TOL_LIBM·u·|log l|, the sum u·|lse|;
         * the backward recomputes P = exp(s − lse): s off by d_j, the
         * subtraction u·|s − lse| <= u(max|s − m| + log l), expf */
        double L = m + log(sum);
        double eL = maxd + epsP + TOL_LIBM * u * log(sum) + u * fabs(L);
        o->lse[lo] = L;
        o->lse_b[lo] = TOL_FIRST_ORDER * (eL + e64 * (1.0 + fabs(L)));
        double epsB = a->flash ? maxd + eL + u * (maxsm + log(sum)) + TOL_LIBM * u : epsP;
        /* P as P·v and P^T·dout read it: rounded once more with lowp */
        double epsPr = epsP + a->lowp * (1.0 + epsP), epsBr = epsB + a->lowp * (1.0 + epsB);
        double *Prow = o->P + ((b * a->nh + h) * S + i) * S,
               *Pb = o->P_b + ((b * a->nh + h) * S + i) * S;
        for (int64_t j = 0; j < S; j++)
          Prow[j] = p[j], Pb[j] = TOL_FIRST_ORDER * (epsP + e64) * p[j];
        double D_out = 0.0; /* flash: the error of D = dout·out from out's */
        for (int64_t d = 0; d < hd; d++) {
          double y = 0.0, ya = 0.0;
          for (int64_t j = 0; j < S; j++) {
            double vj = a->v[((b * S + j) * a->nkv + g) * hd + d];
            y += p[j] * vj, ya += p[j] * fabs(vj);
          }
          double ey = (gs + epsPr + gs * epsPr + e64) * ya;
          o->out[qo + d] = y;
          o->out_a[qo + d] = ya;
          o->out_b[qo + d] = TOL_FIRST_ORDER * ey;
          if (dout) D_out += fabs((double)dout[qo + d]) * (ey + fabs(y) * tol_gamma64((double)hd));
        }
        if (!dout) continue;
        double D = 0.0, Da = 0.0, dD = 0.0;
        for (int64_t j = 0; j < S; j++) {
          const float *vj = a->v + ((b * S + j) * a->nkv + g) * hd;
          dp[j] = dpa[j] = 0.0;
          for (int64_t d = 0; d < hd; d++)
            dp[j] += (double)dout[qo + d] * vj[d], dpa[j] += fabs((double)dout[qo + d] * vj[d]);
          D += p[j] * dp[j];
          Da += p[j] * fabs(dp[j]);
          dD += p[j] * (epsP * fabs(dp[j]) + tol_gamma((double)hd) * dpa[j]);
        }
        /* eager: D = sum_j P·dP (its P and dP products); flash: D = dout·out
         * in double (= sum_j P·dP exactly), off by dout·(out's error); both
         * converted to fp32 */
        dD = (a->flash ? D_out : dD) + (u + tol_gamma64((double)S)) * Da;
        for (int64_t j = 0; j < S; j++) {
          if (p[j] == 0.0) continue;
          int64_t ko = ((b * S + j) * a->nkv + g) * hd;
          double ds = p[j] * (dp[j] - D), dsa = p[j] * (fabs(dp[j]) + fabs(D));
          double dds = p[j] * ((epsB + tol_gamma(2.0)) * (fabs(dp[j]) + fabs(D)) +
                               tol_gamma((double)hd) * dpa[j] + dD);
          /* dS as dS·k and dS^T·q read it (rounded with lowp): |dS − ds| <=
           * dds + lowp·(|ds| + dds); the sums' roundings are against the
           * terms they add, at most dsa + that */
          dds += a->lowp * (fabs(ds) + dds);
          double dsa_r = a->lowp > 0 ? dsa + dds : dsa;
          for (int64_t d = 0; d < hd; d++) {
            double kd = a->k[ko + d], qd = qi[d], od = dout[qo + d];
            o->dq[qo + d] += a->scale * ds * kd;
            o->dq_b[qo + d] +=
                a->scale * ((tol_gamma((double)S + 1 + R) + e64) * dsa_r + dds) * fabs(kd);
            o->dk[ko + d] += a->scale * ds * qd;
            o->dk_b[ko + d] += a->scale * ((gsg1 + e64) * dsa_r + dds) * fabs(qd);
            o->dv[ko + d] += p[j] * od;
            o->dv_b[ko + d] += (gsg1 + epsBr + gsg1 * a->lowp + e64) * p[j] * fabs(od);
          }
        }
      }
  free(s), free(sa), free(p), free(dp), free(dpa);
}

static void attn_ref(const attn_ctx *a, const float *dout, attn_ref_out *o) {
  attn_ref_rows(a, dout, o, 0, a->B, 0, a->nh, 0, a->S);
  int64_t nq = a->B * a->S * a->nh * a->hd, nk = a->B * a->S * a->nkv * a->hd;
  for (int64_t i = 0; i < nq; i++) o->dq_b[i] *= TOL_FIRST_ORDER;
  for (int64_t i = 0; i < nk; i++) o->dk_b[i] *= TOL_FIRST_ORDER, o->dv_b[i] *= TOL_FIRST_ORDER;
}

/* Finite differences: L restricted to the rows a perturbed coordinate can
 * change (the others are identical in both evaluations and cancel). */
static void attn_fd_loss(void *c, double *L, double *A, double *S) {
  attn_ctx *a = c;
  attn_ref_out o = attn_ref_alloc(a);
  attn_ref_rows(a, NULL, &o, a->b0, a->b0 + 1, a->h0, a->h1, a->i0, a->i1);
  *L = *A = *S = 0.0;
  for (int64_t i = a->i0; i < a->i1; i++)
    for (int64_t h = a->h0; h < a->h1; h++)
      for (int64_t d = 0; d < a->hd; d++) {
        int64_t at = ((a->b0 * a->S + i) * a->nh + h) * a->hd + d;
        double dy = a->dout[at];
        *L += dy * o.out[at];
        *A += fabs(dy) * o.out_a[at];
        *S += fabs(dy * o.out[at]);
      }
  attn_ref_free(&o);
}

/* Ranges over the visible keys of row i (head h, batch b) of a_j = scale·k_jd
 * (Ra) and of c_j = dout_i·v_j (Rc). */
static void attn_ranges(const attn_ctx *a, int64_t b, int64_t h, int64_t i, int64_t d, double *Ra,
                        double *Rc) {
  int64_t g = h / (a->nh / a->nkv), qo = ((b * a->S + i) * a->nh + h) * a->hd;
  double alo = INFINITY, ahi = -INFINITY, clo = INFINITY, chi = -INFINITY;
  for (int64_t j = 0; j < a->S; j++) {
    if (!visible(i, j, a->window)) continue;
    int64_t ko = ((b * a->S + j) * a->nkv + g) * a->hd;
    double aj = a->scale * a->k[ko + d], cj = 0.0;
    for (int64_t e = 0; e < a->hd; e++) cj += (double)a->dout[qo + e] * a->v[ko + e];
    alo = fmin(alo, aj), ahi = fmax(ahi, aj), clo = fmin(clo, cj), chi = fmax(chi, cj);
  }
  *Ra = ahi - alo;
  *Rc = chi - clo;
}

/* tolerance.h §2, attention along q_id: |f''| <= Ra²Rc, |f'''| <= 19/16·Ra³Rc */
static void attn_derivs_q(void *c, int64_t idx, double *M2, double *M3) {
  attn_ctx *a = c;
  int64_t d = idx % a->hd, h = (idx / a->hd) % a->nh, t = idx / (a->hd * a->nh);
  double Ra, Rc;
  attn_ranges(a, t / a->S, h, t % a->S, d, &Ra, &Rc);
  *M2 = Ra * Ra * Rc;
  *M3 = TOL_SOFTMAX_D3 * Ra * Ra * Ra * Rc;
}

/* along k_jd: every row i that sees key j, with a = scale·q_id at j only */
static void attn_derivs_k(void *c, int64_t idx, double *M2, double *M3) {
  attn_ctx *a = c;
  int64_t d = idx % a->hd, g = (idx / a->hd) % a->nkv, t = idx / (a->hd * a->nkv);
  int64_t b = t / a->S, j = t % a->S, group = a->nh / a->nkv;
  *M2 = *M3 = 0.0;
  for (int64_t h = g * group; h < (g + 1) * group; h++)
    for (int64_t i = j; i < a->S; i++) {
      if (!visible(i, j, a->window)) continue;
      double Ra, Rc, qa = fabs(a->scale * a->q[((b * a->S + i) * a->nh + h) * a->hd + d]);
      attn_ranges(a, b, h, i, d, &Ra, &Rc);
      *M2 += qa * qa * Rc;
      *M3 += TOL_SOFTMAX_D3 * qa * qa * qa * Rc;
    }
}

/* The rows a coordinate of q changes: its own row of its head. */
static void attn_at_q(void *c, int64_t idx) {
  attn_ctx *a = c;
  int64_t h = (idx / a->hd) % a->nh, t = idx / (a->hd * a->nh);
  a->b0 = t / a->S, a->h0 = h, a->h1 = h + 1, a->i0 = t % a->S, a->i1 = a->i0 + 1;
}

/* ... of k or v (key j of kv head g): rows j.. of the group's heads. */
static void attn_at_kv(void *c, int64_t idx) {
  attn_ctx *a = c;
  int64_t g = (idx / a->hd) % a->nkv, t = idx / (a->hd * a->nkv), group = a->nh / a->nkv;
  a->b0 = t / a->S, a->h0 = g * group, a->h1 = (g + 1) * group, a->i0 = t % a->S, a->i1 = a->S;
}

// a case: sizes, window, scale
#define ATTN(B_, S_, nh_, nkv_, hd_, window_, scale_)                                    \
  {.B = B_, .S = S_, .nh = nh_, .nkv = nkv_, .hd = hd_, .window = window_, .scale = scale_}
static const attn_ctx ATTN_CASES[] = {
    ATTN(2, 5, 4, 2, 8, 0, 0.35f),  // GQA
    // GQA + sliding window
    ATTN(2, 5, 4, 2, 8, 3, 0.35f),
    ATTN(2, 7, 3, 3, 6, 0, 0.4f),   // MHA, odd sizes
    ATTN(1, 300, 4, 2, 16, 0, 0.25f),  // several query and key tiles
    ATTN(1, 300, 2, 1, 16, 100, 0.25f),
    // sliding windows: Gemma3-like (window 8 < S = 24, scale 24^-0.5), only
    // the query itself (window 1), a window past S (= full causal), and one
    // reaching back across a key tile into the previous one with GQA
    ATTN(2, 24, 4, 2, 16, 8, 0.20412415f),
    ATTN(1, 7, 2, 1, 4, 1, 0.5f),
    ATTN(2, 5, 4, 2, 8, 9, 0.35f),
    ATTN(1, 300, 4, 2, 16, 130, 0.25f),
};

/* The case's inputs, room for both kernels' saved tensors, and the flash
 * kernel's bounds (one rescale per key tile). */
static attn_ctx attn_alloc(attn_ctx a) {
  int64_t nq = a.B * a.S * a.nh * a.hd, nk = a.B * a.S * a.nkv * a.hd;
  a.q = rand_buf(nq, 1.5f), a.k = rand_buf(nk, 1.5f), a.v = rand_buf(nk, 1);
  a.P = malloc((size_t)(a.B * a.nh * a.S * a.S) * sizeof(float));
  a.lse = malloc((size_t)(a.B * a.S * a.nh) * sizeof(float));
  a.flash = true;
  a.rescales = key_tiles(a.S);
  return a;
}

static void attn_free(attn_ctx *a) {
  free(a->q), free(a->k), free(a->v), free(a->P), free(a->lse);
}

static void attn_name(char *what, size_t n, const char *part, const attn_ctx *a) {
  snprintf(what, n, "attention %s S=%lld window=%lld", part, (long long)a->S,
           (long long)a->window);
}

/* out, a->lse, dq, dk, dv against the reference r (what: "attention PART ...") */
static void expect_attention(const char *part, const attn_ctx *a, const attn_ref_out *r,
                             const float *out, const float *dq, const float *dk,
                             const float *dv) {
  int64_t nq = a->B * a->S * a->nh * a->hd, nk = a->B * a->S * a->nkv * a->hd;
  char what[80];
  attn_name(what, sizeof what, part, a);
  printf("  %s\n", what);
  expect_within("  out", out, r->out, r->out_b, nq);
  expect_within("  lse", a->lse, r->lse, r->lse_b, a->B * a->S * a->nh);
  expect_within("  dq", dq, r->dq, r->dq_b, nq);
  expect_within("  dk", dk, r->dk, r->dk_b, nk);
  expect_within("  dv", dv, r->dv, r->dv_b, nk);
}

/* |x − y| <= bx + by: two results each within its bound of the same
 * reference (the triangle inequality through it) */
static void expect_pair(const char *what, const float *x, const float *y, const double *bx,
                        const double *by, int64_t n) {
  double *yd = dzeros(n), *b = dzeros(n);
  for (int64_t i = 0; i < n; i++) yd[i] = y[i], b[i] = bx[i] + by[i];
  expect_within(what, x, yd, b, n);
  free(yd), free(b);
}

/* The flash kernel's forward against the double reference (out and lse),
 * the exact kernel's against the same reference with its own bounds (out
 * and P), and the two against each other. */
static void test_attention_fwd(void **state) {
  (void)state;
  for (size_t c = 0; c < sizeof ATTN_CASES / sizeof ATTN_CASES[0]; c++) {
    attn_ctx a = attn_alloc(ATTN_CASES[c]), e = a;
    e.flash = false;
    int64_t nq = a.B * a.S * a.nh * a.hd, np = a.B * a.nh * a.S * a.S;
    float *out = malloc((size_t)nq * sizeof(float)), *oute = malloc((size_t)nq * sizeof(float));
    attn_ref_out r = attn_ref_alloc(&a), re = attn_ref_alloc(&e);
    attn_run(&a, out);
    attn_run_exact(&e, oute);
    attn_ref(&a, NULL, &r);
    attn_ref(&e, NULL, &re);
    char what[64];
    attn_name(what, sizeof what, "fwd", &a);
    expect_within(what, out, r.out, r.out_b, nq);
    expect_within("attention lse", a.lse, r.lse, r.lse_b, a.B * a.S * a.nh);
    expect_within("attention exact out", oute, re.out, re.out_b, nq);
    expect_within("attention exact P", e.P, re.P, re.P_b, np); /* masked: bound 0, exactly 0 */
    expect_pair("attention fwd vs exact", out, oute, r.out_b, re.out_b, nq);
    free(out), free(oute);
    attn_ref_free(&r), attn_ref_free(&re);
    attn_free(&a);
  }
}

/* The batch-invariant forward (k_attn_block.fixed_order) against the
 * double reference with the flash kernel's bounds: each row still goes
 * through at most key_tiles(S) online-softmax steps (its keys lie in that
 * many tiles at multiples of K_ATTN_TILE_K), its scores and P·v are sums
 * in some order (tolerance.h R2 bounds any). */
static void test_attention_fixed_fwd(void **state) {
  (void)state;
  for (size_t c = 0; c < sizeof ATTN_CASES / sizeof ATTN_CASES[0]; c++) {
    attn_ctx a = attn_alloc(ATTN_CASES[c]);
    a.fixed = true;
    int64_t nq = a.B * a.S * a.nh * a.hd;
    float *out = malloc((size_t)nq * sizeof(float));
    attn_ref_out r = attn_ref_alloc(&a);
    attn_run(&a, out);
    attn_ref(&a, NULL, &r);
    char what[80];
    attn_name(what, sizeof what, "fixed-order fwd", &a);
    expect_within(what, out, r.out, r.out_b, nq);
    expect_within("attention fixed-order lse", a.lse, r.lse, r.lse_b, a.B * a.S * a.nh);
    free(out);
    attn_ref_free(&r);
    attn_free(&a);
  }
}

/* Rows [i0, i0 + sq) of sequence b of a (q_pos i0 against keys 0 .. i0+sq−1,
 * as a KV cache or a chunked prefill holds them) in the fixed order, fp32
 * or packed bf16 (lp: the rounded q, k, v of the whole sequences): out
 * [sq, nh, hd], lse [sq, nh]. */
static void fixed_rows(const attn_ctx *a, const k_attn_bf16 *lp, int64_t b, int64_t i0,
                       int64_t sq, float *tiles, float *out, float *lse) {
  int64_t qr = a->nh * a->hd, kr = a->nkv * a->hd;
  k_attn_block blk = {.B = 1, .sq = sq, .sk = i0 + sq, .nh = a->nh, .nkv = a->nkv, .hd = a->hd,
                      .q_pos = i0, .q_bs = sq * qr, .k_bs = a->S * kr, .l_bs = sq * a->nh,
                      .scale = a->scale, .window = a->window, .fixed_order = true};
  int64_t qo = (b * a->S + i0) * qr, ko = b * a->S * kr;
  k_attn_bf16 part;
  if (lp) {
    part = *lp;
    part.q = (const uint16_t *)lp->q + qo, part.k = (const uint16_t *)lp->k + ko;
    part.v = (const uint16_t *)lp->v + ko;
  }
  assert_int_equal(k_attention_block_fwd(&blk, a->q + qo, a->k + ko, a->v + ko, out, lse, false,
                                         lp ? &part : NULL, tiles),
                   0);
}

/* The batch-invariant forward is the same bit pattern (memcmp) for a query
 * whatever block computes it: the whole batch of sequences, its sequence
 * alone, a KV-cache step (sq = 1 at q_pos p against the keys 0 .. p), and
 * chunks of a prefill (q_pos at 0, 37, 150), over several key tiles, GQA
 * and sliding windows inside and across tiles, fp32 and packed bf16. */
static void test_attention_fixed_blocks(void **state) {
  (void)state;
  static const attn_ctx cases[] = {
      ATTN(2, 300, 4, 2, 16, 0, 0.25f),
      ATTN(2, 300, 4, 1, 16, 40, 0.25f),
      ATTN(2, 300, 2, 1, 16, 130, 0.25f),
  };
  const int64_t cut[] = {0, 37, 150, 151, 300};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
    for (int bf = 0; bf < 2; bf++) {
      attn_ctx a = attn_alloc(cases[c]);
      a.fixed = true;
      int64_t qr = a.nh * a.hd, nq = a.B * a.S * qr, nk = a.B * a.S * a.nkv * a.hd;
      k_attn_bf16 lp = {.packed = true};
      if (bf) lp.q = bf16_copy(a.q, nq), lp.k = bf16_copy(a.k, nk), lp.v = bf16_copy(a.v, nk);
      float *tiles = attn_tiles(a.hd), *out = malloc((size_t)nq * sizeof(float));
      float *o = malloc((size_t)(a.S * qr) * sizeof(float)), *l = malloc(sizeof(float) * a.S * a.nh);
      k_attn_block whole = attn_whole(&a);
      assert_int_equal(
          k_attention_block_fwd(&whole, a.q, a.k, a.v, out, a.lse, false, bf ? &lp : NULL, tiles),
          0);
      for (int64_t b = 0; b < a.B; b++) {
        const float *ob = out + b * a.S * qr, *lb = a.lse + b * a.S * a.nh;
        fixed_rows(&a, bf ? &lp : NULL, b, 0, a.S, tiles, o, l); /* alone */
        assert_memory_equal(o, ob, sizeof(float) * (size_t)(a.S * qr));
        assert_memory_equal(l, lb, sizeof(float) * (size_t)(a.S * a.nh));
        for (int k = 0; k + 1 < 5; k++) { /* prefill chunks */
          fixed_rows(&a, bf ? &lp : NULL, b, cut[k], cut[k + 1] - cut[k], tiles, o, l);
          assert_memory_equal(o, ob + cut[k] * qr, sizeof(float) * (size_t)((cut[k + 1] - cut[k]) * qr));
          assert_memory_equal(l, lb + cut[k] * a.nh,
                              sizeof(float) * (size_t)((cut[k + 1] - cut[k]) * a.nh));
        }
        for (int64_t p = 0; p < a.S; p++) { /* KV-cache steps */
          fixed_rows(&a, bf ? &lp : NULL, b, p, 1, tiles, o, l);
          assert_memory_equal(o, ob + p * qr, sizeof(float) * (size_t)qr);
          assert_memory_equal(l, lb + p * a.nh, sizeof(float) * (size_t)a.nh);
        }
      }
      printf("  attention fixed order S=%lld window=%lld %s: batch = alone = chunks = KV steps, "
             "bitwise\n",
             (long long)a.S, (long long)a.window, bf ? "bf16" : "fp32");
      free((void *)lp.q), free((void *)lp.k), free((void *)lp.v);
      free(tiles), free(out), free(o), free(l);
      attn_free(&a);
    }
}

/* The row kernel (kernels.h K_ATTN_ROWS): a block of at most K_ATTN_ROWS
 * query rows in the default mode is the fixed order's bit pattern (decode
 * steps and short chunks at several positions, fp32 and packed bf16,
 * GQA, windows); and its tasks, which take a kv head's query heads
 * together, give a tp rank's heads (a group split across ranks:
 * head_off, group) the bits of the same heads in the whole call. */
static void test_attention_rows(void **state) {
  (void)state;
  static const attn_ctx cases[] = {
      ATTN(1, 300, 9, 3, 16, 0, 0.25f), /* SmolLM2's grouping, three key tiles */
      ATTN(1, 300, 4, 1, 16, 40, 0.25f),
  };
  const int64_t at_pos[] = {0, 5, 127, 128, 200, 299 - K_ATTN_ROWS};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
    for (int bf = 0; bf < 2; bf++) {
      attn_ctx a = attn_alloc(cases[c]);
      int64_t qr = a.nh * a.hd, nq = a.B * a.S * qr, nk = a.B * a.S * a.nkv * a.hd;
      k_attn_bf16 lp = {.packed = true};
      if (bf) lp.q = bf16_copy(a.q, nq), lp.k = bf16_copy(a.k, nk), lp.v = bf16_copy(a.v, nk);
      float *tiles = attn_tiles(a.hd);
      size_t ob = sizeof(float) * (size_t)(K_ATTN_ROWS * qr);
      size_t lb = sizeof(float) * (size_t)(K_ATTN_ROWS * a.nh);
      float *o1 = malloc(ob), *o2 = malloc(ob), *l1 = malloc(lb), *l2 = malloc(lb);
      for (size_t p = 0; p < sizeof at_pos / sizeof *at_pos; p++)
        for (int64_t sq = 1; sq <= K_ATTN_ROWS; sq += K_ATTN_ROWS - 1) {
          fixed_rows(&a, bf ? &lp : NULL, 0, at_pos[p], sq, tiles, o1, l1);
          k_attn_block blk = {.B = 1, .sq = sq, .sk = at_pos[p] + sq, .nh = a.nh, .nkv = a.nkv,
                              .hd = a.hd, .q_pos = at_pos[p], .q_bs = sq * qr,
                              .k_bs = a.S * a.nkv * a.hd, .l_bs = sq * a.nh, .scale = a.scale,
                              .window = a.window};
          k_attn_bf16 part = lp;
          if (bf) part.q = (const uint16_t *)lp.q + at_pos[p] * qr;
          assert_int_equal(k_attention_block_fwd(&blk, a.q + at_pos[p] * qr, a.k, a.v, o2, l2,
                                                 false, bf ? &part : NULL, tiles),
                           0);
          assert_memory_equal(o1, o2, sizeof(float) * (size_t)(sq * qr));
          assert_memory_equal(l1, l2, sizeof(float) * (size_t)(sq * a.nh));
        }
      printf("  attention rows <= %d, S=%lld nh %lld nkv %lld %s: default = fixed order, "
             "bitwise\n",
             K_ATTN_ROWS, (long long)a.S, (long long)a.nh, (long long)a.nkv, bf ? "bf16" : "fp32");
      free((void *)lp.q), free((void *)lp.k), free((void *)lp.v);
      free(tiles), free(o1), free(o2), free(l1), free(l2);
      attn_free(&a);
    }
  /* SmolLM2's 9 query heads over 3 kv heads cut for tp 2 and 4 (5 + 4, 3 + 2 + 2 + 2: kv
     heads shared), decode steps in the fixed order: each rank's heads = the whole call's */
  attn_ctx a = attn_alloc((attn_ctx)ATTN(1, 200, 9, 3, 16, 0, 0.25f));
  int64_t g = 3, hd = a.hd, p = 150, qr = a.nh * hd;
  float *tiles = attn_tiles(hd), *whole = malloc(sizeof(float) * (size_t)qr);
  float *wl = malloc(sizeof(float) * (size_t)a.nh);
  fixed_rows(&a, NULL, 0, p, 1, tiles, whole, wl);
  for (int tp = 2; tp <= 4; tp += 2)
    for (int r = 0; r < tp; r++) {
      int64_t base = a.nh / tp, extra = a.nh % tp;
      int64_t q0 = r * base + (r < extra ? r : extra), n = base + (r < extra);
      int64_t kv0 = q0 / g, nkv = (q0 + n - 1) / g + 1 - kv0;
      size_t qb = sizeof(float) * (size_t)(n * hd), kb = sizeof(float) * (size_t)(a.S * nkv * hd);
      float *lq = malloc(qb), *lo = malloc(qb), *lk = malloc(kb), *lv = malloc(kb);
      float *ll = malloc(sizeof(float) * (size_t)n);
      memcpy(lq, a.q + p * qr + q0 * hd, sizeof(float) * (size_t)(n * hd));
      for (int64_t t = 0; t < a.S; t++) {
        memcpy(lk + t * nkv * hd, a.k + (t * a.nkv + kv0) * hd, sizeof(float) * (size_t)(nkv * hd));
        memcpy(lv + t * nkv * hd, a.v + (t * a.nkv + kv0) * hd, sizeof(float) * (size_t)(nkv * hd));
      }
      k_attn_block blk = {.B = 1, .sq = 1, .sk = p + 1, .nh = n, .nkv = nkv, .hd = hd,
                          .q_pos = p, .q_bs = n * hd, .k_bs = a.S * nkv * hd, .l_bs = n,
                          .scale = a.scale, .group = g, .head_off = q0 - kv0 * g,
                          .fixed_order = true};
      assert_int_equal(k_attention_block_fwd(&blk, lq, lk, lv, lo, ll, false, NULL, tiles), 0);
      assert_memory_equal(lo, whole + q0 * hd, sizeof(float) * (size_t)(n * hd));
      assert_memory_equal(ll, wl + q0, sizeof(float) * (size_t)n);
      free(lq), free(lo), free(lk), free(lv), free(ll);
    }
  printf("  attention rows, 9 heads over 3 kv heads split over tp 2 and 4: = whole, bitwise\n");
  free(tiles), free(whole), free(wl);
  attn_free(&a);
}

/* The backward: both kernels against the double reference and each other,
 * the flash one also against finite differences of the reference. */
static void test_attention_bwd(void **state) {
  (void)state;
  for (size_t c = 0; c < sizeof ATTN_CASES / sizeof ATTN_CASES[0]; c++) {
    attn_ctx a = attn_alloc(ATTN_CASES[c]), e = a;
    e.flash = false;
    int64_t nq = a.B * a.S * a.nh * a.hd, nk = a.B * a.S * a.nkv * a.hd;
    int64_t stride = a.S > 16 ? 97 : 1;
    float *out = malloc((size_t)nq * sizeof(float)), *dout = rand_buf(nq, 1);
    float *dq = const_buf(nq, 9.0f), *dk = const_buf(nk, 9.0f), *dv = const_buf(nk, 9.0f);
    float *dqe = malloc((size_t)nq * sizeof(float)), *dke = const_buf(nk, 9.0f),
          *dve = const_buf(nk, 9.0f);
    attn_ref_out r = attn_ref_alloc(&a), re = attn_ref_alloc(&e);
    attn_run(&a, out);
    attn_run_bwd(&a, dout, out, dq, dk, dv);
    attn_run_exact(&e, dqe); /* its out is not needed: dqe is overwritten */
    float *work = malloc((size_t)eager_attention_bwd_work(a.B, a.S, a.nh) * sizeof(float));
    assert_int_equal(eager_attention_bwd(dout, e.q, e.k, e.v, e.P, dqe, dke, dve, a.B, a.S, a.nh,
                                         a.nkv, a.hd, a.scale, work, NULL),
                     0);
    free(work);
    attn_ref(&a, dout, &r);
    attn_ref(&e, dout, &re);
    char what[64];
    attn_name(what, sizeof what, "bwd dq", &a);
    expect_within(what, dq, r.dq, r.dq_b, nq);
    expect_within("attention bwd dk", dk, r.dk, r.dk_b, nk);
    expect_within("attention bwd dv", dv, r.dv, r.dv_b, nk);
    expect_within("attention exact dq", dqe, re.dq, re.dq_b, nq);
    expect_within("attention exact dk (=)", dke, re.dk, re.dk_b, nk);
    expect_within("attention exact dv (=)", dve, re.dv, re.dv_b, nk);
    expect_pair("attention dq vs exact", dq, dqe, r.dq_b, re.dq_b, nq);
    expect_pair("attention dk vs exact", dk, dke, r.dk_b, re.dk_b, nk);
    expect_pair("attention dv vs exact", dv, dve, r.dv_b, re.dv_b, nk);
    a.dout = dout;
    /* the double forward's own roundings per output: the scores' dot
     * (hd + 1, amplified by exp up to the largest |score| sum, <= 10 here
     * since |q|, |k| <= 1.5 and scale·hd·1.5² <= 9), the softmax sum S and
     * the P·V sum S (R5) */
    double k64 = 4.0 * ((double)a.hd + 1) * 10.0 + 3.0 * a.S + 20.0,
           n = (double)(a.S * a.nh * a.hd);
    fd_spec fq = {attn_fd_loss, attn_at_q, attn_derivs_q, k64, n, &a, &a};
    fd_spec fk = {attn_fd_loss, attn_at_kv, attn_derivs_k, k64, n, &a, &a};
    fd_spec fv = {attn_fd_loss, attn_at_kv, NULL, k64, n, &a, NULL}; /* L is linear in v */
    fd_check("attention dq vs fd", &fq, a.q, nq, stride, dq, r.dq_b, 1e-2f);
    fd_check("attention dk vs fd", &fk, a.k, nk, stride, dk, r.dk_b, 1e-2f);
    fd_check("attention dv vs fd", &fv, a.v, nk, stride, dv, r.dv_b, 1e-2f);
    free(out), free(dout), free(dq), free(dk), free(dv), free(dqe), free(dke), free(dve);
    attn_ref_free(&r), attn_ref_free(&re);
    attn_free(&a);
  }
}

/* The sequences' queries cut into `nq` chunks of rows [qcut[c], qcut[c+1])
 * and their keys into `nk` chunks by kcut (the same cuts: ring attention's
 * blocks), each query chunk run against every key chunk as ring attention
 * runs them: first its diagonal block (the last key chunk starting before
 * its last row; not accumulating), then the key chunks below it, then the
 * rest, downwards (accumulating; blocks no query sees, masked by causality
 * or the window, included: the kernel must leave their rows as they are);
 * backward over every block with the final out and lse (dq, dk, dv +=). */
static void attn_run_blocks(attn_ctx *a, const int64_t *qcut, int nq, const int64_t *kcut,
                            int nk, const float *dout, float *out, float *dq, float *dk,
                            float *dv) {
  int64_t nqe = a->B * a->S * a->nh * a->hd, nke = a->B * a->S * a->nkv * a->hd;
  memset(dq, 0, (size_t)nqe * sizeof(float));
  memset(dk, 0, (size_t)nke * sizeof(float));
  memset(dv, 0, (size_t)nke * sizeof(float));
  for (int pass = 0; pass < 2; pass++)
    for (int qc = 0; qc < nq; qc++) {
      int diag = 0;
      while (diag + 1 < nk && kcut[diag + 1] < qcut[qc + 1]) diag++;
      for (int step = 0; step < nk; step++) {
        int kc = (diag - step + nk) % nk;
        k_attn_block blk = attn_whole(a);
        blk.q_pos = qcut[qc], blk.sq = qcut[qc + 1] - qcut[qc];
        blk.k_pos = kcut[kc], blk.sk = kcut[kc + 1] - kcut[kc];
        int64_t qo = qcut[qc] * a->nh * a->hd, ko = kcut[kc] * a->nkv * a->hd;
        size_t wb = k_attention_bwd_work(&blk, K_ATTN_BWD_STORE);
        float *tiles = attn_tiles(a->hd);
        void *work = malloc(wb);
        if (pass == 0)
          assert_int_equal(k_attention_block_fwd(&blk, a->q + qo, a->k + ko, a->v + ko, out + qo,
                                                 a->lse + qcut[qc] * a->nh, step > 0, NULL,
                                                 tiles),
                           0);
        else
          assert_int_equal(k_attention_block_bwd(&blk, dout + qo, a->q + qo, a->k + ko,
                                                 a->v + ko, out + qo, a->lse + qcut[qc] * a->nh,
                                                 dq + qo, dk + ko, dv + ko, NULL, work, wb,
                                                 tiles),
                           0);
        free(tiles), free(work);
      }
    }
}

/* Block attention (ring attention's pieces) on uneven chunks of a causal
 * GQA case and a sliding-window one whose window is shorter than a chunk,
 * and blocks whose keys start before their queries off the tiles' grid
 * (queries cut at 100, keys at 37 and 333: the block of queries 100..399
 * over keys 37..332 has pass 2's query tiles at local rows 65, 129, 193,
 * 257 for its second key tile and 193, 257 for its third, 40 keys, whose
 * tile at 193 spans pass 1's query tiles 3 and 4 with its keys inside tile
 * 3's: gathered, and the one at 257 read in place), against the double
 * reference: R grows by the blocks' key tiles and the merges (each
 * rescales like a tile). */
static void test_attention_blocks(void **state) {
  (void)state;
  static const int64_t cut[] = {0, 37, 150, 151, 300}, qcut[] = {0, 100, 400},
                       kcut[] = {0, 37, 333, 400};
  static const struct {
    attn_ctx c;
    const int64_t *qcut, *kcut;
    int nq, nk;
  } cases[] = {
      {ATTN(2, 300, 4, 2, 16, 0, 0.25f), cut, cut, 4, 4},
      {ATTN(2, 300, 4, 1, 16, 40, 0.25f), cut, cut, 4, 4},
      {ATTN(2, 400, 4, 2, 16, 0, 0.25f), qcut, kcut, 2, 3},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    attn_ctx a = attn_alloc(cases[c].c);
    a.rescales = 0.0;
    for (int i = 0; i < cases[c].nk; i++)
      a.rescales += key_tiles(cases[c].kcut[i + 1] - cases[c].kcut[i]) + 1.0;
    int64_t nq = a.B * a.S * a.nh * a.hd, nk = a.B * a.S * a.nkv * a.hd;
    float *out = malloc((size_t)nq * sizeof(float)), *dout = rand_buf(nq, 1);
    float *dq = malloc((size_t)nq * sizeof(float)), *dk = malloc((size_t)nk * sizeof(float)),
          *dv = malloc((size_t)nk * sizeof(float));
    attn_run_blocks(&a, cases[c].qcut, cases[c].nq, cases[c].kcut, cases[c].nk, dout, out, dq,
                    dk, dv);
    attn_ref_out r = attn_ref_alloc(&a);
    attn_ref(&a, dout, &r);
    expect_attention("blocks", &a, &r, out, dq, dk, dv);
    free(out), free(dout), free(dq), free(dk), free(dv);
    attn_ref_free(&r);
    attn_free(&a);
  }
}

/* Attention heads split over tp ranks as parallel/tp.h splits them (query
 * heads as torch.tensor_split, each rank the kv heads its query heads
 * read, a group straddling two ranks on both): each rank's block, in its
 * local layouts with its group and head_off, gives exactly the whole
 * kernel's out, lse and dq of its query heads (the same products in the
 * same order), and its dk, dv are partial sums over its query heads whose
 * sum over the ranks is the whole-run gradient, against the double
 * reference (a sum in another association: the bounds hold for any). */
static void test_attention_head_split(void **state) {
  (void)state;
  static const struct {
    attn_ctx c;
    int tp;
  } cases[] = {
      {ATTN(2, 70, 9, 3, 8, 0, 0.35f), 2},  // SmolLM2's grouping: 5 + 4, kv head 1 shared
      {ATTN(2, 70, 9, 3, 8, 0, 0.35f), 4},  // 3+2+2+2: kv heads 1 and 2 shared
      {ATTN(1, 140, 4, 1, 16, 8, 0.25f), 4}, // Gemma-3-270M's: the one kv head on every rank
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    attn_ctx a = attn_alloc(cases[c].c);
    int tp = cases[c].tp;
    int64_t nq = a.B * a.S * a.nh * a.hd, nk = a.B * a.S * a.nkv * a.hd;
    int64_t g = a.nh / a.nkv, hd = a.hd;
    float *out = malloc((size_t)nq * 4), *dout = rand_buf(nq, 1), *dq = malloc((size_t)nq * 4);
    float *dk = malloc((size_t)nk * 4), *dv = malloc((size_t)nk * 4);
    attn_run(&a, out);
    attn_run_bwd(&a, dout, out, dq, dk, dv);
    float *sdk = calloc((size_t)nk, 4), *sdv = calloc((size_t)nk, 4);
    for (int r = 0; r < tp; r++) {
      int64_t base = a.nh / tp, extra = a.nh % tp;
      int64_t q0 = r * base + (r < extra ? r : extra), n = base + (r < extra);
      int64_t kv0 = q0 / g, nkv = (q0 + n - 1) / g + 1 - kv0, T = a.B * a.S;
      // local layouts: [T, n, hd] and [T, nkv, hd], the heads' rows copied
      float *lq = malloc((size_t)(T * n * hd) * 4), *ldo = malloc((size_t)(T * n * hd) * 4);
      float *lk = malloc((size_t)(T * nkv * hd) * 4), *lv = malloc((size_t)(T * nkv * hd) * 4);
      for (int64_t t = 0; t < T; t++) {
        memcpy(lq + t * n * hd, a.q + (t * a.nh + q0) * hd, (size_t)(n * hd) * 4);
        memcpy(ldo + t * n * hd, dout + (t * a.nh + q0) * hd, (size_t)(n * hd) * 4);
        memcpy(lk + t * nkv * hd, a.k + (t * a.nkv + kv0) * hd, (size_t)(nkv * hd) * 4);
        memcpy(lv + t * nkv * hd, a.v + (t * a.nkv + kv0) * hd, (size_t)(nkv * hd) * 4);
      }
      k_attn_block blk = {.B = a.B, .sq = a.S, .sk = a.S, .nh = n, .nkv = nkv, .hd = hd,
                          .q_bs = a.S * n * hd, .k_bs = a.S * nkv * hd, .l_bs = a.S * n,
                          .scale = a.scale, .window = a.window, .group = g,
                          .head_off = q0 - kv0 * g};
      float *lo = malloc((size_t)(T * n * hd) * 4), *ll = malloc((size_t)(T * n) * 4);
      float *ldq = calloc((size_t)(T * n * hd), 4), *ldk = calloc((size_t)(T * nkv * hd), 4),
            *ldv = calloc((size_t)(T * nkv * hd), 4);
      size_t wb = k_attention_bwd_work(&blk, K_ATTN_BWD_STORE);
      float *tiles = attn_tiles(hd);
      void *work = malloc(wb);
      assert_int_equal(k_attention_block_fwd(&blk, lq, lk, lv, lo, ll, false, NULL, tiles), 0);
      assert_int_equal(k_attention_block_bwd(&blk, ldo, lq, lk, lv, lo, ll, ldq, ldk, ldv, NULL,
                                             work, wb, tiles),
                       0);
      for (int64_t t = 0; t < T; t++) {
        assert_memory_equal(lo + t * n * hd, out + (t * a.nh + q0) * hd, (size_t)(n * hd) * 4);
        assert_memory_equal(ll + t * n, a.lse + t * a.nh + q0, (size_t)n * 4);
        assert_memory_equal(ldq + t * n * hd, dq + (t * a.nh + q0) * hd, (size_t)(n * hd) * 4);
        for (int64_t e = 0; e < nkv * hd; e++) {
          sdk[(t * a.nkv + kv0) * hd + e] += ldk[t * nkv * hd + e];
          sdv[(t * a.nkv + kv0) * hd + e] += ldv[t * nkv * hd + e];
        }
      }
      free(lq), free(ldo), free(lk), free(lv), free(lo), free(ll), free(ldq), free(ldk);
      free(ldv), free(tiles), free(work);
    }
    attn_ref_out ref = attn_ref_alloc(&a);
    attn_ref(&a, dout, &ref);
    char what[96];
    snprintf(what, sizeof what, "heads %lld/%lld over tp %d: summed dk", (long long)a.nh,
             (long long)a.nkv, tp);
    expect_within(what, sdk, ref.dk, ref.dk_b, nk);
    expect_within("  summed dv", sdv, ref.dv, ref.dv_b, nk);
    free(out), free(dout), free(dq), free(dk), free(dv), free(sdk), free(sdv);
    attn_ref_free(&ref);
    attn_free(&a);
  }
}

/* x [n] rounded to bf16, as fp32 (the bf16 products' emulated operands) */
static float *bf16_fp32_copy(const float *x, int64_t n) {
  float *y = malloc((size_t)n * sizeof(float));
  for (int64_t i = 0; i < n; i++) y[i] = ml_bf16_to_f32(ml_f32_to_bf16(x[i]));
  return y;
}

/* The backward's chunks (kernels.h K_ATTN_BWD_STORE) change no bit: dq, dk,
 * dv (memcmp) with a store holding the whole block (one chunk) and with the
 * least one (k_attention_bwd_work(blk, 0): one or two query tiles a chunk,
 * chunks starting inside a head), on 1, 2 and 3 threads, fp32 and the bf16
 * products emulated on sgemm: whole GQA sequences with a window, and a ring
 * attention block (q_pos 150, k_pos 37: pass 2's query tiles start at
 * local rows 15, 79, 143, across pass 1's tiles, so a chunk reads the
 * item kept from the chunk before). */
static void test_attention_bwd_chunks(void **state) {
  (void)state;
  attn_ctx a = attn_alloc((attn_ctx)ATTN(2, 300, 4, 2, 16, 40, 0.25f));
  int64_t nq = a.B * a.S * a.nh * a.hd, nk = a.B * a.S * a.nkv * a.hd;
  float *dout = rand_buf(nq, 1), *out = malloc((size_t)nq * 4), *lse = malloc((size_t)nq * 4);
  float *rq = bf16_fp32_copy(a.q, nq), *rk = bf16_fp32_copy(a.k, nk);
  float *rv = bf16_fp32_copy(a.v, nk), *rdo = bf16_fp32_copy(dout, nq);
  float *tiles = NULL, *r[2][3];
  for (int w = 0; w < 2; w++)
    for (int i = 0; i < 3; i++) r[w][i] = malloc((size_t)(i ? nk : nq) * 4);
  int threads = omp_get_max_threads();
  for (int c = 0; c < 2; c++)
    for (int bf = 0; bf < 2; bf++) {
      k_attn_block blk = attn_whole(&a);
      if (c == 1) blk.q_pos = 150, blk.sq = 150, blk.k_pos = 37, blk.sk = 263, blk.window = 0;
      int64_t qo = blk.q_pos * a.nh * a.hd, ko = blk.k_pos * a.nkv * a.hd;
      k_attn_bf16 lp = {.packed = false, .q = rq + qo, .k = rk + ko, .v = rv + ko,
                        .dout = rdo + qo};
      size_t least = k_attention_bwd_work(&blk, 0), whole = k_attention_bwd_work(&blk, SIZE_MAX);
      assert_true(least < whole / 4); /* several chunks */
      /* the backend's block workspace: one size for every block of these sizes (a ring's
         steps: parallel/cp.c sizes it once), so the most any geometry takes */
      ml_attn_block be_blk = attn_whole_be(&a), diag = be_blk;
      be_blk.q_pos = blk.q_pos, be_blk.sq = blk.sq, be_blk.k_pos = blk.k_pos, be_blk.sk = blk.sk;
      diag.q_pos = diag.k_pos = 0, diag.sq = blk.sq, diag.sk = blk.sk;
      size_t be_work = ml_be_attention_block_work(cpu_backend(), &be_blk);
      assert_int_equal(be_work, ml_be_attention_block_work(cpu_backend(), &diag));
      assert_true(be_work >= k_attention_bwd_work(&blk, K_ATTN_BWD_STORE));
      void *work = malloc(whole);
      for (int t = 1; t <= 3; t++) {
        omp_set_num_threads(t);
        free(tiles);
        tiles = attn_tiles(a.hd); /* per thread: sized for this team */
        assert_int_equal(k_attention_block_fwd(&blk, a.q + qo, a.k + ko, a.v + ko, out, lse,
                                               false, bf ? &lp : NULL, tiles),
                         0);
        for (int least_store = 0; least_store < 2; least_store++) {
          int w = t > 1 || least_store; /* r[0]: one thread, one chunk */
          for (int i = 0; i < 3; i++) memset(r[w][i], 0, (size_t)(i ? nk : nq) * 4);
          assert_int_equal(k_attention_block_bwd(&blk, dout + qo, a.q + qo, a.k + ko, a.v + ko,
                                                 out, lse, r[w][0], r[w][1], r[w][2],
                                                 bf ? &lp : NULL, work,
                                                 least_store ? least : whole, tiles),
                           0);
          for (int i = 0; w && i < 3; i++)
            assert_memory_equal(r[w][i], r[0][i], (size_t)(i ? nk : nq) * 4);
        }
      }
      free(work);
    }
  omp_set_num_threads(threads);
  for (int w = 0; w < 2; w++)
    for (int i = 0; i < 3; i++) free(r[w][i]);
  free(dout), free(out), free(lse), free(rq), free(rk), free(rv), free(rdo), free(tiles);
  attn_free(&a);
}

// a random integer in [lo, hi]
static int64_t rand_in(int64_t lo, int64_t hi) { return lo + (int64_t)(rand_bits() % (hi - lo + 1)); }

/* x [B][rows · w floats at bs apart] (the rest of each sequence's bs, a gap,
 * kept): 0 */
static void zero_seq_rows(float *x, int64_t B, int64_t rows, int64_t w, int64_t bs) {
  for (int64_t b = 0; b < B; b++) memset(x + b * bs, 0, (size_t)(rows * w) * sizeof(float));
}

/* The backward's written outputs (k_attn_block.bwd_overwrite) are bitwise
 * the added ones on zeros (memcmp): 200 random blocks (1..3 sequences with
 * gaps between them as ring attention's, 0..230 queries and keys at random
 * positions, so rows seeing no key and keys no query sees, windows, GQA
 * groups with head_off whose query heads leave kv heads unread, hd 8..40,
 * no queries or no keys), fp32 and the bf16 products emulated on sgemm, 1
 * or 2 threads, the least store (several chunks, pass 2's first chunk of a
 * pair without products) or the whole. The written run starts from NaN
 * bytes everywhere; the added one from the same with the block's rows
 * zeroed: the gaps must come out untouched in both. */
static void test_attention_bwd_overwrite(void **state) {
  (void)state;
  int threads = omp_get_max_threads();
  for (int it = 0; it < 200; it++) {
    int64_t group = rand_in(1, 3), nkv = rand_in(1, 3), off = rand_in(0, group - 1);
    int64_t nh = rand_in(1, nkv * group - off), hd = 8 * rand_in(1, 5) - (it % 3 == 2 ? 4 : 0);
    int64_t sq = it % 15 == 7 ? 0 : rand_in(1, 230), sk = it % 15 == 11 ? 0 : rand_in(1, 230);
    k_attn_block blk = {.B = rand_in(1, 3), .sq = sq, .sk = sk, .nh = nh, .nkv = nkv, .hd = hd,
                        .q_pos = rand_in(0, 200), .k_pos = rand_in(0, 200),
                        .scale = 0.25f, .window = it % 3 ? 0 : rand_in(1, 150),
                        .group = group, .head_off = off};
    int64_t qr = nh * hd, kr = nkv * hd;
    blk.q_bs = sq * qr + (it % 2) * rand_in(0, 3) * qr, blk.k_bs = sk * kr + (it % 2) * 5 * kr;
    blk.l_bs = sq * nh;
    int64_t nq = blk.B * blk.q_bs + 1, nk = blk.B * blk.k_bs + 1; /* + 1: nothing empty */
    float *q = rand_buf(nq, 1.5f), *k = rand_buf(nk, 1.5f), *v = rand_buf(nk, 1);
    float *dout = rand_buf(nq, 1), *out = calloc((size_t)nq, 4);
    float *lse = calloc((size_t)(blk.B * blk.l_bs + 1), 4);
    float *rq = bf16_fp32_copy(q, nq), *rk = bf16_fp32_copy(k, nk), *rv = bf16_fp32_copy(v, nk),
          *rdo = bf16_fp32_copy(dout, nq);
    float *r[2][3];
    for (int w = 0; w < 2; w++)
      for (int i = 0; i < 3; i++) r[w][i] = malloc((size_t)(i ? nk : nq) * 4);
    int bf = it % 2, t = 1 + (it / 2) % 2;
    k_attn_bf16 lp = {.packed = false, .q = rq, .k = rk, .v = rv, .dout = rdo};
    size_t wb = k_attention_bwd_work(&blk, it % 4 < 2 ? 0 : SIZE_MAX);
    void *work = malloc(wb ? wb : 1);
    omp_set_num_threads(t);
    float *tiles = attn_tiles(hd);
    assert_int_equal(k_attention_block_fwd(&blk, q, k, v, out, lse, false, bf ? &lp : NULL,
                                           tiles),
                     0);
    for (int w = 0; w < 2; w++) { /* r[0]: added onto zeros; r[1]: written */
      for (int i = 0; i < 3; i++) memset(r[w][i], 0xff, (size_t)(i ? nk : nq) * 4);
      if (!w) {
        zero_seq_rows(r[0][0], blk.B, sq, qr, blk.q_bs);
        zero_seq_rows(r[0][1], blk.B, sk, kr, blk.k_bs);
        zero_seq_rows(r[0][2], blk.B, sk, kr, blk.k_bs);
      }
      blk.bwd_overwrite = w;
      assert_int_equal(k_attention_block_bwd(&blk, dout, q, k, v, out, lse, r[w][0], r[w][1],
                                             r[w][2], bf ? &lp : NULL, work, wb, tiles),
                       0);
    }
    for (int i = 0; i < 3; i++)
      if (memcmp(r[0][i], r[1][i], (size_t)(i ? nk : nq) * 4))
        fail_msg("block %d (B %lld sq %lld sk %lld nh %lld nkv %lld group %lld off %lld hd %lld "
                 "q_pos %lld k_pos %lld window %lld, bf16 %d, %d threads): %s written differs",
                 it, (long long)blk.B, (long long)sq, (long long)sk, (long long)nh,
                 (long long)nkv, (long long)group, (long long)off, (long long)hd,
                 (long long)blk.q_pos, (long long)blk.k_pos, (long long)blk.window, bf, t,
                 i == 0 ? "dq" : i == 1 ? "dk" : "dv");
    for (int w = 0; w < 2; w++)
      for (int i = 0; i < 3; i++) free(r[w][i]);
    free(q), free(k), free(v), free(dout), free(out), free(lse), free(rq), free(rk), free(rv);
    free(rdo), free(work), free(tiles);
  }
  omp_set_num_threads(threads);
}

/* op(X) of a bf16 operand stored [rows, cols] ld apart, widened exactly
 * into a dense fp32 [rows, cols] */
static float *widen_dense(const void *x, int64_t rows, int64_t cols, int64_t ld) {
  float *y = malloc((size_t)(rows * cols + 1) * sizeof(float));
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) y[r * cols + c] = ml_bf16_to_f32(((const uint16_t *)x)[r * ld + c]);
  return y;
}

/* k_attn_bf16's gemm on packed bf16 as sgemm on the widened operands
 * (dense copies; C in place at ldc): the packed path's bookkeeping run on
 * a CPU without a bf16 GEMM, with sgemm's bits (its value of an element
 * depends on neither lda nor ldc: attention.c) */
static int sgemm_on_bf16(void *ctx, int thread, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                         float alpha, const void *A, int64_t lda, const void *B, int64_t ldb,
                         float beta, float *C, int64_t ldc) {
  (void)ctx, (void)thread;
  float *a = widen_dense(A, ta ? K : M, ta ? M : K, lda), *b = widen_dense(B, tb ? N : K, tb ? K : N, ldb);
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              (int)M, (int)N, (int)K, alpha, a, (int)(ta ? M : K), b, (int)(tb ? K : N), beta, C,
              (int)ldc);
  free(a), free(b);
  return 0;
}

/* The bf16 products on head-major operands (k_attn_head_major, the CPU
 * backend's copies: [B][heads][rows][hd]) are bitwise (memcmp) the ones on
 * operands in the block's layout: 40 random blocks (1..3 sequences with
 * gaps, 0..150 queries and keys at random positions, windows, GQA groups
 * with head_off, hd 4..40), emulated on sgemm, and packed through a bf16
 * GEMM that is sgemm on the widened operands (sgemm_on_bf16: the packed
 * path's own tiles, gathers and dense dk, dv tiles, run here), forward and
 * backward, written (bwd_overwrite) and added onto values already there.
 * The copies themselves: element for element the rounded values, from
 * fp32 or bf16 (qkv_bf16) sources. */
static void test_attention_head_major(void **state) {
  (void)state;
  for (int it = 0; it < 40; it++) {
    int64_t group = rand_in(1, 3), nkv = rand_in(1, 3), off = rand_in(0, group - 1);
    int64_t nh = rand_in(1, nkv * group - off), hd = 8 * rand_in(1, 5) - (it % 3 == 2 ? 4 : 0);
    int64_t sq = it % 13 == 7 ? 0 : rand_in(1, 150), sk = rand_in(1, 150), B = rand_in(1, 3);
    k_attn_block blk = {.B = B, .sq = sq, .sk = sk, .nh = nh, .nkv = nkv, .hd = hd,
                        .q_pos = rand_in(0, 100), .k_pos = rand_in(0, 100), .scale = 0.25f,
                        .window = it % 3 ? 0 : rand_in(1, 100), .group = group, .head_off = off,
                        .bwd_overwrite = it % 2};
    int64_t qr = nh * hd, kr = nkv * hd;
    blk.q_bs = sq * qr + (it % 2) * 2 * qr, blk.k_bs = sk * kr + (it % 2) * 3 * kr;
    blk.l_bs = sq * nh;
    int64_t nq = B * blk.q_bs + 1, nk = B * blk.k_bs + 1, hq = B * sq * qr + 1, hk = B * sk * kr + 1;
    float *q = rand_buf(nq, 1.5f), *k = rand_buf(nk, 1.5f), *v = rand_buf(nk, 1);
    float *dout = rand_buf(nq, 1);
    float *src[4] = {q, k, v, dout}, *rnd[4];
    for (int i = 0; i < 4; i++) rnd[i] = bf16_fp32_copy(src[i], i % 3 ? nk : nq);
    k_attn_bf16 lp[3] = {{.packed = false, .q = rnd[0], .k = rnd[1], .v = rnd[2], .dout = rnd[3]}};
    void *hm[2][4]; /* head-major copies: [0] fp32 holding bf16 values, [1] bf16 */
    for (int pk = 0; pk < 2; pk++) {
      for (int i = 0; i < 4; i++) {
        bool kv = i == 1 || i == 2;
        int64_t rows = kv ? sk : sq, heads = kv ? nkv : nh, bs = kv ? blk.k_bs : blk.q_bs;
        size_t bytes = (size_t)(kv ? hk : hq) * (pk ? 2 : 4);
        hm[pk][i] = malloc(bytes);
        k_attn_head_major(src[i], false, B, bs, rows, heads, hd, pk, hm[pk][i]);
        for (int64_t b = 0; b < B; b++) /* element for element */
          for (int64_t h = 0; h < heads; h++)
            for (int64_t r = 0; r < rows; r++)
              for (int64_t d = 0; d < hd; d++) {
                int64_t at = ((b * heads + h) * rows + r) * hd + d;
                float want = rnd[i][b * bs + (r * heads + h) * hd + d];
                float got = pk ? ml_bf16_to_f32(((uint16_t *)hm[pk][i])[at]) : ((float *)hm[pk][i])[at];
                if (memcmp(&got, &want, 4))
                  fail_msg("block %d: head-major copy %d (packed %d) differs at %lld", it, i, pk, (long long)at);
              }
        /* from a bf16 source (qkv_bf16): the same bytes */
        uint16_t *s16 = bf16_copy(src[i], kv ? nk : nq);
        void *again = malloc(bytes);
        k_attn_head_major(s16, true, B, bs, rows, heads, hd, pk, again);
        assert_memory_equal(again, hm[pk][i], bytes - (pk ? 2 : 4));
        free(s16), free(again);
      }
      lp[1 + pk] = (k_attn_bf16){.packed = pk, .q = hm[pk][0], .k = hm[pk][1], .v = hm[pk][2],
                                 .dout = hm[pk][3], .q_bs = nh * sq * hd, .q_row = hd,
                                 .q_head = sq * hd, .k_bs = nkv * sk * hd, .k_row = hd,
                                 .k_head = sk * hd, .gemm = sgemm_on_bf16};
    }
    size_t wb = k_attention_bwd_work(&blk, it % 4 < 2 ? 0 : SIZE_MAX);
    void *work = malloc(wb ? wb : 1);
    float *tiles = attn_tiles(hd), *r[3][5];
    for (int w = 0; w < 3; w++) { /* out, lse, dq, dk, dv of each lp */
      r[w][0] = const_buf(nq, 0.5f), r[w][1] = const_buf(B * blk.l_bs + 1, 0.0f);
      r[w][2] = const_buf(nq, 0.5f), r[w][3] = const_buf(nk, 0.5f), r[w][4] = const_buf(nk, 0.5f);
      assert_int_equal(k_attention_block_fwd(&blk, q, k, v, r[w][0], r[w][1], false, &lp[w], tiles), 0);
      assert_int_equal(k_attention_block_bwd(&blk, dout, q, k, v, r[0][0], r[0][1], r[w][2], r[w][3],
                                             r[w][4], &lp[w], work, wb, tiles),
                       0);
    }
    int64_t len[5] = {nq, B * blk.l_bs + 1, nq, nk, nk};
    for (int w = 1; w < 3; w++)
      for (int i = 0; i < 5; i++)
        if (memcmp(r[0][i], r[w][i], (size_t)len[i] * 4))
          fail_msg("block %d (B %lld sq %lld sk %lld nh %lld nkv %lld group %lld off %lld hd %lld "
                   "window %lld, overwrite %d): head-major %s %s differs",
                   it, (long long)B, (long long)sq, (long long)sk, (long long)nh, (long long)nkv,
                   (long long)group, (long long)off, (long long)hd, (long long)blk.window,
                   blk.bwd_overwrite, w == 1 ? "emulated" : "packed",
                   (const char *[]){"out", "lse", "dq", "dk", "dv"}[i]);
    for (int w = 0; w < 3; w++)
      for (int i = 0; i < 5; i++) free(r[w][i]);
    for (int i = 0; i < 4; i++) free(src[i]), free(rnd[i]), free(hm[0][i]), free(hm[1][i]);
    free(work), free(tiles);
  }
}

/* Attention with bf16 products through the CPU backend (autocast's SDPA):
 * against the double reference on the rounded q, k, v and dout, whose
 * products are then the kernels' up to fp32 summation (bf16 products are
 * exact in fp32) — the bounds above — plus the rounding of P for P·v and
 * P^T·dout and of dS for dS·k and dS^T·q, each a relative error of at most
 * u_bf16 on top of its own (attn_ctx.lowp). On a CPU without bf16 GEMMs
 * (or ONEDNN_MAX_CPU_ISA=AVX2) the backend emulates them on sgemm: the
 * same bounds. And the rounding did happen: the fp32 products differ. */
static void test_attention_bf16(void **state) {
  (void)state;
  ml_backend *be = cpu_backend();
  for (size_t c = 0; c < sizeof ATTN_CASES / sizeof ATTN_CASES[0]; c++) {
    attn_ctx a = attn_alloc(ATTN_CASES[c]);
    int64_t nq = a.B * a.S * a.nh * a.hd, nk = a.B * a.S * a.nkv * a.hd;
    float *out = malloc((size_t)nq * sizeof(float)), *out32 = malloc((size_t)nq * sizeof(float));
    float *dout = rand_buf(nq, 1), *dq = malloc((size_t)nq * sizeof(float));
    float *dk = const_buf(nk, 9.0f), *dv = const_buf(nk, 9.0f);
    assert_int_equal(ml_be_attention_saved(be, a.B, a.S, a.nh), a.B * a.S * a.nh);
    void *work = malloc(ml_be_attention_work(be, a.B, a.S, a.nh, a.nkv, a.hd));
    attn_run(&a, out32);
    if (ml_be_attention_fwd(be, a.q, a.k, a.v, out, a.lse, a.B, a.S, a.nh, a.nkv, a.hd, a.scale,
                            a.window, ML_BF16) ||
        ml_be_attention_bwd(be, dout, a.q, a.k, a.v, out, a.lse, dq, dk, dv, a.B, a.S, a.nh,
                            a.nkv, a.hd, a.scale, a.window, ML_BF16, work))
      fail_msg("bf16 attention: %s", ml_error_msg());
    attn_ctx r = a;
    r.q = bf16_rounded(a.q, nq), r.k = bf16_rounded(a.k, nk), r.v = bf16_rounded(a.v, nk);
    r.lowp = TOL_U_BF16;
    float *dout_r = bf16_rounded(dout, nq);
    attn_ref_out ref = attn_ref_alloc(&r);
    attn_ref(&r, dout_r, &ref);
    expect_attention("bf16 (dk, dv =)", &a, &ref, out, dq, dk, dv);
    assert_true(memcmp(out, out32, (size_t)nq * sizeof(float)) != 0);
    free(r.q), free(r.k), free(r.v), free(dout_r), free(work);
    free(out), free(out32), free(dout), free(dq), free(dk), free(dv);
    attn_ref_free(&ref);
    attn_free(&a);
  }
}

/* A bf16 attention output (ml_attn_block.out_bf16: o_proj's input saved in
 * bf16, ml_model_bf16_att) through the CPU backend with bf16 products, in
 * the default order (GEMM tiles; the row kernel for short blocks) and the
 * batch-invariant one: the forward's out is bitwise the fp32-out call's out
 * rounded to nearest-even (the same O / l, rounded once), its lse bitwise
 * the same; the backward on the bf16 out is bitwise the backward given an
 * fp32 out holding the same bf16 values (D widened exactly, summed in the
 * same order), and differs from the backward on the unrounded out in some
 * case (the rounding site tolerance.h §4 counts). A merge (accumulate) or fp32
 * products with a bf16 out are refused. */
static void test_attention_bf16_out(void **state) {
  (void)state;
  ml_backend *be = cpu_backend();
  int differs = 0; /* cases whose dq moved with the rounding of out (dS's bf16 rounding may
                      absorb D's change in a small case: counted over all) */
  for (int inv = 0; inv < 2; inv++) {
    assert_int_equal(ml_be_set_batch_invariant(be, inv), 0);
    for (size_t c = 0; c < sizeof ATTN_CASES / sizeof ATTN_CASES[0]; c++) {
      attn_ctx a = attn_alloc(ATTN_CASES[c]);
      int64_t nq = a.B * a.S * a.nh * a.hd, nk = a.B * a.S * a.nkv * a.hd, nl = a.B * a.S * a.nh;
      ml_attn_block blk = attn_whole_be(&a);
      float *out = malloc((size_t)nq * sizeof(float)), *lse = malloc((size_t)nl * sizeof(float));
      uint16_t *outh = malloc((size_t)nq * sizeof(uint16_t));
      float *dout = rand_buf(nq, 1), *dq[3], *dk[3], *dv[3];
      void *work = malloc(ml_be_attention_block_work(be, &blk));
      ml_attn_block bh = blk;
      bh.out_bf16 = true;
      if (ml_be_attention_block_fwd(be, &blk, a.q, a.k, a.v, out, lse, false, ML_BF16) ||
          ml_be_attention_block_fwd(be, &bh, a.q, a.k, a.v, (float *)outh, a.lse, false, ML_BF16))
        fail_msg("bf16-out attention: %s", ml_error_msg());
      uint16_t *rounded = bf16_copy(out, nq);
      assert_memory_equal(outh, rounded, (size_t)nq * sizeof(uint16_t));
      assert_memory_equal(lse, a.lse, (size_t)nl * sizeof(float));
      float *out_r = malloc((size_t)nq * sizeof(float)); /* the bf16 out's values in fp32 */
      for (int64_t i = 0; i < nq; i++) out_r[i] = ml_bf16_to_f32(outh[i]);
      const void *outs[3] = {outh, out_r, out}; /* bf16; its values in fp32; unrounded */
      for (int r = 0; r < 3; r++) {
        dq[r] = const_buf(nq, 0.0f), dk[r] = const_buf(nk, 0.0f), dv[r] = const_buf(nk, 0.0f);
        if (ml_be_attention_block_bwd(be, r ? &blk : &bh, dout, a.q, a.k, a.v, outs[r], lse,
                                      dq[r], dk[r], dv[r], ML_BF16, work))
          fail_msg("bf16-out attention backward: %s", ml_error_msg());
      }
      assert_memory_equal(dq[0], dq[1], (size_t)nq * sizeof(float));
      assert_memory_equal(dk[0], dk[1], (size_t)nk * sizeof(float));
      assert_memory_equal(dv[0], dv[1], (size_t)nk * sizeof(float));
      differs += memcmp(dq[0], dq[2], (size_t)nq * sizeof(float)) != 0;
      for (int r = 0; r < 3; r++) free(dq[r]), free(dk[r]), free(dv[r]);
      free(out), free(lse), free(outh), free(dout), free(work), free(rounded), free(out_r);
      attn_free(&a);
    }
  }
  assert_int_equal(ml_be_set_batch_invariant(be, false), 0);
  printf("  bf16 out: dq moved by out's rounding in %d of %d cases\n", differs,
         (int)(2 * (sizeof ATTN_CASES / sizeof ATTN_CASES[0])));
  assert_true(differs > 0);
  ml_attn_block blk = {.B = 1, .sq = 1, .sk = 1, .nh = 1, .nkv = 1, .hd = 8, .out_bf16 = true};
  ml_error_clear(); /* the first error is kept until cleared */
  assert_int_equal(ml_be_attention_block_fwd(be, &blk, NULL, NULL, NULL, NULL, NULL, true, ML_BF16),
                   -1);
  assert_non_null(strstr(ml_error_msg(), "block attention: a bf16 out (out_bf16) with "
                                         "accumulate true and compute BF16; expected accumulate "
                                         "false and compute BF16"));
  ml_error_clear(); /* the first error is kept until cleared */
  assert_int_equal(ml_be_attention_block_bwd(be, &blk, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                             NULL, NULL, ML_F32, NULL),
                   -1);
  assert_non_null(strstr(ml_error_msg(), "block attention backward: a bf16 out (out_bf16) "
                                         "with compute F32; expected BF16"));
}

/* bf16 q, k, v (ml_attn_block.qkv_bf16: attention's inputs saved in bf16,
 * ml_model_bf16_qkv) through the CPU backend with bf16 products, in the
 * default order and the batch-invariant one, with an fp32 and a bf16 out:
 * the forward's out and lse and the backward's dq, dk, dv are bitwise those
 * of the same call on fp32 q, k, v holding the same bf16 values (the
 * operands every product reads are the same bits: read in place where the
 * GEMM takes bf16, widened exactly where it is emulated on sgemm). bf16 q,
 * k, v with fp32 products, or with paged keys, are refused. */
static void test_attention_bf16_qkv(void **state) {
  (void)state;
  ml_backend *be = cpu_backend();
  for (int inv = 0; inv < 2; inv++) {
    assert_int_equal(ml_be_set_batch_invariant(be, inv), 0);
    for (size_t c = 0; c < sizeof ATTN_CASES / sizeof ATTN_CASES[0]; c++) {
      attn_ctx a = attn_alloc(ATTN_CASES[c]);
      int64_t nq = a.B * a.S * a.nh * a.hd, nk = a.B * a.S * a.nkv * a.hd, nl = a.B * a.S * a.nh;
      ml_attn_block blk = attn_whole_be(&a);
      blk.out_bf16 = c % 2 == 1;
      ml_attn_block bh = blk;
      bh.qkv_bf16 = true;
      uint16_t *qh = bf16_copy(a.q, nq), *kh = bf16_copy(a.k, nk), *vh = bf16_copy(a.v, nk);
      float *q = bf16_rounded(a.q, nq), *k = bf16_rounded(a.k, nk), *v = bf16_rounded(a.v, nk);
      size_t osz = blk.out_bf16 ? sizeof(uint16_t) : sizeof(float);
      void *out[2] = {malloc((size_t)nq * osz), malloc((size_t)nq * osz)};
      float *lse[2] = {malloc((size_t)nl * sizeof(float)), malloc((size_t)nl * sizeof(float))};
      float *dout = rand_buf(nq, 1), *dq[2], *dk[2], *dv[2];
      void *work = malloc(ml_be_attention_block_work(be, &blk));
      for (int r = 0; r < 2; r++) { /* r 0: fp32 q, k, v of bf16 values; 1: bf16 */
        const ml_attn_block *b = r ? &bh : &blk;
        const float *Q = r ? (const float *)qh : q, *K = r ? (const float *)kh : k,
                    *V = r ? (const float *)vh : v;
        dq[r] = const_buf(nq, 0.0f), dk[r] = const_buf(nk, 0.0f), dv[r] = const_buf(nk, 0.0f);
        if (ml_be_attention_block_fwd(be, b, Q, K, V, out[r], lse[r], false, ML_BF16) ||
            ml_be_attention_block_bwd(be, b, dout, Q, K, V, out[r], lse[r], dq[r], dk[r], dv[r],
                                      ML_BF16, work))
          fail_msg("bf16 q, k, v attention (case %zu): %s", c, ml_error_msg());
      }
      assert_memory_equal(out[0], out[1], (size_t)nq * osz);
      assert_memory_equal(lse[0], lse[1], (size_t)nl * sizeof(float));
      assert_memory_equal(dq[0], dq[1], (size_t)nq * sizeof(float));
      assert_memory_equal(dk[0], dk[1], (size_t)nk * sizeof(float));
      assert_memory_equal(dv[0], dv[1], (size_t)nk * sizeof(float));
      for (int r = 0; r < 2; r++) free(out[r]), free(lse[r]), free(dq[r]), free(dk[r]), free(dv[r]);
      free(qh), free(kh), free(vh), free(q), free(k), free(v), free(dout), free(work);
      attn_free(&a);
    }
  }
  assert_int_equal(ml_be_set_batch_invariant(be, false), 0);
  ml_attn_block blk = {.B = 1, .sq = 1, .sk = 1, .nh = 1, .nkv = 1, .hd = 8, .qkv_bf16 = true};
  ml_error_clear(); /* the first error is kept until cleared */
  assert_int_equal(ml_be_attention_block_fwd(be, &blk, NULL, NULL, NULL, NULL, NULL, false, ML_F32),
                   -1);
  assert_non_null(strstr(ml_error_msg(), "block attention: bf16 q, k, v (qkv_bf16) with compute "
                                         "F32; expected compute BF16 and unpaged keys"));
  int32_t table[1] = {0};
  blk.kv_table = table, blk.kv_block = 1, blk.table_bs = 1;
  ml_error_clear();
  assert_int_equal(ml_be_attention_block_fwd(be, &blk, NULL, NULL, NULL, NULL, NULL, false,
                                             ML_BF16),
                   -1);
  assert_non_null(strstr(ml_error_msg(), "block attention: bf16 q, k, v (qkv_bf16) with compute "
                                         "BF16 and paged keys; expected"));
  blk.kv_table = NULL;
  ml_error_clear();
  assert_int_equal(ml_be_attention_block_bwd(be, &blk, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                             NULL, NULL, ML_F32, NULL),
                   -1);
  assert_non_null(strstr(ml_error_msg(), "block attention backward: bf16 q, k, v (qkv_bf16) "
                                         "with compute F32"));
}

/* ---- gated activation --------------------------------------------------------- */

typedef struct glu_ctx {
  float *g, *u;
  int64_t n;
  ml_glu_act act;
  const float *dh;
} glu_ctx;

static const double GELU_B = 0.79788456080286535588, GELU_K = 0.044715; /* sqrt(2/pi), kappa */

/* act, act' and the |.|-evaluations of tolerance.h §1 (GLU) at x, in double */
typedef struct act_eval {
  double f, df;
  double fa;  /* |.|-evaluation of act(x) (to be multiplied by |u|) */
  double dfa; /* of act'(x) (to be multiplied by |dh||u|) */
} act_eval;

static act_eval act_ref(double x, ml_glu_act act) {
  act_eval e;
  if (act == ML_GLU_SILU) {
    double s = 1.0 / (1.0 + exp(-x));
    e.f = x * s;
    e.df = s * (1.0 + x * (1.0 - s));
    e.fa = fabs(e.f);
    e.dfa = s * (1.0 + fabs(x) * (1.0 + s));
  } else {
    double inner = GELU_B * (x + GELU_K * x * x * x), th = tanh(inner), ai = fabs(inner);
    double poly = GELU_B * (1.0 + 3.0 * GELU_K * x * x);
    e.f = 0.5 * x * (1.0 + th);
    e.df = 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * poly;
    e.fa = 0.5 * fabs(x) * (1.0 + fabs(th) + (1.0 - th * th) * ai);
    e.dfa =
        0.5 * (1.0 + fabs(th) + (1.0 - th * th) * ai) +
        0.5 * fabs(x) * (1.0 + th * th + 2.0 * fabs(th) * (fabs(th) + (1.0 - th * th) * ai)) * poly;
  }
  return e;
}

static void glu_ref(void *c, double *h, double *ha) {
  const glu_ctx *a = c;
  for (int64_t i = 0; i < a->n; i++) {
    act_eval e = act_ref(a->g[i], a->act);
    h[i] = e.f * a->u[i];
    ha[i] = e.fa * fabs(a->u[i]);
  }
}

/* tolerance.h §2: along g_i, |L''| <= |dh·u|·sup|act''|, likewise L''' */
static void glu_derivs_g(void *c, int64_t i, double *M2, double *M3) {
  const glu_ctx *a = c;
  double w = fabs((double)a->dh[i] * a->u[i]);
  *M2 = w * (a->act == ML_GLU_SILU ? TOL_SUP_SILU_D2 : TOL_SUP_GELU_D2);
  *M3 = w * (a->act == ML_GLU_SILU ? TOL_SUP_SILU_D3 : TOL_SUP_GELU_D3);
}

static void test_glu(void **state) {
  (void)state;
  int64_t n = 301;
  for (int act = ML_GLU_SILU; act <= ML_GLU_GELU_TANH; act++) {
    float *dh = rand_buf(n, 1);
    glu_ctx a = {rand_buf(n, 4), rand_buf(n, 1), n, (ml_glu_act)act, dh};
    float *h = malloc((size_t)n * sizeof(float));
    float *dg = malloc((size_t)n * sizeof(float)), *du = malloc((size_t)n * sizeof(float));
    double *ref = dzeros(n), *rdg = dzeros(n), *rdu = dzeros(n);
    double *bh = dzeros(n), *bdg = dzeros(n), *bdu = dzeros(n);
    int silu = act == ML_GLU_SILU;
    double th = tol_vs_double(silu ? TOL_K_GLU_SILU_FWD : TOL_K_GLU_GELU_FWD, 16.0);
    double tdg = tol_vs_double(silu ? TOL_K_GLU_SILU_DG : TOL_K_GLU_GELU_DG, 24.0);
    double tdu = tol_vs_double(TOL_K_GLU_DU, 16.0);
    for (int64_t i = 0; i < n; i++) {
      act_eval e = act_ref(a.g[i], a.act);
      double wu = fabs(a.u[i]), wd = fabs((double)dh[i]);
      ref[i] = e.f * a.u[i];
      rdu[i] = dh[i] * e.f;
      rdg[i] = dh[i] * a.u[i] * e.df;
      bh[i] = TOL_FIRST_ORDER * th * e.fa * wu;
      bdu[i] = TOL_FIRST_ORDER * tdu * e.fa * wd;
      bdg[i] = TOL_FIRST_ORDER * tdg * e.dfa * wd * wu;
    }
    k_glu_fwd(a.g, a.u, h, n, a.act);
    k_glu_bwd(dh, a.g, a.u, dg, du, n, a.act);
    printf("  [%s]\n", silu ? "silu" : "gelu_tanh");
    expect_within("glu fwd", h, ref, bh, n);
    expect_within("glu bwd dg vs ref", dg, rdg, bdg, n);
    expect_within("glu bwd du vs ref", du, rdu, bdu, n);
    fd_fwd ff = {glu_ref, &a, dh, n};
    fd_spec fg = {fd_fwd_loss, NULL, glu_derivs_g, 16.0, (double)n, &ff, &a};
    fd_spec fu = {fd_fwd_loss, NULL, NULL, 16.0, (double)n, &ff, NULL}; /* linear in u */
    fd_check("glu dg vs fd", &fg, a.g, n, 1, dg, bdg, 1e-2f);
    fd_check("glu du vs fd", &fu, a.u, n, 1, du, bdu, 1e-2f);
    free(a.g), free(a.u), free(h), free(dh), free(dg), free(du), free(ref), free(rdg), free(rdu);
    free(bh), free(bdg), free(bdu);
  }
}

/* The bf16 variants (k_glu_fwd_bf16, k_glu_bwd_bf16) against the fp32
 * kernels on the widened g, u, bitwise (memcmp): h in fp32, and in bf16 as
 * ml_f32_to_bf16 of that; dg, du in fp32, and in bf16 as ml_f32_to_bf16 of
 * those. n spans several chunks and a partial one; g, u include values
 * whose h overflows (inf), a tie and a NaN, dh a dg that is a tie. */
static void test_glu_bf16(void **state) {
  (void)state;
  int64_t n = 1301;
  for (int act = ML_GLU_SILU; act <= ML_GLU_GELU_TANH; act++) {
    float *gf = rand_buf(n, 6), *uf = rand_buf(n, 4), *dh = rand_buf(n, 1);
    uint16_t *g = malloc((size_t)n * 2), *u = malloc((size_t)n * 2), *h16 = malloc((size_t)n * 2);
    float *h = malloc((size_t)n * 4), *ref = malloc((size_t)n * 4), *dg = malloc((size_t)n * 4);
    float *du = malloc((size_t)n * 4), *rdg = malloc((size_t)n * 4), *rdu = malloc((size_t)n * 4);
    uint16_t *r16 = malloc((size_t)n * 2), *dg16 = malloc((size_t)n * 2);
    uint16_t *du16 = malloc((size_t)n * 2), *rg16 = malloc((size_t)n * 2);
    uint16_t *ru16 = malloc((size_t)n * 2);
    gf[0] = 3.0e38f, uf[0] = 3.0e38f; /* h = inf in fp32 */
    gf[1] = 1.0f, uf[1] = 1.0f + 0x1p-8f; /* u exactly between two bf16 values: a tie */
    gf[2] = NAN;
    gf[3] = 0.0f, uf[3] = 1.0f, dh[3] = 1.0f + 0x1p-8f; /* dg = dh·u·act'(0) = dh/2: a tie */
    for (int64_t i = 0; i < n; i++) {
      g[i] = ml_f32_to_bf16(gf[i]), u[i] = ml_f32_to_bf16(uf[i]);
      gf[i] = ml_bf16_to_f32(g[i]), uf[i] = ml_bf16_to_f32(u[i]);
    }
    k_glu_fwd(gf, uf, ref, n, (ml_glu_act)act);
    k_glu_bwd(dh, gf, uf, rdg, rdu, n, (ml_glu_act)act);
    ml_convert_from_f32(ML_BF16, ref, r16, (size_t)n);
    k_glu_fwd_bf16(g, u, h, false, n, (ml_glu_act)act);
    k_glu_fwd_bf16(g, u, h16, true, n, (ml_glu_act)act);
    k_glu_bwd_bf16(dh, g, u, dg, du, false, n, (ml_glu_act)act);
    k_glu_bwd_bf16(dh, g, u, dg16, du16, true, n, (ml_glu_act)act);
    ml_convert_from_f32(ML_BF16, rdg, rg16, (size_t)n);
    ml_convert_from_f32(ML_BF16, rdu, ru16, (size_t)n);
    const char *name = act == ML_GLU_SILU ? "silu" : "gelu_tanh";
    if (memcmp(h, ref, (size_t)n * 4)) fail_msg("%s: bf16-input forward (fp32 h) differs", name);
    if (memcmp(h16, r16, (size_t)n * 2)) fail_msg("%s: bf16 forward differs from h rounded", name);
    if (memcmp(dg, rdg, (size_t)n * 4) || memcmp(du, rdu, (size_t)n * 4))
      fail_msg("%s: bf16-input backward differs", name);
    if (memcmp(dg16, rg16, (size_t)n * 2) || memcmp(du16, ru16, (size_t)n * 2))
      fail_msg("%s: bf16 backward outputs differ from dg, du rounded", name);
    free(gf), free(uf), free(dh), free(g), free(u), free(h16), free(h), free(ref), free(dg);
    free(du), free(rdg), free(rdu), free(r16), free(dg16), free(du16), free(rg16), free(ru16);
  }
}

/* ---- embedding ---------------------------------------------------------------- */

static void test_embedding(void **state) {
  (void)state;
  enum { T = 8, H = 5, ROWS = 4, ROW0 = 3 };
  const int32_t ids[T] = {3, 2, 6, 7, -1, 5, 100, 3};  // 2, 7, −1, 100 outside [3, 7)
  const float scale = 2.5f;
  float *W = rand_buf(ROWS * H, 1), out[T * H], *dout = rand_buf(T * H, 1),
        *dW = const_buf(ROWS * H, 1.0f);
  double ref[T * H] = {0}, rdW[ROWS * H] = {0}, bout[T * H] = {0}, bdW[ROWS * H] = {0};
  int count[ROWS] = {0};
  for (int t = 0; t < T; t++)
    if (ids[t] >= ROW0 && ids[t] < ROW0 + ROWS) count[ids[t] - ROW0]++;
  for (int t = 0; t < T; t++)
    for (int h = 0; h < H; h++)
      if (ids[t] >= ROW0 && ids[t] < ROW0 + ROWS) {
        double w = scale * (double)W[(ids[t] - ROW0) * H + h];
        ref[t * H + h] = w;
        bout[t * H + h] =
            tol_vs_double(TOL_K_EMBED_FWD, 1.0) * fabs(w); /* out of range: 0, exact */
        rdW[(ids[t] - ROW0) * H + h] += scale * (double)dout[t * H + h];
        bdW[(ids[t] - ROW0) * H + h] += fabs(scale * (double)dout[t * H + h]);
      }
  /* dW: 1.0 plus c terms of one product each: a sum of c + 1 terms (R2), c + 2 */
  for (int r = 0; r < ROWS; r++)
    for (int h = 0; h < H; h++)
      bdW[r * H + h] = tol_vs_double(count[r] + 2.0, count[r] + 1.0) * (1.0 + bdW[r * H + h]);
  memset(out, 0x7f, sizeof out);  // out-of-range rows must be written as 0
  k_embedding_fwd(ids, T, W, 0, ROW0, ROWS, H, scale, out);
  expect_within("embedding fwd", out, ref, bout, T * H);
  k_embedding_bwd(ids, T, dout, ROW0, ROWS, H, scale, dW);
  double *r1 = shifted(rdW, 1.0, ROWS * H);
  expect_within("embedding bwd (+=, repeated ids)", dW, r1, bdW, ROWS * H);
  free(r1);
  free(W), free(dout), free(dW);
}

/* ---- cross-entropy ------------------------------------------------------------ */

enum { XT = 6, XV = 23, XSPLIT = 10 };

// per-row loss −log_softmax(logits)[y] in double (0 for y = −1), softmax p,
// dlogits, and per row max_j |l_j − m| and |l_y − m|
static void xent_ref(const float *logits, const int32_t *y, double *loss, double *p, double *dl,
                     const float *w, double *spread, double *ty) {
  for (int t = 0; t < XT; t++) {
    const float *l = logits + t * XV;
    double m = -INFINITY, se = 0.0;
    for (int j = 0; j < XV; j++) m = fmax(m, l[j]);
    spread[t] = 0.0;
    for (int j = 0; j < XV; j++) se += exp(l[j] - m), spread[t] = fmax(spread[t], fabs(l[j] - m));
    loss[t] = y[t] < 0 ? 0.0 : log(se) - (l[y[t]] - m);
    ty[t] = y[t] < 0 ? 0.0 : fabs(l[y[t]] - m);
    for (int j = 0; j < XV; j++) {
      p[t * XV + j] = exp(l[j] - m) / se;
      dl[t * XV + j] = w[t] * (p[t * XV + j] - (j == y[t]));
    }
  }
}

// shard [v0, v0 + V) of the full [XT, XV] logits, contiguous
static float *xent_shard(const float *logits, int64_t v0, int64_t V) {
  float *s = malloc((size_t)(XT * V) * sizeof(float));
  for (int t = 0; t < XT; t++) memcpy(s + t * V, logits + t * XV + v0, (size_t)V * sizeof(float));
  return s;
}

// one shard's pieces: mx [XT] local max; se, tl [XT] against the given max
static void xent_pieces(const float *logits, int64_t v0, int64_t V, const int32_t *y,
                        const float *gmx, float *mx, float *se, float *tl) {
  float *sh = xent_shard(logits, v0, V);
  k_xent_rowmax(sh, XT, V, mx);
  if (gmx) k_xent_sumexp_target(sh, XT, V, v0, y, gmx, se, tl);
  free(sh);
}

/* tolerance.h §1 (cross-entropy) for vocab split into `shards` pieces:
 * bl per row (loss), bd per logit (dlogits) */
static void xent_bounds(int shards, const double *loss, const double *p, const int32_t *y,
                        const float *w, const double *spread, const double *ty, double *bl,
                        double *bd) {
  const double u = TOL_U, e64 = tol_gamma64(XV + 8.0);
  for (int t = 0; t < XT; t++) {
    double eps_se = u * spread[t] + TOL_K_XENT_SE * u + (shards - 1) * u + e64;
    bl[t] = y[t] < 0 ? 0.0 : TOL_FIRST_ORDER * (eps_se + u * ty[t] + e64 * fabs(loss[t]));
    for (int j = 0; j < XV; j++) { /* |l_j - m| <= spread */
      double pj = p[t * XV + j], wa = fabs(w[t]), hit = j == y[t];
      bd[t * XV + j] = TOL_FIRST_ORDER * (wa * pj * (eps_se + u * spread[t] + TOL_K_XENT_BWD * u) +
                                          (u + e64) * wa * (pj + hit));
    }
  }
}

/* K_PAR_MIN (kernels.h): the elementwise and row-wise forwards run serially
 * below it and on the OpenMP team above it, and each row's result must not
 * depend on which: T rows of hidden 576 (T·576 >= K_PAR_MIN, on 2 threads)
 * memcmp-equal to each row computed alone (576 elements: serial) — the
 * batch-1 decode step against a prefill of the same tokens. */
static void test_serial_threshold(void **state) {
  (void)state;
  enum { H = 576, NH = 9, HD = 64 };
  int64_t T = K_PAR_MIN / H + 7, n = T * H;
  assert_true(n >= K_PAR_MIN && (int64_t)H < K_PAR_MIN);
  int threads = omp_get_max_threads();
  omp_set_num_threads(2);
  float *x = rand_buf(n, 2.0f), *w = rand_buf(H, 1.0f), *u = rand_buf(n, 1.0f);
  float *all = malloc((size_t)n * sizeof(float)), *one = malloc(H * sizeof(float));
  float *rs = malloc((size_t)T * sizeof(float)), rs1;
  float *cs = rand_buf(T * HD / 2, 1.0f), *sn = rand_buf(T * HD / 2, 1.0f);
  int32_t *ids = malloc((size_t)T * sizeof(int32_t));
  for (int64_t t = 0; t < T; t++) ids[t] = (int32_t)(rand_bits() % (uint32_t)T);
  for (int k = 0; k < 5; k++) {
    if (k == 0) memcpy(all, x, (size_t)n * sizeof(float)), k_add(all, u, n);
    if (k == 1) k_rmsnorm_fwd(x, w, 0.0f, 1e-6f, all, rs, T, H);
    if (k == 2) k_glu_fwd(x, u, all, n, ML_GLU_SILU);
    if (k == 3) memcpy(all, x, (size_t)n * sizeof(float)), k_rope_fwd(all, cs, sn, 1, T, NH, HD);
    if (k == 4) k_embedding_fwd(ids, T, x, 0, 0, T, H, 1.5f, all);
    for (int64_t t = 0; t < T; t++) {
      const float *xt = x + t * H;
      if (k == 0) memcpy(one, xt, H * sizeof(float)), k_add(one, u + t * H, H);
      if (k == 1) k_rmsnorm_fwd(xt, w, 0.0f, 1e-6f, one, &rs1, 1, H);
      if (k == 2) k_glu_fwd(xt, u + t * H, one, H, ML_GLU_SILU);
      if (k == 3)
        memcpy(one, xt, H * sizeof(float)),
            k_rope_fwd(one, cs + t * HD / 2, sn + t * HD / 2, 1, 1, NH, HD);
      if (k == 4) k_embedding_fwd(ids + t, 1, x, 0, 0, T, H, 1.5f, one);
      if (memcmp(one, all + t * H, H * sizeof(float)))
        fail_msg("kernel %d (add, rmsnorm, glu, rope, embedding): row %lld of %lld differs "
                 "computed alone", k, (long long)t, (long long)T);
    }
  }
  omp_set_num_threads(threads);
  free(x), free(w), free(u), free(all), free(one), free(rs), free(cs), free(sn), free(ids);
}

/* The column-run kernels (k_col_width): a column's sum over the rows is in
 * row order whatever the runs' width, so the bias gradient, RMSNorm's dw
 * and the embedding's dW are memcmp-equal for teams of 1, 2, 3 and 16
 * threads (widths 512, 288, 192 and 40 for 576 columns), and equal to the
 * plain row-order double sums; 577 columns leave a short last run. */
static void test_column_runs(void **state) {
  (void)state;
  assert_int_equal(k_col_width(3), K_COL_ALIGN);
  int threads = omp_get_max_threads();
  const int teams[] = {1, 2, 3, 16};
  for (int64_t N = 576; N <= 577; N++) {
    int64_t T = K_PAR_MIN / N + 5, n = T * N;
    float *dy = rand_buf(n, 1.0f), *x = rand_buf(n, 2.0f), *rs = rand_buf(T, 1.0f);
    float *w = rand_buf(N, 1.0f), *dx = malloc((size_t)n * sizeof(float));
    int32_t *ids = malloc((size_t)T * sizeof(int32_t));
    for (int64_t t = 0; t < T; t++) ids[t] = (int32_t)(rand_bits() % 7u); /* repeated rows */
    float *want = malloc((size_t)(3 * N + 7 * N) * sizeof(float));
    float *got = malloc((size_t)(3 * N + 7 * N) * sizeof(float));
    for (int64_t c = 0; c < N; c++) { /* row-order double sums: db, dw */
      double b = 0.0, d = 0.0;
      for (int64_t t = 0; t < T; t++)
        b += dy[t * N + c], d += (double)dy[t * N + c] * x[t * N + c] * rs[t];
      want[c] = (float)b, want[N + c] = (float)d;
    }
    for (int i = 0; i < 4; i++) {
      omp_set_num_threads(teams[i]);
      if (i == 3) assert_int_equal(k_col_width(576), 40);
      memset(got, 0, (size_t)(3 * N + 7 * N) * sizeof(float));
      k_bias_grad(dy, T, N, got);
      k_rmsnorm_bwd(dy, x, w, 0.0f, rs, dx, got + N, T, N);
      k_embedding_bwd(ids, T, dy, 0, 7, N, 0.5f, got + 3 * N);
      if (i == 0) memcpy(want + 2 * N, got + 2 * N, (size_t)(8 * N) * sizeof(float));
      if (memcmp(got, want, (size_t)(10 * N) * sizeof(float)))
        fail_msg("%lld columns, %d threads (width %lld): a column sum differs from the "
                 "row-order sum or from 1 thread's", (long long)N, teams[i],
                 (long long)k_col_width(N));
    }
    free(dy), free(x), free(rs), free(w), free(dx), free(ids), free(want), free(got);
  }
  omp_set_num_threads(threads);
}

/* k_norm_partials: 7 segments (empty ones, one chunk, a chunk boundary and
 * one of more than 1,024 chunks, so the chunks cross a window) give, for
 * teams of 1, 2 and 16 threads, memcmp-equal sums of squares and maxima,
 * equal to each segment's chunk partials (k_dot_f64 of 16,384 floats)
 * added in chunk order; a NaN counts as +inf in the max. */
static void test_norm_partials(void **state) {
  (void)state;
  enum { CHUNK = 1 << 14 };
  const int64_t sizes[] = {0, 5, CHUNK, CHUNK + 1, 0, 1025 * (int64_t)CHUNK + 3, 3 * CHUNK - 1};
  enum { K = sizeof sizes / sizeof sizes[0] };
  int64_t total = 0;
  for (int s = 0; s < K; s++) total += sizes[s];
  float *g = rand_buf(total, 2.0f);
  ml_norm_seg segs[K];
  double want[2][K], got[K];
  for (int s = 0, at = 0; s < K; at += (int)sizes[s], s++) {
    segs[s] = (ml_norm_seg){g + at, sizes[s]};
    want[0][s] = want[1][s] = 0.0;
    for (int64_t c = 0; c < sizes[s]; c += CHUNK) {
      int64_t n = sizes[s] - c < CHUNK ? sizes[s] - c : CHUNK;
      want[0][s] += k_dot_f64(g + at + c, g + at + c, n);
    }
    for (int64_t j = 0; j < sizes[s]; j++) want[1][s] = fmax(want[1][s], fabs((double)g[at + j]));
  }
  int threads = omp_get_max_threads();
  const int teams[] = {1, 2, 16};
  for (int i = 0; i < 3; i++) {
    omp_set_num_threads(teams[i]);
    for (int kind = 0; kind < 2; kind++) {
      k_norm_partials(segs, K, kind ? ML_NORM_ABSMAX : ML_NORM_SUMSQ, got);
      if (memcmp(got, want[kind], sizeof got))
        fail_msg("norm partials (%s), %d threads: not the chunk-order values",
                 kind ? "absmax" : "sumsq", teams[i]);
    }
  }
  omp_set_num_threads(threads);
  g[CHUNK + 9] = NAN; /* in segment 3 */
  k_norm_partials(segs, K, ML_NORM_ABSMAX, got);
  assert_true(isinf(got[3]) && got[3] > 0 && got[2] == want[1][2]);
  free(g);
}

static void test_xent(void **state) {
  (void)state;
  const int32_t y[XT] = {0, 9, 10, 22, -1, 15};
  const float w[XT] = {0.5f, 1.0f, 1.0f, 0.25f, 0.0f, 2.0f};
  float *logits = rand_buf(XT * XV, 6), got[XT * XV];
  double loss[XT], p[XT * XV], dl[XT * XV], lossd[XT], spread[XT], ty[XT], bl[XT], bd[XT * XV];
  xent_ref(logits, y, loss, p, dl, w, spread, ty);
  // one shard holding the whole vocab: loss = log(se) − tl
  float mx[XT], se[XT], tl[XT];
  xent_pieces(logits, 0, XV, y, NULL, mx, NULL, NULL);
  xent_pieces(logits, 0, XV, y, mx, mx, se, tl);
  for (int t = 0; t < XT; t++) lossd[t] = y[t] < 0 ? tl[t] : log((double)se[t]) - tl[t];
  xent_bounds(1, loss, p, y, w, spread, ty, bl, bd);
  expect_within_d("xent one shard vs log_softmax", lossd, loss, bl, XT);
  // two shards combined as the caller does: MAX of mx, SUM of se and tl
  const int64_t v0s[2] = {0, XSPLIT}, Vs[2] = {XSPLIT, XV - XSPLIT};
  float smx[2][XT], sse[2][XT], stl[2][XT], gmx[XT], gse[XT];
  for (int s = 0; s < 2; s++) xent_pieces(logits, v0s[s], Vs[s], y, NULL, smx[s], NULL, NULL);
  for (int t = 0; t < XT; t++) gmx[t] = fmaxf(smx[0][t], smx[1][t]);
  for (int s = 0; s < 2; s++) xent_pieces(logits, v0s[s], Vs[s], y, gmx, smx[s], sse[s], stl[s]);
  for (int t = 0; t < XT; t++) {
    gse[t] = sse[0][t] + sse[1][t];
    assert_true(stl[y[t] >= XSPLIT ? 0 : 1][t] == 0.0f);  // target elsewhere (or −1): 0
    lossd[t] = y[t] < 0 ? stl[0][t] + stl[1][t] : log((double)gse[t]) - (stl[0][t] + stl[1][t]);
  }
  xent_bounds(2, loss, p, y, w, spread, ty, bl, bd);
  expect_within_d("xent two shards vs log_softmax", lossd, loss, bl, XT);
  for (int s = 0; s < 2; s++) {
    float *sh = xent_shard(logits, v0s[s], Vs[s]);
    k_xent_bwd(sh, XT, Vs[s], v0s[s], y, gmx, gse, w, sh);  // in place
    for (int t = 0; t < XT; t++)
      memcpy(got + t * XV + v0s[s], sh + t * Vs[s], (size_t)Vs[s] * sizeof(float));
    free(sh);
  }
  expect_within("xent bwd (two shards, in place)", got, dl, bd, XT * XV);
  free(logits);
}

enum { XTILE = 4 }; /* columns per tile: 3 tiles of the first shard, 4 of the second */

/* The online log-sum-exp (the fused classifier): one tile is the unfused
 * two passes bit for bit (the same order); tiles of two shards, reduced as
 * parallel/loss.c does (MAX, rebase, SUM), within eps_se + tol_xent_online
 * of log_softmax; the backward tile by tile bitwise the shard's. */
static void test_xent_online(void **state) {
  (void)state;
  const int32_t y[XT] = {0, 9, 10, 22, -1, 15};
  const float w[XT] = {0.5f, 1.0f, 1.0f, 0.25f, 0.0f, 2.0f};
  float *logits = rand_buf(XT * XV, 6);
  double loss[XT], p[XT * XV], dl[XT * XV], lossd[XT], spread[XT], ty[XT], bl[XT], bd[XT * XV];
  xent_ref(logits, y, loss, p, dl, w, spread, ty);
  // one tile from a fresh row: rowmax's mx and sumexp_target's se, tl exactly
  float mx[XT], se[XT], tl[XT], omx[XT], ose[XT] = {0}, otl[XT] = {0};
  xent_pieces(logits, 0, XV, y, NULL, mx, NULL, NULL);
  xent_pieces(logits, 0, XV, y, mx, mx, se, tl);
  k_xent_online(logits, XT, XV, 0, y, omx, ose, otl);
  k_xent_rebase(XT, XV, 0, y, omx, omx, ose, otl);
  assert_memory_equal(omx, mx, sizeof mx);
  assert_memory_equal(ose, se, sizeof se);
  assert_memory_equal(otl, tl, sizeof tl);
  // two shards in tiles of XTILE columns, then MAX, rebase, SUM
  const int64_t v0s[2] = {0, XSPLIT}, Vs[2] = {XSPLIT, XV - XSPLIT};
  float smx[2][XT], sse[2][XT] = {{0}}, stl[2][XT] = {{0}}, gmx[XT], gse[XT];
  int tiles = 0;
  for (int s = 0; s < 2; s++) {
    float *sh = xent_shard(logits, v0s[s], Vs[s]);
    for (int64_t c0 = 0; c0 < Vs[s]; c0 += XTILE) {
      int64_t n = Vs[s] - c0 < XTILE ? Vs[s] - c0 : XTILE;
      float *tile = malloc((size_t)(XT * n) * sizeof(float));
      for (int t = 0; t < XT; t++) memcpy(tile + t * n, sh + t * Vs[s] + c0, (size_t)n * 4);
      k_xent_online(tile, XT, n, v0s[s] + c0, y, smx[s], sse[s], stl[s]);
      free(tile);
      tiles += s == 0;
    }
    free(sh);
  }
  for (int t = 0; t < XT; t++) gmx[t] = fmaxf(smx[0][t], smx[1][t]);
  for (int s = 0; s < 2; s++) k_xent_rebase(XT, Vs[s], v0s[s], y, smx[s], gmx, sse[s], stl[s]);
  for (int t = 0; t < XT; t++) {
    gse[t] = sse[0][t] + sse[1][t];
    lossd[t] = y[t] < 0 ? stl[0][t] + stl[1][t] : log((double)gse[t]) - (stl[0][t] + stl[1][t]);
  }
  xent_bounds(2, loss, p, y, w, spread, ty, bl, bd);
  for (int t = 0; t < XT; t++) bl[t] += y[t] < 0 ? 0.0 : TOL_FIRST_ORDER * tol_xent_online(tiles);
  expect_within_d("xent online (tiles of two shards) vs log_softmax", lossd, loss, bl, XT);
  // backward: per tile (its v0) against the whole shard, the same elementwise ops
  for (int s = 0; s < 2; s++) {
    float *sh = xent_shard(logits, v0s[s], Vs[s]), *whole = xent_shard(logits, v0s[s], Vs[s]);
    k_xent_bwd(whole, XT, Vs[s], v0s[s], y, gmx, gse, w, whole);
    for (int64_t c0 = 0; c0 < Vs[s]; c0 += XTILE) {
      int64_t n = Vs[s] - c0 < XTILE ? Vs[s] - c0 : XTILE;
      float *tile = malloc((size_t)(XT * n) * sizeof(float));
      for (int t = 0; t < XT; t++) memcpy(tile + t * n, sh + t * Vs[s] + c0, (size_t)n * 4);
      k_xent_bwd(tile, XT, n, v0s[s] + c0, y, gmx, gse, w, tile);
      for (int t = 0; t < XT; t++)
        assert_memory_equal(tile + t * n, whole + t * Vs[s] + c0, (size_t)n * 4);
      free(tile);
    }
    free(whole);
    free(sh);
  }
  free(logits);
}

/* ---- AdamW ------------------------------------------------------------------ */

static void test_adamw(void **state) {
  (void)state;
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f;
  float p[3] = {1.0f, -2.0f, 0.5f}, m[3] = {0}, v[3] = {0};
  const float g[2][3] = {{0.1f, -0.3f, 2.0f}, {-0.2f, 0.4f, 1.0f}};
  // torch 2.15 AdamW(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, foreach=False),
  // hyperparameters as Python doubles (1 − b2 differs from 1 − 0.999f by 1.3e-5 relative);
  // the values are torch's fp32 results (9 significant digits name a float)
  const double torch_p[2][3] = {{0.989000022, -1.98800004, 0.489500016},
                                {0.991672099, -1.98794723, 0.479688704}};
  const double torch_m[3] = {-0.01100000087171793, 0.013000000268220901, 0.2800000011920929};
  const double torch_v[3] = {4.999000157113187e-05, 0.0002499100228305906, 0.004996000323444605};
  /* exact trajectories in double: ours (the fp32 hyperparameters the test
   * passes) and torch's (Python doubles), each carrying the bound of an fp32
   * evaluation (tolerance.h §5) */
  tol_adamw ours[3], theirs[3];
  for (int i = 0; i < 3; i++) {
    ours[i] = (tol_adamw){p[i], 0, 0, 0, 0, 0};
    theirs[i] = ours[i];
  }
  for (int s = 0; s < 2; s++) {
    float p0[3], m0[3], v0[3];
    memcpy(p0, p, sizeof p), memcpy(m0, m, sizeof m), memcpy(v0, v, sizeof v);
    float gs[3];
    memcpy(gs, g[s], sizeof gs);
    k_adamw_step(p, gs, m, v, NULL, 3, 1.0f, lr, b1, b2, eps, wd, s + 1);
    assert_memory_equal(gs, g[s], sizeof gs); /* grad_scale 1: g only read */
    double hp[3], hm[3], hv[3], bp[3], bm[3], bv[3], tp[3], btp[3];
    for (int i = 0; i < 3; i++) {
      /* this step from the kernel's own state, by hand in double */
      tol_adamw h = tol_adamw_step((tol_adamw){p0[i], m0[i], v0[i], 0, 0, 0}, g[s][i], lr, b1, b2,
                                   eps, wd, s + 1);
      hp[i] = h.p, hm[i] = h.m, hv[i] = h.v, bp[i] = h.bp, bm[i] = h.bm, bv[i] = h.bv;
      ours[i] = tol_adamw_step(ours[i], g[s][i], lr, b1, b2, eps, wd, s + 1);
      theirs[i] = tol_adamw_step(theirs[i], g[s][i], 1e-2, 0.9, 0.999, 1e-8, 0.1, s + 1);
      /* torch's fp32 value vs the kernel's: both within their carried
       * bounds of their exact trajectories, which differ by the
       * hyperparameters only */
      tp[i] = (float)torch_p[s][i];
      btp[i] = ours[i].bp + theirs[i].bp;
    }
    double shift[3];
    for (int i = 0; i < 3; i++) shift[i] = tp[i] + (ours[i].p - theirs[i].p);
    expect_within("adamw p vs hand", p, hp, bp, 3);
    expect_within("adamw m vs hand", m, hm, bm, 3);
    expect_within("adamw v vs hand", v, hv, bv, 3);
    expect_within("adamw p vs torch", p, shift, btp, 3);
  }
  double sm[3], sv[3], bm2[3], bv2[3];
  for (int i = 0; i < 3; i++) {
    sm[i] = (float)torch_m[i] + (ours[i].m - theirs[i].m);
    sv[i] = (float)torch_v[i] + (ours[i].v - theirs[i].v);
    bm2[i] = ours[i].bm + theirs[i].bm;
    bv2[i] = ours[i].bv + theirs[i].bv;
  }
  expect_within("adamw m vs torch", m, sm, bm2, 3);
  expect_within("adamw v vs torch", v, sv, bv2, 3);
}

/* Clipping folded into the step (grad_scale, ml_engine_clip_adamw): the
 * gradients, parameters and moments bit for bit those of k_scale then the
 * step, over lengths that end inside and outside a SIMD vector; and the
 * bf16 copy written by the same pass (p_bf16, FSDP's persistent
 * param_dtype shard) bit for bit ml_convert_from_f32 of the updated
 * weights, scaled or not. Sides: 0 and 3 scale by k_scale first, 1 and 2
 * in the pass; 2 and 3 write p_bf16. */
static void test_adamw_clip_fused(void **state) {
  (void)state;
  enum { N = 1000, SIDES = 4 };
  static float p[SIDES][N], g[SIDES][N], m[SIDES][N], v[SIDES][N];
  static uint16_t lp[SIDES][N], want[N];
  for (int i = 0; i < N; i++) {
    float pi = 0.5f * frand(), gi = 1.5f * frand(), mi = 0.05f * frand();
    float vi = 0.01f * fabsf(frand());
    for (int s = 0; s < SIDES; s++) p[s][i] = pi, g[s][i] = gi, m[s][i] = mi, v[s][i] = vi;
  }
  const float coef = 0.3719f;
  for (int64_t n = N - 13; n <= N; n += 13) {
    for (int s = 0; s < SIDES; s++) {
      bool fused = s == 1 || s == 2;
      if (!fused) k_scale(g[s], n, coef);
      k_adamw_step(p[s], g[s], m[s], v[s], s >= 2 ? lp[s] : NULL, n, fused ? coef : 1.0f, 1e-3,
                   0.9, 0.999, 1e-8, 0.1, 3);
    }
    for (int s = 1; s < SIDES; s++) {
      assert_memory_equal(g[0], g[s], sizeof g[0]);
      assert_memory_equal(p[0], p[s], sizeof p[0]);
      assert_memory_equal(m[0], m[s], sizeof m[0]);
      assert_memory_equal(v[0], v[s], sizeof v[0]);
    }
    assert_int_equal(ml_convert_from_f32(ML_BF16, p[0], want, (size_t)n), 0);
    assert_memory_equal(lp[2], want, sizeof(uint16_t) * (size_t)n);
    assert_memory_equal(lp[3], want, sizeof(uint16_t) * (size_t)n);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_linear_fwd),    cmocka_unit_test(test_linear_bwd),
      cmocka_unit_test(test_linear_bf16),   cmocka_unit_test(test_linear_operands),
      cmocka_unit_test(test_gemm_empty_inner),
      cmocka_unit_test(test_rmsnorm_fwd),   cmocka_unit_test(test_rmsnorm_bwd),
      cmocka_unit_test(test_rope_inv_freq), cmocka_unit_test(test_rope_scalings),
      cmocka_unit_test(test_rope_tables),
      cmocka_unit_test(test_rope_apply),    cmocka_unit_test(test_expf),
      cmocka_unit_test(test_add_bf16),
      cmocka_unit_test(test_add_to),
      cmocka_unit_test(test_round_bf16_to),
      cmocka_unit_test(test_add_round_to),
      cmocka_unit_test(test_add_grad),
      cmocka_unit_test(test_attention_fwd),
      cmocka_unit_test(test_attention_fixed_fwd),
      cmocka_unit_test(test_attention_fixed_blocks), cmocka_unit_test(test_attention_rows),
      cmocka_unit_test(test_attention_bwd),
      cmocka_unit_test(test_attention_blocks), cmocka_unit_test(test_attention_head_split),
      cmocka_unit_test(test_attention_bwd_chunks),
      cmocka_unit_test(test_attention_bwd_overwrite),
      cmocka_unit_test(test_attention_head_major),
      cmocka_unit_test(test_attention_bf16),
      cmocka_unit_test(test_attention_bf16_out),
      cmocka_unit_test(test_attention_bf16_qkv),
      cmocka_unit_test(test_glu),
      cmocka_unit_test(test_glu_bf16),
      cmocka_unit_test(test_embedding),     cmocka_unit_test(test_xent),
      cmocka_unit_test(test_serial_threshold), cmocka_unit_test(test_column_runs),
      cmocka_unit_test(test_norm_partials),
      cmocka_unit_test(test_xent_online),
      cmocka_unit_test(test_adamw),         cmocka_unit_test(test_adamw_clip_fused),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
