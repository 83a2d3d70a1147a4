#define _POSIX_C_SOURCE 200809L

#include "io/json.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/file.h"
#include "common/status.h"

int ml_json_load(const char *path, ml_json *out) {
  memset(out, 0, sizeof *out);
  json_error_t e;
  json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &e);
  if (!root && json_error_code(&e) == json_error_cannot_open_file)
    return ml_err("%s: cannot open: %s", path, e.text);
  if (!root) return ml_err("%s:%d:%d: invalid JSON: %s", path, e.line, e.column, e.text);
  if (!json_is_object(root)) {
    char found[64];
    ml_json_brief(root, found, sizeof found);
    json_decref(root);
    return ml_err("%s: expected a JSON object at the top level, found %s", path, found);
  }
  if (!(out->path = strdup(path))) {
    json_decref(root);
    return ml_err("%s: out of memory", path);
  }
  out->root = root;
  return 0;
}

void ml_json_free(ml_json *j) {
  json_decref(j->root);
  free(j->path);
  memset(j, 0, sizeof *j);
}

void ml_json_brief(const json_t *v, char *buf, size_t size) {
  char *s = v ? json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
  const char *src = !v ? "nothing" : s ? s : "(unprintable)";
  size_t len = strlen(src);
  if (len < size) {
    memcpy(buf, src, len + 1);
  } else if (size >= 4) {
    memcpy(buf, src, size - 4);
    memcpy(buf + size - 4, "...", 4);
  } else if (size > 0) {
    buf[0] = '\0';
  }
  free(s);
}

static const json_t *field(const ml_json *j, const json_t *obj, const char *key) {
  return json_object_get(obj ? obj : j->root, key);
}

/* Error for field `key` holding v (NULL = missing) where `expected` was wanted. */
static int wrong(const ml_json *j, const char *key, const char *expected, const json_t *v) {
  char found[80];
  if (!v) return ml_err("%s: field '%s': missing, expected %s", j->path, key, expected);
  ml_json_brief(v, found, sizeof found);
  return ml_err("%s: field '%s': expected %s, found %s", j->path, key, expected, found);
}

static int absent(const json_t *v) { return !v || json_is_null(v); }

int ml_json_int(const ml_json *j, const json_t *obj, const char *key, int64_t *out) {
  const json_t *v = field(j, obj, key);
  if (!json_is_integer(v)) return wrong(j, key, "an integer", v);
  *out = json_integer_value(v);
  return 0;
}

int ml_json_num(const ml_json *j, const json_t *obj, const char *key, double *out) {
  const json_t *v = field(j, obj, key);
  if (!json_is_number(v)) return wrong(j, key, "a number", v);
  *out = json_number_value(v);
  return 0;
}

int ml_json_bool(const ml_json *j, const json_t *obj, const char *key, bool *out) {
  const json_t *v = field(j, obj, key);
  if (!json_is_boolean(v)) return wrong(j, key, "true or false", v);
  *out = json_is_true(v);
  return 0;
}

int ml_json_str(const ml_json *j, const json_t *obj, const char *key, const char **out) {
  const json_t *v = field(j, obj, key);
  if (!json_is_string(v)) return wrong(j, key, "a string", v);
  *out = json_string_value(v);
  return 0;
}

int ml_json_int_opt(const ml_json *j, const json_t *obj, const char *key, int64_t dflt,
                    int64_t *out) {
  if (!absent(field(j, obj, key))) return ml_json_int(j, obj, key, out);
  *out = dflt;
  return 0;
}

int ml_json_num_opt(const ml_json *j, const json_t *obj, const char *key, double dflt,
                    double *out) {
  if (!absent(field(j, obj, key))) return ml_json_num(j, obj, key, out);
  *out = dflt;
  return 0;
}

int ml_json_bool_opt(const ml_json *j, const json_t *obj, const char *key, bool dflt, bool *out) {
  if (!absent(field(j, obj, key))) return ml_json_bool(j, obj, key, out);
  *out = dflt;
  return 0;
}

int ml_json_write(const char *path, const json_t *root) {
  char tmp[4096];
  FILE *fp;
  ML_TRY(ml_file_open_tmp(path, tmp, sizeof tmp, &fp));
  if (json_dumpf(root, fp, JSON_INDENT(2)) != 0 || fputc('\n', fp) == EOF) {
    ml_err("%s: cannot write: %s", path, strerror(errno));
    ml_file_abandon(fp, tmp);
    return -1;
  }
  return ml_file_commit(fp, tmp, path);
}
