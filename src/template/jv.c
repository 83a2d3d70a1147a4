/* Values: the arena, strings, lists, dicts, truth and equality (jv.h). */
#include "template/jv.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct ja_chunk {
  ja_chunk *next;
  size_t size, used;
  _Alignas(max_align_t) unsigned char data[];
};

#define JA_CHUNK (64 * 1024)

void *ja_alloc(jarena *a, size_t bytes) {
  const size_t align = _Alignof(max_align_t);
  if (bytes > a->cap) return NULL;
  bytes = (bytes + align - 1) / align * align;
  if (bytes > a->cap - a->used) return NULL;
  ja_chunk *c = a->head;
  if (!c || c->size - c->used < bytes) {
    size_t size = bytes > JA_CHUNK ? bytes : JA_CHUNK;
    c = malloc(sizeof *c + size);
    if (!c) return NULL;
    c->size = size;
    c->used = 0;
    c->next = a->head;
    a->head = c;
  }
  void *p = c->data + c->used;
  c->used += bytes;
  a->used += bytes;
  memset(p, 0, bytes);
  return p;
}

void ja_free(jarena *a) {
  for (ja_chunk *c = a->head, *n; c; c = n) {
    n = c->next;
    free(c);
  }
  a->head = NULL;
  a->used = 0;
}

jstr *jstr_new(jarena *a, const char *p, size_t len) {
  if (len > SIZE_MAX - sizeof(jstr) - 1) return NULL;
  jstr *s = ja_alloc(a, sizeof *s + len + 1);
  if (!s) return NULL;
  s->len = len;
  if (len) memcpy(s->s, p, len);
  s->s[len] = 0;
  return s;
}

jlist *jlist_new(jarena *a, size_t cap) {
  jlist *l = ja_alloc(a, sizeof *l);
  if (!l) return NULL;
  if (cap) {
    if (cap > SIZE_MAX / sizeof(jv)) return NULL;
    l->items = ja_alloc(a, cap * sizeof(jv));
    if (!l->items) return NULL;
    l->cap = cap;
  }
  return l;
}

jdict *jdict_new(jarena *a, size_t cap) {
  jdict *d = ja_alloc(a, sizeof *d);
  if (!d) return NULL;
  if (cap) {
    if (cap > SIZE_MAX / sizeof(jv)) return NULL;
    d->keys = ja_alloc(a, cap * sizeof(jv));
    d->vals = ja_alloc(a, cap * sizeof(jv));
    if (!d->keys || !d->vals) return NULL;
    d->cap = cap;
  }
  return d;
}

/* Grow an arena array of jv from cap to at least n + 1 (doubling). */
static jv *grow(jarena *a, jv *old, size_t n, size_t *cap) {
  if (n < *cap) return old;
  size_t nc = *cap ? *cap * 2 : 4;
  if (nc > SIZE_MAX / sizeof(jv)) return NULL;
  jv *p = ja_alloc(a, nc * sizeof(jv));
  if (!p) return NULL;
  if (n) memcpy(p, old, n * sizeof(jv));
  *cap = nc;
  return p;
}

int jlist_push(jarena *a, jlist *l, jv v) {
  size_t cap = l->cap;
  jv *p = grow(a, l->items, l->n, &cap);
  if (!p) return -1;
  l->items = p;
  l->cap = cap;
  l->items[l->n++] = v;
  return 0;
}

jv *jdict_get(const jdict *d, jv k) {
  for (size_t i = 0; i < d->n; i++)
    if (jv_eq(d->keys[i], k)) return &d->vals[i];
  return NULL;
}

jv *jdict_get_str(const jdict *d, const char *k, size_t len) {
  for (size_t i = 0; i < d->n; i++) {
    const jv *key = &d->keys[i];
    if (key->kind == JV_STR && key->u.s->len == len && memcmp(key->u.s->s, k, len) == 0)
      return &d->vals[i];
  }
  return NULL;
}

int jdict_set(jarena *a, jdict *d, jv k, jv v) {
  jv *old = jdict_get(d, k);
  if (old) {
    *old = v;
    return 0;
  }
  size_t kc = d->cap, vc = d->cap;
  jv *keys = grow(a, d->keys, d->n, &kc);
  jv *vals = keys ? grow(a, d->vals, d->n, &vc) : NULL;
  if (!vals) return -1;
  d->keys = keys;
  d->vals = vals;
  d->cap = kc;
  d->keys[d->n] = k;
  d->vals[d->n++] = v;
  return 0;
}

bool jv_truthy(jv v) {
  switch (v.kind) {
  case JV_UNDEF:
  case JV_NONE: return false;
  case JV_BOOL: return v.u.b;
  case JV_INT: return v.u.i != 0;
  case JV_FLOAT: return v.u.f != 0.0;
  case JV_STR: return v.u.s->len != 0;
  case JV_LIST: return v.u.l->view == JL_GEN || v.u.l->n != 0;
  case JV_DICT: return v.u.d->n != 0;
  default: return true;
  }
}

double jv_num(jv v) {
  switch (v.kind) {
  case JV_BOOL: return v.u.b;
  case JV_INT: return (double)v.u.i;
  case JV_FLOAT: return v.u.f;
  default: return NAN;
  }
}

