#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* madvise */

#include "io/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/file.h"
#include "common/checked.h"
#include "common/status.h"
#include "io/json.h"

/* Tensor bytes are copied/converted as host words; the format is little-endian. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; big-endian hosts are not supported"
#endif

#define ST_MAX_HEADER 100000000ull /* reference MAX_HEADER_SIZE (decimal) */

typedef long long ll; /* for printf of int64_t without PRId64 noise */
#define ML_STR_(x) #x
#define ML_STR(x) ML_STR_(x) /* a macro's value as a string literal */

/* ---------------------------------------------------------------- reading */

/* Byte range of one tensor inside the data section, for the layout check. */
typedef struct {
  int64_t begin, end;
  size_t idx; /* into ml_st_file.tensors */
} st_span;

static int map_file(const char *path, ml_st_file *f) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ml_err("%s: cannot open: %s", path, strerror(errno));
  struct stat st;
  int rc = fstat(fd, &st);
  if (rc != 0 || !S_ISREG(st.st_mode) || st.st_size < 8) {
    close(fd);
    if (rc != 0) return ml_err("%s: cannot stat: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return ml_err("%s: not a regular file", path);
    return ml_err("%s: file is %lld bytes, expected at least 8 (the header length)", path,
                  (ll)st.st_size);
  }
  void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return ml_err("%s: cannot mmap: %s", path, strerror(errno));
  f->map = p;
  f->map_size = (size_t)st.st_size;
  return 0;
}

/* Error: in tensor `name` (NULL: the header itself), `what` was expected
 * but `v` was found. */
static int bad(const char *path, const char *name, const char *what, const json_t *v) {
  char found[96];
  ml_json_brief(v, found, sizeof found);
  if (!name) return ml_err("%s: header: expected %s, found %s", path, what, found);
  return ml_err("%s: tensor '%s': expected %s, found %s", path, name, what, found);
}

/* The JSON member `key` of tensor entry `e`, or an error when it is absent. */
static const json_t *entry_field(const char *path, const char *name, const json_t *e,
                                 const char *key) {
  const json_t *v = json_object_get(e, key);
  if (!v) ml_err("%s: tensor '%s': missing field '%s'", path, name, key);
  return v;
}

static int parse_dtype(const char *path, const char *name, const json_t *v, ml_dtype *out) {
  char found[64];
  if (json_is_string(v) && ml_dtype_parse(json_string_value(v), out) == 0) return 0;
  ml_json_brief(v, found, sizeof found);
  return ml_err("%s: tensor '%s': unknown dtype %s, expected a safetensors dtype name (F32, BF16, "
                "F16, ...)", path, name, found);
}

static int parse_shape(const char *path, const char *name, const json_t *v, ml_st_tensor *t) {
  if (!json_is_array(v)) return bad(path, name, "a shape array", v);
  if (json_array_size(v) > ML_ST_MAX_DIMS)
    return bad(path, name, "a shape of at most " ML_STR(ML_ST_MAX_DIMS) " dimensions", v);
  t->ndim = (int)json_array_size(v);
  t->numel = 1;
  for (int i = 0; i < t->ndim; i++) {
    const json_t *d = json_array_get(v, (size_t)i);
    if (!json_is_integer(d) || json_integer_value(d) < 0)
      return bad(path, name, "a shape of non-negative integers", v);
    t->shape[i] = json_integer_value(d);
    if (ml_mul_i64(t->numel, t->shape[i], &t->numel) != 0)
      return bad(path, name, "a shape whose element count fits 64 bits (overflow)", v);
  }
  return 0;
}

static int parse_offsets(const char *path, const char *name, const json_t *v, int64_t off[2]) {
  int ok = json_is_array(v) && json_array_size(v) == 2;
  for (size_t i = 0; ok && i < 2; i++) {
    const json_t *x = json_array_get(v, i);
    ok = json_is_integer(x) && json_integer_value(x) >= 0;
    off[i] = ok ? json_integer_value(x) : 0;
  }
  if (!ok) return bad(path, name, "data_offsets [begin, end] of non-negative integers", v);
  if (off[0] > off[1]) return bad(path, name, "data_offsets with begin <= end (begin > end)", v);
  return 0;
}

