/* meshlm_open / meshlm_close and what every call shares (api/session.h). */
#define _POSIX_C_SOURCE 200809L /* strdup */

#include "api/session.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "common/checked.h"
#include "common/hash.h"
#include "common/lookup.h"
#include "parallel/device.h"

static bool g_mpi_ours; /* MPI initialised by the library, not finalised yet */

#define VERSION_STR_(x) #x
#define VERSION_STR(x) VERSION_STR_(x)
/* meshlm.h's MESHLM_VERSION_* are the one source of the version (CMakeLists.txt reads them too). */
const char *meshlm_version(void) {
  return VERSION_STR(MESHLM_VERSION_MAJOR) "." VERSION_STR(MESHLM_VERSION_MINOR) "." VERSION_STR(
      MESHLM_VERSION_PATCH);
}

/* The engine's values of the public enums, indexed by them (the inverse:
 * ML_INDEX_OF; dtype_of for the dtypes, where SOURCE has no engine value). */
static const ml_dtype k_dtypes[] = {[MESHLM_DTYPE_F32] = ML_F32, [MESHLM_DTYPE_BF16] = ML_BF16};
static const ml_ac_mode k_acs[] = {[MESHLM_AC_NONE] = ML_AC_NONE, [MESHLM_AC_FULL] = ML_AC_LAYER,
                                   [MESHLM_AC_SELECTIVE] = ML_AC_SELECTIVE,
                                   [MESHLM_AC_MLP] = ML_AC_MLP};
static const ml_reshard_policy k_reshards[] = {[MESHLM_RESHARD_DEFAULT] = ML_RESHARD_DEFAULT,
                                               [MESHLM_RESHARD_ALWAYS] = ML_RESHARD_ALWAYS,
                                               [MESHLM_RESHARD_NEVER] = ML_RESHARD_NEVER};
static const ml_lr_decay k_decays[] = {[MESHLM_LR_CONSTANT] = ML_LR_CONSTANT,
                                       [MESHLM_LR_LINEAR] = ML_LR_LINEAR,
                                       [MESHLM_LR_COSINE] = ML_LR_COSINE};

/* The public dtype of an engine compute dtype (F32 or BF16). */
static meshlm_dtype dtype_of(ml_dtype d) {
  return d == ML_BF16 ? MESHLM_DTYPE_BF16 : MESHLM_DTYPE_F32;
}

/* An old caller's layout ends at the minimum without tail padding that a
 * later field would lie in (meshlm.h orders the appended fields so). */
_Static_assert(API_MIN(meshlm_options) % _Alignof(meshlm_options) == 0,
               "meshlm_options' minimum layout ends on its alignment");

int api_struct_size(const char *call, const char *type, size_t size, size_t min, size_t max) {
  if (size >= min && size <= max) return 0;
  return ml_err("%s: %s.struct_size %zu; expected %zu (the first layout) .. %zu (sizeof(%s) of "
                "libmeshlm %s)%s",
                call, type, size, min, max, type, meshlm_version(),
                size == 0 ? ": struct_size not set (sizeof the struct, or its *_default)" : "");
}

int api_read_struct(const char *call, const char *type, const void *in, size_t min, size_t max,
                    const void *def, void *full) {
  size_t size;
  memcpy(&size, in, sizeof size);
  ML_TRY(api_struct_size(call, type, size, min, max));
  memcpy(full, def, max);
  memcpy(full, in, size);
  memcpy(full, &max, sizeof max);
  return 0;
}

int api_init_struct(void *out, size_t size, size_t min, size_t max, void *full) {
  if (size < min || size > max) {
    if (size >= sizeof size) memcpy(out, &size, sizeof size);
    return -1;
  }
  memcpy(full, &size, sizeof size);
  memcpy(out, full, size);
  return 0;
}

int api_write_struct(const char *call, const char *type, void *out, size_t min, size_t max,
                     const void *full) {
  size_t size;
  memcpy(&size, out, sizeof size);
  ML_TRY(api_struct_size(call, type, size, min, max));
  memcpy(out, full, size);
  memcpy(out, &size, sizeof size);
  return 0;
}

