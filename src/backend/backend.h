/* The compute + memory backend: the one seam between the engine (model/,
 * parallel/, engine/) and a device (ARCHITECTURE.md §12). The engine is written once
 * against these calls; devices differ only behind the vtable. ggml's
 * ggml_backend_i + ggml_backend_buffer_i are the model: a small vtable of
 * memory, ordering and operators, dispatched by thin ml_be_* wrappers.
 *
 * Memory. "Device" memory (ml_be_alloc) is where tensors live and kernels
 * run: host memory on the CPU backend, cudaMalloc'd memory on CUDA. It
 * comes from a caching pool (backend/pool.h): a block freed is kept for the
 * next request of its size class, so a training step allocates nothing
 * from the system after the first (torch's CUDACachingAllocator). Host
 * staging memory (ml_be_host_alloc: pinned on CUDA) carries data between
 * files / the host and the device, with ml_be_copy. Pointers into device
 * memory may be offset like any C pointer; only the backend dereferences
 * them.
 *
 * Ordering. Every operator is issued on the backend's compute stream, in
 * order; ml_be_event_record / ml_be_event_wait order it against other
 * streams (a communication stream: comm/comm.h), and ml_be_sync waits for
 * all issued work. Results a call returns to the host (a loss sum, a norm
 * partial) are complete when it returns. On the CPU backend every call is
 * synchronous and events are complete when recorded.
 *
 * Operators are forward/backward pairs with the conventions of the CPU
 * kernels (kernels/cpu/kernels.h, the fp32 reference): activations
 * row-major [T, D] with T = B·S tokens; "(=)" overwrites, "(+=)"
 * accumulates (gradients of parameters used several times add up). Every
 * operator returns 0, or −1 with a message (common/status.h) when the
 * device reports an error, an argument is outside what it supports, or the
 * backend does not implement the operator (ml_op: ml_be_supports says which
 * it does; a sizing call of one it lacks returns 0). */
#ifndef ML_BACKEND_H
#define ML_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/types.h"
#include "tensor/dtype.h"

typedef struct ml_backend ml_backend;

/* Which memories a copy connects. */
typedef enum { ML_COPY_H2D, ML_COPY_D2H, ML_COPY_D2D } ml_copy_kind;

/* A point in the compute stream (cudaEvent_t on CUDA). */
typedef struct ml_event {
  void *impl;
} ml_event;

/* One matrix product C (=|+=) op(A) · op(B) (+ bias), the GEMM of every
 * linear layer forward and backward (cublasLtMatmul's shape of call).
 * Row-major operands: A is [M, K] with row stride lda (>= K), or, when
 * trans_a, op(A) = A^T with A stored [K, M] (lda >= M); B likewise [K, N]
 * (ldb >= N) or, when trans_b, [N, K] (ldb >= K). C is fp32 [M, N] (ldc >=
 * N). Products accumulate in fp32. compute = ML_F32: fp32 operands;
 * compute = ML_BF16: every operand rounded to bf16 first (nearest-even, as
 * torch.autocast casts a linear's inputs), fp32 operands converted by the
 * backend, bf16 ones read as they are — the GEMM autocast(bfloat16) runs.
 * C is fp32, or with c_bf16 bf16 [M, N] (ldc in elements): the fp32
 * accumulator plus the bias (in fp32) rounded once to nearest-even, bitwise
 * the fp32 output converted by ml_convert_from_f32 — torch's bf16 matmul
 * under autocast, whose output is bf16 (cublasLt/oneDNN with a bf16 D). A
 * zero-initialised ml_gemm has fp32 C. */
typedef struct ml_gemm {
  bool trans_a, trans_b;
  int64_t M, N, K;
  const void *A;
  ml_dtype a_type; /* ML_F32 or ML_BF16 */
  int64_t lda;
  const void *B;
  ml_dtype b_type;
  int64_t ldb;
  void *C;          /* float [M, ldc], or uint16_t (bf16) [M, ldc] when c_bf16 */
  int64_t ldc;
  bool accumulate;  /* C += op(A)·op(B) instead of C = */
  const void *bias; /* [N] added to every row (in fp32), or NULL */
  ml_dtype bias_type;
  ml_dtype compute; /* ML_F32 or ML_BF16 */
  bool c_bf16;      /* C holds bf16 (refused with accumulate) */
  /* a_exact, b_exact: a hint that this fp32 operand of a bf16 GEMM (a_type
   * or b_type ML_F32, compute ML_BF16) already holds bf16 values:
   * fp32(bf16(x)) == x for every element of op(A) [M, K] / op(B) [K, N],
   * as ml_be_round_bf16, ml_be_round_bf16_to and ml_be_add_round_to leave
   * them. The caller guarantees it (each call site names the producer that
   * rounded the operand). It changes no value: rounding such an operand is
   * the identity, so C is bitwise the unflagged GEMM's. It saves the
   * rounding: where the backend reads the operand as fp32 (the CPU's
   * emulation without a bf16 matmul, ml_be_gemm_exact_in_place; the CPU's
   * fixed-order kernel, backend/cpu/gemm.c) it is read in place, with no
   * rounded copy and no temporary; where it needs bf16 storage (oneDNN's
   * bf16 matmul, cuBLASLt) it is converted as any fp32 operand. Ignored for
   * a bf16 operand and in an fp32 GEMM. A flag that lies: the CPU then
   * computes with the unrounded values where it reads them in place (the
   * fp32 products of those values), and rounds them elsewhere — the result
   * is no longer defined by the dtypes alone. */
  bool a_exact, b_exact;
} ml_gemm;

/* The most pool blocks one ml_be_gemm call takes for its temporaries
 * (ml_be_gemm_temp_blocks). */
enum { ML_GEMM_TEMP_BLOCKS = 4 };
/* The most pool blocks an attention call takes for itself and gives back
 * (ml_be_attention_temp_blocks). */
enum { ML_ATTN_TEMP_BLOCKS = 4 };

/* Device memory of a backend's pool in bytes, as torch.cuda's
 * memory_allocated / max_memory_allocated / memory_reserved count it:
 * in_use, the bytes requested by live ml_be_alloc blocks (before the pool
 * rounds them to a size class; host memory is not counted); peak, the
 * largest in_use since the backend was made or ml_be_reset_peak; reserved,
 * what the pool holds from the device (in use or cached). host_in_use and
 * host_peak count the host pool (ml_be_host_alloc: staging, and the shards
 * FSDP's cpu_offload keeps there) the same way (0 where host memory is not
 * pooled: meta). raw_allocs and host_raw_allocs count the blocks each pool
 * has taken from the system (malloc, cudaMalloc, cudaMallocHost) since the
 * backend was made (ml_pool_stats): unchanged over a steady-state training
 * step, whose buffers the pools keep. */
typedef struct ml_memory_stats {
  size_t in_use, peak, reserved;
  size_t host_in_use, host_peak;
  uint64_t raw_allocs, host_raw_allocs;
} ml_memory_stats;

/* One block of attention between a run of queries and a run of keys of
 * the same B sequences (ml_be_attention_block_fwd): the pieces context
 * parallelism's ring attention computes (parallel/cp.h). Queries are at
 * global positions q_pos .. q_pos+sq−1, keys at k_pos .. k_pos+sk−1; query
 * p sees key p' iff p' <= p and, when window > 0, p' > p − window (HF's
 * causal and sliding-window masks on global positions). Layouts: q, out,
 * dout, dq [B][sq rows, nh, hd] with q_bs floats from one sequence's first
 * row to the next's (rows of one sequence consecutive, nh·hd floats each);
 * k, v, dk, dv [B][sk rows, nkv, hd] with k_bs; lse [B][sq rows, nh] with
 * l_bs. Query head h reads key/value head (h + head_off) / group (GQA;
 * group 0 means nh / nkv, head_off 0): a tensor-parallel rank whose query
 * heads start inside a kv group (tp not dividing the heads, parallel/tp.h)
 * holds nh local query heads starting head_off heads into the group of its
 * first local kv head. */
