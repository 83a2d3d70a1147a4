/* The decoder block as data: one table of the modules of a decoder layer
 * (HF *DecoderLayer's submodules, in execution order), which every part of
 * the engine that walks a layer reads instead of writing the block out
 * again:
 *  - model construction (model.c) builds each present row's module and
 *    parameters, named and keyed as the row says;
 *  - the parameter count (ml_model_config_num_params) and the capacities of
 *    the model's and the TP walk's arrays are sums over the rows;
 *  - the TP walk (parallel/tp_walk.c) finds each module's struct, its plan
 *    rule and its linear group (the linears reading one activation share one
 *    input edge) through the rows;
 *  - forward/backward (layer.c) computes on the ml_layer fields the rows
 *    point at; a row that is absent for a family leaves its field's weight
 *    NULL, which the forward reads as the identity (absent norms).
 * A family differs from another by which rows are present (norm names,
 * q/k norms, biases: ml_block_present) and by how its checkpoint stores the
 * rows' parameters (fused tensors: ml_family.fused, split on load and fused
 * on export by the checkpoint-key adapter, ml_model_ckpt_keys) — never by
 * an `if family`. Semantics: transformers' LlamaDecoderLayer, Qwen2/3,
 * Gemma3DecoderLayer, MistralDecoderLayer, Phi3DecoderLayer (unfused),
 * Qwen3MoeDecoderLayer, Qwen2MoeDecoderLayer and MixtralDecoderLayer (a
 * sparse layer: the rows without the dense gate/up/down, its ml_moe after
 * the mlp container). */
#ifndef ML_BLOCK_H
#define ML_BLOCK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

/* A size of the block, from the config. */
typedef enum {
  ML_SZ_NONE,     /* no second dim (a norm's weight, a bias) */
  ML_SZ_HIDDEN,   /* hidden_size H */
  ML_SZ_Q,        /* num_attention_heads · head_dim */
  ML_SZ_KV,       /* num_key_value_heads · head_dim */
  ML_SZ_INTER,    /* intermediate_size I */
  ML_SZ_HEAD_DIM, /* head_dim (per-head norms) */
} ml_block_size;

/* Which config switch gives a Linear row its bias. */
typedef enum { ML_BIAS_NONE, ML_BIAS_QKV, ML_BIAS_O, ML_BIAS_MLP } ml_block_bias;

/* How TP cuts a Linear row's weight by whole attention heads (parallel/tp.h
 * ml_tp_heads) instead of torch.chunk: the rows of query heads (q_proj), of
 * key/value heads (k_proj, v_proj), or the columns of query heads (o_proj). */
typedef enum { ML_HEADS_NONE, ML_HEADS_Q_ROWS, ML_HEADS_KV_ROWS, ML_HEADS_Q_COLS } ml_block_heads;

/* A Linear row's style in the Llama-style plans (parallel/plan.c:
 * torchtitan's and NeMo's parallelize_llama): ColwiseParallel for the
 * linears that fan out of the residual stream, RowwiseParallel for those
 * that return to it. */
typedef enum { ML_TP_NONE, ML_TP_COLWISE, ML_TP_ROWWISE } ml_block_tp;

/* The module kinds of the rows (ML_MOD_ATTENTION / ML_MOD_MLP rows are the
 * containers self_attn and mlp: no parameters, a name for plans). */
typedef enum {
  ML_ROLE_ATTN_NORM,     /* RMSNorm before attention (family->attn_norm) */
  ML_ROLE_ATTN,          /* the self_attn container */
  ML_ROLE_Q, ML_ROLE_K, ML_ROLE_V, /* q/k/v_proj: one linear group */
  ML_ROLE_Q_NORM, ML_ROLE_K_NORM,  /* per-head RMSNorm (family->has_qk_norm) */
  ML_ROLE_O,             /* o_proj */
  ML_ROLE_ATTN_OUT_NORM, /* RMSNorm on the attention output (family->attn_out_norm) */
  ML_ROLE_MLP_NORM,      /* RMSNorm before the MLP (family->mlp_norm) */
  ML_ROLE_MLP,           /* the mlp container */
  ML_ROLE_GATE, ML_ROLE_UP, /* gate/up_proj: one linear group */
  ML_ROLE_DOWN,          /* down_proj */
  ML_ROLE_MLP_OUT_NORM,  /* RMSNorm on the MLP output (family->mlp_out_norm) */
  ML_ROLE_COUNT
} ml_block_role;

typedef struct ml_block_row {
  ml_block_role role;
  ml_module_kind kind;
  const char *leaf;     /* name under "layers.N.": "self_attn.q_proj"; NULL: the family's
                           name for this norm role (ml_block_leaf) */
  size_t field;         /* offsetof(ml_layer, the module's struct) */
  ml_block_size out, in; /* Linear weight [out, in]; RMSNorm weight [out] */
  ml_block_bias bias;
  int group;            /* linears reading one activation share a group id (> 0); 0: alone */
  ml_block_tp tp;       /* Linear: its style in the Llama-style plans */
  ml_block_heads heads; /* Linear: cut by whole heads when TP shards it */
} ml_block_row;

/* The parts of a layer by the saved activations they produce: its input,
 * the attention block (all but its core), the attention core, the MLP
 * block; and the layer output a recompute writes and discards. An
 * activation-checkpointing mode keeps some parts per layer and recomputes
 * the others into a workspace all layers share (model.h ml_ac_mode). */
typedef enum {
  ML_PART_INPUT = 1, ML_PART_ATTN = 2, ML_PART_CORE = 4, ML_PART_MLP = 8,
  ML_PART_ALL = 15, ML_PART_OUT = 16
} ml_block_part;

