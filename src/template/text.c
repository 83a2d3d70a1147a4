/* Python's str operations on UTF-8 text (text.h), over utf8proc's tables. */
#include "template/text.h"

#include <string.h>

#include <utf8proc.h>

const char *txt_find(const char *hay, size_t hn, const char *needle, size_t nn) {
  if (!nn) return hay;
  for (size_t i = 0; i + nn <= hn; i++) {
    const char *p = memchr(hay + i, needle[0], hn - nn + 1 - i);
    if (!p) return NULL;
    i = (size_t)(p - hay);
    if (!memcmp(p, needle, nn)) return p;
  }
  return NULL;
}

int32_t txt_cp(const char *s, size_t len, size_t i, size_t *n) {
  int32_t cp;
  utf8proc_ssize_t k = utf8proc_iterate((const uint8_t *)s + i, (utf8proc_ssize_t)(len - i), &cp);
  if (k <= 0) {
    *n = 1;
    return (unsigned char)s[i];
  }
  *n = (size_t)k;
  return cp;
}

int txt_put_cp(jbuf *b, int32_t cp) {
  uint8_t u[4];
  utf8proc_ssize_t n = utf8proc_encode_char(cp, u);
  return jbuf_put(b, (const char *)u, (size_t)n);
}

bool txt_space(int32_t c) {
  if ((c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0) return true;
  if (c < 0x1680) return false;
  utf8proc_category_t k = utf8proc_category(c);
  return k == UTF8PROC_CATEGORY_ZS || k == UTF8PROC_CATEGORY_ZL || k == UTF8PROC_CATEGORY_ZP;
}

size_t txt_chars(const char *s, size_t len) {
  size_t n = 0;
  for (size_t i = 0; i < len; i++) n += ((unsigned char)s[i] & 0xC0) != 0x80;
  return n;
}

/* Python's _PyUnicode_IsCased / _PyUnicode_IsCaseIgnorable (the final
 * sigma context), from the general categories and the word-break
 * apostrophes and stops. */
static bool cased(int32_t c) {
  utf8proc_category_t k = utf8proc_category(c);
  return k == UTF8PROC_CATEGORY_LU || k == UTF8PROC_CATEGORY_LL || k == UTF8PROC_CATEGORY_LT;
}

static bool case_ignorable(int32_t c) {
  switch (c) {
  case 0x27: case 0x2E: case 0x3A: case 0xB7: case 0x387: case 0x5F4: case 0x2018: case 0x2019:
  case 0x2024: case 0x2027: case 0xFE13: case 0xFE52: case 0xFE55: case 0xFF07: case 0xFF0E: case 0xFF1A:
    return true;
  default: break;
  }
  utf8proc_category_t k = utf8proc_category(c);
  return k == UTF8PROC_CATEGORY_MN || k == UTF8PROC_CATEGORY_ME || k == UTF8PROC_CATEGORY_CF ||
         k == UTF8PROC_CATEGORY_LM || k == UTF8PROC_CATEGORY_SK;
}

/* Σ at s[i] is final: a cased letter before it and none after it (case
 * ignorable characters skipped). */
static bool final_sigma(const char *s, size_t len, size_t i, size_t n) {
  int32_t c = 0;
  size_t j = i, m;
  bool before = false;
  while (j > 0) {
    size_t k = j - 1;
    while (k > 0 && ((unsigned char)s[k] & 0xC0) == 0x80) k--;
    c = txt_cp(s, len, k, &m);
    j = k;
    if (!case_ignorable(c)) {
      before = cased(c);
      break;
    }
  }
  if (!before) return false;
  for (j = i + n; j < len; j += m) {
    c = txt_cp(s, len, j, &m);
    if (!case_ignorable(c)) return !cased(c);
  }
  return true;
}

/* Unicode's SpecialCasing (unconditional) where it differs from the simple
 * mappings: the implemented ones, and the ranges refused. */
static const struct special {
  int32_t cp;
  const char *upper, *title, *lower;
} SPECIAL[] = {
    {0xDF, "SS", "Ss", NULL},      {0x130, NULL, NULL, "i\xCC\x87"}, {0xFB00, "FF", "Ff", NULL},
    {0xFB01, "FI", "Fi", NULL},    {0xFB02, "FL", "Fl", NULL},       {0xFB03, "FFI", "Ffi", NULL},
    {0xFB04, "FFL", "Ffl", NULL},  {0xFB05, "ST", "St", NULL},       {0xFB06, "ST", "St", NULL},
};

static bool special_refused(int32_t c) {
  static const int32_t ranges[][2] = {
      {0x149, 0x149},   {0x1F0, 0x1F0},   {0x390, 0x390},   {0x3B0, 0x3B0},   {0x587, 0x587},
      {0x1E96, 0x1E9A}, {0x1F50, 0x1F50}, {0x1F52, 0x1F52}, {0x1F54, 0x1F54}, {0x1F56, 0x1F56},
      {0x1F80, 0x1FAF}, {0x1FB2, 0x1FB4}, {0x1FB6, 0x1FB7}, {0x1FBC, 0x1FBC}, {0x1FC2, 0x1FC4},
      {0x1FC6, 0x1FC7}, {0x1FCC, 0x1FCC}, {0x1FD2, 0x1FD3}, {0x1FD6, 0x1FD7}, {0x1FE2, 0x1FE4},
      {0x1FE6, 0x1FE7}, {0x1FF2, 0x1FF4}, {0x1FF6, 0x1FF7}, {0x1FFC, 0x1FFC}, {0xFB13, 0xFB17}};
  for (size_t i = 0; i < sizeof ranges / sizeof *ranges; i++)
    if (c >= ranges[i][0] && c <= ranges[i][1]) return true;
  return false;
}

int txt_case(jbuf *b, const char *s, size_t len, size_t from, size_t to, char mode, int32_t *bad) {
  for (size_t i = from; i < to;) {
    size_t n;
    int32_t c = txt_cp(s, len, i, &n);
    const char *full = NULL;
    for (size_t k = 0; k < sizeof SPECIAL / sizeof *SPECIAL; k++)
      if (SPECIAL[k].cp == c) full = mode == 'u' ? SPECIAL[k].upper : mode == 't' ? SPECIAL[k].title : SPECIAL[k].lower;
    if (!full && mode != 'l' && special_refused(c)) {
      *bad = c;
      return -2;
    }
    int rc;
    if (full) rc = jbuf_put(b, full, strlen(full));
    else if (mode == 'l' && c == 0x3A3) rc = txt_put_cp(b, final_sigma(s, len, i, n) ? 0x3C2 : 0x3C3);
    else rc = txt_put_cp(b, mode == 'u' ? utf8proc_toupper(c) : mode == 'l' ? utf8proc_tolower(c) : utf8proc_totitle(c));
    if (rc) return -1;
    i += n;
  }
  return 0;
}

size_t txt_linebreak(const char *s, size_t len, size_t i) {
  unsigned char c = (unsigned char)s[i];
  if (c == '\r') return i + 1 < len && s[i + 1] == '\n' ? 2 : 1;
  if (c == '\n' || c == '\v' || c == '\f' || (c >= 0x1c && c <= 0x1e)) return 1;
  if (c == 0xC2 && i + 1 < len && (unsigned char)s[i + 1] == 0x85) return 2;
  if (c == 0xE2 && i + 2 < len && (unsigned char)s[i + 1] == 0x80 &&
      ((unsigned char)s[i + 2] == 0xA8 || (unsigned char)s[i + 2] == 0xA9))
    return 3;
  return 0;
}

bool txt_alpha(int32_t c) {
  utf8proc_category_t k = utf8proc_category(c);
  return k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO;
}

bool txt_digit(int32_t c) { return utf8proc_category(c) == UTF8PROC_CATEGORY_ND; }
bool txt_upper(int32_t c) { return utf8proc_category(c) == UTF8PROC_CATEGORY_LU || utf8proc_category(c) == UTF8PROC_CATEGORY_LT; }
bool txt_lower(int32_t c) { return utf8proc_category(c) == UTF8PROC_CATEGORY_LL; }
