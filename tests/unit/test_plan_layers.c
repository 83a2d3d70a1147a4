/* meshlm plan's listings with identical decoder layers collapsed
 * (src/cli/plan_layers.h): runs of layers identical to the same earlier
 * layer as one "same as" line, a layer that differs in full (and later
 * layers compared with it too), root items in place, --verbose in full, a
 * render's error passed on; the growing text. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cli/plan_layers.h"
#include "common/status.h"

typedef struct item {
  const char *name, *value;
} item;

typedef struct fake {
  const item *items;
  int fail_at; /* render fails on this item (−1: never) */
} fake;

static const char *fake_name(const void *ctx, int i) { return ((const fake *)ctx)->items[i].name; }

static int fake_render(const void *ctx, int i, const char *name, ml_text *out) {
  const fake *f = ctx;
  if (i == f->fail_at) return ml_err("render %d failed", i);
  ml_text_printf(out, "  %s: %s\n", name, f->items[i].value);
  return 0;
}

/* Layers 1-2 as 0, 3 differs, 4 as 0, 5-6 as 3 (two items a layer); the root around them. */
static const item k_items[] = {
    {"model.embed_tokens", "E"},   {"model.layers.0.a", "x"}, {"model.layers.0 b", "y"},
    {"model.layers.1.a", "x"},     {"model.layers.1 b", "y"}, {"model.layers.2.a", "x"},
    {"model.layers.2 b", "y"},     {"model.layers.3.a", "x"}, {"model.layers.3 b", "z"},
    {"model.layers.4.a", "x"},     {"model.layers.4 b", "y"}, {"model.layers.5.a", "x"},
    {"model.layers.5 b", "z"},     {"model.layers.6.a", "x"}, {"model.layers.6 b", "z"},
    {"model.layers.60.a", "x"},    {"model.norm", "N"},       {"lm_head", "H"}};
enum { N_ITEMS = sizeof k_items / sizeof k_items[0] };

static char *listing(bool verbose, int fail_at, int *rc) {
  fake f = {k_items, fail_at};
  /* 7 layers: "model.layers.60.a" is no layer's (60 >= 7) and listed as a root item */
  ml_listing l = {N_ITEMS, fake_name, fake_render, &f, "model.layers.", 7, verbose};
  ml_text out = {0};
  *rc = ml_listing_text(&l, &out);
  assert_false(out.failed);
  return out.s;
}

static void test_collapsed(void **state) {
  int rc;
  char *s = listing(false, -1, &rc);
  assert_int_equal(rc, 0);
  assert_string_equal(s, "  model.embed_tokens: E\n"
                         "  model.layers.0.a: x\n"
                         "  model.layers.0 b: y\n"
                         "  model.layers.1-2: same as model.layers.0\n"
                         "  model.layers.3.a: x\n"
                         "  model.layers.3 b: z\n"
                         "  model.layers.4: same as model.layers.0\n"
                         "  model.layers.5-6: same as model.layers.3\n"
                         "  model.layers.60.a: x\n"
                         "  model.norm: N\n"
                         "  lm_head: H\n");
  free(s);
}

static void test_verbose(void **state) {
  int rc;
  char *s = listing(true, -1, &rc);
  assert_int_equal(rc, 0);
  ml_text want = {0};
  for (int i = 0; i < N_ITEMS; i++)
    ml_text_printf(&want, "  %s: %s\n", k_items[i].name, k_items[i].value);
  assert_string_equal(s, want.s);
  assert_null(strstr(s, "same as"));
  ml_text_free(&want);
  free(s);
}

static void test_render_error(void **state) {
  int rc;
  ml_error_clear();
  free(listing(false, 5, &rc)); /* layer 2's first item, rendered only to compare */
  assert_int_equal(rc, -1);
  assert_non_null(strstr(ml_error_msg(), "render 5 failed"));
  ml_error_clear();
}

/* The text grows past its first allocation, and a long line in one append. */
static void test_text(void **state) {
  ml_text t = {0};
  char big[1000];
  memset(big, 'b', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  for (int i = 0; i < 100; i++) ml_text_printf(&t, "%d,", i % 10);
  ml_text_printf(&t, "%s", big);
  assert_false(t.failed);
  assert_int_equal(t.n, 200 + sizeof big - 1);
  assert_int_equal(strlen(t.s), t.n);
  assert_memory_equal(t.s, "0,1,2,", 6);
  ml_text_free(&t);
  assert_null(t.s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_collapsed),
      cmocka_unit_test(test_verbose),
      cmocka_unit_test(test_render_error),
      cmocka_unit_test(test_text),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
