/* One optimizer step of the engine, the one both front ends run (the CLI's
 * training loop, cli/cmd_train.c; the library's meshlm_train_step,
 * api/train.c), as a torch training loop writes it:
 *   optimizer.zero_grad(); for each micro-batch: loss.backward();
 *   norm = clip_grad_norm_(params, max_norm, norm_type);
 *   if norm is finite: optimizer.step()   (torch.optim.AdamW)
 * A non-finite norm skips the update and names the first non-finite
 * gradient (the one policy: the step's data and its slot of the schedule are
 * spent, AdamW's own step count, which its bias correction reads, does not
 * move). The optimizer is AdamW, the only one the engine has. */
#ifndef ML_STEP_H
#define ML_STEP_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/engine.h"
#include "engine/schedule.h"

/* The optimizer and gradient settings of every step of a run. Their
 * defaults: engine/settings.h (ml_train_defaults). */
typedef struct ml_step_opts {
  ml_lr_schedule schedule; /* step k's learning rate: ml_lr_at(&schedule, k) */
  double beta1, beta2, eps, weight_decay; /* torch.optim.AdamW's betas, eps, weight_decay
                                             (decoupled) */
  double max_grad_norm;    /* clip_grad_norm_'s max_norm; 0: no clipping */
  double norm_type;        /* its norm_type: 2.0 (L2) or INFINITY (max |g|) */
} ml_step_opts;

/* Where a step's micro-batches come from (the gradient accumulation): the
 * caller's data. fill(ctx, m, b) sets *b to micro-batch m of n_micro
 * (0-based, in order; the arrays stay valid until the next call of fill);
 * it returns 0, or −1 with the error recorded. The loss of the step:
 *  - objective NULL: the NLL's mean over the targets of the whole global
 *    batch (every data-parallel rank, every micro-batch): global_targets
 *    of them (ml_engine_forward_backward; b's docs and obj must be NULL);
 *  - else that objective, every target weighted by b->obj
 *    (ml_engine_forward_backward_batch; global_targets unused). */
typedef struct ml_step_source {
  int64_t n_micro;
  int (*fill)(void *ctx, int64_t m, ml_engine_batch *b);
  void *ctx;
  const ml_objective *objective;
  int64_t global_targets;
  double norm_type; /* the grad norm that follows (ml_step_apply's o->norm_type): the last
                       micro-batch's backward computes its partials as its FSDP units finish
                       (ml_engine_norm_ahead); 0: none (the norm makes one pass) */
} ml_step_source;

typedef struct ml_step_result {
  double lr;        /* the step's learning rate (the schedule's at its index) */
  double loss;      /* the step's loss, the same on every rank: objective NULL, the mean NLL
                       (Σ over micro-batches of each one's loss sum over the data ranks /
                       global_targets); else sums.loss */
  ml_obj_sums sums; /* with an objective: its sums over every micro-batch and data rank
                       (dp × cp), sums.loss plus each micro-batch's MoE load-balancing term
                       (as the NLL path's loss: engine.h); zero without */
  double grad_norm; /* the global norm before clipping (clip_grad_norm_'s return) */
  bool skipped;     /* the norm was not finite: no update */
  char nonfinite[sizeof((ml_param *)0)->name]; /* skipped: the HF name of the first
                       parameter (FSDP unit order) with a non-finite gradient, "" when every
                       gradient is finite (the norm itself overflowed) */
  char reason[256];  /* skipped: why ("the loss is not finite", "the grad norm is not
                        finite", or the caller's reason given to ml_step_apply) */
} ml_step_result;

/* Forward + backward of src's micro-batches in order, the gradients added
 * (+=) to the accumulated ones (no zeroing), the last one computing the
 * partials of a norm of src->norm_type: r->loss and r->sums set to
 * this source's loss and objective sums over the data ranks (as
 * ml_step_result's). Collective over the world. Errors: src->fill's, a
 * batch with docs or obj under the NLL, those of the engine calls. */
int ml_step_accumulate(ml_engine *e, const ml_step_source *src, ml_step_result *r);

/* The optimizer step of index k on the accumulated gradients: r->lr,
 * r->grad_norm (ml_engine_grad_norm), then a skipped step when `skip`
 * names a reason (copied to r->reason; the caller's agreed decision, e.g.
 * a non-finite loss) or the norm is not finite (then r->nonfinite named
 * either way), else
 * clipping and AdamW (ml_engine_clip_adamw). Collective over the world
 * (every rank the same k, o and skip != NULL). Errors: the engine's. */
int ml_step_apply(ml_engine *e, const ml_step_opts *o, int64_t k, const char *skip,
                  ml_step_result *r);

/* Run the optimizer step of 0-based index k (its place in o->schedule) on
 * e: zero the gradients; forward + backward of src's micro-batches in
 * order (gradients accumulate: ml_step_accumulate, the last one computing
 * the partials of o->norm_type's norm whatever src->norm_type); then
 * ml_step_apply,
 * skipping the step when the loss is not finite (a NaN input whose
 * gradient is 0, e.g. a clipped ratio of NaN old log-probs, leaves the norm
 * finite) or the norm is not (named by ml_engine_find_nonfinite), else
 * clipping to o->max_grad_norm and AdamW at ml_lr_at(&o->schedule, k) in
 * one pass (ml_engine_clip_adamw).
 * Collective over the world (every rank the same k, o and n_micro). *r is
 * set in full on success. Errors: src->fill's, a batch with docs or obj
 * under the NLL, those of the engine calls; a failure may leave peers
 * inside a collective, so callers abort every rank on −1 (as the CLI's
 * ml_cli_abort and the library's api_abort do). */
int ml_step_run(ml_engine *e, const ml_step_opts *o, int64_t k, const ml_step_source *src,
                ml_step_result *r);

#endif