int meshlm_options_init(meshlm_options *o, size_t struct_size) {
  ml_train_settings d = ml_train_defaults(ML_DEFAULTS_API);
  const ml_fsdp_opts *f = &d.engine.fsdp;
  const ml_step_opts *st = &d.step;
  meshlm_options full = {
      .dp_replicate = 1, .cp = 1, .tp = 1, .device = "cpu",
      .parallel_plan = d.engine.parallel_plan, .sequence_parallel = d.engine.sequence_parallel,
      .param_dtype = dtype_of(f->param_dtype), .reduce_dtype = dtype_of(f->reduce_dtype),
      .ac = (meshlm_ac)ML_INDEX_OF(k_acs, d.engine.ac), .lr = st->schedule.lr,
      .min_lr = st->schedule.min_lr, .beta1 = st->beta1, .beta2 = st->beta2, .eps = st->eps,
      .weight_decay = st->weight_decay,
      .schedule = (meshlm_schedule)ML_INDEX_OF(k_decays, st->schedule.decay),
      .warmup_steps = st->schedule.warmup_steps, .total_steps = st->schedule.total_steps,
      .max_grad_norm = st->max_grad_norm, .micro_batch_tokens = 4096,
      .unshard_for_inference = 1, .output_dtype = dtype_of(d.engine.output_dtype),
      .reshard_after_forward = (meshlm_reshard)ML_INDEX_OF(k_reshards, f->reshard_after_forward),
      .zero = f->zero, .prefetch_forward = f->prefetch_forward,
      .prefetch_backward = f->prefetch_backward, .grad_norm_type = st->norm_type,
      .cpu_offload = f->cpu_offload, .batch_invariant = d.engine.batch_invariant,
      .freeze = d.engine.freeze, .ep = 1, .lora_rank = d.engine.lora.rank,
      .lora_alpha = d.engine.lora.alpha, .lora_dropout = d.engine.lora.dropout,
      .lora_targets = d.engine.lora.targets, .lora_use_rslora = d.engine.lora.rslora,
      .adapter = d.engine.lora.adapter, .lora_seed = (int64_t)d.engine.lora.seed,
      .fp32_params = d.engine.fp32_params};
  return api_init_struct(o, struct_size, API_MIN(meshlm_options), sizeof full, &full);
}

static const char *const k_calls[API_CALL_KINDS] = {
    "?",             "meshlm_close",  "meshlm_logprobs",   "meshlm_train_step",
    "meshlm_save",   "meshlm_resume", "meshlm_export",     "meshlm_refit",
    "meshlm_reload", "meshlm_reload_tensors", "meshlm_generate", "meshlm_zero_grad",
    "meshlm_forward_backward", "meshlm_optimizer_step", "meshlm_eval_loss",
    "meshlm_set_reference", "meshlm_reference_logprobs", "meshlm_score",
    "meshlm_refit_lora", "meshlm_export_merged"};

int api_leave(meshlm_session *s, int rc) {
  if (rc == 0) return 0;
  const char *msg = ml_error_msg();
  snprintf(s->err, sizeof s->err, "rank %d: %s", ml_error_origin() > 0 ? ml_error_origin() : 0,
           msg[0] ? msg : "unknown error (no message recorded)");
  ml_error_clear();
  return -1;
}

int api_agree(meshlm_session *s, int rc) { return api_leave(s, ml_host_agree(s->world, rc)); }

_Noreturn void api_abort(meshlm_session *s) {
  fprintf(stderr, "meshlm: error: %s; aborting every rank (a failure inside collectives)\n",
          ml_error_msg());
  fflush(stderr);
  MPI_Abort(s->comm, 1);
  exit(1);
}

/* The calls an inference_only session refuses (meshlm.h inference_only):
 * those that train, and where its FSDP units hold bf16 alone those that read
 * the fp32 master weights. */
