/* HF checkpoint directories: single file, sharded with an index, and every
 * kind of broken index; the streaming writer. */
#define _XOPEN_SOURCE 700
#define TMPDIR_PREFIX "ml_test_ckpt"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/status.h"
#include "io/checkpoint.h"
#include "io/json.h"
#include "tmpdir.h"

static void write_bytes(const char *path, const char *bytes, size_t n) {
  FILE *fp = fopen(path, "wb");
  assert_non_null(fp);
  assert_int_equal(fwrite(bytes, 1, n, fp), n);
  assert_int_equal(fclose(fp), 0);
}

static void write_text(const char *path, const char *text) { write_bytes(path, text, strlen(text)); }

static void expect_msg(const char *what, const char *word) {
  const char *msg = ml_error_msg();
  if (!strstr(msg, what) || !strstr(msg, word))
    fail_msg("message \"%s\" lacks \"%s\" or \"%s\"", msg, what, word);
}

static void expect_open_err(const char *dir, const char *word) {
  ml_ckpt c;
  ml_error_clear();
  assert_int_equal(ml_ckpt_open(dir, &c), -1);
  expect_msg(dir, word);
  assert_null(c.files);
  assert_int_equal(c.nfiles, 0);
}

enum { NT = 5, NE = 16 };
static float g_data[NT][NE];
static const char *g_names[NT] = {"embed.weight", "l0.w", "l0.b", "l1.w", "head.weight"};

/* NT F32 tensors of NE elements (64 bytes each), tensor k holding k*100 + i. */
static void make_entries(ml_st_entry e[NT]) {
  for (int k = 0; k < NT; k++) {
    for (int i = 0; i < NE; i++) g_data[k][i] = (float)(k * 100 + i);
    e[k] = (ml_st_entry){.name = g_names[k], .dtype = ML_F32, .ndim = 1, .shape = {NE},
                         .data = g_data[k]};
  }
}

static void check_tensors(const ml_ckpt *c) {
  float out[NE];
  for (int k = 0; k < NT; k++) {
    const ml_st_tensor *t = ml_ckpt_find(c, g_names[k]);
    if (!t) fail_msg("tensor %s not found", g_names[k]);
    assert_int_equal(ml_st_read_block(t, 0, NE, 0, 1, out), 0);
    assert_memory_equal(out, g_data[k], sizeof out);
  }
  assert_null(ml_ckpt_find(c, "nope"));
}

static int exists(const char *path) { return access(path, F_OK) == 0; }

static void test_single_file(void **state) {
  (void)state;
  ml_st_entry e[NT];
  make_entries(e);
  char dir[512];
  snprintf(dir, sizeof dir, "%s", tpath("single/nested")); /* created, parents too */
  ml_error_clear();
  assert_int_equal(ml_ckpt_write(dir, e, NT, 0), 0);
  assert_true(exists(tpath("single/nested/model.safetensors")));
  assert_false(exists(tpath("single/nested/model.safetensors.index.json")));
  ml_ckpt c;
  assert_int_equal(ml_ckpt_open(dir, &c), 0);
  assert_int_equal(c.nfiles, 1);
  assert_string_equal(c.dir, dir);
  check_tensors(&c);
  ml_ckpt_close(&c);

  /* a limit at or above the total does not shard */
  assert_int_equal(ml_ckpt_write(dir, e, NT, NT * NE * 4), 0);
  assert_int_equal(ml_ckpt_open(dir, &c), 0);
  assert_int_equal(c.nfiles, 1);
  ml_ckpt_close(&c);
}

