/* The export of a LoRA run (ckpt/lora_export.h). */
#include "ckpt/lora_export.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckpt/hf_source.h"
#include "ckpt/save.h"
#include "common/status.h"
#include "io/json.h"
#include "io/safetensors.h"

/* The adapters' global tensors, gathered on world rank 0 (ad[k]: export
 * index k, NULL for a base parameter). */
typedef struct gathered {
  int n;
  float **ad;
} gathered;

static int keep_adapter(void *ctx, int k, const ml_param *p, const float *global) {
  gathered *g = ctx;
  if (!p->adapter) return 0;
  size_t bytes = sizeof(float) * (size_t)(p->shape[0] * p->shape[1]);
  if (!(g->ad[k] = malloc(bytes))) return ml_err("%s: out of memory (%zu bytes)", p->name, bytes);
  memcpy(g->ad[k], global, bytes);
  return 0;
}

static void gathered_free(gathered *g) {
  for (int k = 0; g->ad && k < g->n; k++) free(g->ad[k]);
  free(g->ad);
}

static bool is_adapter(const ml_param *p) { return p->adapter; }
static bool is_base(const ml_param *p) { return !p->adapter; }

/* Collective: every adapter on world rank `root` (every rank when root < 0;
 * the others hold none), the base parameters not moved. */
static int gather_adapters(ml_engine *e, int root, gathered *g) {
  g->n = e->model.n_params;
  g->ad = ml_calloc((size_t)g->n, sizeof *g->ad, "the exported adapters");
  int rc = ml_host_agree(ml_mesh_host(e->mesh, ML_GROUP_WORLD), g->ad ? 0 : -1);
  return rc ? rc : ml_engine_stream_selected(e, root, is_adapter, keep_adapter, g);
}

/* The export index of parameter p. */
static int export_index(const ml_engine *e, const ml_param *p) {
  for (int k = 0; k < e->model.n_params; k++)
    if (ml_engine_export_param(e, k) == p) return k;
  return -1;
}

/* The linear whose weight p is, when it carries an adapter; else NULL. */
static const ml_linear *adapted(const ml_model *m, const ml_param *p) {
  for (int i = 0; i < m->n_modules; i++) {
    const ml_linear *lin = m->modules[i].ptr;
    if (m->modules[i].kind == ML_MOD_LINEAR && lin->weight == p && lin->lora_a) return lin;
  }
  return NULL;
}

/* ------------------------------------------------------------- the PEFT adapter */

/* target_modules: the adapted linears' last name components, sorted, once each. */
static json_t *target_modules(const ml_model *m) {
  const char *names[64];
  int n = 0;
  for (int i = 0; i < m->n_modules; i++) {
    const ml_linear *lin = m->modules[i].ptr;
    if (m->modules[i].kind != ML_MOD_LINEAR || !lin->lora_a) continue;
    /* PEFT's module: the fused checkpoint linear for a part of one (Phi-3's qkv_proj) */
    const char *mod = m->modules[i].alias[0] ? m->modules[i].alias : m->modules[i].name;
    const char *leaf = strrchr(mod, '.');
    leaf = leaf ? leaf + 1 : mod;
    int at = 0;
    while (at < n && strcmp(names[at], leaf) < 0) at++;
    if ((at < n && strcmp(names[at], leaf) == 0) || n == 64) continue;
    memmove(names + at + 1, names + at, sizeof *names * (size_t)(n - at));
    names[at] = leaf;
    n++;
  }
  json_t *a = json_array();
  for (int i = 0; a && i < n; i++) json_array_append_new(a, json_string(names[i]));
  return a;
}

/* adapter_config.json as PEFT 0.x's LoraConfig.save_pretrained writes it
 * (the fields meshlm sets, PEFT's defaults for the options it refuses). */
static int write_config(const ml_engine *e, const char *dir) {
  const ml_lora *l = &e->lora;
  json_t *c = json_pack(
      "{s:s, s:s, s:s, s:I, s:f, s:f, s:o, s:b, s:s, s:b, s:b, s:b, s:n, s:n, s:{}, s:{}, s:b}",
      "peft_type", "LORA", "task_type", "CAUSAL_LM", "base_model_name_or_path", e->model_dir,
      "r", (json_int_t)l->rank, "lora_alpha", l->alpha, "lora_dropout", l->dropout,
      "target_modules", target_modules(&e->model), "use_rslora", l->rslora, "bias", "none",
      "use_dora", 0, "fan_in_fan_out", 0, "inference_mode", 1, "modules_to_save",
      "layers_to_transform", "rank_pattern", "alpha_pattern", "init_lora_weights", 1);
  if (!c) return ml_err("%s: out of memory writing adapter_config.json", dir);
  char path[4096];
  snprintf(path, sizeof path, "%s/adapter_config.json", dir);
  int rc = ml_json_write(path, c);
  json_decref(c);
  return rc;
}

