/* safetensors reader/writer: round trips, block reads, and every rejection
 * of a malformed file (with a message naming the file and the problem);
 * typed block reads (fp32 and bf16, bitwise widen-then-round); the
 * streaming writer (bf16 rounding, raw bytes of any dtype, misuse),
 * and releasing a mapping's pages. */
#define _XOPEN_SOURCE 700
#define TMPDIR_PREFIX "ml_test_st"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/status.h"
#include "io/safetensors.h"
#include "tensor/dtype.h"
#include "tmpdir.h"

/* A file of: u64 LE `hlen`, `hbytes` bytes of `header`, `ndata` bytes of
 * `data` (zeros when NULL). hlen may lie about hbytes on purpose. */
static void write_raw_len(const char *path, uint64_t hlen, const char *header, size_t hbytes,
                          const void *data, size_t ndata) {
  FILE *fp = fopen(path, "wb");
  assert_non_null(fp);
  for (int i = 0; i < 8; i++) fputc((int)(hlen >> (8 * i)) & 0xff, fp);
  assert_int_equal(fwrite(header, 1, hbytes, fp), hbytes);
  for (size_t i = 0; i < ndata; i++) fputc(data ? ((const uint8_t *)data)[i] : 0, fp);
  assert_int_equal(fclose(fp), 0);
}

static void write_raw(const char *path, const char *header, const void *data, size_t ndata) {
  write_raw_len(path, strlen(header), header, strlen(header), data, ndata);
}

static void expect_msg(const char *what, const char *word) {
  const char *msg = ml_error_msg();
  if (!strstr(msg, what) || !strstr(msg, word))
    fail_msg("message \"%s\" lacks \"%s\" or \"%s\"", msg, what, word);
}

/* ml_st_open fails, names the file and says `word`, and leaves f closed. */
static void expect_reject(const char *path, const char *word) {
  ml_st_file f;
  ml_error_clear();
  if (ml_st_open(path, &f) != -1) fail_msg("%s: accepted, expected rejection (%s)", path, word);
  expect_msg(path, word);
  assert_null(f.map);
  assert_null(f.tensors);
  assert_int_equal(f.n, 0);
}

/* ------------------------------------------------------------ rejections */

#define T4 "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":"

