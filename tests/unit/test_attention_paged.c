/* Paged block attention (backend.h ml_attn_block.kv_table, vLLM's
 * PagedAttention) on the CPU backend against the same keys laid out
 * contiguously (k_bs per sequence), as a KV cache's steps call it: decode
 * steps (sq = 1 at q_pos p over keys 0 .. p) and a prefill chunk, B = 2
 * sequences in one call, blocks of 16 rows scattered over the pool in an
 * order unrelated to the positions.
 *
 * Expected, in the batch-invariant mode (the fixed order, which generation
 * = scoring rests on): out and lse bitwise equal (memcmp), fp32 and bf16
 * products, fp32 and bf16 storage (bf16 storage against unpaged keys of
 * the same bf16 values). Why no tolerance: the fixed order loads key rows
 * one at a time into fp32 tiles either way, and the paged kernel reads the
 * same values (fp32 keys under bf16 products rounded as read = the rounded
 * copy the unpaged call makes; bf16 storage = those rounded values), so
 * every product and sum is the same. Out of that mode a tile's rows are
 * gathered for the GEMMs, whose bf16 kernels may block a gathered operand
 * differently (no bitwise claim there; tests/mpi/test_generate.c bounds
 * generation out of the mode). The backward refuses paged keys. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "check_util.h"
#include "backend/backend.h"
#include "common/status.h"
#include "tensor/dtype.h"

enum { BS = 16 /* rows a block */ };

static ml_backend *cpu_backend(void) {
  static ml_backend *be;
  if (!be && ml_backend_get("cpu", 0, &be)) fail_msg("cpu backend: %s", ml_error_msg());
  return be;
}

typedef struct paged_case {
  int64_t S, nh, nkv, hd, window;
} paged_case;

/* Two sequences of S keys: contiguous k, v [2][S, nkv, hd], and the same
 * rows in a pool of blocks (fp32 and bf16), sequence b's block i at pool
 * block table[b·nb + i], the blocks dealt out in a scrambled order. */
typedef struct paged {
  paged_case c;
  float *q, *k, *v, *kr, *vr; /* kr, vr: k, v rounded to bf16 (fp32 holding them) */
  float *pk, *pv;             /* the pool, fp32 */
  uint16_t *hk, *hv;          /* the pool, bf16 */
  int32_t *table;
  int64_t nb;                 /* blocks a sequence */
} paged;

static paged paged_make(paged_case c) {
  paged p = {.c = c, .nb = (c.S + BS - 1) / BS};
  int64_t kr = c.nkv * c.hd, nk = 2 * c.S * kr, pool = 2 * p.nb * BS * kr;
  p.q = rand_buf(2 * c.S * c.nh * c.hd, 1.5f), p.k = rand_buf(nk, 1.5f), p.v = rand_buf(nk, 1);
  p.kr = malloc(sizeof(float) * (size_t)nk), p.vr = malloc(sizeof(float) * (size_t)nk);
  for (int64_t i = 0; i < nk; i++) {
    p.kr[i] = ml_bf16_to_f32(ml_f32_to_bf16(p.k[i]));
    p.vr[i] = ml_bf16_to_f32(ml_f32_to_bf16(p.v[i]));
  }
  p.pk = calloc((size_t)pool, sizeof(float)), p.pv = calloc((size_t)pool, sizeof(float));
  p.hk = calloc((size_t)pool, sizeof(uint16_t)), p.hv = calloc((size_t)pool, sizeof(uint16_t));
  p.table = malloc(sizeof(int32_t) * (size_t)(2 * p.nb));
  int64_t nblocks = 2 * p.nb;
  assert_true(nblocks % 7 != 0); /* i·7 + 3 mod nblocks: a permutation */
  for (int64_t i = 0; i < nblocks; i++) p.table[i] = (int32_t)((i * 7 + 3) % nblocks);
  for (int64_t b = 0; b < 2; b++)
    for (int64_t j = 0; j < c.S; j++) {
      int64_t row = p.table[b * p.nb + j / BS] * BS + j % BS, src = (b * c.S + j) * kr;
      memcpy(p.pk + row * kr, p.k + src, sizeof(float) * (size_t)kr);
      memcpy(p.pv + row * kr, p.v + src, sizeof(float) * (size_t)kr);
      for (int64_t d = 0; d < kr; d++)
        p.hk[row * kr + d] = ml_f32_to_bf16(p.k[src + d]), p.hv[row * kr + d] = ml_f32_to_bf16(p.v[src + d]);
    }
  return p;
}

static void paged_free(paged *p) {
  free(p->q), free(p->k), free(p->v), free(p->kr), free(p->vr), free(p->pk), free(p->pv);
  free(p->hk), free(p->hv), free(p->table);
}

/* Rows q_pos .. q_pos+sq−1 of both sequences over keys 0 .. q_pos+sq−1:
 * unpaged (contiguous k, v: kv16 picks the bf16-valued copies) and paged
 * (the fp32 or the bf16 pool), compared bitwise. */
