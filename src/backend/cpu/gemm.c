/* ml_be_gemm on the CPU through oneDNN's matmul primitive (oneDNN 2.x C
 * API), and the bf16 tile GEMMs of attention. oneDNN picks the ISA at run
 * time: AMX tiles on Sapphire Rapids and later, AVX512-BF16 dot products
 * on Zen 4 / Cooper Lake, fp32 FMAs elsewhere (bf16 then emulated).
 * Operands are described with strides, so transposed operands cost no
 * copy; fp32 operands of a bf16 GEMM are rounded into contiguous bf16
 * scratch first (torch.autocast's cast), except those flagged bf16-exact
 * (ml_gemm.a_exact) where the GEMM reads fp32 (operand_bytes). A bf16
 * output (ml_gemm.c_bf16) is rounded to nearest-even once, at the fixed
 * kernel's store, or after oneDNN's fp32 product (ml_convert_from_f32):
 * not oneDNN's bf16 dst,
 * whose AVX512-BF16 and AMX stores convert with VCVTNEPS2BF16, which
 * treats subnormal values as zero, so its bits would differ from every
 * other path's (and the CUDA backend's) on tiny outputs. A
 * primitive is built once per distinct (shape, layout, dtypes, epilogue)
 * and cached; a training step has a few dozen of them. Tiles run inside
 * the attention kernel's OpenMP region, each thread with its own cache and
 * stream (oneDNN runs a call from inside a parallel region on the calling
 * thread alone). */
#include <oneapi/dnnl/dnnl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "common/checked.h"
#include "common/status.h"
#include "kernels/cpu/kernels.h"

enum { CACHE = 128, TILE_CACHE = 64 };

typedef struct key {
  int64_t M, N, K, lda, ldb, ldc;
  int ta, tb, accumulate, bias;
  dnnl_data_type_t dt; /* the operands' */
} key;

typedef struct entry {
  key k;
  uint64_t used; /* last use (LRU clock); 0: empty */
  dnnl_primitive_t prim;
  dnnl_memory_t a, b, c, bias, pad;
  void *pad_buf; /* a tile's own scratchpad (NULL: oneDNN's) */
} entry;

/* Primitives by key, least recently used evicted. */
typedef struct cache {
  entry *e;
  int n;
  uint64_t clock;
} cache;

/* One OpenMP thread's tile GEMMs: its primitives, its stream, its
 * product scratch (see ml_cpu_gemm_tile), and its first failure (reported
 * by the driving thread: messages are per thread). */
typedef struct tiles {
  cache c;
  dnnl_stream_t stream;
  float *acc; /* [acc_cap] op(A)·op(B) of a scaled, accumulating tile */
  int64_t acc_cap;
  dnnl_status_t status;
  const char *what;
  key failed;
} tiles;

