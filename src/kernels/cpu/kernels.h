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

/* ---- RMSNorm (HF LlamaRMSNorm; Gemma3RMSNorm when w_offset = 1) -------- */
/* rstd[t] = 1/sqrt(mean_h x[t,h]^2 + eps); y[t,h] = x[t,h]·rstd[t]·(w_offset + w[h]).
 * x, y: [T, H]; w: [H]; rstd: [T] saved for backward. y may alias x. */
void k_rmsnorm_fwd(const float *x, const float *w, float w_offset, float eps, float *y, float *rstd,
                   int64_t T, int64_t H);
/* dx[T, H] (=) and dw[H] (+=) given dy[T, H], the forward input x and rstd.
 * dw may be NULL. dx may alias dy. */
void k_rmsnorm_bwd(const float *dy, const float *x, const float *w, float w_offset,
                   const float *rstd, float *dx, float *dw, int64_t T, int64_t H);

/* ---- Rotary position embedding (HF modeling_rope_utils + apply_rotary_pos_emb) */
/* inv_freq[hd/2], computed in fp32 as HF does: 1/theta^(2i/hd), then
 * divided by factor (linear) or rescaled per wavelength (llama3,
 * _compute_llama3_parameters). */
void k_rope_inv_freq(double theta, int64_t hd, const ml_rope_scaling *sc, float *inv_freq);
/* cos/sin tables [S, hd/2]: angle[p, i] = (float)p · inv_freq[i] (fp32). */
void k_rope_tables(const float *inv_freq, int64_t hd, int64_t S, float *cos_t, float *sin_t);
/* In place on x: [B*S, nheads, hd], token row t at position t % S.
 * rotate_half convention: (x1, x2) = halves of each head vector;
 * out = (x1·cos − x2·sin, x2·cos + x1·sin). */
void k_rope_fwd(float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t S,
                int64_t nheads, int64_t hd);
/* In place on dx: the transpose (rotation by −angle). */
void k_rope_bwd(float *dx, const float *cos_t, const float *sin_t, int64_t B, int64_t S,
                int64_t nheads, int64_t hd);

/* ---- Causal grouped-query attention (HF eager_attention_forward) -------- */
/* The products on bf16 operands, as torch.autocast(bfloat16) runs SDPA
 * (bf16 inputs, fp32 accumulation, softmax in fp32): q, k, v, P and, in
 * the backward, dout and dS = P ⊙ (dP − D) enter every product rounded to
 * bf16 (nearest-even); accumulation, softmax and its backward stay fp32.
 * The caller provides q, k, v, dout rounded, in the layouts of the fp32
 * tensors, and room for the rounded P and dS: per thread forward
 * (`scratch`), per head backward (`probs`, `dscores`). packed: the
 * operands are bf16 (uint16_t) and the products go to `gemm`; else they
 * are fp32 holding bf16 values and go to sgemm (whose products of such
 * values are exact: the emulation for CPUs without bf16 GEMMs). */
typedef struct k_attn_bf16 {
  bool packed;
  const void *q, *k, *v, *dout; /* dout: backward only */
  /* C [M, N] = alpha·op(A)·op(B) + beta·C (beta 0 or 1) as cblas_sgemm
   * row-major, on bf16 A, B with fp32 accumulation; called from the
   * kernels' OpenMP threads (thread = omp_get_thread_num()); returns 0, or
   * an error code the kernel passes on */
  int (*gemm)(void *ctx, int thread, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
              float alpha, const void *A, int64_t lda, const void *B, int64_t ldb, float beta,
              float *C, int64_t ldc);
  void *ctx;
  void *scratch;          /* forward: k_attention_bf16_scratch bytes per OpenMP thread */
  void *probs, *dscores;  /* backward: [B, nh, S, S] each, of the operands' type */
} k_attn_bf16;

/* q: [B*S, nh, hd]; k, v: [B*S, nkv, hd]; head h reads kv head h / (nh/nkv).
 * scores = scale · q·k^T; query i sees key j iff j <= i and, when window > 0,
 * j > i − window (HF sliding-window mask); softmax in fp32.
 * out: [B*S, nh, hd]; P: [B, nh, S, S] probabilities saved for backward
 * (masked entries 0). lp: NULL for fp32 products, else bf16 ones (above).
 * Returns 0, or the first error of lp's gemm. */
