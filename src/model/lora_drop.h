/* LoRA dropout: PEFT's lora_dropout, an nn.Dropout(p) on the input of
 * lora_A only (tuners/lora/layer.py Linear.forward:
 *   result + lora_B(lora_A(dropout(x))) * scaling),
 * the base path x·W^T untouched; inverted scaling: kept elements are
 * multiplied by 1/(1 − p) so the expectation is x; applied only while the
 * engine runs a training micro-batch (ml_model.lora_drop.active: off in
 * scoring, evaluation and generation, as module.eval() turns it off).
 *
 * The mask is a function of (run seed, optimizer step, micro-batch,
 * linear, global token, global feature) alone — a counter-based draw
 * (common/rng.h ml_rng_hash) — so every mesh draws the same mask for the
 * same element: a tensor-parallel rank whose input holds features
 * [offset, offset + c) of a row-parallel linear (lora_A Shard(1)) uses
 * their global indices, a data-parallel rank's rows are numbered from its
 * row offset in the global micro-batch, a context-parallel rank's positions
 * by their index in the whole sequence. torch draws its masks from the
 * device generator's offset instead, which depends on the launch order, so
 * PEFT's masks are not reproduced: the distribution is. */
#ifndef ML_LORA_DROP_H
#define ML_LORA_DROP_H

#include <stdbool.h>
#include <stdint.h>

#include "model/model.h"

/* Whether element (global token g, global feature f) of an input with
 * `in` global features is kept under `key` (a linear's key:
 * ml_rng_hash(ml_lora_dropout.key, ml_linear.lora_id)): the draw's top 53
 * bits as a uniform u in [0, 1), kept when u >= p, so P(kept) = 1 − p to
 * within 2^-53. */
bool ml_lora_drop_keep(uint64_t key, int64_t g, int64_t f, int64_t in, double p);

/* Whether lin's adapter input is dropped now: it has a dropout context, the
 * context is active and p > 0. */
bool ml_lora_drop_active(const ml_linear *lin);

/* out [T, c] = src [T, c] ⊙ keep · (1/(1 − p)), the dropped elements 0,
 * for the tokens and features of lin's input view x (B rows of s
 * positions, T = B·s, c local features starting at lin->lora_a->offset[1]
 * of lora_a->shape[1]); src and out device memory of be, out may be src.
 * The same mask serves the forward (src: the input x) and the backward
 * (src: the gradient of the dropped input). Staged through host memory
 * (the mask is drawn on the host). Errors: x sequence-sharded (s < S: the
 * adapters run on whole sequences), allocation, copies. */
int ml_lora_drop_apply(ml_backend *be, const ml_linear *lin, const ml_act *x, const float *src,
                       float *out);

#endif
