/* The parallel engine: a model loaded from an HF checkpoint, sharded over a
 * device mesh (TP from a plan, then FSDP over dp_shard, torchtitan's order),
 * with the forward/backward of one step, the global grad norm and AdamW.
 * One step, as data flows (DESIGN §1): embedding → per layer (FSDP
 * all-gather, TP hooks, kernels, reshard) → lm_head → vocab-parallel loss →
 * backward in reverse (gather again, grads reduce-scattered into shards). */
#ifndef ML_ENGINE_H
#define ML_ENGINE_H

#include <stdbool.h>

#include "model/model.h"
#include "parallel/fsdp.h"
#include "parallel/loss.h"
#include "parallel/mesh.h"
#include "parallel/plan.h"
#include "parallel/tp.h"

/* How to parallelize beyond the mesh: NeMo's dtensor_cfg
 * custom_parallel_plan and sequence_parallel. */
typedef struct ml_engine_opts {
  const char *parallel_plan; /* NULL/"auto", "optimized", "hf", "default" or a plan file */
  bool sequence_parallel;
} ml_engine_opts;

typedef struct ml_engine {
  ml_mesh *mesh;
  ml_model model;
  ml_plan plan;
  ml_tp tp;
  ml_fsdp fsdp;
  float *x;        /* [T, H] residual stream */
  int32_t *targets; /* [T] */
  int64_t cap_tokens;
  int64_t step; /* optimizer steps taken */
} ml_engine;

/* Load DIR (config.json + safetensors), select the plan (ml_plan_select;
 * opts NULL = auto, no SP), apply it over mesh->tp_comm and shard over
 * mesh->dp_shard_comm. Errors: config, plan selection and validation,
 * checkpoint (each named). */
int ml_engine_open(ml_engine *e, ml_mesh *mesh, const char *model_dir,
                   const ml_engine_opts *opts);
void ml_engine_close(ml_engine *e);

/* Forward + backward of a local batch ids/mask [B, S] (mask[b, i] = 1:
 * token i is a target, predicted from the tokens before it). The loss is
 * the mean over the global batch's targets: gradients are scaled by
 * 1/global_targets. Leaves the reduced gradients in the FSDP shards;
 * *loss receives the global mean loss (one all-reduce over dp). */
int ml_engine_forward_backward(ml_engine *e, const int32_t *ids, const uint8_t *mask, int64_t B,
                               int64_t S, int64_t global_targets, double *loss);

/* Per-token log-probs of one local batch ids [B, S]: out [B, S−1],
 * out[b, t] = log p(ids[b, t+1] | ids[b, ≤t]). Forward only. */
int ml_engine_logprobs(ml_engine *e, const int32_t *ids, int64_t B, int64_t S, float *out);

/* Global L2 norm of the gradients over the whole mesh, each parameter
 * counted once (TP-replicated parameters only from tp rank 0; DESIGN §7). */
int ml_engine_grad_norm(ml_engine *e, double *norm);

/* Multiply every gradient by max_norm / (norm + 1e-6) when that is < 1
 * (torch.nn.utils.clip_grad_norm_). */
void ml_engine_clip(ml_engine *e, double norm, double max_norm);

typedef struct ml_adamw_cfg {
  double lr, beta1, beta2, eps, weight_decay;
} ml_adamw_cfg;

/* One AdamW step (torch.optim.AdamW) on every local shard. */
void ml_engine_adamw(ml_engine *e, const ml_adamw_cfg *cfg);

#endif
