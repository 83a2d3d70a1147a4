/* ml_chat_render (data/data_chat.h): a record's messages checked and
 * normalized as transformers' apply_chat_template passes them, rendered,
 * and its target spans found. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "data/data_chat.h"
#include "data/data_chat_impl.h"
#include "io/json.h"

void ml_chat_text_free(ml_chat_text *t) {
  free(t->text);
  free(t->spans);
  memset(t, 0, sizeof *t);
}

static int oom(const char *where) {
  return ml_err("%s: out of memory rendering the conversation", where);
}

/* "found X" for messages. */
static const char *found(const json_t *v, char *buf, size_t cap) {
  if (!v) return "the field missing";
  ml_json_brief(v, buf, cap);
  return buf;
}

/* content: a string, or a list of {"type": "text", "text": string} parts. */
static int check_content(const char *where, size_t i, const json_t *content) {
  char f[96];
  if (json_is_string(content)) return 0;
  if (!json_is_array(content))
    return ml_err("%s: field 'messages'[%zu].content: expected a string or a list of "
                  "{\"type\": \"text\", \"text\": ...} parts, found %s",
                  where, i, found(content, f, sizeof f));
  size_t j;
  const json_t *part;
  json_array_foreach(content, j, part) {
    const json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
    if (!json_is_string(type) || strcmp(json_string_value(type), "text") != 0)
      return ml_err("%s: field 'messages'[%zu].content[%zu].type: expected \"text\" (text "
                    "parts only), found %s",
                    where, i, j, found(type, f, sizeof f));
    if (!json_is_string(text))
      return ml_err("%s: field 'messages'[%zu].content[%zu].text: expected a string, found %s",
                    where, i, j, found(text, f, sizeof f));
  }
  return 0;
}

static const char *const reasoning_keys[] = {"reasoning_content", "thinking", "reasoning"};

/* Message i as transformers passes it (null-valued keys dropped, the
 * reasoning aliased: _alias_reasoning_fields), checked. */
static int message(const char *where, size_t i, const json_t *m, json_t **out) {
  char f[96];
  if (!json_is_object(m))
    return ml_err("%s: field 'messages'[%zu]: expected an object {\"role\", \"content\"}, "
                  "found %s",
                  where, i, found(m, f, sizeof f));
  const json_t *role = json_object_get(m, "role"), *content = json_object_get(m, "content");
  if (!json_is_string(role))
    return ml_err("%s: field 'messages'[%zu].role: expected a string, found %s", where, i,
                  found(json_is_null(role) ? NULL : role, f, sizeof f));
  bool calls = json_object_get(m, "tool_calls") && !json_is_null(json_object_get(m, "tool_calls"));
  if ((content && !json_is_null(content)) || !calls) ML_TRY(check_content(where, i, content));
  const json_t *reason = NULL;
  for (int k = 0; k < 3 && !reason; k++) {
    const json_t *v = json_object_get(m, reasoning_keys[k]);
    if (v && !json_is_null(v)) reason = v;
  }
  json_t *o = json_object();
  int rc = o ? 0 : -1;
  if (rc == 0 && reason) rc = json_object_set(o, "thinking", (json_t *)reason);
  const char *key;
  json_t *v;
  json_object_foreach((json_t *)m, key, v) {
    if (rc == 0 && !json_is_null(v)) rc = json_object_set(o, key, v);
  }
  if (rc == 0 && reason) rc = json_object_set(o, "reasoning_content", (json_t *)reason);
  if (rc != 0) {
    json_decref(o);
    return oom(where);
  }
  *out = o;
  return 0;
}

/* The record's messages, normalized, into *out (a new array). */
static int messages(const char *where, const json_t *rec, json_t **out) {
  const json_t *ms = json_object_get(rec, "messages");
  char f[96];
  if (!json_is_array(ms))
    return ml_err("%s: field 'messages': expected a list of {\"role\", \"content\"} messages, "
                  "found %s",
                  where, found(ms, f, sizeof f));
  if (json_array_size(ms) == 0)
    return ml_err("%s: field 'messages': expected at least one message, found an empty list",
                  where);
  json_t *arr = json_array();
  if (!arr) return oom(where);
  size_t i;
  const json_t *m;
  json_array_foreach(ms, i, m) {
    json_t *norm = NULL;
    int rc = message(where, i, m, &norm);
    if (rc == 0 && json_array_append_new(arr, norm)) rc = oom(where);
    if (rc != 0) {
      json_decref(arr);
      return -1;
    }
  }
  *out = arr;
  return 0;
}

/* The record's tools: a list of objects, or null. */
static int tools(const char *where, const json_t *rec, const json_t **out) {
  const json_t *t = json_object_get(rec, "tools");
  char f[96];
  *out = t && !json_is_null(t) ? t : NULL;
  if (!*out) return 0;
  bool list = json_is_array(t);
  for (size_t i = 0; list && i < json_array_size(t); i++)
    list = json_is_object(json_array_get(t, i));
  if (list) return 0;
  return ml_err("%s: field 'tools': expected a list of JSON-schema objects, found %s", where,
                found(t, f, sizeof f));
}

