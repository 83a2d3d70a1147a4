/* The session's weights: run checkpoints, HF export, refit, reload
 * (include/meshlm/meshlm.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/session.h"
#include "io/checkpoint.h"
#include "ckpt/hf_source.h"
#include "ckpt/runckpt.h"
#include "ckpt/lora_export.h"
#include "ckpt/save.h"

int meshlm_save(meshlm_session *s, const char *dir) {
  ML_TRY(api_enter(s, API_CALL_SAVE));
  if (api_agree(s, dir ? 0 : ml_err("meshlm_save: dir is NULL"))) return -1;
  ml_run_state st = {.step = s->steps};
  return api_agree(s, ml_run_save(&s->e, dir, &st));
}

int meshlm_resume(meshlm_session *s, const char *dir) {
  ML_TRY(api_enter(s, API_CALL_RESUME));
  if (api_agree(s, dir ? 0 : ml_err("meshlm_resume: dir is NULL"))) return -1;
  ml_run_state st;
  int rc = ml_run_load(&s->e, dir, &st);
  s->version++; /* the shards may be partly overwritten even on failure */
  if (rc == 0) s->steps = st.step;
  return api_agree(s, rc);
}

static int export_dtype(meshlm_dtype d, ml_export_dtype *out, const char *what) {
  switch (d) {
  case MESHLM_DTYPE_SOURCE: *out = ML_EXPORT_DTYPE_SOURCE; return 0;
  case MESHLM_DTYPE_F32: *out = ML_EXPORT_DTYPE_F32; return 0;
  case MESHLM_DTYPE_BF16: *out = ML_EXPORT_DTYPE_BF16; return 0;
  }
  return ml_err("%s: dtype %d; expected MESHLM_DTYPE_SOURCE, _F32 or _BF16", what, (int)d);
}

int meshlm_export(meshlm_session *s, const char *dir, meshlm_dtype dtype) {
  ML_TRY(api_enter(s, API_CALL_EXPORT));
  ml_export_dtype d = ML_EXPORT_DTYPE_SOURCE;
  int rc = export_dtype(dtype, &d, "meshlm_export");
  if (rc == 0 && !dir) rc = ml_err("meshlm_export: dir is NULL");
  if (api_agree(s, rc)) return -1;
  return api_agree(s, ml_engine_save_hf(&s->e, dir, d));
}

int meshlm_export_merged(meshlm_session *s, const char *dir, meshlm_dtype dtype) {
  ML_TRY(api_enter(s, API_CALL_EXPORT_MERGED));
  ml_export_dtype d = ML_EXPORT_DTYPE_SOURCE;
  int rc = export_dtype(dtype, &d, "meshlm_export_merged");
  if (rc == 0 && !dir) rc = ml_err("meshlm_export_merged: dir is NULL");
  if (rc == 0 && !s->e.lora.on)
    rc = ml_err("meshlm_export_merged: the session has no LoRA adapters to merge; expected "
                "meshlm_options.lora_rank > 0 or an adapter (meshlm_export writes a plain model)");
  if (api_agree(s, rc)) return -1;
  return api_agree(s, ml_engine_save_lora(&s->e, dir, true, d));
}

/* ------------------------------------------------------ the weight table */

typedef char weight_name[sizeof((ml_param *)0)->name];

/* The refit names (the source's layout) and source dtypes, once. */
static int weight_table(meshlm_session *s, weight_name **names, ml_dtype **dtypes) {
  if (s->wnames) {
    *names = s->wnames;
    *dtypes = s->wdtypes;
    return 0;
  }
  ml_engine *e = &s->e;
  int n = e->model.n_params;
  const ml_param **params = calloc((size_t)n + 1, sizeof *params);
  s->wnames = calloc((size_t)n + 1, sizeof *s->wnames);
  s->wdtypes = calloc((size_t)n + 1, sizeof *s->wdtypes);
  json_t *source = NULL;
  int rc = params && s->wnames && s->wdtypes ? 0 : ml_err("out of memory: the weight table");
  /* the base parameters through the export's layout; LoRA adapters (engine/lora.h) after
   * them under their own names, fp32 (their masters' dtype: no source tensor) */
  int nb = 0;
  for (int i = 0; rc == 0 && i < n; i++) {
    const ml_param *p = ml_engine_export_param(e, i);
    if (!p->adapter) params[nb++] = p;
  }
  if (rc == 0) rc = ml_hf_source_describe(e->model_dir, &e->model, &source);
  if (rc == 0) {
    ml_hf_export_spec spec = {NULL, &e->model.cfg, params, nb, source, e->model_dir,
                              ML_EXPORT_DTYPE_SOURCE, 0};
    rc = ml_hf_export_layout(&spec, s->wnames, s->wdtypes);
  }
  /* spread the base entries to their export indices, then name the adapters */
  for (int i = n - 1, b = nb - 1; rc == 0 && i >= 0; i--) {
    const ml_param *p = ml_engine_export_param(e, i);
    if (p->adapter) {
      snprintf(s->wnames[i], sizeof s->wnames[i], "%s", p->name);
      s->wdtypes[i] = ML_F32;
    } else {
      memmove(s->wnames[i], s->wnames[b], sizeof s->wnames[i]);
      s->wdtypes[i] = s->wdtypes[b--];
    }
  }
  json_decref(source);
  free(params);
  if (rc) {
    free(s->wnames);
    free(s->wdtypes);
    s->wnames = NULL;
    s->wdtypes = NULL;
    return -1;
  }
  *names = s->wnames;
  *dtypes = s->wdtypes;
  return 0;
}