static int check_inference_only(const meshlm_session *s, api_call call) {
  if (!s->o.inference_only) return 0;
  bool trains = call == API_CALL_TRAIN_STEP || call == API_CALL_ZERO_GRAD ||
                call == API_CALL_FORWARD_BACKWARD || call == API_CALL_OPTIMIZER_STEP ||
                call == API_CALL_RESUME;
  bool reads_masters = call == API_CALL_SAVE || call == API_CALL_EXPORT ||
                       call == API_CALL_EXPORT_MERGED || call == API_CALL_REFIT ||
                       call == API_CALL_REFIT_LORA;
  if (trains)
    return ml_err("%s: the session was opened with meshlm_options.inference_only = 1 (no "
                  "gradients or AdamW state); expected a session opened with inference_only 0 "
                  "to train", k_calls[call]);
  if (reads_masters && !ml_fsdp_has_masters(&s->e.fsdp))
    return ml_err("%s: the session was opened with meshlm_options.inference_only = 1 under "
                  "param_dtype bf16 and holds its weights in bf16 alone, no fp32 master "
                  "weights to read; expected a session opened with inference_only 0",
                  k_calls[call]);
  return 0;
}

int api_enter(meshlm_session *s, api_call call) {
  if (!s) return -1;
  s->err[0] = '\0';
  ml_error_clear();
  if (!s->open) {
    snprintf(s->err, sizeof s->err, "%s: the session is not open (closed, or its meshlm_open "
             "failed)", k_calls[call]);
    return -1;
  }
  if (s->closed_by >= 0) {
    snprintf(s->err, sizeof s->err, "%s: rank %d closed the session (its meshlm_close met "
             "another collective call here); expected only meshlm_close now", k_calls[call],
             s->closed_by);
    return -1;
  }
  int n = s->world->size, other = -1, closer = -1;
  int32_t mine = (int32_t)call, *all = ml_calloc((size_t)n, sizeof *all, "the call check");
  int rc = all ? ml_host_all_gather(s->world, &mine, sizeof mine, all) : -1;
  for (int q = 0; rc == 0 && q < n; q++)
    if (all[q] != mine && all[q] > 0 && all[q] < API_CALL_KINDS) {
      other = other < 0 ? q : other;
      closer = closer < 0 && all[q] == API_CALL_CLOSE ? q : closer;
    }
  if (other >= 0)
    rc = ml_err("collective call order: rank %d called %s while rank %d called %s; every rank "
                "must make the same collective calls in the same order%s",
                s->world->rank, k_calls[call], other, k_calls[all[other]],
                closer >= 0 || call == API_CALL_CLOSE
                    ? " (a rank that calls meshlm_close leaves the session: the others can "
                      "only close it too)"
                    : "");
  /* the closing rank tears its session down after this check and makes no
   * collective call on it again: here the session can only be freed */
  s->closed_by = closer;
  free(all);
  if (rc == 0) rc = check_inference_only(s, call); /* the same options on every rank */
  return api_agree(s, rc);
}

static bool compute_dtype(meshlm_dtype d) {
  return d == MESHLM_DTYPE_F32 || d == MESHLM_DTYPE_BF16;
}

