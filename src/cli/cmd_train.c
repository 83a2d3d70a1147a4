/* meshlm train: AdamW training of an HF checkpoint over the device mesh.
 *
 * Settings come from flags and --config (train_flags.c). One optimizer step
 * k takes the next --batch-size sequences of the shuffled data stream
 * (sequences consumed .. consumed + batch − 1, wrapping around the
 * dataset), as --grad-accum micro-batches: micro-batch m is sequences
 * consumed + m·mb .. + mb − 1 (mb = batch / grad_accum), each split over the
 * data-parallel ranks as ml_dataset_batch splits a batch (dp rank r takes
 * the r-th contiguous slice). Every micro-batch's loss is normalised by the
 * target count of the whole step, so the accumulated gradient is that of
 * one batch of --batch-size sequences (ARCHITECTURE.md §6). The step itself is the
 * engine's (engine/step.h, the library's too): global grad norm
 * (--grad-norm-type), and either a skipped step when it is not finite
 * (the first non-finite gradient named) or clipping (--max-grad-norm) and
 * AdamW at the schedule's learning rate (engine/schedule.h). A skipped step
 * still consumes its sequences and its slot of the schedule (AdamW's own
 * step count, kept by the engine for its bias correction, does not move).
 * Run checkpoints (--save, --resume) carry the step and the loader position
 * (ckpt/runckpt.h); the --save directory is locked for the whole run (one
 * writer, ckpt/runlock.h); --export-hf writes a consolidated HF checkpoint.
 * --eval-data: every --eval-every steps and after the last, the mean NLL
 * over every target of its sequences in file order (no shuffling), forward
 * only, in micro-batches of the step's (--batch-size / --grad-accum
 * sequences), each split over the data-parallel ranks as a step's are: the
 * sums over the dp ranks (dp_cp) of each micro-batch's NLL sum and target
 * count, then their quotient. Its batch of a step's data at unchanged
 * weights thus gives bitwise the loss that step prints (the same forward,
 * loss pass and reduction; one micro-batch). */
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "cli/data_group.h"
#include "cli/device.h"
#include "cli/train_flags.h"
#include "common/checked.h"
#include "common/rng.h"
#include "common/status.h"
#include "data/data.h"
#include "engine/engine.h"
#include "engine/freeze.h"
#include "model/lora.h"
#include "cli/metrics.h"
#include "ckpt/lora_export.h"
#include "ckpt/runckpt.h"
#include "ckpt/runlock.h"
#include "ckpt/save.h"
#include "engine/step.h"

typedef struct train_run {
  const ml_train_opts *o;
  ml_host *world; /* the CLI's host channel over every rank */
  ml_mesh mesh;
  ml_engine e;
  ml_dataset ds;
  ml_dataset eval_ds; /* --eval-data (nseq 0 without) */
  ml_metrics_writer mw; /* world rank 0, with --metrics */
  bool has_metrics;
  ml_run_state st;      /* steps done, sequences consumed */
  ml_run_lock lock;     /* world rank 0, with --save: one writer per directory */
  int64_t micro, local; /* micro-batch: sequences in all, on this dp rank */
  int32_t *ids;         /* [local, seq_len] */
  uint8_t *mask;        /* [local, seq_len] */
  double t_start;       /* MPI_Wtime at the command's start: the metrics' time */
} train_run;

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

/* Mesh and engine. */
static int setup_engine(train_run *r) {
  const ml_train_opts *o = r->o;
  ml_engine_opts eo = ml_train_settings_of(o).engine;
  ml_comm_factory make_comm;
  void *comm_ctx;
  ML_TRY(ml_device_open("train", &o->device, &o->device_comm, &eo.backend, &make_comm, &comm_ctx));
  ML_TRY(ml_mesh_create(MPI_COMM_WORLD, (int)o->dp_replicate, 0, (int)o->cp, (int)o->tp,
                        make_comm, comm_ctx, &r->mesh));
  ML_TRY(ml_mesh_set_ep(&r->mesh, MPI_COMM_WORLD, (int)o->ep, make_comm, comm_ctx));
  if (o->save && r->mesh.rank == 0) ML_TRY(ml_run_lock_take(o->save, &r->lock));
  ML_TRY(ml_engine_open(&r->e, &r->mesh, o->model, &eo));
  ML_TRY(ml_model_config_check_seq_len(&r->e.model.cfg, o->model, o->seq_len,
                                       "train: flag --seq-len"));
  return 0;
}

