/* meshlm_train_step: one optimizer step on a variable-length batch under
 * the objectives of include/meshlm/meshlm.h (NeMo RL's loss functions). */
#include <math.h>
#include <string.h>

#include "api/pack.h"
#include "common/checked.h"
#include "engine/step.h"

int meshlm_loss_init(meshlm_loss *l, size_t struct_size) {
  meshlm_loss full = {.kind = MESHLM_LOSS_NLL, .ratio_clip_min = 0.2f, .ratio_clip_max = 0.2f};
  return api_init_struct(l, struct_size, API_MIN(meshlm_loss), sizeof full, &full);
}

/* The loss's fields and the arrays it needs, named. */
static int check_loss(const meshlm_loss *l, const meshlm_train_batch *b) {
  if ((unsigned)l->kind > MESHLM_LOSS_CLIPPED_PG)
    return ml_err("meshlm_train_step: loss.kind %d; expected MESHLM_LOSS_NLL, _WEIGHTED_NLL or "
                  "_CLIPPED_PG", (int)l->kind);
  if (!(l->ratio_clip_min >= 0) || !(l->ratio_clip_max >= 0) ||
      !(l->ratio_clip_c == 0 || l->ratio_clip_c > 1) || !(l->kl_penalty >= 0))
    return ml_err("meshlm_train_step: loss ratio_clip_min %g, ratio_clip_max %g, ratio_clip_c %g, "
                  "kl_penalty %g; expected clips >= 0, ratio_clip_c 0 (off) or > 1, "
                  "kl_penalty >= 0",
                  l->ratio_clip_min, l->ratio_clip_max, l->ratio_clip_c, l->kl_penalty);
  if (!isfinite(l->entropy_coef))
    return ml_err("meshlm_train_step: loss.entropy_coef %g; expected a finite coefficient (0: "
                  "off)",
                  l->entropy_coef);
  if (l->kind == MESHLM_LOSS_NLL && l->kl_penalty > 0)
    return ml_err("meshlm_train_step: loss.kl_penalty %g with MESHLM_LOSS_NLL; expected 0 (the "
                  "KL penalty goes with WEIGHTED_NLL or CLIPPED_PG)", l->kl_penalty);
  if (b->seqs.n > 0 && l->kind == MESHLM_LOSS_CLIPPED_PG && !b->old_logprobs)
    return ml_err("meshlm_train_step: MESHLM_LOSS_CLIPPED_PG needs old_logprobs; it is NULL");
  if (b->seqs.n > 0 && l->kl_penalty > 0 && !b->ref_logprobs)
    return ml_err("meshlm_train_step: loss.kl_penalty %g needs ref_logprobs; it is NULL",
                  l->kl_penalty);
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
static int global_counts(meshlm_session *s, const meshlm_train_batch *b, const api_plan *p,
                         int64_t g[3]) {
  g[0] = g[1] = 0;
  g[2] = b->seqs.n;
  for (int64_t k = 0; k < b->seqs.n; k++) {
    int64_t n = masked(b, k, p->start[k] - k);
    g[0] += n;
    g[1] += n > 0;
  }
  ML_TRY(ml_host_all_reduce_i64(ml_mesh_host(&s->mesh, ML_GROUP_DP), g, 3, ML_RED_SUM));
  if (g[0] == 0)
    return ml_err("meshlm_train_step: no masked prediction in the whole global batch (%lld "
                  "sequences); expected at least one token_mask entry set",
                  (long long)g[2]);
  return 0;
}

/* Micro-batch j's objective inputs (position i of the row: the target
 * token i + 1). */
static void fill_objective(const api_plan *p, const meshlm_train_batch *b, const meshlm_loss *l,
                           const int64_t g[3], int64_t j) {
  const ml_pack *pk = &p->pack;
  const ml_micro *m = &pk->mb[j];
  memset(pk->obj, 0, sizeof *pk->obj * (size_t)m->S);
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
    }
    at += L;
  }
}

/* A step's micro-batches (ml_step_source.fill): the packed batch with its
 * objective inputs. */
