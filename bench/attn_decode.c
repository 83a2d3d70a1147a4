/* The CPU backend's block attention over a paged KV cache, alone, as a
 * decode or short prefill step calls it (engine/kvcache.c): B sequences of
 * sq query rows at positions sk − sq .. sk − 1 against their sk keys in
 * 16-position blocks (ml_attn_block.kv_table), nh query heads over nkv
 * key/value heads of hd; fp32 (fp32 pool) or bf16 (bf16 pool, bf16
 * products). Two paths, each timed: `rows`, the batch-invariant mode's
 * (ml_be_set_batch_invariant on: the row kernel, kernels.h K_ATTN_ROWS),
 * and `default` (the mode off: the row kernel up to K_ATTN_ROWS rows a
 * sequence, per-tile GEMMs above). Run it under OMP_NUM_THREADS=1 and 2
 * to see what waking the team buys (K_ATTN_PAR_MAC).
 *
 * q, k, v random normal (bench/METHOD's rule: never zeros); the blocks of
 * each sequence shuffled over the pool as a running cache leaves them. 3
 * warm-up calls, then the median of at least REPS calls (more while under
 * 0.1 s in all), wall clock.
 *
 * usage: bench_attn_decode [--reps 20] [--Bs 1,8,64] [--sqs 1] [--sks 192,512,2048]
 *                          [--nh 9] [--nkv 3] [--hd 64] [--dtypes f32,bf16]
 * prints one line per (dtype, B, sq, sk, path). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "bench_util.h"
#include "common/status.h"
#include "tensor/dtype.h"

enum { BLOCK = 16 };

/* a comma-separated list of at most cap integers in [1, 2^20]; its length, or 0 */
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

typedef struct shape {
  int64_t B, sq, sk, nh, nkv, hd;
  bool bf;
} shape;

/* Times one shape on both paths and prints their lines. */
static int run(ml_backend *be, shape s, int reps) {
  int64_t nb = (s.sk + BLOCK - 1) / BLOCK, blocks = s.B * nb, kr = s.nkv * s.hd;
  int64_t nq = s.B * s.sq * s.nh * s.hd, pool = blocks * BLOCK * kr;
  size_t esz = s.bf ? sizeof(uint16_t) : sizeof(float);
  float *q = malloc(sizeof(float) * (size_t)nq), *out = malloc(sizeof(float) * (size_t)nq);
  float *lse = malloc(sizeof(float) * (size_t)(s.B * s.sq * s.nh));
  float *kv32 = malloc(sizeof(float) * (size_t)pool);
  void *k = malloc(esz * (size_t)pool), *v = malloc(esz * (size_t)pool);
  int32_t *table = malloc(sizeof(int32_t) * (size_t)blocks);
  double *t = malloc(sizeof(double) * 4096);
  if (!q || !out || !lse || !kv32 || !k || !v || !table || !t) {
    fprintf(stderr, "bench_attn_decode: out of memory\n");
    free(q), free(out), free(lse), free(kv32), free(k), free(v), free(table), free(t);
    return -1;
  }
  bench_normal_fill(q, nq, 1);
  for (int kv = 0; kv < 2; kv++) {
    bench_normal_fill(kv32, pool, 2 + (uint64_t)kv);
    void *dst = kv ? v : k;
    if (s.bf) ml_convert_from_f32(ML_BF16, kv32, dst, (size_t)pool);
    else memcpy(dst, kv32, sizeof(float) * (size_t)pool);
  }
  uint64_t r = 12345; /* the blocks shuffled (Fisher–Yates) */
  for (int64_t i = 0; i < blocks; i++) table[i] = (int32_t)i;
  for (int64_t i = blocks - 1; i > 0; i--) {
    r = r * 6364136223846793005ull + 1442695040888963407ull;
    int64_t j = (int64_t)((r >> 33) % (uint64_t)(i + 1));
    int32_t x = table[i];
    table[i] = table[j], table[j] = x;
  }
  ml_attn_block blk = {.B = s.B, .sq = s.sq, .sk = s.sk, .nh = s.nh, .nkv = s.nkv, .hd = s.hd,
                       .q_pos = s.sk - s.sq, .q_bs = s.sq * s.nh * s.hd, .l_bs = s.sq * s.nh,
                       .scale = 0.125f, .kv_table = table, .kv_block = BLOCK,
                       .table_bs = nb, .kv_bf16 = s.bf};
  int rc = 0;
  for (int path = 0; path < 2 && rc == 0; path++) {
    rc = ml_be_set_batch_invariant(be, path == 0);
    int n = 0;
    double spent = 0;
    for (int i = -3; rc == 0 && n < 4096 && (n < reps || spent < 0.1); i++) {
      double t0 = bench_now();
      rc = ml_be_attention_block_fwd(be, &blk, q, k, v, out, lse, false,
                                     s.bf ? ML_BF16 : ML_F32);
      double dt = bench_now() - t0;
      if (i >= 0) t[n++] = dt, spent += dt;
    }
    if (rc) break;
    qsort(t, (size_t)n, sizeof(double), bench_cmp_double);
    double macs = 2.0 * (double)(s.B * s.nh * s.sq) * (double)s.sk * (double)s.hd;
    printf("attn %s B %3lld sq %3lld sk %5lld nh %lld nkv %lld hd %lld %-7s: %9.4f ms  "
           "%7.2f GFLOP/s  (median of %d)\n",
           s.bf ? "bf16" : "f32 ", (long long)s.B, (long long)s.sq, (long long)s.sk,
           (long long)s.nh, (long long)s.nkv, (long long)s.hd, path ? "default" : "rows",
           t[n / 2] * 1e3, 2.0 * macs / t[n / 2] * 1e-9, n);
  }
  if (rc) fprintf(stderr, "bench_attn_decode: %s\n", ml_error_msg());
  free(q), free(out), free(lse), free(kv32), free(k), free(v), free(table), free(t);
  return rc;
}

