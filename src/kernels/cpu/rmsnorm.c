/* RMSNorm (HF LlamaRMSNorm / Gemma3RMSNorm): y = x·rstd·(w_offset + w).
 * Row sums in double, in SIMD lanes; the forward writes y in fp32 or, fused,
 * rounded to bf16 (the saved bf16 input of the linears that read it). */
#include <math.h>

#include "kernels/cpu/kernels.h"
#include "tensor/dtype.h"

enum { LANES = 8 };

// x: [T, H]; w: [H]; rstd: [T]; y [T, H] fp32, or with y16 [T, H] bf16 the same value rounded
// to nearest-even (ml_f32_to_bf16) instead
static void rmsnorm_fwd(const float *x, const float *w, float w_offset, float eps, float *y,
                        uint16_t *y16, float *rstd, int64_t T, int64_t H) {
#pragma omp parallel for if (K_PAR(T, T * H))
  for (int64_t t = 0; t < T; t++) {
    const float *xr = x + t * H;
    double ss = k_dot_f64(xr, xr, H);
    float r = 1.0f / sqrtf((float)(ss / (double)H) + eps);
    rstd[t] = r;
    if (y16) {
      uint16_t *yr = y16 + t * H;
      for (int64_t h = 0; h < H; h++) yr[h] = ml_f32_to_bf16((xr[h] * r) * (w_offset + w[h]));
    } else {
      float *yr = y + t * H;
      for (int64_t h = 0; h < H; h++) yr[h] = (xr[h] * r) * (w_offset + w[h]);
    }
  }
}

void k_rmsnorm_fwd(const float *x, const float *w, float w_offset, float eps, float *y, float *rstd,
                   int64_t T, int64_t H) {
  rmsnorm_fwd(x, w, w_offset, eps, y, NULL, rstd, T, H);
}

void k_rmsnorm_fwd_bf16(const float *x, const float *w, float w_offset, float eps, uint16_t *y,
                        float *rstd, int64_t T, int64_t H) {
  rmsnorm_fwd(x, w, w_offset, eps, NULL, y, rstd, T, H);
}

// dw: [H] += sum_t dy[t]·x[t]·rstd[t]; threads own disjoint column runs
static void rmsnorm_dw(const float *dy, const float *x, const float *rstd, float *dw, int64_t T,
                       int64_t H) {
  int64_t width = k_col_width(H);
#pragma omp parallel for if (K_PAR((H + width - 1) / width, T * H))
  for (int64_t c0 = 0; c0 < H; c0 += width) {
    int64_t n = H - c0 < width ? H - c0 : width;
    double acc[K_COL_MAX] = {0};
    for (int64_t t = 0; t < T; t++) {
      const float *dr = dy + t * H + c0, *xr = x + t * H + c0;
      for (int64_t j = 0; j < n; j++) acc[j] += (double)dr[j] * xr[j] * rstd[t];
    }
    for (int64_t j = 0; j < n; j++) dw[c0 + j] += (float)acc[j];
  }
}

// dx[t,h] = rstd·we[h]·dy[t,h] − x[t,h]·rstd³/H · sum_k dy[t,k]·we[k]·x[t,k]
void k_rmsnorm_bwd(const float *dy, const float *x, const float *w, float w_offset,
                   const float *rstd, float *dx, float *dw, int64_t T, int64_t H) {
  if (dw) rmsnorm_dw(dy, x, rstd, dw, T, H);  // before dx, which may overwrite dy
#pragma omp parallel for if (K_PAR(T, T * H))
  for (int64_t t = 0; t < T; t++) {
    const float *dr = dy + t * H, *xr = x + t * H;
    double acc[LANES] = {0}, dot = 0.0; /* LANES partial sums (R2: any order) */
    int64_t h = 0;
    for (; h + LANES <= H; h += LANES)
      for (int k = 0; k < LANES; k++)
        acc[k] += (double)dr[h + k] * (w_offset + w[h + k]) * xr[h + k];
    for (; h < H; h++) acc[0] += (double)dr[h] * (w_offset + w[h]) * xr[h];
    for (int k = 0; k < LANES; k++) dot += acc[k];
    float r = rstd[t];
    float c = (float)(dot * r * r * r / (double)H);
    float *dxr = dx + t * H;
    for (int64_t h = 0; h < H; h++) dxr[h] = r * (w_offset + w[h]) * dr[h] - xr[h] * c;
  }
}
