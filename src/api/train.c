/* meshlm_train_step: one optimizer step on a variable-length batch under
 * the objectives of include/meshlm/meshlm.h (NeMo RL's loss functions);
 * the loss calls it shares with the split steps (api/train.h). */
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "api/routing.h"
#include "api/train.h"
#include "common/checked.h"

int meshlm_loss_init(meshlm_loss *l, size_t struct_size) {
  meshlm_loss full = {.kind = MESHLM_LOSS_NLL, .ratio_clip_min = 0.2f, .ratio_clip_max = 0.2f};
  return api_init_struct(l, struct_size, API_MIN(meshlm_loss), sizeof full, &full);
}

/* The loss's fields and the arrays it needs, named. */
static int check_loss(const char *call, const meshlm_loss *l, const meshlm_train_batch *b) {
  if ((unsigned)l->kind > MESHLM_LOSS_CUSTOM)
    return ml_err("%s: loss.kind %d; expected MESHLM_LOSS_NLL, _WEIGHTED_NLL, _CLIPPED_PG or "
                  "_CUSTOM", call, (int)l->kind);
  if (!(l->ratio_clip_min >= 0) || !(l->ratio_clip_max >= 0) ||
      !(l->ratio_clip_c == 0 || l->ratio_clip_c > 1) || !(l->kl_penalty >= 0))
    return ml_err("%s: loss ratio_clip_min %g, ratio_clip_max %g, ratio_clip_c %g, "
                  "kl_penalty %g; expected clips >= 0, ratio_clip_c 0 (off) or > 1, "
                  "kl_penalty >= 0",
                  call, l->ratio_clip_min, l->ratio_clip_max, l->ratio_clip_c, l->kl_penalty);
  if (!isfinite(l->entropy_coef))
    return ml_err("%s: loss.entropy_coef %g; expected a finite coefficient (0: off)", call,
                  l->entropy_coef);
  if ((l->kind == MESHLM_LOSS_NLL || l->kind == MESHLM_LOSS_CUSTOM) && l->kl_penalty > 0)
    return ml_err("%s: loss.kl_penalty %g with kind %d; expected 0 (the KL penalty goes with "
                  "WEIGHTED_NLL or CLIPPED_PG)", call, l->kl_penalty, (int)l->kind);
  if (l->kind == MESHLM_LOSS_CUSTOM && !l->objective)
    return ml_err("%s: MESHLM_LOSS_CUSTOM needs loss.objective; it is NULL", call);
  if (l->kind != MESHLM_LOSS_CUSTOM && (l->objective || l->objective_seq_logprobs))
    return ml_err("%s: loss.objective / objective_seq_logprobs set with kind %d; expected "
                  "MESHLM_LOSS_CUSTOM", call, (int)l->kind);
  if ((unsigned)l->is_level > MESHLM_IS_SEQUENCE ||
      (unsigned)l->is_truncation > MESHLM_IS_TRUNC_SEQ_MASK_TIS)
    return ml_err("%s: loss.is_level %d, is_truncation %d; expected MESHLM_IS_OFF/_TOKEN/"
                  "_SEQUENCE and MESHLM_IS_TRUNC_NONE/_TIS/_ICEPOP/_SEQ_MASK_TIS",
                  call, (int)l->is_level, (int)l->is_truncation);
  if (l->is_level != MESHLM_IS_OFF && l->kind != MESHLM_LOSS_CLIPPED_PG)
    return ml_err("%s: loss.is_level %d with kind %d; expected MESHLM_LOSS_CLIPPED_PG (NeMo "
                  "RL ClippedPGLossFn's correction)", call, (int)l->is_level, (int)l->kind);
  if (l->is_level == MESHLM_IS_SEQUENCE && !l->sequence_level)
    return ml_err("%s: loss.is_level MESHLM_IS_SEQUENCE with token-level normalisation; "
                  "expected sequence_level 1 (NeMo RL: sequence-level importance ratios are "
                  "mutually exclusive with token_level_loss)", call);
  if (l->is_truncation != MESHLM_IS_TRUNC_NONE &&
      (l->is_level == MESHLM_IS_OFF || !(l->is_ratio_min >= 0) ||
       !(l->is_ratio_max >= l->is_ratio_min) || !(l->is_ratio_max > 0) ||
       !isfinite(l->is_ratio_max)))
    return ml_err("%s: loss.is_truncation %d with is_level %d, is_ratio_min %g, is_ratio_max "
                  "%g; expected an is_level other than OFF and finite 0 <= min <= max, max > 0",
                  call, (int)l->is_truncation, (int)l->is_level, l->is_ratio_min,
                  l->is_ratio_max);
  if (b->seqs.n > 0 && l->kind == MESHLM_LOSS_CLIPPED_PG && !b->old_logprobs)
    return ml_err("%s: MESHLM_LOSS_CLIPPED_PG needs old_logprobs; it is NULL", call);
  if (b->seqs.n > 0 && l->kl_penalty > 0 && !b->ref_logprobs)
    return ml_err("%s: loss.kl_penalty %g needs ref_logprobs; it is NULL", call, l->kl_penalty);
  if (b->seqs.n > 0 && l->is_level != MESHLM_IS_OFF && !b->generation_logprobs)
    return ml_err("%s: loss.is_level %d needs generation_logprobs; it is NULL", call,
                  (int)l->is_level);
  return 0;
}

