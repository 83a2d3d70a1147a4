/* The parallel engine: a model loaded from an HF checkpoint, sharded over a
 * device mesh (TP from a plan, then FSDP over dp_shard, torchtitan's order),
 * with the forward/backward of one step, the global grad norm and AdamW.
 * One step, as data flows (ARCHITECTURE.md §1): embedding → per layer (FSDP
 * all-gather, TP hooks, kernels, reshard) → lm_head → vocab-parallel loss →
 * backward in reverse (gather again, grads reduce-scattered into shards).
 *
 * Whenever FSDP's group (dp_shard_cp) has more than one rank, the
 * vocab-sized root parameters (embed_tokens.weight, an untied
 * lm_head.weight) are vocab-parallel over it (parallel/vocab.h,
 * parallel/fsdp.h): never all-gathered, the tokens, lm_head's input and
 * their gradients travel instead — unless lm_head's logits need an output
 * redistribute over tp (a custom plan's lm_head colwise_rep on tp > 1, which
 * assembles whole-vocab rows from torch.chunk blocks), where the root is
 * gathered whole as before. */
#ifndef ML_ENGINE_H
#define ML_ENGINE_H

#include <stdbool.h>

#include "engine/grad_norm.h"
#include "engine/grads.h"
#include "engine/lora.h"
#include "model/model.h"
#include "model/varlen.h"
#include "parallel/cp.h"
#include "parallel/fsdp.h"
#include "parallel/loss.h"
#include "parallel/mesh.h"
#include "parallel/objective.h"
#include "parallel/plan.h"
#include "parallel/tp.h"
#include "parallel/vocab.h"

/* How to parallelize beyond the mesh, as NeMo's dtensor_cfg and FSDP2's
 * fully_shard arguments name it. Start from ml_engine_opts_default(). */
typedef struct ml_engine_opts {
  const char *parallel_plan; /* NULL/"auto", "optimized", "hf", "default" or a plan file */
  bool sequence_parallel;
  ml_fsdp_opts fsdp;         /* mixed precision, reshard policy, ZeRO stage, prefetch */
  ml_dtype output_dtype;     /* MixedPrecisionPolicy.output_dtype: logits rounded to it (F32/BF16) */
  int64_t loss_tile_floats;  /* logits per tile of the fused classifier (parallel/loss.h); 0: the
                                default 2^24 */
  ml_ac_mode ac;             /* activation checkpointing of every decoder layer */
  ml_backend *backend;       /* where to compute (NULL: the CPU backend) */
  bool no_weights;           /* read config.json only, never the safetensors: the shards are
                                allocated and left unset (the meta backend: torch's meta-device
                                init; engine/predict.h) */
  bool batch_invariant;      /* every token's log-prob the same bits whatever batch, padding,
                                packing, micro-batch, dp or cp size or KV-cache step computes
                                it: the backend's batch-invariant mode
                                (ml_be_set_batch_invariant), cp's fixed-order forward
                                (parallel/cp.h), no vocab parallelism (whole vocab rows per rank: the sum of exp
                                over the vocabulary in one order), the fused classifier's
                                tiles whole rows (ml_loss_split.batch_invariant) */
  const char *freeze;        /* comma-separated fnmatch patterns of HF parameter names to freeze
                                (requires_grad=False: engine/freeze.h); NULL/"": none */
  ml_lora_opts lora;         /* LoRA adapters (engine/lora.h); rank 0, no adapter: off */
  const char *fp32_params;   /* comma-separated fnmatch patterns of HF parameter names kept and
                                computed in fp32 under a bf16 param_dtype, besides every MoE
                                router gate (engine/fp32_params.h); NULL/"": the routers only */
} ml_engine_opts;

/* fp32 everywhere, FSDP2's reshard defaults, ZeRO-3, prefetch forward 1 /
 * backward 2, no CPU offload, no activation checkpointing, plan auto, no
 * SP. */
ml_engine_opts ml_engine_opts_default(void);

