/* Decoder layer forward/backward (HF LlamaDecoderLayer, Qwen3DecoderLayer,
 * Gemma3DecoderLayer):
 *   h1 = attn_norm(x)
 *   q = rope(q_norm(q_proj(h1))), k = rope(k_norm(k_proj(h1))), v = v_proj(h1)
 *   x_mid = x + attn_out_norm(o_proj(attention(q, k, v)))
 *   h2 = mlp_norm(x_mid); out = x_mid + mlp_out_norm(down(act(gate(h2)) · up(h2)))
 * Norms the family lacks (weight NULL) are the identity; q_norm/k_norm are
 * RMSNorm(head_dim) on each head, i.e. the row norm of [T·heads, hd]. The
 * layer's window and RoPE tables select sliding or full attention. Under
 * activation checkpointing (ml_ac_mode) the backward starts by rerunning
 * the forward pieces whose activations the layer dropped. */
#include <math.h>

#include "common/status.h"
#include "model/linear.h"
#include "model/moe.h"
#include "tensor/dtype.h"

// x, y: [rows, dim]; rstd: [rows]
static int norm_fwd(ml_model *m, const ml_rmsnorm *n, const float *x, float *y, float *rstd,
                    int64_t rows, int64_t dim) {
  const ml_param *w = n->weight;
  return ml_be_rmsnorm_fwd(m->be, x, w->data, w->dtype, n->offset, n->eps, y, rstd, rows, dim);
}

// x: [rows, dim] → y16 [rows, dim] bf16 (norm_fwd's y rounded in the kernel); rstd: [rows]
static int norm_fwd_bf16(ml_model *m, const ml_rmsnorm *n, const float *x, void *y16, float *rstd,
                         int64_t rows, int64_t dim) {
  const ml_param *w = n->weight;
  return ml_be_rmsnorm_fwd_bf16(m->be, x, w->data, w->dtype, n->offset, n->eps, y16, rstd, rows,
                                dim);
}

// dy, dx: [rows, dim] (dx may alias dy); weight grad (+=)
static int norm_bwd(ml_model *m, const ml_rmsnorm *n, const float *dy, const float *x,
                    const float *rstd, float *dx, int64_t rows, int64_t dim) {
  const ml_param *w = n->weight;
  return ml_be_rmsnorm_bwd(m->be, dy, x, w->data, w->dtype, n->offset, rstd, dx, w->grad, rows,
                           dim);
}

// y, x: [n] floats: y += x
static int add_inplace(ml_model *m, float *y, const float *x, int64_t n) {
  return ml_be_add(m->be, y, x, n);
}

// dst, src: [n] floats of device memory
static int copy_floats(ml_model *m, float *dst, const float *src, int64_t n) {
  return ml_be_copy(m->be, dst, src, sizeof(float) * (size_t)n, ML_COPY_D2D);
}

static float attn_scale(const ml_model *m) { return (float)pow(m->cfg.attn_scalar, -0.5); }

/* An edge's view must come back with the extent the model continues with. */
static int expect_view(const char *what, const ml_act *v, int64_t s, int64_t c) {
  if (v->s == s && v->c == c) return 0;
  return ml_err("%s: the plan's layouts leave [%lld positions, %lld features] here; expected "
                "[%lld, %lld]",
                what, (long long)v->s, (long long)v->c, (long long)s, (long long)c);
}

/* Query heads per key/value head: the config's, or the tp split's. */
static int64_t group_of(const ml_model *m) {
  return m->attn_group ? m->attn_group : m->cfg.n_heads / m->cfg.n_kv_heads;
}

/* q, k, v as attention needs them: whole sequences, head counts that
 * match; the local head counts come from the views. */
static int attention_views(const ml_model *m, const ml_layer *L, int64_t *nh, int64_t *nkv) {
  const ml_layer_acts *a = &L->acts;
  int64_t hd = m->cfg.head_dim;
  const ml_act *v[3] = {&a->qv, &a->kv, &a->vv};
  for (int i = 0; i < 3; i++)
    if (v[i]->s != m->S || v[i]->c % hd)
      return ml_err("%s: attention needs whole sequences of whole heads; this rank holds %lld of "
                    "%lld positions and %lld features (head_dim %lld)",
                    i == 0 ? L->q_proj.weight->name : i == 1 ? L->k_proj.weight->name
                                                           : L->v_proj.weight->name,
                    (long long)v[i]->s, (long long)m->S, (long long)v[i]->c, (long long)hd);
  *nh = a->qv.c / hd;
  *nkv = a->kv.c / hd;
  int64_t g = group_of(m), off = m->attn_head_off;
  if (a->vv.c != a->kv.c || *nkv == 0 || *nh == 0 || (*nh - 1 + off) / g != *nkv - 1)
    return ml_err("%s: %lld query heads (from %lld into a group of %lld) and %lld/%lld key/value "
                  "heads on this rank do not group",
                  L->q_proj.weight->name, (long long)*nh, (long long)off, (long long)g,
                  (long long)*nkv, (long long)(a->vv.c / hd));
  return 0;
}

/* The view v over another buffer of the same shape (its gradient). */
static ml_act on(ml_act v, float *x) {
  v.x = x;
  return v;
}

/* Whether lin's backward GEMMs read dy in bf16 and nothing else reads it in fp32 (bf16
 * weight, ml_linear_dy_bf16): then its producer may write it in bf16. */
static bool reads_bf16_dy(const ml_linear *lin) {
  return lin->weight->dtype == ML_BF16 && ml_linear_dy_bf16(lin);
}

/* Whether lin's output gradient (lin: o_proj or down_proj; NULL: a sparse layer's experts)
 * is the residual gradient dx as its bf16 copy: no out-norm (norm: attn_out_norm or
 * mlp_out_norm) sits between and lin reads it only in bf16. The one rule for out_grad and
 * for the add that writes the copy ahead (mlp_backward's, for o_proj). */