/* The options a session cannot run with, named. */
static int check_options(const meshlm_options *o) {
  if (o->dp_replicate < 1 || o->cp < 1 || o->tp < 1)
    return ml_err("meshlm_options: dp_replicate %d, cp %d, tp %d; expected each >= 1",
                  o->dp_replicate, o->cp, o->tp);
  if (o->ep < 1) return ml_err("meshlm_options.ep %d; expected >= 1 (1: no expert parallelism)", o->ep);
  if (!o->device || ml_device_find(o->device) < 0)
    return ml_err("meshlm_options.device '%s'; expected one of %s",
                  o->device ? o->device : "(null)", ml_device_list());
  if (!compute_dtype(o->param_dtype) || !compute_dtype(o->reduce_dtype) ||
      !compute_dtype(o->output_dtype))
    return ml_err("meshlm_options: param_dtype %d, reduce_dtype %d, output_dtype %d; expected "
                  "MESHLM_DTYPE_F32 or MESHLM_DTYPE_BF16",
                  (int)o->param_dtype, (int)o->reduce_dtype, (int)o->output_dtype);
  if ((unsigned)o->ac > MESHLM_AC_MLP)
    return ml_err("meshlm_options.ac %d; expected MESHLM_AC_NONE, _FULL, _SELECTIVE or _MLP",
                  (int)o->ac);
  if ((unsigned)o->reshard_after_forward > MESHLM_RESHARD_NEVER)
    return ml_err("meshlm_options.reshard_after_forward %d; expected MESHLM_RESHARD_DEFAULT, "
                  "_ALWAYS or _NEVER", (int)o->reshard_after_forward);
  if (o->zero < 1 || o->zero > 3 || o->prefetch_forward < 0 || o->prefetch_backward < 0)
    return ml_err("meshlm_options: zero %d, prefetch_forward %d, prefetch_backward %d; expected "
                  "zero 1, 2 or 3 and prefetches >= 0",
                  o->zero, o->prefetch_forward, o->prefetch_backward);
  if ((unsigned)o->schedule > MESHLM_LR_COSINE)
    return ml_err("meshlm_options.schedule %d; expected MESHLM_LR_CONSTANT, _LINEAR or _COSINE",
                  (int)o->schedule);
  if (!(o->lr >= 0) || !(o->min_lr >= 0) || !(o->eps > 0) || !(o->weight_decay >= 0) ||
      !(o->beta1 >= 0 && o->beta1 < 1) || !(o->beta2 >= 0 && o->beta2 < 1))
    return ml_err("meshlm_options: lr %g, min_lr %g, betas (%g, %g), eps %g, weight_decay %g; "
                  "expected lr, min_lr, weight_decay >= 0, betas in [0, 1), eps > 0",
                  o->lr, o->min_lr, o->beta1, o->beta2, o->eps, o->weight_decay);
  if (o->warmup_steps < 0 || o->total_steps < 1)
    return ml_err("meshlm_options: warmup_steps %lld, total_steps %lld; expected >= 0 and >= 1",
                  (long long)o->warmup_steps, (long long)o->total_steps);
  if (!(o->max_grad_norm >= 0))
    return ml_err("meshlm_options.max_grad_norm %g; expected >= 0 (0: no clipping)",
                  o->max_grad_norm);
  if (o->grad_norm_type != 2.0 && o->grad_norm_type != INFINITY)
    return ml_err("meshlm_options.grad_norm_type %g; expected 2 or INFINITY", o->grad_norm_type);
  if (o->micro_batch_tokens < 1)
    return ml_err("meshlm_options.micro_batch_tokens %lld; expected >= 1",
                  (long long)o->micro_batch_tokens);
  if (o->inference_only != 0 && o->inference_only != 1)
    return ml_err("meshlm_options.inference_only %d; expected 0 (training allowed) or 1 "
                  "(scoring and generation only)", o->inference_only);
  return 0;
}

/* The engine's and the step's settings of o (checked), plan the session's copy of
 * o->parallel_plan: the library's one mapping onto the engine. */
static ml_train_settings settings_of(const meshlm_options *o, const char *plan) {
  ml_train_settings t = {.engine = ml_engine_opts_default()};
  ml_engine_opts *eo = &t.engine;
  eo->parallel_plan = plan;
  eo->sequence_parallel = o->sequence_parallel != 0;
  eo->fsdp.param_dtype = k_dtypes[o->param_dtype];
  eo->fsdp.reduce_dtype = k_dtypes[o->reduce_dtype];
  eo->fsdp.reshard_after_forward = k_reshards[o->reshard_after_forward];
  eo->fsdp.zero = o->zero;
  eo->fsdp.prefetch_forward = o->prefetch_forward;
  eo->fsdp.prefetch_backward = o->prefetch_backward;
  eo->fsdp.cpu_offload = o->cpu_offload != 0;
  eo->fsdp.inference_only = o->inference_only != 0;
  eo->batch_invariant = o->batch_invariant != 0;
  eo->freeze = o->freeze;
  eo->fp32_params = o->fp32_params;
  eo->lora = (ml_lora_opts){.rank = o->lora_rank, .alpha = o->lora_alpha,
                            .dropout = o->lora_dropout, .targets = o->lora_targets,
                            .rslora = o->lora_use_rslora != 0, .seed = (uint64_t)o->lora_seed,
                            .adapter = o->adapter};
  eo->output_dtype = k_dtypes[o->output_dtype];
  eo->ac = k_acs[o->ac];
  t.step = (ml_step_opts){
      .schedule = {k_decays[o->schedule], o->lr, o->min_lr, o->warmup_steps, o->total_steps},
      .beta1 = o->beta1, .beta2 = o->beta2, .eps = o->eps, .weight_decay = o->weight_decay,
      .max_grad_norm = o->max_grad_norm, .norm_type = o->grad_norm_type};
  return t;
}