typedef struct ml_engine {
  char *model_dir; /* the HF checkpoint directory it was opened from, as given: the source
                      an HF export carries the rest of the model over from (ckpt/save.h) */
  ml_backend *be;
  ml_mesh *mesh;
  ml_engine_opts opts;
  ml_model model;
  ml_plan plan;
  ml_tp tp;
  ml_fsdp fsdp;
  ml_grads grads; /* the gradients' tp step over the FSDP shards */
  ml_vocab vocab; /* vocab parallelism over FSDP's group (comm NULL: off) */
  ml_cp cp;
  /* T = B · s local tokens: s = S, or this cp rank's piece of the sequences */
  float *x;          /* [T, H] residual stream (device) */
  int32_t *ids;      /* [T] token ids, then targets [T] (device) */
  int32_t *targets;
  int32_t *host_ids; /* [2T] their host staging */
  int64_t cap_tokens;
  int32_t *host_shifted; /* [B, S] targets of the whole sequences (host), cap_shifted of them */
  int64_t cap_shifted;
  int64_t step; /* optimizer steps taken */
  /* packed documents (ml_engine_batch.docs) of the batch in use */
  bool packed;
  int64_t *positions; /* [cap_positions] their RoPE positions (host) */
  int64_t cap_positions;
  ml_varlen varlen;   /* the packed documents' attention core */
  bool hold;          /* ml_engine_hold_params: forwards leave every unit unsharded */
  void **ref;         /* [n_units] the reference policy's weights (engine/reference.h), or NULL */
  bool ref_swapped;   /* the engine computes with them now (ml_engine_reference_swap) */
  char *freeze;       /* opts.freeze's copy (opts.freeze points at it), or NULL */
  int bwd_first;      /* the lowest decoder layer backward runs through: the number of
                         leading layers whose parameters are all frozen when embed_tokens is
                         frozen too (nothing below them needs a gradient, as autograd prunes
                         a graph whose leaves do not require grad), else 0 */
  ml_lora lora;       /* the LoRA configuration in effect (engine/lora.h) */
  /* The export order (ckpt/save.h ml_engine_export_param): every parameter by its decoder
   * layer, then the root's (ml_fsdp_unit_of), in model.params order within each — one
   * rank's FSDP unit order, the same on every rank whichever experts it holds (ep) */
  ml_param **order; /* [model.n_params] */
  int *order_k;     /* [model.n_params] by index in model.params: its place in order */
  char *fp32_params;  /* opts.fp32_params's copy (opts.fp32_params points at it), or NULL */
  ml_norm_parts norm; /* the grad norm's partials computed during backward (grad_norm.h) */
} ml_engine;

/* Load DIR (config.json + safetensors), select the plan (ml_plan_select;
 * opts NULL = auto, no SP), apply it over the mesh's tp group, context
 * parallelism over its cp group (parallel/cp.h), and shard over its
 * dp_shard_cp group (FSDP). Checkpoint tensors no parameter reads (another
 * tower of a composite checkpoint, a stray tensor) are ignored with one
 * warning on stderr from mesh rank 0, as transformers warns. With LoRA
 * (opts.lora: engine/lora.h) the adapters are attached before the plan,
 * every base weight frozen after --freeze's patterns, and the adapters set
 * (a seed or a PEFT adapter) after the checkpoint load. Errors: config,
 * plan selection and validation, checkpoint, LoRA options (each named). */
int ml_engine_open(ml_engine *e, ml_mesh *mesh, const char *model_dir,
                   const ml_engine_opts *opts);
void ml_engine_close(ml_engine *e);

/* Put e's backend in e's mode (opts.batch_invariant, ml_be_set_batch_invariant):
 * the mode belongs to the backend, which every engine of the process shares,
 * so every forward (training, scoring, generation) sets it first. Errors:
 * the mode on over a backend without it (cuda), naming the option. */
int ml_engine_batch_mode(ml_engine *e);

/* Allocate the buffers of a local batch [B, S] now (S: whole sequences;
 * under context parallelism the buffers hold this rank's piece) (the model's
 * activations, ml_model_begin; the residual stream and targets) instead of
 * in the first forward, so that a batch too large for memory fails before
 * any collective, where every rank can agree on the error. `what` (NULL:
 * the plain geometry) names the batch in allocation messages, in the
 * user's terms, e.g. "4 sequences per rank (--batch-size 8 / 2
 * data-parallel ranks) x --seq-len 4096"; it is copied. forward_only: the
 * batches will only be scored (ml_model.forward_only: one layer's
 * activations), else trained. No collective.
 * Errors: allocation (the buffer, the batch and the config sizes named). */
