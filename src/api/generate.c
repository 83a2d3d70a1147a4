/* meshlm_generate (include/meshlm/meshlm.h; engine/generate.h does the
 * decoding): on the policy's own engine (sampling.replica 0: its mesh, its
 * weights), or on a per-rank replica of the policy's weights (replica 1).
 * The replica is an engine on this rank alone (a one-rank mesh over
 * MPI_COMM_SELF), opened from the model directory at the first call and
 * refitted from the policy (ml_engine_stream_params to every rank) whenever
 * the policy's weights changed since — NeMo RL's generation engine and its
 * refit, in one process. */

#include "api/session.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/hash.h"
#include "engine/generate.h"
#include "ckpt/save.h"
#include "parallel/device.h"

int meshlm_sampling_init(meshlm_sampling *sp, size_t struct_size) {
  meshlm_sampling full = {.max_new_tokens = 32, .temperature = 1.0f, .top_p = 1.0f,
                          .eos_token_id = -1, .n = 1};
  return api_init_struct(sp, struct_size, API_MIN(meshlm_sampling), sizeof full, &full);
}

static int open_replica(meshlm_session *s) {
  ml_engine_opts eo = s->e.opts;
  eo.parallel_plan = NULL;
  eo.sequence_parallel = false;
  ml_comm_factory make_comm;
  void *ctx;
  eo.backend = s->e.be; /* the session's device */
  ml_mesh_device_comm(eo.backend, &make_comm, &ctx);
  ML_TRY(ml_mesh_create(MPI_COMM_SELF, 1, 1, 1, 1, make_comm, ctx, &s->gen_mesh));
  if (ml_engine_open(&s->gen, &s->gen_mesh, s->e.model_dir, &eo)) {
    ml_engine_close(&s->gen);
    ml_mesh_destroy(&s->gen_mesh);
    return -1;
  }
  s->gen_open = true;
  s->gen_version = 0; /* the directory's weights: the policy's until they change */
  return 0;
}

/* The replica's parameter k (export order) takes the policy's global tensor:
 * on one rank its FSDP shard is the whole tensor. */
static int into_replica(void *ctx, int k, const ml_param *p, const float *global) {
  ml_engine *g = ctx;
  for (int u = 0; u < g->fsdp.n_units; u++) {
    ml_fsdp_unit *unit = &g->fsdp.units[u];
    if (k >= unit->n) {
      k -= unit->n;
      continue;
    }
    return ml_be_copy(g->fsdp.shard_be, unit->shard + unit->shard_off[k], global,
                      sizeof(float) * (size_t)(p->shape[0] * p->shape[1]), ML_COPY_H2D);
  }
  return ml_err("meshlm_generate: the replica has no parameter %d", k);
}

/* Collective: the replica open and at the policy's weights on every rank. */
static int sync_replica(meshlm_session *s) {
  int rc = !ml_fsdp_has_masters(&s->e.fsdp) /* the same on every rank */
               ? ml_err("meshlm_generate: sampling.replica 1 streams the fp32 master weights "
                        "to the replica, and the session (meshlm_options.inference_only = 1 "
                        "under param_dtype bf16) holds bf16 alone; expected sampling.replica 0")
           : s->gen_open ? 0
                         : open_replica(s);
  ML_TRY(ml_host_agree(s->world, rc));
  if (s->gen_version == s->version) return 0;
  ML_TRY(ml_engine_stream_params(&s->e, -1, into_replica, &s->gen));
  ml_fsdp_params_changed(&s->gen.fsdp); /* its shards were written by into_replica */
  ML_TRY(ml_host_agree(s->world, ml_engine_sync_params(&s->gen)));
  s->gen_version = s->version;
  return 0;
}