/* The API's name of a source dtype: BF16 stays, the rest read as F32. */
static meshlm_dtype api_dtype(ml_dtype d) {
  return d == ML_BF16 ? MESHLM_DTYPE_BF16 : MESHLM_DTYPE_F32;
}

int64_t meshlm_num_weights(meshlm_session *s) {
  return api_local(s, "meshlm_num_weights") ? -1 : s->e.model.n_params;
}

int meshlm_weight_info(meshlm_session *s, int64_t i, meshlm_weight *out) {
  ML_TRY(api_local(s, "meshlm_weight_info"));
  weight_name *names;
  ml_dtype *dtypes;
  int rc = i >= 0 && i < s->e.model.n_params
               ? 0
               : ml_err("meshlm_weight_info: index %lld; expected 0 .. %d", (long long)i,
                        s->e.model.n_params - 1);
  if (rc == 0) rc = weight_table(s, &names, &dtypes);
  if (rc) return api_leave(s, rc);
  const ml_param *p = ml_engine_export_param(&s->e, (int)i);
  meshlm_weight full = {0, names[i], p->ndim, {p->shape[0], p->ndim == 2 ? p->shape[1] : 1},
                        api_dtype(dtypes[i])};
  if (!out) return api_leave(s, ml_err("meshlm_weight_info: out is NULL"));
  return api_leave(s, API_WRITE("meshlm_weight_info", meshlm_weight, out, &full));
}

/* ------------------------------------------------------------------ refit */

typedef struct refit_ctx {
  meshlm_session *s;
  meshlm_dtype want; /* SOURCE, F32 or BF16 */
  meshlm_tensor_fn fn;
  void *user;
  void *const *bufs; /* refit_into */
  uint16_t *bf16;    /* [largest tensor] conversion staging */
  bool stopped;
  const char *call;  /* the API function, for messages */
  bool peft_keys;    /* MESHLM_LORA_ADAPTERS: names under PEFT's base_model.model. */
} refit_ctx;

static int refit_sink(void *ctx, int k, const ml_param *p, const float *global) {
  refit_ctx *r = ctx;
  meshlm_dtype d = r->want == MESHLM_DTYPE_SOURCE ? api_dtype(r->s->wdtypes[k]) : r->want;
  size_t numel = (size_t)(p->shape[0] * p->shape[1]);
  const void *data = global;
  size_t nbytes = sizeof(float) * numel;
  if (d == MESHLM_DTYPE_BF16) {
    for (size_t i = 0; i < numel; i++) r->bf16[i] = ml_f32_to_bf16(global[i]);
    data = r->bf16;
    nbytes = sizeof(uint16_t) * numel;
  }
  if (r->bufs) {
    if (!r->bufs[k]) return ml_err("meshlm_refit_into: bufs[%d] ('%s') is NULL", k,
                                   r->s->wnames[k]);
    memcpy(r->bufs[k], data, nbytes);
    return 0;
  }
  char peft[sizeof(weight_name) + 32];
  const char *name = r->s->wnames[k];
  if (r->peft_keys) { /* the adapter's key: a fused module's lora_B comes whole (lora_export.h) */
    snprintf(peft, sizeof peft, "base_model.model.%s", p->key);
    name = peft;
  }
  int64_t shape[2] = {p->shape[0], p->ndim == 2 ? p->shape[1] : 1};
  if (r->fn(r->user, name, d, p->ndim, shape, data, nbytes) == 0) return 0;
  r->stopped = true;
  return ml_err("%s: refit stopped by the callback at tensor '%s'", r->call, name);
}

