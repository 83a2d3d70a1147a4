/* The CPU GEMMs of a decode step, alone: C = x·W^T with x [M, K] fp32 (the
 * activations) and W [N, K] fp32 or bf16 (the weights; compute bf16: x
 * rounded to bf16 by the backend, as torch.autocast), on each kernel of
 * backend/cpu/gemm.c (ml_cpu_gemm_run_on): oneDNN's matmul, the
 * batch-invariant fixed-order kernel (gemm_fixed.c), and AUTO (what the
 * backend runs by default, batch-invariant mode off). Decode is
 * weight-bandwidth-bound at small M: each line gives the rate W streams at
 * (N·K·bytes per call ÷ time) beside GFLOP/s (2·M·N·K ÷ time).
 *
 * x and W random normal (never zeros: bench/METHOD's rule). A decode step
 * reads every layer's weights once (hundreds of MB), so each W comes from
 * memory, not from a cache: the calls cycle through copies of W filling at
 * least 256 MB (more than any L3). 3 warm-up calls, then the median of at
 * least REPS timed calls (more while under 0.2 s in all), wall clock
 * (CLOCK_MONOTONIC). Threads: OpenMP's (OMP_NUM_THREADS). The first line is
 * the ceiling: the rate the same threads read 256 MB at (a sum of every
 * float, OpenMP SIMD over the buffer).
 *
 * usage: bench_cpu_gemm_small [--reps N] [--K 576] [--Ms 1,4,8,16,64]
 *                             [--Ns 576,1536,49152] [--dtypes f32,bf16]
 * prints one line per (dtype, N, M, kernel). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cpu/cpu.h"
#include "common/status.h"
#include "bench_util.h"

/* a comma-separated list of at most cap positive integers; its length, or 0 */
static int parse_list(const char *s, int64_t *out, int cap) {
  int n = 0;
  for (char *end; *s && n < cap; s = *end == ',' ? end + 1 : end) {
    out[n] = strtoll(s, &end, 10);
    if (end == s || out[n] < 1 || out[n] > (1 << 20)) return 0;
    n++;
    if (!*end) return n;
  }
  return 0;
}

static const struct {
  ml_cpu_gemm_path path;
  const char *name;
} kernels[] = {{ML_CPU_GEMM_ONEDNN, "onednn"}, {ML_CPU_GEMM_FIXED, "fixed"},
               {ML_CPU_GEMM_AUTO, "auto"}};

enum { COLD = 256 << 20 }; /* bytes of weight copies the calls cycle through */

/* The rate (GB/s) the OpenMP threads read COLD bytes at: the median of 5 sums. */
static double read_ceiling(void) {
  int64_t n = COLD / sizeof(float);
  float *buf = malloc(COLD);
  if (!buf) return 0;
  bench_normal_fill(buf, n, 3);
  double t[5], sink = 0;
  for (int r = 0; r < 5; r++) {
    double t0 = bench_now();
    float s = 0;
#pragma omp parallel for simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += buf[i];
    t[r] = bench_now() - t0;
    sink += s;
  }
  free(buf);
  qsort(t, 5, sizeof(double), bench_cmp_double);
  return sink == sink ? (double)COLD / t[2] * 1e-9 : 0; /* (sink read: the sums are kept) */
}