/* Masked predictions of sequence k. */
static int64_t masked(const meshlm_train_batch *b, int64_t k, int64_t o) {
  int64_t L = b->seqs.lens[k], n = 0;
  for (int64_t t = 0; t < L - 1; t++) n += !b->token_mask || b->token_mask[o + t];
  return n;
}

/* The global counts the loss is normalised by: masked predictions and
 * sequences with one, over the data-parallel ranks (tp and cp ranks of one
 * hold the same batch). g[0] tokens, g[1] sequences, g[2] all sequences. */
static int global_counts(meshlm_session *s, const char *call, const meshlm_train_batch *b,
                         const api_plan *p, int64_t g[3]) {
  g[0] = g[1] = 0;
  g[2] = b->seqs.n;
  for (int64_t k = 0; k < b->seqs.n; k++) {
    int64_t n = masked(b, k, p->start[k] - k);
    g[0] += n;
    g[1] += n > 0;
  }
  ML_TRY(ml_host_all_reduce_i64(ml_mesh_host(&s->mesh, ML_GROUP_DP), g, 3, ML_RED_SUM));
  if (g[0] == 0)
    return ml_err("%s: no masked prediction in the whole global batch (%lld sequences); "
                  "expected at least one token_mask entry set", call, (long long)g[2]);
  return 0;
}

/* Micro-batch j's objective inputs (position i of the row: the target
 * token i + 1). */
static void fill_objective(const api_plan *p, const meshlm_train_batch *b, const meshlm_loss *l,
                           const int64_t g[3], const float *rho, int64_t j) {
  const ml_pack *pk = &p->pack;
  const ml_micro *m = &pk->mb[j];
  for (int64_t i = 0; i < m->S; i++) pk->obj[i] = (ml_obj_in){.idx = -1};
  int64_t at = 0;
  for (int64_t i = 0; i < m->count; i++) {
    int64_t k = pk->order[m->first + i], L = b->seqs.lens[k], o = p->start[k] - k;
    int64_t nk = l->sequence_level ? masked(b, k, o) : 0;
    double norm = l->sequence_level ? (double)nk * (double)g[1] : (double)g[0];
    float sw = b->seq_weights ? b->seq_weights[k] : 1.0f;
    for (int64_t t = 0; t < L - 1; t++) {
      ml_obj_in *in = &pk->obj[at + t];
      bool on = !b->token_mask || b->token_mask[o + t];
      in->w = on ? 1.0f / (float)norm : 0.0f; /* as the CLI's 1 / global targets */
      in->adv = (b->token_weights ? b->token_weights[o + t] : 1.0f) * sw;
      in->old_lp = b->old_logprobs ? b->old_logprobs[o + t] : 0.0f;
      in->ref_lp = b->ref_logprobs ? b->ref_logprobs[o + t] : 0.0f;
      in->idx = o + t;
      in->rho = rho ? rho[o + t] : 1.0f;
    }
    at += L;
  }
}

/* Micro-batch j's recorded routing into the model's replay (b.routing set). */
static void fill_replay(const api_loss_call *c, int64_t j) {
  if (!c->replay) return;
  api_routing_pack(&c->p, &c->b.seqs, j, c->route_cols, c->b.routing, c->replay);
  c->model->route_replay = c->replay;
}

/* A step's micro-batches (ml_step_source.fill): the packed batch with its
 * objective inputs (and its routing to replay). */
static int fill_micro(void *ctx, int64_t j, ml_engine_batch *eb) {
  const api_loss_call *c = ctx;
  ml_pack_fill(&c->p.pack, j, eb);
  fill_replay(c, j);
  fill_objective(&c->p, &c->b, &c->l, c->g, c->is.rho, j);
  eb->obj = c->p.pack.obj;
  return 0;
}