static bool eq_d(jv a, jv b, int depth, bool *deep);

bool jv_eq(jv a, jv b) {
  bool deep = false;
  return eq_d(a, b, 0, &deep);
}

int jv_equal(jv a, jv b, bool *eq) {
  bool deep = false;
  *eq = eq_d(a, b, 0, &deep);
  return deep ? -1 : 0;
}

static bool eq_d(jv a, jv b, int depth, bool *deep) {
  if (depth > JV_DEPTH) {
    *deep = true;
    return false;
  }
  if (jv_is_num(a) && jv_is_num(b)) {
    if (a.kind != JV_FLOAT && b.kind != JV_FLOAT) {
      int64_t x = a.kind == JV_BOOL ? a.u.b : a.u.i, y = b.kind == JV_BOOL ? b.u.b : b.u.i;
      return x == y;
    }
    /* int vs float: exact, as Python (no rounding of the int) */
    if (a.kind == JV_FLOAT && b.kind == JV_FLOAT) return a.u.f == b.u.f;
    double f = a.kind == JV_FLOAT ? a.u.f : b.u.f;
    jv iv = a.kind == JV_FLOAT ? b : a;
    int64_t i = iv.kind == JV_BOOL ? iv.u.b : iv.u.i;
    if (!(f >= -9223372036854775808.0 && f < 9223372036854775808.0)) return false;
    if (f != floor(f)) return false;
    return (int64_t)f == i;
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
  case JV_UNDEF:
  case JV_NONE: return true;
  case JV_STR: return a.u.s->len == b.u.s->len && memcmp(a.u.s->s, b.u.s->s, a.u.s->len) == 0;
  case JV_LIST:
    if (a.u.l == b.u.l) return true;
    if (a.u.l->view != b.u.l->view || a.u.l->view == JL_GEN || a.u.l->n != b.u.l->n) return false;
    for (size_t i = 0; i < a.u.l->n; i++)
      if (!eq_d(a.u.l->items[i], b.u.l->items[i], depth + 1, deep)) return false;
    return true;
  case JV_DICT:
    if (a.u.d == b.u.d) return true;
    if (a.u.d->n != b.u.d->n) return false;
    for (size_t i = 0; i < a.u.d->n; i++) {
      jv *o = jdict_get(b.u.d, a.u.d->keys[i]);
      if (!o || !eq_d(a.u.d->vals[i], *o, depth + 1, deep)) return false;
    }
    return true;
  case JV_NS: return a.u.d == b.u.d;
  case JV_LOOP: return a.u.loop == b.u.loop;
  case JV_MACRO: return a.u.macro == b.u.macro;
  case JV_FUNC: return a.u.fn == b.u.fn;
  default: return false;
  }
}

const char *jv_type_name(jv v) {
  switch (v.kind) {
  case JV_UNDEF: return "Undefined";
  case JV_NONE: return "NoneType";
  case JV_BOOL: return "bool";
  case JV_INT: return "int";
  case JV_FLOAT: return "float";
  case JV_STR: return "str";
  case JV_LIST: {
    static const char *const names[] = {"list", "tuple", "dict_items", "dict_keys", "dict_values", "generator", "range"};
    return names[v.u.l->view];
  }
  case JV_DICT: return "dict";
  case JV_NS: return "Namespace";
  case JV_LOOP: return "LoopContext";
  case JV_MACRO: return "Macro";
  default: return "function";
  }
}

static int from_json(jarena *a, const json_t *j, jv *out, int depth, const char **why) {
  if (depth > JV_DEPTH) {
    *why = "nesting deeper than 512";
    return -1;
  }
  *why = "the render's memory bound";
  switch (json_typeof(j)) {
  case JSON_OBJECT: {
    jdict *d = jdict_new(a, json_object_size(j));
    if (!d) return -1;
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)j, k, v) {
      jstr *ks = jstr_new(a, k, strlen(k));
      if (!ks) return -1;
      d->keys[d->n] = jv_strv(ks);
      if (from_json(a, v, &d->vals[d->n], depth + 1, why)) return -1;
      d->n++;
    }
    *out = (jv){.kind = JV_DICT, .u.d = d};
    return 0;
  }
  case JSON_ARRAY: {
    size_t n = json_array_size(j);
    jlist *l = jlist_new(a, n);
    if (!l) return -1;
    for (size_t i = 0; i < n; i++)
      if (from_json(a, json_array_get(j, i), &l->items[i], depth + 1, why)) return -1;
    l->n = n;
    *out = (jv){.kind = JV_LIST, .u.l = l};
    return 0;
  }
  case JSON_STRING: {
    jstr *s = jstr_new(a, json_string_value(j), json_string_length(j));
    if (!s) return -1;
    *out = jv_strv(s);
    return 0;
  }
  case JSON_INTEGER: *out = jv_int(json_integer_value(j)); return 0;
  case JSON_REAL: *out = jv_float(json_real_value(j)); return 0;
  case JSON_TRUE: *out = jv_bool(true); return 0;
  case JSON_FALSE: *out = jv_bool(false); return 0;
  default: *out = jv_none(); return 0;
  }
}

int jv_from_json(jarena *a, const json_t *j, jv *out, const char **why) {
  return from_json(a, j, out, 0, why);
}
