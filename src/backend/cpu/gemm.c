/* ml_be_gemm on the CPU through oneDNN's matmul primitive (oneDNN 2.x C
 * API). oneDNN picks the ISA at run time: AMX tiles on Sapphire Rapids and
 * later, AVX512-BF16 dot products on Zen 4 / Cooper Lake, fp32 FMAs
 * elsewhere (bf16 then emulated). Operands are described with strides, so
 * transposed operands cost no copy; fp32 operands of a bf16 GEMM are
 * rounded into contiguous bf16 scratch first (torch.autocast's cast). A
 * primitive is built once per distinct (shape, layout, dtypes, epilogue)
 * and cached; a training step has a few dozen of them. */
#include <oneapi/dnnl/dnnl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "common/status.h"

enum { CACHE = 128 };

typedef struct key {
  int64_t M, N, K, lda, ldb, ldc;
  int ta, tb, accumulate, bias;
  dnnl_data_type_t dt;
} key;

typedef struct entry {
  key k;
  uint64_t used; /* last use (LRU clock); 0: empty */
  dnnl_primitive_t prim;
  dnnl_memory_t a, b, c, bias;
} entry;

struct ml_cpu_gemm {
  ml_backend *be; /* its pool serves the conversion scratch */
  bool bf16_native; /* oneDNN has a bf16 matmul for this CPU (else emulated, see operand) */
  dnnl_engine_t eng;
  dnnl_stream_t stream;
  entry cache[CACHE];
  uint64_t clock;
};

static int dnnl_check(dnnl_status_t s, const char *what, const key *k) {
  if (s == dnnl_success) return 0;
  return ml_err("oneDNN %s failed (status %d) for a %s GEMM [%lld x %lld] x [%lld x %lld]%s%s",
                what, (int)s, k->dt == dnnl_bf16 ? "bf16" : "fp32", (long long)k->M,
                (long long)k->K, (long long)k->K, (long long)k->N, k->ta ? ", A transposed" : "",
                k->tb ? ", B transposed" : "");
}

/* Whether oneDNN implements a bf16 matmul on this CPU (AVX512-BF16, AMX,
 * or its avx512_core emulation; not on AVX2-only CPUs, nor under
 * ONEDNN_MAX_CPU_ISA=AVX2). */
static bool probe_bf16(ml_cpu_gemm *g) {
  dnnl_memory_desc_t a, c;
  dnnl_dims_t d = {16, 16};
  dnnl_matmul_desc_t md;
  dnnl_primitive_desc_t pd = NULL;
  bool ok = dnnl_memory_desc_init_by_tag(&a, 2, d, dnnl_bf16, dnnl_ab) == dnnl_success &&
            dnnl_memory_desc_init_by_tag(&c, 2, d, dnnl_f32, dnnl_ab) == dnnl_success &&
            dnnl_matmul_desc_init(&md, &a, &a, NULL, &c) == dnnl_success &&
            dnnl_primitive_desc_create(&pd, &md, NULL, g->eng, NULL) == dnnl_success;
  if (pd) dnnl_primitive_desc_destroy(pd);
  return ok;
}

int ml_cpu_gemm_create(ml_backend *pool_be, ml_cpu_gemm **out) {
  ml_cpu_gemm *g = ml_calloc(1, sizeof *g, "the oneDNN GEMM state");
  if (!g) return -1;
  g->be = pool_be;
  key none = {0};
  if (dnnl_check(dnnl_engine_create(&g->eng, dnnl_cpu, 0), "engine creation", &none) ||
      dnnl_check(dnnl_stream_create(&g->stream, g->eng, dnnl_stream_default_flags),
                 "stream creation", &none)) {
    ml_cpu_gemm_destroy(g);
    return -1;
  }
  g->bf16_native = probe_bf16(g);
  *out = g;
  return 0;
}

