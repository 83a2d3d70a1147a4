/* The CUDA backend's GEMM (cuda.h): ml_gemm on cuBLASLt.
 *
 * Layout: ml_gemm is row-major, cuBLASLt column-major; gemm_map.h maps one
 * onto the other (cuBLASLt's A is our B, its B our A, m = N, n = M), and
 * the bias epilogue's vector is our [N].
 *
 * Types. fp32 compute: fp32 operands, CUBLAS_COMPUTE_32F — never TF32 (the
 * parity mode). bf16 compute: bf16 operands (fp32 ones rounded into pool
 * scratch first, nearest-even, as autocast casts them), fp32 C and D,
 * CUBLAS_COMPUTE_32F: fp32 accumulation, torch's bf16 GEMM under autocast
 * with its output kept in fp32. A bias is fp32 (bf16 ones widened).
 * A bf16 output (ml_gemm.c_bf16): C = D in CUDA_R_16BF, the fp32
 * accumulator (+ bias) rounded once in the epilogue, torch's bf16 GEMM
 * under autocast. cuBLASLt takes a bf16 D's bias in bf16 only
 * (CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE), so a bf16 bias is passed as it is
 * (its values, widened in the epilogue, are the fp32 ones); with an fp32
 * bias, or K = 0, the product goes to fp32 pool scratch and is rounded
 * after it (kc_f32_to_bf16).
 *
 * Descriptors, layouts and the heuristic's algorithm are cached per call
 * shape (key below); alignment of the pointers is part of the key, since
 * cuBLASLt's kernels need the alignment they were chosen for.
 *
 * cuBLASLt is loaded when the first GEMM state is made (cublaslt_lib.h),
 * not linked: a CUDA build running on the CPU never maps it. */
#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cublaslt_lib.h"
#include "backend/cuda/cuda.h"
#include "backend/cuda/gemm_map.h"
#include "common/status.h"
#include "kernels/cuda/kernels.h"

enum {
  WORKSPACE_BYTES = 32 << 20, /* cuBLASLt's recommended workspace on Hopper */
  CACHE_CAP = 256,
};

typedef struct key {
  int64_t M, N, K, lda, ldb, ldc;
  int ta, tb, bf16, bias, c_bf16;
  int align_a, align_b, align_c; /* of cuBLASLt's A, B, C: bytes, a power of two <= 256 */
} key;

typedef struct entry {
  key k;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc; /* cuBLASLt's A (our B), B (our A), C = D */
  cublasLtMatmulAlgo_t algo;
} entry;

struct ml_cuda_gemm {
  ml_backend *be;
  cudaStream_t stream;
  cublasLtHandle_t lt;
  void *workspace;
  entry cache[CACHE_CAP];
  int n, next; /* entries used; the next one to replace once full */
};

/* cuBLASLt's entry points (the process's one copy), set by the first
 * ml_cuda_gemm_create; every other function here runs on a state it made. */
static const ml_cublaslt_lib *api;

static int lt_check(cublasStatus_t st, const char *what) {
  if (st == CUBLAS_STATUS_SUCCESS) return 0;
  return ml_err("cuBLASLt: %s: %s (%s)", what, api->GetStatusName(st),
                api->GetStatusString(st));
}

static int align_of(const void *p) {
  uintptr_t a = (uintptr_t)p;
  int al = 1;
  while (al < 256 && !(a & (uintptr_t)al)) al <<= 1;
  return al;
}

static void entry_release(entry *e) {
  if (e->lc) api->MatrixLayoutDestroy(e->lc);
  if (e->lb) api->MatrixLayoutDestroy(e->lb);
  if (e->la) api->MatrixLayoutDestroy(e->la);
  if (e->desc) api->MatmulDescDestroy(e->desc);
  memset(e, 0, sizeof *e);
}

static int set_attr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, const void *v,
                    size_t n) {
  return lt_check(api->MatmulDescSetAttribute(d, a, v, n), "cublasLtMatmulDescSetAttribute");
}