/* Data (every rank reads its part, cli/data_group.h; shuffled) and the
 * micro-batch buffers. Collective: the engine is open on every rank. */
static int setup_data(train_run *r) {
  const ml_train_opts *o = r->o;
  ml_data_group group = ml_cli_data_group(r->world);
  ml_data_opts dopts = ml_train_data_opts(o);
  dopts.group = &group;
  ML_TRY(ml_dataset_load(o->data, o->seq_len, r->e.model.cfg.vocab, &dopts, &r->ds));
  if (o->eval_data)
    ML_TRY(ml_dataset_load(o->eval_data, o->seq_len, r->e.model.cfg.vocab, &dopts, &r->eval_ds));
  int dp = r->mesh.groups[ML_GROUP_DP].size;
  if (o->batch % (dp * o->grad_accum) != 0)
    return ml_err("train: flag --batch-size %lld is not divisible by the data-parallel size %d "
                  "x --grad-accum %lld = %lld; expected a multiple of it",
                  (long long)o->batch, dp, (long long)o->grad_accum,
                  (long long)(dp * o->grad_accum));
  r->micro = o->batch / o->grad_accum;
  r->local = r->micro / dp;
  ML_TRY(ml_train_reserve(&r->e, o, dp));
  /* local · seq_len fits: ml_train_reserve allocated activations of that many tokens */
  int64_t tokens = r->local * o->seq_len;
  r->ids = ml_malloc_array(tokens, sizeof(int32_t), "the micro-batch's token ids (%lld tokens per "
                           "rank: --batch-size, --grad-accum, --seq-len)", (long long)tokens);
  r->mask = ml_malloc_array(tokens, 1, "the micro-batch's loss mask (%lld tokens per rank)",
                            (long long)tokens);
  if (!r->ids || !r->mask) return -1;
  return shuffle(&r->ds, o->seed);
}

/* --resume: the run checkpoint's weights, optimizer state and position;
 * refused over another data order (--seed) or dataset. Collective. */
static int resume(train_run *r) {
  const ml_train_opts *o = r->o;
  int rc = ml_run_load(&r->e, o->resume, &r->st);
  ML_TRY(ml_cli_agree(r->world, rc));
  if (r->st.seed != (uint64_t)o->seed || r->st.nseq != r->ds.nseq)
    rc = ml_err("train: flag --resume %s: the checkpoint was trained with --seed %llu on %lld "
                "sequences, this run has --seed %lld and %lld sequences (%s); expected the same "
                "data order",
                o->resume, (unsigned long long)r->st.seed, (long long)r->st.nseq,
                (long long)o->seed, (long long)r->ds.nseq, o->data);
  ML_TRY(ml_cli_agree(r->world, rc));
  ml_cli_print("train: resumed from %s at step %lld (%lld sequences consumed)\n", o->resume,
               (long long)r->st.step, (long long)r->st.consumed);
  return 0;
}

/* Targets (mask = 1) of `count` stream sequences from `first` on. */
static int64_t count_targets(const ml_dataset *ds, int64_t first, int64_t count) {
  int64_t n = 0;
  for (int64_t i = 0; i < count; i++) n += ml_dataset_count_targets(ds, first + i, 1);
  return n;
}

/* This dp rank's slice of the `count` sequences of `ds` from stream
 * position `first` on into r->ids/r->mask, *rows of them: dp rank d takes
 * positions first + i for i in [d·per, (d+1)·per), per = ⌈count/dp⌉, as
 * ml_dataset_batch splits a batch when dp divides count (stream position
 * p is dataset row p mod nseq); the rows past `count` (an eval's last
 * micro-batch) are padding: token 0, no target. */
