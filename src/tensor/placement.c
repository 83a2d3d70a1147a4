#include "tensor/placement.h"

#include <stdio.h>

const char *ml_placement_str(ml_placement p, char *buf, size_t cap) {
  if (p.kind == ML_REPLICATE) snprintf(buf, cap, "Replicate()");
  else if (p.kind == ML_PARTIAL) snprintf(buf, cap, "Partial(sum)");
  else snprintf(buf, cap, "Shard(%d)", p.dim);
  return buf;
}
