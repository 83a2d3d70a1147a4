/* The attention operator's rate on a device, alone: causal GQA forward and
 * backward through the backend (ml_be_attention_fwd / _bwd; on cuda the
 * kernels of src/kernels/cuda/attention.cu). Its peer on the same shapes is
 * bench/attention_peer.py (PyTorch's scaled_dot_product_attention, whose
 * CUDA path is FlashAttention-2): run both in one call, as
 * tools/device_checks.sh's stage `attention` does.
 *
 * q, k, v, dout random normal (never zeros: bench/METHOD's rule), 2 warm-up
 * calls, then the median of REPS timed calls, each between two ml_be_sync
 * (wall clock, CLOCK_MONOTONIC). FLOPs as FlashAttention's benchmarks count
 * them: forward 4·B·S²·nh·hd, halved for the causal mask; backward 2.5×
 * the forward (five products of the forward's size: the kernels' own
 * recomputation of the scores is not counted).
 *
 * usage: bench_cuda_attention [--device cuda|cpu] [--compute bf16|f32] [--reps N]
 *                             B S nh nkv hd [B S nh nkv hd ...]
 * prints one line per shape. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "common/checked.h"
#include "common/status.h"
#include "bench_util.h"

/* A device buffer of n floats, random normal. */
static float *device_normal(ml_backend *be, int64_t n, uint64_t seed, const char *what) {
  float *h = ml_malloc_array((size_t)n, sizeof(float), "%s on the host", what);
  float *d = h ? ml_be_alloc(be, n, sizeof(float), "%s", what) : NULL;
  if (d) {
    bench_normal_fill(h, n, seed);
    if (ml_be_copy(be, d, h, (size_t)n * sizeof(float), ML_COPY_H2D)) {
      ml_be_free(be, d);
      d = NULL;
    }
  }
  free(h);
  return d;
}

typedef struct shape {
  int64_t B, S, nh, nkv, hd;
} shape;

/* Times one shape and prints its line; 0, or -1 with the message printed. */
static int run(ml_backend *be, const char *device, ml_dtype compute, int reps, shape s) {
  const int64_t nq = s.B * s.S * s.nh * s.hd, nk = s.B * s.S * s.nkv * s.hd;
  const float scale = 1.0f / sqrtf((float)s.hd);
  float *q = device_normal(be, nq, 1, "q"), *k = device_normal(be, nk, 2, "k");
  float *v = device_normal(be, nk, 3, "v"), *dout = device_normal(be, nq, 4, "dout");
  float *out = ml_be_alloc(be, nq, sizeof(float), "out");
  float *dq = ml_be_alloc(be, nq, sizeof(float), "dq");
  float *dk = ml_be_alloc(be, nk, sizeof(float), "dk"), *dv = ml_be_alloc(be, nk, sizeof(float), "dv");
  int64_t nsaved = ml_be_attention_saved(be, s.B, s.S, s.nh);
  float *saved = ml_be_alloc(be, nsaved, sizeof(float), "the forward's saved log-sum-exp");
  size_t wbytes = ml_be_attention_work(be, s.B, s.S, s.nh, s.nkv, s.hd);
  void *work = wbytes <= INT64_MAX ? ml_be_alloc(be, (int64_t)wbytes, 1, "the backward's work")
                                   : NULL;
  double *t[2] = {calloc((size_t)reps, sizeof(double)), calloc((size_t)reps, sizeof(double))};
  int rc = !q || !k || !v || !dout || !out || !dq || !dk || !dv || !saved || !work || !t[0] ||
                   !t[1]
               ? -1
               : 0;
  for (int i = -2; rc == 0 && i < reps; i++) {
    double t0 = bench_now();
    rc = ml_be_attention_fwd(be, q, k, v, out, saved, s.B, s.S, s.nh, s.nkv, s.hd, scale, 0,
                             compute) ||
         ml_be_sync(be);
    double t1 = bench_now();
    if (rc == 0)
      rc = ml_be_attention_bwd(be, dout, q, k, v, out, saved, dq, dk, dv, s.B, s.S, s.nh, s.nkv,
                               s.hd, scale, 0, compute, work) ||
           ml_be_sync(be);
    if (i >= 0) t[0][i] = t1 - t0, t[1][i] = bench_now() - t1;
  }
  if (rc == 0) {
    qsort(t[0], (size_t)reps, sizeof(double), bench_cmp_double);
    qsort(t[1], (size_t)reps, sizeof(double), bench_cmp_double);
    const double f = 4.0 * (double)s.B * (double)s.S * (double)s.S * (double)s.nh * (double)s.hd / 2;
    const double tf = t[0][reps / 2], tb = t[1][reps / 2];
    printf("attention %s %s B %lld S %lld heads %lld/%lld hd %lld: forward %.3f ms (%.4g "
           "TFLOP/s), backward %.3f ms (%.4g TFLOP/s); median of %d\n",
           device, ml_dtype_name(compute), (long long)s.B, (long long)s.S, (long long)s.nh,
           (long long)s.nkv, (long long)s.hd, tf * 1e3, f / tf * 1e-12, tb * 1e3,
           2.5 * f / tb * 1e-12, reps);
  } else {
    fprintf(stderr, "bench_cuda_attention: %s\n", ml_error_msg());
  }
  void *bufs[] = {q, k, v, dout, out, dq, dk, dv, saved, work};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) ml_be_free(be, bufs[i]);
  free(t[0]);
  free(t[1]);
  return rc;
}