static bool out_grad_bf16(const ml_rmsnorm *norm, const ml_linear *lin) {
  return !norm->weight && lin && reads_bf16_dy(lin);
}

/* The linear that reads L's MLP output gradient: down_proj, or NULL (a sparse
 * layer's experts). */
static const ml_linear *mlp_down(const ml_layer *L) {
  return L->moe.gate.weight ? NULL : &L->down_proj;
}

/* Whether the cast of L's output gradient at its unit boundary also writes
 * down_proj's bf16 dy into the backward scratch's first [B, s_res, H] bf16
 * (where out_grad reads it ahead): L's own round (ML_CAST_IN) and the layer
 * above's add (ML_CAST_OUT there, ML_CAST_IN_FUSED in L) follow this one rule. */
static bool boundary_dy_bf16(const ml_layer *L) {
  return out_grad_bf16(&L->mlp_out_norm, mlp_down(L));
}

/* Whether lin (o_proj or down_proj; NULL: a sparse layer's experts) reads its fp32 output
 * gradient without writing it: no output edge backward (a tp redistribute) transforms it in
 * place, and the experts' backward takes it read only (model/moe.h). */
static bool reads_dy_only(const ml_linear *lin) { return !lin || !lin->out.bwd.fn; }

/* *dy [B, s_res, H], the output gradient of o_proj or down_proj (lin; NULL: a sparse layer's
 * experts read it), in d: attn_out_norm's or mlp_out_norm's backward on the residual gradient
 * dx (fp32), else dx itself copied (lin's output edge transforms it in place), or where lin
 * reads it only in bf16 (*d16 = out_grad_bf16) converted: the one bf16 copy its GEMMs read,
 * written by this pass instead of a copy and then a conversion — or already written by the
 * add that produced dx (ahead: nothing to do). Where lin reads the fp32 dx only
 * (reads_dy_only) *dy is dx itself, no copy: the caller's GEMMs read it before
 * block_input_backward's add writes dx. */
static int out_grad(ml_model *m, const ml_rmsnorm *norm, const float *saved, const float *rstd,
                    const ml_linear *lin, float *dx, bool ahead, float *d, float **dy,
                    bool *d16) {
  int64_t Tr = m->B * m->s_res, H = m->cfg.hidden;
  *d16 = out_grad_bf16(norm, lin);
  *dy = d;
  if (norm->weight) return norm_bwd(m, norm, dx, saved, rstd, d, Tr, H);
  if (*d16) return ahead ? 0 : ml_be_convert(m->be, d, ML_BF16, dx, ML_F32, (size_t)(Tr * H));
  if (reads_dy_only(lin)) {
    *dy = dx;
    return 0;
  }
  return copy_floats(m, d, dx, Tr * H);
}

/* lin's backward on dy: bf16 as its producer wrote it (dy_bf16: m->bf16_rope_grads for
 * q/k_proj, m->bf16_glu_grads for gate/up_proj, out_grad for o_proj, down_proj), else fp32
 * (rounded by the linear). */
static int linear_backward(ml_model *m, bool dy_bf16, const ml_linear *lin, ml_act *dy,
                           const ml_act *x, const ml_xr *xr, float *dx, int accumulate) {
  if (dy_bf16) return ml_linear_backward_bf16(m->be, lin, dy, x, xr, dx, accumulate);
  return ml_linear_backward(m->be, lin, dy, x, xr, dx, accumulate);
}

/* Backward through a block's shared input: `in` is the view its linears
 * read (dh, their summed input grad, is in that layout); the input edge of
 * `first` brings dh back to the residual layout, then the block's norm and
 * the residual add into dx [B, s_res, H] — with dx16 non-NULL also storing
 * the sum rounded into dx16 [B, s_res, H] bf16 (ml_be_add_bf16); under
 * cast the sum stored in dx rounded to bf16 values, the unit boundary's
 * cast (ml_be_add_round_to, dx16 its bf16 copy or NULL). */
static int block_input_backward(ml_model *m, const ml_linear *first, const ml_act *in, float *dh,
                                const ml_rmsnorm *norm, const float *x, const float *rstd,
                                float *dx, void *dx16, bool cast) {
  int64_t Tr = m->B * m->s_res, H = m->cfg.hidden;
  ml_act dhv = on(*in, dh);
  ML_TRY(ml_hook_run(first->in.bwd, &dhv));
  ML_TRY(expect_view(first->weight->name, &dhv, m->s_res, H));
  ML_TRY(norm_bwd(m, norm, dh, x, rstd, dh, Tr, H));
  if (cast) return ml_be_add_round_to(m->be, dx, dx, dh, dx16, Tr * H);
  if (dx16) return ml_be_add_bf16(m->be, dx, dh, dx16, Tr * H);
  return add_inplace(m, dx, dh, Tr * H);
}

/* Whether the producer of first's input (attn_norm for q/k/v_proj, mlp_norm for gate/up_proj,
 * the GLU for down_proj) writes it straight into the saved bf16 copy (h1, h2, a), no fp32
 * temporary and no conversion: it is kept only in bf16 (m->bf16_inputs: no LoRA dropout,
 * fp32-kept weight, whole hook or router reads it in fp32) and no input edge (a tp or sp
 * redistribute of the fp32 view) runs between the producer and the GEMMs. The one rule for
 * h1, h2 and a; the same bits as the conversion after the edge (both round the same fp32
 * value to nearest-even). */
static bool direct_input(const ml_model *m, const ml_linear *first) {
  return m->bf16_inputs && !first->in.fwd.fn;
}

/* Where the input of linears is written (q/k/v, gate/up: a norm; down_proj:
 * the GLU) when not direct_input: `saved` (h1, h2, a) itself, or under
 * m->bf16_inputs, where `saved` keeps only the bf16 copy, a temporary
 * [B, S, cols] fp32 (room for the input edge's gathered view) from the
 * pool; NULL when it cannot be had. */
