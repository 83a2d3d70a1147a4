/* CPU kernels: the arithmetic of every decoder module as forward/backward
 * pairs, fp32, with OpenMP (and OpenBLAS sgemm inside attention, or the
 * caller's bf16 GEMM: k_attn_bf16). The linear layers' GEMMs are the CPU
 * backend's (backend/cpu/gemm.c, oneDNN); only the CPU backend includes
 * this header.
 *
 * Conventions: activations are row-major [T, D] with T = B*S tokens, the S
 * tokens of one sequence in consecutive rows. "dX (=)" means the kernel
 * overwrites dX; "dW (+=)" means it accumulates into dW, so gradients of a
 * parameter used several times (tied embeddings, micro-batches) add up.
 * Kernels do not allocate unless stated and cannot fail, but for the
 * errors of a GEMM the caller hands them. */
#ifndef ML_KERNELS_H
#define ML_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/types.h"

/* ---- When a kernel's loop goes parallel ----------------------------------
 * Each OpenMP parallel region wakes the team's threads: tens of
 * microseconds under OMP_WAIT_POLICY=passive (a futex wake-up per thread;
 * measured on 2 Zen 4 vCPUs: one decode step of smollm2-135m at batch 1
 * ran ~950 regions, 64 ms a token against 32 ms with the threads
 * spinning), more than one core takes for a pass over a few hundred KiB.
 * So the loops over rows, columns or elements run on the calling thread
 * when K_PAR(iterations, floats) is false: fewer than 2 iterations, or
 * fewer than K_PAR_MIN floats touched. Every iteration's result is the
 * same whichever thread computes it (no reduction across iterations
 * depends on the team), so the results are bitwise the same either way.
 * Attention's forward decides by its own measure (K_ATTN_PAR_MAC). */
#define K_PAR_MIN 65536
#define K_PAR(iters, floats) ((iters) > 1 && (floats) >= K_PAR_MIN)

/* ---- Column runs of a sum over rows -------------------------------------
 * The kernels that sum a [T, N] tensor over its rows per column (bias and
 * RMSNorm weight gradients, the embedding's dW) give each task a run of
 * columns and sum every column in row order, so a column's result does not
 * depend on the runs' width. k_col_width(N): a width that gives each
 * thread of the team a run (N / threads rounded up to a multiple of
 * K_COL_ALIGN, at most K_COL_MAX, the size of a task's accumulators):
 * 576 columns make 15 runs of 40 for 16 threads and 2 of 288 for 2, where
 * a fixed 256 made 3 runs that left 13 threads (or 1 of 2 half the time)
 * idle. */
enum { K_COL_ALIGN = 8, K_COL_MAX = 512 };
int64_t k_col_width(int64_t N);

/* ---- RMSNorm (HF LlamaRMSNorm; Gemma3RMSNorm when w_offset = 1) -------- */
/* rstd[t] = 1/sqrt(mean_h x[t,h]^2 + eps); y[t,h] = x[t,h]·rstd[t]·(w_offset + w[h]).
 * x, y: [T, H]; w: [H]; rstd: [T] saved for backward. y may alias x. */
void k_rmsnorm_fwd(const float *x, const float *w, float w_offset, float eps, float *y, float *rstd,
                   int64_t T, int64_t H);
/* The same into y [T, H] bf16: each fp32 y[t,h] above rounded to nearest-even
 * (ml_f32_to_bf16; bitwise k_rmsnorm_fwd's result converted), x read only — the
 * bf16 h1, h2 that q/k/v_proj and gate/up_proj read (backend.h
 * ml_be_rmsnorm_fwd_bf16; autocast's cast of LlamaRMSNorm's fp32 output). */
void k_rmsnorm_fwd_bf16(const float *x, const float *w, float w_offset, float eps, uint16_t *y,
                        float *rstd, int64_t T, int64_t H);
/* dx[T, H] (=) and dw[H] (+=) given dy[T, H], the forward input x and rstd.
 * dw may be NULL. dx may alias dy. */
void k_rmsnorm_bwd(const float *dy, const float *x, const float *w, float w_offset,
                   const float *rstd, float *dx, float *dw, int64_t T, int64_t H);