static void entry_clear(entry *e) {
  if (e->prim) dnnl_primitive_destroy(e->prim);
  dnnl_memory_t mems[4] = {e->a, e->b, e->c, e->bias};
  for (int i = 0; i < 4; i++)
    if (mems[i]) dnnl_memory_destroy(mems[i]);
  memset(e, 0, sizeof *e);
}

void ml_cpu_gemm_destroy(ml_cpu_gemm *g) {
  if (!g) return;
  for (int i = 0; i < CACHE; i++) entry_clear(&g->cache[i]);
  if (g->stream) dnnl_stream_destroy(g->stream);
  if (g->eng) dnnl_engine_destroy(g->eng);
  free(g);
}

/* A 2-D row-major operand [rows, cols] of stride ld, or its transpose. */
static dnnl_status_t operand_md(dnnl_memory_desc_t *md, int64_t rows, int64_t cols, int64_t ld,
                                int trans, dnnl_data_type_t dt) {
  dnnl_dims_t dims = {rows, cols};
  dnnl_dims_t strides = {ld, 1};
  if (trans) { /* stored [cols, rows] with stride ld */
    strides[0] = 1;
    strides[1] = ld;
  }
  return dnnl_memory_desc_init_by_strides(md, 2, dims, dt, strides);
}

/* Build the primitive and its memory objects for key k into e. */
static int entry_build(ml_cpu_gemm *g, const key *k, entry *e) {
  dnnl_memory_desc_t a, b, c, bias;
  dnnl_dims_t cdims = {k->M, k->N}, cstr = {k->ldc, 1}, bdims = {1, k->N};
  int rc = dnnl_check(operand_md(&a, k->M, k->K, k->lda, k->ta, k->dt), "memory desc", k);
  if (!rc) rc = dnnl_check(operand_md(&b, k->K, k->N, k->ldb, k->tb, k->dt), "memory desc", k);
  if (!rc)
    rc = dnnl_check(dnnl_memory_desc_init_by_strides(&c, 2, cdims, dnnl_f32, cstr), "memory desc",
                    k);
  if (!rc && k->bias)
    rc = dnnl_check(dnnl_memory_desc_init_by_tag(&bias, 2, bdims, dnnl_f32, dnnl_ab),
                    "memory desc", k);
  if (rc) return -1;
  dnnl_matmul_desc_t md;
  ML_TRY(dnnl_check(dnnl_matmul_desc_init(&md, &a, &b, k->bias ? &bias : NULL, &c), "matmul desc",
                    k));
  dnnl_primitive_attr_t attr = NULL;
  dnnl_post_ops_t po = NULL;
  rc = dnnl_check(dnnl_primitive_attr_create(&attr), "attribute", k);
  if (!rc && k->accumulate) { /* C += A·B: the sum post-op reads C before writing it */
    rc = dnnl_check(dnnl_post_ops_create(&po), "post-ops", k);
    if (!rc) rc = dnnl_check(dnnl_post_ops_append_sum(po, 1.0f), "sum post-op", k);
    if (!rc) rc = dnnl_check(dnnl_primitive_attr_set_post_ops(attr, po), "post-ops", k);
  }
  dnnl_primitive_desc_t pd = NULL;
  if (!rc) rc = dnnl_check(dnnl_primitive_desc_create(&pd, &md, attr, g->eng, NULL), "matmul", k);
  if (!rc) rc = dnnl_check(dnnl_primitive_create(&e->prim, pd), "matmul primitive", k);
  if (pd) dnnl_primitive_desc_destroy(pd);
  if (po) dnnl_post_ops_destroy(po);
  if (attr) dnnl_primitive_attr_destroy(attr);
  /* memory objects without buffers: each run sets its pointers */
  if (!rc) rc = dnnl_check(dnnl_memory_create(&e->a, &a, g->eng, DNNL_MEMORY_NONE), "memory", k);
  if (!rc) rc = dnnl_check(dnnl_memory_create(&e->b, &b, g->eng, DNNL_MEMORY_NONE), "memory", k);
  if (!rc) rc = dnnl_check(dnnl_memory_create(&e->c, &c, g->eng, DNNL_MEMORY_NONE), "memory", k);
  if (!rc && k->bias)
    rc = dnnl_check(dnnl_memory_create(&e->bias, &bias, g->eng, DNNL_MEMORY_NONE), "memory", k);
  if (rc) {
    entry_clear(e);
    return -1;
  }
  e->k = *k;
  return 0;
}