static void test_reject_header_cases(void **state) {
  (void)state;
  static const struct {
    const char *header;
    size_t ndata;
    const char *word;
  } cases[] = {
      /* data shorter than the header says */
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8, "truncated"},
      {"{\"a\":{" T4 "[0,8]}}", 11, "trailing"},
      {"{\"a\":", 0, "not valid JSON"},
      {"{\"a\":{" T4 "[0,8]}} x", 8, "not valid JSON"},
      {"{\"a\":{" T4 "[0,8]},\"a\":{" T4 "[0,8]}}", 8, "duplicate"},
      {"{\"a\":{" T4 "[0,8]},\"b\":{" T4 "[4,12]}}", 12, "overlap"},
      {"{\"a\":{" T4 "[0,8]},\"b\":{" T4 "[8,16]},\"c\":{" T4 "[8,16]}}", 16, "overlap"},
      {"{\"a\":{" T4 "[0,8]},\"b\":{" T4 "[12,20]}}", 20, "gap"},
      {"{\"a\":{" T4 "[4,12]}}", 12, "gap"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "expected size"},
      {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,16]}}", 16, "expected size"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,8]}}", 8,
       "overflow"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904],\"data_offsets\":[0,8]}}", 8,
       "overflow"},
      {"{\"a\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "unknown dtype"},
      {"{\"a\":{\"dtype\":32,\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "unknown dtype"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, "non-negative"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}", 8, "non-negative"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":2,\"data_offsets\":[0,8]}}", 8, "shape array"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4,
       "at most 8"},
      {"{\"a\":{" T4 "[8,0]}}", 8, "begin > end"},
      {"{\"a\":{" T4 "[0]}}", 8, "data_offsets"},
      {"{\"a\":{" T4 "[-8,0]}}", 8, "data_offsets"},
      {"{\"a\":{" T4 "[0,18446744073709551615]}}", 8, "not valid JSON"},
      {"{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "missing field 'dtype'"},
      {"{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8, "missing field 'shape'"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "missing field 'data_offsets'"},
      {"{\"a\":5}", 0, "an object"},
      {"{\"a\":[1,2]}", 0, "an object"},
      {"{\"__metadata__\":{\"format\":1}}", 0, "__metadata__"},
      {"{\"__metadata__\":[\"pt\"]}", 0, "__metadata__"},
      {"[1,2]", 0, "a JSON object"},
      {"{\"a\\u0000b\":{" T4 "[0,8]}}", 8, "not valid JSON"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char name[32];
    snprintf(name, sizeof name, "bad%02zu.safetensors", i);
    const char *path = tpath(name);
    write_raw(path, cases[i].header, NULL, cases[i].ndata);
    expect_reject(path, cases[i].word);
  }
}

static void test_reject_invalid_utf8(void **state) {
  (void)state;
  const char *path = tpath("utf8.safetensors");
  write_raw(path, "{\"a\xff\":{" T4 "[0,8]}}", NULL, 8);
  expect_reject(path, "UTF-8");
  write_raw(path, "{\"__metadata__\":{\"k\":\"\xc3\x28\"}}", NULL, 0); /* bad continuation */
  expect_reject(path, "UTF-8");
}

static void test_reject_header_length(void **state) {
  (void)state;
  const char *path = tpath("len.safetensors");
  const char *h = "{}";
  write_raw_len(path, 1000, h, 2, NULL, 8); /* header runs past EOF */
  expect_reject(path, "past end of file");
  write_raw_len(path, 200000000, h, 2, NULL, 0); /* claimed 200 MB */
  expect_reject(path, "exceeds the limit");
  write_raw_len(path, UINT64_MAX, h, 2, NULL, 0); /* 8 + N would overflow */
  expect_reject(path, "exceeds the limit");
  write_raw_len(path, 3, h, 2, NULL, 0); /* one byte short */
  expect_reject(path, "past end of file");
  FILE *fp = fopen(path, "wb");
  assert_non_null(fp);
  fputs("\x02", fp); /* shorter than the length field */
  fclose(fp);
  expect_reject(path, "at least 8");
  expect_reject(tpath("does-not-exist.safetensors"), "cannot open");
  expect_reject(g_dir, "not a regular file");
}

/* ---------------------------------------------------------- valid files */

static void test_accept_edge_cases(void **state) {
  (void)state;
  const char *path = tpath("edge.safetensors");
  /* padding on both sides, keys out of offset order, scalar, empty tensors,
   * an unknown extra field, and a header length that leaves data unaligned */
  const char *h = "  {\"b\":{" T4 "[4,12]},\"s\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]},"
                  "\"e\":{\"dtype\":\"I64\",\"shape\":[3,0],\"data_offsets\":[12,12],\"x\":1},"
                  "\"__metadata__\":{\"format\":\"pt\"}}   ";
  float vals[3] = {7.0f, -1.5f, 2.25f};
  assert_int_not_equal(strlen(h) % 4, 0);
  write_raw(path, h, vals, sizeof vals);
  ml_st_file f;
  ml_error_clear();
  assert_int_equal(ml_st_open(path, &f), 0);
  assert_int_equal(f.n, 3);
  assert_string_equal(f.tensors[0].name, "b"); /* header order */
  const ml_st_tensor *s = ml_st_find(&f, "s"), *b = ml_st_find(&f, "b"), *e = ml_st_find(&f, "e");
  assert_non_null(s);
  assert_int_equal(s->ndim, 0);
  assert_int_equal(s->numel, 1);
  assert_int_equal(e->numel, 0);
  assert_int_equal(e->nbytes, 0);
  assert_null(ml_st_find(&f, "__metadata__"));
  float out[2];
  assert_int_equal(ml_st_read_block(s, 0, 1, 0, 1, out), 0);
  assert_true(out[0] == 7.0f);
  assert_int_equal(ml_st_read_block(b, 0, 2, 0, 1, out), 0);
  assert_true(out[0] == -1.5f && out[1] == 2.25f);
  ml_st_close(&f);
  assert_null(f.map);

  write_raw(path, "{}", NULL, 0); /* no tensors at all */
  assert_int_equal(ml_st_open(path, &f), 0);
  assert_int_equal(f.n, 0);
  ml_st_close(&f);
}

static float g_a[5] = {1.0f, -2.0f, 0.5f, 1e-3f, 12345.678f};
static float g_b[12], g_c[6], g_s[1] = {3.25f};

static void fill_entries(ml_st_entry e[5]) {
  for (int i = 0; i < 12; i++) g_b[i] = (float)i * 0.25f - 1.0f; /* exact in bf16 */
  for (int i = 0; i < 6; i++) g_c[i] = (float)i / 3.0f;          /* rounds in f16 */
  memset(e, 0, 5 * sizeof *e);
  e[0] = (ml_st_entry){.name = "a", .dtype = ML_F32, .ndim = 1, .shape = {5}, .data = g_a};
  e[1] = (ml_st_entry){.name = "b", .dtype = ML_BF16, .ndim = 2, .shape = {3, 4}, .data = g_b};
  e[2] = (ml_st_entry){.name = "c.weight", .dtype = ML_F16, .ndim = 2, .shape = {2, 3}, .data = g_c};
  e[3] = (ml_st_entry){.name = "s", .dtype = ML_F32, .ndim = 0, .data = g_s};
  e[4] = (ml_st_entry){.name = "z", .dtype = ML_BF16, .ndim = 2, .shape = {0, 4}, .data = NULL};
}

static void test_roundtrip(void **state) {
  (void)state;
  ml_st_entry e[5];
  fill_entries(e);
  const char *path = tpath("rt.safetensors");
  ml_error_clear();
  assert_int_equal(ml_st_write(path, e, 5), 0);
  assert_int_equal(access(tpath("rt.safetensors.tmp"), F_OK), -1);

  ml_st_file f;
  assert_int_equal(ml_st_open(path, &f), 0);
  assert_int_equal(f.n, 5);
  const uint8_t *m = f.map;
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = hlen << 8 | m[i];
  assert_int_equal(hlen % 8, 0);
  assert_memory_equal(m + 8, "{\"__metadata__\":{\"format\":\"pt\"},\"a\":{\"dtype\":\"F32\"", 50);
  const uint8_t *pos = m + 8 + hlen; /* data in entry order, back to back */
  for (size_t i = 0; i < 5; i++) {
    assert_string_equal(f.tensors[i].name, e[i].name);
    assert_int_equal(f.tensors[i].dtype, e[i].dtype);
    assert_int_equal(f.tensors[i].ndim, e[i].ndim);
    for (int d = 0; d < e[i].ndim; d++) assert_int_equal(f.tensors[i].shape[d], e[i].shape[d]);
    assert_ptr_equal(f.tensors[i].data, pos);
    pos += f.tensors[i].nbytes;
  }
  assert_ptr_equal(pos, m + f.map_size);

  float out[12];
  assert_int_equal(ml_st_read_block(ml_st_find(&f, "a"), 0, 5, 0, 1, out), 0);
  assert_memory_equal(out, g_a, sizeof g_a);
  assert_int_equal(ml_st_read_block(ml_st_find(&f, "b"), 0, 3, 0, 4, out), 0);
  assert_memory_equal(out, g_b, sizeof g_b);
  assert_int_equal(ml_st_read_block(ml_st_find(&f, "c.weight"), 0, 2, 0, 3, out), 0);
  for (int i = 0; i < 6; i++) assert_true(out[i] == ml_f16_to_f32(ml_f32_to_f16(g_c[i])));
  assert_int_equal(ml_st_read_block(ml_st_find(&f, "s"), 0, 1, 0, 1, out), 0);
  assert_true(out[0] == 3.25f);
  assert_int_equal(ml_st_read_block(ml_st_find(&f, "z"), 0, 0, 0, 4, out), 0);
  assert_int_equal(ml_st_find(&f, "z")->nbytes, 0);
  ml_st_close(&f);
}

/* Row slices, column slices and sub-blocks of a 2-D tensor in each float
 * dtype; 1-D tensors read as [n, 1]. */
static void test_read_block(void **state) {
  (void)state;
  enum { R = 5, C = 7 };
  static float v[R * C];
  for (int i = 0; i < R * C; i++) v[i] = (float)i; /* exact in all three */
  ml_st_entry e[3] = {
      {.name = "f32", .dtype = ML_F32, .ndim = 2, .shape = {R, C}, .data = v},
      {.name = "bf16", .dtype = ML_BF16, .ndim = 2, .shape = {R, C}, .data = v},
      {.name = "f16", .dtype = ML_F16, .ndim = 2, .shape = {R, C}, .data = v},
  };
  const char *path = tpath("block.safetensors");
  ml_error_clear();
  assert_int_equal(ml_st_write(path, e, 3), 0);
  ml_st_file f;
  assert_int_equal(ml_st_open(path, &f), 0);
  static const int64_t blocks[][4] = {{0, R, 0, C}, {1, 3, 0, C}, {4, 1, 0, C}, {0, R, 2, 3},
                                      {1, 3, 2, 4}, {2, 2, 6, 1}, {0, 0, 0, 0}, {3, 2, 0, 1}};
  float out[R * C];
  for (size_t k = 0; k < 3; k++) {
    const ml_st_tensor *t = &f.tensors[k];
    for (size_t b = 0; b < sizeof blocks / sizeof blocks[0]; b++) {
      int64_t r0 = blocks[b][0], nr = blocks[b][1], c0 = blocks[b][2], nc = blocks[b][3];
      assert_int_equal(ml_st_read_block(t, r0, nr, c0, nc, out), 0);
      for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < nc; c++)
          if (out[r * nc + c] != v[(r0 + r) * C + c0 + c])
            fail_msg("%s block %zu [%lld, %lld] wrong", t->name, b, (long long)r, (long long)c);
    }
  }
  ml_st_close(&f);

  ml_st_entry one = {.name = "vec", .dtype = ML_BF16, .ndim = 1, .shape = {6}, .data = v};
  assert_int_equal(ml_st_write(path, &one, 1), 0);
  assert_int_equal(ml_st_open(path, &f), 0);
  assert_int_equal(ml_st_read_block(&f.tensors[0], 2, 3, 0, 1, out), 0);
  assert_true(out[0] == 2.0f && out[1] == 3.0f && out[2] == 4.0f);
  ml_st_close(&f);
}

/* Next of a xorshift32 stream: random bit patterns, so every class of
 * value (normals, subnormals, ±0, ±Inf, NaNs with payloads) turns up. */
static uint32_t next_bits(uint32_t *x) {
  *x ^= *x << 13;
  *x ^= *x >> 17;
  *x ^= *x << 5;
  return *x;
}

/* ml_st_read_block_to: each source dtype's block into fp32 and bf16,
 * bitwise what widening then rounding (ml_st_read_block's fp32, then
 * ml_f32_to_bf16 per element) gives, over random bit patterns plus the
 * edges (NaN payloads, Inf, subnormals, bf16 ties, overflow to Inf), for
 * whole and partial rows of odd sizes; blocks of 1 MiB and more of
 * destination take the threaded path. Nothing past the block is written. */
static void test_read_block_to(void **state) {
  (void)state;
  enum { R = 521, C = 1003, N = R * C, GUARD = 8 }; /* R·C·2 bytes > 1 MiB */
  static const uint32_t edge32[] = {0x7f800001, 0xffc00001, 0x7f800000, 0xff800000, 0x00000001,
                                    0x807fffff, 0x3f808000, 0x3f818000, 0x7f7fffff, 0x80000000};
  static const uint16_t edge16[] = {0x7f81, 0xffff, 0x7c01, 0xfe00, 0x7c00, 0xfc00,
                                    0x0001, 0x83ff, 0x7bff, 0x8000};
  uint32_t *b32 = malloc(sizeof(uint32_t) * N);
  uint16_t *b16 = malloc(sizeof(uint16_t) * N), *h16 = malloc(sizeof(uint16_t) * N);
  float *want32 = malloc(sizeof(float) * (N + GUARD)), *got32 = malloc(sizeof(float) * (N + GUARD));
  uint16_t *want16 = malloc(sizeof(uint16_t) * (N + GUARD));
  uint16_t *got16 = malloc(sizeof(uint16_t) * (N + GUARD));
  assert_true(b32 && b16 && h16 && want32 && got32 && want16 && got16);
  uint32_t x = 0x9e3779b9u;
  for (int i = 0; i < N; i++) {
    b32[i] = next_bits(&x);
    b16[i] = (uint16_t)next_bits(&x);
    h16[i] = (uint16_t)next_bits(&x);
  }
  for (size_t k = 0; k < sizeof edge32 / sizeof edge32[0]; k++) {
    b32[1 + 97 * k] = edge32[k];
    b16[1 + 97 * k] = edge16[k];
    h16[1 + 97 * k] = edge16[k];
  }
  ml_st_entry e[3] = {
      {.name = "f32", .dtype = ML_F32, .ndim = 2, .shape = {R, C}},
      {.name = "bf16", .dtype = ML_BF16, .ndim = 2, .shape = {R, C}},
      {.name = "f16", .dtype = ML_F16, .ndim = 2, .shape = {R, C}},
  };
  const char *path = tpath("typed.safetensors");
  ml_st_writer *w;
  ml_error_clear();
  assert_int_equal(ml_st_writer_open(path, e, 3, &w), 0);
  assert_int_equal(ml_st_writer_put(w, b32, sizeof(uint32_t) * N), 0);
  assert_int_equal(ml_st_writer_put(w, b16, sizeof(uint16_t) * N), 0);
  assert_int_equal(ml_st_writer_put(w, h16, sizeof(uint16_t) * N), 0);
  assert_int_equal(ml_st_writer_close(w), 0);
  ml_st_file f;
  assert_int_equal(ml_st_open(path, &f), 0);
  /* whole tensor (threaded), odd row runs, column blocks (threaded and not),
   * one column, one element, empty */
  static const int64_t blocks[][4] = {{0, R, 0, C},   {3, 17, 0, C},  {1, R - 2, 5, C - 9},
                                      {7, 9, 1, 333}, {0, R, C - 1, 1}, {R - 1, 1, 2, 1},
                                      {4, 0, 0, C}};
  for (size_t k = 0; k < 3; k++) {
    const ml_st_tensor *t = &f.tensors[k];
    for (size_t b = 0; b < sizeof blocks / sizeof blocks[0]; b++) {
      int64_t r0 = blocks[b][0], nr = blocks[b][1], c0 = blocks[b][2], nc = blocks[b][3];
      size_t n = (size_t)(nr * nc);
      for (int64_t r = 0; r < nr; r++) /* the reference: widen each element, then round it */
        for (int64_t c = 0; c < nc; c++) {
          size_t at = (size_t)((r0 + r) * C + c0 + c), to = (size_t)(r * nc + c);
          float v;
          if (t->dtype == ML_F32) memcpy(&v, &b32[at], sizeof v);
          else v = t->dtype == ML_BF16 ? ml_bf16_to_f32(b16[at]) : ml_f16_to_f32(h16[at]);
          want32[to] = v;
          want16[to] = ml_f32_to_bf16(v);
        }
      memset(got32, 0xa5, sizeof(float) * (n + GUARD));
      memset(got16, 0xa5, sizeof(uint16_t) * (n + GUARD));
      memset(want32 + n, 0xa5, sizeof(float) * GUARD);
      memset(want16 + n, 0xa5, sizeof(uint16_t) * GUARD);
      assert_int_equal(ml_st_read_block_to(t, r0, nr, c0, nc, got32, ML_F32), 0);
      assert_int_equal(ml_st_read_block_to(t, r0, nr, c0, nc, got16, ML_BF16), 0);
      if (memcmp(got32, want32, sizeof(float) * (n + GUARD)))
        fail_msg("%s block %zu: fp32 differs from the widened values", t->name, b);
      if (memcmp(got16, want16, sizeof(uint16_t) * (n + GUARD)))
        fail_msg("%s block %zu: bf16 differs from widen-then-round", t->name, b);
    }
  }
  ml_error_clear();
  assert_int_equal(ml_st_read_block_to(&f.tensors[0], 0, 1, 0, 1, got16, ML_F16), -1);
  expect_msg("f32", "expected F32 or BF16");
  ml_st_close(&f);
  free(b32), free(b16), free(h16), free(want32), free(got32), free(want16), free(got16);
}

static void expect_block_err(const ml_st_tensor *t, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                             const char *word) {
  float out[64];
  ml_error_clear();
  assert_int_equal(ml_st_read_block(t, r0, nr, c0, nc, out), -1);
  expect_msg(t->name, word);
}

static void test_read_block_errors(void **state) {
  (void)state;
  const char *path = tpath("blockerr.safetensors");
  const char *h = "{\"m\":{\"dtype\":\"F32\",\"shape\":[4,3],\"data_offsets\":[0,48]},"
                  "\"cube\":{\"dtype\":\"F32\",\"shape\":[2,2,2],\"data_offsets\":[48,80]},"
                  "\"ints\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[80,88]}}";
  write_raw(path, h, NULL, 88);
  ml_st_file f;
  ml_error_clear();
  assert_int_equal(ml_st_open(path, &f), 0);
  const ml_st_tensor *m = ml_st_find(&f, "m");
  expect_block_err(m, 3, 2, 0, 3, "out of range");
  expect_block_err(m, 0, 1, 1, 3, "out of range");
  expect_block_err(m, -1, 1, 0, 1, "out of range");
  expect_block_err(m, 0, -1, 0, 1, "out of range");
  expect_block_err(m, INT64_MAX, 2, 0, 1, "out of range");
  expect_block_err(ml_st_find(&f, "cube"), 0, 1, 0, 1, "at most 2 dimensions");
  expect_block_err(ml_st_find(&f, "ints"), 0, 1, 0, 1, "I32");
  ml_st_close(&f);
}

static void expect_write_err(const ml_st_entry *e, size_t n, const char *path, const char *word) {
  ml_error_clear();
  assert_int_equal(ml_st_write(path, e, n), -1);
  expect_msg(path, word);
  assert_int_equal(access(path, F_OK), -1);
}

static void test_write_errors(void **state) {
  (void)state;
  float x[2] = {1, 2};
  const char *path = tpath("werr.safetensors");
  ml_st_entry dup[2] = {{.name = "w", .dtype = ML_F32, .ndim = 1, .shape = {2}, .data = x},
                        {.name = "w", .dtype = ML_F32, .ndim = 1, .shape = {2}, .data = x}};
  expect_write_err(dup, 2, path, "duplicate");
  ml_st_entry bad = dup[0];
  bad.dtype = ML_I32;
  expect_write_err(&bad, 1, path, "I32");
  bad = dup[0];
  bad.shape[0] = -2;
  expect_write_err(&bad, 1, path, "negative");
  bad = dup[0];
  bad.name = "__metadata__";
  expect_write_err(&bad, 1, path, "not allowed");
  bad = dup[0];
  bad.data = NULL;
  expect_write_err(&bad, 1, path, "NULL");
  const char *nodir = tpath("no/such/dir/x.safetensors");
  expect_write_err(dup, 1, nodir, "cannot create");
}

/* Writing over a file that is mapped leaves the old mapping intact (temp +
 * rename), the hazard the reference writer fixed in #764. */
static void test_overwrite_while_mapped(void **state) {
  (void)state;
  float x[2] = {1, 2}, y[2] = {5, 6}, out[2];
  ml_st_entry e = {.name = "w", .dtype = ML_F32, .ndim = 1, .shape = {2}, .data = x};
  const char *path = tpath("over.safetensors");
  ml_error_clear();
  assert_int_equal(ml_st_write(path, &e, 1), 0);
  ml_st_file old, cur;
  assert_int_equal(ml_st_open(path, &old), 0);
  e.data = y;
  assert_int_equal(ml_st_write(path, &e, 1), 0);
  assert_int_equal(ml_st_open(path, &cur), 0);
  assert_int_equal(ml_st_read_block(&old.tensors[0], 0, 2, 0, 1, out), 0);
  assert_true(out[0] == 1 && out[1] == 2);
  assert_int_equal(ml_st_read_block(&cur.tensors[0], 0, 2, 0, 1, out), 0);
  assert_true(out[0] == 5 && out[1] == 6);
  ml_st_close(&old);
  ml_st_close(&cur);
}

/* The streaming writer: tensors in several puts, fp32 converted (bf16 ties
 * to even, NaN canonical), raw bytes of a dtype it cannot convert, an
 * empty tensor skipped; the result reads back as written. */
static void test_stream_writer(void **state) {
  (void)state;
  const float a[3] = {1.5f, -2.0f, 0.25f};
  /* 1 + 2^-8 ties between bf16 1.0 (even) and 1 + 2^-7; 1 + 3·2^-8 between
   * 1 + 2^-7 and 1 + 2^-6 (even) */
  float b[4] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 0.0f, 3.0f};
  b[2] = b[2] / b[2]; /* NaN */
  const uint16_t b_want[4] = {0x3f80, 0x3f82, 0x7fc0, 0x4040};
  const int64_t ids[2] = {-1, 7};
  const float h = 0.5f;
  ml_st_entry e[5] = {
      {.name = "a", .dtype = ML_F32, .ndim = 1, .shape = {3}},
      {.name = "b", .dtype = ML_BF16, .ndim = 2, .shape = {2, 2}},
      {.name = "ids", .dtype = ML_I64, .ndim = 1, .shape = {2}},
      {.name = "empty", .dtype = ML_F32, .ndim = 2, .shape = {0, 4}},
      {.name = "h", .dtype = ML_F16, .ndim = 0},
  };
  const char *path = tpath("stream.safetensors");
  ml_st_writer *w;
  ml_error_clear();
  assert_int_equal(ml_st_writer_open(path, e, 5, &w), 0);
  assert_int_equal(access(path, F_OK), -1); /* only the temp file so far */
  assert_int_equal(ml_st_writer_put_f32(w, a, 2), 0);
  assert_int_equal(ml_st_writer_put_f32(w, a + 2, 1), 0);
  assert_int_equal(ml_st_writer_put_f32(w, b, 4), 0);
  assert_int_equal(ml_st_writer_put(w, ids, sizeof ids), 0);
  assert_int_equal(ml_st_writer_put_f32(w, &h, 1), 0);
  assert_int_equal(ml_st_writer_close(w), 0);
  assert_int_equal(access(tpath("stream.safetensors.tmp"), F_OK), -1);
  ml_st_file f;
  assert_int_equal(ml_st_open(path, &f), 0);
  assert_int_equal(f.n, 5);
  assert_memory_equal(ml_st_find(&f, "a")->data, a, sizeof a);
  uint16_t got[4];
  memcpy(got, ml_st_find(&f, "b")->data, sizeof got);
  for (int i = 0; i < 4; i++)
    if (got[i] != b_want[i]) fail_msg("b[%d]: bf16 0x%04x, expected 0x%04x", i, got[i], b_want[i]);
  assert_int_equal(ml_st_find(&f, "ids")->dtype, ML_I64);
  assert_memory_equal(ml_st_find(&f, "ids")->data, ids, sizeof ids);
  assert_int_equal(ml_st_find(&f, "empty")->nbytes, 0);
  float out;
  assert_int_equal(ml_st_read_block(ml_st_find(&f, "h"), 0, 1, 0, 1, &out), 0);
  assert_true(out == 0.5f);
  ml_st_close(&f);
}

