/* Data loader: JSONL records (token ids, text, prompt/completion) and raw
 * text, packing, masks, errors, dp batch slicing. The tokenized formats are
 * checked against the tokenizer fixtures' golden ids (tokenizers'
 * Tokenizer.encode, tests/fixtures/tokenizer/NAME/cases.json): every
 * expected row is built from those ids by the rules of data/data.h. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
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
#include <jansson.h>

#include "common/status.h"
#include "data/data.h"

static char g_dir[64];
static char g_path[128];
static ml_data_opts g_opts; /* the defaults over g_dir, which has no tokenizer.json */

static int setup(void **state) {
  strcpy(g_dir, "/tmp/ml_test_data_XXXXXX");
  g_opts = ml_data_opts_default(g_dir);
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
  assert_int_equal(ml_dataset_load(write_file(text), seq_len, vocab, &g_opts, &ds), -1);
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
  assert_int_equal(ml_dataset_load(write_file(text), 4, 10, &g_opts, &ds), 0);
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
  assert_int_equal(ml_dataset_load(write_file(text), 6, 10, &g_opts, &ds), 0);
  assert_int_equal(ds.nseq, 2);
  assert_row(&ds, 0, (int32_t[]){1, 2, 3, 4, 0, 0}, (uint8_t[]){0, 0, 1, 0, 0, 0});
  assert_row(&ds, 1, (int32_t[]){5, 6, 7, 8, 9, 1}, (uint8_t[]){0, 1, 1, 0, 1, 1});
  ml_dataset_free(&ds);
}

static void test_raw_text_windows(void **state) {
  ml_dataset ds;
  assert_int_equal(ml_dataset_load(write_file("abcdefghij"), 4, 256, &g_opts, &ds), 0);
  assert_int_equal(ds.nseq, 3);
  assert_row(&ds, 0, (int32_t[]){'a', 'b', 'c', 'd'}, (uint8_t[]){0, 1, 1, 1});
  assert_row(&ds, 1, (int32_t[]){'e', 'f', 'g', 'h'}, (uint8_t[]){0, 1, 1, 1});
  assert_row(&ds, 2, (int32_t[]){'i', 'j', 0, 0}, (uint8_t[]){0, 1, 0, 0});
  ml_dataset_free(&ds);
  /* A one-byte tail is dropped; leading whitespace stays part of the text. */
  assert_int_equal(ml_dataset_load(write_file(" bcdefghi"), 4, 300, &g_opts, &ds), 0);
  assert_int_equal(ds.nseq, 2);
  assert_row(&ds, 0, (int32_t[]){' ', 'b', 'c', 'd'}, (uint8_t[]){0, 1, 1, 1});
  ml_dataset_free(&ds);
}

static void test_raw_text_high_bytes(void **state) {
  ml_dataset ds;
  assert_int_equal(ml_dataset_load(write_file("\xff\x80"), 8, 256, &g_opts, &ds), 0);
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
  expect_load_error("{\"ids\": [1, 2]}", 4, 10, "data:1: no data field", "'input_ids'",
                    "'text' (text, --text-key)", "'prompt' + 'completion'", NULL);
  expect_load_error("{\"input_ids\": \"12\"}", 4, 10, "data:1:", "not an array", NULL);
  expect_load_error("{\"input_ids\": []}", 4, 10, "data:1:", "at least 1", NULL);
  expect_load_error("{\"input_ids\": [1, 2], \"loss_mask\": [1]}", 4, 10, "data:1:",
                    "'loss_mask': length 1, expected 2", NULL);
  expect_load_error("{\"input_ids\": [1, 2], \"loss_mask\": [1, 2]}", 4, 10, "data:1:",
                    "'loss_mask'[1]", NULL);
}

/* Text and prompt/completion fields of the wrong type, or half a pair:
 * refused naming the line and the field, before any tokenizer is needed. */
