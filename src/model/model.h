/* The decoder: HF module tree (names, parameters) and per-module forward /
 * backward, following transformers' LlamaForCausalLM / Qwen2ForCausalLM
 * (modeling_llama.py, modeling_qwen2.py) in fp32.
 *
 * The model knows nothing of parallelism (DESIGN §1). What parallel/ may
 * change from outside, as torch's parallelize_module does:
 *  - each parameter's TP placement and local shape (ml_param.tp_dim,
 *    tp_start, local); the model computes with whatever local slice it holds:
 *    attention derives its local head counts from q/k_proj's local rows,
 *    the embedding looks up only the vocab rows it holds (ids outside give 0),
 *    lm_head produces the logits of its local vocab rows;
 *  - the data/grad pointers of parameters (FSDP materialises them per unit);
 *  - hooks at module edges (ml_hook), run on activations in place, forward
 *    and backward, like torch's forward pre-/post-hooks and their autograd.
 *
 * Activation layout: [T, D] row-major, T = B·S tokens of the local batch,
 * the S tokens of a sequence in consecutive rows. */
#ifndef ML_MODEL_H
#define ML_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "model/config.h"

typedef struct ml_param {
  char name[160];     /* HF name: model.layers.0.self_attn.q_proj.weight */
  int ndim;           /* 1 or 2 */
  int64_t shape[2];   /* global shape; shape[1] = 1 when ndim = 1 */
  int tp_dim;         /* -1 = Replicate over tp; 0 or 1 = Shard(tp_dim) */
  int64_t tp_start;   /* first global index along tp_dim held by this rank */
  int64_t local[2];   /* local shape (= shape unless sharded) */
  float *data;        /* [local[0], local[1]] while materialised, else NULL */
  float *grad;        /* same shape, during backward, else NULL */
  int unit;           /* FSDP unit: layer index, or n_layers for the root */
} ml_param;

static inline int64_t ml_param_numel(const ml_param *p) { return p->local[0] * p->local[1]; }

/* An in-place transformation of an activation [rows, cols] at a module edge
 * (a redistribute between placements that keeps the local shape). */
typedef struct ml_hook {
  int (*fn)(void *ctx, float *x, int64_t rows, int64_t cols);
  void *ctx;
} ml_hook;

typedef struct ml_linear {
  ml_param *weight; /* [out, in] */
  ml_param *bias;   /* [out] or NULL */
  bool bias_in_forward; /* false: another rank adds the bias (row-parallel Partial output) */
  /* in_*: the input activation (forward) / its gradient (backward);
   * out_*: the output activation / its gradient. Linears reading one shared
   * activation (q/k/v, gate/up) run the first one's input hooks once. */
  ml_hook in_fwd, in_bwd, out_fwd, out_bwd;
} ml_linear;

typedef struct ml_embedding {
  ml_param *weight; /* [V, H]; local rows tp_start .. tp_start+local[0]−1 */
  float scale;
  ml_hook out_fwd, out_bwd;
} ml_embedding;

typedef struct ml_rmsnorm {
  ml_param *weight; /* [H] */
  float eps, offset;
} ml_rmsnorm;

typedef struct ml_layer_acts {
  float *x_in, *rstd1, *h1, *q, *k, *v, *P, *att, *x_mid, *rstd2, *h2, *g, *u, *a;
} ml_layer_acts;

typedef struct ml_layer {
  ml_rmsnorm input_layernorm, post_attention_layernorm;
  ml_linear q_proj, k_proj, v_proj, o_proj;
  ml_linear gate_proj, up_proj, down_proj;
  ml_layer_acts acts;
} ml_layer;

typedef enum { ML_MOD_LINEAR, ML_MOD_EMBEDDING, ML_MOD_RMSNORM } ml_module_kind;

typedef struct ml_module {
  char name[128]; /* HF module name: model.layers.0.self_attn.q_proj */
  ml_module_kind kind;
  void *ptr; /* ml_linear*, ml_embedding* or ml_rmsnorm* */
} ml_module;

typedef struct ml_model {
  ml_model_config cfg;
  ml_embedding embed_tokens;
  ml_layer *layers;
  ml_rmsnorm norm;
  ml_linear lm_head; /* weight = embed_tokens.weight when tied */
  ml_param *params;  /* every parameter once (tied lm_head not repeated) */
  int n_params;
  ml_module *modules; /* every leaf module, in HF order */
  int n_modules;
  /* batch geometry and buffers, set by ml_model_begin */
  int64_t B, S;
  float *inv_freq, *rope_cos, *rope_sin;
  float *x_final, *rstd_final, *xn_final, *dxn_final;
  float *scratch; /* backward temporaries */
} ml_model;

/* Build the module tree of `cfg` (parameters described, no storage).
 * Errors: allocation. */
int ml_model_create(const ml_model_config *cfg, ml_model *m);
void ml_model_destroy(ml_model *m);

/* The module called `name`, or NULL. */
ml_module *ml_model_find_module(ml_model *m, const char *name);
/* The parameter called `name`, or NULL. */
ml_param *ml_model_find_param(ml_model *m, const char *name);

/* (Re)allocate activations for a local batch of B sequences of S tokens,
 * with the local shapes in effect (call after TP is applied). */
int ml_model_begin(ml_model *m, int64_t B, int64_t S);

/* Embedding lookup: ids [T] → x [T, H] (scaled; hooks run). */
int ml_embed_forward(ml_model *m, const int32_t *ids, float *x);
/* dx [T, H] → embedding weight grad (+=). dx is clobbered by hooks. */
int ml_embed_backward(ml_model *m, const int32_t *ids, float *dx);

/* Decoder layer l: x [T, H] residual stream in place; saves activations. */
int ml_layer_forward(ml_model *m, int l, float *x);
/* dx [T, H]: gradient of layer l's output in, of its input out; weight
 * grads accumulate (+=) into the layer's param->grad. */
int ml_layer_backward(ml_model *m, int l, float *dx);

/* Final norm on x [T, H] (saved), then lm_head's input hooks. */
int ml_head_begin(ml_model *m, const float *x);
/* logits [nt, V_local] for tokens t0 .. t0+nt−1 (lm_head output hooks run). */
int ml_head_forward(ml_model *m, int64_t t0, int64_t nt, float *logits);
/* Backward of ml_head_forward for the same tokens: dlogits [nt, V_local]
 * (clobbered by hooks); lm_head weight grad (+=); the input grad is kept. */
int ml_head_backward(ml_model *m, int64_t t0, int64_t nt, float *dlogits);
/* After every chunk's backward: lm_head input hooks, final norm backward
 * → dx [T, H] (=). */
int ml_head_end_backward(ml_model *m, float *dx);

/* The vocab rows lm_head holds: global ids v0 .. v0 + *nv − 1. */
void ml_model_vocab_shard(const ml_model *m, int64_t *v0, int64_t *nv);

#endif
