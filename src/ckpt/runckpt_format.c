#define _POSIX_C_SOURCE 200809L

#include "ckpt/runckpt_format.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/status.h"
#include "io/checkpoint.h"
#include "ckpt/hf_source.h"

typedef long long ll;

static const char *const FORMAT = "meshlm-run-checkpoint";
enum { VERSION = 1 };

const char *const ml_rc_state_names[ML_RC_STATES] = {"param", "exp_avg", "exp_avg_sq"};

int ml_rc_state_key(const char *name, int state, char *out, size_t cap) {
  int n = state == ML_RC_PARAM
              ? snprintf(out, cap, "%s", name)
              : snprintf(out, cap, "optim.state.%s.%s", name, ml_rc_state_names[state]);
  if (n < 0 || (size_t)n >= cap)
    return ml_err("tensor key of '%s' longer than %zu bytes", name, cap);
  return 0;
}

void ml_rc_rank_file(int rank, char *out, size_t cap) {
  snprintf(out, cap, "rank-%05d.safetensors", rank);
}

static int join(char *out, const char *dir, const char *name) {
  int n = snprintf(out, ML_RC_PATH, "%s/%s", dir, name);
  if (n < 0 || n >= ML_RC_PATH)
    return ml_err("%s/%s: path longer than %d bytes", dir, name, ML_RC_PATH);
  return 0;
}

int ml_rc_fsync_dir(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ml_err("%s: cannot open the directory to fsync it: %s", dir, strerror(errno));
  int rc = fsync(fd);
  int err = errno;
  close(fd);
  return rc == 0 ? 0 : ml_err("%s: cannot fsync the directory: %s", dir, strerror(err));
}

/* A step directory name as latest.json may hold it: one path component. */
static bool plain_name(const char *s) {
  return s[0] && strchr(s, '/') == NULL && strcmp(s, ".") != 0 && strcmp(s, "..") != 0 &&
         strlen(s) < ML_RC_NAME;
}

/* The committed step directory's name (name[ML_RC_NAME]), from
 * DIR/latest.json: 0, or 1 when there is none. Errors: malformed file. */
static int read_latest(const char *dir, char *name) {
  char path[ML_RC_PATH];
  ML_TRY(join(path, dir, "latest.json"));
  struct stat sb;
  if (stat(path, &sb) != 0 && errno == ENOENT) return 1;
  ml_json j;
  ML_TRY(ml_json_load(path, &j));
  const char *fmt = NULL, *s = NULL;
  int64_t version = 0;
  int rc = ml_json_str(&j, NULL, "format", &fmt) || ml_json_int(&j, NULL, "version", &version) ||
                   ml_json_str(&j, NULL, "step_dir", &s)
               ? -1
               : 0;
  if (rc == 0 && (strcmp(fmt, FORMAT) != 0 || version != VERSION))
    rc = ml_err("%s: format '%s' version %lld; expected '%s' version %d", path, fmt, (ll)version,
                FORMAT, VERSION);
  if (rc == 0 && !plain_name(s))
    rc = ml_err("%s: field 'step_dir': expected a directory name inside %s, found \"%s\"", path,
                dir, s);
  if (rc == 0) snprintf(name, ML_RC_NAME, "%s", s);
  ml_json_free(&j);
  return rc;
}

/* Remove directory `path` and what it holds (a step directory: files and
 * the source/ directory of files; symbolic links are removed, never
 * followed). A missing directory is fine. */
static int remove_dir(const char *path) {
  DIR *d = opendir(path);
  if (!d) return errno == ENOENT ? 0 : ml_err("%s: cannot open: %s", path, strerror(errno));
  struct dirent *ent;
  char file[ML_RC_PATH];
  struct stat sb;
  int rc = 0;
  while (rc == 0 && (ent = readdir(d)) != NULL) {
    if (strcmp(ent->d_name, ".") == 0 || strcmp(ent->d_name, "..") == 0) continue;
    rc = join(file, path, ent->d_name);
    if (rc == 0 && lstat(file, &sb) == 0 && S_ISDIR(sb.st_mode)) rc = remove_dir(file);
    else if (rc == 0 && unlink(file) != 0)
      rc = ml_err("%s: cannot remove: %s", file, strerror(errno));
  }
  closedir(d);
  if (rc == 0 && rmdir(path) != 0) rc = ml_err("%s: cannot remove: %s", path, strerror(errno));
  return rc;
}

