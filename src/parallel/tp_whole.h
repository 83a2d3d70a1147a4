/* Row-parallel linears computed whole: the batch-invariant mode under tensor
 * parallelism (ARCHITECTURE.md §7). A rowwise linear (o_proj, down_proj, any
 * Linear whose weight is Shard(1) over tp) sums each rank's product over its
 * K-slice of the input features in an all-reduce / reduce-scatter: a split
 * of the reduction whose rounding depends on the tp size. In the mode each
 * tp rank instead all-gathers the input's features and the weight's K-shards
 * (as FSDP all-gathers a unit) and computes the whole [T, out] output with
 * the fixed-order GEMM, as one rank does (as parallel/cp.h has each cp rank
 * attend over the whole sequence's K/V): the output is Replicate, so the
 * output edge's Partial → Replicate all-reduce is nothing and Partial →
 * Shard(1) (sequence parallelism) is a local slice of this rank's sequence
 * chunk. The backward stays local and as without the mode: dy arrives
 * Replicate either way, dx = dy·W_local gives this rank's input features,
 * dW_local += dy^T·x_local its weight columns. A LoRA adapter on such a
 * linear is computed whole the same way (lora_A's columns and its input,
 * after LoRA dropout, whose mask is of the global column, gathered; lora_B
 * is Replicate); its backward too stays local (dB a Partial sum, as
 * without the mode). The cost, per forward and
 * row-parallel linear: an all-gather of the weight and of the input
 * features ((tp − 1)/tp of each on the wire) and tp× the linear's FLOPs. */
#ifndef ML_TP_WHOLE_H
#define ML_TP_WHOLE_H

#include "parallel/tp.h"

/* After ml_tp_apply on m over tp (and LoRA's setup), in the batch-invariant
 * mode: every Linear whose weight is Shard(1) over tp gets a whole hook
 * (model.h ml_whole_hook) gathering over tp's group, and its output edge starts
 * from Replicate instead of Partial (ml_tp_edge.p[0]; the edge's backward
 * steps are unchanged, a Partial's gradient being Replicate). Nothing with
 * tp size 1. Errors (before any collective, the same on every rank): a
 * rowwise lm_head (Partial logits; expected colwise or replicated). */
int ml_tp_whole_apply(ml_tp *tp, ml_model *m);

/* For a generate call (engine/generate.c), after FSDP's unshard: gathers
 * every whole linear's weight [out, in] and lora_A [r, in] (their dtypes)
 * over tp once into pool memory (ml_linear.whole_weight / whole_lora_a),
 * which every forward of the call uses instead of gathering them again per
 * decode step; the same bits (a gather copies). Collective over tp in module
 * order (every tp rank calls it). Nothing where no linear has a whole hook.
 * Errors: the pool's (its peak counts the held weights); what was gathered
 * stays held for ml_tp_whole_release. */
int ml_tp_whole_hold(ml_tp *tp, ml_model *m);

/* Frees what ml_tp_whole_hold gathered (NULL pointers after); call it
 * before FSDP's reshard, also after a failed hold. */
void ml_tp_whole_release(ml_tp *tp, ml_model *m);

#endif
