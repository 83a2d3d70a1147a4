/* meshlm_logprobs: batched scoring (include/meshlm/meshlm.h). */
#include <math.h>
#include <string.h>

#include "api/pack.h"

/* Micro-batch j's log-probs into out / seq_sums; returns how many written
 * are not finite (masked entries are 0). */
static int64_t scatter(const api_plan *p, const meshlm_seqs *b, int64_t j, const uint8_t *mask,
                       float *out, double *seq_sums) {
  const ml_pack *pk = &p->pack;
  const ml_micro *m = &pk->mb[j];
  int64_t at = 0, nonfinite = 0;
  for (int64_t i = 0; i < m->count; i++) {
    int64_t k = pk->order[m->first + i], L = b->lens[k], o = p->start[k] - k;
    double sum = 0;
    for (int64_t t = 0; t < L - 1; t++) {
      float v = mask && !mask[o + t] ? 0.0f : pk->lp[at + t];
      out[o + t] = v;
      nonfinite += !isfinite(v);
      sum += v;
    }
    if (seq_sums) seq_sums[k] = sum;
    at += L;
  }
  return nonfinite;
}

int64_t api_score(meshlm_session *s, api_plan *p, const meshlm_seqs *batch, const uint8_t *mask,
                  float *out, double *seq_sums) {
  ml_engine_hold_params(&s->e, s->o.unshard_for_inference != 0);
  int64_t nonfinite = 0;
  for (int64_t j = 0; j < p->pack.n_mb; j++) {
    ml_engine_batch eb;
    ml_pack_fill(&p->pack, j, &eb);
    if (ml_engine_logprobs_batch(&s->e, &eb, p->pack.lp)) api_abort(s);
    nonfinite += scatter(p, batch, j, mask, out, seq_sums);
  }
  ml_engine_hold_params(&s->e, false);
  return nonfinite;
}

int meshlm_logprobs(meshlm_session *s, const meshlm_seqs *batch, const uint8_t *mask,
                    float *out, double *seq_sums) {
  ML_TRY(api_enter(s, API_CALL_LOGPROBS));
  return api_logprobs(s, batch, mask, out, seq_sums);
}

int api_logprobs(meshlm_session *s, const meshlm_seqs *batch, const uint8_t *mask, float *out,
                 double *seq_sums) {
  int64_t tokens, preds;
  int rc = api_check_seqs(s, batch, "meshlm_logprobs", 1, &tokens, &preds);
  if (rc == 0 && preds > 0 && !out) rc = ml_err("meshlm_logprobs: out is NULL");
  if (rc == 0) rc = api_check_mask(batch, mask, "meshlm_logprobs: mask");
  if (api_agree(s, rc)) return -1;
  if (api_agree(s, api_check_replicas(s, batch, "meshlm_logprobs"))) return -1;
  api_plan p;
  if (api_agree(s, api_plan_batch(s, batch, true, &p))) {
    api_plan_free(&p);
    return -1;
  }
  ml_mesh_stats_reset(&s->mesh);
  int64_t nonfinite = api_score(s, &p, batch, mask, out, seq_sums);
  api_plan_stats(s, &p);
  s->last.nonfinite_logprobs = nonfinite;
  api_plan_free(&p);
  return 0;
}