int ml_rc_begin(const char *dir, int64_t step, char *name) {
  ML_TRY(ml_ckpt_make_dirs(dir));
  char committed[ML_RC_NAME] = "", path[ML_RC_PATH];
  int rc = read_latest(dir, committed);
  if (rc < 0) return -1;
  snprintf(name, ML_RC_NAME, "step-%08lld", (ll)step);
  if (strcmp(name, committed) == 0) snprintf(name, ML_RC_NAME, "step-%08lld.b", (ll)step);
  ML_TRY(join(path, dir, name));
  ML_TRY(remove_dir(path)); /* left by a save that never committed */
  if (mkdir(path, 0777) != 0) return ml_err("%s: cannot create: %s", path, strerror(errno));
  return ml_rc_fsync_dir(dir);
}

int ml_rc_abandon(const char *dir, const char *name) {
  char committed[ML_RC_NAME] = "", path[ML_RC_PATH];
  if (!plain_name(name) || strncmp(name, "step-", 5) != 0) return 0; /* ml_rc_begin never chose it */
  ML_TRY(read_latest(dir, committed) < 0 ? -1 : 0);
  if (strcmp(name, committed) == 0) return 0; /* committed after all: keep it */
  ML_TRY(join(path, dir, name));
  ML_TRY(remove_dir(path));
  return ml_rc_fsync_dir(dir);
}

/* ------------------------------------------------------------- metadata */

/* Building JSON: every constructor may fail (NULL), so calls funnel
 * through these, which remember a failure in *ok. put returns v once obj
 * owns it, NULL when it could not be stored (jansson then freed it; later
 * calls on NULL fail harmlessly). */
static json_t *put(json_t *obj, const char *key, json_t *v, int *ok) {
  if (json_object_set_new(obj, key, v) == 0) return v;
  *ok = 0;
  return NULL;
}

static json_t *dims(const int64_t *v, int ndim, int *ok) {
  json_t *a = json_array();
  for (int d = 0; d < ndim; d++)
    if (json_array_append_new(a, json_integer(v[d])) != 0) *ok = 0;
  if (!a) *ok = 0;
  return a;
}

static json_t *tensor_json(const ml_rc_param *p, int i, int n, int world, const ml_rc_block *blocks,
                           int *ok) {
  json_t *t = json_object();
  put(t, "shape", dims(p->shape, p->ndim, ok), ok);
  json_t *keys = put(t, "keys", json_object(), ok), *pieces = put(t, "pieces", json_array(), ok);
  char key[ML_RC_KEY], file[ML_RC_NAME];
  for (int s = 0; s < ML_RC_STATES; s++) {
    if (ml_rc_state_key(p->name, s, key, sizeof key)) *ok = 0;
    else put(keys, ml_rc_state_names[s], json_string(key), ok);
  }
  for (int r = 0; r < world; r++) {
    const ml_rc_block *b = &blocks[(int64_t)r * n + i];
    if (b->shape[0] == 0) continue;
    json_t *pc = json_object();
    ml_rc_rank_file(r, file, sizeof file);
    put(pc, "file", json_string(file), ok);
    put(pc, "offset", dims(b->off, p->ndim, ok), ok);
    put(pc, "shape", dims(b->shape, p->ndim, ok), ok);
    if (json_array_append_new(pieces, pc) != 0) *ok = 0;
  }
  if (!t) *ok = 0;
  return t;
}

