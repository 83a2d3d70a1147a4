#include "model/block.h"

#include <stddef.h>
#include <string.h>

#include "model/model.h"

#define LIN(r, name, fld, o, i, b, g, style, cut)                                                \
  {.role = r, .kind = ML_MOD_LINEAR, .leaf = name, .field = offsetof(ml_layer, fld), .out = o,   \
   .in = i, .bias = b, .group = g, .tp = style, .heads = cut}
#define NORM(r, name, fld, dim)                                                                  \
  {.role = r, .kind = ML_MOD_RMSNORM, .leaf = name, .field = offsetof(ml_layer, fld), .out = dim}
#define BOX(r, k, name) {.role = r, .kind = k, .leaf = name}

enum { GROUP_QKV = 1, GROUP_GATE_UP = 2 };

/* HF's decoder layer, in execution order (LlamaDecoderLayer.forward;
 * Gemma3's sandwich norms where the family names them). */
const ml_block_row ml_block_rows[ML_ROLE_COUNT] = {
    NORM(ML_ROLE_ATTN_NORM, NULL, attn_norm, ML_SZ_HIDDEN),
    BOX(ML_ROLE_ATTN, ML_MOD_ATTENTION, "self_attn"),
    LIN(ML_ROLE_Q, "self_attn.q_proj", q_proj, ML_SZ_Q, ML_SZ_HIDDEN, ML_BIAS_QKV, GROUP_QKV,
        ML_TP_COLWISE, ML_HEADS_Q_ROWS),
    LIN(ML_ROLE_K, "self_attn.k_proj", k_proj, ML_SZ_KV, ML_SZ_HIDDEN, ML_BIAS_QKV, GROUP_QKV,
        ML_TP_COLWISE, ML_HEADS_KV_ROWS),
    LIN(ML_ROLE_V, "self_attn.v_proj", v_proj, ML_SZ_KV, ML_SZ_HIDDEN, ML_BIAS_QKV, GROUP_QKV,
        ML_TP_COLWISE, ML_HEADS_KV_ROWS),
    NORM(ML_ROLE_Q_NORM, NULL, q_norm, ML_SZ_HEAD_DIM),
    NORM(ML_ROLE_K_NORM, NULL, k_norm, ML_SZ_HEAD_DIM),
    LIN(ML_ROLE_O, "self_attn.o_proj", o_proj, ML_SZ_HIDDEN, ML_SZ_Q, ML_BIAS_O, 0,
        ML_TP_ROWWISE, ML_HEADS_Q_COLS),
    NORM(ML_ROLE_ATTN_OUT_NORM, NULL, attn_out_norm, ML_SZ_HIDDEN),
    NORM(ML_ROLE_MLP_NORM, NULL, mlp_norm, ML_SZ_HIDDEN),
    BOX(ML_ROLE_MLP, ML_MOD_MLP, "mlp"),
    LIN(ML_ROLE_GATE, "mlp.gate_proj", gate_proj, ML_SZ_INTER, ML_SZ_HIDDEN, ML_BIAS_MLP,
        GROUP_GATE_UP, ML_TP_COLWISE, ML_HEADS_NONE),
    LIN(ML_ROLE_UP, "mlp.up_proj", up_proj, ML_SZ_INTER, ML_SZ_HIDDEN, ML_BIAS_MLP,
        GROUP_GATE_UP, ML_TP_COLWISE, ML_HEADS_NONE),
    LIN(ML_ROLE_DOWN, "mlp.down_proj", down_proj, ML_SZ_HIDDEN, ML_SZ_INTER, ML_BIAS_MLP, 0,
        ML_TP_ROWWISE, ML_HEADS_NONE),
    NORM(ML_ROLE_MLP_OUT_NORM, NULL, mlp_out_norm, ML_SZ_HIDDEN),
};

#define ACT(fld, pt, r, c, need)                                                               \
  {.field = offsetof(ml_layer_acts, fld), .part = pt, .rows = r, .cols = c, .needs = need}
/* an input of bf16 GEMMs (ml_block_act.bf16_input) */
#define GEMM_IN(fld, pt, c)                                                                    \
  {.field = offsetof(ml_layer_acts, fld), .part = pt, .rows = ML_ROWS_T, .cols = c,            \
   .needs = -1, .bf16_input = true}

/* gate_proj's or up_proj's output (ml_block_act.bf16_mlp) */
#define MLP_OUT(fld)                                                                           \
  {.field = offsetof(ml_layer_acts, fld), .part = ML_PART_MLP, .rows = ML_ROWS_T,              \
   .cols = ML_COLS_I, .needs = -1, .bf16_mlp = true}

/* attention's q, k or v (ml_block_act.bf16_qkv) */
#define QKV(fld, c)                                                                            \
  {.field = offsetof(ml_layer_acts, fld), .part = ML_PART_ATTN, .rows = ML_ROWS_T, .cols = c,  \
   .needs = -1, .bf16_qkv = true}

