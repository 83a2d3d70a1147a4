#include "model/linear.h"

#include "common/status.h"
#include "kernels/cpu/kernels.h"

int ml_linear_forward(const ml_linear *lin, const ml_act *x, float *ybuf, ml_act *y) {
  const ml_param *w = lin->weight;
  if (x->c != w->local[1])
    return ml_err("%s: the input has %lld features but this rank's weight expects %lld; the "
                  "plan's layouts do not compose here",
                  w->name, (long long)x->c, (long long)w->local[1]);
  const float *b = lin->bias && lin->bias_in_forward ? lin->bias->data : NULL;
  k_linear_fwd(x->x, w->data, b, ybuf, x->B * x->s, w->local[1], w->local[0]);
  *y = (ml_act){ybuf, x->B, x->S, x->s, w->shape[0], w->local[0]};
  return ml_hook_run(lin->out.fwd, y);
}

int ml_linear_backward(const ml_linear *lin, ml_act *dy, const ml_act *x, float *dx,
                       int accumulate) {
  const ml_param *w = lin->weight;
  ML_TRY(ml_hook_run(lin->out.bwd, dy));
  if (dy->s != x->s || dy->c != w->local[0])
    return ml_err("%s: the output gradient is [%lld positions, %lld features] after its edge; "
                  "expected [%lld, %lld]",
                  w->name, (long long)dy->s, (long long)dy->c, (long long)x->s,
                  (long long)w->local[0]);
  k_linear_bwd(dy->x, x->x, w->data, dx, accumulate, w->grad, lin->bias ? lin->bias->grad : NULL,
               x->B * x->s, w->local[1], w->local[0]);
  return 0;
}
