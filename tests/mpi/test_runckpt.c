/* Run checkpoints (ckpt/runckpt.h): `mpiexec -n N test_runckpt FIXTURE TP [ep=P]`
 * (ep=P: every mesh over the world with tp 1 has expert parallelism P, parallel/ep.h, each
 * rank holding and writing its experts only; the meshes with tp > 1 and one rank have none, so
 * the reshard and export checks read an ep checkpoint without ep).
 *  - resume: 4 AdamW steps uninterrupted vs 2 steps, ml_run_save, a fresh
 *    engine, ml_run_load, 2 more steps on the same mesh (dp_shard = N/TP ×
 *    tp = TP): the losses of steps 3–4 and the final params bitwise equal;
 *  - reshard: saved on that mesh, loaded on every other one over the same
 *    ranks (tp 1, 2, 3, 4 where they divide the world, and one rank alone
 *    over MPI_COMM_SELF): params and
 *    AdamW exp_avg / exp_avg_sq bitwise equal after the load (they are
 *    copies), the next step's loss within the pair bound of
 *    tests/tolerance.h §3 (another mesh sums in another order); also under ZeRO-2,
 *    whose persistent unsharded params the load must refresh;
 *  - HSDP: saved under dp_replicate = 2 (only replica 0 writes), loaded on
 *    FSDP meshes; and an FSDP checkpoint loaded under HSDP;
 *  - export: ml_run_export (one process) writes the same model.safetensors
 *    and config.json bytes as the collective ml_engine_save_hf, and a
 *    sharded copy with an index whose tensors are equal;
 *  - commit protocol and errors (each rank alone, MPI_COMM_SELF): no
 *    committed checkpoint, an uncommitted step directory ignored and then
 *    replaced, a second save at the same step, another model config
 *    (field named), a missing tensor, a shape mismatch (both shapes), a
 *    truncated rank file (named).
 * Rank 0 prints save/load times and the bytes each rank wrote. */
#define _XOPEN_SOURCE 700

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <dirent.h>
#include <ftw.h>
#include <jansson.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/status.h"
#include "engine_run.h"
#include "io/checkpoint.h"
#include "parity_util.h"
#include "rank_report.h"
#include "engine/engine.h"
#include "ckpt/runckpt.h"
#include "ckpt/save.h"

static const char *g_fixture;
static int g_tp;
static int g_ep = 1; /* expert parallelism of the meshes over the world with tp 1 ("ep=P") */
static char g_root[256]; /* a temporary directory shared by the ranks */