int ml_rc_write_metadata(const char *step_dir, const ml_rc_info *info, const ml_rc_param *params,
                         int n, const ml_rc_block *blocks, const json_t *source) {
  int ok = 1, world = info->world_size;
  json_t *root = json_object();
  put(root, "format", json_string(FORMAT), &ok);
  put(root, "version", json_integer(VERSION), &ok);
  put(root, "dtype", json_string("F32"), &ok);
  put(root, "optimizer_step", json_integer(info->optimizer_step), &ok);
  json_t *st = put(root, "run_state", json_object(), &ok);
  char seed[32];
  snprintf(seed, sizeof seed, "%" PRIu64, info->st.seed);
  put(st, "step", json_integer(info->st.step), &ok);
  put(st, "consumed", json_integer(info->st.consumed), &ok);
  put(st, "seed", json_string(seed), &ok);
  put(st, "nseq", json_integer(info->st.nseq), &ok);
  json_t *mesh = put(root, "mesh", json_object(), &ok);
  put(mesh, "world_size", json_integer(world), &ok);
  put(mesh, "dp_replicate", json_integer(info->dp_replicate), &ok);
  put(mesh, "dp_shard", json_integer(info->dp_shard), &ok);
  put(mesh, "cp", json_integer(info->cp), &ok);
  put(mesh, "tp", json_integer(info->tp), &ok);
  put(root, "config", json_string("config.json"), &ok);
  json_t *files = put(root, "files", json_object(), &ok);
  char file[ML_RC_NAME];
  for (int r = 0; r < world; r++)
    for (int i = 0; i < n; i++)
      if (blocks[(int64_t)r * n + i].shape[0] > 0) {
        ml_rc_rank_file(r, file, sizeof file);
        put(files, file, json_integer(r), &ok);
        break;
      }
  put(root, "freeze", json_string(info->freeze ? info->freeze : ""), &ok);
  json_t *frozen = put(root, "frozen", json_array(), &ok);
  for (int i = 0; ok && i < n; i++)
    if (params[i].frozen) ok = ok && json_array_append_new(frozen, json_string(params[i].name)) == 0;
  json_t *tensors = put(root, "tensors", json_object(), &ok);
  for (int i = 0; ok && i < n; i++)
    put(tensors, params[i].name, tensor_json(&params[i], i, n, world, blocks, &ok), &ok);
  if (source) put(root, "source", json_incref((json_t *)source), &ok);
  char path[ML_RC_PATH];
  int rc = ok && root ? join(path, step_dir, "metadata.json")
                      : ml_err("%s: out of memory building metadata.json", step_dir);
  if (rc == 0) rc = ml_json_write(path, root);
  json_decref(root);
  return rc == 0 ? ml_rc_fsync_dir(step_dir) : -1;
}

/* A step directory's name as ml_rc_begin chooses it: "step-" and 8 or more
 * digits, then ".b" or nothing. */
static bool step_name(const char *s) {
  size_t digits = strncmp(s, "step-", 5) == 0 ? strspn(s + 5, "0123456789") : 0;
  return digits >= 8 && (s[5 + digits] == '\0' || strcmp(s + 5 + digits, ".b") == 0);
}

/* Remove every step directory under dir but `keep`; their names go to
 * removed[cap] (", " between them, cut at cap) when removed is not NULL. */
static int prune(const char *dir, const char *keep, char *removed, size_t cap) {
  DIR *d = opendir(dir);
  if (!d) return ml_err("%s: cannot open: %s", dir, strerror(errno));
  struct dirent *ent;
  char path[ML_RC_PATH];
  struct stat sb;
  int rc = 0;
  while (rc == 0 && (ent = readdir(d)) != NULL) {
    if (!step_name(ent->d_name) || strcmp(ent->d_name, keep) == 0) continue;
    rc = join(path, dir, ent->d_name);
    if (rc != 0 || lstat(path, &sb) != 0 || !S_ISDIR(sb.st_mode)) continue;
    rc = remove_dir(path);
    size_t at = removed ? strlen(removed) : 0;
    if (rc == 0 && removed)
      snprintf(removed + at, cap - at, "%s%s", at ? ", " : "", ent->d_name);
  }
  closedir(d);
  return rc;
}