/* What layer.c's forward saves (ml_layer_acts), by the part producing it. */
const ml_block_act ml_block_acts[] = {
    ACT(x_in, ML_PART_INPUT, ML_ROWS_TR, ML_COLS_H, -1),
    ACT(rstd1, ML_PART_ATTN, ML_ROWS_TR, ML_COLS_ONE, -1),
    GEMM_IN(h1, ML_PART_ATTN, ML_COLS_H),
    ACT(q_raw, ML_PART_ATTN, ML_ROWS_T, ML_COLS_Q, ML_ROLE_Q_NORM),
    ACT(k_raw, ML_PART_ATTN, ML_ROWS_T, ML_COLS_KV, ML_ROLE_K_NORM),
    ACT(rstd_q, ML_PART_ATTN, ML_ROWS_T, ML_COLS_NH, ML_ROLE_Q_NORM),
    ACT(rstd_k, ML_PART_ATTN, ML_ROWS_T, ML_COLS_NKV, ML_ROLE_K_NORM),
    QKV(q, ML_COLS_Q),
    QKV(k, ML_COLS_KV),
    QKV(v, ML_COLS_KV),
    ACT(attn_saved, ML_PART_CORE, ML_ROWS_T, ML_COLS_CORE, -1),
    {.field = offsetof(ml_layer_acts, att), .part = ML_PART_ATTN, .rows = ML_ROWS_T,
     .cols = ML_COLS_Q, .needs = -1, .bf16_att = true},
    ACT(o, ML_PART_ATTN, ML_ROWS_TR, ML_COLS_H, ML_ROLE_ATTN_OUT_NORM),
    ACT(rstd_o, ML_PART_ATTN, ML_ROWS_TR, ML_COLS_ONE, ML_ROLE_ATTN_OUT_NORM),
    ACT(x_mid, ML_PART_ATTN, ML_ROWS_TR, ML_COLS_H, -1),
    ACT(rstd2, ML_PART_MLP, ML_ROWS_TR, ML_COLS_ONE, -1),
    GEMM_IN(h2, ML_PART_MLP, ML_COLS_H),
    MLP_OUT(g),
    MLP_OUT(u),
    GEMM_IN(a, ML_PART_MLP, ML_COLS_I),
    ACT(d, ML_PART_MLP, ML_ROWS_TR, ML_COLS_H, ML_ROLE_MLP_OUT_NORM),
    ACT(rstd_d, ML_PART_MLP, ML_ROWS_TR, ML_COLS_ONE, ML_ROLE_MLP_OUT_NORM),
    ACT(out, ML_PART_OUT, ML_ROWS_T, ML_COLS_H, -1),
    ACT(probs, ML_PART_MLP, ML_ROWS_T, ML_COLS_E, ML_NEEDS_SPARSE),
    ACT(top_e, ML_PART_MLP, ML_ROWS_T, ML_COLS_K, ML_NEEDS_SPARSE),
    ACT(top_w, ML_PART_MLP, ML_ROWS_T, ML_COLS_K, ML_NEEDS_SPARSE),
    ACT(ye, ML_PART_MLP, ML_ROWS_T, ML_COLS_KH, ML_NEEDS_SPARSE),
    ACT(sg, ML_PART_MLP, ML_ROWS_T, ML_COLS_SI, ML_NEEDS_SHARED),
    ACT(su, ML_PART_MLP, ML_ROWS_T, ML_COLS_SI, ML_NEEDS_SHARED),
    ACT(sa, ML_PART_MLP, ML_ROWS_T, ML_COLS_SI, ML_NEEDS_SHARED),
    ACT(sy, ML_PART_MLP, ML_ROWS_T, ML_COLS_H, ML_NEEDS_SHARED),
    ACT(sz, ML_PART_MLP, ML_ROWS_T, ML_COLS_ONE, ML_NEEDS_SHARED),
};
const int ml_block_n_acts = sizeof ml_block_acts / sizeof ml_block_acts[0];

const ml_block_row *ml_block_row_of(ml_block_role role) { return &ml_block_rows[role]; }

const char *ml_block_leaf(const ml_family *f, const ml_block_row *r) {
  switch (r->role) {
  case ML_ROLE_ATTN_NORM: return f->attn_norm;
  case ML_ROLE_ATTN_OUT_NORM: return f->attn_out_norm;
  case ML_ROLE_MLP_NORM: return f->mlp_norm;
  case ML_ROLE_MLP_OUT_NORM: return f->mlp_out_norm;
  case ML_ROLE_Q_NORM: return f->has_qk_norm ? "self_attn.q_norm" : NULL;
  case ML_ROLE_K_NORM: return f->has_qk_norm ? "self_attn.k_norm" : NULL;
  default: return r->leaf;
  }
}

const ml_block_row *ml_block_row_at(const ml_model *m, const void *ptr, int *layer) {
  const char *p = ptr, *base = (const char *)m->layers;
  size_t size = sizeof(ml_layer);
  if (!m->layers || p < base || p >= base + size * (size_t)m->cfg.n_layers) return NULL;
  *layer = (int)((size_t)(p - base) / size);
  size_t off = (size_t)(p - base) % size;
  for (int i = 0; i < ML_ROLE_COUNT; i++)
    if (ml_block_rows[i].field == off && ml_block_rows[i].kind != ML_MOD_ATTENTION &&
        ml_block_rows[i].kind != ML_MOD_MLP)
      return &ml_block_rows[i];
  return NULL;
}

