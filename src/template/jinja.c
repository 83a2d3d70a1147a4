#define _POSIX_C_SOURCE 200809L /* strdup */
/* The public entry points (jinja.h): source normalisation, parse, render. */
#include "template/jinja.h"

#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "template/ast.h"
#include "template/eval.h"

/* A template's source text may be at most this long (bytes). */
#define JINJA_MAX_SOURCE ((size_t)16 << 20)
/* The parse's arena: tokens, the tree and literals. */
#define JINJA_PARSE_MEMORY ((size_t)256 << 20)

struct ml_jinja {
  jarena a;
  char *origin;
  jbody body;
  bool has_gen;
};

void ml_jinja_free(ml_jinja *t) {
  if (!t) return;
  ja_free(&t->a);
  free(t->origin);
  free(t);
}

int ml_jinja_parse(const char *src, size_t len, const char *origin, ml_jinja **out) {
  *out = NULL;
  if (!origin) origin = "template";
  if (len > JINJA_MAX_SOURCE)
    return ml_err("%s: a template of %zu bytes, expected at most %zu", origin, len, JINJA_MAX_SOURCE);
  if (len && memchr(src, 0, len)) return ml_err("%s: a NUL byte in the template", origin);
  ml_jinja *t = calloc(1, sizeof *t);
  if (!t || !(t->origin = strdup(origin))) {
    free(t);
    return ml_err("%s: out of memory parsing the template", origin);
  }
  t->a.cap = JINJA_PARSE_MEMORY;
  /* Jinja2's lexer: \r\n and \r become \n, and one trailing newline goes
   * (keep_trailing_newline is off) */
  char *s = ja_alloc(&t->a, len + 1);
  if (!s) {
    ml_jinja_free(t);
    return ml_err("%s: out of memory parsing the template", origin);
  }
  size_t n = 0;
  for (size_t i = 0; i < len; i++) { /* (len 0: src may be NULL) */
    if (src[i] == '\r') {
      s[n++] = '\n';
      if (i + 1 < len && src[i + 1] == '\n') i++;
    } else {
      s[n++] = src[i];
    }
  }
  if (n && s[n - 1] == '\n') n--;
  s[n] = 0;
  jtok *toks;
  size_t ntok;
  if (jinja_lex(&t->a, t->origin, s, n, &toks, &ntok) ||
      jinja_parse_tokens(&t->a, t->origin, toks, ntok, &t->body, &t->has_gen)) {
    ml_jinja_free(t);
    return -1;
  }
  *out = t;
  return 0;
}

bool ml_jinja_has_generation(const ml_jinja *t) { return t->has_gen; }

int ml_jinja_render(const ml_jinja *t, const json_t *ctx, ml_jinja_output *out) {
  memset(out, 0, sizeof *out);
  if (!json_is_object(ctx)) return ml_err("%s: the render's context must be a JSON object", t->origin);
  jx x = {.origin = t->origin, .a.cap = JINJA_MAX_MEMORY, .out.limit = JINJA_MAX_OUTPUT};
  jv c;
  const char *why;
  int rc = 0;
  if (jv_from_json(&x.a, ctx, &c, &why)) {
    rc = ml_err("%s: the render's context: %s", t->origin, why);
  } else {
    x.ctx = c.u.d;
    rc = jx_render(&x, &t->body);
  }
  if (!rc && x.ngen) {
    out->gen = malloc(x.ngen * sizeof *out->gen);
    if (!out->gen) rc = ml_err("%s: out of memory", t->origin);
    else {
      memcpy(out->gen, x.gen, x.ngen * sizeof *out->gen);
      out->ngen = x.ngen;
    }
  }
  if (!rc && !x.out.p && !(x.out.p = calloc(1, 1))) rc = ml_err("%s: out of memory", t->origin);
  ja_free(&x.a);
  if (rc) {
    jbuf_free(&x.out);
    ml_jinja_output_free(out);
    return -1;
  }
  out->text = x.out.p;
  out->len = x.out.len;
  return 0;
}

void ml_jinja_output_free(ml_jinja_output *o) {
  free(o->text);
  free(o->gen);
  memset(o, 0, sizeof *o);
}
