/* Internal to the tensor-parallel plan (parallel/tp.c applies it,
 * parallel/tp_walk.c propagates placements through the decoder): what the
 * two share. Not for use outside parallel/tp*. */
#ifndef ML_TP_IMPL_H
#define ML_TP_IMPL_H

#include "parallel/tp.h"

static inline bool ml_tp_is_seq(ml_placement p) { return ml_placement_eq(p, ml_shard(1)); }
static inline bool ml_tp_is_feat(ml_placement p) { return ml_placement_eq(p, ml_shard(-1)); }
static inline bool ml_tp_is_rep(ml_placement p) { return p.kind == ML_REPLICATE; }
static inline bool ml_tp_is_part(ml_placement p) { return p.kind == ML_PARTIAL; }
/* The placement a gradient takes for an activation of placement p. */
static inline ml_placement ml_tp_grad_of(ml_placement p) {
  return ml_tp_is_part(p) ? ml_replicate() : p;
}

/* p as "Shard(1)" for messages (one of 4 rotating static buffers). */
const char *ml_tp_pstr(ml_placement p);

/* Install edge e's redistributes as the hooks of model edge `edge`, each
 * direction's only when it communicates or reshapes (a row-parallel
 * output's Partial → Replicate has no backward step: its backward reads
 * the gradient as it is, so a bf16 GEMM may take it in bf16,
 * model/linear.h ml_linear_dy_bf16), with the widest local feature count
 * it takes on (none when e does neither way). */
void ml_tp_set_hooks(ml_edge *edge, ml_tp_edge *e);

/* How parameter p is cut when sharded on dim d: ML_TP_QUERY_HEADS /
 * ML_TP_KV_HEADS (whole heads, from the block table's heads rule), or 0
 * (torch.chunk). */
unsigned char ml_tp_heads_rule(const ml_model *m, const ml_param *p, int d);

/* Rank r's cut of p's dim d under `rule` (start, len, owned from). */
void ml_tp_slice_of(const ml_model *m, int size, const ml_param *p, int d, unsigned char rule,
                    int r, int64_t *start, int64_t *len, int64_t *own);

/* Propagate placements through m's decoder under the rules tp->modules
 * holds (matched), sharding parameters and installing the edges' hooks
 * (ml_tp_apply's errors). */
int ml_tp_walk(ml_tp *tp, ml_model *m);

#endif
