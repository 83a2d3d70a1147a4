/* FSDP's training state (parallel/fsdp.h ml_fsdp_train_state): each
 * trainable unit's fp32 gradient and AdamW moments, allocated where the
 * shards live at the first training call instead of with the shards, so
 * that a scoring-only session never holds or touches them. */
#include "common/status.h"
#include "parallel/fsdp.h"
#include "parallel/fsdp_impl.h"

int ml_fsdp_train_state(ml_fsdp *f) {
  for (int u = 0; u < f->n_units; u++) {
    ml_fsdp_unit *unit = &f->units[u];
    if (unit->frozen || unit->shard_grad) continue;
    int64_t g = unit->grad_numel; /* <= shard_numel, bounded (fsdp.c unit_layout): 3g fits */
    float *s = ml_fsdp_shard_alloc(f, 3 * g, sizeof(float),
                                   "the gradient and AdamW state of an FSDP unit (%d "
                                   "parameters%s)",
                                   unit->n, fsdp_offload(f) ? ", offloaded to host memory" : "");
    if (!s) return -1;
    /* accumulating modes add into shard_grad: it starts at 0, as the moments do */
    if (ml_be_zero(f->shard_be, s, sizeof(float) * (size_t)(3 * g))) {
      ml_fsdp_shard_free(f, s);
      return -1;
    }
    unit->shard_grad = s;
    unit->adam_m = s + g;
    unit->adam_v = s + 2 * g;
    unit->grad_fresh = true;
  }
  return 0;
}