static void test_sharded(void **state) {
  (void)state;
  ml_st_entry e[NT];
  make_entries(e);
  char dir[512];
  snprintf(dir, sizeof dir, "%s", tpath("sharded"));
  ml_error_clear();
  /* 64-byte tensors, limit 150: {0,1} {2,3} {4} */
  assert_int_equal(ml_ckpt_write(dir, e, NT, 150), 0);
  static const char *shards[] = {"model-00001-of-00003.safetensors",
                                 "model-00002-of-00003.safetensors",
                                 "model-00003-of-00003.safetensors"};
  static const int shard_of[NT] = {0, 0, 1, 1, 2};
  for (int s = 0; s < 3; s++) {
    char name[64];
    snprintf(name, sizeof name, "sharded/%s", shards[s]);
    assert_true(exists(tpath(name)));
  }
  assert_false(exists(tpath("sharded/model.safetensors")));

  ml_json idx;
  assert_int_equal(ml_json_load(tpath("sharded/model.safetensors.index.json"), &idx), 0);
  int64_t total;
  json_t *meta = json_object_get(idx.root, "metadata"), *wm = json_object_get(idx.root, "weight_map");
  assert_int_equal(ml_json_int(&idx, meta, "total_size", &total), 0);
  assert_int_equal(total, NT * NE * 4);
  assert_int_equal(json_object_size(wm), NT);
  for (int k = 0; k < NT; k++) {
    const char *file;
    assert_int_equal(ml_json_str(&idx, wm, g_names[k], &file), 0);
    assert_string_equal(file, shards[shard_of[k]]);
  }
  ml_json_free(&idx);

  ml_ckpt c;
  assert_int_equal(ml_ckpt_open(dir, &c), 0);
  assert_int_equal(c.nfiles, 3);
  check_tensors(&c);
  ml_ckpt_close(&c);

  /* rewriting unsharded removes the stale index, so the new file is read */
  g_data[0][0] = -7.0f;
  assert_int_equal(ml_ckpt_write(dir, e, NT, 0), 0);
  assert_false(exists(tpath("sharded/model.safetensors.index.json")));
  assert_int_equal(ml_ckpt_open(dir, &c), 0);
  assert_int_equal(c.nfiles, 1);
  check_tensors(&c);
  ml_ckpt_close(&c);
}

/* A tensor larger than the limit gets a shard of its own; order is kept. */
static void test_shard_oversized(void **state) {
  (void)state;
  static float big[100], small[2] = {1, 2};
  ml_st_entry e[4] = {
      {.name = "s0", .dtype = ML_F32, .ndim = 1, .shape = {2}, .data = small},
      {.name = "big", .dtype = ML_BF16, .ndim = 2, .shape = {10, 10}, .data = big},
      {.name = "s1", .dtype = ML_F32, .ndim = 1, .shape = {2}, .data = small},
      {.name = "s2", .dtype = ML_F16, .ndim = 0, .data = small},
  };
  char dir[512];
  snprintf(dir, sizeof dir, "%s", tpath("oversized"));
  ml_error_clear();
  assert_int_equal(ml_ckpt_write(dir, e, 4, 16), 0); /* 8 | 200 | 8+2 */
  ml_ckpt c;
  assert_int_equal(ml_ckpt_open(dir, &c), 0);
  assert_int_equal(c.nfiles, 3);
  assert_non_null(ml_ckpt_find(&c, "big"));
  assert_int_equal(ml_ckpt_find(&c, "s2")->ndim, 0);
  ml_ckpt_close(&c);
}

static void test_write_errors(void **state) {
  (void)state;
  ml_st_entry e[NT];
  make_entries(e);
  e[3].name = e[0].name; /* duplicate in another shard */
  char dir[512];
  snprintf(dir, sizeof dir, "%s", tpath("dup"));
  ml_error_clear();
  assert_int_equal(ml_ckpt_write(dir, e, NT, 150), -1);
  expect_msg(dir, "duplicate");
  assert_false(exists(tpath("dup/model.safetensors.index.json")));
  make_entries(e);
  e[1].dtype = ML_I8;
  ml_error_clear();
  assert_int_equal(ml_ckpt_write(dir, e, NT, 0), -1);
  expect_msg("l0.w", "I8");
  write_text(tpath("afile"), "x");
  ml_error_clear();
  assert_int_equal(ml_ckpt_write(tpath("afile/sub"), e, 1, 0), -1);
  expect_msg("afile", "cannot create");
}

/* A valid two-shard checkpoint in `name`: a,b in shard 1, c in shard 2. */
static void make_two_shards(const char *name) {
  static float x[4] = {1, 2, 3, 4};
  ml_st_entry e[3] = {
      {.name = "a", .dtype = ML_F32, .ndim = 1, .shape = {4}, .data = x},
      {.name = "b", .dtype = ML_F32, .ndim = 1, .shape = {4}, .data = x},
      {.name = "c", .dtype = ML_F32, .ndim = 1, .shape = {4}, .data = x},
  };
  ml_error_clear();
  assert_int_equal(ml_ckpt_write(tpath(name), e, 3, 32), 0);
}

