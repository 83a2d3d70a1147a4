#define _POSIX_C_SOURCE 200809L

#include "io/checkpoint.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/status.h"
#include "io/json.h"

#define CKPT_SINGLE "model.safetensors"
#define CKPT_INDEX "model.safetensors.index.json"

/* "dir/name" in a new string (NULL with a message when out of memory). */
static char *join(const char *dir, const char *name) {
  size_t n = strlen(dir) + strlen(name) + 2;
  char *p = ml_malloc(n, "checkpoint path");
  if (p) snprintf(p, n, "%s/%s", dir, name);
  return p;
}

static int exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0;
}

/* ---------------------------------------------------------------- reading */

/* The index's weight_map, checked to be {tensor: shard file name}; shard
 * names must be plain file names inside the checkpoint directory. */
static const json_t *index_weight_map(const ml_json *idx) {
  char found[96];
  const json_t *meta = json_object_get(idx->root, "metadata");
  const json_t *wm = json_object_get(idx->root, "weight_map");
  const char *key;
  const json_t *v;
  if (meta && !json_is_object(meta)) {
    ml_json_brief(meta, found, sizeof found);
    ml_err("%s: field 'metadata': expected an object, found %s", idx->path, found);
    return NULL;
  }
  if (!json_is_object(wm)) {
    ml_json_brief(wm, found, sizeof found);
    ml_err("%s: field 'weight_map': expected an object {tensor: file}, found %s", idx->path, found);
    return NULL;
  }
  json_object_foreach((json_t *)wm, key, v) {
    if (!json_is_string(v) || !json_string_value(v)[0] || strchr(json_string_value(v), '/')) {
      ml_json_brief(v, found, sizeof found);
      ml_err("%s: field 'weight_map.%s': expected a file name in the checkpoint directory, found %s",
             idx->path, key, found);
      return NULL;
    }
  }
  return wm;
}

/* Position of `name` in names[0..n), or n. */
static size_t name_index(const char *const *names, size_t n, const char *name) {
  size_t k = 0;
  while (k < n && strcmp(names[k], name) != 0) k++;
  return k;
}

/* Open each distinct file of the weight map once; names[k] is the index's
 * name of c->files[k]. */
static int open_shards(ml_ckpt *c, const char *ipath, const json_t *wm, const char **names) {
  const char *key;
  const json_t *v;
  json_object_foreach((json_t *)wm, key, v) {
    const char *file = json_string_value(v);
    if (name_index(names, c->nfiles, file) < c->nfiles) continue;
    char *path = join(c->dir, file);
    int rc = !path ? -1
             : !exists(path)
                 ? ml_err("%s: weight_map names %s for tensor '%s', but %s is missing", ipath, file,
                          key, path)
                 : ml_st_open(path, &c->files[c->nfiles]);
    free(path);
    ML_TRY(rc);
    names[c->nfiles++] = file;
  }
  return 0;
}

/* Every index entry's tensor is in its file, and every shard tensor is
 * listed in the index for that file (so no tensor is in two files). */
static int cross_check(const ml_ckpt *c, const char *ipath, const json_t *wm, const char **names) {
  const char *key;
  const json_t *v;
  json_object_foreach((json_t *)wm, key, v) {
    const ml_st_file *f = &c->files[name_index(names, c->nfiles, json_string_value(v))];
    if (!ml_st_find(f, key))
      return ml_err("%s: weight_map puts tensor '%s' in %s, which has no such tensor", ipath, key,
                    f->path);
  }
  for (size_t k = 0; k < c->nfiles; k++) {
    for (size_t i = 0; i < c->files[k].n; i++) {
      const char *name = c->files[k].tensors[i].name;
      const json_t *file = json_object_get(wm, name);
      if (!file)
        return ml_err("%s: tensor '%s' of %s is missing from weight_map", ipath, name,
                      c->files[k].path);
      if (strcmp(json_string_value(file), names[k]) != 0)
        return ml_err("%s: tensor '%s' is in two files: %s and %s", ipath, name, names[k],
                      json_string_value(file));
    }
  }
  return 0;
}

