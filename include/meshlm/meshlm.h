/* meshlm — the library: train and score Hugging Face decoder language models
 * (Llama, Mistral, Phi-3, Qwen2, Qwen3, Gemma 3; others registered with
 * meshlm_register_family) over a device mesh from C, as an RL loop
 * drives its policy (NVIDIA NeMo RL's DTensorPolicyWorker: get_logprobs,
 * train with a policy-gradient loss, refit the generation engine).
 *
 * Link: `pkg-config --cflags --libs meshlm` (libmeshlm.so and Open MPI).
 *
 * Conventions of every call
 * - Return 0 on success, −1 on error. The message of the last error is the
 *   session's own (meshlm_error), not process-global; meshlm_open always
 *   hands out a session, also on failure, so that its message can be read.
 * - Collective calls (marked COLLECTIVE) must be made by every rank of the
 *   session's communicator, in the same order. Each begins by comparing
 *   the call with every rank's: a rank that calls another collective at
 *   that point fails the call on every rank with a message naming both
 *   calls (instead of a hang). On any error of a collective call every rank
 *   returns −1 with the first failing rank's message; the session stays
 *   usable unless the message says otherwise.
 * - Data parallelism: each data-parallel rank passes its own sequences; the
 *   tp and cp ranks of one data-parallel rank (meshlm_info's dp_rank) must
 *   pass identical batches (checked: a hash of the batch is compared).
 * - Sequences are variable length, never padded by the caller: a batch of
 *   n sequences is `lens` [n] and the tokens of all of them concatenated,
 *   [Σ lens] int32 ids. Per-token inputs and outputs are "prediction
 *   aligned": sequence k of len L has L − 1 of them, entry t for token t + 1
 *   predicted from tokens 0..t (HF's logits[:, :-1] against input_ids[:, 1:]),
 *   concatenated over sequences: [Σ (lens − 1)] in all.
 * - Log-probs are natural logs (nats), fp32; sums are accumulated in fp64.
 * - Buffers are the caller's: read during the call only, or written by it.
 * - Threads: a session is used by one thread at a time. The library asks MPI
 *   for MPI_THREAD_FUNNELED when it initialises MPI itself.
 * - MPI: this header does not include <mpi.h> (an application may use any
 *   MPI; the communicator crosses the ABI as its Fortran handle, an int64_t:
 *   meshlm_open_f). meshlm/meshlm_mpi.h adds meshlm_open(…, MPI_Comm, …).
 * - Struct sizes (the ABI): every struct the caller allocates and the library
 *   reads or writes begins with `size_t struct_size`, sizeof(T) as the
 *   caller compiled it: set by the *_default functions (meshlm_options,
 *   meshlm_loss, meshlm_sampling), else by the caller (`meshlm_info i =
 *   {sizeof i};`, and in every element of a meshlm_tensor array). The
 *   library takes any size from the struct's minimum (named at each
 *   struct_size: the struct with the fields of its first 0.1 layout; those
 *   appended during 0.1 are optional) to its own sizeof:
 *   fields beyond the caller's size are not read (they take their defaults:
 *   *_default's, or 0 / NULL) and not written (nothing past struct_size is
 *   touched). A smaller or larger size is refused, the message naming the
 *   struct and both sizes. Fields are only ever appended, so a program built
 *   against this header runs with any later libmeshlm.so.0.
 * - ABI history: 0.2.0 added struct_size (first field) and took <mpi.h> out of
 *   this header (meshlm_open moved to meshlm_mpi.h as an inline function):
 *   it breaks 0.1's layouts, under the same SONAME (libmeshlm.so.0) —
 *   rebuild programs built against 0.1. From 0.2 on the layouts only grow.
 * Semantics: the CLI's (README, `meshlm <command> --help`), the torch /
 * NeMo functions named at each call. */
#ifndef MESHLM_H
#define MESHLM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define MESHLM_API __attribute__((visibility("default")))
#else
#define MESHLM_API
#endif

#define MESHLM_VERSION_MAJOR 0
#define MESHLM_VERSION_MINOR 2
#define MESHLM_VERSION_PATCH 0

/* "0.2.0". */
MESHLM_API const char *meshlm_version(void);

typedef struct meshlm_session meshlm_session;

/* Data types of parameters and of exported / refitted tensors. */
typedef enum meshlm_dtype {
  MESHLM_DTYPE_SOURCE = 0, /* export / refit: each tensor in the source checkpoint's dtype */
  MESHLM_DTYPE_F32 = 1,
  MESHLM_DTYPE_BF16 = 2
} meshlm_dtype;

/* Activation checkpointing of every decoder layer (torch
 * checkpoint_wrapper): none, full (recompute the layer), selective (keep
 * the GEMM outputs, recompute the rest), mlp (recompute the MLP block) —
 * the CLI's none, layer, selective, mlp. */
typedef enum meshlm_ac {
  MESHLM_AC_NONE = 0,
  MESHLM_AC_FULL = 1,
  MESHLM_AC_SELECTIVE = 2,
  MESHLM_AC_MLP = 3
} meshlm_ac;

/* FSDP2's reshard_after_forward: DEFAULT frees every decoder layer's
 * gathered parameters after its forward but the last layer's and the
 * root's (torchtitan's policy), ALWAYS every unit's, NEVER none's. */
typedef enum meshlm_reshard {
  MESHLM_RESHARD_DEFAULT = 0,
  MESHLM_RESHARD_ALWAYS = 1,
  MESHLM_RESHARD_NEVER = 2
} meshlm_reshard;

/* Learning-rate schedules: linear warmup from 0, then constant, or linear /
 * cosine decay to min_lr on step total_steps − 1 (transformers'
 * get_cosine_with_min_lr_schedule_with_warmup; README "Schedule"). */
typedef enum meshlm_schedule {
  MESHLM_LR_CONSTANT = 0,
  MESHLM_LR_LINEAR = 1,
  MESHLM_LR_COSINE = 2
} meshlm_schedule;

/* Everything a session is opened with. Start from meshlm_options_default.
 * The training settings are the CLI's (`meshlm train`): README.md
 * "Defaults" lists each with its flag, its config key and both defaults. */