static int load_slice(train_run *r, const ml_dataset *ds, int64_t first, int64_t count,
                      int64_t *rows) {
  const ml_mesh_group *dp = &r->mesh.groups[ML_GROUP_DP];
  int64_t per = (count + dp->size - 1) / dp->size, S = ds->seq_len;
  for (int64_t i = 0; i < per; i++) {
    int64_t k = dp->rank * per + i;
    if (k < count)
      ML_TRY(ml_dataset_batch(ds, first + k, 1, 0, 1, r->ids + i * S, r->mask + i * S));
    else {
      memset(r->ids + i * S, 0, sizeof(int32_t) * (size_t)S);
      memset(r->mask + i * S, 0, (size_t)S);
    }
  }
  *rows = per;
  return 0;
}

/* The step's micro-batch m (ml_step_source.fill): this dp rank's slice of
 * stream sequences consumed + m·micro .. + micro − 1. */
static int fill_micro(void *ctx, int64_t m, ml_engine_batch *b) {
  train_run *r = ctx;
  int64_t rows;
  ML_TRY(load_slice(r, &r->ds, r->st.consumed + m * r->micro, r->micro, &rows));
  *b = (ml_engine_batch){.ids = r->ids, .mask = r->mask, .B = rows, .S = r->o->seq_len};
  return 0;
}

/* --eval-data's mean NLL at the current weights and its target count (the
 * header comment's order and sums). Collective; a failure may leave peers
 * in a collective (callers abort). */
static int evaluate(train_run *r, double *loss, int64_t *targets) {
  const ml_dataset *ds = &r->eval_ds;
  double total[2] = {0, 0}; /* NLL sum, targets */
  for (int64_t first = 0; first < ds->nseq; first += r->micro) {
    int64_t count = ds->nseq - first < r->micro ? ds->nseq - first : r->micro, rows;
    ML_TRY(load_slice(r, ds, first, count, &rows));
    ml_engine_batch b = {.ids = r->ids, .mask = r->mask, .B = rows, .S = r->o->seq_len};
    ml_loss_out lo;
    ML_TRY(ml_engine_nll_batch(&r->e, &b, &lo));
    double part[2] = {lo.loss_sum, (double)lo.count}; /* counts exact in f64 below 2^53 */
    ML_TRY(ml_host_all_reduce_f64(ml_mesh_host(&r->mesh, ML_GROUP_DP_CP), part, 2, ML_RED_SUM));
    total[0] += part[0];
    total[1] += part[1];
  }
  *targets = (int64_t)total[1];
  *loss = total[1] > 0 ? total[0] / total[1] : 0.0;
  return 0;
}

/* --eval-data after every --eval-every-th step and after the last: the
 * line "eval step K: loss X (T tokens)" and the metrics' eval line.
 * Aborts every rank on failure. */
static void maybe_evaluate(train_run *r) {
  const ml_train_opts *o = r->o;
  bool due = r->st.step == o->steps || (o->eval_every > 0 && r->st.step % o->eval_every == 0);
  if (!o->eval_data || !due) return;
  double loss;
  int64_t targets;
  if (evaluate(r, &loss, &targets)) ml_cli_abort();
  ml_cli_print("eval step %lld: loss %.6f (%lld tokens)\n", (long long)r->st.step, loss,
               (long long)targets);
  if (r->mesh.rank == 0 && r->has_metrics &&
      ml_metrics_write_eval(&r->mw, r->st.step, loss, targets))
    ml_cli_abort();
}

/* The largest v over every rank (a timing or memory figure for the
 * metrics; v itself should the host channel fail). */
static double max_over_world(ml_host *world, double v) {
  double out = v;
  return ml_host_all_reduce_f64(world, &out, 1, ML_RED_MAX) ? v : out;
}

/* One optimizer step (engine/step.h) on the next --batch-size sequences;
 * metrics out. Aborts every rank on failure. */
