/* The inverse of a table that maps a choice's index onto a value (a
 * flag's names onto an engine enum, cli/train_flags.c; the library's enums
 * onto the engine's, api/session.c): which index stands for a value. */
#ifndef ML_LOOKUP_H
#define ML_LOOKUP_H

#include <stddef.h>

/* The index of the first of values[0..n) (elements of `size` bytes) equal
 * byte for byte to *value, or −1 when none is. */
int ml_index_of(const void *values, size_t n, size_t size, const void *value);

/* ml_index_of over a whole array `table` for the lvalue v of its element
 * type. */
#define ML_INDEX_OF(table, v) \
  ml_index_of((table), sizeof(table) / sizeof((table)[0]), sizeof((table)[0]), &(v))

#endif