int ml_rc_clean(const char *dir) {
  char committed[ML_RC_NAME] = "", removed[1024] = "";
  ML_TRY(read_latest(dir, committed) < 0 ? -1 : 0);
  int rc = prune(dir, committed, removed, sizeof removed);
  if (removed[0])
    ml_warn("%s: removed uncommitted %s (left by a save that did not finish; committed: %s)", dir,
            removed, committed[0] ? committed : "none");
  ML_TRY(rc);
  return removed[0] ? ml_rc_fsync_dir(dir) : 0;
}

int ml_rc_commit(const char *dir, const char *name, int64_t step) {
  int ok = 1;
  json_t *root = json_object();
  put(root, "format", json_string(FORMAT), &ok);
  put(root, "version", json_integer(VERSION), &ok);
  put(root, "step_dir", json_string(name), &ok);
  put(root, "step", json_integer(step), &ok);
  char path[ML_RC_PATH];
  int rc = ok && root ? join(path, dir, "latest.json") : ml_err("%s: out of memory", dir);
  if (rc == 0) rc = ml_json_write(path, root); /* latest.json.tmp, fsync, rename */
  json_decref(root);
  ML_TRY(rc);
  ML_TRY(ml_rc_fsync_dir(dir));
  return prune(dir, name, NULL, 0);
}

/* -------------------------------------------------------------- reading */

static int get_obj(const ml_json *j, const json_t *obj, const char *key, json_t **out) {
  *out = json_object_get(obj ? obj : j->root, key);
  if (json_is_object(*out)) return 0;
  char found[64];
  ml_json_brief(*out, found, sizeof found);
  return ml_err("%s: field '%s': expected an object, found %s", j->path, key, found);
}

/* An integer field read from metadata.json in [lo, hi]. */
static int check_range(const ml_rc_ckpt *c, const char *field, int64_t v, int64_t lo, int64_t hi) {
  if (v >= lo && v <= hi) return 0;
  return ml_err("%s: field '%s': expected an integer from %lld to %lld, found %lld", c->meta, field,
                (ll)lo, (ll)hi, (ll)v);
}

static int parse_info(ml_rc_ckpt *c) {
  const ml_json *j = &c->json;
  ml_rc_info *in = &c->info;
  const char *fmt, *seed;
  int64_t version, v[5];
  json_t *st, *mesh;
  ML_TRY(ml_json_str(j, NULL, "format", &fmt));
  ML_TRY(ml_json_int(j, NULL, "version", &version));
  if (strcmp(fmt, FORMAT) != 0 || version != VERSION)
    return ml_err("%s: format '%s' version %lld; expected '%s' version %d", c->meta, fmt,
                  (ll)version, FORMAT, VERSION);
  ML_TRY(ml_json_int(j, NULL, "optimizer_step", &in->optimizer_step));
  ML_TRY(get_obj(j, NULL, "run_state", &st));
  ML_TRY(ml_json_int(j, st, "step", &in->st.step));
  ML_TRY(ml_json_int(j, st, "consumed", &in->st.consumed));
  ML_TRY(ml_json_int(j, st, "nseq", &in->st.nseq));
  ML_TRY(check_range(c, "optimizer_step", in->optimizer_step, 0, INT64_MAX));
  ML_TRY(check_range(c, "run_state.step", in->st.step, 0, INT64_MAX));
  ML_TRY(check_range(c, "run_state.consumed", in->st.consumed, 0, INT64_MAX));
  ML_TRY(check_range(c, "run_state.nseq", in->st.nseq, 0, INT64_MAX));
  ML_TRY(ml_json_str(j, st, "seed", &seed));
  char *end;
  errno = 0;
  in->st.seed = strtoull(seed, &end, 10);
  if (!seed[0] || *end || errno || seed[0] == '-')
    return ml_err("%s: field 'seed': expected a decimal unsigned 64-bit integer, found \"%s\"",
                  c->meta, seed);
  ML_TRY(get_obj(j, NULL, "mesh", &mesh));
  const char *mk[5] = {"world_size", "dp_replicate", "dp_shard", "cp", "tp"};
  for (int k = 0; k < 5; k++) {
    char field[32];
    snprintf(field, sizeof field, "mesh.%s", mk[k]);
    ML_TRY(ml_json_int(j, mesh, mk[k], &v[k]));
    ML_TRY(check_range(c, field, v[k], 1, INT32_MAX));
  }
  in->world_size = (int)v[0], in->dp_replicate = (int)v[1], in->dp_shard = (int)v[2];
  in->cp = (int)v[3], in->tp = (int)v[4];
  in->freeze = "";
  if (json_object_get(j->root, "freeze")) ML_TRY(ml_json_str(j, NULL, "freeze", &in->freeze));
  return 0;
}

