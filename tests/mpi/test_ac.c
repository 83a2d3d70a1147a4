/* Activation checkpointing: `mpiexec -n N test_ac FIXTURE TP [sp] [cp=C] [bf16]`.
 * One step (zero_grad + forward_backward) of the fixture on the mesh
 * dp_shard = N / (C·TP) × cp = C × tp = TP (sequence-parallel with `sp`,
 * context-parallel with cp = C; param_dtype bf16 with `bf16`, where the
 * layer above's residual add leaves a layer's gradient cast with its
 * down_proj bf16 dy in the backward scratch, which that layer's recompute
 * must not write: model.h ml_layer_cast) under each
 * ml_ac_mode must give the loss and every gradient of ML_AC_NONE bit for
 * bit: a recompute repeats the same kernels on the same inputs. The tp
 * group's collectives show the recompute: a rerun block (ML_AC_MLP: the
 * MLP; ML_AC_LAYER: attention and MLP) reruns its forward edges, with SP
 * one all-gather (its input) and one reduce-scatter (its output), without
 * one all-reduce (its output), per layer, each moving Tl·H floats
 * (ARCHITECTURE.md §5); ML_AC_SELECTIVE recomputes the attention core alone and
 * adds none. Under context parallelism the attention core is ring
 * attention: ML_AC_LAYER and ML_AC_SELECTIVE rerun its forward, cp − 1
 * send_recv passes of the K/V (2·Tl·kv floats) per layer. The FSDP
 * collectives never change. Rank 0 prints the saved activation
 * bytes of each mode (ml_model_act_bytes). Bitwise (tests/tolerance.h
 * TOL_EXACT): a recompute runs the same kernels on the same inputs. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "engine_run.h"
#include "parity_util.h"
#include "rank_report.h"
#include "engine/engine.h"
#include "ckpt/save.h"

static const char *g_fixture;
static int g_tp, g_cp = 1;
static bool g_sp, g_bf16;

static const char *const mode_names[] = {"none", "mlp", "layer", "selective"};

/* One global gradient. */
typedef struct grad {
  char name[160];
  int64_t n;
  float *g;
} grad;

/* One step's results under one mode. */
typedef struct result {
  double loss;
  grad *grads; /* export order */
  int n;
  int64_t tp_calls[ML_COLL_KINDS], tp_bytes[ML_COLL_KINDS], fsdp_calls[ML_COLL_KINDS];
  int64_t ring_calls, ring_bytes; /* the cp group's send_recv */
  int64_t per_layer, workspace;   /* ml_model_act_bytes */
  int64_t L, H, Tl, kv;           /* layers, hidden, local tokens, local kv floats per token */
} result;

static result g_none;

static void result_free(result *r) {
  unhold(r);
  for (int i = 0; i < r->n; i++) free(r->grads[i].g);
  free(r->grads);
  memset(r, 0, sizeof *r);
}

static void result_release(void *p) { result_free(p); }

/* Open the engine under `ac` and run one step on this dp rank's rows,
 * counting its collectives; export the gradients. */
