/* Varlen attention (model/varlen.h) on the CPU backend: packed documents
 * against each document run alone.
 *
 * Reference: per document, the backend's whole-sequence attention of that
 * document as a batch of its own (ml_be_attention_fwd / _bwd, B = 1, S =
 * its length), on the same q, k, v, dout; where the heads group in a way
 * that call cannot express (head_off ≠ 0 or group · nkv ≠ nh: a tp size
 * not dividing the heads), the whole document as one block of block
 * attention, as model/layer.c runs such whole sequences. Expected: out,
 * lse, dq, dk, dv bitwise equal. Why no tolerance: varlen runs each
 * document as the block q_pos = k_pos = 0, sq = sk = length on pointers
 * offset to its first token, which is the call the CPU's whole-sequence
 * attention makes (backend/cpu/cpu.c `whole`): the same kernel with the same
 * tiles (from the document's first token), the same products in the same
 * order on the same operands (the buffers come from the same pool, the
 * reference's outputs at the same offsets), and each output row is
 * written by one task whatever the thread (kernels/cpu/attention.c), so
 * not one rounding differs. The tokens outside every document must come
 * out as attending to nothing: out 0, lse −inf, dq, dk, dv 0.
 *
 * Each case runs twice: on the CPU backend, whose varlen attention
 * (ML_OP_ATTENTION_VARLEN) runs every document in one call, and on the
 * same backend declaring no varlen attention (the CUDA backend's case),
 * where the core runs a block per document. Why the one call gives the same
 * bits: its documents' tasks are those blocks' tasks, on the same tiles
 * from each document's first token, only scheduled together (kernels.h
 * k_attention_varlen_fwd / _bwd). Its backward again with the smallest
 * workspace the kernel takes (documents grouped into several chunks, the
 * longest alone in k_attention_block_bwd's chunks): bitwise the same, as
 * the kernel's result does not depend on the store's size. And the fp32
 * cases under the batch-invariant mode (ml_be_set_batch_invariant: every
 * document's forward in the row kernel's fixed order), against the
 * reference in that mode.
 *
 * The bf16 cases run again with bf16 q, k, v and out (ml_attn_call.qkv_bf16,
 * .out_bf16, which the core declares: packed documents under bf16 weights,
 * model.h ml_model_bf16_qkv / _att). Reference: the same per-document
 * calls on fp32 q, k, v holding the bf16 values, the forward's out then
 * rounded to bf16 (nearest-even, ml_be_round_bf16_to) and the backward
 * reading that rounded out. Expected: the bf16 out equal to the rounded
 * reference out (memcmp of the bf16), lse, dq, dk, dv bitwise. Why no
 * tolerance: the block calls read bf16 q, k, v exactly (widening is exact),
 * which gives bitwise the results of fp32 operands holding those values
 * (backend.h ml_attn_block.qkv_bf16), their out_bf16 store is the once-
 * rounded fp32 out, and the backward reads it exactly for D = rowsum(dout ⊙
 * out): the same products and sums on the same values as the reference. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "backend/meta/meta.h"
#include "check_util.h"
#include "common/status.h"
#include "kernels/cpu/kernels.h"
#include "model/varlen.h"
#include "noblock.h"

static ml_backend *cpu_backend(void) {
  static ml_backend *be;
  if (!be && ml_backend_get("cpu", 0, &be)) fail_msg("cpu backend: %s", ml_error_msg());
  return be;
}

enum { MAX_DOCS = 8 };

typedef struct varlen_case {
  const char *name;
  int64_t B, S, nh, nkv, hd, group, head_off, window;
  ml_dtype compute;
  int64_t ndocs;
  int64_t cu[MAX_DOCS + 1];
  int64_t used[MAX_DOCS];
  bool has_used;
} varlen_case;

/* Lengths 1, 7, 63/64/65 and 128/129/130/134 around the kernel's tiles
 * (64 query rows, 128 keys), padding at a row's end, inside a slot and as
 * a whole slot. */