/* lora false: every parameter (meshlm_refit); true: the LoRA view `view`. */
static int refit(meshlm_session *s, int root, meshlm_dtype dtype, meshlm_tensor_fn fn,
                 void *ctx, void *const *bufs, bool lora, int view) {
  ML_TRY(api_enter(s, lora ? API_CALL_REFIT_LORA : API_CALL_REFIT));
  refit_ctx r = {s,     dtype, fn, ctx, bufs, NULL, false,
                 lora ? "meshlm_refit_lora" : "meshlm_refit", lora && view == MESHLM_LORA_ADAPTERS};
  ml_export_dtype unused;
  weight_name *names;
  ml_dtype *dtypes;
  bool receiver = root < 0 || root == s->world->rank;
  int rc = export_dtype(dtype, &unused, r.call);
  if (rc == 0 && root >= s->world->size)
    rc = ml_err("%s: root %d; expected a rank < %d, or < 0 for every rank", r.call, root,
                s->world->size);
  if (rc == 0 && lora && view != MESHLM_LORA_ADAPTERS && view != MESHLM_LORA_MERGED)
    rc = ml_err("meshlm_refit_lora: view %d; expected MESHLM_LORA_ADAPTERS (%d) or "
                "MESHLM_LORA_MERGED (%d)", view, (int)MESHLM_LORA_ADAPTERS,
                (int)MESHLM_LORA_MERGED);
  if (rc == 0 && lora && !s->e.lora.on)
    rc = ml_err("meshlm_refit_lora: the session has no LoRA adapters; expected "
                "meshlm_options.lora_rank > 0 or an adapter");
  if (rc == 0 && receiver && !fn && !bufs)
    rc = ml_err("%s: no callback on receiving rank %d", r.call, s->world->rank);
  if (rc == 0 && receiver) rc = weight_table(s, &names, &dtypes);
  int64_t most = 0;
  for (int i = 0; i < s->e.model.n_params; i++) {
    const ml_param *p = s->e.model.params + i;
    most = p->shape[0] * p->shape[1] > most ? p->shape[0] * p->shape[1] : most;
  }
  if (rc == 0 && receiver && !(r.bf16 = ml_malloc(sizeof(uint16_t) * (size_t)most,
                                                  "the refit's bf16 staging")))
    rc = -1;
  if (api_agree(s, rc) == 0)
    rc = api_agree(s, lora ? ml_lora_stream(&s->e, root, (ml_lora_view)view, refit_sink, &r)
                           : ml_engine_stream_params(&s->e, root, refit_sink, &r));
  else
    rc = -1;
  free(r.bf16);
  return rc;
}

int meshlm_refit(meshlm_session *s, int root, meshlm_dtype dtype, meshlm_tensor_fn fn,
                 void *ctx) {
  return refit(s, root, dtype, fn, ctx, NULL, false, 0);
}

int meshlm_refit_lora(meshlm_session *s, int root, meshlm_dtype dtype, meshlm_lora_view view,
                      meshlm_tensor_fn fn, void *ctx) {
  return refit(s, root, dtype, fn, ctx, NULL, true, (int)view);
}

int meshlm_refit_into(meshlm_session *s, int root, meshlm_dtype dtype, void *const *bufs) {
  return refit(s, root, dtype, NULL, NULL, bufs, false, 0);
}

/* ----------------------------------------------------------------- reload */

/* After the shards changed: the unsharded copies, the version. */
static int reloaded(meshlm_session *s, int rc) {
  rc = api_agree(s, rc);
  s->version++;
  if (rc == 0) rc = api_agree(s, ml_engine_sync_params(&s->e));
  return rc;
}

int meshlm_reload(meshlm_session *s, const char *dir) {
  ML_TRY(api_enter(s, API_CALL_RELOAD));
  ml_ckpt ck;
  int rc = dir ? ml_ckpt_open(dir, &ck) : ml_err("meshlm_reload: dir is NULL");
  if (api_agree(s, rc)) {
    if (rc == 0) ml_ckpt_close(&ck);
    return -1;
  }
  rc = ml_fsdp_load(&s->e.fsdp, &ck, true);
  ml_ckpt_close(&ck);
  return reloaded(s, rc);
}

/* The first of n values of dtype d (F32 or BF16) that is not finite, its
 * value in *v; −1 when every one is. */
static int64_t first_nonfinite(const void *data, meshlm_dtype d, int64_t n, float *v) {
  const float *f = data;
  const uint16_t *h = data;
  for (int64_t i = 0; i < n; i++) {
    *v = d == MESHLM_DTYPE_BF16 ? ml_bf16_to_f32(h[i]) : f[i];
    if (!isfinite(*v)) return i;
  }
  return -1;
}

/* "[d0]" or "[d0, d1]" into buf[64]. */
static void shape_text(char *buf, int ndim, int64_t d0, int64_t d1) {
  if (ndim == 2) snprintf(buf, 64, "[%lld, %lld]", (long long)d0, (long long)d1);
  else snprintf(buf, 64, "[%lld]", (long long)d0);
}