static float *shared_input(ml_model *m, float *saved, int64_t cols) {
  if (!m->bf16_inputs) return saved;
  return ml_be_alloc(m->be, m->B * m->S * cols, sizeof(float),
                     "a GEMM input before its bf16 rounding [%lld x %lld]",
                     (long long)(m->B * m->S), (long long)cols);
}

/* Whether lin's weight is bf16, as the activations carved at 2 B assume. */
static int carved_bf16(const ml_linear *lin) {
  if (lin->weight->dtype == ML_BF16) return 0;
  return ml_err("%s: its activations were laid out for bf16 weights (param_dtype bf16) but the "
                "weight is %s now; expected bf16",
                lin->weight->name, ml_dtype_name(lin->weight->dtype));
}

/* *xr: the rounded operand of the linears reading view *in (first: one of
 * them), for ml_linear_operand_free. Under m->bf16_inputs in->x rounded to
 * nearest-even into `saved` (bf16), which the backward reads again, in->x
 * NULL after: the temporary in->x (shared_input) freed, or where the
 * backend reads exact fp32 in place (ml_be_gemm_exact_in_place) rounded in
 * place in the same pass and kept as *xr until ml_linear_operand_free (no GEMM
 * widens `saved`); else ml_linear_round_input's pool copy (none with fp32
 * weights). */
static int shared_operand(ml_model *m, const ml_linear *first, ml_act *in, float *saved,
                          ml_xr *xr) {
  if (!m->bf16_inputs) return ml_linear_round_input(m->be, first, in, xr);
  *xr = (ml_xr){.p = saved};
  int rc = carved_bf16(first);
  size_t n = (size_t)(in->B * in->s * in->c);
  if (!rc && ml_be_gemm_exact_in_place(m->be)) {
    rc = ml_be_round_bf16_to(m->be, in->x, in->x, saved, n);
    *xr = (ml_xr){.p = in->x, .f32 = true, .owned = in->x};
  } else {
    if (!rc) rc = ml_be_convert(m->be, saved, ML_BF16, in->x, ML_F32, n);
    ml_be_free(m->be, in->x);
  }
  in->x = NULL;
  return rc;
}

/* The input of the linears after a norm (first: q_proj, gate_proj or a sparse layer's router;
 * the first of those its input edge belongs to), from x [B, s_res, H], as the view *in they
 * read (the edge's [B, S, H]), rstd [B·s_res] saved, and with xr their rounded operand *xr:
 * direct_input: the norm writes the bf16 `saved` (h1, h2) itself, *xr its
 * ml_linear_operand_bf16, in->x NULL (its fp32 value is kept nowhere); else the norm's fp32
 * output in `saved` or a shared_input temporary, first's input edge run on it, then
 * shared_operand. xr NULL: in->x stays fp32 in
 * `saved` (the router and experts read it; never under m->bf16_inputs). */
static int norm_input(ml_model *m, const ml_rmsnorm *norm, const ml_linear *first, const float *x,
                      float *saved, float *rstd, ml_act *in, ml_xr *xr) {
  int64_t Tr = m->B * m->s_res, H = m->cfg.hidden;
  if (xr && direct_input(m, first)) {
    *xr = (ml_xr){0};
    ML_TRY(carved_bf16(first));
    *in = ml_act_view(m, NULL, m->s_res, H, H);
    ML_TRY(norm_fwd_bf16(m, norm, x, saved, rstd, Tr, H));
    return ml_linear_operand_bf16(m->be, saved, Tr, H, xr);
  }
  float *h = xr ? shared_input(m, saved, H) : saved;
  if (!h) return -1;
  *in = ml_act_view(m, h, m->s_res, H, H);
  int rc = norm_fwd(m, norm, x, h, rstd, Tr, H);
  if (!rc) rc = ml_hook_run(first->in.fwd, in); /* shared by the linears reading it */
  if (rc || !xr) {
    if (h != saved) ml_be_free(m->be, h);
    return rc;
  }
  return shared_operand(m, first, in, saved, xr);
}

/* The backward's *xr for the linears reading view *in: the forward's saved
 * bf16 copy under m->bf16_inputs (not rounded again; ml_linear_operand_bf16),
 * else as shared_operand. */
static int saved_operand(ml_model *m, const ml_linear *first, const ml_act *in, float *saved,
                         ml_xr *xr) {
  if (!m->bf16_inputs) return ml_linear_round_input(m->be, first, in, xr);
  return ml_linear_operand_bf16(m->be, saved, in->B * in->s, in->c, xr);
}

/* *xo: o_proj's bf16 operand, the attention kernel's bf16 output (m->bf16_att:
 * the view's fp32 x, which holds none, set NULL; one GEMM reads it, as it is), or none
 * (o_proj's GEMM rounds the fp32 att). */
static int att_operand(ml_model *m, const ml_layer *L, ml_act *in_o, ml_xr *xo) {
  *xo = (ml_xr){0};
  if (!m->bf16_att) return 0;
  ML_TRY(carved_bf16(&L->o_proj));
  xo->p = in_o->x;
  in_o->x = NULL;
  return 0;
}

/* The dtype attention's products compute in: the projections' weights'
 * (fp32, or FSDP's bf16 param_dtype), as autocast runs SDPA in the dtype
 * it runs the linears in. */
static ml_dtype attn_compute(const ml_layer *L) { return L->q_proj.weight->dtype; }

/* The attention core's call for layer L's saved q, k, v. */
static ml_attn_call core_call(const ml_model *m, const ml_layer *L) {
  const ml_layer_acts *a = &L->acts;
  int64_t hd = m->cfg.head_dim;
  return (ml_attn_call){.q = a->q, .k = a->k, .v = a->v, .B = m->B, .S = m->S,
                        .nh = a->qv.c / hd, .nkv = a->kv.c / hd, .hd = hd,
                        .group = group_of(m), .head_off = m->attn_head_off,
                        .scale = attn_scale(m), .window = L->window,
                        .compute = attn_compute(L), .layer = L - m->layers,
                        .qkv_bf16 = m->bf16_qkv, .out_bf16 = m->bf16_att};
}

