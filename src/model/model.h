/* The decoder: HF module tree (names, parameters) and per-module forward /
 * backward, following transformers' LlamaForCausalLM, MistralForCausalLM,
 * Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM, the
 * text tower of Gemma3ForConditionalGeneration, Qwen3MoeForCausalLM and
 * MixtralForCausalLM (their modeling_*.py) in fp32. What differs between them is read from the family descriptor
 * (model/family.h); the layer's modules are the rows of the block table
 * (model/block.h).
 *
 * The model knows nothing of parallelism (ARCHITECTURE.md §1). What parallel/ may
 * change from outside, as torch's parallelize_module does:
 *  - each parameter's local view of its global tensor (ml_param.local,
 *    offset), as a DTensor's local tensor: the model computes with whatever
 *    local slice it holds: attention derives its local head counts from
 *    q/k_proj's local rows, the embedding looks up only the vocab rows it
 *    holds (ids outside give 0), lm_head produces the logits of its local
 *    vocab rows;
 *  - the data/grad pointers of parameters (FSDP materialises them);
 *  - hooks at module edges (ml_edge), run on activations forward and on
 *    their gradients backward; they may reshape the local view (gather or
 *    scatter the sequence or the features), e.g. the residual stream may
 *    be sequence-sharded (Shard(1)) between layers.
 * The parallel state itself — placements, FSDP units, which gradients are
 * partial sums — lives in parallel/ (tp.h: ml_tp_param_dim,
 * ml_tp_grad_partial; fsdp.h: ml_fsdp_unit_of), never in the model.
 *
 * Activation layout: [B, s, c] row-major (ml_act), the s positions of a
 * sequence in consecutive rows; s = S unless sequence-sharded. */
#ifndef ML_MODEL_H
#define ML_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "model/config.h"
#include "tensor/act.h"

typedef struct ml_param {
  char name[160];     /* its name: model.layers.0.self_attn.q_proj.weight (the HF parameter
                         name, in composite checkpoints under family->ckpt_prefix); the
                         checkpoint tensor holding it is `key` below (fused families) */
  int ndim;           /* 1 or 2 */
  int64_t shape[2];   /* global shape; shape[1] = 1 when ndim = 1 */
  /* The local view this rank computes with: the block [offset[0],
   * offset[0]+local[0]) × [offset[1], offset[1]+local[1]) of the global
   * tensor (DTensor.to_local() and its offset); local = shape and offset
   * = {0, 0} unless parallel/ sharded it. */
  int64_t local[2];
  int64_t offset[2];
  void *data;         /* [local[0], local[1]] of `dtype` (device memory) while
                         materialised, else NULL */
  ml_dtype dtype;     /* of data: ML_F32, or ML_BF16 (FSDP's param_dtype); the
                         GEMMs reading the parameter compute in it */
  float *grad;        /* [local[0], local[1]] fp32, during backward, else NULL */
  int layer;          /* the decoder layer holding it, or −1 for the root modules
                         (embed_tokens, the final norm, lm_head) */
  /* Where checkpoints hold it (the checkpoint-key adapter, ml_model_ckpt_keys):
   * rows [key_row0, key_row0 + shape[0]) of the tensor `key` of shape
   * [key_rows, shape[1]]. key = name, key_row0 = 0, key_rows = shape[0],
   * unless the family stores it fused with its neighbours on dim 0
   * (ml_family.fused: Phi-3's q/k/v_proj in self_attn.qkv_proj). */
  char key[160];
  int64_t key_row0, key_rows;
  bool frozen;        /* requires_grad=False (engine/freeze.h): grad stays NULL, so backward
                         computes no weight gradient (dW) for it, only the input's */
  bool adapter;       /* a LoRA adapter weight (model/lora.h): not in the base checkpoint; its
                         values come from engine/lora.h (a seed, or a PEFT adapter) */
  bool fp32;          /* kept and computed in fp32 under a bf16 param_dtype
                         (engine/fp32_params.h): FSDP gathers it in fp32, in a part of its
                         unit of its own (parallel/fsdp.h), so its GEMMs read fp32 operands */
} ml_param;

/* Whole rows of a vocab-sized weight (embed_tokens.weight, lm_head.weight)
 * held apart from the parameter's local view: global rows (vocab ids)
 * [row0, row0 + rows), each with the local view's `cols` columns. Vocab
 * parallelism over FSDP's group computes on a rank's shard rows this way
 * (parallel/fsdp.h ml_fsdp_rows, parallel/vocab.h); ml_param_rows is the
 * local view itself. */
typedef struct ml_rows {
  const void *data; /* [rows, cols] of dtype (device memory) */
  ml_dtype dtype;   /* ML_F32 or ML_BF16 (FSDP's param_dtype): the GEMMs compute in it */
  float *grad;      /* [rows, cols] fp32, accumulated (+=); NULL outside backward */
  int64_t row0, rows, cols;
} ml_rows;

/* The rows of p's local view: p->data, p->dtype, p->grad; global rows
 * p->offset[0] .. p->offset[0] + p->local[0] − 1, p->local[1] columns. */
ml_rows ml_param_rows(const ml_param *p);

/* Elements of the local tensor: at most 2^44 (one weight of a config
 * ml_model_config_load accepts, config.h ML_MAX_*), so the plain product
 * cannot overflow. */
static inline int64_t ml_param_numel(const ml_param *p) { return p->local[0] * p->local[1]; }

/* A transformation of an activation at a module edge (a redistribute
 * between placements, ARCHITECTURE.md §3), run on its local view: it may change
 * the view's sequence extent s and feature count c in place (the buffer
 * has room for edge->cap_c features of all S positions). */
typedef struct ml_hook {
  int (*fn)(void *ctx, ml_act *a);
  void *ctx;
} ml_hook;

/* One module edge, set from outside (parallel/): `fwd` runs on the
 * activation crossing it, `bwd` on that activation's gradient crossing
 * back, like torch's forward pre-/post-hooks and their autograd. cap_c: the
 * widest local feature count the activation takes on along the edge (0 =
 * its natural width). */
typedef struct ml_edge {
  ml_hook fwd, bwd;
  int64_t cap_c;
} ml_edge;

typedef struct ml_lora_dropout ml_lora_dropout; /* defined in ml_model below */