/* ---- Rotary position embedding (HF modeling_rope_utils + apply_rotary_pos_emb) */
/* inv_freq[hd/2] of RoPE `sc` (NULL: default) with base theta for a forward
 * over positions 0 .. seq_len − 1 (HF: seq_len = max(position_ids) + 1),
 * computed in fp32 where transformers 5.23 does (modeling_rope_utils'
 * ROPE_INIT_FUNCTIONS): 1/theta^(2i/hd); linear divides by factor; llama3
 * rescales per wavelength (_compute_llama3_parameters); dynamic raises the
 * base to theta·(factor·L/M − (factor − 1))^(hd/(hd−2)) with L = seq_len,
 * M = max_positions, when L > M (_compute_dynamic_ntk_parameters as
 * dynamic_rope_update calls it; up to M the base is theta); yarn blends
 * f/factor and f by a ramp over the correction range
 * (_compute_yarn_parameters); longrope divides by long_factor[i] when
 * seq_len > original_max_positions, else by short_factor[i]
 * (_compute_longrope_parameters, dynamic_rope_update). Returns the
 * attention factor the cos/sin tables are multiplied by: yarn's and
 * longrope's (given, else HF's default formula of factor), 1 for the
 * others. One definition for every backend (the CUDA backend's tables are
 * computed here). */
double k_rope_inv_freq(double theta, int64_t hd, const ml_rope_scaling *sc, int64_t seq_len,
                       float *inv_freq);
/* cos/sin tables [S, hd/2]: angle[p, i] = (float)p · inv_freq[i] (fp32),
 * cos_t = cosf(angle) · scale, sin_t = sinf(angle) · scale (HF: emb.cos() *
 * attention_scaling; scale 1 leaves them exact). */
void k_rope_tables(const float *inv_freq, float scale, int64_t hd, int64_t S, float *cos_t,
                   float *sin_t);
/* In place on x: [B*S, nheads, hd], token row t at position t % S.
 * rotate_half convention: (x1, x2) = halves of each head vector;
 * out = (x1·cos − x2·sin, x2·cos + x1·sin). */
void k_rope_fwd(float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t S,
                int64_t nheads, int64_t hd);
/* In place on dx: the transpose (rotation by −angle). */
void k_rope_bwd(float *dx, const float *cos_t, const float *sin_t, int64_t B, int64_t S,
                int64_t nheads, int64_t hd);
/* The same into y [B*S, nheads, hd] bf16, rounded to nearest-even
 * (ml_f32_to_bf16; bitwise k_rope_fwd's or k_rope_bwd's result converted),
 * the input unchanged: the bf16 q and k attention reads (backend.h
 * ml_be_rope_fwd_bf16), q_proj's and k_proj's bf16 dy (ml_be_rope_bwd_bf16). */
void k_rope_fwd_bf16(const float *x, uint16_t *y, const float *cos_t, const float *sin_t,
                     int64_t B, int64_t S, int64_t nheads, int64_t hd);
void k_rope_bwd_bf16(const float *dx, uint16_t *y, const float *cos_t, const float *sin_t,
                     int64_t B, int64_t S, int64_t nheads, int64_t hd);

/* ---- Causal grouped-query attention, FlashAttention-2 style ------------ */
/* One block of queries against one block of keys of B sequences (backend.h
 * ml_attn_block, field for field): queries at global positions q_pos ..
 * q_pos+sq−1, keys at k_pos .. k_pos+sk−1; query p sees key p' iff p' <= p
 * and, when window > 0, p' > p − window. q, out, dout, dq: [B][sq rows, nh,
 * hd] with q_bs floats from one sequence to the next; k, v, dk, dv: [B][sk
 * rows, nkv, hd] with k_bs; lse: [B][sq rows, nh] with l_bs. Query head h
 * reads kv head (h + head_off) / group (GQA; group 0 means nh / nkv).
 * scores = scale · q·k. A whole sequence is one block (q_pos = k_pos = 0,
 * sq = sk = S). */
typedef struct k_attn_block {
  int64_t B, sq, sk, nh, nkv, hd;
  int64_t q_pos, k_pos;
  int64_t q_bs, k_bs, l_bs;
  float scale;
  int64_t window;   /* 0: causal only */
  int64_t group;    /* query heads per kv head; 0: nh / nkv */
  int64_t head_off; /* 0 <= head_off < group: this block's first query head's place in its group */
  bool fixed_order; /* batch-invariant forward: each query row computed alone, over key tiles at
                       global positions that are multiples of K_ATTN_TILE_K, its scores and
                       P·V in one fixed order (attention.c fwd_row_fixed), so a query's output
                       and lse are bitwise the same whatever block, batch, packing or KV-cache
                       step computes it; the backward is the same either way. A block of at
                       most K_ATTN_ROWS query rows takes this order in either mode */
  /* Paged keys and values (vLLM's PagedAttention; forward only): NULL, k and v
   * are [B][sk rows, nkv, hd] at k_bs as above. Else k and v are a pool of
   * blocks of kv_block rows, [n_blocks · kv_block rows, nkv, hd], and local
   * key j of sequence b is pool row kv_table[b·table_bs + j / kv_block] ·
   * kv_block + j % kv_block (k_bs unused); kv_bf16: the pool holds bf16
   * (uint16_t) elements, read exactly (else fp32, rounded to bf16 as they
   * are read when the products are bf16: the values the rounded copies of
   * k_attn_bf16 hold). lp's k, v are unused: the kernel reads the pool. */
  const int32_t *kv_table;
  int64_t kv_block, table_bs;
  bool kv_bf16;
  /* out is bf16 (uint16_t, out's layout): the forward stores O / l rounded to
   * nearest-even (ml_f32_to_bf16) instead of the fp32 value, the backward's D
   * reads it widened exactly; accumulate false only (backend.h
   * ml_attn_block.out_bf16) */
  bool out_bf16;
  /* q, k, v are bf16 (uint16_t, their layouts): the caller's backend reads
   * them as the bf16 products' operands (lp's q, k, v point at their
   * head-major copies, bf16 or widened exactly to fp32: k_attn_head_major);
   * unpaged, bf16 products only (backend.h ml_attn_block.qkv_bf16). The
   * kernels read q, k, v through lp alone. */
  bool qkv_bf16;
  /* The backward writes (=) dq, dk, dv instead of adding into them: every
   * element of the block's rows ([B][sq rows] of dq at q_bs, [B][sk rows]
   * of dk, dv at k_bs, every head), the bits of adding into zeros; rows no
   * product reaches (no key seen, no query seeing them, kv heads without
   * query heads in the block) written 0 (backend.h
   * ml_attn_block.bwd_overwrite) */
  bool bwd_overwrite;
} k_attn_block;