/* Whether c's heads group as the whole-sequence attention calls assume
 * (query head h reads kv head h / (nh / nkv)); else the call runs as one
 * block of block attention, which takes any grouping (ml_attn_block). */
static bool plain_groups(const ml_attn_call *c) {
  return c->head_off == 0 && c->group * c->nkv == c->nh;
}

// the whole sequences of c as one block of block attention
static ml_attn_block whole_block(const ml_attn_call *c) {
  return (ml_attn_block){.B = c->B, .sq = c->S, .sk = c->S, .nh = c->nh, .nkv = c->nkv,
                         .hd = c->hd, .q_bs = c->S * c->nh * c->hd, .k_bs = c->S * c->nkv * c->hd,
                         .l_bs = c->S * c->nh, .scale = c->scale, .window = c->window,
                         .group = c->group, .head_off = c->head_off};
}

/* Whether c runs as one block of block attention: heads that do not group
 * plainly, or a bf16 output or bf16 q, k, v (ml_attn_block.out_bf16,
 * .qkv_bf16, which the whole-sequence calls lack; on every backend the block
 * call on the whole sequences computes what the whole-sequence call does). */
static bool as_block(const ml_attn_call *c) {
  return c->out_bf16 || c->qkv_bf16 || !plain_groups(c);
}

/* An error unless the activations' layout holds for the attention core in
 * place: a bf16 att, or bf16 q, k, v, were laid out for the backend's
 * attention or a core that takes them (ml_attn_core.bf16_out, .bf16_qkv). */
static int check_core(const ml_model *m, const ml_layer *L) {
  const ml_attn_core *k = &m->attn_core;
  if (!k->fwd) return 0;
  const char *what = m->bf16_att && !k->bf16_out   ? "a bf16 attention output"
                     : m->bf16_qkv && !k->bf16_qkv ? "bf16 q, k, v"
                                                   : NULL;
  if (!what) return 0;
  return ml_err("%s: the activations were laid out for %s, which the attention core set now "
                "(context parallelism, packing, a KV cache) does not take; expected "
                "ml_model_begin after setting ml_model.attn_core",
                L->o_proj.weight->name, what);
}

// q, k: [B, S, nh|nkv, hd] after RoPE, v: [B, S, nkv, hd] → att: [B, S, nh·hd] (bf16 under
// m->bf16_att), attn_saved
static int core_forward(ml_model *m, const ml_layer *L, float *att) {
  ml_attn_call c = core_call(m, L);
  ML_TRY(check_core(m, L));
  if (m->attn_core.fwd) return m->attn_core.fwd(m->attn_core.ctx, &c, att, L->acts.attn_saved);
  if (as_block(&c)) {
    ml_attn_block blk = whole_block(&c);
    blk.out_bf16 = c.out_bf16;
    blk.qkv_bf16 = c.qkv_bf16; /* q, k, v read as saved */
    return ml_be_attention_block_fwd(m->be, &blk, c.q, c.k, c.v, att, L->acts.attn_saved, false,
                                     c.compute);
  }
  return ml_be_attention_fwd(m->be, c.q, c.k, c.v, att, L->acts.attn_saved, c.B, c.S, c.nh, c.nkv,
                             c.hd, c.scale, c.window, c.compute);
}

// datt: [B, S, nh·hd] → dq [B, S, nh, hd], dk, dv [B, S, nkv, hd] (=)
static int core_backward(ml_model *m, const ml_layer *L, const float *datt, float *dq, float *dk,
                         float *dv) {
  const ml_layer_acts *a = &L->acts;
  ml_attn_call c = core_call(m, L);
  ML_TRY(check_core(m, L));
  if (m->attn_core.bwd)
    return m->attn_core.bwd(m->attn_core.ctx, &c, datt, a->att, a->attn_saved, dq, dk, dv);
  if (as_block(&c)) {
    ml_attn_block blk = whole_block(&c);
    blk.out_bf16 = c.out_bf16; /* D reads the bf16 att */
    blk.qkv_bf16 = c.qkv_bf16;
    blk.bwd_overwrite = true; /* the only block: dq, dk, dv (=) */
    return ml_be_attention_block_bwd(m->be, &blk, datt, c.q, c.k, c.v, a->att, a->attn_saved, dq,
                                     dk, dv, c.compute, m->attn_work);
  }
  return ml_be_attention_bwd(m->be, datt, c.q, c.k, c.v, a->att, a->attn_saved, dq, dk, dv, c.B,
                             c.S, c.nh, c.nkv, c.hd, c.scale, c.window, c.compute, m->attn_work);
}

/* Under m->bf16_qkv the fp32 scratch q and k pass through before RoPE
 * rounds them into the bf16 q, k: [T, cap_q] then [T, cap_kv] from the
 * pool (NULL when it cannot be had). */
static float *qk_scratch(ml_model *m, const ml_layer *L) {
  if (carved_bf16(&L->q_proj)) return NULL; /* attention's products read them in bf16 */
  int64_t T = m->B * m->S;
  return ml_be_alloc(m->be, T * (m->cap_q + m->cap_kv), sizeof(float),
                     "q and k before their bf16 rounding [%lld x %lld]", (long long)T,
                     (long long)(m->cap_q + m->cap_kv));
}

/* q, k from q_proj's, k_proj's outputs (the views qv, kv): q_norm, k_norm
 * (saving q_raw, k_raw), RoPE, in place in a->q, a->k; or under m->bf16_qkv
 * through the fp32 scratch qk (qk_scratch) into the bf16 a->q, a->k, RoPE
 * rounding them (qv.x, kv.x NULL: their fp32 values are kept nowhere). */