/* c->files: a private {file name: index} map of metadata's "files". */
static int index_files(ml_rc_ckpt *c) {
  json_t *files;
  ML_TRY(get_obj(&c->json, NULL, "files", &files));
  ML_TRY(get_obj(&c->json, NULL, "tensors", &c->tensors));
  c->nfiles = (int)json_object_size(files);
  c->files = json_object();
  c->open = ml_calloc((size_t)c->nfiles + 1, sizeof *c->open, "run checkpoint files");
  c->file_names = ml_calloc((size_t)c->nfiles + 1, sizeof *c->file_names, "run checkpoint files");
  if (!c->files || !c->open || !c->file_names) return ml_err("%s: out of memory", c->meta);
  const char *name;
  json_t *v;
  int k = 0;
  json_object_foreach(files, name, v) {
    if (!plain_name(name))
      return ml_err("%s: field 'files': \"%s\" is not a file name", c->meta, name);
    c->file_names[k] = name;
    if (json_object_set_new(c->files, name, json_integer(k++)) != 0)
      return ml_err("%s: out of memory", c->meta);
  }
  return 0;
}

int ml_rc_open(const char *dir, ml_rc_ckpt *out) {
  memset(out, 0, sizeof *out);
  char name[ML_RC_NAME];
  int rc = read_latest(dir, name);
  if (rc == 1)
    return ml_err("%s: no committed checkpoint (%s/latest.json does not exist)", dir, dir);
  ML_TRY(rc);
  ML_TRY(join(out->dir, dir, name));
  ML_TRY(join(out->meta, out->dir, "metadata.json"));
  ML_TRY(join(out->config, out->dir, "config.json"));
  ML_TRY(join(out->source_dir, out->dir, ML_RC_SOURCE));
  ML_TRY(ml_json_load(out->meta, &out->json));
  out->source = json_object_get(out->json.root, "source");
  if (parse_info(out) || index_files(out) ||
      (out->source && ml_hf_source_check(out->source, out->meta))) {
    ml_rc_close(out);
    return -1;
  }
  return 0;
}

void ml_rc_close(ml_rc_ckpt *c) {
  for (int k = 0; c->open && k < c->nfiles; k++) ml_st_close(&c->open[k]);
  free(c->open);
  free(c->file_names);
  json_decref(c->files);
  ml_json_free(&c->json);
  memset(c, 0, sizeof *c);
}

/* A 1- or 2-element array of non-negative integers as [2] (1-D: [n, fill]). */
static int parse_dims(const ml_rc_ckpt *c, const char *tensor, const char *field, const json_t *a,
                      int ndim, int64_t fill, int64_t out[2]) {
  out[1] = fill;
  bool good = json_is_array(a) && (ndim == 0 || (int)json_array_size(a) == ndim) &&
              json_array_size(a) >= 1 && json_array_size(a) <= 2;
  for (size_t d = 0; good && d < json_array_size(a); d++) {
    json_t *v = json_array_get(a, d);
    good = json_is_integer(v) && json_integer_value(v) >= 0;
    if (good) out[d] = json_integer_value(v);
  }
  if (good) return 0;
  char found[64];
  ml_json_brief(a, found, sizeof found);
  return ml_err("%s: tensor '%s': field '%s': expected %s non-negative integers, found %s", c->meta,
                tensor, field, ndim == 2 ? "2" : ndim == 1 ? "1" : "1 or 2", found);
}

