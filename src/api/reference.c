/* meshlm_set_reference, meshlm_reference_logprobs (include/meshlm/meshlm.h):
 * the reference policy's shards in the session's engine (engine/reference.h). */
#include <stdio.h>

#include "api/pack.h"
#include "engine/reference.h"

int meshlm_set_reference(meshlm_session *s) {
  ML_TRY(api_enter(s, API_CALL_SET_REFERENCE));
  int rc = ml_engine_reference_set(&s->e);
  if (api_agree(s, rc)) {
    ml_engine_reference_free(&s->e); /* none kept where it or a peer's failed */
    return -1;
  }
  return 0;
}

int meshlm_reference_logprobs(meshlm_session *s, const meshlm_seqs *batch, const uint8_t *mask,
                              float *out, double *seq_sums) {
  ML_TRY(api_enter(s, API_CALL_REFERENCE_LOGPROBS));
  /* captured by every rank or by none (meshlm_set_reference agrees) */
  if (!ml_engine_has_reference(&s->e)) return api_leave(s, ml_engine_reference_swap(&s->e));
  /* the swaps: local under ZeRO-3, a re-gather on every rank under ZeRO-1/2 */
  if (ml_engine_reference_swap(&s->e)) api_abort(s);
  meshlm_scores o = {.struct_size = sizeof o, .logprobs = out, .seq_sums = seq_sums};
  int rc = api_scores(s, "meshlm_reference_logprobs", batch, mask, &o, true);
  char err[sizeof s->err];
  snprintf(err, sizeof err, "%s", s->err); /* the scoring's message, kept across the swap */
  if (ml_engine_reference_swap(&s->e)) api_abort(s);
  snprintf(s->err, sizeof s->err, "%s", err);
  return rc;
}