static int qk_forward(ml_model *m, ml_layer *L, float *qk) {
  ml_layer_acts *a = &L->acts;
  int64_t B = m->B, S = m->S, T = B * S, hd = m->cfg.head_dim, nh = 0, nkv = 0;
  ML_TRY(attention_views(m, L, &nh, &nkv));
  float *qn = qk ? qk : a->q, *kn = qk ? qk + T * m->cap_q : a->k; /* RoPE's input */
  if (L->q_norm.weight) {
    ML_TRY(norm_fwd(m, &L->q_norm, a->q_raw, qn, a->rstd_q, T * nh, hd));   // q: [T·nh, hd]
    ML_TRY(norm_fwd(m, &L->k_norm, a->k_raw, kn, a->rstd_k, T * nkv, hd));  // k: [T·nkv, hd]
  }
  if (!qk) {
    ML_TRY(ml_be_rope_fwd(m->be, a->q, L->rope_cos, L->rope_sin, B, S, nh, hd));
    return ml_be_rope_fwd(m->be, a->k, L->rope_cos, L->rope_sin, B, S, nkv, hd);
  }
  a->qv.x = a->kv.x = NULL;
  ML_TRY(ml_be_rope_fwd_bf16(m->be, qn, a->q, L->rope_cos, L->rope_sin, B, S, nh, hd));
  return ml_be_rope_fwd_bf16(m->be, kn, a->k, L->rope_cos, L->rope_sin, B, S, nkv, hd);
}

// x_in [B, s_res, H] → x_mid [B, s_res, H]; x: room for [B, S, H] (o_proj's output), not read
static int attention_forward(ml_model *m, ml_layer *L, float *x) {
  ml_layer_acts *a = &L->acts;
  int64_t B = m->B, S = m->S, Tr = B * m->s_res, H = m->cfg.hidden, hd = m->cfg.head_dim;
  bool qk_norm = L->q_norm.weight, out_norm = L->attn_out_norm.weight;
  ml_xr xr = {0}; /* in_qkv rounded once for the three (bf16 weights) */
  int rc = norm_input(m, &L->attn_norm, &L->q_proj, a->x_in, a->h1, a->rstd1, &a->in_qkv, &xr);
  float *qk = NULL; /* m->bf16_qkv: q, k in fp32 before RoPE's rounding (qk_scratch) */
  if (!rc && m->bf16_qkv && !(qk = qk_scratch(m, L))) rc = -1;
  float *q = qk_norm ? a->q_raw : qk ? qk : a->q;
  float *k = qk_norm ? a->k_raw : qk ? qk + B * S * m->cap_q : a->k;
  // q: [B, S, nh·hd]; k, v: [B, S, nkv·hd] (v bf16 under m->bf16_qkv)
  if (!rc) rc = ml_linear_forward(m->be, &L->q_proj, &a->in_qkv, &xr, q, &a->qv);
  if (!rc) rc = ml_linear_forward(m->be, &L->k_proj, &a->in_qkv, &xr, k, &a->kv);
  if (!rc)
    rc = m->bf16_qkv ? ml_linear_forward_bf16(m->be, &L->v_proj, &a->in_qkv, &xr, a->v, &a->vv)
                     : ml_linear_forward(m->be, &L->v_proj, &a->in_qkv, &xr, a->v, &a->vv);
  ml_linear_operand_free(m->be, &xr);
  if (!rc) rc = qk_forward(m, L, qk);
  ml_be_free(m->be, qk);
  ML_TRY(rc);
  ML_TRY(core_forward(m, L, a->att));
  a->in_o = ml_act_view(m, a->att, S, m->cfg.n_heads * hd, a->qv.c);
  ML_TRY(ml_hook_run(L->o_proj.in.fwd, &a->in_o)); /* none under m->bf16_att */
  ml_xr xo; /* att in bf16 (m->bf16_att), else none: the GEMM rounds it */
  ML_TRY(att_operand(m, L, &a->in_o, &xo));
  ml_act o; /* into x, which has room for the output edge's unsharded [B, S, H] */
  ML_TRY(ml_linear_forward(m->be, &L->o_proj, &a->in_o, &xo, x, &o));  // [B, s_res, H]
  ML_TRY(expect_view(L->o_proj.weight->name, &o, m->s_res, H));
  if (out_norm) { /* o: [B, s_res, H] saved; x = attn_out_norm(o) */
    ML_TRY(copy_floats(m, a->o, x, Tr * H));
    ML_TRY(norm_fwd(m, &L->attn_out_norm, a->o, x, a->rstd_o, Tr, H));
  }
  return ml_be_add_to(m->be, a->x_mid, x, a->x_in, Tr * H);  // residual, saved: x_mid = x + x_in
}

/* The backward scratch's room for attention's output gradient [B, S, cap_q] fp32, after dtmp
 * and dh [B, S, H] each (attention_backward's layout). */
static float *scratch_datt(const ml_model *m) {
  return m->scratch + 2 * m->B * m->S * m->cfg.hidden;
}

