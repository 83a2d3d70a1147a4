#include "cli/config_file.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "io/json.h"

/* Keys are at most this long (flag names are short). */
enum { KEY_MAX = 64 };

/* The alias naming spec entry `a`, or NULL. */
static const ml_config_alias *alias_of(const ml_arg *a, const ml_config_alias *aliases,
                                       size_t n_aliases) {
  for (size_t i = 0; i < n_aliases; i++)
    if (strcmp(aliases[i].flag, a->name) == 0) return &aliases[i];
  return NULL;
}

/* The config key of spec entry `a` into key[KEY_MAX]. */
static void key_of(const ml_arg *a, const ml_config_alias *al, char *key) {
  if (al) {
    snprintf(key, KEY_MAX, "%s", al->key);
    return;
  }
  snprintf(key, KEY_MAX, "%s", a->name + strspn(a->name, "-"));
  for (char *c = key; *c; c++)
    if (*c == '-') *c = '_';
}

typedef struct cfg_ctx {
  const char *path;
  const ml_arg *spec;
  size_t n;
  const ml_config_alias *aliases;
  size_t n_aliases;
  const char *exclude;
} cfg_ctx;

/* The spec entry whose key is `key` (and its alias), or NULL. */
static const ml_arg *find_key(const cfg_ctx *c, const char *key, const ml_config_alias **al) {
  char k[KEY_MAX];
  for (size_t i = 0; i < c->n; i++) {
    if (c->exclude && strcmp(c->spec[i].name, c->exclude) == 0) continue;
    *al = alias_of(&c->spec[i], c->aliases, c->n_aliases);
    key_of(&c->spec[i], *al, k);
    if (strcmp(k, key) == 0) return &c->spec[i];
  }
  return NULL;
}

static int unknown_key(const cfg_ctx *c, const char *key) {
  char list[2048] = "", k[KEY_MAX];
  size_t used = 0;
  for (size_t i = 0; i < c->n && used < sizeof list; i++) {
    if (c->exclude && strcmp(c->spec[i].name, c->exclude) == 0) continue;
    key_of(&c->spec[i], alias_of(&c->spec[i], c->aliases, c->n_aliases), k);
    used += (size_t)snprintf(list + used, sizeof list - used, "%s%s", used ? ", " : "", k);
  }
  return ml_err("%s: unknown key '%s'; accepted keys: %s", c->path, key, list);
}

static const char *json_type_name(const json_t *v) {
  switch (json_typeof(v)) {
  case JSON_OBJECT: return "an object";
  case JSON_ARRAY: return "an array";
  case JSON_STRING: return "a string";
  case JSON_INTEGER: return "an integer";
  case JSON_REAL: return "a real number";
  case JSON_TRUE:
  case JSON_FALSE: return "a boolean";
  case JSON_NULL: break;
  }
  return "null";
}

static int wrong_type(const cfg_ctx *c, const char *key, const char *expected, const json_t *v) {
  char found[80];
  ml_json_brief(v, found, sizeof found);
  return ml_err("%s: key '%s': expected %s, found %s (%s)", c->path, key, expected,
                json_type_name(v), found);
}

/* "--flag=" + text, malloc'd. */
static char *token(const char *flag, const char *text) {
  size_t len = strlen(flag) + 1 + strlen(text) + 1;
  char *t = ml_malloc(len, "config file argument");
  if (t) snprintf(t, len, "%s=%s", flag, text);
  return t;
}

/* What a key of flag `a` accepts, for messages. */
static const char *expected_json(const ml_arg *a, const ml_config_alias *al) {
  bool bools = al && al->if_true;
  if (a->type == ML_ARG_CHOICE)
    return bools ? "a string, an integer or a boolean" : "a string or an integer";
  if (al && al->list) return "a string or a list of strings";
  return bools ? "a string or a boolean" : "a string";
}

/* "--flag=" and the strings of array v joined with commas; NULL with a
 * message naming the key when an element is not a string. */
static char *list_token(const cfg_ctx *c, const char *key, const ml_arg *a, const json_t *v) {
  size_t len = strlen(a->name) + 2, i;
  const json_t *s;
  json_array_foreach((json_t *)v, i, s) {
    if (!json_is_string(s)) return wrong_type(c, key, "a list of strings", v), NULL;
    len += json_string_length(s) + 1;
  }
  char *t = ml_malloc(len, "config file argument");
  if (!t) return NULL;
  size_t at = (size_t)snprintf(t, len, "%s=", a->name);
  json_array_foreach((json_t *)v, i, s)
    at += (size_t)snprintf(t + at, len - at, "%s%s", i ? "," : "", json_string_value(s));
  return t;
}