typedef struct ml_attn_block {
  int64_t B, sq, sk, nh, nkv, hd;
  int64_t q_pos, k_pos;
  int64_t q_bs, k_bs, l_bs;
  float scale;      /* scores = scale · q·k */
  int64_t window;   /* 0: causal only */
  int64_t group;    /* query heads per key/value head; 0: nh / nkv */
  int64_t head_off; /* in [0, group) */
  /* Paged keys and values, forward only (vLLM's PagedAttention; the KV cache
   * of engine/kvcache.h): kv_table NULL: k, v as above. Else k and v are a
   * pool of blocks of kv_block rows [n_blocks · kv_block rows, nkv, hd]
   * (device), and key j (0 .. sk−1) of sequence b is pool row
   * kv_table[b · table_bs + j / kv_block] · kv_block + j % kv_block
   * (kv_table: device int32, the sequences' block tables at table_bs
   * entries apart; k_bs unused). kv_bf16: the pool holds bf16 elements
   * (k, v point at uint16_t), read exactly; else fp32, which bf16 products
   * read rounded to bf16, as they read unpaged keys. The reductions are
   * those of unpaged keys of the same values: a query's out and lse are
   * bitwise the same, paged or not, in the batch-invariant mode (the fixed
   * order). The backward refuses paged blocks. */
  const int32_t *kv_table;
  int64_t kv_block, table_bs;
  bool kv_bf16;
  /* out is bf16 (out points at uint16_t, the same layout and q_bs): the
   * forward writes each row's O / l rounded to nearest-even once, in its
   * final normalisation's store (the values of its fp32 out rounded as
   * ml_be_convert rounds); the backward reads it exactly for D =
   * rowsum(dout ⊙ out), as FlashAttention-2 run in bf16 reads its bf16
   * out. torch.autocast saves SDPA's bf16 output, the input of o_proj's
   * bf16 GEMM, and nothing else. Needs compute ML_BF16 and, forward,
   * accumulate false (a merge needs the fp32 out). */
  bool out_bf16;
  /* q, k, v are bf16 (they point at uint16_t, the same layouts, q_bs and
   * k_bs in elements): the values every bf16 product reads, read exactly,
   * so no call rounds them again — torch.autocast's SDPA reads the bf16
   * outputs of q/k/v_proj (after RoPE) the same way. The results are
   * bitwise those of fp32 q, k, v holding these values. Needs compute
   * ML_BF16 and unpaged keys (kv_table NULL); dq, dk, dv stay fp32. */
  bool qkv_bf16;
  /* The backward writes (=) dq, dk, dv instead of adding into them (+=):
   * every element of the block's rows — dq's [B][sq rows, nh, hd] at q_bs,
   * dk's and dv's [B][sk rows, nkv, hd] at k_bs — holds bitwise what adding
   * into zeros gives (+0 where that gives +0), rows no product reaches (a
   * query that sees no key, a key no query sees under causality or the
   * window, a kv head none of the block's query heads reads) 0; nothing
   * outside those rows is touched. FlashAttention-2's backward (Dao 2023,
   * Algorithm 2) writes dQ, dK, dV so; the steps of ring attention, whose
   * blocks share outputs, add. The caller's zeroing pass is then not needed
   * for the first (or only) block writing an output. */
  bool bwd_overwrite;
} ml_attn_block;

/* Packed documents (FlashAttention-2's flash_attn_varlen_func with
 * cu_seqlens_q = cu_seqlens_k; FlashAttention-3's seqused_q = seqused_k
 * for a slot's padded tail): documents laid end to end in the rows of one
 * batch, each attending only to itself (model/varlen.h, whose checked
 * documents these are). blk: the whole batch as one block, B rows of S
 * tokens: sq = sk = S, q_pos = k_pos = 0, q_bs = S·nh·hd, k_bs = S·nkv·hd,
 * l_bs = S·nh; nh, nkv, hd, scale, window, group, head_off, out_bf16,
 * qkv_bf16 as ml_attn_block's; no kv_table; bwd_overwrite ignored (the
 * backward writes, =). */
typedef struct ml_attn_varlen {
  ml_attn_block blk;
  int64_t ndocs;       /* >= 0 */
  const int64_t *cu;   /* [ndocs + 1] token offsets into the B·S tokens (cu_seqlens), host */
  const int64_t *used; /* [ndocs] tokens of each slot that are the document; NULL: all, host */
} ml_attn_varlen;

/* The operators of the seam, by family (a family's forward, backward and
 * sizing calls together), as ggml_backend_supports_op asks of a ggml
 * backend: each backend declares the ones it implements
 * (ml_backend_ops.supports), ml_be_supports answers, and an ml_be_* call
 * of one it lacks fails with a message naming it, never reaching an empty
 * slot. Memory and ordering calls are on every backend. The CPU and meta
 * backends implement every operator; CUDA all but ML_OP_BATCH_INVARIANT and
 * ML_OP_ATTENTION_VARLEN. */
typedef enum ml_op {
  ML_OP_GEMM,            /* ml_be_gemm */
  ML_OP_BIAS_GRAD,       /* ml_be_bias_grad */
  ML_OP_ADD,             /* ml_be_add / _bf16 / _grad / _to / _round_to */
  ML_OP_SCALE,           /* ml_be_scale */
  ML_OP_RMSNORM,         /* ml_be_rmsnorm_fwd / _fwd_bf16 / _bwd */
  ML_OP_ROPE,            /* ml_be_rope_tables / _fwd / _bwd */
  ML_OP_ATTENTION,       /* ml_be_attention_saved / _work / _fwd / _bwd */
  ML_OP_ATTENTION_BLOCK, /* ml_be_attention_block_fwd / _work / _bwd: context
                          * parallelism, a tp size that does not divide the
                          * heads, packed documents (model/varlen.h), the KV
                          * cache of generation (engine/generate.h) */
  ML_OP_ATTENTION_VARLEN, /* ml_be_attention_varlen_fwd / _work / _bwd: packed
                           * documents in one call (model/varlen.h; without
                           * it varlen runs a block per document) */
  ML_OP_GLU,             /* ml_be_glu_fwd / _bwd */
  ML_OP_EMBEDDING,       /* ml_be_embedding_fwd / _bwd */
  ML_OP_XENT,            /* ml_be_xent_rowmax / _sumexp_target / _online / _rebase / _logprobs / _bwd */
  ML_OP_ADAMW,           /* ml_be_adamw */
  ML_OP_NORM_PARTIAL,    /* ml_be_norm_partial, ml_be_norm_partials */
  ML_OP_FIND_NONFINITE,  /* ml_be_find_nonfinite */
  ML_OP_ENTROPY,         /* ml_be_xent_entropy_sum / _online / _rebase, ml_be_xent_entropy,
                          * ml_be_xent_bwd_entropy */
  ML_OP_TOPK,            /* ml_be_xent_topk_clear / _online / _merge / _logprobs */
  ML_OP_BATCH_INVARIANT, /* ml_be_set_batch_invariant: the CPU's (meta: nothing to do) */
  ML_OP_COUNT
} ml_op;

/* The bit of op in ml_backend_ops.supports, and the set of every op. */
#define ML_OP_BIT(op) (UINT32_C(1) << (op))
#define ML_OPS_ALL (ML_OP_BIT(ML_OP_COUNT) - 1)