/* One header entry `name: {dtype, shape, data_offsets}` into t (name not set). */
static int parse_entry(const char *path, const char *name, const json_t *e, ml_st_tensor *t,
                       st_span *sp) {
  const json_t *dtype, *shape, *offs;
  int64_t off[2], nbytes;
  if (!json_is_object(e)) return bad(path, name, "an object {dtype, shape, data_offsets}", e);
  if (!(dtype = entry_field(path, name, e, "dtype")) || !(shape = entry_field(path, name, e, "shape")) ||
      !(offs = entry_field(path, name, e, "data_offsets")))
    return -1;
  ML_TRY(parse_dtype(path, name, dtype, &t->dtype));
  ML_TRY(parse_shape(path, name, shape, t));
  ML_TRY(parse_offsets(path, name, offs, off));
  if (ml_mul_i64(t->numel, (int64_t)ml_dtype_size(t->dtype), &nbytes) != 0)
    return ml_err("%s: tensor '%s': byte size of %lld x %s overflows 64 bits", path, name,
                  (ll)t->numel, ml_dtype_name(t->dtype));
  if (off[1] - off[0] != nbytes)
    return ml_err("%s: tensor '%s': data_offsets [%lld, %lld] span %lld bytes, expected size %lld "
                  "(%lld elements of %s)", path, name, (ll)off[0], (ll)off[1], (ll)(off[1] - off[0]),
                  (ll)nbytes, (ll)t->numel, ml_dtype_name(t->dtype));
  t->nbytes = (size_t)nbytes;
  sp->begin = off[0];
  sp->end = off[1];
  return 0;
}

/* "__metadata__" must be a string -> string map (reference HashMap<String, String>). */
static int check_metadata(const char *path, const json_t *meta) {
  const char *key;
  const json_t *v;
  if (!json_is_object(meta)) return bad(path, NULL, "'__metadata__' to be an object of strings", meta);
  json_object_foreach((json_t *)meta, key, v) {
    if (!json_is_string(v)) return bad(path, NULL, "'__metadata__' values to be strings", v);
  }
  return 0;
}

static json_t *parse_json(const char *path, const uint8_t *hdr, size_t len) {
  json_error_t e;
  json_t *root = json_loadb((const char *)hdr, len, JSON_REJECT_DUPLICATES, &e);
  if (root && json_is_object(root)) return root;
  if (root) {
    bad(path, NULL, "a JSON object", root);
    json_decref(root);
  } else if (json_error_code(&e) == json_error_invalid_utf8) {
    ml_err("%s: header is not valid UTF-8 (at header byte %d: %s)", path, e.position, e.text);
  } else if (json_error_code(&e) == json_error_duplicate_key) {
    ml_err("%s: header has a duplicate key (%s)", path, e.text);
  } else {
    ml_err("%s: header is not valid JSON: %s (line %d, column %d)", path, e.text, e.line, e.column);
  }
  return NULL;
}

/* Fill f->tensors (header order) and their spans from the header object. */
static int parse_entries(ml_st_file *f, const json_t *root, st_span *spans) {
  const char *key;
  const json_t *v;
  json_object_foreach((json_t *)root, key, v) {
    if (strcmp(key, "__metadata__") == 0) {
      ML_TRY(check_metadata(f->path, v));
      continue;
    }
    ml_st_tensor *t = &f->tensors[f->n];
    ML_TRY(parse_entry(f->path, key, v, t, &spans[f->n]));
    spans[f->n].idx = f->n;
    if (!(t->name = strdup(key))) return ml_err("%s: out of memory copying tensor names", f->path);
    f->n++;
  }
  return 0;
}

static int span_cmp(const void *pa, const void *pb) {
  const st_span *a = pa, *b = pb;
  if (a->begin != b->begin) return a->begin < b->begin ? -1 : 1;
  if (a->end != b->end) return a->end < b->end ? -1 : 1;
  return a->idx < b->idx ? -1 : a->idx > b->idx;
}

