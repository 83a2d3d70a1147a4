/* CUDA kernels: the arithmetic of every decoder module on an NVIDIA GPU,
 * the device counterparts of kernels/cpu/kernels.h (same names without
 * the k_ prefix, same semantics, same shapes); only the CUDA backend
 * (backend/cuda) includes this header. The linear layers' GEMMs are the
 * backend's (cuBLASLt, backend/cuda/gemm.c).
 *
 * Every launcher enqueues its kernels on `st` and returns at once with
 * cudaSuccess or the first launch error (cudaGetLastError() checked right
 * after each launch; kc_failed_kernel() names the kernel); nothing
 * synchronises and nothing allocates: where a kernel needs scratch, a
 * kc_*_work function gives its bytes and the caller passes device memory
 * of that size. Pointers are device memory unless a comment says host.
 * Element types: fp32 `float`; bf16 as uint16_t bits (torch.bfloat16,
 * tensor/dtype.h), read and written as __nv_bfloat16 inside. Math is fp32
 * unless stated (fp64 where the CPU kernel uses fp64). Sizes are int64_t
 * and may exceed 2^31 elements: kernels index with 64-bit offsets.
 *
 * Conventions as the CPU kernels': activations row-major [T, D] with T =
 * B·S tokens; "(=)" overwrites, "(+=)" accumulates. Results are
 * deterministic: no floating-point atomics, every sum in a fixed order
 * for given sizes (run-to-run bitwise reproducible, as the CPU engine). */
#ifndef ML_KERNELS_CUDA_H
#define ML_KERNELS_CUDA_H

#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- element-wise and conversions (elementwise.cu) ---------------------- */
/* dst[n] = bf16(src[n]) round-to-nearest-even, NaN stays NaN (torch .to()). */
cudaError_t kc_f32_to_bf16(cudaStream_t st, const float *src, uint16_t *dst, int64_t n);
/* dst[n] = fp32(src[n]) (exact). */
cudaError_t kc_bf16_to_f32(cudaStream_t st, const uint16_t *src, float *dst, int64_t n);
/* F16 (IEEE half, uint16_t bits) both ways, as the CPU's ml_convert_*. */
cudaError_t kc_f32_to_f16(cudaStream_t st, const float *src, uint16_t *dst, int64_t n);
cudaError_t kc_f16_to_f32(cudaStream_t st, const uint16_t *src, float *dst, int64_t n);
/* x[n] = fp32(bf16(x[n])) in place. */
cudaError_t kc_round_bf16(cudaStream_t st, float *x, int64_t n);
/* y[n] = fp32(bf16(x[n])) (y is x or apart) and, y16 non-NULL, y16 [n]
 * (bf16 bits) = bf16(x[n]): kernels/cpu k_round_bf16_to, backend.h
 * ml_be_round_bf16_to. */
cudaError_t kc_round_bf16_to(cudaStream_t st, const float *x, float *y, void *y16, int64_t n);
/* Row rows[r] of dst [.., width] (bf16: uint16_t, rounded as kc_f32_to_bf16;
 * else fp32) = row r of src [n, width] for r < n (rows distinct, device
 * int32): backend.h ml_be_scatter_rows. n, width < 2^31. */
cudaError_t kc_scatter_rows(cudaStream_t st, void *dst, bool bf16, const int32_t *rows,
                            const float *src, int64_t n, int64_t width);
/* y[n] += x[n]. */
cudaError_t kc_add(cudaStream_t st, float *y, const float *x, int64_t n);
/* The same, and y16 [n] (bf16 bits) = each sum rounded to nearest-even
 * (kc_f32_to_bf16): bitwise kc_add then a conversion of y (kernels/cpu
 * k_add_bf16, backend.h ml_be_add_bf16). */
cudaError_t kc_add_bf16(cudaStream_t st, float *y, const float *x, void *y16, int64_t n);
/* y[n] = (overwrite ? +0 : y[n]) + (round ? fp32(bf16(x[n])) : x[n])
 * (overwrite: y not read): kernels/cpu k_add_grad, backend.h ml_be_add_grad. */
cudaError_t kc_add_grad(cudaStream_t st, float *y, const float *x, int64_t n, bool overwrite,
                        bool round);
/* z[n] = y[n] + x[n] (z is y, x or apart from both): k_add_to, backend.h
 * ml_be_add_to. */