static const varlen_case k_cases[] = {
    {"gqa 4/2, causal, tail padding", 2, 200, 4, 2, 16, 2, 0, 0, ML_F32, 5,
     {0, 1, 66, 200, 329, 336}, {0}, false},
    {"gqa 4/2, window 37, padded slots", 2, 200, 4, 2, 16, 2, 0, 37, ML_F32, 5,
     {0, 70, 200, 201, 330, 400}, {63, 130, 1, 128, 0}, true},
    {"group 2 head_off 1 (3 heads), window 50, bf16", 1, 300, 3, 2, 8, 2, 1, 50, ML_BF16, 4,
     {0, 64, 192, 193, 290}, {0}, false},
    {"mha 2/2, one document per row", 2, 130, 2, 2, 8, 1, 0, 0, ML_F32, 2, {0, 130, 260}, {0},
     false},
    {"gqa 4/2, window 37, padded slots, bf16", 2, 200, 4, 2, 16, 2, 0, 37, ML_BF16, 5,
     {0, 70, 200, 201, 330, 400}, {63, 130, 1, 128, 0}, true},
};

typedef struct bufs {
  float *out, *lse, *dq, *dk, *dv;
} bufs;

static float *pool_buf(int64_t n) {
  float *p = ml_be_alloc(cpu_backend(), n, sizeof(float), "a test buffer");
  if (!p) fail_msg("%s", ml_error_msg());
  return p;
}

static void fill(float *x, int64_t n, float c) {
  for (int64_t i = 0; i < n; i++) x[i] = c;
}

static bufs bufs_alloc(int64_t T, int64_t qr, int64_t kr, int64_t nh, float value, float lse) {
  bufs b = {pool_buf(T * qr), pool_buf(T * nh), pool_buf(T * qr), pool_buf(T * kr),
            pool_buf(T * kr)};
  fill(b.out, T * qr, value), fill(b.lse, T * nh, lse), fill(b.dq, T * qr, value);
  fill(b.dk, T * kr, value), fill(b.dv, T * kr, value);
  return b;
}

static void bufs_free(bufs *b) {
  float *p[] = {b->out, b->lse, b->dq, b->dk, b->dv};
  for (int i = 0; i < 5; i++) ml_be_free(cpu_backend(), p[i]);
}

/* got and want hold the same bits (-0 ≠ +0, NaN never passes). */
static void expect_bitwise(const char *what, const char *name, const float *got,
                           const float *want, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (memcmp(&got[i], &want[i], sizeof(float)) != 0 || isnan(got[i]))
      fail_msg("varlen %s, %s: element %lld is %.9g, per document %.9g", name, what,
               (long long)i, (double)got[i], (double)want[i]);
}

/* got and want hold the same bf16 bits. */
static void expect_bitwise16(const char *what, const char *name, const uint16_t *got,
                             const uint16_t *want, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (got[i] != want[i])
      fail_msg("varlen %s, %s: element %lld is bf16 0x%04x, per document 0x%04x", name, what,
               (long long)i, got[i], want[i]);
}

static bool plain(const varlen_case *k) { return k->head_off == 0 && k->group * k->nkv == k->nh; }

static ml_attn_block doc_block(const varlen_case *k, int64_t n) {
  return (ml_attn_block){.B = 1, .sq = n, .sk = n, .nh = k->nh, .nkv = k->nkv, .hd = k->hd,
                         .q_bs = n * k->nh * k->hd, .k_bs = n * k->nkv * k->hd,
                         .l_bs = n * k->nh, .scale = 1.0f / sqrtf((float)k->hd),
                         .window = k->window, .group = k->group, .head_off = k->head_off};
}

/* Document t0 .. t0+n−1 alone, forward: the reference's out and lse into r
 * (at the document's offsets). */
static void reference_fwd(const varlen_case *k, const float *q, const float *kk, const float *v,
                          bufs *r, int64_t t0, int64_t n) {
  ml_backend *be = cpu_backend();
  int64_t qo = t0 * k->nh * k->hd, ko = t0 * k->nkv * k->hd, lo = t0 * k->nh;
  ml_attn_block blk = doc_block(k, n);
  int rc = plain(k) ? ml_be_attention_fwd(be, q + qo, kk + ko, v + ko, r->out + qo, r->lse + lo,
                                          1, n, k->nh, k->nkv, k->hd, blk.scale, k->window,
                                          k->compute)
                    : ml_be_attention_block_fwd(be, &blk, q + qo, kk + ko, v + ko, r->out + qo,
                                                r->lse + lo, false, k->compute);
  assert_int_equal(rc, 0);
}

