/* Vocab-parallel cross-entropy and per-token log-probs (DESIGN §7; Megatron
 * _VocabParallelCrossEntropy, torchtitan _LossParallelCrossEntropy, NeMo RL
 * DistributedLogprob): lm_head's logits stay sharded on the vocab dim; per
 * token, an all-reduce MAX of the row max, then one all-reduce SUM of
 * (sum of exp, target logit) over tp. Backward is local:
 * (softmax − onehot)·w. The full [T, V] logits never exist; tokens are
 * processed in chunks that bound the logits buffer. */
#ifndef ML_LOSS_H
#define ML_LOSS_H

#include <stdbool.h>

#include "comm/comm.h"
#include "model/model.h"
#include "tensor/dtype.h"

typedef struct ml_loss_out {
  double loss_sum; /* sum over valid targets of −log p(target), this rank's tokens */
  int64_t count;   /* valid targets among this rank's tokens */
} ml_loss_out;

/* Run lm_head (after ml_head_begin) and the loss over all T tokens.
 * targets [T]: global token id, or −1 to ignore. When `backward`, each
 * valid token's gradient weight is `grad_scale` (1 / global target count
 * for a mean loss) and ml_head_backward runs per chunk. logprobs [T] (may
 * be NULL): log p(targets[t]) (0 for ignored tokens). logits_dtype: ML_F32,
 * or ML_BF16 to round the logits to bf16 first (FSDP2 MixedPrecisionPolicy
 * output_dtype; the loss itself is fp32). tp: the group the
 * logits are vocab-sharded over (lm_head output Shard(−1)), or NULL when
 * each rank holds whole logits rows (output Replicate). Errors:
 * allocation, collectives. */
int ml_vocab_parallel_loss(ml_model *m, ml_comm *tp, const int32_t *targets, ml_dtype logits_dtype,
                           bool backward, float grad_scale, float *logprobs, ml_loss_out *out);

/* Tokens per logits chunk of ml_vocab_parallel_loss for T local tokens and
 * a vocabulary of V split over `parts` vocab shards (the tp size when the
 * logits are vocab-sharded, 1 when each rank holds whole rows): a budget of
 * 2^24 floats (64 MiB) of logits over the largest torch.chunk shard
 * ceil(V / parts), clamped to [1, T] (T = 0 gives 0). Computed from the
 * largest shard so that every rank of the group runs the same number of
 * chunks and so issues the same collectives (2 all-reduces per chunk when
 * sharded: MAX of nt floats, SUM of 2·nt floats). For `meshlm plan`. */
int64_t ml_loss_chunk_tokens(int64_t T, int64_t V, int parts);

#endif