cudaError_t kc_add_to(cudaStream_t st, float *z, const float *y, const float *x, int64_t n);
/* z[n] = fp32(bf16(y[n] + x[n])) (z is y, x or apart from both) and, z16
 * non-NULL, z16 [n] (bf16 bits) = bf16(y[n] + x[n]): kernels/cpu
 * k_add_round_to, backend.h ml_be_add_round_to. */
cudaError_t kc_add_round_to(cudaStream_t st, float *z, const float *y, const float *x, void *z16,
                            int64_t n);
/* x[n] *= s. */
cudaError_t kc_scale(cudaStream_t st, float *x, int64_t n, float s);
/* h[n] = act(g)·u (silu; gelu tanh approximation as torch's
 * gelu(approximate='tanh')). */
cudaError_t kc_glu_fwd(cudaStream_t st, const float *g, const float *u, float *h, int64_t n,
                       ml_glu_act act);
/* dg, du [n] (=) given dh and the forward's g, u. */
cudaError_t kc_glu_bwd(cudaStream_t st, const float *dh, const float *g, const float *u,
                       float *dg, float *du, int64_t n, ml_glu_act act);
/* The same on bf16 g, u [n] (widened exactly): h bf16 (h_bf16, rounded to
 * nearest-even as kc_f32_to_bf16) or fp32; dh fp32; dg, du bf16 (d_bf16,
 * rounded so) or fp32 (kernels/cpu k_glu_fwd_bf16, k_glu_bwd_bf16). */
cudaError_t kc_glu_fwd_bf16(cudaStream_t st, const void *g, const void *u, void *h, bool h_bf16,
                            int64_t n, ml_glu_act act);
cudaError_t kc_glu_bwd_bf16(cudaStream_t st, const float *dh, const void *g, const void *u,
                            void *dg, void *du, bool d_bf16, int64_t n, ml_glu_act act);

/* ---- the GEMM's empty-K case (bias.cu) ----------------------------------- */
/* C[r, :] += bias for the M rows of C [M, N] with row stride ldc. */
cudaError_t kc_add_bias_rows(cudaStream_t st, float *C, int64_t ldc, int64_t M, int64_t N,
                             const float *bias);

/* ---- reductions over rows or whole buffers (reduce.cu) ------------------ */
/* db[N] (+=) sum over the T rows of dy [T, N]; work: kc_bias_grad_work bytes. */
size_t kc_bias_grad_work(int64_t T, int64_t N);
cudaError_t kc_bias_grad(cudaStream_t st, const float *dy, int64_t T, int64_t N, float *db,
                         void *work);
/* out[0] (device double) = sum of g[n]^2 accumulated in fp64; work:
 * kc_reduce_work bytes. */
size_t kc_reduce_work(int64_t n);
cudaError_t kc_sumsq(cudaStream_t st, const float *g, int64_t n, double *out, void *work);
/* out[0] = max |g[n]|, +inf when any is NaN (torch's inf-norm of a NaN). */
cudaError_t kc_absmax(cudaStream_t st, const float *g, int64_t n, double *out, void *work);
/* out[s] (device doubles) = kc_sumsq (absmax 0) or kc_absmax (absmax 1) of
 * g[s] [n[s]] for s < k (g, n: host arrays, read before the call returns;
 * n[s] >= 0), each bitwise that call's result, in one pair of launches per
 * 32 pieces (the grad-norm partials of an FSDP unit's parameters without a
 * launch pair and a stream sync each). work: kc_norm_segs_work(n, k)
 * bytes (0: no piece has elements). */
size_t kc_norm_segs_work(const int64_t *n, int k);
cudaError_t kc_norm_segs(cudaStream_t st, const float *const *g, const int64_t *n, int k,
                         int absmax, double *out, void *work);
/* out[0] (device int) = 1 when g[n] holds a NaN or ±inf, else 0. */
cudaError_t kc_has_nonfinite(cudaStream_t st, const float *g, int64_t n, int *out, void *work);

/* ---- RMSNorm (HF LlamaRMSNorm; Gemma3RMSNorm when offset = 1) (rmsnorm.cu) */
/* rstd[t] = 1/sqrt(mean_h x[t,h]^2 + eps); y[t,h] = x[t,h]·rstd[t]·(offset + w[h]).
 * x, y [T, H] (y may alias x); w [H] fp32 or bf16 (w_bf16); rstd [T]. */
