/* Linear layers as GEMMs on the backend (torch.nn.functional.linear and its
 * autograd): y = x·W^T + b, dx = dy·W, dW += dy^T·x, db += Σ_t dy. The GEMMs
 * compute in the weight's dtype: fp32 weights, fp32 GEMMs; bf16 weights
 * (FSDP's param_dtype), bf16 operands with fp32 accumulation and fp32
 * output, as autocast(bfloat16) runs a linear and its backward, or the
 * output rounded to bf16 by the GEMM itself (ml_linear_forward_bf16:
 * autocast's bf16 output, where the caller keeps it so). Each
 * fp32 activation is rounded once however many GEMMs read it: dy for dx
 * and dW here (into bf16, or where the backend reads exact fp32 operands in
 * place, ml_be_gemm_exact_in_place, into fp32 flagged exact), a shared input
 * by the caller (ml_linear_round_input); and where the backend reads them so,
 * each bf16 one is widened once however many GEMMs read it
 * (ml_linear_operand_bf16: a saved bf16 input, a bf16 dy), not per GEMM. A
 * frozen weight or bias (grad NULL, requires_grad=False) gets no gradient:
 * its GEMM is skipped, dx still flows. A LoRA adapter (model/lora.h) adds
 * its low-rank path before the output edge, so a row-parallel linear's
 * Partial output carries both into the one reduction; with LoRA dropout
 * (model/lora_drop.h) that path reads the dropped input. A linear with a
 * whole hook (ml_linear.whole: a row-parallel linear in the batch-invariant
 * mode under tp) computes its forward on the gathered input and weight (and
 * its adapter's lora_A and input), as one rank; its backward stays local. */
#include "model/linear.h"

#include "common/checked.h"
#include "common/status.h"
#include "model/lora_drop.h"
#include "tensor/dtype.h"

/* x [rows, c] of a view as bf16 in pool memory (*xr). */
static int round_rows(ml_backend *be, const float *x, int64_t rows, int64_t c, void **xr) {
  *xr = ml_be_alloc(be, rows * c, sizeof(uint16_t), "a bf16 GEMM operand [%lld x %lld]",
                    (long long)rows, (long long)c);
  if (!*xr) return -1;
  if (ml_be_convert(be, *xr, ML_BF16, x, ML_F32, (size_t)(rows * c))) {
    ml_be_free(be, *xr);
    *xr = NULL;
    return -1;
  }
  return 0;
}

/* x [rows, c] rounded to bf16 values in fp32 pool memory (*xr): an operand flagged exact
 * (ml_gemm.a_exact). */
static int round_rows_f32(ml_backend *be, const float *x, int64_t rows, int64_t c, void **xr) {
  *xr = ml_be_alloc(be, rows * c, sizeof(float), "a bf16 GEMM operand in fp32 [%lld x %lld]",
                    (long long)rows, (long long)c);
  if (!*xr) return -1;
  if (ml_be_round_bf16_to(be, x, *xr, NULL, (size_t)(rows * c))) {
    ml_be_free(be, *xr);
    *xr = NULL;
    return -1;
  }
  return 0;
}

int ml_linear_round_input(ml_backend *be, const ml_linear *lin, const ml_act *x, ml_xr *xr) {
  *xr = (ml_xr){0};
  if (lin->weight->dtype != ML_BF16) return 0;
  void *r;
  xr->f32 = ml_be_gemm_exact_in_place(be);
  ML_TRY((xr->f32 ? round_rows_f32 : round_rows)(be, x->x, x->B * x->s, x->c, &r));
  xr->p = xr->owned = r;
  return 0;
}

int ml_linear_operand_bf16(ml_backend *be, const void *x16, int64_t rows, int64_t c, ml_xr *xr) {
  *xr = (ml_xr){.p = x16};
  if (!ml_be_gemm_exact_in_place(be)) return 0;
  float *w = ml_be_alloc(be, ml_mul_sat(rows, c), sizeof(float),
                         "a bf16 GEMM operand widened to fp32 [%lld x %lld]", (long long)rows,
                         (long long)c);
  if (!w) return -1;
  if (ml_be_convert(be, w, ML_F32, x16, ML_BF16, (size_t)(rows * c))) {
    ml_be_free(be, w);
    return -1;
  }
  *xr = (ml_xr){.p = w, .f32 = true, .owned = w};
  return 0;
}

