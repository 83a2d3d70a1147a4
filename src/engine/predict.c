/* One rank's step on the meta backend (predict.h). */
#include "engine/predict.h"

#include <stdlib.h>
#include <string.h>

#include "backend/meta/meta.h"
#include "common/checked.h"
#include "common/status.h"
#include "engine/freeze.h"
#include "engine/reference.h"
#include "parallel/loss.h"

/* The counters of every group into st, then zeroed. */
static void take_stats(ml_mesh *mesh, ml_comm_stats st[ML_GROUP_KINDS]) {
  for (int g = 0; g < ML_GROUP_KINDS; g++) st[g] = *ml_comm_stats_of(ml_mesh_comm(mesh, g));
  ml_mesh_stats_reset(mesh);
}

/* The parameters kept in fp32 under bf16 and the units' fp32 parts
 * (ml_prediction.fp32_*), read off the engine's FSDP units. */
static void fp32_count(const ml_engine *e, ml_prediction *p) {
  if (e->opts.fsdp.param_dtype == ML_F32) return; /* every parameter is fp32: no fp32 part */
  for (int u = 0; u < e->fsdp.n_units; u++) {
    const ml_fsdp_unit *unit = &e->fsdp.units[u];
    for (int i = 0; i < unit->n; i++)
      if (unit->params[i]->fp32) {
        p->fp32_params++;
        p->fp32_numel += unit->params[i]->shape[0] * unit->params[i]->shape[1];
      }
    if (unit->f32_numel == 0) continue;
    p->fp32_units++; /* bounded: a unit's elements fit int64 (parallel/fsdp.c unit_layout) */
    p->fp32_gather_bytes += (int64_t)sizeof(float) * unit->f32_numel * unit->dp->size;
  }
}

