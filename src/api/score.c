/* meshlm_logprobs and meshlm_score: batched scoring
 * (include/meshlm/meshlm.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/pack.h"
#include "api/routing.h"
#include "common/checked.h"

/* One micro-batch's host buffers beside the pack's log-probs: [S_max] and
 * [S_max, k], route [S_max, route_cols] the sparse layers' choices (NULL
 * where not wanted). */
typedef struct score_bufs {
  float *ent, *tlp;
  int32_t *tid, *route;
  int64_t route_cols;
} score_bufs;

/* Micro-batch j's outputs into `out` (its log-probs from pk->lp; masked
 * entries 0, top-k ids −1); returns how many log-probs written are not
 * finite. */
static int64_t scatter(const api_plan *p, const meshlm_seqs *b, int64_t j, const uint8_t *mask,
                       const meshlm_scores *out, const score_bufs *sb) {
  const ml_pack *pk = &p->pack;
  const ml_micro *m = &pk->mb[j];
  int64_t at = 0, nonfinite = 0, k = out->topk;
  for (int64_t i = 0; i < m->count; i++) {
    int64_t q = pk->order[m->first + i], L = b->lens[q], o = p->start[q] - q;
    double sum = 0;
    for (int64_t t = 0; t < L - 1; t++) {
      bool off = mask && !mask[o + t];
      float v = off ? 0.0f : pk->lp[at + t];
      if (out->logprobs) out->logprobs[o + t] = v;
      nonfinite += !isfinite(v);
      sum += v;
      if (out->entropy) out->entropy[o + t] = off ? 0.0f : sb->ent[at + t];
      for (int64_t c = 0; c < k; c++) {
        out->topk_logprobs[(o + t) * k + c] = off ? 0.0f : sb->tlp[(at + t) * k + c];
        out->topk_ids[(o + t) * k + c] = off ? -1 : sb->tid[(at + t) * k + c];
      }
    }
    if (out->seq_sums) out->seq_sums[q] = sum;
    at += L;
  }
  if (out->routing) api_routing_unpack(p, b, j, sb->route_cols, sb->route, out->routing);
  return nonfinite;
}

/* The host buffers `out` needs for micro-batches of up to S_max tokens
 * (route_cols int32 of routing per token). */
static int bufs_alloc(const meshlm_scores *out, int64_t S_max, int64_t route_cols,
                      score_bufs *sb) {
  *sb = (score_bufs){.route_cols = route_cols};
  int64_t n = ml_mul_sat(S_max, out->topk), nr = ml_mul_sat(S_max, route_cols);
  if (out->routing && !(sb->route = ml_malloc_array(nr, sizeof(int32_t),
                                                    "a micro-batch's expert choices (%lld)",
                                                    (long long)nr)))
    return -1;
  if (out->entropy && !(sb->ent = ml_malloc_array(S_max, sizeof(float),
                                                   "a micro-batch's entropies (%lld)",
                                                   (long long)S_max)))
    return -1;
  if (out->topk && !(sb->tlp = ml_malloc_array(n, sizeof(float),
                                               "a micro-batch's top-k log-probs (%lld)",
                                               (long long)n)))
    return -1;
  if (out->topk && !(sb->tid = ml_malloc_array(n, sizeof(int32_t),
                                               "a micro-batch's top-k ids (%lld)", (long long)n)))
    return -1;
  return 0;
}

static void bufs_free(score_bufs *sb) {
  free(sb->ent);
  free(sb->tlp);
  free(sb->tid);
  free(sb->route);
}

/* The outputs of a call with `preds` predictions: meshlm_logprobs's out
 * (logprobs_out), meshlm_score's top-k. */
static int check_outputs(const meshlm_session *s, const char *call, const meshlm_scores *out,
                         int64_t preds, bool logprobs_out) {
  if (preds > 0 && logprobs_out && !out->logprobs) return ml_err("%s: out is NULL", call);
  int64_t V = s->e.model.cfg.vocab;
  if (out->topk < 0 || out->topk > V)
    return ml_err("%s: topk %d; expected 0 .. vocab_size %lld", call, out->topk, (long long)V);
  if (out->topk > 0 && preds > 0 && (!out->topk_logprobs || !out->topk_ids))
    return ml_err("%s: topk %d with topk_logprobs or topk_ids NULL; expected both [predictions, "
                  "topk] arrays",
                  call, out->topk);
  if (out->topk > 0 && s->e.cp.size > 1)
    return ml_err("%s: topk %d under context parallelism (cp %d) is not implemented; expected "
                  "topk 0 or cp 1",
                  call, out->topk, s->e.cp.size);
  if (out->routing) ML_TRY(api_routing_check(s, call, "out->routing"));
  return 0;
}

