/* tolerance.h §3's model sizes from a meshlm model config, for the MPI
 * tests (engine_run.h) and the CLI tests' tol_bound alike. */
#ifndef ML_TOL_CONFIG_H
#define ML_TOL_CONFIG_H

#include <stdint.h>

#include "model/config.h"
#include "tolerance.h"

/* The sizes section 3 counts for config c, with S keys per query and T
 * token rows in the batch. */
static inline tol_model tol_model_of_config(const ml_model_config *c, int64_t S, int64_t T) {
  double inter = c->moe_inter > c->intermediate ? c->moe_inter : c->intermediate;
  tol_model m = {(double)c->hidden,   inter,                   (double)c->n_heads,
                 (double)c->n_kv_heads, (double)c->head_dim,   (double)c->n_layers,
                 (double)c->vocab,    (double)S,               (double)T,
                 1.0 /* whole rows: the fixtures' batches fit one logits tile */,
                 (double)c->n_experts, (double)c->top_k};
  return m;
}

#endif
