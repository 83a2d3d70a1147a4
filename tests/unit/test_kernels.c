/* CPU kernels against naive double-precision references, central finite
 * differences of sum(dy ⊙ f(x)), and literal values from torch/transformers. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>  // after the headers it needs

#include "kernels/cpu/kernels.h"

/* ---- helpers ------------------------------------------------------------ */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

// uniform in [-1, 1)
static float frand(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (float)((double)(rng_state >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static float *rand_buf(int64_t n, float scale) {
  float *a = malloc((size_t)n * sizeof(float));
  for (int64_t i = 0; i < n; i++) a[i] = scale * frand();
  return a;
}

static float *const_buf(int64_t n, float c) {
  float *a = malloc((size_t)n * sizeof(float));
  for (int64_t i = 0; i < n; i++) a[i] = c;
  return a;
}

static double *dzeros(int64_t n) { return calloc((size_t)n, sizeof(double)); }

// max |a − ref| / max |ref| (ref all zero: absolute error)
static double rel_err(const float *a, const double *ref, int64_t n) {
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < n; i++) {
    num = fmax(num, fabs((double)a[i] - ref[i]));
    den = fmax(den, fabs(ref[i]));
  }
  return den > 0.0 ? num / den : num;
}

// max |a − ref| / max |ref| for a double result
static double rel_err_d(const double *a, const double *ref, int64_t n) {
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < n; i++) {
    num = fmax(num, fabs(a[i] - ref[i]));
    den = fmax(den, fabs(ref[i]));
  }
  return num / den;
}

// the same, with a float reference shifted by `base` (for += outputs)
static double rel_err_acc(const float *a, float base, const double *ref, int64_t n) {
  double *shifted = dzeros(n);
  for (int64_t i = 0; i < n; i++) shifted[i] = ref[i] + base;
  double e = rel_err(a, shifted, n);
  free(shifted);
  return e;
}

static void expect_below(const char *what, double err, double tol) {
  printf("  %-44s max rel err %.3g (tol %.0e)\n", what, err, tol);
  assert_true(err < tol);
}

/* Finite differences: `run` evaluates the forward on the inputs held by ctx
 * into y[ny]; the loss is sum(dy ⊙ y) accumulated in double. */
typedef void (*fwd_run)(void *ctx, float *y);

static double loss_at(fwd_run run, void *ctx, const float *dy, float *y, int64_t ny) {
  run(ctx, y);
  double l = 0.0;
  for (int64_t i = 0; i < ny; i++) l += (double)dy[i] * y[i];
  return l;
}

// max |grad − fd| / max |fd| over every `stride`-th entry of x[nx] (fd all
// zero, e.g. scores of a single visible key: absolute error)
static double fd_err(fwd_run run, void *ctx, float *x, int64_t nx, int64_t stride,
                     const float *grad, const float *dy, int64_t ny, float eps) {
  float *y = malloc((size_t)ny * sizeof(float));
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < nx; i += stride) {
    float xi = x[i], xp = xi + eps, xm = xi - eps;
    x[i] = xp;
    double lp = loss_at(run, ctx, dy, y, ny);
    x[i] = xm;
    double lm = loss_at(run, ctx, dy, y, ny);
    x[i] = xi;
    double fd = (lp - lm) / ((double)xp - (double)xm);
    num = fmax(num, fabs(grad[i] - fd));
    den = fmax(den, fabs(fd));
  }
  free(y);
  return den > 0.0 ? num / den : num;
}

/* ---- linear -------------------------------------------------------------- */

typedef struct linear_ctx {
  float *x, *W, *b;
  int64_t T, in, out;
} linear_ctx;

static void linear_run(void *c, float *y) {
  linear_ctx *l = c;
  k_linear_fwd(l->x, l->W, l->b, y, l->T, l->in, l->out);
}

// y: [T, out] = x·W^T + b in double
static void linear_ref(const linear_ctx *l, double *y) {
  for (int64_t t = 0; t < l->T; t++)
    for (int64_t o = 0; o < l->out; o++) {
      double s = l->b ? l->b[o] : 0.0;
      for (int64_t i = 0; i < l->in; i++) s += (double)l->x[t * l->in + i] * l->W[o * l->in + i];
      y[t * l->out + o] = s;
    }
}

