#include "data/data_chat.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/status.h"
#include "data/data_chat_impl.h"
#include "data/data_lines.h"

void ml_chat_free(ml_chat *c) {
  if (!c) return;
  ml_jinja_free(c->tmpl);
  ml_jinja_free(c->tool_use);
  free(c->origin);
  free(c->tool_origin);
  json_decref(c->tokens);
  free(c);
}

/* DIR/NAME into buf[cap]. */
static int join(const char *dir, const char *name, char *buf, size_t cap) {
  if ((size_t)snprintf(buf, cap, "%s/%s", dir, name) >= cap)
    return ml_err("%s/%s: path too long", dir, name);
  return 0;
}

static bool exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0;
}

/* Parse src[0, len) as template *t with origin `origin` (kept in *keep). */
static int parse(const char *src, size_t len, const char *origin, ml_jinja **t, char **keep) {
  *keep = strdup(origin);
  if (!*keep) return ml_err("out of memory for the chat template's origin");
  return ml_jinja_parse(src, len, origin, t);
}

/* A template file, when it exists. */
static int load_file(const char *dir, const char *name, ml_jinja **t, char **origin) {
  char path[4096];
  ML_TRY(join(dir, name, path, sizeof path));
  if (!exists(path)) return 0;
  char *src;
  size_t len;
  ML_TRY(ml_data_read_file(path, &src, &len));
  int rc = parse(src, len, path, t, origin);
  free(src);
  return rc;
}

/* A JSON object file of dir, NULL when it does not exist. */
static int load_json(const char *dir, const char *name, char *path, size_t cap, json_t **doc) {
  *doc = NULL;
  ML_TRY(join(dir, name, path, cap));
  if (!exists(path)) return 0;
  json_error_t e;
  *doc = json_load_file(path, JSON_REJECT_DUPLICATES | JSON_DECODE_INT_AS_REAL, &e);
  if (!*doc) return ml_err("%s:%d:%d: invalid JSON: %s", path, e.line, e.column, e.text);
  if (json_is_object(*doc)) return 0;
  json_decref(*doc);
  *doc = NULL;
  return ml_err("%s: expected a JSON object at the top level", path);
}

/* tokenizer_config.json's "chat_template": a string, or a list of
 * {"name", "template"} ("default" and "tool_use" used). */
static int load_config(ml_chat *c, const char *path, const json_t *v) {
  char origin[4200];
  if (json_is_string(v)) {
    snprintf(origin, sizeof origin, "%s: field 'chat_template'", path);
    return parse(json_string_value(v), json_string_length(v), origin, &c->tmpl, &c->origin);
  }
  if (!json_is_array(v))
    return ml_err("%s: field 'chat_template': expected a string or a list of {\"name\", "
                  "\"template\"}, found another JSON value",
                  path);
  size_t i;
  const json_t *e;
  json_array_foreach(v, i, e) {
    const json_t *name = json_object_get(e, "name"), *src = json_object_get(e, "template");
    if (!json_is_string(name) || !json_is_string(src))
      return ml_err("%s: field 'chat_template'[%zu]: expected {\"name\": string, \"template\": "
                    "string}",
                    path, i);
    bool dflt = strcmp(json_string_value(name), "default") == 0;
    if (!dflt && strcmp(json_string_value(name), "tool_use") != 0) continue;
    snprintf(origin, sizeof origin, "%s: field 'chat_template'[%zu] (\"%s\")", path, i,
             json_string_value(name));
    ML_TRY(parse(json_string_value(src), json_string_length(src), origin,
                 dflt ? &c->tmpl : &c->tool_use, dflt ? &c->origin : &c->tool_origin));
  }
  if (!c->tmpl)
    return ml_err("%s: field 'chat_template': a list of %zu templates without one named "
                  "\"default\"; expected a \"default\" template (transformers' "
                  "get_chat_template)",
                  path, json_array_size(v));
  return 0;
}

static const char *const special_names[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                            "pad_token", "cls_token", "mask_token"};
enum { N_SPECIAL = sizeof special_names / sizeof special_names[0] };

/* The named special tokens of `doc` (file `path`) not yet in c->tokens:
 * a string, {"content": string}, or null (none). */
static int add_specials(ml_chat *c, const char *path, const json_t *doc, bool *seen) {
  for (int k = 0; k < N_SPECIAL; k++) {
    const json_t *v = json_object_get(doc, special_names[k]);
    if (!v || seen[k]) continue;
    seen[k] = true;
    if (json_is_object(v)) v = json_object_get(v, "content");
    if (json_is_null(v)) continue;
    if (!json_is_string(v))
      return ml_err("%s: field '%s': expected a string, {\"content\": string} or null",
                    path, special_names[k]);
    if (json_object_set(c->tokens, special_names[k], (json_t *)v))
      return ml_err("out of memory for the chat template's context");
  }
  return 0;
}

/* The templates and the special tokens of dir. */
static int load(ml_chat *c, const char *dir) {
  char cfg_path[4096], map_path[4096], jinja_path[4096];
  json_t *cfg = NULL, *map = NULL;
  bool seen[N_SPECIAL] = {false};
  c->tokens = json_object();
  if (!c->tokens) return ml_err("out of memory for the chat template's context");
  int rc = load_file(dir, "chat_template.jinja", &c->tmpl, &c->origin);
  if (rc == 0)
    rc = load_file(dir, "additional_chat_templates/tool_use.jinja", &c->tool_use,
                   &c->tool_origin);
  bool files = c->tmpl || c->tool_use; /* template files replace the config's */
  if (rc == 0) rc = load_json(dir, "tokenizer_config.json", cfg_path, sizeof cfg_path, &cfg);
  if (rc == 0 && !files && cfg && json_object_get(cfg, "chat_template"))
    rc = load_config(c, cfg_path, json_object_get(cfg, "chat_template"));
  if (rc == 0) rc = load_json(dir, "special_tokens_map.json", map_path, sizeof map_path, &map);
  if (rc == 0 && map) rc = add_specials(c, map_path, map, seen);
  if (rc == 0 && cfg) rc = add_specials(c, cfg_path, cfg, seen);
  json_decref(cfg);
  json_decref(map);
  ML_TRY(rc);
  if (c->tmpl) return 0;
  ML_TRY(join(dir, "chat_template.jinja", jinja_path, sizeof jinja_path));
  if (files)
    return ml_err("%s: %s without %s: no default chat template; expected %s (template files "
                  "replace tokenizer_config.json's chat_template, as transformers reads them)",
                  dir, c->tool_origin, jinja_path, jinja_path);
  return ml_err("%s: no chat template: neither %s nor field 'chat_template' of %s%s exists; "
                "expected the model's chat template (messages records are rendered with it, "
                "as transformers' apply_chat_template)",
                dir, jinja_path, cfg_path, exists(cfg_path) ? "" : " (no such file)");
}

int ml_chat_load(const char *dir, ml_chat **out) {
  *out = NULL;
  ml_chat *c = calloc(1, sizeof *c);
  if (!c) return ml_err("out of memory for a chat template");
  if (load(c, dir)) {
    ml_chat_free(c);
    return -1;
  }
  *out = c;
  return 0;
}