typedef struct train_source {
  const api_plan *p;
  const meshlm_train_batch *b;
  const meshlm_loss *l;
  const int64_t *g;
} train_source;

static int fill_micro(void *ctx, int64_t j, ml_engine_batch *eb) {
  const train_source *t = ctx;
  ml_pack_fill(&t->p->pack, j, eb);
  fill_objective(t->p, t->b, t->l, t->g, j);
  eb->obj = t->p->pack.obj;
  return 0;
}

/* The engine's step (engine/step.h) of b's micro-batches into out. Aborts
 * on a failure inside the collectives. */
static void step(meshlm_session *s, const meshlm_train_batch *b, const meshlm_loss *l,
                 const api_plan *p, const int64_t g[3], meshlm_step_result *out) {
  ml_obj_kind kinds[] = {ML_OBJ_NLL, ML_OBJ_WEIGHTED_NLL, ML_OBJ_CLIPPED_PG};
  ml_objective obj = {kinds[l->kind], l->ratio_clip_min, l->ratio_clip_max, l->ratio_clip_c,
                      l->kl_penalty, l->entropy_coef};
  train_source t = {p, b, l, g};
  ml_step_source src = {.n_micro = p->pack.n_mb, .fill = fill_micro, .ctx = &t, .objective = &obj};
  ml_step_result r;
  if (ml_step_run(&s->e, &s->set.step, s->steps, &src, &r)) api_abort(s);
  s->version += !r.skipped;
  _Static_assert(sizeof out->nonfinite_param == sizeof r.nonfinite, "the parameter name's size");
  meshlm_step_result full = {
      .loss = r.sums.loss, .kl = r.sums.kl,
      .clip_fraction = r.sums.trained ? (double)r.sums.clipped / (double)r.sums.trained : 0.0,
      .grad_norm = r.grad_norm, .lr = r.lr, .tokens = g[0], .sequences = g[2],
      .step = ++s->steps, .skipped = r.skipped, .entropy = r.sums.entropy};
  memcpy(full.nonfinite_param, r.nonfinite, sizeof r.nonfinite);
  api_write_struct("meshlm_train_step", "meshlm_step_result", out, API_MIN(meshlm_step_result),
                   sizeof full, &full); /* its size checked before the step */
}

int meshlm_train_step(meshlm_session *s, const meshlm_train_batch *b, const meshlm_loss *loss,
                      meshlm_step_result *out) {
  ML_TRY(api_enter(s, API_CALL_TRAIN_STEP));
  meshlm_loss def, l;
  meshlm_loss_default(&def);
  meshlm_train_batch nothing = {.struct_size = sizeof nothing}, tb;
  int64_t tokens, preds;
  int rc = b && out ? 0 : ml_err("meshlm_train_step: batch or result is NULL");
  if (rc == 0) rc = API_READ("meshlm_train_step", meshlm_train_batch, b, &nothing, &tb);
  if (rc == 0 && loss) rc = API_READ("meshlm_train_step", meshlm_loss, loss, &def, &l);
  if (rc == 0) rc = API_STRUCT_SIZE("meshlm_train_step", meshlm_step_result, out->struct_size);
  b = &tb;
  loss = loss ? &l : &def;
  if (rc == 0) rc = api_check_seqs(s, &b->seqs, "meshlm_train_step", 1, &tokens, &preds);
  if (rc == 0) rc = api_check_mask(&b->seqs, b->token_mask, "meshlm_train_step: token_mask");
  if (rc == 0) rc = check_loss(loss, b);
  if (api_agree(s, rc)) return -1;
  if (api_agree(s, api_check_replicas(s, &b->seqs, "meshlm_train_step"))) return -1;
  api_plan p;
  int64_t g[3];
  if (api_agree(s, api_plan_batch(s, &b->seqs, &p)) || api_agree(s, global_counts(s, b, &p, g))) {
    api_plan_free(&p);
    return -1;
  }
  ml_mesh_stats_reset(&s->mesh);
  step(s, b, loss, &p, g, out);
  api_plan_stats(s, &p);
  api_plan_free(&p);
  return 0;
}