static void run_mode(ml_ac_mode ac, result *out) {
  static fixture fx; /* held: static, see held.h */
  fixture_load(g_fixture, &fx);
  ml_engine_opts opts = ml_engine_opts_default();
  opts.sequence_parallel = g_sp;
  opts.ac = ac;
  if (g_bf16) opts.fsdp.param_dtype = ML_BF16;
  static run r;
  run_open_mesh(&r, MPI_COMM_WORLD, 1, g_cp, g_tp, &opts, fx.dir, NULL, NULL);
  int dp = ml_mesh_comm(&r.mesh, ML_GROUP_DP)->size;
  assert_int_equal(fx.B % dp, 0);
  int64_t Bl = fx.B / dp, off = ml_mesh_comm(&r.mesh, ML_GROUP_DP)->rank * Bl * fx.S;
  ml_mesh_stats_reset(&r.mesh);
  ml_engine_zero_grad(&r.e);
  if (ml_engine_forward_backward(&r.e, fx.ids + off, fx.mask + off, Bl, fx.S, fx.targets,
                                 &out->loss))
    fail_msg("step (ac %s): %s", mode_names[ac], ml_error_msg());
  const ml_comm_stats *tp = ml_comm_stats_of(ml_mesh_comm(&r.mesh, ML_GROUP_TP));
  const ml_comm_stats *fs = ml_comm_stats_of(ml_mesh_comm(&r.mesh, ML_GROUP_DP_SHARD_CP));
  memcpy(out->tp_calls, tp->calls, sizeof out->tp_calls);
  memcpy(out->tp_bytes, tp->bytes, sizeof out->tp_bytes);
  memcpy(out->fsdp_calls, fs->calls, sizeof out->fsdp_calls);
  const ml_comm_stats *cp = ml_comm_stats_of(ml_mesh_comm(&r.mesh, ML_GROUP_CP));
  out->ring_calls = cp->calls[ML_COLL_SEND_RECV];
  out->ring_bytes = cp->bytes[ML_COLL_SEND_RECV];
  float **g = export_all(&r, ML_EXPORT_GRADS);
  out->n = r.e.model.n_params;
  out->grads = calloc((size_t)out->n, sizeof *out->grads);
  hold(out, result_release);
  for (int i = 0; i < out->n; i++) {
    const ml_param *p = ml_engine_export_param(&r.e, i);
    grad *d = &out->grads[i];
    snprintf(d->name, sizeof d->name, "%s", p->name);
    d->n = p->shape[0] * p->shape[1];
    d->g = malloc(sizeof(float) * (size_t)d->n);
    memcpy(d->g, g[i], sizeof(float) * (size_t)d->n);
  }
  free_all(g);
  ml_model_act_bytes(&r.e.model, r.e.model.B, r.e.model.S, &out->per_layer, &out->workspace);
  out->L = r.e.model.cfg.n_layers;
  out->H = r.e.model.cfg.hidden;
  out->Tl = Bl * r.e.model.S; /* this cp rank's positions */
  out->kv = r.e.model.layers[0].acts.kv.c;
  if (rank0())
    printf("ac %-9s saved activations %lld B/layer x %lld layers + workspace %lld B = %lld B\n",
           mode_names[ac], (long long)out->per_layer, (long long)out->L,
           (long long)out->workspace, (long long)(out->per_layer * out->L + out->workspace));
  run_close(&r);
  fixture_free(&fx);
}

static int setup_none(void **state) {
  (void)state;
  run_mode(ML_AC_NONE, &g_none);
  unhold(&g_none); /* the group's, freed by teardown_none */
  return 0;
}

static int teardown_none(void **state) {
  (void)state;
  result_free(&g_none);
  return release_held(state);
}

/* The tp collectives `blocks` rerun blocks per layer add: with SP an
 * all-gather and a reduce-scatter each, without SP an all-reduce. */
static void expect_rerun(const result *r, int blocks, int64_t calls[ML_COLL_KINDS],
                         int64_t bytes[ML_COLL_KINDS]) {
  memset(calls, 0, sizeof(int64_t) * ML_COLL_KINDS);
  memset(bytes, 0, sizeof(int64_t) * ML_COLL_KINDS);
  if (g_tp == 1) return;
  int64_t n = blocks * r->L, b = n * 4 * r->Tl * r->H;
  if (g_sp) {
    calls[ML_COLL_ALL_GATHER] = calls[ML_COLL_REDUCE_SCATTER] = n;
    bytes[ML_COLL_ALL_GATHER] = bytes[ML_COLL_REDUCE_SCATTER] = b;
  } else {
    calls[ML_COLL_ALL_REDUCE] = n;
    bytes[ML_COLL_ALL_REDUCE] = b;
  }
}

/* Mode ac against ML_AC_NONE: loss and every gradient bitwise; the tp
 * collectives of none plus those of `rerun_blocks` rerun blocks per layer;
 * the same FSDP collectives; less saved per layer. */