static void compare(const paged *p, int64_t q_pos, int64_t sq, ml_dtype compute, bool kv16) {
  ml_backend *be = cpu_backend();
  const paged_case *c = &p->c;
  int64_t qr = c->nh * c->hd, kr = c->nkv * c->hd;
  ml_attn_block blk = {.B = 2, .sq = sq, .sk = q_pos + sq, .nh = c->nh, .nkv = c->nkv,
                       .hd = c->hd, .q_pos = q_pos, .q_bs = c->S * qr, .k_bs = c->S * kr,
                       .l_bs = sq * c->nh, .scale = 0.25f, .window = c->window};
  size_t on = sizeof(float) * (size_t)(2 * c->S * qr), ln = sizeof(float) * (size_t)(2 * sq * c->nh);
  float *o1 = calloc(1, on), *o2 = calloc(1, on), *l1 = malloc(ln), *l2 = malloc(ln);
  const float *q = p->q + q_pos * qr;
  if (ml_be_attention_block_fwd(be, &blk, q, kv16 ? p->kr : p->k, kv16 ? p->vr : p->v,
                                o1 + q_pos * qr, l1, false, compute))
    fail_msg("unpaged: %s", ml_error_msg());
  ml_attn_block pg = blk;
  pg.k_bs = 0, pg.kv_table = p->table, pg.kv_block = BS, pg.table_bs = p->nb, pg.kv_bf16 = kv16;
  if (ml_be_attention_block_fwd(be, &pg, q, kv16 ? (const float *)p->hk : p->pk,
                                kv16 ? (const float *)p->hv : p->pv, o2 + q_pos * qr, l2, false,
                                compute))
    fail_msg("paged: %s", ml_error_msg());
  assert_memory_equal(o1, o2, on);
  assert_memory_equal(l1, l2, ln);
  free(o1), free(o2), free(l1), free(l2);
}

static void test_paged_equals_contiguous(void **state) {
  (void)state;
  static const paged_case cases[] = {
      {300, 4, 2, 16, 0},   /* GQA, several key tiles of 128 */
      {300, 4, 1, 16, 40},  /* a sliding window inside a tile */
      {200, 2, 1, 16, 130}, /* a window across a tile boundary */
  };
  ml_backend *be = cpu_backend();
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    paged p = paged_make(cases[i]);
    int64_t S = cases[i].S;
    assert_int_equal(ml_be_set_batch_invariant(be, true), 0);
    for (int mode = 0; mode < 3; mode++) { /* fp32; bf16 products on fp32, on bf16 storage */
      ml_dtype compute = mode ? ML_BF16 : ML_F32;
      bool kv16 = mode == 2;
      const int64_t steps[] = {0, 15, 16, 127, 128, 129, S - 1};
      for (size_t s = 0; s < sizeof steps / sizeof steps[0]; s++)
        compare(&p, steps[s], 1, compute, kv16); /* decode steps */
      compare(&p, 37, S - 37, compute, kv16);     /* a prefill chunk from 37 on */
      compare(&p, 0, S, compute, kv16);           /* the whole prompt */
    }
    assert_int_equal(ml_be_set_batch_invariant(be, false), 0);
    printf("  paged S=%lld window=%lld: = contiguous, bitwise (fixed order; fp32, bf16 products, "
           "bf16 storage)\n",
           (long long)S, (long long)cases[i].window);
    paged_free(&p);
  }
}

/* A paged call with a table too short for its keys, a block size < 1, or
 * paged keys in the backward: one message each. */
static void test_paged_errors(void **state) {
  (void)state;
  ml_backend *be = cpu_backend();
  int32_t table[2] = {0, 1};
  float x[64] = {0}, lse[4];
  ml_error_clear();
  ml_attn_block blk = {.B = 1, .sq = 1, .sk = 33, .nh = 1, .nkv = 1, .hd = 2, .q_pos = 32,
                       .q_bs = 2, .l_bs = 1, .scale = 1.0f, .kv_table = table, .kv_block = 16,
                       .table_bs = 2};
  assert_int_equal(ml_be_attention_block_fwd(be, &blk, x, x, x, x, lse, false, ML_F32), -1);
  assert_non_null(strstr(ml_error_msg(), "table_bs 2 entries a sequence; expected kv_block >= 1 "
                                         "and table_bs >= 3 (sk 33)"));
  blk.kv_block = 0;
  ml_error_clear();
  assert_int_equal(ml_be_attention_block_fwd(be, &blk, x, x, x, x, lse, false, ML_F32), -1);
  assert_non_null(strstr(ml_error_msg(), "kv_block 0"));
  blk.kv_block = 16, blk.sk = 32, blk.q_pos = 31;
  ml_error_clear();
  assert_int_equal(ml_be_attention_block_bwd(be, &blk, x, x, x, x, x, lse, x, x, x, ML_F32, NULL),
                   -1);
  assert_non_null(strstr(ml_error_msg(), "paged keys (kv_table set)"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_paged_equals_contiguous),
      cmocka_unit_test(test_paged_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