cudaError_t kc_rmsnorm_fwd(cudaStream_t st, const float *x, const void *w, bool w_bf16,
                           float offset, float eps, float *y, float *rstd, int64_t T, int64_t H);
/* The forward fused with the rounding: y [T, H] (bf16 bits) = the fp32 y
 * above rounded to nearest-even (kc_f32_to_bf16), bitwise kc_rmsnorm_fwd
 * then kc_f32_to_bf16; x read only (kernels/cpu k_rmsnorm_fwd_bf16,
 * backend.h ml_be_rmsnorm_fwd_bf16). */
cudaError_t kc_rmsnorm_fwd_bf16(cudaStream_t st, const float *x, const void *w, bool w_bf16,
                                float offset, float eps, void *y, float *rstd, int64_t T,
                                int64_t H);
/* dx [T, H] (=, may alias dy), dw [H] (+=, may be NULL) given dy, x, rstd;
 * work: kc_rmsnorm_bwd_work bytes (the dw partial sums). */
size_t kc_rmsnorm_bwd_work(int64_t T, int64_t H);
cudaError_t kc_rmsnorm_bwd(cudaStream_t st, const float *dy, const float *x, const void *w,
                           bool w_bf16, float offset, const float *rstd, float *dx, float *dw,
                           int64_t T, int64_t H, void *work);

/* ---- RoPE (HF apply_rotary_pos_emb, rotate_half) (rope.cu) -------------- */
/* In place on x [B·S, nheads, hd], row t at position t % S; cos_t, sin_t
 * [S, hd/2] (the backend computes them on the host, as the CPU does).
 * out = (x1·cos − x2·sin, x2·cos + x1·sin); bwd: rotation by −angle. */
cudaError_t kc_rope_fwd(cudaStream_t st, float *x, const float *cos_t, const float *sin_t,
                        int64_t B, int64_t S, int64_t nheads, int64_t hd);
cudaError_t kc_rope_bwd(cudaStream_t st, float *dx, const float *cos_t, const float *sin_t,
                        int64_t B, int64_t S, int64_t nheads, int64_t hd);
/* The forward fused with the rounding: y [B·S, nh, hd] (bf16 bits) = the
 * rotation of x rounded to nearest-even (kc_f32_to_bf16), bitwise
 * kc_rope_fwd then kc_f32_to_bf16; x is read only (kernels/cpu
 * k_rope_fwd_bf16, backend.h ml_be_rope_fwd_bf16). */
cudaError_t kc_rope_fwd_bf16(cudaStream_t st, const float *x, uint16_t *y, const float *cos_t,
                             const float *sin_t, int64_t B, int64_t S, int64_t nheads, int64_t hd);
/* kc_rope_bwd into y [B·S, nheads, hd] bf16 (rounded to nearest-even as
 * kc_f32_to_bf16), dx unchanged (kernels/cpu k_rope_bwd_bf16). */
cudaError_t kc_rope_bwd_bf16(cudaStream_t st, const float *dx, void *y, const float *cos_t,
                             const float *sin_t, int64_t B, int64_t S, int64_t nheads,
                             int64_t hd);

/* ---- Embedding (Megatron VocabParallelEmbedding) (embedding.cu) -------- */
/* out[t] = scale · W[ids[t] − row0] for ids in [row0, row0 + rows), else 0;
 * W [rows, H] fp32 or bf16 (w_bf16, widened exactly, scaled in fp32). */
cudaError_t kc_embedding_fwd(cudaStream_t st, const int32_t *ids, int64_t T, const void *W,
                             bool w_bf16, int64_t row0, int64_t rows, int64_t H, float scale,
                             float *out);
/* dW[ids[t] − row0] (+=) scale · dout[t] for ids in range, the rows of
 * each id summed in token order (deterministic); work:
 * kc_embedding_bwd_work bytes (a sort of the tokens by id). */
size_t kc_embedding_bwd_work(int64_t T);
cudaError_t kc_embedding_bwd(cudaStream_t st, const int32_t *ids, int64_t T, const float *dout,
                             int64_t row0, int64_t rows, int64_t H, float scale, float *dW,
                             void *work);

/* ---- Vocab-parallel cross-entropy pieces (Megatron
 * _VocabParallelCrossEntropy) (xent.cu). logits [T, V] = global columns
 * v0 .. v0+V−1; y [T] global targets or −1. ---------------------------- */