static void train_step(train_run *r, const ml_step_opts *so, ml_step_metrics *sm) {
  const ml_train_opts *o = r->o;
  ml_mesh_stats_reset(&r->mesh);
  int64_t faults = ml_minor_faults();
  double t0 = MPI_Wtime();
  ml_step_source src = {.n_micro = o->grad_accum, .fill = fill_micro, .ctx = r,
                        .global_targets = count_targets(&r->ds, r->st.consumed, o->batch)};
  ml_step_result res;
  if (ml_step_run(&r->e, so, r->st.step, &src, &res)) ml_cli_abort();
  *sm = (ml_step_metrics){.step = r->st.step + 1, .lr = res.lr, .tokens = o->batch * o->seq_len,
                          .loss = res.loss, .grad_norm = res.grad_norm, .skipped = res.skipped};
  if (res.skipped)
    ml_cli_print("step %lld: skipped, non-finite gradient %s%s\n", (long long)sm->step,
                 res.nonfinite[0] ? "in " : "norm (every gradient finite)", res.nonfinite);
  r->st.step++;
  r->st.consumed += o->batch;
  double dt = max_over_world(r->world, MPI_Wtime() - t0);
  sm->minor_faults = (int64_t)max_over_world(r->world, (double)(ml_minor_faults() - faults));
  sm->tokens_per_s = (double)sm->tokens / dt;
  double rss = ml_peak_rss_mib();
  sm->peak_rss_mib_max = max_over_world(r->world, rss);
  sm->peak_rss_mib_min = -max_over_world(r->world, -rss);
  double dev = (double)ml_be_memory_stats(r->e.be).peak / (1024.0 * 1024.0);
  sm->device_peak_mib = max_over_world(r->world, dev);
  double wait = ml_comm_stats_of(ml_mesh_comm(&r->mesh, ML_GROUP_DP_SHARD_CP))->wait_s +
                ml_comm_stats_of(ml_mesh_comm(&r->mesh, ML_GROUP_DP_REPLICATE))->wait_s;
  sm->fsdp_wait_ms = 1e3 * max_over_world(r->world, wait);
}

/* --save after every --save-every-th step and after the last. Collective. */
static int maybe_save(train_run *r) {
  const ml_train_opts *o = r->o;
  bool due = r->st.step == o->steps || (o->save_every > 0 && r->st.step % o->save_every == 0);
  if (!o->save || !due) return 0;
  ML_TRY(ml_cli_agree(r->world, ml_run_save(&r->e, o->save, &r->st)));
  ml_cli_print("train: saved run checkpoint %s (step %lld)\n", o->save, (long long)r->st.step);
  return 0;
}

/* The collectives of the last step per mesh group, as rank 0 saw them, and
 * the time it waited on each group that communicated. */
static void print_comm_summary(const ml_mesh *mesh) {
  ml_cli_print("train: collectives of the last step (rank 0):");
  for (int g = 0; g < ML_GROUP_KINDS; g++) {
    const ml_comm_stats *st = ml_comm_stats_of(ml_mesh_comm(mesh, (ml_group)g));
    for (int k = 0; k < ML_COLL_KINDS; k++)
      if (st->calls[k])
        ml_cli_print(" %s %s x%lld (%.3f MB)", ml_group_name((ml_group)g),
                     ml_coll_name((ml_coll)k), (long long)st->calls[k],
                     (double)st->bytes[k] / 1e6);
  }
  ml_cli_print("\ntrain: time waiting on communication in the last step (rank 0):");
  for (int g = 0; g < ML_GROUP_KINDS; g++) {
    const ml_comm_stats *st = ml_comm_stats_of(ml_mesh_comm(mesh, (ml_group)g));
    int64_t calls = 0;
    for (int k = 0; k < ML_COLL_KINDS; k++) calls += st->calls[k];
    if (mesh->groups[g].size > 1 && calls > 0)
      ml_cli_print(" %s %.1f ms", ml_group_name((ml_group)g), 1e3 * st->wait_s);
  }
  ml_cli_print("\n");
}

/* The mesh's peak FLOP/s for MFU: --peak-tflops, or (0, the default) the
 * GEMM rate every rank sustains at once, summed (ml_gemm_flops_per_s); 0
 * when a rank could not measure. Collective. */