struct ml_cpu_gemm {
  ml_backend *be; /* its pool serves the conversion scratch */
  bool bf16_native; /* oneDNN has a bf16 matmul for this CPU (else emulated, see operand) */
  bool fixed;       /* batch-invariant mode: products A·B^T on ml_cpu_gemm_fixed */
  dnnl_engine_t eng;
  dnnl_stream_t stream;
  entry main[CACHE];
  cache c;
  tiles *tiles; /* [ntiles], one per OpenMP thread of ml_cpu_gemm_tile */
  int ntiles;
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

int ml_cpu_gemm_onednn_cache_bound(void) {
  if (getenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY") || getenv("DNNL_PRIMITIVE_CACHE_CAPACITY"))
    return 0; /* the user's setting stands */
  key none = {0};
  return dnnl_check(dnnl_set_primitive_cache_capacity(ML_CPU_GEMM_ONEDNN_CACHE),
                    "primitive cache capacity", &none);
}

int ml_cpu_gemm_create(ml_backend *pool_be, ml_cpu_gemm **out) {
  ml_cpu_gemm *g = ml_calloc(1, sizeof *g, "the oneDNN GEMM state");
  if (!g) return -1;
  g->be = pool_be;
  g->c = (cache){g->main, CACHE, 0};
  key none = {0};
  if (ml_cpu_gemm_onednn_cache_bound()) {
    ml_cpu_gemm_destroy(g);
    return -1;
  }
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
  dnnl_memory_t mems[5] = {e->a, e->b, e->c, e->bias, e->pad};
  for (int i = 0; i < 5; i++)
    if (mems[i]) dnnl_memory_destroy(mems[i]);
  free(e->pad_buf);
  memset(e, 0, sizeof *e);
}

static void cache_clear(cache *c) {
  for (int i = 0; i < c->n; i++) entry_clear(&c->e[i]);
}

void ml_cpu_gemm_destroy(ml_cpu_gemm *g) {
  if (!g) return;
  cache_clear(&g->c);
  for (int t = 0; t < g->ntiles; t++) {
    cache_clear(&g->tiles[t].c);
    free(g->tiles[t].c.e);
    free(g->tiles[t].acc);
    if (g->tiles[t].stream) dnnl_stream_destroy(g->tiles[t].stream);
  }
  free(g->tiles);
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

/* Build the primitive and its memory objects for key k into e; a tile
 * (user_pad) gets a scratchpad of its own. On failure *what names the
 * step and e is left empty. */
static dnnl_status_t entry_build(ml_cpu_gemm *g, const key *k, bool user_pad, entry *e,
                                 const char **what) {
  dnnl_memory_desc_t a, b, c, bias;
  dnnl_dims_t cdims = {k->M, k->N}, cstr = {k->ldc, 1}, bdims = {1, k->N};
  dnnl_matmul_desc_t md;
  dnnl_primitive_attr_t attr = NULL;
  dnnl_post_ops_t po = NULL;
  dnnl_primitive_desc_t pd = NULL;
  dnnl_status_t st;
#define STEP(call, name) \
  if ((st = (call)) != dnnl_success) { \
    *what = (name); \
    goto done; \
  }
  STEP(operand_md(&a, k->M, k->K, k->lda, k->ta, k->dt), "memory desc");
  STEP(operand_md(&b, k->K, k->N, k->ldb, k->tb, k->dt), "memory desc");
  STEP(dnnl_memory_desc_init_by_strides(&c, 2, cdims, dnnl_f32, cstr), "memory desc");
  if (k->bias)
    STEP(dnnl_memory_desc_init_by_tag(&bias, 2, bdims, dnnl_f32, dnnl_ab), "memory desc");
  STEP(dnnl_matmul_desc_init(&md, &a, &b, k->bias ? &bias : NULL, &c), "matmul desc");
  STEP(dnnl_primitive_attr_create(&attr), "attribute");
  if (k->accumulate) { /* C += A·B: the sum post-op reads C before writing it */
    STEP(dnnl_post_ops_create(&po), "post-ops");
    STEP(dnnl_post_ops_append_sum(po, 1.0f), "sum post-op");
    STEP(dnnl_primitive_attr_set_post_ops(attr, po), "post-ops");
  }
  if (user_pad)
    STEP(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user), "scratchpad");
  STEP(dnnl_primitive_desc_create(&pd, &md, attr, g->eng, NULL), "matmul");
  STEP(dnnl_primitive_create(&e->prim, pd), "matmul primitive");
  /* memory objects without buffers: each run sets its pointers */
  STEP(dnnl_memory_create(&e->a, &a, g->eng, DNNL_MEMORY_NONE), "memory");
  STEP(dnnl_memory_create(&e->b, &b, g->eng, DNNL_MEMORY_NONE), "memory");
  STEP(dnnl_memory_create(&e->c, &c, g->eng, DNNL_MEMORY_NONE), "memory");
  if (k->bias) STEP(dnnl_memory_create(&e->bias, &bias, g->eng, DNNL_MEMORY_NONE), "memory");
  if (user_pad) {
    const dnnl_memory_desc_t *pmd = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    size_t bytes = pmd ? dnnl_memory_desc_get_size(pmd) : 0;
    if (bytes) {
      st = dnnl_out_of_memory;
      e->pad_buf = malloc(bytes);
      if (!e->pad_buf) STEP(st, "scratchpad allocation");
      STEP(dnnl_memory_create(&e->pad, pmd, g->eng, e->pad_buf), "memory");
    }
  }
#undef STEP
done:
  if (pd) dnnl_primitive_desc_destroy(pd);
  if (po) dnnl_post_ops_destroy(po);
  if (attr) dnnl_primitive_attr_destroy(attr);
  if (st != dnnl_success) entry_clear(e);
  else e->k = *k;
  return st;
}

/* The cached primitive for k in c, built on a miss (evicting the least
 * recently used); NULL with the status and step in *st, *what. */
static entry *lookup(ml_cpu_gemm *g, cache *c, const key *k, bool user_pad, dnnl_status_t *st,
                     const char **what) {
  entry *victim = &c->e[0];
  for (int i = 0; i < c->n; i++) {
    entry *e = &c->e[i];
    if (e->used && memcmp(&e->k, k, sizeof *k) == 0) {
      e->used = ++c->clock;
      return e;
    }
    if (e->used < victim->used) victim = e;
  }
  entry_clear(victim);
  *st = entry_build(g, k, user_pad, victim, what);
  if (*st != dnnl_success) return NULL;
  victim->used = ++c->clock;
  return victim;
}

/* Run e on A, B, C (and bias) on stream s, and wait for it. */
static dnnl_status_t entry_run(entry *e, dnnl_stream_t s, const void *A, const void *B, void *C,
                               const void *bias) {
  dnnl_memory_set_data_handle(e->a, (void *)A);
  dnnl_memory_set_data_handle(e->b, (void *)B);
  dnnl_memory_set_data_handle(e->c, C);
  dnnl_exec_arg_t args[5] = {{DNNL_ARG_SRC, e->a}, {DNNL_ARG_WEIGHTS, e->b}, {DNNL_ARG_DST, e->c}};
  int n = 3;
  if (e->bias) {
    dnnl_memory_set_data_handle(e->bias, (void *)bias);
    args[n++] = (dnnl_exec_arg_t){DNNL_ARG_BIAS, e->bias};
  }
  if (e->pad) args[n++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, e->pad};
  dnnl_status_t st = dnnl_primitive_execute(e->prim, s, n, args);
  return st == dnnl_success ? dnnl_stream_wait(s) : st;
}

/* src [rows, cols] of stride ld (`type`) → dst [rows, cols] contiguous:
 * bf16 (fp32 sources rounded), or, to emulate a bf16 GEMM where the CPU
 * has none, fp32 holding the bf16 values (rounded, then widened exactly). */
static void to_compute(const void *src, ml_dtype type, int64_t rows, int64_t cols, int64_t ld,
                       void *dst, bool emulate) {
#pragma omp parallel for if (K_PAR(rows, rows * cols))
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

/* One operand as run_on reads it: stored [rows, cols] with stride ld, of
 * `type`, flagged exact (ml_gemm.a_exact / b_exact); `fixed`: read by the
 * fixed-order kernel, `widen`: asked for in fp32 (the fixed kernel's A). */
typedef struct operand_in {
  const void *p;
  ml_dtype type;
  int64_t rows, cols, ld;
  bool exact, fixed, widen;
} operand_in;

/* Bytes of the scratch `operand` takes for o (0: o is read as it is) and
 * whether the bf16 GEMM is emulated for it. An exact fp32 operand that the
 * GEMM reads in fp32 (the emulation, or the fixed kernel, which takes fp32
 * and bf16 alike) is read in place: by the fixed kernel at any stride (its
 * order depends on K alone), by oneDNN only stored contiguously (ld = cols,
 * the layout of the copy it replaces: the same primitive, so the same
 * summation order and the same bits). */
static int64_t operand_bytes(const ml_cpu_gemm *g, const operand_in *o, ml_dtype compute,
                             bool *emulate) {
  *emulate = compute == ML_BF16 && (!g->bf16_native || (o->widen && o->type == ML_F32));
  if (o->type == compute && !*emulate) return 0; /* (ml_be_gemm refused bf16 in fp32 GEMMs) */
  bool exact = o->exact && o->type == ML_F32;
  if (exact && (o->fixed || (*emulate && o->ld == o->cols))) {
    *emulate = true; /* read as fp32 holding bf16 values */
    return 0;
  }
  return ml_mul_sat(ml_mul_sat(o->rows, o->cols), *emulate ? sizeof(float) : sizeof(uint16_t));
}

/* The operand as the GEMM's compute dtype wants it: as it is, or rounded
 * (emulated bf16, or `widen` asking for an fp32 source in that form:
 * rounded and widened) into pool scratch (*scratch, freed by the caller)
 * with its new stride *ld; *bf = whether *out holds bf16 elements. */
static int operand(ml_cpu_gemm *g, const operand_in *o, ml_dtype compute, int64_t *ld,
                   const void **out, void **scratch, bool *bf) {
  *out = o->p;
  *ld = o->ld;
  bool emulate;
  int64_t bytes = operand_bytes(g, o, compute, &emulate);
  *bf = compute == ML_BF16 && !emulate;
  if (!bytes) return 0;
  void *s = ml_be_alloc(g->be, bytes, 1, "a bf16 GEMM operand [%lld x %lld]", (long long)o->rows,
                        (long long)o->cols);
  if (!s) return -1;
  to_compute(o->p, o->type, o->rows, o->cols, o->ld, s, emulate);
  *ld = o->cols;
  *out = s;
  *scratch = s;
  return 0;
}

/* Operand A or B of a (b_side) as run_on reads it on the fixed kernel or not. */
static operand_in operand_of(const ml_gemm *a, bool b_side, bool fixed) {
  bool t = b_side ? a->trans_b : a->trans_a;
  int64_t outer = b_side ? a->N : a->M; /* op(A) [M, K], op(B)^T [N, K] */
  /* stored [K, outer] when op(A) = A^T or when B is not transposed */
  bool k_rows = b_side ? !t : t;
  return (operand_in){.p = b_side ? a->B : a->A,
                      .type = b_side ? a->b_type : a->a_type,
                      .rows = k_rows ? a->K : outer,
                      .cols = k_rows ? outer : a->K,
                      .ld = b_side ? a->ldb : a->lda,
                      .exact = b_side ? a->b_exact : a->a_exact,
                      .fixed = fixed,
                      /* the fixed kernel takes a bf16 GEMM's activations widened once
                         (gemm_fixed.c) */
                      .widen = fixed && !b_side};
}

/* K = 0: every product is an empty sum, so C (=|+=) 0 (+ bias); C fp32. */
static int empty_sum(const ml_gemm *a) {
#pragma omp parallel for if (K_PAR(a->M, a->M * a->N))
  for (int64_t r = 0; r < a->M; r++) {
    float *c = (float *)a->C + r * a->ldc;
    for (int64_t j = 0; j < a->N; j++) {
      float b = !a->bias ? 0.0f
                : a->bias_type == ML_BF16 ? ml_bf16_to_f32(((const uint16_t *)a->bias)[j])
                                          : ((const float *)a->bias)[j];
      c[j] = a->accumulate ? c[j] + b : b;
    }
  }
  return 0;
}

// frees a run's scratch (the converted operands and bias); returns rc
static int finish(ml_cpu_gemm *g, void *sa, void *sb, float *bias, int rc) {
  ml_be_free(g->be, sa);
  ml_be_free(g->be, sb);
  ml_be_free(g->be, bias);
  return rc;
}

int ml_cpu_gemm_run(ml_cpu_gemm *g, const ml_gemm *a) {
  return ml_cpu_gemm_run_on(g, a, ML_CPU_GEMM_AUTO);
}

/* A bf16 C where oneDNN does not write one (an fp32 or emulated GEMM, or
 * K = 0): the product into fp32 pool scratch [M, N], then each element
 * rounded to nearest-even into C (ml_convert_from_f32). */
static int via_f32(ml_cpu_gemm *g, const ml_gemm *a, ml_cpu_gemm_path path) {
  float *t = ml_be_alloc(g->be, ml_mul_sat(a->M, a->N), sizeof(float),
                         "a GEMM's fp32 output before its bf16 rounding [%lld x %lld]",
                         (long long)a->M, (long long)a->N);
  if (!t) return -1;
  ml_gemm f = *a;
  f.C = t, f.ldc = a->N, f.c_bf16 = false;
  int rc = ml_cpu_gemm_run_on(g, &f, path);
  if (!rc) {
#pragma omp parallel for if (K_PAR(a->M, a->M * a->N))
    for (int64_t r = 0; r < a->M; r++)
      ml_convert_from_f32(ML_BF16, t + r * a->N, (uint16_t *)a->C + r * a->ldc, (size_t)a->N);
  }
  ml_be_free(g->be, t);
  return rc;
}

/* The path AUTO resolves to: the fixed kernel for x·W^T in batch-invariant
 * mode or of at most ML_CPU_GEMM_SMALL_M rows, else oneDNN. */
static ml_cpu_gemm_path resolve(const ml_cpu_gemm *g, const ml_gemm *a, ml_cpu_gemm_path path) {
  bool xwt = !a->trans_a && a->trans_b; /* the forward's layout x·W^T */
  if (path != ML_CPU_GEMM_AUTO) return path;
  return xwt && (g->fixed || a->M <= ML_CPU_GEMM_SMALL_M) ? ML_CPU_GEMM_FIXED
                                                          : ML_CPU_GEMM_ONEDNN;
}

/* Whether a's bf16 C goes through via_f32 on `path` (resolved): on oneDNN
 * (whose bf16 dst is not used: file comment) and for K = 0 (empty_sum). */
static bool c_via_f32(const ml_gemm *a, ml_cpu_gemm_path path) {
  return a->c_bf16 && (a->K == 0 || path == ML_CPU_GEMM_ONEDNN);
}

int ml_cpu_gemm_temp_blocks(const ml_cpu_gemm *g, const ml_gemm *a,
                            int64_t bytes[ML_GEMM_TEMP_BLOCKS]) {
  ml_cpu_gemm_path path = resolve(g, a, ML_CPU_GEMM_AUTO);
  bool fixed = path == ML_CPU_GEMM_FIXED, e;
  operand_in oa = operand_of(a, false, fixed), ob = operand_of(a, true, fixed);
  /* in run_on's order, live together: via_f32's product, then (unless K = 0: empty_sum reads
   * no operand) operand A, operand B, the widened bias */
  int64_t b[ML_GEMM_TEMP_BLOCKS] = {
      c_via_f32(a, path) ? ml_mul_sat(ml_mul_sat(a->M, a->N), sizeof(float)) : 0,
      a->K ? operand_bytes(g, &oa, a->compute, &e) : 0,
      a->K ? operand_bytes(g, &ob, a->compute, &e) : 0,
      a->K && a->bias && a->bias_type == ML_BF16 ? ml_mul_sat(a->N, sizeof(float)) : 0};
  int n = 0;
  for (int i = 0; i < ML_GEMM_TEMP_BLOCKS; i++)
    if (b[i] > 0) bytes[n++] = b[i];
  return n;
}

int64_t ml_cpu_gemm_temp(const ml_cpu_gemm *g, const ml_gemm *a) {
  int64_t b[ML_GEMM_TEMP_BLOCKS], s = 0;
  int n = ml_cpu_gemm_temp_blocks(g, a, b);
  for (int i = 0; i < n; i++) s = ml_add_sat(s, b[i]);
  return s;
}

int ml_cpu_gemm_run_on(ml_cpu_gemm *g, const ml_gemm *a, ml_cpu_gemm_path path) {
  if (path == ML_CPU_GEMM_FIXED && (a->trans_a || !a->trans_b))
    return ml_err("the fixed-order CPU GEMM computes A·B^T only (trans_a false, trans_b true); "
                  "got trans_a %d, trans_b %d", (int)a->trans_a, (int)a->trans_b);
  path = resolve(g, a, path);
  if (c_via_f32(a, path)) return via_f32(g, a, path);
  if (a->K == 0) return empty_sum(a); /* an empty torch.chunk shard of the inner dim */
  key k;
  memset(&k, 0, sizeof k); /* the cache compares keys bytewise, padding included */
  k.M = a->M, k.N = a->N, k.K = a->K, k.lda = a->lda, k.ldb = a->ldb, k.ldc = a->ldc;
  k.ta = a->trans_a, k.tb = a->trans_b, k.accumulate = a->accumulate, k.bias = !!a->bias;
  k.dt = a->compute == ML_BF16 && g->bf16_native ? dnnl_bf16 : dnnl_f32;
  const void *A, *B;
  void *sa = NULL, *sb = NULL;
  float *bias = NULL;
  bool abf, bbf, fixed = path == ML_CPU_GEMM_FIXED;
  operand_in oa = operand_of(a, false, fixed), ob = operand_of(a, true, fixed);
  int rc = operand(g, &oa, a->compute, &k.lda, &A, &sa, &abf);
  if (!rc) rc = operand(g, &ob, a->compute, &k.ldb, &B, &sb, &bbf);
  if (!rc && a->bias && a->bias_type == ML_BF16) {
    bias = ml_be_alloc(g->be, a->N, sizeof(float), "a GEMM bias [%lld]", (long long)a->N);
    if (!bias) rc = -1;
    else ml_convert_to_f32(ML_BF16, a->bias, bias, (size_t)a->N);
  }
  if (!rc && fixed)
    return finish(g, sa, sb, bias,
                  ml_cpu_gemm_fixed(a, A, k.lda, abf, B, k.ldb, bbf,
                                    bias ? bias : (const float *)a->bias));
  if (!rc) {
    dnnl_status_t st = dnnl_success;
    const char *what = "";
    entry *e = lookup(g, &g->c, &k, false, &st, &what);
    if (e) {
      what = "execute";
      st = entry_run(e, g->stream, A, B, a->C, bias ? bias : a->bias);
    }
    rc = dnnl_check(st, what, &k);
  }
  return finish(g, sa, sb, bias, rc);
}

void ml_cpu_gemm_set_fixed(ml_cpu_gemm *g, bool on) { g->fixed = on; }

/* ---- tiles: small bf16 GEMMs from OpenMP threads ------------------------ */

bool ml_cpu_gemm_bf16_native(const ml_cpu_gemm *g) { return g->bf16_native; }

int ml_cpu_gemm_tiles_reserve(ml_cpu_gemm *g, int threads) {
  if (threads <= g->ntiles) return 0;
  tiles *t = realloc(g->tiles, (size_t)threads * sizeof *t);
  if (!t) return ml_err("out of memory for the tile GEMMs of %d threads", threads);
  g->tiles = t;
  for (; g->ntiles < threads; g->ntiles++) {
    tiles *mine = &t[g->ntiles];
    memset(mine, 0, sizeof *mine);
    mine->c = (cache){ml_calloc(TILE_CACHE, sizeof(entry), "a tile GEMM cache"), TILE_CACHE, 0};
    if (!mine->c.e) return -1;
    key none = {0};
    if (dnnl_check(dnnl_stream_create(&mine->stream, g->eng, dnnl_stream_default_flags),
                   "stream creation", &none)) {
      free(mine->c.e);
      return -1;
    }
  }
  for (int i = 0; i < g->ntiles; i++) g->tiles[i].status = dnnl_success;
  return 0;
}

/* C [M, N] (ldc) = alpha·P (+ C) for the product P [M, N] (ldp), the
 * tile's epilogue in fp32: a product and, when accumulating, a sum per
 * element (one fused multiply-add where the compiler contracts them), as
 * oneDNN's output scale and sum post-op; P may be C (ldp = ldc) when not
 * accumulating. Vectorized by the compiler (AVX-512 / AVX2). */
static void tile_epilogue(int64_t M, int64_t N, float alpha, const float *P, int64_t ldp,
                          bool accumulate, float *C, int64_t ldc) {
  for (int64_t i = 0; i < M; i++) {
    const float *p = P + i * ldp;
    float *c = C + i * ldc;
    if (accumulate) {
#pragma omp simd
      for (int64_t j = 0; j < N; j++) c[j] += alpha * p[j];
    } else {
#pragma omp simd
      for (int64_t j = 0; j < N; j++) c[j] = alpha * p[j];
    }
  }
}

/* The primitive's key of a tile (below): the product plain, or with the
 * sum post-op when alpha = 1 and accumulating; a scaled accumulating
 * tile's product goes to the thread's dense scratch (ldc N). */
static key tile_key(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, int64_t lda,
                    int64_t ldb, float beta, int64_t ldc) {
  bool accumulate = beta != 0.0f, scaled = alpha != 1.0f;
  key k;
  memset(&k, 0, sizeof k);
  k.M = M, k.N = N, k.K = K, k.lda = lda, k.ldb = ldb, k.ldc = scaled && accumulate ? N : ldc;
  k.ta = ta, k.tb = tb, k.accumulate = accumulate && !scaled, k.dt = dnnl_bf16;
  return k;
}

/* A tile's output scale stays out of oneDNN: with alpha != 1, oneDNN 2.6's
 * gemm path (where strided tiles land, brgemm refusing strided operands)
 * runs on AMX into an fp32 buffer and scales and adds it in a scalar loop
 * (src/cpu/x64/gemm/gemm_driver.cpp, add_results: "AMX bfloat16 kernels
 * don't support alpha scaling yet") — the scalar loop of issue 30's
 * Sapphire Rapids profile, ~20 % of a bf16 step. (Read from oneDNN
 * 2.6.3's source; on AVX512-BF16 the same tiles scale inside the JIT
 * kernel.) So the primitive computes op(A)·op(B) plain, or with the sum
 * post-op when alpha = 1 (inside the kernel on every ISA: gemm beta = 1),
 * and tile_epilogue applies alpha: into C itself when not accumulating,
 * else from the thread's scratch. */
int ml_cpu_gemm_tile(ml_cpu_gemm *g, int thread, bool ta, bool tb, int64_t M, int64_t N,
                     int64_t K, float alpha, const void *A, int64_t lda, const void *B,
                     int64_t ldb, float beta, float *C, int64_t ldc) {
  tiles *t = &g->tiles[thread];
  bool accumulate = beta != 0.0f, scaled = alpha != 1.0f;
  bool via_acc = scaled && accumulate; /* the product goes to t->acc first */
  key k = tile_key(ta, tb, M, N, K, alpha, lda, ldb, beta, ldc);
  const char *what = "";
  dnnl_status_t st = dnnl_success;
  float *out = C;
  if (via_acc && M * N > t->acc_cap) { /* grown to the largest tile, then kept */
    float *acc = malloc((size_t)(M * N) * sizeof *acc);
    if (acc) {
      free(t->acc);
      t->acc = acc;
      t->acc_cap = M * N;
    } else {
      st = dnnl_out_of_memory;
      what = "tile scratch allocation";
    }
  }
  if (via_acc) out = t->acc;
  entry *e = st == dnnl_success ? lookup(g, &t->c, &k, true, &st, &what) : NULL;
  if (e) {
    what = "execute";
    st = entry_run(e, t->stream, A, B, out, NULL);
  }
  if (st == dnnl_success && scaled)
    tile_epilogue(M, N, alpha, out, k.ldc, accumulate, C, ldc);
  if (st != dnnl_success && t->status == dnnl_success) {
    t->status = st;
    t->what = what;
    t->failed = k;
  }
  return st != dnnl_success;
}

const char *ml_cpu_gemm_tile_impl(ml_cpu_gemm *g, int thread, bool ta, bool tb, int64_t M,
                                  int64_t N, int64_t K, float alpha, int64_t lda, int64_t ldb,
                                  float beta, int64_t ldc) {
  key k = tile_key(ta, tb, M, N, K, alpha, lda, ldb, beta, ldc);
  dnnl_status_t st = dnnl_success;
  const char *what = "", *info = NULL;
  entry *e = lookup(g, &g->tiles[thread].c, &k, true, &st, &what);
  const_dnnl_primitive_desc_t pd = NULL;
  if (!e) {
    dnnl_check(st, what, &k);
    return NULL;
  }
  if (dnnl_check(dnnl_primitive_get_primitive_desc(e->prim, &pd), "primitive desc query", &k) ||
      dnnl_check(dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &info),
                 "implementation query", &k))
    return NULL;
  return info;
}

int ml_cpu_gemm_tiles_check(ml_cpu_gemm *g) {
  for (int i = 0; i < g->ntiles; i++)
    if (g->tiles[i].status != dnnl_success)
      return dnnl_check(g->tiles[i].status, g->tiles[i].what, &g->tiles[i].failed);
  return 0;
}
