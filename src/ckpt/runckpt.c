#define _POSIX_C_SOURCE 200809L

#include "ckpt/runckpt.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/status.h"
#include "model/family.h"
#include "ckpt/runckpt_format.h"
#include "ckpt/hf_source.h"
#include "ckpt/save.h"

typedef long long ll;

/* The flat per-rank array of `unit` holding checkpointed state s of its
 * parameter i, or NULL: a frozen parameter has no AdamW state (saved as
 * zeros; its chunk may lie beyond the unit's grad_numel), nor has a
 * session before its first training call (ml_engine_train_state: saved as
 * the zeros it would start from). */
static float *state_array(const ml_fsdp_unit *unit, int i, int s) {
  if (s == ML_RC_EXP_AVG || s == ML_RC_EXP_AVG_SQ)
    return unit->params[i]->frozen ? NULL : s == ML_RC_EXP_AVG ? unit->adam_m : unit->adam_v;
  return unit->shard;
}

/* p's checkpoint key in the saved family's layout (ml_family_saved). */
static int saved_name(const ml_model_config *cfg, const ml_param *p, char *out) {
  return ml_family_rename(cfg->family, ml_family_saved(cfg->family), p->name, out, ML_RC_KEY);
}

/* ------------------------------------------------------------------ save */

/* Test hook of the crash-safety test (runckpt.h): MESHLM_TEST_CRASH_IN_SAVE
 * = "STEP:RANK" names the save and the world rank that dies in it. */
static bool crash_requested(const ml_run_state *st, int rank) {
  const char *v = getenv("MESHLM_TEST_CRASH_IN_SAVE");
  long long step;
  int r;
  char end;
  return v && sscanf(v, "%lld:%d%c", &step, &r, &end) == 2 && step == st->step && r == rank;
}

/* Write part of this rank's file (its first half, under the final name, as
 * a torn write would leave it), then die by SIGKILL. */
_Noreturn static void crash_in_save(const char *path, const ml_st_entry *ent, int ne) {
  struct stat sb;
  if (ne > 0 && ml_st_write(path, ent, (size_t)ne) == 0 && stat(path, &sb) == 0 &&
      truncate(path, sb.st_size / 2) == 0)
    fprintf(stderr, "meshlm: test hook: rank file %s cut to %lld bytes; killing this rank\n", path,
            (ll)(sb.st_size / 2));
  fflush(stderr);
  raise(SIGKILL);
  abort();
}

/* Elements of host staging this rank's pieces take: every state of them. */
static int64_t pieces_numel(const ml_engine *e) {
  int64_t total = 0, at;
  ml_rc_block b;
  for (int u = 0; u < e->fsdp.n_units; u++) {
    const ml_fsdp_unit *unit = &e->fsdp.units[u];
    for (int i = 0; i < unit->n; i++)
      if (ml_engine_piece(e, unit, i, b.off, b.shape, &at))
        total += ML_RC_STATES * b.shape[0] * b.shape[1];
  }
  return total;
}

/* Write this rank's pieces to step_dir/rank-R.safetensors (each copied
 * from the shards into host staging first) and record their blocks
 * in mine[n] by export order (shape[0] = 0: none, e.g. another ep rank's
 * expert). */
