/* Rotary position embedding applied in place (HF apply_rotary_pos_emb,
 * rotate_half convention), forward and backward, with the arithmetic of
 * kernels/cpu/rope.c's rope_rotate: x1·c − x2·(dir·s), x2·c + x1·(dir·s)
 * with dir = ±1. The cos/sin tables come from the host (k_rope_tables).
 *
 * One block per token row t (rows beyond the grid loop), position t % S;
 * its threads stride over (head, quad of the half) pairs, a quad being 4
 * consecutive i of x1 = x[t, h, i] and x2 = x[t, h, half + i] with the
 * matching cos/sin (vector accesses when aligned, common.cuh kc_ld4). */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

// x: [B·S, nh, hd] rotated in place by +angle (dir = 1) or −angle (dir = −1), or, y set,
// the rotation rounded to bf16 into y [B·S, nh, hd] (x untouched)
static __global__ void rope_kernel(float *x, uint16_t *y, const float *cos_t, const float *sin_t,
                                   int64_t BS, int64_t S, int64_t nh, int64_t hd, float dir) {
  int64_t half = hd / 2;
  unsigned quads = (unsigned)((half + 3) / 4), items = (unsigned)nh * quads; /* < 2^31 */
  for (int64_t t = blockIdx.x; t < BS; t += gridDim.x) {
    const float *c = cos_t + (t % S) * half, *s = sin_t + (t % S) * half;
    for (unsigned j = threadIdx.x; j < items; j += blockDim.x) {
      unsigned h = j / quads; /* 32-bit division: cheap beside a 64-bit one */
      int64_t i = (int64_t)(j - h * quads) * 4;
      float *x1 = x + (t * nh + h) * hd, *x2 = x1 + half;
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
      if (y) { /* the same values rounded as kc_f32_to_bf16 rounds */
        uint16_t *y1 = y + (t * nh + h) * hd, *y2 = y1 + half;
        for (int k = 0; k < 4 && i + k < half; k++) {
          y1[i + k] = kc_f32_to_bf16(a[k]);
          y2[i + k] = kc_f32_to_bf16(b[k]);
        }
        continue;
      }
      kc_st4(x1, i, half, a);
      kc_st4(x2, i, half, b);
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
  return rope(st, x, nullptr, cos_t, sin_t, B, S, nheads, hd, 1.0f);
}

extern "C" cudaError_t kc_rope_fwd_bf16(cudaStream_t st, const float *x, uint16_t *y,
                                        const float *cos_t, const float *sin_t, int64_t B,
                                        int64_t S, int64_t nheads, int64_t hd) {
  return rope(st, const_cast<float *>(x), y, cos_t, sin_t, B, S, nheads, hd, 1.0f);
}

extern "C" cudaError_t kc_rope_bwd(cudaStream_t st, float *dx, const float *cos_t,
                                   const float *sin_t, int64_t B, int64_t S, int64_t nheads,
                                   int64_t hd) {
  return rope(st, dx, nullptr, cos_t, sin_t, B, S, nheads, hd, -1.0f);
}
