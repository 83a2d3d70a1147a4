/* Rotary position embedding applied in place (HF apply_rotary_pos_emb,
 * rotate_half convention), forward and backward, with the arithmetic of
 * kernels/cpu/rope.c's rope_rotate: x1·c − x2·(dir·s), x2·c + x1·(dir·s)
 * with dir = ±1. The cos/sin tables come from the host (k_rope_tables).
 *
 * One block per token row t (rows beyond the grid loop), position t % S;
 * its threads stride over (head, quad of the half) pairs, a quad being 4
 * consecutive i of x1 = x[t, h, i] and x2 = x[t, h, half + i] with the
 * matching cos/sin (vector accesses when aligned, common.cuh kc_ld4). The
 * bf16 variants store the same results rounded to nearest-even into a bf16
 * y instead of in place: the forward's bf16 q and k, the backward's
 * q_proj and k_proj bf16 dy. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

/* x: [B·S, nh, hd] rotated by +angle (dir = 1) or −angle (dir = −1): in place, or with y (the
 * same shape in bf16) into y rounded to nearest-even, x unchanged */
static __global__ void rope_kernel(float *x, uint16_t *y, const float *cos_t, const float *sin_t,
                                   int64_t BS, int64_t S, int64_t nh, int64_t hd, float dir) {
  int64_t half = hd / 2;
  unsigned quads = (unsigned)((half + 3) / 4), items = (unsigned)nh * quads; /* < 2^31 */
  for (int64_t t = blockIdx.x; t < BS; t += gridDim.x) {
    const float *c = cos_t + (t % S) * half, *s = sin_t + (t % S) * half;
    for (unsigned j = threadIdx.x; j < items; j += blockDim.x) {
      unsigned h = j / quads; /* 32-bit division: cheap beside a 64-bit one */
      int64_t i = (int64_t)(j - h * quads) * 4, o = (t * nh + h) * hd;
      float *x1 = x + o, *x2 = x1 + half;
      float a[4], b[4], cv[4], sv[4];
      kc_ld4(x1, i, half, a);
      kc_ld4(x2, i, half, b);
      kc_ld4(c, i, half, cv);
      kc_ld4(s, i, half, sv);
      for (int k = 0; k < 4; k++) {
        float ak = a[k], bk = b[k], si = dir * sv[k];
        a[k] = ak * cv[k] - bk * si;
        b[k] = bk * cv[k] + ak * si;
      }
      if (y) {
        uint16_t a16[4], b16[4];
        for (int k = 0; k < 4; k++) a16[k] = kc_f32_to_bf16(a[k]), b16[k] = kc_f32_to_bf16(b[k]);
        kc_st4h(y + o, i, half, a16);
        kc_st4h(y + o + half, i, half, b16);
      } else {
        kc_st4(x1, i, half, a);
        kc_st4(x2, i, half, b);
      }
    }
  }
}

static cudaError_t rope(cudaStream_t st, float *x, uint16_t *y, const float *cos_t,
                        const float *sin_t, int64_t B, int64_t S, int64_t nheads, int64_t hd,
                        float dir) {
  if (B <= 0 || S <= 0 || nheads <= 0 || hd < 2) return cudaSuccess;
  if (nheads * ((hd / 2 + 3) / 4) > INT32_MAX) return cudaErrorInvalidValue;
  return KC_LAUNCH(rope_kernel, kc_row_grid(B * S), KC_THREADS, 0, st, x, y, cos_t, sin_t, B * S,
                   S, nheads, hd, dir);
}

extern "C" cudaError_t kc_rope_fwd(cudaStream_t st, float *x, const float *cos_t,
                                   const float *sin_t, int64_t B, int64_t S, int64_t nheads,
                                   int64_t hd) {
  return rope(st, x, NULL, cos_t, sin_t, B, S, nheads, hd, 1.0f);
}

extern "C" cudaError_t kc_rope_fwd_bf16(cudaStream_t st, const float *x, uint16_t *y,
                                        const float *cos_t, const float *sin_t, int64_t B,
                                        int64_t S, int64_t nheads, int64_t hd) {
  /* x only read (rope_kernel stores into y) */
  return rope(st, (float *)x, y, cos_t, sin_t, B, S, nheads, hd, 1.0f);
}

extern "C" cudaError_t kc_rope_bwd(cudaStream_t st, float *dx, const float *cos_t,
                                   const float *sin_t, int64_t B, int64_t S, int64_t nheads,
                                   int64_t hd) {
  return rope(st, dx, NULL, cos_t, sin_t, B, S, nheads, hd, -1.0f);
}

extern "C" cudaError_t kc_rope_bwd_bf16(cudaStream_t st, const float *dx, void *y,
                                        const float *cos_t, const float *sin_t, int64_t B,
                                        int64_t S, int64_t nheads, int64_t hd) {
  /* dx only read (rope_kernel stores into y) */
  return rope(st, (float *)dx, (uint16_t *)y, cos_t, sin_t, B, S, nheads, hd, -1.0f);
}