static int open_index(ml_ckpt *c, const char *ipath) {
  ml_json idx;
  ML_TRY(ml_json_load(ipath, &idx));
  const json_t *wm = index_weight_map(&idx);
  size_t cap = wm ? json_object_size(wm) : 0;
  const char **names = wm ? ml_calloc(cap, sizeof *names, "shard names") : NULL;
  c->files = names ? ml_calloc(cap, sizeof *c->files, "shard files") : NULL;
  int rc = c->files && open_shards(c, ipath, wm, names) == 0 ? cross_check(c, ipath, wm, names) : -1;
  free(names);
  ml_json_free(&idx);
  return rc;
}

static int open_single(ml_ckpt *c, const char *path) {
  c->files = ml_calloc(1, sizeof *c->files, "checkpoint file");
  if (!c->files) return -1;
  ML_TRY(ml_st_open(path, &c->files[0]));
  c->nfiles = 1;
  return 0;
}

int ml_ckpt_open(const char *dir, ml_ckpt *out) {
  memset(out, 0, sizeof *out);
  if (!(out->dir = strdup(dir))) return ml_err("%s: out of memory", dir);
  char *ipath = join(dir, CKPT_INDEX), *spath = join(dir, CKPT_SINGLE);
  int rc = -1;
  if (ipath && spath) {
    if (exists(ipath)) rc = open_index(out, ipath);
    else if (exists(spath)) rc = open_single(out, spath);
    else rc = ml_err("%s: no " CKPT_SINGLE " or " CKPT_INDEX, dir);
  }
  free(ipath);
  free(spath);
  if (rc != 0) ml_ckpt_close(out);
  return rc;
}

void ml_ckpt_close(ml_ckpt *c) {
  for (size_t k = 0; k < c->nfiles; k++) ml_st_close(&c->files[k]);
  free(c->files);
  free(c->dir);
  memset(c, 0, sizeof *c);
}

const ml_st_tensor *ml_ckpt_find(const ml_ckpt *c, const char *name) {
  for (size_t k = 0; k < c->nfiles; k++) {
    const ml_st_tensor *t = ml_st_find(&c->files[k], name);
    if (t) return t;
  }
  return NULL;
}

/* ---------------------------------------------------------------- writing */

/* mkdir -p */
int ml_ckpt_make_dirs(const char *dir) {
  char *p = strdup(dir);
  if (!p) return ml_err("%s: out of memory", dir);
  for (char *s = p + (p[0] == '/');; s++) {
    if (*s != '/' && *s != '\0') continue;
    char c = *s;
    *s = '\0';
    if (p[0] && mkdir(p, 0777) != 0 && errno != EEXIST) {
      ml_err("%s: cannot create directory %s: %s", dir, p, strerror(errno));
      free(p);
      return -1;
    }
    *s = c;
    if (!c) break;
  }
  free(p);
  return 0;
}

/* Shard of each entry: greedy fill in entry order, a new shard when the
 * next tensor would overflow a non-empty one (so a tensor larger than the
 * limit sits alone). Returns the number of shards. */
static size_t assign_shards(const size_t *sizes, size_t n, size_t max, size_t *shard) {
  size_t k = 0, fill = 0;
  for (size_t i = 0; i < n; i++) {
    if (fill > 0 && fill + sizes[i] > max) {
      k++;
      fill = 0;
    }
    shard[i] = k;
    fill += sizes[i];
  }
  return n ? k + 1 : 0;
}

static void shard_name(char *buf, size_t size, size_t k, size_t nshards) {
  snprintf(buf, size, "model-%05zu-of-%05zu.safetensors", k + 1, nshards);
}

struct ml_ckpt_writer {
  char *dir;
  ml_st_entry *e; /* the entries' header fields (names copied) */
  size_t n;
  size_t *sizes, *shard; /* per entry: bytes, shard index */
  size_t nshards;        /* 0: one model.safetensors */
  size_t total;
  size_t cur, done;      /* the current tensor and its bytes put so far */
  size_t open_shard;     /* the shard `file` writes; SIZE_MAX: none open */
  ml_st_writer *file;
};

static void ckpt_writer_free(ml_ckpt_writer *w) {
  for (size_t i = 0; w->e && i < w->n; i++) free((char *)w->e[i].name);
  free(w->e);
  free(w->sizes);
  free(w->shard);
  free(w->dir);
  free(w);
}