/* Tensors sorted by offset must tile [0, data_size) exactly: each begins
 * where the previous ended (no gap, no overlap) and the last ends at EOF. */
static int check_layout(ml_st_file *f, st_span *sp, const uint8_t *data, size_t data_size) {
  qsort(sp, f->n, sizeof *sp, span_cmp);
  int64_t pos = 0;
  const char *prev = NULL;
  for (size_t i = 0; i < f->n; i++) {
    const char *name = f->tensors[sp[i].idx].name;
    if (sp[i].begin < pos)
      return ml_err("%s: tensor '%s' data_offsets [%lld, %lld] overlap tensor '%s' ending at %lld",
                    f->path, name, (ll)sp[i].begin, (ll)sp[i].end, prev, (ll)pos);
    if (sp[i].begin > pos)
      return ml_err("%s: gap of %lld bytes before tensor '%s' (data_offsets [%lld, %lld], expected "
                    "begin %lld)", f->path, (ll)(sp[i].begin - pos), name, (ll)sp[i].begin,
                    (ll)sp[i].end, (ll)pos);
    pos = sp[i].end;
    prev = name;
  }
  if ((uint64_t)pos > data_size)
    return ml_err("%s: truncated: tensors end at data byte %lld but the data section holds %zu bytes",
                  f->path, (ll)pos, data_size);
  if ((uint64_t)pos < data_size)
    return ml_err("%s: %zu trailing bytes after the last tensor (data section %zu bytes, tensors "
                  "cover %lld)", f->path, data_size - (size_t)pos, data_size, (ll)pos);
  for (size_t i = 0; i < f->n; i++) f->tensors[sp[i].idx].data = data + sp[i].begin;
  return 0;
}

/* Validate header and layout of the mapped file f. */
static int parse_file(ml_st_file *f) {
  const uint8_t *m = f->map;
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = hlen << 8 | m[i];
  if (hlen > ST_MAX_HEADER)
    return ml_err("%s: header length %llu exceeds the limit of %llu bytes", f->path,
                  (unsigned long long)hlen, ST_MAX_HEADER);
  if (hlen > f->map_size - 8)
    return ml_err("%s: header length %llu runs past end of file (file is %zu bytes)", f->path,
                  (unsigned long long)hlen, f->map_size);
  json_t *root = parse_json(f->path, m + 8, (size_t)hlen);
  if (!root) return -1;
  size_t cap = json_object_size(root);
  st_span *spans = ml_calloc(cap, sizeof *spans, "safetensors offsets");
  f->tensors = ml_calloc(cap, sizeof *f->tensors, "safetensors tensors");
  int rc = -1;
  if (spans && f->tensors && parse_entries(f, root, spans) == 0)
    rc = check_layout(f, spans, m + 8 + hlen, f->map_size - 8 - (size_t)hlen);
  free(spans);
  json_decref(root);
  return rc;
}

int ml_st_open(const char *path, ml_st_file *out) {
  memset(out, 0, sizeof *out);
  if (!(out->path = strdup(path))) return ml_err("%s: out of memory", path);
  if (map_file(path, out) != 0 || parse_file(out) != 0) {
    ml_st_close(out);
    return -1;
  }
  return 0;
}

void ml_st_close(ml_st_file *f) {
  if (f->tensors)
    for (size_t i = 0; i < f->n; i++) free(f->tensors[i].name);
  free(f->tensors);
  if (f->map) munmap(f->map, f->map_size);
  free(f->path);
  memset(f, 0, sizeof *f);
}

const ml_st_tensor *ml_st_find(const ml_st_file *f, const char *name) {
  for (size_t i = 0; i < f->n; i++)
    if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
  return NULL;
}

void ml_st_shape_str(char *buf, size_t cap, int ndim, const int64_t *shape) {
  int at = snprintf(buf, cap, "[");
  for (int d = 0; d < ndim && at > 0 && (size_t)at < cap; d++)
    at += snprintf(buf + at, cap - (size_t)at, "%s%lld", d ? ", " : "", (ll)shape[d]);
  if (at > 0 && (size_t)at < cap) snprintf(buf + at, cap - (size_t)at, "]");
}

