#define _POSIX_C_SOURCE 200809L

#include "ckpt/hf_export.h"

#include <dirent.h>
#include <errno.h>
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/status.h"
#include "io/checkpoint.h"
#include "io/json.h"
#include "model/family.h"
#include "ckpt/hf_source.h"
#include "ckpt/runckpt_format.h"

typedef long long ll;

const char *const ml_export_dtype_names[] = {"source", "fp32", "bf16", NULL};

enum { PATH_CAP = 4096, NAME_CAP = sizeof ((ml_param *)0)->name };
/* Carried bytes go to the writer in pieces of this size, each released from
 * memory once written (the source is mapped). */
enum { CARRY_CHUNK = 64 << 20 };

struct ml_hf_export {
  ml_hf_export_spec spec;
  char out[PATH_CAP], stage[PATH_CAP];
  const ml_family *family; /* the layout written */
  ml_st_entry *entries;    /* n_trained trained, then the carried ones */
  int n_entries, n_trained, next; /* entries; the next trained parameter to put */
  char (*names)[NAME_CAP]; /* the trained parameters' names in that layout */
  char (*keys)[NAME_CAP];  /* the trained entries' names (a fused tensor: one for its parts) */
  ml_dtype dtype;          /* the trained tensors' dtype when they share one */
  bool uniform;
  ml_ckpt src;             /* the source's weights (carried tensors), when open */
  bool src_open;
  ml_ckpt_writer *w;
};

/* ------------------------------------------------------------- the plan */

/* The dtype trained tensor `name` is written in. */
static int trained_dtype(const ml_hf_export *x, const char *name, ml_dtype *out) {
  switch (x->spec.dtype) {
  case ML_EXPORT_DTYPE_F32: *out = ML_F32; return 0;
  case ML_EXPORT_DTYPE_BF16: *out = ML_BF16; return 0;
  case ML_EXPORT_DTYPE_SOURCE: break;
  }
  if (!x->spec.source) {
    *out = ML_F32; /* no record of the source: the checkpoint's own fp32 */
    return 0;
  }
  const json_t *d = json_object_get(json_object_get(x->spec.source, "dtypes"), name);
  if (!d || ml_dtype_parse(json_string_value(d), out) != 0)
    return ml_err("export: the source description has no dtype for trained tensor '%s'", name);
  return 0;
}

/* The trained entries: one per checkpoint tensor (ml_param.key), the parts
 * of a fused one consecutive in spec->params, in their rows' order (their
 * puts append to one entry); dtypes[k] (NULL: not wanted) the dtype
 * parameter k is written in. */
static int plan_trained(ml_hf_export *x, ml_dtype *dtypes) {
  const ml_hf_export_spec *s = &x->spec;
  ml_st_entry *e = NULL;
  int64_t next_row = 0; /* where the next part of e begins */
  for (int k = 0; k < s->n; k++) {
    const ml_param *p = s->params[k];
    ML_TRY(ml_family_rename(s->cfg->family, x->family, p->name, x->names[k], NAME_CAP));
    char *key = x->keys[x->n_trained];
    ML_TRY(ml_family_rename(s->cfg->family, x->family, p->key, key, NAME_CAP));
    if (p->key_row0 > 0) { /* a later part of the fused tensor e */
      if (!e || strcmp(e->name, key) != 0 || p->key_row0 != next_row)
        return ml_err("export: '%s' is rows %lld.. of '%s', which do not follow its other parts",
                      p->name, (ll)p->key_row0, key);
    } else {
      e = &x->entries[x->n_trained++];
      *e = (ml_st_entry){key, ML_F32, p->ndim, {p->key_rows, p->shape[1]}, NULL};
      ML_TRY(trained_dtype(x, key, &e->dtype));
      if (x->n_trained > 1 && e->dtype != x->dtype) x->uniform = false;
      x->dtype = e->dtype;
    }
    next_row = p->key_row0 + p->shape[0];
    if (dtypes) dtypes[k] = e->dtype;
  }
  return 0;
}

static int pick_family(ml_hf_export *x);

int ml_hf_export_layout(const ml_hf_export_spec *spec, char (*names)[NAME_CAP], ml_dtype *dtypes) {
  ml_hf_export x = {.spec = *spec, .names = names, .uniform = true};
  x.entries = ml_calloc((size_t)spec->n + 1, sizeof *x.entries, "the export's layout");
  x.keys = ml_calloc((size_t)spec->n + 1, sizeof *x.keys, "the export's layout");
  int rc = x.entries && x.keys ? pick_family(&x) : -1;
  if (rc == 0) rc = plan_trained(&x, dtypes);
  free(x.entries);
  free(x.keys);
  return rc;
}

