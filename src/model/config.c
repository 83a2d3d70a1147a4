#include "model/config.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/status.h"
#include "io/json.h"

static int positive(const ml_json *j, const char *key, int64_t v) {
  if (v > 0) return 0;
  return ml_err("%s: field '%s': expected a positive integer, found %lld", j->path, key,
                (long long)v);
}

static int read_family(const ml_json *j, ml_model_config *c) {
  json_t *archs = json_object_get(j->root, "architectures");
  json_t *a0 = json_is_array(archs) ? json_array_get(archs, 0) : NULL;
  if (!json_is_string(a0))
    return ml_err("%s: field 'architectures': expected a list with one architecture such as "
                  "\"LlamaForCausalLM\", found %s",
                  j->path, archs ? "something else" : "nothing");
  c->family = ml_family_by_architecture(json_string_value(a0));
  if (!c->family)
    return ml_err("%s: field 'architectures': unsupported architecture '%s'; supported: %s",
                  j->path, json_string_value(a0), ml_family_list_architectures());
  return 0;
}

static int read_sizes(const ml_json *j, ml_model_config *c) {
  ML_TRY(ml_json_int(j, NULL, "hidden_size", &c->hidden));
  ML_TRY(positive(j, "hidden_size", c->hidden));
  ML_TRY(ml_json_int(j, NULL, "intermediate_size", &c->intermediate));
  ML_TRY(positive(j, "intermediate_size", c->intermediate));
  ML_TRY(ml_json_int(j, NULL, "num_hidden_layers", &c->n_layers));
  ML_TRY(positive(j, "num_hidden_layers", c->n_layers));
  ML_TRY(ml_json_int(j, NULL, "num_attention_heads", &c->n_heads));
  ML_TRY(positive(j, "num_attention_heads", c->n_heads));
  ML_TRY(ml_json_int_opt(j, NULL, "num_key_value_heads", c->n_heads, &c->n_kv_heads));
  ML_TRY(positive(j, "num_key_value_heads", c->n_kv_heads));
  if (c->n_heads % c->n_kv_heads != 0)
    return ml_err("%s: num_attention_heads %lld is not a multiple of num_key_value_heads %lld",
                  j->path, (long long)c->n_heads, (long long)c->n_kv_heads);
  ML_TRY(ml_json_int_opt(j, NULL, "head_dim", c->hidden / c->n_heads, &c->head_dim));
  ML_TRY(positive(j, "head_dim", c->head_dim));
  if (c->head_dim % 2 != 0)
    return ml_err("%s: field 'head_dim': expected an even size for rotary embeddings, found %lld",
                  j->path, (long long)c->head_dim);
  ML_TRY(ml_json_int(j, NULL, "vocab_size", &c->vocab));
  ML_TRY(positive(j, "vocab_size", c->vocab));
  ML_TRY(ml_json_int_opt(j, NULL, "max_position_embeddings", 2048, &c->max_positions));
  ML_TRY(ml_json_num(j, NULL, "rms_norm_eps", &c->rms_eps));
  return 0;
}

/* rope_theta + rope_scaling (transformers 4) or rope_parameters (5). */
static int read_rope(const ml_json *j, ml_model_config *c) {
  json_t *params = json_object_get(j->root, "rope_parameters");
  const char *where = "rope_parameters";
  if (json_is_object(params)) {
    ML_TRY(ml_json_num_opt(j, params, "rope_theta", c->family->rope_theta_default, &c->rope_theta));
  } else {
    ML_TRY(ml_json_num_opt(j, NULL, "rope_theta", c->family->rope_theta_default, &c->rope_theta));
    params = json_object_get(j->root, "rope_scaling");
    where = "rope_scaling";
  }
  c->rope.type = K_ROPE_DEFAULT;
  if (!json_is_object(params)) return 0;
  json_t *t = json_object_get(params, "rope_type");
  if (!t) t = json_object_get(params, "type");
  const char *type = json_is_string(t) ? json_string_value(t) : "default";
  if (strcmp(type, "default") == 0) return 0;
  if (strcmp(type, "linear") == 0) {
    c->rope.type = K_ROPE_LINEAR;
    return ml_json_num(j, params, "factor", &c->rope.factor);
  }
  if (strcmp(type, "llama3") == 0) {
    c->rope.type = K_ROPE_LLAMA3;
    ML_TRY(ml_json_num(j, params, "factor", &c->rope.factor));
    ML_TRY(ml_json_num(j, params, "low_freq_factor", &c->rope.low_freq_factor));
    ML_TRY(ml_json_num(j, params, "high_freq_factor", &c->rope.high_freq_factor));
    return ml_json_num(j, params, "original_max_position_embeddings",
                       &c->rope.original_max_positions);
  }
  return ml_err("%s: field '%s.rope_type': unsupported rope type '%s'; expected default, linear "
                "or llama3",
                j->path, where, type);
}

