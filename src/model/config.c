#include "model/config.h"
#include "model/block.h"

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

/* A size in [1, max] (config.h ML_MAX_*: the bounds that keep every
 * product of config sizes within int64). */
static int size_in_range(const ml_json *j, const char *key, int64_t v, int64_t max) {
  if (v >= 1 && v <= max) return 0;
  return ml_err("%s: field '%s': expected an integer from 1 to %lld (meshlm's limit, which keeps "
                "every tensor size within 64 bits), found %lld",
                j->path, key, (long long)max, (long long)v);
}

/* Read the integer field `key` (required, or `dflt` when absent if
 * `optional`) and bound it to [1, max]. */
static int read_size(const ml_json *j, const char *key, bool optional, int64_t dflt, int64_t max,
                     int64_t *out) {
  if (optional) ML_TRY(ml_json_int_opt(j, NULL, key, dflt, out));
  else ML_TRY(ml_json_int(j, NULL, key, out));
  return size_in_range(j, key, *out, max);
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

/* The document the text model's hyper-parameters live in: the root, or a
 * view of its text_config object (path "DIR/config.json (text_config)",
 * held in `path`; not to be freed). */
static int text_view(const ml_json *j, const ml_family *f, char *path, size_t cap,
                     ml_json *out) {
  *out = *j;
  if (!f->text_config_key) return 0;
  json_t *t = json_object_get(j->root, f->text_config_key);
  if (!json_is_object(t))
    return ml_err("%s: field '%s': %s checkpoints nest the text model's settings there; expected "
                  "an object, found %s",
                  j->path, f->text_config_key, f->architecture, t ? "something else" : "nothing");
  snprintf(path, cap, "%s (%s)", j->path, f->text_config_key);
  out->path = path;
  out->root = t;
  return 0;
}

/* The sizes, each bounded (config.h ML_MAX_*) as it is read, before any
 * product of them is formed. */
static int read_sizes(const ml_json *j, ml_model_config *c) {
  ML_TRY(read_size(j, "hidden_size", false, 0, ML_MAX_HIDDEN, &c->hidden));
  ML_TRY(read_size(j, "intermediate_size", false, 0, ML_MAX_INTERMEDIATE, &c->intermediate));
  ML_TRY(read_size(j, "num_hidden_layers", false, 0, ML_MAX_LAYERS, &c->n_layers));
  ML_TRY(read_size(j, "num_attention_heads", false, 0, ML_MAX_HEADS, &c->n_heads));
  ML_TRY(read_size(j, "num_key_value_heads", true, c->n_heads, ML_MAX_HEADS, &c->n_kv_heads));
  if (c->n_heads % c->n_kv_heads != 0)
    return ml_err("%s: num_attention_heads %lld is not a multiple of num_key_value_heads %lld",
                  j->path, (long long)c->n_heads, (long long)c->n_kv_heads);
  int64_t hd = c->family->head_dim_default ? c->family->head_dim_default : c->hidden / c->n_heads;
  ML_TRY(read_size(j, "head_dim", true, hd, ML_MAX_HEAD_DIM, &c->head_dim));
  if (c->head_dim % 2 != 0)
    return ml_err("%s: field 'head_dim': expected an even size for rotary embeddings, found %lld",
                  j->path, (long long)c->head_dim);
  ML_TRY(read_size(j, "vocab_size", false, 0, ML_MAX_VOCAB, &c->vocab));
  ML_TRY(read_size(j, "max_position_embeddings", true, c->family->max_positions_default,
                   ML_MAX_POSITIONS, &c->max_positions));
  ML_TRY(ml_json_num(j, NULL, "rms_norm_eps", &c->rms_eps));
  return 0;
}

int64_t ml_model_config_max_seq_len(const ml_model_config *c) {
  bool dynamic = c->rope.type == ML_ROPE_DYNAMIC && c->rope_local.type == ML_ROPE_DYNAMIC;
  return dynamic ? ML_MAX_POSITIONS : c->max_positions;
}

int ml_model_config_check_seq_len(const ml_model_config *c, const char *dir, int64_t seq_len,
                                  const char *what) {
  int64_t max = ml_model_config_max_seq_len(c);
  if (seq_len <= max) return 0;
  if (max > c->max_positions)
    return ml_err("%s: %lld tokens, above meshlm's limit of %lld positions; expected at most %lld "
                  "tokens",
                  what, (long long)seq_len, (long long)max, (long long)max);
  return ml_err("%s: %lld tokens, above max_position_embeddings %lld of %s/config.json; expected "
                "at most %lld tokens",
                what, (long long)seq_len, (long long)c->max_positions, dir,
                (long long)c->max_positions);
}

/* One rope_parameters / rope_scaling entry being read: its JSON object,
 * its name in messages ("rope_parameters", "rope_parameters.full_attention"),
 * and whether it is the flat (one for all layers) layout. */
typedef struct rope_entry {
  const ml_json *j;
  const json_t *params;
  const char *where;
  bool flat;
} rope_entry;

/* Field `key` of the entry as a number: required, or `dflt` when absent or
 * null; errors name the file and where.key. */
static int rope_num(const rope_entry *e, const char *key, bool required, double dflt, double *out) {
  const json_t *v = json_object_get(e->params, key);
  *out = dflt;
  if (!required && (!v || json_is_null(v))) return 0;
  if (json_is_number(v)) {
    *out = json_number_value(v);
    return 0;
  }
  char found[64];
  ml_json_brief(v, found, sizeof found);
  return ml_err("%s: field '%s.%s': expected a number, found %s", e->j->path, e->where, key,
                found);
}

/* An optional number that must be positive when given (0: absent). */
static int rope_positive_opt(const rope_entry *e, const char *key, double *out) {
  const json_t *v = json_object_get(e->params, key);
  ML_TRY(rope_num(e, key, false, 0.0, out));
  if (!v || json_is_null(v) || *out > 0) return 0;
  return ml_err("%s: field '%s.%s': expected a positive number or null, found %g", e->j->path,
                e->where, key, *out);
}

/* original_max_position_embeddings of a llama3 / yarn / longrope entry as
 * standardize_rope_params settles it: in the flat layout a top-level key
 * wins (Phi-3 keeps it there), else the entry's, else
 * max_position_embeddings. */
static int rope_original_max(const rope_entry *e, const ml_model_config *c, double *out) {
  const char *key = "original_max_position_embeddings";
  const json_t *top = e->flat ? json_object_get(e->j->root, key) : NULL;
  int64_t dflt = c->family->original_max_default; /* a class attribute: always set */
  if (top && !json_is_null(top)) ML_TRY(ml_json_num(e->j, NULL, key, out));
  else if (e->flat && dflt) *out = (double)dflt;
  else ML_TRY(rope_num(e, key, false, (double)c->max_positions, out));
  if (*out >= 1) return 0;
  return ml_err("%s: field '%s%s%s': expected a length >= 1, found %g", e->j->path,
                top ? "" : e->where, top ? "" : ".", key, *out);
}

/* longrope's `key` list: head_dim / 2 numbers into out. */
static int rope_factors(const rope_entry *e, const char *key, int64_t head_dim, float *out) {
  const json_t *v = json_object_get(e->params, key);
  size_t n = (size_t)(head_dim / 2);
  if (json_is_array(v) && json_array_size(v) == n) {
    for (size_t i = 0; i < n; i++) {
      const json_t *x = json_array_get(v, i);
      if (!json_is_number(x) || !(json_number_value(x) > 0))
        return ml_err("%s: field '%s.%s[%zu]': expected a positive number", e->j->path, e->where,
                      key, i);
      out[i] = (float)json_number_value(x); /* torch.tensor(..., dtype=float32) */
    }
    return 0;
  }
  char found[64];
  ml_json_brief(v, found, sizeof found);
  return ml_err("%s: field '%s.%s': expected a list of %zu numbers (head_dim / 2), found %s",
                e->j->path, e->where, key, n, found);
}

/* partial_rotary_factor, top-level or in an entry: meshlm rotates whole
 * heads, so only 1 (or its absence) is accepted. */
static int whole_heads(const ml_json *j, const json_t *obj, const char *where) {
  double f;
  ML_TRY(ml_json_num_opt(j, obj, "partial_rotary_factor", 1.0, &f));
  if (f == 1.0) return 0;
  return ml_err("%s: field '%s%spartial_rotary_factor': meshlm rotates whole heads; expected 1.0, "
                "found %g",
                j->path, where ? where : "", where ? "." : "", f);
}

static const struct {
  const char *name;
  ml_rope_type type;
} rope_types[] = {
    {"default", ML_ROPE_DEFAULT}, {"linear", ML_ROPE_LINEAR}, {"llama3", ML_ROPE_LLAMA3},
    {"dynamic", ML_ROPE_DYNAMIC}, {"yarn", ML_ROPE_YARN},     {"longrope", ML_ROPE_LONGROPE},
};
enum { N_ROPE_TYPES = sizeof rope_types / sizeof rope_types[0] };

/* The fields of the entry's type (transformers 5.23 modeling_rope_utils:
 * the keys each _compute_*_parameters reads, with its defaults). */
static int read_rope_fields(const rope_entry *e, const ml_model_config *c, ml_rope_scaling *sc) {
  const ml_json *j = e->j;
  switch (sc->type) {
  case ML_ROPE_DEFAULT: return 0;
  case ML_ROPE_LINEAR: return rope_num(e, "factor", true, 0, &sc->factor);
  case ML_ROPE_LLAMA3:
    ML_TRY(rope_num(e, "factor", true, 0, &sc->factor));
    ML_TRY(rope_num(e, "low_freq_factor", true, 0, &sc->low_freq_factor));
    ML_TRY(rope_num(e, "high_freq_factor", true, 0, &sc->high_freq_factor));
    return rope_original_max(e, c, &sc->original_max_positions);
  case ML_ROPE_DYNAMIC:
    sc->max_positions = (double)c->max_positions;
    ML_TRY(rope_num(e, "factor", true, 0, &sc->factor));
    if (c->head_dim <= 2) /* the NTK exponent head_dim / (head_dim − 2) */
      return ml_err("%s: field 'head_dim': dynamic RoPE needs a head_dim above 2, found %lld",
                    j->path, (long long)c->head_dim);
    if (sc->factor > 0) return 0;
    return ml_err("%s: field '%s.factor': expected a positive number, found %g", j->path,
                  e->where, sc->factor);
  case ML_ROPE_YARN:
    sc->max_positions = (double)c->max_positions;
    sc->truncate = true; /* config.rope_parameters.get("truncate", True): the flat entry's */
    if (e->flat) ML_TRY(ml_json_bool_opt(j, e->params, "truncate", true, &sc->truncate));
    ML_TRY(rope_positive_opt(e, "factor", &sc->factor));
    ML_TRY(rope_positive_opt(e, "attention_factor", &sc->attention_factor));
    ML_TRY(rope_num(e, "mscale", false, 0, &sc->mscale));
    ML_TRY(rope_num(e, "mscale_all_dim", false, 0, &sc->mscale_all_dim));
    ML_TRY(rope_num(e, "beta_fast", false, 0, &sc->beta_fast));
    ML_TRY(rope_num(e, "beta_slow", false, 0, &sc->beta_slow));
    return rope_original_max(e, c, &sc->original_max_positions);
  case ML_ROPE_LONGROPE:
    sc->max_positions = (double)c->max_positions;
    ML_TRY(rope_positive_opt(e, "factor", &sc->factor));
    ML_TRY(rope_positive_opt(e, "attention_factor", &sc->attention_factor));
    ML_TRY(rope_factors(e, "short_factor", c->head_dim, sc->short_factor));
    ML_TRY(rope_factors(e, "long_factor", c->head_dim, sc->long_factor));
    return rope_original_max(e, c, &sc->original_max_positions);
  }
  return 0;
}

/* One RoPE: theta from params.rope_theta (default theta_dflt) and the
 * scaling named by params.rope_type (or .type); params may be NULL / null
 * (default rope). `where` names params in messages; `flat`: the one entry
 * of every layer (not nested per layer type). */
static int read_rope_params(const ml_json *j, const ml_model_config *c, const json_t *params,
                            const char *where, bool flat, double theta_dflt, double *theta,
                            ml_rope_scaling *sc) {
  memset(sc, 0, sizeof *sc);
  sc->type = ML_ROPE_DEFAULT;
  *theta = theta_dflt;
  if (!json_is_object(params)) return 0;
  ML_TRY(ml_json_num_opt(j, params, "rope_theta", theta_dflt, theta));
  ML_TRY(whole_heads(j, params, where));
  json_t *t = json_object_get(params, "rope_type");
  if (!t) t = json_object_get(params, "type");
  const char *type = json_is_string(t) ? json_string_value(t) : "default";
  for (int i = 0; i < N_ROPE_TYPES; i++)
    if (strcmp(type, rope_types[i].name) == 0) {
      sc->type = rope_types[i].type;
      return read_rope_fields(&(rope_entry){j, params, where, flat}, c, sc);
    }
  return ml_err("%s: field '%s.rope_type': unsupported rope type '%s'; expected default, linear, "
                "llama3, dynamic, yarn or longrope",
                j->path, where, type);
}

/* Global and local RoPE. transformers 4: rope_theta + rope_scaling (+
 * rope_local_base_freq); 5: rope_parameters, flat, or nested per layer type
 * {full_attention, sliding_attention} (Gemma3TextConfig.convert_rope_params_to_dict). */
static int read_rope(const ml_json *j, ml_model_config *c) {
  const ml_family *f = c->family;
  double theta_kw, local_kw;
  ML_TRY(ml_json_num_opt(j, NULL, "rope_theta", f->rope_theta_default, &theta_kw));
  ML_TRY(whole_heads(j, NULL, NULL));
  json_t *params = json_object_get(j->root, "rope_parameters");
  if (!f->local_rope) {
    if (json_is_object(params))
      ML_TRY(read_rope_params(j, c, params, "rope_parameters", true, theta_kw, &c->rope_theta,
                              &c->rope));
    else
      ML_TRY(read_rope_params(j, c, json_object_get(j->root, "rope_scaling"), "rope_scaling",
                              true, theta_kw, &c->rope_theta, &c->rope));
    c->rope_local_theta = c->rope_theta;
    c->rope_local = c->rope;
    return 0;
  }
  ML_TRY(ml_json_num_opt(j, NULL, "rope_local_base_freq", f->rope_local_theta_default, &local_kw));
  if (!json_is_object(params)) {
    ML_TRY(read_rope_params(j, c, json_object_get(j->root, "rope_scaling"), "rope_scaling", true,
                            theta_kw, &c->rope_theta, &c->rope));
    return read_rope_params(j, c, NULL, "rope_local_base_freq", true, local_kw,
                            &c->rope_local_theta, &c->rope_local);
  }
  json_t *full = json_object_get(params, "full_attention");
  json_t *sliding = json_object_get(params, "sliding_attention");
  if (!full && !sliding)
    return ml_err("%s: field 'rope_parameters': %s models take one entry per layer type; "
                  "expected {\"full_attention\": {...}, \"sliding_attention\": {...}}",
                  j->path, f->name);
  ML_TRY(read_rope_params(j, c, full, "rope_parameters.full_attention", false, theta_kw,
                          &c->rope_theta, &c->rope));
  return read_rope_params(j, c, sliding, "rope_parameters.sliding_attention", false, local_kw,
                          &c->rope_local_theta, &c->rope_local);
}

/* sliding_window and the per-layer attention types: layer_types when given,
 * else the family's rule (Qwen2Config/Qwen3Config/Gemma3TextConfig/
 * Qwen2MoeConfig __post_init__; Mistral, Mixtral: sliding_window alone, on
 * every layer; Qwen3-MoE: the same when use_sliding_window). */
static int read_layer_types(const ml_json *j, ml_model_config *c) {
  const ml_family *f = c->family;
  memset(c->sliding, 0, sizeof c->sliding);
  c->sliding_window = 0;
  if (f->layer_rule == ML_LAYERS_ALL_FULL) return 0;
  const char *why = "is null";
  ML_TRY(ml_json_int_opt(j, NULL, "sliding_window", f->sliding_window_default, &c->sliding_window));
  if (json_is_null(json_object_get(j->root, "sliding_window"))) c->sliding_window = 0;
  if (f->layer_rule == ML_LAYERS_ALL_SLIDING) {
    bool use = true;
    if (f->window_gated) ML_TRY(ml_json_bool_opt(j, NULL, "use_sliding_window", false, &use));
    if (!use) c->sliding_window = 0;
    for (int64_t l = 0; l < c->n_layers; l++) c->sliding[l] = c->sliding_window > 0;
    return 0;
  }
  bool gated = f->layer_rule == ML_LAYERS_MAX_WINDOW || f->layer_rule == ML_LAYERS_EVEN_BELOW_MAX;
  if (gated) {
    bool use = false;
    ML_TRY(ml_json_bool_opt(j, NULL, "use_sliding_window", false, &use));
    if (!use) {
      c->sliding_window = 0;
      why = "is unused (use_sliding_window is false)";
    }
  }
  json_t *types = json_object_get(j->root, "layer_types");
  if (types && !json_is_null(types)) {
    if (!json_is_array(types) || (int64_t)json_array_size(types) != c->n_layers)
      return ml_err("%s: field 'layer_types': expected a list of %lld entries (num_hidden_layers), "
                    "found %s",
                    j->path, (long long)c->n_layers,
                    json_is_array(types) ? "a list of another length" : "something else");
    for (int64_t l = 0; l < c->n_layers; l++) {
      const char *t = json_string_value(json_array_get(types, (size_t)l));
      if (t && strcmp(t, "sliding_attention") == 0) c->sliding[l] = true;
      else if (!t || strcmp(t, "full_attention") != 0)
        return ml_err("%s: field 'layer_types[%lld]': expected \"full_attention\" or "
                      "\"sliding_attention\", found %s",
                      j->path, (long long)l, t ? t : "a non-string");
    }
  } else if (gated) {
    int64_t max_window_layers;
    ML_TRY(ml_json_int_opt(j, NULL, "max_window_layers", 28, &max_window_layers));
    for (int64_t l = 0; l < c->n_layers; l++)
      c->sliding[l] = c->sliding_window > 0 && (f->layer_rule == ML_LAYERS_MAX_WINDOW
                                                    ? l >= max_window_layers
                                                    : (l + 1) % 2 != 0 && l < max_window_layers);
  } else {
    int64_t pattern;
    ML_TRY(ml_json_int_opt(j, NULL, "sliding_window_pattern", f->sliding_pattern_default,
                           &pattern));
    ML_TRY(positive(j, "sliding_window_pattern", pattern));
    for (int64_t l = 0; l < c->n_layers; l++) c->sliding[l] = (l + 1) % pattern != 0;
  }
  for (int64_t l = 0; l < c->n_layers; l++)
    if (c->sliding[l] && c->sliding_window <= 0)
      return ml_err("%s: field 'sliding_window': layer %lld is \"sliding_attention\" but the "
                    "window %s; expected a positive window",
                    j->path, (long long)l, why);
  return 0;
}

/* Keys the family does not implement must be absent, null or false. */
static int reject_unsupported(const ml_json *j, const ml_family *f) {
  for (int i = 0; i < ML_FAMILY_MAX_UNSUPPORTED && f->unsupported[i]; i++) {
    json_t *v = json_object_get(j->root, f->unsupported[i]);
    if (!v || json_is_null(v) || json_is_false(v)) continue;
    char found[64];
    ml_json_brief(v, found, sizeof found);
    return ml_err("%s: field '%s': meshlm does not implement it for %s models, found %s; "
                  "expected %s",
                  j->path, f->unsupported[i], f->name, found,
                  json_is_boolean(v) ? "false" : "null");
  }
  return 0;
}

/* Text-model flags (from the text view t) and top-level ones (from root). */
static int read_flags(const ml_json *root, const ml_json *t, ml_model_config *c) {
  const ml_family *f = c->family;
  c->qkv_bias = f->qkv_bias_default;
  if (f->qkv_bias_key)
    ML_TRY(ml_json_bool_opt(t, NULL, f->qkv_bias_key, f->qkv_bias_default, &c->qkv_bias));
  c->o_bias = f->o_bias_follows_qkv && c->qkv_bias;
  c->mlp_bias = false;
  if (f->has_mlp_bias_key) ML_TRY(ml_json_bool_opt(t, NULL, "mlp_bias", false, &c->mlp_bias));
  ML_TRY(ml_json_bool_opt(root, NULL, "tie_word_embeddings", f->tie_default, &c->tie_embeddings));
  json_t *dt = json_object_get(root->root, "dtype");
  if (!json_is_string(dt)) dt = json_object_get(root->root, "torch_dtype");
  c->dtype = ML_F32;
  if (json_is_string(dt) && ml_dtype_parse_torch(json_string_value(dt), &c->dtype))
    return ml_err("%s: field 'torch_dtype': expected float32, bfloat16 or float16, found '%s'",
                  root->path, json_string_value(dt));
  json_t *act = json_object_get(t->root, f->hidden_act_key);
  if (json_is_string(act) && strcmp(json_string_value(act), f->hidden_act) != 0)
    return ml_err("%s: field '%s': %s models use '%s', found '%s'", t->path, f->hidden_act_key,
                  f->name, f->hidden_act, json_string_value(act));
  c->attn_scalar = (double)c->head_dim;
  if (f->attn_scalar_key) {
    ML_TRY(ml_json_num_opt(t, NULL, f->attn_scalar_key, f->attn_scalar_default, &c->attn_scalar));
    if (!(c->attn_scalar > 0))
      return ml_err("%s: field '%s': expected a positive number, found %g", t->path,
                    f->attn_scalar_key, c->attn_scalar);
  }
  return reject_unsupported(t, f);
}

/* The sparse layers of a Qwen3-MoE config: l is sparse unless listed in
 * mlp_only_layers or (l + 1) % decoder_sparse_step != 0
 * (Qwen3MoeDecoderLayer.__init__). */
static int read_sparse_layers(const ml_json *j, ml_model_config *c) {
  int64_t step;
  ML_TRY(ml_json_int_opt(j, NULL, "decoder_sparse_step", 1, &step));
  ML_TRY(positive(j, "decoder_sparse_step", step));
  for (int64_t l = 0; l < c->n_layers; l++) c->moe[l] = (l + 1) % step == 0;
  json_t *only = json_object_get(j->root, "mlp_only_layers");
  if (!only || json_is_null(only)) return 0;
  if (!json_is_array(only))
    return ml_err("%s: field 'mlp_only_layers': expected a list of layer indices, found "
                  "something else",
                  j->path);
  for (size_t i = 0; i < json_array_size(only); i++) {
    json_t *v = json_array_get(only, i);
    int64_t l = json_is_integer(v) ? (int64_t)json_integer_value(v) : -1;
    if (l < 0 || l >= c->n_layers)
      return ml_err("%s: field 'mlp_only_layers[%zu]': expected a layer index from 0 to %lld, "
                    "found %s",
                    j->path, i, (long long)c->n_layers - 1,
                    json_is_integer(v) ? "one outside" : "a non-integer");
    c->moe[l] = false;
  }
  return 0;
}

/* The mixture-of-experts settings of a family with a sparse block
 * (family.h moe_block), bounded before any product is formed. */
static int read_moe(const ml_json *j, ml_model_config *c) {
  const ml_family *f = c->family;
  if (!f->moe_block) return 0;
  const char *ek = f->experts_key                                ? f->experts_key
                   : json_object_get(j->root, "num_experts") ? "num_experts"
                                                             : "num_local_experts";
  ML_TRY(read_size(j, ek, true, f->experts_default, ML_MAX_EXPERTS, &c->n_experts));
  ML_TRY(read_size(j, "num_experts_per_tok", true, f->top_k_default, ML_MAX_EXPERTS, &c->top_k));
  if (c->top_k > c->n_experts)
    return ml_err("%s: field 'num_experts_per_tok': %lld experts per token, but %s is %lld; "
                  "expected at most %lld",
                  j->path, (long long)c->top_k, ek, (long long)c->n_experts,
                  (long long)c->n_experts);
  ML_TRY(read_size(j, f->moe_inter_key, f->moe_inter_default > 0, f->moe_inter_default,
                   ML_MAX_INTERMEDIATE, &c->moe_inter));
  if (c->moe_inter > ML_MAX_INTERMEDIATE / c->n_experts)
    return ml_err("%s: %s %lld experts of %s %lld: %lld features in all, above meshlm's limit of "
                  "%d (ML_MAX_INTERMEDIATE, which keeps every tensor size within 64 bits)",
                  j->path, ek, (long long)c->n_experts, f->moe_inter_key,
                  (long long)c->moe_inter, (long long)(c->n_experts * c->moe_inter),
                  ML_MAX_INTERMEDIATE);
  if (f->shared_expert)
    ML_TRY(read_size(j, f->shared_inter_key, true, f->shared_inter_default, ML_MAX_INTERMEDIATE,
                     &c->shared_inter));
  c->norm_topk = true;
  if (f->norm_topk_key) ML_TRY(ml_json_bool_opt(j, NULL, f->norm_topk_key, false, &c->norm_topk));
  ML_TRY(ml_json_bool_opt(j, NULL, "output_router_logits", false, &c->router_aux));
  ML_TRY(ml_json_num_opt(j, NULL, "router_aux_loss_coef", 0.001, &c->aux_coef));
  double jitter;
  ML_TRY(ml_json_num_opt(j, NULL, "router_jitter_noise", 0.0, &jitter));
  if (jitter != 0.0)
    return ml_err("%s: field 'router_jitter_noise': meshlm does not implement the router's "
                  "training noise, found %g; expected 0",
                  j->path, jitter);
  if (f->moe_sparse_keys) return read_sparse_layers(j, c);
  for (int64_t l = 0; l < c->n_layers; l++) c->moe[l] = true;
  return 0;
}

int ml_model_config_load(const char *dir, ml_model_config *out) {
  char path[4096], text_path[4200];
  snprintf(path, sizeof path, "%s/config.json", dir);
  memset(out, 0, sizeof *out);
  ml_json j, t;
  ML_TRY(ml_json_load(path, &j));
  int rc = read_family(&j, out);
  if (!rc) rc = text_view(&j, out->family, text_path, sizeof text_path, &t);
  if (!rc) rc = read_sizes(&t, out);
  if (!rc) rc = read_rope(&t, out);
  if (!rc) rc = read_layer_types(&t, out);
  if (!rc) rc = read_flags(&j, &t, out);
  if (!rc) rc = read_moe(&t, out);
  ml_json_free(&j);
  return rc;
}

/* ---- writing ------------------------------------------------------------ */

/* A number that configs type as int when it is integral. */
static json_t *int_or_real(double v) {
  return v == floor(v) && fabs(v) < 9e15 ? json_integer((json_int_t)v) : json_real(v);
}

/* key: v in o unless v is 0 (a field config.json omitted). */
static void set_given(json_t *o, const char *key, double v) {
  if (v != 0) json_object_set_new(o, key, json_real(v));
}

static json_t *factor_list(const float *f, int64_t n) {
  json_t *a = json_array();
  for (int64_t i = 0; i < n; i++) json_array_append_new(a, json_real(f[i]));
  return a;
}

/* The rope_scaling / rope_parameters entry of sc (without rope_theta), the
 * keys read_rope_fields reads. */
static json_t *rope_json(const ml_rope_scaling *sc, int64_t head_dim) {
  const char *name = NULL;
  for (int i = 0; i < N_ROPE_TYPES; i++)
    if (rope_types[i].type == sc->type) name = rope_types[i].name;
  if (sc->type == ML_ROPE_DEFAULT) return json_null();
  json_t *o = json_pack("{s:s}", "rope_type", name);
  set_given(o, "factor", sc->factor);
  if (sc->type == ML_ROPE_LLAMA3) {
    json_object_set_new(o, "low_freq_factor", json_real(sc->low_freq_factor));
    json_object_set_new(o, "high_freq_factor", json_real(sc->high_freq_factor));
  }
  if (sc->type == ML_ROPE_YARN) {
    set_given(o, "attention_factor", sc->attention_factor);
    set_given(o, "mscale", sc->mscale);
    set_given(o, "mscale_all_dim", sc->mscale_all_dim);
    set_given(o, "beta_fast", sc->beta_fast);
    set_given(o, "beta_slow", sc->beta_slow);
    if (!sc->truncate) json_object_set_new(o, "truncate", json_false());
  }
  if (sc->type == ML_ROPE_LONGROPE) {
    set_given(o, "attention_factor", sc->attention_factor);
    json_object_set_new(o, "short_factor", factor_list(sc->short_factor, head_dim / 2));
    json_object_set_new(o, "long_factor", factor_list(sc->long_factor, head_dim / 2));
  }
  if (sc->type == ML_ROPE_LLAMA3 || sc->type == ML_ROPE_YARN || sc->type == ML_ROPE_LONGROPE)
    json_object_set_new(o, "original_max_position_embeddings",
                        int_or_real(sc->original_max_positions));
  return o;
}

/* One rope_parameters entry (transformers 5): {rope_type, rope_theta, ...}. */
static json_t *rope_params_json(double theta, const ml_rope_scaling *sc, int64_t head_dim) {
  json_t *p = rope_json(sc, head_dim);
  if (json_is_null(p)) p = json_pack("{s:s}", "rope_type", "default");
  json_object_set_new(p, "rope_theta", json_real(theta));
  return p;
}

/* rope, sliding window and layer types of the text model. */
static void write_attention_keys(json_t *o, const ml_model_config *c) {
  const ml_family *f = c->family;
  json_object_set_new(o, "rope_theta", json_real(c->rope_theta));
  json_object_set_new(o, "rope_scaling", rope_json(&c->rope, c->head_dim));
  if (f->local_rope) {
    json_object_set_new(o, "rope_local_base_freq", json_real(c->rope_local_theta));
    json_object_set_new(o, "rope_parameters",
                        json_pack("{s:o, s:o}", "full_attention",
                                  rope_params_json(c->rope_theta, &c->rope, c->head_dim),
                                  "sliding_attention",
                                  rope_params_json(c->rope_local_theta, &c->rope_local,
                                                   c->head_dim)));
  }
  if (f->attn_scalar_key) json_object_set_new(o, f->attn_scalar_key, int_or_real(c->attn_scalar));
  if (f->layer_rule == ML_LAYERS_ALL_FULL) return;
  json_t *window = c->sliding_window > 0 ? json_integer(c->sliding_window) : json_null();
  if (f->layer_rule == ML_LAYERS_ALL_SLIDING) { /* the window alone says it (and its switch) */
    json_object_set_new(o, "sliding_window", window);
    if (f->window_gated)
      json_object_set_new(o, "use_sliding_window", json_boolean(c->sliding_window > 0));
    return;
  }
  json_t *types = json_array();
  int64_t first_sliding = c->n_layers;
  for (int64_t l = 0; l < c->n_layers; l++) {
    const char *type = c->sliding[l] ? "sliding_attention" : "full_attention";
    json_array_append_new(types, json_string(type));
    if (c->sliding[l] && first_sliding == c->n_layers) first_sliding = l;
  }
  json_object_set_new(o, "layer_types", types);
  json_object_set_new(o, "sliding_window", window);
  if (f->layer_rule == ML_LAYERS_MAX_WINDOW) {
    json_object_set_new(o, "use_sliding_window", json_boolean(first_sliding < c->n_layers));
    json_object_set_new(o, "max_window_layers", json_integer(first_sliding));
  }
  if (f->layer_rule == ML_LAYERS_EVEN_BELOW_MAX) { /* layer_types says which; the key bounds it */
    json_object_set_new(o, "use_sliding_window", json_boolean(first_sliding < c->n_layers));
    json_object_set_new(o, "max_window_layers", json_integer(c->n_layers));
  }
}

/* The mixture-of-experts keys (read_moe's): num_experts under the name
 * save_pretrained writes (the family's experts_key, else num_local_experts,
 * the attribute_map target). */
static void write_moe_keys(json_t *o, const ml_model_config *c) {
  const ml_family *f = c->family;
  json_object_set_new(o, f->experts_key ? f->experts_key : "num_local_experts",
                      json_integer(c->n_experts));
  json_object_set_new(o, "num_experts_per_tok", json_integer(c->top_k));
  json_object_set_new(o, f->moe_inter_key, json_integer(c->moe_inter));
  if (f->norm_topk_key) json_object_set_new(o, f->norm_topk_key, json_boolean(c->norm_topk));
  if (f->shared_expert) json_object_set_new(o, f->shared_inter_key, json_integer(c->shared_inter));
  json_object_set_new(o, "output_router_logits", json_boolean(c->router_aux));
  json_object_set_new(o, "router_aux_loss_coef", json_real(c->aux_coef));
  if (!f->moe_sparse_keys) return;
  json_t *only = json_array();
  for (int64_t l = 0; l < c->n_layers; l++)
    if (!c->moe[l]) json_array_append_new(only, json_integer(l));
  json_object_set_new(o, "decoder_sparse_step", json_integer(1));
  json_object_set_new(o, "mlp_only_layers", only);
}

/* The text model's keys (the whole config of a text-only family). */
static json_t *text_json(const ml_model_config *c) {
  const ml_family *f = c->family;
  json_t *o = json_pack(
      "{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:b, s:s, s:f}", "hidden_size",
      (json_int_t)c->hidden, "intermediate_size", (json_int_t)c->intermediate,
      "num_hidden_layers", (json_int_t)c->n_layers, "num_attention_heads",
      (json_int_t)c->n_heads, "num_key_value_heads", (json_int_t)c->n_kv_heads, "head_dim",
      (json_int_t)c->head_dim, "vocab_size", (json_int_t)c->vocab, "max_position_embeddings",
      (json_int_t)c->max_positions, "rms_norm_eps", c->rms_eps, "tie_word_embeddings",
      c->tie_embeddings, "torch_dtype", ml_dtype_torch_name(c->dtype), "initializer_range", 0.02);
  if (!o) return NULL;
  json_object_set_new(o, f->hidden_act_key, json_string(f->hidden_act));
  write_attention_keys(o, c);
  if (f->qkv_bias_key) json_object_set_new(o, f->qkv_bias_key, json_boolean(c->qkv_bias));
  if (f->has_mlp_bias_key) json_object_set_new(o, "mlp_bias", json_boolean(c->mlp_bias));
  if (f->moe_block) write_moe_keys(o, c);
  return o;
}

int ml_model_config_write(const char *dir, const ml_model_config *c) {
  const ml_family *f = c->family;
  json_t *root = json_pack("{s:[s], s:s}", "architectures", f->architecture, "model_type",
                           f->model_type);
  json_t *text = text_json(c);
  if (!root || !text) {
    json_decref(root);
    json_decref(text);
    return ml_err("%s/config.json: could not build the JSON document", dir);
  }
  if (f->text_config_key) { /* composite: the text model nested, tying and dtype top-level */
    json_object_set_new(text, "model_type", json_string(f->text_model_type));
    json_object_set_new(root, f->text_config_key, text);
    json_object_set_new(root, "tie_word_embeddings", json_boolean(c->tie_embeddings));
    json_object_set_new(root, "torch_dtype", json_string(ml_dtype_torch_name(c->dtype)));
  } else {
    json_object_update(root, text);
    json_decref(text);
  }
  static const char *const token_keys[3] = {"bos_token_id", "eos_token_id", "pad_token_id"};
  for (int i = 0; i < 3; i++) /* class defaults the vocabulary does not hold: none */
    if (f->token_id_defaults[i] >= c->vocab) json_object_set_new(root, token_keys[i], json_null());
  if (f->original_max_default) { /* Phi-3 reads it top-level over the RoPE entry's */
    const ml_rope_scaling *sc = &c->rope;
    bool has = sc->type == ML_ROPE_LLAMA3 || sc->type == ML_ROPE_YARN || sc->type == ML_ROPE_LONGROPE;
    json_object_set_new(root, "original_max_position_embeddings",
                        has ? int_or_real(sc->original_max_positions)
                            : json_integer(f->original_max_default));
  }
  char path[4096];
  snprintf(path, sizeof path, "%s/config.json", dir);
  int rc = ml_json_write(path, root);
  json_decref(root);
  return rc;
}

/* ---- presets ------------------------------------------------------------ */

typedef struct preset {
  const char *name;
  int64_t hidden, intermediate, layers, heads, kv_heads, vocab, max_positions;
  int64_t window; /* sliding window of families with sliding layers */
  bool tied;      /* tie_word_embeddings even where the family's default is untied */
  double rope_theta; /* 0: the family's default */
} preset;

static const preset presets[] = {
    {"tiny", 64, 192, 2, 4, 2, 256, 512, 16, false, 0},
    {"small", 384, 1024, 8, 6, 2, 256, 2048, 128, false, 0},
    /* the shape of HuggingFaceTB/SmolLM2-135M (config.json), for benchmarks */
    {"smollm2-135m", 576, 1536, 30, 9, 3, 49152, 8192, 128, true, 100000},
    /* the shape of meta-llama/Llama-3.2-1B (its llama3 RoPE scaling aside: the
     * arithmetic per token is the same), for the GPU benchmarks */
    {"llama3.2-1b", 2048, 8192, 16, 32, 8, 128256, 131072, 4096, true, 500000},
};

int ml_model_config_preset(const char *arch, const char *name, ml_model_config *out) {
  memset(out, 0, sizeof *out);
  const ml_family *f = ml_family_by_name(arch);
  if (f && f->save_as)
    return ml_err("--arch %s: init writes text models only; expected --arch %s", arch, f->save_as);
  if (!f)
    return ml_err("--arch: unknown family '%s'; expected one of: %s", arch,
                  ml_family_list_names());
  out->family = f;
  const preset *p = NULL;
  for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
    if (strcmp(presets[i].name, name) == 0) p = &presets[i];
  if (!p)
    return ml_err("--preset: unknown preset '%s'; expected tiny, small, smollm2-135m or "
                  "llama3.2-1b",
                  name);
  out->hidden = p->hidden;
  out->intermediate = p->intermediate;
  out->n_layers = p->layers;
  out->n_heads = p->heads;
  out->n_kv_heads = p->kv_heads;
  out->head_dim = p->hidden / p->heads;
  out->vocab = p->vocab;
  out->max_positions = p->max_positions;
  out->rms_eps = 1e-5;
  out->rope_theta = p->rope_theta > 0 ? p->rope_theta : f->rope_theta_default;
  out->rope.type = ML_ROPE_DEFAULT;
  out->rope_local_theta = f->local_rope ? f->rope_local_theta_default : f->rope_theta_default;
  out->rope_local.type = ML_ROPE_DEFAULT;
  /* families whose layers slide by pattern alternate sliding / full;
   * Mistral's all slide */
  if (f->layer_rule == ML_LAYERS_PATTERN || f->layer_rule == ML_LAYERS_ALL_SLIDING) {
    out->sliding_window = p->window;
    for (int64_t l = 0; l < p->layers; l++)
      out->sliding[l] = f->layer_rule == ML_LAYERS_ALL_SLIDING || l % 2 == 0;
  }
  out->attn_scalar = (double)out->head_dim;
  out->qkv_bias = f->qkv_bias_default;
  out->o_bias = f->o_bias_follows_qkv && out->qkv_bias;
  out->tie_embeddings = f->tie_default || p->tied;
  out->dtype = ML_F32;
  if (f->moe_block) { /* 4 experts, top 2, each a quarter of the preset's MLP: the
                         active MLP width is half the dense preset's */
    out->n_experts = 4;
    out->top_k = 2;
    out->moe_inter = p->intermediate / 4;
    /* experts sized by intermediate_size (Mixtral): the model's one MLP size */
    if (strcmp(f->moe_inter_key, "intermediate_size") == 0) out->intermediate = out->moe_inter;
    /* a shared expert (Qwen2-MoE) as wide as one routed expert */
    out->shared_inter = f->shared_expert ? out->moe_inter : 0;
    out->norm_topk = true;
    out->aux_coef = 0.001;
    for (int64_t l = 0; l < p->layers; l++) out->moe[l] = true;
  }
  return 0;
}

/* Plain int64 arithmetic: bounded by the ML_MAX_* limits (config.h), the
 * total is below 2^58. Each layer's elements are the block table's (a
 * sparse layer's: its router and experts). */
int64_t ml_model_config_num_params(const ml_model_config *c) {
  int64_t embed = c->vocab * c->hidden * (c->tie_embeddings ? 1 : 2);
  int64_t n = embed + c->hidden;
  for (int64_t l = 0; l < c->n_layers; l++) n += ml_block_numel_at(c, l);
  return n;
}