/* ... backward, from r's out and lse: dq, dk, dv into r. */
static void reference_bwd(const varlen_case *k, const float *q, const float *kk, const float *v,
                          const float *dout, bufs *r, int64_t t0, int64_t n) {
  ml_backend *be = cpu_backend();
  int64_t qo = t0 * k->nh * k->hd, ko = t0 * k->nkv * k->hd, lo = t0 * k->nh;
  float scale = 1.0f / sqrtf((float)k->hd);
  if (plain(k)) {
    size_t wb = ml_be_attention_work(be, 1, n, k->nh, k->nkv, k->hd);
    void *work = ml_be_alloc(be, (int64_t)wb, 1, "the reference's workspace");
    assert_int_equal(ml_be_attention_bwd(be, dout + qo, q + qo, kk + ko, v + ko, r->out + qo,
                                         r->lse + lo, r->dq + qo, r->dk + ko, r->dv + ko, 1, n,
                                         k->nh, k->nkv, k->hd, scale, k->window, k->compute,
                                         work),
                     0);
    ml_be_free(be, work);
    return;
  }
  ml_attn_block blk = doc_block(k, n);
  size_t wb = ml_be_attention_block_work(be, &blk);
  void *work = ml_be_alloc(be, (int64_t)wb, 1, "the reference's workspace");
  /* dq, dk, dv are 0 there (the block backward adds) */
  assert_int_equal(ml_be_attention_block_bwd(be, &blk, dout + qo, q + qo, kk + ko, v + ko,
                                             r->out + qo, r->lse + lo, r->dq + qo, r->dk + ko,
                                             r->dv + ko, k->compute, work),
                   0);
  ml_be_free(be, work);
}

/* n bf16 elements from the pool */
static uint16_t *pool_bf16(int64_t n) { return (uint16_t *)pool_buf(n / 2 + 1); }

/* `base` declaring no varlen attention (its slots set): the core's block
 * per document, as on CUDA. ops must outlive the result. */
static ml_backend novarlen_backend(const ml_backend *base, ml_backend_ops *ops) {
  *ops = *base->ops;
  ops->name = "novarlen";
  ops->supports &= ~ML_OP_BIT(ML_OP_ATTENTION_VARLEN);
  return (ml_backend){.ops = ops, .impl = base->impl};
}

/* The varlen kernel's backward (fp32) with its smallest workspace, against
 * the core's dq, dk, dv in g (bitwise). */
static void expect_small_store(const varlen_case *k, const float *q, const float *kk,
                               const float *v, const float *dout, const bufs *g) {
  int64_t T = k->B * k->S, qr = k->nh * k->hd, kr = k->nkv * k->hd;
  k_attn_block blk = {.B = k->B, .sq = k->S, .sk = k->S, .nh = k->nh, .nkv = k->nkv,
                      .hd = k->hd, .q_bs = k->S * qr, .k_bs = k->S * kr, .l_bs = k->S * k->nh,
                      .scale = 1.0f / sqrtf((float)k->hd), .window = k->window,
                      .group = k->group, .head_off = k->head_off, .bwd_overwrite = true};
  k_attn_docs docs = {.n = k->ndocs, .cu = k->cu, .used = k->has_used ? k->used : NULL};
  size_t wb = k_attention_varlen_bwd_work(&blk, &docs, 0);
  int64_t tf = k_attention_tile_floats(k->hd);
  float *tiles = pool_buf(tf), *dq = pool_buf(T * qr), *dk = pool_buf(T * kr),
        *dv = pool_buf(T * kr);
  void *work = pool_buf((int64_t)(wb / sizeof(float)) + 1);
  fill(dq, T * qr, NAN), fill(dk, T * kr, NAN), fill(dv, T * kr, NAN);
  assert_int_equal(k_attention_varlen_bwd(&blk, &docs, dout, q, kk, v, g->out, g->lse, dq, dk,
                                          dv, NULL, work, wb, tiles),
                   0);
  expect_bitwise("dq (smallest store)", k->name, dq, g->dq, T * qr);
  expect_bitwise("dk (smallest store)", k->name, dk, g->dk, T * kr);
  expect_bitwise("dv (smallest store)", k->name, dv, g->dv, T * kr);
  float *p[] = {tiles, dq, dk, dv, work};
  for (int i = 0; i < 5; i++) ml_be_free(cpu_backend(), p[i]);
}

/* bf16: q, k, v and out go to the core as bf16 (the file's header). core_be:
 * the backend the core runs on (the CPU's, or novarlen_backend of it). */