static void test_text_field_errors(void **state) {
  expect_load_error("{\"text\": 3}", 4, 10, "data:1: field 'text': expected a string, found 3",
                    NULL);
  expect_load_error("\n{\"prompt\": \"a\"}", 4, 10,
                    "data:2: field 'completion': expected a string (the completion of field "
                    "'prompt'), found the field missing",
                    NULL);
  expect_load_error("{\"completion\": \"a\"}", 4, 10,
                    "data:1: field 'prompt': expected a string (the prompt of field "
                    "'completion'), found the field missing",
                    NULL);
  expect_load_error("{\"prompt\": [\"a\"], \"completion\": \"b\"}", 4, 10,
                    "data:1: field 'prompt': expected a string, found [\"a\"]", NULL);
  expect_load_error("{\"prompt\": \"a\", \"completion\": null}", 4, 10,
                    "data:1: field 'completion': expected a string, found null", NULL);
}

/* --text-key, --prompt-key, --completion-key: the fields looked for, and
 * named in messages; the default names are then ordinary fields. */
static void test_custom_keys(void **state) {
  ml_data_opts o = g_opts;
  o.text_key = "body";
  o.prompt_key = "question";
  o.completion_key = "answer";
  ml_dataset ds;
  ml_error_clear();
  assert_int_equal(ml_dataset_load(write_file("{\"body\": 1}"), 4, 10, &o, &ds), -1);
  assert_non_null(strstr(ml_error_msg(), "data:1: field 'body': expected a string, found 1"));
  ml_error_clear();
  assert_int_equal(ml_dataset_load(write_file("{\"question\": \"q\"}"), 4, 10, &o, &ds), -1);
  assert_non_null(strstr(ml_error_msg(), "field 'answer': expected a string (the completion of "
                                         "field 'question'), found the field missing"));
  ml_error_clear();
  assert_int_equal(ml_dataset_load(write_file("{\"text\": \"t\"}"), 4, 10, &o, &ds), -1);
  assert_non_null(strstr(ml_error_msg(), "'body' (text, --text-key), 'question' + 'answer' "
                                         "(--prompt-key, --completion-key) or 'messages'"));
}

/* A text or prompt/completion record without the model's tokenizer.json:
 * the record, the field and the missing file named. */
static void test_text_needs_tokenizer(void **state) {
  char file[128];
  snprintf(file, sizeof file, "and %s/tokenizer.json does not exist", g_dir);
  expect_load_error("\n{\"text\": \"abc\"}", 4, 10,
                    "data:2: field 'text': tokenizing text needs the model's tokenizer", file,
                    NULL);
  expect_load_error("{\"prompt\": \"a\", \"completion\": \"b\"}", 4, 10,
                    "data:1: fields 'prompt' + 'completion': tokenizing text needs", file, NULL);
  ml_seqs s;
  ml_error_clear();
  assert_int_equal(ml_seqs_load(write_file("{\"text\": \"abc\"}"), 10, 16, &g_opts, &s), -1);
  if (!strstr(ml_error_msg(), "data:1: field 'text'") || !strstr(ml_error_msg(), file))
    fail_msg("message '%s'", ml_error_msg());
}

/* input_ids wins over text fields; one format per file. */
static void test_formats_per_file(void **state) {
  ml_dataset ds;
  const char *text = "{\"input_ids\": [1, 2], \"text\": 5, \"prompt\": 1}\n";
  assert_int_equal(ml_dataset_load(write_file(text), 4, 10, &g_opts, &ds), 0);
  assert_int_equal(ds.format, ML_DATA_IDS);
  assert_row(&ds, 0, (int32_t[]){1, 2, 0, 0}, (uint8_t[]){0, 1, 0, 0});
  ml_dataset_free(&ds);
  expect_load_error("{\"input_ids\": [1, 2]}\n\n{\"text\": \"abc\"}\n", 4, 10,
                    "data:3: a record in the text format, but line 1's is in the input_ids "
                    "format; expected every record of a file in one format (the first record's, "
                    "field 'input_ids')",
                    NULL);
  expect_load_error("{\"input_ids\": [1]}\n{\"prompt\": \"a\", \"completion\": \"b\"}\n", 4, 10,
                    "data:2: a record in the prompt/completion format, but line 1's is in the "
                    "input_ids format",
                    NULL);
}

static void test_file_errors(void **state) {
  expect_load_error("", 4, 300, "empty dataset", NULL);
  expect_load_error("x", 4, 300, "empty dataset", NULL);
  ml_dataset ds;
  ml_error_clear();
  assert_int_equal(ml_dataset_load("/nonexistent/meshlm/data.jsonl", 4, 10, &g_opts, &ds), -1);
  assert_non_null(strstr(ml_error_msg(), "/nonexistent/meshlm/data.jsonl"));
  ml_error_clear();
  assert_int_equal(ml_dataset_load(write_file("{\"input_ids\":[1]}"), 1, 10, &g_opts, &ds), -1);
  assert_non_null(strstr(ml_error_msg(), "seq_len 1"));
}

