/* Predicted vs counted collectives:
 * `mpiexec -n N test_predict FIXTURE TP SP [rep-logits|hsdp]`.
 * Opens the engine on the fixture over MPI_COMM_WORLD (dp_shard = N / TP,
 * tp = TP, sequence parallel when SP = 1; with rep-logits, a custom plan
 * whose lm_head is HF colwise_rep: logits all-gathered per chunk, the loss
 * on whole rows; with hsdp, dp_replicate = 2 and dp_shard inferred), runs
 * one training step
 * (ml_engine_forward_backward + ml_engine_grad_norm) and one logprobs pass
 * of the fixture batch, and compares, on every rank and for every mesh
 * group and collective kind, the calls and bytes the counting comm
 * recorded with ml_predict_step's numbers exactly (parallel/predict.h).
 * Also: the predicted parameter memory equals the FSDP shards allocated.
 * Mismatches are collected per rank and agreed on after the collectives,
 * so a failure never leaves other ranks waiting. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/status.h"
#include "held.h"
#include "rank_report.h"
#include "parallel/predict.h"
#include "engine_run.h"
#include "parity_util.h"
#include "train/engine.h"

static const char *g_fixture;
static int g_tp, g_sp, g_dpr = 1; /* g_dpr: dp_replicate (HSDP with "hsdp") */
static char g_plan[64]; /* a custom plan file, or "" for the automatic choice */

/* The HF-style plan with lm_head colwise_rep (Replicate logits). Each
 * process writes its own copy. */