/* Reads into a typed destination convert READ_RUN elements at a time
 * through a buffer of fp32 (16 KiB: it stays in L1 between the widening and
 * the rounding); a block of READ_PARALLEL_MIN bytes of destination or more
 * is shared among the OpenMP threads in pieces of READ_PIECE bytes (whole
 * rows: a piece of the run; else a row each) — the CPU backend's copies
 * split the same way (backend/cpu/cpu.c PASS_CHUNK, PASS_MIN). */
enum { READ_RUN = 4096, READ_PIECE = 1 << 18, READ_PARALLEL_MIN = 1 << 20 };

/* dst[0..n) (to: F32 or BF16) = src's n elements of dtype `from` (F32, BF16
 * or F16; unaligned), widened to fp32 then, for BF16, rounded. Cannot fail:
 * the dtypes are checked by the caller. */
static void read_run(ml_dtype from, const uint8_t *src, ml_dtype to, void *dst, size_t n) {
  if (to == ML_F32) {
    (void)ml_convert_to_f32(from, src, dst, n);
    return;
  }
  float wide[READ_RUN];
  size_t es = ml_dtype_size(from);
  for (size_t at = 0; at < n; at += READ_RUN) {
    size_t len = n - at < READ_RUN ? n - at : READ_RUN;
    (void)ml_convert_to_f32(from, src + at * es, wide, len);
    (void)ml_convert_from_f32(to, wide, (uint16_t *)dst + at, len);
  }
}

int ml_st_read_block(const ml_st_tensor *t, int64_t row0, int64_t nrows, int64_t col0,
                     int64_t ncols, float *dst) {
  return ml_st_read_block_to(t, row0, nrows, col0, ncols, dst, ML_F32);
}

int ml_st_read_block_to(const ml_st_tensor *t, int64_t row0, int64_t nrows, int64_t col0,
                        int64_t ncols, void *dst, ml_dtype dst_type) {
  if (t->ndim > 2)
    return ml_err("tensor '%s': block reads need at most 2 dimensions, found %d", t->name, t->ndim);
  if (t->dtype != ML_F32 && t->dtype != ML_BF16 && t->dtype != ML_F16)
    return ml_err("tensor '%s': dtype %s cannot be read as fp32, expected F32, BF16 or F16", t->name,
                  ml_dtype_name(t->dtype));
  if (dst_type != ML_F32 && dst_type != ML_BF16)
    return ml_err("tensor '%s': cannot read into dtype %s, expected F32 or BF16", t->name,
                  ml_dtype_name(dst_type));
  int64_t rows = t->ndim >= 1 ? t->shape[0] : 1, cols = t->ndim == 2 ? t->shape[1] : 1;
  if (row0 < 0 || nrows < 0 || col0 < 0 || ncols < 0 || row0 > rows - nrows || col0 > cols - ncols)
    return ml_err("tensor '%s' [%lld, %lld]: block rows %lld+%lld, cols %lld+%lld out of range",
                  t->name, (ll)rows, (ll)cols, (ll)row0, (ll)nrows, (ll)col0, (ll)ncols);
  /* in range of a validated tensor: every product below is below its numel */
  size_t es = ml_dtype_size(t->dtype), ds = ml_dtype_size(dst_type);
  const uint8_t *src = t->data + ((size_t)row0 * (size_t)cols + (size_t)col0) * es;
  uint8_t *d = dst;
  size_t n = (size_t)nrows * (size_t)ncols;
  if (ncols == cols) { /* whole rows: one contiguous run */
    size_t piece = READ_PIECE / ds;
#pragma omp parallel for if (n * ds >= READ_PARALLEL_MIN)
    for (size_t at = 0; at < n; at += piece)
      read_run(t->dtype, src + at * es, dst_type, d + at * ds, n - at < piece ? n - at : piece);
    return 0;
  }
#pragma omp parallel for if (n * ds >= READ_PARALLEL_MIN)
  for (int64_t r = 0; r < nrows; r++)
    read_run(t->dtype, src + (size_t)r * (size_t)cols * es, dst_type,
             d + (size_t)r * (size_t)ncols * ds, (size_t)ncols);
  return 0;
}

