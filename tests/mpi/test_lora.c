/* LoRA (engine/lora.h, model/lora.h):
 * `mpiexec -n N test_lora LORA_FIXTURE BASE_FIXTURE [dpr=R] [cp=C] [tp=T] [sp] [ep=E]
 * [targets=LIST]` (the mesh: R HSDP replicas of dp_shard N / (R·C·T), context parallel C, tensor
 * parallel T with the auto plan's LoRA-aware placements, sp: sequence parallel, E: expert
 * parallelism of a mixture-of-experts model; targets: the seeded runs' lora_targets, all-linear
 * unless given). The fixture (tools/gen_lora_fixtures.py) is a PEFT adapter with non-zero
 * lora_A and lora_B on the base fixture, and PEFT's float64 loss,
 * log-probs and adapter gradients. The mesh (dp_shard = N) and one rank
 * (MPI_COMM_SELF) must reproduce them within tolerance.h §8 and each
 * other; AdamW steps must leave every base weight bitwise as it was and
 * move the adapters; a seeded start (lora_B = 0) must give the base
 * model's loss bit for bit, lora_A within Kaiming-uniform's bound; bad
 * options and adapter configs fail with messages naming the field; a run
 * checkpoint resumes bit for bit; the PEFT export is PEFT's own adapter file
 * (keys, shapes, values) with its config's fields, and the merged export
 * PEFT's merge_and_unload within the rounding bound derived there; the
 * LoRA streams (ml_lora_stream: refit's adapters-only and merged views) are
 * those exports' tensors bit for bit; greedy generation on the LoRA engine
 * (its unmerged forward, x·W^T + s·(x·A^T)·B^T) gives the tokens of the
 * merged export opened as a plain model on the same mesh, log-probs within
 * the pair bound derived in test_generate_merged (cp > 1: generation is
 * refused there, the test says so and passes). */
#define _XOPEN_SOURCE 700 /* symlink, getpid, nftw */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <ftw.h>
#include <errno.h>
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
#include "ckpt/lora_export.h"
#include "ckpt/runckpt.h"
#include "engine/generate.h"
#include "io/safetensors.h"
#include "parity_util.h"

static const char *g_fixture, *g_base;
static int g_dpr = 1; /* HSDP replicas of the mesh runs (dpr=N) */
static int g_cp = 1;  /* context parallelism of the mesh runs (cp=N) */
static int g_tp = 1;  /* tensor parallelism of the mesh runs (tp=N) */
static bool g_sp;     /* sequence parallelism of the mesh runs (sp) */
static const char *g_targets = "all-linear"; /* the seeded runs' targets (targets=LIST) */
static int g_ep = 1;  /* expert parallelism of the mesh runs (ep=N) */
static char g_base_dir[512];

static void st_release(void *p) { ml_st_close(p); }

/* Engine options for the fixture's adapter, or (adapter NULL) a seeded
 * rank-4 all-linear LoRA. */
static ml_engine_opts lora_opts(const char *adapter) {
  ml_engine_opts o = ml_engine_opts_default();
  o.lora = (ml_lora_opts){.adapter = adapter, .alpha = 8, .seed = 5};
  if (!adapter) {
    o.lora.rank = 4;
    o.lora.targets = g_targets;
  }
  return o;
}

/* The engine with o on the mesh of the command line (dpr, cp, tp, sp). */
static void mesh_open(run *r, const ml_engine_opts *o) {
  ml_engine_opts m = *o;
  m.sequence_parallel = g_sp;
  run_open_ep(r, MPI_COMM_WORLD, g_dpr, g_cp, g_tp, g_ep, &m, g_base_dir, NULL, NULL);
}

static double step(run *r, const fixture *fx) {
  int dp = r->mesh.groups[ML_GROUP_DP].size, d = r->mesh.groups[ML_GROUP_DP].rank;
  int64_t Bl = fx->B / dp;
  double loss;
  ml_engine_zero_grad(&r->e);
  if (ml_engine_forward_backward(&r->e, fx->ids + d * Bl * fx->S, fx->mask + d * Bl * fx->S, Bl,
                                 fx->S, fx->targets, &loss))
    fail_msg("step: %s", ml_error_msg());
  return loss;
}

