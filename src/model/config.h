/* Model hyper-parameters from an HF config.json, interpreted through the
 * family descriptor (defaults differ per family, as in transformers'
 * LlamaConfig / Qwen2Config). Reads both the transformers 4 layout
 * (rope_theta, rope_scaling, torch_dtype) and the 5 layout
 * (rope_parameters, dtype). */
#ifndef ML_CONFIG_H
#define ML_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "model/family.h"
#include "tensor/dtype.h"

typedef struct ml_model_config {
  const ml_family *family;
  int64_t hidden;       /* hidden_size H */
  int64_t intermediate; /* intermediate_size I */
  int64_t n_layers;     /* num_hidden_layers L */
  int64_t n_heads;      /* num_attention_heads */
  int64_t n_kv_heads;   /* num_key_value_heads (default n_heads) */
  int64_t head_dim;     /* head_dim (default H / n_heads) */
  int64_t vocab;        /* vocab_size V */
  int64_t max_positions;
  double rms_eps;
  double rope_theta;
  k_rope_scaling rope;
  bool qkv_bias, mlp_bias, tie_embeddings;
  ml_dtype dtype; /* the checkpoint's torch dtype (weights are fp32 in memory) */
} ml_model_config;

/* Parse DIR/config.json. Errors name the file and the field: missing
 * required field (hidden_size, intermediate_size, num_hidden_layers,
 * num_attention_heads, vocab_size, rms_norm_eps), wrong type, non-positive
 * size, unsupported architecture (listing the supported ones), unknown
 * rope type, hidden_size/heads inconsistent with head_dim. */
int ml_model_config_load(const char *dir, ml_model_config *out);

/* Write DIR/config.json so that transformers' AutoConfig loads it. */
int ml_model_config_write(const char *dir, const ml_model_config *c);

/* The built-in presets of `meshlm init`: "tiny" (a few hundred thousand
 * parameters, for tests) and "small" (about 13M parameters, byte vocab 256,
 * for the demo). Errors: unknown family name or preset. */
int ml_model_config_preset(const char *arch, const char *preset, ml_model_config *out);

/* Number of parameters (embedding counted once when tied). */
int64_t ml_model_config_num_params(const ml_model_config *c);

#endif
