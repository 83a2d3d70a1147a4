/* A call's batch as micro-batches (engine/pack.h) and the call statistics
 * (meshlm_last_call_stats). Internal to libmeshlm. */
#ifndef ML_API_PACK_H
#define ML_API_PACK_H

#include "api/session.h"
#include "engine/pack.h"

typedef struct api_plan {
  ml_pack pack;
  int64_t *start;      /* [n + 1] first token of sequence k in the batch; start[k] − k: its
                          first prediction */
  const int32_t **ids; /* [n] pointers into the batch's tokens */
} api_plan;

/* Plan b's micro-batches of options.micro_batch_tokens over the session's
 * world and reserve the longest (collective; errors agreed), for scoring
 * when forward_only (ml_engine_reserve). Free with
 * api_plan_free, also after an error. */
int api_plan_batch(meshlm_session *s, const meshlm_seqs *b, bool forward_only, api_plan *p);
void api_plan_free(api_plan *p);

/* The body of meshlm_logprobs and meshlm_score after their api_enter:
 * `batch` scored with the engine's weights as they are
 * (meshlm_reference_logprobs swaps the reference's in around it) into the
 * caller's `req` (struct_size checked; logprobs_out: req->logprobs is
 * required, as meshlm_logprobs' out); `call` names the caller in
 * messages. Collective; errors agreed (those of meshlm_score). */
int api_scores(meshlm_session *s, const char *call, const meshlm_seqs *batch,
               const uint8_t *mask, const meshlm_scores *req, bool logprobs_out);

/* Set s's call statistics after a call of p's micro-batches (see
 * meshlm_call_stats). */
void api_plan_stats(meshlm_session *s, const api_plan *p);

/* The log-probs of batch (checked; p its plan) at the current weights,
 * forward only, as meshlm_logprobs writes them: out [Σ (lens − 1)], 0
 * where mask (NULL: all) is 0; seq_sums [n] (may be NULL) Σ out per
 * sequence. Collective; a failure inside the passes aborts the job
 * (api_abort). Returns how many written entries are not finite. */
int64_t api_score(meshlm_session *s, api_plan *p, const meshlm_seqs *batch, const uint8_t *mask,
                  float *out, double *seq_sums);

#endif