/* PEFT's loss, log-probs and adapter gradients, on the mesh and on one rank. */
static void test_parity(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  ml_engine_opts o = lora_opts(fx.dir);
  static run one, mesh;
  run_open(&one, MPI_COMM_SELF, 1, 1, &o, g_base_dir);
  mesh_open(&mesh, &o);
  assert_int_equal(fx.B % mesh.mesh.groups[ML_GROUP_DP].size, 0);
  double r = (double)one.e.lora.rank;
  tol_model tm = tol_model_of(&mesh, fx.S, fx.B * fx.S);
  double l1 = step(&one, &fx), lm = step(&mesh, &fx);
  double e1 = fabs(l1 - fx.loss) / fx.loss, em = fabs(lm - fx.loss) / fx.loss;
  double e1m = fabs(lm - l1) / fabs(l1);
  double tl = tol_lora_vs_ref(&tm, TOL_LOSS, r), tp = tol_lora_pair(&tm, TOL_LOSS, r);
  if (rank0())
    printf("loss: peft %.9f one %.9f mesh %.9f (rel err %.3g, %.3g, bound %.3g; pair %.3g, "
           "bound %.3g)\n", fx.loss, l1, lm, e1, em, tl, e1m, tp);
  assert_true(e1 <= tl && em <= tl && e1m <= tp);

  float **g1 = export_all(&one, ML_EXPORT_GRADS), **gm = export_all(&mesh, ML_EXPORT_GRADS);
  char path[600];
  snprintf(path, sizeof path, "%s/grads.safetensors", fx.dir);
  static ml_st_file ref;
  if (ml_st_open(path, &ref)) fail_msg("%s", ml_error_msg());
  hold(&ref, st_release);
  double tg = tol_lora_vs_ref(&tm, TOL_GRADS, r), tgp = tol_lora_pair(&tm, TOL_GRADS, r);
  double worst = 0, worst_pair = 0;
  size_t adapters = 0;
  for (int i = 0; i < mesh.e.model.n_params; i++) {
    const ml_param *p = ml_engine_export_param(&mesh.e, i);
    int64_t n = p->shape[0] * p->shape[1];
    /* a fused module's lora_B (Phi-3's qkv_proj): this part's rows of PEFT's one tensor */
    const ml_st_tensor *t = ml_st_find(&ref, p->adapter ? p->key : p->name);
    if (!p->adapter) { /* frozen base weight: no gradient at all */
      assert_null(t);
      for (int64_t k = 0; k < n; k++)
        if (gm[i][k] != 0.0f) fail_msg("%s: frozen base weight has a gradient", p->name);
      continue;
    }
    if (!t) fail_msg("grads.safetensors has no %s", p->key);
    adapters += p->key_row0 == 0; /* each of PEFT's tensors once */
    float *want = malloc(sizeof(float) * (size_t)n);
    hold(want, free);
    if (ml_st_read_block(t, p->key_row0, p->shape[0], 0, p->shape[1], want))
      fail_msg("%s: %s", p->name, ml_error_msg());
    double eh = fmax(rel_l2(gm[i], want, n), rel_l2(g1[i], want, n)), ep = rel_l2(gm[i], g1[i], n);
    worst = fmax(worst, eh);
    worst_pair = fmax(worst_pair, ep);
    if (eh > tg || ep > tgp)
      fail_msg("%s: grad rel L2 vs peft %.3g (bound %.3g), mesh vs one %.3g (bound %.3g)",
               p->name, eh, tg, ep, tgp);
    unhold(want);
    free(want);
  }
  assert_int_equal(adapters, ref.n); /* every adapter of the fixture was built */
  if (rank0())
    printf("adapter grads (%zu): worst rel L2 vs peft %.3g (bound %.3g), mesh vs one %.3g "
           "(bound %.3g)\n", adapters, worst, tg, worst_pair, tgp);

  int64_t n = fx.B * (fx.S - 1);
  float *lp = malloc(sizeof(float) * (size_t)n);
  hold(lp, free);
  if (ml_engine_logprobs(&mesh.e, fx.ids, fx.B, fx.S, lp)) fail_msg("%s", ml_error_msg());
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) {
    double d = lp[i] - fx.logprobs[i];
    num += d * d;
    den += fx.logprobs[i] * fx.logprobs[i];
  }
  double rel = sqrt(num / den);
  double tlp = tol_lora_vs_ref(&tm, TOL_LOGPROBS, r);
  if (rank0()) printf("logprobs: rel L2 vs peft %.3g (bound %.3g)\n", rel, tlp);
  assert_true(rel <= tlp);
  unhold(lp);
  free(lp);
  unhold(&ref);
  ml_st_close(&ref);
  free_all(g1);
  free_all(gm);
  run_close(&mesh);
  run_close(&one);
  fixture_free(&fx);
}

/* Two AdamW steps: every base weight bitwise as loaded, every adapter moved. */
static void test_base_unchanged(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  ml_engine_opts o = lora_opts(fx.dir);
  static run mesh;
  mesh_open(&mesh, &o);
  float **before = export_all(&mesh, ML_EXPORT_PARAMS);
  ml_adamw_cfg adam = {1e-2, 0.9, 0.999, 1e-8, 0.1};
  for (int s = 0; s < 2; s++) {
    step(&mesh, &fx);
    if (ml_engine_adamw(&mesh.e, &adam)) fail_msg("adamw: %s", ml_error_msg());
  }
  float **after = export_all(&mesh, ML_EXPORT_PARAMS);
  int moved = 0, kept = 0;
  for (int i = 0; i < mesh.e.model.n_params; i++) {
    const ml_param *p = ml_engine_export_param(&mesh.e, i);
    size_t bytes = sizeof(float) * (size_t)(p->shape[0] * p->shape[1]);
    bool same = memcmp(before[i], after[i], bytes) == 0;
    if (!p->adapter && !same) fail_msg("%s: a frozen base weight changed", p->name);
    if (p->adapter && same) fail_msg("%s: the adapter did not train", p->name);
    moved += p->adapter;
    kept += !p->adapter;
  }
  if (rank0()) printf("2 AdamW steps: %d base weights bitwise unchanged, %d adapters moved\n",
                      kept, moved);
  free_all(after);
  free_all(before);
  run_close(&mesh);
  fixture_free(&fx);
}

/* A seeded start: lora_B zero, so the loss is the base model's bit for bit
 * (fp32 and bf16 parameters);
 * lora_A within U(-1/sqrt(in), 1/sqrt(in)), not all zero, the same on one
 * rank and on the mesh. */
