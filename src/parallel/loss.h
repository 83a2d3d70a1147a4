/* Vocab-parallel cross-entropy and per-token log-probs (ARCHITECTURE.md §7; Megatron
 * _VocabParallelCrossEntropy, torchtitan _LossParallelCrossEntropy, NeMo RL
 * DistributedLogprob): each rank computes the logits of a block of vocab
 * columns only; per token, an all-reduce MAX of the row max, then one
 * all-reduce SUM of (sum of exp, target logit) over the ranks holding the
 * other columns. Backward is local: (softmax − onehot)·w. The full [T, V]
 * logits never exist; tokens are processed in chunks that bound the logits
 * buffer.
 *
 * The columns are split over tp when lm_head's logits are vocab-sharded
 * there (output Shard(−1)), and under vocab parallelism over FSDP's group
 * too (parallel/vocab.h; on whenever that group has more than one rank,
 * engine/engine.h): then lm_head's weight rows stay where FSDP
 * sharded them and the tokens come to them — lm_head's input [T, c] (after
 * its input edge) and the targets of every rank of the group are gathered,
 * each rank computes its rows' logits for all d·T tokens, the statistics
 * are reduced over tp and then over the group, each rank keeps the
 * log-probs and loss of its own T tokens, its rows' weight gradient
 * dlogits^T·h is complete (no reduction over the group), and the input
 * gradient dlogits·W_rows, a Partial over the split, is reduce-scattered
 * back to each rank's tokens. */
#ifndef ML_LOSS_H
#define ML_LOSS_H

#include <stdbool.h>

#include "comm/comm.h"
#include "model/model.h"
#include "parallel/objective.h"
#include "parallel/vocab.h"
#include "tensor/dtype.h"

typedef struct ml_loss_out {
  double loss_sum; /* sum over valid targets of −log p(target), this rank's tokens */
  int64_t count;   /* valid targets among this rank's tokens */
} ml_loss_out;

/* Where this rank's logits columns come from and which groups hold the
 * others. */
typedef struct ml_loss_split {
  ml_comm *tp;           /* the group the logits are vocab-sharded over (lm_head output
                            Shard(−1)), or NULL when lm_head hands out whole rows over tp */
  const ml_vocab *group; /* NULL: lm_head's local view on this rank's tokens (its output edge
                            runs); else lm_head's rows `rows` on the tokens of every rank of
                            the group (vocab parallelism over FSDP's group, gathered by
                            ml_vocab_gather_tokens; lm_head's output edge must be inactive) */
  ml_rows rows;          /* with group: this rank's rows of lm_head.weight (ml_fsdp_rows) */
} ml_loss_split;

/* The backward of a loss pass: each valid target's weight in the logits'
 * gradient. Without an objective, `scale` (1 / global target count for a
 * mean NLL). With one (parallel/objective.h), the weight is −dL/dlp of the
 * target's objective on its log-prob, in[t] its inputs: [N] in host memory
 * for the N targets of the pass (this rank's T, or under vocab parallelism
 * the group's d·T in rank order, as the targets are gathered); the terms of
 * this rank's own targets are added to *sums. */
typedef struct ml_loss_grad {
  float scale;
  const ml_objective *obj;
  const ml_obj_in *in;
  ml_obj_sums *sums;
} ml_loss_grad;

/* Run lm_head (after ml_head_begin) and the loss over this rank's T = B·S
 * tokens. targets [T]: global token id, or −1 to ignore (with a group its
 * gathered targets are read, the same values). With `grad` (NULL: forward
 * only), the backward: lm_head's weight gradient accumulates (+=) and its
 * input gradient m->dxn_final is written. logprobs [T] (may be NULL): log
 * p(targets[t]) (0 for ignored tokens). out: the NLL of this rank's
 * targets (also under an objective). logits_dtype: ML_F32, or ML_BF16 to
 * round the logits to bf16 first (FSDP2 MixedPrecisionPolicy output_dtype;
 * the loss itself is fp32). Errors: allocation, collectives, copies. */
int ml_vocab_parallel_loss(ml_model *m, const ml_loss_split *split, const int32_t *targets,
                           ml_dtype logits_dtype, const ml_loss_grad *grad, float *logprobs,
                           ml_loss_out *out);

/* Tokens per logits chunk of ml_vocab_parallel_loss for T tokens (this
 * rank's, or the group's d·T under vocab parallelism) and a vocabulary of
 * V split into `parts` column blocks (the tp size when the logits are
 * vocab-sharded over tp, else 1; times d under vocab parallelism, which
 * splits each tp block over the group by torch.chunk again: the largest
 * block is ceil(ceil(V / tp) / d) = ceil(V / (tp·d))): a budget of 2^24
 * floats (64 MiB) of logits over the largest block ceil(V / parts), clamped
 * to [1, T] (T = 0 gives 0). Computed from the largest block so that every
 * rank runs the same number of chunks and so issues the same collectives
 * (per chunk and group reduced over: MAX of nt floats, SUM of 2·nt
 * floats). For `meshlm plan`. */
int64_t ml_loss_chunk_tokens(int64_t T, int64_t V, int parts);

#endif