static void test_linear_fwd(void **state) {
  (void)state;
  int64_t T = 7, in = 13, out = 9;
  linear_ctx l = {rand_buf(T * in, 1), rand_buf(out * in, 1), rand_buf(out, 1), T, in, out};
  float *y = malloc((size_t)(T * out) * sizeof(float));
  double *ref = dzeros(T * out);
  for (int with_bias = 0; with_bias < 2; with_bias++) {
    linear_ctx c = l;
    c.b = with_bias ? l.b : NULL;
    linear_run(&c, y);
    linear_ref(&c, ref);
    expect_below(with_bias ? "linear fwd (bias)" : "linear fwd", rel_err(y, ref, T * out), 1e-6);
  }
  free(l.x), free(l.W), free(l.b), free(y), free(ref);
}

static void test_linear_bwd(void **state) {
  (void)state;
  int64_t T = 6, in = 11, out = 5;
  linear_ctx l = {rand_buf(T * in, 1), rand_buf(out * in, 1), rand_buf(out, 1), T, in, out};
  float *dy = rand_buf(T * out, 1), *dx = const_buf(T * in, 0.25f);
  float *dW = const_buf(out * in, 0.5f), *db = const_buf(out, -0.5f);
  double *rdx = dzeros(T * in), *rdW = dzeros(out * in), *rdb = dzeros(out);
  for (int64_t t = 0; t < T; t++)
    for (int64_t o = 0; o < out; o++) {
      double g = dy[t * out + o];
      rdb[o] += g;
      for (int64_t i = 0; i < in; i++) {
        rdx[t * in + i] += g * l.W[o * in + i];
        rdW[o * in + i] += g * l.x[t * in + i];
      }
    }
  k_linear_bwd(dy, l.x, l.W, dx, 1, dW, db, T, in, out);
  expect_below("linear bwd dx (+=)", rel_err_acc(dx, 0.25f, rdx, T * in), 1e-6);
  expect_below("linear bwd dW (+=)", rel_err_acc(dW, 0.5f, rdW, out * in), 1e-6);
  expect_below("linear bwd db (+=)", rel_err_acc(db, -0.5f, rdb, out), 1e-6);
  // dx overwritten, dW accumulates a second time, db skipped
  k_linear_bwd(dy, l.x, l.W, dx, 0, dW, NULL, T, in, out);
  expect_below("linear bwd dx (=)", rel_err(dx, rdx, T * in), 1e-6);
  for (int64_t i = 0; i < out * in; i++) rdW[i] *= 2.0;
  expect_below("linear bwd dW twice", rel_err_acc(dW, 0.5f, rdW, out * in), 1e-6);
  expect_below("linear bwd db untouched", rel_err_acc(db, -0.5f, rdb, out), 1e-6);
  k_linear_bwd(dy, l.x, l.W, NULL, 0, dW, NULL, T, in, out);  // dx skipped
  memset(dW, 0, (size_t)(out * in) * sizeof(float));
  memset(db, 0, (size_t)out * sizeof(float));
  k_linear_bwd(dy, l.x, l.W, dx, 0, dW, db, T, in, out);
  expect_below("linear dx vs fd", fd_err(linear_run, &l, l.x, T * in, 1, dx, dy, T * out, 1e-2f),
               1e-3);
  expect_below("linear dW vs fd", fd_err(linear_run, &l, l.W, out * in, 1, dW, dy, T * out, 1e-2f),
               1e-3);
  expect_below("linear db vs fd", fd_err(linear_run, &l, l.b, out, 1, db, dy, T * out, 1e-2f),
               1e-3);
  free(l.x), free(l.W), free(l.b), free(dy), free(dx), free(dW), free(db);
  free(rdx), free(rdW), free(rdb);
}

/* ---- rmsnorm --------------------------------------------------------------- */

typedef struct rms_ctx {
  float *x, *w, *rstd;
  float w_offset, eps;
  int64_t T, H;
} rms_ctx;

static void rms_run(void *c, float *y) {
  rms_ctx *r = c;
  k_rmsnorm_fwd(r->x, r->w, r->w_offset, r->eps, y, r->rstd, r->T, r->H);
}

// y = x / sqrt(mean x² + eps) · (w_offset + w) in double; returns rstd too
static void rms_ref(const rms_ctx *r, double *y, double *rstd) {
  for (int64_t t = 0; t < r->T; t++) {
    double ss = 0.0;
    for (int64_t h = 0; h < r->H; h++) ss += (double)r->x[t * r->H + h] * r->x[t * r->H + h];
    rstd[t] = 1.0 / sqrt(ss / (double)r->H + r->eps);
    for (int64_t h = 0; h < r->H; h++)
      y[t * r->H + h] = r->x[t * r->H + h] * rstd[t] * (r->w_offset + (double)r->w[h]);
  }
}