/* The training step on the open engine e. ids: [B, S] host. */
static int run_step(ml_engine *e, ml_mesh *mesh, const int32_t *ids, ml_prediction *p) {
  ml_predict_memory *mem = &p->mem;
  ml_memory_stats ms = ml_be_memory_stats(e->be);
  mem->opened = (int64_t)ms.in_use;
  int64_t max_shard = 0;
  ml_freeze_count(&e->model, &p->frozen_params, &p->frozen_numel);
  for (int u = 0; u < e->fsdp.n_units; u++) {
    p->frozen_units += e->fsdp.units[u].frozen;
    int64_t n = e->fsdp.units[u].shard_numel;
    mem->shards += 4 * ml_fsdp_unit_floats(&e->fsdp.units[u]); /* frozen chunks: params alone */
    mem->reference += (int64_t)ml_engine_reference_unit_bytes(&e->fsdp, &e->fsdp.units[u]);
    max_shard = n > max_shard ? n : max_shard;
  }
  fp32_count(e, p);
  if (e->opts.fsdp.cpu_offload) /* the shards, and host_grad where FSDP allocated it */
    mem->host = mem->shards + (e->fsdp.host_grad ? 4 * max_shard : 0);
  ml_mesh_stats_reset(mesh);
  ml_be_reset_peak(e->be);
  double loss, norm;
  ml_adamw_cfg adam = {.lr = 0.0, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
  ML_TRY(ml_engine_zero_grad(e)); /* the gradients and AdamW state: allocated here */
  for (int k = 0; k < p->shape.grad_accum; k++) {
    if (k == p->shape.grad_accum - 1) ml_engine_norm_ahead(e, 2.0); /* as engine/step.c */
    ML_TRY(ml_engine_forward_backward(e, ids, NULL, p->B, p->S, p->B * p->S, &loss));
  }
  ML_TRY(ml_engine_grad_norm(e, 2.0, &norm));
  ML_TRY(ml_engine_adamw(e, &adam));
  take_stats(mesh, p->train);
  ms = ml_be_memory_stats(e->be);
  mem->train_peak = (int64_t)ms.peak;
  mem->step_reserved = (int64_t)ms.reserved; /* from the open engine's blocks alone:
                                                ml_engine_reserve's ml_model_begin gave the
                                                cached ones back (ml_be_trim) */
  p->S_pad = e->cp.S_pad;
  p->s_local = p->S_pad / e->cp.size;
  int64_t per_layer, work; /* the step's (m->forward_only is off) */
  ml_model_act_bytes(&e->model, p->B, p->s_local, &per_layer, &work);
  mem->activations = ml_add_sat(ml_mul_sat(per_layer, e->model.cfg.n_layers), work);
  return 0;
}

/* One logprobs pass on the freshly opened engine e: an inference-only
 * session (`meshlm logprobs`), which holds no gradients or AdamW state
 * (ml_engine_train_state), under bf16 no fp32 master shards (parallel/fsdp.h
 * inference_only), no training activations or backward scratch,
 * no tp gradient packing. ids: [B, S] host; lp: [B, S−1]. */
static int run_logprobs(ml_engine *e, ml_mesh *mesh, const int32_t *ids, float *lp,
                        ml_prediction *p) {
  p->mem.logprobs_opened = (int64_t)ml_be_memory_stats(e->be).in_use;
  for (int u = 0; u < e->fsdp.n_units; u++)
    p->mem.logprobs_shards += ml_fsdp_unit_bytes(&e->fsdp.units[u]);
  ml_mesh_stats_reset(mesh);
  ml_be_reset_peak(e->be);
  ML_TRY(ml_engine_logprobs(e, ids, p->B, p->S, lp));
  take_stats(mesh, p->logprobs);
  ml_memory_stats ms = ml_be_memory_stats(e->be);
  p->mem.logprobs_peak = (int64_t)ms.peak;
  p->mem.logprobs_reserved = (int64_t)ms.reserved; /* from the open session's blocks alone: the
                                                      first pass's ml_model_begin gives the
                                                      cached ones back (ml_be_trim) */
  /* the loss runs over this rank's tokens, or the FSDP group's under vocab parallelism, whose
   * columns are split over tp (sharded logits) and then over the group */
  p->vocab_group = e->vocab.comm ? e->vocab.comm->size : 1;
  int parts = (e->tp.logits.kind == ML_SHARD ? e->tp.size : 1) * p->vocab_group;
  int64_t T = p->B * p->s_local * p->vocab_group;
  p->loss_chunk = ml_loss_tiling(T, e->model.cfg.vocab, parts,
                                 !e->model.lm_head.out.fwd.fn && !e->opts.batch_invariant,
                                 e->opts.loss_tile_floats)
                      .block;
  p->loss_chunks = T / p->loss_chunk + (T % p->loss_chunk != 0);
  return 0;
}

int ml_predict_step(const char *model_dir, const ml_engine_opts *opts,
                    const ml_predict_shape *shape, ml_prediction *out) {
  memset(out, 0, sizeof *out);
  int64_t B = shape->B, S = shape->S;
  if (B < 1 || S < 2 || shape->grad_accum < 1)
    return ml_err("plan: expected micro-batches of B >= 1 sequences of S >= 2 tokens, "
                  "grad_accum >= 1 of them per step; found B=%lld, S=%lld, grad_accum=%d",
                  (long long)B, (long long)S, shape->grad_accum);
  int64_t T = ml_mul_sat(B, S);
  ml_backend *like = opts->backend, *meta = NULL;
  if (!like) ML_TRY(ml_backend_get("cpu", 0, &like));
  ML_TRY(ml_backend_meta_create(like, &meta));
  ml_mesh mesh;
  int rc = ml_mesh_create_meta(shape->dp_replicate, shape->dp_shard, shape->cp, shape->tp,
                               shape->rank, &mesh);
  if (rc == 0 && shape->ep > 1 && (rc = ml_mesh_set_ep_meta(&mesh, shape->ep)) != 0)
    ml_mesh_destroy(&mesh);
  if (rc) {
    ml_backend_meta_destroy(meta);
    return rc;
  }
  *out = (ml_prediction){.shape = *shape, .world = mesh.world_size, .tp_rank = mesh.tp_rank,
                         .B = B, .S = S};
  out->shape.batch_what = NULL; /* the caller's string: not kept */
  ml_engine_opts o = *opts;
  o.backend = meta;
  o.no_weights = true;
  o.fsdp.inference_only = false; /* the training step's engine; the logprobs pass's below */
  ml_engine e;
  memset(&e, 0, sizeof e);
  int32_t *ids = NULL;
  float *lp = NULL;
  rc = ml_engine_open(&e, &mesh, model_dir, &o);
  /* the device buffers first: a batch beyond 2^63 bytes fails there, with their message */
  if (rc == 0) rc = ml_engine_reserve(&e, B, S, false, shape->batch_what);
  if (rc == 0) {
    ids = ml_calloc_array(T, sizeof *ids, "the planned batch's token ids");
    lp = ml_calloc_array(T, sizeof *lp, "the planned batch's log-probs");
    rc = ids && lp ? 0 : -1;
  }
  if (rc == 0) rc = run_step(&e, &mesh, ids, out);
  ml_engine_close(&e);
  /* scoring in a session of its own, as `meshlm logprobs` runs it: inference-only */
  o.fsdp.inference_only = true;
  if (rc == 0 && (rc = ml_engine_open(&e, &mesh, model_dir, &o)) == 0)
    rc = run_logprobs(&e, &mesh, ids, lp, out);
  ml_engine_close(&e); /* a closed engine is zeroed: closing it again is a no-op */
  free(ids);
  free(lp);
  ml_mesh_destroy(&mesh);
  ml_backend_meta_destroy(meta);
  return rc;
}