typedef struct ml_backend_ops {
  const char *name;  /* "cpu" */
  bool host_memory;  /* its device memory is host memory (ml_be_host_memory) */
  uint32_t supports; /* ML_OP_BIT of each operator it implements; their slots
                      * are set, the others' may be NULL (ml_be_supports) */
  /* memory: bytes from the pool, NULL when there are not (no message) */
  void *(*alloc)(ml_backend *be, size_t bytes);
  void (*free)(ml_backend *be, void *p);
  void *(*host_alloc)(ml_backend *be, size_t bytes);
  void (*host_free)(ml_backend *be, void *p);
  int (*copy)(ml_backend *be, void *dst, const void *src, size_t bytes, ml_copy_kind kind);
  int (*copy_async)(ml_backend *be, void *dst, const void *src, size_t bytes,
                    ml_copy_kind kind);
  int (*zero)(ml_backend *be, void *dst, size_t bytes);
  int (*copy2d)(ml_backend *be, void *dst, size_t dpitch, const void *src, size_t spitch,
                size_t width, size_t rows);
  int (*convert)(ml_backend *be, void *dst, ml_dtype dst_type, const void *src, ml_dtype src_type,
                 size_t n);
  int (*round_bf16)(ml_backend *be, float *x, size_t n);
  int (*round_bf16_to)(ml_backend *be, const float *x, float *y, void *y16, size_t n);
  int (*scatter_rows)(ml_backend *be, void *dst, ml_dtype dst_type, const int32_t *rows,
                      const float *src, int64_t n, int64_t width);
  void (*trim)(ml_backend *be);
  void (*memory_stats)(ml_backend *be, ml_memory_stats *out);
  void (*reset_peak)(ml_backend *be);
  /* ordering */
  int (*event_record)(ml_backend *be, ml_event *ev);
  int (*event_wait)(ml_backend *be, ml_event *ev);
  int (*event_sync)(ml_backend *be, ml_event *ev);
  int (*sync)(ml_backend *be);
  /* the backend computing on its host memory (ml_be_host_peer) */
  int (*host_peer)(ml_backend *be, ml_backend **out);
  /* operators */
  int (*gemm)(ml_backend *be, const ml_gemm *g);
  int64_t (*gemm_temp)(ml_backend *be, const ml_gemm *g); /* NULL: 0 */
  /* NULL: gemm_temp's bytes as one block */
  int (*gemm_temp_blocks)(ml_backend *be, const ml_gemm *g, int64_t bytes[ML_GEMM_TEMP_BLOCKS]);
  bool (*gemm_exact_in_place)(ml_backend *be); /* NULL: false */
  int (*bias_grad)(ml_backend *be, const float *dy, int64_t T, int64_t N, float *db);
  int (*add)(ml_backend *be, float *y, const float *x, int64_t n);
  int (*add_bf16)(ml_backend *be, float *y, const float *x, void *y16, int64_t n);
  int (*add_grad)(ml_backend *be, float *y, const float *x, int64_t n, bool overwrite, bool round);
  int (*add_to)(ml_backend *be, float *z, const float *y, const float *x, int64_t n);
  int (*add_round_to)(ml_backend *be, float *z, const float *y, const float *x, void *z16,
                      int64_t n);
  int (*scale)(ml_backend *be, float *x, int64_t n, float s);
  int (*rmsnorm_fwd)(ml_backend *be, const float *x, const void *w, ml_dtype w_type, float offset,
                     float eps, float *y, float *rstd, int64_t T, int64_t H);
  int (*rmsnorm_bwd)(ml_backend *be, const float *dy, const float *x, const void *w,
                     ml_dtype w_type, float offset, const float *rstd, float *dx, float *dw,
                     int64_t T, int64_t H);
  int (*rmsnorm_fwd_bf16)(ml_backend *be, const float *x, const void *w, ml_dtype w_type,
                          float offset, float eps, void *y, float *rstd, int64_t T, int64_t H);
  int (*rope_tables)(ml_backend *be, double theta, int64_t hd, const ml_rope_scaling *sc,
                     int64_t seq_len, int64_t S, float *cos_t, float *sin_t);
  int (*rope_fwd)(ml_backend *be, float *x, const float *cos_t, const float *sin_t, int64_t B,
                  int64_t S, int64_t nheads, int64_t hd);
  int (*rope_bwd)(ml_backend *be, float *dx, const float *cos_t, const float *sin_t, int64_t B,
                  int64_t S, int64_t nheads, int64_t hd);
  int (*rope_fwd_bf16)(ml_backend *be, const float *x, void *y, const float *cos_t,
                       const float *sin_t, int64_t B, int64_t S, int64_t nheads, int64_t hd);
  int (*rope_bwd_bf16)(ml_backend *be, const float *dx, void *y, const float *cos_t,
                       const float *sin_t, int64_t B, int64_t S, int64_t nheads, int64_t hd);
  int64_t (*attention_saved)(ml_backend *be, int64_t B, int64_t S, int64_t nh);
  size_t (*attention_work)(ml_backend *be, int64_t B, int64_t S, int64_t nh, int64_t nkv,
                           int64_t hd);
  int (*attention_fwd)(ml_backend *be, const float *q, const float *k, const float *v, float *out,
                       float *saved, int64_t B, int64_t S, int64_t nh, int64_t nkv, int64_t hd,
                       float scale, int64_t window, ml_dtype compute);
  int (*attention_bwd)(ml_backend *be, const float *dout, const float *q, const float *k,
                       const float *v, const float *out, const float *saved, float *dq,
                       float *dk, float *dv, int64_t B, int64_t S, int64_t nh, int64_t nkv,
                       int64_t hd, float scale, int64_t window, ml_dtype compute, void *work);
  int (*attention_block_fwd)(ml_backend *be, const ml_attn_block *blk, const float *q,
                             const float *k, const float *v, float *out, float *lse,
                             bool accumulate, ml_dtype compute);
  size_t (*attention_block_work)(ml_backend *be, const ml_attn_block *blk);
  /* NULL: none (ml_be_attention_temp_blocks) */
  int (*attention_temp_blocks)(ml_backend *be, const ml_attn_block *blk, ml_dtype compute,
                               bool bwd, int64_t bytes[ML_ATTN_TEMP_BLOCKS]);
  int (*attention_block_bwd)(ml_backend *be, const ml_attn_block *blk, const float *dout,
                             const float *q, const float *k, const float *v, const float *out,
                             const float *lse, float *dq, float *dk, float *dv,
                             ml_dtype compute, void *work);
  int (*attention_varlen_fwd)(ml_backend *be, const ml_attn_varlen *vl, const float *q,
                              const float *k, const float *v, float *out, float *lse,
                              ml_dtype compute);
  size_t (*attention_varlen_work)(ml_backend *be, const ml_attn_varlen *vl);
  int (*attention_varlen_bwd)(ml_backend *be, const ml_attn_varlen *vl, const float *dout,
                              const float *q, const float *k, const float *v, const float *out,
                              const float *lse, float *dq, float *dk, float *dv,
                              ml_dtype compute, void *work);
  int (*glu_fwd)(ml_backend *be, const float *g, const float *u, float *h, int64_t n,
                 ml_glu_act act);
  int (*glu_bwd)(ml_backend *be, const float *dh, const float *g, const float *u, float *dg,
                 float *du, int64_t n, ml_glu_act act);
  int (*glu_fwd_bf16)(ml_backend *be, const void *g, const void *u, void *h, ml_dtype h_type,
                      int64_t n, ml_glu_act act);
  int (*glu_bwd_bf16)(ml_backend *be, const float *dh, const void *g, const void *u, void *dg,
                      void *du, ml_dtype d_type, int64_t n, ml_glu_act act);
  int (*embedding_fwd)(ml_backend *be, const int32_t *ids, int64_t T, const void *W,
                       ml_dtype w_type, int64_t row0, int64_t rows, int64_t H, float scale,
                       float *out);
  int (*embedding_bwd)(ml_backend *be, const int32_t *ids, int64_t T, const float *dout,
                       int64_t row0, int64_t rows, int64_t H, float scale, float *dW);
  int (*xent_rowmax)(ml_backend *be, const float *logits, int64_t T, int64_t V, float *mx);
  int (*xent_sumexp_target)(ml_backend *be, const float *logits, int64_t T, int64_t V,
                            int64_t v0, const int32_t *y, const float *mx, float *se, float *tl);
  int (*xent_online)(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                     const int32_t *y, float *mx, float *se, float *tl);
  int (*xent_rebase)(ml_backend *be, int64_t T, int64_t V, int64_t v0, const int32_t *y,
                     const float *mx, const float *M, float *se, float *tl);
  int (*xent_logprobs)(ml_backend *be, const float *se, const float *tl, const int32_t *y,
                       int64_t T, float scale, float *logprobs, float *w, double *sums);
  int (*xent_bwd)(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                  const int32_t *y, const float *mx, const float *se, const float *w,
                  float *dlogits);
  int (*adamw)(ml_backend *be, float *p, float *g, float *m, float *v, uint16_t *p_bf16,
               int64_t n, float grad_scale, double lr, double b1, double b2, double eps, double wd,
               int64_t step);
  int (*norm_partial)(ml_backend *be, const float *g, int64_t n, ml_norm_kind kind, double *out);
  int (*find_nonfinite)(ml_backend *be, const float *g, int64_t n, bool *found);
  int (*xent_entropy_sum)(ml_backend *be, const float *logits, int64_t T, int64_t V,
                          const float *mx, float *sl);
  int (*xent_entropy_online)(ml_backend *be, const float *logits, int64_t T, int64_t V,
                             const float *mx, const float *se, float *sl);
  int (*xent_entropy_rebase)(ml_backend *be, int64_t T, const float *mx, const float *M,
                             const float *se, float *sl);
  int (*xent_entropy)(ml_backend *be, const float *se, const float *sl, int64_t T, float *ent);
  int (*xent_bwd_entropy)(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                          const int32_t *y, const float *mx, const float *se, const float *w,
                          const float *H, const float *ew, float *dlogits);
  int (*xent_topk_clear)(ml_backend *be, int64_t T, int64_t k, float *val, int32_t *id);
  int (*xent_topk_online)(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                          int64_t k, float *val, int32_t *id);
  int (*xent_topk_merge)(ml_backend *be, int64_t P, int64_t T, int64_t k, const float *cval,
                         const int32_t *cid, float *val, int32_t *id);
  int (*xent_topk_logprobs)(ml_backend *be, int64_t T, int64_t k, const float *M,
                            const float *se, const float *val, const int32_t *id, float *lp);
  void (*destroy)(ml_backend *be);
  int (*set_batch_invariant)(ml_backend *be, bool on);
  int (*norm_partials)(ml_backend *be, const ml_norm_seg *segs, int k, ml_norm_kind kind,
                       double *out);
} ml_backend_ops;