static void run_case(const varlen_case *k, bool bf16, ml_backend *core_be) {
  ml_backend *be = cpu_backend();
  int64_t T = k->B * k->S, qr = k->nh * k->hd, kr = k->nkv * k->hd;
  float *q = pool_buf(T * qr), *kk = pool_buf(T * kr), *v = pool_buf(T * kr),
        *dout = pool_buf(T * qr);
  for (int64_t i = 0; i < T * qr; i++) q[i] = 2.0f * frand(), dout[i] = frand();
  for (int64_t i = 0; i < T * kr; i++) kk[i] = 2.0f * frand(), v[i] = frand();
  /* bf16: q, k, v rounded in place (the reference's operands) and their bf16 copies */
  uint16_t *q16 = NULL, *k16 = NULL, *v16 = NULL, *out16 = NULL, *want16 = NULL;
  if (bf16) {
    q16 = pool_bf16(T * qr), k16 = pool_bf16(T * kr), v16 = pool_bf16(T * kr);
    out16 = pool_bf16(T * qr), want16 = pool_bf16(T * qr);
    assert_int_equal(ml_be_round_bf16_to(be, q, q, q16, (size_t)(T * qr)), 0);
    assert_int_equal(ml_be_round_bf16_to(be, kk, kk, k16, (size_t)(T * kr)), 0);
    assert_int_equal(ml_be_round_bf16_to(be, v, v, v16, (size_t)(T * kr)), 0);
    memset(out16, 0xff, sizeof(uint16_t) * (size_t)(T * qr)); /* bf16 NaN: must be written */
  }
  bufs g = bufs_alloc(T, qr, kr, k->nh, NAN, NAN); /* every element must be written */
  bufs r = bufs_alloc(T, qr, kr, k->nh, 0.0f, -INFINITY); /* padding: attends to nothing */

  ml_varlen vl = {.be = core_be, .ndocs = k->ndocs, .cu = k->cu,
                 .used = k->has_used ? k->used : NULL};
  ml_attn_core core = ml_varlen_core(&vl);
  assert_true(core.bf16_qkv && core.bf16_out);
  ml_attn_call c = {.q = bf16 ? (float *)q16 : q, .k = bf16 ? (float *)k16 : kk,
                    .v = bf16 ? (float *)v16 : v, .B = k->B, .S = k->S, .nh = k->nh,
                    .nkv = k->nkv, .hd = k->hd, .group = k->group, .head_off = k->head_off,
                    .scale = 1.0f / sqrtf((float)k->hd), .window = k->window,
                    .compute = k->compute, .qkv_bf16 = bf16, .out_bf16 = bf16};
  float *out = bf16 ? (float *)out16 : g.out;
  assert_int_equal(core.saved(core.ctx, k->B, k->S, k->nh), T * k->nh);
  if (core.fwd(core.ctx, &c, out, g.lse) || core.bwd(core.ctx, &c, dout, out, g.lse, g.dq,
                                                     g.dk, g.dv))
    fail_msg("varlen %s: %s", k->name, ml_error_msg());

  int64_t docs = 0;
  for (int64_t d = 0; d < k->ndocs; d++) {
    int64_t n = k->has_used ? k->used[d] : k->cu[d + 1] - k->cu[d];
    if (n > 0) reference_fwd(k, q, kk, v, &r, k->cu[d], n);
    docs += n;
  }
  /* bf16: the backward reads the out rounded as the core stores it */
  if (bf16) assert_int_equal(ml_be_round_bf16_to(be, r.out, r.out, want16, (size_t)(T * qr)), 0);
  for (int64_t d = 0; d < k->ndocs; d++) {
    int64_t n = k->has_used ? k->used[d] : k->cu[d + 1] - k->cu[d];
    if (n > 0) reference_bwd(k, q, kk, v, dout, &r, k->cu[d], n);
  }
  if (bf16) expect_bitwise16("bf16 out", k->name, out16, want16, T * qr);
  else expect_bitwise("out", k->name, g.out, r.out, T * qr);
  expect_bitwise("lse", k->name, g.lse, r.lse, T * k->nh);
  expect_bitwise("dq", k->name, g.dq, r.dq, T * qr);
  expect_bitwise("dk", k->name, g.dk, r.dk, T * kr);
  expect_bitwise("dv", k->name, g.dv, r.dv, T * kr);
  if (!bf16 && k->compute == ML_F32) expect_small_store(k, q, kk, v, dout, &g);
  printf("  varlen %-48s%s on %s bitwise (%lld documents, %lld tokens, %lld padding)\n",
         k->name, bf16 ? " (bf16 q, k, v, out)" : "", core_be->ops->name, (long long)k->ndocs,
         (long long)docs, (long long)(T - docs));

  ml_varlen_destroy(&vl);
  bufs_free(&g), bufs_free(&r);
  void *p[] = {q, kk, v, dout, q16, k16, v16, out16, want16};
  for (int i = 0; i < 9; i++)
    if (p[i]) ml_be_free(be, p[i]);
}

