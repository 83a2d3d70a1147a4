/* Attention's bf16 tile products alone (kernels/cpu/attention.c's GEMMs,
 * TILE_Q 64 × TILE_K 128, head_dim 64: SmolLM2-135M's 9 query heads over 3
 * kv heads), each with main's operand strides (q, dout read in the model's
 * layout, rows nh·hd = 576 apart; k, v nkv·hd = 192; dk, dv written 192
 * apart) and with the head-major copies' (rows hd = 64 apart; dk, dv into
 * dense [128, 64] tiles): one thread, and oneDNN's implementation name of
 * each primitive (ml_cpu_gemm_tile_impl: "brg:..." is the brgemm matmul,
 * "gemm:..." the gemm-based one). Where the CPU has no bf16 matmul
 * (ml_cpu_gemm_bf16_native false: AVX2-only, e.g. Zen 3) the products are
 * the emulation's, cblas_sgemm on fp32 holding bf16 values, and the name
 * says so.
 *
 * The products (M × N × K, op): S = scale·Q·K^T and dP = dout·V^T (64 ×
 * 128 × 64, B transposed, written), O += P·V (64 × 64 × 128), dq +=
 * scale·dS·K (64 × 64 × 128, via the tile GEMM's dense scratch: alpha ≠ 1
 * and accumulating), dv += P^T·dout and dk += scale·dS^T·Q (128 × 64 × 64,
 * A transposed). Operands random normal rounded to bf16 (never zeros:
 * bench/METHOD's rule), resident in cache as in the kernel's tiles. 20
 * warm-up calls, then the median of at least REPS timed calls (more while
 * under 0.1 s), wall clock (CLOCK_MONOTONIC). Nothing is asserted.
 *
 * usage: bench_attn_tile_gemm [--reps N]
 * prints one line per (product, strides): time, GFLOP/s (2·M·N·K ÷ time),
 * implementation. */
#include <cblas.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "bench_util.h"
#include "common/status.h"
#include "tensor/dtype.h"

typedef struct product {
  const char *name;
  bool ta, tb;
  int64_t M, N, K;
  float alpha, beta;
  int64_t ld[2][3]; /* [main, head-major][lda, ldb, ldc] */
} product;

static const float SCALE = 0.125f; /* 1/√64 */
static const product products[] = {
    {"S = s.Q.K^T", false, true, 64, 128, 64, SCALE, 0.0f, {{576, 192, 128}, {64, 64, 128}}},
    {"dP = dO.V^T", false, true, 64, 128, 64, 1.0f, 0.0f, {{576, 192, 128}, {64, 64, 128}}},
    {"O += P.V", false, false, 64, 64, 128, 1.0f, 1.0f, {{128, 192, 64}, {128, 64, 64}}},
    {"dq += s.dS.K", false, false, 64, 64, 128, SCALE, 1.0f, {{128, 192, 576}, {128, 64, 576}}},
    {"dv += P^T.dO", true, false, 128, 64, 64, 1.0f, 1.0f, {{128, 576, 192}, {128, 64, 64}}},
    {"dk += s.dS^T.Q", true, false, 128, 64, 64, SCALE, 1.0f, {{128, 576, 192}, {128, 64, 64}}},
};

/* n bf16 values, random normal (seed), as bf16 and as fp32 holding them */
static void fill(uint16_t *h, float *f, int64_t n, uint64_t seed) {
  bench_normal_fill(f, n, seed);
  for (int64_t i = 0; i < n; i++) h[i] = ml_f32_to_bf16(f[i]), f[i] = ml_bf16_to_f32(h[i]);
}