void ml_linear_operand_free(ml_backend *be, ml_xr *xr) {
  ml_be_free(be, xr->owned);
  *xr = (ml_xr){0};
}

/* xr as an operand: none (NULL or zeroed) when the caller gave no rounded copy. */
static ml_xr operand_of(const ml_xr *xr) { return xr ? *xr : (ml_xr){0}; }
/* A GEMM operand read from xr where it holds one, else the fp32 x; its dtype (fp32 where xr
 * holds fp32 bf16 values, which the GEMM reads flagged exact: xr.f32). */
static const void *operand_ptr(ml_xr xr, const float *x) {
  return xr.p ? xr.p : (const void *)x;
}
static ml_dtype operand_type(ml_xr xr) { return xr.p && !xr.f32 ? ML_BF16 : ML_F32; }

/* The input of lora_A: x itself (xin = x->x, its bf16 copy xr), or under
 * LoRA dropout x ⊙ mask/(1 − p) into *xd [T, in] (device; with bf16
 * weights rounded once into *xdr), the caller freeing both. */
static int lora_input(ml_backend *be, const ml_linear *lin, const ml_act *x, ml_xr xr,
                      float **xd, void **xdr, const float **xin, ml_xr *xinr) {
  *xd = NULL;
  *xdr = NULL;
  *xin = x->x;
  *xinr = xr;
  if (!ml_lora_drop_active(lin)) return 0;
  int64_t T = x->B * x->s;
  *xd = ml_be_alloc(be, T * x->c, sizeof(float), "%s's dropped input [%lld x %lld]",
                    lin->lora_a->name, (long long)T, (long long)x->c);
  if (!*xd) return -1;
  ML_TRY(ml_lora_drop_apply(be, lin, x, x->x, *xd));
  if (lin->weight->dtype == ML_BF16) ML_TRY(round_rows(be, *xd, T, x->c, xdr));
  *xin = *xd;
  *xinr = (ml_xr){.p = *xdr};
  return 0;
}

/* u [T, r] (=) xin [T, in] · A [r, in]^T, in lora_A a's dtype: A its local data (in =
 * a->local[1]) or its whole columns (in = a->shape[1]); xr: xin rounded once, or none. */
static int lora_down(ml_backend *be, const ml_param *a, const void *A, int64_t in, int64_t T,
                     const float *xin, ml_xr xr, float *u) {
  ml_gemm g = {.trans_b = true, .M = T, .N = a->local[0], .K = in,
               .A = operand_ptr(xr, xin), .a_type = operand_type(xr),
               .lda = in, .a_exact = xr.f32, .B = A, .b_type = a->dtype, .ldb = in, .C = u,
               .ldc = a->local[0], .compute = a->dtype};
  return ml_be_gemm(be, &g);
}

/* *dst [rows, p->shape[1]] of dt in pool memory (the caller frees it; NULL on error) =
 * the whole matrix whose columns src [rows, p->local[1]] are this rank's (ml_linear.whole). */
static int whole_cols(ml_backend *be, const ml_linear *lin, const ml_param *p, const void *src,
                      int64_t rows, ml_dtype dt, void **dst) {
  *dst = ml_be_alloc(be, ml_mul_sat(rows, p->shape[1]), ml_dtype_size(dt),
                     "%s's columns gathered whole [%lld x %lld]", p->name, (long long)rows,
                     (long long)p->shape[1]);
  if (!*dst) return -1;
  return lin->whole.cols(lin->whole.ctx, p, src, rows, dt, *dst);
}

/* PEFT's Linear.forward adapter term: y [T, out] += scaling · (drop(x)·A^T)·B^T,
 * B(A(drop(x))) computed first and then scaled (result + lora_B(lora_A(dropout(x)))
 * * scaling), in the adapters' dtype. With a whole hook, drop(x) and A are gathered whole
 * first (each rank's dropped columns: the mask is of the global column) and u is one
 * rank's. */
