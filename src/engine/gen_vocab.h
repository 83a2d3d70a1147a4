/* Generation on the policy's own FSDP mesh (engine/generate.h): the
 * vocab-parallel parameters whole for the call. Under vocab parallelism
 * over FSDP's group (parallel/fsdp.h, parallel/vocab.h) embed_tokens.weight
 * and an untied lm_head.weight are never gathered: each rank computes on
 * its block of vocab rows and the tokens of the whole group travel, which
 * ties every FSDP rank's forward to the others'. Generation's data-parallel
 * ranks decode different prompts for different numbers of steps, so for
 * the call each rank holds these parameters whole (their TP-local tensor,
 * as FSDP's all-gather would give it: the same bits as the rows, fp32, or
 * rounded once to param_dtype) and computes the embedding and the logits
 * alone, as a one-rank FSDP group does. Memory: the unit's every parameter
 * unsharded in fp32 ([full_numel], ml_fsdp_gather_flat's layout), plus a
 * param_dtype copy of the vocab-parallel ones when param_dtype is bf16. */
#ifndef ML_GEN_VOCAB_H
#define ML_GEN_VOCAB_H

#include "parallel/fsdp.h"

typedef struct ml_gen_vocab {
  ml_fsdp_unit *unit; /* the unit holding vocab-parallel parameters (NULL: none) */
  float *full;        /* [unit->full_numel] fp32: the unit unsharded (device) */
  void *cast;         /* the vocab-parallel parameters in param_dtype bf16, or NULL */
} ml_gen_vocab;

/* After ml_fsdp_unshard of every unit: point each vocab-parallel
 * parameter's data at its whole TP-local tensor in param_dtype (one
 * ml_fsdp_gather_flat of its unit). Nothing when f is not vocab-parallel.
 * Collective over FSDP's group (every rank, even one with no prompt).
 * Errors: allocation (named), the collective's. */
int ml_gen_vocab_whole(ml_fsdp *f, ml_gen_vocab *v);

/* Their data back to NULL (as ml_fsdp_unshard leaves them) and the
 * buffers freed; before ml_fsdp_reshard. Safe after a failed
 * ml_gen_vocab_whole. */
void ml_gen_vocab_release(ml_fsdp *f, ml_gen_vocab *v);

#endif