static int parse_piece(const ml_rc_ckpt *c, ml_rc_tensor *t, const json_t *pc,
                       struct ml_rc_piece *out) {
  const char *file = json_string_value(json_object_get(pc, "file"));
  json_t *idx = file ? json_object_get(c->files, file) : NULL;
  if (!idx)
    return ml_err("%s: tensor '%s': a piece's field 'file' is not one of 'files' (found %s)",
                  c->meta, t->name, file ? file : "nothing");
  out->file = (int)json_integer_value(idx);
  ML_TRY(parse_dims(c, t->name, "offset", json_object_get(pc, "offset"), t->ndim, 0, out->b.off));
  ML_TRY(parse_dims(c, t->name, "shape", json_object_get(pc, "shape"), t->ndim, 1, out->b.shape));
  /* off, shape >= 0 (parse_dims): compare without forming off + shape, which
   * can overflow; afterwards off + shape <= t->shape, so ml_rc_read_block's
   * sums are in range. */
  for (int d = 0; d < 2; d++)
    if (out->b.off[d] > t->shape[d] || out->b.shape[d] > t->shape[d] - out->b.off[d])
      return ml_err("%s: tensor '%s': field '%s' of a piece in %s: offset [%lld, %lld] + shape "
                    "[%lld, %lld] lies outside the tensor's shape [%lld, %lld]; expected offset + "
                    "shape <= shape in every dimension",
                    c->meta, t->name, out->b.off[d] > t->shape[d] ? "offset" : "shape", file,
                    (ll)out->b.off[0], (ll)out->b.off[1], (ll)out->b.shape[0],
                    (ll)out->b.shape[1], (ll)t->shape[0], (ll)t->shape[1]);
  return 0;
}

int ml_rc_tensor_get(ml_rc_ckpt *c, const char *name, ml_rc_tensor *out) {
  memset(out, 0, sizeof *out);
  json_t *t = json_object_get(c->tensors, name);
  if (!t) return 1;
  out->name = name;
  json_t *shape = json_object_get(t, "shape"), *keys = json_object_get(t, "keys");
  json_t *pieces = json_object_get(t, "pieces");
  ML_TRY(parse_dims(c, name, "shape", shape, 0, 1, out->shape));
  out->ndim = (int)json_array_size(shape);
  for (int s = 0; s < ML_RC_STATES; s++) {
    out->keys[s] = json_string_value(json_object_get(keys, ml_rc_state_names[s]));
    if (!out->keys[s])
      return ml_err("%s: tensor '%s': field 'keys' has no string '%s'", c->meta, name,
                    ml_rc_state_names[s]);
  }
  if (!json_is_array(pieces))
    return ml_err("%s: tensor '%s': field 'pieces': expected an array", c->meta, name);
  out->n = (int)json_array_size(pieces);
  out->pieces = ml_calloc((size_t)out->n + 1, sizeof *out->pieces, "checkpoint pieces");
  if (!out->pieces) return -1;
  for (int k = 0; k < out->n; k++)
    if (parse_piece(c, out, json_array_get(pieces, (size_t)k), &out->pieces[k])) {
      ml_rc_tensor_free(out);
      return -1;
    }
  return 0;
}

void ml_rc_tensor_free(ml_rc_tensor *t) {
  free(t->pieces);
  memset(t, 0, sizeof *t);
}

