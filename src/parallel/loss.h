/* Vocab-parallel cross-entropy and per-token log-probs (ARCHITECTURE.md §7; Megatron
 * _VocabParallelCrossEntropy, torchtitan _LossParallelCrossEntropy, NeMo RL
 * DistributedLogprob): each rank computes the logits of a block of vocab
 * columns only; per token, an all-reduce MAX of the row max, then one
 * all-reduce SUM of (sum of exp, target logit) over the ranks holding the
 * other columns. Backward is local: (softmax − onehot)·w. The full [T, V]
 * logits never exist.
 *
 * The fused classifier (Liger's fused linear cross entropy, with an online
 * log-sum-exp per tile as Milakov & Gimelshein's online softmax and
 * FlashAttention run it): tokens go in blocks (every rank the same count,
 * so the same collectives: per block MAX of nt floats, SUM of 2·nt), and a
 * rank's vocab columns in tiles of at most `tile_floats` logits
 * (ml_loss_tiling). Where a block's whole rows fit one tile, lm_head runs
 * once per block with its edges and the statistics are Megatron's two
 * passes over the stored logits. Otherwise the block has at least 4096
 * tokens (or all N) and per tile: logits = x·W_tile^T, the running max
 * and sum of exp of each token updated (fp64 per tile, rounded once); the
 * max is then MAX-reduced, each rank's sum moved onto it (·exp(local max −
 * max)) and SUM-reduced; the backward runs the tiles again, last first —
 * the logits recomputed (but the last tile's, still in the buffer), their
 * gradient, dx += dlogits·W_tile and W_tile's gradient
 * += dlogits^T·x, one GEMM over the whole block (K = its tokens) per tile,
 * so lm_head's weight gradient is read and written once per block. With
 * bf16 rows the block's x and each tile's gradient are rounded once for
 * both GEMMs. fp32 logits live one tile at a time; with one tile per
 * block (a narrow vocabulary or few tokens) it is exactly the unfused
 * computation. With several tiles the sum of exp differs from the unfused
 * one by the order of its terms and the rescaling (tests/tolerance.h
 * tol_xent_online, tol_model.vocab_tiles), dx and lm_head's weight
 * gradient by their GEMMs' summation order over tiles and blocks.
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
  int64_t tile_floats;   /* logits per tile of the fused classifier; 0: 2^24 (64 MiB) */
  bool batch_invariant;  /* never tile the vocabulary (ml_loss_tiling's tileable false): each
                            token's whole row of logits in one tile, whatever the block's
                            token count, so its log-sum-exp is summed in one order; with tp
                            (and no group) each block's vocab-sharded logits are all-gathered
                            into whole rows [block, V] whose statistics are one rank's: the
                            same log-probs on any tp size */
} ml_loss_split;

/* The backward of a loss pass: each valid target's weight in the logits'
 * gradient. Without an objective, `scale` (1 / global target count for a
 * mean NLL). With one (parallel/objective.h), the weight is −dL/dlp of the
 * target's objective on its log-prob, in[t] its inputs: [N] in host memory
 * for the N targets of the pass (this rank's T, or under vocab parallelism
 * the group's d·T in rank order, as the targets are gathered); the terms of
 * this rank's own targets are added to *sums. With obj->entropy_coef c ≠ 0
 * the entropy bonus too: each trained target's token gets the gradient
 * c·w·p(log p + H) on its logits beside its objective's (the entropy
 * computed as ml_loss_extra's, xent_bwd_entropy tile by tile), and its
 * −c·w·H, w·H go to sums->loss, sums->entropy. */
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

/* What a forward pass gives per token besides the log-probs (loss.c
 * chunk_extras), of this rank's T tokens, in device memory:
 *  - entropy [T] (NULL: not wanted): H_t = −Σ_v p_v log p_v of the full
 *    softmax in nats (verl's entropy_from_logits), computed as the
 *    log-sum-exp is, never over full-vocabulary logits: with each tile's
 *    shifted sum sl = Σ exp(l − m)·(l − m) carried beside the sum of exp
 *    (moved to a new max as sl·e^d + d·se·e^d), reduced with it (one SUM
 *    over tp then the group), H = log(se) − sl/se;
 *  - topk_logprobs, topk_ids [T, topk] (topk 0: not wanted): the topk
 *    largest log-probs best first and their global token ids, in the
 *    logits' order (equal logits by the lower id; NeMo RL get_topk_logits with its
 *    distributed_vocab_topk merge, as log-probs: logit − log-sum-exp); each
 *    rank's lists per tile, all-gathered over tp then the group and merged.
 *    A log-prob is bitwise the one the scoring path gives that token as a
 *    target (the same fp32 logit − max, then − log(se) in fp64). */
typedef struct ml_loss_extra {
  float *entropy;
  int64_t topk;
  float *topk_logprobs;
  int32_t *topk_ids;
} ml_loss_extra;

/* ml_vocab_parallel_loss with the extra outputs `extra` (NULL: none, the
 * same pass bit for bit; the statistics' SUM reduction carries sl as well
 * when the entropy is wanted). Errors: those of ml_vocab_parallel_loss, a
 * topk below 0 or above vocab_size. */
int ml_vocab_parallel_scores(ml_model *m, const ml_loss_split *split, const int32_t *targets,
                             ml_dtype logits_dtype, const ml_loss_grad *grad, float *logprobs,
                             const ml_loss_extra *extra, ml_loss_out *out);

/* The fused classifier's tiling for N tokens (this rank's T, or the group's
 * d·T under vocab parallelism) and a vocabulary of V split into `parts`
 * column blocks (the tp size when the logits are vocab-sharded over tp,
 * else 1; times d under vocab parallelism, which splits each tp block over
 * the group by torch.chunk again: the largest block is ceil(ceil(V / tp) /
 * d) = ceil(V / (tp·d))), with `budget` logits per tile (0: 2^24). block:
 * tokens per block — as many as whole rows of the largest block fit the
 * budget, and where fewer than N fit and the logits may be tiled
 * (`tileable`: lm_head's output needs no redistribute), at least
 * min(4096, budget / 16); clamped to N (N = 0 gives 0). cols: columns per
 * tile (a multiple of 16 when above 16), the largest block's width where
 * whole rows fit; a rank holding nv columns tiles them when cols < nv.
 * Computed from the largest block so that every rank runs the same number
 * of blocks and so issues the same collectives. For `meshlm plan` too. */
typedef struct ml_loss_tiles {
  int64_t block, cols;
} ml_loss_tiles;
ml_loss_tiles ml_loss_tiling(int64_t N, int64_t V, int parts, bool tileable, int64_t budget);

#endif
