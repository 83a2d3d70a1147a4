#include "tokenizer/tok_bytelevel.h"

#include <stdbool.h>

#include "tokenizer/tok_util.h"

static bool printable(unsigned b) {
  return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
}

/* The 68 other bytes, in order: 0x00..0x20, 0x7F..0xA0, 0xAD. */
uint32_t tok_byte_to_cp(unsigned char b) {
  if (printable(b)) return b;
  if (b <= 0x20) return 256 + b;
  if (b != 0xAD) return 256 + 33 + (b - 0x7F);
  return 256 + 67;
}

int tok_cp_to_byte(uint32_t cp) {
  if (cp < 256) return printable(cp) ? (int)cp : -1;
  if (cp < 256 + 33) return (int)(cp - 256);
  if (cp < 256 + 67) return (int)(cp - 256 - 33 + 0x7F);
  return cp == 256 + 67 ? 0xAD : -1;
}

size_t tok_byte_to_utf8(unsigned char b, char *out) {
  return tok_utf8_encode(tok_byte_to_cp(b), out);
}

long tok_bytelevel_unmap(const char *s, size_t len, char *out) {
  size_t o = 0;
  for (size_t i = 0; i < len;) {
    size_t n = tok_utf8_len((unsigned char)s[i]);
    if (i + n > len) return -1;
    int b = tok_cp_to_byte(tok_utf8_decode(s + i));
    if (b < 0) return -1;
    out[o++] = (char)b;
    i += n;
  }
  return (long)o;
}