// dx: [B, s_res, H] grad of x_mid in, grad of the layer input out (below: the layer below, when
// the gradient enters it cast, ML_CAST_OUT: stored rounded, with its down_proj's bf16 dy)
static int attention_backward(ml_model *m, ml_layer *L, float *dx, const ml_layer *below) {
  ml_layer_acts *a = &L->acts;
  int64_t B = m->B, S = m->S, T = B * S, H = m->cfg.hidden;
  int64_t hd = m->cfg.head_dim, nh = a->qv.c / hd, nkv = a->kv.c / hd;
  float *dtmp = m->scratch, *dh = dtmp + T * H, *datt = scratch_datt(m);
  float *dq = datt + T * m->cap_q, *dk = dq + T * m->cap_q, *dv = dk + T * m->cap_kv;
  bool d16; /* dy: d o [B, s_res, H], fp32 (dtmp or dx), or bf16 as mlp_backward's add wrote it */
  float *dy;
  ML_TRY(out_grad(m, &L->attn_out_norm, a->o, a->rstd_o, &L->o_proj, dx, true, dtmp, &dy, &d16));
  ml_act d = ml_act_view(m, dy, m->s_res, H, H);
  // datt: [B, S, nh·hd]
  ml_xr xo = {.p = m->bf16_att ? a->att : NULL}; /* as forward (att_operand) */
  ML_TRY(linear_backward(m, d16, &L->o_proj, &d, &a->in_o, &xo, datt, 0));
  ml_act datt_v = on(a->in_o, datt);
  ML_TRY(ml_hook_run(L->o_proj.in.bwd, &datt_v));
  ML_TRY(expect_view(L->o_proj.weight->name, &datt_v, S, nh * hd));
  ML_TRY(core_backward(m, L, datt, dq, dk, dv));
  ml_act dqv = on(a->qv, dq), dkv = on(a->kv, dk), dvv = on(a->vv, dv);
  if (m->bf16_rope_grads) { /* dq, dk: [B, S, nh|nkv, hd] bf16 in datt's room (model.c) */
    uint16_t *dq16 = (uint16_t *)datt, *dk16 = dq16 + T * nh * hd;
    ML_TRY(ml_be_rope_bwd_bf16(m->be, dq, dq16, L->rope_cos, L->rope_sin, B, S, nh, hd));
    ML_TRY(ml_be_rope_bwd_bf16(m->be, dk, dk16, L->rope_cos, L->rope_sin, B, S, nkv, hd));
    dqv.x = (float *)dq16; /* ml_linear_backward_bf16 reads them as bf16 */
    dkv.x = (float *)dk16;
  } else {
    ML_TRY(ml_be_rope_bwd(m->be, dq, L->rope_cos, L->rope_sin, B, S, nh, hd));
    ML_TRY(ml_be_rope_bwd(m->be, dk, L->rope_cos, L->rope_sin, B, S, nkv, hd));
  }
  if (L->q_norm.weight) { /* never under m->bf16_rope_grads */
    ML_TRY(norm_bwd(m, &L->q_norm, dq, a->q_raw, a->rstd_q, dq, T * nh, hd));   // dq: [T·nh, hd]
    ML_TRY(norm_bwd(m, &L->k_norm, dk, a->k_raw, a->rstd_k, dk, T * nkv, hd));  // dk: [T·nkv, hd]
  }
  ml_xr xr; /* in_qkv rounded for the three dW GEMMs (bf16 weights) */
  ML_TRY(saved_operand(m, &L->q_proj, &a->in_qkv, a->h1, &xr));
  bool qk16 = m->bf16_rope_grads;
  int rc = linear_backward(m, qk16, &L->q_proj, &dqv, &a->in_qkv, &xr, dh, 0);  // dh: [B, S, H]
  if (!rc) rc = linear_backward(m, qk16, &L->k_proj, &dkv, &a->in_qkv, &xr, dh, 1);
  if (!rc) rc = ml_linear_backward(m->be, &L->v_proj, &dvv, &a->in_qkv, &xr, dh, 1);
  ml_linear_operand_free(m->be, &xr);
  ML_TRY(rc);
  /* the layer below's bf16 dy into dtmp (dead now), which its recompute does not write */
  void *d16_below = below && boundary_dy_bf16(below) ? (void *)dtmp : NULL;
  return block_input_backward(m, &L->q_proj, &a->in_qkv, dh, &L->attn_norm, a->x_in, a->rstd1,
                              dx, d16_below, below != NULL);  // dx += d x_in
}

/* The linear whose input edge the MLP's input crosses: gate_proj, or a
 * sparse layer's router. */
static const ml_linear *mlp_first(const ml_layer *L) {
  return L->moe.gate.weight ? &L->moe.gate : &L->gate_proj;
}

/* g = gate_proj(in_gu), u = up_proj(in_gu) [B, s, I] (xr: in_gu rounded
 * once, or none): fp32, or under m->bf16_mlp bf16 from the GEMMs. */
static int gate_up(ml_model *m, ml_layer *L, const ml_xr *xr, ml_act *u) {
  ml_layer_acts *a = &L->acts;
  if (!m->bf16_mlp) {
    ML_TRY(ml_linear_forward(m->be, &L->gate_proj, &a->in_gu, xr, a->g, &a->gv));
    return ml_linear_forward(m->be, &L->up_proj, &a->in_gu, xr, a->u, u);
  }
  ML_TRY(ml_linear_forward_bf16(m->be, &L->gate_proj, &a->in_gu, xr, a->g, &a->gv));
  return ml_linear_forward_bf16(m->be, &L->up_proj, &a->in_gu, xr, a->u, u);
}

/* a = act(g)·u [B, s, I] into `act` (n elements): from fp32 g, u, or under
 * m->bf16_mlp from bf16 ones, written in a_type (bf16: rounded in the
 * kernel). */
static int glu_forward(ml_model *m, const ml_layer *L, void *act, ml_dtype a_type, int64_t n) {
  const ml_layer_acts *a = &L->acts;
  if (!m->bf16_mlp) return ml_be_glu_fwd(m->be, a->g, a->u, act, n, m->cfg.family->act);
  return ml_be_glu_fwd_bf16(m->be, a->g, a->u, act, a_type, n, m->cfg.family->act);
}