static int write_pieces(ml_engine *e, const char *step_dir, const ml_run_state *st,
                        ml_rc_block *mine) {
  const ml_mesh *mesh = e->mesh;
  int n = e->model.n_params, ne = 0, rc = 0;
  ml_st_entry *ent = ml_calloc((size_t)n * ML_RC_STATES, sizeof *ent, "checkpoint entries");
  char(*keys)[ML_RC_KEY] = ml_calloc((size_t)n * ML_RC_STATES, sizeof *keys, "checkpoint keys");
  float *stage = ml_be_host_alloc(e->be, pieces_numel(e), sizeof(float),
                                  "staging this rank's checkpoint pieces");
  if (!ent || !keys || !stage) rc = -1;
  char name[ML_RC_KEY];
  float *at = stage;
  for (int u = 0; rc == 0 && u < e->fsdp.n_units; u++) {
    const ml_fsdp_unit *unit = &e->fsdp.units[u];
    for (int i = 0; rc == 0 && i < unit->n; i++) {
      const ml_param *p = unit->params[i];
      ml_rc_block b;
      int64_t b_at;
      if (!ml_engine_piece(e, unit, i, b.off, b.shape, &b_at)) continue;
      mine[e->order_k[p - e->model.params]] = b;
      rc = saved_name(&e->model.cfg, p, name);
      size_t numel = (size_t)(b.shape[0] * b.shape[1]);
      for (int s = 0; rc == 0 && s < ML_RC_STATES; s++, ne++, at += numel) {
        rc = ml_rc_state_key(name, s, keys[ne], sizeof keys[ne]);
        const float *src = state_array(unit, i, s);
        if (rc == 0 && !src) /* no AdamW state (frozen, or none yet): saved as zeros */
          memset(at, 0, sizeof(float) * numel);
        else if (rc == 0)
          rc = ml_be_copy(e->fsdp.shard_be, at, src + b_at, sizeof(float) * numel, ML_COPY_D2H);
        ent[ne] = (ml_st_entry){keys[ne], ML_F32, p->ndim, {b.shape[0], b.shape[1]}, at};
      }
    }
  }
  char file[ML_RC_NAME], path[ML_RC_PATH];
  ml_rc_rank_file(mesh->rank, file, sizeof file);
  if (rc == 0 && snprintf(path, sizeof path, "%s/%s", step_dir, file) >= (int)sizeof path)
    rc = ml_err("%s/%s: path too long", step_dir, file);
  if (rc == 0 && crash_requested(st, mesh->rank)) crash_in_save(path, ent, ne);
  if (rc == 0 && ne > 0) rc = ml_st_write(path, ent, (size_t)ne); /* temp, fsync, rename */
  if (rc == 0 && ne > 0) rc = ml_rc_fsync_dir(step_dir);
  free(ent);
  free(keys);
  ml_be_host_free(e->be, stage);
  return rc;
}

/* The source model (ckpt/hf_source.h) for `meshlm export`: its
 * description into *out and copies of its files into step_dir/source/. A
 * source that cannot be read is no reason to lose the checkpoint: a
 * warning, and *out NULL (the export then writes the text model alone). */
static int record_source(const ml_engine *e, const char *step_dir, json_t **out) {
  if (ml_hf_source_describe(e->model_dir, &e->model, out) != 0) {
    ml_warn("%s: no record of the source model in this checkpoint (%s); meshlm export will write "
            "the text model's config.json and weights alone",
            step_dir, ml_error_msg());
    ml_error_clear();
    return 0;
  }
  char dir[ML_RC_PATH];
  if (snprintf(dir, sizeof dir, "%s/" ML_RC_SOURCE, step_dir) >= (int)sizeof dir)
    return ml_err("%s/" ML_RC_SOURCE ": path too long", step_dir);
  if (mkdir(dir, 0777) != 0) return ml_err("%s: cannot create: %s", dir, strerror(errno));
  ML_TRY(ml_hf_source_relate(*out, dir));
  ML_TRY(ml_hf_source_copy(*out, e->model_dir, dir, true));
  return ml_rc_fsync_dir(dir);
}

/* World rank 0, once every rank's file is durable: config.json, the
 * source's files, metadata.json, then the commit. */
static int commit(ml_engine *e, const char *dir, const char *name, const char *step_dir,
                  const ml_run_state *st, const ml_rc_block *blocks) {
  const ml_mesh *mesh = e->mesh;
  int n = e->model.n_params, rc = 0;
  ml_rc_param *params = ml_calloc((size_t)n, sizeof *params, "checkpoint params");
  char(*names)[ML_RC_KEY] = ml_calloc((size_t)n, sizeof *names, "checkpoint names");
  if (!params || !names) rc = -1;
  for (int i = 0; rc == 0 && i < n; i++) {
    const ml_param *p = ml_engine_export_param(e, i);
    rc = saved_name(&e->model.cfg, p, names[i]);
    params[i] = (ml_rc_param){names[i], p->ndim, {p->shape[0], p->shape[1]}, p->frozen};
  }
  ml_model_config cfg = e->model.cfg;
  cfg.family = ml_family_saved(cfg.family);
  cfg.dtype = ML_F32;
  ml_rc_info info = {*st,       e->step,  mesh->world_size, mesh->dp_replicate, mesh->dp_shard,
                     mesh->cp,  mesh->tp, e->opts.freeze ? e->opts.freeze : ""};
  json_t *source = NULL;
  if (rc == 0) rc = ml_model_config_write(step_dir, &cfg);
  if (rc == 0) rc = record_source(e, step_dir, &source);
  if (rc == 0) rc = ml_rc_write_metadata(step_dir, &info, params, n, blocks, source);
  if (rc == 0) rc = ml_rc_commit(dir, name, st->step);
  json_decref(source);
  free(params);
  free(names);
  return rc;
}

