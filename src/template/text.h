/* Python's str operations on UTF-8 text that the filters and methods share:
 * whitespace (str.isspace), case mapping (str.upper, lower, title's
 * titlecase, with Unicode's full mappings for ß, İ, the ligatures ﬀ-ﬆ and
 * the final sigma rule), and the line breaks of str.splitlines. */
#ifndef ML_TEMPLATE_TEXT_H
#define ML_TEMPLATE_TEXT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "template/pyfmt.h"

/* The first occurrence of needle[0, nn) in hay[0, hn) (nn == 0: hay), or
 * NULL (memmem, which C11 lacks). */
const char *txt_find(const char *hay, size_t hn, const char *needle, size_t nn);
/* The code point at s[i] (bytes in *n; an invalid byte reads as itself). */
int32_t txt_cp(const char *s, size_t len, size_t i, size_t *n);
/* Append the UTF-8 of cp: 0 or -1 (buffer). */
int txt_put_cp(jbuf *b, int32_t cp);
/* Python's str.isspace() of one code point. */
bool txt_space(int32_t cp);
/* The number of code points of s. */
size_t txt_chars(const char *s, size_t len);
/* Case-map the code points of s[from, to) (mode 'u' upper, 'l' lower, 't'
 * titlecase), s[0, len) being the string whose neighbours decide a final
 * sigma. 0; -1 when the buffer refuses; -2 with *bad set for a code point
 * whose Unicode special casing is not implemented here (the Greek with
 * ypogegrammeni, ŉ, ǰ, և...): an error, never a different text. */
int txt_case(jbuf *b, const char *s, size_t len, size_t from, size_t to, char mode, int32_t *bad);
/* The length of the line break at s[i] (\n, \r\n, \r, \v, \f, \x1c-\x1e,
 * U+0085, U+2028, U+2029 as str.splitlines), 0 when none. */
size_t txt_linebreak(const char *s, size_t len, size_t i);
/* Whether cp is a letter (cased or not) / a decimal digit / cased upper,
 * lower, as Python's str predicates use them. */
bool txt_alpha(int32_t cp);
bool txt_digit(int32_t cp);
bool txt_upper(int32_t cp);
bool txt_lower(int32_t cp);

#endif
