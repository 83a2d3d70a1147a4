/* meshlm train: AdamW training of an HF checkpoint over the device mesh. */
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "common/rng.h"
#include "common/status.h"
#include "train/data.h"
#include "train/engine.h"
#include "train/metrics.h"
#include "train/save.h"

typedef struct train_opts {
  const char *model, *data, *metrics, *save, *plan;
  bool sp;
  int64_t tp, steps, batch, seq_len, seed;
  double lr, weight_decay, max_grad_norm, peak_tflops;
} train_opts;

/* Deterministic shuffle of the dataset's sequences (same on every rank). */
static int shuffle(ml_dataset *ds, int64_t seed) {
  ml_rng rng = ml_rng_seed((uint64_t)seed);
  int64_t S = ds->seq_len;
  int32_t *tid = ml_malloc(sizeof(int32_t) * (size_t)S, "shuffle buffer");
  uint8_t *tm = ml_malloc((size_t)S, "shuffle buffer");
  int rc = tid && tm ? 0 : -1;
  for (int64_t i = ds->nseq - 1; rc == 0 && i > 0; i--) {
    int64_t j = (int64_t)(ml_rng_next(&rng) % (uint64_t)(i + 1));
    memcpy(tid, ds->ids + i * S, sizeof(int32_t) * (size_t)S);
    memcpy(ds->ids + i * S, ds->ids + j * S, sizeof(int32_t) * (size_t)S);
    memcpy(ds->ids + j * S, tid, sizeof(int32_t) * (size_t)S);
    memcpy(tm, ds->mask + i * S, (size_t)S);
    memcpy(ds->mask + i * S, ds->mask + j * S, (size_t)S);
    memcpy(ds->mask + j * S, tm, (size_t)S);
  }
  free(tid);
  free(tm);
  return rc;
}

static int setup(const train_opts *o, ml_mesh *mesh, ml_engine *e, ml_dataset *ds) {
  ML_TRY(ml_mesh_create(MPI_COMM_WORLD, 1, 0, 1, (int)o->tp, mesh));
  ml_engine_opts eo = ml_engine_opts_default();
  eo.parallel_plan = o->plan;
  eo.sequence_parallel = o->sp;
  ML_TRY(ml_engine_open(e, mesh, o->model, &eo));
  ML_TRY(ml_dataset_load(o->data, o->seq_len, e->model.cfg.vocab, ds));
  if (o->batch % mesh->dp_comm->size != 0)
    return ml_err("--batch-size %lld is not divisible by the data-parallel size %d; expected a "
                  "multiple of it",
                  (long long)o->batch, mesh->dp_comm->size);
  return shuffle(ds, o->seed);
}

static double max_over_world(double v) {
  double out = v;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

/* The collectives of the last step per mesh group, as this rank saw them. */
static void print_comm_summary(const ml_mesh *mesh) {
  ml_comm *groups[] = {mesh->tp_comm, mesh->dp_shard_comm, mesh->dp_comm, mesh->world};
  ml_cli_print("train: collectives of the last step (rank 0):");
  for (size_t g = 0; g < sizeof groups / sizeof groups[0]; g++) {
    const ml_comm_stats *st = ml_comm_stats_of(groups[g]);
    for (int k = 0; k < ML_COLL_KINDS; k++)
      if (st->calls[k])
        ml_cli_print(" %s %s x%lld (%.3f MB)", groups[g]->name, ml_coll_name((ml_coll)k),
                     (long long)st->calls[k], (double)st->bytes[k] / 1e6);
  }
  ml_cli_print("\n");
}

static int train_loop(const train_opts *o, ml_mesh *mesh, ml_engine *e, const ml_dataset *ds,
                      ml_metrics_writer *mw) {
  int64_t S = o->seq_len, Bl = o->batch / mesh->dp_comm->size;
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)(Bl * S));
  uint8_t *mask = malloc((size_t)(Bl * S));
  if (!ids || !mask) return ml_err("out of memory for the batch");
  const ml_model_config *c = &e->model.cfg;
  double fpt = ml_flops_per_token((double)ml_model_config_num_params(c), c->n_layers, c->hidden, S);
  ml_adamw_cfg adam = {o->lr, 0.9, 0.999, 1e-8, o->weight_decay};
  for (int64_t step = 0; step < o->steps; step++) {
    ml_mesh_stats_reset(mesh);
    double t0 = MPI_Wtime(), loss, norm;
    int64_t targets = ml_dataset_count_targets(ds, step, o->batch);
    if (ml_dataset_batch(ds, step, o->batch, mesh->dp_comm->rank, mesh->dp_comm->size, ids, mask) ||
        (ml_engine_zero_grad(e), 0) ||
        ml_engine_forward_backward(e, ids, mask, Bl, S, targets, &loss) ||
        ml_engine_grad_norm(e, 2.0, &norm))
      ml_cli_abort();
    ml_engine_clip(e, norm, o->max_grad_norm);
    if (ml_engine_adamw(e, &adam)) ml_cli_abort();
    double dt = max_over_world(MPI_Wtime() - t0);
    ml_step_metrics sm = {.step = step + 1, .loss = loss, .grad_norm = norm, .lr = o->lr,
                          .tokens = o->batch * S};
    sm.tokens_per_s = (double)sm.tokens / dt;
    sm.mfu = ml_mfu(fpt, sm.tokens_per_s, o->peak_tflops * 1e12);
    sm.peak_rss_mb = max_over_world(ml_peak_rss_mb());
    if (mesh->rank == 0) {
      ml_metrics_print(stdout, &sm);
      fflush(stdout);
      if (mw && ml_metrics_write(mw, &sm)) ml_cli_abort();
    }
  }
  if (o->steps > 0) print_comm_summary(mesh);
  free(ids);
  free(mask);
  return 0;
}

