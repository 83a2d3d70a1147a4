/* Model families as rows of one descriptor table (ARCHITECTURE.md §8): every
 * difference between Llama, Mistral, Phi-3, Qwen2, Qwen3, Gemma3 (text model,
 * and the text tower of the Gemma3 VLM), Qwen3-MoE, Qwen2-MoE and Mixtral is a field here, read by the config reader
 * and the model code, never an `if (family == ...)`. Semantics follow the
 * transformers 5.23 modeling_* / configuration_* files of each family. */
#ifndef ML_FAMILY_H
#define ML_FAMILY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/types.h"

/* How a config without `layer_types` assigns "sliding_attention" /
 * "full_attention" to its layers (the __post_init__ of each config class). */
typedef enum {
  ML_LAYERS_ALL_FULL,   /* Llama: no sliding-window layers */
  ML_LAYERS_MAX_WINDOW, /* Qwen2/Qwen3: sliding iff use_sliding_window and i >= max_window_layers */
  ML_LAYERS_PATTERN,    /* Gemma3: sliding iff (i + 1) % sliding_window_pattern != 0 */
  /* Mistral: every layer slides when sliding_window is set (not null), none
   * when it is null; layer_types is not read (MistralModel ignores it) */
  ML_LAYERS_ALL_SLIDING,
  /* Qwen2-MoE: sliding iff use_sliding_window, (i + 1) % 2 != 0 and i <
   * max_window_layers (Qwen2MoeConfig.__post_init__) */
  ML_LAYERS_EVEN_BELOW_MAX,
} ml_layer_rule;

enum { ML_FAMILY_MAX_UNSUPPORTED = 4, ML_FAMILY_MAX_FUSED = 2, ML_FUSED_MAX_PARTS = 3 };

/* A checkpoint tensor that stacks several modules' parameters on dim 0, as
 * transformers' Phi3Attention.qkv_proj holds [q_proj; k_proj; v_proj]: the
 * checkpoint-key adapter (model.h ml_model_ckpt_keys) splits it on load and
 * fuses it on export; inside meshlm the parts are separate modules (so TP
 * shards each by heads). Names under "layers.N.", parts in stacking order,
 * consecutive in the block (model/block.h); .weight and .bias alike. */
typedef struct ml_fused {
  const char *leaf;                        /* "self_attn.qkv_proj"; NULL: unused slot */
  const char *parts[ML_FUSED_MAX_PARTS + 1]; /* "self_attn.q_proj", ...; NULL-terminated */
} ml_fused;

