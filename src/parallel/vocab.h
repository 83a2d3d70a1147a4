/* Vocab parallelism over FSDP's group for the vocab-sized root parameters
 * (embed_tokens.weight and an untied lm_head.weight): Megatron's
 * VocabParallelEmbedding and _VocabParallelCrossEntropy
 * (megatron/core/tensor_parallel/layers.py, cross_entropy.py), which split
 * the vocabulary over tp, applied over the group FSDP shards over
 * (dp_shard_cp, parallel/fsdp.h). FSDP chunks each parameter's TP-local
 * tensor on dim 0, which for these two is the vocab, so a rank's FSDP shard
 * of them is a contiguous block of vocab rows (ml_fsdp_rows): they are
 * computed on where they lie and never all-gathered. The tokens travel
 * instead, per micro-batch, d ranks of T = B·S tokens each:
 *  - ml_vocab_gather_tokens: one all-gather of every rank's [ids | targets];
 *  - embedding forward: the group's d·T ids looked up in this rank's rows
 *    (0 for ids outside them), [d·T, c], a Partial sum over the vocab
 *    split; one reduce-scatter → this rank's [T, c] (every sum has one
 *    nonzero term: exact), which is what the lookup on the TP-local weight
 *    gives (Partial over tp under a rowwise embedding); then the
 *    embedding's output edge (TP) as without FSDP. Backward: the edge's
 *    backward, one all-gather of the output gradient [T, c] → [d·T, c],
 *    scattered into this rank's rows of the gradient, complete for them;
 *  - the loss (parallel/loss.h ml_loss_split): lm_head's input all-gathered,
 *    the logits of this rank's rows for all d·T tokens, the softmax
 *    statistics all-reduced over tp and then over the group, the input
 *    gradient reduce-scattered back.
 * Bytes per rank and micro-batch, as the counting comm counts them (c =
 * hidden): 4·d·T·(4c + 2) moved by these gathers and reduce-scatters plus
 * the loss's 12·d·T (over the group and again over tp when the logits are
 * vocab-sharded there), against 8·V·c to all-gather the vocab rows and
 * reduce-scatter their gradient; about 2·d·T/V of it. The memory added is
 * [2, d·T, c] activations (ml_vocab.work, reserved with the batch) against
 * the gathered [V, c] weight, its [V, c] gradient and FSDP's staging for
 * both. Both favour this while the group's tokens d·T stay below V/2 —
 * 131,072 tokens per micro-batch for Gemma 3's 262,144-token vocabulary,
 * 24,576 for a 49,152-token one; beyond that gathering the weight would
 * move fewer bytes, and the work buffer grows with d. The engine turns it
 * on whenever FSDP's group has more than one rank and lm_head's logits
 * need no output redistribute (engine/engine.h). */
#ifndef ML_VOCAB_H
#define ML_VOCAB_H

#include <stdint.h>

#include "comm/comm.h"
#include "model/model.h"

typedef struct ml_vocab {
  ml_comm *comm;   /* FSDP's group (size d > 1); NULL: off (the vocab rows are gathered) */
  ml_backend *be;  /* the model's */
  int64_t T;       /* tokens per rank of the micro-batch gathered last */
  int32_t *ids;    /* [d·T] the group's token ids, rank-major (device) */
  int32_t *targets;/* [d·T] their targets (global id or −1), rank-major (device) */
  int32_t *send;   /* [2T] this rank's ids | targets (staging) */
  int32_t *wire;   /* [d, 2T] every rank's, as gathered (staging) */
  float *work;     /* [2, d·T, hidden]: the group's tokens' activations — the embedding's
                      lookup or output gradient in the first block, lm_head's input and its
                      gradient in both (the loss, parallel/loss.h) */
  int64_t cap;     /* tokens per rank the buffers hold */
  int64_t hidden;  /* features per token they hold */
} ml_vocab;

/* Vocab parallelism over `comm` (FSDP's group, more than one rank) on
 * backend `be`; nothing allocated yet. */
void ml_vocab_init(ml_vocab *v, ml_comm *comm, ml_backend *be);
void ml_vocab_destroy(ml_vocab *v);

/* Room for T tokens per rank of `hidden` features (no collective): the
 * engine reserves it with the batch, so that a batch whose group
 * activations do not fit fails before any collective. Errors: allocation,
 * naming the token counts. */
int ml_vocab_reserve(ml_vocab *v, int64_t T, int64_t hidden);

/* All-gather this rank's token ids and targets, T each (device memory),
 * over the group into v->ids and v->targets: one all-gather of [ids |
 * targets], the int32 words carried by an fp32 all-gather (which moves bits
 * and computes nothing). Collective over the group. Errors: T beyond what
 * ml_vocab_reserve made room for, the collective. */
int ml_vocab_gather_tokens(ml_vocab *v, const int32_t *ids, const int32_t *targets, int64_t T);

/* Whether the model's batch is the one gathered last (B·S = v->T) and c
 * features per token fit the work buffer: 0, or −1 with the error set. */
int ml_vocab_check(const ml_vocab *v, const ml_model *m, int64_t c);

/* Embedding forward of the gathered micro-batch (see above) with this
 * rank's rows w of embed_tokens.weight: x [B, s_res, H] (room for [B, S,
 * H]), this rank's B·S = v->T tokens, after the output edge. Collective
 * over the group (and the edge's tp group). Errors: another batch geometry
 * than the one gathered, the collectives, the edge's. */
int ml_vocab_embed_forward(ml_vocab *v, ml_model *m, const ml_rows *w, float *x);
/* Its backward: dx [B, s_res, H] (clobbered) → w->grad (+=) for every
 * token of the group whose id w holds. Collective as the forward. */
int ml_vocab_embed_backward(ml_vocab *v, ml_model *m, const ml_rows *w, float *dx);

#endif