struct ml_backend {
  const ml_backend_ops *ops;
  void *impl;
};

/* ---- the devices: one registry ------------------------------------------- */
/* One device meshlm knows: the value of the CLI's --device and of
 * meshlm_options.device (torch's device types). */
typedef struct ml_device_info {
  const char *name;        /* "cpu", "cuda" */
  const char *description; /* one line: where it computes */
  bool available;          /* this build has its backend */
} ml_device_info;

/* The known devices' names, NULL-terminated, cpu first (the default): every
 * device meshlm knows, whether or not this build has it (ml_device_info). */
const char *const *ml_device_names(void);
/* Device i of ml_device_names (0 <= i < their count). */
ml_device_info ml_device_at(int i);
/* The index of device `name` in ml_device_names, or −1 (no message) when
 * meshlm knows no device of that name. */
int ml_device_find(const char *name);
/* The known names joined by ", " ("cpu, cuda"), for messages. */
const char *ml_device_list(void);

/* The backend of device `name` ("cpu"), created on first use and kept for
 * the process (ml_backend_release_all frees them): later calls return it,
 * whatever their local_rank. local_rank is this process's rank among the
 * processes of its job on its node (comm/node.h), from which a device
 * backend picks its device (CUDA: local_rank modulo the GPUs visible, as
 * torchrun's LOCAL_RANK picks cuda:LOCAL_RANK); the CPU backend ignores
 * it. Errors: an unknown name ("device 'tpu': unknown; expected one of
 * cpu, cuda"), a device this build does not have (saying why), a device
 * that fails to start. */
int ml_backend_get(const char *name, int local_rank, ml_backend **out);
/* Destroy every backend ml_backend_get created (at exit). */
void ml_backend_release_all(void);

/* ---- properties ---------------------------------------------------------- */
/* Whether be implements operator op (its ml_backend_ops.supports; false
 * for an op outside the enum): ggml_backend_supports_op for the families
 * of ml_op. The way code above the seam learns what a backend can do. */
bool ml_be_supports(const ml_backend *be, ml_op op);
/* Whether be's device memory (ml_be_alloc) is host memory, which the host
 * and MPI may read and write directly: true on the CPU backend, false on
 * CUDA (GPU memory) and meta (addresses no one may dereference). */
bool ml_be_host_memory(const ml_backend *be);
/* The backend whose kernels compute on be's host memory (ml_be_host_alloc):
 * where FSDP's cpu_offload runs the optimizer step (torch's
 * CPUOffloadPolicy: AdamW, the grad norm and clipping on the CPU's copies
 * of the shards). be itself where its device memory is host memory (cpu)
 * or nothing is computed (meta); on CUDA the CPU backend (kernels/cpu),
 * created on first use (ml_backend_get). Errors: the CPU backend fails to
 * start. */
int ml_be_host_peer(ml_backend *be, ml_backend **out);

/* ---- memory -------------------------------------------------------------- */
/* count elements of `elem` bytes of device memory from the pool; NULL
 * with the message of ml_malloc_array (common/checked.h: "out of memory
 * allocating N bytes (X GiB) for WHAT", WHAT printf-formatted from the
 * remaining arguments, at the caller's file:line) when the pool cannot,
 * or when count is negative or count · elem does not fit (checked before
 * anything is allocated). count 0 gives a valid, distinct pointer. */
#define ml_be_alloc(be, count, elem, ...) \
  ml_be_alloc_at(__FILE__, __LINE__, (be), 0, (count), (elem), __VA_ARGS__)
/* The same in host staging memory (pinned where the device DMAs from it). */
#define ml_be_host_alloc(be, count, elem, ...) \
  ml_be_alloc_at(__FILE__, __LINE__, (be), 1, (count), (elem), __VA_ARGS__)
void *ml_be_alloc_at(const char *file, int line, ml_backend *be, int host, int64_t count,
                     size_t elem, const char *what_fmt, ...) __attribute__((format(printf, 7, 8)));
/* Return p (NULL: no-op) to the pool it came from. */
void ml_be_free(ml_backend *be, void *p);
void ml_be_host_free(ml_backend *be, void *p);
/* Give the pool's cached blocks back to the system (after the working set
 * changed shape, e.g. a new batch geometry). */
void ml_be_trim(ml_backend *be);
/* The device pool's byte counts (ml_memory_stats). */
ml_memory_stats ml_be_memory_stats(ml_backend *be);
/* peak = in_use (torch.cuda.reset_peak_memory_stats). */
void ml_be_reset_peak(ml_backend *be);