/* mx[t] = max_j logits[t, j]. */
cudaError_t kc_xent_rowmax(cudaStream_t st, const float *logits, int64_t T, int64_t V, float *mx);
/* se[t] = sum_j exp(logits[t,j] − mx[t]); tl[t] = logits[t, y−v0] − mx[t]
 * when y[t] is in this shard, else 0. */
cudaError_t kc_xent_sumexp_target(cudaStream_t st, const float *logits, int64_t T, int64_t V,
                                  int64_t v0, const int32_t *y, const float *mx, float *se,
                                  float *tl);
/* The online log-sum-exp over column tiles (the fused classifier;
 * kernels/cpu/kernels.h k_xent_online / k_xent_rebase give the semantics):
 * online updates the running mx, se (fp64 per tile, rounded once) and the
 * raw target logit tl from one tile [T, V] of columns v0 .. v0+V−1; rebase
 * moves se to the reduced max M and turns tl into tl − M (0 outside the
 * shard's columns v0 .. v0+V−1). */
cudaError_t kc_xent_online(cudaStream_t st, const float *logits, int64_t T, int64_t V, int64_t v0,
                           const int32_t *y, float *mx, float *se, float *tl);
cudaError_t kc_xent_rebase(cudaStream_t st, int64_t T, int64_t V, int64_t v0, const int32_t *y,
                           const float *mx, const float *M, float *se, float *tl);
/* From the reduced se, tl: logprobs[t] = tl − log(se) computed in fp64 and
 * rounded once (0 where y < 0; logprobs may be NULL); w[t] = scale where
 * y[t] >= 0 else 0; sums [2] (device doubles): sums[0] −= the sum of the
 * log-probs, sums[1] += the targets counted — accumulated on the device
 * across calls, read by the caller once; work: kc_xent_logprobs_work bytes. */
size_t kc_xent_logprobs_work(int64_t T);
cudaError_t kc_xent_logprobs(cudaStream_t st, const float *se, const float *tl, const int32_t *y,
                             int64_t T, float scale, float *logprobs, float *w, double *sums,
                             void *work);
/* dlogits [T, V] (=, may alias logits) = w[t]·(exp(logits − mx)/se − onehot). */
cudaError_t kc_xent_bwd(cudaStream_t st, const float *logits, int64_t T, int64_t V, int64_t v0,
                        const int32_t *y, const float *mx, const float *se, const float *w,
                        float *dlogits);
/* Entropy pieces over the shards and tiles (kernels/cpu/kernels.h
 * k_xent_entropy_* give the semantics): sl about the reduced max (sum) or
 * the running one (online, before kc_xent_online), moved onto the reduced
 * max (rebase, before kc_xent_rebase), ent = log(se) − sl/se. */
cudaError_t kc_xent_entropy_sum(cudaStream_t st, const float *logits, int64_t T, int64_t V,
                                const float *mx, float *sl);
cudaError_t kc_xent_entropy_online(cudaStream_t st, const float *logits, int64_t T, int64_t V,
                                   const float *mx, const float *se, float *sl);
cudaError_t kc_xent_entropy_rebase(cudaStream_t st, int64_t T, const float *mx, const float *M,
                                   const float *se, float *sl);
cudaError_t kc_xent_entropy(cudaStream_t st, const float *se, const float *sl, int64_t T,
                            float *ent);
/* The entropy bonus's backward (k_xent_bwd_entropy): dlogits (=, may alias
 * logits) = w·(softmax − onehot) + ew·p·(log p + H). */
cudaError_t kc_xent_bwd_entropy(cudaStream_t st, const float *logits, int64_t T, int64_t V,
                                int64_t v0, const int32_t *y, const float *mx, const float *se,
                                const float *w, const float *H, const float *ew,
                                float *dlogits);
/* Top-k logits per token over the shards and tiles (kernels/cpu/kernels.h
 * k_xent_topk_* give the semantics): lists val, id [T, k] cleared, a
 * tile's columns merged in, P gathered lists [P, T, k] merged, log-probs. */
cudaError_t kc_xent_topk_clear(cudaStream_t st, int64_t T, int64_t k, float *val, int32_t *id);
cudaError_t kc_xent_topk_online(cudaStream_t st, const float *logits, int64_t T, int64_t V,
                                int64_t v0, int64_t k, float *val, int32_t *id);
