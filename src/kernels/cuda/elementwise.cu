/* Element-wise kernels: fp32 <-> bf16 / f16 conversions and bf16 rounding
 * (tensor/dtype.{h,c}: ml_f32_to_bf16, ml_f32_to_f16, ml_f16_to_f32,
 * ml_round_bf16, reproduced bit for bit in integer arithmetic; the cast
 * with a bf16 copy: k_round_bf16_to), the residual add (with a bf16 copy
 * of the sum: k_add_bf16; a reduced gradient, written or rounded: k_add_grad;
 * into another buffer: k_add_to; rounded to bf16
 * values there, the cast at a unit boundary: k_add_round_to) and scaling
 * (kernels/cpu/vector.c: k_add, k_scale) and the
 * gated MLP activation (kernels/cpu/glu.c: k_glu_fwd/bwd and their bf16
 * variants, torch's silu and gelu(approximate='tanh') formulas in fp32).
 *
 * Every kernel strides over quads of 4 elements with 64-bit indices; a quad
 * moves in one vector access per operand whose pointer is aligned (common.cuh
 * kc_ld4/kc_st4), element by element otherwise. Each element is read and
 * written by one thread, so in-place use (scale, round_bf16) is safe. */
#include <math.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

/* ---- f16 (IEEE binary16), ports of tensor/dtype.c ------------------------ */

static __device__ __forceinline__ float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mant << 13)); /* inf, NaN */
  if (exp != 0) return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
  /* zero or subnormal: mant * 2^-24, exact in fp32 */
  float v = (float)mant * 5.9604644775390625e-8f;
  return sign ? -v : v;
}

/* |f| < 2^-14: a half subnormal q * 2^-24 (or zero), q the 24-bit
 * significand shifted right and rounded to nearest-even. */
static __device__ __forceinline__ uint16_t f16_subnormal(uint32_t ax) {
  uint32_t e = ax >> 23;
  if (e < 102) return 0; /* below 2^-25: rounds to zero (2^-25 itself ties to 0) */
  uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126 - e; /* 14..24 */
  uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) q++;
  return (uint16_t)q; /* q == 0x400 is the smallest normal, correctly encoded */
}

static __device__ __forceinline__ uint16_t f32_to_f16(float f) {
  uint32_t u = __float_as_uint(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t ax = u & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu)); /* qNaN */
  if (ax < 0x38800000u) return (uint16_t)(sign | f16_subnormal(ax));
  /* normal: round at bit 13 to nearest-even, rebias the exponent 127 -> 15;
   * anything that reaches exponent 31 (incl. inf) is inf */
  uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u) - (112u << 23);
  if (r >= (31u << 23)) return (uint16_t)(sign | 0x7c00u);
  return (uint16_t)(sign | (r >> 13));
}

/* ---- conversions ---------------------------------------------------------- */

/* Quads of either element type (kc_ld4 / kc_ld4h and their stores). */
static __device__ __forceinline__ void ld4(const float *p, int64_t i, int64_t n, float v[4]) {
  kc_ld4(p, i, n, v);
}
static __device__ __forceinline__ void ld4(const uint16_t *p, int64_t i, int64_t n,
                                           uint16_t v[4]) {
  kc_ld4h(p, i, n, v);
}
static __device__ __forceinline__ void st4(float *p, int64_t i, int64_t n, const float v[4]) {
  kc_st4(p, i, n, v);
}
static __device__ __forceinline__ void st4(uint16_t *p, int64_t i, int64_t n,
                                           const uint16_t v[4]) {
  kc_st4h(p, i, n, v);
}

static __device__ __forceinline__ float round_bf16(float x) {
  return kc_bf16_to_f32(kc_f32_to_bf16(x));
}

// dst[n] = F(src[n]); dst may be src (same type: in place)
template <typename S, typename D, D (*F)(S)>
static __global__ void map_kernel(const S *src, D *dst, int64_t n) {
  for (int64_t i = kc_gtid() * 4; i < n; i += kc_gstride() * 4) {
    S v[4];
    D h[4];
    ld4(src, i, n, v);
    for (int k = 0; k < 4; k++) h[k] = F(v[k]);
    st4(dst, i, n, h);
  }
}