// dx, dw of sum(dy ⊙ y) in double
static void rms_ref_bwd(const rms_ctx *r, const float *dy, double *dx, double *dw) {
  double *y = dzeros(r->T * r->H), *rs = dzeros(r->T);
  rms_ref(r, y, rs);
  for (int64_t t = 0; t < r->T; t++) {
    const float *x = r->x + t * r->H, *d = dy + t * r->H;
    double dot = 0.0;
    for (int64_t h = 0; h < r->H; h++) dot += d[h] * (r->w_offset + (double)r->w[h]) * x[h];
    for (int64_t h = 0; h < r->H; h++) {
      double we = r->w_offset + (double)r->w[h];
      dx[t * r->H + h] = rs[t] * we * d[h] - x[h] * rs[t] * rs[t] * rs[t] * dot / (double)r->H;
      dw[h] += d[h] * x[h] * rs[t];
    }
  }
  free(y), free(rs);
}

static void test_rmsnorm_fwd(void **state) {
  (void)state;
  int64_t T = 6, H = 37;
  for (int gemma = 0; gemma < 2; gemma++) {
    rms_ctx r = {rand_buf(T * H, 2), rand_buf(H, 1), malloc(T * sizeof(float)), gemma, 1e-6f, T, H};
    double *ref = dzeros(T * H), *rrs = dzeros(T);
    rms_ref(&r, ref, rrs);
    float *y = malloc((size_t)(T * H) * sizeof(float));
    rms_run(&r, y);
    expect_below(gemma ? "rmsnorm fwd (w_offset 1)" : "rmsnorm fwd", rel_err(y, ref, T * H), 1e-6);
    expect_below("rmsnorm rstd", rel_err(r.rstd, rrs, T), 1e-6);
    k_rmsnorm_fwd(r.x, r.w, r.w_offset, r.eps, r.x, r.rstd, T, H);  // y aliases x
    expect_below("rmsnorm fwd in place", rel_err(r.x, ref, T * H), 1e-6);
    free(r.x), free(r.w), free(r.rstd), free(ref), free(rrs), free(y);
  }
}