/* What one render reads. */
typedef struct job {
  const ml_chat *c;
  const char *where;
  const ml_jinja *tmpl;
  const char *origin;
  const json_t *msgs, *tools;
} job;

/* Render the first k messages (add_generation_prompt agp) into *o. */
static int render(const job *j, size_t k, bool agp, ml_jinja_output *o) {
  memset(o, 0, sizeof *o);
  json_t *ctx = json_copy(j->c->tokens), *slice = json_array();
  int rc = ctx && slice ? 0 : -1;
  for (size_t i = 0; rc == 0 && i < k; i++)
    rc = json_array_append(slice, json_array_get(j->msgs, i));
  if (rc == 0) rc = json_object_set(ctx, "messages", slice);
  if (rc == 0) rc = json_object_set_new(ctx, "tools", j->tools ? json_incref((json_t *)j->tools)
                                                                : json_null());
  if (rc == 0) rc = json_object_set_new(ctx, "documents", json_null());
  if (rc == 0) rc = json_object_set_new(ctx, "add_generation_prompt", json_boolean(agp));
  if (rc != 0) rc = oom(j->where);
  if (rc == 0 && ml_jinja_render(j->tmpl, ctx, o)) {
    char msg[ML_ERROR_MSG_CAP];
    snprintf(msg, sizeof msg, "%s", ml_error_msg());
    ml_error_clear();
    rc = ml_err("%s: field 'messages': rendering the chat template: %s", j->where, msg);
  }
  json_decref(slice);
  json_decref(ctx);
  if (rc != 0) ml_jinja_output_free(o);
  return rc;
}

/* The byte where a and b first differ (the shorter's length when one
 * starts with the other). */
static size_t differ(const ml_jinja_output *a, const ml_jinja_output *b) {
  size_t n = a->len < b->len ? a->len : b->len, k = 0;
  while (k < n && a->text[k] == b->text[k]) k++;
  return k;
}

static int add_span(ml_chat_text *t, size_t begin, size_t end, const char *where) {
  if (end <= begin) return 0;
  ml_jinja_span *s = realloc(t->spans, (t->nspans + 1) * sizeof *s);
  if (!s) return oom(where);
  t->spans = s;
  t->spans[t->nspans++] = (ml_jinja_span){begin, end};
  return 0;
}

/* Assistant message i's span by prefix rendering (data_chat.h). */
static int prefix_span(const job *j, size_t i, const ml_jinja_output *full, ml_chat_text *t) {
  ml_jinja_output a, b;
  ML_TRY(render(j, i, true, &a));
  int rc = render(j, i + 1, false, &b);
  size_t k = rc == 0 ? differ(&a, &b) : 0;
  if (rc == 0 && k < a.len)
    rc = ml_err("%s: field 'messages'[%zu]: the chat template (%s) renders messages[0..%zu] as "
                "text that does not start with its rendering of messages[0..%zu) with "
                "add_generation_prompt (they differ from byte %zu on), so the assistant turn "
                "cannot be told apart; expected renderings that extend each other, or "
                "{%% generation %%} blocks in the template",
                j->where, i, j->origin, i, i, k);
  k = rc == 0 ? differ(&b, full) : 0;
  if (rc == 0 && k < b.len)
    rc = ml_err("%s: field 'messages'[%zu]: the chat template (%s) renders the whole "
                "conversation as text that does not start with its rendering of "
                "messages[0..%zu] (they differ from byte %zu on: the template rewrites earlier "
                "turns); expected renderings that extend each other, or {%% generation %%} "
                "blocks in the template",
                j->where, i, j->origin, i, k);
  if (rc == 0) rc = add_span(t, a.len, b.len, j->where);
  ml_jinja_output_free(&a);
  ml_jinja_output_free(&b);
  return rc;
}

static int render_all(const job *j, ml_chat_text *out) {
  ml_jinja_output full;
  ML_TRY(render(j, json_array_size(j->msgs), false, &full));
  int rc = 0;
  if (ml_jinja_has_generation(j->tmpl)) {
    for (size_t s = 0; rc == 0 && s < full.ngen; s++)
      rc = add_span(out, full.gen[s].begin, full.gen[s].end, j->where);
  } else {
    for (size_t i = 0; rc == 0 && i < json_array_size(j->msgs); i++) {
      const json_t *role = json_object_get(json_array_get(j->msgs, i), "role");
      if (strcmp(json_string_value(role), "assistant") == 0) rc = prefix_span(j, i, &full, out);
    }
  }
  out->text = full.text;
  out->len = full.len;
  full.text = NULL;
  ml_jinja_output_free(&full);
  return rc;
}

int ml_chat_render(const ml_chat *c, const char *where, const json_t *rec, ml_chat_text *out) {
  memset(out, 0, sizeof *out);
  job j = {c, where, c->tmpl, c->origin, NULL, NULL};
  ML_TRY(tools(where, rec, &j.tools));
  if (j.tools && c->tool_use) {
    j.tmpl = c->tool_use;
    j.origin = c->tool_origin;
  }
  json_t *msgs = NULL;
  ML_TRY(messages(where, rec, &msgs));
  j.msgs = msgs;
  int rc = render_all(&j, out);
  json_decref(msgs);
  if (rc != 0) ml_chat_text_free(out);
  return rc;
}