/* Piece k's tensor of `state`, its file opened (and validated) on first use. */
static int piece_tensor(ml_rc_ckpt *c, const ml_rc_tensor *t, int k, int state,
                        const ml_st_tensor **out) {
  const struct ml_rc_piece *pc = &t->pieces[k];
  ml_st_file *f = &c->open[pc->file];
  if (!f->path) {
    char path[ML_RC_PATH];
    ML_TRY(join(path, c->dir, c->file_names[pc->file]));
    ML_TRY(ml_st_open(path, f));
  }
  const ml_st_tensor *st = ml_st_find(f, t->keys[state]);
  if (!st)
    return ml_err("%s: no tensor '%s' (%s lists a piece there)", f->path, t->keys[state], c->meta);
  int64_t got1 = st->ndim == 2 ? st->shape[1] : 1;
  if (st->ndim != t->ndim || st->shape[0] != pc->b.shape[0] || got1 != pc->b.shape[1])
    return ml_err("%s: tensor '%s' has shape [%lld, %lld] (ndim %d); %s lists [%lld, %lld] (ndim "
                  "%d)",
                  f->path, t->keys[state], (ll)st->shape[0], (ll)got1, st->ndim, c->meta,
                  (ll)pc->b.shape[0], (ll)pc->b.shape[1], t->ndim);
  *out = st;
  return 0;
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The block [r0, r0+nr) x [c0, c0+nc) is a parameter's (< 2^44 elements,
 * config.h) and every piece lies inside t's shape (parse_piece), so the sums
 * and products below stay in range. */
int ml_rc_read_block(ml_rc_ckpt *c, const ml_rc_tensor *t, int state, int64_t r0, int64_t c0,
                     int64_t nr, int64_t nc, float *dst) {
  ml_rc_block *seen = ml_calloc((size_t)t->n + 1, sizeof *seen, "checkpoint block cover");
  if (!seen) return -1;
  int nseen = 0, rc = 0;
  int64_t covered = 0;
  for (int k = 0; rc == 0 && k < t->n; k++) {
    const ml_rc_block *b = &t->pieces[k].b;
    int64_t i0 = max64(r0, b->off[0]), i1 = min64(r0 + nr, b->off[0] + b->shape[0]);
    int64_t j0 = max64(c0, b->off[1]), j1 = min64(c0 + nc, b->off[1] + b->shape[1]);
    if (i0 >= i1 || j0 >= j1) continue;
    for (int q = 0; q < nseen; q++)
      if (i0 < seen[q].off[0] + seen[q].shape[0] && seen[q].off[0] < i1 &&
          j0 < seen[q].off[1] + seen[q].shape[1] && seen[q].off[1] < j1)
        rc = ml_err("%s: tensor '%s': pieces overlap at rows %lld.., cols %lld..", c->meta,
                    t->name, (ll)i0, (ll)j0);
    seen[nseen++] = (ml_rc_block){{i0, j0}, {i1 - i0, j1 - j0}};
    covered += (i1 - i0) * (j1 - j0);
    const ml_st_tensor *st;
    if (rc == 0) rc = piece_tensor(c, t, k, state, &st);
    if (rc == 0 && j0 == c0 && j1 - j0 == nc) /* whole rows of the block: one read */
      rc = ml_st_read_block(st, i0 - b->off[0], i1 - i0, j0 - b->off[1], nc,
                            dst + (i0 - r0) * nc);
    for (int64_t i = i0; rc == 0 && (j0 != c0 || j1 - j0 != nc) && i < i1; i++)
      rc = ml_st_read_block(st, i - b->off[0], 1, j0 - b->off[1], j1 - j0,
                            dst + (i - r0) * nc + (j0 - c0));
    if (rc == 0) ml_st_release(st->data, st->nbytes);
  }
  free(seen);
  if (rc == 0 && covered != nr * nc)
    rc = ml_err("%s: tensor '%s' (%s): the pieces cover %lld of the %lld elements of rows "
                "%lld..%lld, cols %lld..%lld",
                c->meta, t->name, ml_rc_state_names[state], (ll)covered, (ll)(nr * nc), (ll)r0,
                (ll)(r0 + nr - 1), (ll)c0, (ll)(c0 + nc - 1));
  return rc;
}