typedef struct meshlm_options {
  size_t struct_size;        /* sizeof(meshlm_options); minimum offsetof(meshlm_options,
                                grad_norm_type): the fields from grad_norm_type on then take
                                their defaults */
  /* the device mesh: dp_replicate × dp_shard × cp × tp (tp fastest),
     dp_shard = world / (dp_replicate · cp · tp) */
  int dp_replicate, cp, tp;
  const char *device;        /* "cpu" (default) or "cuda" (one GPU per rank) */
  const char *parallel_plan; /* NULL/"auto", "optimized", "hf", "default" or a plan file */
  int sequence_parallel;     /* 1: norms and residuals Shard(1) over tp */
  meshlm_dtype param_dtype;  /* F32 or BF16: FSDP2 MixedPrecisionPolicy.param_dtype */
  meshlm_dtype reduce_dtype; /* F32 or BF16: its reduce_dtype */
  meshlm_ac ac;
  /* AdamW (torch.optim.AdamW) and the schedule of meshlm_train_step */
  double lr, min_lr, beta1, beta2, eps, weight_decay;
  meshlm_schedule schedule;
  int64_t warmup_steps, total_steps;
  double max_grad_norm; /* clip_grad_norm_ (in grad_norm_type) before each step; 0: none */
  /* scoring and training micro-batches: sequences are packed into micro-
     batches of at most this many tokens per rank (a longer sequence is one
     micro-batch of its own) */
  int64_t micro_batch_tokens;
  /* meshlm_logprobs: all-gather every FSDP unit once per call and keep the
     whole model unsharded until it returns (NeMo RL's unshard_fsdp2_model
     around inference), instead of once per micro-batch: fewer all-gathers,
     the whole model's parameters in memory for the call */
  int unshard_for_inference;
  /* the grad norm and FSDP2 (appended in 0.1; optional: see struct_size) */
  double grad_norm_type;                /* clip_grad_norm_'s norm_type: 2 (L2) or INFINITY
                                           (max |g|, math.h) */
  meshlm_dtype output_dtype;            /* F32 or BF16: MixedPrecisionPolicy.output_dtype (the
                                           logits') */
  meshlm_reshard reshard_after_forward;
  int zero;                             /* ZeRO stage: 3 parameters, gradients and optimizer
                                           state sharded; 2 parameters whole between steps;
                                           1 gradients too */
  int prefetch_forward, prefetch_backward; /* FSDP units all-gathered ahead (0: none) */
  /* appended in 0.2 (optional: see struct_size) */
  int cpu_offload; /* 1: FSDP2's CPUOffloadPolicy (NeMo's cpu_offload): the parameter shards,
                      their gradients and the AdamW state in host memory (pinned on CUDA),
                      each shard copied to the device before its all-gather, the reduced
                      gradients copied back, the optimizer step on the host; the same
                      numbers as without (README: --cpu-offload) */
  /* appended later in 0.2 (optional: see struct_size) */
  int batch_invariant; /* 1: every token's log-prob is the same bit pattern whatever batch,
                          padding, packing, micro_batch_tokens, dp or cp size or KV-cache step
                          computes it — meshlm_logprobs, the training forward and
                          meshlm_generate's out_logprobs alike (vLLM's VLLM_BATCH_INVARIANT):
                          GEMMs and attention in one fixed reduction order, no vocab
                          parallelism; under tp the vocab-sharded logits are gathered
                          into whole rows and each row-parallel linear (o_proj,
                          down_proj) is computed whole on every tp rank from its
                          all-gathered input and weight, so the tp size (default
                          plans, sequence parallelism, uneven head splits, LoRA
                          adapters) does not change the bits either; CPU only
                          (README: --batch-invariant) */
  /* appended for frozen parameters (optional: see struct_size) */
  const char *freeze; /* NULL or "": train every parameter; else comma-separated fnmatch
                         patterns of HF parameter names to freeze (requires_grad=False, as
                         NeMo Automodel / torch users set it before fully_shard), e.g.
                         "model.embed_tokens.*,model.layers.0.*": no gradient, no AdamW
                         state or update, not in the grad norm; a pattern matching nothing,
                         or every parameter frozen, fails meshlm_open (README: --freeze);
                         copied */
  /* appended for expert parallelism (optional: see struct_size) */
  int ep; /* expert-parallel size of the mixture-of-experts layers (default 1: none): the
             experts split over groups of ep consecutive ranks, tokens sent to their experts'
             ranks by all-to-all (NeMo Automodel's ep_size; README: --ep); the world must be
             a multiple of ep, num_experts too, and the model a MoE family, else meshlm_open
             fails naming the values */
  /* appended for LoRA (optional: see struct_size; README: --lora-rank). PEFT LoraConfig's
     semantics: rank-r adapters lora_A [r, in], lora_B [out, r] on the target linears,
     y = W·x + scaling·B·A·x, scaling lora_alpha / r (lora_alpha / sqrt(r) with rslora);
     every base weight frozen; lora_A Kaiming-uniform from lora_seed, lora_B 0 */
  int64_t lora_rank;        /* 0: no LoRA unless `adapter` is set; else r >= 1 */
  double lora_alpha;        /* default 8 */
  double lora_dropout;      /* [0, 1): PEFT's dropout on lora_A's input in training; with
                               `adapter`, 0 (its lora_dropout) or the adapter's value */
  const char *lora_targets; /* comma-separated linear module names (q_proj,v_proj) or
                               "all-linear" (default: every decoder linear); copied */
  int lora_use_rslora;      /* 1: scaling lora_alpha / sqrt(r) */
  const char *adapter;      /* NULL, or a PEFT LoRA adapter directory (adapter_config.json +
                               adapter_model.safetensors) to start from; its configuration
                               rules when lora_rank is 0, else must equal the options'; copied */
  int64_t lora_seed;        /* seed of lora_A's initialisation (default 0) */
  /* appended for mixed-dtype FSDP units (optional: see struct_size) */
  const char *fp32_params; /* NULL or "": only the mixture-of-experts routers; else also the
                              parameters whose HF names these comma-separated fnmatch patterns
                              match, e.g. "model.layers.*.self_attn.o_proj.weight": kept and
                              computed in fp32 under param_dtype bf16 (fp32 all-gather and
                              GEMMs; NeMo Automodel's fully_shard_by_dtype); a pattern matching
                              nothing fails meshlm_open (README: --fp32-params); copied */
  /* appended for inference-only sessions (optional: see struct_size) */
  int inference_only; /* 1: the session only scores and generates (an RL reference or
                         log-prob worker; `meshlm logprobs` always is): no gradients or AdamW
                         state ever, and under param_dtype BF16 (without cpu_offload) each
                         FSDP unit's weights held in bf16 alone, rounded once from the
                         checkpoint (the same log-probs bit for bit as a session without it),
                         no fp32 master shards (parameters kept in fp32, fp32_params and MoE
                         routers, keep their units' fp32 shards). Refused on it, naming
                         inference_only: meshlm_train_step, meshlm_zero_grad,
                         meshlm_forward_backward, meshlm_optimizer_step, meshlm_resume; and
                         where bf16 alone is held, what reads fp32 masters: meshlm_save,
                         meshlm_export(_merged), meshlm_refit(_lora, _into), meshlm_generate
                         with sampling.replica 1. meshlm_reload and meshlm_reload_tensors
                         load new weights into it (rounded once to bf16). 0 (default):
                         training allowed. (README: Library, inference_only) */
} meshlm_options;

/* One rank's mesh (1 × world × 1 × 1 with the communicator's size), CPU,
 * micro_batch_tokens 4096, unshard_for_inference 1, and the training
 * settings' defaults of the library (README.md "Defaults", the engine's
 * one table: src/engine/settings.h): plan auto, no SP, fp32, FSDP2's
 * reshard policy, ZeRO-3, prefetch 1 / 2, no CPU offload, no AC; AdamW lr 1e-5, min_lr 0,
 * betas (0.9, 0.999), eps 1e-8, weight decay 0.01 (the CLI's: lr 3e-4,
 * weight decay 0), constant schedule, no warmup, total_steps 1;
 * max_grad_norm 1.0 in the L2 norm. meshlm_options_init writes the first
 * struct_size bytes of them (struct_size included); a struct_size out of
 * range (see "Struct sizes") returns −1 with only o->struct_size written,
 * which meshlm_open then refuses with the sizes named. meshlm_options_default
 * is meshlm_options_init with the size this header gives. */
MESHLM_API int meshlm_options_init(meshlm_options *o, size_t struct_size);
static inline int meshlm_options_default(meshlm_options *o) {
  return meshlm_options_init(o, sizeof *o);
}

/* COLLECTIVE over the communicator with Fortran handle comm_f
 * (MPI_Comm_c2f's MPI_Fint, widened; mpi4py's comm.py2f()), or over
 * MPI_COMM_WORLD when comm_f < 0 or MPI is not initialised yet. Open the HF
 * checkpoint `model_dir` (config.json + safetensors; Llama, Mistral, Phi-3,
 * Qwen2, Qwen3, Gemma 3, or a registered family) sharded over the mesh of
 * `o` (NULL: defaults) on the ranks of
 * the communicator (the session duplicates it). Initialises MPI
 * (MPI_Init_thread, FUNNELED) when nobody has; see meshlm_finalize. *out
 * always receives a session: on failure (−1) meshlm_error(*out) says why
 * (the file, field or option, found and expected; o's struct_size) and the
 * session can only be closed. *out is NULL only when even that could not be
 * allocated. C callers with <mpi.h>: meshlm_open (meshlm/meshlm_mpi.h)
 * takes an MPI_Comm. */
