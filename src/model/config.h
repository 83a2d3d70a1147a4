/* Model hyper-parameters from an HF config.json, interpreted through the
 * family descriptor (defaults differ per family, as in transformers'
 * LlamaConfig / MistralConfig / Qwen2Config / Qwen3Config /
 * Gemma3TextConfig / Gemma3Config). Reads both the transformers 4 layout
 * (rope_theta, rope_scaling, rope_local_base_freq, sliding_window_pattern,
 * torch_dtype) and the 5 layout (rope_parameters, flat or nested per layer
 * type; layer_types; dtype); composite configs (Gemma3Config) are read from
 * their text_config. RoPE entries: the keys transformers 5.23's
 * _compute_*_parameters read for rope_type default, linear, llama3, dynamic,
 * yarn and longrope, with their defaults (backend/types.h ml_rope_scaling);
 * original_max_position_embeddings as standardize_rope_params settles it (a
 * top-level key first in the flat layout, Phi-3's, then the entry's, then
 * max_position_embeddings); partial_rotary_factor only 1. */
#ifndef ML_CONFIG_H
#define ML_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "model/family.h"
#include "tensor/dtype.h"

/* Limits on the sizes in config.json, checked by ml_model_config_load
 * before any product of them is formed. Each is far above every released
 * decoder (for scale: Llama 3.1 405B has hidden_size 16384,
 * intermediate_size 53248, 126 layers, 128 heads; Gemma 3 vocab_size
 * 262144; Gemma 2 head_dim 256; Llama 4 Scout max_position_embeddings
 * 10485760); they exist so that every size derived from a validated config
 * provably fits:
 *   one weight  <= max(H·(heads·head_dim), H·I, V·H) <= 2^20 · 2^24 = 2^44 elements
 *   one layer   <  2^47 elements (q, k, v, o and gate, up, down: 7 weights of
 *                  <= 2^44, plus biases and norms)
 *   the model   <  2^58 elements (2^10 layers, embedding and lm_head 2^45)
 * so element counts fit int64, and the fp32 bytes of parameters, gradients
 * and both AdamW moments (16 bytes an element, < 2^62) fit int64 and size_t.
 * Sizes that also scale with the batch (activations, logits) are accounted
 * with common/checked.h's saturating helpers instead. The vocabulary also
 * has to fit the int32 token ids; the layer count bounds the per-layer
 * attention types kept inline (the config stays a plain value). */
enum {
  ML_MAX_HIDDEN = 1 << 20,       /* hidden_size */
  ML_MAX_INTERMEDIATE = 1 << 24, /* intermediate_size */
  ML_MAX_VOCAB = 1 << 24,        /* vocab_size */
  ML_MAX_LAYERS = 1024,          /* num_hidden_layers (2^10) */
  ML_MAX_HEADS = 1 << 12,        /* num_attention_heads, hence num_key_value_heads */
  ML_MAX_HEAD_DIM = 1 << 12,     /* head_dim */
  ML_MAX_POSITIONS = 1 << 24,    /* max_position_embeddings, hence any sequence */
  /* num_experts (Qwen3-MoE-235B: 128; DeepSeek-V3: 256); the experts of a
   * layer together are bounded as one dense MLP: num_experts ·
   * moe_intermediate_size <= ML_MAX_INTERMEDIATE, so a sparse layer's
   * elements obey the per-layer bound above */
  ML_MAX_EXPERTS = 1 << 12,
};

typedef struct ml_model_config {
  const ml_family *family;
  int64_t hidden;       /* hidden_size H */
  int64_t intermediate; /* intermediate_size I */
  int64_t n_layers;     /* num_hidden_layers L */
  int64_t n_heads;      /* num_attention_heads */
  int64_t n_kv_heads;   /* num_key_value_heads (default n_heads) */
  int64_t head_dim;     /* head_dim (default: family->head_dim_default, else H / n_heads) */
  int64_t vocab;        /* vocab_size V */
  int64_t max_positions;
  double rms_eps;
  /* RoPE of full-attention layers (global) and of sliding layers (local;
   * the same as the global one unless family->local_rope). */
  double rope_theta;
  ml_rope_scaling rope;
  double rope_local_theta;
  ml_rope_scaling rope_local;
  /* Layer l attends to keys j > i − sliding_window when sliding[l]
   * ("sliding_attention"), else to every j <= i ("full_attention"). */
  int64_t sliding_window; /* 0 when no layer slides */
  bool sliding[ML_MAX_LAYERS];
  /* attention scores scale = attn_scalar^-0.5: head_dim, or query_pre_attn_scalar */
  double attn_scalar;
  bool qkv_bias, o_bias, mlp_bias, tie_embeddings;
  ml_dtype dtype; /* the checkpoint's torch dtype (weights are fp32 in memory) */
  /* Mixture of experts (family->moe_block; all 0/false for dense families):
   * layer l's MLP is the sparse block when moe[l], else the dense MLP of
   * `intermediate`. Each token's router probabilities softmax(x·W_gate^T)
   * (fp32) pick its top_k experts (torch.topk); their probabilities,
   * renormalized to sum 1 when norm_topk, weight the experts' SwiGLU
   * outputs (moe_inter features each). */
  int64_t n_experts;   /* num_experts / num_local_experts E, in [top_k, ML_MAX_EXPERTS] */
  int64_t top_k;       /* num_experts_per_tok, in [1, E] */
  int64_t moe_inter;   /* moe_intermediate_size (Mixtral: intermediate_size) */
  bool norm_topk;      /* norm_topk_prob (Mixtral: always) */
  bool moe[ML_MAX_LAYERS];
  /* output_router_logits: the load-balancing loss (transformers'
   * load_balancing_loss_func) × router_aux_loss_coef joins the loss, as
   * *ForCausalLM.forward adds it */
  bool router_aux;
  double aux_coef; /* router_aux_loss_coef */
  /* the sparse block's shared expert (family->shared_expert; 0: none):
   * shared_expert_intermediate_size I_s */
  int64_t shared_inter;
} ml_model_config;

