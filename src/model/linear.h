/* nn.Linear as a module with edge hooks (used by model/ only). */
#ifndef ML_LINEAR_H
#define ML_LINEAR_H

#include "model/model.h"

static inline int ml_hook_run(ml_hook h, ml_act *a) { return h.fn ? h.fn(h.ctx, a) : 0; }

/* The view of buffer x as [B, s, c] of a global [B, S, C] activation. */
static inline ml_act ml_act_view(const ml_model *m, float *x, int64_t s, int64_t C, int64_t c) {
  return (ml_act){x, m->B, m->S, s, C, c};
}

/* A linear's input [B, s, c] rounded once for the bf16 GEMMs of the linears
 * that read it (q/k/v, gate/up share their input; a backward's dx and dW
 * GEMMs share dy): p points at bf16 (uint16_t) elements, or with f32 at
 * fp32 ones holding bf16 values (fp32(bf16(v)) == v), which the GEMMs read
 * flagged exact (ml_gemm.a_exact / b_exact). fp32 storage where the
 * backend reads such operands in place (ml_be_gemm_exact_in_place: the
 * CPU's emulation without a bf16 matmul), so that no GEMM widens a bf16
 * copy again; bf16 storage elsewhere (the one copy a bf16 matmul reads).
 * owned: pool memory of p that ml_linear_operand_free releases, or NULL
 * (p is a saved activation). A zeroed ml_xr (p NULL): none, the GEMMs
 * round the fp32 input themselves. */
typedef struct ml_xr {
  const void *p;
  bool f32;
  void *owned;
} ml_xr;

/* *xr: x [B, s, c] rounded once when lin's weight is bf16 (their GEMMs
 * then round it anyway) into pool memory (ml_xr: fp32 holding bf16 values
 * where the backend reads them in place, else bf16); zeroed with fp32
 * weights. The caller releases it with ml_linear_operand_free. */
int ml_linear_round_input(ml_backend *be, const ml_linear *lin, const ml_act *x, ml_xr *xr);
/* *xr for a bf16 x16 [rows, c] (uint16_t) that several bf16 GEMMs read (a
 * saved bf16 activation, a bf16 output gradient): where the backend reads
 * exact fp32 in place (ml_be_gemm_exact_in_place) widened once into fp32
 * pool memory (owned), exactly — each GEMM would widen it again otherwise;
 * elsewhere x16 itself (nothing owned). Bitwise the same GEMM results
 * either way (widening bf16 is exact). Released by ml_linear_operand_free. */
int ml_linear_operand_bf16(ml_backend *be, const void *x16, int64_t rows, int64_t c, ml_xr *xr);
/* Frees xr's owned pool memory (none: nothing) and zeroes it. */
void ml_linear_operand_free(ml_backend *be, ml_xr *xr);
/* y = x · W^T (+ b) on backend `be` (its GEMM computes in the weight's
 * dtype: fp32, or bf16 operands with fp32 accumulation) on the view x
 * [B, s, in_local] into ybuf; the output edge runs; *y is the resulting
 * view. xr: x rounded once (ml_linear_round_input, ml_linear_operand_bf16),
 * or NULL or zeroed (the GEMM rounds x itself). The input edge is the
 * caller's (siblings share it). With lin->whole set (model.h
 * ml_whole_hook) the GEMM runs on the gathered whole input and weight
 * instead, K = the weight's global in-features,
 * the bias on every rank, xr unused, and *y is [B, s, out] whole. Errors:
 * x->c ≠ the weight's local in-features (the plan's layouts do not
 * compose; the message names the module). */
int ml_linear_forward(ml_backend *be, const ml_linear *lin, const ml_act *x, const ml_xr *xr,
                      float *ybuf, ml_act *y);
/* The same with y in bf16 (ybuf [B, s, out_local] uint16_t; *y's x points
 * at it): the fp32 accumulator (+ bias) rounded once to nearest-even by the
 * GEMM (ml_gemm.c_bf16), bitwise ml_linear_forward's output rounded after
 * it — a linear's bf16 output under torch.autocast(bfloat16). With a LoRA
 * adapter its term is added to the fp32 output in a pool temporary and the
 * sum rounded once (PEFT under autocast rounds the base output, the
 * adapter's and their sum; one rounding here keeps lora_B = 0 bitwise the
 * base linear). Errors (the message names the weight): a weight not bf16,
 * a whole hook or an output edge hook (it reads fp32), which this path
 * does not serve. */
int ml_linear_forward_bf16(ml_backend *be, const ml_linear *lin, const ml_act *x,
                           const ml_xr *xr, void *ybuf, ml_act *y);
/* Backward: the output edge's backward runs on dy (in place; then
 * [B, x->s, out_local]); dx [B, x->s, in_local] (= or += when accumulate;
 * NULL to skip) and weight/bias grads (+=); xr as forward. With a bf16
 * weight dy is rounded once for both GEMMs. */
int ml_linear_backward(ml_backend *be, const ml_linear *lin, ml_act *dy, const ml_act *x,
                       const ml_xr *xr, float *dx, int accumulate);
/* Whether lin's backward, under bf16 weights, reads its output gradient
 * only as the bf16 operand of its two GEMMs, so that the kernel producing
 * dy may write it in bf16 once (ml_linear_backward_bf16): its weight is not
 * kept in fp32 (ml_param.fp32), and it has no LoRA adapter (lora_B's and
 * lora_A's gradients read the fp32 dy), no bias (its gradient sums the fp32
 * dy) and no output edge backward (a tp collective on the fp32 dy). The
 * single source of this rule for the model's choices (model.h
 * ml_model_bf16_glu_grads, ml_model_bf16_rope_grads). */
bool ml_linear_dy_bf16(const ml_linear *lin);
/* ml_linear_backward on a dy [B, x->s, out_local] already in bf16 (dy->x
 * points at uint16_t: the fp32 gradient rounded to nearest-even by its
 * producer, as ml_linear_backward rounds it): the dx and dW GEMMs read it as
 * is (both widen it: where the backend reads exact fp32 in place, once,
 * ml_linear_operand_bf16); bitwise ml_linear_backward on the fp32 dy (autocast's
 * linear backward, its bf16 grad_output). Errors (naming the weight): a
 * weight not bf16 or a linear that fails ml_linear_dy_bf16; dy not [B,
 * x->s, out_local]. */
int ml_linear_backward_bf16(ml_backend *be, const ml_linear *lin, const ml_act *dy,
                            const ml_act *x, const ml_xr *xr, float *dx, int accumulate);

#endif