int k_attention_fwd(const float *q, const float *k, const float *v, float *out, float *P,
                    int64_t B, int64_t S, int64_t nh, int64_t nkv, int64_t hd, float scale,
                    int64_t window, const k_attn_bf16 *lp);
/* dq [B*S, nh, hd], dk, dv [B*S, nkv, hd] (=) given dout and the forward's
 * q, k, v, P (dk/dv sum over the heads of each group). The mask (causal and
 * sliding window) is read from P's exact zeros, so any window of the
 * forward is honoured without repeating it here. lp, result: as forward. */
int k_attention_bwd(const float *dout, const float *q, const float *k, const float *v,
                    const float *P, float *dq, float *dk, float *dv, int64_t B, int64_t S,
                    int64_t nh, int64_t nkv, int64_t hd, float scale, float *work,
                    const k_attn_bf16 *lp);
/* Floats of k_attention_bwd's `work` for these sizes with the OpenMP
 * threads of this process (the row terms D [B, nh, S] and one [128, S]
 * block per thread); INT64_MAX when that does not fit. */
int64_t k_attention_bwd_work(int64_t B, int64_t S, int64_t nh);
/* Bytes of k_attn_bf16.scratch per thread for sequences of S (a
 * [min(S, 128), S] tile of bf16, or of fp32 when not packed). */
size_t k_attention_bf16_scratch(int64_t S, bool packed);

/* ---- Gated MLP activation: h = act(g) · u (LlamaMLP, Gemma3MLP) -------- */
void k_glu_fwd(const float *g, const float *u, float *h, int64_t n, ml_glu_act act);
/* dg, du (=) given dh and the forward inputs g, u. */
void k_glu_bwd(const float *dh, const float *g, const float *u, float *dg, float *du, int64_t n,
               ml_glu_act act);

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
/* From the reduced se, tl: logprobs[t] = tl[t] − log(se[t]) in fp64 (0
 * where y[t] < 0; logprobs may be NULL), w[t] = scale for targets and 0
 * otherwise; *loss_sum −= the log-probs, *count += the targets. */
void k_xent_logprobs(const float *se, const float *tl, const int32_t *y, int64_t T, float scale,
                     float *logprobs, float *w, double *loss_sum, int64_t *count);
/* dlogits[t, j] (=) w[t] · (exp(logits[t, j] − mx[t]) / se[t] − [j == y[t] − v0]).
 * dlogits may alias logits. */
void k_xent_bwd(const float *logits, int64_t T, int64_t V, int64_t v0, const int32_t *y,
                const float *mx, const float *se, const float *w, float *dlogits);

/* ---- AdamW (torch.optim.AdamW, single-tensor path) --------------------- */
/* p *= 1 − lr·wd; m = b1·m + (1−b1)·g; v = b2·v + (1−b2)·g²;
 * p −= (lr / (1 − b1^step)) · m / (sqrt(v) / sqrt(1 − b2^step) + eps).
 * step counts from 1. Hyper-parameters are doubles, as torch's Python floats;
 * the scalar factors are formed in double and rounded once to fp32. */
void k_adamw_step(float *p, const float *g, float *m, float *v, int64_t n, double lr, double b1,
                  double b2, double eps, double wd, int64_t step);

/* ---- Vectors ----------------------------------------------------------- */
/* y[n] = expf(x[n]), equal bit for bit to glibc's expf (vectorized on
 * AVX-512, expf.c); y may alias x. */
void k_expf(const float *x, float *y, int64_t n);
/* y[n] += x[n]. */
void k_add(float *y, const float *x, int64_t n);
/* x[n] *= s. */
void k_scale(float *x, int64_t n, float s);
/* max of x[n] (-inf for n = 0; NaNs skipped, as m = x > m ? x : m does),
 * in SIMD lanes: max is exact, so every order gives the same value. */
float k_max(const float *x, int64_t n);
/* sum of x[i]·y[i] over n in fp64 (products exact: fp32 operands), in
 * LANES partial sums (an order R2 covers; vectorized). */
double k_dot_f64(const float *x, const float *y, int64_t n);
/* sum of g² in fp64; max |g| (+inf for a NaN); whether any g is NaN or ±inf. */
double k_sumsq(const float *g, int64_t n);
double k_absmax(const float *g, int64_t n);
int k_has_nonfinite(const float *g, int64_t n);
/* db[N] (+=) column sums of dy [T, N] (fp64 accumulation). */
void k_bias_grad(const float *dy, int64_t T, int64_t N, float *db);

#endif