/* The tiles: query rows per task (forward, backward pass 1) and per step
 * of a key tile (pass 2); keys per tile. No [S, S] tensor is formed: the
 * forward holds one [TILE_Q, TILE_K] tile of scores per thread at a time,
 * the backward the P and dS tiles of a bounded chunk (K_ATTN_BWD_STORE). */
enum { K_ATTN_TILE_Q = 64, K_ATTN_TILE_K = 128 };

/* The row kernel (attention.c fwd_group_fixed): the batch-invariant
 * forward's, and the default forward's for blocks of at most K_ATTN_ROWS
 * query rows a sequence (decode: one), where per-tile GEMMs of a few rows
 * cost more than they compute. Its tasks take a kv head's query heads
 * together (GQA: each key and value row loaded once for its group), and
 * run on the OpenMP team only for blocks of at least K_ATTN_PAR_MAC
 * multiply-adds (2·B·nh·sq·sk·hd), below which waking the team (~40 µs
 * under OMP_WAIT_POLICY=passive) costs more than the work. Measured with
 * bench/attn_decode.c (AMD EPYC Zen 4, 2 vCPUs under load average ~9, 9
 * query heads over 3 kv heads of 64, sk 512, paged): the row kernel
 * against main's per-tile GEMMs, fp32 / bf16, sq 1 0.059 / 0.051 ms
 * against 0.111 / 0.122, sq 4 0.149 / 0.145 against 0.149 / 0.193, sq 8
 * 0.260 / 0.255 against 0.226 / 0.212 (lost); one thread against two at
 * B 1..8 (up to 4.7 M multiply-adds) one thread as fast or faster in every
 * case (e.g. B 8, sk 512, bf16 0.58 against 1.29 ms), B 16 at sk 192
 * (3.5 M) split between runs: a loaded machine's figure, to be measured
 * again on a quiet one. */
enum { K_ATTN_ROWS = 4 };
#define K_ATTN_PAR_MAC 8388608.0

/* The products on bf16 operands, as torch.autocast(bfloat16) runs SDPA
 * (bf16 inputs, fp32 accumulation, softmax in fp32): q, k, v, the
 * probabilities P and, in the backward, dout and dS = P ⊙ (dP − D) enter
 * every product rounded to bf16 (nearest-even); accumulation, softmax and
 * its backward stay fp32. The caller provides q, k, v, dout rounded, in
 * the layouts of the fp32 tensors, or in their own (the strides below;
 * k_attn_head_major's copies); the kernels round P and dS per tile into
 * their tiles. packed: the operands are bf16 (uint16_t) and the products
 * go to `gemm`; else they are fp32 holding bf16 values and go to sgemm
 * (whose products of such values are exact: the emulation for CPUs
 * without bf16 GEMMs; its value of an element depends on neither lda nor
 * ldc, so the layout does not change the bits: attention.c).
 *
 * Why head-major copies: oneDNN 2.6's brgemm matmul (the AMX and
 * AVX512-BF16 kernels) takes a 2-D operand only in the dense plain or
 * transposed layout (src, weights: format tags ab or ba with the strides
 * dnnl_memory_desc_init_by_tag gives them; dst: ab only; v2.6.3
 * src/cpu/x64/matmul/brgemm_matmul_utils.cpp:206-236 set_or_check_tags,
 * :146-193 set_or_check_B_tag, matched by strides in
 * src/common/type_helpers.hpp:772-803 memory_desc_matches_tag), so a tile
 * of q read nh·hd elements apart falls to its gemm-based matmul. It also
 * refuses small shapes on AMX (M <= 32 with M·N <= 256, or K <= 16:
 * brgemm_matmul_utils.cpp:846-851). With head-major q, k, v, dout every
 * operand of the tiles is dense (ld hd, or the tiles' own n), transposed
 * ones included (P^T, dS^T, K^T: ba is accepted for bf16 src and
 * weights); the outputs: S, dP, O dense; dq and dk (alpha = scale)
 * through the tile GEMM's dense fp32 scratch (backend/cpu/gemm.c
 * ml_cpu_gemm_tile); dk, dv through dense [TILE_K, hd] tiles (attention.c
 * bwd_key_tile). */