/* A row-parallel linear computed whole, set from outside (parallel/tp_whole.h)
 * where a linear must produce the bits one rank's does (the batch-invariant
 * mode under tp): cols(ctx, p, src, rows, dt, dst) fills dst [rows,
 * p->shape[1]] (device memory) with the whole matrix whose columns the
 * group's ranks hold as parameter p's dim 1 is cut, from this rank's
 * columns src [rows, p->local[1]], both of dtype dt (ML_F32 or ML_BF16):
 * the linear's input features (cut as its weight), its weight, a LoRA
 * lora_A and its input. Every rank of the group calls it for the same
 * parameters in the same order. cols NULL: the linear computes on its
 * local view. */
typedef struct ml_whole_hook {
  int (*cols)(void *ctx, const ml_param *p, const void *src, int64_t rows, ml_dtype dt,
              void *dst);
  void *ctx;
} ml_whole_hook;

typedef struct ml_linear {
  ml_param *weight; /* [out, in] */
  ml_param *bias;   /* [out] or NULL */
  bool bias_in_forward; /* false: another rank adds the bias (row-parallel Partial output) */
  /* in: the input activation; out: the output. Linears reading one shared
   * activation (q/k/v, gate/up) run the first one's input edge once. */
  ml_edge in, out;
  /* LoRA (model/lora.h, PEFT's lora.Linear): y += lora_scale · (x·A^T)·B^T before the
   * output edge, with lora_a [r, in] and lora_b [out, r]; both NULL: no adapter. */
  ml_param *lora_a, *lora_b;
  float lora_scale;
  /* LoRA dropout on lora_A's input (model/lora_drop.h): the model's context (NULL: none)
   * and this linear's key, its index among the model's modules (the same on every rank) */
  const ml_lora_dropout *lora_drop;
  uint64_t lora_id;
  /* set: the forward computes y = x_whole · W_whole^T + b from `whole`'s
   * operands (the bias on every rank; a LoRA adapter's x_whole · A_whole^T
   * likewise) and hands its output edge a whole [B, s, out] (Replicate)
   * instead of a Partial sum; the backward is the local one (dx of this
   * rank's input features, dW of its weight columns, dA of its lora_A
   * columns, dB a Partial sum). */
  ml_whole_hook whole;
  /* With `whole` set: the whole weight [out, in] and lora_A [r, in] (its dtype, pool memory)
   * gathered once for a generate call (parallel/tp_whole.h ml_tp_whole_hold), which the
   * forward uses instead of gathering them again; NULL: gathered per forward. */
  void *whole_weight, *whole_lora_a;
} ml_linear;

typedef struct ml_embedding {
  ml_param *weight; /* [V, H]; local rows offset[0] .. offset[0]+local[0]−1 */
  float scale;      /* output × scale: sqrt(H) in fp32 (Gemma3TextScaledWordEmbedding) or 1 */
  ml_edge out;
} ml_embedding;

typedef struct ml_rmsnorm {
  ml_param *weight; /* [dim]; NULL where the family has no such norm */
  float eps, offset;
} ml_rmsnorm;

/* Saved by ml_layer_forward for the backward; [T, D] unless noted. Buffers
 * of modules the family lacks are NULL. Under activation checkpointing
 * (ml_model.ac) the buffers the mode drops point into the model's recompute
 * workspace, shared by all layers: they hold a layer's values only from its
 * forward, or from the recompute its backward starts with, until another
 * layer's. */
typedef struct ml_layer_acts {
  float *x_in;          /* layer input (residual) [T, H] */
  float *rstd1, *h1;    /* attn_norm: rstd [T], output [T, H] (bf16 under bf16_inputs) */
  float *q_raw, *k_raw; /* q/k_proj outputs before q_norm/k_norm [T, nh·hd], [T, nkv·hd] */
  float *rstd_q, *rstd_k; /* q_norm/k_norm rstd per (token, head) [T·nh], [T·nkv] */
  float *q, *k, *v;     /* attention inputs (after norm and RoPE) [T, nh·hd], [T, nkv·hd]
                           (bf16 under bf16_qkv) */
  float *attn_saved;    /* what attention's forward saves (ml_be_attention_saved) */
  float *att;           /* attention output, o_proj input [T, nh·hd] (bf16 under bf16_att) */
  float *o, *rstd_o;    /* o_proj output before attn_out_norm [T, H], rstd [T] */
  float *x_mid;         /* residual after attention [T, H] */
  float *rstd2, *h2;    /* mlp_norm: rstd [T], output [T, H] (bf16 under bf16_inputs) */
  float *g, *u, *a;     /* gate, up, act(gate)·up [T, I] (a: bf16 under bf16_inputs;
                           g, u: bf16 under bf16_mlp) */
  float *d, *rstd_d;    /* down_proj output before mlp_out_norm [T, H], rstd [T] */
  float *out;           /* workspace only, where the MLP is recomputed: the layer
                           output a recompute writes and discards [T, H] */
  /* A sparse layer's routing (ml_moe; NULL in a model without one): probs
   * [T, E] the router's softmax (fp32), top_e [T, k] each token's chosen
   * experts (exact small integers, torch.topk's order), top_w [T, k] their
   * weights (renormalized when cfg.norm_topk), ye [T·k, H] each choice's
   * expert output before weighting (rows in expert order: ml_moe_order).
   * g, u, a then hold the experts' [T·k, moe_inter] rows in that order. */
  float *probs, *top_e, *top_w, *ye;
  /* A sparse layer's shared expert (ml_moe.shared; NULL in a model without
   * one, model/moe_shared.h): sg, su, sa [T, I_s] its gate, up and
   * act(gate)·up; sy [T, H] its output before the gate; sz [T] the gate
   * sigmoid(h·w^T). */
  float *sg, *su, *sa, *sy, *sz;
  /* Buffers on the residual stream (x_in, x_mid, the rstd of attn_norm,
   * mlp_norm and the post-norms, o and d) hold Tr = B · s_res tokens, s_res
   * this rank's sequence piece (ml_model.res_parts); the others T = B · S. */
  /* the views the linears read (after their input edges): q/k/v, o_proj,
   * gate/up, down_proj; and q, k, v as attention saw them. Under
   * ml_model.bf16_inputs in_qkv.x, in_gu.x and in_down.x are NULL after the
   * forward (their fp32 values are kept nowhere: h1, h2, a hold the bf16
   * copy); under ml_model.bf16_qkv so are qv.x and kv.x (q, k hold the bf16
   * values after RoPE) and vv.x is v, bf16 */
  ml_act in_qkv, in_o, in_gu, in_down, qv, kv, vv, gv;
} ml_layer_acts;