/* Five sequences; row r starts with token r+1 and has r+1 targets. */
static void load_five(ml_dataset *ds) {
  const char *text = "{\"input_ids\": [1, 9]}\n{\"input_ids\": [2, 9, 9]}\n"
                     "{\"input_ids\": [3, 9, 9, 9]}\n{\"input_ids\": [4, 9, 9, 9, 9]}\n"
                     "{\"input_ids\": [5, 9, 9, 9, 9, 9]}\n";
  assert_int_equal(ml_dataset_load(write_file(text), 6, 10, &g_opts, ds), 0);
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
  assert_int_equal(ml_seqs_load(write_file(text), 10, 16, &g_opts, &s), 0);
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
  assert_int_equal(ml_seqs_load(write_file(text), 10, 16, &g_opts, &s), -1);
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

/* ---- tokenized formats against the fixtures' golden ids ---------------- */

/* The fixture tokenizers used here (tests/fixtures/NAME) and what their
 * post-processor's single template does (tools/gen_tokenizer_fixtures.py,
 * tools/gen_data_format_fixture.py): bytelevel "BOS $A" and no EOS token;
 * bytelevel_legacy "BOS $A EOS"; smollm2 "$A" with EOS <|im_end|> from
 * tokenizer_config.json; data_formats "BOS $A" with EOS from
 * tokenizer_config.json. */
typedef struct fixture {
  const char *name;
  bool template_eos; /* the template ends with EOS */
} fixture;
static const fixture k_fixtures[] = {{"tokenizer/bytelevel", false},
                                     {"tokenizer/bytelevel_legacy", true},
                                     {"tokenizer/smollm2", false},
                                     {"data_formats", false}};
enum { N_FIXTURES = sizeof k_fixtures / sizeof k_fixtures[0] };
enum { VOCAB = 50000 }; /* above every fixture's ids (smollm2: 49152) */

/* Texts the fixtures' cases.json hold, with and without specials (ASCII). */
static const char *const k_texts[] = {"   leading and trailing   ", "line one\r\nline two\r\n\r\n",
                                      "\t\tindented\ttabs\t", "12345678901234567890"};
static const char *const k_texts_df[] = {"The quick brown fox jumps over the lazy dog.",
                                         "meshlm trains and scores decoder language models.",
                                         "Question: what is two plus two?", " Answer: four."};

/* Text i for fixture fx. */
static const char *text_of(const fixture *fx, int i) {
  return strcmp(fx->name, "data_formats") == 0 ? k_texts_df[i] : k_texts[i];
}

typedef struct ids {
  int32_t v[512];
  int64_t n;
} ids;

/* tests/fixtures/NAME, one string per name for the whole run (ml_data_opts
 * keep the pointer). */
static const char *fixture_dir(const char *name) {
  static char names[8][64], dirs[8][512];
  for (int i = 0; i < 8; i++) {
    if (!names[i][0]) {
      snprintf(names[i], sizeof names[i], "%s", name);
      snprintf(dirs[i], sizeof dirs[i], "%s/tests/fixtures/%s", ML_SOURCE_DIR, name);
    }
    if (strcmp(names[i], name) == 0) return dirs[i];
  }
  fail_msg("more than 8 fixture names");
  return NULL;
}

static json_t *load_cases(const char *name) {
  char path[4200];
  snprintf(path, sizeof path, "%s/cases.json", fixture_dir(name));
  json_error_t e;
  json_t *root = json_load_file(path, JSON_ALLOW_NUL, &e);
  if (!root) fail_msg("%s: %s", path, e.text);
  return root;
}

/* Append the golden ids of encode(text, add_special) to *out. */
static void golden(const char *name, const char *text, bool add_special, ids *out) {
  json_t *root = load_cases(name), *c;
  size_t i;
  bool found = false;
  json_array_foreach(json_object_get(root, "cases"), i, c) {
    if (found || strcmp(json_string_value(json_object_get(c, "text")), text) != 0 ||
        json_is_true(json_object_get(c, "add_special")) != add_special)
      continue;
    found = true;
    size_t t;
    json_t *id;
    json_array_foreach(json_object_get(c, "ids"), t, id) {
      assert_true(out->n < 512);
      out->v[out->n++] = (int32_t)json_integer_value(id);
    }
  }
  json_decref(root);
  if (!found) fail_msg("%s/cases.json: no case for %s", name, text);
}

/* The fixture's EOS id (cases.json "eos": transformers' eos_token_id), -1 if none. */
static int32_t golden_eos(const char *name) {
  json_t *root = load_cases(name);
  json_t *eos = json_object_get(root, "eos");
  int32_t id = json_is_integer(eos) ? (int32_t)json_integer_value(eos) : -1;
  json_decref(root);
  return id;
}

static void push_id(ids *out, int32_t id) {
  assert_true(out->n < 512);
  out->v[out->n++] = id;
}

/* A text document (data/data.h): encode(text, true), then EOS unless the
 * template ended with it (checked against the golden ids). */
static void expect_document(const fixture *fx, const char *text, ids *out) {
  int64_t n0 = out->n;
  golden(fx->name, text, true, out);
  int32_t eos = golden_eos(fx->name);
  if (fx->template_eos) {
    assert_int_equal(out->v[out->n - 1], eos);
    return;
  }
  if (eos >= 0) push_id(out, eos);
  assert_true(out->n > n0);
}

/* A prompt/completion record: encode(prompt, true) less the template's
 * EOS, encode(completion, false), EOS; *plen = the prompt's tokens. */
static void expect_prompt(const fixture *fx, const char *prompt, const char *completion, ids *out,
                          int64_t *plen) {
  golden(fx->name, prompt, true, out);
  if (fx->template_eos) out->n--;
  *plen = out->n;
  golden(fx->name, completion, false, out);
  int32_t eos = golden_eos(fx->name);
  if (eos >= 0) push_id(out, eos);
}

/* One JSONL line {"k1": v1[, "k2": v2]} (strings JSON-escaped) appended to buf. */
static void add_line(char *buf, size_t cap, const char *k1, const char *v1, const char *k2,
                     const char *v2) {
  json_t *o = json_object();
  json_object_set_new(o, k1, json_string(v1));
  if (k2) json_object_set_new(o, k2, json_string(v2));
  char *line = json_dumps(o, JSON_COMPACT);
  size_t used = strlen(buf);
  snprintf(buf + used, cap - used, "%s\n", line);
  free(line);
  json_decref(o);
}

/* The dataset's row r: ids `from[0, n)` (n <= seq_len), padded with 0;
 * targets where target[t] and t > 0. */
static void assert_row_of(const ml_dataset *ds, int64_t r, const int32_t *from, int64_t n,
                          const uint8_t *target) {
  assert_true(n <= ds->seq_len);
  for (int64_t t = 0; t < ds->seq_len; t++) {
    int32_t id = t < n ? from[t] : 0;
    uint8_t m = t > 0 && t < n && target[t];
    if (ds->ids[r * ds->seq_len + t] != id || ds->mask[r * ds->seq_len + t] != m)
      fail_msg("row %lld position %lld: id %d mask %d, expected %d %d", (long long)r, (long long)t,
               ds->ids[r * ds->seq_len + t], ds->mask[r * ds->seq_len + t], id, m);
  }
}

static const uint8_t k_all_targets[512] = {[0 ... 511] = 1};

/* Windows of seq_len over `stream`: a tail of >= 2 tokens padded, 1 dropped. */
static void assert_windows(const ml_dataset *ds, const ids *stream) {
  int64_t S = ds->seq_len, full = stream->n / S, tail = stream->n % S;
  assert_int_equal(ds->nseq, full + (tail >= 2));
  assert_true(ds->packed);
  assert_int_equal(ds->tokens, stream->n);
  for (int64_t r = 0; r < ds->nseq; r++)
    assert_row_of(ds, r, stream->v + r * S, r < full ? S : tail, k_all_targets);
}

static ml_data_opts fixture_opts(const fixture *fx) {
  return ml_data_opts_default(fixture_dir(fx->name));
}

/* Text records packed (the default): documents with their BOS/EOS in file
 * order, cut into windows; every token a target but a window's first. */
static void test_text_packed(void **state) {
  for (int f = 0; f < N_FIXTURES; f++) {
    const fixture *fx = &k_fixtures[f];
    char text[2048] = "";
    ids stream = {.n = 0};
    for (int i = 0; i < 3; i++) {
      add_line(text, sizeof text, "text", text_of(fx, i), "note", "ignored");
      if (i == 0) strcat(text, "\n  \n");
      expect_document(fx, text_of(fx, i), &stream);
    }
    ml_data_opts o = fixture_opts(fx);
    for (int64_t S = 2; S <= 9; S += 7) {
      ml_dataset ds;
      if (ml_dataset_load(write_file(text), S, VOCAB, &o, &ds) != 0) fail_msg("%s", ml_error_msg());
      assert_int_equal(ds.format, ML_DATA_TEXT);
      assert_int_equal(ds.records, 3);
      assert_windows(&ds, &stream);
      ml_dataset_free(&ds);
    }
  }
}

/* --packing false: one document per row, truncated or padded. */
static void test_text_unpacked(void **state) {
  for (int f = 0; f < N_FIXTURES; f++) {
    const fixture *fx = &k_fixtures[f];
    char text[2048] = "";
    ids doc[4];
    for (int i = 0; i < 4; i++) {
      add_line(text, sizeof text, "text", text_of(fx, i), NULL, NULL);
      doc[i] = (ids){.n = 0};
      expect_document(fx, text_of(fx, i), &doc[i]);
    }
    ml_data_opts o = fixture_opts(fx);
    o.packing = false;
    ml_dataset ds;
    const int64_t S = 12;
    if (ml_dataset_load(write_file(text), S, VOCAB, &o, &ds) != 0) fail_msg("%s", ml_error_msg());
    assert_int_equal(ds.nseq, 4);
    assert_false(ds.packed);
    for (int i = 0; i < 4; i++)
      assert_row_of(&ds, i, doc[i].v, doc[i].n < S ? doc[i].n : S, k_all_targets);
    ml_dataset_free(&ds);
  }
}

/* Prompt/completion: one record per row, the completion's tokens (EOS
 * included) the only targets; truncated to seq_len. */
static void test_prompt_completion(void **state) {
  for (int f = 0; f < N_FIXTURES; f++) {
    const fixture *fx = &k_fixtures[f];
    char text[2048] = "";
    ids rec[3];
    int64_t plen[3];
    const int pairs[3][2] = {{0, 1}, {3, 2}, {1, 0}};
    for (int i = 0; i < 3; i++) {
      const char *p = text_of(fx, pairs[i][0]), *c = text_of(fx, pairs[i][1]);
      add_line(text, sizeof text, "completion", c, "prompt", p);
      rec[i] = (ids){.n = 0};
      expect_prompt(fx, p, c, &rec[i], &plen[i]);
    }
    ml_data_opts o = fixture_opts(fx);
    ml_dataset ds;
    const int64_t S = 16;
    if (ml_dataset_load(write_file(text), S, VOCAB, &o, &ds) != 0) fail_msg("%s", ml_error_msg());
    assert_int_equal(ds.format, ML_DATA_PROMPT);
    assert_int_equal(ds.nseq, 3);
    bool truncated = false;
    for (int i = 0; i < 3; i++) {
      uint8_t target[512] = {0};
      for (int64_t t = plen[i]; t < rec[i].n; t++) target[t] = 1;
      truncated |= rec[i].n > S;
      assert_row_of(&ds, i, rec[i].v, rec[i].n < S ? rec[i].n : S, target);
    }
    assert_true(truncated); /* the truncation rule was exercised */
    ml_dataset_free(&ds);
  }
}

/* Custom keys; the default names are then ordinary fields. */
static void test_custom_keys_tokenized(void **state) {
  const fixture *fx = &k_fixtures[1];
  ml_data_opts o = fixture_opts(fx);
  o.prompt_key = "question";
  o.completion_key = "answer";
  char text[1024] = "";
  add_line(text, sizeof text, "question", text_of(fx, 3), "answer", text_of(fx, 2));
  ids rec = {.n = 0};
  int64_t plen;
  expect_prompt(fx, text_of(fx, 3), text_of(fx, 2), &rec, &plen);
  ml_dataset ds;
  if (ml_dataset_load(write_file(text), 64, VOCAB, &o, &ds) != 0) fail_msg("%s", ml_error_msg());
  uint8_t target[512] = {0};
  for (int64_t t = plen; t < rec.n; t++) target[t] = 1;
  assert_row_of(&ds, 0, rec.v, rec.n, target);
  ml_dataset_free(&ds);
  o.text_key = "body";
  text[0] = 0;
  add_line(text, sizeof text, "body", text_of(fx, 0), "text", "not this one");
  ids doc = {.n = 0};
  expect_document(fx, text_of(fx, 0), &doc);
  if (ml_dataset_load(write_file(text), 64, VOCAB, &o, &ds) != 0) fail_msg("%s", ml_error_msg());
  assert_windows(&ds, &doc);
  ml_dataset_free(&ds);
}

/* Raw text with a tokenizer.json: one document, packed; without one,
 * bytes (test_raw_text_windows). */
static void test_raw_text_tokenized(void **state) {
  for (int f = 0; f < N_FIXTURES; f++) {
    const fixture *fx = &k_fixtures[f];
    ids doc = {.n = 0};
    expect_document(fx, text_of(fx, 1), &doc);
    ml_data_opts o = fixture_opts(fx);
    o.packing = false; /* no effect on raw text: one document, always windowed */
    ml_dataset ds;
    if (ml_dataset_load(write_file(text_of(fx, 1)), 4, VOCAB, &o, &ds) != 0)
      fail_msg("%s", ml_error_msg());
    assert_int_equal(ds.format, ML_DATA_RAW);
    assert_int_equal(ds.records, 1);
    assert_windows(&ds, &doc);
    ml_dataset_free(&ds);
  }
  /* an empty file is no document */
  ml_data_opts o = fixture_opts(&k_fixtures[0]);
  ml_dataset ds;
  ml_error_clear();
  assert_int_equal(ml_dataset_load(write_file(""), 4, VOCAB, &o, &ds), -1);
  assert_non_null(strstr(ml_error_msg(), "empty dataset"));
}

/* Scoring: the same tokens as training, whole; prompt lengths kept. */
static void test_seqs_tokenized(void **state) {
  const fixture *fx = &k_fixtures[2];
  ml_data_opts o = fixture_opts(fx);
  char text[2048] = "";
  add_line(text, sizeof text, "text", k_texts[0], NULL, NULL);
  add_line(text, sizeof text, "text", k_texts[1], NULL, NULL);
  ml_seqs s;
  if (ml_seqs_load(write_file(text), VOCAB, 512, &o, &s) != 0) fail_msg("%s", ml_error_msg());
  assert_int_equal(s.format, ML_DATA_TEXT);
  assert_int_equal(s.n, 2);
  for (int i = 0; i < 2; i++) {
    ids doc = {.n = 0};
    expect_document(fx, k_texts[i], &doc);
    assert_int_equal(s.len[i], doc.n);
    assert_memory_equal(s.ids[i], doc.v, (size_t)doc.n * sizeof(int32_t));
    assert_int_equal(s.prompt_len[i], 0);
  }
  ml_seqs_free(&s);
  text[0] = 0;
  add_line(text, sizeof text, "prompt", k_texts[2], "completion", k_texts[3]);
  ids rec = {.n = 0};
  int64_t plen;
  expect_prompt(fx, k_texts[2], k_texts[3], &rec, &plen);
  if (ml_seqs_load(write_file(text), VOCAB, 512, &o, &s) != 0) fail_msg("%s", ml_error_msg());
  assert_int_equal(s.format, ML_DATA_PROMPT);
  assert_int_equal(s.len[0], rec.n);
  assert_int_equal(s.prompt_len[0], plen);
  assert_memory_equal(s.ids[0], rec.v, (size_t)rec.n * sizeof(int32_t));
  ml_seqs_free(&s);
  /* longer than max_position_embeddings: the line, the fields, the count */
  char want[128];
  snprintf(want, sizeof want, "data:1: fields 'prompt' + 'completion': %lld tokens (after "
           "tokenization), above the model's max_position_embeddings 8", (long long)rec.n);
  ml_error_clear();
  assert_int_equal(ml_seqs_load(write_file(text), VOCAB, 8, &o, &s), -1);
  if (!strstr(ml_error_msg(), want)) fail_msg("'%s' lacks '%s'", ml_error_msg(), want);
}

/* Errors of tokenized records: ids beyond the model's vocabulary, too few
 * tokens to score, a record of another format after a text one, a
 * tokenizer.json that does not load, raw text that is not UTF-8. */
static void test_tokenized_errors(void **state) {
  ml_data_opts legacy = fixture_opts(&k_fixtures[1]), plain = fixture_opts(&k_fixtures[0]);
  ml_dataset ds;
  char text[1024] = "";
  add_line(text, sizeof text, "text", k_texts[0], NULL, NULL);
  ids doc = {.n = 0};
  golden("tokenizer/bytelevel_legacy", k_texts[0], true, &doc);
  char want[160];
  snprintf(want, sizeof want, "data:1: field 'text': token 0 has id %d", doc.v[0]);
  ml_error_clear();
  assert_int_equal(ml_dataset_load(write_file(text), 8, 1000, &legacy, &ds), -1);
  if (!strstr(ml_error_msg(), want) || !strstr(ml_error_msg(), "vocabulary [0, 1000)"))
    fail_msg("'%s'", ml_error_msg());
  /* "" is [BOS] alone in bytelevel (no EOS): one token, nothing to score */
  ml_seqs s;
  ml_error_clear();
  assert_int_equal(ml_seqs_load(write_file("{\"text\": \"\"}\n"), VOCAB, 64, &plain, &s), -1);
  assert_non_null(strstr(ml_error_msg(), "data:1: field 'text': expected at least 2 tokens"));
  assert_non_null(strstr(ml_error_msg(), "found 1 (after tokenization)"));
  /* gpt2's template adds nothing and it has no EOS: "" is no token */
  ml_data_opts gpt2 = ml_data_opts_default(fixture_dir("tokenizer/gpt2"));
  ml_error_clear();
  assert_int_equal(ml_dataset_load(write_file("{\"text\": \"\"}\n"), 8, VOCAB, &gpt2, &ds), -1);
  assert_non_null(strstr(ml_error_msg(), "data:1: field 'text': the text tokenizes to no token"));
  strcat(text, "{\"input_ids\": [1, 2]}\n");
  ml_error_clear();
  assert_int_equal(ml_dataset_load(write_file(text), 8, VOCAB, &legacy, &ds), -1);
  assert_non_null(strstr(ml_error_msg(), "data:2: a record in the input_ids format, but line 1's "
                                         "is in the text format; expected every record of a "
                                         "file in one format (the first record's, field 'text')"));
  ml_error_clear();
  assert_int_equal(ml_dataset_load(write_file("\xff\xfe raw"), 8, VOCAB, &plain, &ds), -1);
  assert_non_null(strstr(ml_error_msg(), "data: raw text: "));
  /* a tokenizer.json that does not load: its message behind the record's */
  char dir[128], file[160];
  snprintf(dir, sizeof dir, "%s/badtok", g_dir);
  snprintf(file, sizeof file, "%s/tokenizer.json", dir);
  assert_int_equal(mkdir(dir, 0700), 0);
  FILE *f = fopen(file, "w");
  fputs("{\"model\": {\"type\": \"WordPiece\"}}", f);
  fclose(f);
  ml_data_opts bad = ml_data_opts_default(dir);
  ml_error_clear();
  assert_int_equal(ml_dataset_load(write_file(text), 8, VOCAB, &bad, &ds), -1);
  assert_non_null(strstr(ml_error_msg(), "data:1: field 'text': "));
  assert_non_null(strstr(ml_error_msg(), "tokenizer.json"));
  unlink(file);
  rmdir(dir);
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
      cmocka_unit_test(test_seqs_errors),          cmocka_unit_test(test_text_field_errors),
      cmocka_unit_test(test_custom_keys),          cmocka_unit_test(test_text_needs_tokenizer),
      cmocka_unit_test(test_formats_per_file),     cmocka_unit_test(test_text_packed),
      cmocka_unit_test(test_text_unpacked),        cmocka_unit_test(test_prompt_completion),
      cmocka_unit_test(test_custom_keys_tokenized), cmocka_unit_test(test_raw_text_tokenized),
      cmocka_unit_test(test_seqs_tokenized),       cmocka_unit_test(test_tokenized_errors),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
