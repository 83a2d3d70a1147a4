/* Variable-length ("varlen") attention over packed sequences: several
 * documents laid end to end in the rows of one batch [B, S], each
 * attending only to itself: causal within the document and, with a
 * sliding window, keys within the window of the document's own positions
 * (FlashAttention-2's flash_attn_varlen_func with cu_seqlens_q =
 * cu_seqlens_k, NeMo's packed sequences; FlashAttention-3's seqused_q /
 * seqused_k for the padded tail of a document's slot).
 *
 * It is an attention core (model.h ml_attn_core), set from outside as
 * m->attn_core = ml_varlen_core(&v). Each document runs as one block of the
 * backend's block attention (ml_be_attention_block_fwd / _bwd) with q_pos =
 * k_pos = 0 and sq = sk = its length, on pointers offset to its first
 * token: exactly the backend's whole-sequence attention of that document
 * alone, so its outputs and gradients are those of the document run as a
 * batch of its own (same kernels, same tiles from its first token). A
 * backend with varlen attention (ML_OP_ATTENTION_VARLEN: the CPU's) runs
 * all those blocks in one call per layer (ml_be_attention_varlen_fwd /
 * _bwd, the same bits); others (CUDA) get one block call per document. Position
 * ids are the caller's (m->position_ids restarting at 0 per document; RoPE
 * takes any positions). Not with context parallelism (whose ring core
 * replaces this one). */
#ifndef ML_VARLEN_H
#define ML_VARLEN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "model/model.h"

/* Documents over the flattened T = B·S tokens of a batch (token t is
 * position t mod S of row t / S). Host memory, set by the caller before
 * each forward and kept through its backward. */
typedef struct ml_varlen {
  ml_backend *be;
  int64_t ndocs;     /* documents in the whole batch, >= 0 */
  /* [ndocs + 1] cumulative token offsets (cu_seqlens): cu[0] = 0, strictly
   * increasing, cu[ndocs] <= B·S; document d's slot is tokens cu[d] ..
   * cu[d+1] − 1, within one row (a slot never crosses a row boundary). */
  const int64_t *cu;
  /* [ndocs] tokens of each slot that are the document (seqused), 0 <=
   * used[d] <= cu[d+1] − cu[d]; NULL: every slot is all document. */
  const int64_t *used;
  /* the backward's block workspace (device memory, owned, grown on need) */
  void *work;
  size_t work_bytes;
} ml_varlen;

/* Checks v's documents against a batch [B, S]; the forward and backward
 * check them too. Errors (naming the document and its offsets): ndocs < 0,
 * cu NULL with ndocs > 0, cu[0] ≠ 0, offsets not increasing, a slot past
 * B·S or crossing a row boundary, used[d] outside [0, slot length]. */
int ml_varlen_check(const ml_varlen *v, int64_t B, int64_t S);

/* The attention core over v (ctx = v), for m->attn_core:
 *  saved: the log-sum-exp, B·S·nh floats, [B][S, nh] (ml_attn_block's lse
 *    layout on every backend);
 *  fwd: out [B, S, nh·hd] (=) and lse: each document's attention, a token
 *    not in a document (the rest of a slot, tokens from cu[ndocs] on)
 *    attends to nothing: out 0, lse −inf;
 *  bwd: dq [B, S, nh, hd], dk, dv [B, S, nkv, hd] (=), 0 outside the
 *    documents.
 * The call's group, head_off, scale, window and compute go to every block,
 * and so do its qkv_bf16 and out_bf16 (the core declares bf16_qkv and
 * bf16_out: q, k, v and out then hold bf16 elements at the same offsets,
 * read and written exactly as ml_attn_block.qkv_bf16 / .out_bf16 do; lse,
 * dout, dq, dk, dv stay fp32), so under bf16 weights packed documents keep
 * the bf16 q, k, v and attention output of the unpacked run (model.h
 * ml_model_bf16_qkv, ml_model_bf16_att), every document's values bitwise
 * those of its block alone. Errors: ml_varlen_check's, a backend without block attention (the
 * message says to run one sequence per micro-batch), the backend's. */
ml_attn_core ml_varlen_core(ml_varlen *v);

/* Frees the workspace (v->cu and v->used are the caller's). */
void ml_varlen_destroy(ml_varlen *v);

#endif