/* ---------------------------------------------------------------- writing */

/* Header fields of e (name, dtype, ndim, shape, overflow): its data size
 * into *nbytes_out. */
int ml_st_spec_nbytes(const char *path, const ml_st_entry *e, size_t *nbytes_out) {
  const char *name = e->name ? e->name : "(null)";
  int64_t numel = 1, nbytes;
  if (!e->name || strcmp(e->name, "__metadata__") == 0)
    return ml_err("%s: tensor name %s is not allowed", path, name);
  if ((unsigned)e->dtype >= ML_DTYPE_COUNT)
    return ml_err("%s: tensor '%s': dtype %d is not a safetensors dtype", path, name,
                  (int)e->dtype);
  if (e->ndim < 0 || e->ndim > ML_ST_MAX_DIMS)
    return ml_err("%s: tensor '%s': ndim %d, expected 0..%d", path, name, e->ndim, ML_ST_MAX_DIMS);
  for (int i = 0; i < e->ndim; i++)
    if (e->shape[i] < 0 || ml_mul_i64(numel, e->shape[i], &numel) != 0)
      return ml_err("%s: tensor '%s': shape[%d] = %lld is negative or overflows the element count",
                    path, name, i, (ll)e->shape[i]);
  if (ml_mul_i64(numel, (int64_t)ml_dtype_size(e->dtype), &nbytes) != 0 ||
      (uint64_t)nbytes > SIZE_MAX)
    return ml_err("%s: tensor '%s': byte size overflows", path, name);
  *nbytes_out = (size_t)nbytes;
  return 0;
}

int ml_st_entry_nbytes(const char *path, const ml_st_entry *e, size_t *nbytes_out) {
  ML_TRY(ml_st_spec_nbytes(path, e, nbytes_out));
  if (e->dtype != ML_F32 && e->dtype != ML_BF16 && e->dtype != ML_F16)
    return ml_err("%s: tensor '%s': cannot write fp32 data as dtype %s, expected F32, BF16 or F16",
                  path, e->name, ml_dtype_name(e->dtype));
  if (*nbytes_out > 0 && !e->data) return ml_err("%s: tensor '%s': data is NULL", path, e->name);
  return 0;
}

static json_t *header_entry(const ml_st_entry *e, int64_t begin, int64_t end) {
  json_t *shape = json_array();
  for (int i = 0; shape && i < e->ndim; i++)
    if (json_array_append_new(shape, json_integer(e->shape[i])) != 0) {
      json_decref(shape);
      return NULL;
    }
  /* key order as the reference writer's TensorInfo: dtype, shape, data_offsets */
  return json_pack("{s:s, s:o, s:[I, I]}", "dtype", ml_dtype_name(e->dtype), "shape", shape,
                   "data_offsets", (json_int_t)begin, (json_int_t)end);
}

/* Append entry e of nb bytes at data offset *off to the header object `root`. */
static int header_add(const char *path, json_t *root, const ml_st_entry *e, size_t nb,
                      int64_t *off) {
  if ((int64_t)nb > INT64_MAX - *off)
    return ml_err("%s: tensor '%s': data offsets overflow 64 bits", path, e->name);
  if (json_object_get(root, e->name))
    return ml_err("%s: duplicate tensor name '%s'", path, e->name);
  json_t *info = header_entry(e, *off, *off + (int64_t)nb);
  if (!info || json_object_set_new(root, e->name, info) != 0)
    return ml_err("%s: out of memory building the header entry of '%s'", path, e->name);
  *off += (int64_t)nb;
  return 0;
}

/* Header JSON object: "__metadata__" first, then entries with consecutive
 * offsets (sizes nbytes[i]). */