cudaError_t kc_xent_topk_merge(cudaStream_t st, int64_t P, int64_t T, int64_t k,
                               const float *cval, const int32_t *cid, float *val, int32_t *id);
cudaError_t kc_xent_topk_logprobs(cudaStream_t st, int64_t T, int64_t k, const float *M,
                                  const float *se, const float *val, const int32_t *id,
                                  float *lp);

/* ---- AdamW (torch.optim.AdamW, single-tensor, fp32 state) (adamw.cu) --- */
/* One step on p, m, v [n] with g, in one launch; the bias corrections are
 * computed in fp64 on the host side of the launcher, as the CPU kernel.
 * grad_scale != 1: g *= grad_scale first (kc_scale's product, stored), in
 * the same launch. p_bf16 [n] or NULL: the updated p rounded to bf16
 * (kc_f32_to_bf16, bit for bit the CPU's ml_f32_to_bf16), in the same
 * launch. */
cudaError_t kc_adamw(cudaStream_t st, float *p, float *g, float *m, float *v, uint16_t *p_bf16,
                     int64_t n, float grad_scale, double lr, double b1, double b2, double eps,
                     double wd, int64_t step);

/* ---- Attention (attention.cu): causal GQA, flash-style (FlashAttention-2:
 * tiles of queries × keys in shared memory, running max and sum, no
 * [S, S] tensor in device memory). q [B·S, nh, hd]; k, v [B·S, nkv, hd];
 * head h reads kv head h / (nh / nkv); query i sees key j iff j <= i and,
 * when window > 0, j > i − window; scores = scale · q·k^T; softmax in
 * fp32. bf16: q, k, v, P and (backward) dout, dS enter every product
 * rounded to bf16 with fp32 accumulation (SDPA under autocast(bfloat16)),
 * as the CPU kernel's lp path; else fp32 products. hd a multiple of 8 from
 * 8 to 256, nh a multiple of nkv, S < 2^30, q, k, v, out (backward: dout,
 * dq, dk, dv too) and, in bf16, `stage` 16-byte aligned; else
 * cudaErrorInvalidValue before any launch (kc_failed_kernel() NULL).
 * bf16 `stage`: kc_attention_stage_bytes of scratch (device) that receives
 * the bf16 copies of q, k, v (and dout) the tiles are copied from (cp.async,
 * double-buffered); free to reuse once the call's kernels have run (stream
 * order); unused (may be NULL) in fp32. */
/* Bytes of `stage` for bf16: q [B·S, nh, hd], k, v [B·S, nkv, hd] and, when
 * `dout` (the backward), dout [B·S, nh, hd], in bf16; SIZE_MAX when a size is
 * negative or the product overflows. */
size_t kc_attention_stage_bytes(int64_t B, int64_t S, int64_t nh, int64_t nkv, int64_t hd,
                                bool dout);
/* out [B·S, nh, hd]; lse [B, nh, S] (fp32 log-sum-exp of each query's
 * scaled scores) saved for the backward. */
cudaError_t kc_attention_fwd(cudaStream_t st, const float *q, const float *k, const float *v,
                             float *out, float *lse, int64_t B, int64_t S, int64_t nh,
                             int64_t nkv, int64_t hd, float scale, int64_t window, bool bf16,
                             void *stage);
/* dq [B·S, nh, hd], dk, dv [B·S, nkv, hd] (=) given dout and the forward's
 * q, k, v, out, lse (probabilities recomputed tile by tile; dk, dv summed
 * over each group's heads in a fixed order); work: kc_attention_bwd_work
 * bytes (D = rowsum(dout ⊙ out) [B, nh, S] fp32; nkv, hd do not change it). */
size_t kc_attention_bwd_work(int64_t B, int64_t S, int64_t nh, int64_t nkv, int64_t hd);
cudaError_t kc_attention_bwd(cudaStream_t st, const float *dout, const float *q, const float *k,
                             const float *v, const float *out, const float *lse, float *dq,
                             float *dk, float *dv, int64_t B, int64_t S, int64_t nh, int64_t nkv,
                             int64_t hd, float scale, int64_t window, bool bf16, void *work,
                             void *stage);