/* The prepared parts that may fail without a collective (agreed after). */
static int prepare(meshlm_session *s, api_loss_call *c) {
  ML_TRY(api_is_prepare(&c->b, &c->l, &c->p, c->preds, &c->is));
  if (c->b.routing) {
    ML_TRY(api_routing_check(s, c->name, "batch->routing"));
    if (c->l.kind == MESHLM_LOSS_CUSTOM && c->l.objective_seq_logprobs)
      return ml_err("%s: batch->routing with loss.objective_seq_logprobs is not implemented "
                    "(its sums' forward-only pass does not replay); expected one of them",
                    c->name);
    c->route_cols = api_routing_cols(s);
    c->model = &s->e.model;
    int64_t n = ml_mul_sat(c->p.pack.S_max, c->route_cols);
    if (!(c->replay = ml_malloc_array(n, sizeof(int32_t), "the routing to replay (%lld)",
                                      (long long)n)))
      return -1;
  }
  if (c->l.kind == MESHLM_LOSS_CUSTOM)
    ML_TRY(api_custom_prepare(s, &c->b, &c->l, &c->p, c->g, &c->cu));
  return 0;
}

int api_loss_begin(meshlm_session *s, const char *name, const meshlm_train_batch *b,
                   const meshlm_loss *loss, const meshlm_step_result *out, bool backward,
                   api_loss_call *c) {
  memset(c, 0, sizeof *c);
  c->name = name;
  meshlm_loss def;
  meshlm_loss_default(&def);
  meshlm_train_batch nothing = {.struct_size = sizeof nothing};
  int64_t tokens;
  int rc = b ? 0 : ml_err("%s: batch is NULL", name);
  if (rc == 0) rc = API_READ(name, meshlm_train_batch, b, &nothing, &c->b);
  c->l = def;
  if (rc == 0 && loss) rc = API_READ(name, meshlm_loss, loss, &def, &c->l);
  if (rc == 0 && out) rc = API_STRUCT_SIZE(name, meshlm_step_result, out->struct_size);
  if (rc == 0) rc = api_check_seqs(s, &c->b.seqs, name, 1, &tokens, &c->preds);
  if (rc == 0) rc = api_check_mask(&c->b.seqs, c->b.token_mask, name);
  if (rc == 0) rc = check_loss(name, &c->l, &c->b);
  if (api_agree(s, rc)) return -1;
  if (api_agree(s, api_check_replicas(s, &c->b.seqs, name))) return -1;
  if (api_agree(s, api_plan_batch(s, &c->b.seqs, !backward, &c->p)) ||
      api_agree(s, global_counts(s, name, &c->b, &c->p, c->g)) || api_agree(s, prepare(s, c)))
    return -1;
  ml_obj_kind kinds[] = {ML_OBJ_NLL, ML_OBJ_WEIGHTED_NLL, ML_OBJ_CLIPPED_PG, ML_OBJ_CUSTOM};
  const meshlm_loss *l = &c->l;
  c->obj = (ml_objective){.kind = kinds[l->kind], .clip_low = l->ratio_clip_min,
                          .clip_high = l->ratio_clip_max, .clip_c = l->ratio_clip_c,
                          .kl_beta = l->kl_penalty, .is_weighted = c->is.rho != NULL,
                          .fn = api_custom_call, .ctx = &c->cu,
                          .entropy_coef = l->entropy_coef};
  ml_mesh_stats_reset(&s->mesh);
  api_custom_sums(s, &c->b, &c->p, &c->cu);
  return 0;
}

void api_loss_free(api_loss_call *c) {
  if (c->model) c->model->route_replay = NULL;
  free(c->replay);
  api_custom_free(&c->cu);
  api_is_free(&c->is);
  api_plan_free(&c->p);
}

void api_loss_backward(meshlm_session *s, api_loss_call *c, ml_step_result *r) {
  ml_step_source src = {.n_micro = c->p.pack.n_mb, .fill = fill_micro, .ctx = c,
                        .objective = &c->obj, .norm_type = c->norm_type};
  if (ml_step_accumulate(&s->e, &src, r)) api_abort(s);
  s->e.model.route_replay = NULL;
  api_plan_stats(s, &c->p);
}