/* Misuse of the streaming writer: a message naming the file and tensor, and
 * no file left behind (neither the file nor its temp). */
static void expect_stream_err(int rc, ml_st_writer *w, const char *path, const char *word) {
  assert_int_equal(rc, -1);
  expect_msg(path, word);
  ml_st_writer_abandon(w);
  char tmp[600];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  assert_int_equal(access(path, F_OK), -1);
  assert_int_equal(access(tmp, F_OK), -1);
}

static void test_stream_writer_errors(void **state) {
  (void)state;
  float x[4] = {1, 2, 3, 4};
  ml_st_entry e[2] = {{.name = "w", .dtype = ML_F32, .ndim = 1, .shape = {2}},
                      {.name = "n", .dtype = ML_I32, .ndim = 1, .shape = {1}}};
  const char *path = tpath("swerr.safetensors");
  ml_st_writer *w;
  ml_error_clear();
  assert_int_equal(ml_st_writer_open(path, e, 2, &w), 0);
  expect_stream_err(ml_st_writer_put_f32(w, x, 3), w, path, "'w': 12 bytes put where 8 of its 8");
  ml_error_clear();
  assert_int_equal(ml_st_writer_open(path, e, 2, &w), 0);
  assert_int_equal(ml_st_writer_put_f32(w, x, 2), 0);
  expect_stream_err(ml_st_writer_put_f32(w, x, 1), w, path,
                    "'n': cannot write fp32 data as dtype I32");
  ml_error_clear();
  assert_int_equal(ml_st_writer_open(path, e, 2, &w), 0);
  assert_int_equal(ml_st_writer_put(w, x, 8), 0);
  assert_int_equal(ml_st_writer_put(w, x, 4), 0);
  expect_stream_err(ml_st_writer_put(w, x, 1), w, path, "1 bytes put after the last tensor");
  /* close with a tensor incomplete: an error, and close has removed the temp file */
  ml_error_clear();
  assert_int_equal(ml_st_writer_open(path, e, 2, &w), 0);
  assert_int_equal(ml_st_writer_put(w, x, 4), 0);
  assert_int_equal(ml_st_writer_close(w), -1);
  expect_stream_err(-1, NULL, path, "'w': 4 of its 8 bytes written");
  ml_st_entry dup[2] = {e[0], e[0]};
  ml_error_clear();
  assert_int_equal(ml_st_writer_open(path, dup, 2, &w), -1);
  expect_stream_err(-1, NULL, path, "duplicate");
  ml_st_entry bad = e[0];
  bad.dtype = ML_DTYPE_COUNT;
  ml_error_clear();
  assert_int_equal(ml_st_writer_open(path, &bad, 1, &w), -1);
  expect_stream_err(-1, NULL, path, "not a safetensors dtype");
}