/* ---- Block attention (attention.cu, the same kernels): ring attention's
 * blocks (context parallelism), packed documents, a tp rank whose query
 * heads start inside a kv group, and generation's paged KV cache —
 * backend.h ml_attn_block's semantics and layouts, field for field: sq
 * query rows at global positions q_pos.. against sk key rows at k_pos..
 * of each of B sequences; query p sees key p' iff p' <= p and, with a
 * window, p' > p − window; q, out, dout, dq [B][sq rows, nh, hd] q_bs
 * floats apart; k, v, dk, dv [B][sk rows, nkv, hd] k_bs apart; lse
 * [B][sq rows, nh] l_bs apart; query head h reads kv head (h + head_off) /
 * group (group 0: nh / nkv). Paged keys (kv_table, device int32; forward
 * only): k and v are the pool [n_blocks · kv_block rows, nkv, hd], fp32 or
 * (kv_bf16) bf16, key j of sequence b its row kv_table[b · table_bs + j /
 * kv_block] · kv_block + j % kv_block. Sizes: hd as kc_attention_fwd's;
 * sq, sk, |q_pos|, |k_pos| < 2^30; the sequences' strides at least their
 * rows; else cudaErrorInvalidValue before any launch. */
typedef struct kc_attn_block {
  int64_t B, sq, sk, nh, nkv, hd;
  int64_t q_pos, k_pos;
  int64_t q_bs, k_bs, l_bs;
  float scale;
  int64_t window, group, head_off;
  const int32_t *kv_table;
  int64_t kv_block, table_bs;
  bool kv_bf16;
  bool out_bf16; /* out is bf16: written rounded to nearest-even, read exactly (backend.h
                    ml_attn_block.out_bf16; bf16 products, accumulate false) */
  bool qkv_bf16; /* q, k, v are bf16 (uint16_t, their layouts): the tiles copy them in place,
                    nothing staged but dout (backend.h ml_attn_block.qkv_bf16; bf16 products,
                    unpaged; B > 1: q compact, q_bs = sq·nh·hd, and k_bs a multiple of
                    8; else cudaErrorInvalidValue) */
  bool bwd_overwrite; /* the backward writes dq, dk, dv (=) instead of adding (backend.h
                         ml_attn_block.bwd_overwrite) */
} kc_attn_block;
/* Bytes of `stage` (device scratch, 16-byte aligned; free to reuse once
 * the call's kernels have run): bf16, the rows of q, k, v (and, `dout`, of
 * dout) gathered compact in bf16 (with qkv_bf16 dout's alone); fp32 with
 * paged keys, k and v gathered in fp32; else 0 (stage unused, may be
 * NULL). SIZE_MAX on overflow. */
size_t kc_attention_block_stage_bytes(const kc_attn_block *blk, bool bf16, bool dout);
/* The block's softmax attention: accumulate false, out and lse (=) the
 * block's (a row that sees no key: out 0, lse −inf); true, merged into the
 * out and lse there as the attention over the union of their keys and the
 * block's (lse' = log(e^lse + e^lse_b), out' = out·e^(lse−lse') +
 * out_b·e^(lse_b−lse')). Products as kc_attention_fwd's (bf16: every
 * operand rounded to bf16, fp32 accumulation). blk->out_bf16: out is bf16
 * (cudaErrorInvalidValue unless bf16 and not accumulate). */
cudaError_t kc_attention_block_fwd(cudaStream_t st, const kc_attn_block *blk, const float *q,
                                   const float *k, const float *v, float *out, float *lse,
                                   bool accumulate, bool bf16, void *stage);
/* Bytes of the backward's work: D [B, nh, sq] fp32. */
size_t kc_attention_block_work(const kc_attn_block *blk);
/* dq, dk, dv (+=; = under blk->bwd_overwrite) of the block for the final out and lse of its queries
 * (every block merged): P = exp(scale·q·k − lse), D = rowsum(dout ⊙ out),
 * as kc_attention_bwd (a bf16 out, blk->out_bf16, read exactly; bf16
 * only); paged keys refused. */
cudaError_t kc_attention_block_bwd(cudaStream_t st, const kc_attn_block *blk, const float *dout,
                                   const float *q, const float *k, const float *v,
                                   const float *out, const float *lse, float *dq, float *dk,
                                   float *dv, bool bf16, void *work, void *stage);

/* ---- launch errors (launch.cu) ------------------------------------------ */
/* The name of the kernel whose launch returned the last error a launcher
 * above gave this host thread (cleared by the call), or NULL when its error
 * came from elsewhere (an argument refused before any launch). */
const char *kc_failed_kernel(void);

#ifdef __cplusplus
}
#endif

#endif
