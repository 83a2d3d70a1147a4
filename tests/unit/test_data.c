/* Data loader: JSONL and raw text parsing, errors, dp batch slicing. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
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
#include "train/data.h"

static char g_dir[64];
static char g_path[128];

static int setup(void **state) {
  strcpy(g_dir, "/tmp/ml_test_data_XXXXXX");
  return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state) {
  unlink(g_path);
  return rmdir(g_dir);
}

/* Write `text` to the test file and return its path. */
static const char *write_file(const char *text) {
  snprintf(g_path, sizeof g_path, "%s/data", g_dir);
  FILE *f = fopen(g_path, "wb");
  assert_non_null(f);
  fwrite(text, 1, strlen(text), f);
  fclose(f);
  return g_path;
}

static void assert_row(const ml_dataset *ds, int64_t r, const int32_t *ids, const uint8_t *mask) {
  for (int64_t t = 0; t < ds->seq_len; t++) {
    assert_int_equal(ds->ids[r * ds->seq_len + t], ids[t]);
    assert_int_equal(ds->mask[r * ds->seq_len + t], mask[t]);
  }
}

/* Load must fail with a message containing every string in the NULL-ended list. */
static void expect_load_error(const char *text, int64_t seq_len, int64_t vocab, ...) {
  ml_dataset ds;
  ml_error_clear();
  assert_int_equal(ml_dataset_load(write_file(text), seq_len, vocab, &ds), -1);
  assert_null(ds.ids);
  va_list ap;
  va_start(ap, vocab);
  for (const char *s = va_arg(ap, const char *); s; s = va_arg(ap, const char *)) {
    if (!strstr(ml_error_msg(), s)) fail_msg("message '%s' lacks '%s'", ml_error_msg(), s);
  }
  va_end(ap);
}

static void test_jsonl_no_mask(void **state) {
  ml_dataset ds;
  const char *text = "\n{\"input_ids\": [1, 2, 3]}\n\n  \n{\"input_ids\": [4,5,6,7,8,9], \"x\": 1}";
  assert_int_equal(ml_dataset_load(write_file(text), 4, 10, &ds), 0);
  assert_int_equal(ds.nseq, 2);
  assert_int_equal(ds.seq_len, 4);
  assert_row(&ds, 0, (int32_t[]){1, 2, 3, 0}, (uint8_t[]){0, 1, 1, 0});
  assert_row(&ds, 1, (int32_t[]){4, 5, 6, 7}, (uint8_t[]){0, 1, 1, 1});
  ml_dataset_free(&ds);
  assert_null(ds.ids);
}

static void test_jsonl_with_mask(void **state) {
  ml_dataset ds;
  const char *text = "{\"input_ids\": [1,2,3,4], \"loss_mask\": [1, 0, true, false]}\r\n"
                     "{\"input_ids\": [5,6,7,8,9,1,2,3], \"loss_mask\": [0,1,1,0,1,1,1,1]}\n";
  assert_int_equal(ml_dataset_load(write_file(text), 6, 10, &ds), 0);
  assert_int_equal(ds.nseq, 2);
  assert_row(&ds, 0, (int32_t[]){1, 2, 3, 4, 0, 0}, (uint8_t[]){0, 0, 1, 0, 0, 0});
  assert_row(&ds, 1, (int32_t[]){5, 6, 7, 8, 9, 1}, (uint8_t[]){0, 1, 1, 0, 1, 1});
  ml_dataset_free(&ds);
}

static void test_raw_text_windows(void **state) {
  ml_dataset ds;
  assert_int_equal(ml_dataset_load(write_file("abcdefghij"), 4, 256, &ds), 0);
  assert_int_equal(ds.nseq, 3);
  assert_row(&ds, 0, (int32_t[]){'a', 'b', 'c', 'd'}, (uint8_t[]){0, 1, 1, 1});
  assert_row(&ds, 1, (int32_t[]){'e', 'f', 'g', 'h'}, (uint8_t[]){0, 1, 1, 1});
  assert_row(&ds, 2, (int32_t[]){'i', 'j', 0, 0}, (uint8_t[]){0, 1, 0, 0});
  ml_dataset_free(&ds);
  /* A one-byte tail is dropped; leading whitespace stays part of the text. */
  assert_int_equal(ml_dataset_load(write_file(" bcdefghi"), 4, 300, &ds), 0);
  assert_int_equal(ds.nseq, 2);
  assert_row(&ds, 0, (int32_t[]){' ', 'b', 'c', 'd'}, (uint8_t[]){0, 1, 1, 1});
  ml_dataset_free(&ds);
}

static void test_raw_text_high_bytes(void **state) {
  ml_dataset ds;
  assert_int_equal(ml_dataset_load(write_file("\xff\x80"), 8, 256, &ds), 0);
  assert_int_equal(ds.nseq, 1);
  assert_int_equal(ds.ids[0], 255);
  assert_int_equal(ds.ids[1], 128);
  ml_dataset_free(&ds);
}

