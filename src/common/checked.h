/* Sizes without overflow (ARCHITECTURE.md §11): checked and saturating int64
 * arithmetic, and array allocation whose out-of-memory message names what
 * was being allocated in the user's terms, never a wrapped count.
 *
 * Where sizes come from:
 *  - config.json: ml_model_config_load bounds every field (model/config.h,
 *    ML_MAX_*) before any product of them is formed; every product of
 *    config sizes alone (a parameter, a layer, the model) then provably
 *    fits int64, and its fp32 bytes (times 4 for params, grads and AdamW)
 *    fit size_t. Such products are written plainly, with a comment citing
 *    the bound.
 *  - flags and data (--batch-size, --seq-len, sequence lengths) times
 *    config sizes: activations, logits, batches. These are accounted with
 *    the saturating helpers below (ML_SAT stands for "more than int64
 *    holds", and stays so through further sums and products) and allocated
 *    with ml_malloc_array / ml_calloc_array, which refuse a saturated
 *    count with a message instead of allocating a wrapped one.
 *  - files (safetensors shapes, metadata.json offsets): checked with
 *    ml_mul_i64 / ml_add_i64 at the reader, the field named. */
#ifndef ML_CHECKED_H
#define ML_CHECKED_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

/* *out = a · b; returns 0, or nonzero when the exact product does not fit
 * int64 (then *out holds the wrapped value: do not use it). Any signs. */
static inline int ml_mul_i64(int64_t a, int64_t b, int64_t *out) {
  return __builtin_mul_overflow(a, b, out);
}

/* *out = a + b; returns 0, or nonzero on int64 overflow (as ml_mul_i64). */
static inline int ml_add_i64(int64_t a, int64_t b, int64_t *out) {
  return __builtin_add_overflow(a, b, out);
}

/* The saturated size: "at least INT64_MAX", i.e. more than any buffer. */
#define ML_SAT INT64_MAX

/* a · b for sizes a, b >= 0, or ML_SAT when the product does not fit (or
 * either operand is ML_SAT and the other non-zero). */
static inline int64_t ml_mul_sat(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_mul_overflow(a, b, &r) ? ML_SAT : r;
}

/* a + b for sizes a, b >= 0, or ML_SAT when the sum does not fit. */
static inline int64_t ml_add_sat(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_add_overflow(a, b, &r) ? ML_SAT : r;
}

/* malloc / calloc of `count` elements of `elem` bytes (count 0 gives a
 * valid 1-byte block). On failure returns NULL with the message (what_fmt
 * printf-formatted, e.g. "layer activations (4 sequences x --seq-len 4096
 * x hidden_size 2048)"), located at the caller's file:line as ml_err's:
 *   "out of memory allocating N bytes (X GiB) for WHAT"        malloc failed
 *   "out of memory: WHAT needs more than 2^63 bytes"          count < 0,
 *                  ML_SAT, or count · elem beyond int64 / size_t.
 * The message is formatted only on failure. */
#define ml_malloc_array(count, elem, ...) \
  ml_alloc_array_at(__FILE__, __LINE__, (count), (elem), 0, __VA_ARGS__)
#define ml_calloc_array(count, elem, ...) \
  ml_alloc_array_at(__FILE__, __LINE__, (count), (elem), 1, __VA_ARGS__)
/* The function behind both (zero: calloc). */
void *ml_alloc_array_at(const char *file, int line, int64_t count, size_t elem, int zero,
                        const char *what_fmt, ...) __attribute__((format(printf, 6, 7)));

/* The same size check and messages around any allocator (a backend's
 * pool): raw(ctx, bytes) returns NULL when it cannot; count · elem is
 * checked before it is called. */
typedef void *(*ml_raw_alloc)(void *ctx, size_t bytes);
void *ml_alloc_checked_v(const char *file, int line, int64_t count, size_t elem,
                         ml_raw_alloc raw, void *ctx, const char *what_fmt, va_list ap);

#endif