int main(int argc, char **argv) {
  int64_t Bs[16] = {1, 8, 64}, sqs[16] = {1}, sks[16] = {192, 512, 2048};
  int64_t nh = 9, nkv = 3, hd = 64;
  int nB = 3, nsq = 1, nsk = 3, reps = 20, a = 1;
  bool dts[2] = {true, true};
  for (; a + 1 < argc; a += 2) {
    if (!strcmp(argv[a], "--reps")) reps = atoi(argv[a + 1]);
    else if (!strcmp(argv[a], "--Bs")) nB = parse_list(argv[a + 1], Bs, 16);
    else if (!strcmp(argv[a], "--sqs")) nsq = parse_list(argv[a + 1], sqs, 16);
    else if (!strcmp(argv[a], "--sks")) nsk = parse_list(argv[a + 1], sks, 16);
    else if (!strcmp(argv[a], "--nh")) nh = strtoll(argv[a + 1], NULL, 10);
    else if (!strcmp(argv[a], "--nkv")) nkv = strtoll(argv[a + 1], NULL, 10);
    else if (!strcmp(argv[a], "--hd")) hd = strtoll(argv[a + 1], NULL, 10);
    else if (!strcmp(argv[a], "--dtypes")) {
      dts[0] = strstr(argv[a + 1], "f32") != NULL;
      dts[1] = strstr(argv[a + 1], "bf16") != NULL;
    } else break;
  }
  if (a != argc || reps < 1 || reps > 4096 || !nB || !nsq || !nsk || nh < 1 || nkv < 1 ||
      nh % nkv || hd < 2 || hd > 512 || hd % 2 || !(dts[0] || dts[1])) {
    fprintf(stderr, "usage: bench_attn_decode [--reps 1..4096] [--Bs 1,8,64] [--sqs 1] "
                    "[--sks 192,512,2048] [--nh 9] [--nkv 3 (divides nh)] [--hd 64 (even, "
                    "<= 512)] [--dtypes f32,bf16]\n");
    return 2;
  }
  ml_backend *be;
  if (ml_backend_get("cpu", 0, &be)) {
    fprintf(stderr, "bench_attn_decode: %s\n", ml_error_msg());
    return 1;
  }
  int rc = 0;
  for (int d = 0; d < 2 && rc == 0; d++)
    for (int i = 0; dts[d] && i < nB && rc == 0; i++)
      for (int j = 0; j < nsq && rc == 0; j++)
        for (int l = 0; l < nsk && rc == 0; l++)
          if (sqs[j] <= sks[l])
            rc = run(be, (shape){Bs[i], sqs[j], sks[l], nh, nkv, hd, d == 1}, reps) ? 1 : 0;
  ml_backend_release_all();
  return rc;
}