/* dst[bytes] = src[bytes] between the memories `kind` names. */
int ml_be_copy(ml_backend *be, void *dst, const void *src, size_t bytes, ml_copy_kind kind);
/* The same for H2D or D2H, enqueued on the compute stream without waiting
 * (cudaMemcpyAsync from pinned memory: torch's .to(non_blocking=True)), the
 * host side from ml_be_host_alloc: the device side is ordered as any
 * operator's; the host side must not be touched until ml_be_event_sync of
 * an event recorded after the call (FSDP2's offloaded gradients,
 * parallel/fsdp.h). Synchronous where every call is (cpu). Errors: a D2D
 * kind, the device's. */
int ml_be_copy_async(ml_backend *be, void *dst, const void *src, size_t bytes,
                     ml_copy_kind kind);
/* rows rows of width bytes, device to device: row i from src + i·spitch
 * to dst + i·dpitch (cudaMemcpy2DAsync's shape of call), rows in
 * increasing order; the ranges may overlap only to compact in place (dst
 * <= src, dpitch <= spitch: each row moves to a lower address). */
int ml_be_copy2d(ml_backend *be, void *dst, size_t dpitch, const void *src, size_t spitch,
                 size_t width, size_t rows);
/* dst[bytes] = 0 (device memory). */
int ml_be_zero(ml_backend *be, void *dst, size_t bytes);
/* dst[n] (dst_type) = src[n] (src_type), device memory; ML_F32 ↔ ML_BF16
 * (fp32 → bf16 rounds to nearest-even, NaN stays NaN: torch's .to()),
 * or the same type (a copy). dst == src is allowed for F32 → F32 only. */
int ml_be_convert(ml_backend *be, void *dst, ml_dtype dst_type, const void *src,
                  ml_dtype src_type, size_t n);
/* x[n] = fp32(bf16(x[n])) in place: the values a bf16 tensor would hold. */
int ml_be_round_bf16(ml_backend *be, float *x, size_t n);
/* ml_be_round_bf16 written elsewhere, with a bf16 copy, in one pass: y[n] =
 * fp32(bf16(x[n])) (y is x or apart from it) and, y16 non-NULL, y16 [n] (uint16_t) =
 * bf16(x[n]), nearest-even (NaN stays NaN): bitwise a copy of x into y,
 * ml_be_round_bf16 of y and ml_be_convert of x (or of y: the rounding is
 * idempotent) to bf16 into y16. FSDP2's cast of a unit's input to
 * param_dtype (MixedPrecisionPolicy, cast_forward_inputs) stored where the
 * layer reads it: the forward's saved x_in, the backward's gradient in place
 * with the bf16 dy of down_proj's backward GEMMs (model/layer.c). x and y16,
 * y and y16 apart. */
int ml_be_round_bf16_to(ml_backend *be, const float *x, float *y, void *y16, size_t n);
/* Row rows[r] of dst [.., width] (dst_type F32 or BF16: rounded to
 * nearest-even, as ml_be_convert) = row r of src [n, width] fp32, for r <
 * n; rows: device int32, distinct, each within dst (the caller's). One
 * call for what n ml_be_convert calls of a row would do: the KV cache's
 * appends, every new key (value) row of a step into its block
 * (engine/kvcache.c; vLLM's reshape_and_cache). Errors: dst_type, n < 0
 * or width < 1. */
int ml_be_scatter_rows(ml_backend *be, void *dst, ml_dtype dst_type, const int32_t *rows,
                       const float *src, int64_t n, int64_t width);

/* ---- ordering ------------------------------------------------------------ */
int ml_be_event_record(ml_backend *be, ml_event *ev);
int ml_be_event_wait(ml_backend *be, ml_event *ev);
/* Block the host until ev (ml_be_event_record) has completed
 * (cudaEventSynchronize); an event never recorded has. */
int ml_be_event_sync(ml_backend *be, ml_event *ev);
int ml_be_sync(ml_backend *be);

/* ---- operators (semantics: kernels/cpu/kernels.h of the same name) ------- */
/* Batch-invariant mode (on: true; off when the backend is made): from now
 * on every forward product that feeds a log-prob reduces in one order per
 * output element that depends on neither the batch nor the call's shape —
 * the GEMMs of the forward's layout (ml_gemm with trans_a false, trans_b
 * true: the linears, lm_head, the fused classifier's tiles) with a fixed
 * K order whatever M and N, and the attention forwards (ml_be_attention_fwd,
 * ml_be_attention_block_fwd) with key tiles at fixed global positions and
 * each query row computed alone — so a token's log-prob is the same bit
 * pattern whatever batch, padding, packing, micro-batch or KV-cache step
 * computes it (vLLM's VLLM_BATCH_INVARIANT). Norms, RoPE, GLU and the
 * log-softmax kernels are row-local with fixed chunking in both modes. The
 * backward and the optimizer are unchanged. A mode of the backend (the
 * process's), not of one call. Errors: a backend without the mode (cuda:
 * "backend 'cuda' does not implement ml_be_set_batch_invariant"). */
int ml_be_set_batch_invariant(ml_backend *be, bool on);

/* See ml_gemm. Checks the arguments for every backend (a backend's gemm
 * sees valid ones with M, N > 0; K may be 0: C (=|+=) 0 (+ bias)). Errors:
 * dtypes other than F32/BF16, compute F32 with a bf16 operand, a leading
 * dimension too small, c_bf16 with accumulate (a bf16 C would be
 * rounded twice). */
int ml_be_gemm(ml_backend *be, const ml_gemm *g);
/* Bytes of pool memory ml_be_gemm(be, g) holds at once inside the call for
 * valid arguments: operands converted to the compute dtype, a bf16 bias
 * widened, a bf16 C's fp32 product where the library writes no bf16 output
 * (backend/cpu/gemm.c, backend/cuda/gemm.c); 0 for a backend that takes
 * none. The meta backend allocates as much for the backend it models, so
 * `meshlm plan`'s peaks count a GEMM's temporaries. */
int64_t ml_be_gemm_temp(ml_backend *be, const ml_gemm *g);
/* Those bytes as the pool blocks ml_be_gemm(be, g) takes, in the order it
 * takes them, all held until the call returns (at most ML_GEMM_TEMP_BLOCKS;
 * a backend without the op: one block of ml_be_gemm_temp's bytes, or none).
 * Returns their number. The meta backend takes the same blocks in the same
 * order, so its pool caches the blocks the modelled backend's does and
 * `meshlm plan`'s reserved bytes (memory_reserved) are the run's. */
int ml_be_gemm_temp_blocks(ml_backend *be, const ml_gemm *g, int64_t bytes[ML_GEMM_TEMP_BLOCKS]);
/* Whether be's bf16 GEMMs read an fp32 operand flagged exact (ml_gemm.a_exact,
 * b_exact) in place where it is stored contiguously (lda, ldb = its row's
 * elements): true on a CPU without a bf16 matmul, whose emulation computes
 * in fp32 on bf16 values (backend/cpu/gemm.c), and on the meta backend
 * modelling one; false elsewhere (cuBLASLt, oneDNN's bf16 matmul convert an
 * fp32 operand to bf16 storage). Where true, an fp32 operand read by several
 * bf16 GEMMs costs least rounded once in fp32 storage and flagged; where
 * false, rounded once into a bf16 copy — which the emulation would widen
 * again into an fp32 temporary per GEMM. */