#define SH1 "model-00001-of-00002.safetensors"
#define SH2 "model-00002-of-00002.safetensors"

static void test_bad_indexes(void **state) {
  (void)state;
  static const struct {
    const char *index;
    const char *word;
  } cases[] = {
      {"{\"weight_map\":{\"a\":\"" SH1 "\",\"b\":\"" SH1 "\",\"c\":\"model-00009.safetensors\"}}",
       "missing"},
      {"{\"metadata\":{\"total_size\":48}}", "weight_map"},
      {"{\"weight_map\":[\"" SH1 "\"]}", "weight_map"},
      {"{\"weight_map\":{\"a\":1}}", "weight_map.a"},
      {"{\"weight_map\":{\"a\":\"../" SH1 "\"}}", "weight_map.a"},
      {"{\"metadata\":5,\"weight_map\":{}}", "metadata"},
      {"{\"weight_map\":{\"a\":\"" SH1 "\",\"b\":\"" SH1 "\",\"c\":\"" SH1 "\"}}", "no such tensor"},
      {"{\"weight_map\":{\"a\":\"" SH1 "\",\"c\":\"" SH2 "\"}}", "missing from weight_map"},
      {"{\"weight_map\":{\"a\":\"" SH1 "\",\"b\":\"" SH1 "\",\"c\":\"" SH2 "\"", "invalid JSON"},
      {"{\"weight_map\":{\"a\":\"" SH1 "\",\"a\":\"" SH1 "\"}}", "duplicate"},
  };
  char dir[512];
  snprintf(dir, sizeof dir, "%s", tpath("badidx"));
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    make_two_shards("badidx");
    write_text(tpath("badidx/model.safetensors.index.json"), cases[i].index);
    expect_open_err(dir, cases[i].word);
  }
  /* without metadata the index is fine */
  write_text(tpath("badidx/model.safetensors.index.json"),
             "{\"weight_map\":{\"a\":\"" SH1 "\",\"b\":\"" SH1 "\",\"c\":\"" SH2 "\"}}");
  ml_ckpt c;
  ml_error_clear();
  assert_int_equal(ml_ckpt_open(dir, &c), 0);
  assert_int_equal(c.nfiles, 2);
  ml_ckpt_close(&c);
}

/* The same tensor in two shard files is rejected. */
static void test_tensor_in_two_files(void **state) {
  (void)state;
  static float x[4] = {1, 2, 3, 4};
  ml_st_entry e[2] = {
      {.name = "a", .dtype = ML_F32, .ndim = 1, .shape = {4}, .data = x},
      {.name = "b", .dtype = ML_F32, .ndim = 1, .shape = {4}, .data = x},
  };
  assert_int_equal(mkdir(tpath("two"), 0777), 0);
  ml_error_clear();
  assert_int_equal(ml_st_write(tpath("two/" SH1), e, 1), 0);     /* a */
  assert_int_equal(ml_st_write(tpath("two/" SH2), e, 2), 0);     /* a, b */
  write_text(tpath("two/model.safetensors.index.json"),
             "{\"weight_map\":{\"a\":\"" SH1 "\",\"b\":\"" SH2 "\"}}");
  expect_open_err(tpath("two"), "two files");
}

static void test_missing_or_invalid_files(void **state) {
  (void)state;
  char dir[512];
  snprintf(dir, sizeof dir, "%s", tpath("empty"));
  assert_int_equal(mkdir(dir, 0777), 0);
  expect_open_err(dir, "no model.safetensors or model.safetensors.index.json");
  expect_open_err(tpath("does-not-exist"), "no model.safetensors");
  /* an invalid single file: the message names it */
  write_text(tpath("empty/model.safetensors"), "garbage");
  expect_open_err(dir, "model.safetensors: file is 7 bytes");
  /* an invalid shard named by the index */
  make_two_shards("badshard");
  write_bytes(tpath("badshard/" SH2), "\x10\0\0\0\0\0\0\0{}", 10);
  expect_open_err(tpath("badshard"), SH2 ": header length 16 runs past end of file");
}