static int check_sampling(const meshlm_sampling *sp) {
  if (sp->replica != 0 && sp->replica != 1)
    return ml_err("meshlm_generate: sampling.replica %d; expected 0 (the policy's mesh) or 1 "
                  "(a one-rank replica per rank)", sp->replica);
  if (sp->max_new_tokens < 1)
    return ml_err("meshlm_generate: sampling.max_new_tokens %lld; expected >= 1",
                  (long long)sp->max_new_tokens);
  if (sp->eos_token_id < -2)
    return ml_err("meshlm_generate: eos_token_id %d; expected a token id, -1 (the model's) or "
                  "-2 (none)", sp->eos_token_id);
  return 0; /* the rest: ml_generate's checks, naming each */
}

/* max_new_tokens within what the longest prompt (checked) leaves of the
 * model's positions, before the replica or the outputs are touched. */
static int check_room(const meshlm_session *s, const meshlm_seqs *prompts, int64_t max_new) {
  int64_t max = ml_model_config_max_seq_len(&s->e.model.cfg), longest = 0;
  for (int64_t k = 1; k < prompts->n; k++)
    if (prompts->lens[k] > prompts->lens[longest]) longest = k;
  int64_t len = prompts->n ? prompts->lens[longest] : 1; /* <= max: api_check_seqs */
  if (max_new <= max - len) return 0;
  char which[64] = "no prompt: at least 1";
  if (prompts->n) snprintf(which, sizeof which, "prompt %lld", (long long)longest);
  return ml_err("meshlm_generate: sampling.max_new_tokens %lld; expected at most %lld "
                "(meshlm_info.max_seq_len %lld − the longest prompt's %lld tokens, %s)",
                (long long)max_new, (long long)(max - len), (long long)max, (long long)len,
                which);
}

/* FNV-1a of what the decoding reads of the sampling besides the prompts
 * (the struct's scalars field by field: its padding is not the caller's). */
static uint64_t sampling_hash(const meshlm_sampling *sp, int64_t n_prompts) {
  uint64_t h = ML_FNV_BASIS;
#define H(f) h = ml_fnv1a(h, &sp->f, sizeof sp->f)
  H(max_new_tokens); H(temperature); H(top_p); H(greedy); H(eos_token_id); H(seed); H(n);
  H(top_k); H(min_p); H(n_stop); H(max_running); H(prefill_tokens); H(replica);
  H(max_kv_bytes);
#undef H
  if (sp->n_stop > 0) h = ml_fnv1a(h, sp->stop_token_ids, sizeof(int32_t) * (size_t)sp->n_stop);
  if (sp->max_new_tokens_per)
    h = ml_fnv1a(h, sp->max_new_tokens_per, sizeof(int64_t) * (size_t)n_prompts);
  return h;
}

/* replica 0: a mesh without cp whose tp ranks passed the same prompts and
 * sampling (collective over tp and cp). */
static int check_policy_mesh(meshlm_session *s, const meshlm_seqs *prompts,
                             const meshlm_sampling *sp) {
  const ml_mesh *ms = &s->mesh;
  if (ms->cp != 1)
    return ml_err("meshlm_generate: sampling.replica 0 (the policy's mesh) on a mesh with cp "
                  "%d; expected cp 1 (the KV cache holds whole sequences), or replica 1",
                  ms->cp);
  ML_TRY(api_check_replicas(s, prompts, "meshlm_generate"));
  bool same;
  ML_TRY(ml_host_all_equal(ml_mesh_host(ms, ML_GROUP_TP), sampling_hash(sp, prompts->n), &same));
  if (!same)
    return ml_err("meshlm_generate: the tp ranks of data-parallel rank %d passed different "
                  "sampling; expected the same meshlm_sampling on every tp rank of a "
                  "data-parallel rank (they decode together), or replica 1",
                  ms->groups[ML_GROUP_DP].rank);
  return 0;
}

/* The stop ids: eos (resolved; < 0: none) then the caller's, into ids
 * (malloc'd, *n of them). Errors: allocation, n_stop < 0 or the list
 * missing (named). */