static void check_mode(ml_ac_mode ac, int rerun_blocks, bool rerun_core) {
  static result r;
  memset(&r, 0, sizeof r);
  run_mode(ac, &r);
  report rep = {0};
  if (memcmp(&r.loss, &g_none.loss, sizeof r.loss))
    note(&rep, "ac %s: loss %.17g, ac none %.17g", mode_names[ac], r.loss, g_none.loss);
  int differ = 0;
  for (int i = 0; i < r.n; i++) {
    const grad *a = &r.grads[i], *b = &g_none.grads[i];
    if (strcmp(a->name, b->name) || a->n != b->n) {
      note(&rep, "export order differs: %s vs %s", a->name, b->name);
      break;
    }
    if (memcmp(a->g, b->g, sizeof(float) * (size_t)a->n) == 0) continue;
    differ++;
    note(&rep, "ac %s: %s differs from ac none (rel L2 %.3g)", mode_names[ac], a->name,
         rel_l2(a->g, b->g, a->n));
  }
  int64_t calls[ML_COLL_KINDS], bytes[ML_COLL_KINDS];
  expect_rerun(&r, rerun_blocks, calls, bytes);
  for (int k = 0; k < ML_COLL_KINDS; k++) {
    if (r.tp_calls[k] != g_none.tp_calls[k] + calls[k] ||
        r.tp_bytes[k] != g_none.tp_bytes[k] + bytes[k])
      note(&rep, "ac %s: tp collective %d: %lld calls (%lld B), expected none's %lld (%lld B) + "
           "%lld (%lld B)",
           mode_names[ac], k, (long long)r.tp_calls[k], (long long)r.tp_bytes[k],
           (long long)g_none.tp_calls[k], (long long)g_none.tp_bytes[k], (long long)calls[k],
           (long long)bytes[k]);
    if (r.fsdp_calls[k] != g_none.fsdp_calls[k])
      note(&rep, "ac %s: dp_shard collective %d: %lld calls, ac none %lld", mode_names[ac], k,
           (long long)r.fsdp_calls[k], (long long)g_none.fsdp_calls[k]);
  }
  /* a rerun attention core under cp: its ring's forward passes again */
  int64_t ring = rerun_core ? r.L * (g_cp - 1) : 0;
  if (r.ring_calls != g_none.ring_calls + ring ||
      r.ring_bytes != g_none.ring_bytes + ring * 2 * 4 * r.Tl * r.kv)
    note(&rep, "ac %s: cp send_recv %lld calls (%lld B), expected none's %lld (%lld B) + %lld",
         mode_names[ac], (long long)r.ring_calls, (long long)r.ring_bytes,
         (long long)g_none.ring_calls, (long long)g_none.ring_bytes, (long long)ring);
  if (!(r.per_layer < g_none.per_layer) || !(r.workspace > 0) || g_none.workspace != 0)
    note(&rep, "ac %s: %lld B/layer + %lld B workspace, ac none %lld B/layer + %lld B",
         mode_names[ac], (long long)r.per_layer, (long long)r.workspace,
         (long long)g_none.per_layer, (long long)g_none.workspace);
  if (rank0())
    printf("ac %-9s vs none: %d of %d gradients differ; tp all-gather +%lld, reduce-scatter "
           "+%lld, all-reduce +%lld\n",
           mode_names[ac], differ, r.n,
           (long long)(r.tp_calls[ML_COLL_ALL_GATHER] - g_none.tp_calls[ML_COLL_ALL_GATHER]),
           (long long)(r.tp_calls[ML_COLL_REDUCE_SCATTER] -
                       g_none.tp_calls[ML_COLL_REDUCE_SCATTER]),
           (long long)(r.tp_calls[ML_COLL_ALL_REDUCE] - g_none.tp_calls[ML_COLL_ALL_REDUCE]));
  agree(&rep, "differences from ac none");
  result_free(&r);
}

static void test_mlp(void **state) {
  (void)state;
  check_mode(ML_AC_MLP, 1, false);
}

static void test_layer(void **state) {
  (void)state;
  check_mode(ML_AC_LAYER, 2, true);
}

static void test_selective(void **state) {
  (void)state;
  check_mode(ML_AC_SELECTIVE, 0, true);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  bool ok = argc >= 3;
  for (int i = 3; ok && i < argc; i++) {
    if (!strcmp(argv[i], "sp")) g_sp = true;
    else if (!strcmp(argv[i], "bf16")) g_bf16 = true;
    else if (!strncmp(argv[i], "cp=", 3) && atoi(argv[i] + 3) >= 1) g_cp = atoi(argv[i] + 3);
    else ok = false;
  }
  if (!ok) {
    fprintf(stderr, "usage: test_ac FIXTURE TP [sp] [cp=C] [bf16]\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  g_tp = atoi(argv[2]);
  const struct CMUnitTest tests[] = {
      held_test(test_mlp),
      held_test(test_layer),
      held_test(test_selective),
  };
  return held_finish(cmocka_run_group_tests(tests, setup_none, teardown_none));
}