static int lora_forward(ml_backend *be, const ml_linear *lin, const ml_act *x, ml_xr xr,
                        float *y) {
  const ml_param *a = lin->lora_a, *b = lin->lora_b;
  int64_t T = x->B * x->s, r = b->local[1], out = b->local[0];
  float *xd, *v = NULL, *u = NULL;
  void *xdr, *xw = NULL, *aw = NULL;
  const float *xin;
  ml_xr xinr;
  int rc = lora_input(be, lin, x, xr, &xd, &xdr, &xin, &xinr);
  if (!rc && lin->whole.cols) { // xw: [T, in], aw: [r, in] whole (unless held for the call)
    rc = whole_cols(be, lin, a, xin, T, ML_F32, &xw);
    if (!rc && !lin->whole_lora_a)
      rc = whole_cols(be, lin, a, a->data, a->local[0], a->dtype, &aw);
  }
  if (!rc) u = ml_be_alloc(be, T * r, sizeof(float), "%s's LoRA down-projection [%lld x %lld]",
                           b->name, (long long)T, (long long)r);
  if (u) v = ml_be_alloc(be, T * out, sizeof(float), "%s's LoRA output [%lld x %lld]", b->name,
                         (long long)T, (long long)out);
  // u: [T, r] = drop(x) · A^T over the whole columns (xw, aw) or this rank's
  if (!v) rc = -1;
  else if (xw)
    rc = lora_down(be, a, aw ? aw : lin->whole_lora_a, a->shape[1], T, xw, (ml_xr){0}, u);
  else rc = lora_down(be, a, a->data, a->local[1], T, xin, xinr, u);
  // v: [T, out] = u: [T, r] · B: [out, r]^T
  ml_gemm g = {.trans_b = true, .M = T, .N = out, .K = r, .A = u, .a_type = ML_F32, .lda = r,
               .B = b->data, .b_type = b->dtype, .ldb = r, .C = v, .ldc = out,
               .compute = b->dtype};
  if (!rc) rc = ml_be_gemm(be, &g);
  if (!rc) rc = ml_be_scale(be, v, T * out, lin->lora_scale);
  if (!rc) rc = ml_be_add(be, y, v, T * out);
  ml_be_free(be, v);
  ml_be_free(be, u);
  ml_be_free(be, aw);
  ml_be_free(be, xw);
  ml_be_free(be, xdr);
  ml_be_free(be, xd);
  return rc;
}

/* Its backward, on dy [T, out] after the output edge: with xd = drop(x)
 * and u = xd·A^T recomputed (the same mask; T·in·r FLOPs, no activation
 * kept), dB [out, r] += dy^T · (s·u), du = s · dy·B [T, r], dA [r, in] +=
 * du^T · xd, dx [T, in] += drop(du · A) (when dx: the mask and 1/(1 − p)
 * applied to the dropped input's gradient). A frozen adapter gets no
 * gradient. */
