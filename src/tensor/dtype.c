#include "tensor/dtype.h"

#include <string.h>

#include "common/status.h"

static const struct {
  const char *name;
  size_t size;
} k_dtypes[ML_DTYPE_COUNT] = {
    [ML_BOOL] = {"BOOL", 1},       [ML_U8] = {"U8", 1},   [ML_I8] = {"I8", 1},
    [ML_F8_E5M2] = {"F8_E5M2", 1}, [ML_F8_E4M3] = {"F8_E4M3", 1},
    [ML_I16] = {"I16", 2},         [ML_U16] = {"U16", 2}, [ML_F16] = {"F16", 2},
    [ML_BF16] = {"BF16", 2},       [ML_I32] = {"I32", 4}, [ML_U32] = {"U32", 4},
    [ML_F32] = {"F32", 4},         [ML_F64] = {"F64", 8}, [ML_I64] = {"I64", 8},
    [ML_U64] = {"U64", 8},
};

size_t ml_dtype_size(ml_dtype t) { return (unsigned)t < ML_DTYPE_COUNT ? k_dtypes[t].size : 0; }

const char *ml_dtype_name(ml_dtype t) {
  return (unsigned)t < ML_DTYPE_COUNT ? k_dtypes[t].name : "?";
}

int ml_dtype_parse(const char *name, ml_dtype *out) {
  for (int t = 0; t < ML_DTYPE_COUNT; t++) {
    if (strcmp(name, k_dtypes[t].name) == 0) {
      *out = (ml_dtype)t;
      return 0;
    }
  }
  return -1;
}

int ml_dtype_parse_torch(const char *name, ml_dtype *out) {
  static const ml_dtype floats[] = {ML_F32, ML_BF16, ML_F16};
  for (size_t i = 0; i < sizeof floats / sizeof floats[0]; i++) {
    if (strcmp(name, ml_dtype_torch_name(floats[i])) == 0) {
      *out = floats[i];
      return 0;
    }
  }
  return -1;
}

const char *ml_dtype_torch_name(ml_dtype t) {
  switch (t) {
  case ML_F32: return "float32";
  case ML_BF16: return "bfloat16";
  case ML_F16: return "float16";
  default: return "?";
  }
}

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

float ml_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (mant << 13)); /* inf, NaN */
  if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
  /* zero or subnormal: mant * 2^-24, exact in fp32 */
  float v = (float)mant * 5.9604644775390625e-8f;
  return sign ? -v : v;
}

/* |f| < 2^-14: the result is a half subnormal q * 2^-24 (or zero), with q the
 * 24-bit significand shifted right and rounded to nearest-even. */
static uint16_t f16_subnormal(uint32_t ax) {
  uint32_t e = ax >> 23;
  if (e < 102) return 0; /* below 2^-25: rounds to zero (2^-25 itself ties to 0) */
  uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126 - e; /* 14..24 */
  uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) q++;
  return (uint16_t)q; /* q == 0x400 is the smallest normal, correctly encoded */
}

uint16_t ml_f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t ax = u & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu)); /* quiet NaN */
  if (ax < 0x38800000u) return (uint16_t)(sign | f16_subnormal(ax));
  /* normal: round at bit 13 to nearest-even, rebias the exponent 127 -> 15;
   * anything that reaches exponent 31 (incl. inf) is inf */
  uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u) - (112u << 23);
  if (r >= (31u << 23)) return (uint16_t)(sign | 0x7c00u);
  return (uint16_t)(sign | (r >> 13));
}

static int unsupported(ml_dtype t) {
  return ml_err("cannot convert between dtype %s and fp32: expected F32, BF16 or F16",
                ml_dtype_name(t));
}

/* The 16-bit loops use memcpy per element: src/dst may be unaligned (old
 * safetensors files); compilers turn these into plain loads/stores. */
int ml_convert_to_f32(ml_dtype t, const void *src, float *dst, size_t n) {
  const uint8_t *s = src;
  uint16_t h;
  switch (t) {
  case ML_F32: memcpy(dst, src, n * sizeof(float)); return 0;
  case ML_BF16:
    for (size_t i = 0; i < n; i++) {
      memcpy(&h, s + 2 * i, 2);
      dst[i] = ml_bf16_to_f32(h);
    }
    return 0;
  case ML_F16:
    for (size_t i = 0; i < n; i++) {
      memcpy(&h, s + 2 * i, 2);
      dst[i] = ml_f16_to_f32(h);
    }
    return 0;
  default: return unsupported(t);
  }
}

int ml_convert_from_f32(ml_dtype t, const float *src, void *dst, size_t n) {
  uint8_t *d = dst;
  uint16_t h;
  switch (t) {
  case ML_F32: memcpy(dst, src, n * sizeof(float)); return 0;
  case ML_BF16:
    for (size_t i = 0; i < n; i++) {
      h = ml_f32_to_bf16(src[i]);
      memcpy(d + 2 * i, &h, 2);
    }
    return 0;
  case ML_F16:
    for (size_t i = 0; i < n; i++) {
      h = ml_f32_to_f16(src[i]);
      memcpy(d + 2 * i, &h, 2);
    }
    return 0;
  default: return unsupported(t);
  }
}

void ml_round_bf16(float *x, size_t n) {
#pragma omp parallel for
  for (size_t i = 0; i < n; i++) x[i] = ml_bf16_to_f32(ml_f32_to_bf16(x[i]));
}