/* A saved-activation buffer's extent: rows of tokens (all T = B·S, or the
 * residual stream's Tr = B·s_res) times columns. */
typedef enum { ML_ROWS_T, ML_ROWS_TR } ml_block_rows_of;
typedef enum {
  ML_COLS_ONE,   /* one float a token (a norm's rstd) */
  ML_COLS_H,     /* hidden_size */
  ML_COLS_Q,     /* the widest local q / attention output view */
  ML_COLS_KV,    /* the widest local k / v view */
  ML_COLS_I,     /* the widest local gate / up / act view */
  ML_COLS_NH,    /* local query heads (a per-head norm's rstd) */
  ML_COLS_NKV,   /* local key/value heads */
  ML_COLS_CORE,  /* what the attention core saves for the whole batch (not per token) */
  ML_COLS_E,     /* num_experts (a sparse layer's router) */
  ML_COLS_K,     /* num_experts_per_tok */
  ML_COLS_KH,    /* num_experts_per_tok · hidden_size (an expert output per choice) */
  ML_COLS_SI,    /* shared_expert_intermediate_size (a sparse block's shared expert) */
} ml_block_cols;

/* ml_block_act.needs of the buffers only sparse layers use: present when
 * the model has one (config.h ml_config_moe_layer). */
enum { ML_NEEDS_SPARSE = -2 };
/* ml_block_act.needs of the shared expert's buffers: present when the
 * model's sparse blocks have one (config.h shared_inter > 0). */
enum { ML_NEEDS_SHARED = -3 };

/* One buffer of ml_layer_acts that the forward saves for the backward. */
typedef struct ml_block_act {
  size_t field;          /* offsetof(ml_layer_acts, the buffer) */
  ml_block_part part;
  ml_block_rows_of rows;
  ml_block_cols cols;
  int needs;             /* the role (ml_block_role) whose module must be present, −1
                            (always there), ML_NEEDS_SPARSE or ML_NEEDS_SHARED */
  bool bf16_input;       /* a GEMM input, kept as bf16 under ml_model_bf16_inputs */
  bool bf16_att;         /* attention's output (o_proj's input), bf16 under ml_model_bf16_att */
  bool bf16_mlp;         /* gate/up's output, kept as bf16 under ml_model_bf16_mlp */
  bool bf16_qkv;         /* attention's q, k, v, kept as bf16 under ml_model_bf16_qkv */
} ml_block_act;

/* The saved buffers of a layer in carve order (x_in first: it frees the
 * layer's block), and their count. The layer output `out` (ML_PART_OUT) is
 * there only when the MLP is recomputed. */
extern const ml_block_act ml_block_acts[];
extern const int ml_block_n_acts;

/* The rows, in execution order (the order modules and parameters are
 * created, listed by plans and reports, and stored in run checkpoints). */
extern const ml_block_row ml_block_rows[ML_ROLE_COUNT];

/* The row of `role`. */
const ml_block_row *ml_block_row_of(ml_block_role role);

/* The struct of row r in layer L: ml_linear for Linear rows, ml_rmsnorm
 * for RMSNorm rows (its weight NULL when the family lacks it). */
static inline void *ml_block_at(ml_layer *L, const ml_block_row *r) {
  return (char *)L + r->field;
}

/* The row whose struct in a layer is `ptr` (ml_layer_of tells the layer),
 * or NULL: ptr lies in no module of the layers array. *layer: its layer. */
const ml_block_row *ml_block_row_at(const ml_model *m, const void *ptr, int *layer);

/* The Linear row called `leaf` ("self_attn.q_proj"), or NULL. */
const ml_block_row *ml_block_linear(const char *leaf);

/* The linears of layer L in group g (ml_block_row.group > 0), in table
 * order, into out (room for ML_ROLE_COUNT); returns their count. */
int ml_block_group(ml_layer *L, int g, ml_linear **out);

/* The row's module name under "layers.N." for family f ("input_layernorm",
 * "self_attn.q_norm"), or NULL when f's block lacks it. */
const char *ml_block_leaf(const ml_family *f, const ml_block_row *r);

/* The row's module name in layer l of c: ml_block_leaf, but in a sparse
 * layer (config.h ml_config_moe_layer) the mlp container is the family's
 * moe_block ("block_sparse_moe") and the dense gate/up/down rows are absent
 * (NULL): the layer's sparse block (model.h ml_moe) takes their place. */
const char *ml_block_leaf_at(const ml_model_config *c, const ml_block_row *r, int64_t l);

/* Whether layer l of c has the row (ml_block_leaf_at non-NULL). */
bool ml_block_present_at(const ml_model_config *c, const ml_block_row *r, int64_t l);

/* Whether some layer of c has the row. */
bool ml_block_present(const ml_model_config *c, const ml_block_row *r);

/* The config size s. */
int64_t ml_block_dim(const ml_model_config *c, ml_block_size s);

/* Whether a Linear row of c has a bias. */
bool ml_block_has_bias(const ml_model_config *c, const ml_block_row *r);

/* The most parameters (tensors, not elements) of one layer of c (a sparse
 * layer's router, experts and shared expert included), and the elements of layer l (<
 * 2^47 for a config ml_model_config_load accepts, config.h). */
int ml_block_n_params(const ml_model_config *c);
int64_t ml_block_numel_at(const ml_model_config *c, int64_t l);

/* The most modules of one layer of c (present rows, containers included;
 * a sparse layer's router and expert linears). */
int ml_block_n_modules(const ml_model_config *c);

/* The most linears of one layer of c. */
int ml_block_n_linears(const ml_model_config *c);

#endif