/* Entry e of a carried tensor, checked against the source's weights. */
static int check_carried(const ml_hf_export *x, const ml_st_entry *e) {
  const ml_st_tensor *t = ml_ckpt_find(&x->src, e->name);
  char want[ML_ST_SHAPE_CAP], got[ML_ST_SHAPE_CAP];
  ml_st_shape_str(want, sizeof want, e->ndim, e->shape);
  if (!t)
    return ml_err("%s: no tensor '%s' (%s %s), which the export carries over: the source model "
                  "changed since the run recorded it",
                  x->src.dir, e->name, ml_dtype_name(e->dtype), want);
  bool same = t->dtype == e->dtype && t->ndim == e->ndim;
  for (int d = 0; same && d < e->ndim; d++) same = t->shape[d] == e->shape[d];
  if (same) return 0;
  ml_st_shape_str(got, sizeof got, t->ndim, t->shape);
  return ml_err("%s: tensor '%s' is %s %s; the run recorded %s %s: the source model changed "
                "since",
                x->src.dir, e->name, ml_dtype_name(t->dtype), got, ml_dtype_name(e->dtype), want);
}

/* The bytes of files a and b are the same. Errors: unreadable (named). */
static int same_bytes(const char *a, const char *b, bool *same) {
  FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
  int rc = fa && fb ? 0 : ml_err("%s: cannot open: %s", fa ? b : a, strerror(errno));
  int ca = 0, cb = 0;
  while (rc == 0 && (ca = getc(fa)) == (cb = getc(fb)) && ca != EOF) {}
  if (rc == 0 && (ferror(fa) || ferror(fb)))
    rc = ml_err("%s: cannot read: %s", ferror(fa) ? a : b, strerror(errno));
  *same = rc == 0 && ca == cb;
  if (fa) fclose(fa);
  if (fb) fclose(fb);
  return rc;
}

/* Open dir as the source of the carried entries: its config.json the
 * recorded one (the files' copy), each carried tensor's dtype and shape as
 * recorded. Errors: the first mismatch (named); nothing left open. */
static int try_source(ml_hf_export *x, const char *dir) {
  char got[PATH_CAP], want[PATH_CAP];
  bool same = false;
  int rc = 0;
  if (snprintf(got, sizeof got, "%s/config.json", dir) >= (int)sizeof got ||
      snprintf(want, sizeof want, "%s/config.json", x->spec.files_dir) >= (int)sizeof want)
    rc = ml_err("%s: path too long", dir);
  if (rc == 0) rc = same_bytes(got, want, &same);
  if (rc == 0 && !same)
    rc = ml_err("%s differs from the recorded %s: another model", got, want);
  if (rc == 0) rc = ml_ckpt_open(dir, &x->src);
  if (rc != 0) return -1;
  x->src_open = true;
  for (int i = x->n_trained; rc == 0 && i < x->n_entries; i++)
    rc = check_carried(x, &x->entries[i]);
  if (rc == 0) return 0;
  ml_ckpt_close(&x->src);
  x->src_open = false;
  return -1;
}

/* The source's weights, where the carried tensors are read from: the
 * recorded absolute path, else the one relative to the files' copy (a
 * checkpoint moved with its source), whichever try_source accepts. */
static int open_source(ml_hf_export *x) {
  const char *dir = json_string_value(json_object_get(x->spec.source, "dir"));
  const json_t *rel = json_object_get(x->spec.source, "dir_rel");
  if (try_source(x, dir) == 0) return 0;
  char why[ML_ERROR_MSG_CAP], rel_dir[PATH_CAP], why_rel[ML_ERROR_MSG_CAP + PATH_CAP + 64] = "";
  snprintf(why, sizeof why, "%s", ml_error_msg());
  ml_error_clear();
  if (rel) {
    snprintf(rel_dir, sizeof rel_dir, "%s/%s", x->spec.files_dir, json_string_value(rel));
    if (try_source(x, rel_dir) == 0) return 0;
    snprintf(why_rel, sizeof why_rel, "; nor at %s, relative to the checkpoint: %s", rel_dir,
             ml_error_msg());
    ml_error_clear();
  }
  return ml_err("export: the source model %s holds the %d tensors the run does not train (e.g. "
                "'%s'), which the export copies, but it cannot be used: %s%s",
                dir, x->n_entries - x->n_trained, x->entries[x->n_trained].name, why, why_rel);
}

