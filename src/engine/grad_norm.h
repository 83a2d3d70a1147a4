/* The grad norm's partials computed during backward (issue 30): as each
 * FSDP unit's gradient shard becomes final in the last backward before the
 * norm (after its reduce-scatter, in the micro-batch loop's last
 * micro-batch), its parameters' partials (fp64 sum of squares, or max |g|
 * for the inf-norm: ml_be_norm_partials) are computed on the shards'
 * backend and left there, so that the norm itself is one copy to the host
 * (one per step, where the one pass after backward synchronised per
 * parameter) and one all-reduce. The partials are folded in the one pass's
 * order (units in order, parameters in unit order), each the one pass's
 * value: the norm is bitwise what the one pass gives
 * (ml_engine_grad_norm). A gradient the tp step changes after its unit's
 * reduction (engine/grads.h ml_grads_tp_stepped) and, under cpu_offload,
 * every gradient (its copy to the host lands at the end of backward) has
 * its partial computed at the end of backward instead. Internal to the
 * engine (engine.c, grad_norm.c). */
#ifndef ML_GRAD_NORM_H
#define ML_GRAD_NORM_H

#include <stdbool.h>

#include "backend/backend.h"

struct ml_engine;

/* Zero-initialised with the engine; ml_norm_parts_free. */
typedef struct ml_norm_parts {
  double ahead;      /* norm_type the next backward computes partials for (0: none) */
  double active;     /* the backward now running computes them for this norm_type (0: not) */
  double have;       /* the gradients as they are have their partials for this norm_type (0:
                        none) until the norm takes them, zero_grad, a backward or a clip */
  int n;             /* slots: one per (FSDP unit, parameter), in unit order */
  int *first;        /* [n_units] unit u's first slot */
  int *at;           /* [n] where slot s's partial lies in dev / host (−1: none yet) */
  int used;          /* partials computed in this backward */
  double *dev;       /* [n] the partials, in the shards' backend's device memory
                        (fsdp.shard_be), or `host` itself where that is host memory */
  double *host;      /* [n] their copy on the host */
  ml_norm_seg *segs; /* [n] the pieces of one ml_be_norm_partials call */
} ml_norm_parts;

/* The next backward (ml_engine_forward_backward*) is the last before
 * ml_engine_grad_norm(e, norm_type) (a step's last micro-batch): it
 * computes the norm's partials as its units finish. norm_type 2 or
 * INFINITY; anything else (0) asks for none. A backward consumes the
 * request. */
void ml_engine_norm_ahead(struct ml_engine *e, double norm_type);

/* With the training state (ml_engine_train_state): the slots (8 B per
 * parameter in the device pool where the shards' backend is not on host
 * memory, i.e. CUDA without cpu_offload; else host memory outside the
 * pools). Errors: allocation. */
int ml_norm_parts_alloc(struct ml_engine *e);
void ml_norm_parts_free(struct ml_engine *e);

/* At the start of a backward: drop the partials held; take up the request
 * of ml_engine_norm_ahead. */
void ml_norm_parts_begin(struct ml_engine *e);
/* In the backward asking for them (else nothing), after ml_fsdp_reduce_grads
 * of unit u: the partials of u's (and its expert unit's) gradients final
 * now. Errors: the backend's. */
int ml_norm_parts_unit(struct ml_engine *e, int u);
/* At the end of that backward, after the tp step: the remaining partials;
 * then they are held. Errors: the backend's. */
int ml_norm_parts_finish(struct ml_engine *e);
/* Drop the partials held (the gradients change: zero_grad, clipping). */
void ml_norm_parts_drop(struct ml_engine *e);

#endif
