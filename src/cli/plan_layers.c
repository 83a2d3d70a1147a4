/* meshlm plan: listings with identical decoder layers collapsed (plan_layers.h). */
#include "cli/plan_layers.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

void ml_text_printf(ml_text *t, const char *fmt, ...) {
  if (t->failed) return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(t->s ? t->s + t->n : NULL, t->s ? t->cap - t->n : 0, fmt, ap);
    va_end(ap);
    if (k < 0) {
      t->failed = true;
      return;
    }
    if (t->s && (size_t)k < t->cap - t->n) {
      t->n += (size_t)k;
      return;
    }
    size_t cap = t->cap ? t->cap : 256;
    while (cap - t->n <= (size_t)k) cap *= 2;
    char *s = realloc(t->s, cap);
    if (!s) {
      t->failed = true;
      return;
    }
    t->s = s;
    t->cap = cap;
  }
}

void ml_text_free(ml_text *t) {
  free(t->s);
  *t = (ml_text){0};
}

/* The decoder layer of item i (−1: none), *rest the part of its name after
 * the layer's number. */
static int layer_of(const ml_listing *l, int i, const char **rest) {
  const char *name = l->name(l->ctx, i);
  size_t n = strlen(l->layer_prefix);
  if (strncmp(name, l->layer_prefix, n) != 0) return -1;
  const char *d = name + n;
  char *end;
  long k = strtol(d, &end, 10);
  if (end == d || *d < '0' || *d > '9' || k >= l->n_layers || (*end && *end != '.' && *end != ' '))
    return -1;
  *rest = end;
  return (int)k;
}

/* The pending run of layers from..to identical to layer ref, as one line. */
static void flush_same(const ml_listing *l, int *from, int to, int ref, ml_text *out) {
  if (*from < 0) return;
  if (*from == to)
    ml_text_printf(out, "  %s%d: same as %s%d\n", l->layer_prefix, to, l->layer_prefix, ref);
  else
    ml_text_printf(out, "  %s%d-%d: same as %s%d\n", l->layer_prefix, *from, to, l->layer_prefix,
                   ref);
  *from = -1;
}

int ml_listing_text(const ml_listing *l, ml_text *out) {
  ml_text *shown = ml_calloc((size_t)l->n_layers + 1, sizeof *shown, "the plan's layer listing");
  if (!shown) return -1;
  ml_text cur = {0};
  int rc = 0, from = -1, to = -1, ref = -1; /* the pending run of "same as" layers */
  for (int i = 0; rc == 0 && i < l->n;) {
    const char *rest;
    int k = layer_of(l, i, &rest), j = i;
    if (k < 0) {
      flush_same(l, &from, to, ref, out);
      rc = l->render(l->ctx, i, l->name(l->ctx, i), out);
      i++;
      continue;
    }
    cur.n = 0;
    for (const char *r; rc == 0 && j < l->n && layer_of(l, j, &r) == k; j++)
      rc = l->render(l->ctx, j, r, &cur);
    int same = -1;
    for (int q = 0; !l->verbose && q < k && same < 0; q++)
      if (shown[q].s && shown[q].n == cur.n && !memcmp(shown[q].s, cur.s, cur.n)) same = q;
    if (same >= 0 && from >= 0 && ref == same && to == k - 1) {
      to = k;
    } else if (same >= 0) {
      flush_same(l, &from, to, ref, out);
      from = to = k;
      ref = same;
    } else {
      flush_same(l, &from, to, ref, out);
      for (int q = i; rc == 0 && q < j; q++) rc = l->render(l->ctx, q, l->name(l->ctx, q), out);
      if (!l->verbose) {
        ml_text_free(&shown[k]);
        shown[k] = cur;
        cur = (ml_text){0};
      }
    }
    if (cur.failed) out->failed = true;
    i = j;
  }
  if (rc == 0) flush_same(l, &from, to, ref, out);
  for (int q = 0; q < l->n_layers; q++) {
    if (shown[q].failed) out->failed = true;
    ml_text_free(&shown[q]);
  }
  free(shown);
  ml_text_free(&cur);
  if (rc == 0 && out->failed) rc = ml_err("plan: out of memory formatting the report");
  return rc;
}