static int plan_carried(ml_hf_export *x) {
  const json_t *carried = json_object_get(x->spec.source, "carried"), *v;
  const char *name;
  int k = x->n_trained;
  json_object_foreach((json_t *)carried, name, v) {
    ml_st_entry *e = &x->entries[k++];
    const json_t *shape = json_object_get(v, "shape");
    *e = (ml_st_entry){name, ML_F32, (int)json_array_size(shape), {0}, NULL};
    ml_dtype_parse(json_string_value(json_object_get(v, "dtype")), &e->dtype); /* checked */
    for (int d = 0; d < e->ndim; d++)
      e->shape[d] = json_integer_value(json_array_get(shape, (size_t)d));
  }
  x->n_entries = k;
  return k == x->n_trained ? 0 : open_source(x);
}

/* The layout written: the source's family, which must be the trained
 * model's as saved; else the saved family. */
static int pick_family(ml_hf_export *x) {
  const ml_family *saved = ml_family_saved(x->spec.cfg->family);
  if (!x->spec.source) {
    x->family = saved;
    return 0;
  }
  const char *arch = json_string_value(json_object_get(x->spec.source, "architecture"));
  x->family = ml_family_by_architecture(arch);
  if (!x->family || ml_family_saved(x->family) != saved)
    return ml_err("export: the source model is a %s; the trained model is a %s", arch,
                  x->spec.cfg->family->architecture);
  return 0;
}

/* ------------------------------------------------------------ the staging */

/* out[PATH_CAP] = "dir/name". Errors: too long. */
static int join(char *out, const char *dir, const char *name) {
  int n = snprintf(out, PATH_CAP, "%s/%s", dir, name);
  if (n >= 0 && n < PATH_CAP) return 0;
  return ml_err("%s/%s: path longer than %d bytes", dir, name, PATH_CAP - 1);
}

/* Remove directory `dir` and the files in it (a stage holds no
 * subdirectories); a missing one is fine. */
static int remove_stage(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return errno == ENOENT ? 0 : ml_err("%s: cannot open: %s", dir, strerror(errno));
  char path[PATH_CAP];
  struct dirent *ent;
  int rc = 0;
  while (rc == 0 && (ent = readdir(d)) != NULL) {
    if (strcmp(ent->d_name, ".") == 0 || strcmp(ent->d_name, "..") == 0) continue;
    rc = join(path, dir, ent->d_name);
    if (rc == 0 && unlink(path) != 0) rc = ml_err("%s: cannot remove: %s", path, strerror(errno));
  }
  closedir(d);
  if (rc == 0 && rmdir(dir) != 0) rc = ml_err("%s: cannot remove: %s", dir, strerror(errno));
  return rc;
}

/* x->out (trailing slashes dropped) and x->stage; the parent of out
 * created, a stale stage removed, a new one created. */
static int make_stage(ml_hf_export *x) {
  size_t len = strlen(x->spec.out_dir);
  while (len > 1 && x->spec.out_dir[len - 1] == '/') len--;
  if (len == 0 || len + sizeof ".export-tmp" > PATH_CAP)
    return ml_err("export: output directory '%s': expected a path of 1 to %d bytes",
                  x->spec.out_dir, PATH_CAP - (int)sizeof ".export-tmp");
  memcpy(x->out, x->spec.out_dir, len);
  x->out[len] = '\0';
  memcpy(x->stage, x->out, len);
  memcpy(x->stage + len, ".export-tmp", sizeof ".export-tmp");
  char parent[PATH_CAP];
  snprintf(parent, sizeof parent, "%s", x->out);
  char *slash = strrchr(parent, '/');
  if (slash && slash != parent) {
    *slash = '\0';
    ML_TRY(ml_ckpt_make_dirs(parent));
  }
  struct stat sb;
  if (stat(x->out, &sb) == 0 && !S_ISDIR(sb.st_mode))
    return ml_err("export: output directory %s exists and is not a directory", x->out);
  ML_TRY(remove_stage(x->stage));
  if (mkdir(x->stage, 0777) != 0)
    return ml_err("%s: cannot create the export's staging directory: %s", x->stage,
                  strerror(errno));
  return 0;
}