static int world_rank(void) {
  int r;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

static int world_size(void) {
  int n;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

static const char *path_in(char *buf, size_t cap, const char *name) {
  snprintf(buf, cap, "%s/%s", g_root, name);
  return buf;
}

/* An engine on the fixture over a mesh of `base`, FSDP as ZeRO stage `zero`.
 * Held objects (runs, fixtures, batches) are static throughout: see held.h. */
static void run_open_zero(run *r, MPI_Comm base, int dp_replicate, int tp, int zero,
                          const char *fixture_name) {
  static fixture fx;
  fixture_load(fixture_name, &fx);
  ml_engine_opts opts = ml_engine_opts_default();
  opts.fsdp.zero = zero;
  int ep = base == MPI_COMM_WORLD && tp == 1 ? g_ep : 1;
  run_open_ep(r, base, dp_replicate, 1, tp, ep, &opts, fx.dir, NULL, NULL);
  fixture_free(&fx);
}

static void open_on(run *r, MPI_Comm base, int dp_replicate, int tp, const char *fixture_name) {
  run_open_zero(r, base, dp_replicate, tp, 3, fixture_name);
}

/* One optimizer step on this dp rank's rows of b: the step's mean loss. */
static double train_step(run *r, const batch *b) {
  int dp = ml_mesh_comm(&r->mesh, ML_GROUP_DP)->size, d = ml_mesh_comm(&r->mesh, ML_GROUP_DP)->rank;
  int64_t Bl = b->B / dp;
  double loss, norm;
  ml_adamw_cfg adam = {1e-2, 0.9, 0.999, 1e-8, 0.1};
  ml_engine_zero_grad(&r->e);
  if (ml_engine_forward_backward(&r->e, b->ids + d * Bl * b->S, b->mask + d * Bl * b->S, Bl,
                                 b->S, b->targets, &loss) ||
      ml_engine_grad_norm(&r->e, 2.0, &norm))
    fail_msg("step: %s", ml_error_msg());
  ml_engine_clip(&r->e, norm, 1.0);
  if (ml_engine_adamw(&r->e, &adam)) fail_msg("adamw: %s", ml_error_msg());
  return loss;
}

/* Global params, exp_avg and exp_avg_sq (ML_EXPORT_PARAMS, _EXP_AVG, _EXP_AVG_SQ). */
typedef struct state {
  int n;
  float **t[3];
} state;

static const ml_export_what WHAT[3] = {ML_EXPORT_PARAMS, ML_EXPORT_EXP_AVG, ML_EXPORT_EXP_AVG_SQ};
static const char *const WHAT_NAME[3] = {"param", "exp_avg", "exp_avg_sq"};

static void state_get(run *r, state *s, int kinds) {
  s->n = r->e.model.n_params;
  for (int k = 0; k < kinds; k++) s->t[k] = export_all(r, WHAT[k]);
}

static void state_free(state *s, int kinds) {
  for (int k = kinds - 1; k >= 0; k--) free_all(s->t[k]);
}

/* Bitwise equality of two states of the same model (export order). */
static void state_compare(report *rep, run *r, const state *a, const state *b, int kinds,
                          const char *what) {
  for (int k = 0; k < kinds; k++)
    for (int i = 0; i < a->n; i++) {
      const ml_param *p = ml_engine_export_param(&r->e, i);
      size_t bytes = sizeof(float) * (size_t)(p->shape[0] * p->shape[1]);
      if (memcmp(a->t[k][i], b->t[k][i], bytes) != 0)
        note(rep, "%s: %s of %s differs (rel L2 %.3g)", what, WHAT_NAME[k], p->name,
             rel_l2(b->t[k][i], a->t[k][i], p->shape[0] * p->shape[1]));
    }
}

static void save_or_fail(run *r, const char *dir, const ml_run_state *st) {
  if (ml_run_save(&r->e, dir, st)) fail_msg("save %s: %s", dir, ml_error_msg());
}

static void load_or_fail(run *r, const char *dir, ml_run_state *st) {
  if (ml_run_load(&r->e, dir, st)) fail_msg("load %s: %s", dir, ml_error_msg());
}

static const ml_run_state ST2 = {2, 8, 12345678901234567890ull, 40};

/* The run state ST2 and the optimizer step `opt_step` came back. */
static void check_state(report *rep, const ml_run_state *got, const ml_engine *e,
                        int64_t opt_step) {
  if (got->step != ST2.step || got->consumed != ST2.consumed || got->seed != ST2.seed ||
      got->nseq != ST2.nseq || e->step != opt_step)
    note(rep, "run state after load: step %lld consumed %lld seed %llu nseq %lld, engine step %lld",
         (long long)got->step, (long long)got->consumed, (unsigned long long)got->seed,
         (long long)got->nseq, (long long)e->step);
}

/* (a) Resume on the same mesh: bitwise the uninterrupted run. */
static void test_resume_same_mesh(void **unused) {
  (void)unused;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch b;
  batch_make(&fx, 4, &b);
  char dir[512];
  path_in(dir, sizeof dir, "resume");
  static run r;
  double want[4], got[4];
  open_on(&r, MPI_COMM_WORLD, 1, g_tp, g_fixture);
  for (int s = 0; s < 4; s++) want[s] = train_step(&r, &b);
  state ref;
  state_get(&r, &ref, 3);
  run_close(&r);

  open_on(&r, MPI_COMM_WORLD, 1, g_tp, g_fixture);
  for (int s = 0; s < 2; s++) got[s] = train_step(&r, &b);
  save_or_fail(&r, dir, &ST2);
  run_close(&r);
  open_on(&r, MPI_COMM_WORLD, 1, g_tp, g_fixture);
  ml_run_state st;
  load_or_fail(&r, dir, &st);
  report rep = {0};
  check_state(&rep, &st, &r.e, 2);
  for (int s = 2; s < 4; s++) got[s] = train_step(&r, &b);
  for (int s = 0; s < 4; s++) {
    if (world_rank() == 0)
      printf("step %d loss: uninterrupted %.17g, resumed %.17g\n", s + 1, want[s], got[s]);
    if (memcmp(&want[s], &got[s], sizeof(double)) != 0)
      note(&rep, "step %d loss %.17g after resume, %.17g uninterrupted", s + 1, got[s], want[s]);
  }
  state fin;
  state_get(&r, &fin, 3);
  state_compare(&rep, &r, &fin, &ref, 3, "after resume + 2 steps");
  agree(&rep, "resume mismatches");
  state_free(&fin, 3);
  state_free(&ref, 3);
  run_close(&r);
  batch_free(&b);
  fixture_free(&fx);
}

/* Bytes of each file of the committed step directory under dir (rank 0 prints). */
static void print_files(const char *dir) {
  char latest[600], step[600], path[1200];
  snprintf(latest, sizeof latest, "%s/latest.json", dir);
  json_t *j = json_load_file(latest, 0, NULL);
  snprintf(step, sizeof step, "%s/%s", dir, json_string_value(json_object_get(j, "step_dir")));
  json_decref(j);
  DIR *d = opendir(step);
  struct dirent *ent;
  struct stat sb;
  while (d && (ent = readdir(d)))
    if (ent->d_name[0] != '.' && snprintf(path, sizeof path, "%s/%s", step, ent->d_name) > 0 &&
        stat(path, &sb) == 0)
      printf("  %s: %lld bytes\n", ent->d_name, (long long)sb.st_size);
  if (d) closedir(d);
}

/* Load `dir` into a mesh over `base` (ZeRO stage `zero`) and compare with
 * the source's state `src` (bitwise: a load copies) and, after one more step
 * on both, the loss: the same parameters on another mesh sum in another
 * order, within the pair bound of tests/tolerance.h §3. */
static void check_load(report *rep, MPI_Comm base, int dp_replicate, int tp, int zero,
                       const char *dir, const state *src, double src_next) {
  static run r;
  run_open_zero(&r, base, dp_replicate, tp, zero, g_fixture);
  ml_run_state st;
  double t0 = MPI_Wtime();
  load_or_fail(&r, dir, &st);
  double dt = MPI_Wtime() - t0;
  char what[96];
  snprintf(what, sizeof what, "load on %s dp_replicate %d x dp_shard %d x tp %d, ZeRO-%d",
           base == MPI_COMM_SELF ? "one rank" : "the world", dp_replicate, r.mesh.dp_shard, tp,
           zero);
  check_state(rep, &st, &r.e, 2);
  state got;
  state_get(&r, &got, 3);
  state_compare(rep, &r, &got, src, 3, what);
  state_free(&got, 3);
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch b;
  batch_make(&fx, 4, &b);
  double next = train_step(&r, &b);
  tol_model tm = tol_model_of(&r, b.S, b.B * b.S);
  double rel = fabs(next - src_next) / fabs(src_next), bound = tol_model_pair(&tm, TOL_LOSS);
  if (world_rank() == 0)
    printf("%s: load %.3f ms, next loss %.9g vs %.9g on the saving mesh (rel %.3g, bound %.3g)\n",
           what, dt * 1e3, next, src_next, rel, bound);
  if (rel > bound)
    note(rep, "%s: next loss %.9g vs %.9g (rel %.3g, bound %.3g)", what, next, src_next, rel,
         bound);
  batch_free(&b);
  fixture_free(&fx);
  run_close(&r);
}

/* Train 2 steps on a mesh, save, and return its state and next-step loss. */
static void save_source(int dp_replicate, int tp, const char *dir, state *src, double *next) {
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch b;
  batch_make(&fx, 4, &b);
  static run r;
  open_on(&r, MPI_COMM_WORLD, dp_replicate, tp, g_fixture);
  for (int s = 0; s < 2; s++) train_step(&r, &b);
  double t0 = MPI_Wtime();
  save_or_fail(&r, dir, &ST2);
  double dt = MPI_Wtime() - t0;
  if (world_rank() == 0) {
    printf("save on dp_replicate %d x dp_shard %d x tp %d: %.3f ms\n", dp_replicate,
           r.mesh.dp_shard, tp, dt * 1e3);
    print_files(dir);
  }
  state_get(&r, src, 3);
  *next = train_step(&r, &b);
  run_close(&r);
  batch_free(&b);
  fixture_free(&fx);
}

/* The tp sizes a 4-row batch and the fixtures (at least 4 attention heads;
 * kv heads shared by tp ranks where tp does not divide them, parallel/tp.h)
 * allow over the world. */
static bool tp_ok(int tp) {
  int n = world_size();
  return n % tp == 0 && 4 % (n / tp) == 0 && tp <= 4;
}

/* (b) Reshard on load: every other mesh over the same ranks, and one rank. */
static void test_reshard(void **unused) {
  (void)unused;
  char dir[512];
  path_in(dir, sizeof dir, "reshard");
  state src;
  double next;
  save_source(1, g_tp, dir, &src, &next);
  report rep = {0};
  for (int tp = 1; tp <= 4; tp++)
    if (tp_ok(tp)) check_load(&rep, MPI_COMM_WORLD, 1, tp, 3, dir, &src, next);
  /* ZeRO-2 keeps unsharded params between steps: the load must refresh them */
  check_load(&rep, MPI_COMM_WORLD, 1, g_tp, 2, dir, &src, next);
  check_load(&rep, MPI_COMM_SELF, 1, 1, 3, dir, &src, next);
  agree(&rep, "reshard mismatches");
  state_free(&src, 3);
}

/* (c) HSDP: a dp_replicate = 2 checkpoint on FSDP meshes, and back. */
static void test_hsdp(void **unused) {
  (void)unused;
  if (world_size() % (2 * g_tp) != 0) skip();
  char dir[512];
  path_in(dir, sizeof dir, "hsdp");
  state src;
  double next;
  save_source(2, g_tp, dir, &src, &next);
  report rep = {0};
  for (int tp = 1; tp <= 4; tp++)
    if (tp_ok(tp)) check_load(&rep, MPI_COMM_WORLD, 1, tp, 3, dir, &src, next);
  state_free(&src, 3);
  path_in(dir, sizeof dir, "fsdp_to_hsdp");
  save_source(1, g_tp, dir, &src, &next);
  check_load(&rep, MPI_COMM_WORLD, 2, g_tp, 3, dir, &src, next);
  agree(&rep, "HSDP mismatches");
  state_free(&src, 3);
}

static void *slurp(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  *len = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  void *buf = malloc(*len + 1);
  if (fread(buf, 1, *len, f) != *len) *len = 0;
  fclose(f);
  return buf;
}

static void same_bytes(report *rep, const char *a, const char *b) {
  size_t na = 0, nb = 0;
  void *x = slurp(a, &na), *y = slurp(b, &nb);
  if (!x || !y || na != nb || memcmp(x, y, na) != 0)
    note(rep, "%s (%zu bytes) and %s (%zu bytes) differ", a, na, b, nb);
  free(x);
  free(y);
}

/* (d) ml_run_export = ml_engine_save_hf, one file and sharded. */
static void test_export(void **unused) {
  (void)unused;
  char dir[512], hf[512], ex[512], exs[512], a[600], b[600];
  path_in(dir, sizeof dir, "export");
  path_in(hf, sizeof hf, "export_hf");
  path_in(ex, sizeof ex, "export_run");
  path_in(exs, sizeof exs, "export_sharded");
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch b4;
  batch_make(&fx, 4, &b4);
  static run r;
  open_on(&r, MPI_COMM_WORLD, 1, g_tp, g_fixture);
  for (int s = 0; s < 2; s++) train_step(&r, &b4);
  save_or_fail(&r, dir, &ST2);
  if (ml_engine_save_hf(&r.e, hf, ML_EXPORT_DTYPE_SOURCE)) fail_msg("save_hf: %s", ml_error_msg());
  report rep = {0};
  if (world_rank() == 0) {
    double t0 = MPI_Wtime();
    if (ml_run_export(dir, ex, 0, ML_EXPORT_DTYPE_SOURCE)) note(&rep, "export: %s", ml_error_msg());
    double dt = MPI_Wtime() - t0;
    if (ml_run_export(dir, exs, 20000, ML_EXPORT_DTYPE_SOURCE)) note(&rep, "sharded export: %s", ml_error_msg());
    printf("export (one process): %.3f ms\n", dt * 1e3);
    snprintf(a, sizeof a, "%s/model.safetensors", hf);
    snprintf(b, sizeof b, "%s/model.safetensors", ex);
    same_bytes(&rep, a, b);
    snprintf(a, sizeof a, "%s/config.json", hf);
    snprintf(b, sizeof b, "%s/config.json", ex);
    same_bytes(&rep, a, b);
    ml_ckpt one, sh;
    snprintf(a, sizeof a, "%s/model.safetensors.index.json", exs);
    if (access(a, F_OK) != 0) note(&rep, "sharded export wrote no %s", a);
    if (ml_ckpt_open(ex, &one) || ml_ckpt_open(exs, &sh)) {
      note(&rep, "reopen: %s", ml_error_msg());
    } else {
      if (sh.nfiles < 2) note(&rep, "sharded export: %zu files", sh.nfiles);
      for (size_t i = 0; i < one.files[0].n; i++) {
        const ml_st_tensor *t = &one.files[0].tensors[i], *u = ml_ckpt_find(&sh, t->name);
        if (!u || u->nbytes != t->nbytes || memcmp(u->data, t->data, t->nbytes) != 0)
          note(&rep, "sharded export: tensor %s differs", t->name);
      }
      ml_ckpt_close(&one);
      ml_ckpt_close(&sh);
    }
  }
  agree(&rep, "export mismatches");
  run_close(&r);
  batch_free(&b4);
  fixture_free(&fx);
}

/* ------------------------------------------------- protocol and errors */

static void expect_error(report *rep, int rc, const char *what, const char *needle1,
                         const char *needle2) {
  const char *msg = ml_error_msg();
  if (rc == 0) note(rep, "%s: succeeded, expected an error", what);
  else if (!strstr(msg, needle1) || (needle2 && !strstr(msg, needle2)))
    note(rep, "%s: message \"%s\" lacks \"%s\"%s%s", what, msg, needle1, needle2 ? " / " : "",
         needle2 ? needle2 : "");
  else if (world_rank() == 0)
    printf("%s: %s\n", what, msg);
  ml_error_clear();
}

/* Rewrite dir's committed metadata.json with `edit` applied. */
static void edit_metadata(const char *dir, void (*edit)(json_t *tensors)) {
  char latest[700], meta[800];
  snprintf(latest, sizeof latest, "%s/latest.json", dir);
  json_t *l = json_load_file(latest, 0, NULL);
  snprintf(meta, sizeof meta, "%s/%s/metadata.json", dir,
           json_string_value(json_object_get(l, "step_dir")));
  json_decref(l);
  json_t *m = json_load_file(meta, 0, NULL);
  assert_non_null(m);
  edit(json_object_get(m, "tensors"));
  assert_int_equal(json_dump_file(m, meta, JSON_INDENT(1)), 0);
  json_decref(m);
}

static void drop_norm(json_t *tensors) { json_object_del(tensors, "model.norm.weight"); }
/* model.norm.weight [63], as another model's checkpoint would list it (its
 * one piece, saved by one rank, shrunk alike). */
static void shrink_norm(json_t *tensors) {
  json_t *t = json_object_get(tensors, "model.norm.weight");
  json_t *piece = json_array_get(json_object_get(t, "pieces"), 0);
  json_array_set_new(json_object_get(t, "shape"), 0, json_integer(63));
  json_array_set_new(json_object_get(piece, "shape"), 0, json_integer(63));
}

static const char *committed_dir(const char *dir, char *out, size_t cap) {
  char latest[700];
  snprintf(latest, sizeof latest, "%s/latest.json", dir);
  json_t *l = json_load_file(latest, 0, NULL);
  snprintf(out, cap, "%s", l ? json_string_value(json_object_get(l, "step_dir")) : "(none)");
  json_decref(l);
  return out;
}

/* latest.json names `want`, and the step directory `gone` was pruned. */
static void check_committed(report *rep, const char *dir, const char *want, const char *gone) {
  char name[64], path[700];
  committed_dir(dir, name, sizeof name);
  if (strcmp(name, want) != 0) note(rep, "%s: latest.json names %s, expected %s", dir, name, want);
  snprintf(path, sizeof path, "%s/%s", dir, gone);
  if (access(path, F_OK) == 0) note(rep, "%s still exists after the commit", path);
}

/* Each rank alone (MPI_COMM_SELF) in its own directory. */
static void test_protocol_and_errors(void **unused) {
  (void)unused;
  char base[512], dir[600], path[700];
  snprintf(base, sizeof base, "%s/errors-%d", g_root, world_rank());
  report rep = {0};
  static run r;
  ml_run_state st;
  open_on(&r, MPI_COMM_SELF, 1, 1, "llama_untied");
  snprintf(dir, sizeof dir, "%s/empty", base);
  mkdir(base, 0755);
  mkdir(dir, 0755);
  ml_error_clear();
  expect_error(&rep, ml_run_load(&r.e, dir, &st), "load from an empty directory",
               "no committed checkpoint", "latest.json");

  /* a step directory that never committed is ignored, then replaced */
  snprintf(dir, sizeof dir, "%s/ck", base);
  ml_run_state s2 = ST2;
  save_or_fail(&r, dir, &s2);
  snprintf(path, sizeof path, "%s/step-00000003", dir);
  mkdir(path, 0755);
  snprintf(path, sizeof path, "%s/step-00000003/rank-00000.safetensors", dir);
  FILE *f = fopen(path, "w");
  fputs("torn", f);
  fclose(f);
  load_or_fail(&r, dir, &st);
  check_state(&rep, &st, &r.e, 0);
  ml_run_state s3 = {3, 12, 1, 40};
  save_or_fail(&r, dir, &s3);
  check_committed(&rep, dir, "step-00000003", "step-00000002");
  /* a second save at the committed step never rewrites it */
  save_or_fail(&r, dir, &s3);
  check_committed(&rep, dir, "step-00000003.b", "step-00000003");
  save_or_fail(&r, dir, &s3);
  check_committed(&rep, dir, "step-00000003", "step-00000003.b");
  save_or_fail(&r, dir, &s2);
  load_or_fail(&r, dir, &st);
  check_state(&rep, &st, &r.e, 0);

  static run other;
  open_on(&other, MPI_COMM_SELF, 1, 1, "llama_tied");
  expect_error(&rep, ml_run_load(&other.e, dir, &st), "load into another config", "config.json",
               "'vocab_size' is 300");
  run_close(&other);

  edit_metadata(dir, shrink_norm);
  expect_error(&rep, ml_run_load(&r.e, dir, &st), "shape mismatch", "[63]", "[64]");
  edit_metadata(dir, drop_norm);
  expect_error(&rep, ml_run_load(&r.e, dir, &st), "missing tensor",
               "no tensor 'model.norm.weight'", NULL);

  snprintf(dir, sizeof dir, "%s/trunc", base);
  save_or_fail(&r, dir, &s2);
  char name[64];
  snprintf(path, sizeof path, "%s/%s/rank-00000.safetensors", dir,
           committed_dir(dir, name, sizeof name));
  struct stat sb;
  if (stat(path, &sb) != 0 || truncate(path, sb.st_size / 2) != 0) fail_msg("truncate %s", path);
  expect_error(&rep, ml_run_load(&r.e, dir, &st), "truncated rank file", "rank-00000.safetensors",
               NULL);
  char out[600];
  snprintf(out, sizeof out, "%s/hf", base);
  expect_error(&rep, ml_run_export(dir, out, 0, ML_EXPORT_DTYPE_SOURCE), "export of a truncated checkpoint",
               "rank-00000.safetensors", NULL);
  run_close(&r);
  agree(&rep, "protocol/error mismatches");
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb, (void)flag, (void)ftw;
  return remove(p);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  if (argc == 4 && !strncmp(argv[3], "ep=", 3)) g_ep = atoi(argv[3] + 3);
  if ((argc != 3 && argc != 4) || (argc == 4 && g_ep < 1)) {
    fprintf(stderr, "usage: test_runckpt FIXTURE TP [ep=P]\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  g_tp = atoi(argv[2]);
  if (world_rank() == 0) {
    snprintf(g_root, sizeof g_root, "/tmp/ml_runckpt_XXXXXX");
    if (!mkdtemp(g_root)) MPI_Abort(MPI_COMM_WORLD, 2);
  }
  MPI_Bcast(g_root, sizeof g_root, MPI_CHAR, 0, MPI_COMM_WORLD);
  const struct CMUnitTest tests[] = {
      held_test(test_resume_same_mesh),
      held_test(test_reshard),
      held_test(test_hsdp),
      held_test(test_export),
      held_test(test_protocol_and_errors),
  };
  int failed = cmocka_run_group_tests(tests, NULL, NULL);
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (world_rank() == 0) nftw(g_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
  MPI_Finalize();
  return any ? 1 : 0;
}
