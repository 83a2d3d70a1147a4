/* Multi-rank data loading (data/data.h ml_data_group, cli/data_group.h):
 * `mpiexec -n N test_data_split`. Every rank reads its part of the file
 * and the parts are all-gathered; the dataset (rows, masks, counts,
 * format) and the scoring sequences must equal bitwise what one rank
 * loading the whole file alone builds, and a bad file must fail on every
 * rank with the single-rank load's message (the first failing line's),
 * whichever part the bad lines fall in. Files: token ids with blank lines
 * and loss masks, text (packed and not) and prompt/completion records
 * tokenized with tests/fixtures/data_formats' tokenizer, a first line
 * longer than a part (later parts empty), raw text (read whole by every
 * rank), conversations rendered with SmolLM2's chat template (data_chat.h),
 * gathers in rounds of a few bytes, and errors at lines of every part. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/data_group.h"
#include "comm/host.h"
#include "common/status.h"
#include "data/data.h"
#include "held.h"
#include "rank_report.h"

static char g_dir[64];
static char g_path[128];
static ml_host *g_world;
static ml_data_group g_group;
static const char *g_tok = ML_SOURCE_DIR "/tests/fixtures/data_formats";
static char g_chat[128]; /* g_tok's tokenizer with SmolLM2's chat template */

/* A growing text buffer. */
typedef struct text {
  char *s;
  size_t n, cap;
} text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(text *t, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (t->n + (size_t)k + 1 > t->cap) {
    t->cap = (t->n + (size_t)k + 1) * 2;
    t->s = realloc(t->s, t->cap);
    assert_non_null(t->s);
  }
  va_start(ap, fmt);
  vsnprintf(t->s + t->n, (size_t)k + 1, fmt, ap);
  va_end(ap);
  t->n += (size_t)k;
}