/* ---- add, scale ----------------------------------------------------------- */

// z = y + x (z: y for y += x); with z16 also the sums rounded to nearest-even into z16 [n] bf16
static __global__ void add_kernel(float *z, const float *y, const float *x, uint16_t *z16,
                                  int64_t n) {
  for (int64_t i = kc_gtid() * 4; i < n; i += kc_gstride() * 4) {
    float a[4], b[4];
    kc_ld4(y, i, n, a);
    kc_ld4(x, i, n, b);
    for (int k = 0; k < 4; k++) a[k] += b[k];
    kc_st4(z, i, n, a);
    if (z16) {
      uint16_t h[4];
      for (int k = 0; k < 4; k++) h[k] = kc_f32_to_bf16(a[k]);
      kc_st4h(z16, i, n, h);
    }
  }
}

// y = (overwrite ? +0 : y) + (round ? fp32(bf16(x)) : x); overwrite: y not read
static __global__ void add_grad_kernel(float *y, const float *x, int64_t n, bool overwrite,
                                       bool round) {
  for (int64_t i = kc_gtid() * 4; i < n; i += kc_gstride() * 4) {
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f}, b[4];
    if (!overwrite) kc_ld4(y, i, n, a);
    kc_ld4(x, i, n, b);
    for (int k = 0; k < 4; k++) a[k] += round ? round_bf16(b[k]) : b[k]; /* 0 + −0 = +0 */
    kc_st4(y, i, n, a);
  }
}

// z = fp32(bf16(y + x)) (z may be y or x); with z16 also bf16(y + x) into z16 [n]
static __global__ void add_round_to_kernel(float *z, const float *y, const float *x,
                                           uint16_t *z16, int64_t n) {
  for (int64_t i = kc_gtid() * 4; i < n; i += kc_gstride() * 4) {
    float a[4], b[4];
    uint16_t h[4];
    kc_ld4(y, i, n, a);
    kc_ld4(x, i, n, b);
    for (int k = 0; k < 4; k++) {
      h[k] = kc_f32_to_bf16(a[k] + b[k]);
      a[k] = kc_bf16_to_f32(h[k]);
    }
    kc_st4(z, i, n, a);
    if (z16) kc_st4h(z16, i, n, h);
  }
}

// y = fp32(bf16(x)) (y may be x); with y16 also bf16(x) into y16 [n]
static __global__ void round_bf16_to_kernel(const float *x, float *y, uint16_t *y16,
                                            int64_t n) {
  for (int64_t i = kc_gtid() * 4; i < n; i += kc_gstride() * 4) {
    float v[4];
    uint16_t h[4];
    kc_ld4(x, i, n, v);
    for (int k = 0; k < 4; k++) {
      h[k] = kc_f32_to_bf16(v[k]);
      v[k] = kc_bf16_to_f32(h[k]);
    }
    kc_st4(y, i, n, v);
    if (y16) kc_st4h(y16, i, n, h);
  }
}

static __global__ void scale_kernel(float *x, int64_t n, float s) {
  for (int64_t i = kc_gtid() * 4; i < n; i += kc_gstride() * 4) {
    float v[4];
    kc_ld4(x, i, n, v);
    for (int k = 0; k < 4; k++) v[k] *= s;
    kc_st4(x, i, n, v);
  }
}

/* ---- gated MLP activation (glu.c's expressions, operation for operation) -- */

#define GELU_BETA 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_KAPPA 0.044715f

// silu(x) given e = expf(-x)
static __device__ __forceinline__ float silu(float x, float e) { return x / (1.0f + e); }

// silu'(x) given e = expf(-x)
static __device__ __forceinline__ float silu_grad(float x, float e) {
  float s = 1.0f / (1.0f + e);
  return s * (1.0f + x * (1.0f - s));
}