static void test_seeded(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  ml_engine_opts o = lora_opts(NULL), plain = ml_engine_opts_default();
  static run base, lora, one;
  for (int bf16 = 0; bf16 < 2; bf16++) { /* and with bf16 parameters: B·u = 0 exactly */
    ml_engine_opts ob = o, pb = plain;
    ob.fsdp.param_dtype = pb.fsdp.param_dtype = bf16 ? ML_BF16 : ML_F32;
    mesh_open(&base, &pb);
    mesh_open(&lora, &ob);
    double lb = step(&base, &fx), ll = step(&lora, &fx);
    if (rank0()) printf("seeded LoRA%s: loss %.9g, base %.9g\n", bf16 ? " (bf16)" : "", ll, lb);
    assert_memory_equal(&lb, &ll, sizeof lb);
    run_close(&lora);
    run_close(&base);
  }
  mesh_open(&lora, &o);
  run_open(&one, MPI_COMM_SELF, 1, 1, &o, g_base_dir);
  float **pm = export_all(&lora, ML_EXPORT_PARAMS), **p1 = export_all(&one, ML_EXPORT_PARAMS);
  for (int i = 0; i < lora.e.model.n_params; i++) {
    const ml_param *p = ml_engine_export_param(&lora.e, i);
    if (!p->adapter) continue;
    int64_t n = p->shape[0] * p->shape[1];
    assert_memory_equal(pm[i], p1[i], sizeof(float) * (size_t)n);
    bool is_a = strstr(p->name, ".lora_A.") != NULL;
    float bound = (float)(1.0 / sqrt((double)p->shape[1]));
    double sumsq = 0;
    for (int64_t k = 0; k < n; k++) {
      if (!is_a && pm[i][k] != 0.0f) fail_msg("%s[%lld] = %g; expected 0", p->name,
                                               (long long)k, (double)pm[i][k]);
      if (fabsf(pm[i][k]) > bound) fail_msg("%s[%lld] = %g beyond the bound %g", p->name,
                                             (long long)k, (double)pm[i][k], (double)bound);
      sumsq += (double)pm[i][k] * pm[i][k];
    }
    /* U(-b, b) has variance b²/3: n draws sum to n·b²/3, far above n·b²/30 */
    if (is_a && sumsq < n * (double)bound * bound / 30.0)
      fail_msg("%s: sum of squares %g; expected about %g (U(-b, b))", p->name, sumsq,
               n * (double)bound * bound / 3.0);
  }
  free_all(p1);
  free_all(pm);
  run_close(&one);
  run_close(&lora);
  fixture_free(&fx);
}

/* Opening checkpoint dir with o fails with a message containing `want`. */
static void expect_error_on(const char *dir, const ml_engine_opts *o, const char *want) {
  static run r;
  memset(&r, 0, sizeof r);
  int rc = ml_mesh_create(MPI_COMM_SELF, 1, 0, 1, 1, NULL, NULL, &r.mesh);
  if (rc == 0) rc = ml_engine_open(&r.e, &r.mesh, dir, o);
  const char *msg = rc ? ml_error_msg() : "";
  if (rank0()) printf("expected error: %s\n", msg);
  if (rc == 0 || !strstr(msg, want))
    fail_msg("expected an error containing '%s', got rc %d: %s", want, rc, msg);
  ml_error_clear(); /* the next message is the next failure's (the first one wins) */
  run_release(&r);
}

/* Opening the base fixture with o fails with a message containing `want`. */
static void expect_error(const ml_engine_opts *o, const char *want) {
  expect_error_on(g_base_dir, o, want);
}

/* adapter_config.json of the fixture with `field` set to `value` (JSON) in a
 * fresh directory beside a link to its safetensors; returns the directory. */
static const char *edited_adapter(const char *fxdir, const char *field, const char *value) {
  static char dir[700];
  char src[800], dst[800];
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  snprintf(dir, sizeof dir, "/tmp/meshlm_lora_test_%d_%d", (int)getpid(), rank);
  mkdir(dir, 0700);
  snprintf(src, sizeof src, "%s/adapter_model.safetensors", fxdir);
  snprintf(dst, sizeof dst, "%s/adapter_model.safetensors", dir);
  unlink(dst);
  if (symlink(src, dst)) fail_msg("symlink %s: %s", dst, strerror(errno));
  snprintf(src, sizeof src, "%s/adapter_config.json", fxdir);
  snprintf(dst, sizeof dst, "%s/adapter_config.json", dir);
  json_t *c = json_load_file(src, 0, NULL), *v = json_loads(value, JSON_DECODE_ANY, NULL);
  if (!c || !v || json_object_set_new(c, field, v) || json_dump_file(c, dst, 0))
    fail_msg("could not write %s", dst);
  json_decref(c);
  return dir;
}

/* Remove what edited_adapter wrote. */
static void remove_edited(const char *dir) {
  char path[800];
  snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
  unlink(path);
  snprintf(path, sizeof path, "%s/adapter_config.json", dir);
  unlink(path);
  rmdir(dir);
}