static void test_against_documents_alone(void **state) {
  ml_backend_ops ops;
  ml_backend loop = novarlen_backend(cpu_backend(), &ops);
  ml_backend *bes[] = {cpu_backend(), &loop};
  for (int b = 0; b < 2; b++)
    for (size_t i = 0; i < sizeof k_cases / sizeof *k_cases; i++) {
      run_case(&k_cases[i], false, bes[b]);
      if (k_cases[i].compute == ML_BF16) run_case(&k_cases[i], true, bes[b]);
    }
  assert_int_equal(ml_be_set_batch_invariant(cpu_backend(), true), 0);
  for (size_t i = 0; i < sizeof k_cases / sizeof *k_cases; i++)
    if (k_cases[i].compute == ML_F32) run_case(&k_cases[i], false, cpu_backend());
  assert_int_equal(ml_be_set_batch_invariant(cpu_backend(), false), 0);
}

/* The pool bytes one varlen call on be takes above what is in use (its
 * temporaries' peak), and checks it gives them back. */
static int64_t call_peak(ml_backend *be, const ml_attn_varlen *vl, bool bwd, void **p) {
  ml_be_reset_peak(be);
  size_t before = ml_be_memory_stats(be).in_use;
  int rc = bwd ? ml_be_attention_varlen_bwd(be, vl, p[0], p[1], p[2], p[3], p[4], p[5], p[6],
                                            p[7], p[8], ML_BF16, p[9])
               : ml_be_attention_varlen_fwd(be, vl, p[1], p[2], p[3], p[4], p[5], ML_BF16);
  if (rc) fail_msg("varlen on %s: %s", be->ops->name, ml_error_msg());
  ml_memory_stats ms = ml_be_memory_stats(be);
  assert_int_equal(ms.in_use, before);
  return (int64_t)(ms.peak - before);
}

/* The meta backend (`meshlm plan`) models the varlen call exactly: it
 * declares the op where the backend it stands for does (a block per
 * document otherwise, as there), gives that backend's workspace size, and
 * its forward and backward take the temporaries the CPU's take (their
 * peak above what is in use, bytes as the pool counts them; bf16 q, k, v
 * and out: the operands' head-major copies of the whole batch). */
static void test_meta_models_the_call(void **state) {
  ml_backend *cpu = cpu_backend(), *meta = NULL, *meta_loop = NULL;
  ml_backend_ops ops;
  ml_backend loop = novarlen_backend(cpu, &ops);
  assert_int_equal(ml_backend_meta_create(cpu, &meta), 0);
  assert_int_equal(ml_backend_meta_create(&loop, &meta_loop), 0);
  assert_true(ml_be_supports(meta, ML_OP_ATTENTION_VARLEN));
  assert_false(ml_be_supports(meta_loop, ML_OP_ATTENTION_VARLEN));
  const varlen_case *k = &k_cases[4]; /* bf16, padded slots, two rows */
  int64_t T = k->B * k->S, qr = k->nh * k->hd, kr = k->nkv * k->hd;
  ml_attn_varlen vl = {
      .blk = {.B = k->B, .sq = k->S, .sk = k->S, .nh = k->nh, .nkv = k->nkv, .hd = k->hd,
              .q_bs = k->S * qr, .k_bs = k->S * kr, .l_bs = k->S * k->nh,
              .scale = 1.0f / sqrtf((float)k->hd), .window = k->window, .group = k->group,
              .qkv_bf16 = true, .out_bf16 = true},
      .ndocs = k->ndocs, .cu = k->cu, .used = k->used};
  size_t wb = ml_be_attention_varlen_work(cpu, &vl);
  assert_true(wb > 0);
  assert_int_equal(ml_be_attention_varlen_work(meta, &vl), wb);
  /* dout, q, k, v, out, lse, dq, dk, dv, work; q, k, v, out bf16 (0: finite) */
  int64_t n[] = {T * qr, T * qr / 2 + 1, T * kr / 2 + 1, T * kr / 2 + 1, T * qr / 2 + 1,
                 T * k->nh, T * qr, T * kr, T * kr, (int64_t)(wb / sizeof(float)) + 1};
  void *p[10], *none[10] = {NULL};
  for (int i = 0; i < 10; i++) p[i] = pool_buf(n[i]), memset(p[i], 0, sizeof(float) * n[i]);
  for (int bwd = 0; bwd < 2; bwd++) {
    int64_t want = call_peak(cpu, &vl, bwd, p), got = call_peak(meta, &vl, bwd, none);
    if (want <= 0 || got != want)
      fail_msg("varlen %s: meta takes %lld bytes of temporaries; the cpu backend %lld",
               bwd ? "backward" : "forward", (long long)got, (long long)want);
  }
  for (int i = 0; i < 10; i++) ml_be_free(cpu, p[i]);
  ml_backend_meta_destroy(meta);
  ml_backend_meta_destroy(meta_loop);
}