static int read_flags(const ml_json *j, ml_model_config *c) {
  const ml_family *f = c->family;
  c->qkv_bias = f->qkv_bias_default;
  if (f->qkv_bias_key)
    ML_TRY(ml_json_bool_opt(j, NULL, f->qkv_bias_key, f->qkv_bias_default, &c->qkv_bias));
  c->mlp_bias = false;
  if (f->has_mlp_bias_key) ML_TRY(ml_json_bool_opt(j, NULL, "mlp_bias", false, &c->mlp_bias));
  ML_TRY(ml_json_bool_opt(j, NULL, "tie_word_embeddings", f->tie_default, &c->tie_embeddings));
  json_t *dt = json_object_get(j->root, "dtype");
  if (!json_is_string(dt)) dt = json_object_get(j->root, "torch_dtype");
  c->dtype = ML_F32;
  if (json_is_string(dt) && ml_dtype_parse_torch(json_string_value(dt), &c->dtype))
    return ml_err("%s: field 'torch_dtype': expected float32, bfloat16 or float16, found '%s'",
                  j->path, json_string_value(dt));
  json_t *act = json_object_get(j->root, "hidden_act");
  if (json_is_string(act) && strcmp(json_string_value(act), f->hidden_act) != 0)
    return ml_err("%s: field 'hidden_act': %s models use '%s', found '%s'", j->path, f->name,
                  f->hidden_act, json_string_value(act));
  return 0;
}

int ml_model_config_load(const char *dir, ml_model_config *out) {
  char path[4096];
  snprintf(path, sizeof path, "%s/config.json", dir);
  memset(out, 0, sizeof *out);
  ml_json j;
  ML_TRY(ml_json_load(path, &j));
  int rc = read_family(&j, out);
  if (!rc) rc = read_sizes(&j, out);
  if (!rc) rc = read_rope(&j, out);
  if (!rc) rc = read_flags(&j, out);
  ml_json_free(&j);
  return rc;
}

static json_t *rope_json(const ml_model_config *c) {
  if (c->rope.type == K_ROPE_DEFAULT) return json_null();
  if (c->rope.type == K_ROPE_LINEAR)
    return json_pack("{s:s, s:f}", "rope_type", "linear", "factor", c->rope.factor);
  return json_pack("{s:s, s:f, s:f, s:f, s:f}", "rope_type", "llama3", "factor", c->rope.factor,
                   "low_freq_factor", c->rope.low_freq_factor, "high_freq_factor",
                   c->rope.high_freq_factor, "original_max_position_embeddings",
                   c->rope.original_max_positions);
}

int ml_model_config_write(const char *dir, const ml_model_config *c) {
  const ml_family *f = c->family;
  json_t *root = json_pack(
      "{s:[s], s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:f, s:o, s:b, s:s, s:s, s:f}",
      "architectures", f->architecture, "model_type", f->model_type, "hidden_size",
      (json_int_t)c->hidden, "intermediate_size", (json_int_t)c->intermediate,
      "num_hidden_layers", (json_int_t)c->n_layers, "num_attention_heads",
      (json_int_t)c->n_heads, "num_key_value_heads", (json_int_t)c->n_kv_heads, "head_dim",
      (json_int_t)c->head_dim, "vocab_size", (json_int_t)c->vocab, "max_position_embeddings",
      (json_int_t)c->max_positions, "rms_norm_eps", c->rms_eps, "rope_theta", c->rope_theta,
      "rope_scaling", rope_json(c), "tie_word_embeddings", c->tie_embeddings, "hidden_act",
      f->hidden_act, "torch_dtype", ml_dtype_torch_name(c->dtype), "initializer_range", 0.02);
  if (!root) return ml_err("%s/config.json: could not build the JSON document", dir);
  if (f->qkv_bias_key) json_object_set_new(root, f->qkv_bias_key, json_boolean(c->qkv_bias));
  if (f->has_mlp_bias_key) json_object_set_new(root, "mlp_bias", json_boolean(c->mlp_bias));
  char path[4096];
  snprintf(path, sizeof path, "%s/config.json", dir);
  int rc = ml_json_write(path, root);
  json_decref(root);
  return rc;
}

typedef struct preset {
  const char *name;
  int64_t hidden, intermediate, layers, heads, kv_heads, vocab, max_positions;
} preset;

static const preset presets[] = {
    {"tiny", 64, 192, 2, 4, 2, 256, 512},
    {"small", 384, 1024, 8, 6, 2, 256, 2048},
};

int ml_model_config_preset(const char *arch, const char *name, ml_model_config *out) {
  memset(out, 0, sizeof *out);
  out->family = ml_family_by_name(arch);
  if (!out->family)
    return ml_err("--arch: unknown family '%s'; expected one of: %s", arch,
                  ml_family_list_names());
  const preset *p = NULL;
  for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
    if (strcmp(presets[i].name, name) == 0) p = &presets[i];
  if (!p) return ml_err("--preset: unknown preset '%s'; expected tiny or small", name);
  out->hidden = p->hidden;
  out->intermediate = p->intermediate;
  out->n_layers = p->layers;
  out->n_heads = p->heads;
  out->n_kv_heads = p->kv_heads;
  out->head_dim = p->hidden / p->heads;
  out->vocab = p->vocab;
  out->max_positions = p->max_positions;
  out->rms_eps = 1e-5;
  out->rope_theta = out->family->rope_theta_default;
  out->rope.type = K_ROPE_DEFAULT;
  out->qkv_bias = out->family->qkv_bias_default;
  out->tie_embeddings = out->family->tie_default;
  out->dtype = ML_F32;
  return 0;
}

int64_t ml_model_config_num_params(const ml_model_config *c) {
  int64_t H = c->hidden, q = c->n_heads * c->head_dim, kv = c->n_kv_heads * c->head_dim;
  int64_t attn = H * q + 2 * H * kv + q * H + (c->qkv_bias ? q + 2 * kv : 0);
  int64_t mlp = 3 * H * c->intermediate + (c->mlp_bias ? 2 * c->intermediate + H : 0);
  int64_t layer = attn + mlp + 2 * H;
  int64_t embed = c->vocab * H * (c->tie_embeddings ? 1 : 2);
  return c->n_layers * layer + embed + H;
}