int ml_engine_reserve(ml_engine *e, int64_t B, int64_t S, bool forward_only, const char *what);

/* Zero the sharded gradients: the start of an optimizer step (torch's
 * optimizer.zero_grad(set_to_none=True): lazily, parallel/fsdp.h
 * ml_fsdp_zero_grads; they read as zeros until a backward writes them);
 * the first call allocates the training state (ml_engine_train_state). */
int ml_engine_zero_grad(ml_engine *e);

/* The FSDP shards' gradients and AdamW state (parallel/fsdp.h
 * ml_fsdp_train_state: 12 B per trainable shard element where the shards
 * live), allocated zeroed on the first call, a no-op after. Opening the
 * engine allocates the parameter shards alone: the training entry points
 * (zero_grad, forward + backward, the grad norm, the non-finite search,
 * clipping, AdamW, a run checkpoint's load) call this first, scoring and
 * generation never do. With them the grad norm's partials' slots
 * (engine/grad_norm.h ml_norm_parts_alloc: 8 B per parameter). Errors:
 * allocation (named). */
int ml_engine_train_state(ml_engine *e);

/* Forward + backward of a local (micro-)batch ids/mask [B, S] (mask[b, i]
 * = 1: token i is a target, predicted from the tokens before it). The cp
 * ranks of a data-parallel rank pass the same whole sequences; each
 * computes its piece (parallel/cp.h). The loss
 * is the mean over the targets of the whole global batch of the optimizer
 * step (all dp ranks, all micro-batches of gradient accumulation):
 * gradients are scaled by 1/global_targets and accumulate (+=) into the
 * FSDP shards, reduced over dp_shard (and dp_replicate under HSDP), so N
 * micro-batches give the gradient of one batch N times larger. *loss
 * receives this micro-batch's loss sum over the whole dp group divided by
 * global_targets (one all-reduce over dp): the sum over micro-batches is
 * the step's mean loss. A mixture-of-experts config with
 * output_router_logits adds router_aux_loss_coef × the load-balancing loss
 * of this micro-batch's tokens over the whole dp group (model/moe.h
 * ml_moe_aux_begin; transformers' *ForCausalLM.forward adds it per forward
 * call, so N micro-batches add N terms) to *loss and to the gradients; the
 * objective path (ml_engine_forward_backward_batch) differentiates it too. */
int ml_engine_forward_backward(ml_engine *e, const int32_t *ids, const uint8_t *mask, int64_t B,
                               int64_t S, int64_t global_targets, double *loss);

/* A local (micro-)batch in full: token ids [B, S]; mask [B, S] (NULL:
 * all 1; mask[b, i] = 1: token i is a target, predicted from the tokens
 * before it); packed documents: docs [ndocs + 1] (NULL: one sequence per
 * row) offsets into the flattened B·S tokens, document d = tokens docs[d]
 * .. docs[d+1] − 1, each attending to itself only with positions from 0
 * (FlashAttention's cu_seqlens; needs B = 1 and ml_engine_can_pack), the
 * tokens from docs[ndocs] on padding (no target, nothing reads them); the
 * last token of a document is never a target. obj [B, S] (NULL: NLL):
 * position i's objective inputs, those of the target token i + 1. */
typedef struct ml_engine_batch {
  const int32_t *ids;
  const uint8_t *mask;
  int64_t B, S;
  const int64_t *docs;
  int64_t ndocs;
  const ml_obj_in *obj;
} ml_engine_batch;