/* ml_varlen_check on B = 2 rows of S = 8 refuses docs with a message
 * containing `want`. */
static void expect_refused(int64_t ndocs, const int64_t *cu, const int64_t *used,
                           const char *want) {
  ml_varlen vl = {.be = cpu_backend(), .ndocs = ndocs, .cu = cu, .used = used};
  ml_error_clear();
  assert_int_equal(ml_varlen_check(&vl, 2, 8), -1);
  if (!strstr(ml_error_msg(), want))
    fail_msg("expected a message with \"%s\"; got \"%s\"", want, ml_error_msg());
  ml_error_clear();
}

static void test_refused(void **state) {
  expect_refused(2, (const int64_t[]){0, 5, 10}, NULL,
                 "document 1 (tokens 5 .. 9) crosses the boundary of rows 0 and 1");
  expect_refused(3, (const int64_t[]){0, 4, 4, 8}, NULL,
                 "cu[2] = 4 after cu[1] = 4; expected increasing offsets");
  expect_refused(2, (const int64_t[]){0, 6, 3}, NULL, "cu[2] = 3 after cu[1] = 6");
  expect_refused(1, (const int64_t[]){2, 6}, NULL, "cu[0] = 2; expected 0");
  expect_refused(2, (const int64_t[]){0, 8, 17}, NULL,
                 "document 1 ends at token 16 (cu[2] = 17), beyond the batch's 2 x 8 = 16");
  expect_refused(2, (const int64_t[]){0, 8, 16}, (const int64_t[]){8, 9},
                 "used[1] = 9; expected 0 .. 8");
  expect_refused(-1, NULL, NULL, "-1 documents");
  expect_refused(1, NULL, NULL, "1 documents without offsets");

  /* the core refuses them too, before computing */
  ml_varlen vl = {.be = cpu_backend(), .ndocs = 2, .cu = (const int64_t[]){0, 5, 10}};
  ml_attn_core core = ml_varlen_core(&vl);
  ml_attn_call c = {.B = 2, .S = 8, .nh = 1, .nkv = 1, .hd = 4, .scale = 0.5f, .compute = ML_F32};
  assert_int_equal(core.fwd(core.ctx, &c, NULL, NULL), -1);
  assert_non_null(strstr(ml_error_msg(), "crosses the boundary"));
  ml_error_clear();
  assert_int_equal(core.bwd(core.ctx, &c, NULL, NULL, NULL, NULL, NULL, NULL), -1);
  assert_non_null(strstr(ml_error_msg(), "crosses the boundary"));
  ml_error_clear();
  ml_varlen_destroy(&vl);
}

/* A backend without block attention (CUDA today): not supported, and the
 * forward says so. */
static void test_unsupported_backend(void **state) {
  ml_backend_ops ops;
  ml_backend fake = noblock_backend(cpu_backend(), &ops);
  ml_varlen vl = {.be = &fake, .ndocs = 1, .cu = (const int64_t[]){0, 8}};
  ml_attn_core core = ml_varlen_core(&vl);
  ml_attn_call c = {.B = 1, .S = 8, .nh = 1, .nkv = 1, .hd = 4, .scale = 0.5f, .compute = ML_F32};
  ml_error_clear();
  assert_int_equal(core.fwd(core.ctx, &c, NULL, NULL), -1);
  const char *want = "backend 'noblock' has no block attention; expected one sequence per "
                     "micro-batch";
  if (!strstr(ml_error_msg(), want))
    fail_msg("expected a message with \"%s\"; got \"%s\"", want, ml_error_msg());
  ml_error_clear();
  ml_varlen_destroy(&vl);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_against_documents_alone),
      cmocka_unit_test(test_meta_models_the_call),
      cmocka_unit_test(test_refused),
      cmocka_unit_test(test_unsupported_backend),
  };
  int rc = cmocka_run_group_tests(tests, NULL, NULL);
  ml_backend_release_all();
  return rc;
}