const ml_block_row *ml_block_linear(const char *leaf) {
  for (int i = 0; i < ML_ROLE_COUNT; i++)
    if (ml_block_rows[i].kind == ML_MOD_LINEAR && strcmp(ml_block_rows[i].leaf, leaf) == 0)
      return &ml_block_rows[i];
  return NULL;
}

int ml_block_group(ml_layer *L, int g, ml_linear **out) {
  int n = 0;
  for (int i = 0; i < ML_ROLE_COUNT; i++)
    if (ml_block_rows[i].kind == ML_MOD_LINEAR && ml_block_rows[i].group == g)
      out[n++] = ml_block_at(L, &ml_block_rows[i]);
  return n;
}

/* The dense MLP's rows: absent from a sparse layer. */
static bool dense_mlp_row(const ml_block_row *r) {
  return r->role == ML_ROLE_GATE || r->role == ML_ROLE_UP || r->role == ML_ROLE_DOWN;
}

const char *ml_block_leaf_at(const ml_model_config *c, const ml_block_row *r, int64_t l) {
  if (!ml_config_moe_layer(c, l)) return ml_block_leaf(c->family, r);
  if (r->role == ML_ROLE_MLP) return c->family->moe_block;
  return dense_mlp_row(r) ? NULL : ml_block_leaf(c->family, r);
}

bool ml_block_present_at(const ml_model_config *c, const ml_block_row *r, int64_t l) {
  return ml_block_leaf_at(c, r, l) != NULL;
}

bool ml_block_present(const ml_model_config *c, const ml_block_row *r) {
  for (int64_t l = 0; l < c->n_layers; l++)
    if (ml_block_present_at(c, r, l)) return true;
  return false;
}

int64_t ml_block_dim(const ml_model_config *c, ml_block_size s) {
  switch (s) {
  case ML_SZ_HIDDEN: return c->hidden;
  case ML_SZ_Q: return c->n_heads * c->head_dim;
  case ML_SZ_KV: return c->n_kv_heads * c->head_dim;
  case ML_SZ_INTER: return c->intermediate;
  case ML_SZ_HEAD_DIM: return c->head_dim;
  default: return 0;
  }
}

bool ml_block_has_bias(const ml_model_config *c, const ml_block_row *r) {
  switch (r->bias) {
  case ML_BIAS_QKV: return c->qkv_bias;
  case ML_BIAS_O: return c->o_bias;
  case ML_BIAS_MLP: return c->mlp_bias;
  default: return false;
  }
}

/* Tensors (what = 0), elements (1), modules (2) or linears (3) of layer l:
 * its present rows, and a sparse layer's router [E, H], experts (gate,
 * up [I_e, H], down [H, I_e] each) and shared expert (gate, up [I_s, H],
 * down [H, I_s], its gate [1, H]; Linear modules without bias). */
static int64_t count(const ml_model_config *c, int64_t l, int what) {
  int64_t n = 0;
  for (int i = 0; i < ML_ROLE_COUNT; i++) {
    const ml_block_row *r = &ml_block_rows[i];
    if (!ml_block_present_at(c, r, l)) continue;
    bool lin = r->kind == ML_MOD_LINEAR, bias = lin && ml_block_has_bias(c, r);
    int64_t out = ml_block_dim(c, r->out), in = ml_block_dim(c, r->in);
    if (what == 0) n += r->kind == ML_MOD_LINEAR || r->kind == ML_MOD_RMSNORM ? 1 + bias : 0;
    if (what == 1) n += (lin ? out * in : out) + (bias ? out : 0);
    if (what == 2) n++;
    if (what == 3) n += lin;
  }
  if (!ml_config_moe_layer(c, l)) return n;
  int64_t E = c->n_experts, shared = c->shared_inter > 0;
  /* E · H · (1 + 3 I_e) + H · (1 + 3 I_s) <= 2^20 · (2^12 + 3 · 2^24) + 2^20 · (1 + 3 · 2^24)
   * < 2^47 (config.h) */
  return n + (what == 1 ? E * c->hidden * (1 + 3 * c->moe_inter) +
                              shared * c->hidden * (1 + 3 * c->shared_inter)
                        : 1 + 3 * E + 4 * shared);
}

/* The most of `what` in one layer of c. */
static int64_t count_max(const ml_model_config *c, int what) {
  int64_t most = 0;
  for (int64_t l = 0; l < c->n_layers; l++) {
    int64_t n = count(c, l, what);
    most = n > most ? n : most;
  }
  return most;
}

int ml_block_n_params(const ml_model_config *c) { return (int)count_max(c, 0); }
int64_t ml_block_numel_at(const ml_model_config *c, int64_t l) { return count(c, l, 1); }
int ml_block_n_modules(const ml_model_config *c) { return (int)count_max(c, 2); }
int ml_block_n_linears(const ml_model_config *c) { return (int)count_max(c, 3); }