/* Descriptors and the heuristic's best algorithm for k into e. */
static int entry_build(ml_cuda_gemm *g, const key *k, entry *e) {
  memset(e, 0, sizeof *e);
  e->k = *k;
  ml_gemm shape = {.trans_a = k->ta, .trans_b = k->tb, .M = k->M, .N = k->N, .K = k->K,
                   .lda = k->lda, .ldb = k->ldb, .ldc = k->ldc};
  ml_lt_gemm l = ml_lt_gemm_of(&shape);
  cudaDataType_t in = k->bf16 ? CUDA_R_16BF : CUDA_R_32F;
  cublasOperation_t opa = l.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t opb = l.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  int rc = lt_check(api->MatmulDescCreate(&e->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                    "cublasLtMatmulDescCreate");
  if (!rc)
    rc = set_attr(e->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa) ||
         set_attr(e->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb);
  if (!rc && k->bias) {
    cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
    cudaDataType_t bt = k->c_bf16 ? CUDA_R_16BF : CUDA_R_32F;
    rc = set_attr(e->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep) ||
         set_attr(e->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt);
  }
  if (!rc)
    rc = lt_check(api->MatrixLayoutCreate(&e->la, in, l.a_rows, l.a_cols, l.lda),
                  "cublasLtMatrixLayoutCreate") ||
         lt_check(api->MatrixLayoutCreate(&e->lb, in, l.b_rows, l.b_cols, l.ldb),
                  "cublasLtMatrixLayoutCreate") ||
         lt_check(api->MatrixLayoutCreate(&e->lc, k->c_bf16 ? CUDA_R_16BF : CUDA_R_32F,
                                          l.c_rows, l.c_cols, l.ldc),
                  "cublasLtMatrixLayoutCreate");
  cublasLtMatmulPreference_t pref = NULL;
  if (!rc) rc = lt_check(api->MatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  if (!rc) {
    size_t ws = WORKSPACE_BYTES;
    uint32_t al[4] = {(uint32_t)k->align_a, (uint32_t)k->align_b, (uint32_t)k->align_c,
                      (uint32_t)k->align_c};
    cublasLtMatmulPreferenceAttributes_t at[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    rc = lt_check(api->MatmulPreferenceSetAttribute(
                      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
                  "cublasLtMatmulPreferenceSetAttribute");
    for (int i = 0; i < 4 && !rc; i++)
      rc = lt_check(api->MatmulPreferenceSetAttribute(pref, at[i], &al[i], sizeof al[i]),
                    "cublasLtMatmulPreferenceSetAttribute");
  }
  if (!rc) {
    cublasLtMatmulHeuristicResult_t best;
    int found = 0;
    rc = lt_check(api->MatmulAlgoGetHeuristic(g->lt, e->desc, e->la, e->lb, e->lc, e->lc, pref, 1,
                                              &best, &found),
                  "cublasLtMatmulAlgoGetHeuristic");
    if (!rc && found < 1)
      rc = ml_err("cuBLASLt: no algorithm for a %s GEMM [%lld x %lld] x [%lld x %lld]%s%s "
                  "(leading dimensions %lld, %lld, %lld)",
                  k->bf16 ? "bf16" : "fp32", (long long)k->M, (long long)k->K, (long long)k->K,
                  (long long)k->N, k->ta ? " A^T" : "", k->tb ? " B^T" : "", (long long)k->lda,
                  (long long)k->ldb, (long long)k->ldc);
    if (!rc) e->algo = best.algo;
  }
  if (pref) api->MatmulPreferenceDestroy(pref);
  if (rc) entry_release(e);
  return rc;
}

/* The cached entry for k, built on first use (the oldest replaced when full). */
static entry *lookup(ml_cuda_gemm *g, const key *k) {
  for (int i = 0; i < g->n; i++)
    if (!memcmp(&g->cache[i].k, k, sizeof *k)) return &g->cache[i];
  entry *e = &g->cache[g->n < CACHE_CAP ? g->n : g->next];
  if (g->n == CACHE_CAP) {
    entry_release(e);
    g->next = (g->next + 1) % CACHE_CAP;
  }
  if (entry_build(g, k, e)) return NULL;
  if (g->n < CACHE_CAP) g->n++;
  return e;
}

/* An operand stored [rows, cols] with stride ld as bf16: itself, or fp32
 * rounded into pool scratch with the same stride (the gaps between rows are
 * left unset; cuBLASLt never reads them). */
/* Elements of to_bf16's scratch: 0 for a bf16 operand, else through the last row's end
 * (not its stride). */
static int64_t bf16_elems(ml_dtype type, int64_t rows, int64_t cols, int64_t ld) {
  return type == ML_BF16 ? 0 : (rows - 1) * ld + cols;
}

static int to_bf16(ml_cuda_gemm *g, const void *p, ml_dtype type, int64_t rows, int64_t cols,
                   int64_t ld, const void **out, void **mem) {
  *out = p;
  *mem = NULL;
  int64_t n = bf16_elems(type, rows, cols, ld);
  if (!n) return 0;
  *mem = ml_be_alloc(g->be, n, sizeof(uint16_t), "a bf16 GEMM operand [%lld x %lld]",
                     (long long)rows, (long long)cols);
  if (!*mem) return -1;
  *out = *mem;
  return ml_cuda_launched(kc_f32_to_bf16(g->stream, p, *mem, n), "GEMM operand to bf16");
}

/* K = 0: every product is an empty sum, so C (=|+=) 0 (+ bias). */
static int empty_sum(ml_cuda_gemm *g, const ml_gemm *a, const float *bias) {
  if (!a->accumulate)
    ML_TRY(ml_cuda_check(cudaMemset2DAsync(a->C, (size_t)a->ldc * sizeof(float), 0,
                                           (size_t)a->N * sizeof(float), (size_t)a->M,
                                           g->stream),
                         "cudaMemset2DAsync"));
  if (!bias) return 0;
  return ml_cuda_launched(kc_add_bias_rows(g->stream, a->C, a->ldc, a->M, a->N, bias),
                          "GEMM bias rows");
}

/* A bf16 C that cuBLASLt does not write (see the top): the fp32 product into
 * pool scratch [M, N], each row then rounded to nearest-even into C. */
static int via_f32(ml_cuda_gemm *g, const ml_gemm *a) {
  float *t = ml_be_alloc(g->be, a->M * a->N, sizeof(float),
                         "a GEMM's fp32 output before its bf16 rounding [%lld x %lld]",
                         (long long)a->M, (long long)a->N);
  if (!t) return -1;
  ml_gemm f = *a;
  f.C = t, f.ldc = a->N, f.c_bf16 = false;
  int rc = ml_cuda_gemm_run(g, &f);
  bool whole = a->ldc == a->N; /* contiguous rows: one launch */
  for (int64_t r = 0; !rc && r < (whole ? 1 : a->M); r++)
    rc = ml_cuda_launched(kc_f32_to_bf16(g->stream, t + r * a->N, (uint16_t *)a->C + r * a->ldc,
                                         whole ? a->M * a->N : a->N),
                          "GEMM output to bf16");
  ml_be_free(g->be, t);
  return rc;
}

/* Whether a's bf16 C goes through via_f32 (see the top). */
static bool c_via_f32(const ml_gemm *a) {
  return a->c_bf16 && (a->K == 0 || a->compute != ML_BF16 || (a->bias && a->bias_type != ML_BF16));
}

int64_t ml_cuda_gemm_temp(const ml_gemm *a) {
  bool via = c_via_f32(a); /* then the run below has an fp32 C */
  int64_t c = via ? a->M * a->N * (int64_t)sizeof(float) : 0;
  bool widen_bias = a->bias && a->bias_type == ML_BF16 && (via || !a->c_bf16);
  int64_t s = widen_bias ? a->N * (int64_t)sizeof(float) : 0;
  if (a->K > 0 && a->compute == ML_BF16) /* ml_cuda_gemm_run's operands, as to_bf16 takes them */
    s += (int64_t)sizeof(uint16_t) *
         (bf16_elems(a->a_type, a->trans_a ? a->K : a->M, a->trans_a ? a->M : a->K, a->lda) +
          bf16_elems(a->b_type, a->trans_b ? a->N : a->K, a->trans_b ? a->K : a->N, a->ldb));
  return c + s;
}

int ml_cuda_gemm_run(ml_cuda_gemm *g, const ml_gemm *a) {
  if (c_via_f32(a)) return via_f32(g, a);
  void *mem[3] = {NULL, NULL, NULL};
  const void *bias = a->bias;
  int rc = 0;
  if (a->bias && a->bias_type == ML_BF16 && !a->c_bf16) {
    mem[2] = ml_be_alloc(g->be, a->N, sizeof(float), "a GEMM bias [%lld]", (long long)a->N);
    rc = !mem[2] ||
         ml_cuda_launched(kc_bf16_to_f32(g->stream, a->bias, mem[2], a->N), "GEMM bias to fp32");
    bias = mem[2];
  }
  if (!rc && a->K == 0) rc = empty_sum(g, a, (const float *)bias); /* fp32 C: via_f32 */
  else if (!rc) {
    key k;
    memset(&k, 0, sizeof k); /* compared bytewise */
    k.M = a->M, k.N = a->N, k.K = a->K, k.lda = a->lda, k.ldb = a->ldb, k.ldc = a->ldc;
    k.ta = a->trans_a, k.tb = a->trans_b, k.bf16 = a->compute == ML_BF16, k.bias = !!bias;
    k.c_bf16 = a->c_bf16;
    const void *A = a->A, *B = a->B;
    if (k.bf16)
      rc = to_bf16(g, a->A, a->a_type, a->trans_a ? a->K : a->M, a->trans_a ? a->M : a->K,
                   a->lda, &A, &mem[0]) ||
           to_bf16(g, a->B, a->b_type, a->trans_b ? a->N : a->K, a->trans_b ? a->K : a->N,
                   a->ldb, &B, &mem[1]);
    const void *lt_a, *lt_b; /* cuBLASLt's A and B */
    ml_lt_operands(A, B, &lt_a, &lt_b);
    k.align_a = align_of(lt_a), k.align_b = align_of(lt_b), k.align_c = align_of(a->C);
    entry *e = rc ? NULL : lookup(g, &k);
    if (!rc && !e) rc = -1;
    if (!rc && bias) rc = set_attr(e->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias);
    if (!rc) {
      float alpha = 1.0f, beta = a->accumulate ? 1.0f : 0.0f;
      rc = lt_check(api->Matmul(g->lt, e->desc, &alpha, lt_a, e->la, lt_b, e->lb, &beta, a->C,
                                e->lc, a->C, e->lc, &e->algo, g->workspace, WORKSPACE_BYTES,
                                g->stream),
                    "cublasLtMatmul");
    }
  }
  for (int i = 0; i < 3; i++) ml_be_free(g->be, mem[i]); /* stream-ordered reuse: cuda.c */
  return rc ? -1 : 0;
}

int ml_cuda_gemm_create(ml_backend *be, void *stream, ml_cuda_gemm **out) {
  ML_TRY(ml_cublaslt_lib_get(&api));
  ml_cuda_gemm *g = ml_calloc(1, sizeof *g, "the cuBLASLt GEMM");
  if (!g) return -1;
  g->be = be;
  g->stream = stream;
  int rc = lt_check(api->Create(&g->lt), "cublasLtCreate");
  if (!rc) {
    g->workspace = ml_be_alloc(be, WORKSPACE_BYTES, 1, "cuBLASLt's workspace");
    rc = !g->workspace;
  }
  if (rc) {
    ml_cuda_gemm_destroy(g);
    return -1;
  }
  *out = g;
  return 0;
}

void ml_cuda_gemm_destroy(ml_cuda_gemm *g) {
  if (!g) return;
  for (int i = 0; i < g->n; i++) entry_release(&g->cache[i]);
  if (g->lt) api->Destroy(g->lt);
  ml_be_free(g->be, g->workspace);
  free(g);
}