static void test_errors(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  ml_engine_opts o = lora_opts(NULL);
  o.lora.dropout = 1.0;
  expect_error(&o, "lora_dropout (--lora-dropout) 1: expected a probability in [0, 1)");
  o = lora_opts(NULL);
  o.lora.targets = "o_proj,qq_proj";
  expect_error(&o, "target module 'qq_proj' not found");
  o = lora_opts(NULL);
  o.lora.rank = -2;
  expect_error(&o, "lora_rank (--lora-rank) -2");
  o = lora_opts(NULL);
  o.lora.alpha = 0;
  expect_error(&o, "lora_alpha (--lora-alpha) 0");
  static const char *const bad[][3] = {
      {"use_dora", "true", "field 'use_dora' is true"},
      {"modules_to_save", "[\"lm_head\"]", "field 'modules_to_save'"},
      {"bias", "\"all\"", "field 'bias' is 'all'"},
      {"rank_pattern", "{\"q_proj\": 8}", "field 'rank_pattern'"},
      {"alpha_pattern", "{\"q_proj\": 8}", "field 'alpha_pattern'"},
      {"peft_type", "\"IA3\"", "field 'peft_type' is 'IA3'"},
      {"target_modules", "\".*proj\"", "regular expression"},
      {"r", "8", "]; expected [8, "}, /* [4, hidden] of the fixture against r = 8 rows */
      {"lora_bias", "true", "field 'lora_bias' is true"},
      {"exclude_modules", "[\"q_proj\"]", "field 'exclude_modules'"},
      {"layers_to_transform", "[0]", "field 'layers_to_transform' is [0]"},
      {"fan_in_fan_out", "true", "field 'fan_in_fan_out' is true"},
      {"layer_replication", "[[0, 1]]", "field 'layer_replication'"},
      {"target_parameters", "[\"mlp.experts.gate_up_proj\"]", "field 'target_parameters'"},
      {"trainable_token_indices", "[1, 2]", "field 'trainable_token_indices'"},
      {"use_qalora", "true", "field 'use_qalora' is true"},
      {"alora_invocation_tokens", "[5]", "field 'alora_invocation_tokens'"},
      {"use_bdlora", "{\"a\": 1}", "field 'use_bdlora'"},
      {"velora_config", "{\"a\": 1}", "field 'velora_config'"},
      {"monteclora_config", "{\"a\": 1}", "field 'monteclora_config'"},
      {"arrow_config", "{\"a\": 1}", "field 'arrow_config'"},
      {"kasa_config", "{\"a\": 1}", "field 'kasa_config'"},
      {"lora_dropout", "1.5", "lora_dropout (--lora-dropout, or the adapter's field) 1.5"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    const char *dir = edited_adapter(fx.dir, bad[i][0], bad[i][1]);
    o = lora_opts(dir);
    expect_error(&o, bad[i][2]);
    remove_edited(dir);
  }
  o = lora_opts(fx.dir);
  o.lora.rank = 8;
  expect_error(&o, "the adapter");
  o = lora_opts(fx.dir);
  o.lora.dropout = 0.2;
  expect_error(&o, "lora_dropout (--lora-dropout) 0.2 with the adapter");
  /* a part of a fused checkpoint linear (PEFT sees Phi-3's qkv_proj, gate_up_proj only) and
     mixture-of-experts models */
  char dir[600];
  snprintf(dir, sizeof dir, "%s/tests/fixtures/phi3", ML_SOURCE_DIR);
  static const char *const fused[][2] = {
      {"q_proj", "target module 'q_proj' is a part of the fused "
                 "model.layers.0.self_attn.qkv_proj (one checkpoint linear for q_proj, k_proj, "
                 "v_proj), which PEFT adapts as one module; expected 'qkv_proj'"},
      {"o_proj,up_proj", "target module 'up_proj' is a part of the fused "
                         "model.layers.0.mlp.gate_up_proj (one checkpoint linear for gate_proj, "
                         "up_proj), which PEFT adapts as one module; expected 'gate_up_proj'"}};
  for (size_t i = 0; i < sizeof fused / sizeof fused[0]; i++) {
    o = lora_opts(NULL);
    o.lora.targets = fused[i][0];
    expect_error_on(dir, &o, fused[i][1]);
  }
  snprintf(dir, sizeof dir, "%s/tests/fixtures/qwen3_moe", ML_SOURCE_DIR);
  o = lora_opts(NULL);
  o.lora.targets = "all-linear";
  expect_error_on(dir, &o, "lora_targets (--lora-targets) 'all-linear': model.layers.1.mlp.gate "
                           "is a linear of the mixture-of-experts block (its router or an expert)");
  o.lora.targets = "o_proj,up_proj";
  expect_error_on(dir, &o, "model.layers.1.mlp.experts.0.up_proj is a linear of the "
                           "mixture-of-experts block");
  /* a shared expert's gate (Qwen2-MoE) is part of the block too */
  snprintf(dir, sizeof dir, "%s/tests/fixtures/qwen2_moe", ML_SOURCE_DIR);
  o.lora.targets = "shared_expert_gate";
  expect_error_on(dir, &o, "model.layers.1.mlp.shared_expert_gate is a linear of the "
                           "mixture-of-experts block");
  fixture_free(&fx);
}

/* LoRA dropout p = 0.1 (the fixture's adapter with its lora_dropout set): the mask is a
 * function of global coordinates (model/lora_drop.h), so the mesh draws one rank's mask and
 * the two agree within the pair bound of two orders of one fp32 computation (tolerance.h §8,
 * the dropout's scaling one more rounding of lora_A's input, in series with the GEMM it
 * feeds: covered by tol_k_lora's 2 roundings per adapted linear beside the r-term sum);
 * the dropout is on (the loss differs from p = 0's) and off in scoring (log-probs bitwise
 * p = 0's on the same engine geometry). */
static void test_dropout(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  const char *dir = edited_adapter(fx.dir, "lora_dropout", "0.1");
  ml_engine_opts o = lora_opts(dir), o0 = lora_opts(fx.dir);
  static run one, mesh, plain;
  run_open(&one, MPI_COMM_SELF, 1, 1, &o, g_base_dir);
  mesh_open(&mesh, &o);
  mesh_open(&plain, &o0);
  assert_true(one.e.lora.dropout == 0.1 && mesh.e.lora.dropout == 0.1);
  double r = (double)one.e.lora.rank;
  tol_model tm = tol_model_of(&mesh, fx.S, fx.B * fx.S);
  double l1 = step(&one, &fx), lm = step(&mesh, &fx), l0 = step(&plain, &fx);
  double el = fabs(lm - l1) / fabs(l1), tl = tol_lora_pair(&tm, TOL_LOSS, r);
  float **g1 = export_all(&one, ML_EXPORT_GRADS), **gm = export_all(&mesh, ML_EXPORT_GRADS);
  double tg = tol_lora_pair(&tm, TOL_GRADS, r), worst = 0;
  for (int i = 0; i < mesh.e.model.n_params; i++) {
    const ml_param *p = ml_engine_export_param(&mesh.e, i);
    if (!p->adapter) continue;
    double e = rel_l2(gm[i], g1[i], p->shape[0] * p->shape[1]);
    worst = fmax(worst, e);
    if (e > tg) fail_msg("%s: dropout grad rel L2 mesh vs one %.3g (bound %.3g)", p->name, e, tg);
  }
  if (rank0())
    printf("dropout 0.1: loss one %.9f mesh %.9f (rel %.3g, bound %.3g; p = 0: %.9f), adapter "
           "grads mesh vs one worst rel L2 %.3g (bound %.3g)\n", l1, lm, el, tl, l0, worst, tg);
  assert_true(el <= tl);
  assert_true(lm != l0); /* the mask took effect */
  int64_t n = fx.B * (fx.S - 1);
  float *lp = malloc(sizeof(float) * (size_t)n), *lp0 = malloc(sizeof(float) * (size_t)n);
  assert_true(lp && lp0);
  if (ml_engine_logprobs(&mesh.e, fx.ids, fx.B, fx.S, lp) ||
      ml_engine_logprobs(&plain.e, fx.ids, fx.B, fx.S, lp0))
    fail_msg("%s", ml_error_msg());
  assert_memory_equal(lp, lp0, sizeof(float) * (size_t)n);
  free(lp0);
  free(lp);
  free_all(gm);
  free_all(g1);
  run_close(&plain);
  run_close(&mesh);
  run_close(&one);
  remove_edited(dir);
  fixture_free(&fx);
}

/* A per-rank-agreed scratch directory name under /tmp (world rank 0's pid). */
static const char *scratch(const char *what) {
  static char dir[256];
  int pid = (int)getpid();
  MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
  snprintf(dir, sizeof dir, "/tmp/meshlm_lora_%s_%d", what, pid);
  return dir;
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  return remove(path);
}

/* Remove a scratch directory and everything under it (exports, run checkpoints). */
static void remove_tree(const char *dir) { nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS); }

