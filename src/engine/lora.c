#define _POSIX_C_SOURCE 200809L /* strdup */

#include "engine/lora.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "common/status.h"
#include "io/checkpoint.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "model/lora.h"

/* PEFT's key prefix of an adapter's tensors (PeftModel's base_model.model). */
#define PEFT_PREFIX "base_model.model."

/* The adapter's target_modules as a comma-separated list into *out
 * (malloc'd): a list of names, or the string "all-linear" (another string
 * is a regular expression to PEFT: refused). */
static int config_targets(const ml_json *j, char **out) {
  json_t *t = json_object_get(j->root, "target_modules");
  if (json_is_string(t)) {
    if (strcmp(json_string_value(t), "all-linear") != 0)
      return ml_err("%s: field 'target_modules' is the regular expression '%s'; expected a list "
                    "of module names or \"all-linear\"", j->path, json_string_value(t));
    return (*out = strdup("all-linear")) ? 0 : ml_err("%s: out of memory", j->path);
  }
  if (!json_is_array(t) || json_array_size(t) == 0) {
    char got[64];
    ml_json_brief(t, got, sizeof got);
    return ml_err("%s: field 'target_modules' is %s; expected a non-empty list of module names",
                  j->path, got);
  }
  size_t len = 1, i;
  json_t *v;
  json_array_foreach(t, i, v) {
    if (!json_is_string(v) || strchr(json_string_value(v), ','))
      return ml_err("%s: field 'target_modules' entry %zu is not a module name", j->path, i);
    len += strlen(json_string_value(v)) + 1;
  }
  char *s = calloc(len, 1);
  if (!s) return ml_err("%s: out of memory", j->path);
  json_array_foreach(t, i, v) {
    if (i) strcat(s, ",");
    strcat(s, json_string_value(v));
  }
  *out = s;
  return 0;
}

/* Field `key` absent, null, false, or an empty list/object: PEFT's default
 * (the option unused); else an error naming it and `why`. */
static int refuse_set(const ml_json *j, const char *key, const char *why) {
  json_t *v = json_object_get(j->root, key);
  bool unset = !v || json_is_null(v) || json_is_false(v) ||
               (json_is_array(v) && json_array_size(v) == 0) ||
               (json_is_object(v) && json_object_size(v) == 0);
  if (unset) return 0;
  char got[64];
  ml_json_brief(v, got, sizeof got);
  return ml_err("%s: field '%s' is %s; %s is not supported (expected it unset)", j->path, key,
                got, why);
}

/* l from DIR/adapter_config.json (PEFT's LoraConfig as save_pretrained writes it). */
static int read_config(ml_lora *l, const char *dir) {
  char path[4096];
  snprintf(path, sizeof path, "%s/adapter_config.json", dir);
  ml_json j;
  ML_TRY(ml_json_load(path, &j));
  const char *type = NULL, *bias = "none";
  json_t *b = json_object_get(j.root, "bias");
  int rc = ml_json_str(&j, NULL, "peft_type", &type);
  if (!rc && strcmp(type, "LORA") != 0)
    rc = ml_err("%s: field 'peft_type' is '%s'; expected \"LORA\"", path, type);
  if (!rc && b && !json_is_null(b)) rc = ml_json_str(&j, NULL, "bias", &bias);
  if (!rc && strcmp(bias, "none") != 0)
    rc = ml_err("%s: field 'bias' is '%s'; expected \"none\" (trained biases are not supported)",
                path, bias);
  if (!rc) rc = refuse_set(&j, "use_dora", "DoRA");
  if (!rc) rc = refuse_set(&j, "modules_to_save", "training whole modules beside the adapters");
  if (!rc) rc = refuse_set(&j, "rank_pattern", "a rank per module");
  if (!rc) rc = refuse_set(&j, "alpha_pattern", "an alpha per module");
  if (!rc) rc = refuse_set(&j, "fan_in_fan_out", "a transposed (Conv1D) base weight");
  if (!rc) rc = refuse_set(&j, "layers_to_transform", "adapting some layers only");
  if (!rc) rc = refuse_set(&j, "layer_replication", "replicated layers");
  if (!rc) rc = refuse_set(&j, "exclude_modules", "excluding modules from the targets");
  if (!rc) rc = refuse_set(&j, "lora_bias", "a bias on lora_B");
  if (!rc) rc = refuse_set(&j, "target_parameters", "adapting parameters (not linears)");
  if (!rc) rc = refuse_set(&j, "trainable_token_indices", "trainable token embeddings");
  if (!rc) rc = refuse_set(&j, "use_qalora", "QA-LoRA (lora_A on a pooled input)");
  if (!rc) rc = refuse_set(&j, "alora_invocation_tokens",
                           "activated LoRA (adapters on after invocation tokens)");
  if (!rc) rc = refuse_set(&j, "use_bdlora", "block-diagonal LoRA");
  if (!rc) rc = refuse_set(&j, "velora_config", "VeLoRA");
  if (!rc) rc = refuse_set(&j, "monteclora_config", "MonteCLoRA");
  if (!rc) rc = refuse_set(&j, "arrow_config", "Arrow routing between adapters");
  if (!rc) rc = refuse_set(&j, "kasa_config", "KaSA");
  if (!rc) rc = ml_json_int(&j, NULL, "r", &l->rank);
  if (!rc) rc = ml_json_num(&j, NULL, "lora_alpha", &l->alpha);
  if (!rc) rc = ml_json_num_opt(&j, NULL, "lora_dropout", 0.0, &l->dropout);
  if (!rc) rc = ml_json_bool_opt(&j, NULL, "use_rslora", false, &l->rslora);
  if (!rc) rc = config_targets(&j, &l->targets);
  ml_json_free(&j);
  return rc;
}

