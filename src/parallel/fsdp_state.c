/* FSDP's training state (parallel/fsdp.h ml_fsdp_train_state): each
 * trainable unit's fp32 gradient and AdamW moments, allocated where the
 * shards live at the first training call instead of with the shards, so
 * that a scoring-only session never holds or touches them; and under a bf16
 * param_dtype every unit's persistent bf16 shard (fsdp.h lp), which AdamW's
 * pass writes: a scoring-only session rounds at each unshard instead of
 * holding it beside the fp32 shards. */
#include "common/status.h"
#include "parallel/fsdp.h"
#include "parallel/fsdp_impl.h"

/* Unit u's persistent param_dtype shard (fsdp.h lp): param_dtype bf16
 * without cpu_offload (offloaded shards are rounded on their way to the
 * device); stale until the next unshard or AdamW's pass. */
static int lp_alloc(ml_fsdp *f, ml_fsdp_unit *unit) {
  if (unit->lp || f->opts.param_dtype != ML_BF16 || fsdp_offload(f)) return 0;
  unit->lp = ml_be_alloc(f->be, unit->shard_numel, sizeof(uint16_t),
                         "the persistent bf16 shard of an FSDP unit (%d parameters)", unit->n);
  unit->lp_fresh = false;
  return unit->lp ? 0 : -1;
}

int ml_fsdp_train_state(ml_fsdp *f) {
  if (f->opts.inference_only)
    return ml_err("training on an inference_only session: it holds no gradients or AdamW "
                  "state%s; expected a session opened without inference_only",
                  ml_fsdp_has_masters(f) ? "" : ", nor fp32 master weights (bf16 alone)");
  for (int u = 0; u < f->n_units; u++) {
    ml_fsdp_unit *unit = &f->units[u];
    ML_TRY(lp_alloc(f, unit));
    if (unit->frozen || unit->shard_grad) continue;
    int64_t g = unit->grad_numel; /* <= shard_numel, bounded (fsdp.c unit_layout): 3g fits */
    float *s = ml_fsdp_shard_alloc(f, 3 * g, sizeof(float),
                                   "the gradient and AdamW state of an FSDP unit (%d "
                                   "parameters%s)",
                                   unit->n, fsdp_offload(f) ? ", offloaded to host memory" : "");
    if (!s) return -1;
    /* the moments start at 0; shard_grad starts fresh (ml_fsdp_zero_grads: unwritten) */
    if (ml_be_zero(f->shard_be, s + g, sizeof(float) * (size_t)(2 * g))) {
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