/* Copy the options, their strings and their settings into s. */
static int keep_options(meshlm_session *s, const meshlm_options *o) {
  s->o = *o;
  s->device = strdup(o->device);
  s->plan = o->parallel_plan ? strdup(o->parallel_plan) : NULL;
  s->freeze = o->freeze ? strdup(o->freeze) : NULL;
  s->lora_targets = o->lora_targets ? strdup(o->lora_targets) : NULL;
  s->adapter = o->adapter ? strdup(o->adapter) : NULL;
  s->fp32_params = o->fp32_params ? strdup(o->fp32_params) : NULL;
  if (!s->device || (o->parallel_plan && !s->plan) || (o->freeze && !s->freeze) ||
      (o->lora_targets && !s->lora_targets) || (o->adapter && !s->adapter) ||
      (o->fp32_params && !s->fp32_params))
    return ml_err("meshlm_open: out of memory");
  s->o.device = s->device;
  s->o.parallel_plan = s->plan;
  s->o.freeze = s->freeze;
  s->o.lora_targets = s->lora_targets;
  s->o.adapter = s->adapter;
  s->o.fp32_params = s->fp32_params;
  s->set = settings_of(&s->o, s->plan);
  return 0;
}

/* Mesh and engine on s->comm. */
static int open_engine(meshlm_session *s, const char *model_dir) {
  ml_engine_opts eo = s->set.engine;
  ml_comm_factory make_comm;
  void *ctx;
  ML_TRY(ml_mesh_device_open(s->comm, s->o.device, "meshlm_open: meshlm_options.device",
                             ML_DEVICE_COMM_AUTO, "meshlm_open",
                             &eo.backend, &make_comm, &ctx));
  ML_TRY(ml_mesh_create(s->comm, s->o.dp_replicate, 0, s->o.cp, s->o.tp, make_comm, ctx,
                        &s->mesh));
  ML_TRY(ml_mesh_set_ep(&s->mesh, s->comm, s->o.ep, make_comm, ctx));
  return ml_engine_open(&s->e, &s->mesh, model_dir, &eo);
}

static int ensure_mpi(void) {
  int up = 0, down = 0;
  MPI_Initialized(&up);
  MPI_Finalized(&down);
  if (down) return ml_err("meshlm_open: MPI was finalised already; expected it running");
  if (up) return 0;
  int provided;
  if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
    return ml_err("meshlm_open: MPI_Init_thread failed");
  g_mpi_ours = true;
  return 0;
}

