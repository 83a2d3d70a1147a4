/* Prediction of one training step's collectives and per-rank memory,
 * without running it: `meshlm plan`'s numbers. The engine's own step
 * (engine/engine.h) runs for one rank of the mesh on the meta backend
 * (backend/meta/meta.h: the caching pool over addresses nothing reads,
 * every operator a no-op) with null data comms under the counting wrapper
 * (parallel/mesh.h ml_mesh_create_meta), config.json only — as torch's
 * FSDPMemTracker and CommDebugMode run a model under FakeTensorMode
 * (torch/distributed/_tools). There is no second description of the step
 * to keep in line with the engine: the collectives are the ones the step
 * issues, counted per mesh group with the counting comm's byte convention
 * (comm/comm.h), and the memory is the pool's, as ml_be_memory_stats
 * reports it for a real run of the same step (requested bytes; a GEMM's
 * temporaries are modelled, as the pool blocks the backend takes for them,
 * ml_be_gemm_temp_blocks; other kernels' own temporaries are not: a real
 * CPU run's peak may exceed it by those).
 *
 * One training step = ml_engine_zero_grad, grad_accum ×
 * ml_engine_forward_backward (micro-batches; the last computing the grad
 * norm's partials, engine/grad_norm.h, as engine/step.c asks), ml_engine_grad_norm,
 * ml_engine_adamw (which re-gathers parameters under ZeRO-1/2); one
 * logprobs pass = ml_engine_logprobs of one micro-batch on an engine
 * opened afresh, as `meshlm logprobs` runs it (an inference-only session:
 * no gradients or AdamW state, engine.h ml_engine_train_state, and under
 * bf16 no fp32 master shards, parallel/fsdp.h inference_only). */
#ifndef ML_PREDICT_STEP_H
#define ML_PREDICT_STEP_H

#include <stdint.h>

#include "comm/comm.h"
#include "parallel/mesh.h"
#include "engine/engine.h"

/* Per-rank memory in bytes: the device's, and what FSDP keeps in host
 * memory under cpu_offload. */
typedef struct ml_predict_memory {
  int64_t shards;      /* FSDP shards: parameters, gradients, AdamW exp_avg and exp_avg_sq
                          (4 × the padded shard, fp32; the frozen chunks' parameters alone,
                          ml_fsdp_unit_floats): device memory, or host memory under
                          cpu_offload */
  int64_t host;        /* host memory FSDP holds under cpu_offload: the shards and the
                          staging of the gradients it accumulates there (0 without offload;
                          the tp step's stash of a few norm gradients is not counted) */
  int64_t opened;      /* device memory in use once a training engine is open: the parameter
                          shards (not under cpu_offload; their gradients and AdamW state come
                          at the first training call), FSDP's communication buffers,
                          persistent unsharded parameters (ZeRO-1/2), and the micro-batch's
                          buffers train reserves up front (ml_engine_reserve) */
  int64_t activations; /* saved for backward, all layers, plus the AC recompute workspace
                          (ml_model_act_bytes) */
  int64_t train_peak;  /* the peak of one training step (everything live at once) */
  int64_t step_reserved; /* what the device pool holds after that step, its cached free blocks
                            included (torch.cuda.memory_reserved after the first
                            optimizer.step(); backend/pool.h): above the peak by the blocks a
                            later request of another size could not reuse. A later step may
                            cache a few blocks more (measured on the test fixtures: +0 to
                            +1.0 % by the second step, nothing after; more under ep, whose
                            buffers follow the routing). On the CPU backend the pool is
                            malloc'd memory, so the step's resident set is at most this plus
                            the libraries' fixed overhead (and the host pool under
                            cpu_offload): a block's pages never written stay out of it (the
                            smollm2-135m preset, bf16, S 512 × 2, one rank: RSS 155 MiB below
                            these bytes, bench/results/2026-11-27-plan-step-reserved.md) */
  int64_t logprobs_peak; /* the peak of one logprobs pass in an inference-only session
                            (under bf16 the units' bf16 shards instead of their fp32 ones:
                            parallel/fsdp.h inference_only) */
  int64_t logprobs_reserved; /* what the device pool holds after that pass, its cached free
                                blocks included (torch.cuda.memory_reserved; backend/pool.h):
                                above the peak by the blocks a later request of another size
                                could not reuse. On the CPU backend the pool is malloc'd
                                memory, so the pass's resident set is this plus the
                                libraries' fixed overhead */
  int64_t reference;   /* a reference policy's weights (engine/reference.h: the padded
                          parameter shards, fp32 where the shards live, or bf16 on the device
                          for the units computing from bf16 weights) */
  int64_t logprobs_opened; /* device memory in use once a scoring-only session is open, as
                              `meshlm logprobs` holds it before its first pass: `opened` without
                              the training micro-batch's buffers */
  int64_t logprobs_shards; /* the parameters that session holds where the shards live
                              (parallel/fsdp.h ml_fsdp_unit_bytes: fp32 shards, or under bf16
                              the inference-only units' bf16 shards) */
} ml_predict_memory;