static __device__ __forceinline__ float gelu_tanh(float x) {
  float inner = GELU_BETA * (x + GELU_KAPPA * x * x * x);
  return 0.5f * x * (1.0f + tanhf(inner));
}

static __device__ __forceinline__ float gelu_tanh_grad(float x) {
  float th = tanhf(GELU_BETA * (x + GELU_KAPPA * x * x * x));
  float right = 0.5f * x * (1.0f - th * th) * GELU_BETA * (1.0f + 3.0f * GELU_KAPPA * x * x);
  return 0.5f * (1.0f + th) + right;
}

static __global__ void glu_fwd_kernel(const float *g, const float *u, float *h, int64_t n,
                                      ml_glu_act act) {
  for (int64_t i = kc_gtid() * 4; i < n; i += kc_gstride() * 4) {
    float gv[4], uv[4], hv[4];
    kc_ld4(g, i, n, gv);
    kc_ld4(u, i, n, uv);
    for (int k = 0; k < 4; k++)
      hv[k] = (act == ML_GLU_SILU ? silu(gv[k], expf(-gv[k])) : gelu_tanh(gv[k])) * uv[k];
    kc_st4(h, i, n, hv);
  }
}

static __global__ void glu_bwd_kernel(const float *dh, const float *g, const float *u, float *dg,
                                      float *du, int64_t n, ml_glu_act act) {
  for (int64_t i = kc_gtid() * 4; i < n; i += kc_gstride() * 4) {
    float dv[4], gv[4], uv[4], dgv[4], duv[4];
    kc_ld4(dh, i, n, dv);
    kc_ld4(g, i, n, gv);
    kc_ld4(u, i, n, uv);
    for (int k = 0; k < 4; k++) {
      float d = dv[k], gi = gv[k];
      if (act == ML_GLU_SILU) {
        float e = expf(-gi);
        dgv[k] = d * uv[k] * silu_grad(gi, e);
        duv[k] = d * silu(gi, e);
      } else {
        dgv[k] = d * uv[k] * gelu_tanh_grad(gi);
        duv[k] = d * gelu_tanh(gi);
      }
    }
    kc_st4(dg, i, n, dgv);
    kc_st4(du, i, n, duv);
  }
}

/* The bf16 variants (kernels/cpu/glu.c k_glu_fwd_bf16 / k_glu_bwd_bf16): g,
 * u bf16 widened exactly, the fp32 expressions above, h rounded to
 * nearest-even at the store (h_bf16) or fp32, and so dg, du (d_bf16). */
static __global__ void glu_fwd_bf16_kernel(const uint16_t *g, const uint16_t *u, void *h,
                                           bool h_bf16, int64_t n, ml_glu_act act) {
  for (int64_t i = kc_gtid() * 4; i < n; i += kc_gstride() * 4) {
    uint16_t gh[4], uh[4], hh[4];
    float hv[4];
    kc_ld4h(g, i, n, gh);
    kc_ld4h(u, i, n, uh);
    for (int k = 0; k < 4; k++) {
      float gv = kc_bf16_to_f32(gh[k]);
      hv[k] = (act == ML_GLU_SILU ? silu(gv, expf(-gv)) : gelu_tanh(gv)) * kc_bf16_to_f32(uh[k]);
      hh[k] = kc_f32_to_bf16(hv[k]);
    }
    if (h_bf16) kc_st4h((uint16_t *)h, i, n, hh);
    else kc_st4((float *)h, i, n, hv);
  }
}