int main(int argc, char **argv) {
  const char *device = "cuda", *cname = "bf16";
  int reps = 10, a = 1;
  for (; a + 1 < argc && !strncmp(argv[a], "--", 2); a += 2) {
    if (!strcmp(argv[a], "--device")) device = argv[a + 1];
    else if (!strcmp(argv[a], "--compute")) cname = argv[a + 1];
    else if (!strcmp(argv[a], "--reps")) reps = atoi(argv[a + 1]);
    else break;
  }
  ml_dtype compute = !strcmp(cname, "bf16") ? ML_BF16 : !strcmp(cname, "f32") ? ML_F32 : ML_DTYPE_COUNT;
  if (compute == ML_DTYPE_COUNT || reps < 1 || reps > 1000 || (argc - a) % 5 || argc == a) {
    fprintf(stderr,
            "usage: bench_cuda_attention [--device cuda|cpu] [--compute bf16|f32] [--reps 1..1000] "
            "B S nh nkv hd [B S nh nkv hd ...]\n");
    return 2;
  }
  ml_backend *be;
  if (ml_backend_get(device, 0, &be)) {
    fprintf(stderr, "bench_cuda_attention: %s\n", ml_error_msg());
    return 1;
  }
  int rc = 0;
  for (; a < argc && rc == 0; a += 5) {
    shape s;
    int64_t *f[] = {&s.B, &s.S, &s.nh, &s.nkv, &s.hd};
    for (int i = 0; i < 5; i++) *f[i] = strtoll(argv[a + i], NULL, 10);
    if (s.B < 1 || s.S < 1 || s.nkv < 1 || s.nh % s.nkv || s.hd < 8 || s.hd > 256 || s.hd % 8 ||
        s.B * s.S > (1 << 24) || s.nh > 256) {
      fprintf(stderr, "bench_cuda_attention: shape %s %s %s %s %s: expected B, S >= 1 (B·S <= "
                      "2^24), nh a multiple of nkv (<= 256), hd a multiple of 8 in 8..256\n",
              argv[a], argv[a + 1], argv[a + 2], argv[a + 3], argv[a + 4]);
      rc = 2;
      break;
    }
    rc = run(be, device, compute, reps, s) ? 1 : 0;
  }
  ml_backend_release_all();
  return rc;
}
