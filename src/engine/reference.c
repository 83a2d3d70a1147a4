/* The reference policy's shards (reference.h). */
#include "engine/reference.h"

#include <stdlib.h>

#include "common/status.h"

int ml_engine_reference_set(ml_engine *e) {
  ml_fsdp *f = &e->fsdp;
  if (e->ref_swapped)
    return ml_err("the reference policy cannot be captured while it is swapped in");
  if (!e->ref) {
    e->ref = ml_calloc((size_t)f->n_units, sizeof *e->ref, "the reference policy's shards");
    if (!e->ref) return -1;
    for (int u = 0; u < f->n_units; u++) {
      e->ref[u] = ml_fsdp_shard_alloc(f, f->units[u].shard_numel, sizeof(float),
                                      "the reference policy's shard of FSDP unit %d", u);
      if (!e->ref[u]) {
        ml_engine_reference_free(e);
        return -1;
      }
    }
  }
  /* shard to shard in the shards' memory, on the backend that computes there */
  for (int u = 0; u < f->n_units; u++)
    ML_TRY(ml_be_copy(f->shard_be, e->ref[u], f->units[u].shard,
                      sizeof(float) * (size_t)f->units[u].shard_numel, ML_COPY_D2D));
  return ml_be_sync(f->shard_be);
}

bool ml_engine_has_reference(const ml_engine *e) { return e->ref != NULL; }

int ml_engine_reference_swap(ml_engine *e) {
  if (!e->ref)
    return ml_err("no reference policy: capture one first (meshlm_set_reference, "
                  "Policy.set_reference or Policy(reference=True))");
  ML_TRY(ml_fsdp_swap_shards(&e->fsdp, e->ref));
  e->ref_swapped = !e->ref_swapped;
  return 0;
}

void ml_engine_reference_free(ml_engine *e) {
  if (!e->ref) return;
  for (int u = 0; e->ref_swapped && u < e->fsdp.n_units; u++) { /* the policy's shards back */
    float *ref = e->fsdp.units[u].shard;
    e->fsdp.units[u].shard = e->ref[u];
    e->ref[u] = ref;
    e->fsdp.units[u].lp_fresh = false; /* parallel/fsdp.h: the policy's shard is back */
  }
  e->ref_swapped = false;
  for (int u = 0; u < e->fsdp.n_units; u++) ml_fsdp_shard_free(&e->fsdp, e->ref[u]);
  free(e->ref);
  e->ref = NULL;
}

size_t ml_engine_reference_bytes(const ml_engine *e) {
  size_t n = 0;
  for (int u = 0; e->ref && u < e->fsdp.n_units; u++)
    n += sizeof(float) * (size_t)e->fsdp.units[u].shard_numel;
  return n;
}