/* The cached primitive for k, built on a miss (evicting the least
 * recently used). */
static entry *lookup(ml_cpu_gemm *g, const key *k) {
  entry *victim = &g->cache[0];
  for (int i = 0; i < CACHE; i++) {
    entry *e = &g->cache[i];
    if (e->used && memcmp(&e->k, k, sizeof *k) == 0) {
      e->used = ++g->clock;
      return e;
    }
    if (e->used < victim->used) victim = e;
  }
  entry_clear(victim);
  if (entry_build(g, k, victim)) return NULL;
  victim->used = ++g->clock;
  return victim;
}

/* src [rows, cols] of stride ld (`type`) → dst [rows, cols] contiguous:
 * bf16 (fp32 sources rounded), or, to emulate a bf16 GEMM where the CPU
 * has none, fp32 holding the bf16 values (rounded, then widened exactly). */
static void to_compute(const void *src, ml_dtype type, int64_t rows, int64_t cols, int64_t ld,
                       void *dst, bool emulate) {
#pragma omp parallel for
  for (int64_t r = 0; r < rows; r++) {
    if (type == ML_BF16) { /* emulation: widen */
      ml_convert_to_f32(ML_BF16, (const uint16_t *)src + r * ld, (float *)dst + r * cols,
                        (size_t)cols);
    } else if (emulate) {
      float *d = (float *)dst + r * cols;
      const float *x = (const float *)src + r * ld;
      for (int64_t c = 0; c < cols; c++) d[c] = ml_bf16_to_f32(ml_f32_to_bf16(x[c]));
    } else {
      ml_convert_from_f32(ML_BF16, (const float *)src + r * ld, (uint16_t *)dst + r * cols,
                          (size_t)cols);
    }
  }
}

/* The operand as the GEMM's compute dtype wants it: as it is, or rounded
 * (emulated bf16: rounded and widened) into pool scratch (*scratch, freed
 * by the caller) with its new stride. */
static int operand(ml_cpu_gemm *g, const void *p, ml_dtype type, ml_dtype compute, int64_t rows,
                   int64_t cols, int64_t *ld, const void **out, void **scratch) {
  *out = p;
  bool emulate = compute == ML_BF16 && !g->bf16_native;
  if (type == compute && !emulate) return 0;
  if (compute == ML_F32)
    return ml_err("GEMM: a %s operand in an fp32 GEMM; expected fp32 operands (or compute bf16)",
                  ml_dtype_name(type));
  /* stored [rows, cols] with stride ld */
  void *s = ml_be_alloc(g->be, (int64_t)rows * cols, emulate ? sizeof(float) : sizeof(uint16_t),
                        "a bf16 GEMM operand [%lld x %lld]", (long long)rows, (long long)cols);
  if (!s) return -1;
  to_compute(p, type, rows, cols, *ld, s, emulate);
  *ld = cols;
  *out = s;
  *scratch = s;
  return 0;
}