static __global__ void glu_bwd_bf16_kernel(const float *dh, const uint16_t *g, const uint16_t *u,
                                           void *dg, void *du, bool d_bf16, int64_t n,
                                           ml_glu_act act) {
  for (int64_t i = kc_gtid() * 4; i < n; i += kc_gstride() * 4) {
    float dv[4], dgv[4], duv[4];
    uint16_t gh[4], uh[4], dgh[4], duh[4];
    kc_ld4(dh, i, n, dv);
    kc_ld4h(g, i, n, gh);
    kc_ld4h(u, i, n, uh);
    for (int k = 0; k < 4; k++) {
      float d = dv[k], gi = kc_bf16_to_f32(gh[k]), ui = kc_bf16_to_f32(uh[k]);
      if (act == ML_GLU_SILU) {
        float e = expf(-gi);
        dgv[k] = d * ui * silu_grad(gi, e);
        duv[k] = d * silu(gi, e);
      } else {
        dgv[k] = d * ui * gelu_tanh_grad(gi);
        duv[k] = d * gelu_tanh(gi);
      }
      dgh[k] = kc_f32_to_bf16(dgv[k]);
      duh[k] = kc_f32_to_bf16(duv[k]);
    }
    if (d_bf16) { /* gate_proj's and up_proj's bf16 dy, rounded once here */
      kc_st4h((uint16_t *)dg, i, n, dgh);
      kc_st4h((uint16_t *)du, i, n, duh);
    } else {
      kc_st4((float *)dg, i, n, dgv);
      kc_st4((float *)du, i, n, duv);
    }
  }
}

/* ---- launchers: one grid-stride launch each, KC_THREADS threads a block ---- */

static unsigned quad_grid(int64_t n) { return kc_grid((n + 3) / 4, KC_THREADS); }

// map_kernel<S, D, F> over n elements (none for n <= 0)
template <typename S, typename D, D (*F)(S)>
static cudaError_t launch_map(cudaStream_t st, const S *src, D *dst, int64_t n) {
  if (n <= 0) return cudaSuccess;
  return KC_LAUNCH((map_kernel<S, D, F>), quad_grid(n), KC_THREADS, 0, st, src, dst, n);
}

extern "C" cudaError_t kc_f32_to_bf16(cudaStream_t st, const float *src, uint16_t *dst,
                                      int64_t n) {
  return launch_map<float, uint16_t, kc_f32_to_bf16>(st, src, dst, n);
}

extern "C" cudaError_t kc_bf16_to_f32(cudaStream_t st, const uint16_t *src, float *dst,
                                      int64_t n) {
  return launch_map<uint16_t, float, kc_bf16_to_f32>(st, src, dst, n);
}

extern "C" cudaError_t kc_f32_to_f16(cudaStream_t st, const float *src, uint16_t *dst,
                                     int64_t n) {
  return launch_map<float, uint16_t, f32_to_f16>(st, src, dst, n);
}

extern "C" cudaError_t kc_f16_to_f32(cudaStream_t st, const uint16_t *src, float *dst,
                                     int64_t n) {
  return launch_map<uint16_t, float, f16_to_f32>(st, src, dst, n);
}

/* one grid-stride element of the n·width */
static __global__ void __launch_bounds__(KC_THREADS) scatter_rows(void *__restrict__ dst, bool bf16,
                                                                  const int32_t *__restrict__ rows,
                                                                  const float *__restrict__ src,
                                                                  int64_t n, int64_t width) {
  for (int64_t e = kc_gtid(); e < n * width; e += kc_gstride()) {
    const int64_t at = (int64_t)rows[e / width] * width + e % width;
    if (bf16)
      static_cast<uint16_t *>(dst)[at] = kc_f32_to_bf16(src[e]);
    else
      static_cast<float *>(dst)[at] = src[e];
  }
}

extern "C" cudaError_t kc_scatter_rows(cudaStream_t st, void *dst, bool bf16, const int32_t *rows,
                                       const float *src, int64_t n, int64_t width) {
  if (n <= 0) return cudaSuccess;
  if (n > INT32_MAX || width > INT32_MAX) return cudaErrorInvalidValue;
  return KC_LAUNCH(scatter_rows, kc_grid(n * width, KC_THREADS), KC_THREADS, 0, st, dst, bf16,
                   rows, src, n, width);
}

extern "C" cudaError_t kc_round_bf16(cudaStream_t st, float *x, int64_t n) {
  return launch_map<float, float, round_bf16>(st, x, x, n);
}