int ml_cmd_train(int argc, char **argv) {
  train_opts o = {.tp = 1, .steps = 10, .batch = 8, .seq_len = 128, .seed = 0, .lr = 3e-4,
                  .weight_decay = 0.0, .max_grad_norm = 1.0, .peak_tflops = 0.24};
  ml_arg spec[] = {
      {"--model", ML_ARG_STR, &o.model, "HF checkpoint directory (config.json + safetensors)", true},
      {"--data", ML_ARG_STR, &o.data, "JSONL with input_ids [+ loss_mask], or raw text (bytes)", true},
      {"--tp", ML_ARG_INT, &o.tp, "tensor-parallel size (dp_shard = world / tp)", false},
      {"--sequence-parallel", ML_ARG_FLAG, &o.sp, "shard norms and residuals on the sequence", false},
      {"--parallel-plan", ML_ARG_STR, &o.plan, "plan file (JSON), or auto|optimized|hf|default", false},
      {"--steps", ML_ARG_INT, &o.steps, "optimizer steps", false},
      {"--batch-size", ML_ARG_INT, &o.batch, "global batch in sequences", false},
      {"--seq-len", ML_ARG_INT, &o.seq_len, "tokens per sequence", false},
      {"--lr", ML_ARG_FLOAT, &o.lr, "AdamW learning rate", false},
      {"--weight-decay", ML_ARG_FLOAT, &o.weight_decay, "AdamW decoupled weight decay", false},
      {"--max-grad-norm", ML_ARG_FLOAT, &o.max_grad_norm, "clip the global grad norm (0 = off)", false},
      {"--seed", ML_ARG_INT, &o.seed, "seed of the data order", false},
      {"--peak-tflops", ML_ARG_FLOAT, &o.peak_tflops, "peak fp32 TFLOP/s of the whole job, for MFU", false},
      {"--metrics", ML_ARG_STR, &o.metrics, "write one JSON object per step to this file", false},
      {"--save", ML_ARG_STR, &o.save, "write a consolidated HF checkpoint here at the end", false},
  };
  int rc = ml_cli_parse("train", "train an HF checkpoint over the device mesh", argc, argv, spec,
                        sizeof spec / sizeof spec[0]);
  if (rc == 1) return 0;
  if (rc == 0 && (o.steps < 0 || o.batch < 1 || o.seq_len < 2 || o.tp < 1))
    rc = ml_err("train: expected --steps >= 0, --batch-size >= 1, --seq-len >= 2 and --tp >= 1");
  ml_mesh mesh = {0};
  ml_engine e = {0};
  ml_dataset ds = {0};
  if (rc == 0) rc = setup(&o, &mesh, &e, &ds);
  ml_metrics_writer mw, *mwp = NULL;
  if (rc == 0 && o.metrics && mesh.rank == 0 && (rc = ml_metrics_open(o.metrics, &mw)) == 0)
    mwp = &mw;
  if (ml_cli_agree(rc) == 0) {
    ml_cli_print("train: %s, mesh dp_shard=%d x tp=%d, plan %s, %lld parameters\n", o.model,
                 mesh.dp_shard, mesh.tp, e.plan.name,
                 (long long)ml_model_config_num_params(&e.model.cfg));
    ml_cli_print("train: plan %s (%s)\n", e.plan.name, e.plan.reason);
    rc = train_loop(&o, &mesh, &e, &ds, mwp);
    if (rc == 0 && o.save) rc = ml_engine_save_hf(&e, o.save);
    if (rc == 0 && o.save) ml_cli_print("train: saved %s\n", o.save);
    rc = ml_cli_agree(rc);
  } else {
    rc = -1;
  }
  if (mwp) ml_metrics_close(mwp);
  ml_dataset_free(&ds);
  ml_engine_close(&e);
  if (mesh.world) ml_mesh_destroy(&mesh);
  return rc;
}