bool ml_be_gemm_exact_in_place(ml_backend *be);
/* db[N] (+=) sum over the T rows of dy [T, N] (the bias gradient). */
int ml_be_bias_grad(ml_backend *be, const float *dy, int64_t T, int64_t N, float *db);
/* y[n] += x[n] (the residual add). */
int ml_be_add(ml_backend *be, float *y, const float *x, int64_t n);
/* ml_be_add of an FSDP unit's reduced gradient x into its shard gradient y
 * (parallel/fsdp_grads.c), in one pass: y[n] = (overwrite ? +0 : y[n]) +
 * (round ? fp32(bf16(x[n])) : x[n]), bitwise ml_be_round_bf16 of x (round)
 * then ml_be_add into y, or into zeros (overwrite: y is not read, and a −0
 * is written +0 as 0 + −0 is). The first reduction after zero_grad
 * writes (torch's zero_grad(set_to_none=True): the grad is None until the
 * backward sets it), and under param_dtype bf16 the rounding of a gradient
 * computed in bf16 (MixedPrecisionPolicy) rides along. ML_OP_ADD. */
int ml_be_add_grad(ml_backend *be, float *y, const float *x, int64_t n, bool overwrite,
                   bool round);
/* ml_be_add fused with the rounding: y[n] += x[n] and y16 [n] (uint16_t) =
 * the sum rounded to nearest-even once, bitwise ml_be_add then ml_be_convert
 * of y. The residual stream's gradient (fp32) and, in the same pass, the
 * bf16 dy that o_proj's backward GEMMs read (autocast's cast of
 * grad_output). ML_OP_ADD. */
int ml_be_add_bf16(ml_backend *be, float *y, const float *x, void *y16, int64_t n);
/* z[n] = y[n] + x[n] (z is y, x, or apart from both): ml_be_add into another buffer,
 * bitwise ml_be_add then ml_be_copy of y into z — the residual add of the
 * attention block written straight into the saved x_mid (model/layer.c).
 * ML_OP_ADD. */
int ml_be_add_to(ml_backend *be, float *z, const float *y, const float *x, int64_t n);
/* ml_be_add_to with the unit boundary's cast in the same pass: z[n] =
 * fp32(bf16(y[n] + x[n])) (z is y, x, or apart from both) and, z16
 * non-NULL, z16 [n] (uint16_t) = bf16(y[n] + x[n]), nearest-even (NaN
 * stays NaN): bitwise ml_be_add_to then ml_be_round_bf16_to of z in place
 * with z16. The residual sum that a layer hands on rounded to bf16 values
 * where the next unit reads it (FSDP2's cast_forward_inputs under
 * MixedPrecisionPolicy param_dtype bf16): the forward's MLP residual into
 * the layer above's saved x_in (or the head's input), the backward's
 * attention-block residual gradient with the bf16 dy of the layer below's
 * down_proj (model/layer.c). z16 apart from z, y, x. ML_OP_ADD. */
int ml_be_add_round_to(ml_backend *be, float *z, const float *y, const float *x, void *z16,
                       int64_t n);
/* x[n] *= s (gradient clipping). */
int ml_be_scale(ml_backend *be, float *x, int64_t n, float s);
/* RMSNorm (HF LlamaRMSNorm, Gemma3RMSNorm when offset = 1) in fp32 on x,
 * y [T, H]; w [H] of w_type (F32 or BF16, widened exactly); rstd [T]
 * saved. y may alias x. */
int ml_be_rmsnorm_fwd(ml_backend *be, const float *x, const void *w, ml_dtype w_type,
                      float offset, float eps, float *y, float *rstd, int64_t T, int64_t H);
/* ml_be_rmsnorm_fwd with a bf16 output, fused: y [T, H] (uint16_t) is the
 * fp32 result rounded to nearest-even once, bitwise ml_be_rmsnorm_fwd's y
 * converted by ml_be_convert; x [T, H] fp32 is only read, rstd [T] saved as
 * there. The bf16 input of the linears after the norm (h1: q/k/v_proj,
 * h2: gate/up_proj), which torch.autocast casts LlamaRMSNorm's fp32 output
 * to at the bf16 matmul. ML_OP_RMSNORM. */
int ml_be_rmsnorm_fwd_bf16(ml_backend *be, const float *x, const void *w, ml_dtype w_type,
                           float offset, float eps, void *y, float *rstd, int64_t T, int64_t H);
/* dx [T, H] (=, may alias dy), dw [H] (+=, may be NULL). */
int ml_be_rmsnorm_bwd(ml_backend *be, const float *dy, const float *x, const void *w,
                      ml_dtype w_type, float offset, const float *rstd, float *dx, float *dw,
                      int64_t T, int64_t H);
/* RoPE cos/sin tables [S, hd/2] of positions 0 .. S−1 for base theta and
 * scaling `sc`, as HF's rotary embedding computes them for a forward whose
 * positions reach seq_len − 1 (seq_len = max(position_ids) + 1: what the
 * length-dependent types, dynamic and longrope, are computed for; the
 * others ignore it): cos/sin of fp32 angles p·inv_freq times the attention
 * factor (kernels/cpu/kernels.h k_rope_inv_freq, k_rope_tables: the one
 * definition every backend uses). Errors: allocation. */
int ml_be_rope_tables(ml_backend *be, double theta, int64_t hd, const ml_rope_scaling *sc,
                      int64_t seq_len, int64_t S, float *cos_t, float *sin_t);
/* In place on x: [B·S, nheads, hd] (rotate_half); bwd: the transpose. */
int ml_be_rope_fwd(ml_backend *be, float *x, const float *cos_t, const float *sin_t, int64_t B,
                   int64_t S, int64_t nheads, int64_t hd);
int ml_be_rope_bwd(ml_backend *be, float *dx, const float *cos_t, const float *sin_t, int64_t B,
                   int64_t S, int64_t nheads, int64_t hd);
/* ml_be_rope_fwd with a bf16 output, fused: y [B·S, nheads, hd] (uint16_t)
 * is rope(x) rounded to nearest-even once (bitwise ml_be_rope_fwd's fp32
 * result converted by ml_be_convert); x [B·S, nheads, hd] fp32 is only
 * read. The bf16 q and k that autocast's SDPA reads (HF
 * apply_rotary_pos_emb in fp32, the cast at the bf16 product). ML_OP_ROPE. */
int ml_be_rope_fwd_bf16(ml_backend *be, const float *x, void *y, const float *cos_t,
                        const float *sin_t, int64_t B, int64_t S, int64_t nheads, int64_t hd);
/* ml_be_rope_bwd with a bf16 output, fused: y [B·S, nheads, hd] (uint16_t)
 * is the rotation of dx by −angle rounded to nearest-even once, bitwise
 * ml_be_rope_bwd's fp32 result converted by ml_be_convert; dx [B·S, nheads,
 * hd] fp32 is only read. The dy of q_proj's and k_proj's bf16 GEMMs, which
 * autocast's linear backward casts to bf16 (one rounding of HF
 * apply_rotary_pos_emb's fp32 gradient). ML_OP_ROPE. */
int ml_be_rope_bwd_bf16(ml_backend *be, const float *dx, void *y, const float *cos_t,
                        const float *sin_t, int64_t B, int64_t S, int64_t nheads, int64_t hd);
/* Causal GQA attention (HF eager_attention_forward): q [B·S, nh, hd], k, v
 * [B·S, nkv, hd], out [B·S, nh, hd]. Keys j <= i, and j > i − window when
 * window > 0. The softmax and its backward run in fp32; the products (q·k^T,
 * P·v and, backward, dout·v^T, P^T·dout, dS·k, dS^T·q) in `compute`, as
 * ml_gemm's: ML_F32, or ML_BF16 with every operand rounded to bf16 and fp32
 * accumulation — SDPA under torch.autocast(bfloat16), whose outputs are kept
 * in fp32 here. What the forward saves for the backward is the backend's
 * choice, `saved` of ml_be_attention_saved floats: both backends run
 * FlashAttention-2 (no [S, S] tensor; the backward recomputes P) and save
 * each query's log-sum-exp, [B][S, nh] on the CPU (ml_attn_block's lse
 * layout), [B, nh, S] on CUDA. */
