/* JSON documents (jansson) with typed field access whose errors name the
 * file and field, what was found and what was expected, e.g.
 * "tests/x/config.json: field 'hidden_size': expected a positive integer, found \"abc\"". */
#ifndef ML_JSON_H
#define ML_JSON_H

#include <stdbool.h>
#include <stdint.h>

#include <jansson.h>

typedef struct ml_json {
  char *path;   /* for messages */
  json_t *root; /* an object */
} ml_json;

/* Load and parse `path` (duplicate keys rejected); the root must be an
 * object. Errors name the file, the line/column and jansson's reason. */
int ml_json_load(const char *path, ml_json *out);
void ml_json_free(ml_json *j);

/* Field access: `obj` is the object to look in (NULL = the root), `key`
 * the field name used in messages.
 * Required fields: -1 with a message when missing or of the wrong type. */
int ml_json_int(const ml_json *j, const json_t *obj, const char *key, int64_t *out);
int ml_json_num(const ml_json *j, const json_t *obj, const char *key, double *out); /* int or real */
int ml_json_bool(const ml_json *j, const json_t *obj, const char *key, bool *out);
int ml_json_str(const ml_json *j, const json_t *obj, const char *key, const char **out);

/* Optional fields: `dflt` when missing or JSON null; -1 when present with
 * the wrong type. */
int ml_json_int_opt(const ml_json *j, const json_t *obj, const char *key, int64_t dflt, int64_t *out);
int ml_json_num_opt(const ml_json *j, const json_t *obj, const char *key, double dflt, double *out);
int ml_json_bool_opt(const ml_json *j, const json_t *obj, const char *key, bool dflt, bool *out);

/* Write `root` to `path` (indent 2, keys in insertion order) through a
 * temp file + rename. */
int ml_json_write(const char *path, const json_t *root);

/* Helper for messages: `v` as compact JSON in buf (truncated with "..." to
 * fit `size` bytes); "nothing" when v is NULL. */
void ml_json_brief(const json_t *v, char *buf, size_t size);

#endif