int ml_run_save(ml_engine *e, const char *dir, const ml_run_state *st) {
  ml_host *w = ml_mesh_host(e->mesh, ML_GROUP_WORLD);
  char name[ML_RC_NAME] = "", step_dir[ML_RC_PATH];
  if (ml_host_agree(w, w->rank == 0 ? ml_rc_begin(dir, st->step, name) : 0)) {
    if (w->rank == 0) (void)ml_rc_abandon(dir, name);
    return -1;
  }
  ML_TRY(ml_host_broadcast(w, name, sizeof name, 0));
  snprintf(step_dir, sizeof step_dir, "%s/%s", dir, name);
  int n = e->model.n_params;
  /* every rank's blocks, gathered as [world][n] */
  ml_rc_block *mine = ml_calloc((size_t)n, sizeof *mine, "checkpoint blocks");
  ml_rc_block *all = ml_calloc((size_t)n * (size_t)w->size, sizeof *all, "checkpoint blocks");
  int rc = mine && all ? write_pieces(e, step_dir, st, mine) : -1;
  rc = ml_host_agree(w, rc);
  if (rc == 0) rc = ml_host_all_gather(w, mine, sizeof *mine * (size_t)n, all);
  if (rc == 0 && w->rank == 0) rc = commit(e, dir, name, step_dir, st, all);
  free(mine);
  free(all);
  rc = ml_host_agree(w, rc);
  /* every rank is past its writes: nothing of the failed save stays behind
   * (the agreed message, recorded first, outlives a failure to remove) */
  if (rc != 0 && w->rank == 0) (void)ml_rc_abandon(dir, name);
  return rc;
}

/* ------------------------------------------------------------------ load */

/* The checkpoint's config.json against the engine's model: the fields that
 * decide the parameters' names and shapes. */
static int check_config(const ml_rc_ckpt *c, const ml_model_config *want) {
  ml_model_config got;
  ML_TRY(ml_model_config_load(c->dir, &got));
  const char *path = c->config;
  const ml_family *saved = ml_family_saved(want->family);
  if (got.family != saved)
    return ml_err("%s: field 'architectures' is %s; the model being trained is saved as %s", path,
                  got.family->architecture, saved->architecture);
  struct {
    const char *key;
    int64_t got, want;
  } f[] = {
      {"num_hidden_layers", got.n_layers, want->n_layers},
      {"hidden_size", got.hidden, want->hidden},
      {"intermediate_size", got.intermediate, want->intermediate},
      {"num_attention_heads", got.n_heads, want->n_heads},
      {"num_key_value_heads", got.n_kv_heads, want->n_kv_heads},
      {"head_dim", got.head_dim, want->head_dim},
      {"vocab_size", got.vocab, want->vocab},
      {"tie_word_embeddings", got.tie_embeddings, want->tie_embeddings},
      {"attention_bias (q/k/v)", got.qkv_bias, want->qkv_bias},
      {"attention_bias (o_proj)", got.o_bias, want->o_bias},
      {"mlp_bias", got.mlp_bias, want->mlp_bias},
  };
  for (size_t k = 0; k < sizeof f / sizeof f[0]; k++)
    if (f[k].got != f[k].want)
      return ml_err("%s: field '%s' is %lld; the model being trained has %lld", path, f[k].key,
                    (ll)f[k].got, (ll)f[k].want);
  return 0;
}

/* The checkpoint's tensor of p, checked against p's global shape. */
static int find_tensor(ml_rc_ckpt *c, const char *name, const ml_param *p, ml_rc_tensor *t) {
  int rc = ml_rc_tensor_get(c, name, t);
  char want[ML_ST_SHAPE_CAP], got[ML_ST_SHAPE_CAP];
  ml_st_shape_str(want, sizeof want, p->ndim, p->shape);
  if (rc == 1)
    return ml_err("%s: no tensor '%s'; the model has it, of shape %s", c->meta, name, want);
  ML_TRY(rc);
  if (t->ndim != p->ndim || t->shape[0] != p->shape[0] || t->shape[1] != p->shape[1]) {
    ml_st_shape_str(got, sizeof got, t->ndim, t->shape);
    ml_rc_tensor_free(t);
    return ml_err("%s: tensor '%s' has shape %s; the model has %s", c->meta, name, got, want);
  }
  return 0;
}