/* A fused module's lora_B (PEFT's one tensor over the parts' rows) from its
 * parts' gathered values: parameter k (key_row0 0) and the parts after it
 * in export order under the same key, into a new [key_rows, r] tensor. */
static float *fuse_parts(const ml_engine *e, const gathered *g, int k) {
  const ml_param *p = ml_engine_export_param(e, k);
  float *t = ml_malloc(sizeof(float) * (size_t)(p->key_rows * p->shape[1]), "a fused lora_B");
  for (int j = k; t && j < g->n; j++) {
    const ml_param *q = ml_engine_export_param(e, j);
    if (q->adapter && strcmp(q->key, p->key) == 0)
      memcpy(t + q->key_row0 * q->shape[1], g->ad[j],
             sizeof(float) * (size_t)(q->shape[0] * q->shape[1]));
  }
  return t;
}

/* adapter_model.safetensors: the adapters in export order under PEFT's keys, fp32. */
static int write_adapters(const ml_engine *e, const gathered *g, const char *dir) {
  int n = 0;
  ml_st_entry *en = ml_calloc((size_t)g->n + 1, sizeof *en, "the adapter file's entries");
  char (*names)[192] = ml_calloc((size_t)g->n + 1, sizeof *names, "the adapter file's names");
  float **fused = ml_calloc((size_t)g->n + 1, sizeof *fused, "the fused lora_B tensors");
  int rc = en && names && fused ? 0 : -1;
  for (int k = 0; rc == 0 && k < g->n; k++) {
    const ml_param *p = ml_engine_export_param(e, k);
    if (!p->adapter || p->key_row0 > 0) continue; /* a later part: in its first part's tensor */
    if (p->key_rows != p->shape[0] && !(fused[n] = fuse_parts(e, g, k))) rc = -1;
    snprintf(names[n], sizeof names[n], "base_model.model.%s", p->key);
    en[n] = (ml_st_entry){names[n], ML_F32, 2, {p->key_rows, p->shape[1]},
                          fused[n] ? fused[n] : g->ad[k]};
    n++;
  }
  char path[4096];
  snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
  if (rc == 0) rc = ml_st_write(path, en, (size_t)n);
  for (int i = 0; fused && i < n; i++) free(fused[i]);
  free(fused);
  free(names);
  free(en);
  return rc;
}

/* dir, created unless it exists (its adapter files are then replaced). */
static int make_dir(const char *dir) {
  if (mkdir(dir, 0777) != 0 && errno != EEXIST)
    return ml_err("%s: cannot create: %s", dir, strerror(errno));
  return 0;
}

static int save_peft(ml_engine *e, const char *dir) {
  ml_host *w = ml_mesh_host(e->mesh, ML_GROUP_WORLD);
  gathered g = {0};
  int rc = gather_adapters(e, 0, &g);
  if (rc == 0 && w->rank == 0) rc = make_dir(dir);
  if (rc == 0 && w->rank == 0) rc = write_adapters(e, &g, dir);
  if (rc == 0 && w->rank == 0) rc = write_config(e, dir);
  gathered_free(&g);
  return ml_host_agree(w, rc);
}

/* ------------------------------------------------------------- the merged model */

typedef struct merging {
  ml_engine *e;
  gathered g;
  ml_param_sink sink;
  void *ctx;
  float *merged; /* room for the largest adapted weight (receivers) */
} merging;

/* W [out, in] + scaling · B [out, r] · A [r, in], summed in double. */
static void merge_into(const ml_linear *lin, const float *w, const float *a, const float *b,
                       float *out) {
  int64_t O = lin->weight->shape[0], I = lin->weight->shape[1], R = lin->lora_a->shape[0];
  double s = lin->lora_scale;
  for (int64_t o = 0; o < O; o++)
    for (int64_t i = 0; i < I; i++) {
      double d = 0;
      for (int64_t r = 0; r < R; r++) d += (double)b[o * R + r] * a[r * I + i];
      out[o * I + i] = (float)(w[o * I + i] + s * d);
    }
}

static int put_merged(void *ctx, int k, const ml_param *p, const float *global) {
  merging *mg = ctx;
  const ml_linear *lin = adapted(&mg->e->model, p);
  if (!lin) return mg->sink(mg->ctx, k, p, global);
  const float *a = mg->g.ad[export_index(mg->e, lin->lora_a)];
  const float *b = mg->g.ad[export_index(mg->e, lin->lora_b)];
  merge_into(lin, global, a, b, mg->merged);
  return mg->sink(mg->ctx, k, p, mg->merged);
}