/* meshlm_open_f on the communicator itself. */
static int open_comm(const char *model_dir, const meshlm_options *o, MPI_Comm comm,
                     meshlm_session **out) {
  meshlm_session *s = calloc(1, sizeof *s);
  *out = s;
  if (!s) return -1;
  s->comm = MPI_COMM_NULL;
  s->closed_by = -1;
  meshlm_options def, opts;
  meshlm_options_default(&def);
  ml_error_clear();
  if (ensure_mpi()) return api_leave(s, -1);
  int wr = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &wr);
  ml_error_set_rank(wr);
  if (MPI_Comm_dup(comm, &s->comm) != MPI_SUCCESS) {
    s->comm = MPI_COMM_NULL;
    return api_leave(s, ml_err("meshlm_open: MPI_Comm_dup of the communicator failed"));
  }
  if (ml_host_create(s->comm, "world", &s->world)) return api_leave(s, -1);
  int rc = o ? API_READ("meshlm_open", meshlm_options, o, &def, &opts) : 0;
  o = o ? &opts : &def;
  if (rc == 0) rc = check_options(o);
  if (rc == 0 && !model_dir) rc = ml_err("meshlm_open: model_dir is NULL");
  if (rc == 0) rc = keep_options(s, o);
  if (ml_host_agree(s->world, rc)) return api_leave(s, -1);
  if (api_agree(s, open_engine(s, model_dir))) return -1;
  s->open = true;
  return 0;
}

int meshlm_open_f(const char *model_dir, const meshlm_options *o, int64_t comm_f,
                  meshlm_session **out) {
  int up = 0;
  MPI_Initialized(&up);
  if (comm_f < 0 || !up) return open_comm(model_dir, o, MPI_COMM_WORLD, out);
  return open_comm(model_dir, o, MPI_Comm_f2c((MPI_Fint)comm_f), out);
}

void meshlm_close(meshlm_session *s) {
  if (!s) return;
  if (s->open && s->closed_by < 0) api_enter(s, API_CALL_CLOSE);
  if (s->gen_open) {
    ml_engine_close(&s->gen);
    ml_mesh_destroy(&s->gen_mesh);
  }
  ml_engine_close(&s->e); /* the reference policy's shards too (engine/reference.h) */
  ml_mesh_destroy(&s->mesh);
  ml_host_destroy(s->world);
  if (s->comm != MPI_COMM_NULL) MPI_Comm_free(&s->comm);
  free(s->device);
  free(s->plan);
  free(s->freeze);
  free(s->fp32_params);
  free(s->lora_targets);
  free(s->adapter);
  free(s->wnames);
  free(s->wdtypes);
  free(s);
}

int meshlm_finalize(void) {
  int down = 0;
  MPI_Finalized(&down);
  if (!g_mpi_ours || down) return 0;
  g_mpi_ours = false;
  ml_backend_release_all();
  return MPI_Finalize() == MPI_SUCCESS ? 0 : -1;
}

const char *meshlm_error(const meshlm_session *s) {
  return s ? s->err : "meshlm: no session (meshlm_open could not allocate one)";
}

/* config.json's bos_token_id / eos_token_id (an int, or the first of a
 * list), −1 when absent. */
static int32_t special_id(const char *model_dir, const char *key) {
  char path[4096];
  snprintf(path, sizeof path, "%s/config.json", model_dir);
  json_t *root = json_load_file(path, 0, NULL);
  json_t *v = root ? json_object_get(root, key) : NULL;
  if (json_is_array(v)) v = json_array_get(v, 0);
  int32_t id = json_is_integer(v) ? (int32_t)json_integer_value(v) : -1;
  json_decref(root);
  return id;
}

int api_local(meshlm_session *s, const char *call) {
  if (s && s->open) return 0;
  if (s) snprintf(s->err, sizeof s->err, "%s: the session is not open (closed, or its meshlm_open "
                  "failed)", call);
  return -1;
}

int meshlm_get_info(meshlm_session *s, meshlm_info *out) {
  ML_TRY(api_local(s, "meshlm_get_info"));
  const ml_mesh *m = &s->mesh;
  const ml_model_config *c = &s->e.model.cfg;
  meshlm_info full = {
      .rank = m->rank, .world = m->world_size, .dp_replicate = m->dp_replicate,
      .dp_shard = m->dp_shard, .cp = m->cp, .tp = m->tp,
      .dp_rank = m->groups[ML_GROUP_DP].rank, .dp_size = m->groups[ML_GROUP_DP].size,
      .cp_rank = m->cp_rank, .tp_rank = m->tp_rank, .vocab_size = c->vocab,
      .hidden_size = c->hidden, .num_layers = c->n_layers,
      .num_params = ml_model_config_num_params(c),
      .bos_token_id = special_id(s->e.model_dir, "bos_token_id"),
      .eos_token_id = special_id(s->e.model_dir, "eos_token_id"), .step = s->e.step,
      .max_seq_len = ml_model_config_max_seq_len(c)};
  if (!out) return api_leave(s, ml_err("meshlm_get_info: out is NULL"));
  return api_leave(s, API_WRITE("meshlm_get_info", meshlm_info, out, &full));
}