/* The file of shard k (its entries are a run of w->e) opened for writing. */
static int open_shard(ml_ckpt_writer *w, size_t k) {
  char name[64];
  size_t start = 0, end;
  if (w->nshards == 0) snprintf(name, sizeof name, CKPT_SINGLE);
  else shard_name(name, sizeof name, k, w->nshards);
  while (start < w->n && w->shard[start] != k) start++;
  for (end = start; end < w->n && w->shard[end] == k; end++) {}
  char *path = join(w->dir, name);
  int rc = path ? ml_st_writer_open(path, w->e + start, end - start, &w->file) : -1;
  free(path);
  if (rc == 0) w->open_shard = k;
  return rc;
}

/* Move past complete tensors, closing a shard's file when the next tensor
 * belongs to another and opening that one's. */
static int ckpt_advance(ml_ckpt_writer *w) {
  for (;;) {
    if (w->cur < w->n && w->open_shard != w->shard[w->cur]) {
      if (w->file) {
        ml_st_writer *f = w->file;
        w->file = NULL;
        ML_TRY(ml_st_writer_close(f));
      }
      ML_TRY(open_shard(w, w->shard[w->cur]));
    }
    if (w->cur == w->n || w->done < w->sizes[w->cur]) return 0;
    w->cur++;
    w->done = 0;
  }
}

/* No two entries share a name (the index maps each to one file). */
static int check_unique(const char *dir, const ml_st_entry *e, size_t n) {
  json_t *seen = json_object();
  int rc = seen ? 0 : ml_err("%s: out of memory", dir);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    if (json_object_get(seen, e[i].name))
      rc = ml_err("%s: duplicate tensor name '%s'", dir, e[i].name);
    else if (json_object_set_new(seen, e[i].name, json_true()) != 0)
      rc = ml_err("%s: out of memory", dir);
  }
  json_decref(seen);
  return rc;
}

int ml_ckpt_writer_open(const char *dir, const ml_st_entry *entries, size_t n,
                        size_t max_shard_bytes, ml_ckpt_writer **out) {
  *out = NULL;
  ml_ckpt_writer *w = ml_calloc(1, sizeof *w, "checkpoint writer");
  if (!w) return -1;
  w->n = n;
  w->open_shard = SIZE_MAX;
  w->dir = strdup(dir);
  w->e = ml_calloc(n + 1, sizeof *w->e, "checkpoint writer entries");
  w->sizes = ml_calloc(n + 1, sizeof *w->sizes, "tensor sizes");
  w->shard = ml_calloc(n + 1, sizeof *w->shard, "shard assignment");
  int rc = w->dir && w->e && w->sizes && w->shard ? 0 : ml_err("%s: out of memory", dir);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    rc = ml_st_spec_nbytes(dir, &entries[i], &w->sizes[i]);
    if (rc == 0 && w->sizes[i] > SIZE_MAX - w->total) rc = ml_err("%s: total size overflows", dir);
    w->total += rc == 0 ? w->sizes[i] : 0;
    w->e[i] = entries[i];
    w->e[i].data = NULL;
    w->e[i].name = entries[i].name ? strdup(entries[i].name) : NULL;
    if (rc == 0 && !w->e[i].name) rc = ml_err("%s: out of memory", dir);
  }
  if (rc == 0) rc = check_unique(dir, entries, n);
  if (rc == 0 && max_shard_bytes > 0 && w->total > max_shard_bytes)
    w->nshards = assign_shards(w->sizes, n, max_shard_bytes, w->shard);
  if (rc == 0) rc = ml_ckpt_make_dirs(dir);
  if (rc == 0) rc = ckpt_advance(w);
  if (rc != 0) {
    ml_ckpt_writer_abandon(w);
    return -1;
  }
  *out = w;
  return 0;
}

/* nbytes more of the current tensor may be put. */
static int ckpt_room(const ml_ckpt_writer *w, size_t nbytes) {
  if (w->cur == w->n)
    return nbytes == 0 ? 0 : ml_err("%s: %zu bytes put after the last tensor", w->dir, nbytes);
  if (nbytes > w->sizes[w->cur] - w->done)
    return ml_err("%s: tensor '%s': %zu bytes put where %zu of its %zu remain", w->dir,
                  w->e[w->cur].name, nbytes, w->sizes[w->cur] - w->done, w->sizes[w->cur]);
  return 0;
}