/* Mixed precision: a unit's floating-point inputs are cast to param_dtype
 * (FSDP2's cast_forward_inputs, MixedPrecisionPolicy), and the gradients
 * its bf16 backward hands on are bf16 too: under param_dtype bf16 the
 * residual stream (or its gradient) [B, s_res, H] of m is rounded to bf16
 * values (fp32 storage) at every unit boundary. ml_engine_casts_units is
 * the rule; the decoder layers apply it (model.h ml_layer_cast), each
 * boundary once: ml_engine_layer_cast gives layer l's flags in the
 * engine's loops, which run every layer upward in the forward (the
 * engine's step, generation's forward: the embedding's output cast by
 * layer 0, each layer's output by its residual add, the last one's for the
 * head) and downward from the last to e->bwd_first in the backward (the
 * head's gradient cast by the last layer, each layer's input gradient by
 * its residual add for the layer below, none below e->bwd_first: the
 * embedding's backward reads it unrounded). ml_engine_layer_cast: the
 * flags of layer l's forward (backward: of its backward) in those loops.
 * Unless ml_engine_casts_units nothing is rounded: the forward's layers
 * still hand the residual stream on by their adds (ML_CAST_FP32: layer 0
 * copies x into its x_in, each layer's add stores into the next one's x_in,
 * the last one's into x), and the backward's flags are 0. */
bool ml_engine_casts_units(const ml_engine *e);
unsigned ml_engine_layer_cast(const ml_engine *e, int l, bool backward);

/* Whether batches of packed documents run here: no context parallelism
 * (its ring owns the attention), a backend with block attention. */
bool ml_engine_can_pack(const ml_engine *e);

/* Forward + backward of batch b under objective `o`: NULL, the NLL with
 * every target's gradient weight global_scale (1/global_targets: the mean
 * of ml_engine_forward_backward); else b->obj gives every target's weight
 * and inputs (parallel/objective.h) and global_scale is unused. Gradients
 * accumulate (+=) into the FSDP shards as ml_engine_forward_backward's.
 * *sums (with o) += the objective's terms of this rank's targets; *nll =
 * the NLL sum and target count of this rank's targets (cp ranks: their
 * pieces; no reduction over ranks). Errors: a malformed batch (docs), an
 * objective without b->obj, those of ml_engine_forward_backward. */
int ml_engine_forward_backward_batch(ml_engine *e, const ml_engine_batch *b,
                                     const ml_objective *o, float global_scale,
                                     ml_obj_sums *sums, ml_loss_out *nll);

/* Per-token log-probs of batch b (mask and obj unused): out [B, S−1] as
 * ml_engine_logprobs; with packed documents the entries of each
 * document's last token (no target) are 0. */
int ml_engine_logprobs_batch(ml_engine *e, const ml_engine_batch *b, float *out);

/* What ml_engine_scores_batch writes (host memory; NULL / 0: not wanted):
 * logprobs [B, S−1] as ml_engine_logprobs_batch; entropy [B, S−1] the
 * entropy (nats) of the distribution at each position (of the token after
 * it); topk_logprobs, topk_ids [B, S−1, topk] the topk largest log-probs
 * there, best first in the logits' order, equal logits by the lower id
 * (parallel/loss.h ml_loss_extra). */
typedef struct ml_engine_scores {
  float *logprobs;
  float *entropy;
  int64_t topk;
  float *topk_logprobs;
  int32_t *topk_ids;
  /* host, one double: the MoE load-balancing term cfg.aux_coef · aux of this forward's
     sparse layers over the whole batch (every data rank's tokens, dp_cp), counted as the
     training forward counts it (ml_engine_forward_backward_batch; model/moe.h
     ml_moe_aux_begin), the same on every rank; 0 without cfg.router_aux. transformers
     adds it to the loss in eval as in training (Qwen3MoeForCausalLM / MixtralForCausalLM
     .forward: loss += router_aux_loss_coef · load_balancing_loss_func(...) whenever
     output_router_logits, whatever module.training is). Collective over dp_cp. */
  double *aux;
} ml_engine_scores;

/* Forward only over batch b (mask and obj unused): what `out` asks for, in
 * the original order (cp ranks: gathered, as ml_engine_logprobs). Errors:
 * those of ml_engine_logprobs_batch, topk < 0 or above vocab_size, topk
 * with cp > 1 (not implemented), a NULL topk output with topk > 0. */
int ml_engine_scores_batch(ml_engine *e, const ml_engine_batch *b, const ml_engine_scores *out);

/* Forward only: the NLL of batch b's targets (b->mask; b->obj must be NULL)
 * as the training loss computes it (the same forward and loss pass, no
 * gradient): *nll = this rank's NLL sum and target count (cp ranks: their
 * pieces; no reduction over ranks), so that the sums over the data ranks
 * (dp_cp) over the targets' count is the mean NLL the training step would
 * report for b at these weights. Errors: those of ml_engine_logprobs_batch. */
