/* The per-step scalars of one AdamW step (torch.optim.AdamW, single-tensor
 * path), shared by the CPU and CUDA kernels so both round them alike: the
 * bias corrections 1 − β^step in fp64, every factor rounded once to fp32. */
#ifndef ML_KERNELS_ADAMW_SCALARS_H
#define ML_KERNELS_ADAMW_SCALARS_H

#include <math.h>
#include <stdint.h>

typedef struct ml_adamw_scalars {
  float decay;    /* 1 − lr·weight_decay (decoupled decay: p *= decay) */
  float w1, w2;   /* 1 − β1, 1 − β2 */
  float neg_step; /* −lr / (1 − β1^step) */
  float bc2_sqrt; /* sqrt(1 − β2^step) */
  float eps;
} ml_adamw_scalars;

static inline ml_adamw_scalars ml_adamw_scalars_of(double lr, double b1, double b2, double eps,
                                                   double wd, int64_t step) {
  double bc1 = 1.0 - pow(b1, (double)step), bc2 = 1.0 - pow(b2, (double)step);
  ml_adamw_scalars s = {(float)(1.0 - lr * wd), (float)(1.0 - b1), (float)(1.0 - b2),
                        (float)(-lr / bc1), (float)sqrt(bc2), (float)eps};
  return s;
}

#endif
