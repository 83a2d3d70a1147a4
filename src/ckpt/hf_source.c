#define _XOPEN_SOURCE 700 /* realpath */

#include "ckpt/hf_source.h"

#include <dirent.h>
#include <errno.h>
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/file.h"
#include "common/status.h"
#include "io/checkpoint.h"
#include "io/json.h"
#include "io/safetensors.h"

enum { PATH_CAP = 4096 };

/* The files besides config.json and the weights that a tokenizer's,
 * a generation config's and a processor's save_pretrained write. */
static const char *const k_patterns[] = {
    "tokenizer*",      "special_tokens_map.json", "added_tokens.json",
    "vocab.*",         "merges.txt",              "*.tiktoken",
    "spiece.model",    "generation_config.json",  "chat_template*",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
};

static bool wanted(const char *name) {
  for (size_t i = 0; i < sizeof k_patterns / sizeof k_patterns[0]; i++)
    if (fnmatch(k_patterns[i], name, 0) == 0) return true;
  return false;
}

static int name_cmp(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* "files": config.json, then the regular files of dir matching k_patterns,
 * sorted (readdir's order is the file system's). */
static int list_files(const char *dir, json_t *files) {
  DIR *d = opendir(dir);
  if (!d) return ml_err("%s: cannot open the source model directory: %s", dir, strerror(errno));
  char **names = NULL, path[PATH_CAP];
  size_t n = 0, cap = 0;
  int rc = json_array_append_new(files, json_string("config.json"));
  struct dirent *ent;
  while (rc == 0 && (ent = readdir(d)) != NULL) {
    struct stat sb;
    if (!wanted(ent->d_name)) continue;
    snprintf(path, sizeof path, "%s/%s", dir, ent->d_name);
    if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
    if (n == cap) {
      cap = cap ? 2 * cap : 16;
      char **grown = realloc(names, cap * sizeof *names);
      if (!grown) {
        rc = -1;
        break;
      }
      names = grown;
    }
    if (!(names[n] = strdup(ent->d_name))) rc = -1;
    else n++;
  }
  closedir(d);
  if (rc == 0) qsort(names, n, sizeof *names, name_cmp);
  for (size_t i = 0; i < n; i++) {
    if (rc == 0) rc = json_array_append_new(files, json_string(names[i]));
    free(names[i]);
  }
  free(names);
  return rc == 0 ? 0 : ml_err("%s: out of memory listing the source model's files", dir);
}

static json_t *shape_json(const ml_st_tensor *t) {
  json_t *a = json_array();
  for (int d = 0; a && d < t->ndim; d++)
    if (json_array_append_new(a, json_integer(t->shape[d])) != 0) {
      json_decref(a);
      return NULL;
    }
  return a;
}

/* "dtypes" of m's parameters (LoRA adapters are none of the source's: left
 * out) and "carried": every other tensor of ck but a tied lm_head. */
static int list_tensors(const ml_ckpt *ck, const ml_model *m, json_t *dtypes, json_t *carried) {
  for (int i = 0; i < m->n_params; i++) {
    if (m->params[i].adapter) continue; /* LoRA adapters: no tensors of the source */
    const char *name = m->params[i].key; /* a fused tensor's parts name it each */
    const ml_st_tensor *t = ml_ckpt_find(ck, name);
    if (!t) return ml_err("%s: no tensor '%s', which the model being trained has", ck->dir, name);
    if (t->dtype != ML_F32 && t->dtype != ML_BF16 && t->dtype != ML_F16)
      return ml_err("%s: tensor '%s' is %s; expected F32, BF16 or F16", ck->dir, name,
                    ml_dtype_name(t->dtype));
    if (json_object_set_new(dtypes, name, json_string(ml_dtype_name(t->dtype))) != 0) return -1;
  }
  char tied[256] = "";
  if (m->cfg.tie_embeddings) snprintf(tied, sizeof tied, "%s.weight", m->cfg.family->ckpt_lm_head);
  for (size_t f = 0; f < ck->nfiles; f++)
    for (size_t k = 0; k < ck->files[f].n; k++) {
      const ml_st_tensor *t = &ck->files[f].tensors[k];
      if (json_object_get(dtypes, t->name) || strcmp(t->name, tied) == 0) continue;
      json_t *e = json_pack("{s:s, s:o}", "dtype", ml_dtype_name(t->dtype), "shape", shape_json(t));
      if (!e || json_object_set_new(carried, t->name, e) != 0) return -1;
    }
  return 0;
}

int ml_hf_source_describe(const char *dir, const ml_model *m, json_t **out) {
  *out = NULL;
  char *abs = realpath(dir, NULL);
  if (!abs)
    return ml_err("%s: cannot resolve the source model directory: %s", dir, strerror(errno));
  json_t *src = json_pack("{s:s, s:s, s:[], s:{}, s:{}}", "dir", abs, "architecture",
                          m->cfg.family->architecture, "files", "dtypes", "carried");
  ml_ckpt ck;
  int rc = src ? ml_ckpt_open(abs, &ck) : ml_err("%s: out of memory", dir);
  if (rc == 0) {
    rc = list_tensors(&ck, m, json_object_get(src, "dtypes"), json_object_get(src, "carried"));
    if (rc != 0) ml_err("%s: out of memory describing the source model", dir);
    ml_ckpt_close(&ck);
  }
  if (rc == 0) rc = list_files(abs, json_object_get(src, "files"));
  free(abs);
  if (rc != 0) {
    json_decref(src);
    return -1;
  }
  *out = src;
  return 0;
}

/* The path of `to` relative to `from`, both absolute and resolved, into
 * out[PATH_CAP]: the components past their common ones, after a ".." for
 * each of from's. Errors: too long. */
static int relative_path(const char *from, const char *to, char *out) {
  size_t common = 0; /* the length of their common whole components */
  for (size_t i = 0;; i++) {
    bool end_f = from[i] == '/' || from[i] == '\0', end_t = to[i] == '/' || to[i] == '\0';
    if (end_f && end_t) common = i;
    if (from[i] != to[i] || from[i] == '\0') break;
  }
  size_t n = 0;
  out[0] = '\0';
  for (const char *p = from + common; *p && n < PATH_CAP; p++)
    if (*p == '/' && p[1] != '\0')
      n += (size_t)snprintf(out + n, PATH_CAP - n, "%s..", n ? "/" : "");
  const char *rest = to + common + (to[common] == '/');
  if (*rest && n < PATH_CAP)
    n += (size_t)snprintf(out + n, PATH_CAP - n, "%s%s", n ? "/" : "", rest);
  if (n == 0) n = (size_t)snprintf(out, PATH_CAP, ".");
  if (n < PATH_CAP) return 0;
  return ml_err("%s: path relative to %s longer than %d bytes", to, from, PATH_CAP - 1);
}

int ml_hf_source_relate(json_t *src, const char *base) {
  char *abs = realpath(base, NULL), rel[PATH_CAP];
  if (!abs) return ml_err("%s: cannot resolve: %s", base, strerror(errno));
  int rc = relative_path(abs, json_string_value(json_object_get(src, "dir")), rel);
  free(abs);
  if (rc == 0 && json_object_set_new(src, "dir_rel", json_string(rel)) != 0)
    rc = ml_err("%s: out of memory recording the source model's relative path", base);
  return rc;
}

/* ---------------------------------------------------------------- checking */

static int bad(const char *what, const char *field, const char *expected, const json_t *v) {
  char found[96];
  ml_json_brief(v, found, sizeof found);
  return ml_err("%s: field 'source.%s': expected %s, found %s", what, field, expected, found);
}

static bool plain_name(const char *s) {
  return s[0] && !strchr(s, '/') && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

static bool float_dtype(const json_t *v) {
  ml_dtype t;
  return json_is_string(v) && ml_dtype_parse(json_string_value(v), &t) == 0 &&
         (t == ML_F32 || t == ML_BF16 || t == ML_F16);
}

static bool good_shape(const json_t *v) {
  bool ok = json_is_array(v) && json_array_size(v) <= ML_ST_MAX_DIMS;
  for (size_t d = 0; ok && d < json_array_size(v); d++)
    ok = json_is_integer(json_array_get(v, d)) && json_integer_value(json_array_get(v, d)) >= 0;
  return ok;
}

int ml_hf_source_check(const json_t *src, const char *what) {
  if (!json_is_object(src)) return bad(what, "", "an object", src);
  const char *str_keys[] = {"dir", "architecture"};
  for (int k = 0; k < 2; k++)
    if (!json_is_string(json_object_get(src, str_keys[k])))
      return bad(what, str_keys[k], "a string", json_object_get(src, str_keys[k]));
  const json_t *rel = json_object_get(src, "dir_rel");
  if (rel && !json_is_string(rel)) return bad(what, "dir_rel", "a string", rel);
  const json_t *files = json_object_get(src, "files"), *v;
  if (!json_is_array(files) || json_array_size(files) == 0 ||
      !json_is_string(json_array_get(files, 0)) ||
      strcmp(json_string_value(json_array_get(files, 0)), "config.json") != 0)
    return bad(what, "files", "an array of file names beginning with \"config.json\"", files);
  size_t i;
  json_array_foreach(files, i, v) {
    if (!json_is_string(v) || !plain_name(json_string_value(v)))
      return bad(what, "files", "plain file names", v);
  }
  const char *key;
  const json_t *dtypes = json_object_get(src, "dtypes"), *carried = json_object_get(src, "carried");
  if (!json_is_object(dtypes)) return bad(what, "dtypes", "an object {tensor: dtype}", dtypes);
  json_object_foreach((json_t *)dtypes, key, v) {
    if (!float_dtype(v)) return bad(what, "dtypes", "F32, BF16 or F16", v);
  }
  if (!json_is_object(carried)) return bad(what, "carried", "an object {tensor: {dtype, shape}}",
                                           carried);
  json_object_foreach((json_t *)carried, key, v) {
    ml_dtype t;
    const json_t *d = json_object_get(v, "dtype");
    if (!json_is_string(d) || ml_dtype_parse(json_string_value(d), &t) != 0 ||
        !good_shape(json_object_get(v, "shape")))
      return bad(what, "carried", "entries {\"dtype\": a safetensors dtype, \"shape\": [sizes]}",
                 v);
  }
  return 0;
}

/* ----------------------------------------------------------------- copying */

static int copy_file(const char *from, const char *to) {
  FILE *in = fopen(from, "rb"), *out = NULL;
  if (!in) return ml_err("%s: cannot open: %s", from, strerror(errno));
  char tmp[PATH_CAP];
  enum { BUF = 1 << 20 };
  char *buf = ml_malloc(BUF, "a file copy's buffer");
  int rc = buf ? ml_file_open_tmp(to, tmp, sizeof tmp, &out) : -1;
  size_t k;
  while (rc == 0 && (k = fread(buf, 1, BUF, in)) > 0)
    if (fwrite(buf, 1, k, out) != k)
      rc = ml_err("%s: cannot write: %s", to, strerror(errno));
  if (rc == 0 && ferror(in)) rc = ml_err("%s: cannot read: %s", from, strerror(errno));
  if (rc == 0) rc = ml_file_commit(out, tmp, to);
  else if (out) ml_file_abandon(out, tmp);
  fclose(in);
  free(buf);
  return rc;
}

int ml_hf_source_copy(const json_t *src, const char *from, const char *to, bool with_config) {
  const json_t *v;
  size_t i;
  char a[PATH_CAP], b[PATH_CAP];
  json_array_foreach(json_object_get(src, "files"), i, v) {
    const char *name = json_string_value(v);
    if (!with_config && strcmp(name, "config.json") == 0) continue;
    if (snprintf(a, sizeof a, "%s/%s", from, name) >= (int)sizeof a ||
        snprintf(b, sizeof b, "%s/%s", to, name) >= (int)sizeof b)
      return ml_err("%s/%s: path too long", from, name);
    ML_TRY(copy_file(a, b));
  }
  return 0;
}