typedef struct k_attn_bf16 {
  bool packed;
  const void *q, *k, *v, *dout; /* dout: backward only */
  /* The operands' layout, in elements: q and dout from one sequence to the
   * next (q_bs), one row to the next (q_row), one head to the next
   * (q_head); unpaged k and v likewise (k_*). q_row 0 (k_row 0): the
   * block's layout of the fp32 tensors (q_bs, nh·hd, hd; k_bs, nkv·hd,
   * hd). */
  int64_t q_bs, q_row, q_head, k_bs, k_row, k_head;
  /* C [M, N] = alpha·op(A)·op(B) + beta·C (beta 0 or 1) as cblas_sgemm
   * row-major, on bf16 A, B with fp32 accumulation; called from the
   * kernels' OpenMP threads (thread = omp_get_thread_num()); returns 0, or
   * an error code the kernel passes on */
  int (*gemm)(void *ctx, int thread, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
              float alpha, const void *A, int64_t lda, const void *B, int64_t ldb, float beta,
              float *C, int64_t ldc);
  void *ctx;
} k_attn_bf16;

/* src, B sequences of `rows` rows of `heads` heads of hd elements (row
 * heads·hd elements apart, sequences bs apart; fp32, or bf16 (uint16_t)
 * when src_bf16), into dst head-major, [B][heads][rows][hd] dense: bf16
 * (packed; fp32 rounded to nearest-even, ml_f32_to_bf16; bf16 copied), or
 * fp32 holding the bf16 values (fp32 rounded, bf16 widened exactly): the
 * values of ml_convert_from_f32 / ml_round_bf16 / ml_convert_to_f32, in
 * one pass. The layout k_attn_bf16's strides then name: bs = heads·rows·
 * hd, row = hd, head = rows·hd. Parallel over rows (K_PAR). */
void k_attn_head_major(const void *src, bool src_bf16, int64_t B, int64_t bs, int64_t rows,
                       int64_t heads, int64_t hd, bool packed, void *dst);

/* Floats of the kernels' `tiles` for head size hd with the OpenMP threads
 * of this process: per thread a score and a dS tile, their rounded copies
 * ([TILE_Q, TILE_K] each), the accumulator [TILE_Q, hd] and the row terms
 * (64-byte aligned); INT64_MAX when that does not fit. Independent of the
 * sequence lengths. */
int64_t k_attention_tile_floats(int64_t hd);
/* The softmax attention of the block's queries over its visible keys:
 * out (probability-weighted v) and lse = log sum exp of the visible scores
 * (natural log), fp32 online softmax (running max and sum per row).
 * accumulate false: out, lse (=) the block's; a row that sees no key of
 * the block gets out 0, lse −inf. true: merged into the out and lse there
 * (lse' = log(e^lse + e^lse_b), out' = out·e^(lse−lse') +
 * out_b·e^(lse_b−lse'); an lse of −inf there takes the block's; a row
 * seeing no key of the block is left as it is). Query tiles that see no
 * key are skipped, and so are key tiles no row of a query tile sees.
 * lp: NULL for fp32 products, else bf16 ones (above). tiles:
 * k_attention_tile_floats(hd) floats, 64-byte aligned (no other use while
 * the kernel runs). blk->out_bf16: out points at bf16 elements (accumulate
 * false). Returns 0, or the first error of lp's gemm. */
int k_attention_block_fwd(const k_attn_block *blk, const float *q, const float *k, const float *v,
                          float *out, float *lse, bool accumulate, const k_attn_bf16 *lp,
                          float *tiles);