/* A sparse mixture-of-experts block (transformers 5.23 Qwen3MoeSparseMoeBlock,
 * MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock with its shared expert:
 * model/moe_shared.h; dropless: every token reaches its top_k experts):
 * router logits = h·W_gate^T, probs = softmax (fp32), the top_k experts by
 * probability (torch.topk), their probabilities (renormalized to sum 1
 * when cfg.norm_topk) weighting each expert's SwiGLU MLP
 * down(act(gate(h))·up(h)) of moe_inter features. */
typedef struct ml_moe {
  ml_linear gate;     /* router <moe_block>.gate [E, H], no bias; weight NULL: a dense layer */
  ml_linear *experts; /* expert e's gate_proj, up_proj [I_e, H] and down_proj [H, I_e] at
                         experts[3e + 0, 1, 2] (ml_model.experts) */
  /* The shared expert (family->shared_expert, Qwen2MoeSparseMoeBlock): its
   * gate, up [I_s, H] and down [H, I_s] at shared[0, 1, 2] and its gate
   * <moe_block>.shared_expert_gate [1, H], no biases; weights NULL: none. */
  ml_linear shared[3], shared_gate;
} ml_moe;

/* The load-balancing loss of a forward's sparse layers (cfg.router_aux;
 * transformers' load_balancing_loss_func, Switch Transformer eqs. 4-6),
 * kept by model/moe.h's ml_moe_aux_*: over the counted tokens t (HF
 * attention_mask 1) of every sparse layer l, count_e = the top-k choices of
 * expert e, prob_e = Σ p_{l,t,e}, rows = tokens × sparse layers;
 * aux = E · Σ_e count_e · prob_e / rows². */
typedef struct ml_moe_aux {
  bool open;     /* the forward accumulates into sums (between begin and close) */
  int64_t valid; /* positions 0 .. valid − 1 of each sequence count; later ones are padding */
  double *sums;  /* host [2E + 1]: count_e, prob_e, rows */
  double value;  /* after close: aux */
  double grad;   /* after close: coef · E / rows², so d(coef · aux) / d p_{l,t,e} =
                    grad · count_e on a counted token (count is the selection's: no gradient) */
  /* the global position of each local position of a sequence, which valid
   * bounds (context parallelism's pieces, parallel/cp.h: its padding lies at
   * positions >= S); NULL: the local position. Set from outside after begin. */
  const int64_t *pos;
} ml_moe_aux;

typedef struct ml_layer {
  /* norms by role (family->attn_norm ... mlp_out_norm name them) */
  ml_rmsnorm attn_norm;     /* before attention: input_layernorm */
  ml_rmsnorm attn_out_norm; /* on the attention output, before the residual add (Gemma3) */
  ml_rmsnorm mlp_norm;      /* before the MLP */
  ml_rmsnorm mlp_out_norm;  /* on the MLP output, before the residual add (Gemma3) */
  ml_rmsnorm q_norm, k_norm; /* [head_dim], per head before RoPE (Qwen3, Gemma3) */
  ml_linear q_proj, k_proj, v_proj, o_proj;
  ml_linear gate_proj, up_proj, down_proj;
  /* attention of this layer: keys j > i − window (0: all j <= i), RoPE
   * tables [S, hd/2] of its layer type (set by ml_model_begin) */
  int64_t window;
  const float *rope_cos, *rope_sin;
  ml_layer_acts acts;
  ml_moe moe; /* the sparse block replacing gate/up/down_proj (their weights NULL) */
  /* Under expert parallelism (ml_model.moe_ep): the rows this rank's
   * experts received in the last forward and their activations, kept for
   * backward (model/moe.c; NULL otherwise). */
  struct ml_moe_held *moe_held;
} ml_layer;

/* Expert parallelism of the sparse layers, set from outside
 * (parallel/ep.h) before the first forward, as the attention core: the
 * experts are split over `ranks` ranks in contiguous blocks of E / ranks,
 * this rank computing experts [rank·E/ranks, (rank+1)·E/ranks) for the
 * tokens of every rank of the group (model/moe.h). ranks 0 or 1: every
 * expert here, no exchange. counts: all-to-all of n int64 per rank (send
 * [ranks·n], block q for rank q; recv [ranks·n], block q from rank q),
 * host memory; rows: all-to-all of fp32 blocks of uneven length (counts in
 * floats, [ranks] each; comm/comm.h ml_all_to_all_v), backend memory.
 * Every rank of the group calls them for the same layers in the same
 * order.
 * Under tp (slices > 1: the tp group's size, slice this rank's tp rank),
 * the tp ranks hold the same Replicate tokens, so each dispatches only its
 * torch.chunk of a layer's T tokens (rows [t0, t0 + n) of ml_chunk(T,
 * slices, slice), as Megatron-LM's token dispatchers take S/TP·B tokens
 * per rank) and gather rebuilds the Replicate [T, cols] rows (backend
 * memory) from every tp rank's chunk in place (an all-gather over tp,
 * collective over the tp group; gather_ctx its group). slices 0 or 1:
 * every rank dispatches all its tokens. */
typedef struct ml_moe_ep {
  int ranks, rank;
  int (*counts)(void *ctx, const int64_t *send, int n, int64_t *recv);
  int (*rows)(void *ctx, const float *send, const int64_t *send_counts, float *recv,
              const int64_t *recv_counts);
  void *ctx;
  int slices, slice;
  int (*gather)(void *gather_ctx, ml_backend *be, float *rows, int64_t T, int64_t cols);
  void *gather_ctx;
} ml_moe_ep;

/* One call of a layer's attention core, softmax(scale·q·k^T + mask)·v
 * (HF eager_attention_forward / SDPA): q [B, S, nh, hd] and k [B, S, nkv,
 * hd] after RoPE, v [B, S, nkv, hd], the local S positions of each
 * sequence; causal, and keys within `window` when window > 0; products in
 * `compute` (ml_be_attention_fwd). */
