#include "tokenizer/tok_post.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "tokenizer/tok_util.h"

/* The loader's state: the processor read so far, the templates seen, the
 * tokenizer's number of tokens (which bounds the ids: tok_id). */
typedef struct load_ctx {
  tok_post *p;
  int templates;
  size_t tokens;
} load_ctx;

/* Append the ids of special token `name` (from special_tokens) to *ids. */
static int special_ids(const json_t *specials, const json_t *name, size_t tokens, const char *field,
                       const char *file, int32_t **ids, size_t *n, size_t *cap) {
  const json_t *sp =
      json_is_string(name) ? json_object_get(specials, json_string_value(name)) : NULL;
  if (!sp) return tok_bad(file, field, name, "a token named in the processor's special_tokens");
  const json_t *list = json_object_get(sp, "ids");
  if (!json_is_array(list))
    return tok_bad(file, field, sp, "a special token with an \"ids\" array");
  for (size_t i = 0; i < json_array_size(list); i++) {
    int32_t id;
    ML_TRY(tok_id(file, field, json_array_get(list, i), tokens, &id));
    ML_TRY(tok_reserve(ids, cap, *n + 1, sizeof **ids, "post-processor template"));
    (*ids)[(*n)++] = id;
  }
  return 0;
}

static int load_template(const load_ctx *c, const json_t *j, const char *field, const char *file) {
  tok_post *p = c->p;
  char f[256];
  snprintf(f, sizeof f, "%s.single", field);
  const json_t *single = json_object_get(j, "single");
  const json_t *specials = json_object_get(j, "special_tokens");
  if (!json_is_array(single)) return tok_bad(file, f, single, "an array of template pieces");
  int seen_a = 0;
  for (size_t i = 0; i < json_array_size(single); i++) {
    const json_t *piece = json_array_get(single, i);
    char fi[300];
    snprintf(fi, sizeof fi, "%s[%zu]", f, i);
    const json_t *seq = json_object_get(piece, "Sequence");
    const json_t *tok = json_object_get(piece, "SpecialToken");
    if (seq) {
      const json_t *id = json_object_get(seq, "id");
      if (!json_is_string(id) || strcmp(json_string_value(id), "A") != 0 || seen_a++)
        return tok_bad(file, fi, piece, "the sequence $A, once (a single template)");
    } else if (tok) {
      ML_TRY(special_ids(specials, json_object_get(tok, "id"), c->tokens, fi, file,
                         seen_a ? &p->post : &p->pre, seen_a ? &p->n_post : &p->n_pre,
                         seen_a ? &p->post_cap : &p->pre_cap));
    } else {
      return tok_bad(file, fi, piece, "{\"Sequence\": ...} or {\"SpecialToken\": ...}");
    }
  }
  if (!seen_a) return tok_bad(file, f, single, "a template with the sequence $A");
  return 0;
}

static int load(load_ctx *c, const json_t *j, const char *field, const char *file);

/* A Sequence's processor, through tok_each_item. */
static int load_item(void *c, const json_t *j, const char *field, const char *file) {
  return load(c, j, field, file);
}

static int load(load_ctx *c, const json_t *j, const char *field, const char *file) {
  const json_t *type = json_object_get(j, "type");
  const char *t = json_is_string(type) ? json_string_value(type) : "";
  char f[256];
  if (strcmp(t, "ByteLevel") == 0) return 0;
  if (strcmp(t, "TemplateProcessing") == 0) {
    if (c->templates++) {
      snprintf(f, sizeof f, "%s", field);
      return tok_bad(file, f, type, "one TemplateProcessing in the post-processor at most");
    }
    return load_template(c, j, field, file);
  }
  if (strcmp(t, "Sequence") == 0)
    return tok_each_item(j, "processors", field, file, "an array of processors", load_item, c);
  snprintf(f, sizeof f, "%s.type", field);
  return tok_bad(file, f, type,
                 "\"TemplateProcessing\", \"ByteLevel\" or \"Sequence\" (the post-processors "
                 "meshlm implements)");
}

int tok_post_load(tok_post *p, const json_t *j, size_t tokens, const char *file) {
  memset(p, 0, sizeof *p);
  if (!j || json_is_null(j)) return 0;
  if (!json_is_object(j)) return tok_bad(file, "post_processor", j, "an object or null");
  load_ctx c = {p, 0, tokens};
  return load(&c, j, "post_processor", file);
}

void tok_post_free(tok_post *p) {
  free(p->pre);
  free(p->post);
  memset(p, 0, sizeof *p);
}