static void test_raw_text_small_vocab(void **state) {
  expect_load_error("hello world", 4, 255, "raw text", "vocab_size >= 256", "255", NULL);
}

static void test_id_out_of_range(void **state) {
  const char *text = "{\"input_ids\": [1, 2]}\n\n{\"input_ids\": [3, 10]}\n";
  expect_load_error(text, 4, 10, "data:3:", "'input_ids'[1] = 10", "[0, 10)", NULL);
  expect_load_error("{\"input_ids\": [-1]}", 4, 10, "data:1:", "= -1", NULL);
  expect_load_error("{\"input_ids\": [1.5]}", 4, 10, "data:1:", "non-integer", NULL);
}

static void test_bad_json(void **state) {
  expect_load_error("{\"input_ids\": [1, 2]}\n{\"input_ids\": [1, 2}\n", 4, 10, "data:2:",
                    "invalid JSON", NULL);
  expect_load_error("{\"input_ids\": [1], \"input_ids\": [2]}", 4, 10, "data:1:", "duplicate",
                    NULL);
  expect_load_error("{\"input_ids\": [1]}\n[1, 2]\n", 4, 10, "data:2:", "JSON object", NULL);
}

static void test_field_errors(void **state) {
  expect_load_error("{\"ids\": [1, 2]}", 4, 10, "data:1:", "'input_ids'",
                    "found the field missing", NULL);
  expect_load_error("{\"input_ids\": \"12\"}", 4, 10, "data:1:", "not an array", NULL);
  expect_load_error("{\"input_ids\": []}", 4, 10, "data:1:", "at least 1", NULL);
  expect_load_error("{\"input_ids\": [1, 2], \"loss_mask\": [1]}", 4, 10, "data:1:",
                    "'loss_mask': length 1, expected 2", NULL);
  expect_load_error("{\"input_ids\": [1, 2], \"loss_mask\": [1, 2]}", 4, 10, "data:1:",
                    "'loss_mask'[1]", NULL);
}

static void test_file_errors(void **state) {
  expect_load_error("", 4, 300, "empty dataset", NULL);
  expect_load_error("x", 4, 300, "empty dataset", NULL);
  ml_dataset ds;
  ml_error_clear();
  assert_int_equal(ml_dataset_load("/nonexistent/meshlm/data.jsonl", 4, 10, &ds), -1);
  assert_non_null(strstr(ml_error_msg(), "/nonexistent/meshlm/data.jsonl"));
  ml_error_clear();
  assert_int_equal(ml_dataset_load(write_file("{\"input_ids\":[1]}"), 1, 10, &ds), -1);
  assert_non_null(strstr(ml_error_msg(), "seq_len 1"));
}

/* Five sequences; row r starts with token r+1 and has r+1 targets. */
static void load_five(ml_dataset *ds) {
  const char *text = "{\"input_ids\": [1, 9]}\n{\"input_ids\": [2, 9, 9]}\n"
                     "{\"input_ids\": [3, 9, 9, 9]}\n{\"input_ids\": [4, 9, 9, 9, 9]}\n"
                     "{\"input_ids\": [5, 9, 9, 9, 9, 9]}\n";
  assert_int_equal(ml_dataset_load(write_file(text), 6, 10, ds), 0);
  assert_int_equal(ds->nseq, 5);
}

static void test_batch_wraps(void **state) {
  ml_dataset ds;
  load_five(&ds);
  int32_t ids[2 * 6];
  uint8_t mask[2 * 6];
  /* step 1, B = 4: rows 4, 0, 1, 2; rank 0 of 2 gets rows 4 and 0. */
  assert_int_equal(ml_dataset_batch(&ds, 1, 4, 0, 2, ids, mask), 0);
  assert_int_equal(ids[0], 5);
  assert_int_equal(ids[6], 1);
  assert_memory_equal(mask, ds.mask + 4 * 6, 6);
  assert_int_equal(ml_dataset_batch(&ds, 1, 4, 1, 2, ids, mask), 0);
  assert_int_equal(ids[0], 2);
  assert_int_equal(ids[6], 3);
  ml_dataset_free(&ds);
}

static void test_batch_union_of_ranks(void **state) {
  ml_dataset ds;
  load_five(&ds);
  enum { B = 6, S = 6 };
  int32_t whole[B * S], part[B * S];
  uint8_t whole_m[B * S], part_m[B * S];
  for (int64_t step = 0; step < 7; step++) {
    assert_int_equal(ml_dataset_batch(&ds, step, B, 0, 1, whole, whole_m), 0);
    for (int64_t dp = 2; dp <= 3; dp++) {
      for (int64_t r = 0; r < dp; r++) {
        int64_t off = r * (B / dp) * S;
        assert_int_equal(ml_dataset_batch(&ds, step, B, r, dp, part + off, part_m + off), 0);
      }
      assert_memory_equal(part, whole, sizeof whole);
      assert_memory_equal(part_m, whole_m, sizeof whole_m);
    }
    for (int64_t i = 0; i < B; i++) assert_int_equal(whole[i * S], (step * B + i) % 5 + 1);
  }
  ml_dataset_free(&ds);
}

