/* Packed documents' attention (model/varlen.h) on the CPU backend, alone:
 * the varlen core on one row of documents, two paths timed in turn in one
 * process — `one-call` (the backend's varlen attention, every document in
 * one call: ML_OP_ATTENTION_VARLEN) and `per-doc` (the same backend
 * declaring no varlen attention: one block call per document, what main
 * runs and CUDA still runs). Forward (scoring) and, with --bwd 1, the
 * backward (packed training). nh query heads over nkv key/value heads of
 * hd (SmolLM2-135M's 9/3/64 by default); --bf16 1: bf16 q, k, v and out,
 * bf16 products (as scoring under --param-dtype bf16 runs it).
 *
 * Document lengths uniform in [min-len, max-len] (seed); q, k, v, dout
 * random normal (bench/METHOD's rule). The two paths alternate call by
 * call, so a machine's load falls on both alike; 2 warm-up calls each,
 * then REPS each; prints the minimum and the median (ms), wall clock.
 *
 * usage: bench_attn_varlen [--n 16] [--min-len 512] [--max-len 512] [--seed 1] [--reps 10]
 *                          [--nh 9] [--nkv 3] [--hd 64] [--bf16 0|1] [--bwd 0|1] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "bench_util.h"
#include "common/status.h"
#include "model/varlen.h"
#include "tensor/dtype.h"

static void *buf(ml_backend *be, int64_t n, size_t esz) {
  void *p = ml_be_alloc(be, n, esz, "a bench buffer");
  if (!p) {
    fprintf(stderr, "bench_attn_varlen: %s\n", ml_error_msg());
    exit(1);
  }
  return p;
}

int main(int argc, char **argv) {
  int64_t n = 16, lo = 512, hi = 512, seed = 1, reps = 10, nh = 9, nkv = 3, hd = 64, bf = 0,
          bwd = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    int64_t x = strtoll(argv[i + 1], NULL, 10);
    const char *f = argv[i];
    if (!strcmp(f, "--n")) n = x;
    else if (!strcmp(f, "--min-len")) lo = x;
    else if (!strcmp(f, "--max-len")) hi = x;
    else if (!strcmp(f, "--seed")) seed = x;
    else if (!strcmp(f, "--reps")) reps = x;
    else if (!strcmp(f, "--nh")) nh = x;
    else if (!strcmp(f, "--nkv")) nkv = x;
    else if (!strcmp(f, "--hd")) hd = x;
    else if (!strcmp(f, "--bf16")) bf = x;
    else if (!strcmp(f, "--bwd")) bwd = x;
    else {
      fprintf(stderr, "bench_attn_varlen: unknown flag %s (see the file's header)\n", f);
      return 2;
    }
  }
  if (n < 1 || n > 100000 || lo < 1 || hi < lo || hi > 65536 || reps < 1 || reps > 1000 ||
      nh < 1 || nkv < 1 || nh % nkv || hd < 1 || hd > 512) {
    fprintf(stderr, "bench_attn_varlen: expected 1 <= n <= 1e5, 1 <= min-len <= max-len <= "
                    "65536, 1 <= reps <= 1000, nkv dividing nh, 1 <= hd <= 512\n");
    return 2;
  }
  ml_backend *cpu;
  if (ml_backend_get("cpu", 0, &cpu)) {
    fprintf(stderr, "bench_attn_varlen: %s\n", ml_error_msg());
    return 1;
  }
  ml_backend_ops ops = *cpu->ops;
  ops.supports &= ~ML_OP_BIT(ML_OP_ATTENTION_VARLEN);
  ml_backend loop = {.ops = &ops, .impl = cpu->impl};
  int64_t *cu = malloc(sizeof(int64_t) * (size_t)(n + 1));
  uint64_t s = (uint64_t)seed * 2862933555777941757ull + 3037000493ull;
  cu[0] = 0;
  for (int64_t d = 0; d < n; d++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    cu[d + 1] = cu[d] + lo + (int64_t)((s >> 33) % (uint64_t)(hi - lo + 1));
  }
  int64_t T = cu[n], qr = nh * hd, kr = nkv * hd;
  size_t e = bf ? sizeof(uint16_t) : sizeof(float);
  float *q32 = buf(cpu, T * qr, 4), *k32 = buf(cpu, T * kr, 4), *v32 = buf(cpu, T * kr, 4);
  float *dout = buf(cpu, T * qr, 4), *lse = buf(cpu, T * nh, 4), *dq = buf(cpu, T * qr, 4);
  float *dk = buf(cpu, T * kr, 4), *dv = buf(cpu, T * kr, 4);
  void *q = buf(cpu, T * qr, e), *k = buf(cpu, T * kr, e), *v = buf(cpu, T * kr, e);
  void *out = buf(cpu, T * qr, e);
  bench_normal_fill(q32, T * qr, 1), bench_normal_fill(k32, T * kr, 2);
  bench_normal_fill(v32, T * kr, 3), bench_normal_fill(dout, T * qr, 4);
  if (bf) {
    ml_be_convert(cpu, q, ML_BF16, q32, ML_F32, (size_t)(T * qr));
    ml_be_convert(cpu, k, ML_BF16, k32, ML_F32, (size_t)(T * kr));
    ml_be_convert(cpu, v, ML_BF16, v32, ML_F32, (size_t)(T * kr));
  } else {
    memcpy(q, q32, sizeof(float) * (size_t)(T * qr));
    memcpy(k, k32, sizeof(float) * (size_t)(T * kr));
    memcpy(v, v32, sizeof(float) * (size_t)(T * kr));
  }
  ml_varlen vl[2] = {{.be = cpu, .ndocs = n, .cu = cu}, {.be = &loop, .ndocs = n, .cu = cu}};
  ml_attn_call c = {.q = q, .k = k, .v = v, .B = 1, .S = T, .nh = nh, .nkv = nkv, .hd = hd,
                    .scale = 1.0f / sqrtf((float)hd), .compute = bf ? ML_BF16 : ML_F32,
                    .qkv_bf16 = bf, .out_bf16 = bf};
  double *t[2] = {malloc(sizeof(double) * (size_t)reps), malloc(sizeof(double) * (size_t)reps)};
  for (int64_t r = -2; r < reps; r++)
    for (int p = 0; p < 2; p++) {
      ml_attn_core core = ml_varlen_core(&vl[p]);
      double t0 = bench_now();
      int rc = core.fwd(core.ctx, &c, out, lse);
      if (!rc && bwd) {
        t0 = bench_now(); /* the backward alone */
        rc = core.bwd(core.ctx, &c, dout, out, lse, dq, dk, dv);
      }
      double dt = bench_now() - t0;
      if (rc) {
        fprintf(stderr, "bench_attn_varlen: %s\n", ml_error_msg());
        return 1;
      }
      if (r >= 0) t[p][r] = dt;
    }
  const char *names[2] = {"one-call", "per-doc"};
  for (int p = 0; p < 2; p++) {
    qsort(t[p], (size_t)reps, sizeof(double), bench_cmp_double);
    printf("%s %s %s: %lld documents of %lld..%lld tokens (%lld), heads %lld/%lld of %lld: "
           "min %.2f ms, median %.2f ms over %lld calls\n",
           bwd ? "backward" : "forward", bf ? "bf16" : "fp32", names[p], (long long)n,
           (long long)lo, (long long)hi, (long long)T, (long long)nh, (long long)nkv,
           (long long)hd, 1e3 * t[p][0], 1e3 * t[p][reps / 2], (long long)reps);
  }
  ml_varlen_destroy(&vl[0]), ml_varlen_destroy(&vl[1]);
  ml_backend_release_all();
  return 0;
}