static bool weight_file(const char *name) {
  return strcmp(name, "model.safetensors") == 0 ||
         strcmp(name, "model.safetensors.index.json") == 0 ||
         fnmatch("model-*-of-*.safetensors", name, 0) == 0;
}

/* When a staged file moves into an existing output: the weights first,
 * then the index that commits shards, then the rest, config.json last. */
static int move_rank(const char *name) {
  if (strcmp(name, "config.json") == 0) return 3;
  if (strcmp(name, "model.safetensors.index.json") == 0) return 1;
  return weight_file(name) ? 0 : 2;
}

/* Move every staged file into the existing directory x->out; `moved`
 * collects their names. */
static int move_files(const ml_hf_export *x, json_t *moved) {
  char from[PATH_CAP], to[PATH_CAP];
  for (int pass = 0; pass < 4; pass++) {
    DIR *d = opendir(x->stage);
    if (!d) return ml_err("%s: cannot open: %s", x->stage, strerror(errno));
    struct dirent *ent;
    int rc = 0;
    while (rc == 0 && (ent = readdir(d)) != NULL) {
      if (ent->d_name[0] == '.' || move_rank(ent->d_name) != pass) continue;
      rc = join(from, x->stage, ent->d_name) || join(to, x->out, ent->d_name) ? -1 : 0;
      if (rc == 0 && rename(from, to) != 0)
        rc = ml_err("%s: cannot move %s into place: %s", to, from, strerror(errno));
      else if (rc == 0 && json_object_set_new(moved, ent->d_name, json_true()) != 0)
        rc = ml_err("%s: out of memory", x->out);
    }
    closedir(d);
    ML_TRY(rc);
  }
  return 0;
}

/* Weight files of an earlier export in x->out that this one did not write. */
static int remove_stale(const ml_hf_export *x, const json_t *moved) {
  DIR *d = opendir(x->out);
  if (!d) return ml_err("%s: cannot open: %s", x->out, strerror(errno));
  char path[PATH_CAP];
  struct dirent *ent;
  int rc = 0;
  while (rc == 0 && (ent = readdir(d)) != NULL) {
    if (!weight_file(ent->d_name) || json_object_get(moved, ent->d_name)) continue;
    rc = join(path, x->out, ent->d_name);
    if (rc == 0 && unlink(path) != 0)
      rc = ml_err("%s: cannot remove the stale %s: %s", x->out, path, strerror(errno));
  }
  closedir(d);
  return rc;
}

/* The staged export into place. */
static int commit(const ml_hf_export *x) {
  char parent[PATH_CAP];
  snprintf(parent, sizeof parent, "%s", x->out);
  char *slash = strrchr(parent, '/');
  if (!slash) snprintf(parent, sizeof parent, ".");
  else slash[slash == parent] = '\0'; /* "/out" → "/" */
  if (rename(x->stage, x->out) == 0) return ml_rc_fsync_dir(parent);
  if (errno != EEXIST && errno != ENOTEMPTY)
    return ml_err("%s: cannot move the export %s into place: %s", x->out, x->stage,
                  strerror(errno));
  json_t *moved = json_object();
  int rc = moved ? move_files(x, moved) : ml_err("%s: out of memory", x->out);
  if (rc == 0) rc = remove_stale(x, moved);
  json_decref(moved);
  if (rc == 0 && rmdir(x->stage) != 0)
    rc = ml_err("%s: cannot remove: %s", x->stage, strerror(errno));
  return rc == 0 ? ml_rc_fsync_dir(x->out) : -1;
}

/* ------------------------------------------------------------ the writer */

static void export_free(ml_hf_export *x) {
  if (x->src_open) ml_ckpt_close(&x->src);
  free(x->entries);
  free(x->names);
  free(x->keys);
  free(x);
}

int ml_hf_export_begin(const ml_hf_export_spec *spec, ml_hf_export **out) {
  *out = NULL;
  ml_hf_export *x = ml_calloc(1, sizeof *x, "the export");
  if (!x) return -1;
  x->spec = *spec;
  x->uniform = true;
  size_t n_carried = spec->source ? json_object_size(json_object_get(spec->source, "carried")) : 0;
  x->entries = ml_calloc((size_t)spec->n + n_carried + 1, sizeof *x->entries, "export entries");
  x->names = ml_calloc((size_t)spec->n + 1, sizeof *x->names, "export names");
  x->keys = ml_calloc((size_t)spec->n + 1, sizeof *x->keys, "export names");
  int rc = x->entries && x->names && x->keys ? pick_family(x) : -1;
  if (rc == 0) rc = plan_trained(x, NULL);
  x->n_entries = x->n_trained;
  if (rc == 0 && spec->source) rc = plan_carried(x);
  if (rc == 0) rc = make_stage(x);
  if (rc == 0)
    rc = ml_ckpt_writer_open(x->stage, x->entries, (size_t)x->n_entries, spec->max_shard_bytes,
                             &x->w);
  if (rc != 0) {
    ml_hf_export_abandon(x);
    return -1;
  }
  *out = x;
  return 0;
}

