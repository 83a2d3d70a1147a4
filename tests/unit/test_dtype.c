/* dtype table and fp32 <-> bf16/f16 conversions against known bit patterns. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "common/status.h"
#include "tensor/dtype.h"

static float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static void test_table(void **state) {
  (void)state;
  static const char *names[] = {"BOOL", "U8",  "I8",  "F8_E5M2", "F8_E4M3", "I16", "U16", "F16",
                                "BF16", "I32", "U32", "F32",     "F64",     "I64", "U64"};
  static const size_t sizes[] = {1, 1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 8, 8, 8};
  for (int t = 0; t < ML_DTYPE_COUNT; t++) {
    ml_dtype back;
    assert_string_equal(ml_dtype_name((ml_dtype)t), names[t]);
    assert_int_equal(ml_dtype_size((ml_dtype)t), sizes[t]);
    assert_int_equal(ml_dtype_parse(names[t], &back), 0);
    assert_int_equal(back, t);
  }
  ml_dtype t;
  assert_int_equal(ml_dtype_parse("F33", &t), -1);
  assert_int_equal(ml_dtype_parse("f32", &t), -1);
  assert_int_equal(ml_dtype_parse("", &t), -1);
}

static void test_torch_names(void **state) {
  (void)state;
  ml_dtype t;
  assert_int_equal(ml_dtype_parse_torch("float32", &t), 0);
  assert_int_equal(t, ML_F32);
  assert_int_equal(ml_dtype_parse_torch("bfloat16", &t), 0);
  assert_int_equal(t, ML_BF16);
  assert_int_equal(ml_dtype_parse_torch("float16", &t), 0);
  assert_int_equal(t, ML_F16);
  assert_int_equal(ml_dtype_parse_torch("float64", &t), -1);
  assert_int_equal(ml_dtype_parse_torch("F32", &t), -1);
  assert_string_equal(ml_dtype_torch_name(ML_BF16), "bfloat16");
  assert_string_equal(ml_dtype_torch_name(ML_F16), "float16");
  assert_string_equal(ml_dtype_torch_name(ML_F32), "float32");
}

static void test_bf16_known(void **state) {
  (void)state;
  static const struct {
    uint32_t f32;
    uint16_t bf16;
  } cases[] = {
      {0x3f800000u, 0x3f80}, /* 1.0 */
      {0x3f808000u, 0x3f80}, /* tie, kept bit even: down */
      {0x3f818000u, 0x3f82}, /* tie, kept bit odd: up */
      {0x3f808001u, 0x3f81}, /* above the tie: up */
      {0x3f807fffu, 0x3f80}, /* below the tie: down */
      {0x80000000u, 0x8000}, /* -0 */
      {0x7f800000u, 0x7f80}, /* inf */
      {0xff800000u, 0xff80}, /* -inf */
      {0x7f7fffffu, 0x7f80}, /* FLT_MAX rounds to inf, as torch */
      {0x7fc00001u, 0x7fc0}, /* NaN */
      {0x7f800001u, 0x7fc0}, /* signalling NaN: stays NaN (quiet), not inf */
      {0xffffffffu, 0x7fc0}, /* negative NaN */
      {0x00000001u, 0x0000}, /* smallest fp32 subnormal */
      {0x00008000u, 0x0000}, /* tie at the bottom: even */
      {0x00018000u, 0x0002},
      {0xc0490fdbu, 0xc049}, /* -pi */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    uint16_t got = ml_f32_to_bf16(from_bits(cases[i].f32));
    if (got != cases[i].bf16)
      fail_msg("bf16(0x%08x) = 0x%04x, expected 0x%04x", cases[i].f32, got, cases[i].bf16);
  }
  assert_true(ml_bf16_to_f32(0x3f80) == 1.0f);
  assert_true(ml_bf16_to_f32(0xc049) == from_bits(0xc0490000u));
  assert_true(isnan(ml_bf16_to_f32(0x7fc0)));
  assert_true(isinf(ml_bf16_to_f32(0xff80)) && ml_bf16_to_f32(0xff80) < 0);
}

/* Every bf16 value survives bf16 -> fp32 -> bf16; NaNs stay NaN. */
static void test_bf16_roundtrip_all(void **state) {
  (void)state;
  for (uint32_t h = 0; h < 0x10000u; h++) {
    float f = ml_bf16_to_f32((uint16_t)h);
    uint16_t back = ml_f32_to_bf16(f);
    if (isnan(f)) {
      if ((back & 0x7f80) != 0x7f80 || (back & 0x7f) == 0) fail_msg("NaN 0x%04x -> 0x%04x", h, back);
    } else if (back != h) {
      fail_msg("bf16 0x%04x -> %g -> 0x%04x", h, (double)f, back);
    }
  }
}