int api_scores(meshlm_session *s, const char *call, const meshlm_seqs *batch,
               const uint8_t *mask, const meshlm_scores *req, bool logprobs_out) {
  int64_t tokens, preds;
  meshlm_scores none = {0}, full = {0}, *out = &full;
  int rc = req ? API_READ(call, meshlm_scores, req, &none, &full)
               : ml_err("%s: out is NULL", call);
  if (rc == 0) rc = api_check_seqs(s, batch, call, 1, &tokens, &preds);
  if (rc == 0) rc = check_outputs(s, call, out, preds, logprobs_out);
  char what[64];
  snprintf(what, sizeof what, "%s: mask", call);
  if (rc == 0) rc = api_check_mask(batch, mask, what);
  if (api_agree(s, rc)) return -1;
  if (api_agree(s, api_check_replicas(s, batch, call))) return -1;
  api_plan p;
  score_bufs sb = {0};
  rc = api_plan_batch(s, batch, true, &p);
  if (rc == 0) rc = bufs_alloc(out, p.pack.S_max, api_routing_cols(s), &sb);
  if (api_agree(s, rc)) {
    bufs_free(&sb);
    api_plan_free(&p);
    return -1;
  }
  ml_mesh_stats_reset(&s->mesh);
  ml_engine_hold_params(&s->e, s->o.unshard_for_inference != 0);
  int64_t nonfinite = 0;
  bool extra = out->entropy || out->topk;
  for (int64_t j = 0; j < p.pack.n_mb; j++) {
    ml_engine_batch eb;
    ml_pack_fill(&p.pack, j, &eb);
    ml_engine_scores es = {.logprobs = p.pack.lp, .entropy = sb.ent, .topk = out->topk,
                           .topk_logprobs = sb.tlp, .topk_ids = sb.tid};
    if (sb.route) /* dense layers' rows stay −1 */
      for (int64_t i = 0; i < eb.S * sb.route_cols; i++) sb.route[i] = -1;
    s->e.model.route_record = sb.route;
    if (extra ? ml_engine_scores_batch(&s->e, &eb, &es)
              : ml_engine_logprobs_batch(&s->e, &eb, p.pack.lp))
      api_abort(s);
    s->e.model.route_record = NULL;
    nonfinite += scatter(&p, batch, j, mask, out, &sb);
  }
  ml_engine_hold_params(&s->e, false);
  api_plan_stats(s, &p);
  s->last.nonfinite_logprobs = nonfinite;
  bufs_free(&sb);
  api_plan_free(&p);
  return 0;
}

int64_t api_score(meshlm_session *s, api_plan *p, const meshlm_seqs *batch, const uint8_t *mask,
                  float *out, double *seq_sums) {
  meshlm_scores o = {.struct_size = sizeof o, .logprobs = out, .seq_sums = seq_sums};
  score_bufs none = {0};
  ml_engine_hold_params(&s->e, s->o.unshard_for_inference != 0);
  int64_t nonfinite = 0;
  for (int64_t j = 0; j < p->pack.n_mb; j++) {
    ml_engine_batch eb;
    ml_pack_fill(&p->pack, j, &eb);
    if (ml_engine_logprobs_batch(&s->e, &eb, p->pack.lp)) api_abort(s);
    nonfinite += scatter(p, batch, j, mask, &o, &none);
  }
  ml_engine_hold_params(&s->e, false);
  return nonfinite;
}

int meshlm_logprobs(meshlm_session *s, const meshlm_seqs *batch, const uint8_t *mask,
                    float *out, double *seq_sums) {
  ML_TRY(api_enter(s, API_CALL_LOGPROBS));
  meshlm_scores o = {.struct_size = sizeof o, .logprobs = out, .seq_sums = seq_sums};
  return api_scores(s, "meshlm_logprobs", batch, mask, &o, true);
}

int meshlm_score(meshlm_session *s, const meshlm_seqs *batch, const uint8_t *mask,
                 const meshlm_scores *out) {
  ML_TRY(api_enter(s, API_CALL_SCORE));
  return api_scores(s, "meshlm_score", batch, mask, out, false);
}