typedef struct ml_family {
  const char *name;         /* --arch name: "llama" */
  const char *architecture; /* config.json architectures[0]: "LlamaForCausalLM" */
  const char *model_type;   /* config.json model_type */
  /* HF module name prefix of the text model: "model.", "model.language_model." */
  const char *prefix;
  /* Checkpoint (safetensors) keys, which name the parameters: the text
   * model's tensors are ckpt_prefix + their name inside it, lm_head's weight
   * is ckpt_lm_head + ".weight". Text models: "model.", "lm_head" (= the
   * module names); transformers 5 saves Gemma3ForConditionalGeneration in
   * the legacy layout: "language_model.model.", "language_model.lm_head". */
  const char *ckpt_prefix;
  const char *ckpt_lm_head;
  /* Composite (vision-language) checkpoints: the text model's hyper-parameters
   * are nested under this config.json key, whose model_type is
   * text_model_type; NULL for text-only families. tie_word_embeddings and the
   * dtype stay top-level. */
  const char *text_config_key;
  const char *text_model_type;
  /* The family whose layout a trained checkpoint is saved in (meshlm keeps
   * only the text tower of a composite model), or NULL for this one. */
  const char *save_as;

  /* ---- config.json keys and defaults ---- */
  /* q/k/v (and o) bias: read from config key `qkv_bias_key` (default
   * qkv_bias_default), or fixed to qkv_bias_default when the key is NULL. */
  const char *qkv_bias_key;
  bool qkv_bias_default;
  bool o_bias_follows_qkv;    /* o_proj has it too (Llama/Qwen3/Gemma3 attention_bias; not Qwen2) */
  bool has_mlp_bias_key;      /* Llama's `mlp_bias` */
  bool tie_default;           /* tie_word_embeddings when config.json omits it */
  double rope_theta_default;  /* rope_theta when config.json omits it, and in presets */
  int64_t max_positions_default; /* max_position_embeddings when config.json omits it */
  /* Phi3Config's top-level original_max_position_embeddings (default when
   * omitted), which RoPE's llama3 / yarn / longrope entries take over theirs
   * (standardize_rope_params); 0: the family has no such key. */
  int64_t original_max_default;
  /* The config class's default bos_token_id, eos_token_id, pad_token_id
   * (Phi3Config: 1, 32000, 32000); a config meshlm writes sets to null those
   * outside its vocabulary, which transformers refuses (the padding_idx of
   * nn.Embedding). 0 where the class default fits every vocabulary. */
  int64_t token_id_defaults[3];
  int64_t head_dim_default;   /* head_dim when omitted; 0: hidden_size / num_attention_heads */
  const char *hidden_act_key; /* "hidden_act" or "hidden_activation" (Gemma3) */
  const char *hidden_act;     /* its only accepted value */
  /* Keys that must be absent, null or false (features not implemented:
   * Gemma3's logit soft-capping, bidirectional attention). */
  const char *unsupported[ML_FAMILY_MAX_UNSUPPORTED];

  /* ---- sliding-window layers and their RoPE ---- */
  ml_layer_rule layer_rule;
  int64_t sliding_window_default; /* `sliding_window` when omitted */
  int64_t sliding_pattern_default; /* ML_LAYERS_PATTERN: sliding_window_pattern when omitted */
  /* Sliding layers use their own RoPE: rope_local_base_freq (transformers 4)
   * or rope_parameters.sliding_attention (5); false: the global one. */
  bool local_rope;
  double rope_local_theta_default;

  /* ---- module structure and arithmetic ---- */
  float norm_offset;      /* RMSNorm weight offset: x·(offset + w) (Gemma3RMSNorm: 1) */
  ml_glu_act act;              /* MLP gate activation */
  bool has_qk_norm;       /* self_attn.q_norm / k_norm: RMSNorm(head_dim) per head before RoPE */
  /* HF names (under layers.N.) of the decoder layer's norms by role; NULL
   * where the family has none. Llama: x += attn(attn_norm(x));
   * x += mlp(mlp_norm(x)). Gemma3 ("sandwich"): x += attn_out_norm(attn(attn_norm(x)));
   * x += mlp_out_norm(mlp(mlp_norm(x))). */
  const char *attn_norm;     /* "input_layernorm" */
  const char *attn_out_norm; /* Gemma3 "post_attention_layernorm" */
  /* Llama/Qwen "post_attention_layernorm", Gemma3 "pre_feedforward_layernorm" */
  const char *mlp_norm;
  const char *mlp_out_norm;  /* Gemma3 "post_feedforward_layernorm" */
  bool embed_scale_sqrt_hidden; /* embeddings × sqrt(hidden_size): Gemma3TextScaledWordEmbedding */
  /* Attention scores scale = s^-0.5 with s read from this key (default
   * attn_scalar_default); NULL: s = head_dim. */
  const char *attn_scalar_key;
  double attn_scalar_default;

  /* ---- checkpoint layout ---- */
  ml_fused fused[ML_FAMILY_MAX_FUSED]; /* fused tensors of the block (Phi-3) */

  /* ---- tensor-parallel plans (parallel/plan.h), JSON {pattern: style}
   * relative to `prefix` ---- */
  /* The optimized plan, or NULL: the Llama-style plan of the block table
   * (a registered family may bring its own: meshlm_register_family). */
  const char *tp_plan;
  /* transformers' class attribute base_model_tp_plan, the HF plan when
   * config.json carries none (as PreTrainedConfig.base_model_tp_plan), or
   * NULL. */
  const char *hf_tp_plan;

  /* ---- mixture of experts (transformers' Qwen3MoeSparseMoeBlock,
   * MixtralSparseMoeBlock): NULL moe_block: every layer's MLP is dense ---- */
  /* The sparse block's module name under "layers.N." ("mlp",
   * "block_sparse_moe"): its router is <moe_block>.gate ([E, H]), expert e's
   * SwiGLU MLP <moe_block>.experts.<e>.<expert_leaves[0..2]> (gate, up, down:
   * "gate_proj", "up_proj", "down_proj"; Mixtral "w1", "w3", "w2"), the
   * per-expert layout transformers 5.23's save_pretrained writes. */
  const char *moe_block;
  const char *expert_leaves[3];
  /* config.json key of the experts' intermediate size ("moe_intermediate_size";
   * Mixtral: "intermediate_size", its only MLP) and its default when omitted
   * (0: required). num_experts (alias num_local_experts, both classes'
   * attribute_map) and num_experts_per_tok default to experts_default and
   * top_k_default. */
  const char *moe_inter_key;
  int64_t moe_inter_default, experts_default, top_k_default;
  /* config key renormalizing the top-k weights (Qwen3-MoE "norm_topk_prob",
   * default false), or NULL: always renormalized (MixtralTopKRouter) */
  const char *norm_topk_key;
  /* decoder_sparse_step and mlp_only_layers choose dense layers (Qwen3-MoE:
   * layer l is sparse iff l is not in mlp_only_layers and (l + 1) %
   * decoder_sparse_step == 0); false: every layer is sparse (Mixtral). */
  bool moe_sparse_keys;

  /* ML_LAYERS_ALL_SLIDING: the window applies only when use_sliding_window
   * is true (Qwen3MoeConfig.__post_init__ sets sliding_window to None
   * otherwise); false: whenever sliding_window is set (Mistral, Mixtral). */
  bool window_gated;

  /* ---- a shared expert in the sparse block (transformers 5.23
   * Qwen2MoeSparseMoeBlock; DeepSeekMoE's shared experts): NULL
   * shared_expert: none ---- */
  /* <moe_block>.<shared_expert> is a SwiGLU MLP every token takes
   * (<shared_expert>.<expert_leaves[0..2]>: gate [I_s, H], up [I_s, H],
   * down [H, I_s]), its output scaled by sigmoid(<moe_block>.<shared_gate>
   * (h)), a [1, H] linear, and added to the routed experts' sum; I_s is
   * config key shared_inter_key ("shared_expert_intermediate_size"),
   * shared_inter_default when omitted. */
  const char *shared_expert, *shared_gate, *shared_inter_key;
  int64_t shared_inter_default;
  /* The one config key of the expert count, read and written, where the
   * config class has no attribute_map alias (Qwen2MoeConfig: "num_experts");
   * NULL: num_experts or num_local_experts read, num_local_experts written
   * (Qwen3MoeConfig, MixtralConfig). */
  const char *experts_key;
} ml_family;