static void test_f16_known(void **state) {
  (void)state;
  static const struct {
    float f;
    uint16_t h;
  } cases[] = {
      {1.0f, 0x3c00},
      {-2.0f, 0xc000},
      {0.1f, 0x2e66},
      {65504.0f, 0x7bff},             /* largest finite */
      {65519.0f, 0x7bff},             /* below the overflow tie */
      {65520.0f, 0x7c00},             /* tie to even = overflow to inf */
      {1e6f, 0x7c00},                 /* overflow */
      {-1e6f, 0xfc00},
      {0x1p-14f, 0x0400},             /* smallest normal */
      {0x1p-24f, 0x0001},             /* smallest subnormal */
      {0x1p-25f, 0x0000},             /* tie between 0 and 2^-24: even (0) */
      {0x1.8p-25f, 0x0001},           /* above the tie */
      {0x1.8p-24f, 0x0002},           /* 1.5 * 2^-24: tie to even (2) */
      {1023.0f * 0x1p-24f, 0x03ff},   /* largest subnormal */
      {1023.5f * 0x1p-24f, 0x0400},   /* tie up into the normals */
      {0x1p-30f, 0x0000},             /* underflow */
      {-0x1p-30f, 0x8000},            /* underflow keeps the sign */
      {1.0f + 0x1p-11f, 0x3c00},      /* tie, even below */
      {1.0f + 0x3p-11f, 0x3c02},      /* tie, odd below: up */
      {0x1.002002p+0f, 0x3c01},    /* 1 + 2^-11 + 2^-23: just above the tie */
      {-0.0f, 0x8000},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    uint16_t got = ml_f32_to_f16(cases[i].f);
    if (got != cases[i].h)
      fail_msg("f16(%a) = 0x%04x, expected 0x%04x", (double)cases[i].f, got, cases[i].h);
  }
  assert_int_equal(ml_f32_to_f16(INFINITY), 0x7c00);
  assert_int_equal(ml_f32_to_f16(-INFINITY), 0xfc00);
  uint16_t nan = ml_f32_to_f16(from_bits(0x7f800001u)); /* signalling NaN */
  assert_int_equal(nan & 0x7e00, 0x7e00);               /* quiet NaN, not inf */
  assert_true(ml_f16_to_f32(0x0001) == 0x1p-24f);
  assert_true(ml_f16_to_f32(0x03ff) == 1023.0f * 0x1p-24f);
  assert_true(ml_f16_to_f32(0x7bff) == 65504.0f);
  assert_true(ml_f16_to_f32(0x3555) == 0x1.554p-2f);
  assert_true(isinf(ml_f16_to_f32(0x7c00)) && ml_f16_to_f32(0x7c00) > 0);
  assert_true(isinf(ml_f16_to_f32(0xfc00)) && ml_f16_to_f32(0xfc00) < 0);
  assert_true(isnan(ml_f16_to_f32(0x7e00)));
  assert_true(signbit(ml_f16_to_f32(0x8000)) && ml_f16_to_f32(0x8000) == 0.0f);
}

/* Every finite f16 survives f16 -> fp32 -> f16; and at each midpoint between
 * adjacent positive f16 values, rounding goes to the even neighbour, the
 * next fp32 below to the lower and the next fp32 above to the upper. */
static void test_f16_exhaustive(void **state) {
  (void)state;
  for (uint32_t h = 0; h < 0x10000u; h++) {
    float f = ml_f16_to_f32((uint16_t)h);
    uint16_t back = ml_f32_to_f16(f);
    if (isnan(f) ? (back & 0x7c00) != 0x7c00 || (back & 0x3ff) == 0 : back != h)
      fail_msg("f16 0x%04x -> %a -> 0x%04x", h, (double)f, back);
  }
  for (uint16_t a = 0; a < 0x7bff; a++) {
    float lo = ml_f16_to_f32(a), hi = ml_f16_to_f32((uint16_t)(a + 1));
    float mid = (lo + hi) / 2; /* exact: f16 has 11 significant bits */
    uint16_t even = (a & 1) ? (uint16_t)(a + 1) : a;
    if (ml_f32_to_f16(mid) != even || ml_f32_to_f16(nextafterf(mid, 0)) != a ||
        ml_f32_to_f16(nextafterf(mid, INFINITY)) != a + 1)
      fail_msg("rounding between 0x%04x and 0x%04x (mid %a)", a, a + 1, (double)mid);
  }
}

/* Array conversions through an unaligned buffer: values exact in every
 * type come back unchanged; 65504 is exact in F32/F16 but bf16 (8
 * significant bits) rounds it to 65536. */
static void test_convert_arrays(void **state) {
  (void)state;
  const float src[5] = {1.0f, -0.5f, 3.0f, 0x1p-24f, 65504.0f};
  const float bf16_last = 65536.0f;
  uint8_t raw[1 + 5 * 4];
  float back[5];
  ml_dtype types[] = {ML_F32, ML_BF16, ML_F16};
  for (size_t k = 0; k < 3; k++) {
    assert_int_equal(ml_convert_from_f32(types[k], src, raw + 1, 5), 0);
    assert_int_equal(ml_convert_to_f32(types[k], raw + 1, back, 5), 0);
    for (int i = 0; i < 4; i++) assert_true(back[i] == src[i]);
    assert_true(back[4] == (types[k] == ML_BF16 ? bf16_last : src[4]));
  }
  uint16_t h;
  assert_int_equal(ml_convert_from_f32(ML_F16, src, raw + 1, 1), 0);
  memcpy(&h, raw + 1, 2);
  assert_int_equal(h, 0x3c00); /* little-endian 1.0 */
}

static void test_convert_unsupported(void **state) {
  (void)state;
  float f[1] = {0};
  int32_t i[1] = {0};
  ml_error_clear();
  assert_int_equal(ml_convert_to_f32(ML_I32, i, f, 1), -1);
  assert_non_null(strstr(ml_error_msg(), "I32"));
  ml_error_clear();
  assert_int_equal(ml_convert_from_f32(ML_F64, f, i, 1), -1);
  assert_non_null(strstr(ml_error_msg(), "F64"));
  ml_error_clear();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_table),           cmocka_unit_test(test_torch_names),
      cmocka_unit_test(test_bf16_known),      cmocka_unit_test(test_bf16_roundtrip_all),
      cmocka_unit_test(test_f16_known),       cmocka_unit_test(test_f16_exhaustive),
      cmocka_unit_test(test_convert_arrays),  cmocka_unit_test(test_convert_unsupported),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