MESHLM_API int meshlm_open_f(const char *model_dir, const meshlm_options *o, int64_t comm_f,
                             meshlm_session **out);

/* COLLECTIVE (when the session opened). Free everything; s may be NULL.
 * A rank that closes while the others make another collective call fails
 * their call (call order, naming meshlm_close) and leaves the session: on
 * the others every later collective call fails at once, naming that rank,
 * and their meshlm_close frees without communicating (it returns). */
MESHLM_API void meshlm_close(meshlm_session *s);

/* MPI_Finalize if the library initialised MPI and nobody finalised it
 * since; call after the last meshlm_close (the Python binding does at
 * exit). Returns 0, or −1 when MPI_Finalize failed. */
MESHLM_API int meshlm_finalize(void);

/* The last error's message on s ("" when none; never NULL). It names the
 * world rank it arose on. Valid until the next call on s. */
MESHLM_API const char *meshlm_error(const meshlm_session *s);

/* Where this rank stands and what the model is. */
typedef struct meshlm_info {
  size_t struct_size;                   /* sizeof(meshlm_info), set by the caller; minimum
                                           offsetof(meshlm_info, max_seq_len) */
  int rank, world;                      /* in the session's communicator */
  int dp_replicate, dp_shard, cp, tp;   /* mesh sizes */
  int dp_rank, dp_size;                 /* data-parallel rank (dp_replicate × dp_shard) */
  int cp_rank, tp_rank;
  int64_t vocab_size, hidden_size, num_layers, num_params;
  int32_t bos_token_id, eos_token_id;   /* −1: none in config.json */
  int64_t step;                         /* optimizer steps taken (meshlm_train_step, resume) */
  int64_t max_seq_len;                  /* the longest sequence the model takes, in tokens:
                                           max_position_embeddings (with dynamic RoPE scaling
                                           meshlm's limit, 2^24) */
} meshlm_info;
/* Not collective. Errors: s NULL or not open, out->struct_size out of
 * range. */
MESHLM_API int meshlm_get_info(meshlm_session *s, meshlm_info *out);

/* A batch of variable-length token sequences (conventions above). */
typedef struct meshlm_seqs {
  int64_t n;             /* sequences on this rank, >= 0 */
  const int64_t *lens;   /* [n] tokens of each, 1 <= len <= max_position_embeddings */
  const int32_t *tokens; /* [Σ lens] token ids in [0, vocab_size) */
} meshlm_seqs;

/* COLLECTIVE. Per-token log-probs, out[t] = log p(token t+1 | tokens
 * 0..t) of each sequence, prediction aligned: out [Σ (lens − 1)] fp32
 * (NeMo RL get_logprobs without its leading 0). mask (NULL: all) [Σ (lens −
 * 1)], each 0 or 1: where 0, out is 0 and the token is left out of the sums. seq_sums
 * (NULL: not wanted) [n] fp64: Σ out over each sequence (log p of the
 * masked tokens given what precedes them, e.g. of a completion). Forward
 * only, vocab-parallel (no rank holds full-vocabulary logits). Sequences
 * are packed into micro-batches of options.micro_batch_tokens without
 * padding; with unshard_for_inference each FSDP unit is all-gathered once
 * per call, else once per micro-batch. Errors: a length or id out of
 * range (which sequence, which value), a mask entry other than 0/1, differing batches on the tp/cp
 * ranks of a data-parallel rank, allocation. */
MESHLM_API int meshlm_logprobs(meshlm_session *s, const meshlm_seqs *batch, const uint8_t *mask,
                               float *out, double *seq_sums);

/* The reference policy (the KL penalty's π_ref) in the same session, as
 * NeMo RL's DTensorPolicyWorker keeps reference_model_state_dict and swaps
 * it in for get_reference_policy_logprobs (use_reference_model): a frozen
 * copy of the weights as FSDP shards beside the policy's — fp32, no
 * gradient, no AdamW state, no second model — 4Ψ/N bytes per rank (Ψ
 * parameters over N = dp_shard·cp·tp ranks: each rank's shard; in the
 * device memory, or the host's under cpu_offload). */

/* COLLECTIVE (every rank calls it; no communication). Capture the
 * session's current weights as the reference: right after meshlm_open for
 * the initial policy (NeMo's init_reference_model), or later to move the
 * reference (e.g. after meshlm_reload_tensors of other weights). A second
 * call overwrites the first's copy in place. Errors: allocation (agreed:
 * every rank returns −1 and no reference is kept where it failed). */
MESHLM_API int meshlm_set_reference(meshlm_session *s);

/* COLLECTIVE. meshlm_logprobs (same arguments, outputs and errors, the
 * messages naming meshlm_reference_logprobs) computed with the reference's
 * weights; the policy's weights, gradients and AdamW state are as before
 * the call.
 * The numbers are bitwise those of a session opened on the captured
 * weights on the same mesh and options. Errors: also no reference
 * captured. */
MESHLM_API int meshlm_reference_logprobs(meshlm_session *s, const meshlm_seqs *batch,
                                         const uint8_t *mask, float *out, double *seq_sums);

/* The objective of a training step. Per prediction t (of sequence k) with
 * mask m_t, log-prob lp_t under the current weights, weight A_t =
 * token_weights[t] · seq_weights[k] (1 where NULL):
 *   NLL:          ℓ_t = −lp_t                           (SFT; NeMo RL NLLLoss)
 *   WEIGHTED_NLL: ℓ_t = −A_t · lp_t                     (REINFORCE / GRPO without a ratio)
 *   CLIPPED_PG:   r_t = exp(lp_t − old_t),
 *                 ℓ_t = max(−A_t·r_t, −A_t·clip(r_t, 1 − ratio_clip_min, 1 + ratio_clip_max)),
 *                 and where A_t < 0 and ratio_clip_c > 1: min(ℓ_t, −A_t·ratio_clip_c)
 *                 (dual clip) — NeMo RL ClippedPGLossFn (PPO, GRPO, DAPO's decoupled clip)
 * plus, for WEIGHTED_NLL and CLIPPED_PG with kl_penalty β > 0, β·k3_t where
 *   k3_t = exp(ref_t − lp_t) − (ref_t − lp_t) − 1        (Schulman's k3;
 * NeMo RL calculate_kl_penalty_joschu2020, reference_policy_kl_penalty).
 * Normalised over the global batch of the step (all ranks), so every mesh
 * gives the same loss: token level (NeMo token_level_loss: true):
 *   loss = Σ_t m_t ℓ_t / Σ_t m_t, sums over every masked prediction of the
 * step; sequence level (false): loss = Σ_k (Σ_{t∈k} m_t ℓ_t / Σ_{t∈k} m_t)
 * / #{k : Σ_{t∈k} m_t > 0}. Gradients are those of this loss (torch.max's
 * and clamp's subgradients: none through a clipped ratio). Importance
 * sampling (meshlm_is_level) corrects CLIPPED_PG for a generator's
 * log-probs; CUSTOM is any other loss of the log-probs
 * (meshlm_objective_chunk). Not supported: NeMo's on-policy KL
 * approximation. */
typedef enum meshlm_loss_kind {
  MESHLM_LOSS_NLL = 0,
  MESHLM_LOSS_WEIGHTED_NLL = 1,
  MESHLM_LOSS_CLIPPED_PG = 2,
  MESHLM_LOSS_CUSTOM = 3 /* the caller's objective: meshlm_loss.objective */
} meshlm_loss_kind;