typedef struct ml_attn_call {
  const float *q, *k, *v;
  int64_t B, S, nh, nkv, hd;
  int64_t group, head_off; /* query head h reads kv head (h + head_off) / group */
  float scale;
  int64_t window;
  ml_dtype compute;
  int64_t layer; /* the decoder layer the call serves (0 .. n_layers − 1), for a core
                    that keeps per-layer state (engine/generate.c: its KV cache) */
  /* q, k, v are bf16 (they point at uint16_t, the same layouts): the
   * model keeps them so (ml_model.bf16_qkv); only for a core that declares
   * ml_attn_core.bf16_qkv, which reads them as ml_attn_block.qkv_bf16 does. */
  bool qkv_bf16;
  /* out is bf16 (uint16_t, the same layout), written and, backward, read
   * as ml_attn_block.out_bf16 (ml_model.bf16_att); only for a core that
   * declares ml_attn_core.bf16_out. The saved floats stay fp32. */
  bool out_bf16;
} ml_attn_call;

/* The attention core, replaceable from outside as torch's context_parallel
 * replaces SDPA (parallel/cp.h: ring attention over the cp group). All
 * NULL: the backend's whole-sequence attention (ml_be_attention_fwd/_bwd).
 * saved: floats fwd saves for bwd for a batch [B, S] with nh local heads;
 * fwd: out [B, S, nh·hd] (=); bwd: dq, dk, dv (=) given dout and the
 * forward's out and saved. Every rank of the group the core communicates
 * over must call it for the same layers in the same order. */
typedef struct ml_attn_core {
  int64_t (*saved)(void *ctx, int64_t B, int64_t S, int64_t nh);
  int (*fwd)(void *ctx, const ml_attn_call *c, float *out, float *saved);
  int (*bwd)(void *ctx, const ml_attn_call *c, const float *dout, const float *out,
             const float *saved, float *dq, float *dk, float *dv);
  void *ctx;
  /* What the core takes beyond fp32 (model/varlen.h's blocks do, as
   * torch.autocast's SDPA reads bf16 q, k, v and writes a bf16 output):
   * bf16_qkv: bf16 q, k, v (ml_attn_call.qkv_bf16); bf16_out: a bf16 out
   * (ml_attn_call.out_bf16), written by fwd and read by bwd. A core that
   * does not declare one gets that buffer in fp32 (ml_model_bf16_qkv,
   * ml_model_bf16_att): context parallelism's ring takes bf16 q, k, v (its
   * K/V passes then carry bf16) but merges fp32 outs, the KV cache's core
   * declares neither. */
  bool bf16_qkv, bf16_out;
} ml_attn_core;

typedef enum {
  ML_MOD_LINEAR,
  ML_MOD_EMBEDDING,
  ML_MOD_RMSNORM,
  ML_MOD_ATTENTION, /* container: <layer>.self_attn */
  ML_MOD_MLP        /* container: <layer>.mlp */
} ml_module_kind;

typedef struct ml_module {
  char name[128]; /* HF module name: model.layers.0.self_attn.q_proj */
  /* The HF module it is a part of when the family fuses it (ml_family.fused:
   * Phi-3's model.layers.0.self_attn.qkv_proj), else empty: plans may name
   * either, a rule on the fused module applying to each part. */
  char alias[128];
  ml_module_kind kind;
  void *ptr; /* ml_linear*, ml_embedding*, ml_rmsnorm*; containers: their ml_layer */
} ml_module;

/* "Linear", "Embedding", "RMSNorm", "Attention", "MLP". */
const char *ml_module_kind_name(ml_module_kind k);

/* Activation checkpointing (torch.utils.checkpoint as torchtitan and NeMo
 * apply it per decoder layer): which saved activations a layer drops in
 * forward and recomputes in backward. Set ml_model.ac before
 * ml_model_begin. A recompute repeats the forward's kernels on the same
 * inputs, so forward results and gradients are bitwise those of
 * ML_AC_NONE; where it reruns module edges it reruns their forward hooks
 * (collectives under TP) in the forward's order, as torch's checkpoint does. */
typedef enum {
  ML_AC_NONE,      /* save everything */
  ML_AC_MLP,       /* recompute the MLP block from its input (x_mid): mlp_norm,
                      gate/up, act, down_proj, mlp_out_norm, with their edges */
  ML_AC_LAYER,     /* full (NeMo activation_checkpointing: true): keep only the
                      layer input, rerun the whole layer forward with its edges */
  ML_AC_SELECTIVE  /* Megatron's selective recomputation (Korthikanti et al. 2022):
                      drop what the attention core saves (with FlashAttention-2
                      only the log-sum-exp [B, S, nh]), recompute it from the
                      saved q, k, v (no tp edges; under cp the ring again) */
} ml_ac_mode;