static int stop_ids(const meshlm_sampling *sp, int32_t eos, int32_t **ids, int64_t *n) {
  *ids = NULL;
  *n = 0;
  if (sp->n_stop < 0 || (sp->n_stop > 0 && !sp->stop_token_ids))
    return ml_err("meshlm_generate: sampling.n_stop %lld%s; expected >= 0 and the ids in "
                  "stop_token_ids",
                  (long long)sp->n_stop, sp->n_stop > 0 ? " with stop_token_ids NULL" : "");
  *ids = ml_malloc_array(sp->n_stop + 1, sizeof(int32_t), "the stop ids (%lld)",
                         (long long)(sp->n_stop + 1));
  if (!*ids) return -1;
  if (eos >= 0) (*ids)[(*n)++] = eos;
  for (int64_t i = 0; i < sp->n_stop; i++) (*ids)[(*n)++] = sp->stop_token_ids[i];
  return 0;
}

int meshlm_generate_samples(meshlm_session *s, const meshlm_seqs *prompts,
                            const meshlm_sampling *sp, int32_t *out_tokens, int64_t *out_lens,
                            float *out_logprobs, int32_t *out_finish) {
  ML_TRY(api_enter(s, API_CALL_GENERATE));
  int64_t tokens;
  meshlm_sampling def, spc;
  meshlm_sampling_default(&def);
  int rc = sp ? API_READ("meshlm_generate", meshlm_sampling, sp, &def, &spc)
              : ml_err("meshlm_generate: sampling is NULL");
  sp = &spc;
  if (rc == 0) rc = check_sampling(sp);
  if (rc == 0) rc = api_check_seqs(s, prompts, "meshlm_generate", 1, &tokens, NULL);
  if (rc == 0) rc = check_room(s, prompts, sp->max_new_tokens);
  if (rc == 0 && prompts->n > 0 && (!out_tokens || !out_lens))
    rc = ml_err("meshlm_generate: out_tokens or out_lens is NULL");
  meshlm_info info;
  int32_t eos = sp->eos_token_id, *stop = NULL;
  if (rc == 0 && eos == -1 && meshlm_get_info(s, &info) == 0) eos = info.eos_token_id;
  int64_t n_stop = 0;
  if (rc == 0) rc = stop_ids(sp, eos, &stop, &n_stop);
  ml_gen_stats st = {0};
  ml_gen_opts o = {.max_new = sp->max_new_tokens, .max_new_per = sp->max_new_tokens_per,
                   .n_samples = sp->n, .stop = stop, .n_stop = n_stop, .seed = sp->seed,
                   .max_running = sp->max_running, .prefill_tokens = sp->prefill_tokens,
                   .max_kv_bytes = sp->max_kv_bytes, .stats = &st,
                   .sampler = {.greedy = sp->greedy != 0, .temperature = sp->temperature,
                               .top_k = sp->top_k, .top_p = sp->top_p, .min_p = sp->min_p}};
  /* the arguments against the model (the replica's config is the policy's), before any
     collective: the replica decodes each rank's own prompts, the policy's engine its tp
     group together and FSDP's group unsharding together, so every rank enters or none */
  if (rc == 0)
    rc = ml_generate_check(&s->e, prompts->n, prompts->lens, prompts->tokens, &o, out_tokens,
                           out_lens);
  if (api_agree(s, rc) ||
      api_agree(s, sp->replica ? sync_replica(s) : check_policy_mesh(s, prompts, sp))) {
    free(stop);
    return -1;
  }
  rc = ml_generate(sp->replica ? &s->gen : &s->e, prompts->n, prompts->lens, prompts->tokens,
                   &o, out_tokens, out_lens, out_logprobs, out_finish);
  free(stop);
  if (rc == 0) { /* meshlm_call_stats: this call's preemptions, nothing else */
    memset(&s->last, 0, sizeof s->last);
    s->last.preemptions = st.preemptions;
  }
  return api_agree(s, rc);
}

int meshlm_generate(meshlm_session *s, const meshlm_seqs *prompts, const meshlm_sampling *sp,
                    int32_t *out_tokens, int64_t *out_lens, float *out_logprobs) {
  return meshlm_generate_samples(s, prompts, sp, out_tokens, out_lens, out_logprobs, NULL);
}