/* The backward's store (attention.c, the stored tiles): P and dS of each
 * query tile over the keys its rows see, kept by pass 1 for pass 2, about
 * sq·sk/2 (causal) · 2 tiles · 4 bytes per (sequence, head); the block goes
 * in chunks of query tiles that fit the store, so its bytes are bounded:
 * the whole block's when less, else this budget, else (a budget below it)
 * the least a chunk takes, two query tiles' (one kept from the chunk
 * before) of at most K_ATTN_TILE_Q × sk each. 64 MiB: the whole block of
 * SmolLM2-135M's attention (9 heads of 64) at S 512, batch 4 (40.5 MiB, one
 * chunk, every tile pair's task in one parallel loop as before), and at S
 * 2048 three heads a chunk (16.5 MiB each), at a cost next to the
 * activations of a training step of such shapes (hundreds of MiB) that is
 * small; pass 2's tasks are the chunk's (sequence, kv head, key tile)
 * triples, so a larger chunk only adds tasks where there are plenty. */
#define K_ATTN_BWD_STORE ((size_t)64 << 20)
/* Bytes of k_attention_block_bwd's workspace for blk with a store of at
 * most `budget` bytes (K_ATTN_BWD_STORE, or another: a test's 0 forces the
 * smallest chunks, SIZE_MAX one chunk) and at least the least a chunk
 * takes, plus the chunks' offsets and 64 bytes of alignment (the work may
 * have any); SIZE_MAX when it overflows. Depends on the block's geometry
 * (not the pointers, not the threads). */
size_t k_attention_bwd_work(const k_attn_block *blk, size_t budget);
/* dq (+=, or = under blk->bwd_overwrite) [B][sq, nh, hd], dk, dv (+=, =)
 * [B][sk, nkv, hd] (summed over the
 * heads of each group) for this block, given dout and the final out and
 * lse of its queries (after every block of theirs was merged): P =
 * exp(scale·q·k − lse) recomputed, D = rowsum(dout ⊙ out) (fp64, of dout
 * as the products read it), dS = P ⊙ (dout·v^T − D); dq += scale·dS·k,
 * dk += scale·dS^T·q, dv += P^T·dout (FlashAttention-2, Dao 2023,
 * Algorithm 2, without atomics: pass 1 over query tiles (dq) stores P and
 * dS, pass 2 over key tiles (dk, dv) reads them, in chunks of the block
 * bounded by work_bytes). work: work_bytes >= k_attention_bwd_work(blk, 0)
 * bytes (else −1 and nothing done); dq, dk, dv are bitwise the same for
 * any such size and any thread count. lp, tiles, result, blk->out_bf16
 * (out read widened exactly): as forward. */
int k_attention_block_bwd(const k_attn_block *blk, const float *dout, const float *q,
                          const float *k, const float *v, const float *out, const float *lse,
                          float *dq, float *dk, float *dv, const k_attn_bf16 *lp, void *work,
                          size_t work_bytes, float *tiles);

/* Packed documents (FlashAttention-2's flash_attn_varlen_func with
 * cu_seqlens_q = cu_seqlens_k, and FlashAttention-3's seqused for a slot's
 * padded tail; model/varlen.h): n documents laid in the rows of a batch,
 * each attending only to itself. cu [n + 1]: token offsets into the B·S
 * tokens (cu[0] = 0, increasing, cu[n] <= B·S, a slot within one row);
 * used [n]: each slot's document tokens (NULL: the whole slot). Host
 * memory, checked by the caller (ml_varlen_check). */
typedef struct k_attn_docs {
  int64_t n;
  const int64_t *cu, *used;
} k_attn_docs;

/* Every document's attention in one call: blk is the whole batch [B rows
 * of S = sq = sk tokens] (q_pos = k_pos = 0, q_bs = S·nh·hd, k_bs =
 * S·nkv·hd, l_bs = S·nh, unpaged; heads, scale, window, group, head_off,
 * fixed_order, out_bf16, qkv_bf16 as k_attn_block's), lp's copies (if any)
 * of the whole batch. Document d's out and lse are bitwise
 * k_attention_block_fwd's on the block of its tokens alone (B = 1, sq = sk
 * = its length, operands from its first token, accumulate false): its
 * tasks are that block's tasks, run in one parallel region with every
 * other document's (tasks (document, head, query tile), or the row
 * kernel's where that call takes it). A token outside every document
 * attends to nothing: out 0, lse −inf. first: n + 1 int64s of the caller's
 * scratch (each document's first task). Returns 0, or lp's gemm's first
 * error. */
int k_attention_varlen_fwd(const k_attn_block *blk, const k_attn_docs *docs, const float *q,
                           const float *k, const float *v, float *out, float *lse,
                           const k_attn_bf16 *lp, float *tiles, int64_t *first);
/* Bytes of k_attention_varlen_bwd's workspace: the documents' records and
 * item offsets, and a store of min(budget, every document's items) bytes,
 * at least what the largest document alone takes in k_attention_block_bwd
 * (k_attention_bwd_work(its block, 0)); SIZE_MAX on overflow. */
size_t k_attention_varlen_bwd_work(const k_attn_block *blk, const k_attn_docs *docs,
                                   size_t budget);