static int lora_backward(ml_backend *be, const ml_linear *lin, const ml_act *dy, const ml_act *x,
                         ml_xr xr, float *dx) {
  const ml_param *a = lin->lora_a, *b = lin->lora_b;
  int64_t T = x->B * x->s, r = b->local[1], out = b->local[0], in = a->local[1];
  float *xd;
  void *xdr;
  const float *xin;
  ml_xr xinr;
  int rc = lora_input(be, lin, x, xr, &xd, &xdr, &xin, &xinr);
  float *u = rc ? NULL : ml_be_alloc(be, 2 * T * r, sizeof(float), "%s's LoRA gradients "
                                     "[2 x %lld x %lld]", b->name, (long long)T, (long long)r);
  float *du = u ? u + T * r : NULL;
  rc = u ? lora_down(be, a, a->data, in, T, xin, xinr, u) : -1; // u: [T, r]
  if (!rc) rc = ml_be_scale(be, u, T * r, lin->lora_scale);
  // dB: [out, r] += dy^T: [out, T] · (s·u): [T, r]
  ml_gemm gb = {.trans_a = true, .M = out, .N = r, .K = T, .A = dy->x, .a_type = ML_F32,
                .lda = out, .B = u, .b_type = ML_F32, .ldb = r, .C = b->grad, .ldc = r,
                .accumulate = true, .compute = b->dtype};
  if (!rc && b->grad) rc = ml_be_gemm(be, &gb);
  // du: [T, r] = dy: [T, out] · B: [out, r], then · s
  ml_gemm gu = {.M = T, .N = r, .K = out, .A = dy->x, .a_type = ML_F32, .lda = out,
                .B = b->data, .b_type = b->dtype, .ldb = r, .C = du, .ldc = r,
                .compute = b->dtype};
  if (!rc) rc = ml_be_gemm(be, &gu);
  if (!rc) rc = ml_be_scale(be, du, T * r, lin->lora_scale);
  // dA: [r, in] += du^T: [r, T] · xd: [T, in]
  ml_gemm ga = {.trans_a = true, .M = r, .N = in, .K = T, .A = du, .a_type = ML_F32, .lda = r,
                .B = operand_ptr(xinr, xin), .b_type = operand_type(xinr), .ldb = in,
                .b_exact = xinr.f32, .C = a->grad, .ldc = in, .accumulate = true,
                .compute = a->dtype};
  if (!rc && a->grad) rc = ml_be_gemm(be, &ga);
  // dx: [T, in] += du: [T, r] · A: [r, in]; under dropout into xd (free now), masked, added
  ml_gemm gx = {.M = T, .N = in, .K = r, .A = du, .a_type = ML_F32, .lda = r, .B = a->data,
                .b_type = a->dtype, .ldb = in, .C = xd ? xd : dx, .ldc = in,
                .accumulate = !xd, .compute = a->dtype};
  if (!rc && dx) rc = ml_be_gemm(be, &gx);
  if (!rc && dx && xd) rc = ml_lora_drop_apply(be, lin, x, xd, xd);
  if (!rc && dx && xd) rc = ml_be_add(be, dx, xd, T * in);
  ml_be_free(be, u);
  ml_be_free(be, xdr);
  ml_be_free(be, xd);
  return rc;
}

/* y [T, out] (=) x [T, K] · W [out, K]^T (+ b) in W's dtype; x fp32, or rounded once in xr;
 * y fp32, or bf16 when y_bf16 (rounded once by the GEMM). */
static int xwt(ml_backend *be, const ml_param *w, const void *W, int64_t T, int64_t K,
               const float *x, ml_xr xr, const ml_param *b, void *y, bool y_bf16) {
  int64_t out = w->local[0];
  ml_gemm g = {.trans_b = true, .M = T, .N = out, .K = K,
               .A = operand_ptr(xr, x), .a_type = operand_type(xr),
               .lda = K, .a_exact = xr.f32, .B = W, .b_type = w->dtype, .ldb = K,
               .C = y, .ldc = out, .c_bf16 = y_bf16,
               .bias = b ? b->data : NULL, .bias_type = b ? b->dtype : ML_F32,
               .compute = w->dtype};
  return ml_be_gemm(be, &g);
}

/* y [T, out] (=) x_whole [T, in] · W_whole [out, in]^T + b (ml_linear.whole): what one rank
 * computes, the bias added on every rank. */
static int whole_forward(ml_backend *be, const ml_linear *lin, const ml_act *x, float *y) {
  const ml_param *w = lin->weight;
  int64_t T = x->B * x->s;
  void *xw = NULL, *ww = NULL;
  int rc = whole_cols(be, lin, w, x->x, T, ML_F32, &xw); // xw: [T, in] whole
  if (!rc && !lin->whole_weight) // ww: [out, in], unless held for the call
    rc = whole_cols(be, lin, w, w->data, w->local[0], w->dtype, &ww);
  if (!rc)
    rc = xwt(be, w, ww ? ww : lin->whole_weight, T, w->shape[1], xw, (ml_xr){0}, lin->bias, y,
             false);
  ml_be_free(be, ww);
  ml_be_free(be, xw);
  return rc;
}

