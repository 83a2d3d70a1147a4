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

int txt_map(jbuf *b, const char *s, size_t len, char mode) {
  for (size_t i = 0; i < len;) {
    size_t n;
    int32_t c = txt_cp(s, len, i, &n);
    int32_t m = mode == 'u' ? utf8proc_toupper(c) : mode == 'l' ? utf8proc_tolower(c) : utf8proc_totitle(c);
    if (txt_put_cp(b, m)) return -1;
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
