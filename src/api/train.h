/* One loss call of the library (meshlm_train_step, meshlm_forward_backward,
 * meshlm_eval_loss): the caller's batch and loss read and checked, the
 * micro-batches planned, the global counts, the importance-sampling
 * weights, a custom objective's adapter, then the engine's passes.
 * Internal to libmeshlm (src/api). */
#ifndef ML_API_TRAIN_H
#define ML_API_TRAIN_H

#include "api/pack.h"
#include "engine/step.h"

/* Importance sampling (api/is.c): rho [preds] the weights ρ of this rank's
 * targets (NULL: no correction); the mismatch metrics' local sums over the
 * masked targets (with generation_logprobs and old_logprobs), the
 * truncation's out-of-bounds count of oob_of targets (or sequences). */
typedef struct api_is {
  float *rho;
  double mult_err, gen_kl;
  int64_t tokens, oob, oob_of;
} api_is;

/* ρ and the metrics of b (checked) under l, p its plan, preds = Σ (lens −
 * 1). No collective. Errors: allocation. Free with api_is_free. */
int api_is_prepare(const meshlm_train_batch *b, const meshlm_loss *l, const api_plan *p,
                   int64_t preds, api_is *is);
void api_is_free(api_is *is);

/* A custom objective's adapter (api/custom.c): the engine's ml_obj_fn
 * over the caller's meshlm_objective_fn. */
typedef struct api_custom {
  meshlm_objective_fn fn;
  void *ctx;
  int64_t *seq_of;      /* [preds] the sequence of each prediction */
  double *seq_lp;       /* [n] Σ masked lp per sequence, or NULL */
  float *lp;            /* [preds] the pass's per-target log-probs (with seq_lp) */
  int64_t global_tokens, global_sequences;
  int failed;           /* the first nonzero return of fn, 0 while none */
} api_custom;

/* The adapter's buffers for batch b (checked; plan p): seq_of and, when
 * l->objective_seq_logprobs, those of seq_lp. No collective. Errors:
 * allocation. Free with api_custom_free (also after an error). */
int api_custom_prepare(meshlm_session *s, const meshlm_train_batch *b, const meshlm_loss *l,
                       api_plan *p, const int64_t g[3], api_custom *c);
void api_custom_free(api_custom *c);

/* With seq_lp: fill it by a forward-only pass over p's micro-batches
 * (api_score, masked by b->token_mask). Collective; aborts on a failure
 * inside the pass. */
void api_custom_sums(meshlm_session *s, const meshlm_train_batch *b, api_plan *p,
                     api_custom *c);

/* ml_obj_fn of the adapter (ctx: api_custom): meshlm_objective_chunk's
 * arrays for n targets, the caller's function, its outputs back; a nonzero
 * return is recorded in c->failed and gives NaN terms and 0 gradients (so
 * the pass's collectives go on and the loss is not finite). Returns 0
 * (−1: allocation). */
int api_custom_call(void *ctx, int64_t n, const float *lp, const ml_obj_in *in, double *loss,
                    double *grad);

/* A prepared call. */
typedef struct api_loss_call {
  const char *name;     /* "meshlm_forward_backward", … for messages */
  meshlm_train_batch b; /* the caller's, read into this library's layout */
  meshlm_loss l;
  api_plan p;
  int64_t g[3];         /* global masked targets, sequences with one, all sequences */
  int64_t preds;        /* this rank's Σ (lens − 1) */
  api_is is;
  api_custom cu;
  ml_objective obj;
  /* router replay (b.routing set): micro-batch j's packed routing [S_max, route_cols],
     which model->route_replay points at during the passes (api/routing.h) */
  int32_t *replay;
  int64_t route_cols;
  ml_model *model;
  double norm_type; /* meshlm_train_step: the grad norm that follows the passes
                       (ml_step_source.norm_type); else 0 */
} api_loss_call;

/* Read, check (agreed over the world) and prepare c for a call of `name`
 * with b and loss (NULL: meshlm_loss_default); out's struct_size is
 * checked when out is not NULL; backward: gradients will be computed (else
 * the batch's buffers are a forward-only pass's, ml_engine_reserve).
 * Collective. Errors (every rank): those of
 * meshlm_train_step. Free with api_loss_free, also after an error. */
int api_loss_begin(meshlm_session *s, const char *name, const meshlm_train_batch *b,
                   const meshlm_loss *loss, const meshlm_step_result *out, bool backward,
                   api_loss_call *c);
void api_loss_free(api_loss_call *c);

/* Forward + backward of c's micro-batches (gradients +=): r->loss, r->sums
 * (ml_step_accumulate). Aborts the job on a failure inside the passes. */
void api_loss_backward(meshlm_session *s, api_loss_call *c, ml_step_result *r);

/* Forward only: r->loss and r->sums as api_loss_backward would give them
 * at these weights, no gradient touched. Aborts likewise. */
void api_loss_forward(meshlm_session *s, api_loss_call *c, ml_step_result *r);

/* This call's part of the accumulation: a = its loss sums, the global
 * counts, the IS metrics summed over the data ranks (collective: one
 * all-reduce over dp), its skip reason when the loss is not finite (the
 * first non-finite per-token input on this rank named, or the objective
 * that failed). */
int api_loss_result(meshlm_session *s, api_loss_call *c, const ml_step_result *r, api_acc *a);

/* a (one call's or the sum since zero_grad) as a meshlm_step_result in
 * *full, with step's fields (grad_norm, lr, skipped, names). */
void api_result_fill(const api_acc *a, const ml_step_result *step, int64_t steps,
                     meshlm_step_result *full);

/* a += b (the skip reason: a's if set, else b's). */
void api_acc_add(api_acc *a, const api_acc *b);

#endif
