#include "parity_util.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "held.h"

static void die(const char *what, const char *path) {
  fprintf(stderr, "fixture %s: %s\n", path, what);
  exit(2);
}

static void fixture_release(void *p) {
  fixture *fx = p;
  free(fx->ids);
  free(fx->mask);
  free(fx->logprobs);
  fx->ids = NULL, fx->mask = NULL, fx->logprobs = NULL;
}

void fixture_load(const char *name, fixture *fx) {
  memset(fx, 0, sizeof *fx);
  snprintf(fx->dir, sizeof fx->dir, "%s/tests/fixtures/%s", ML_SOURCE_DIR, name);
  char path[600];
  snprintf(path, sizeof path, "%s/expected.json", fx->dir);
  json_error_t err;
  json_t *root = json_load_file(path, 0, &err);
  if (!root) die(err.text, path);
  json_t *ids = json_object_get(root, "input_ids"), *mask = json_object_get(root, "loss_mask");
  json_t *lps = json_object_get(root, "logprobs");
  fx->B = (int64_t)json_array_size(ids);
  fx->S = (int64_t)json_array_size(json_array_get(ids, 0));
  if (!fx->B || fx->S < 2) die("bad input_ids", path);
  fx->ids = calloc((size_t)(fx->B * fx->S), sizeof *fx->ids);
  fx->mask = calloc((size_t)(fx->B * fx->S), 1);
  fx->logprobs = calloc((size_t)(fx->B * (fx->S - 1)), sizeof *fx->logprobs);
  hold(fx, fixture_release);
  for (int64_t b = 0; b < fx->B; b++)
    for (int64_t t = 0; t < fx->S; t++) {
      int64_t i = b * fx->S + t;
      fx->ids[i] = (int32_t)json_integer_value(json_array_get(json_array_get(ids, b), t));
      fx->mask[i] =
          t > 0 && (!mask || json_integer_value(json_array_get(json_array_get(mask, b), t)));
      fx->targets += fx->mask[i];
      if (t + 1 < fx->S)
        fx->logprobs[b * (fx->S - 1) + t] =
            json_real_value(json_array_get(json_array_get(lps, b), t));
    }
  fx->loss = json_real_value(json_object_get(root, "loss"));
  json_t *prefix = json_object_get(root, "text_prefix");
  if (prefix && !json_is_string(prefix)) die("text_prefix is not a string", path);
  const char *text_prefix = prefix ? json_string_value(prefix) : "";
  snprintf(fx->text_prefix, sizeof fx->text_prefix, "%s", text_prefix);
  json_decref(root);
}

void fixture_free(fixture *fx) {
  unhold(fx);
  fixture_release(fx);
}

static void batch_release(void *p) {
  batch *b = p;
  free(b->ids);
  free(b->mask);
  b->ids = NULL, b->mask = NULL;
}

void batch_make(const fixture *fx, int64_t rows, batch *b) {
  b->B = rows;
  b->S = fx->S;
  b->ids = malloc(sizeof(int32_t) * (size_t)(b->B * b->S));
  b->mask = malloc((size_t)(b->B * b->S));
  hold(b, batch_release);
  for (int64_t i = 0; i < b->B; i++) {
    memcpy(b->ids + i * b->S, fx->ids + (i % fx->B) * fx->S, sizeof(int32_t) * (size_t)fx->S);
    memcpy(b->mask + i * b->S, fx->mask + (i % fx->B) * fx->S, (size_t)fx->S);
  }
  b->targets = 0; /* as fixture_load counts a fixture's targets */
  for (int64_t i = 0; i < b->B * b->S; i++) b->targets += b->mask[i];
}

void batch_free(batch *b) {
  unhold(b);
  batch_release(b);
}

double rel_l2(const float *a, const float *b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) {
    double d = (double)a[i] - b[i];
    num += d * d;
    den += (double)b[i] * b[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}
