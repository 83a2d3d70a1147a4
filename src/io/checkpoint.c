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

/* {tensor: shard file} for the index; rejects duplicate tensor names. */
static json_t *weight_map(const char *dir, const ml_st_entry *e, size_t n, const size_t *shard,
                          size_t nshards) {
  json_t *wm = json_object();
  char name[64];
  for (size_t i = 0; wm && i < n; i++) {
    shard_name(name, sizeof name, shard[i], nshards);
    int rc = json_object_get(wm, e[i].name)
                 ? ml_err("%s: duplicate tensor name '%s'", dir, e[i].name)
                 : json_object_set_new(wm, e[i].name, json_string(name));
    if (rc != 0) {
      ml_err("%s: cannot add tensor '%s' to the index", dir, e[i].name);
      json_decref(wm);
      return NULL;
    }
  }
  if (!wm) ml_err("%s: out of memory building the index", dir);
  return wm;
}

/* Each run of entries with the same shard goes to its own file. */
static int write_shards(const char *dir, const ml_st_entry *e, size_t n, const size_t *shard,
                        size_t nshards) {
  char name[64];
  for (size_t start = 0, end; start < n; start = end) {
    for (end = start; end < n && shard[end] == shard[start]; end++) {}
    shard_name(name, sizeof name, shard[start], nshards);
    char *path = join(dir, name);
    int rc = path ? ml_st_write(path, e + start, end - start) : -1;
    free(path);
    ML_TRY(rc);
  }
  return 0;
}

static int write_sharded(const char *dir, const ml_st_entry *e, size_t n, const size_t *sizes,
                         size_t max, size_t total) {
  size_t *shard = ml_calloc(n, sizeof *shard, "shard assignment");
  if (!shard) return -1;
  size_t nshards = assign_shards(sizes, n, max, shard);
  json_t *wm = weight_map(dir, e, n, shard, nshards);
  json_t *index = wm ? json_pack("{s:{s:I}, s:o}", "metadata", "total_size", (json_int_t)total,
                                 "weight_map", wm)
                     : NULL;
  char *ipath = index ? join(dir, CKPT_INDEX) : NULL;
  int rc = -1;
  if (wm && !index) ml_err("%s: out of memory building the index", dir);
  /* the index goes last: it commits the shards */
  if (ipath && write_shards(dir, e, n, shard, nshards) == 0) rc = ml_json_write(ipath, index);
  free(ipath);
  json_decref(index);
  free(shard);
  return rc;
}

static int write_single(const char *dir, const ml_st_entry *e, size_t n) {
  char *path = join(dir, CKPT_SINGLE), *ipath = join(dir, CKPT_INDEX);
  int rc = path && ipath ? ml_st_write(path, e, n) : -1;
  /* an older sharded index would take precedence over the new file */
  if (rc == 0 && unlink(ipath) != 0 && errno != ENOENT)
    rc = ml_err("%s: cannot remove the stale %s: %s", dir, ipath, strerror(errno));
  free(path);
  free(ipath);
  return rc;
}

int ml_ckpt_write(const char *dir, const ml_st_entry *entries, size_t n, size_t max_shard_bytes) {
  size_t *sizes = ml_calloc(n, sizeof *sizes, "tensor sizes");
  size_t total = 0;
  int rc = sizes ? 0 : -1;
  for (size_t i = 0; rc == 0 && i < n; i++) {
    rc = ml_st_entry_nbytes(dir, &entries[i], &sizes[i]);
    if (rc == 0 && sizes[i] > SIZE_MAX - total) rc = ml_err("%s: total size overflows", dir);
    total += rc == 0 ? sizes[i] : 0;
  }
  if (rc == 0) rc = ml_ckpt_make_dirs(dir);
  if (rc == 0 && (max_shard_bytes == 0 || total <= max_shard_bytes))
    rc = write_single(dir, entries, n);
  else if (rc == 0)
    rc = write_sharded(dir, entries, n, sizes, max_shard_bytes, total);
  free(sizes);
  return rc;
}
