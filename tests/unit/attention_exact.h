/* The former CPU attention kernel (eager attention storing P [B, nh, S, S]),
 * kept in the tests as a reference for the FlashAttention-2 kernel that
 * replaced it (attention_exact.c; compiled into test_kernels only). */
#ifndef ML_TEST_ATTENTION_EXACT_H
#define ML_TEST_ATTENTION_EXACT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The products on bf16 operands (as the former k_attn_bf16): q, k, v,
 * dout rounded by the caller in the layouts of the fp32 tensors; P and dS
 * rounded by the kernel into `scratch` (forward: eager_attention_bf16_scratch
 * bytes per OpenMP thread) and `probs`, `dscores` (backward: [B, nh, S, S]
 * each, of the operands' type). packed: the operands are bf16 (uint16_t)
 * and the products go to `gemm`; else fp32 holding bf16 values, on sgemm. */
typedef struct eager_bf16 {
  bool packed;
  const void *q, *k, *v, *dout;
  int (*gemm)(void *ctx, int thread, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
              float alpha, const void *A, int64_t lda, const void *B, int64_t ldb, float beta,
              float *C, int64_t ldc);
  void *ctx;
  void *scratch;
  void *probs, *dscores;
} eager_bf16;

/* q: [B*S, nh, hd]; k, v: [B*S, nkv, hd]; head h reads kv head h / (nh/nkv).
 * Query i sees key j iff j <= i and, when window > 0, j > i − window.
 * out: [B*S, nh, hd]; P: [B, nh, S, S] (masked entries 0). lp: NULL for
 * fp32 products. Returns 0, or the first error of lp's gemm. */
int eager_attention_fwd(const float *q, const float *k, const float *v, float *out, float *P,
                        int64_t B, int64_t S, int64_t nh, int64_t nkv, int64_t hd, float scale,
                        int64_t window, const eager_bf16 *lp);
/* dq, dk, dv (=) given dout and the forward's q, k, v, P; the mask is read
 * from P's zeros. work: eager_attention_bwd_work floats. */
int eager_attention_bwd(const float *dout, const float *q, const float *k, const float *v,
                        const float *P, float *dq, float *dk, float *dv, int64_t B, int64_t S,
                        int64_t nh, int64_t nkv, int64_t hd, float scale, float *work,
                        const eager_bf16 *lp);
int64_t eager_attention_bwd_work(int64_t B, int64_t S, int64_t nh);
size_t eager_attention_bf16_scratch(int64_t S, bool packed);

#endif
