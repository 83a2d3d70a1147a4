/* A caller's objective (MESHLM_LOSS_CUSTOM, include/meshlm/meshlm.h
 * meshlm_objective_chunk) behind the engine's chunk hook
 * (parallel/objective.h ml_obj_fn). */
#include <math.h>
#include <stdlib.h>

#include "api/train.h"
#include "common/checked.h"

int api_custom_prepare(meshlm_session *s, const meshlm_train_batch *b, const meshlm_loss *l,
                       api_plan *p, const int64_t g[3], api_custom *c) {
  *c = (api_custom){.fn = l->objective, .ctx = l->objective_ctx, .global_tokens = g[0],
                    .global_sequences = g[1]};
  int64_t preds = 0, n = b->seqs.n;
  for (int64_t k = 0; k < n; k++) preds += b->seqs.lens[k] - 1;
  c->seq_of = ml_malloc_array(preds > 0 ? preds : 1, sizeof *c->seq_of,
                              "the objective's sequence of each target (%lld)", (long long)preds);
  if (!c->seq_of) return -1;
  for (int64_t k = 0; k < n; k++)
    for (int64_t t = 0, o = p->start[k] - k; t < b->seqs.lens[k] - 1; t++) c->seq_of[o + t] = k;
  if (!l->objective_seq_logprobs) return 0;
  c->lp = ml_malloc_array(preds > 0 ? preds : 1, sizeof *c->lp,
                          "the objective's log-probs pass (%lld targets)", (long long)preds);
  c->seq_lp = ml_malloc_array(n > 0 ? n : 1, sizeof *c->seq_lp,
                              "the objective's sequence sums (%lld)", (long long)n);
  return c->lp && c->seq_lp ? 0 : -1;
}

void api_custom_sums(meshlm_session *s, const meshlm_train_batch *b, api_plan *p,
                     api_custom *c) {
  if (c->seq_lp) api_score(s, p, &b->seqs, b->token_mask, c->lp, c->seq_lp);
}

void api_custom_free(api_custom *c) {
  free(c->seq_of);
  free(c->seq_lp);
  free(c->lp);
  *c = (api_custom){0};
}

int api_custom_call(void *ctx, int64_t n, const float *lp, const ml_obj_in *in, double *loss,
                    double *grad) {
  api_custom *c = ctx;
  /* per target: index, seq (int64) and weight (float); n is a chunk's count */
  size_t each = 2 * sizeof(int64_t) + sizeof(float);
  int64_t *index = ml_malloc_array(n, each, "the objective's chunk (%lld targets)", (long long)n);
  if (!index) return -1;
  int64_t *seq = index + n;
  float *weight = (float *)(seq + n);
  for (int64_t i = 0; i < n; i++) {
    index[i] = in[i].idx;
    seq[i] = c->seq_of[in[i].idx];
    weight[i] = in[i].w;
    loss[i] = grad[i] = 0.0;
  }
  meshlm_objective_chunk ch = {sizeof ch, n, lp, index, seq, weight, c->seq_lp,
                               c->global_tokens, c->global_sequences, loss, grad};
  int rc = c->failed ? c->failed : c->fn(c->ctx, &ch);
  if (rc != 0) { /* the pass goes on; the loss is NaN, the step skipped (api_loss_result) */
    c->failed = c->failed ? c->failed : rc;
    for (int64_t i = 0; i < n; i++) {
      loss[i] = NAN;
      grad[i] = 0.0;
    }
  }
  free(index);
  return 0;
}