/* Families registered at run time (meshlm_register_family), at most. */
enum { ML_FAMILY_MAX_REGISTERED = 32 };

/* Add family f to the table for this process (the row is copied; its
 * strings must outlive the process). Errors: an architecture or name
 * already in the table, the table full, a fused tensor whose parts are not
 * consecutive linears of the block (model/block.h). */
int ml_family_register(const ml_family *f);

/* The family whose architecture string is `architecture`, or NULL. */
const ml_family *ml_family_by_architecture(const char *architecture);
/* The family called `name` (--arch), or NULL. */
const ml_family *ml_family_by_name(const char *name);
/* "LlamaForCausalLM, Qwen2ForCausalLM, ..." (for messages). */
const char *ml_family_list_architectures(void);
/* "llama, qwen2, ..." (families `meshlm init` can write: save_as NULL). */
const char *ml_family_list_names(void);

/* The family a checkpoint of `f` is saved as (f->save_as, else f). */
const ml_family *ml_family_saved(const ml_family *f);
/* Rename parameter (checkpoint key) `name` of family `from` into the
 * checkpoint layout of `to`: a leading from->ckpt_prefix becomes
 * to->ckpt_prefix, a leading from->ckpt_lm_head becomes to->ckpt_lm_head
 * ("language_model.model.norm.weight" → "model.norm.weight",
 * "language_model.lm_head.weight" → "lm_head.weight"). Errors: the result
 * does not fit `cap` bytes. */
int ml_family_rename(const ml_family *from, const ml_family *to, const char *name, char *out,
                     size_t cap);

#endif