/* Every name of the comma-separated list a is in the list b. */
static bool names_within(const char *a, const char *b) {
  for (const char *t = a; *t;) {
    size_t n = strcspn(t, ",");
    bool found = false;
    for (const char *u = b; *u && !found;) {
      size_t m = strcspn(u, ",");
      found = m == n && strncmp(t, u, n) == 0;
      u += m + (u[m] == ',');
    }
    if (!found) return false;
    t += n + (t[n] == ',');
  }
  return true;
}

/* Options that configure LoRA themselves (a rank > 0) must agree with the
 * adapter's configuration: r, lora_alpha, use_rslora and target_modules
 * (as sets); a lora_dropout other than 0 must be the adapter's. */
static int agree(const ml_lora *l, const ml_lora_opts *o) {
  if (o->dropout != 0 && o->dropout != l->dropout)
    return ml_err("lora_dropout (--lora-dropout) %g with the adapter %s, whose lora_dropout is %g; "
                  "expected 0 (the adapter's) or %g (edit its adapter_config.json to change it)",
                  o->dropout, o->adapter, l->dropout, l->dropout);
  if (o->rank <= 0) return 0;
  const char *t = o->targets ? o->targets : "";
  if (o->rank != l->rank || o->alpha != l->alpha || o->rslora != l->rslora ||
      !names_within(t, l->targets) || !names_within(l->targets, t))
    return ml_err("lora_rank (--lora-rank) %lld, lora_alpha %g, lora_use_rslora %s, lora_targets "
                  "'%s': the adapter %s has r = %lld, lora_alpha %g, use_rslora %s, "
                  "target_modules '%s'; expected the same, or no --lora-rank with --adapter",
                  (long long)o->rank, o->alpha, o->rslora ? "true" : "false", t, o->adapter,
                  (long long)l->rank, l->alpha, l->rslora ? "true" : "false", l->targets);
  return 0;
}

int ml_lora_setup(ml_lora *l, const ml_lora_opts *o, ml_model *m) {
  memset(l, 0, sizeof *l);
  if (o->rank == 0 && !o->adapter) return 0;
  l->on = true;
  l->seed = o->seed;
  if (o->adapter) {
    if (!(l->adapter = strdup(o->adapter))) return ml_err("adapter: out of memory");
    ML_TRY(read_config(l, o->adapter));
    ML_TRY(agree(l, o));
  } else {
    l->rank = o->rank;
    l->alpha = o->alpha;
    l->dropout = o->dropout;
    l->rslora = o->rslora;
    if (!(l->targets = strdup(o->targets ? o->targets : "")))
      return ml_err("lora_targets: out of memory");
  }
  if (!(l->dropout >= 0 && l->dropout < 1))
    return ml_err("lora_dropout (--lora-dropout%s) %g: expected a probability in [0, 1)",
                  l->adapter ? ", or the adapter's field" : "", l->dropout);
  m->lora_drop = (ml_lora_dropout){.p = l->dropout};
  if (!(l->alpha > 0) || !isfinite(l->alpha))
    return ml_err("lora_alpha (--lora-alpha) %g: expected a finite number > 0", l->alpha);
  l->scaling = ml_lora_scaling(l->rank, l->alpha, l->rslora);
  return ml_lora_attach(m, l->rank, l->scaling, l->targets);
}

void ml_lora_freeze_base(ml_model *m) {
  for (int i = 0; i < m->n_params; i++)
    if (!m->params[i].adapter) m->params[i].frozen = true;
}

/* The seed's values of every adapter tensor (a fused module's lora_B once,
 * with its first part: key_row0 0), in parameter order, into t[k] and
 * bufs[k] (host, the tensor's shape [key_rows, cols]): lora_A U(−1/√in,
 * 1/√in) (kaiming_uniform_ with a = √5: gain √(2/(1+5)), bound
 * gain·√(3/in) = 1/√in), lora_B 0. */
static int seeded(const ml_lora *l, const ml_model *m, ml_st_tensor *t, float **bufs) {
  ml_rng rng = ml_rng_seed(l->seed);
  int k = 0;
  for (int i = 0; i < m->n_params; i++) {
    const ml_param *p = &m->params[i];
    if (!p->adapter || p->key_row0 > 0) continue;
    int64_t n = p->key_rows * p->shape[1]; /* rank <= 2^20 times a config dim: fits */
    float *x = bufs[k] = calloc((size_t)n, sizeof *x);
    if (!x) return ml_err("%s: out of memory (%lld floats)", p->name, (long long)n);
    bool is_a = strstr(p->name, ".lora_A.") != NULL;
    double bound = 1.0 / sqrt((double)p->shape[1]);
    for (int64_t e = 0; is_a && e < n; e++)
      x[e] = (float)((2.0 * ml_rng_uniform(&rng) - 1.0) * bound);
    t[k++] = (ml_st_tensor){(char *)p->key, ML_F32, 2, {p->key_rows, p->shape[1]}, n,
                            (const uint8_t *)x, sizeof(float) * (size_t)n};
  }
  return 0;
}

