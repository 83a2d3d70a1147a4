/* Optimizer steps checked without comparing two meshes' parameters (AdamW
 * is ill-conditioned where |g| is near eps: an update is about lr·sign(g),
 * so two meshes whose gradients differ by rounding can move such a
 * parameter by up to 2·lr, and no gradient bound bounds the parameters):
 *  - checked_step: each step's new parameters and moments against AdamW in
 *    double on the run's own state and gradients, element by element
 *    (tolerance.h §5);
 *  - check_replay_one_rank: after steps, one forward/backward of the run
 *    against one rank opened on the run's current parameters (saved as an
 *    HF checkpoint): a well-conditioned comparison (tolerance.h §3) that
 *    catches a compute copy left stale by a step.
 * Include after <cmocka.h> and <mpi.h>. */
#ifndef ML_TRAIN_CHECK_H
#define ML_TRAIN_CHECK_H

#include <stdbool.h>
#include <stdint.h>

#include "engine_run.h"
#include "parity_util.h"

/* zero_grad + forward_backward of this dp rank's rows of b; the loss. */
double step_rows(run *r, const batch *b);

/* The worst relative L2 difference over the parameters of what ra and rb
 * export (rb the reference); *exact: whether every tensor is bitwise equal. */
double worst_rel(run *ra, run *rb, ml_export_what what, bool *exact);

/* A run against a reference run on the same fixture batch (tests/mpi/
 * test_bf16.c, tests/cuda/test_cuda_engine.c): one forward/backward of
 * each on bt (step_rows: loss, gradients), then the log-probs of the
 * fixture's batch. */
typedef struct run_diff {
  double loss_ref, loss_rel, grad_rel;
  /* over the tokens: mean and max |log-prob − reference's|, and
   * ‖log-probs − reference's‖₂ / ‖reference's‖₂ */
  double logprob_mean_abs, logprob_max_abs, logprob_rel_l2;
  bool grads_exact;
} run_diff;
run_diff run_compare(run *r, run *ref, const fixture *fx, const batch *bt);

/* The engine options of real bf16 compute: ml_engine_opts_default() with
 * param_dtype bf16 (FSDP2's MixedPrecisionPolicy under autocast). */
ml_engine_opts bf16_engine_opts(void);

/* Norms of the exported gradients of a, and of a − b, in double
 * (tolerance.h §6): max|a|, ‖a‖₂, max|a − b|, ‖a − b‖₂, element count. */
typedef struct norms {
  double inf, l2, dinf, dl2;
  int64_t n;
} norms;
norms grad_norms(run *ra, run *rb);

/* ml_engine_grad_norm of r's gradients (norm_type 2 or INFINITY). */
double engine_norm(run *r, double type);

/* After a backward that ml_engine_norm_ahead(type) asked for (or a step
 * source of that norm_type): its partials are held (engine/grad_norm.h),
 * the norm from them (taken) is bitwise the one pass's that a second call
 * makes (memcmp), and positive. Returns the norm. what: for messages. */
double check_norm_partials(run *r, double type, const char *what);

/* Grad norms (tolerance.h §6, tests/mpi/test_fsdp.c, tests/cuda/
 * test_cuda_engine.c): the engine norms of ref and of every run against
 * their own exported gradients (inf bitwise, L2 within double rounding),
 * and each run's against ref's within what their gradients differ by:
 * |max|a| − max|b|| <= max|a − b|, |‖a‖ − ‖b‖| <= ‖a − b‖ (triangle
 * inequality). Collective over the world. */
void check_norms(run *ref, run *const *runs, int n);

/* One training step of r on b (step_rows, the L2 grad norm, clipping to
 * max_norm, ml_engine_adamw with c), checked as above. Returns the loss;
 * *worst (when not NULL) gets the largest error/bound seen. Fails the test
 * on every rank (the exported tensors are the same everywhere). */
double checked_step(run *r, const batch *b, const ml_adamw_cfg *c, double max_norm, double *worst);

/* One forward/backward of b on r and on one rank opened on r's current
 * parameters: loss and every gradient within the pair bounds of
 * tolerance.h §3. Collective over the world. */
void check_replay_one_rank(run *r, const batch *b);

#endif