/* The token for choice flag `a` taking `text` (from `v`), or NULL when
 * `text` is not one of its names (error naming the key). */
static char *choice_token(const cfg_ctx *c, const char *key, const ml_arg *a, const char *text,
                          const json_t *v) {
  const ml_arg_choice *ch = a->dst;
  for (int i = 0; ch->names[i]; i++)
    if (strcmp(ch->names[i], text) == 0) return token(a->name, text);
  char list[256], found[80];
  ml_json_brief(v, found, sizeof found);
  return ml_err("%s: key '%s': expected one of %s, found %s", c->path, key,
                ml_arg_choice_list(ch, ", ", list, sizeof list), found),
         NULL;
}

/* The "--flag=value" token for `v` under `key`, or NULL (error recorded). */
static char *translate(const cfg_ctx *c, const char *key, const ml_arg *a,
                       const ml_config_alias *al, const json_t *v) {
  char num[32];
  const char *text = NULL;
  switch (a->type) {
  case ML_ARG_INT:
    if (!json_is_integer(v)) return wrong_type(c, key, "an integer", v), NULL;
    snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
    return token(a->name, num);
  case ML_ARG_FLOAT:
    if (!json_is_number(v)) return wrong_type(c, key, "a number", v), NULL;
    snprintf(num, sizeof num, "%.17g", json_number_value(v));
    return token(a->name, num);
  case ML_ARG_FLAG:
    if (!json_is_boolean(v)) return wrong_type(c, key, "a boolean", v), NULL;
    return token(a->name, json_is_true(v) ? "true" : "false");
  case ML_ARG_CHOICE:
  case ML_ARG_STR:
    if (al && al->list && json_is_array(v)) return list_token(c, key, a, v);
    if (json_is_string(v))
      text = json_string_value(v);
    else if (al && al->if_true && json_is_boolean(v))
      text = json_is_true(v) ? al->if_true : al->if_false;
    else if (a->type == ML_ARG_CHOICE && json_is_integer(v)) {
      snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
      text = num;
    }
    if (!text) return wrong_type(c, key, expected_json(a, al), v), NULL;
    return a->type == ML_ARG_CHOICE ? choice_token(c, key, a, text, v) : token(a->name, text);
  }
  return ml_err("%s: key '%s': flag %s has an unknown type", c->path, key, a->name), NULL;
}

static int build_tokens(const cfg_ctx *c, const json_t *root, ml_config_argv *out) {
  const char *key;
  const json_t *v;
  json_object_foreach((json_t *)root, key, v) {
    const ml_config_alias *al = NULL;
    const ml_arg *a = find_key(c, key, &al);
    if (!a) return unknown_key(c, key);
    if (json_is_null(v)) continue;
    char *t = translate(c, key, a, al, v);
    if (!t) return -1;
    out->argv[out->n_file++] = t;
  }
  return 0;
}

int ml_config_argv_build(const char *path, const ml_arg *spec, size_t n,
                         const ml_config_alias *aliases, size_t n_aliases, const char *exclude,
                         int argc, char **argv, ml_config_argv *out) {
  memset(out, 0, sizeof *out);
  ml_json j = {0};
  if (path) ML_TRY(ml_json_load(path, &j));
  size_t n_keys = path ? json_object_size(j.root) : 0;
  out->argv = ml_calloc(n_keys + (size_t)argc + 1, sizeof *out->argv, "argument vector");
  int rc = out->argv ? 0 : -1;
  cfg_ctx c = {path, spec, n, aliases, n_aliases, exclude};
  if (rc == 0 && path) rc = build_tokens(&c, j.root, out);
  ml_json_free(&j);
  if (rc != 0) return rc;
  for (int i = 0; i < argc; i++) out->argv[out->n_file + i] = argv[i];
  out->argc = out->n_file + argc;
  return 0;
}

void ml_config_argv_free(ml_config_argv *a) {
  for (int i = 0; a->argv && i < a->n_file; i++) free(a->argv[i]);
  free(a->argv);
  memset(a, 0, sizeof *a);
}
