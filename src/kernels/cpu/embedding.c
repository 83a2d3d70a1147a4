/* Vocab-parallel embedding lookup: rows outside this rank's range give 0. */
#include <string.h>

#include "kernels/cpu/kernels.h"
#include "tensor/dtype.h"


static inline int in_range(int32_t id, int64_t row0, int64_t rows) {
  return id >= row0 && id < row0 + rows;
}

// out: [T, H] = scale · W: [rows, H] at ids[t] − row0, or 0 when out of range;
// W fp32, or bf16 (widened exactly) when w_bf16
void k_embedding_fwd(const int32_t *ids, int64_t T, const void *W, int w_bf16, int64_t row0,
                     int64_t rows, int64_t H, float scale, float *out) {
#pragma omp parallel for if (K_PAR(T, T * H))
  for (int64_t t = 0; t < T; t++) {
    float *o = out + t * H;
    if (!in_range(ids[t], row0, rows)) {
      memset(o, 0, (size_t)H * sizeof(float));
      continue;
    }
    int64_t r = (ids[t] - row0) * H;
    if (w_bf16) {
      const uint16_t *wr = (const uint16_t *)W + r;
      for (int64_t h = 0; h < H; h++) o[h] = scale * ml_bf16_to_f32(wr[h]);
    } else {
      const float *wr = (const float *)W + r;
      for (int64_t h = 0; h < H; h++) o[h] = scale * wr[h];
    }
  }
}

// dW: [rows, H] += scale · dout: [T, H]; threads own disjoint column runs so
// repeated ids never race
void k_embedding_bwd(const int32_t *ids, int64_t T, const float *dout, int64_t row0, int64_t rows,
                     int64_t H, float scale, float *dW) {
  int64_t width = k_col_width(H);
#pragma omp parallel for if (K_PAR((H + width - 1) / width, T * H))
  for (int64_t c0 = 0; c0 < H; c0 += width) {
    int64_t n = H - c0 < width ? H - c0 : width;
    for (int64_t t = 0; t < T; t++) {
      if (!in_range(ids[t], row0, rows)) continue;
      float *wr = dW + (ids[t] - row0) * H + c0;
      const float *d = dout + t * H + c0;
      for (int64_t j = 0; j < n; j++) wr[j] += scale * d[j];
    }
  }
}