static int check_args(const ml_gemm *a) {
  bool types_ok = (a->a_type == ML_F32 || a->a_type == ML_BF16) &&
                  (a->b_type == ML_F32 || a->b_type == ML_BF16) &&
                  (a->compute == ML_F32 || a->compute == ML_BF16) &&
                  (!a->bias || a->bias_type == ML_F32 || a->bias_type == ML_BF16);
  if (!types_ok) return ml_err("GEMM: operand dtypes must be F32 or BF16");
  int64_t a_cols = a->trans_a ? a->M : a->K, b_cols = a->trans_b ? a->K : a->N;
  if (a->M < 0 || a->N < 0 || a->K < 0 || a->lda < a_cols || a->ldb < b_cols || a->ldc < a->N)
    return ml_err("GEMM [%lld x %lld] x [%lld x %lld]: leading dimensions %lld, %lld, %lld are "
                  "smaller than the rows they hold",
                  (long long)a->M, (long long)a->K, (long long)a->K, (long long)a->N,
                  (long long)a->lda, (long long)a->ldb, (long long)a->ldc);
  return 0;
}

/* K = 0: every product is an empty sum, so C (=|+=) 0 (+ bias). */
static int empty_sum(const ml_gemm *a) {
#pragma omp parallel for
  for (int64_t r = 0; r < a->M; r++) {
    float *c = a->C + r * a->ldc;
    for (int64_t j = 0; j < a->N; j++) {
      float b = !a->bias ? 0.0f
                : a->bias_type == ML_BF16 ? ml_bf16_to_f32(((const uint16_t *)a->bias)[j])
                                          : ((const float *)a->bias)[j];
      c[j] = a->accumulate ? c[j] + b : b;
    }
  }
  return 0;
}

int ml_cpu_gemm_run(ml_cpu_gemm *g, const ml_gemm *a) {
  ML_TRY(check_args(a));
  if (a->M == 0 || a->N == 0) return 0;
  if (a->K == 0) return empty_sum(a); /* an empty torch.chunk shard of the inner dim */
  key k;
  memset(&k, 0, sizeof k); /* the cache compares keys bytewise, padding included */
  k.M = a->M, k.N = a->N, k.K = a->K, k.lda = a->lda, k.ldb = a->ldb, k.ldc = a->ldc;
  k.ta = a->trans_a, k.tb = a->trans_b, k.accumulate = a->accumulate, k.bias = !!a->bias;
  k.dt = a->compute == ML_BF16 && g->bf16_native ? dnnl_bf16 : dnnl_f32;
  const void *A, *B;
  void *sa = NULL, *sb = NULL;
  float *bias = NULL;
  int rc = operand(g, a->A, a->a_type, a->compute, a->trans_a ? a->K : a->M,
                   a->trans_a ? a->M : a->K, &k.lda, &A, &sa);
  if (!rc)
    rc = operand(g, a->B, a->b_type, a->compute, a->trans_b ? a->N : a->K,
                 a->trans_b ? a->K : a->N, &k.ldb, &B, &sb);
  if (!rc && a->bias && a->bias_type == ML_BF16) {
    bias = ml_be_alloc(g->be, a->N, sizeof(float), "a GEMM bias [%lld]", (long long)a->N);
    if (!bias) rc = -1;
    else ml_convert_to_f32(ML_BF16, a->bias, bias, (size_t)a->N);
  }
  entry *e = rc ? NULL : lookup(g, &k);
  if (e) {
    dnnl_memory_set_data_handle(e->a, (void *)A);
    dnnl_memory_set_data_handle(e->b, (void *)B);
    dnnl_memory_set_data_handle(e->c, a->C);
    dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, e->a}, {DNNL_ARG_WEIGHTS, e->b},
                               {DNNL_ARG_DST, e->c}, {DNNL_ARG_BIAS, e->bias}};
    if (k.bias) dnnl_memory_set_data_handle(e->bias, bias ? bias : (void *)a->bias);
    rc = dnnl_check(dnnl_primitive_execute(e->prim, g->stream, k.bias ? 4 : 3, args), "execute",
                    &k);
    if (!rc) rc = dnnl_check(dnnl_stream_wait(g->stream), "stream wait", &k);
  } else {
    rc = -1;
  }
  ml_be_free(g->be, sa);
  ml_be_free(g->be, sb);
  ml_be_free(g->be, bias);
  return rc;
}