/* A caller's objective (MESHLM_LOSS_CUSTOM): the loss as a function of the
 * per-token log-probs, evaluated by the engine after the vocab-parallel
 * log-softmax of each chunk of targets, as NeMo RL's loss functions take
 * next_token_logprobs (LossInputType.LOGPROB) and return the loss whose
 * gradient backward carries to the logits: dL/dlogits = −∂L/∂lp_t ·
 * (softmax − onehot) per target, so full-vocabulary logits never exist.
 *
 * When: once per chunk of targets of each micro-batch (the fused
 * classifier's token blocks, parallel/loss.h), during the forward +
 * backward; the targets of one sequence may come in several calls and in
 * any order. On which rank: every rank, on the trained targets (mask 1)
 * of its own batch only (under context parallelism the positions this cp
 * rank holds); every tp rank of a data-parallel rank with the same inputs,
 * so the function must be deterministic (a pure function of its inputs and
 * of data the caller fixed before the call). What it may not do: call
 * collectives or any meshlm function (ranks call it different numbers of
 * times), keep the pointers after it returns.
 *
 * Inputs, entry i of n (n >= 1): logprobs[i] = lp_t (nats, fp32, the
 * current weights); index[i]: the target's place in this rank's
 * prediction-aligned batch arrays (meshlm_train_batch: token_weights,
 * old_logprobs, … — and any array of the caller's of that layout, e.g.
 * rewards, held through ctx); seq[i]: its sequence in this rank's batch;
 * weight[i]: its weight in the built-in normalisation of
 * meshlm_loss.sequence_level (token level: 1 / global masked targets;
 * sequence level: 1 / (its sequence's masked targets × global sequences
 * with one)); seq_logprobs [seqs.n] (NULL unless
 * meshlm_loss.objective_seq_logprobs): each sequence's Σ over its masked
 * targets of lp_t under the same weights, from a forward-only pass before
 * the first micro-batch (the sequence-sum-then-gradient scheme: DPO's
 * pairwise sums, GSPO's sequence ratio; lp_t in the calls and in the sums
 * are the same numbers, the forward being deterministic); global_tokens,
 * global_sequences: masked targets and sequences with one over the global
 * batch of the call (every data-parallel rank).
 * Outputs: loss[i], the target's term of the loss, already normalised
 * (the loss reported is Σ of every term over the global batch: the
 * function chooses how a sequence's or a pair's loss is split over its
 * targets); grad[i] = ∂loss/∂lp_t. Return 0, or nonzero for an error:
 * then the step's loss is NaN (the step is skipped, meshlm_step_result.
 * skip_reason naming the call) and the meshlm call returns −1 on every
 * rank after the pass (its collectives finish first).
 * Pairwise (DPO): chosen and rejected sequences of a pair in the same
 * rank's batch (e.g. adjacent, as NeMo RL's PreferenceLossFn splits
 * [::2], [1::2]), the pair's loss from seq_logprobs, ∂L/∂lp_t = ∂L/∂S_k
 * for each target of sequence k. */
typedef struct meshlm_objective_chunk {
  size_t struct_size;        /* sizeof(meshlm_objective_chunk) of the library */
  int64_t n;
  const float *logprobs;     /* [n] */
  const int64_t *index;      /* [n] */
  const int64_t *seq;        /* [n] */
  const float *weight;       /* [n] */
  const double *seq_logprobs; /* [seqs.n] or NULL */
  int64_t global_tokens, global_sequences;
  double *loss;              /* [n] out */
  double *grad;              /* [n] out */
} meshlm_objective_chunk;
typedef int (*meshlm_objective_fn)(void *ctx, const meshlm_objective_chunk *c);

/* Importance-sampling correction between the generator's log-probs and the
 * trainer's (meshlm_train_batch.generation_logprobs), NeMo RL
 * nemo_rl/algorithms/loss_functions.py ClippedPGLossFn
 * (use_importance_sampling_correction, sequence_level_importance_ratios,
 * truncated_importance_sampling_ratio / _min / _type): a weight ρ, constant
 * in the current weights (detached), multiplies CLIPPED_PG's clipped term
 * (not its KL):
 *   TOKEN:    ρ_t = exp(old_t − gen_t)
 *   SEQUENCE: ρ_t = exp(Σ_{masked s∈k} (old_s − gen_s)) for every t of k
 * (a NaN or ±Inf ρ of finite inputs becomes 0: torch.nan_to_num(nan=0,
 * posinf=0, neginf=0); a non-finite old_t or gen_t of a masked target gives
 * ρ_t NaN instead, a non-finite loss: the step is skipped, the input named),
 * then truncation:
 *   TIS:          ρ ← min(ρ, is_ratio_max)
 *   ICEPOP:       ρ ← 0 where ρ ∉ [is_ratio_min, is_ratio_max]
 *   SEQ_MASK_TIS: ρ ← 0 over a sequence whose geometric mean
 *                 exp(mean_{masked t} nan_to_num(old_t − gen_t)) ∉
 *                 [is_ratio_min, is_ratio_max]; kept ones keep ρ. */
typedef enum meshlm_is_level {
  MESHLM_IS_OFF = 0,
  MESHLM_IS_TOKEN = 1,
  MESHLM_IS_SEQUENCE = 2
} meshlm_is_level;
typedef enum meshlm_is_truncation {
  MESHLM_IS_TRUNC_NONE = 0,
  MESHLM_IS_TRUNC_TIS = 1,
  MESHLM_IS_TRUNC_ICEPOP = 2,
  MESHLM_IS_TRUNC_SEQ_MASK_TIS = 3
} meshlm_is_truncation;

typedef struct meshlm_loss {
  size_t struct_size;     /* sizeof(meshlm_loss); minimum offsetof(meshlm_loss, objective) */
  meshlm_loss_kind kind;
  int sequence_level;     /* 0: token-level normalisation, 1: sequence-level */
  float ratio_clip_min;   /* ε_low (NeMo ratio_clip_min), >= 0 */
  float ratio_clip_max;   /* ε_high (ratio_clip_max), >= 0 */
  float ratio_clip_c;     /* dual clip c > 1, or 0: off */
  float kl_penalty;       /* β >= 0; > 0 needs ref_logprobs */
  /* appended in 0.2 (the minimum ends before them): */
  meshlm_objective_fn objective; /* MESHLM_LOSS_CUSTOM: the objective (above), with ctx */
  void *objective_ctx;
  int objective_seq_logprobs;    /* CUSTOM: 1 = compute seq_logprobs first (one more forward) */
  meshlm_is_level is_level;      /* CLIPPED_PG: importance-sampling correction (above); not OFF
                                    needs generation_logprobs; SEQUENCE needs sequence_level */
  meshlm_is_truncation is_truncation;
  float is_ratio_min, is_ratio_max; /* truncation bounds (TIS reads max only), 0 <= min <= max */
  /* appended (a caller's struct_size may end before it: 0): */
  float entropy_coef;     /* c: an entropy bonus, loss − c·H̄ with H̄ = the masked
                             predictions' entropies H_t = −Σ_v p_v log p_v of the whole
                             distribution, normalised as the loss (token or sequence
                             level); its gradient exact on the logits (dH_t/dl_v =
                             −p_v(log p_v + H_t)), computed vocab-parallel in the fused
                             classifier; any kind; finite; 0: off (NeMo RL's
                             entropy_loss_coeff, verl's entropy_coeff) */
} meshlm_loss;

/* NLL, token level, ε 0.2/0.2, no dual clip, β 0; _init and _default as
 * meshlm_options_init / _default's. */
MESHLM_API int meshlm_loss_init(meshlm_loss *l, size_t struct_size);
static inline int meshlm_loss_default(meshlm_loss *l) { return meshlm_loss_init(l, sizeof *l); }

/* One optimizer step's batch on this rank (every array prediction aligned
 * [Σ (lens − 1)] unless said otherwise; NULL where not needed). */