/* Times x·W^T of one (dtype, M, N) on each kernel and prints its lines. */
static int run(ml_cpu_gemm *gm, bool bf, int64_t M, int64_t N, int64_t K, int reps) {
  size_t esz = bf ? sizeof(uint16_t) : sizeof(float), wbytes = (size_t)(N * K) * esz;
  int64_t copies = (int64_t)((COLD + wbytes - 1) / wbytes);
  float *x = malloc(sizeof(float) * (size_t)(M * K)), *C = malloc(sizeof(float) * (size_t)(M * N));
  float *w = malloc(sizeof(float) * (size_t)(N * K));
  char *ws = malloc(wbytes * (size_t)copies);
  int cap = reps + 4096;
  double *t = malloc(sizeof(double) * (size_t)cap);
  if (!x || !C || !w || !ws || !t) {
    fprintf(stderr, "bench_cpu_gemm_small: out of memory for M %lld N %lld K %lld\n",
            (long long)M, (long long)N, (long long)K);
    free(x), free(C), free(w), free(ws), free(t);
    return -1;
  }
  bench_normal_fill(x, M * K, 1);
  bench_normal_fill(w, N * K, 2);
  if (bf) ml_convert_from_f32(ML_BF16, w, ws, (size_t)(N * K));
  else memcpy(ws, w, wbytes);
  for (int64_t c = 1; c < copies; c++) memcpy(ws + (size_t)c * wbytes, ws, wbytes);
  ml_gemm g = {.trans_b = true, .M = M, .N = N, .K = K, .A = x, .a_type = ML_F32, .lda = K,
               .b_type = bf ? ML_BF16 : ML_F32, .ldb = K, .C = C, .ldc = N,
               .compute = bf ? ML_BF16 : ML_F32};
  int rc = 0;
  for (size_t kk = 0; rc == 0 && kk < sizeof kernels / sizeof *kernels; kk++) {
    int n = 0;
    double spent = 0;
    for (int i = -3; rc == 0 && n < cap && (n < reps || spent < 0.2); i++) {
      g.B = ws + (size_t)((i + 3) % copies) * wbytes;
      double t0 = bench_now();
      rc = ml_cpu_gemm_run_on(gm, &g, kernels[kk].path);
      double dt = bench_now() - t0;
      if (i >= 0) t[n++] = dt, spent += dt;
    }
    if (rc) break;
    qsort(t, (size_t)n, sizeof(double), bench_cmp_double);
    double med = t[n / 2], bytes = (double)N * (double)K * (bf ? 2.0 : 4.0);
    printf("gemm %s M %4lld N %6lld K %lld %-6s: %8.4f ms  W %6.2f GB/s  %7.2f GFLOP/s  "
           "(median of %d)\n",
           bf ? "bf16" : "f32 ", (long long)M, (long long)N, (long long)K, kernels[kk].name,
           med * 1e3, bytes / med * 1e-9, 2.0 * (double)M * (double)N * (double)K / med * 1e-9,
           n);
  }
  if (rc) fprintf(stderr, "bench_cpu_gemm_small: %s\n", ml_error_msg());
  free(x), free(C), free(w), free(ws), free(t);
  return rc;
}

int main(int argc, char **argv) {
  int64_t Ms[16] = {1, 4, 8, 16, 64}, Ns[16] = {576, 1536, 49152}, K = 576;
  int nM = 5, nN = 3, reps = 20, a = 1;
  bool dts[2] = {true, true}; /* f32, bf16 */
  for (; a + 1 < argc; a += 2) {
    if (!strcmp(argv[a], "--reps")) reps = atoi(argv[a + 1]);
    else if (!strcmp(argv[a], "--K")) K = strtoll(argv[a + 1], NULL, 10);
    else if (!strcmp(argv[a], "--Ms")) nM = parse_list(argv[a + 1], Ms, 16);
    else if (!strcmp(argv[a], "--Ns")) nN = parse_list(argv[a + 1], Ns, 16);
    else if (!strcmp(argv[a], "--dtypes")) {
      dts[0] = strstr(argv[a + 1], "f32") != NULL;
      dts[1] = strstr(argv[a + 1], "bf16") != NULL;
    } else break;
  }
  if (a != argc || reps < 1 || reps > 10000 || K < 1 || K > (1 << 16) || !nM || !nN ||
      !(dts[0] || dts[1])) {
    fprintf(stderr, "usage: bench_cpu_gemm_small [--reps 1..10000] [--K 1..65536] "
                    "[--Ms 1,4,8,16,64] [--Ns 576,1536,49152] [--dtypes f32,bf16]\n");
    return 2;
  }
  ml_backend *be;
  ml_cpu_gemm *gm = NULL;
  if (ml_backend_get("cpu", 0, &be) || ml_cpu_gemm_create(be, &gm)) {
    fprintf(stderr, "bench_cpu_gemm_small: %s\n", ml_error_msg());
    return 1;
  }
  printf("read ceiling: %.2f GB/s (%d MB, OpenMP threads as the GEMMs)\n", read_ceiling(),
         COLD >> 20);
  int rc = 0;
  for (int d = 0; d < 2 && rc == 0; d++)
    for (int j = 0; dts[d] && j < nN && rc == 0; j++)
      for (int i = 0; i < nM && rc == 0; i++) rc = run(gm, d == 1, Ms[i], Ns[j], K, reps) ? 1 : 0;
  ml_cpu_gemm_destroy(gm);
  ml_backend_release_all();
  return rc;
}