static double mesh_peak_flops(const ml_train_opts *o, ml_engine *e, ml_host *world) {
  if (o->peak_tflops > 0) return o->peak_tflops * 1e12;
  ml_dtype dt = e->opts.fsdp.param_dtype;
  if (ml_host_barrier(world)) return 0;
  double mine = ml_gemm_flops_per_s(e->be, dt, 0.25), sum = mine, least = mine;
  if (ml_host_all_reduce_f64(world, &sum, 1, ML_RED_SUM) ||
      ml_host_all_reduce_f64(world, &least, 1, ML_RED_MIN))
    return 0;
  if (least <= 0) {
    ml_cli_print("train: MFU n/a: the GEMM calibration could not allocate its operands; "
                 "--peak-tflops X gives the peak\n");
    return 0;
  }
  ml_cli_print("train: MFU against %.3f TFLOP/s measured (%s GEMM 1024^3, %d rank%s at once); "
               "--peak-tflops X gives the hardware's peak instead\n",
               sum / 1e12, dt == ML_BF16 ? "bf16" : "fp32", world->size,
               world->size > 1 ? "s" : "");
  return sum;
}

static int train_loop(train_run *r) {
  const ml_train_opts *o = r->o;
  const ml_model_config *c = &r->e.model.cfg;
  double fpt =
      ml_flops_per_token((double)ml_model_config_num_params(c), c->n_layers, c->hidden, o->seq_len);
  double peak = mesh_peak_flops(o, &r->e, r->world);
  ml_step_opts so = ml_train_settings_of(o).step;
  double t_loop = MPI_Wtime();
  if (r->st.step >= o->steps) maybe_evaluate(r); /* --steps 0, or resumed at the end: no step runs */
  for (int64_t done = 1; r->st.step < o->steps; done++) {
    ml_step_metrics sm;
    train_step(r, &so, &sm);
    double now = MPI_Wtime();
    sm.time_s = now - r->t_start;
    sm.eta_s = (now - t_loop) / (double)done * (double)(o->steps - r->st.step);
    sm.mfu = ml_mfu(fpt, sm.tokens_per_s, peak);
    sm.peak_tflops = peak / 1e12;
    sm.peak_measured = o->peak_tflops == 0;
    if (r->mesh.rank == 0) {
      ml_metrics_print(stdout, &sm);
      fflush(stdout);
      if (r->has_metrics && ml_metrics_write(&r->mw, &sm)) ml_cli_abort();
    }
    if (r->st.step == o->steps) print_comm_summary(&r->mesh);
    maybe_evaluate(r);
    ML_TRY(maybe_save(r));
  }
  return 0;
}

static void print_header(const train_run *r) {
  const ml_train_opts *o = r->o;
  const ml_mesh *m = &r->mesh;
  ml_cli_print("train: %s, mesh dp_replicate=%d x dp_shard=%d x tp=%d, %lld parameters\n", o->model,
               m->dp_replicate, m->dp_shard, m->tp,
               (long long)ml_model_config_num_params(&r->e.model.cfg));
  ml_cli_print("train: plan %s (%s)\n", r->e.plan.name, r->e.plan.reason);
  int n_frozen, units = 0;
  int64_t frozen_numel;
  ml_freeze_count(&r->e.model, &n_frozen, &frozen_numel);
  for (int u = 0; u < r->e.fsdp.n_units; u++) units += r->e.fsdp.units[u].frozen;
  const ml_lora *l = &r->e.lora;
  if (l->on) {
    int64_t adapter_numel = 0;
    for (int i = 0; i < r->e.model.n_params; i++)
      if (r->e.model.params[i].adapter) adapter_numel += ml_param_numel(&r->e.model.params[i]);
    ml_cli_print("train: LoRA r=%lld, lora_alpha %g (scaling %g%s) on %d linears (%s)%s%s: %lld "
                 "adapter elements train, every base weight frozen\n",
                 (long long)l->rank, l->alpha, l->scaling, l->rslora ? ", rslora" : "",
                 ml_lora_count(&r->e.model), l->targets, l->adapter ? ", from " : "",
                 l->adapter ? l->adapter : "", (long long)adapter_numel);
  }
  if (n_frozen && o->freeze)
    ml_cli_print("train: --freeze '%s': %d of %d parameter tensors frozen (%lld elements), %d "
                 "FSDP unit(s) wholly frozen; backward runs down to layer %d\n",
                 o->freeze, n_frozen, r->e.model.n_params, (long long)frozen_numel, units,
                 r->e.bwd_first);
  ml_print_fp32_params("train", &r->e, o->fp32_params);
  const ml_dataset *ds = &r->ds;
  bool raw = ds->format == ML_DATA_RAW || ds->format == ML_DATA_RAW_BYTES;
  ml_cli_print("train: data %s: %lld %s record%s, %lld tokens -> %lld sequences (%s)\n", o->data,
               (long long)ds->records, raw ? "raw text" : ml_data_format_name(ds->format),
               ds->records == 1 ? "" : "s", (long long)ds->tokens, (long long)ds->nseq,
               ds->format == ML_DATA_RAW_BYTES ? "bytes as token ids: no tokenizer.json in --model"
               : ds->packed                    ? "packed into --seq-len windows"
                                               : "one per record");
  ml_cli_print("train: %lld steps of %lld sequences x %lld tokens in %lld micro-batch(es)\n",
               (long long)o->steps, (long long)o->batch, (long long)o->seq_len,
               (long long)o->grad_accum);
  const ml_dataset *ev = &r->eval_ds;
  if (o->eval_data)
    ml_cli_print("train: eval data %s: %lld record%s, %lld tokens -> %lld sequences, evaluated "
                 "%s\n",
                 o->eval_data, (long long)ev->records, ev->records == 1 ? "" : "s",
                 (long long)ev->tokens, (long long)ev->nseq,
                 o->eval_every > 0 ? "every --eval-every steps and after the last"
                                   : "after the last step");
}