int ml_be_attention_fwd(ml_backend *be, const float *q, const float *k, const float *v,
                        float *out, float *saved, int64_t B, int64_t S, int64_t nh, int64_t nkv,
                        int64_t hd, float scale, int64_t window, ml_dtype compute);
/* Floats of the forward's `saved` for these sizes (saturates at ML_SAT). */
int64_t ml_be_attention_saved(ml_backend *be, int64_t B, int64_t S, int64_t nh);
/* Bytes of device workspace ml_be_attention_bwd needs for these sizes
 * (the caller carves it; saturates at SIZE_MAX). */
size_t ml_be_attention_work(ml_backend *be, int64_t B, int64_t S, int64_t nh, int64_t nkv,
                            int64_t hd);
/* dq, dk, dv (=) given dout and the forward's q, k, v, out, saved, with the
 * forward's window and compute. */
int ml_be_attention_bwd(ml_backend *be, const float *dout, const float *q, const float *k,
                        const float *v, const float *out, const float *saved, float *dq,
                        float *dk, float *dv, int64_t B, int64_t S, int64_t nh, int64_t nkv,
                        int64_t hd, float scale, int64_t window, ml_dtype compute, void *work);
/* Block attention (FlashAttention-2's tile step, on ml_attn_block's
 * layouts): the softmax of the block's visible scores, as probabilities
 * `out` [sq, nh, hd] per sequence and their log-sum-exp `lse` [sq, nh]
 * (natural log, of the scaled scores). accumulate false: out and lse are
 * the block's (a row that sees no key gets out 0, lse −inf); true: merged
 * into the out and lse already there as the attention over the union of
 * their keys and the block's (ring attention's online-softmax merge:
 * lse' = log(e^lse + e^lse_b), out' = out·e^(lse−lse') + out_b·e^(lse_b−lse')),
 * so a query's blocks in any order give its attention over all of them.
 * Products in `compute` as ml_be_attention_fwd's; softmax and merge fp32.
 * No [sq, sk] tensor is stored. ML_OP_ATTENTION_BLOCK (CPU: kernels/cpu
 * attention.c; CUDA: the whole-sequence kernels on the block's geometry,
 * kernels/cuda/kernels.h kc_attention_block_fwd). */
int ml_be_attention_block_fwd(ml_backend *be, const ml_attn_block *blk, const float *q,
                              const float *k, const float *v, float *out, float *lse,
                              bool accumulate, ml_dtype compute);
/* Bytes of device workspace ml_be_attention_block_bwd needs for blk (the
 * caller carves it; saturates at SIZE_MAX; 0 on a backend without block
 * attention). */
size_t ml_be_attention_block_work(ml_backend *be, const ml_attn_block *blk);
/* The pool blocks (bytes[i], in the order taken) an attention call on blk
 * (forward, or backward: bwd) in `compute` allocates and frees before it
 * returns, for the meta backend to take the same (`meshlm plan`): the CPU
 * backend's bf16 operand copies (cpu.c attention_begin); a whole-sequence
 * call is the block sq = sk = S. Returns their count (0: none, and on a
 * backend that does not say). */
int ml_be_attention_temp_blocks(ml_backend *be, const ml_attn_block *blk, ml_dtype compute,
                                bool bwd, int64_t bytes[ML_ATTN_TEMP_BLOCKS]);
/* Backward of the block for the final out and lse of its queries (after
 * every block was merged): probabilities recomputed as exp(scale·q·k −
 * lse), D = rowsum(dout ⊙ out); dq [sq, nh, hd], dk, dv [sk, nkv, hd]
 * per sequence (+=: a query's blocks, and a key's, add up; = under
 * blk->bwd_overwrite, the first block of each output). work:
 * ml_be_attention_block_work bytes. */
int ml_be_attention_block_bwd(ml_backend *be, const ml_attn_block *blk, const float *dout,
                              const float *q, const float *k, const float *v, const float *out,
                              const float *lse, float *dq, float *dk, float *dv,
                              ml_dtype compute, void *work);
/* Varlen attention: every document of vl in one call. out [B, S, nh, hd]
 * (bf16 under blk.out_bf16) and lse [B][S, nh]: document d's rows bitwise
 * those of ml_be_attention_block_fwd on the block of its tokens alone
 * (B = 1, q_pos = k_pos = 0, sq = sk = its length, operands from its first
 * token, accumulate false); a token outside every document attends to
 * nothing: out 0, lse −inf. Products in `compute` as the block's. The
 * pool blocks it takes for itself are ml_be_attention_temp_blocks(vl->blk)
 * (one set for the whole batch). ML_OP_ATTENTION_VARLEN (CPU:
 * kernels/cpu/attention.c k_attention_varlen_fwd, one parallel region of
 * (document, head, query tile) tasks). */
int ml_be_attention_varlen_fwd(ml_backend *be, const ml_attn_varlen *vl, const float *q,
                               const float *k, const float *v, float *out, float *lse,
                               ml_dtype compute);
/* Bytes of device workspace ml_be_attention_varlen_bwd needs for vl (its
 * documents included; the caller carves it; SIZE_MAX on overflow; 0 on a
 * backend without the op). */
size_t ml_be_attention_varlen_work(ml_backend *be, const ml_attn_varlen *vl);
/* Its backward for the forward's out and lse: dq [B, S, nh, hd], dk, dv
 * [B, S, nkv, hd] (=), document d's rows bitwise
 * ml_be_attention_block_bwd's on its block alone with bwd_overwrite, 0
 * outside the documents. work: ml_be_attention_varlen_work bytes. */
int ml_be_attention_varlen_bwd(ml_backend *be, const ml_attn_varlen *vl, const float *dout,
                               const float *q, const float *k, const float *v, const float *out,
                               const float *lse, float *dq, float *dk, float *dv,
                               ml_dtype compute, void *work);
/* h[n] = act(g)·u; backward dg, du (=). */
int ml_be_glu_fwd(ml_backend *be, const float *g, const float *u, float *h, int64_t n,
                  ml_glu_act act);
int ml_be_glu_bwd(ml_backend *be, const float *dh, const float *g, const float *u, float *dg,
                  float *du, int64_t n, ml_glu_act act);
/* The same on g, u [n] in bf16 (autocast's MLP: the bf16 outputs of
 * gate_proj and up_proj), widened exactly and computed in fp32 as the ops
 * above (bitwise those on the widened values, on every backend); the
 * forward's h [n] of h_type, ML_BF16 (rounded to nearest-even in the same
 * kernel: down_proj's bf16 input, no separate conversion) or ML_F32.
 * ML_OP_GLU. Errors: h_type other than F32/BF16. */
int ml_be_glu_fwd_bf16(ml_backend *be, const void *g, const void *u, void *h, ml_dtype h_type,
                       int64_t n, ml_glu_act act);
/* Its backward: dh [n] fp32; dg, du [n] (=) of d_type, ML_F32 or ML_BF16
 * (rounded to nearest-even in the same kernel: the dy of gate_proj's and
 * up_proj's bf16 GEMMs, autocast's cast of their fp32 gradient, no
 * separate conversion; bitwise the F32 outputs converted). Errors: d_type
 * other than F32/BF16. */
int ml_be_glu_bwd_bf16(ml_backend *be, const float *dh, const void *g, const void *u, void *dg,
                       void *du, ml_dtype d_type, int64_t n, ml_glu_act act);
/* Vocab-parallel lookup (Megatron VocabParallelEmbedding): out [T, H] =
 * scale · W[ids − row0] for ids in [row0, row0 + rows), else 0; W [rows, H]
 * of w_type (F32 or BF16). ids are device memory. */