// x_mid [B, s_res, H] → x [B, s_res, H] = down(act(gate(h2)) · up(h2)) (room for [B, S, H]; not
// read)
static int dense_forward(ml_model *m, ml_layer *L, float *x) {
  ml_layer_acts *a = &L->acts;
  ml_act u;
  ml_xr xr; /* in_gu rounded once for both (bf16 weights) */
  ML_TRY(norm_input(m, &L->mlp_norm, &L->gate_proj, a->x_mid, a->h2, a->rstd2, &a->in_gu, &xr));
  int rc = gate_up(m, L, &xr, &u);  // g, u: [B, s, I]
  ml_linear_operand_free(m->be, &xr);
  ML_TRY(rc);
  ML_TRY(expect_view(L->up_proj.weight->name, &u, a->gv.s, a->gv.c));
  int64_t n = a->gv.B * a->gv.s * a->gv.c;
  /* a in bf16 straight from the GLU (autocast's bf16 mul output) where it is kept so
   * (m->bf16_inputs) and no input edge of down_proj reads it in fp32; else fp32 (a pool
   * temporary under m->bf16_inputs, rounded after the edge) */
  bool direct = m->bf16_mlp && direct_input(m, &L->down_proj);
  if (direct) {
    ML_TRY(carved_bf16(&L->down_proj));
    ML_TRY(glu_forward(m, L, a->a, ML_BF16, n));
    a->in_down = on(a->gv, NULL); /* its fp32 value is kept nowhere (model.h) */
    xr = (ml_xr){.p = a->a}; /* down_proj's GEMM alone reads it, as it is */
  } else {
    float *act = shared_input(m, a->a, m->cap_i); /* a: [B, s, I] */
    if (!act) return -1;
    a->in_down = on(a->gv, act);
    rc = glu_forward(m, L, act, ML_F32, n);
    if (!rc) rc = ml_hook_run(L->down_proj.in.fwd, &a->in_down);
    xr = (ml_xr){0}; /* in_down rounded under m->bf16_inputs (else the GEMM rounds it) */
    if (!rc && m->bf16_inputs) rc = shared_operand(m, &L->down_proj, &a->in_down, a->a, &xr);
    else if (act != a->a) ml_be_free(m->be, act);
  }
  ml_act d; /* into x, which has room for the output edge's unsharded [B, S, H] */
  if (!rc) rc = ml_linear_forward(m->be, &L->down_proj, &a->in_down, &xr, x, &d);  // [B, s_res, H]
  ml_linear_operand_free(m->be, &xr);
  ML_TRY(rc);
  return expect_view(L->down_proj.weight->name, &d, m->s_res, m->cfg.hidden);
}

// x_mid [B, s_res, H] → x [B, s_res, H] = layer output (room for [B, S, H]; not read); with z
// non-NULL the output goes instead to z [B, s_res, H] (may be x), with round rounded to bf16
// values: the hand-off to the unit it enters and its cast (ML_CAST_OUT), in the residual add's
// pass
static int mlp_forward(ml_model *m, ml_layer *L, float *x, float *z, bool round) {
  ml_layer_acts *a = &L->acts;
  int64_t Tr = m->B * m->s_res, H = m->cfg.hidden;
  bool out_norm = L->mlp_out_norm.weight;
  if (L->moe.gate.weight) { /* the router and experts read h2 in fp32 */
    ML_TRY(norm_input(m, &L->mlp_norm, &L->moe.gate, a->x_mid, a->h2, a->rstd2, &a->in_gu, NULL));
    ML_TRY(ml_moe_forward(m, L, &a->in_gu, x));  // [B, s_res, H]
  } else {
    ML_TRY(dense_forward(m, L, x));
  }
  if (out_norm) { /* d: [B, s_res, H] saved; x = mlp_out_norm(d) */
    ML_TRY(copy_floats(m, a->d, x, Tr * H));
    ML_TRY(norm_fwd(m, &L->mlp_out_norm, a->d, x, a->rstd_d, Tr, H));
  }
  if (z && round) return ml_be_add_round_to(m->be, z, x, a->x_mid, NULL, Tr * H);
  if (z) return ml_be_add_to(m->be, z, x, a->x_mid, Tr * H);
  return add_inplace(m, x, a->x_mid, Tr * H);
}

// d [B, s_res, H]: grad of down_proj's output (bf16 when d16) → dh [B, s, H] (=) grad of in_gu
static int dense_backward(ml_model *m, ml_layer *L, ml_act *d, bool d16, float *dh) {
  ml_layer_acts *a = &L->acts;
  int64_t T = m->B * m->S;
  float *da = dh + T * m->cfg.hidden;
  /* dg, du: [B, s, I], bf16 under m->bf16_glu_grads (the layout model.c allocates) */
  ml_dtype d_type = m->bf16_glu_grads ? ML_BF16 : ML_F32;
  void *dg = da + T * m->cap_i, *du = (char *)dg + (size_t)(T * m->cap_i) * ml_dtype_size(d_type);
  ml_xr xr = {.p = m->bf16_inputs ? a->a : NULL}; /* a in bf16, or the GEMM rounds */
  ML_TRY(linear_backward(m, d16, &L->down_proj, d, &a->in_down, &xr, da, 0));  // da: [B, s, I]
  ml_act dav = on(a->in_down, da);
  ML_TRY(ml_hook_run(L->down_proj.in.bwd, &dav));
  ML_TRY(expect_view(L->down_proj.weight->name, &dav, a->gv.s, a->gv.c));
  int64_t n = a->gv.B * a->gv.s * a->gv.c;
  if (m->bf16_mlp) /* g, u saved in bf16 */
    ML_TRY(ml_be_glu_bwd_bf16(m->be, da, a->g, a->u, dg, du, d_type, n, m->cfg.family->act));
  else
    ML_TRY(ml_be_glu_bwd(m->be, da, a->g, a->u, dg, du, n, m->cfg.family->act));
  ml_act dgv = on(a->gv, dg), duv = on(a->gv, du);
  ml_xr xg; /* in_gu rounded for both dW GEMMs (bf16 weights) */
  ML_TRY(saved_operand(m, &L->gate_proj, &a->in_gu, a->h2, &xg));
  bool g16 = m->bf16_glu_grads;
  int rc = linear_backward(m, g16, &L->gate_proj, &dgv, &a->in_gu, &xg, dh, 0);  // dh: [B, s, H]
  if (!rc) rc = linear_backward(m, g16, &L->up_proj, &duv, &a->in_gu, &xg, dh, 1);
  ml_linear_operand_free(m->be, &xg);
  return rc;
}