extern "C" cudaError_t kc_round_bf16_to(cudaStream_t st, const float *x, float *y, void *y16,
                                        int64_t n) {
  if (n <= 0) return cudaSuccess;
  return KC_LAUNCH(round_bf16_to_kernel, quad_grid(n), KC_THREADS, 0, st, x, y, (uint16_t *)y16,
                   n);
}

extern "C" cudaError_t kc_add(cudaStream_t st, float *y, const float *x, int64_t n) {
  if (n <= 0) return cudaSuccess;
  return KC_LAUNCH(add_kernel, quad_grid(n), KC_THREADS, 0, st, y, y, x, (uint16_t *)NULL, n);
}

extern "C" cudaError_t kc_add_bf16(cudaStream_t st, float *y, const float *x, void *y16,
                                   int64_t n) {
  if (n <= 0) return cudaSuccess;
  return KC_LAUNCH(add_kernel, quad_grid(n), KC_THREADS, 0, st, y, y, x, (uint16_t *)y16, n);
}

extern "C" cudaError_t kc_add_grad(cudaStream_t st, float *y, const float *x, int64_t n,
                                   bool overwrite, bool round) {
  if (n <= 0) return cudaSuccess;
  return KC_LAUNCH(add_grad_kernel, quad_grid(n), KC_THREADS, 0, st, y, x, n, overwrite, round);
}

extern "C" cudaError_t kc_add_to(cudaStream_t st, float *z, const float *y, const float *x,
                                 int64_t n) {
  if (n <= 0) return cudaSuccess;
  return KC_LAUNCH(add_kernel, quad_grid(n), KC_THREADS, 0, st, z, y, x, (uint16_t *)NULL, n);
}

extern "C" cudaError_t kc_add_round_to(cudaStream_t st, float *z, const float *y, const float *x,
                                       void *z16, int64_t n) {
  if (n <= 0) return cudaSuccess;
  return KC_LAUNCH(add_round_to_kernel, quad_grid(n), KC_THREADS, 0, st, z, y, x,
                   (uint16_t *)z16, n);
}

extern "C" cudaError_t kc_scale(cudaStream_t st, float *x, int64_t n, float s) {
  if (n <= 0) return cudaSuccess;
  return KC_LAUNCH(scale_kernel, quad_grid(n), KC_THREADS, 0, st, x, n, s);
}

extern "C" cudaError_t kc_glu_fwd(cudaStream_t st, const float *g, const float *u, float *h,
                                  int64_t n, ml_glu_act act) {
  if (n <= 0) return cudaSuccess;
  return KC_LAUNCH(glu_fwd_kernel, quad_grid(n), KC_THREADS, 0, st, g, u, h, n, act);
}

extern "C" cudaError_t kc_glu_bwd(cudaStream_t st, const float *dh, const float *g,
                                  const float *u, float *dg, float *du, int64_t n,
                                  ml_glu_act act) {
  if (n <= 0) return cudaSuccess;
  return KC_LAUNCH(glu_bwd_kernel, quad_grid(n), KC_THREADS, 0, st, dh, g, u, dg, du, n, act);
}

extern "C" cudaError_t kc_glu_fwd_bf16(cudaStream_t st, const void *g, const void *u, void *h,
                                       bool h_bf16, int64_t n, ml_glu_act act) {
  if (n <= 0) return cudaSuccess;
  return KC_LAUNCH(glu_fwd_bf16_kernel, quad_grid(n), KC_THREADS, 0, st, (const uint16_t *)g,
                   (const uint16_t *)u, h, h_bf16, n, act);
}

extern "C" cudaError_t kc_glu_bwd_bf16(cudaStream_t st, const float *dh, const void *g,
                                       const void *u, void *dg, void *du, bool d_bf16, int64_t n,
                                       ml_glu_act act) {
  if (n <= 0) return cudaSuccess;
  return KC_LAUNCH(glu_bwd_bf16_kernel, quad_grid(n), KC_THREADS, 0, st, dh, (const uint16_t *)g,
                   (const uint16_t *)u, dg, du, d_bf16, n, act);
}