/* Resume: a run checkpoint after one step, loaded into a fresh engine
 * (holding the adapter's initial values and zero AdamW state until the
 * load), then one more step on each: adapters, AdamW state and the loss
 * bit for bit. */
static void resume_with(const fixture *fx, const char *adapter) {
  ml_engine_opts o = lora_opts(adapter);
  static run a, b;
  mesh_open(&a, &o);
  ml_adamw_cfg adam = {1e-2, 0.9, 0.999, 1e-8, 0.1};
  step(&a, fx);
  if (ml_engine_adamw(&a.e, &adam)) fail_msg("adamw: %s", ml_error_msg());
  const char *dir = scratch("resume");
  ml_run_state st = {.step = 1}, got;
  if (ml_run_save(&a.e, dir, &st)) fail_msg("save: %s", ml_error_msg());
  mesh_open(&b, &o);
  if (ml_run_load(&b.e, dir, &got)) fail_msg("load: %s", ml_error_msg());
  double la = step(&a, fx), lb = step(&b, fx);
  assert_memory_equal(&la, &lb, sizeof la);
  if (ml_engine_adamw(&a.e, &adam) || ml_engine_adamw(&b.e, &adam))
    fail_msg("adamw: %s", ml_error_msg());
  for (ml_export_what w = ML_EXPORT_PARAMS; w <= ML_EXPORT_EXP_AVG_SQ; w++) {
    float **ta = export_all(&a, w), **tb = export_all(&b, w);
    for (int i = 0; i < a.e.model.n_params; i++) {
      const ml_param *p = ml_engine_export_param(&a.e, i);
      if (memcmp(ta[i], tb[i], sizeof(float) * (size_t)(p->shape[0] * p->shape[1])) != 0)
        fail_msg("%s (state %d) differs after the resumed step", p->name, (int)w);
    }
    free_all(tb);
    free_all(ta);
  }
  if (rank0())
    printf("resume (lora_dropout %g): loss %.9g and every adapter, exp_avg, exp_avg_sq bitwise "
           "equal\n", a.e.lora.dropout, la);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank0()) remove_tree(dir);
  run_close(&b);
  run_close(&a);
}

/* Resume (resume_with) with the fixture's adapter, and with it under LoRA dropout p = 0.1:
 * the masks are keyed by the optimizer step, which the resume restores, and the micro-batch,
 * which each step counts from 0, so the resumed step draws the uninterrupted run's masks. */
static void test_resume(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  resume_with(&fx, fx.dir);
  const char *dir = edited_adapter(fx.dir, "lora_dropout", "0.1");
  resume_with(&fx, dir);
  remove_edited(dir);
  fixture_free(&fx);
}

