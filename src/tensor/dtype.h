/* Element types of checkpoint tensors and conversion to/from fp32.
 * Semantics follow torch: bf16 = upper 16 bits of an IEEE fp32, rounded to
 * nearest-even on conversion (torch's `tensor.to(torch.bfloat16)`), NaN kept
 * NaN; f16 = IEEE binary16 with round-to-nearest-even, overflow to ±inf. */
#ifndef ML_DTYPE_H
#define ML_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Every dtype string the safetensors format defines (the reader validates
 * sizes for all of them; only F32/BF16/F16 convert to fp32). */
typedef enum {
  ML_BOOL, ML_U8, ML_I8, ML_F8_E5M2, ML_F8_E4M3, ML_I16, ML_U16, ML_F16, ML_BF16,
  ML_I32, ML_U32, ML_F32, ML_F64, ML_I64, ML_U64, ML_DTYPE_COUNT
} ml_dtype;

/* Bytes per element (1..8). */
size_t ml_dtype_size(ml_dtype t);
/* The safetensors name ("F32", "BF16", ...). */
const char *ml_dtype_name(ml_dtype t);
/* Parse a safetensors dtype name; returns 0, or -1 (no message) if unknown. */
int ml_dtype_parse(const char *name, ml_dtype *out);
/* Parse a torch_dtype string from config.json ("float32", "bfloat16",
 * "float16"); returns 0, or -1 (no message) if it is none of these. */
int ml_dtype_parse_torch(const char *name, ml_dtype *out);
/* The torch_dtype name for F32/BF16/F16 ("float32", ...). */
const char *ml_dtype_torch_name(ml_dtype t);

/* bf16 ↔ fp32, inline so that loops over them vectorize. Widening is
 * exact. Narrowing is torch's c10::BFloat16 round_to_nearest_even: NaN
 * becomes the canonical quiet NaN 0x7FC0; otherwise add 0x7FFF plus the
 * lowest kept bit, so ties go to the even neighbour (the carry may roll
 * into the exponent, up to inf). */
static inline float ml_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static inline uint16_t ml_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
float ml_f16_to_f32(uint16_t h);
uint16_t ml_f32_to_f16(float f);

/* x[i] = fp32(bf16(x[i])) in place: the value a bf16 tensor would hold
 * (mixed precision on CPU: bf16 storage, fp32 arithmetic). */
void ml_round_bf16(float *x, size_t n);

/* dst[i] = (float)src[i] for n elements of type t (F32, BF16 or F16; src
 * may be unaligned). Returns 0, or -1 with a message for other dtypes. */
int ml_convert_to_f32(ml_dtype t, const void *src, float *dst, size_t n);
/* dst[i] = (t)src[i] for F32, BF16 or F16; -1 with a message otherwise. */
int ml_convert_from_f32(ml_dtype t, const float *src, void *dst, size_t n);

#endif
