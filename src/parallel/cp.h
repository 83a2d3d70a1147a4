/* Context parallelism (ARCHITECTURE.md §2; torch.distributed.tensor.experimental.context_parallel): the cp
 * ranks of one data-parallel rank share its sequences, each holding a piece
 * of every sequence; attention, the one place tokens meet, runs as ring
 * attention over the cp group (Liu et al. 2023, "Ring Attention with
 * Blockwise Transformers"; torch.distributed.tensor.experimental's
 * context_parallel with the "alltoall" rotate method). Everything else —
 * norms, linears, the loss — is per token and runs on the local piece.
 *
 * Load balance (torch's _HeadTailLoadBalancer, Megatron's
 * get_batch_on_this_cp_rank): a sequence of S tokens is padded to S' (the
 * next multiple of 2·cp), cut into 2·cp chunks of c = S' / (2·cp), and cp
 * rank r holds chunks r and 2·cp − 1 − r, in that order: s = 2·c local
 * positions whose global positions are the model's position_ids (RoPE
 * rotates by them). Under a causal mask every rank then sees the same
 * number of (query, key) pairs. Padding: the S' − S pad positions come after
 * the last real token with token id 0 and no target, so causal attention
 * never lets a real token see one (exact: real tokens' outputs, the loss
 * and every gradient are those of the unpadded sequence).
 *
 * Ring attention: each rank's keys and values (K/V chunks of nkv heads: GQA
 * circulates the kv heads, never repeated ones) travel around the cp ring in
 * cp − 1 passes (ml_iring_pass), the next pass in flight while the current
 * block computes. Per (query chunk, key chunk) pair a block
 * (ml_be_attention_block_fwd) merges into the query chunk's output by its
 * log-sum-exp; a pair whose keys all come after its queries (causal) or all
 * fall outside a sliding window is skipped, not computed. Backward runs the
 * ring again: K/V travel as in forward, and each K/V chunk's dK/dV
 * accumulator travels with it one pass behind (cp passes; this rank's
 * contribution is computed into a separate buffer while the accumulator is
 * in flight, then added), returning to the owner complete.
 * Under bf16 q, k, v (model.h ml_model_bf16_qkv: the core declares
 * ml_attn_core.bf16_qkv) the K/V chunks travel, and are kept, as the bf16
 * values every block reads exactly (ml_attn_block.qkv_bf16): half the K/V
 * traffic and buffers, as Megatron / TransformerEngine context parallelism
 * sends bf16 KV; the results are bitwise those of fp32 K/V holding the same
 * values. Outputs, the log-sum-exp and the dK/dV accumulators stay fp32
 * (the forward merges fp32 outs: the core takes no bf16 out).
 *
 * Targets are shifted on the whole sequence before the pieces are cut (NeMo
 * RL's seq_index convention), so each position scores the token after it in
 * the original order; log-probs come back in that order
 * (ml_cp_gather_tokens). The ring's passes are counted by the cp group's
 * counting comm as send_recv, so `meshlm plan` (which runs this code on the
 * meta backend) predicts them from what runs.
 *
 * The batch-invariant mode (fixed: meshlm_options.batch_invariant): the
 * forward's merges by log-sum-exp round differently from one rank's single
 * pass over the keys, so there the ring only carries the K/V chunks (the
 * same passes) into a copy of the whole sequence's K/V, and each query
 * chunk attends to it in one fixed-order block from position 0 — the
 * computation one rank does, so log-probs are the same bits at every cp
 * size (the all-gather form of context parallelism, as Llama 3's; K/V of
 * the whole sequence per rank: 2·B·S'·nkv·hd elements more, bf16 under
 * bf16 q, k, v). The backward is
 * the ring's either way (gradients are not part of the mode's promise). */
#ifndef ML_CP_H
#define ML_CP_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "comm/comm.h"
#include "model/model.h"

typedef struct ml_cp {
  ml_comm *comm; /* the cp group's data comm (ring passes, log-prob gather) */
  ml_backend *be;
  int size, rank;
  int64_t S, S_pad, chunk; /* the geometry: sequence length, padded, chunk c */
  int64_t *position_ids;   /* [2·chunk] global position of each local position */
  bool fixed;              /* the batch-invariant mode's forward (above) */
} ml_cp;

/* Set up context parallelism of model m over `comm` (its size is cp): the
 * model's attention core becomes ring attention (m->attn_core); fixed: the
 * batch-invariant mode's forward (above). A comm of one rank installs
 * nothing (the model's own attention). No collective. Errors: allocation. */
int ml_cp_apply(ml_cp *cp, ml_model *m, ml_comm *comm, ml_backend *be, bool fixed);
void ml_cp_destroy(ml_cp *cp);

/* The geometry for sequences of S tokens: the padded S', chunks and this
 * rank's position_ids (set on m, with m->rope_len = S: RoPE's
 * length-dependent scalings see the whole sequence). Returns the local positions per sequence
 * s = S' / cp (S when cp = 1) in *s_local, to pass to ml_model_begin.
 * Errors: S < 1, a padded length beyond int32 positions, allocation. */
int ml_cp_geometry(ml_cp *cp, ml_model *m, int64_t S, int64_t *s_local);

/* This rank's tokens of full sequences: in [B, S] (S as in the last
 * ml_cp_geometry) → out [B, s_local] (host), the positions past S filled
 * with `pad`. With cp = 1, a copy. */
void ml_cp_local_tokens(const ml_cp *cp, const int32_t *in, int64_t B, int32_t pad,
                        int32_t *out);
/* The same for per-position records of `size` bytes (e.g. a target's
 * objective inputs, parallel/objective.h): in [B, S] → out [B, s_local],
 * the positions past S set to *pad. */
void ml_cp_local_values(const ml_cp *cp, const void *in, int64_t B, size_t size, const void *pad,
                        void *out);

/* The inverse for per-token values: every cp rank's local [B, s_local]
 * fp32 values (device) → out [B, S] in the original order (host), one
 * all-gather over the cp group into `work` (device, cp·B·s_local floats)
 * and `host` (host, as many). Collective over the cp group. */
int ml_cp_gather_tokens(const ml_cp *cp, const float *local, int64_t B, float *work, float *host,
                        float *out);

#endif