static int check_input(const ml_linear *lin, const ml_act *x) {
  const ml_param *w = lin->weight;
  if (x->c == w->local[1]) return 0;
  return ml_err("%s: the input has %lld features but this rank's weight expects %lld; the "
                "plan's layouts do not compose here",
                w->name, (long long)x->c, (long long)w->local[1]);
}

int ml_linear_forward(ml_backend *be, const ml_linear *lin, const ml_act *x, const ml_xr *xr,
                      float *ybuf, ml_act *y) {
  const ml_param *w = lin->weight;
  ML_TRY(check_input(lin, x));
  if (lin->whole.cols) {
    ML_TRY(whole_forward(be, lin, x, ybuf));
  } else {
    const ml_param *b = lin->bias && lin->bias_in_forward ? lin->bias : NULL;
    // y: [T, out] = x: [T, in] · W: [out, in]^T (+ b)
    ML_TRY(xwt(be, w, w->data, x->B * x->s, w->local[1], x->x, operand_of(xr), b, ybuf, false));
  }
  if (lin->lora_a) ML_TRY(lora_forward(be, lin, x, operand_of(xr), ybuf));
  *y = (ml_act){ybuf, x->B, x->S, x->s, w->shape[0], w->local[0]};
  return ml_hook_run(lin->out.fwd, y);
}

int ml_linear_forward_bf16(ml_backend *be, const ml_linear *lin, const ml_act *x,
                           const ml_xr *xr_in, void *ybuf, ml_act *y) {
  ml_xr xr = operand_of(xr_in);
  const ml_param *w = lin->weight;
  ML_TRY(check_input(lin, x));
  const char *why = w->dtype != ML_BF16 ? "its weight is not bf16"
                    : lin->whole.cols   ? "it is computed whole (ml_linear.whole)"
                    : lin->out.fwd.fn   ? "its output edge reads fp32"
                                        : NULL;
  if (why) return ml_err("%s: a bf16 output was asked for, but %s", w->name, why);
  const ml_param *b = lin->bias && lin->bias_in_forward ? lin->bias : NULL;
  int64_t T = x->B * x->s, out = w->local[0];
  *y = (ml_act){ybuf, x->B, x->S, x->s, w->shape[0], out};
  // y: [T, out] (bf16) = x: [T, in] · W: [out, in]^T (+ b)
  if (!lin->lora_a) return xwt(be, w, w->data, T, w->local[1], x->x, xr, b, ybuf, true);
  /* with an adapter: its term added to the fp32 output, then one rounding (lora_B zero:
   * bitwise the plain linear's bf16 output) */
  float *t = ml_be_alloc(be, ml_mul_sat(T, out), sizeof(float),
                         "%s's output before its bf16 rounding [%lld x %lld]", w->name,
                         (long long)T, (long long)out);
  if (!t) return -1;
  int rc = xwt(be, w, w->data, T, w->local[1], x->x, xr, b, t, false);
  if (!rc) rc = lora_forward(be, lin, x, xr, t);
  if (!rc) rc = ml_be_convert(be, ybuf, ML_BF16, t, ML_F32, (size_t)(T * out));
  ml_be_free(be, t);
  return rc;
}

/* The GEMMs of the backward on dy [T, out] of a_type (fp32, or rounded once for both: bf16,
 * or fp32 holding bf16 values when a_exact): dx (= or += when accumulate; NULL: none) and dW
 * (+=; none for a frozen weight). */
static int grad_gemms(ml_backend *be, const ml_param *w, const void *A, ml_dtype a_type,
                      bool a_exact, const ml_act *x, ml_xr xr, float *dx, int accumulate) {
  int64_t T = x->B * x->s, in = w->local[1], out = w->local[0];
  if (dx) { // dx: [T, in] (= or +=) dy: [T, out] · W: [out, in]
    ml_gemm g = {.M = T, .N = in, .K = out, .A = A, .a_type = a_type, .lda = out,
                 .a_exact = a_exact, .B = w->data, .b_type = w->dtype, .ldb = in, .C = dx,
                 .ldc = in, .accumulate = accumulate, .compute = w->dtype};
    ML_TRY(ml_be_gemm(be, &g));
  }
  // dW: [out, in] += dy^T: [out, T] · x: [T, in]; none for a frozen weight (grad NULL)
  ml_gemm gw = {.trans_a = true, .M = out, .N = in, .K = T, .A = A, .a_type = a_type,
                .lda = out, .a_exact = a_exact, .B = operand_ptr(xr, x->x),
                .b_type = operand_type(xr), .ldb = in, .b_exact = xr.f32,
                .C = w->grad, .ldc = in, .accumulate = true, .compute = w->dtype};
  return w->grad ? ml_be_gemm(be, &gw) : 0;
}

