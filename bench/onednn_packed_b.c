/* The bf16 matmul of a scoring linear, C [M, N] fp32 = A [M, K] bf16 ·
 * W [N, K]^T bf16, through oneDNN (the CPU backend's library, 2.x C API)
 * two ways, alternating: "plain" as backend/cpu/gemm.c builds it (W read
 * through strides, transposed: the primitive reorders it inside every
 * call), and "packed" with W reordered once into the layout the primitive
 * chooses (format_tag any), as a cache of pre-packed weights per unshard
 * would run it. Median ms and GFLOP/s of each over ITERS calls after a
 * warm-up. Figures for notes; nothing asserted.
 * usage: onednn_packed_b M N K [ITERS]   (bench/onednn_packed_b.sh builds and runs it) */
#include <oneapi/dnnl/dnnl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(x)                                                   \
  do {                                                             \
    dnnl_status_t s_ = (x);                                        \
    if (s_ != dnnl_success) {                                      \
      fprintf(stderr, "%s: status %d\n", #x, (int)s_);             \
      exit(1);                                                     \
    }                                                              \
  } while (0)

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return 1e3 * (double)t.tv_sec + 1e-6 * (double)t.tv_nsec;
}

static int cmp(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return (a > b) - (a < b);
}

/* A matmul primitive for weights described by wmd (its memory created on wbuf). */
static dnnl_primitive_t build(dnnl_engine_t eng, const dnnl_memory_desc_t *a,
                              const dnnl_memory_desc_t *w, const dnnl_memory_desc_t *c,
                              dnnl_memory_desc_t *chosen) {
  dnnl_matmul_desc_t md;
  dnnl_primitive_desc_t pd;
  dnnl_primitive_t p;
  CHECK(dnnl_matmul_desc_init(&md, a, w, NULL, c));
  CHECK(dnnl_primitive_desc_create(&pd, &md, NULL, eng, NULL));
  if (chosen) *chosen = *dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
  CHECK(dnnl_primitive_create(&p, pd));
  dnnl_primitive_desc_destroy(pd);
  return p;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: onednn_packed_b M N K [ITERS]\n");
    return 2;
  }
  long M = atol(argv[1]), N = atol(argv[2]), K = atol(argv[3]);
  int iters = argc > 4 ? atoi(argv[4]) : 7;
  dnnl_engine_t eng;
  dnnl_stream_t st;
  CHECK(dnnl_engine_create(&eng, dnnl_cpu, 0));
  CHECK(dnnl_stream_create(&st, eng, dnnl_stream_default_flags));
  dnnl_memory_desc_t a, wt, wany, c, wpacked;
  dnnl_dims_t ad = {M, K}, wd = {K, N}, cd = {M, N};
  dnnl_dims_t wstr = {1, K}; /* W [N, K] row-major read as [K, N]: transposed */
  CHECK(dnnl_memory_desc_init_by_tag(&a, 2, ad, dnnl_bf16, dnnl_ab));
  CHECK(dnnl_memory_desc_init_by_strides(&wt, 2, wd, dnnl_bf16, wstr));
  CHECK(dnnl_memory_desc_init_by_tag(&wany, 2, wd, dnnl_bf16, dnnl_format_tag_any));
  CHECK(dnnl_memory_desc_init_by_tag(&c, 2, cd, dnnl_f32, dnnl_ab));
  dnnl_primitive_t plain = build(eng, &a, &wt, &c, NULL);
  dnnl_primitive_t packed = build(eng, &a, &wany, &c, &wpacked);
  size_t abytes = (size_t)M * K * 2, wbytes = (size_t)N * K * 2;
  unsigned short *A = malloc(abytes), *W = malloc(wbytes);
  float *C = malloc((size_t)M * N * 4);
  void *Wp = malloc(dnnl_memory_desc_get_size(&wpacked));
  for (size_t i = 0; i < abytes / 2; i++) A[i] = 0x3f80 + (unsigned short)(i % 61); /* ~1..1.5 */
  for (size_t i = 0; i < wbytes / 2; i++) W[i] = 0x3c00 + (unsigned short)(i % 53);
  dnnl_memory_t ma, mw, mwp, mc;
  CHECK(dnnl_memory_create(&ma, &a, eng, A));
  CHECK(dnnl_memory_create(&mw, &wt, eng, W));
  CHECK(dnnl_memory_create(&mwp, &wpacked, eng, Wp));
  CHECK(dnnl_memory_create(&mc, &c, eng, C));
  /* the one reorder a per-unshard cache would do */
  dnnl_primitive_desc_t rpd;
  dnnl_primitive_t reorder;
  CHECK(dnnl_reorder_primitive_desc_create(&rpd, &wt, eng, &wpacked, eng, NULL));
  CHECK(dnnl_primitive_create(&reorder, rpd));
  dnnl_exec_arg_t rargs[2] = {{DNNL_ARG_FROM, mw}, {DNNL_ARG_TO, mwp}};
  double r0 = now_ms();
  CHECK(dnnl_primitive_execute(reorder, st, 2, rargs));
  CHECK(dnnl_stream_wait(st));
  double reorder_ms = now_ms() - r0;
  dnnl_exec_arg_t pa[3] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mw}, {DNNL_ARG_DST, mc}};
  dnnl_exec_arg_t pb[3] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mwp}, {DNNL_ARG_DST, mc}};
  double *tp = malloc(sizeof(double) * (size_t)iters), *tk = malloc(sizeof(double) * (size_t)iters);
  for (int it = -1; it < iters; it++) { /* it = -1: warm-up */
    double t0 = now_ms();
    CHECK(dnnl_primitive_execute(plain, st, 3, pa));
    CHECK(dnnl_stream_wait(st));
    double t1 = now_ms();
    CHECK(dnnl_primitive_execute(packed, st, 3, pb));
    CHECK(dnnl_stream_wait(st));
    double t2 = now_ms();
    if (it >= 0) tp[it] = t1 - t0, tk[it] = t2 - t1;
  }
  qsort(tp, (size_t)iters, sizeof *tp, cmp);
  qsort(tk, (size_t)iters, sizeof *tk, cmp);
  double gf = 2.0 * (double)M * (double)N * (double)K * 1e-6;
  printf("bf16 matmul %ldx%ldx%ld: plain W^T %.2f ms (%.1f GFLOP/s), packed W %.2f ms "
         "(%.1f GFLOP/s), packed/plain speed %.2fx; the one reorder %.2f ms\n",
         M, N, K, tp[iters / 2], gf / tp[iters / 2], tk[iters / 2], gf / tk[iters / 2],
         tp[iters / 2] / tk[iters / 2], reorder_ms);
  return 0;
}