/* The backward of k_attention_varlen_fwd: dq [B, S, nh, hd], dk, dv [B, S,
 * nkv, hd] (=), document d's rows bitwise k_attention_block_bwd's on its
 * block alone under bwd_overwrite (the same functions on the same tiles);
 * 0 outside the documents. Consecutive documents whose stored tiles fit
 * the store together run as one chunk (one parallel region: pass 1 over
 * their (document, head, query tile) items, pass 2 over their (document,
 * kv head, key tile) pairs); a document that does not fit alone runs
 * alone in k_attention_block_bwd's chunks (bitwise the same for any
 * store). work: work_bytes >= k_attention_varlen_bwd_work(blk, docs, 0)
 * (else −1 and nothing done). Returns 0, −1, or lp's gemm's first error. */
int k_attention_varlen_bwd(const k_attn_block *blk, const k_attn_docs *docs, const float *dout,
                           const float *q, const float *k, const float *v, const float *out,
                           const float *lse, float *dq, float *dk, float *dv,
                           const k_attn_bf16 *lp, void *work, size_t work_bytes, float *tiles);

/* ---- Gated MLP activation: h = act(g) · u (LlamaMLP, Gemma3MLP) -------- */
void k_glu_fwd(const float *g, const float *u, float *h, int64_t n, ml_glu_act act);
/* dg, du (=) given dh and the forward inputs g, u. */
void k_glu_bwd(const float *dh, const float *g, const float *u, float *dg, float *du, int64_t n,
               ml_glu_act act);
/* The same on bf16 g, u (widened exactly; the fp32 expressions of k_glu_fwd,
 * k_glu_bwd, so bitwise those on the widened values): h [n] bf16 (h_bf16,
 * rounded to nearest-even as ml_f32_to_bf16) or fp32; dh fp32; dg, du [n]
 * bf16 (d_bf16, rounded so) or fp32. */
void k_glu_fwd_bf16(const uint16_t *g, const uint16_t *u, void *h, bool h_bf16, int64_t n,
                    ml_glu_act act);
void k_glu_bwd_bf16(const float *dh, const uint16_t *g, const uint16_t *u, void *dg, void *du,
                    bool d_bf16, int64_t n, ml_glu_act act);

/* ---- Embedding (vocab-parallel lookup: Megatron VocabParallelEmbedding) */
/* out[t] = scale · W[ids[t] − row0] if row0 <= ids[t] < row0 + rows, else 0.
 * W: [rows, H] (the rows this rank holds), fp32, or bf16 when w_bf16
 * (widened exactly, scaled in fp32); out: [T, H]. */
void k_embedding_fwd(const int32_t *ids, int64_t T, const void *W, int w_bf16, int64_t row0,
                     int64_t rows, int64_t H, float scale, float *out);
/* dW[ids[t] − row0] (+=) scale · dout[t] for ids in range. */
void k_embedding_bwd(const int32_t *ids, int64_t T, const float *dout, int64_t row0, int64_t rows,
                     int64_t H, float scale, float *dW);

/* ---- Cross-entropy pieces on a vocab shard (Megatron _VocabParallelCrossEntropy)
 * logits: [T, V] the columns v0 .. v0+V−1 of the full vocab; y[t] a global
 * target id or −1 (ignored). The caller all-reduces mx (MAX), then se and tl
 * (SUM) over the vocab shards. */
/* mx[t] = max_j logits[t, j]. */
void k_xent_rowmax(const float *logits, int64_t T, int64_t V, float *mx);
/* se[t] = sum_j exp(logits[t, j] − mx[t]); tl[t] = logits[t, y[t] − v0] − mx[t]
 * when y[t] is in this shard, else 0. */
void k_xent_sumexp_target(const float *logits, int64_t T, int64_t V, int64_t v0, const int32_t *y,
                          const float *mx, float *se, float *tl);
/* Online log-sum-exp over column tiles (the fused classifier): logits [T, V]
 * one tile, the columns v0 .. v0+V−1; before the first tile se = tl = 0 (mx
 * is then not read; after a tile se >= 1, the max's own term). mx[t] = max(mx[t], the tile's max); se[t] = se[t]·exp(old mx −
 * new mx) + sum_j exp(logits[t, j] − mx[t]) (fp64, rounded once per tile);
 * tl[t] = logits[t, y[t] − v0] (raw) where y[t] is in the tile. One tile
 * covering the shard gives k_xent_rowmax's mx and, once rebased onto the
 * same max, k_xent_sumexp_target's se bit for bit. */
void k_xent_online(const float *logits, int64_t T, int64_t V, int64_t v0, const int32_t *y,
                   float *mx, float *se, float *tl);