/* t as a checkpoint tensor under the model's parameter name: its name, dtype
 * and shape checked (meshlm_weight_info's) before its values are read, then
 * every value finite. */
static int dress(meshlm_session *s, const meshlm_tensor *t, int64_t i, ml_st_tensor *out) {
  weight_name *names;
  ml_dtype *dtypes;
  ML_TRY(weight_table(s, &names, &dtypes));
  int k = 0;
  while (k < s->e.model.n_params && (!t->name || strcmp(names[k], t->name) != 0)) k++;
  if (k == s->e.model.n_params)
    return ml_err("meshlm_reload_tensors: tensor %lld '%s' is not a weight of the model "
                  "(meshlm_weight_info lists them)", (long long)i, t->name ? t->name : "(null)");
  if ((t->dtype != MESHLM_DTYPE_F32 && t->dtype != MESHLM_DTYPE_BF16) || !t->data ||
      t->ndim < 1 || t->ndim > 2)
    return ml_err("meshlm_reload_tensors: tensor '%s': dtype %d, ndim %d, data %s; expected F32 "
                  "or BF16, ndim 1 or 2, data given", t->name, (int)t->dtype, t->ndim,
                  t->data ? "given" : "NULL");
  const ml_param *p = ml_engine_export_param(&s->e, k);
  int64_t cols = t->ndim == 2 ? t->shape[1] : 1;
  if (t->ndim != p->ndim || t->shape[0] != p->shape[0] || cols != p->shape[1]) {
    char got[64], want[64];
    shape_text(got, t->ndim, t->shape[0], cols);
    shape_text(want, p->ndim, p->shape[0], p->shape[1]);
    return ml_err("meshlm_reload_tensors: tensor '%s' has shape %s; expected %s "
                  "(meshlm_weight_info)", t->name, got, want);
  }
  int64_t numel = p->shape[0] * p->shape[1]; /* the model's own tensor: no overflow */
  float v;
  int64_t bad = first_nonfinite(t->data, t->dtype, numel, &v);
  if (bad >= 0)
    return ml_err("meshlm_reload_tensors: tensor '%s' has a non-finite value (%g) at index "
                  "%lld ([%lld, %lld]); expected finite values",
                  t->name, (double)v, (long long)bad, (long long)(bad / cols),
                  (long long)(bad % cols));
  size_t es = t->dtype == MESHLM_DTYPE_BF16 ? 2 : 4;
  *out = (ml_st_tensor){(char *)p->name, t->dtype == MESHLM_DTYPE_BF16 ? ML_BF16 : ML_F32,
                        t->ndim, {t->shape[0], t->ndim == 2 ? t->shape[1] : 0}, numel,
                        t->data, es * (size_t)numel};
  return 0;
}

int meshlm_reload_tensors(meshlm_session *s, int64_t n, const meshlm_tensor *tensors) {
  ML_TRY(api_enter(s, API_CALL_RELOAD_TENSORS));
  int rc = n >= 0 && (n == 0 || tensors)
               ? 0
               : ml_err("meshlm_reload_tensors: n = %lld, tensors %s; expected n >= 0 and the "
                        "tensors given", (long long)n, tensors ? "given" : "NULL");
  ml_st_tensor *ts = rc == 0 ? ml_calloc((size_t)n + 1, sizeof *ts, "the reloaded tensors") : NULL;
  if (rc == 0 && !ts) rc = -1;
  /* the caller's layout: its elements tensors[0].struct_size apart */
  size_t stride = n > 0 ? tensors[0].struct_size : 0;
  for (int64_t i = 0; rc == 0 && i < n; i++) {
    const meshlm_tensor *in = (const meshlm_tensor *)((const char *)tensors + stride * (size_t)i);
    meshlm_tensor def = {0}, t;
    if (in->struct_size != stride)
      rc = ml_err("meshlm_reload_tensors: tensor %lld's struct_size %zu; expected tensors[0]'s, "
                  "%zu (one layout for the array)", (long long)i, in->struct_size, stride);
    if (rc == 0) rc = API_READ("meshlm_reload_tensors", meshlm_tensor, in, &def, &t);
    if (rc == 0) rc = dress(s, &t, i, &ts[i]);
  }
  if (api_agree(s, rc)) {
    free(ts);
    return -1;
  }
  ml_st_file file = {.path = "meshlm_reload_tensors", .n = (size_t)n, .tensors = ts};
  ml_ckpt ck = {.dir = "meshlm_reload_tensors", .nfiles = 1, .files = &file};
  rc = ml_fsdp_load(&s->e.fsdp, &ck, false);
  free(ts);
  return reloaded(s, rc);
}
