/* `meshlm plan`'s per-module and per-edge listings with identical decoder
 * layers collapsed: a layer whose lines, read with its own layer's name
 * taken out, are an earlier listed layer's is not repeated, and a run of
 * such layers is one line, "model.layers.1-29: same as model.layers.0". */
#ifndef ML_PLAN_LAYERS_H
#define ML_PLAN_LAYERS_H

#include <stdbool.h>
#include <stddef.h>

/* A growing string; `failed` once an append ran out of memory (s then
 * holds what fitted). */
typedef struct ml_text {
  char *s;
  size_t n, cap;
  bool failed;
} ml_text;

/* Append printf-style to t. */
void ml_text_printf(ml_text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void ml_text_free(ml_text *t);

/* A listing of n items (modules or edges) in model order, each decoder
 * layer's items consecutive. */
typedef struct ml_listing {
  int n;
  const char *(*name)(const void *ctx, int i); /* item i's name: "model.layers.3.mlp input" */
  /* Append item i's lines to out, with `name` in place of the item's name:
   * its own, or (to compare layers) the part after its layer's number,
   * ".mlp input". Returns 0, or −1 with the error recorded. */
  int (*render)(const void *ctx, int i, const char *name, ml_text *out);
  const void *ctx;
  const char *layer_prefix; /* the decoder layers' name prefix: "model.layers." */
  int n_layers;
  bool verbose; /* every layer in full */
} ml_listing;

/* The listing into out: the items outside the decoder layers and each
 * layer not identical to an earlier one in full; unless l->verbose, a run of
 * consecutive layers identical to the same earlier layer as one line
 * "  <prefix>A-B: same as <prefix>R" ("<prefix>A: ..." for one layer).
 * Errors: the render's; out of memory. */
int ml_listing_text(const ml_listing *l, ml_text *out);

#endif