typedef struct meshlm_train_batch {
  size_t struct_size;          /* sizeof(meshlm_train_batch), set by the caller; minimum
                                  offsetof(meshlm_train_batch, generation_logprobs) */
  meshlm_seqs seqs;
  const uint8_t *token_mask;   /* 1: trained, 0: not (NeMo token_mask[:, 1:]; any other
                                  value is refused); NULL: all */
  const float *token_weights;  /* per-token weights / advantages; NULL: 1 */
  const float *seq_weights;    /* [n] per-sequence weights / advantages; NULL: 1 */
  const float *old_logprobs;   /* CLIPPED_PG: log-probs of the policy that sampled
                                  (NeMo prev_logprobs) */
  const float *ref_logprobs;   /* kl_penalty > 0: the reference policy's */
  /* appended in 0.2 (the minimum ends before it): */
  const float *generation_logprobs; /* the generator's (NeMo generation_logprobs): with
                                  old_logprobs, the mismatch metrics of meshlm_step_result
                                  and loss.is_level's correction */
  /* appended (router replay): */
  const int32_t *routing;      /* NULL, or [Σ lens, num_hidden_layers, num_experts_per_tok]:
                                  each token's experts at each layer, as meshlm_scores.routing
                                  returns them; the sparse layers route by them instead of
                                  their top-k (a row starting with a negative entry, e.g. a
                                  dense layer's −1: the token's own top-k). Gates: the router's
                                  softmax at the recorded experts (renormalized when
                                  norm_topk_prob), gradients through them, the load-balancing
                                  loss counting the recorded routing — Megatron-LM's router
                                  replay (R3, PR #4168), model/moe.h. Refused under cp > 1
                                  (tp > 1 allowed, with or without ep), or for a model without
                                  experts (named). */
} meshlm_train_batch;

typedef struct meshlm_step_result {
  size_t struct_size;   /* sizeof(meshlm_step_result), set by the caller; minimum
                           offsetof(meshlm_step_result, nonfinite_param) */
  double loss;          /* the step's loss (above), same on every rank */
  double kl;            /* its KL part: Σ m_t β k3_t normalised as the loss (0 without KL) */
  double clip_fraction; /* CLIPPED_PG: masked predictions whose gradient the clip removed,
                           over all masked predictions */
  double grad_norm;     /* global norm (options.grad_norm_type) before clipping (torch
                           clip_grad_norm_'s return) */
  double lr;            /* the learning rate this step used */
  int64_t tokens;       /* masked predictions over the whole global batch */
  int64_t sequences;    /* sequences over the whole global batch */
  int64_t step;         /* optimizer steps taken after this one */
  int skipped;          /* 1: the grad norm was not finite; no update was made */
  char nonfinite_param[160]; /* skipped: the HF name of the first parameter with a non-finite
                                gradient (model order), "" when every gradient is finite (the
                                norm overflowed) or the step was not skipped */
  /* appended in 0.2: */
  double token_mult_prob_error; /* with generation_logprobs and old_logprobs (else 0), NeMo RL
                                   ClippedPGLossFn's metrics over the masked targets m of the
                                   global batch: mean_m exp(|gen_t − old_t|) */
  double gen_kl_error;          /* mean_m k3(gen ‖ old) = exp(old_t − gen_t) − (old_t − gen_t)
                                   − 1 */
  double is_oob_fraction;       /* with is_truncation: the fraction of masked targets (of
                                   sequences, SEQ_MASK_TIS) whose ρ was out of the bounds */
  char skip_reason[256];        /* skipped: why (a non-finite loss and its first non-finite
                                   per-token input on this rank, a failed objective call, a
                                   non-finite grad norm); "" otherwise */
  /* appended (written when the caller's struct_size holds it): */
  double entropy;       /* with loss.entropy_coef ≠ 0: H̄, the masked predictions' mean
                           entropy (nats) normalised as the loss, at the step's weights
                           (before the update); 0 otherwise */
} meshlm_step_result;

/* COLLECTIVE. One optimizer step on the global batch (every data-parallel
 * rank's `b`): zero the gradients, forward + backward of `loss` (NULL:
 * meshlm_loss_default) over micro-batches of options.micro_batch_tokens
 * (gradient accumulation, as one batch), global grad norm, clipping to
 * max_grad_norm, AdamW at the schedule's lr for this step — the CLI's step
 * (src/engine/step.h). A non-finite loss (e.g. NaN in an input it reads)
 * or grad norm skips the update (result.skipped, skip_reason, the parameter
 * named) but counts the step. A rank
 * may pass n = 0 sequences. Errors: as meshlm_logprobs; a struct_size out of
 * range (b, loss, out); a loss field out of
 * range or an array the loss needs left NULL (named); no masked prediction
 * in the whole global batch. */
MESHLM_API int meshlm_train_step(meshlm_session *s, const meshlm_train_batch *b,
                                 const meshlm_loss *loss, meshlm_step_result *out);

/* Split steps: meshlm_train_step is exactly (bitwise) meshlm_zero_grad,
 * meshlm_forward_backward, meshlm_optimizer_step, in that order, as a torch
 * loop writes optimizer.zero_grad(); loss.backward(); clip_grad_norm_();
 * optimizer.step() (NeMo RL's policy train(), verl's
 * forward_backward_batch + optimizer step).
 *
 * COLLECTIVE. meshlm_zero_grad: zero the accumulated gradients and the
 * accumulated results (torch optimizer.zero_grad()). */
MESHLM_API int meshlm_zero_grad(meshlm_session *s);

/* COLLECTIVE. Forward + backward of `loss` on the global batch b (as
 * meshlm_train_step's), the gradients added (+=) to those accumulated
 * since meshlm_zero_grad. Normalisation: each call by its own global batch
 * (the loss is Σ over its targets / its global masked targets or
 * sequences), as one torch loss.backward() per call: k calls accumulate
 * the sum of k means, as NeMo RL normalises every micro-batch by the
 * global valid tokens of the batch its train() call was given
 * (global_valid_toks); to train on one mean over several calls' data pass
 * it in one call (it is split into micro-batches of
 * options.micro_batch_tokens anyway). out (NULL: not wanted): this call's
 * loss, kl, clip_fraction, tokens, sequences and mismatch metrics;
 * grad_norm, lr 0, step the steps taken so far; skipped 1 with
 * skip_reason when this call's loss is not finite (the next
 * meshlm_optimizer_step then skips). Errors: as meshlm_train_step's. */
MESHLM_API int meshlm_forward_backward(meshlm_session *s, const meshlm_train_batch *b,
                                       const meshlm_loss *loss, meshlm_step_result *out);

/* COLLECTIVE. The optimizer step on the accumulated gradients: global grad
 * norm, then a skipped step (a non-finite loss in any forward_backward since
 * meshlm_zero_grad, or a non-finite norm: skip_reason says which) or
 * clipping to max_grad_norm and AdamW at the schedule's lr; the step counts
 * either way (meshlm_train_step's policy). The gradients stay (zero them
 * with meshlm_zero_grad). out (NULL: not wanted): loss, kl, clip_fraction,
 * tokens, sequences and the mismatch metrics summed over the
 * forward_backward calls since zero_grad (their ratios over the summed
 * counts), grad_norm, lr, step, skipped, nonfinite_param, skip_reason.
 * Errors: a struct_size out of range. */
MESHLM_API int meshlm_optimizer_step(meshlm_session *s, meshlm_step_result *out);