/* The adapter file's tensors renamed to the model's keys into t: each
 * adapter tensor of m (a fused module's lora_B once) present with its
 * shape, and no tensor beside them. */
static int from_file(const ml_lora *l, const ml_model *m, const ml_st_file *file,
                     ml_st_tensor *t) {
  char key[256];
  int k = 0;
  for (int i = 0; i < m->n_params; i++) {
    const ml_param *p = &m->params[i];
    if (!p->adapter || p->key_row0 > 0) continue;
    snprintf(key, sizeof key, PEFT_PREFIX "%s", p->key);
    const ml_st_tensor *s = ml_st_find(file, key);
    if (!s)
      return ml_err("%s: adapter tensor '%s' is missing (adapter_config.json targets %s)",
                    file->path, key, l->targets);
    if (s->ndim != 2 || s->shape[0] != p->key_rows || s->shape[1] != p->shape[1]) {
      char got[ML_ST_SHAPE_CAP], want[ML_ST_SHAPE_CAP];
      ml_st_shape_str(got, sizeof got, s->ndim, s->shape);
      ml_st_shape_str(want, sizeof want, 2, (const int64_t[2]){p->key_rows, p->shape[1]});
      return ml_err("%s: tensor '%s' has shape %s; expected %s (adapter_config.json: r = %lld)",
                    file->path, key, got, want, (long long)l->rank);
    }
    t[k] = *s;
    t[k++].name = (char *)p->key;
  }
  size_t np = strlen(PEFT_PREFIX);
  for (size_t i = 0; i < file->n; i++) {
    const char *name = file->tensors[i].name;
    bool used = false;
    for (int j = 0; j < k && !used; j++)
      used = strncmp(name, PEFT_PREFIX, np) == 0 && strcmp(name + np, t[j].name) == 0;
    if (!used)
      return ml_err("%s: tensor '%s' is no adapter of this model's targets (%s)", file->path,
                    name, l->targets);
  }
  return 0;
}

int ml_lora_load(const ml_lora *l, ml_fsdp *f, const ml_model *m) {
  if (!l->on) return 0;
  int n = 0;
  for (int i = 0; i < m->n_params; i++) n += m->params[i].adapter;
  ml_st_tensor *t = calloc((size_t)n + 1, sizeof *t);
  float **bufs = calloc((size_t)n + 1, sizeof *bufs);
  ml_st_file file = {0}, own = {.path = "LoRA initialisation", .n = (size_t)n};
  int rc = t && bufs ? 0 : ml_err("LoRA adapters: out of memory");
  char path[4096];
  if (!rc && l->adapter) {
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", l->adapter);
    rc = ml_st_open(path, &file);
    if (!rc) rc = from_file(l, m, &file, t);
  } else if (!rc) {
    rc = seeded(l, m, t, bufs);
  }
  own.tensors = t;
  while (own.n > 0 && !t[own.n - 1].name) own.n--; /* a fused lora_B is one tensor of its parts */
  ml_ckpt ck = {.dir = l->adapter ? l->adapter : "LoRA initialisation", .nfiles = 1,
                .files = &own};
  if (!rc) rc = ml_fsdp_load(f, &ck, false);
  if (!rc) rc = ml_fsdp_sync_params(f);
  if (l->adapter && file.path) ml_st_close(&file);
  for (int k = 0; bufs && k < n; k++) free(bufs[k]);
  free(bufs);
  free(t);
  return rc;
}

int ml_lora_dropout_begin(ml_lora *l, ml_model *m, ml_host *dp, int64_t step, int64_t B,
                          int64_t S, const int64_t *row_pos) {
  if (!l->on || !(l->dropout > 0)) return 0;
  int64_t *rows = ml_calloc((size_t)dp->size, sizeof *rows, "the data ranks' rows");
  int rc = rows ? ml_host_all_gather(dp, &B, sizeof B, rows) : -1;
  int64_t row0 = 0;
  for (int q = 0; rc == 0 && q < dp->rank; q++) row0 += rows[q];
  free(rows);
  ML_TRY(rc);
  m->lora_drop.active = true;
  m->lora_drop.key = ml_rng_hash(ml_rng_hash(l->seed, (uint64_t)step), (uint64_t)l->micro++);
  m->lora_drop.row0 = row0;
  m->lora_drop.row_len = S;
  m->lora_drop.row_pos = row_pos;
  return 0;
}

void ml_lora_dropout_end(ml_model *m) { m->lora_drop.active = false; }

void ml_lora_free(ml_lora *l) {
  free(l->targets);
  free(l->adapter);
  memset(l, 0, sizeof *l);
}