/* Parameter i of unit: this rank's rows of every state from the pieces,
 * read into host staging, then copied into the shards. */
static int load_param(ml_engine *e, ml_rc_ckpt *c, const ml_fsdp_unit *unit, int i) {
  const ml_param *p = unit->params[i];
  char name[ML_RC_KEY];
  ml_rc_tensor t;
  ML_TRY(saved_name(&e->model.cfg, p, name));
  ML_TRY(find_tensor(c, name, p, &t));
  int64_t r0, nr; /* every row this rank holds, whether or not it writes them */
  ml_fsdp_param_rows(&e->fsdp, unit, i, &r0, &nr);
  ml_rc_block b = {{p->offset[0] + r0, p->offset[1]}, {nr, p->local[1]}};
  size_t numel = (size_t)(nr * p->local[1]);
  float *stage = NULL;
  int rc = 0;
  if (nr > 0 && !(stage = ml_be_host_alloc(e->be, nr * p->local[1], sizeof(float), "loading '%s'",
                                           name)))
    rc = -1;
  for (int s = 0; rc == 0 && nr > 0 && s < ML_RC_STATES; s++) {
    if (!state_array(unit, i, s)) continue; /* a frozen parameter's AdamW state: none */
    rc = ml_rc_read_block(c, &t, s, b.off[0], b.off[1], b.shape[0], b.shape[1], stage);
    if (rc == 0)
      rc = ml_be_copy(e->fsdp.shard_be, state_array(unit, i, s) + unit->shard_off[i], stage,
                      sizeof(float) * numel, ML_COPY_H2D);
  }
  ml_be_host_free(e->be, stage);
  ml_rc_tensor_free(&t);
  return rc;
}

/* The checkpoint's frozen parameters (metadata's "frozen"; none when it
 * lacks the key) against the engine's: the same set, or an error naming
 * both runs' --freeze patterns and the first parameter they disagree on
 * (AdamW state exists for trainable parameters only, and one step count
 * serves all: a parameter thawed on resume would start its moments at
 * step k, not 1, so the change is refused rather than guessed). */
static int check_frozen(const ml_engine *e, const ml_rc_ckpt *c) {
  const json_t *list = json_object_get(c->json.root, "frozen");
  if (list && !json_is_array(list))
    return ml_err("%s: field 'frozen': expected an array of parameter names", c->meta);
  const char *mine = e->opts.freeze ? e->opts.freeze : "";
  int n_mine = 0;
  char name[ML_RC_KEY];
  for (int i = 0; i < e->model.n_params; i++) {
    const ml_param *p = &e->model.params[i];
    n_mine += p->frozen;
    bool listed = false;
    ML_TRY(saved_name(&e->model.cfg, p, name));
    for (size_t k = 0; list && k < json_array_size(list) && !listed; k++) {
      const char *v = json_string_value(json_array_get(list, k));
      listed = v && strcmp(v, name) == 0;
    }
    if (listed != p->frozen)
      return ml_err("--resume %s: the checkpoint's run froze --freeze '%s' and this run "
                    "--freeze '%s': %s is %s there and %s here; expected the same frozen "
                    "parameters (frozen ones have no AdamW state)",
                    c->dir, c->info.freeze, mine, name, listed ? "frozen" : "trainable",
                    p->frozen ? "frozen" : "trainable");
  }
  size_t n_ck = list ? json_array_size(list) : 0;
  if (n_ck != (size_t)n_mine)
    return ml_err("--resume %s: the checkpoint lists %zu frozen parameters (--freeze '%s') and "
                  "this run freezes %d (--freeze '%s'); expected the same set",
                  c->dir, n_ck, c->info.freeze, n_mine, mine);
  return 0;
}

int ml_run_load(ml_engine *e, const char *dir, ml_run_state *st) {
  ml_rc_ckpt c;
  int rc = ml_rc_open(dir, &c);
  bool opened = rc == 0;
  if (rc == 0) rc = check_config(&c, &e->model.cfg);
  if (rc == 0) rc = check_frozen(e, &c);
  if (rc == 0) rc = ml_engine_train_state(e); /* the AdamW state to resume into */
  for (int u = 0; rc == 0 && u < e->fsdp.n_units; u++)
    for (int i = 0; rc == 0 && i < e->fsdp.units[u].n; i++)
      rc = load_param(e, &c, &e->fsdp.units[u], i);
  ml_fsdp_params_changed(&e->fsdp); /* the masters are the checkpoint's (or partly, on error) */
  ml_rc_info info = c.info;
  if (opened) ml_rc_close(&c);
  ML_TRY(ml_host_agree(ml_mesh_host(e->mesh, ML_GROUP_WORLD), rc));
  *st = info.st;
  e->step = info.optimizer_step;
  return ml_engine_sync_params(e);
}