int ml_hf_export_put(ml_hf_export *x, const float *data) {
  if (x->next == x->spec.n)
    return ml_err("export: %d trained tensors put, expected %d", x->next + 1, x->spec.n);
  /* appended to its entry: a fused tensor's parts come one after another */
  const ml_param *p = x->spec.params[x->next++];
  return ml_ckpt_writer_put_f32(x->w, data, (size_t)(p->shape[0] * p->shape[1]));
}

/* The carried tensors' bytes, from the mapped source weights. */
static int write_carried(ml_hf_export *x) {
  for (int i = x->n_trained; i < x->n_entries; i++) {
    const ml_st_tensor *t = ml_ckpt_find(&x->src, x->entries[i].name);
    for (size_t at = 0; at < t->nbytes; at += CARRY_CHUNK) {
      size_t k = t->nbytes - at < CARRY_CHUNK ? t->nbytes - at : CARRY_CHUNK;
      ML_TRY(ml_ckpt_writer_put(x->w, t->data + at, k));
      ml_st_release(t->data + at, k);
    }
  }
  return 0;
}

/* Set the torch dtype keys of config `root` (and of its text config) to t. */
static int set_dtype(json_t *root, const char *text_key, ml_dtype t) {
  json_t *objs[2] = {root, text_key ? json_object_get(root, text_key) : NULL};
  static const char *const keys[] = {"torch_dtype", "dtype"};
  bool at_top = false;
  int rc = 0;
  for (int o = 0; o < 2; o++)
    for (int k = 0; k < 2 && json_is_object(objs[o]); k++) {
      if (!json_object_get(objs[o], keys[k])) continue;
      rc |= json_object_set_new(objs[o], keys[k], json_string(ml_dtype_torch_name(t)));
      at_top |= o == 0;
    }
  if (!at_top) rc |= json_object_set_new(root, "torch_dtype", json_string(ml_dtype_torch_name(t)));
  return rc;
}

static int write_config(ml_hf_export *x) {
  char path[PATH_CAP];
  if (!x->spec.source) {
    ml_model_config saved = *x->spec.cfg;
    saved.family = x->family;
    saved.dtype = x->uniform ? x->dtype : ML_F32;
    return ml_model_config_write(x->stage, &saved);
  }
  ml_json j;
  ML_TRY(join(path, x->spec.files_dir, "config.json"));
  ML_TRY(ml_json_load(path, &j));
  int rc = 0;
  if (x->uniform && set_dtype(j.root, x->family->text_config_key, x->dtype) != 0)
    rc = ml_err("%s: out of memory setting its dtype", path);
  if (rc == 0) rc = join(path, x->stage, "config.json");
  if (rc == 0) rc = ml_json_write(path, j.root);
  ml_json_free(&j);
  return rc;
}

int ml_hf_export_end(ml_hf_export *x) {
  int rc = 0;
  if (x->next < x->spec.n)
    rc = ml_err("export: trained tensor '%s' (%d of %d) never came", x->entries[x->next].name,
                x->next + 1, x->spec.n);
  if (rc == 0) rc = write_carried(x);
  ml_ckpt_writer *w = x->w;
  x->w = NULL;
  if (rc == 0) rc = ml_ckpt_writer_close(w);
  else ml_ckpt_writer_abandon(w);
  if (rc == 0) rc = write_config(x);
  if (rc == 0 && x->spec.source)
    rc = ml_hf_source_copy(x->spec.source, x->spec.files_dir, x->stage, false);
  if (rc == 0) rc = commit(x);
  if (rc != 0) {
    ml_hf_export_abandon(x);
    return -1;
  }
  export_free(x);
  return 0;
}

void ml_hf_export_abandon(ml_hf_export *x) {
  if (!x) return;
  ml_ckpt_writer_abandon(x->w);
  if (x->stage[0]) (void)remove_stage(x->stage); /* the error being handled is the cause */
  export_free(x);
}
