/* The log-prob of a chosen token from its row of logits, computed as the
 * loss computes a log-prob (parallel/loss.c over whole rows): the batch-
 * invariant mode's generation reports it, so that meshlm_generate's
 * out_logprobs equal meshlm_logprobs' bit for bit. */
#ifndef ML_TOKEN_LP_H
#define ML_TOKEN_LP_H

#include <stdint.h>

#include "backend/backend.h"

/* *out = log_softmax(logits)[token] for one row logits [V] fp32 (device
 * memory of be, V >= 1, 0 <= token < V), by the loss's pieces (Megatron's
 * vocab-parallel cross entropy) over the whole row, as the loss computes
 * it in the batch-invariant mode on any tp size (vocab-sharded logits are
 * gathered into whole rows first): mx = the row's max
 * (ml_be_xent_rowmax), se = Σ exp(l − mx) (ml_be_xent_sumexp_target: fp64
 * lanes over expf, rounded to fp32) and tl = l[token] − mx, then
 * tl − log(se) in fp64 rounded once (ml_be_xent_logprobs). Errors:
 * allocation, the backend's. */
int ml_token_logprob(ml_backend *be, const float *logits, int64_t V, int32_t token, float *out);

#endif
