/* noblock.h: a backend that is another one but declares no block attention
 * (ML_OP_ATTENTION_BLOCK), named "noblock": what the CUDA backend is to the
 * code above the seam, on the CPU. Its slots stay set, so only the
 * declaration (ml_be_supports) can keep a call from them. */
#ifndef ML_TESTS_NOBLOCK_H
#define ML_TESTS_NOBLOCK_H

#include "backend/backend.h"

/* `base` without block attention; ops holds the copy of its vtable (and
 * must outlive the result). */
static inline ml_backend noblock_backend(const ml_backend *base, ml_backend_ops *ops) {
  *ops = *base->ops;
  ops->name = "noblock";
  ops->supports &= ~ML_OP_BIT(ML_OP_ATTENTION_BLOCK);
  return (ml_backend){.ops = ops, .impl = base->impl};
}

#endif