/* COLLECTIVE. The loss of `loss` on the global batch b at the current
 * weights, forward only: no gradient is touched (NeMo RL train(...,
 * eval_mode=True)). out: as meshlm_forward_backward's (grad_norm 0). A
 * CUSTOM objective is called on the trained targets of each micro-batch
 * of this data rank's batch (every tp and cp rank of it with the same
 * inputs: the log-probs are gathered over cp); its grad outputs are read
 * and dropped. A mixture-of-experts model with output_router_logits adds
 * router_aux_loss_coef times its load-balancing loss, as training does and
 * as transformers' Qwen3MoeForCausalLM / MixtralForCausalLM forward does
 * in eval too (so out->loss = meshlm_forward_backward's at these weights).
 * Errors: as meshlm_train_step's. */
MESHLM_API int meshlm_eval_loss(meshlm_session *s, const meshlm_train_batch *b,
                                const meshlm_loss *loss, meshlm_step_result *out);

/* COLLECTIVE. Run checkpoints (`meshlm train --save / --resume`'s format:
 * sharded weights, AdamW state, the step; any mesh can resume any other's).
 * save writes a new checkpoint under dir (created) and commits it
 * atomically; resume loads the latest committed one. Errors: I/O (path
 * named), a checkpoint of another model. */
MESHLM_API int meshlm_save(meshlm_session *s, const char *dir);
MESHLM_API int meshlm_resume(meshlm_session *s, const char *dir);

/* COLLECTIVE. Write the current weights as an HF checkpoint in dir (the
 * source model's config.json, tokenizer and untrained tensors carried over;
 * trained tensors in dtype), as `meshlm export`. Nothing is left of a
 * failed export. */
MESHLM_API int meshlm_export(meshlm_session *s, const char *dir, meshlm_dtype dtype);

/* The HF tensors of the model, in refit order (i in [0, meshlm_num_weights)).
 * With LoRA (meshlm_options.lora_rank / adapter) the adapters are among them,
 * named without PEFT's prefix ("model.layers.0.self_attn.q_proj.lora_A.weight"),
 * F32, beside the unchanged (frozen) base weights. */
typedef struct meshlm_weight {
  size_t struct_size; /* sizeof(meshlm_weight), set by the caller (the minimum) */
  const char *name;   /* HF name, e.g. "model.layers.0.self_attn.q_proj.weight" */
  int ndim;           /* 1 or 2 */
  int64_t shape[2];
  meshlm_dtype dtype; /* the source checkpoint's (F32 or BF16; F16 sources read as F32) */
} meshlm_weight;
/* Not collective. −1 (with s's message) on a session that is not open;
 * weight_info also on an index or out->struct_size out of range. */
MESHLM_API int64_t meshlm_num_weights(meshlm_session *s);
MESHLM_API int meshlm_weight_info(meshlm_session *s, int64_t i, meshlm_weight *out);

/* Receives one full (unsharded) tensor during meshlm_refit: data
 * [shape] row-major in dtype (F32 or BF16), nbytes long, valid during the
 * call. Return 0 to go on, non-zero to stop the refit (every rank then
 * fails with "refit stopped by the callback"). */
typedef int (*meshlm_tensor_fn)(void *ctx, const char *name, meshlm_dtype dtype, int ndim,
                                const int64_t *shape, const void *data, size_t nbytes);

/* COLLECTIVE. Refit: the current weights, full and in HF names, streamed
 * one tensor at a time (refit order) to rank `root` of the session, or to
 * every rank when root < 0, without files — what NeMo RL's refit hands to
 * vLLM. dtype: SOURCE, F32 or BF16. fn is called on the receiving rank(s)
 * only (it may be NULL elsewhere). Each tensor is assembled from the
 * shards (as meshlm_export) in host memory: the receiver holds one full
 * tensor at a time beyond its shards. Equal, byte for byte, to the tensors
 * meshlm_export writes with the same dtype. */
MESHLM_API int meshlm_refit(meshlm_session *s, int root, meshlm_dtype dtype, meshlm_tensor_fn fn,
                            void *ctx);
/* COLLECTIVE. meshlm_refit into caller memory: bufs[i] receives tensor i
 * (meshlm_weight_info's shape, in `dtype`'s element size) on the receiving
 * rank(s); bufs may be NULL elsewhere. */
MESHLM_API int meshlm_refit_into(meshlm_session *s, int root, meshlm_dtype dtype,
                                 void *const *bufs);

/* A full tensor handed to meshlm_reload_tensors. */
typedef struct meshlm_tensor {
  size_t struct_size; /* sizeof(meshlm_tensor), set by the caller (the minimum); the
                         array's stride is tensors[0].struct_size, the same in every
                         element */
  const char *name; /* HF name */
  meshlm_dtype dtype; /* F32 or BF16 */
  int ndim;
  int64_t shape[2];
  const void *data;
} meshlm_tensor;

/* COLLECTIVE. Replace the weights (not the optimizer state nor the step):
 * from an HF checkpoint directory with the model's shapes, every parameter;
 * or from caller memory, the n tensors given (each rank passes the same
 * full tensors and keeps its shard of them; others stay). Errors: a
 * missing or unknown tensor, a shape other than config.json's (named), a
 * struct_size out of range or differing from tensors[0]'s;
 * reload_tensors: a value that is not finite (NaN, ±inf: the tensor and
 * its first such index named) — nothing is reloaded then. */
MESHLM_API int meshlm_reload(meshlm_session *s, const char *dir);
MESHLM_API int meshlm_reload_tensors(meshlm_session *s, int64_t n, const meshlm_tensor *tensors);

/* Sampling of meshlm_generate. */
typedef struct meshlm_sampling {
  size_t struct_size;     /* sizeof(meshlm_sampling) (the minimum: offsetof(meshlm_sampling, n)) */
  int64_t max_new_tokens; /* 1 .. meshlm_info.max_seq_len − the longest prompt's length
                             (max_seq_len − 1 without prompts); checked before anything is
                             allocated */
  float temperature;      /* > 0; logits / temperature */
  float top_p;            /* (0, 1]: nucleus sampling over the smallest set of tokens whose
                             probability reaches top_p (vLLM / transformers TopPLogitsWarper) */
  int greedy;             /* 1: argmax (temperature and top_p ignored) */
  int32_t eos_token_id;   /* stop a sequence after it; −1: the model's (config.json), −2: none */
  uint64_t seed;          /* the sampler's RNG: same seed, same tokens */
  /* Appended during 0.2 (optional: a caller's struct_size without them gives their
   * defaults). The warpers apply as
   * transformers' for do_sample: temperature, top_k, top_p, min_p, in that order. */
  int64_t n;              /* samples per prompt (GRPO's group), >= 1: output rows
                             prompts.n x n, row k·n + j sample j of prompt k; the prompt is
                             prefilled once, its full KV blocks shared by each sample */
  int64_t top_k;          /* >= 0: keep the top_k most probable tokens (ties at the k-th
                             kept; TopKLogitsWarper); 0: off */
  float min_p;            /* [0, 1]: keep tokens with probability >= min_p x the most
                             probable's (MinPLogitsWarper); 0: off */
  int64_t n_stop;         /* >= 0: stop ids besides eos_token_id */
  const int32_t *stop_token_ids;      /* [n_stop] a sequence stops after any of them */
  const int64_t *max_new_tokens_per;  /* [prompts.n] each prompt's own max_new_tokens, 1 ..
                                         max_new_tokens; NULL: max_new_tokens for all */
  int64_t max_running;    /* sequences decoding at once (continuous batching: a finished one's
                             KV slot goes to the next prompt), >= n; 0: all, at most 256 */
  int64_t prefill_tokens; /* prompt tokens per forward (chunked prefill), >= 0; 0: 512 */
  /* Appended by issue 31 item 2 (optional, as above). */
  int replica;            /* 0: generate on the policy's own mesh and weights (refit-free: tp
                             ranks decode together, each data-parallel rank its own prompts,
                             FSDP units unsharded for the call; cp > 1 refused); 1: on a
                             one-rank replica per rank, refitted from the policy when it
                             changed (each rank its own prompts, any mesh) */
  /* Appended by issue 31 item 1 (optional, as above). */
  int64_t max_kv_bytes;   /* the paged KV cache's pool, bytes a rank, >= 0 (vLLM's KV cache
                             budget): prompts enter as the blocks their samples need now (and
                             for their next token) free up, and a sequence that finds no free
                             block preempts the last-arrived running one (recompute: it
                             re-enters later, its outputs the same; meshlm_call_stats
                             .preemptions); 0: room for max_running sequences to their end */
} meshlm_sampling;
/* max_new_tokens 32, temperature 1, top_p 1, not greedy, eos from the
 * model, seed 0, n 1, top_k 0, min_p 0, no stop ids, max_new_tokens for
 * every prompt, max_running 0, prefill_tokens 0, replica 0, max_kv_bytes 0; _init and _default as meshlm_options_init / _default's. */
