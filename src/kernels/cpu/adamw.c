/* AdamW update, torch.optim.AdamW single-tensor path (foreach=False). */
#include <math.h>

#include "kernels/adamw_scalars.h"
#include "kernels/cpu/kernels.h"
#include "tensor/dtype.h"

// One element's update with gradient gi; scalars derived in double as Python does, applied in fp32
static inline void adamw_elem(float *p, float *m, float *v, float gi, const ml_adamw_scalars *c,
                              double b2) {
  *p *= c->decay;
  *m += c->w1 * (gi - *m);  // exp_avg.lerp_(grad, 1 - b1)
  *v = *v * b2 + c->w2 * gi * gi;
  float denom = sqrtf(*v) / c->bc2_sqrt + c->eps;
  *p += c->neg_step * *m / denom;
}

// The pass over [n], specialised by its callers on the constants scaled (clipping: g *= grad_scale
// first, k_scale's product rounded and stored, never fused into the update's arithmetic) and
// p_bf16 != NULL (the updated weight's bf16 rounding, ml_f32_to_bf16, stored in the same loop)
static inline __attribute__((always_inline)) void
adamw_pass(float *p, float *g, float *m, float *v, uint16_t *p_bf16, int64_t n, float grad_scale,
           bool scaled, const ml_adamw_scalars *c, double b2) {
#pragma omp parallel for simd
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i];
    if (scaled) {
      gi = g[i] * grad_scale;
      g[i] = gi;
    }
    adamw_elem(&p[i], &m[i], &v[i], gi, c, b2);
    if (p_bf16) p_bf16[i] = ml_f32_to_bf16(p[i]);
  }
}

// p, g, m, v: [n]; p_bf16: [n] or NULL
void k_adamw_step(float *p, float *g, float *m, float *v, uint16_t *p_bf16, int64_t n,
                  float grad_scale, double lr, double b1, double b2, double eps, double wd,
                  int64_t step) {
  ml_adamw_scalars c = ml_adamw_scalars_of(lr, b1, b2, eps, wd, step);
  bool scaled = grad_scale != 1.0f;
  if (scaled && p_bf16) adamw_pass(p, g, m, v, p_bf16, n, grad_scale, true, &c, b2);
  else if (scaled) adamw_pass(p, g, m, v, NULL, n, grad_scale, true, &c, b2);
  else if (p_bf16) adamw_pass(p, g, m, v, p_bf16, n, grad_scale, false, &c, b2);
  else adamw_pass(p, g, m, v, NULL, n, grad_scale, false, &c, b2);
}