typedef struct ml_model {
  ml_model_config cfg;
  ml_backend *be; /* where the model computes and its buffers live; set before ml_model_begin */
  ml_ac_mode ac; /* set before ml_model_begin; default ML_AC_NONE */
  /* Set before ml_model_begin: no backward will follow the forwards until
   * it is cleared (scoring, generation's prefill and decode). Then every
   * layer's buffers are carved from one shared block, overwritten by the
   * next layer (torch.no_grad / inference_mode keep no activations
   * either), and no backward scratch is allocated: a forward costs one
   * layer's activations instead of n_layers'. Buffers allocated for
   * training serve a forward-only pass of the same geometry as they are
   * (no reallocation when an RL loop alternates scoring and training). */
  bool forward_only;
  bool acts_shared; /* the buffers in place are forward_only's (one block for every layer) */
  /* Set before ml_model_begin: FSDP's param_dtype is bf16, so the weights
   * (but those kept in fp32, ml_param.fp32) are gathered as bf16 for the
   * forward and backward (their ml_param.dtype says so only once gathered). */
  bool bf16_params;
  /* The buffers in place keep the inputs of q/k/v, gate/up and down_proj
   * (h1, h2, a) as bf16, the operand their bf16 GEMMs read, forward and
   * backward (ml_model_bf16_inputs when they were carved). */
  bool bf16_inputs;
  /* The buffers in place keep attention's output (att, o_proj's input) as
   * bf16 only, written by the attention kernel (ml_model_bf16_att when they
   * were carved). */
  bool bf16_att;
  /* ... and gate_proj's and up_proj's outputs g, u as bf16, written so by
   * their GEMMs and read so by the GLU (ml_model_bf16_mlp when carved). */
  bool bf16_mlp;
  /* ... and attention's inputs q, k, v as bf16 only, written so by RoPE
   * (q, k) and v_proj's GEMM, read so by attention (ml_model_bf16_qkv when
   * carved). */
  bool bf16_qkv;
  /* The backward scratch is laid out for the GLU backward writing dg, du in
   * bf16 (ml_model_bf16_glu_grads when it was allocated) ... */
  bool bf16_glu_grads;
  /* ... and for the RoPE backward writing dq, dk in bf16
   * (ml_model_bf16_rope_grads when allocated). */
  bool bf16_rope_grads;
  ml_embedding embed_tokens;
  ml_layer *layers;
  ml_rmsnorm norm;
  ml_linear lm_head; /* weight = embed_tokens.weight when tied */
  ml_param *params;  /* every parameter once (tied lm_head not repeated) */
  int n_params;
  ml_module *modules; /* every module (leaves and self_attn/mlp containers), in HF order */
  int n_modules;
  /* How allocation errors of ml_model_begin name the batch, in the user's
   * terms (e.g. "4 sequences per rank (--batch-size 8 / 2 data-parallel
   * ranks) x --seq-len 4096"); empty: "B sequences x S tokens per rank".
   * Set by the caller, optional. */
  char batch_what[192];
  /* The residual stream between modules is sequence-sharded (Shard(1),
   * sequence parallelism) into res_parts torch.chunk pieces of which this
   * rank holds piece res_index: the buffers it passes through (layer input,
   * residual after attention, norms' rstd, post-norm inputs) are sized for
   * that piece. 1 and 0 (the default): whole sequences. Set from outside
   * (parallel/) before ml_model_begin. */
  int res_parts, res_index;
  /* The attention heads this rank holds when they are split over tensor
   * parallelism (parallel/tp.h): its local query head h reads its local
   * key/value head (h + attn_head_off) / attn_group. 0 and 0 (the default):
   * the config's grouping, num_attention_heads / num_key_value_heads, from
   * the first head of a group. Set from outside before ml_model_begin. */
  int64_t attn_group, attn_head_off;
  /* The global position of each of the S local positions of a sequence (HF
   * position_ids, the same for every sequence of the batch): RoPE rotates
   * by it. NULL: 0 .. S−1. Context parallelism holds pieces of longer
   * sequences (parallel/cp.h). Host memory, S entries, set from outside
   * before ml_model_begin and kept while the geometry is in use. */
  const int64_t *position_ids;
  /* The sequence length RoPE's length-dependent scalings (dynamic, longrope;
   * model/config.h) are computed for, HF's max(position_ids) + 1 of the
   * whole forward: 0 takes it from the positions (max(position_ids) + 1,
   * or S). Context parallelism sets the whole sequence's length, which no
   * rank's piece shows (its pieces hold some positions each, and padding
   * past the end). Set from outside like position_ids (ml_model_set_positions
   * rebuilds the tables for a new value). */
  int64_t rope_len;
  ml_attn_core attn_core; /* set from outside; zero: the backend's attention */
  /* batch geometry and buffers, set by ml_model_begin */
  int64_t B, S;
  int64_t s_res;  /* local positions of the residual stream (S, or a Shard(1) chunk) */
  int64_t s_res_cap; /* positions its buffers hold (S, or piece res_index of res_parts) */
  int64_t cap_q, cap_kv, cap_i; /* buffer widths of q/att, k/v, gate/up/act (widest view) */
  ml_act head_in;   /* lm_head's input view (after its input edge) */
  int64_t logits_c; /* features of the logits ml_head_forward hands out */
  float *rope_cos, *rope_sin;             /* full-attention layers: [S, hd/2] each */
  float *rope_local_cos, *rope_local_sin; /* sliding layers */
  /* the final norm: its input [B, s_res, H], output (lm_head's input: head_in views it,
   * [B·S, head_in.c] after the edge), rstd; dxn_final: the gradient of head_in, rows of
   * head_in.c (=, ml_head_backward per chunk), which ml_head_end_backward reads */
  float *x_final, *rstd_final, *xn_final, *dxn_final;
  float *scratch; /* backward temporaries */
  void *attn_work; /* the attention backward's workspace (ml_be_attention_work) */
  float *ac_work; /* recompute workspace shared by all layers (NULL under ML_AC_NONE) */
  /* The experts' linears of every sparse layer (ml_moe.experts points in), or NULL. */
  ml_linear *experts;
  ml_moe_aux aux; /* the load-balancing loss of the last training forward */
  ml_moe_ep moe_ep; /* set from outside; zero: every expert on this rank */
  /* Router replay (model/moe.h): each forward's expert choices, int32 [T,
   * n_layers, top_k] over the T = B · s tokens its sparse layers see (rows of
   * dense layers untouched). route_record (non-NULL): every forward writes
   * them; route_replay (non-NULL): forwards route by them instead of top-k
   * (a token whose row starts with a negative entry routes by its own).
   * Host memory, set from outside before the forward, kept through its
   * backward. NULL (the default): neither. */
  int32_t *route_record;
  const int32_t *route_replay;
  /* LoRA dropout of the current forward (model/lora_drop.h): set by the engine around a
   * training micro-batch, inactive otherwise (scoring, evaluation, generation). */
  struct ml_lora_dropout {
    double p;               /* lora_dropout: the probability of zeroing an element */
    bool active;            /* a training forward (and its backward) runs */
    uint64_t key;           /* the draw's key: seed, optimizer step, micro-batch chained */
    int64_t row0;           /* the global row (of the global micro-batch) of local row 0 */
    int64_t row_len;        /* tokens of a global row: the whole sequence, before cp's cut */
    const int64_t *row_pos; /* [S] each local position's index in its row (cp's pieces);
                               NULL: 0 .. S − 1 */
  } lora_drop;
} ml_model;

/* Build the module tree of `cfg` (parameters described, no storage), with
 * room in m->params for two LoRA adapters per weight (model/lora.h).
 * Errors: allocation. */
int ml_model_create(const ml_model_config *cfg, ml_model *m);

/* Append a parameter of global shape [d0, d1] (d1 = 0: 1-D [d0]) in
 * `layer` (−1: a root module) named (and keyed) as the format says; the
 * caller keeps the count within ml_model_create's capacity. */