/* After the tiles and the MAX reduction M [T] of mx over the shards: se[t]
 * ·= exp(mx[t] − M[t]) (fp64, rounded once; unchanged where mx = M);
 * tl[t] = tl[t] − M[t] where y[t] is in this shard's columns v0 .. v0+V−1,
 * else 0 — k_xent_sumexp_target's meaning, ready for the SUM reduction. */
void k_xent_rebase(int64_t T, int64_t V, int64_t v0, const int32_t *y, const float *mx,
                   const float *M, float *se, float *tl);
/* From the reduced se, tl: logprobs[t] = tl[t] − log(se[t]) in fp64 (0
 * where y[t] < 0; logprobs may be NULL), w[t] = scale for targets and 0
 * otherwise; sums[0] −= the log-probs (in token order), sums[1] += the
 * targets. */
void k_xent_logprobs(const float *se, const float *tl, const int32_t *y, int64_t T, float scale,
                     float *logprobs, float *w, double *sums);
/* dlogits[t, j] (=) w[t] · (exp(logits[t, j] − mx[t]) / se[t] − [j == y[t] − v0]).
 * dlogits may alias logits. */
void k_xent_bwd(const float *logits, int64_t T, int64_t V, int64_t v0, const int32_t *y,
                const float *mx, const float *se, const float *w, float *dlogits);
/* Entropy of the softmax over the shards (xent_entropy.c): sl[t] = Σ_j
 * exp(l − m)·(l − m) about a max m, fp64 per call, rounded once to fp32.
 * entropy_sum: about m = mx[t] (the reduced max; logits [T, V] the
 * shard's). entropy_online, called on a tile [T, V] before k_xent_online
 * with its mx, se (se = 0: no tile yet): sl moved onto the new max m =
 * max(mx, the tile's max) — sl·e^d + d·se·e^d, d = mx − m — plus the
 * tile's terms (sl = 0 before the first tile). entropy_rebase, before
 * k_xent_rebase with its mx, M, se: sl = e^d·(sl + d·se), d = mx − M (0
 * where se = 0). entropy: ent[t] = log(se) − sl/se from the reduced se,
 * sl (fp64, rounded once), in nats. */
void k_xent_entropy_sum(const float *logits, int64_t T, int64_t V, const float *mx, float *sl);
void k_xent_entropy_online(const float *logits, int64_t T, int64_t V, const float *mx,
                           const float *se, float *sl);
void k_xent_entropy_rebase(int64_t T, const float *mx, const float *M, const float *se,
                           float *sl);
void k_xent_entropy(const float *se, const float *sl, int64_t T, float *ent);
/* The backward of a loss with an entropy bonus −Σ_t c_t·H_t (c_t = ew[t],
 * the coefficient times the token's normalised weight): dlogits[t, j] (=)
 * w[t]·(p_j − [j == y[t] − v0]) + ew[t]·p_j·(log p_j + H[t]), p_j =
 * exp(l − mx)/se over the reduced mx, se, H the token's entropy (dH/dl_j =
 * −p_j(log p_j + H)); log p_j + H = (l_j − mx) − (log se − H), the bracket
 * in fp64 rounded once per row. dlogits may alias logits. */
void k_xent_bwd_entropy(const float *logits, int64_t T, int64_t V, int64_t v0, const int32_t *y,
                        const float *mx, const float *se, const float *w, const float *H,
                        const float *ew, float *dlogits);
/* Top-k logits per token over the shards (xent_topk.c): val, id [T, k] a
 * list best first (larger logit; equal logits: lower global id), empty
 * entries −inf and id −1. clear: every list empty. online: the columns v0
 * .. v0+V−1 of logits [T, V] merged into the lists (NaNs skipped). merge:
 * val, id (=) the top-k of P candidate lists cval, cid [P, T, k] (an
 * all-gather's layout). logprobs: lp[t, j] = (val − M[t]) − log(se[t]),
 * the subtraction in fp32 then fp64 rounded once (k_xent_logprobs's
 * arithmetic on the same logit), −inf for an empty entry; lp may alias
 * val. */
void k_xent_topk_clear(int64_t T, int64_t k, float *val, int32_t *id);
void k_xent_topk_online(const float *logits, int64_t T, int64_t V, int64_t v0, int64_t k,
                        float *val, int32_t *id);
void k_xent_topk_merge(int64_t P, int64_t T, int64_t k, const float *cval, const int32_t *cid,
                       float *val, int32_t *id);
void k_xent_topk_logprobs(int64_t T, int64_t k, const float *M, const float *se,
                          const float *val, const int32_t *id, float *lp);

