/* GPT-2's byte ↔ unicode map (tokenizers/src/pre_tokenizers/byte_level.rs,
 * bytes_char; openai/gpt-2 encoder.py bytes_to_unicode): the printable
 * bytes '!'..'~', 0xA1..0xAC, 0xAE..0xFF map to the code point of the same
 * value, the other 68 bytes in order to U+0100, U+0101, ... */
#ifndef ML_TOK_BYTELEVEL_H
#define ML_TOK_BYTELEVEL_H

#include <stddef.h>
#include <stdint.h>

/* The code point byte b stands for. */
uint32_t tok_byte_to_cp(unsigned char b);

/* The byte code point cp stands for, or −1 when cp is none of the 256. */
int tok_cp_to_byte(uint32_t cp);

/* The UTF-8 of byte b's code point in out (room for 2
 * bytes); returns its length (1 or 2). */
size_t tok_byte_to_utf8(unsigned char b, char *out);

/* Map a byte-level string (UTF-8 made of the 256 code points) back to raw
 * bytes in out (room for len bytes); returns the byte count, or −1 when a
 * code point is outside the map. */
long tok_bytelevel_unmap(const char *s, size_t len, char *out);

#endif