static void write_rep_logits_plan(void) {
  snprintf(g_plan, sizeof g_plan, "/tmp/test_predict_%ld.json", (long)getpid());
  FILE *f = fopen(g_plan, "w");
  if (!f) {
    perror(g_plan);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  fputs("{\"model.embed_tokens\": \"embedding_rowwise\",\n"
        " \"model.layers.*.self_attn.q_proj\": \"colwise\",\n"
        " \"model.layers.*.self_attn.k_proj\": \"colwise\",\n"
        " \"model.layers.*.self_attn.v_proj\": \"colwise\",\n"
        " \"model.layers.*.self_attn.o_proj\": \"rowwise\",\n"
        " \"model.layers.*.mlp.gate_proj\": \"colwise\",\n"
        " \"model.layers.*.mlp.up_proj\": \"colwise\",\n"
        " \"model.layers.*.mlp.down_proj\": \"rowwise\",\n"
        " \"lm_head\": \"colwise_rep\"}\n",
        f);
  fclose(f);
}


typedef struct setup {
  fixture fx;
  ml_mesh mesh;
  ml_engine e;
  int64_t Bl;
  const int32_t *ids;
  const uint8_t *mask;
  ml_prediction pred;
} setup;

static void setup_release(void *p) {
  setup *s = p;
  ml_engine_close(&s->e);
  ml_mesh_destroy(&s->mesh);
}

/* s is held (held.h): static in the tests. */
static void setup_open(setup *s) {
  memset(s, 0, sizeof *s);
  fixture_load(g_fixture, &s->fx);
  hold(s, setup_release);
  ml_engine_opts opts = ml_engine_opts_default();
  opts.parallel_plan = g_plan[0] ? g_plan : NULL;
  opts.sequence_parallel = g_sp != 0;
  if (ml_mesh_create(MPI_COMM_WORLD, g_dpr, 0, 1, g_tp, NULL, NULL, &s->mesh) ||
      ml_engine_open(&s->e, &s->mesh, s->fx.dir, &opts))
    fail_msg("setup: %s", ml_error_msg());
  int dp = s->mesh.groups[ML_GROUP_DP].size, d = s->mesh.groups[ML_GROUP_DP].rank;
  assert_int_equal(s->fx.B % dp, 0);
  s->Bl = s->fx.B / dp;
  s->ids = s->fx.ids + d * s->Bl * s->fx.S;
  s->mask = s->fx.mask + d * s->Bl * s->fx.S;
  if (ml_predict_step(&s->e.model, &s->e.tp, s->mesh.dp_replicate, s->mesh.dp_shard, s->Bl,
                      s->fx.S, &s->pred))
    fail_msg("predict: %s", ml_error_msg());
}

static void setup_close(setup *s) {
  unhold(s);
  setup_release(s);
  fixture_free(&s->fx);
}

/* Every group and kind: counted (this rank's counting comms) vs predicted. */
static void compare(setup *s, const ml_comm_stats want[ML_GROUP_KINDS], const char *what,
                    report *rep) {
  for (int g = 0; g < ML_GROUP_KINDS; g++) {
    ml_comm *c = ml_mesh_comm(&s->mesh, (ml_group)g);
    const ml_comm_stats *got = ml_comm_stats_of(c);
    if (!got) {
      note(rep, "group %s is not a counting comm", ml_group_name((ml_group)g));
      continue;
    }
    if (strcmp(c->name, ml_group_name((ml_group)g)))
      note(rep, "group %d is called '%s', predict calls it '%s'", g, c->name,
           ml_group_name((ml_group)g));
    for (int k = 0; k < ML_COLL_KINDS; k++)
      if (got->calls[k] != want[g].calls[k] || got->bytes[k] != want[g].bytes[k])
        note(rep, "%s: %s %s: counted %lld calls / %lld B, predicted %lld calls / %lld B", what,
             ml_group_name((ml_group)g), ml_coll_name((ml_coll)k), (long long)got->calls[k],
             (long long)got->bytes[k], (long long)want[g].calls[k], (long long)want[g].bytes[k]);
  }
}

static void print_counts(const ml_comm_stats st[ML_GROUP_KINDS], const char *what) {
  if (!rank0()) return;
  printf("%s (rank 0):", what);
  for (int g = 0; g < ML_GROUP_KINDS; g++)
    for (int k = 0; k < ML_COLL_KINDS; k++)
      if (st[g].calls[k])
        printf(" %s %s x%lld (%lld B)", ml_group_name((ml_group)g), ml_coll_name((ml_coll)k),
               (long long)st[g].calls[k], (long long)st[g].bytes[k]);
  printf("\n");
}

/* One training step: forward + backward + grad norm. */
static void test_train_step(void **state) {
  (void)state;
  static setup s;
  setup_open(&s);
  ml_mesh_stats_reset(&s.mesh);
  double loss, norm;
  report rep = {0};
  ml_engine_zero_grad(&s.e);
  if (ml_engine_forward_backward(&s.e, s.ids, s.mask, s.Bl, s.fx.S, s.fx.targets, &loss) ||
      ml_engine_grad_norm(&s.e, 2.0, &norm))
    fail_msg("step: %s", ml_error_msg());
  compare(&s, s.pred.train, "train step", &rep);
  int64_t shard = 0;
  for (int u = 0; u < s.e.fsdp.n_units; u++) shard += s.e.fsdp.units[u].shard_numel;
  if (s.pred.mem.params != 4 * shard)
    note(&rep, "parameter memory: predicted %lld B, FSDP holds %lld B",
         (long long)s.pred.mem.params, (long long)(4 * shard));
  print_counts(s.pred.train, "train step");
  agree(&rep, "mismatches between prediction and counting comm");
  setup_close(&s);
}

/* One forward-only logprobs pass. */
static void test_logprobs(void **state) {
  (void)state;
  static setup s;
  setup_open(&s);
  float *out = malloc(sizeof(float) * (size_t)(s.Bl * (s.fx.S - 1)));
  assert_non_null(out);
  hold(out, free);
  ml_mesh_stats_reset(&s.mesh);
  report rep = {0};
  if (ml_engine_logprobs(&s.e, s.ids, s.Bl, s.fx.S, out)) fail_msg("logprobs: %s", ml_error_msg());
  compare(&s, s.pred.logprobs, "logprobs", &rep);
  print_counts(s.pred.logprobs, "logprobs");
  unhold(out);
  free(out);
  agree(&rep, "mismatches between prediction and counting comm");
  setup_close(&s);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  if (argc != 4 && !(argc == 5 && (!strcmp(argv[4], "rep-logits") || !strcmp(argv[4], "hsdp")))) {
    fprintf(stderr, "usage: test_predict FIXTURE TP SP(0|1) [rep-logits|hsdp]\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  g_tp = atoi(argv[2]);
  g_sp = atoi(argv[3]);
  g_dpr = argc == 5 && !strcmp(argv[4], "hsdp") ? 2 : 1;
  if (argc == 5 && g_dpr == 1) write_rep_logits_plan();
  const struct CMUnitTest tests[] = {
      held_test(test_train_step),
      held_test(test_logprobs),
  };
  int failed = cmocka_run_group_tests(tests, NULL, NULL);
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (g_plan[0]) remove(g_plan);
  MPI_Finalize();
  return any ? 1 : 0;
}