void api_loss_forward(meshlm_session *s, api_loss_call *c, ml_step_result *r) {
  const ml_pack *pk = &c->p.pack;
  ml_obj_sums *sums = &r->sums;
  *sums = (ml_obj_sums){0};
  double coef = c->obj.entropy_coef;
  float *w = ml_malloc_array(pk->S_max, sizeof *w, "the objective's weights (%lld)",
                             (long long)pk->S_max);
  float *ent = coef != 0.0 ? ml_malloc_array(pk->S_max, sizeof *ent, "the entropies (%lld)",
                                             (long long)pk->S_max)
                           : NULL;
  int rc = w && (ent || coef == 0.0) ? 0 : -1;
  /* the micro-batches' MoE load-balancing terms, each the whole batch's on every rank, added
     after the reduction as the training step adds them (engine/step.c) */
  double aux = 0.0;
  /* every rank holds all of its data rank's log-probs (gathered over cp): evaluated once per
     data rank, summed over dp below */
  for (int64_t j = 0; j < pk->n_mb; j++) {
    ml_engine_batch eb;
    ml_pack_fill(pk, j, &eb);
    fill_replay(c, j);
    double part;
    ml_engine_scores es = {.logprobs = pk->lp, .entropy = ent, .aux = &part};
    if (ml_engine_scores_batch(&s->e, &eb, &es)) api_abort(s);
    aux += part;
    fill_micro(c, j, &eb);
    int64_t n = eb.S - 1; /* out [1, S − 1]; an empty micro-batch (S 0) has none */
    for (int64_t i = 0; rc == 0 && i < n; i++) w[i] = pk->obj[i].w != 0.0f ? 1.0f : 0.0f;
    if (rc == 0 && n > 0) rc = ml_objective_chunk(&c->obj, n, pk->lp, pk->obj, 0, n, w, sums);
    /* the entropy bonus, − c·Σ w·H as the training pass's classifier adds it */
    for (int64_t i = 0; ent && rc == 0 && i < n; i++)
      sums->entropy += pk->obj[i].w != 0.0f ? (double)pk->obj[i].w * (double)ent[i] : 0.0;
  }
  free(w);
  free(ent);
  s->e.model.route_replay = NULL;
  sums->loss -= coef * sums->entropy;
  double v[6] = {sums->loss, sums->kl, (double)sums->trained, (double)sums->clipped,
                 sums->entropy, rc != 0};
  if (ml_host_all_reduce_f64(ml_mesh_host(&s->mesh, ML_GROUP_DP), v, 6, ML_RED_SUM) || v[5] > 0)
    api_abort(s);
  *sums = (ml_obj_sums){v[0], v[1], (int64_t)v[2], (int64_t)v[3], v[4]};
  sums->loss += aux;
  r->loss = sums->loss;
  api_plan_stats(s, &c->p);
}

/* The first non-finite per-token input the loss reads on this rank, as
 * "old_logprobs[i] (sequence k, entry t) is nan", into buf; 0 when none. */
static int nonfinite_input(const api_loss_call *c, char *buf, size_t cap) {
  const meshlm_train_batch *b = &c->b;
  const meshlm_loss *l = &c->l;
  bool weights = l->kind == MESHLM_LOSS_WEIGHTED_NLL || l->kind == MESHLM_LOSS_CLIPPED_PG;
  struct { const char *name; const float *x; bool per_seq; } in[] = {
      {"token_weights", weights ? b->token_weights : NULL, false},
      {"seq_weights", weights ? b->seq_weights : NULL, true},
      {"old_logprobs", l->kind == MESHLM_LOSS_CLIPPED_PG ? b->old_logprobs : NULL, false},
      {"ref_logprobs", l->kl_penalty > 0 ? b->ref_logprobs : NULL, false},
      {"generation_logprobs", c->is.rho ? b->generation_logprobs : NULL, false}};
  for (size_t a = 0; a < sizeof in / sizeof in[0]; a++) {
    if (!in[a].x) continue;
    for (int64_t k = 0; k < b->seqs.n; k++) {
      int64_t o = c->p.start[k] - k, L = b->seqs.lens[k];
      for (int64_t t = 0; t < L - 1; t++) {
        if (b->token_mask && !b->token_mask[o + t]) continue;
        float v = in[a].per_seq ? in[a].x[k] : in[a].x[o + t];
        if (isfinite(v)) continue;
        if (in[a].per_seq)
          snprintf(buf, cap, "%s[%lld] is %g", in[a].name, (long long)k, v);
        else
          snprintf(buf, cap, "%s[%lld] (sequence %lld, entry %lld) is %g", in[a].name,
                   (long long)(o + t), (long long)k, (long long)t, v);
        return 1;
      }
    }
  }
  return 0;
}