/* ---- AdamW (torch.optim.AdamW, single-tensor path) --------------------- */
/* p *= 1 − lr·wd; m = b1·m + (1−b1)·g; v = b2·v + (1−b2)·g²;
 * p −= (lr / (1 − b1^step)) · m / (sqrt(v) / sqrt(1 − b2^step) + eps).
 * step counts from 1. Hyper-parameters are doubles, as torch's Python floats;
 * the scalar factors are formed in double and rounded once to fp32.
 * grad_scale != 1 first sets g *= grad_scale in fp32 (clip_grad_norm_'s
 * in-place scaling, bit for bit k_scale's) in the same pass; 1: g is only
 * read. p_bf16 [n] (uint16_t bf16 bits) or NULL: the updated p rounded to
 * bf16 (ml_f32_to_bf16, torch's round-to-nearest-even: bit for bit what
 * ml_convert_from_f32 would make of p afterwards), stored in the same loop
 * (FSDP's persistent param_dtype shard, parallel/fsdp.h). */
void k_adamw_step(float *p, float *g, float *m, float *v, uint16_t *p_bf16, int64_t n,
                  float grad_scale, double lr, double b1, double b2, double eps, double wd,
                  int64_t step);

/* ---- Vectors ----------------------------------------------------------- */
/* y[n] = expf(x[n]), equal bit for bit to glibc's expf (vectorized on
 * AVX-512, expf.c); y may alias x. */
void k_expf(const float *x, float *y, int64_t n);
/* y[n] += x[n]. */
void k_add(float *y, const float *x, int64_t n);
/* y[n] = (overwrite ? +0 : y[n]) + (round ? fp32(bf16(x[n])) : x[n]): an
 * FSDP unit's reduced gradient into its shard gradient (backend.h
 * ml_be_add_grad), bitwise k_add into zeros (overwrite: y is not read) after
 * ml_round_bf16 of x (round) — but for which payload a NaN + NaN keeps (C
 * leaves a commutative add's operand order to the compiler; a GPU returns
 * its canonical NaN). */
void k_add_grad(float *y, const float *x, int64_t n, bool overwrite, bool round);
/* k_add, and y16[n] = each sum rounded to nearest-even (ml_f32_to_bf16;
 * bitwise k_add then a conversion of y): the residual gradient and the bf16
 * copy o_proj's backward GEMMs read (backend.h ml_be_add_bf16). */
void k_add_bf16(float *y, const float *x, uint16_t *y16, int64_t n);
/* z[n] = y[n] + x[n] (z is y, x or apart from both; bitwise k_add then a
 * copy of y): the residual sum stored where it is saved (backend.h
 * ml_be_add_to). */
void k_add_to(float *z, const float *y, const float *x, int64_t n);
/* z[n] = fp32(bf16(y[n] + x[n])) (z is y, x or apart from both) and, z16
 * non-NULL, z16[n] = bf16(y[n] + x[n]) (nearest-even; bitwise k_add_to then
 * k_round_bf16_to of z in place with z16): the residual sum stored rounded
 * where the next unit reads its bf16-cast input (backend.h
 * ml_be_add_round_to). */
void k_add_round_to(float *z, const float *y, const float *x, uint16_t *z16, int64_t n);
/* y[n] = fp32(bf16(x[n])) (y is x or apart from it) and, y16 non-NULL,
 * y16[n] = bf16(x[n]) (ml_f32_to_bf16, nearest-even; bitwise ml_round_bf16
 * of a copy of x and a conversion of x): a unit's input cast to bf16 with
 * its bf16 copy in one pass (backend.h ml_be_round_bf16_to). */
void k_round_bf16_to(const float *x, float *y, uint16_t *y16, int64_t n);
/* x[n] *= s. */
void k_scale(float *x, int64_t n, float s);
/* max of x[n] (-inf for n = 0; NaNs skipped, as m = x > m ? x : m does),
 * in SIMD lanes: max is exact, so every order gives the same value. */
float k_max(const float *x, int64_t n);
/* sum of x[i]·y[i] over n in fp64 (products exact: fp32 operands), in
 * LANES partial sums (an order R2 covers; vectorized). */
double k_dot_f64(const float *x, const float *y, int64_t n);
/* out[s] (=) for each of the k segments: the sum of g² in fp64 (ML_NORM_SUMSQ)
 * or max |g|, +inf for a NaN (ML_NORM_ABSMAX), of segs[s].g [segs[s].n]. The
 * chunks of 16,384 floats of all segments run in one parallel region (a
 * region per parameter woke the team ~270 times a SmolLM2 step), and each
 * segment's chunk partials are added in chunk order: the same value for
 * any team, 0 for an empty segment. */
void k_norm_partials(const ml_norm_seg *segs, int k, ml_norm_kind kind, double *out);
/* whether any g[n] is NaN or ±inf. */
int k_has_nonfinite(const float *g, int64_t n);
/* db[N] (+=) column sums of dy [T, N] (fp64 accumulation). */
void k_bias_grad(const float *dy, int64_t T, int64_t N, float *db);

#endif