int ml_be_embedding_fwd(ml_backend *be, const int32_t *ids, int64_t T, const void *W,
                        ml_dtype w_type, int64_t row0, int64_t rows, int64_t H, float scale,
                        float *out);
/* dW [rows, H] (+=) scale · dout rows of the ids in range. */
int ml_be_embedding_bwd(ml_backend *be, const int32_t *ids, int64_t T, const float *dout,
                        int64_t row0, int64_t rows, int64_t H, float scale, float *dW);
/* Vocab-parallel cross-entropy pieces (Megatron _VocabParallelCrossEntropy)
 * on logits [T, V] = global columns v0 .. v0+V−1; y [T] global targets or
 * −1. rowmax: mx [T]; sumexp_target: se [T], tl [T] (target logit − mx, 0
 * when not in this shard); the caller reduces them over the vocab shards. */
int ml_be_xent_rowmax(ml_backend *be, const float *logits, int64_t T, int64_t V, float *mx);
int ml_be_xent_sumexp_target(ml_backend *be, const float *logits, int64_t T, int64_t V,
                             int64_t v0, const int32_t *y, const float *mx, float *se, float *tl);
/* The online log-sum-exp over column tiles of the shard (the fused
 * classifier, parallel/loss.h; Milakov & Gimelshein 2018). xent_online:
 * logits [T, V] one tile = global columns v0 .. v0+V−1; mx, se, tl [T]
 * (se = tl = 0 before the first tile, mx then unread) become the running max, the sum of
 * exp(logit − mx) (fp64, rounded once per tile) and the target's raw logit
 * where the tile holds it. xent_rebase, after the MAX reduction M [T] of mx:
 * se ·= exp(mx − M), tl = tl − M where y[t] is in the shard's columns v0 ..
 * v0+V−1, else 0: sumexp_target's se, tl (bit for bit from one tile on the
 * rank holding the max), ready for the SUM reduction. */
int ml_be_xent_online(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                      const int32_t *y, float *mx, float *se, float *tl);
int ml_be_xent_rebase(ml_backend *be, int64_t T, int64_t V, int64_t v0, const int32_t *y,
                      const float *mx, const float *M, float *se, float *tl);
/* From the reduced se, tl [T]: logprobs[t] = tl − log(se) (fp64, rounded
 * once; 0 for y[t] < 0; logprobs may be NULL), w[t] = scale where y[t] >=
 * 0 else 0; sums [2] (device memory, fp64): sums[0] −= the sum of the
 * log-probs, sums[1] += the targets counted (exact below 2^53). The sums
 * stay on the device (no synchronisation): the caller copies them once,
 * when its pass ends. */
int ml_be_xent_logprobs(ml_backend *be, const float *se, const float *tl, const int32_t *y,
                        int64_t T, float scale, float *logprobs, float *w, double *sums);
/* dlogits [T, V] (=, may alias logits) = w[t]·(softmax − onehot). */
int ml_be_xent_bwd(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                   const int32_t *y, const float *mx, const float *se, const float *w,
                   float *dlogits);
/* Per-token entropy H = log(se) − sl/se (nats) of the softmax over the
 * shards, from sl [T] = Σ exp(l − m)·(l − m) about the max m (fp64, rounded
 * once per call as se is; kernels/cpu/kernels.h k_xent_entropy_*). Whole
 * rows: entropy_sum about the reduced max mx, then the SUM reduction with
 * se. Tiles: entropy_online on each tile before xent_online (reads its mx,
 * se before the update; sl = 0 first), entropy_rebase before xent_rebase
 * (reads mx, M, se), then the SUM reduction. entropy: ent [T] from the
 * reduced se, sl. */
int ml_be_xent_entropy_sum(ml_backend *be, const float *logits, int64_t T, int64_t V,
                           const float *mx, float *sl);
int ml_be_xent_entropy_online(ml_backend *be, const float *logits, int64_t T, int64_t V,
                              const float *mx, const float *se, float *sl);
int ml_be_xent_entropy_rebase(ml_backend *be, int64_t T, const float *mx, const float *M,
                              const float *se, float *sl);
int ml_be_xent_entropy(ml_backend *be, const float *se, const float *sl, int64_t T, float *ent);
/* The backward with an entropy bonus (loss − Σ_t ew[t]·H_t, ew [T] the
 * coefficient times each token's normalised weight; dH/dl = −p(log p + H)):
 * dlogits [T, V] (=, may alias logits) = w[t]·(softmax − onehot) +
 * ew[t]·p·(log p + H[t]), from the reduced mx, se and the entropies H [T]. */
int ml_be_xent_bwd_entropy(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                           const int32_t *y, const float *mx, const float *se, const float *w,
                           const float *H, const float *ew, float *dlogits);
/* Per-token top-k logits over the shards (NeMo RL distributed_vocab_topk;
 * kernels/cpu/kernels.h k_xent_topk_*): lists val, id [T, k] best first
 * (larger logit, ties by the lower global id; empty: −inf, id −1). clear:
 * all empty; online: logits [T, V] of global columns v0 .. v0+V−1 merged in;
 * merge: val, id (=) the top-k of P lists cval, cid [P, T, k] (all-gathered);
 * logprobs: lp [T, k] (may alias val) = (val − M) − log(se) as
 * xent_logprobs computes a target's (bitwise the same for the same logit). */
int ml_be_xent_topk_clear(ml_backend *be, int64_t T, int64_t k, float *val, int32_t *id);
int ml_be_xent_topk_online(ml_backend *be, const float *logits, int64_t T, int64_t V, int64_t v0,
                           int64_t k, float *val, int32_t *id);
int ml_be_xent_topk_merge(ml_backend *be, int64_t P, int64_t T, int64_t k, const float *cval,
                          const int32_t *cid, float *val, int32_t *id);
int ml_be_xent_topk_logprobs(ml_backend *be, int64_t T, int64_t k, const float *M,
                             const float *se, const float *val, const int32_t *id, float *lp);
/* One AdamW step (torch.optim.AdamW, single-tensor) on p, m, v [n] with g.
 * grad_scale != 1: g *= grad_scale first, in the same pass (the clipping
 * of clip_grad_norm_ folded into the step: g and the step bit for bit
 * those of ml_be_scale then the step); 1: g is only read. p_bf16 [n]
 * (bf16 bits) or NULL: the updated p rounded to bf16 in the same pass,
 * bit for bit ml_be_convert(p_bf16, ML_BF16, p, ML_F32, n) afterwards
 * (FSDP's persistent param_dtype shard, parallel/fsdp.h). */
int ml_be_adamw(ml_backend *be, float *p, float *g, float *m, float *v, uint16_t *p_bf16,
                int64_t n, float grad_scale, double lr, double b1, double b2, double eps, double wd,
                int64_t step);
/* *out (host) = the partial `kind` of g [n]. */
int ml_be_norm_partial(ml_backend *be, const float *g, int64_t n, ml_norm_kind kind, double *out);
/* out[s] (=) the partial `kind` of segs[s] for s < k, each bitwise what
 * ml_be_norm_partial returns for that piece, left in device memory: out
 * [k] doubles is device memory (ml_be_alloc), issued on the compute
 * stream without waiting for it (a later ml_be_copy to the host reads
 * them: one copy for many calls, where ml_be_norm_partial waits per
 * piece). segs is host memory, read before the call returns. CUDA: one
 * pair of launches per 32 pieces (kernels/cuda kc_norm_segs). Errors: k <
 * 0, a piece with n < 0, the device's. */
int ml_be_norm_partials(ml_backend *be, const ml_norm_seg *segs, int k, ml_norm_kind kind,
                        double *out);
/* *found (host) = whether g [n] holds a NaN or ±inf. */
int ml_be_find_nonfinite(ml_backend *be, const float *g, int64_t n, bool *found);

#endif