int api_loss_result(meshlm_session *s, api_loss_call *c, const ml_step_result *r, api_acc *a) {
  *a = (api_acc){.loss = r->sums.loss, .kl = r->sums.kl, .entropy = r->sums.entropy,
                 .trained = r->sums.trained,
                 .clipped = r->sums.clipped, .tokens = c->g[0], .sequences = c->g[2]};
  const api_is *is = &c->is;
  double v[6] = {is->mult_err, is->gen_kl, (double)is->tokens, (double)is->oob,
                 (double)is->oob_of, c->cu.failed != 0};
  ML_TRY(ml_host_all_reduce_f64(ml_mesh_host(&s->mesh, ML_GROUP_DP), v, 6, ML_RED_SUM));
  a->mult_err = v[0];
  a->gen_kl = v[1];
  a->metric_tokens = (int64_t)v[2];
  a->oob = (int64_t)v[3];
  a->oob_of = (int64_t)v[4];
  char input[160];
  if (c->cu.failed)
    snprintf(a->skip, sizeof a->skip, "%s: loss.objective returned %d on this rank", c->name,
             c->cu.failed);
  else if (v[5] > 0)
    snprintf(a->skip, sizeof a->skip, "%s: loss.objective failed on another rank", c->name);
  else if (!isfinite(a->loss))
    snprintf(a->skip, sizeof a->skip, "%s: the loss is not finite (%g); %s", c->name, a->loss,
             nonfinite_input(c, input, sizeof input)
                 ? input
                 : "no per-token input the loss reads is on this rank");
  if (v[5] > 0) /* every rank: the step was skipped, the call fails */
    return ml_err("%s", a->skip);
  return 0;
}

void api_acc_add(api_acc *a, const api_acc *b) {
  a->loss += b->loss;
  a->kl += b->kl;
  a->entropy += b->entropy;
  a->mult_err += b->mult_err;
  a->gen_kl += b->gen_kl;
  a->trained += b->trained;
  a->clipped += b->clipped;
  a->tokens += b->tokens;
  a->sequences += b->sequences;
  a->metric_tokens += b->metric_tokens;
  a->oob += b->oob;
  a->oob_of += b->oob_of;
  if (!a->skip[0]) memcpy(a->skip, b->skip, sizeof a->skip);
}

void api_result_fill(const api_acc *a, const ml_step_result *step, int64_t steps,
                     meshlm_step_result *full) {
  _Static_assert(sizeof full->nonfinite_param == sizeof step->nonfinite,
                 "the parameter name's size");
  double mt = a->metric_tokens ? (double)a->metric_tokens : 1.0;
  *full = (meshlm_step_result){
      .struct_size = sizeof *full, .loss = a->loss, .kl = a->kl,
      .clip_fraction = a->trained ? (double)a->clipped / (double)a->trained : 0.0,
      .grad_norm = step->grad_norm, .lr = step->lr, .tokens = a->tokens,
      .sequences = a->sequences, .step = steps, .skipped = step->skipped,
      .token_mult_prob_error = a->mult_err / mt, .gen_kl_error = a->gen_kl / mt,
      .is_oob_fraction = a->oob_of ? (double)a->oob / (double)a->oob_of : 0.0,
      .entropy = a->entropy};
  memcpy(full->nonfinite_param, step->nonfinite, sizeof step->nonfinite);
  memcpy(full->skip_reason, step->reason, sizeof full->skip_reason);
}

int meshlm_train_step(meshlm_session *s, const meshlm_train_batch *b, const meshlm_loss *loss,
                      meshlm_step_result *out) {
  ML_TRY(api_enter(s, API_CALL_TRAIN_STEP));
  if (!out) return api_agree(s, ml_err("meshlm_train_step: result is NULL"));
  api_loss_call c;
  if (api_loss_begin(s, "meshlm_train_step", b, loss, out, true, &c)) {
    api_loss_free(&c);
    return -1;
  }
  ml_step_result r = {0};
  if (ml_engine_zero_grad(&s->e)) api_abort(s);
  c.norm_type = s->set.step.norm_type; /* ml_step_apply's, below */
  api_loss_backward(s, &c, &r);
  api_acc a;
  int rc = api_loss_result(s, &c, &r, &a);
  api_loss_free(&c);
  if (ml_step_apply(&s->e, &s->set.step, s->steps, a.skip[0] ? a.skip : NULL, &r)) api_abort(s);
  s->version += !r.skipped;
  meshlm_step_result full;
  api_result_fill(&a, &r, ++s->steps, &full);
  api_write_struct("meshlm_train_step", "meshlm_step_result", out, API_MIN(meshlm_step_result),
                   sizeof full, &full); /* its size checked before the step */
  s->acc = (api_acc){0};
  return api_agree(s, rc);
}
