/* Gated MLP activation h = act(g)·u with act = SiLU or tanh-approximate GELU
 * (torch's formulas). SiLU takes its exponentials CHUNK at a time from
 * k_expf (vectorized, expf's values), then applies the same fp32
 * expressions elementwise. The bf16 variants (autocast's MLP: g, u the
 * bf16 outputs of gate_proj/up_proj) widen g, u a chunk at a time and run
 * the same fp32 expressions, the forward rounding h to nearest-even at the
 * store, the backward dg, du where gate_proj's and up_proj's bf16 GEMMs read
 * them: bitwise the fp32 kernels on the widened inputs, outputs then
 * converted. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/kernels.h"
#include "tensor/dtype.h"

static const float GELU_BETA = 0.7978845608028654f;  // sqrt(2/pi)
static const float GELU_KAPPA = 0.044715f;

enum { CHUNK = 512 };

// silu(x) given e = expf(-x)
static inline float silu(float x, float e) { return x / (1.0f + e); }

// silu'(x) given e = expf(-x)
static inline float silu_grad(float x, float e) {
  float s = 1.0f / (1.0f + e);
  return s * (1.0f + x * (1.0f - s));
}

// e[n] = expf(-g[n]), n <= CHUNK
static void exp_neg(const float *g, float *e, int64_t n) {
  for (int64_t i = 0; i < n; i++) e[i] = -g[i];
  k_expf(e, e, n);
}

static inline int64_t chunk_len(int64_t c0, int64_t n) { return n - c0 < CHUNK ? n - c0 : CHUNK; }

static inline float gelu_tanh(float x) {
  float inner = GELU_BETA * (x + GELU_KAPPA * x * x * x);
  return 0.5f * x * (1.0f + tanhf(inner));
}

static inline float gelu_tanh_grad(float x) {
  float th = tanhf(GELU_BETA * (x + GELU_KAPPA * x * x * x));
  float right = 0.5f * x * (1.0f - th * th) * GELU_BETA * (1.0f + 3.0f * GELU_KAPPA * x * x);
  return 0.5f * (1.0f + th) + right;
}

// g, u, h: [n]
void k_glu_fwd(const float *g, const float *u, float *h, int64_t n, ml_glu_act act) {
  if (act == ML_GLU_SILU) {
#pragma omp parallel for if (K_PAR(n / CHUNK, n))
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
      int64_t c = chunk_len(c0, n);
      float e[CHUNK];
      exp_neg(g + c0, e, c);
      for (int64_t i = 0; i < c; i++) h[c0 + i] = silu(g[c0 + i], e[i]) * u[c0 + i];
    }
  } else {
#pragma omp parallel for simd if (K_PAR(n, n))
    for (int64_t i = 0; i < n; i++) h[i] = gelu_tanh(g[i]) * u[i];
  }
}

// dg = dh·u·act'(g); du = dh·act(g); all [n]
void k_glu_bwd(const float *dh, const float *g, const float *u, float *dg, float *du, int64_t n,
               ml_glu_act act) {
  if (act == ML_GLU_SILU) {
#pragma omp parallel for if (K_PAR(n / CHUNK, n))
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
      int64_t c = chunk_len(c0, n);
      float e[CHUNK];
      exp_neg(g + c0, e, c);
      for (int64_t j = 0; j < c; j++) {
        int64_t i = c0 + j;
        float d = dh[i], gi = g[i];
        dg[i] = d * u[i] * silu_grad(gi, e[j]);
        du[i] = d * silu(gi, e[j]);
      }
    }
  } else {
#pragma omp parallel for simd if (K_PAR(n, n))
    for (int64_t i = 0; i < n; i++) {
      float d = dh[i], gi = g[i];
      dg[i] = d * u[i] * gelu_tanh_grad(gi);
      du[i] = d * gelu_tanh(gi);
    }
  }
}

/* x[0 .. c) = the bf16 values s[0 .. c) widened (exactly) */
static inline void widen(const uint16_t *s, float *x, int64_t c) {
  for (int64_t i = 0; i < c; i++) x[i] = ml_bf16_to_f32(s[i]);
}

// g, u: [n] bf16; h: [n] bf16 (h_bf16) or fp32
void k_glu_fwd_bf16(const uint16_t *g, const uint16_t *u, void *h, bool h_bf16, int64_t n,
                    ml_glu_act act) {
#pragma omp parallel for if (K_PAR(n / CHUNK, n))
  for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
    int64_t c = chunk_len(c0, n);
    float gf[CHUNK], uf[CHUNK], hf[CHUNK];
    widen(g + c0, gf, c);
    widen(u + c0, uf, c);
    if (act == ML_GLU_SILU) {
      float e[CHUNK];
      exp_neg(gf, e, c);
      for (int64_t i = 0; i < c; i++) hf[i] = silu(gf[i], e[i]) * uf[i];
    } else {
      for (int64_t i = 0; i < c; i++) hf[i] = gelu_tanh(gf[i]) * uf[i];
    }
    if (h_bf16)
      for (int64_t i = 0; i < c; i++) ((uint16_t *)h)[c0 + i] = ml_f32_to_bf16(hf[i]);
    else
      memcpy((float *)h + c0, hf, sizeof(float) * (size_t)c);
  }
}

// dh: [n] fp32; g, u: [n] bf16; dg, du: [n] bf16 (d_bf16) or fp32
void k_glu_bwd_bf16(const float *dh, const uint16_t *g, const uint16_t *u, void *dg, void *du,
                    bool d_bf16, int64_t n, ml_glu_act act) {
#pragma omp parallel for if (K_PAR(n / CHUNK, n))
  for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
    int64_t c = chunk_len(c0, n);
    float gf[CHUNK], uf[CHUNK], e[CHUNK], dgf[CHUNK], duf[CHUNK];
    widen(g + c0, gf, c);
    widen(u + c0, uf, c);
    if (act == ML_GLU_SILU) exp_neg(gf, e, c);
    for (int64_t j = 0; j < c; j++) {
      float d = dh[c0 + j], gi = gf[j];
      if (act == ML_GLU_SILU) {
        dgf[j] = d * uf[j] * silu_grad(gi, e[j]);
        duf[j] = d * silu(gi, e[j]);
      } else {
        dgf[j] = d * uf[j] * gelu_tanh_grad(gi);
        duf[j] = d * gelu_tanh(gi);
      }
    }
    if (d_bf16) { /* the dy of gate_proj's and up_proj's bf16 GEMMs, rounded once here */
      for (int64_t j = 0; j < c; j++) {
        ((uint16_t *)dg)[c0 + j] = ml_f32_to_bf16(dgf[j]);
        ((uint16_t *)du)[c0 + j] = ml_f32_to_bf16(duf[j]);
      }
    } else {
      memcpy((float *)dg + c0, dgf, sizeof(float) * (size_t)c);
      memcpy((float *)du + c0, duf, sizeof(float) * (size_t)c);
    }
  }
}