/* The PEFT export's adapter_config.json: the fields PEFT reads, as the fixture's. */
static void check_config(const char *dir, const char *fxdir) {
  char path[1024];
  snprintf(path, sizeof path, "%s/adapter_config.json", dir);
  json_t *c = json_load_file(path, 0, NULL);
  snprintf(path, sizeof path, "%s/adapter_config.json", fxdir);
  json_t *want = json_load_file(path, 0, NULL);
  assert_non_null(c);
  assert_non_null(want);
  static const char *const same[] = {"peft_type", "task_type", "r", "lora_alpha", "lora_dropout",
                                     "use_rslora", "bias", "use_dora", "fan_in_fan_out",
                                     "modules_to_save", "rank_pattern", "alpha_pattern"};
  for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
    json_t *g = json_object_get(c, same[i]), *w = json_object_get(want, same[i]);
    bool eq = json_equal(g, w) || (json_is_number(g) && json_is_number(w) &&
                                   json_number_value(g) == json_number_value(w));
    if (!eq) fail_msg("adapter_config.json: field %s differs from PEFT's", same[i]);
  }
  /* target_modules: the same set of linear names (PEFT writes a set's order, and resolves
   * all-linear to full module names, whose last components ours lists) */
  json_t *tg = json_object_get(c, "target_modules"), *tw = json_object_get(want, "target_modules");
  for (int dir = 0; dir < 2; dir++) {
    json_t *from = dir ? tg : tw, *to = dir ? tw : tg;
    for (size_t i = 0; i < json_array_size(from); i++) {
      const char *name = json_string_value(json_array_get(from, i)), *leaf = strrchr(name, '.');
      leaf = leaf ? leaf + 1 : name;
      bool found = false;
      for (size_t j = 0; j < json_array_size(to) && !found; j++) {
        const char *t = json_string_value(json_array_get(to, j)), *tl = strrchr(t, '.');
        found = strcmp(tl ? tl + 1 : t, leaf) == 0;
      }
      if (!found) fail_msg("adapter_config.json: target_modules: %s in %s only", name,
                           dir ? "ours" : "PEFT's");
    }
  }
  assert_string_equal(json_string_value(json_object_get(c, "base_model_name_or_path")),
                      g_base_dir);
  json_decref(want);
  json_decref(c);
}

/* The PEFT export of the fixture's adapter (no step) holds PEFT's own file's
 * keys, shapes, dtype and values bit for bit; the merged export is PEFT's
 * merge_and_unload within the rounding bound below, every other tensor the
 * base's bitwise. */
static void test_export(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  ml_engine_opts o = lora_opts(fx.dir);
  static run a;
  mesh_open(&a, &o);
  char peft[300], merged[300], path[1024];
  snprintf(peft, sizeof peft, "%s", scratch("peft"));
  snprintf(merged, sizeof merged, "%s", scratch("merged"));
  if (ml_engine_save_hf(&a.e, peft, ML_EXPORT_DTYPE_SOURCE) ||
      ml_engine_save_lora(&a.e, merged, true, ML_EXPORT_DTYPE_SOURCE))
    fail_msg("export: %s", ml_error_msg());
  if (rank0()) {
    check_config(peft, fx.dir);
    static ml_st_file got, want, mg, mw, base;
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", peft);
    if (ml_st_open(path, &got)) fail_msg("%s", ml_error_msg());
    hold(&got, st_release);
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", fx.dir);
    if (ml_st_open(path, &want)) fail_msg("%s", ml_error_msg());
    hold(&want, st_release);
    assert_int_equal(got.n, want.n);
    for (size_t i = 0; i < want.n; i++) {
      const ml_st_tensor *w = &want.tensors[i], *g = ml_st_find(&got, w->name);
      if (!g) fail_msg("the PEFT export lacks %s", w->name);
      assert_int_equal(g->dtype, w->dtype);
      assert_int_equal(g->ndim, 2);
      assert_memory_equal(g->shape, w->shape, sizeof w->shape[0] * 2);
      assert_memory_equal(g->data, w->data, w->nbytes);
    }
    snprintf(path, sizeof path, "%s/model.safetensors", merged);
    if (ml_st_open(path, &mg)) fail_msg("%s", ml_error_msg());
    hold(&mg, st_release);
    snprintf(path, sizeof path, "%s/merged.safetensors", fx.dir);
    if (ml_st_open(path, &mw)) fail_msg("%s", ml_error_msg());
    hold(&mw, st_release);
    snprintf(path, sizeof path, "%s/model.safetensors", g_base_dir);
    if (ml_st_open(path, &base)) fail_msg("%s", ml_error_msg());
    hold(&base, st_release);
    assert_int_equal(mg.n, base.n);
    double worst = 0;
    for (size_t i = 0; i < mg.n; i++) {
      const ml_st_tensor *g = &mg.tensors[i], *b = ml_st_find(&base, g->name);
      const ml_st_tensor *w = ml_st_find(&mw, g->name);
      assert_non_null(b);
      assert_int_equal(g->nbytes, b->nbytes);
      if (!w) { /* not adapted: the base's bytes */
        assert_memory_equal(g->data, b->data, b->nbytes);
        continue;
      }
      /* merged = fp32(W + s·Σ_r B·A): ours sums the R products in double, PEFT's reference
       * in float64 matmul order; both exact sums of the same fp32 inputs differ by at most
       * gamma64(R + 2)·m, m = |W| + s·Σ|B||A| <= 2·max(|W|, |merged|) + ... here bounded by
       * the larger of |got|, |want| plus |W|'s and each rounding to fp32 adds u·|value|: so
       * |got − want| <= u·(|got| + |want|) + gamma64(R + 2)·(|W| + |got| + |want|)·2. */
      int64_t n = w->numel;
      const float *gv = (const float *)g->data, *wv = (const float *)w->data,
                  *bv = (const float *)b->data;
      double r = (double)a.e.lora.rank, u = TOL_U, g64 = tol_gamma64(r + 2.0);
      for (int64_t k = 0; k < n; k++) {
        double d = fabs((double)gv[k] - wv[k]);
        double bound = u * (fabs(gv[k]) + fabs(wv[k])) +
                       2.0 * g64 * (fabs(bv[k]) + fabs(gv[k]) + fabs(wv[k]));
        if (d > bound) fail_msg("%s[%lld]: merged %.9g, PEFT %.9g (bound %.3g)", g->name,
                                (long long)k, (double)gv[k], (double)wv[k], bound);
        worst = fmax(worst, d / fmax(bound, 1e-30));
      }
    }
    printf("export: PEFT adapter bitwise PEFT's (%zu tensors); merged within %.3g of its bound\n",
           want.n, worst);
    unhold(&base);
    ml_st_close(&base);
    unhold(&mw);
    ml_st_close(&mw);
    unhold(&mg);
    ml_st_close(&mg);
    unhold(&want);
    ml_st_close(&want);
    unhold(&got);
    ml_st_close(&got);
    remove_tree(peft);
    remove_tree(merged);
  }
  run_close(&a);
  fixture_free(&fx);
}