static json_t *header_json(const char *path, const ml_st_entry *entries, const size_t *nbytes,
                           size_t n) {
  json_t *root = json_pack("{s:{s:s}}", "__metadata__", "format", "pt");
  if (!root) {
    ml_err("%s: out of memory building the header", path);
    return NULL;
  }
  int64_t off = 0;
  for (size_t i = 0; i < n; i++) {
    if (header_add(path, root, &entries[i], nbytes[i], &off) != 0) {
      json_decref(root);
      return NULL;
    }
  }
  return root;
}

/* Serialised header, space-padded to a multiple of 8 so the data is 8-aligned. */
static char *header_bytes(const char *path, const ml_st_entry *entries, const size_t *nbytes,
                          size_t n, size_t *len) {
  json_t *root = header_json(path, entries, nbytes, n);
  if (!root) return NULL;
  char *s = json_dumps(root, JSON_COMPACT);
  json_decref(root);
  if (!s) {
    ml_err("%s: out of memory serialising the header", path);
    return NULL;
  }
  size_t raw = strlen(s), padded = (raw + 7) / 8 * 8;
  char *h = padded <= ST_MAX_HEADER ? realloc(s, padded) : NULL;
  if (!h) {
    free(s);
    ml_err("%s: header of %zu bytes is too large (limit %llu) or out of memory", path, padded,
           ST_MAX_HEADER);
    return NULL;
  }
  memset(h + raw, ' ', padded - raw);
  *len = padded;
  return h;
}

/* One tensor's data as the writer tracks it. */
typedef struct st_slot {
  char *name; /* for messages */
  ml_dtype dtype;
  size_t nbytes;
} st_slot;

struct ml_st_writer {
  char *path;
  char tmp[4096];
  FILE *fp;
  st_slot *slots;
  size_t n, cur, done; /* tensors; the current one; its bytes written so far */
};

static void writer_free(ml_st_writer *w) {
  for (size_t i = 0; w->slots && i < w->n; i++) free(w->slots[i].name);
  free(w->slots);
  free(w->path);
  free(w);
}

/* Skip the tensors whose bytes are all written (zero-sized ones included). */
static void writer_advance(ml_st_writer *w) {
  while (w->cur < w->n && w->done == w->slots[w->cur].nbytes) {
    w->cur++;
    w->done = 0;
  }
}

/* The header's length and bytes, then nothing more: data follows by puts. */
static int write_header(ml_st_writer *w, const char *hdr, size_t hlen) {
  uint8_t len8[8];
  for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
  if (fwrite(len8, 1, 8, w->fp) == 8 && fwrite(hdr, 1, hlen, w->fp) == hlen) return 0;
  return ml_err("%s: cannot write: %s", w->path, strerror(errno));
}

int ml_st_writer_open(const char *path, const ml_st_entry *entries, size_t n, ml_st_writer **out) {
  *out = NULL;
  ml_st_writer *w = ml_calloc(1, sizeof *w, "safetensors writer");
  if (!w) return -1;
  w->n = n;
  w->path = strdup(path);
  w->slots = ml_calloc(n + 1, sizeof *w->slots, "safetensors writer");
  size_t *nbytes = ml_calloc(n + 1, sizeof *nbytes, "safetensors sizes");
  int rc = w->path && w->slots && nbytes ? 0 : ml_err("%s: out of memory", path);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    rc = ml_st_spec_nbytes(path, &entries[i], &nbytes[i]);
    w->slots[i] = (st_slot){strdup(entries[i].name ? entries[i].name : ""), entries[i].dtype,
                            nbytes[i]};
    if (rc == 0 && !w->slots[i].name) rc = ml_err("%s: out of memory", path);
  }
  size_t hlen = 0;
  char *hdr = rc == 0 ? header_bytes(path, entries, nbytes, n, &hlen) : NULL;
  free(nbytes);
  if (rc == 0 && !hdr) rc = -1;
  if (rc == 0) rc = ml_file_open_tmp(path, w->tmp, sizeof w->tmp, &w->fp);
  if (rc == 0 && write_header(w, hdr, hlen) != 0) {
    ml_file_abandon(w->fp, w->tmp);
    rc = -1;
  }
  free(hdr);
  if (rc != 0) {
    writer_free(w);
    return -1;
  }
  writer_advance(w);
  *out = w;
  return 0;
}