MESHLM_API int meshlm_sampling_init(meshlm_sampling *sp, size_t struct_size);
static inline int meshlm_sampling_default(meshlm_sampling *sp) {
  return meshlm_sampling_init(sp, sizeof *sp);
}

/* COLLECTIVE (each data-parallel rank samples its own prompts; n may differ
 * between them and be 0).
 * Continue each prompt with up to max_new_tokens sampled tokens, with a KV
 * cache. Where (sp->replica):
 *  - 0: on the policy's own mesh and weights (refit-free): the tp ranks of
 *    a data-parallel rank decode its prompts together under the training
 *    plan and must pass identical prompts and sampling (checked: their
 *    hashes are compared, as for every batch of this API), and each returns
 *    the same outputs; FSDP units are all-gathered for the call and
 *    resharded after. A mesh with cp > 1 is refused (use replica 1).
 *    Tokens and log-probs equal a one-rank session's up to the order of the
 *    tp row-parallel sums (tests/tolerance.h); bitwise in the
 *    batch-invariant mode (meshlm_options.batch_invariant).
 *    Under expert parallelism (ep > 1) the ranks of an ep group step
 *    together: a rank whose prompts are done (or n = 0) runs steps of zero
 *    tokens for the others' experts until all are done, and an error on one
 *    rank of the group before a step fails the call on every rank of it.
 *  - 1: on a replica of the current weights that every rank holds (the
 *    generation engine of NeMo RL, refitted from the policy when it changed
 *    since the last call: one meshlm_refit to every rank); every rank,
 *    tp and cp ranks included, samples its own prompts. out_tokens [n,
 * max_new_tokens] int32, row k's first out_lens[k] entries generated (the
 * eos included), the rest −1; out_logprobs (NULL: not wanted) [n,
 * max_new_tokens]: log p of each generated token under the model at
 * temperature 1 (the distribution meshlm_logprobs scores), 0 past the end.
 * With sp->n > 1 the outputs have prompts.n x n rows (meshlm_generate_samples).
 * Errors: sp->struct_size out of range; max_new_tokens beyond meshlm_info.max_seq_len − the longest
 * prompt (meshlm_sampling's bound), other sampling fields out of range
 * (named), replica other than 0 or 1, and with replica 0: cp > 1, tp ranks
 * of a data-parallel rank with different prompts or sampling; allocation. */
MESHLM_API int meshlm_generate(meshlm_session *s, const meshlm_seqs *prompts,
                               const meshlm_sampling *sp, int32_t *out_tokens, int64_t *out_lens,
                               float *out_logprobs);

/* Why a generated sequence ended (meshlm_generate_samples' out_finish). */
enum { MESHLM_FINISH_STOP = 1, MESHLM_FINISH_LENGTH = 2 };

/* COLLECTIVE, as meshlm_generate (which is this call with out_finish NULL),
 * with sp->n samples per prompt: every output has R = prompts.n x sp->n
 * rows, row k·n + j sample j of prompt k (out_tokens, out_logprobs [R,
 * max_new_tokens], out_lens [R]); out_finish (NULL: not wanted) [R]
 * int32: MESHLM_FINISH_STOP (eos_token_id or a stop_token_ids id, included
 * in the tokens) or MESHLM_FINISH_LENGTH (its max_new_tokens). All
 * sequences decode together (one forward per token over every running
 * sequence, continuous batching); a sequence's tokens and log-probs do not
 * depend on the other prompts of the call (its draws: a function of seed
 * and its row). Errors: meshlm_generate's, and n < 1, top_k < 0, min_p
 * outside [0, 1], n_stop < 0 or a stop id out of range, a per-prompt
 * max_new_tokens outside 1 .. max_new_tokens, max_running in 1 .. n − 1,
 * prefill_tokens < 0 (each named). */
MESHLM_API int meshlm_generate_samples(meshlm_session *s, const meshlm_seqs *prompts,
                                       const meshlm_sampling *sp, int32_t *out_tokens,
                                       int64_t *out_lens, float *out_logprobs,
                                       int32_t *out_finish);

/* What the last meshlm_logprobs or meshlm_train_step (or meshlm_generate: its
 * preemptions alone) did on this rank:
 * its micro-batches and the collectives each mesh group issued (torch's
 * CommDebugMode counts), from the mesh's counting communicators. The FSDP
 * group (dp_shard × cp) carries the parameter all-gathers (one per FSDP
 * unit — a decoder layer, the root — per micro-batch, or per call under
 * unshard_for_inference) and the gradient reduce-scatters, and under
 * vocab parallelism (embed_tokens / lm_head rows split over that group)
 * per micro-batch: one all-gather of the token ids and one of lm_head's
 * input, one reduce-scatter of the embedding, the log-softmax statistics'
 * all-reduces (and, training, the reduce-scatter of lm_head's input
 * gradient). */
typedef struct meshlm_call_stats {
  size_t struct_size;   /* sizeof(meshlm_call_stats), set by the caller; minimum
                           offsetof(meshlm_call_stats, nonfinite_logprobs) */
  int64_t micro_batches;
  int64_t tokens;       /* token positions computed (padding included) */
  int64_t padding;      /* of them padding: the packed rows' tails */
  int64_t fsdp_all_gathers, fsdp_reduce_scatters, fsdp_all_reduces;
  int64_t fsdp_bytes;   /* bytes of those collectives' full buffers per rank */
  int64_t tp_collectives, cp_collectives, dp_replicate_collectives;
  int64_t nonfinite_logprobs; /* meshlm_logprobs: entries of out that are not finite (NaN or
                                 ±inf, from weights or activations that overflowed; masked
                                 entries are 0), what the CLI writes as null and warns of;
                                 0 after meshlm_train_step */
  /* Appended for preemption (optional: an older struct_size leaves it out). */
  int64_t preemptions;        /* meshlm_generate / _samples (which set it and zero every other
                                 field): sequences preempted for want of KV blocks in
                                 max_kv_bytes, each re-entering later by prefilling its prompt
                                 and generated tokens again (vLLM's recompute preemption);
                                 0 after meshlm_logprobs and meshlm_train_step */
} meshlm_call_stats;
/* Not collective. Errors: s not open, out->struct_size out of range. */
MESHLM_API int meshlm_last_call_stats(meshlm_session *s, meshlm_call_stats *out);

/* A model family registered from outside the tree, as NeMo Automodel's
 * register_parallel_strategy and transformers' AutoConfig.register add a
 * model class: an HF architecture that meshlm reads as a built-in family's
 * decoder block (`base`: its config keys and defaults, norms, activation,
 * RoPE) under its own architecture and model_type, with optional fused
 * checkpoint tensors and its own tensor-parallel plan. */
#define MESHLM_MAX_FUSED 2
typedef struct meshlm_fused {
  /* the fused tensor's module under "layers.N." ("self_attn.qkv_proj") and
     the block's linears it stacks on dim 0, in order ("self_attn.q_proj",
     "self_attn.k_proj", "self_attn.v_proj"; 2 or 3, consecutive in the block,
     NULL after the last); leaf NULL: unused */
  const char *leaf;
  const char *parts[4];
} meshlm_fused;