/* Set up, resume, train, export. Returns the agreed status. */
static int run(train_run *r) {
  const ml_train_opts *o = r->o;
  ML_TRY(ml_cli_agree(r->world, setup_engine(r)));
  int rc = setup_data(r);
  if (rc == 0 && o->metrics && r->mesh.rank == 0 && (rc = ml_metrics_open(o->metrics, &r->mw)) == 0)
    r->has_metrics = true;
  ML_TRY(ml_cli_agree(r->world, rc));
  print_header(r);
  r->st = (ml_run_state){.seed = (uint64_t)o->seed, .nseq = r->ds.nseq};
  if (o->resume) ML_TRY(resume(r));
  ML_TRY(train_loop(r));
  if (!o->export_hf) return 0;
  char what[256] = "";
  ml_export_dtype dtype = (ml_export_dtype)o->export_dtype.index;
  rc = o->merge_lora ? ml_engine_save_lora(&r->e, o->export_hf, true, dtype)
                     : ml_engine_save_hf(&r->e, o->export_hf, dtype);
  if (rc == 0 && r->mesh.rank == 0) rc = ml_cli_export_summary(o->export_hf, what, sizeof what);
  ML_TRY(ml_cli_agree(r->world, rc));
  ml_cli_print("train: exported %s: %s\n", o->export_hf, what);
  return 0;
}

static void run_free(train_run *r) {
  ml_run_lock_release(&r->lock);
  if (r->has_metrics) ml_metrics_close(&r->mw);
  free(r->ids);
  free(r->mask);
  ml_dataset_free(&r->ds);
  ml_dataset_free(&r->eval_ds);
  ml_engine_close(&r->e);
  ml_mesh_destroy(&r->mesh);
}

int ml_cmd_train(ml_host *world, int argc, char **argv) {
  double t_start = MPI_Wtime();
  ml_train_opts o = ml_train_opts_default();
  ml_arg spec[ML_TRAIN_MAX_FLAGS];
  size_t n = ml_train_flags(&o, spec);
  ml_config_argv args;
  int rc = ml_train_argv(argc, argv, spec, n, &args);
  if (rc == 0)
    rc = ml_cli_parse("train", "train an HF checkpoint over the device mesh", args.argc, args.argv,
                      spec, n);
  if (rc == 1) {
    ml_config_argv_free(&args);
    return 0;
  }
  if (rc == 0) rc = ml_train_opts_check(&o);
  train_run r = {.o = &o, .world = world, .lock = {-1}, .t_start = t_start};
  if (ml_cli_agree(world, rc) == 0)
    rc = run(&r);
  else
    rc = -1;
  if (rc != 0) ml_run_lock_abandon(&r.lock); /* a --save DIR it created and left empty goes */
  run_free(&r);
  ml_config_argv_free(&args);
  return rc;
}