/* ---------------------------------------------------------------- export */

/* The model's parameters in FSDP unit order (layers, then the root), the
 * order ml_engine_save_hf writes; *largest: the most elements of one. */
static void unit_order(const ml_model *m, const ml_param **out, int64_t *largest) {
  int k = 0;
  *largest = 0;
  for (int u = 0; u <= m->cfg.n_layers; u++)
    for (int i = 0; i < m->n_params; i++) {
      const ml_param *p = &m->params[i];
      if (ml_fsdp_unit_of(m, p) != u) continue;
      out[k++] = p;
      if (p->shape[0] * p->shape[1] > *largest) *largest = p->shape[0] * p->shape[1];
    }
}

/* Every tensor of the checkpoint into the export, one at a time. */
static int export_tensors(ml_rc_ckpt *c, ml_hf_export *x, const ml_param **params, int n,
                          float *buf) {
  for (int i = 0; i < n; i++) {
    const ml_param *p = params[i];
    ml_rc_tensor t;
    ML_TRY(find_tensor(c, p->name, p, &t));
    int rc = ml_rc_read_block(c, &t, ML_RC_PARAM, 0, 0, p->shape[0], p->shape[1], buf);
    ml_rc_tensor_free(&t);
    ML_TRY(rc);
    ML_TRY(ml_hf_export_put(x, buf));
  }
  return 0;
}

/* A checkpoint of a LoRA run (engine/lora.h) holds adapters no HF model has:
 * refused, naming one, rather than exporting the untouched base weights. */
static int refuse_lora(const ml_rc_ckpt *c) {
  const char *name;
  json_t *v;
  json_object_foreach(c->tensors, name, v) {
    if (strstr(name, ".lora_A.") || strstr(name, ".lora_B."))
      return ml_err("%s: a LoRA run's checkpoint (it holds adapters such as '%s'); expected a "
                    "checkpoint without LoRA: export a LoRA run with meshlm train --resume %s "
                    "and its --lora-* flags, --export-hf DIR [--merge-lora]",
                    c->meta, name, c->dir);
  }
  return 0;
}

int ml_run_export(const char *ckpt_dir, const char *out_dir, size_t max_shard_bytes,
                  ml_export_dtype dtype) {
  ml_rc_ckpt c;
  ML_TRY(ml_rc_open(ckpt_dir, &c));
  if (refuse_lora(&c)) {
    ml_rc_close(&c);
    return -1;
  }
  ml_model_config cfg;
  ml_model m = {0};
  int rc = ml_model_config_load(c.dir, &cfg);
  if (rc == 0) rc = ml_model_create(&cfg, &m);
  const ml_param **params = ml_calloc((size_t)m.n_params + 1, sizeof *params, "export params");
  int64_t largest = 0;
  if (rc == 0 && !params) rc = -1;
  if (rc == 0) unit_order(&m, params, &largest);
  if (rc == 0 && !c.source)
    ml_warn("%s: the checkpoint records no source model (saved by an older meshlm, or its source "
            "was unreadable): exporting config.json and the %s weights alone, without tokenizer "
            "files or tensors the run did not train",
            c.meta, ml_family_saved(cfg.family)->architecture);
  /* host memory: a file-to-file conversion, one tensor at a time */
  float *buf = rc == 0 ? ml_malloc(sizeof(float) * (size_t)largest, "the export's tensor buffer")
                       : NULL;
  ml_hf_export_spec spec = {out_dir, &cfg, params, m.n_params, c.source, c.source_dir, dtype,
                            max_shard_bytes};
  ml_hf_export *x = NULL;
  if (rc == 0 && !buf) rc = -1;
  if (rc == 0) rc = ml_hf_export_begin(&spec, &x);
  if (rc == 0) rc = export_tensors(&c, x, params, m.n_params, buf);
  if (rc == 0) rc = ml_hf_export_end(x);
  else ml_hf_export_abandon(x);
  free(buf);
  free(params);
  ml_model_destroy(&m);
  ml_rc_close(&c);
  return rc;
}