/* Collects the streamed tensors by export index (a copy each). */
typedef struct collected {
  int n;
  float **t;
} collected;

static int collect(void *ctx, int k, const ml_param *p, const float *global) {
  collected *c = ctx;
  size_t bytes = sizeof(float) * (size_t)(p->shape[0] * p->shape[1]);
  if (k < 0 || k >= c->n || c->t[k] || !(c->t[k] = malloc(bytes)))
    return ml_err("collect: tensor %d ('%s') out of range, twice, or no memory", k, p->name);
  memcpy(c->t[k], global, bytes);
  return 0;
}

static void collected_free(void *p) {
  collected *c = p;
  for (int k = 0; k < c->n; k++) free(c->t[k]);
  free(c->t);
}

/* The view streamed to `root` (every rank when < 0) into c (held). */
static void stream_view(run *r, int root, ml_lora_view view, collected *c) {
  c->n = r->e.model.n_params;
  c->t = calloc((size_t)c->n, sizeof *c->t);
  assert_non_null(c->t);
  hold(c, collected_free);
  if (ml_lora_stream(&r->e, root, view, collect, c)) fail_msg("stream: %s", ml_error_msg());
}

/* Tensor `name` of file f equals the fp32 values v bit for bit. */
static void assert_file_tensor(const ml_st_file *f, const char *name, const ml_param *p,
                               const float *v) {
  const ml_st_tensor *t = ml_st_find(f, name);
  if (!t) fail_msg("%s has no tensor %s", f->path, name);
  assert_int_equal(t->dtype, ML_F32);
  assert_int_equal(t->numel, p->shape[0] * p->shape[1]);
  assert_memory_equal(t->data, v, t->nbytes);
}

/* The LoRA streams: the adapters-only view to every rank is the fixture's
 * PEFT file (no step: the loaded values) under PEFT's keys, and moves no
 * base parameter; the merged view to rank 0 is the merged export's every
 * tensor bit for bit (one computation: ml_engine_save_lora writes the
 * same stream, the fixture's source dtype fp32 keeping every bit). */
static void test_streams(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  ml_engine_opts o = lora_opts(fx.dir);
  static run a;
  static collected ad, mg;
  mesh_open(&a, &o);
  char merged[300], path[1024];
  snprintf(merged, sizeof merged, "%s", scratch("stream_merged"));
  if (ml_engine_save_lora(&a.e, merged, true, ML_EXPORT_DTYPE_SOURCE))
    fail_msg("export: %s", ml_error_msg());
  stream_view(&a, -1, ML_LORA_ADAPTERS, &ad);
  stream_view(&a, 0, ML_LORA_MERGED, &mg);
  static ml_st_file peft, mfile;
  snprintf(path, sizeof path, "%s/adapter_model.safetensors", fx.dir);
  if (ml_st_open(path, &peft)) fail_msg("%s", ml_error_msg());
  hold(&peft, st_release);
  int n_ad = 0, n_base = 0;
  for (int k = 0; k < a.e.model.n_params; k++) {
    const ml_param *p = ml_engine_export_param(&a.e, k);
    char key[300];
    snprintf(key, sizeof key, "base_model.model.%s", p->key);
    /* a fused module's lora_B comes whole at its first part's index, PEFT's key and shape */
    ml_param whole = *p;
    whole.shape[0] = p->key_rows;
    if (p->adapter && p->key_row0 == 0) assert_file_tensor(&peft, key, &whole, ad.t[k]);
    else assert_null(ad.t[k]); /* no base parameter, no later part on its own */
    n_ad += p->adapter && p->key_row0 == 0;
  }
  assert_int_equal((size_t)n_ad, peft.n);
  if (rank0()) {
    snprintf(path, sizeof path, "%s/model.safetensors", merged);
    if (ml_st_open(path, &mfile)) fail_msg("%s", ml_error_msg());
    hold(&mfile, st_release);
    for (int k = 0; k < a.e.model.n_params; k++) {
      const ml_param *p = ml_engine_export_param(&a.e, k);
      if (p->adapter) {
        assert_null(mg.t[k]); /* the merged view hands no adapter on */
        continue;
      }
      /* a part of a fused checkpoint tensor: its rows of it */
      const ml_st_tensor *t = ml_st_find(&mfile, p->key);
      if (!t) fail_msg("%s has no tensor %s", mfile.path, p->key);
      size_t row = sizeof(float) * (size_t)p->shape[1];
      assert_memory_equal((const char *)t->data + row * (size_t)p->key_row0, mg.t[k],
                          row * (size_t)p->shape[0]);
      n_base += p->key_row0 == 0;
    }
    assert_int_equal((size_t)n_base, mfile.n);
    printf("streams: %d adapters bitwise PEFT's file, %d merged tensors bitwise the merged "
           "export's\n", n_ad, n_base);
    unhold(&mfile);
    ml_st_close(&mfile);
    remove_tree(merged);
  }
  unhold(&peft);
  ml_st_close(&peft);
  unhold(&mg);
  collected_free(&mg);
  unhold(&ad);
  collected_free(&ad);
  run_close(&a);
  fixture_free(&fx);
}