typedef struct meshlm_family {
  size_t struct_size;       /* sizeof(meshlm_family) as the caller compiled it (exactly) */
  const char *architecture; /* config.json architectures[0]: "MyLlamaForCausalLM" */
  const char *model_type;   /* config.json model_type */
  const char *name;         /* its short name in messages and plan names: "myllama" */
  const char *base;         /* the built-in family whose block it has: "llama", "qwen2",
                               "qwen3", "gemma3", "mistral", "phi3", "qwen3_moe",
                               "mixtral", "qwen2_moe" (the MoE settings, expert names and
                               shared expert come with it) */
  meshlm_fused fused[MESHLM_MAX_FUSED];
  /* Its optimized plan (--parallel-plan auto / optimized), as a JSON object
     {pattern: style} in the format of a --parallel-plan file (README), the
     patterns relative to the base model ("layers.*.self_attn.q_proj",
     "embed_tokens"; "lm_head" as is), or NULL: the base family's. A plan
     with SequenceParallel styles is the one --sequence-parallel uses. */
  const char *tp_plan_json;
} meshlm_family;

/* Register family f for this process (not collective: call it on every
 * rank, before meshlm_open or meshlm_cli_main opens such a checkpoint).
 * Strings are copied. Returns 0, or −1 with the reason in err (capacity
 * err_cap, NUL-terminated; may be NULL): struct_size unknown, a missing
 * field, an architecture or name already known, an unknown base, fused
 * parts that are not consecutive linears of the block, a plan that does not
 * parse (the key named). */
MESHLM_API int meshlm_register_family(const meshlm_family *f, char *err, size_t err_cap);

/* ---- Entropy and top-k log-probs (scoring for RL: verl's
 * compute_log_prob(calculate_entropy=True), NeMo RL's get_topk_logits) ---- */

/* What meshlm_score writes, each prediction aligned as meshlm_logprobs's
 * out (P = Σ (lens − 1) predictions, sequence after sequence); a NULL
 * pointer (topk 0) is an output not wanted. */
typedef struct meshlm_scores {
  size_t struct_size;     /* sizeof(meshlm_scores), set by the caller */
  float *logprobs;        /* [P] fp32: meshlm_logprobs's out, bit for bit */
  double *seq_sums;       /* [n] fp64: meshlm_logprobs's seq_sums */
  float *entropy;         /* [P] fp32: H_t = −Σ_v p_v log p_v (nats) of the whole
                             distribution that predicts token t+1 (verl
                             entropy_from_logits), computed vocab-parallel beside the
                             log-sum-exp: no rank holds full-vocabulary logits */
  int32_t topk;           /* k, 0 <= k <= vocab_size; 0: no top-k */
  float *topk_logprobs;   /* [P, k] fp32: the k largest log-probs at each prediction, best
                             first (NeMo RL get_topk_logits, as log-probs: logit −
                             log-sum-exp), so non-increasing; the entry of token v is
                             bitwise the log-prob meshlm_logprobs gives v as the next token */
  int32_t *topk_ids;      /* [P, k]: their token ids, in the logits' order: larger logit
                             first, equal logits by the lower id (two logits a rounding
                             apart may give equal log-probs: then the larger logit's first) */
  /* appended (router replay): */
  int32_t *routing;       /* NULL, or [Σ lens, num_hidden_layers, num_experts_per_tok]: for
                             every token (not prediction; the mask does not apply) the experts
                             each sparse layer chose, torch.topk's order; −1 at dense layers.
                             meshlm_train_batch.routing replays them. Refused under cp > 1
                             (tp > 1 allowed, with or without ep), or for a model without
                             experts (named) */
} meshlm_scores;

/* COLLECTIVE. meshlm_logprobs with the entropy and top-k outputs of `out`
 * (the same micro-batches and forward; each output optional). mask (NULL:
 * all) as meshlm_logprobs: where 0, logprobs and entropy are 0, the top-k
 * ids −1 and their log-probs 0. The top-k lists are merged over the
 * vocab-parallel ranks (tp, and the FSDP group under vocab parallelism):
 * each rank's k best per vocabulary tile, all-gathered and merged with
 * equal logits by the lower id, so the order is one total order however
 * the vocabulary is split. meshlm_last_call_stats reports it as a
 * meshlm_logprobs call (nonfinite_logprobs: of out->logprobs). Errors: those of
 * meshlm_logprobs, out->struct_size out of range, topk out of range, topk
 * > 0 with a NULL topk_logprobs or topk_ids, topk > 0 under context
 * parallelism (cp > 1: not implemented). */
MESHLM_API int meshlm_score(meshlm_session *s, const meshlm_seqs *batch, const uint8_t *mask,
                            const meshlm_scores *out);

/* ---- LoRA refit and merged export (issue 33 item 4) ---------------------------------- */

/* Which tensors of a LoRA session (meshlm_options.lora_rank / adapter)
 * meshlm_refit_lora streams. */
typedef enum meshlm_lora_view {
  MESHLM_LORA_ADAPTERS = 1, /* the adapters alone, under PEFT's keys
                               ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                               lora_A [r, in], lora_B [out, r]) as adapter_model.safetensors
                               holds them: what vLLM's LoRA loading (LoRAModel.from_lora_tensors
                               with the adapter_config.json meshlm_export writes) takes. SOURCE
                               dtype: F32 (the adapters' masters) */
  MESHLM_LORA_MERGED = 2    /* the base model's tensors (meshlm_weight_info's names, adapters
                               left out), each adapted weight W replaced by W + scaling·B·A
                               (PEFT's merge_and_unload; the product summed in double, rounded
                               once to fp32, then to dtype; SOURCE: the source checkpoint's
                               dtype): what a plain model (vLLM without LoRA) loads */
} meshlm_lora_view;

/* COLLECTIVE. meshlm_refit of a LoRA session's `view`: one full tensor at a
 * time (MESHLM_LORA_ADAPTERS: a fused module's lora_B — Phi-3's qkv_proj,
 * which meshlm_refit hands as its parts' rows, "…q_proj.lora_B.weight" — as
 * PEFT's one tensor "…qkv_proj.lora_B.weight"), in refit order, to rank `root` (every rank when root < 0), fn
 * called on the receiving rank(s) only. Merged weights are merged on the
 * fly, one tensor at a time (the adapters gathered on the receivers first,
 * 2·r·(in + out) floats per adapted linear): the receiver never holds a
 * second copy of the model. The merged view is byte for byte what
 * meshlm_export_merged writes with the same dtype. Errors: a session
 * without LoRA, view not MESHLM_LORA_ADAPTERS or _MERGED, meshlm_refit's. */
MESHLM_API int meshlm_refit_lora(meshlm_session *s, int root, meshlm_dtype dtype,
                                 meshlm_lora_view view, meshlm_tensor_fn fn, void *ctx);

/* COLLECTIVE. Write a LoRA session's merged model as an HF checkpoint in
 * dir (`meshlm train --export-hf DIR --merge-lora`: the source's
 * config.json, tokenizer and untrained tensors carried over, every adapted
 * weight W + scaling·B·A in dtype, no adapter). meshlm_export writes the
 * PEFT adapter directory instead. Errors: a session without LoRA,
 * meshlm_export's. */
MESHLM_API int meshlm_export_merged(meshlm_session *s, const char *dir, meshlm_dtype dtype);

/* The command-line program: `meshlm <command> [flags]` (argv[0] the
 * program name). Initialises and finalises MPI itself; returns the exit
 * status. The meshlm binary is this call. */
MESHLM_API int meshlm_cli_main(int argc, char **argv);

#ifdef __cplusplus
}
#endif

#endif