/* Released pages of a mapped tensor read back the same from the file. */
static void test_release(void **state) {
  (void)state;
  enum { N = 5000 }; /* several pages */
  static float v[N], out[N];
  for (int i = 0; i < N; i++) v[i] = (float)i * 0.5f;
  ml_st_entry e = {.name = "v", .dtype = ML_F32, .ndim = 1, .shape = {N}, .data = v};
  const char *path = tpath("release.safetensors");
  ml_error_clear();
  assert_int_equal(ml_st_write(path, &e, 1), 0);
  ml_st_file f;
  assert_int_equal(ml_st_open(path, &f), 0);
  assert_int_equal(ml_st_read_block(&f.tensors[0], 0, N, 0, 1, out), 0);
  ml_st_release(f.tensors[0].data + 100, f.tensors[0].nbytes - 200);
  memset(out, 0, sizeof out);
  assert_int_equal(ml_st_read_block(&f.tensors[0], 0, N, 0, 1, out), 0);
  assert_memory_equal(out, v, sizeof v);
  ml_st_close(&f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_reject_header_cases), cmocka_unit_test(test_reject_invalid_utf8),
      cmocka_unit_test(test_reject_header_length), cmocka_unit_test(test_accept_edge_cases),
      cmocka_unit_test(test_roundtrip),           cmocka_unit_test(test_read_block),
      cmocka_unit_test(test_read_block_to),
      cmocka_unit_test(test_read_block_errors),   cmocka_unit_test(test_write_errors),
      cmocka_unit_test(test_overwrite_while_mapped), cmocka_unit_test(test_stream_writer),
      cmocka_unit_test(test_stream_writer_errors),  cmocka_unit_test(test_release),
  };
  return cmocka_run_group_tests(tests, tmpdir_setup, tmpdir_teardown);
}
