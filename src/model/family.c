#include "model/family.h"

#include <string.h>

static const ml_family families[] = {
    {
        .name = "llama",
        .architecture = "LlamaForCausalLM",
        .model_type = "llama",
        .prefix = "model.",
        .qkv_bias_key = "attention_bias",
        .qkv_bias_default = false,
        .has_mlp_bias_key = true,
        .tie_default = false,
        .rope_theta_default = 10000.0,
        .norm_offset = 0.0f,
        .act = K_ACT_SILU,
        .hidden_act = "silu",
    },
    {
        .name = "qwen2",
        .architecture = "Qwen2ForCausalLM",
        .model_type = "qwen2",
        .prefix = "model.",
        .qkv_bias_key = NULL,
        .qkv_bias_default = true,
        .has_mlp_bias_key = false,
        .tie_default = false,
        .rope_theta_default = 1000000.0,
        .norm_offset = 0.0f,
        .act = K_ACT_SILU,
        .hidden_act = "silu",
    },
};
enum { N_FAMILIES = sizeof families / sizeof families[0] };

const ml_family *ml_family_by_architecture(const char *architecture) {
  for (int i = 0; i < N_FAMILIES; i++)
    if (strcmp(families[i].architecture, architecture) == 0) return &families[i];
  return NULL;
}

const ml_family *ml_family_by_name(const char *name) {
  for (int i = 0; i < N_FAMILIES; i++)
    if (strcmp(families[i].name, name) == 0) return &families[i];
  return NULL;
}

static const char *join(char *buf, size_t cap, int use_arch) {
  buf[0] = '\0';
  for (int i = 0; i < N_FAMILIES; i++) {
    if (i) strncat(buf, ", ", cap - strlen(buf) - 1);
    strncat(buf, use_arch ? families[i].architecture : families[i].name, cap - strlen(buf) - 1);
  }
  return buf;
}

const char *ml_family_list_architectures(void) {
  static char buf[256];
  return join(buf, sizeof buf, 1);
}

const char *ml_family_list_names(void) {
  static char buf[128];
  return join(buf, sizeof buf, 0);
}
