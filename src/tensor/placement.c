#include "tensor/placement.h"

#include <stdio.h>

const char *ml_placement_str(ml_placement p, char *buf, size_t cap) {
  if (p.kind == ML_REPLICATE) snprintf(buf, cap, "Replicate()");
  else if (p.kind == ML_PARTIAL) snprintf(buf, cap, "Partial(sum)");
  else snprintf(buf, cap, "Shard(%d)", p.dim);
  return buf;
}

int64_t ml_chunk_size(int64_t n, int parts) { return (n + parts - 1) / parts; }

void ml_chunk(int64_t n, int parts, int rank, int64_t *start, int64_t *len) {
  int64_t c = ml_chunk_size(n, parts);
  int64_t s = c * rank < n ? c * rank : n;
  int64_t e = s + c < n ? s + c : n;
  *start = s;
  *len = e - s;
}