// dx: [B, s_res, H] grad of the layer output in (cast: ML_CAST_IN, rounded to bf16 first, or
// ML_CAST_IN_FUSED, already), grad of x_mid out
static int mlp_backward(ml_model *m, ml_layer *L, float *dx, unsigned cast) {
  ml_layer_acts *a = &L->acts;
  int64_t T = m->B * m->S, Tr = m->B * m->s_res, H = m->cfg.hidden;
  float *dtmp = m->scratch, *dh = dtmp + T * H;
  const ml_linear *down = mlp_down(L); /* NULL: the experts' */
  /* the unit boundary's cast, in the pass that also writes down_proj's bf16 dy into dtmp
   * where out_grad would convert dx (ahead: done): here after the recompute, which uses
   * dtmp, or by the layer above's add (ML_CAST_IN_FUSED) */
  bool ahead = (cast & (ML_CAST_IN | ML_CAST_IN_FUSED)) && boundary_dy_bf16(L);
  if (cast & ML_CAST_IN)
    ML_TRY(ml_be_round_bf16_to(m->be, dx, dx, ahead ? dtmp : NULL, (size_t)(Tr * H)));
  bool d16; /* dy: d down [B, s_res, H], fp32 (dtmp or dx) or bf16 (dtmp) */
  float *dy;
  ML_TRY(out_grad(m, &L->mlp_out_norm, a->d, a->rstd_d, down, dx, ahead, dtmp, &dy, &d16));
  ml_act d = ml_act_view(m, dy, m->s_res, H, H);
  if (!down) ML_TRY(ml_moe_backward(m, L, &a->in_gu, dy, dh));  // dh: [B, s, H]
  else ML_TRY(dense_backward(m, L, &d, d16, dh));
  /* o_proj's bf16 dy, the sum rounded, stored by the add into dtmp (dead now), where
   * attention_backward, next, reads it (its out_grad with ahead) */
  void *o16 = out_grad_bf16(&L->attn_out_norm, &L->o_proj) ? (void *)dtmp : NULL;
  return block_input_backward(m, mlp_first(L), &a->in_gu, dh, &L->mlp_norm, a->x_mid, a->rstd2,
                              dx, o16, false);  // dx += d x_mid
}

/* An error unless the cast flags (model.h ml_layer_cast) of layer l's forward (backward: true)
 * combine: at most one way the input is cast, the backward's output cast into a layer below,
 * and no rounding flag under ML_CAST_FP32, a forward's alone. */
static int check_cast(const ml_model *m, int l, unsigned cast, bool backward) {
  if ((cast & ML_CAST_IN) && (cast & ML_CAST_IN_FUSED))
    return ml_err("decoder layer %d: cast flags %#x cast the input twice (ML_CAST_IN and "
                  "ML_CAST_IN_FUSED); expected at most one",
                  l, cast);
  if ((cast & ML_CAST_FP32) && (backward || (cast & ML_CAST_IN)))
    return ml_err("decoder layer %d: cast flags %#x keep fp32 (ML_CAST_FP32) %s; expected it "
                  "in a forward without ML_CAST_IN",
                  l, cast, backward ? "in the backward" : "but round the input (ML_CAST_IN)");
  if (backward && (cast & ML_CAST_OUT) && l == 0)
    return ml_err("decoder layer 0: ML_CAST_OUT in the backward, but no decoder layer is below "
                  "it; expected it on layers 1 .. %lld only",
                  (long long)m->cfg.n_layers - 1);
  return 0;
}

// x: [B, s_res, H] in place, or under ML_CAST_OUT below the last layer into layer l + 1's x_in
// (the input: x, or under ML_CAST_IN_FUSED the saved x_in), rounded unless ML_CAST_FP32
int ml_layer_forward(ml_model *m, int l, float *x, unsigned cast) {
  ml_layer *L = &m->layers[l];
  int64_t n = m->B * m->s_res * m->cfg.hidden;
  ML_TRY(check_cast(m, l, cast, false));
  float *out = NULL; /* ML_CAST_OUT: where the unit above reads its cast input */
  if (cast & ML_CAST_OUT) out = l + 1 < m->cfg.n_layers ? m->layers[l + 1].acts.x_in : x;
  if (cast & ML_CAST_IN) ML_TRY(ml_be_round_bf16_to(m->be, x, L->acts.x_in, NULL, (size_t)n));
  else if (!(cast & ML_CAST_IN_FUSED)) ML_TRY(copy_floats(m, L->acts.x_in, x, n));
  ML_TRY(attention_forward(m, L, x));
  return mlp_forward(m, L, x, out, !(cast & ML_CAST_FP32));
}

/* Activation checkpointing: rerun the forward of what m->ac dropped into
 * the workspace, from the saved x_in (ML_AC_LAYER), x_mid (ML_AC_MLP) or
 * q, k, v (ML_AC_SELECTIVE), edges and their collectives included, as
 * torch.utils.checkpoint reruns the module; the output is discarded: a->out
 * in fp32, never another layer's x_in. The backward scratch's first
 * [B, s_res, H] bf16 is not written: it may hold this layer's down_proj dy
 * (ML_CAST_IN_FUSED). */
static int recompute(ml_model *m, ml_layer *L) {
  ml_layer_acts *a = &L->acts;
  if (m->ac == ML_AC_SELECTIVE) /* attn_saved; att into the scratch's datt room, dropped */
    ML_TRY(core_forward(m, L, scratch_datt(m)));
  if (m->ac == ML_AC_LAYER) ML_TRY(attention_forward(m, L, a->out));
  if (m->ac == ML_AC_LAYER || m->ac == ML_AC_MLP) ML_TRY(mlp_forward(m, L, a->out, NULL, false));
  return 0;
}

// dx: [B, s_res, H] in place (mlp_backward's add leaves o_proj's bf16 dy for attention_backward)
int ml_layer_backward(ml_model *m, int l, float *dx, unsigned cast) {
  ml_layer *L = &m->layers[l];
  ML_TRY(check_cast(m, l, cast, true));
  ML_TRY(recompute(m, L));
  ML_TRY(mlp_backward(m, L, dx, cast));
  return attention_backward(m, L, dx, (cast & ML_CAST_OUT) ? &m->layers[l - 1] : NULL);
}
