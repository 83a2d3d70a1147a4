#include "common/lookup.h"

#include <string.h>

int ml_index_of(const void *values, size_t n, size_t size, const void *value) {
  for (size_t i = 0; i < n; i++)
    if (memcmp((const char *)values + i * size, value, size) == 0) return (int)i;
  return -1;
}
