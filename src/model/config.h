/* Model hyper-parameters from an HF config.json, interpreted through the
 * family descriptor (defaults differ per family, as in transformers'
 * LlamaConfig / Qwen2Config / Qwen3Config / Gemma3TextConfig /
 * Gemma3Config). Reads both the transformers 4 layout (rope_theta,
 * rope_scaling, rope_local_base_freq, sliding_window_pattern, torch_dtype)
 * and the 5 layout (rope_parameters, flat or nested per layer type;
 * layer_types; dtype); composite configs (Gemma3Config) are read from their
 * text_config. */
#ifndef ML_CONFIG_H
#define ML_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "model/family.h"
#include "tensor/dtype.h"

/* Most decoder layers a config may have (per-layer attention types are
 * kept inline so that the config stays a plain value). */
enum { ML_MAX_LAYERS = 1024 };

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
  k_rope_scaling rope;
  double rope_local_theta;
  k_rope_scaling rope_local;
  /* Layer l attends to keys j > i − sliding_window when sliding[l]
   * ("sliding_attention"), else to every j <= i ("full_attention"). */
  int64_t sliding_window; /* 0 when no layer slides */
  bool sliding[ML_MAX_LAYERS];
  /* attention scores scale = attn_scalar^-0.5: head_dim, or query_pre_attn_scalar */
  double attn_scalar;
  bool qkv_bias, o_bias, mlp_bias, tie_embeddings;
  ml_dtype dtype; /* the checkpoint's torch dtype (weights are fp32 in memory) */
} ml_model_config;

/* Parse DIR/config.json. Errors name the file and the field: missing
 * required field (hidden_size, intermediate_size, num_hidden_layers,
 * num_attention_heads, vocab_size, rms_norm_eps), wrong type, non-positive
 * size, unsupported architecture (listing the supported ones), unknown
 * rope type, hidden_size/heads inconsistent with head_dim, more than
 * ML_MAX_LAYERS layers, a layer_types list of the wrong length or with an
 * unknown entry, a sliding layer without a sliding_window, a setting the
 * family marks unsupported (e.g. Gemma3 final_logit_softcapping non-null). */
int ml_model_config_load(const char *dir, ml_model_config *out);

/* Write DIR/config.json so that transformers' AutoConfig loads it (the
 * transformers 4 keys, plus layer_types and, for families with a local
 * RoPE, the transformers 5 rope_parameters nested per layer type; composite
 * families nest the text model under their text_config key). */
int ml_model_config_write(const char *dir, const ml_model_config *c);

/* The built-in presets of `meshlm init`: "tiny" (a few hundred thousand
 * parameters, for tests) and "small" (about 13M parameters, byte vocab 256,
 * for the demo). Families with sliding layers get a window below the preset
 * length and both layer types. Errors: unknown family name or preset, a
 * composite family (init writes text models: use its save_as family). */
int ml_model_config_preset(const char *arch, const char *preset, ml_model_config *out);

/* Number of parameters (embedding counted once when tied). */
int64_t ml_model_config_num_params(const ml_model_config *c);

#endif