/* Rank 0 writes t to the shared test file; every rank returns its path. */
static const char *publish(text *t) {
  if (g_world->rank == 0) {
    FILE *f = fopen(g_path, "wb");
    assert_non_null(f);
    fwrite(t->s ? t->s : "", 1, t->n, f);
    fclose(f);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  free(t->s);
  *t = (text){0};
  return g_path;
}

static uint32_t g_rng = 12345;
static uint32_t rnd(uint32_t n) {
  g_rng = g_rng * 1103515245u + 12345u;
  return (g_rng >> 8) % n;
}

static const char *g_sentences[] = {"The quick brown fox jumps over the lazy dog.",
                                    "meshlm trains and scores decoder language models.",
                                    "Question: what is two plus two?", " Answer: four.",
                                    "Name a colour of the sky.", " Blue, on a clear day."};

/* Load with one rank alone and with the group; equal results required.
 * Returns the single-rank load's status. */
static int compare_dataset(report *rep, const char *what, int64_t seq_len, int64_t vocab,
                            ml_data_opts o) {
  ml_dataset solo, all;
  char msg[ML_ERROR_MSG_CAP];
  ml_error_clear();
  o.group = NULL;
  int rc1 = ml_dataset_load(g_path, seq_len, vocab, &o, &solo);
  snprintf(msg, sizeof msg, "%s", ml_error_msg());
  ml_error_clear();
  o.group = &g_group;
  int rc2 = ml_dataset_load(g_path, seq_len, vocab, &o, &all);
  if (rc1 != rc2)
    note(rep, "%s: single-rank load %d (%s), group load %d (%s)", what, rc1, msg, rc2,
         ml_error_msg());
  else if (rc1 != 0 && strcmp(msg, ml_error_msg()) != 0)
    note(rep, "%s: single-rank message '%s', group message '%s'", what, msg, ml_error_msg());
  else if (rc1 == 0 &&
           (solo.nseq != all.nseq || solo.format != all.format || solo.records != all.records ||
            solo.tokens != all.tokens || solo.packed != all.packed ||
            memcmp(solo.ids, all.ids, sizeof *solo.ids * (size_t)(solo.nseq * seq_len)) ||
            memcmp(solo.mask, all.mask, (size_t)(solo.nseq * seq_len))))
    note(rep, "%s: the group's dataset differs from the single-rank one (%lld vs %lld rows)",
         what, (long long)all.nseq, (long long)solo.nseq);
  ml_error_clear();
  ml_dataset_free(&solo);
  ml_dataset_free(&all);
  return rc1;
}

static int compare_seqs(report *rep, const char *what, int64_t vocab, int64_t max_len,
                         ml_data_opts o) {
  ml_seqs solo, all;
  char msg[ML_ERROR_MSG_CAP];
  ml_error_clear();
  o.group = NULL;
  int rc1 = ml_seqs_load(g_path, vocab, max_len, &o, &solo);
  snprintf(msg, sizeof msg, "%s", ml_error_msg());
  ml_error_clear();
  o.group = &g_group;
  int rc2 = ml_seqs_load(g_path, vocab, max_len, &o, &all);
  bool same = rc1 == rc2 && (rc1 != 0 || (solo.n == all.n && solo.format == all.format));
  for (int64_t i = 0; same && rc1 == 0 && i < solo.n; i++)
    same = solo.len[i] == all.len[i] && solo.prompt_len[i] == all.prompt_len[i] &&
           memcmp(solo.ids[i], all.ids[i], sizeof(int32_t) * (size_t)solo.len[i]) == 0;
  if (!same || (rc1 != 0 && strcmp(msg, ml_error_msg()) != 0))
    note(rep, "%s: single-rank %d '%s', group %d '%s' (or the sequences differ)", what, rc1, msg,
         rc2, ml_error_msg());
  ml_error_clear();
  ml_seqs_free(&solo);
  ml_seqs_free(&all);
  return rc1;
}

/* A load that must succeed. */
static void good(report *rep, const char *what, int rc) {
  if (rc != 0) note(rep, "%s: the single-rank load failed", what);
}

static void ids_file(int lines, int bad_line, int bad_line2) {
  text t = {0};
  for (int i = 1; i <= lines; i++) {
    if (i == bad_line || i == bad_line2) {
      put(&t, i == bad_line ? "{\"input_ids\": [1, 2,]}\n" : "{\"input_ids\": [99999]}\n");
      continue;
    }
    if (rnd(7) == 0) {
      put(&t, rnd(2) ? "\n" : "   \t\n");
      continue;
    }
    int n = 1 + (int)rnd(12);
    put(&t, "{\"input_ids\": [");
    for (int k = 0; k < n; k++) put(&t, "%s%u", k ? ", " : "", rnd(50));
    put(&t, "]");
    if (rnd(3) == 0) {
      put(&t, ", \"loss_mask\": [");
      for (int k = 0; k < n; k++) put(&t, "%s%u", k ? ", " : "", rnd(2));
      put(&t, "]");
    }
    put(&t, "}\n");
  }
  publish(&t);
}

static void test_ids(void **state) {
  (void)state;
  report rep = {0};
  ml_data_opts o = ml_data_opts_default(g_dir);
  ids_file(300, 0, 0);
  good(&rep, "ids", compare_dataset(&rep, "ids", 8, 64, o));
  compare_seqs(&rep, "ids scoring", 64, 13, o); /* 1-token records: the first one's line */
  for (int bad = 1; bad <= 300; bad += 37) {
    ids_file(300, bad, 300 - bad / 2);
    compare_dataset(&rep, "ids, a bad line", 8, 64, o);
  }
  ids_file(300, 280, 0); /* the later error first in the file */
  compare_dataset(&rep, "ids, a bad line", 8, 64, o);
  agree(&rep, "failures");
}

/* Text or prompt/completion records; `other` (line) in the other format. */
static void text_file(int lines, bool prompt, int other) {
  text t = {0};
  for (int i = 1; i <= lines; i++) {
    const char *a = g_sentences[rnd(6)], *b = g_sentences[rnd(6)];
    if (i == other)
      put(&t, "{\"input_ids\": [3, 4]}\n");
    else if (prompt)
      put(&t, "{\"prompt\": \"%s\", \"completion\": \"%s\"}\n", a, b);
    else
      put(&t, "{\"text\": \"%s%s\"}\n%s", a, b, rnd(5) ? "" : "\n");
  }
  publish(&t);
}

static void test_text(void **state) {
  (void)state;
  report rep = {0};
  ml_data_opts o = ml_data_opts_default(g_tok);
  text_file(120, false, 0);
  good(&rep, "text", compare_dataset(&rep, "text, packed", 16, 256, o));
  o.packing = false;
  good(&rep, "text", compare_dataset(&rep, "text, one row each", 16, 256, o));
  good(&rep, "text", compare_seqs(&rep, "text scoring", 256, 512, o));
  text_file(120, true, 0);
  good(&rep, "pc", compare_dataset(&rep, "prompt/completion", 16, 256, o));
  good(&rep, "pc", compare_seqs(&rep, "prompt/completion scoring", 256, 512, o));
  compare_seqs(&rep, "prompt/completion scoring, too long", 256, 30, o);
  for (int other = 1; other <= 120; other += 29) {
    text_file(120, other % 2, other);
    compare_dataset(&rep, "a record of another format", 16, 256, o);
  }
  compare_dataset(&rep, "a tokenizer-less vocabulary", 16, 5, o); /* ids out of the vocabulary */
  agree(&rep, "failures");
}

/* Conversations (data/data_chat.h); line `bad` with a content that is not
 * text, line `other` a text record. */
static void chat_file(int lines, int bad, int other) {
  text t = {0};
  for (int i = 1; i <= lines; i++) {
    if (i == bad) {
      put(&t, "{\"messages\": [{\"role\": \"user\", \"content\": 7}]}\n");
      continue;
    }
    if (i == other) {
      put(&t, "{\"text\": \"%s\"}\n", g_sentences[0]);
      continue;
    }
    put(&t, "{\"messages\": [");
    if (rnd(2)) put(&t, "{\"role\": \"system\", \"content\": \"%s\"}, ", g_sentences[rnd(6)]);
    for (int k = 0, turns = 1 + (int)rnd(3); k < turns; k++)
      put(&t, "%s{\"role\": \"user\", \"content\": \"%s\"}, {\"role\": \"assistant\", "
              "\"content\": \"%s\"}",
          k ? ", " : "", g_sentences[rnd(6)], g_sentences[rnd(6)]);
    put(&t, "]}\n");
  }
  publish(&t);
}

static void test_chat(void **state) {
  (void)state;
  report rep = {0};
  ml_data_opts o = ml_data_opts_default(g_chat);
  chat_file(90, 0, 0);
  good(&rep, "messages", compare_dataset(&rep, "messages", 64, 256, o));
  o.assistant_only_loss = false;
  good(&rep, "messages", compare_dataset(&rep, "messages, every token a target", 64, 256, o));
  good(&rep, "messages", compare_seqs(&rep, "messages scoring", 256, 512, o));
  for (int bad = 7; bad <= 90; bad += 28) {
    chat_file(90, bad, 95 - bad);
    compare_dataset(&rep, "messages, a bad record", 64, 256, o);
  }
  ml_data_opts none = ml_data_opts_default(g_tok); /* no chat template */
  chat_file(90, 0, 0);
  compare_dataset(&rep, "messages without a chat template", 64, 256, none);
  agree(&rep, "failures");
}

/* The gathers in rounds of a few bytes (ml_data_group.call_bytes), as
 * beyond MPI's int counts: the same dataset. */
static void test_rounds(void **state) {
  (void)state;
  report rep = {0};
  ml_data_opts o = ml_data_opts_default(g_tok);
  text_file(50, true, 0);
  g_group.call_bytes = 7 * (size_t)g_world->size;
  good(&rep, "rounds", compare_dataset(&rep, "prompt/completion in rounds", 16, 256, o));
  g_group.call_bytes = 0;
  agree(&rep, "failures");
}

static void test_shapes(void **state) {
  (void)state;
  report rep = {0};
  ml_data_opts o = ml_data_opts_default(g_tok);
  text t = {0};
  put(&t, "\n\n{\"input_ids\": [");
  for (int k = 0; k < 5000; k++) put(&t, "%s%d", k ? "," : "", k % 40);
  put(&t, "]}\n{\"input_ids\": [1, 2, 3]}");
  publish(&t);
  good(&rep, "long", compare_dataset(&rep, "a line longer than a part", 64, 64, o));
  put(&t, "\n \n\n");
  publish(&t);
  compare_dataset(&rep, "blank lines only", 8, 64, o);
  put(&t, "The quick brown fox jumps over the lazy dog.\nmeshlm trains.\n");
  publish(&t);
  good(&rep, "raw", compare_dataset(&rep, "raw text", 8, 256, o));
  ml_data_opts bytes = ml_data_opts_default(g_dir);
  good(&rep, "raw", compare_dataset(&rep, "raw text bytes", 8, 256, bytes));
  compare_seqs(&rep, "raw text, scored", 256, 64, o);
  agree(&rep, "failures");
}

/* g_chat: the data_formats tokenizer and SmolLM2's chat template, linked. */
static const char *const g_chat_files[][2] = {
    {"tokenizer.json", ML_SOURCE_DIR "/tests/fixtures/data_formats/tokenizer.json"},
    {"tokenizer_config.json", ML_SOURCE_DIR "/tests/fixtures/data_formats/tokenizer_config.json"},
    {"chat_template.jinja", ML_SOURCE_DIR "/tests/fixtures/jinja/templates/smollm2.jinja"}};

static int make_chat_dir(void) {
  char dst[256];
  if (mkdir(g_chat, 0755)) return -1;
  for (int k = 0; k < 3; k++) {
    snprintf(dst, sizeof dst, "%s/%s", g_chat, g_chat_files[k][0]);
    if (symlink(g_chat_files[k][1], dst)) return -1;
  }
  return 0;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  ml_error_set_rank(rank);
  if (ml_host_create(MPI_COMM_WORLD, "world", &g_world)) {
    fprintf(stderr, "%s\n", ml_error_msg());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  g_group = ml_cli_data_group(g_world);
  strcpy(g_dir, "/tmp/ml_test_split_XXXXXX");
  if (rank == 0 && !mkdtemp(g_dir)) MPI_Abort(MPI_COMM_WORLD, 1);
  MPI_Bcast(g_dir, sizeof g_dir, MPI_CHAR, 0, MPI_COMM_WORLD);
  snprintf(g_path, sizeof g_path, "%s/data.jsonl", g_dir);
  snprintf(g_chat, sizeof g_chat, "%s/chat", g_dir);
  if (rank == 0 && make_chat_dir()) MPI_Abort(MPI_COMM_WORLD, 1);
  const struct CMUnitTest tests[] = {
      held_test(test_ids),
      held_test(test_text),
      held_test(test_chat),
      held_test(test_rounds),
      held_test(test_shapes),
  };
  int failed = cmocka_run_group_tests(tests, NULL, NULL);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) {
    for (int k = 0; k < 3; k++) {
      char p[256];
      snprintf(p, sizeof p, "%s/%s", g_chat, g_chat_files[k][0]);
      unlink(p);
    }
    rmdir(g_chat);
    unlink(g_path);
    rmdir(g_dir);
  }
  ml_host_destroy(g_world);
  return held_finish(failed);
}