static void test_batch_errors(void **state) {
  ml_dataset ds;
  load_five(&ds);
  int32_t ids[6 * 6];
  uint8_t mask[6 * 6];
  ml_error_clear();
  assert_int_equal(ml_dataset_batch(&ds, 0, 5, 0, 2, ids, mask), -1);
  assert_non_null(strstr(ml_error_msg(), "global_batch 5 is not divisible by dp size 2"));
  ml_error_clear();
  assert_int_equal(ml_dataset_batch(&ds, 0, 4, 2, 2, ids, mask), -1);
  assert_non_null(strstr(ml_error_msg(), "dp_rank 2"));
  ml_error_clear();
  assert_int_equal(ml_dataset_batch(&ds, -1, 4, 0, 2, ids, mask), -1);
  ml_error_clear();
  assert_int_equal(ml_dataset_count_targets(&ds, 0, 0), -1);
  ml_dataset_free(&ds);
}

static void test_count_targets(void **state) {
  ml_dataset ds;
  load_five(&ds);
  /* Row r has r+1 targets. step 0, B = 4: rows 0..3 -> 1+2+3+4. */
  assert_int_equal(ml_dataset_count_targets(&ds, 0, 4), 10);
  /* step 1, B = 4: rows 4, 0, 1, 2 -> 5+1+2+3. */
  assert_int_equal(ml_dataset_count_targets(&ds, 1, 4), 11);
  /* B = 7 wraps within one step: rows 0..4, 0, 1 -> 15+1+2. */
  assert_int_equal(ml_dataset_count_targets(&ds, 0, 7), 18);
  ml_dataset_free(&ds);
}

static void test_seqs(void **state) {
  ml_seqs s;
  const char *text = "{\"input_ids\": [1, 2, 3], \"loss_mask\": [0]}\n\n{\"input_ids\": [4, 5]}\n";
  assert_int_equal(ml_seqs_load_jsonl(write_file(text), 10, 16, &s), 0);
  assert_int_equal(s.n, 2);
  assert_int_equal(s.len[0], 3);
  assert_int_equal(s.len[1], 2);
  assert_int_equal(s.ids[0][2], 3);
  assert_int_equal(s.ids[1][0], 4);
  ml_seqs_free(&s);
  assert_null(s.ids);
}

static void expect_seqs_error(const char *text, const char *a, const char *b) {
  ml_seqs s;
  ml_error_clear();
  assert_int_equal(ml_seqs_load_jsonl(write_file(text), 10, 16, &s), -1);
  assert_null(s.ids);
  if (!strstr(ml_error_msg(), a) || !strstr(ml_error_msg(), b))
    fail_msg("message '%s' lacks '%s' or '%s'", ml_error_msg(), a, b);
}

static void test_seqs_errors(void **state) {
  expect_seqs_error("{\"input_ids\": [1, 2]}\n{\"input_ids\": [3]}\n", "data:2:", "at least 2");
  expect_seqs_error("{\"input_ids\": [1, 2]}\n{\"input_ids\": [3, 11]}\n", "data:2:", "= 11");
  expect_seqs_error("{\"input_ids\": [1, 2]}\n{\"input_ids\": [3, 4]\n", "data:2:", "invalid JSON");
  expect_seqs_error("\n\n", "empty dataset", "data");
  /* longer than max_position_embeddings (16 here): refused up front, the line named */
  expect_seqs_error("{\"input_ids\": [1, 2]}\n\n{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, "
                    "3, 4, 5, 6, 7, 8]}\n",
                    "data:3: field 'input_ids': 17 tokens", "max_position_embeddings 16");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_jsonl_no_mask),        cmocka_unit_test(test_jsonl_with_mask),
      cmocka_unit_test(test_raw_text_windows),     cmocka_unit_test(test_raw_text_high_bytes),
      cmocka_unit_test(test_raw_text_small_vocab), cmocka_unit_test(test_id_out_of_range),
      cmocka_unit_test(test_bad_json),             cmocka_unit_test(test_field_errors),
      cmocka_unit_test(test_file_errors),          cmocka_unit_test(test_batch_wraps),
      cmocka_unit_test(test_batch_union_of_ranks), cmocka_unit_test(test_batch_errors),
      cmocka_unit_test(test_count_targets),        cmocka_unit_test(test_seqs),
      cmocka_unit_test(test_seqs_errors),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