static void test_rmsnorm_bwd(void **state) {
  (void)state;
  int64_t T = 5, H = 19;
  for (int gemma = 0; gemma < 2; gemma++) {
    rms_ctx r = {rand_buf(T * H, 2), rand_buf(H, 1), malloc(T * sizeof(float)), gemma, 1e-5f, T, H};
    float *dy = rand_buf(T * H, 1), *dx = malloc((size_t)(T * H) * sizeof(float));
    float *dw = const_buf(H, 0.5f), *y = malloc((size_t)(T * H) * sizeof(float));
    double *rdx = dzeros(T * H), *rdw = dzeros(H);
    rms_ref_bwd(&r, dy, rdx, rdw);
    rms_run(&r, y);
    k_rmsnorm_bwd(dy, r.x, r.w, r.w_offset, r.rstd, dx, dw, T, H);
    expect_below("rmsnorm bwd dx vs ref", rel_err(dx, rdx, T * H), 1e-5);
    expect_below("rmsnorm bwd dw (+=) vs ref", rel_err_acc(dw, 0.5f, rdw, H), 1e-5);
    for (int64_t h = 0; h < H; h++) dw[h] -= 0.5f;
    expect_below("rmsnorm dx vs fd", fd_err(rms_run, &r, r.x, T * H, 1, dx, dy, T * H, 1e-2f),
                 2e-3);
    expect_below("rmsnorm dw vs fd", fd_err(rms_run, &r, r.w, H, 1, dw, dy, T * H, 1e-2f), 1e-3);
    rms_run(&r, y);  // restore rstd of the unperturbed input
    k_rmsnorm_bwd(dy, r.x, r.w, r.w_offset, r.rstd, dy, NULL, T, H);  // dx aliases dy
    expect_below("rmsnorm bwd in place, dw NULL", rel_err(dy, rdx, T * H), 1e-5);
    free(r.x), free(r.w), free(r.rstd), free(dy), free(dx), free(dw), free(y), free(rdx), free(rdw);
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

static void test_rope_inv_freq(void **state) {
  (void)state;
  enum { HD = 16 };
  float inv[HD / 2];
  double ref[HD / 2];
  k_rope_inv_freq(10000.0, HD, NULL, inv);
  for (int i = 0; i < HD / 2; i++) ref[i] = 1.0 / pow(10000.0, 2.0 * i / HD);
  expect_below("rope inv_freq default", rel_err(inv, ref, HD / 2), 1e-6);
  k_rope_scaling lin = {K_ROPE_LINEAR, 4.0, 0, 0, 0};
  k_rope_inv_freq(10000.0, HD, &lin, inv);
  for (int i = 0; i < HD / 2; i++) ref[i] /= 4.0;
  expect_below("rope inv_freq linear", rel_err(inv, ref, HD / 2), 1e-6);
  // transformers 5.23 llama3 inv_freq (theta 5e5, factor 8, low 1, high 4)
  static const double hf[2][HD / 2] = {
      {0x1p+0, 0x1.8d276p-3, 0x1.34119p-5, 0x1.ddee9ep-8, 0x1.132ba4p-11, 0x1.1f91fp-15,
       0x1.be2188p-18, 0x1.5a0f4ep-20},
      {0x1p+0, 0x1.453c18p-4, 0x1.34119p-8, 0x1.ddee9ep-11, 0x1.72ba42p-13, 0x1.1f91fp-15,
       0x1.be2188p-18, 0x1.5a0f4ep-20}};
  static const double originals[2] = {8192.0, 64.0};
  for (int c = 0; c < 2; c++) {
    k_rope_scaling l3 = {K_ROPE_LLAMA3, 8.0, 1.0, 4.0, originals[c]};
    k_rope_inv_freq(500000.0, HD, &l3, inv);
    for (int i = 0; i < HD / 2; i++)
      ref[i] = llama3_ref(1.0 / pow(500000.0, 2.0 * i / HD), 8.0, 1.0, 4.0, originals[c]);
    expect_below(
        c ? "rope llama3 (original 64) vs double" : "rope llama3 (original 8192) vs double",
        rel_err(inv, ref, HD / 2), 1e-5);
    double e = 0.0;
    for (int i = 0; i < HD / 2; i++) e = fmax(e, fabs(inv[i] - hf[c][i]) / hf[c][i]);
    expect_below("rope llama3 vs transformers", e, 3e-7);
  }
}

static void test_rope_tables(void **state) {
  (void)state;
  int64_t hd = 12, S = 300, half = hd / 2;
  float inv[6], *c = malloc((size_t)(S * half) * sizeof(float)),
                *s = malloc((size_t)(S * half) * sizeof(float));
  k_rope_inv_freq(10000.0, hd, NULL, inv);
  k_rope_tables(inv, hd, S, c, s);
  double err = 0.0;
  for (int64_t p = 0; p < S; p++)
    for (int64_t i = 0; i < half; i++) {
      double a = (float)p * inv[i];
      err = fmax(err, fmax(fabs(c[p * half + i] - cos(a)), fabs(s[p * half + i] - sin(a))));
    }
  expect_below("rope tables (abs)", err, 1e-6);
  free(c), free(s);
}

// x: [B*S, nh, hd] rotated by dir·angle in double
static void rope_ref(const float *x, const float *c, const float *s, int64_t B, int64_t S,
                     int64_t nh, int64_t hd, double dir, double *y) {
  int64_t half = hd / 2;
  for (int64_t t = 0; t < B * S; t++)
    for (int64_t h = 0; h < nh; h++)
      for (int64_t i = 0; i < half; i++) {
        int64_t o = (t * nh + h) * hd + i, p = (t % S) * half + i;
        double x1 = x[o], x2 = x[o + half], sn = dir * s[p];
        y[o] = x1 * c[p] - x2 * sn;
        y[o + half] = x2 * c[p] + x1 * sn;
      }
}

static void test_rope_apply(void **state) {
  (void)state;
  int64_t B = 2, S = 5, nh = 3, hd = 8, n = B * S * nh * hd;
  float inv[4], c[5 * 4], s[5 * 4];
  k_rope_inv_freq(10000.0, hd, NULL, inv);
  k_rope_tables(inv, hd, S, c, s);
  float *x = rand_buf(n, 1), *y = malloc((size_t)n * sizeof(float)), *g = rand_buf(n, 1);
  float *dx = malloc((size_t)n * sizeof(float));
  double *ref = dzeros(n);
  memcpy(y, x, (size_t)n * sizeof(float));
  k_rope_fwd(y, c, s, B, S, nh, hd);
  rope_ref(x, c, s, B, S, nh, hd, 1.0, ref);
  expect_below("rope fwd", rel_err(y, ref, n), 1e-6);
  memcpy(dx, g, (size_t)n * sizeof(float));
  k_rope_bwd(dx, c, s, B, S, nh, hd);
  rope_ref(g, c, s, B, S, nh, hd, -1.0, ref);
  expect_below("rope bwd", rel_err(dx, ref, n), 1e-6);
  double lhs = 0.0, rhs = 0.0;  // <rope(x), g> = <x, rope_bwd(g)>
  for (int64_t i = 0; i < n; i++) lhs += (double)y[i] * g[i], rhs += (double)x[i] * dx[i];
  expect_below("rope bwd is the adjoint", fabs(lhs - rhs) / fabs(lhs), 1e-6);
  free(x), free(y), free(g), free(dx), free(ref);
}

/* ---- attention ---------------------------------------------------------------- */

typedef struct attn_ctx {
  float *q, *k, *v, *P;
  int64_t B, S, nh, nkv, hd, window;
  float scale;
} attn_ctx;

static void attn_run(void *c, float *out) {
  attn_ctx *a = c;
  k_attention_fwd(a->q, a->k, a->v, out, a->P, a->B, a->S, a->nh, a->nkv, a->hd, a->scale,
                  a->window);
}

static int visible(int64_t i, int64_t j, int64_t window) {
  return j <= i && (window <= 0 || j > i - window);
}

// row (b, h, i) of the probabilities in double: p[S]
static void attn_ref_probs(const attn_ctx *a, int64_t b, int64_t h, int64_t i, double *p) {
  int64_t g = h / (a->nh / a->nkv);
  const float *qi = a->q + ((b * a->S + i) * a->nh + h) * a->hd;
  double m = -INFINITY, sum = 0.0;
  for (int64_t j = 0; j < a->S; j++) {
    const float *kj = a->k + ((b * a->S + j) * a->nkv + g) * a->hd;
    double s = 0.0;
    for (int64_t d = 0; d < a->hd; d++) s += (double)qi[d] * kj[d];
    p[j] = a->scale * s;
    if (visible(i, j, a->window)) m = fmax(m, p[j]);
  }
  for (int64_t j = 0; j < a->S; j++) {
    p[j] = visible(i, j, a->window) ? exp(p[j] - m) : 0.0;
    sum += p[j];
  }
  for (int64_t j = 0; j < a->S; j++) p[j] /= sum;
}

// out [B*S, nh, hd], P [B, nh, S, S]; with dout: dq, dk, dv (+=) too
static void attn_ref(const attn_ctx *a, const float *dout, double *out, double *P, double *dq,
                     double *dk, double *dv) {
  int64_t S = a->S, hd = a->hd;
  double *dp = dzeros(S);
  for (int64_t b = 0; b < a->B; b++)
    for (int64_t h = 0; h < a->nh; h++)
      for (int64_t i = 0; i < S; i++) {
        int64_t g = h / (a->nh / a->nkv), qo = ((b * S + i) * a->nh + h) * hd;
        double *p = P + ((b * a->nh + h) * S + i) * S, dot = 0.0;
        attn_ref_probs(a, b, h, i, p);
        for (int64_t j = 0; j < S; j++) {
          int64_t ko = ((b * S + j) * a->nkv + g) * hd;
          dp[j] = 0.0;
          for (int64_t d = 0; d < hd; d++) {
            out[qo + d] += p[j] * a->v[ko + d];
            if (dout) dp[j] += (double)dout[qo + d] * a->v[ko + d];
            if (dout) dv[ko + d] += p[j] * dout[qo + d];
          }
          dot += p[j] * dp[j];
        }
        for (int64_t j = 0; dout && j < S; j++) {
          int64_t ko = ((b * S + j) * a->nkv + g) * hd;
          double ds = a->scale * p[j] * (dp[j] - dot);
          for (int64_t d = 0; d < hd; d++) {
            dq[qo + d] += ds * a->k[ko + d];
            dk[ko + d] += ds * a->q[qo + d];
          }
        }
      }
  free(dp);
}

static const attn_ctx ATTN_CASES[] = {
    {NULL, NULL, NULL, NULL, 2, 5, 4, 2, 8, 0, 0.35f},     // GQA
    {NULL, NULL, NULL, NULL, 2, 5, 4, 2, 8, 3, 0.35f},     // GQA + sliding window
    {NULL, NULL, NULL, NULL, 2, 7, 3, 3, 6, 0, 0.4f},      // MHA, odd sizes
    {NULL, NULL, NULL, NULL, 1, 300, 4, 2, 16, 0, 0.25f},  // several row blocks
    {NULL, NULL, NULL, NULL, 1, 300, 2, 1, 16, 100, 0.25f},
    // sliding windows: Gemma3-like (window 8 < S = 24, scale 24^-0.5), only
    // the query itself (window 1), a window past S (= full causal), and one
    // reaching back across a row block into the previous one with GQA
    {NULL, NULL, NULL, NULL, 2, 24, 4, 2, 16, 8, 0.20412415f},
    {NULL, NULL, NULL, NULL, 1, 7, 2, 1, 4, 1, 0.5f},
    {NULL, NULL, NULL, NULL, 2, 5, 4, 2, 8, 9, 0.35f},
    {NULL, NULL, NULL, NULL, 1, 300, 4, 2, 16, 130, 0.25f},
};

static attn_ctx attn_alloc(attn_ctx a) {
  int64_t nq = a.B * a.S * a.nh * a.hd, nk = a.B * a.S * a.nkv * a.hd;
  a.q = rand_buf(nq, 1.5f), a.k = rand_buf(nk, 1.5f), a.v = rand_buf(nk, 1);
  a.P = malloc((size_t)(a.B * a.nh * a.S * a.S) * sizeof(float));
  return a;
}

static void attn_free(attn_ctx *a) { free(a->q), free(a->k), free(a->v), free(a->P); }

static void test_attention_fwd(void **state) {
  (void)state;
  for (size_t c = 0; c < sizeof ATTN_CASES / sizeof ATTN_CASES[0]; c++) {
    attn_ctx a = attn_alloc(ATTN_CASES[c]);
    int64_t nq = a.B * a.S * a.nh * a.hd, np = a.B * a.nh * a.S * a.S;
    float *out = malloc((size_t)nq * sizeof(float));
    double *rout = dzeros(nq), *rP = dzeros(np);
    attn_run(&a, out);
    attn_ref(&a, NULL, rout, rP, NULL, NULL, NULL);
    char what[64];
    snprintf(what, sizeof what, "attention fwd S=%lld window=%lld", (long long)a.S,
             (long long)a.window);
    expect_below(what, rel_err(out, rout, nq), 1e-5);
    expect_below("attention P", rel_err(a.P, rP, np), 1e-5);
    for (int64_t i = 0; i < np; i++)
      if (rP[i] == 0.0) assert_true(a.P[i] == 0.0f);  // masked entries exactly 0
    free(out), free(rout), free(rP);
    attn_free(&a);
  }
}

static void test_attention_bwd(void **state) {
  (void)state;
  for (size_t c = 0; c < sizeof ATTN_CASES / sizeof ATTN_CASES[0]; c++) {
    attn_ctx a = attn_alloc(ATTN_CASES[c]);
    int64_t nq = a.B * a.S * a.nh * a.hd, nk = a.B * a.S * a.nkv * a.hd;
    int64_t np = a.B * a.nh * a.S * a.S, stride = a.S > 16 ? 97 : 1;
    float *out = malloc((size_t)nq * sizeof(float)), *dout = rand_buf(nq, 1);
    float *dq = malloc((size_t)nq * sizeof(float)), *dk = const_buf(nk, 9.0f),
          *dv = const_buf(nk, 9.0f);
    double *rout = dzeros(nq), *rP = dzeros(np), *rdq = dzeros(nq), *rdk = dzeros(nk),
           *rdv = dzeros(nk);
    attn_run(&a, out);
    k_attention_bwd(dout, a.q, a.k, a.v, a.P, dq, dk, dv, a.B, a.S, a.nh, a.nkv, a.hd, a.scale);
    attn_ref(&a, dout, rout, rP, rdq, rdk, rdv);
    char what[64];
    snprintf(what, sizeof what, "attention bwd S=%lld window=%lld dq", (long long)a.S,
             (long long)a.window);
    expect_below(what, rel_err(dq, rdq, nq), 1e-5);
    expect_below("attention bwd dk (=)", rel_err(dk, rdk, nk), 1e-5);
    expect_below("attention bwd dv (=)", rel_err(dv, rdv, nk), 1e-5);
    expect_below("attention dq vs fd", fd_err(attn_run, &a, a.q, nq, stride, dq, dout, nq, 1e-2f),
                 2e-3);
    expect_below("attention dk vs fd", fd_err(attn_run, &a, a.k, nk, stride, dk, dout, nq, 1e-2f),
                 2e-3);
    expect_below("attention dv vs fd", fd_err(attn_run, &a, a.v, nk, stride, dv, dout, nq, 1e-2f),
                 2e-3);
    free(out), free(dout), free(dq), free(dk), free(dv);
    free(rout), free(rP), free(rdq), free(rdk), free(rdv);
    attn_free(&a);
  }
}

/* ---- gated activation --------------------------------------------------------- */

typedef struct glu_ctx {
  float *g, *u;
  int64_t n;
  k_act act;
} glu_ctx;

static void glu_run(void *c, float *h) {
  glu_ctx *a = c;
  k_glu_fwd(a->g, a->u, h, a->n, a->act);
}

static double act_ref(double x, k_act act) {
  if (act == K_ACT_SILU) return x / (1.0 + exp(-x));
  return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

static void test_glu(void **state) {
  (void)state;
  int64_t n = 301;
  for (int act = K_ACT_SILU; act <= K_ACT_GELU_TANH; act++) {
    glu_ctx a = {rand_buf(n, 4), rand_buf(n, 1), n, (k_act)act};
    float *h = malloc((size_t)n * sizeof(float)), *dh = rand_buf(n, 1);
    float *dg = malloc((size_t)n * sizeof(float)), *du = malloc((size_t)n * sizeof(float));
    double *ref = dzeros(n), *rdg = dzeros(n), *rdu = dzeros(n);
    for (int64_t i = 0; i < n; i++) {
      double x = a.g[i], e = 1e-6;
      ref[i] = act_ref(x, a.act) * a.u[i];
      rdu[i] = dh[i] * act_ref(x, a.act);
      rdg[i] = dh[i] * a.u[i] * (act_ref(x + e, a.act) - act_ref(x - e, a.act)) / (2 * e);
    }
    glu_run(&a, h);
    k_glu_bwd(dh, a.g, a.u, dg, du, n, a.act);
    const char *name = act == K_ACT_SILU ? "silu" : "gelu_tanh";
    printf("  [%s]\n", name);
    expect_below("glu fwd", rel_err(h, ref, n), 1e-6);
    expect_below("glu bwd dg vs ref", rel_err(dg, rdg, n), 1e-6);
    expect_below("glu bwd du vs ref", rel_err(du, rdu, n), 1e-6);
    expect_below("glu dg vs fd", fd_err(glu_run, &a, a.g, n, 1, dg, dh, n, 1e-2f), 1e-3);
    expect_below("glu du vs fd", fd_err(glu_run, &a, a.u, n, 1, du, dh, n, 1e-2f), 1e-3);
    free(a.g), free(a.u), free(h), free(dh), free(dg), free(du), free(ref), free(rdg), free(rdu);
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
  double ref[T * H] = {0}, rdW[ROWS * H] = {0};
  for (int t = 0; t < T; t++)
    for (int h = 0; h < H; h++)
      if (ids[t] >= ROW0 && ids[t] < ROW0 + ROWS) {
        ref[t * H + h] = scale * (double)W[(ids[t] - ROW0) * H + h];
        rdW[(ids[t] - ROW0) * H + h] += scale * (double)dout[t * H + h];
      }
  memset(out, 0x7f, sizeof out);  // out-of-range rows must be written as 0
  k_embedding_fwd(ids, T, W, ROW0, ROWS, H, scale, out);
  expect_below("embedding fwd", rel_err(out, ref, T * H), 1e-6);
  k_embedding_bwd(ids, T, dout, ROW0, ROWS, H, scale, dW);
  expect_below("embedding bwd (+=, repeated ids)", rel_err_acc(dW, 1.0f, rdW, ROWS * H), 1e-6);
  free(W), free(dout), free(dW);
}

/* ---- cross-entropy ------------------------------------------------------------ */

enum { XT = 6, XV = 23, XSPLIT = 10 };

// per-row loss −log_softmax(logits)[y] in double (0 for y = −1)
static void xent_ref(const float *logits, const int32_t *y, double *loss, double *dl,
                     const float *w) {
  for (int t = 0; t < XT; t++) {
    const float *l = logits + t * XV;
    double m = -INFINITY, se = 0.0;
    for (int j = 0; j < XV; j++) m = fmax(m, l[j]);
    for (int j = 0; j < XV; j++) se += exp(l[j] - m);
    loss[t] = y[t] < 0 ? 0.0 : log(se) - (l[y[t]] - m);
    for (int j = 0; j < XV; j++) dl[t * XV + j] = w[t] * (exp(l[j] - m) / se - (j == y[t]));
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

static void test_xent(void **state) {
  (void)state;
  const int32_t y[XT] = {0, 9, 10, 22, -1, 15};
  const float w[XT] = {0.5f, 1.0f, 1.0f, 0.25f, 0.0f, 2.0f};
  float *logits = rand_buf(XT * XV, 6), got[XT * XV];
  double loss[XT], dl[XT * XV], lossd[XT];
  xent_ref(logits, y, loss, dl, w);
  // one shard holding the whole vocab: loss = log(se) − tl
  float mx[XT], se[XT], tl[XT];
  xent_pieces(logits, 0, XV, y, NULL, mx, NULL, NULL);
  xent_pieces(logits, 0, XV, y, mx, mx, se, tl);
  for (int t = 0; t < XT; t++) lossd[t] = y[t] < 0 ? tl[t] : log((double)se[t]) - tl[t];
  expect_below("xent one shard vs log_softmax", rel_err_d(lossd, loss, XT), 1e-6);
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
  expect_below("xent two shards vs log_softmax", rel_err_d(lossd, loss, XT), 1e-6);
  for (int s = 0; s < 2; s++) {
    float *sh = xent_shard(logits, v0s[s], Vs[s]);
    k_xent_bwd(sh, XT, Vs[s], v0s[s], y, gmx, gse, w, sh);  // in place
    for (int t = 0; t < XT; t++)
      memcpy(got + t * XV + v0s[s], sh + t * Vs[s], (size_t)Vs[s] * sizeof(float));
    free(sh);
  }
  expect_below("xent bwd (two shards, in place)", rel_err(got, dl, XT * XV), 1e-6);
  free(logits);
}

/* ---- AdamW ------------------------------------------------------------------ */

static void test_adamw(void **state) {
  (void)state;
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f;
  float p[3] = {1.0f, -2.0f, 0.5f}, m[3] = {0}, v[3] = {0};
  const float g[2][3] = {{0.1f, -0.3f, 2.0f}, {-0.2f, 0.4f, 1.0f}};
  // torch 2.15 AdamW(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, foreach=False),
  // hyperparameters as Python doubles: 1 − b2 differs from 1 − 0.999f by 1.3e-5 relative
  const double torch_p[2][3] = {{0.989000022, -1.98800004, 0.489500016},
                                {0.991672099, -1.98794723, 0.479688704}};
  const double torch_m[3] = {-0.01100000087171793, 0.013000000268220901, 0.2800000011920929};
  const double torch_v[3] = {4.999000157113187e-05, 0.0002499100228305906, 0.004996000323444605};
  double hp[3] = {1.0, -2.0, 0.5}, hm[3] = {0}, hv[3] = {0};
  for (int s = 0; s < 2; s++) {
    k_adamw_step(p, g[s], m, v, 3, lr, b1, b2, eps, wd, s + 1);
    double bc1 = 1.0 - pow(b1, s + 1), bc2 = 1.0 - pow(b2, s + 1);
    for (int i = 0; i < 3; i++) {  // by hand in double, from the same fp32 hyperparameters
      hp[i] *= 1.0 - (double)lr * wd;
      hm[i] = b1 * hm[i] + (1.0 - b1) * g[s][i];
      hv[i] = b2 * hv[i] + (1.0 - b2) * g[s][i] * g[s][i];
      hp[i] -= lr / bc1 * hm[i] / (sqrt(hv[i]) / sqrt(bc2) + eps);
    }
    expect_below("adamw p vs hand", rel_err(p, hp, 3), 1e-6);
    expect_below("adamw m vs hand", rel_err(m, hm, 3), 1e-6);
    expect_below("adamw v vs hand", rel_err(v, hv, 3), 1e-6);
    expect_below("adamw p vs torch", rel_err(p, torch_p[s], 3), 1e-7);
  }
  expect_below("adamw m vs torch", rel_err(m, torch_m, 3), 1e-6);
  expect_below("adamw v vs torch", rel_err(v, torch_v, 3), 2e-5);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_linear_fwd),    cmocka_unit_test(test_linear_bwd),
      cmocka_unit_test(test_rmsnorm_fwd),   cmocka_unit_test(test_rmsnorm_bwd),
      cmocka_unit_test(test_rope_inv_freq), cmocka_unit_test(test_rope_tables),
      cmocka_unit_test(test_rope_apply),    cmocka_unit_test(test_attention_fwd),
      cmocka_unit_test(test_attention_bwd), cmocka_unit_test(test_glu),
      cmocka_unit_test(test_embedding),     cmocka_unit_test(test_xent),
      cmocka_unit_test(test_adamw),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
