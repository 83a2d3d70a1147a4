/* The paged KV cache's bookkeeping (engine/kvcache.h) on the CPU backend:
 * block tables grow by blocks, a fork shares the full blocks by reference
 * and copies the partial last one (its rows bitwise the source's), a block
 * returns to the free list only when its last holder releases it, and the
 * attention core writes a step's keys and values into the slot's blocks
 * (fp32 copied, bf16 rounded to nearest-even). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "check_util.h"
#include "common/status.h"
#include "engine/kvcache.h"
#include "tensor/dtype.h"

enum { L = 2, NKV = 2, HD = 4, KR = NKV * HD };

static ml_backend *cpu_backend(void) {
  static ml_backend *be;
  if (!be && ml_backend_get("cpu", 0, &be)) fail_msg("cpu backend: %s", ml_error_msg());
  return be;
}

static ml_model_config config(void) {
  return (ml_model_config){.n_layers = L, .n_heads = NKV, .n_kv_heads = NKV, .head_dim = HD};
}

/* Row `pos` of slot s's layer l keys (kv 0) or values (kv 1) in the pool. */
static const void *row_of(const ml_kv_pool *p, int64_t s, int64_t l, int kv, int64_t pos) {
  int32_t b = p->host_table[s * p->maxb + pos / ML_KV_BLOCK];
  size_t esz = p->bf16 ? 2 : 4;
  int64_t at = (((l * 2 + kv) * p->nblocks + b) * ML_KV_BLOCK + pos % ML_KV_BLOCK) * KR;
  return (const char *)p->mem + (size_t)at * esz;
}

/* One step of the core over segment g: q, k, v [n, KR] (one query head a kv head). */
static void step(ml_kv_pool *p, const ml_kv_seg *g, int64_t l, const float *k, const float *v) {
  int64_t n = g->n;
  float q[64 * KR] = {0}, out[64 * KR], lse[64 * NKV];
  assert_true(n <= 64);
  p->seg = g, p->nseg = 1;
  ml_attn_core core = ml_kv_core(p);
  ml_attn_call c = {.q = q, .k = k, .v = v, .B = 1, .S = n, .nh = NKV, .nkv = NKV, .hd = HD,
                    .group = 1, .scale = 0.5f, .compute = p->bf16 ? ML_BF16 : ML_F32,
                    .layer = l};
  if (core.fwd(core.ctx, &c, out, lse)) fail_msg("kv core: %s", ml_error_msg());
}

static void check_rows(const ml_kv_pool *p, int64_t s, int64_t l, int kv, int64_t pos0,
                       const float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const void *r = row_of(p, s, l, kv, pos0 + i);
    for (int64_t d = 0; d < KR; d++) {
      float want = x[i * KR + d];
      if (p->bf16) assert_int_equal(((const uint16_t *)r)[d], ml_f32_to_bf16(want));
      else assert_memory_equal((const float *)r + d, &want, sizeof want);
    }
  }
}

static void check_pool(bool bf16) {
  ml_model_config c = config();
  ml_kv_pool p;
  enum { SLOTS = 3, CAP = 40, NB = 8, P = 21 /* a prompt: one full block and 5 positions */ };
  if (ml_kv_pool_create(&p, cpu_backend(), &c, NKV, SLOTS, CAP, NB, bf16))
    fail_msg("pool: %s", ml_error_msg());
  assert_int_equal(p.maxb, 3);
  assert_int_equal(p.nfree, NB);
  int64_t taken;
  /* slot 0 prefills P positions: 2 blocks */
  assert_int_equal(ml_kv_reserve(&p, 0, P, &taken), 0);
  assert_int_equal(taken, 2);
  assert_int_equal(p.nfree, NB - 2);
  float *k = rand_buf(P * KR, 1.5f), *v = rand_buf(P * KR, 1.0f);
  ml_kv_seg pre = {0, 0, P, 0};
  for (int64_t l = 0; l < L; l++) step(&p, &pre, l, k, v);
  for (int64_t l = 0; l < L; l++) check_rows(&p, 0, l, 0, 0, k, P), check_rows(&p, 0, l, 1, 0, v, P);
  /* slot 1 forks it: the full block shared, the partial one copied */
  assert_int_equal(ml_kv_fork(&p, 0, 1, P, &taken), 0);
  assert_int_equal(taken, 1);
  assert_int_equal(p.nfree, NB - 3);
  assert_int_equal(p.host_table[1 * p.maxb], p.host_table[0]);
  assert_int_not_equal(p.host_table[1 * p.maxb + 1], p.host_table[1]);
  assert_int_equal(p.ref[p.host_table[0]], 2);
  for (int64_t l = 0; l < L; l++) check_rows(&p, 1, l, 0, 0, k, P), check_rows(&p, 1, l, 1, 0, v, P);
  /* slot 1 decodes position P into its own copy: slot 0's row P untouched */
  float k1[KR], v1[KR];
  for (int d = 0; d < KR; d++) k1[d] = 7.0f + (float)d, v1[d] = -3.0f - (float)d;
  ml_kv_seg dec = {1, P, 1, 0};
  assert_int_equal(ml_kv_reserve(&p, 1, P + 1, &taken), 0);
  assert_int_equal(taken, 0);
  step(&p, &dec, 0, k1, v1);
  check_rows(&p, 1, 0, 0, P, k1, 1);
  assert_memory_not_equal(row_of(&p, 0, 0, 0, P), row_of(&p, 1, 0, 0, P), KR * (bf16 ? 2 : 4));
  /* a segment past the slot's blocks is refused */
  ml_kv_seg past = {1, 2 * ML_KV_BLOCK, 1, 0};
  ml_error_clear();
  p.seg = &past, p.nseg = 1;
  ml_attn_core core = ml_kv_core(&p);
  ml_attn_call call = {.q = k1, .k = k1, .v = v1, .B = 1, .S = 1, .nh = NKV, .nkv = NKV,
                       .hd = HD, .group = 1, .scale = 1, .compute = bf16 ? ML_BF16 : ML_F32};
  float o[KR], ls[NKV];
  assert_int_equal(core.fwd(core.ctx, &call, o, ls), -1);
  assert_non_null(strstr(ml_error_msg(), "its slot's 2 blocks of 16 positions"));
  /* slot 0 released: only its own partial block frees; slot 1 then frees both of its */
  assert_int_equal(ml_kv_release(&p, 0), 1);
  assert_int_equal(p.ref[p.host_table[1 * p.maxb]], 1);
  assert_int_equal(ml_kv_release(&p, 1), 2);
  assert_int_equal(p.nfree, NB);
  /* every block taken: the next one is refused with a message */
  for (int64_t s = 0; s < SLOTS - 1; s++) assert_int_equal(ml_kv_reserve(&p, s, CAP, NULL), 0);
  ml_error_clear();
  assert_int_equal(ml_kv_reserve(&p, 2, CAP, NULL), -1);
  assert_non_null(strstr(ml_error_msg(), "no free block"));
  printf("  kv pool %s: tables, fork (shared + copied block), release, limits\n",
         bf16 ? "bf16" : "fp32");
  free(k), free(v);
  ml_kv_pool_destroy(&p);
}

static void test_pool_fp32(void **state) {
  (void)state;
  check_pool(false);
}

static void test_pool_bf16(void **state) {
  (void)state;
  check_pool(true);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_pool_fp32),
      cmocka_unit_test(test_pool_bf16),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
