/* Drawing the next token of each row from its logits, the sampling of
 * engine/generate.h: transformers' logits processors in the order
 * GenerationMixin applies them for do_sample — TemperatureLogitsWarper,
 * TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper — then one draw from
 * the renormalised distribution (greedy: the argmax).
 *
 * No row sorts its vocabulary: every warper keeps the tokens whose weight
 * w_i = exp((l_i − max l) / T) reaches a threshold, and the thresholds are
 * found by selection in O(V) expected time (quickselect over weights, and
 * over probability mass for top-p), then one pass in id order draws. Rows
 * are independent and run in parallel (OpenMP), each from its own stream:
 * a row's token is a function of its logits and its stream only. */
#ifndef ML_SAMPLE_H
#define ML_SAMPLE_H

#include <stdbool.h>
#include <stdint.h>

#include "common/rng.h"

typedef struct ml_sampler {
  bool greedy;       /* argmax of the logits, the lowest id on ties; the rest ignored */
  float temperature; /* > 0, finite: logits / temperature (TemperatureLogitsWarper) */
  int64_t top_k;     /* >= 0: keep the tokens whose weight is >= the top_k-th largest
                        (TopKLogitsWarper: ties at the k-th kept); 0 or >= V: every token */
  float top_p;       /* (0, 1]: of the tokens top_k kept, keep those whose strictly heavier
                        tokens hold < top_p of their mass (TopPLogitsWarper: the smallest
                        set of heaviest tokens reaching top_p, ties at its edge kept); 1: all */
  float min_p;       /* [0, 1]: keep the tokens whose probability is >= min_p times the most
                        probable's (MinPLogitsWarper; the most probable always kept); 0: all */
} ml_sampler;

/* Checks s (greedy: nothing). Errors (-1, naming the field, the value and
 * the range): temperature <= 0 or not finite, top_k < 0, top_p outside
 * (0, 1], min_p outside [0, 1]. `who` prefixes the message. */
int ml_sampler_check(const ml_sampler *s, const char *who);

/* Draws one token for each of `draws` draws: draw d reads logits row
 * row_of[d] (NULL: row d) of logits [rows, V] (host, fp32; several draws
 * may read one row: a prompt's samples), with stream rng[d] (advanced by
 * one uniform draw when not greedy) and scratch work + d · 2V (host, [draws,
 * 2·V] floats; NULL when greedy). Out: tok[d], and lp[d] =
 * log_softmax(logits row)[tok] at temperature 1, in double then rounded
 * (the distribution the loss scores, whatever the warpers). Bitwise
 * reproducible: a draw depends on its logits row and its stream only (not
 * on draws, threads or the other draws). */
void ml_sample_rows(const float *logits, const int64_t *row_of, int64_t draws, int64_t V,
                    const ml_sampler *s, ml_rng *rng, float *work, int32_t *tok, float *lp);

#endif
