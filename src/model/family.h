/* Model families as rows of one descriptor table (DESIGN §8): every
 * difference between Llama, Qwen2 (and later Qwen3, Gemma3) is a field here,
 * read by the model code, never an `if (family == ...)`. */
#ifndef ML_FAMILY_H
#define ML_FAMILY_H

#include <stdbool.h>

#include "kernels/cpu/kernels.h"

typedef struct ml_family {
  const char *name;         /* --arch name: "llama" */
  const char *architecture; /* config.json architectures[0]: "LlamaForCausalLM" */
  const char *model_type;   /* config.json model_type */
  const char *prefix;       /* module name prefix of the base model: "model." */
  /* q/k/v bias: read from config key `qkv_bias_key` (default
   * qkv_bias_default), or fixed to qkv_bias_default when the key is NULL. */
  const char *qkv_bias_key;
  bool qkv_bias_default;
  bool has_mlp_bias_key;      /* Llama's `mlp_bias` */
  bool tie_default;           /* tie_word_embeddings when config.json omits it */
  double rope_theta_default;  /* rope_theta when config.json omits it, and in presets */
  float norm_offset;          /* RMSNorm weight offset: x·(offset + w) */
  k_act act;                  /* MLP gate activation */
  const char *hidden_act;     /* its config.json name */
} ml_family;

/* The family whose architecture string is `architecture`, or NULL. */
const ml_family *ml_family_by_architecture(const char *architecture);
/* The family called `name` (--arch), or NULL. */
const ml_family *ml_family_by_name(const char *name);
/* "LlamaForCausalLM, Qwen2ForCausalLM" (for messages). */
const char *ml_family_list_architectures(void);
/* "llama, qwen2". */
const char *ml_family_list_names(void);

#endif