int ml_ckpt_writer_put(ml_ckpt_writer *w, const void *bytes, size_t nbytes) {
  ML_TRY(ckpt_room(w, nbytes));
  if (nbytes == 0) return 0;
  ML_TRY(ml_st_writer_put(w->file, bytes, nbytes));
  w->done += nbytes;
  return ckpt_advance(w);
}

int ml_ckpt_writer_put_f32(ml_ckpt_writer *w, const float *x, size_t n) {
  size_t es = w->cur < w->n ? ml_dtype_size(w->e[w->cur].dtype) : sizeof(float);
  if (n > SIZE_MAX / es) return ml_err("%s: %zu elements put: byte size overflows", w->dir, n);
  ML_TRY(ckpt_room(w, n * es));
  if (n == 0) return 0;
  ML_TRY(ml_st_writer_put_f32(w->file, x, n));
  w->done += n * es;
  return ckpt_advance(w);
}

/* {tensor: shard file} for the index. */
static json_t *weight_map(const ml_ckpt_writer *w) {
  json_t *wm = json_object();
  char name[64];
  for (size_t i = 0; wm && i < w->n; i++) {
    shard_name(name, sizeof name, w->shard[i], w->nshards);
    if (json_object_set_new(wm, w->e[i].name, json_string(name)) != 0) {
      json_decref(wm);
      wm = NULL;
    }
  }
  if (!wm) ml_err("%s: out of memory building the index", w->dir);
  return wm;
}

/* Sharded: the index, which commits the shards. One file: remove an older
 * sharded index, which would take precedence over the new file. */
static int finish(const ml_ckpt_writer *w) {
  char *ipath = join(w->dir, CKPT_INDEX);
  int rc = ipath ? 0 : -1;
  if (rc == 0 && w->nshards == 0) {
    if (unlink(ipath) != 0 && errno != ENOENT)
      rc = ml_err("%s: cannot remove the stale %s: %s", w->dir, ipath, strerror(errno));
  } else if (rc == 0) {
    json_t *wm = weight_map(w);
    json_t *index = wm ? json_pack("{s:{s:I}, s:o}", "metadata", "total_size",
                                   (json_int_t)w->total, "weight_map", wm)
                       : NULL;
    rc = index ? ml_json_write(ipath, index) : wm ? ml_err("%s: out of memory", w->dir) : -1;
    json_decref(index);
  }
  free(ipath);
  return rc;
}

int ml_ckpt_writer_close(ml_ckpt_writer *w) {
  int rc = 0;
  if (w->cur < w->n)
    rc = ml_err("%s: tensor '%s': %zu of its %zu bytes put when the checkpoint was closed", w->dir,
                w->e[w->cur].name, w->done, w->sizes[w->cur]);
  if (rc == 0 && w->n == 0) rc = open_shard(w, 0); /* an empty model.safetensors */
  ml_st_writer *f = w->file;
  w->file = NULL;
  if (rc == 0 && f) rc = ml_st_writer_close(f);
  else ml_st_writer_abandon(f);
  if (rc == 0) rc = finish(w);
  ckpt_writer_free(w);
  return rc;
}

void ml_ckpt_writer_abandon(ml_ckpt_writer *w) {
  if (!w) return;
  ml_st_writer_abandon(w->file);
  ckpt_writer_free(w);
}

int ml_ckpt_write(const char *dir, const ml_st_entry *entries, size_t n, size_t max_shard_bytes) {
  size_t nb;
  for (size_t i = 0; i < n; i++) ML_TRY(ml_st_entry_nbytes(dir, &entries[i], &nb));
  ml_ckpt_writer *w;
  ML_TRY(ml_ckpt_writer_open(dir, entries, n, max_shard_bytes, &w));
  for (size_t i = 0; i < n; i++) {
    size_t numel = 1;
    for (int d = 0; d < entries[i].ndim; d++) numel *= (size_t)entries[i].shape[d]; /* checked */
    if (ml_ckpt_writer_put_f32(w, entries[i].data, numel) != 0) {
      ml_ckpt_writer_abandon(w);
      return -1;
    }
  }
  return ml_ckpt_writer_close(w);
}