enum { GEN_PROMPTS = 2, GEN_NEW = 12 };

/* Greedy generation (engine/generate.h) of two prompts cut from the fixture's rows. */
static void gen_greedy(run *r, const fixture *fx, int32_t *tok, int64_t *len, float *lp) {
  int64_t lens[GEN_PROMPTS] = {5, 9};
  int32_t ids[5 + 9];
  memcpy(ids, fx->ids, sizeof(int32_t) * 5);
  memcpy(ids + 5, fx->ids + (fx->B > 1 ? fx->S : 0) + 1, sizeof(int32_t) * 9);
  ml_gen_opts g = {.max_new = GEN_NEW, .n_samples = 1, .sampler = {.greedy = true}};
  if (ml_generate(&r->e, GEN_PROMPTS, lens, ids, &g, tok, len, lp, NULL))
    fail_msg("generate: %s", ml_error_msg());
}

/* Generation on the LoRA engine against its merged export opened as a plain
 * model, on the same mesh. */
static void test_generate_merged(void **state) {
  (void)state;
  if (g_cp > 1) { /* ml_generate refuses cp > 1 (the KV cache holds whole sequences) */
    if (rank0()) printf("generate: cp %d, not run (generation needs cp 1)\n", g_cp);
    return;
  }
  static fixture fx;
  fixture_load(g_fixture, &fx);
  ml_engine_opts o = lora_opts(fx.dir), plain = ml_engine_opts_default();
  plain.sequence_parallel = g_sp;
  static run lora, merged;
  mesh_open(&lora, &o);
  char dir[300];
  snprintf(dir, sizeof dir, "%s", scratch("gen_merged"));
  if (ml_engine_save_lora(&lora.e, dir, true, ML_EXPORT_DTYPE_SOURCE))
    fail_msg("export: %s", ml_error_msg());
  run_open_ep(&merged, MPI_COMM_WORLD, g_dpr, 1, g_tp, g_ep, &plain, dir, NULL, NULL);
  int32_t tl[GEN_PROMPTS * GEN_NEW], tm[GEN_PROMPTS * GEN_NEW];
  int64_t ll[GEN_PROMPTS], lm[GEN_PROMPTS];
  float pl[GEN_PROMPTS * GEN_NEW], pm[GEN_PROMPTS * GEN_NEW];
  gen_greedy(&lora, &fx, tl, ll, pl);
  gen_greedy(&merged, &fx, tm, lm, pm);
  /* Both evaluate the same LoRA model in fp32: the LoRA engine with the adapter terms of
     tolerance.h §8 in its chain (tol_k_lora: r-term up-projection, scaling, add per adapted
     linear), the merged one with W' = fl32(W + s·B·A) — one rounding of each weight
     element (the double sum's own error, gamma64(r + 1), far below u), fewer than the
     adapter terms it replaces on the same chain. Each is within gamma(K)·|.| of the exact
     model with K = tol_model_k + tol_k_lora, so the two within tol_lora_pair. */
  tol_model tmod = tol_model_of(&lora, 9 + GEN_NEW, GEN_PROMPTS * (9 + GEN_NEW));
  double tol = tol_lora_pair(&tmod, TOL_LOGPROBS, (double)lora.e.lora.rank);
  assert_memory_equal(ll, lm, sizeof ll);
  assert_memory_equal(tl, tm, sizeof tl);
  double err = rel_l2(pl, pm, GEN_PROMPTS * GEN_NEW);
  if (rank0())
    printf("generate: LoRA engine vs merged export (dp_replicate %d, tp %d%s): %d greedy tokens "
           "equal, log-probs rel L2 %.3g (bound %.3g)\n", g_dpr, g_tp, g_sp ? " sp" : "",
           GEN_PROMPTS * GEN_NEW, err, tol);
  assert_true(err <= tol);
  run_close(&merged);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank0()) remove_tree(dir);
  run_close(&lora);
  fixture_free(&fx);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  bool usage = argc < 3;
  for (int i = 3; i < argc; i++) {
    if (!strncmp(argv[i], "dpr=", 4)) g_dpr = atoi(argv[i] + 4);
    else if (!strncmp(argv[i], "cp=", 3)) g_cp = atoi(argv[i] + 3);
    else if (!strncmp(argv[i], "tp=", 3)) g_tp = atoi(argv[i] + 3);
    else if (!strcmp(argv[i], "sp")) g_sp = true;
    else if (!strncmp(argv[i], "targets=", 8)) g_targets = argv[i] + 8;
    else if (!strncmp(argv[i], "ep=", 3)) g_ep = atoi(argv[i] + 3);
    else usage = true;
  }
  if (usage || g_dpr < 1 || g_cp < 1 || g_tp < 1 || g_ep < 1) {
    fprintf(stderr, "usage: test_lora LORA_FIXTURE BASE_FIXTURE [dpr=N] [cp=N] [tp=N] [sp] "
                    "[ep=N] [targets=LIST]\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  g_base = argv[2];
  snprintf(g_base_dir, sizeof g_base_dir, "%s/tests/fixtures/%s", ML_SOURCE_DIR, g_base);
  const struct CMUnitTest tests[] = {
      held_test(test_parity),
      held_test(test_base_unchanged),
      held_test(test_seeded),
      held_test(test_errors),
      held_test(test_dropout),
      held_test(test_resume),
      held_test(test_export),
      held_test(test_streams),
      held_test(test_generate_merged),
  };
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}