int api_check_seqs(const meshlm_session *s, const meshlm_seqs *b, const char *what,
                   int64_t min_len, int64_t *tokens_out, int64_t *preds) {
  if (!b) return ml_err("%s: the batch is NULL", what);
  if (b->n < 0) return ml_err("%s: n = %lld sequences; expected >= 0", what, (long long)b->n);
  if (b->n > 0 && (!b->lens || !b->tokens))
    return ml_err("%s: %lld sequences but lens or tokens is NULL", what, (long long)b->n);
  const ml_model_config *c = &s->e.model.cfg;
  int64_t tokens = 0, p = 0, max = ml_model_config_max_seq_len(c);
  for (int64_t k = 0; k < b->n; k++) {
    int64_t L = b->lens[k];
    if (L < min_len || L > max)
      return ml_err("%s: sequence %lld has %lld tokens; expected %lld .. %lld "
                    "(max_position_embeddings)",
                    what, (long long)k, (long long)L, (long long)min_len, (long long)max);
    tokens += L; /* each <= ML_MAX_POSITIONS = 2^24: no overflow below 2^39 sequences */
    p += L - 1;
  }
  for (int64_t t = 0, k = 0, end = b->n ? b->lens[0] : 0; t < tokens; t++) {
    while (t >= end) end += b->lens[++k];
    if (b->tokens[t] < 0 || b->tokens[t] >= c->vocab)
      return ml_err("%s: sequence %lld, token %lld: id %d; expected 0 .. %lld (vocab_size - 1)",
                    what, (long long)k, (long long)(t - (end - b->lens[k])), b->tokens[t],
                    (long long)(c->vocab - 1));
  }
  *tokens_out = tokens;
  if (preds) *preds = p;
  return 0;
}

int api_check_mask(const meshlm_seqs *b, const uint8_t *mask, const char *what) {
  if (!mask) return 0;
  for (int64_t k = 0, o = 0; k < b->n; o += b->lens[k] - 1, k++)
    for (int64_t t = 0; t < b->lens[k] - 1; t++)
      if (mask[o + t] > 1)
        return ml_err("%s: sequence %lld, prediction %lld: %u; expected 0 or 1", what,
                      (long long)k, (long long)t, (unsigned)mask[o + t]);
  return 0;
}

/* FNV-1a over the batch's lengths and ids. */
static uint64_t batch_hash(const meshlm_seqs *b) {
  uint64_t h = ml_fnv1a(ML_FNV_BASIS, &b->n, sizeof b->n);
  int64_t tokens = 0;
  for (int64_t k = 0; k < b->n; k++) {
    tokens += b->lens[k];
    h = ml_fnv1a(h, &b->lens[k], sizeof b->lens[k]);
  }
  return ml_fnv1a(h, b->tokens, sizeof(int32_t) * (size_t)tokens);
}

int api_check_replicas(meshlm_session *s, const meshlm_seqs *b, const char *what) {
  uint64_t h = batch_hash(b);
  ml_group groups[2] = {ML_GROUP_TP, ML_GROUP_CP};
  for (int g = 0; g < 2; g++) {
    bool same;
    ML_TRY(ml_host_all_equal(ml_mesh_host(&s->mesh, groups[g]), h, &same));
    if (!same)
      return ml_err("%s: the %s ranks of data-parallel rank %d passed different batches; "
                    "expected the same sequences on every tp and cp rank of a data-parallel rank",
                    what, ml_group_name(groups[g]), s->mesh.groups[ML_GROUP_DP].rank);
  }
  return 0;
}