/* An error unless dy [B, x->s, out_local] fits lin's weight after the output edge. */
static int check_grad(const ml_linear *lin, const ml_act *dy, const ml_act *x) {
  const ml_param *w = lin->weight;
  if (dy->s == x->s && dy->c == w->local[0]) return 0;
  return ml_err("%s: the output gradient is [%lld positions, %lld features] after its edge; "
                "expected [%lld, %lld]",
                w->name, (long long)dy->s, (long long)dy->c, (long long)x->s,
                (long long)w->local[0]);
}

int ml_linear_backward(ml_backend *be, const ml_linear *lin, ml_act *dy, const ml_act *x,
                       const ml_xr *xr, float *dx, int accumulate) {
  const ml_param *w = lin->weight;
  ML_TRY(ml_hook_run(lin->out.bwd, dy));
  ML_TRY(check_grad(lin, dy, x));
  int64_t T = x->B * x->s, out = w->local[0];
  /* dy rounded once for both GEMMs (bf16 weights): into bf16, or where the backend reads
     exact fp32 operands in place, into fp32 storage (ml_be_round_bf16_to), flagged exact */
  void *dyr = NULL;
  bool exact = w->dtype == ML_BF16 && dx && ml_be_gemm_exact_in_place(be);
  if (exact) ML_TRY(round_rows_f32(be, dy->x, T, out, &dyr));
  else if (w->dtype == ML_BF16 && dx) ML_TRY(round_rows(be, dy->x, T, out, &dyr));
  ml_dtype dyt = dyr && !exact ? ML_BF16 : ML_F32;
  int rc = grad_gemms(be, w, dyr ? dyr : (const void *)dy->x, dyt, exact, x, operand_of(xr), dx,
                      accumulate);
  ml_be_free(be, dyr);
  ML_TRY(rc);
  if (lin->lora_a) ML_TRY(lora_backward(be, lin, dy, x, operand_of(xr), dx));
  if (lin->bias && lin->bias->grad) ML_TRY(ml_be_bias_grad(be, dy->x, T, out, lin->bias->grad));
  return 0;
}

bool ml_linear_dy_bf16(const ml_linear *lin) {
  return !lin->weight->fp32 && !lin->lora_a && !lin->bias && !lin->out.bwd.fn;
}

int ml_linear_backward_bf16(ml_backend *be, const ml_linear *lin, const ml_act *dy,
                            const ml_act *x, const ml_xr *xr, float *dx, int accumulate) {
  const ml_param *w = lin->weight;
  const char *why = w->dtype != ML_BF16 ? "its weight is not bf16"
                    : !ml_linear_dy_bf16(lin)
                        ? "its backward reads the fp32 gradient (an fp32-kept weight, a LoRA "
                          "adapter, a bias or an output edge)"
                        : NULL;
  if (why) return ml_err("%s: a bf16 output gradient was given, but %s", w->name, why);
  ML_TRY(check_grad(lin, dy, x));
  /* dy read by both GEMMs: widened once where the backend reads exact fp32 in place */
  ml_xr d = {.p = dy->x};
  if (dx && w->grad) ML_TRY(ml_linear_operand_bf16(be, dy->x, x->B * x->s, w->local[0], &d));
  int rc = grad_gemms(be, w, d.p, d.f32 ? ML_F32 : ML_BF16, d.f32, x, operand_of(xr), dx,
                      accumulate);
  ml_linear_operand_free(be, &d);
  return rc;
}