/* Whether layer l of c has the sparse MoE block as its MLP. */
static inline bool ml_config_moe_layer(const ml_model_config *c, int64_t l) {
  return c->n_experts > 0 && c->moe[l];
}

/* Parse DIR/config.json. Errors name the file and the field: missing
 * required field (hidden_size, intermediate_size, num_hidden_layers,
 * num_attention_heads, vocab_size, rms_norm_eps), wrong type, a size
 * outside [1, its ML_MAX_* limit] (the message gives the value found and
 * the range expected), unsupported architecture (listing the supported
 * ones), unknown rope type, a RoPE field of the wrong type or range
 * (longrope factors not head_dim / 2 positive numbers, a yarn/longrope
 * factor or attention_factor not positive, dynamic's factor not positive
 * or head_dim <= 2, partial_rotary_factor other than 1; named as
 * 'rope_parameters.FIELD' or 'rope_scaling.FIELD'), hidden_size/heads inconsistent with head_dim,
 * a layer_types list of the wrong length or with an unknown entry, a
 * sliding layer without a sliding_window, a setting the family marks
 * unsupported (e.g. Gemma3 final_logit_softcapping non-null); for MoE
 * families num_experts / num_experts_per_tok / the experts' intermediate
 * size out of range (top_k above num_experts, num_experts ·
 * moe_intermediate_size above ML_MAX_INTERMEDIATE), decoder_sparse_step
 * not positive, mlp_only_layers not a list of layer indices, a non-zero
 * router_jitter_noise (not implemented). */
int ml_model_config_load(const char *dir, ml_model_config *out);

/* The longest sequence the model takes: max_position_embeddings, or
 * ML_MAX_POSITIONS when every RoPE of the model is dynamic (its NTK scaling
 * exists to run past max_position_embeddings, and HF sets no limit). */
int64_t ml_model_config_max_seq_len(const ml_model_config *c);

/* Refuse sequences longer than the model's positions: 0 when 1 <= seq_len
 * <= ml_model_config_max_seq_len(c), else -1 with "WHAT: N tokens, above
 * max_position_embeddings M of DIR/config.json; expected at most M" (what
 * names where seq_len came from, e.g. "train: flag --seq-len" or
 * "data.jsonl line 3"; dir is the model directory; dynamic RoPE: "above
 * meshlm's limit of ML_MAX_POSITIONS positions"). */
int ml_model_config_check_seq_len(const ml_model_config *c, const char *dir, int64_t seq_len,
                                  const char *what);

/* Write DIR/config.json so that transformers' AutoConfig loads it (the
 * transformers 4 keys, plus layer_types and, for families with a local
 * RoPE, the transformers 5 rope_parameters nested per layer type; composite
 * families nest the text model under their text_config key). */
int ml_model_config_write(const char *dir, const ml_model_config *c);

/* The built-in presets of `meshlm init`: "tiny" (a few hundred thousand
 * parameters, for tests), "small" (about 13M parameters, byte vocab 256,
 * for the demo) and "smollm2-135m" (SmolLM2-135M's shape: 134.5M
 * parameters, vocab 49152, tied, rope_theta 1e5; for benchmarks) and
 * "llama3.2-1b" (Llama-3.2-1B's shape: 1.24B parameters, vocab 128256,
 * tied, rope_theta 5e5 without its llama3 scaling; for GPU benchmarks).
 * Families with sliding layers get a window below the preset length and
 * both layer types. Errors: unknown family name or preset, a composite
 * family (init writes text models: use its save_as family). */
int ml_model_config_preset(const char *arch, const char *preset, ml_model_config *out);

/* Number of parameters (embedding counted once when tied). Fits int64
 * for any config ml_model_config_load accepts (< 2^58, see ML_MAX_*). */
int64_t ml_model_config_num_params(const ml_model_config *c);

#endif