/* Times one product with strides ld[3]; prints its line. */
static int run(ml_cpu_gemm *g, bool native, const product *p, int which, int reps) {
  const int64_t *ld = p->ld[which];
  int64_t na = (p->ta ? p->K : p->M) * ld[0], nb = (p->tb ? p->N : p->K) * ld[1];
  int64_t nc = p->M * ld[2];
  uint16_t *a16 = malloc((size_t)na * 2), *b16 = malloc((size_t)nb * 2);
  float *a = malloc((size_t)na * 4), *b = malloc((size_t)nb * 4), *c = calloc((size_t)nc, 4);
  int cap = reps + 100000;
  double *t = malloc(sizeof(double) * (size_t)cap);
  if (!a16 || !b16 || !a || !b || !c || !t) {
    fprintf(stderr, "bench_attn_tile_gemm: out of memory\n");
    free(a16), free(b16), free(a), free(b), free(c), free(t);
    return -1;
  }
  fill(a16, a, na, 1), fill(b16, b, nb, 2);
  const char *impl = "emulated: cblas_sgemm on fp32 holding bf16";
  if (native)
    impl = ml_cpu_gemm_tile_impl(g, 0, p->ta, p->tb, p->M, p->N, p->K, p->alpha, ld[0], ld[1],
                                 p->beta, ld[2]);
  int rc = impl ? 0 : -1, n = 0;
  double spent = 0;
  for (int i = -20; rc == 0 && n < cap && (n < reps || spent < 0.1); i++) {
    if (p->beta == 0.0f || i < 0) memset(c, 0, (size_t)nc * 4); /* accumulators stay bounded */
    double t0 = bench_now();
    if (native)
      rc = ml_cpu_gemm_tile(g, 0, p->ta, p->tb, p->M, p->N, p->K, p->alpha, a16, ld[0], b16,
                            ld[1], p->beta, c, ld[2]);
    else
      cblas_sgemm(CblasRowMajor, p->ta ? CblasTrans : CblasNoTrans,
                  p->tb ? CblasTrans : CblasNoTrans, (int)p->M, (int)p->N, (int)p->K, p->alpha,
                  a, (int)ld[0], b, (int)ld[1], p->beta, c, (int)ld[2]);
    double dt = bench_now() - t0;
    if (i >= 0) t[n++] = dt, spent += dt;
  }
  if (rc == 0 && native) rc = ml_cpu_gemm_tiles_check(g);
  if (rc == 0) {
    qsort(t, (size_t)n, sizeof(double), bench_cmp_double);
    double med = t[n / 2];
    printf("%-14s %4lld x %3lld x %3lld %-10s lda %3lld ldb %3lld ldc %3lld: %8.2f us %7.1f GFLOP/s"
           "  %s\n",
           p->name, (long long)p->M, (long long)p->N, (long long)p->K,
           which ? "head-major" : "main", (long long)ld[0], (long long)ld[1], (long long)ld[2],
           med * 1e6, 2.0 * (double)(p->M * p->N * p->K) / med * 1e-9, impl);
  } else {
    fprintf(stderr, "bench_attn_tile_gemm: %s: %s\n", p->name, ml_error_msg());
  }
  free(a16), free(b16), free(a), free(b), free(c), free(t);
  return rc;
}

int main(int argc, char **argv) {
  int reps = 200;
  if (argc == 3 && !strcmp(argv[1], "--reps")) reps = atoi(argv[2]);
  if ((argc != 1 && argc != 3) || reps < 1 || reps > 100000) {
    fprintf(stderr, "usage: bench_attn_tile_gemm [--reps 1..100000]\n");
    return 2;
  }
  omp_set_num_threads(1); /* a tile runs on its kernel thread alone (OpenBLAS too, as */
  openblas_set_num_threads(1); /* attention.c's region sets it) */
  ml_backend *be;
  ml_cpu_gemm *g = NULL;
  if (ml_backend_get("cpu", 0, &be) || ml_cpu_gemm_create(be, &g) ||
      (ml_cpu_gemm_bf16_native(g) && ml_cpu_gemm_tiles_reserve(g, 1))) {
    fprintf(stderr, "bench_attn_tile_gemm: %s\n", ml_error_msg());
    return 1;
  }
  bool native = ml_cpu_gemm_bf16_native(g);
  printf("bf16 tile products, one thread, %s\n",
         native ? "oneDNN (ml_cpu_gemm_tile)" : "no bf16 matmul here: the emulation");
  int rc = 0;
  for (size_t i = 0; rc == 0 && i < sizeof products / sizeof *products; i++)
    for (int w = 0; rc == 0 && w < 2; w++) rc = run(g, native, &products[i], w, reps);
  ml_cpu_gemm_destroy(g);
  ml_backend_release_all();
  return rc ? 1 : 0;
}