int ml_engine_nll_batch(ml_engine *e, const ml_engine_batch *b, ml_loss_out *nll);

/* hold: from now on forwards leave every FSDP unit unsharded (each
 * all-gathered once, by the first forward), as NeMo RL's
 * unshard_fsdp2_model around a whole inference pass; !hold: reshard every
 * unit now and return to FSDP2's policy. */
void ml_engine_hold_params(ml_engine *e, bool hold);

/* Per-token log-probs of one local batch ids [B, S]: out [B, S−1],
 * out[b, t] = log p(ids[b, t+1] | ids[b, ≤t]), in the original order on
 * every cp rank (one all-gather over cp). Forward only. */
int ml_engine_logprobs(ml_engine *e, const int32_t *ids, int64_t B, int64_t S, float *out);

/* Global norm of the gradients over the mesh (ARCHITECTURE.md §7,
 * torch.nn.utils.clip_grad_norm_ norm_type): norm_type 2 = L2 (local sums of
 * squares in fp64, summed over dp_shard × cp × tp), INFINITY = max |g|
 * (MAX). Each parameter counted once (ml_engine_owned_rows). A NaN or Inf
 * gradient makes the norm non-finite. Collective over the world (one
 * all-reduce of one double). This rank's part comes from the partials the
 * last backward computed when ml_engine_norm_ahead asked for this
 * norm_type (engine/grad_norm.h; taken: a second call makes the pass),
 * else from one pass over the gradients now: the same bits either way.
 * Errors: norm_type, allocation, the backend's. */
int ml_engine_grad_norm(ml_engine *e, double norm_type, double *norm);

/* The rows of unit's parameter i this rank's copy stands for, the one copy
 * of them that counts in the grad norm and that run checkpoints write: *nr
 * of its FSDP shard's rows from shard row *skip on. None on an HSDP replica
 * > 0 of the unit (an expert unit has none: ep_shard spans the replicas);
 * of a TP-replicated parameter, all on tp rank 0 and none elsewhere, but
 * all of an expert unit's on every rank (under ep the experts are not
 * replicated over tp: each rank holds its ep rank's, parallel/ep.h);
 * of a k_proj / v_proj whose kv heads several tp ranks hold, those of the
 * heads this rank owns (ml_tp_param_slice); else all. */
void ml_engine_owned_rows(const ml_engine *e, const ml_fsdp_unit *unit, int i, int64_t *skip,
                          int64_t *nr);

/* Collective: whether any rank holds a non-finite gradient; if so, *name
 * (cap bytes) receives the HF name of the first such parameter in export
 * order (the same on every rank). Returns 1 (found), 0 (none) or −1. */
int ml_engine_find_nonfinite(ml_engine *e, char *name, size_t cap);

/* Multiply every gradient by max_norm / (norm + 1e-6) when that is < 1
 * (torch.nn.utils.clip_grad_norm_). */
int ml_engine_clip(ml_engine *e, double norm, double max_norm);

typedef struct ml_adamw_cfg {
  double lr, beta1, beta2, eps, weight_decay;
} ml_adamw_cfg;

/* One AdamW step (torch.optim.AdamW) on every local shard; then, where
 * parameters stay unsharded between steps (ZeRO-1/2), all-gather them
 * again. e->step counts the steps taken. Errors: the all-gather. */
int ml_engine_adamw(ml_engine *e, const ml_adamw_cfg *cfg);

/* ml_engine_clip then ml_engine_adamw in one pass over each unit's shard
 * (the clip factor applied by the AdamW kernel as it reads a gradient, the
 * scaled gradient stored as ml_engine_clip leaves it): the same gradients,
 * parameters and moments bit for bit, one read and write of the gradients
 * fewer. Errors: ml_engine_adamw's. */
int ml_engine_clip_adamw(ml_engine *e, double norm, double max_norm, const ml_adamw_cfg *cfg);

/* After the fp32 shards were overwritten from outside (a run checkpoint
 * loaded): refresh what is derived from them — the persistent unsharded
 * parameters of ZeRO-1/2. Collective over dp_shard. */
int ml_engine_sync_params(ml_engine *e);

#endif
