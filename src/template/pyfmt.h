/* Values as Python writes them: str() (what {{ x }} renders), repr() (the
 * items of a rendered list or dict), float repr, and json.dumps (the `tojson`
 * filter as transformers defines it), into a growing byte buffer. */
#ifndef ML_TEMPLATE_PYFMT_H
#define ML_TEMPLATE_PYFMT_H

#include <stdbool.h>
#include <stddef.h>

#include "template/jv.h"

/* A malloc'ed byte buffer, always NUL-terminated once non-empty, that
 * refuses to grow beyond `limit` bytes (then `over` is set). */
typedef struct jbuf {
  char *p;
  size_t len, cap, limit;
  bool over;
} jbuf;

/* Append: 0, or -1 when the buffer would pass its limit (over) or malloc
 * fails. */
int jbuf_put(jbuf *b, const char *s, size_t n);
void jbuf_free(jbuf *b);

/* Python's repr(float) (the shortest text that reads back to x: "1.0",
 * "0.1", "1e-05", "1e+16", "inf", "nan") into out (32 bytes). */
void py_float_repr(double x, char *out);

/* str(v) as Jinja2 renders {{ v }}: None → "None", True → "True", Undefined
 * → "", floats as repr, lists/tuples/dicts as Python's repr of them.
 * -1 with *why set (a static text) for what has no rendering here
 * (namespace, loop, macro, function objects; nesting beyond JV_DEPTH) or
 * when the buffer refuses (*why NULL). */
int py_str(jbuf *b, jv v, const char **why);
int py_repr(jbuf *b, jv v, const char **why);

/* json.dumps(v, ensure_ascii, indent, separators, sort_keys) as Python
 * writes it: indent < 0 is None (separators ", " and ": "), indent >= 0
 * newlines and that many spaces per level (separators "," and ": ");
 * item_sep/key_sep override the separators when not NULL. Floats as repr
 * (NaN, Infinity, -Infinity), non-string keys as json.dumps converts them.
 * -1 with *why (e.g. "Object of type Undefined is not JSON serializable"),
 * or *why NULL when the buffer refuses. */
typedef struct py_json_opts {
  bool ensure_ascii, sort_keys;
  int indent;
  const char *item_sep, *key_sep;
} py_json_opts;
int py_tojson(jbuf *b, jv v, const py_json_opts *o, const char **why);

#endif