/* nbytes more of the current tensor may be written. */
static int writer_room(const ml_st_writer *w, size_t nbytes) {
  if (w->cur == w->n)
    return nbytes == 0 ? 0
                       : ml_err("%s: %zu bytes put after the last tensor's data", w->path, nbytes);
  const st_slot *s = &w->slots[w->cur];
  if (nbytes > s->nbytes - w->done)
    return ml_err("%s: tensor '%s': %zu bytes put where %zu of its %zu remain", w->path, s->name,
                  nbytes, s->nbytes - w->done, s->nbytes);
  return 0;
}

int ml_st_writer_put(ml_st_writer *w, const void *bytes, size_t nbytes) {
  ML_TRY(writer_room(w, nbytes));
  if (nbytes > 0 && fwrite(bytes, 1, nbytes, w->fp) != nbytes)
    return ml_err("%s: cannot write: %s", w->path, strerror(errno));
  w->done += nbytes;
  writer_advance(w);
  return 0;
}

int ml_st_writer_put_f32(ml_st_writer *w, const float *x, size_t n) {
  uint8_t buf[1 << 16];
  if (w->cur < w->n) {
    const st_slot *s = &w->slots[w->cur];
    if (s->dtype != ML_F32 && s->dtype != ML_BF16 && s->dtype != ML_F16)
      return ml_err("%s: tensor '%s': cannot write fp32 data as dtype %s, expected F32, BF16 or "
                    "F16", w->path, s->name, ml_dtype_name(s->dtype));
  }
  size_t es = w->cur < w->n ? ml_dtype_size(w->slots[w->cur].dtype) : sizeof(float);
  if (n > SIZE_MAX / es) return ml_err("%s: %zu elements put: byte size overflows", w->path, n);
  ML_TRY(writer_room(w, n * es)); /* so the chunks below stay in this tensor */
  for (size_t i = 0, chunk = sizeof buf / es; i < n; i += chunk) {
    size_t k = n - i < chunk ? n - i : chunk;
    ML_TRY(ml_convert_from_f32(w->slots[w->cur].dtype, x + i, buf, k));
    ML_TRY(ml_st_writer_put(w, buf, k * es));
  }
  return 0;
}

int ml_st_writer_close(ml_st_writer *w) {
  int rc = 0;
  if (w->cur < w->n)
    rc = ml_err("%s: tensor '%s': %zu of its %zu bytes written when the file was closed", w->path,
                w->slots[w->cur].name, w->done, w->slots[w->cur].nbytes);
  if (rc == 0) rc = ml_file_commit(w->fp, w->tmp, w->path);
  else ml_file_abandon(w->fp, w->tmp);
  writer_free(w);
  return rc;
}

void ml_st_writer_abandon(ml_st_writer *w) {
  if (!w) return;
  ml_file_abandon(w->fp, w->tmp);
  writer_free(w);
}

int ml_st_write(const char *path, const ml_st_entry *entries, size_t n) {
  size_t nb;
  for (size_t i = 0; i < n; i++) ML_TRY(ml_st_entry_nbytes(path, &entries[i], &nb));
  ml_st_writer *w;
  ML_TRY(ml_st_writer_open(path, entries, n, &w));
  for (size_t i = 0; i < n; i++) {
    size_t numel = 1;
    for (int d = 0; d < entries[i].ndim; d++) numel *= (size_t)entries[i].shape[d]; /* checked */
    if (ml_st_writer_put_f32(w, entries[i].data, numel) != 0) {
      ml_st_writer_abandon(w);
      return -1;
    }
  }
  return ml_st_writer_close(w);
}

void ml_st_release(const void *data, size_t n) {
  if (n == 0) return;
  uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)data;
  uintptr_t lo = a / page * page, hi = (a + n + page - 1) / page * page;
  (void)madvise((void *)lo, hi - lo, MADV_DONTNEED); /* advice: a failure only costs memory */
}