/* The streaming writer shards as ml_ckpt_write does, one tensor at a time:
 * shards open when their first tensor begins (raw bytes of any dtype and
 * converted fp32 alike), the index comes last. */
static void test_stream_sharded(void **state) {
  (void)state;
  ml_st_entry e[NT];
  make_entries(e);
  static const int32_t ints[NE] = {5, -6};
  e[3].dtype = ML_I32; /* carried raw: 64 bytes, as the fp32 ones */
  char dir[512];
  snprintf(dir, sizeof dir, "%s", tpath("stream"));
  ml_ckpt_writer *w;
  ml_error_clear();
  assert_int_equal(ml_ckpt_writer_open(dir, e, NT, 150, &w), 0); /* {0,1} {2,3} {4} */
  assert_true(exists(tpath("stream/model-00001-of-00003.safetensors.tmp")));
  for (int k = 0; k < 3; k++) assert_int_equal(ml_ckpt_writer_put_f32(w, g_data[k], NE), 0);
  assert_true(exists(tpath("stream/model-00001-of-00003.safetensors")));
  assert_int_equal(ml_ckpt_writer_put(w, ints, 32), 0);
  assert_int_equal(ml_ckpt_writer_put(w, (const char *)ints + 32, 32), 0);
  assert_true(exists(tpath("stream/model-00002-of-00003.safetensors")));
  assert_false(exists(tpath("stream/model.safetensors.index.json")));
  assert_int_equal(ml_ckpt_writer_put_f32(w, g_data[4], NE), 0);
  assert_int_equal(ml_ckpt_writer_close(w), 0);
  ml_ckpt c;
  assert_int_equal(ml_ckpt_open(dir, &c), 0);
  assert_int_equal(c.nfiles, 3);
  const ml_st_tensor *t = ml_ckpt_find(&c, "l1.w");
  assert_int_equal(t->dtype, ML_I32);
  assert_memory_equal(t->data, ints, sizeof ints);
  float out[NE];
  assert_int_equal(ml_st_read_block(ml_ckpt_find(&c, "head.weight"), 0, NE, 0, 1, out), 0);
  assert_memory_equal(out, g_data[4], sizeof out);
  ml_ckpt_close(&c);

  /* misuse: a put beyond the tensor; close before the end (no index) */
  ml_error_clear();
  assert_int_equal(ml_ckpt_writer_open(tpath("stream2"), e, NT, 0, &w), 0);
  assert_int_equal(ml_ckpt_writer_put_f32(w, g_data[0], NE + 1), -1);
  expect_msg("stream2", "'embed.weight': 68 bytes put where 64 of its 64 remain");
  ml_ckpt_writer_abandon(w);
  assert_false(exists(tpath("stream2/model.safetensors.tmp")));
  ml_error_clear();
  assert_int_equal(ml_ckpt_writer_open(tpath("stream2"), e, NT, 150, &w), 0);
  for (int k = 0; k < 2; k++) assert_int_equal(ml_ckpt_writer_put_f32(w, g_data[k], NE), 0);
  assert_int_equal(ml_ckpt_writer_close(w), -1);
  expect_msg("stream2", "'l0.b': 0 of its 64 bytes put");
  assert_false(exists(tpath("stream2/model.safetensors.index.json")));
  assert_false(exists(tpath("stream2/model-00002-of-00003.safetensors.tmp")));
  e[4].name = e[0].name;
  ml_error_clear();
  assert_int_equal(ml_ckpt_writer_open(tpath("stream3"), e, NT, 150, &w), -1);
  expect_msg("stream3", "duplicate tensor name 'embed.weight'");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_single_file),         cmocka_unit_test(test_sharded),
      cmocka_unit_test(test_shard_oversized),     cmocka_unit_test(test_write_errors),
      cmocka_unit_test(test_bad_indexes),         cmocka_unit_test(test_tensor_in_two_files),
      cmocka_unit_test(test_missing_or_invalid_files), cmocka_unit_test(test_stream_sharded),
  };
  return cmocka_run_group_tests(tests, tmpdir_setup, tmpdir_teardown);
}