/* The merged view (ml_lora_stream). */
static int stream_merged(ml_engine *e, int root, ml_param_sink sink, void *ctx) {
  ml_host *w = ml_mesh_host(e->mesh, ML_GROUP_WORLD);
  merging mg = {.e = e, .sink = sink, .ctx = ctx};
  int64_t largest = 0;
  for (int i = 0; i < e->model.n_params; i++) {
    const ml_param *p = &e->model.params[i];
    if (!p->adapter && adapted(&e->model, p) && p->shape[0] * p->shape[1] > largest)
      largest = p->shape[0] * p->shape[1];
  }
  int rc = 0;
  if ((root < 0 || root == w->rank) &&
      !(mg.merged = ml_malloc(sizeof(float) * (size_t)largest, "the merged weight")))
    rc = -1;
  rc = ml_host_agree(w, rc);
  if (rc == 0) rc = gather_adapters(e, root, &mg.g);
  if (rc == 0) rc = ml_engine_stream_selected(e, root, is_base, put_merged, &mg);
  gathered_free(&mg.g);
  free(mg.merged);
  return rc;
}

/* The adapters view's sink: a fused module's lora_B parts (streamed one
 * after another, in row order) assembled into PEFT's one tensor and handed
 * on once, as a parameter of its shape and key, with its first part's
 * export index; the other adapters handed on as they come. */
typedef struct fusing {
  ml_param_sink sink;
  void *ctx;
  float *rows; /* [key_rows, r] of the tensor being assembled (receivers), or NULL */
  int first;   /* its first part's export index */
} fusing;

static int put_fused(void *ctx, int k, const ml_param *p, const float *global) {
  fusing *fu = ctx;
  if (p->key_rows == p->shape[0]) return fu->sink(fu->ctx, k, p, global);
  if (p->key_row0 == 0) {
    free(fu->rows);
    fu->first = k;
    if (!(fu->rows = ml_malloc(sizeof(float) * (size_t)(p->key_rows * p->shape[1]),
                               "a fused lora_B")))
      return -1;
  }
  memcpy(fu->rows + p->key_row0 * p->shape[1], global,
         sizeof(float) * (size_t)(p->shape[0] * p->shape[1]));
  if (p->key_row0 + p->shape[0] < p->key_rows) return 0;
  ml_param whole = *p; /* the fused tensor: PEFT's key and shape */
  whole.shape[0] = whole.local[0] = p->key_rows;
  whole.key_row0 = 0;
  snprintf(whole.name, sizeof whole.name, "%s", p->key);
  return fu->sink(fu->ctx, fu->first, &whole, fu->rows);
}

int ml_lora_stream(ml_engine *e, int root, ml_lora_view view, ml_param_sink sink, void *ctx) {
  if (!e->lora.on)
    return ml_err("refit: a LoRA view (%s) of a run without LoRA adapters; expected "
                  "lora_rank > 0 or an adapter", view == ML_LORA_MERGED ? "merged" : "adapters");
  if (view == ML_LORA_ADAPTERS) {
    fusing fu = {sink, ctx, NULL, 0};
    int rc = ml_engine_stream_selected(e, root, is_adapter, put_fused, &fu);
    free(fu.rows);
    return rc;
  }
  if (view == ML_LORA_MERGED) return stream_merged(e, root, sink, ctx);
  return ml_err("refit: LoRA view %d; expected adapters (%d) or merged (%d)", (int)view,
                (int)ML_LORA_ADAPTERS, (int)ML_LORA_MERGED);
}

static int put_export(void *x, int k, const ml_param *p, const float *global) {
  (void)k;
  (void)p;
  return ml_hf_export_put(x, global);
}

static int save_merged(ml_engine *e, const char *dir, ml_export_dtype dtype) {
  ml_host *w = ml_mesh_host(e->mesh, ML_GROUP_WORLD);
  int n = e->model.n_params, nb = 0;
  json_t *source = NULL;
  ml_hf_export *x = NULL;
  const ml_param **params = ml_calloc((size_t)n + 1, sizeof *params, "export params");
  for (int i = 0; params && i < n; i++) {
    const ml_param *p = ml_engine_export_param(e, i);
    if (!p->adapter) params[nb++] = p;
  }
  int rc = params ? 0 : -1;
  if (rc == 0 && w->rank == 0) rc = ml_hf_source_describe(e->model_dir, &e->model, &source);
  if (rc == 0 && w->rank == 0) {
    ml_hf_export_spec spec = {dir,          &e->model.cfg, params, nb, source,
                              e->model_dir, dtype,         ML_HF_MAX_SHARD_BYTES};
    rc = ml_hf_export_begin(&spec, &x);
  }
  rc = ml_host_agree(w, rc);
  if (rc == 0) rc = stream_merged(e, 0, put_export, x);
  if (x && rc == 0) rc = ml_hf_export_end(x);
  else ml_hf_export_abandon(x);
  json_decref(source);
  free(params);
  return ml_host_agree(w, rc);
}

int ml_engine_save_lora(ml_engine *e, const char *dir, bool merge, ml_export_dtype dtype) {
  if (!e->lora.on)
    return ml_err("%s: the run has no LoRA adapters to %s; expected --lora-rank or --adapter",
                  dir, merge ? "merge (--merge-lora)" : "export");
  return merge ? save_merged(e, dir, dtype) : save_peft(e, dir);
}