ml_param *ml_model_add_param(ml_model *m, int layer, int64_t d0, int64_t d1, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
void ml_model_destroy(ml_model *m);

/* One checkpoint tensor of m (the checkpoint-key adapter, torchtitan's
 * state_dict_adapter): `key`, [rows, cols] (ndim 1: [rows]), holding the
 * parameters m->params[first .. first + n) stacked on dim 0 in that order
 * (n = 1 but for a family's fused tensors). */
typedef struct ml_ckpt_key {
  const char *key;
  int first, n, ndim;
  int64_t rows, cols;
} ml_ckpt_key;

/* m's checkpoint tensors in parameter order, into out (room for
 * m->n_params); returns their count. The tied lm_head has none (its weight
 * is embed_tokens'). */
int ml_model_ckpt_keys(const ml_model *m, ml_ckpt_key *out);

/* The module called `name`, or NULL. */
ml_module *ml_model_find_module(ml_model *m, const char *name);
/* The parameter called `name`, or NULL. */
ml_param *ml_model_find_param(ml_model *m, const char *name);

/* (Re)allocate activations for a local batch of B sequences of S tokens,
 * with the local shapes in effect (call after TP is applied): per layer
 * the buffers m->ac keeps, and one recompute workspace for those it drops
 * (sizes: ml_model_act_bytes); under m->forward_only one block for every
 * layer and no backward scratch (kept when the buffers in place are a
 * training geometry of the same B and S). Errors: allocation, the message naming the
 * buffer, the batch (m->batch_what) and the config sizes that set it; a
 * size beyond 2^63 bytes is reported as such, never wrapped. */
int ml_model_begin(ml_model *m, int64_t B, int64_t S);

/* New positions (m->position_ids, NULL: 0 .. S−1) for the geometry in
 * use: point at `position_ids` (host, m->S entries, kept while in use) and
 * rebuild the RoPE tables when ml_model_begin built them for other
 * positions of the same (B, S) — ml_model_begin alone keeps them (packed
 * documents restarting at 0, a KV-cache decode step). Call before
 * ml_model_begin, or after it to refresh. Errors: allocation. */
int ml_model_set_positions(ml_model *m, const int64_t *position_ids);

/* Drop the activations, so that the next ml_model_begin allocates them
 * afresh (after m->attn_core changed: its saved size may differ). */
void ml_model_reset_acts(ml_model *m);

/* Activation memory under m->ac for a local batch of B sequences of S
 * tokens, with the local shapes and edges in effect (after TP), in bytes
 * (fp32): *per_layer, what ml_layer_forward keeps for the backward of one
 * decoder layer (the largest layer's), and *workspace, the recompute
 * workspace shared by all layers (0 under ML_AC_NONE). ml_model_begin(m,
 * B, S) allocates these; the backward temporaries, the final norm's
 * activations and the RoPE tables come on top and do not depend on the
 * mode. With ml_model_bf16_inputs h1, h2 and a count as bf16 (2 bytes),
 * with ml_model_bf16_att att, with ml_model_bf16_mlp g and u, with
 * ml_model_bf16_qkv q, k and v. Buffers on the residual stream are sized for this rank's piece of
 * the sequence (m->res_parts), the rest for whole sequences (S positions:
 * the linears and attention read gathered sequences). A size beyond int64
 * is ML_SAT (common/checked.h). */
void ml_model_act_bytes(const ml_model *m, int64_t B, int64_t S, int64_t *per_layer,
                        int64_t *workspace);

/* Whether the forward keeps the inputs of q/k/v, gate/up (the norm outputs
 * h1, h2 after their input edges) and down_proj (a = act(gate)·up) only as
 * their bf16 copy: every such weight is gathered as bf16 (m->bf16_params and
 * not ml_param.fp32), so their
 * GEMMs read the bf16 rounding of the input forward (y = x·W^T) and
 * backward (dW += dy^T·x); as torch autocast saves the bf16 cast of a
 * linear's input for backward (the GLU's backward reads gate and up, not
 * a). False when anything else reads the fp32 input: a sparse layer's
 * router and experts (model/moe.c), LoRA dropout on one of them
 * (model/lora_drop.h), a down_proj computed whole (ml_linear.whole, the
 * batch-invariant mode under tp). Values are unchanged (the same rounding
 * of the same fp32 tensor); h1, h2, a take half the memory. Where no
 * input edge sits between, the norm (ml_be_rmsnorm_fwd_bf16) or the GLU
 * writes the bf16 copy itself (layer.c direct_input), else the fp32 value
 * passes through a pool temporary and the edge before its rounding. */
bool ml_model_bf16_inputs(const ml_model *m);

/* Whether attention's output (att, o_proj's input) is kept only in bf16, as
 * torch autocast keeps SDPA's bf16 output for o_proj's backward: q_proj
 * (attention's compute dtype, layer.c) and o_proj gathered as bf16 with no
 * LoRA dropout and not computed whole (as ml_model_bf16_inputs), no
 * attention core or one that declares ml_attn_core.bf16_out (packed
 * documents' varlen core does; context parallelism's ring merges fp32
 * outs across blocks, the KV cache's core writes fp32) and no forward
 * hook on o_proj's input edge (a tp redistribute of the fp32 view: there
 * the feature is off). Then the attention kernel writes its output
 * rounded to bf16 in its final store (ml_attn_block.out_bf16): o_proj's
 * forward and dW GEMMs read the same bf16 values as before (bitwise), and
 * the attention backward's D = rowsum(dout ⊙ out) reads the bf16 out (a
 * rounding site of the backward, FlashAttention-2's in bf16); att takes
 * half the memory. */
bool ml_model_bf16_att(const ml_model *m);

/* Whether a dense layer's MLP runs as torch.autocast(bfloat16) runs it
 * (LlamaMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x))): gate_proj and
 * up_proj write g, u in bf16 straight from their GEMMs (fp32 accumulation,
 * one rounding), saved only so; the GLU reads them widened, computes
 * act(g)·u in fp32 and writes a (down_proj's input) in bf16 in the same
 * kernel under ml_model_bf16_inputs (fp32 where down_proj's input edge, or
 * its whole hook, reads it: the GEMM rounds it then, the same bits); its
 * backward reads the bf16 g, u. True when every weight is gathered as bf16
 * (m->bf16_params), no layer is sparse, and in every layer gate_proj and
 * up_proj are bf16 (not ml_param.fp32) and have no output edge hooks (they
 * read fp32; a LoRA adapter's term is added before the rounding:
 * ml_linear_forward_bf16). Independent of how the MLP's input is kept, so
 * the batch-invariant mode's tp runs (down_proj whole) round g, u as one
 * rank does. */
bool ml_model_bf16_mlp(const ml_model *m);

/* Whether attention's inputs q, k, v are kept only in bf16, the values
 * every bf16 product of attention reads (as torch autocast's SDPA reads the
 * bf16 outputs of q/k/v_proj; RoPE, q_norm and k_norm run in fp32 before
 * the one rounding): v_proj's GEMM writes v in bf16 (ml_linear_forward_bf16:
 * one rounding, a LoRA term added before it), RoPE writes q and k rounded
 * (ml_be_rope_fwd_bf16; q_raw, k_raw stay fp32 for q_norm's and k_norm's
 * backward), and attention reads them in place, forward and backward
 * (ml_attn_block.qkv_bf16; dq, dk, dv stay fp32): results bitwise those of
 * rounding per call, q, k, v in half the memory. True under
 * ml_model_bf16_att's rule but for its core's part (block attention on
 * the backend's kernels in bf16 compute, o_proj as it says) under no core
 * or one that declares ml_attn_core.bf16_qkv (the varlen core, context
 * parallelism's ring, which takes them without a bf16 out; the KV cache's
 * core reads fp32 q, k, v) when in every layer q_proj, k_proj and v_proj
 * are bf16 (not ml_param.fp32), not computed whole and have no output edge hooks (a tp
 * or sp redistribute of the fp32 views: there the feature is off). */
bool ml_model_bf16_qkv(const ml_model *m);
/* Whether the GLU backward writes dg, du (the output gradients of gate_proj
 * and up_proj) in bf16, rounded once to nearest-even in its kernel
 * (ml_be_glu_bwd_bf16), and the two linears' backward GEMMs read them so
 * (ml_linear_backward_bf16) — the rounding ml_linear_backward does
 * itself otherwise, as autocast's linear backward casts grad_output: true
 * under ml_model_bf16_mlp when gate_proj and up_proj of every layer pass
 * ml_linear_dy_bf16 (no LoRA adapter, bias or output edge reads the fp32
 * gradient). Bitwise the same gradients; the backward scratch holds dg, du
 * at 2 bytes and no GEMM operand is converted for them. */
bool ml_model_bf16_glu_grads(const ml_model *m);

/* Whether the RoPE backward writes dq, dk (the output gradients of q_proj
 * and k_proj) in bf16 (ml_be_rope_bwd_bf16), read so by the two linears'
 * backward GEMMs (ml_linear_backward_bf16), as ml_model_bf16_glu_grads
 * for gate/up: true when every weight is gathered as bf16
 * (m->bf16_params), the family has no q_norm/k_norm (their backward sits
 * between RoPE's and the linears' and reads the fp32 gradient), and q_proj
 * and k_proj of every layer pass ml_linear_dy_bf16. The bf16 dq, dk take
 * the room of attention's output gradient (dead by then) in the backward
 * scratch. */
bool ml_model_bf16_rope_grads(const ml_model *m);

/* Embedding lookup: ids [B, S] → x [B, s_res, H] (scaled; the output edge
 * runs and sets m->s_res). x has room for [B, S, H]. Errors: an edge that
 * leaves other than H features. = ml_embed_lookup on the weight's local
 * view (ml_param_rows), then ml_embed_edge_forward. */
int ml_embed_forward(ml_model *m, const int32_t *ids, float *x);
/* dx [B, s_res, H] → embedding weight grad (+=). dx (room for [B, S, H])
 * is clobbered by the edge. = ml_embed_edge_backward, then
 * ml_embed_lookup_backward on the weight's local view. */
int ml_embed_backward(ml_model *m, const int32_t *ids, float *dx);

/* The embedding's lookup alone (HF Embedding / Gemma3TextScaledWordEmbedding
 * forward on the rows w holds, as Megatron's VocabParallelEmbedding masks
 * the ids outside its shard): ids [n] → y [n, w->cols] (=), scale · the row
 * of each id in [w->row0, w->row0 + w->rows), 0 for any other id. */
int ml_embed_lookup(ml_model *m, const int32_t *ids, int64_t n, const ml_rows *w, float *y);
/* Its backward: w->grad (+=) scale · dy [n, w->cols] rows, each scattered
 * onto the row of its id when w holds it. */
int ml_embed_lookup_backward(ml_model *m, const int32_t *ids, int64_t n, const float *dy,
                             const ml_rows *w);
/* The embedding's output edge on this rank's lookup x [B, S, c] (c the
 * weight's local columns; x has room for [B, S, H]) → the residual stream
 * [B, s_res, H] (sets m->s_res). Errors: as ml_embed_forward. */
int ml_embed_edge_forward(ml_model *m, float *x);
/* The edge's backward: dx [B, s_res, H] → the lookup's output gradient
 * [B, S, c] in place. Errors: an edge that leaves another shape. */
int ml_embed_edge_backward(ml_model *m, float *dx);

/* The unit boundaries' bf16 casts around a decoder layer (FSDP2's
 * cast_forward_inputs under MixedPrecisionPolicy param_dtype bf16: a unit's
 * input, and the gradient a bf16 unit hands on, rounded to bf16 values in
 * fp32 storage), and the forward's hand-off of the residual stream between
 * layers, as the caller's loop runs the layers (engine.h
 * ml_engine_layer_cast; 0: neither, each layer copies its input into x_in
 * and adds its output into x). The cast between two layers is done once, by
 * the add that produces the residual sum (its store rounded,
 * ml_be_add_round_to) — ML_CAST_OUT on the layer the sum leaves,
 * ML_CAST_IN_FUSED on the one it enters — and by the layer itself
 * (ML_CAST_IN) where the unit before it is not a layer (the embedding, the
 * head's backward). In fp32 (ML_CAST_FP32) the forward's sum goes the same
 * way unrounded (ml_be_add_to): the same bits as the add in place and the
 * next layer's copy into its x_in. */
enum ml_layer_cast {
  /* the layer casts its input: forward, x rounded into the saved x_in;
     backward, dx rounded in place (with down_proj's bf16 dy, where its
     GEMMs read it so) */
  ML_CAST_IN = 1,
  /* the input arrives cast by the neighbour's ML_CAST_OUT: forward, in the
     saved x_in (x is only room); backward, in dx, with down_proj's bf16 dy
     in the first [B, s_res, H] bf16 of the backward scratch where its GEMMs
     read it so (the rule of both: layer.c's boundary_dy_bf16) */
  ML_CAST_IN_FUSED = 2,
  /* the output goes to a unit that casts it, and the layer's last add
     stores it so: forward, into layer l + 1's x_in (ML_CAST_IN_FUSED
     there), or from the last layer into x (the head's input); backward,
     into dx, with layer l − 1's down_proj bf16 dy (ML_CAST_IN_FUSED
     there; l >= 1) */
  ML_CAST_OUT = 4,
  /* forward only, no rounding at the boundaries (param_dtype fp32):
     ML_CAST_IN_FUSED's input is in x_in as the layer below stored it, and
     ML_CAST_OUT's add stores the sum as it is; with ML_CAST_IN refused */
  ML_CAST_FP32 = 8,
};

/* Decoder layer l: x [B, s_res, H] residual stream in place (under
 * ML_CAST_OUT of a layer below the last: into layer l + 1's x_in, x left
 * holding no value); saves the activations m->ac keeps. cast: the unit
 * boundaries' casts and hand-offs (ml_layer_cast); x itself is overwritten
 * unread after the input is saved in x_in. Errors: cast flags that do not
 * combine (IN with IN_FUSED, FP32 with IN); edges whose layouts do not
 * compose (attention fed a sequence shard, a residual of another extent),
 * named by module.
 * x += attn_out_norm(o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v)))
 * on attn_norm(x), then x += mlp_out_norm(down(act(gate)·up)) on
 * mlp_norm(x); absent norms are the identity (HF *DecoderLayer.forward). */
int ml_layer_forward(ml_model *m, int l, float *x, unsigned cast);
/* dx [B, s_res, H]: gradient of layer l's output in, of its input out; weight
 * grads accumulate (+=) into the layer's param->grad. First recomputes what
 * m->ac dropped (ml_ac_mode), running the forward edges it reruns: every
 * rank of a tp group must call it for the same layers in the same order.
 * cast: the unit boundaries' casts (ml_layer_cast): ML_CAST_IN rounds dx in
 * place after the recompute, in the pass that writes the bf16 dy down_proj's
 * backward reads; ML_CAST_OUT leaves dx rounded and layer l − 1's bf16 dy
 * in the scratch, which the recompute of layer l − 1 does not write.
 * Errors: cast flags that do not combine (IN with IN_FUSED, OUT on layer
 * 0, FP32: forward only); those of ml_layer_forward (from the recompute)
 * and of the backward edges. */
int ml_layer_backward(ml_model *m, int l, float *dx, unsigned cast);

/* Final norm on x [B, s_res, H] (saved), then lm_head's input edge, which
 * must leave whole sequences (the loss scores every token). */
int ml_head_begin(ml_model *m, const float *x);
/* logits [nt, V_local] for tokens t0 .. t0+nt−1 of the B·S (lm_head's
 * output edge runs on them: V_local may become V). */
int ml_head_forward(ml_model *m, int64_t t0, int64_t nt, float *logits);
/* Backward of ml_head_forward for the same tokens: dlogits [nt, V_local]
 * (clobbered by hooks); lm_head weight grad (+=); the input grad is kept. */
int ml_head_backward(ml_model *m, int64_t t0, int64_t nt, float *dlogits);
/* After every chunk's backward: lm_head's input edge backward, final norm
 * backward → dx [B, s_res, H] (=). */
int ml_head_end_backward(ml_model *m, float *dx);

/* lm_head on a block of rows of its weight, without its edges (HF
 * nn.Linear without bias; the rows are the logits' columns): logits [nt,
 * w->rows] (=) = x [nt, w->cols] · W_rows^T, x rows of lm_head's input as
 * its input edge leaves it (m->head_in, or those of several ranks); the
 * GEMM in w->dtype as ml_linear_forward runs it. */
int ml_head_logits(ml_model *m, const float *x, int64_t nt, const ml_rows *w, float *logits);
/* Its backward: dx [nt, w->cols] (=) dlogits · W_rows, w->grad (+=)
 * dlogits^T · x; dlogits [nt, w->rows] (read only: with bf16 rows the
 * GEMMs read it rounded once, as ml_linear_backward does). */
int ml_head_logits_backward(ml_model *m, const float *x, int64_t nt, const ml_rows *w,
                            float *dlogits, float *dx);

/* An operand of the fused classifier's tile GEMMs, stored contiguously: p
 * of type (ML_F32 or ML_BF16); exact: fp32 values the caller rounded to
 * bf16 already (ml_gemm.a_exact: the GEMMs read it as it is where the
 * backend can, ml_be_gemm_exact_in_place). */
typedef struct ml_tile_in {
  const void *p;
  ml_dtype type;
  bool exact;
} ml_tile_in;

/* The fused classifier's tiles (parallel/loss.h): n rows r0 .. r0+n−1 of w
 * (local indices) at a time, for nt tokens x [nt, w->cols] (ML_F32, or with
 * bf16 rows rounded once for every tile by the caller: ML_BF16 or exact
 * fp32), GEMMs in w->dtype as ml_linear_forward/backward run them; lm_head's
 * edges do not run (the caller tiles only logits that need no output
 * redistribute). tile_logits: logits [nt, n] (=) = x · W[r0 : r0+n]^T. */
int ml_head_tile_logits(ml_model *m, const ml_rows *w, ml_tile_in x, int64_t nt, int64_t r0,
                        int64_t n, float *logits);
/* tile_backward: dlogits [nt, n] (ML_F32, or rounded by the caller: ML_BF16
 * or exact fp32); dx [nt, w->cols] (= or += when accumulate) dlogits · W[r0 :
 * r0+n]; w->grad[r0 : r0+n] (+=) dlogits^T · x, one GEMM with K = nt. */
int ml_head_tile_backward(ml_model *m, const ml_rows *w, ml_tile_in x, int64_t nt, int64_t r0,
                          int64_t n, ml_tile_in dlogits, float *dx, bool accumulate);

/* The vocab rows lm_head holds: global ids v0 .. v0 + *nv − 1. */
void ml_model_vocab_shard(const ml_model *m, int64_t *v0, int64_t *nv);

#endif
