/* The reference policy in the policy's session (include/meshlm/meshlm.h
 * meshlm_set_reference, meshlm_reference_logprobs): a frozen copy of every
 * FSDP unit's fp32 shard, where the shards live, sharded as the policy
 * (4Ψ/N bytes per rank for Ψ parameters over N shards), no gradients, no
 * optimizer state. Scoring with it exchanges the contents of the shards
 * and the copies around the pass, the gathered parameters freed before and
 * after (ZeRO-1/2's persistent ones gathered again), so the forward is the
 * policy's own: the reference's log-probs are those of a session holding
 * its weights, bitwise. */
#include <stdlib.h>

#include "api/pack.h"
#include "common/checked.h"
#include "parallel/fsdp.h"

void api_reference_free(meshlm_session *s) {
  if (!s->ref) return;
  for (int u = 0; u < s->e.fsdp.n_units; u++) ml_fsdp_shard_free(&s->e.fsdp, s->ref[u]);
  free(s->ref);
  s->ref = NULL;
}

/* The shards' copies, allocated on the first call (NULL each before). No
 * collective. Errors: allocation (the unit named). */
static int reference_alloc(meshlm_session *s) {
  ml_fsdp *f = &s->e.fsdp;
  if (s->ref) return 0;
  s->ref = ml_calloc_array(f->n_units, sizeof *s->ref, "the reference policy's units (%d)",
                           f->n_units);
  if (!s->ref) return -1;
  for (int u = 0; u < f->n_units; u++)
    if (!(s->ref[u] = ml_fsdp_shard_alloc(f, f->units[u].shard_numel, sizeof(float),
                                          "the reference policy's shard of FSDP unit %d "
                                          "(%lld floats)",
                                          u, (long long)f->units[u].shard_numel))) {
      api_reference_free(s);
      return -1;
    }
  return 0;
}

/* Copy n floats between shard memory (shard_be's own: D2D there). */
static int shard_copy(const ml_fsdp *f, float *dst, const float *src, int64_t n) {
  return ml_be_copy(f->shard_be, dst, src, sizeof(float) * (size_t)n, ML_COPY_D2D);
}

/* Exchange the shards' contents with the reference's (through tmp, room
 * for the largest shard), the gathered parameters freed first and the
 * persistent ones gathered again after. Collective (the gathers). */
static int exchange(meshlm_session *s, float *tmp) {
  ml_fsdp *f = &s->e.fsdp;
  ml_engine_hold_params(&s->e, false);
  for (int u = 0; u < f->n_units; u++) {
    ml_fsdp_unit *unit = &f->units[u];
    ML_TRY(shard_copy(f, tmp, unit->shard, unit->shard_numel));
    ML_TRY(shard_copy(f, unit->shard, s->ref[u], unit->shard_numel));
    ML_TRY(shard_copy(f, s->ref[u], tmp, unit->shard_numel));
  }
  return ml_fsdp_sync_params(f);
}

int meshlm_set_reference(meshlm_session *s) {
  ML_TRY(api_enter(s, API_CALL_SET_REFERENCE));
  if (api_agree(s, reference_alloc(s))) return -1;
  ml_fsdp *f = &s->e.fsdp;
  for (int u = 0; u < f->n_units; u++)
    if (shard_copy(f, s->ref[u], f->units[u].shard, f->units[u].shard_numel)) api_abort(s);
  return 0;
}

int meshlm_reference_logprobs(meshlm_session *s, const meshlm_seqs *batch, const uint8_t *mask,
                              float *out, double *seq_sums) {
  ML_TRY(api_enter(s, API_CALL_REFERENCE_LOGPROBS));
  const char *name = "meshlm_reference_logprobs";
  int64_t tokens, preds, largest = 1;
  int rc = s->ref ? 0
                  : ml_err("%s: no reference policy; call meshlm_set_reference first", name);
  if (rc == 0) rc = api_check_seqs(s, batch, name, 1, &tokens, &preds);
  if (rc == 0 && preds > 0 && !out) rc = ml_err("%s: out is NULL", name);
  if (rc == 0) rc = api_check_mask(batch, mask, "meshlm_reference_logprobs: mask");
  if (api_agree(s, rc)) return -1;
  if (api_agree(s, api_check_replicas(s, batch, name))) return -1;
  ml_fsdp *f = &s->e.fsdp;
  for (int u = 0; u < f->n_units; u++)
    largest = f->units[u].shard_numel > largest ? f->units[u].shard_numel : largest;
  float *tmp = ml_fsdp_shard_alloc(f, largest, sizeof(float),
                                   "the reference exchange's staging (%lld floats)",
                                   (long long)largest);
  api_plan p = {0};
  if (api_agree(s, tmp ? 0 : -1) || api_agree(s, api_plan_batch(s, batch, &p))) {
    ml_fsdp_shard_free(f, tmp);
    api_plan_free(&p);
    return -1;
  }
  ml_mesh_stats_reset(&s->mesh);
  if (exchange(s, tmp)) api_abort(s);
  int64_t nonfinite = api_score(s, &p, batch, mask, out, seq_sums);
  if (exchange(s, tmp)) api_abort(s);
  api_plan_stats(s, &p);
  s->last.nonfinite_logprobs = nonfinite;
  ml_fsdp_shard_free(f, tmp);
  api_plan_free(&p);
  return 0;
}