/* What is predicted: world rank `rank` of a dp_replicate × dp_shard × cp
 * × tp mesh, each optimizer step grad_accum micro-batches of B sequences
 * of S tokens per dp rank (under context parallelism each cp rank holds
 * its piece of every sequence: parallel/cp.h). batch_what: how allocation errors
 * name the micro-batch (ml_engine_reserve; NULL: "B sequences x S
 * tokens"). */
typedef struct ml_predict_shape {
  int dp_replicate, dp_shard, cp, tp, rank;
  int64_t B, S;
  int grad_accum;
  const char *batch_what;
  int ep; /* expert parallelism (parallel/ep.h; 0 or 1: none): the sparse layers' all-to-alls
             counted on the ep group with the balanced routing the meta backend models
             (model/moe.h) */
} ml_predict_shape;

typedef struct ml_prediction {
  ml_predict_shape shape;
  int world, tp_rank;
  int64_t B, S;                    /* local micro-batch per dp rank */
  int64_t S_pad, s_local;          /* S padded for cp (S when cp = 1), positions per cp rank */
  int vocab_group;   /* ranks the vocab-sized root parameters are split over by vocab rows
                        (FSDP's group under vocab parallelism, parallel/vocab.h), or 1: they
                        are gathered whole */
  int64_t loss_chunk, loss_chunks; /* the fused classifier's token block (ml_loss_tiling) and
                                      blocks per pass, over the tokens the loss runs on (the
                                      group's d·T under vocab parallelism) */
  ml_comm_stats train[ML_GROUP_KINDS];    /* one training step */
  ml_comm_stats logprobs[ML_GROUP_KINDS]; /* one logprobs pass */
  ml_predict_memory mem;
  /* frozen parameters (ml_engine_opts.freeze, engine/freeze.h): their count and elements
     (global), and the FSDP units all of whose parameters are frozen (no gradient, AdamW
     state or gradient reduction) */
  int frozen_params, frozen_units;
  int64_t frozen_numel;
  /* parameters kept in fp32 under a bf16 param_dtype (engine/fp32_params.h: the MoE routers,
     ml_engine_opts.fp32_params): their count and elements (global), the FSDP units with an
     fp32 part (parallel/fsdp.h: an fp32 all-gather of its own beside the bf16 one), and the
     bytes those fp32 all-gathers deliver to a rank when every unit is gathered once */
  int fp32_params, fp32_units;
  int64_t fp32_numel, fp32_gather_bytes;
} ml_prediction;

/* Predict one training step and one logprobs pass of `shape` for the
 * model in `model_dir` (config.json) under the engine options `opts`
 * (plan, SP, mixed precision, ZeRO stage, reshard and prefetch, activation
 * checkpointing; opts->backend names the backend predicted for, NULL =
 * CPU). Errors: those of opening the engine (plan, sizes,
 * config), mesh sizes or rank out of range, B < 1, S < 2 or grad_accum
 * < 1, and a step
 * too large to address (a buffer beyond 2^63 bytes, or more than 2^62
 * bytes of device memory in all: the meta pool's address range). */
int ml_predict_step(const char *model_dir, const ml_engine_opts *opts,
                    const ml_predict_shape *shape, ml_prediction *out);

#endif
