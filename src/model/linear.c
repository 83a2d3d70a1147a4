/* Linear layers as GEMMs on the backend (torch.nn.functional.linear and its
 * autograd): y = x·W^T + b, dx = dy·W, dW += dy^T·x, db += Σ_t dy. The GEMMs
 * compute in the weight's dtype: fp32 weights, fp32 GEMMs; bf16 weights
 * (FSDP's param_dtype), bf16 operands with fp32 accumulation and fp32
 * output, as autocast(bfloat16) runs a linear and its backward. */
#include "model/linear.h"

#include "common/status.h"

int ml_linear_forward(ml_backend *be, const ml_linear *lin, const ml_act *x, float *ybuf,
                      ml_act *y) {
  const ml_param *w = lin->weight;
  if (x->c != w->local[1])
    return ml_err("%s: the input has %lld features but this rank's weight expects %lld; the "
                  "plan's layouts do not compose here",
                  w->name, (long long)x->c, (long long)w->local[1]);
  const ml_param *b = lin->bias && lin->bias_in_forward ? lin->bias : NULL;
  int64_t T = x->B * x->s, in = w->local[1], out = w->local[0];
  // y: [T, out] = x: [T, in] · W: [out, in]^T (+ b)
  ml_gemm g = {.trans_b = true, .M = T, .N = out, .K = in,
               .A = x->x, .a_type = ML_F32, .lda = in,
               .B = w->data, .b_type = w->dtype, .ldb = in,
               .C = ybuf, .ldc = out,
               .bias = b ? b->data : NULL, .bias_type = b ? b->dtype : ML_F32,
               .compute = w->dtype};
  ML_TRY(ml_be_gemm(be, &g));
  *y = (ml_act){ybuf, x->B, x->S, x->s, w->shape[0], w->local[0]};
  return ml_hook_run(lin->out.fwd, y);
}

int ml_linear_backward(ml_backend *be, const ml_linear *lin, ml_act *dy, const ml_act *x,
                       float *dx, int accumulate) {
  const ml_param *w = lin->weight;
  ML_TRY(ml_hook_run(lin->out.bwd, dy));
  if (dy->s != x->s || dy->c != w->local[0])
    return ml_err("%s: the output gradient is [%lld positions, %lld features] after its edge; "
                  "expected [%lld, %lld]",
                  w->name, (long long)dy->s, (long long)dy->c, (long long)x->s,
                  (long long)w->local[0]);
  int64_t T = x->B * x->s, in = w->local[1], out = w->local[0];
  if (dx) { // dx: [T, in] (= or +=) dy: [T, out] · W: [out, in]
    ml_gemm g = {.M = T, .N = in, .K = out, .A = dy->x, .a_type = ML_F32, .lda = out,
                 .B = w->data, .b_type = w->dtype, .ldb = in, .C = dx, .ldc = in,
                 .accumulate = accumulate, .compute = w->dtype};
    ML_TRY(ml_be_gemm(be, &g));
  }
  // dW: [out, in] += dy^T: [out, T] · x: [T, in]
  ml_gemm gw = {.trans_a = true, .M = out, .N = in, .K = T, .A = dy->x, .a_type = ML_F32,
                .lda = out, .B = x->x, .b_type = ML_F32, .ldb = in, .C = w->grad, .ldc = in,
                .accumulate = true, .compute = w->dtype};
  ML_TRY(ml_be_gemm(be, &gw));
  if (lin->bias) ML_TRY(ml_be_bias_grad(be, dy->x, T, out, lin->bias->grad));
  return 0;
}
