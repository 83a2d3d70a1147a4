#include "model/family.h"

#include <stdio.h>
#include <string.h>

#include "common/status.h"
#include "model/block.h"

/* The config classes' base_model_tp_plan (transformers 5.23), the HF plan
 * of a checkpoint whose config.json carries none: LlamaConfig's (also
 * MistralConfig's and Qwen2Config's), and with the per-head norms
 * replicated (Qwen3Config's and Gemma3TextConfig's). */
#define HF_PLAN_LINEARS                                                                          \
  "\"layers.*.self_attn.q_proj\": \"colwise\", \"layers.*.self_attn.k_proj\": \"colwise\", "      \
  "\"layers.*.self_attn.v_proj\": \"colwise\", \"layers.*.self_attn.o_proj\": \"rowwise\", "      \
  "\"layers.*.mlp.gate_proj\": \"colwise\", \"layers.*.mlp.up_proj\": \"colwise\", "              \
  "\"layers.*.mlp.down_proj\": \"rowwise\""
#define HF_PLAN_LLAMA "{" HF_PLAN_LINEARS "}"
#define HF_PLAN_QK_NORM                                                                          \
  "{" HF_PLAN_LINEARS ", \"layers.*.self_attn.q_norm\": \"replicated_with_grad_allreduce\", "     \
  "\"layers.*.self_attn.k_norm\": \"replicated_with_grad_allreduce\"}"

/* Gemma3TextConfig / Gemma3TextModel, shared by the text model and the
 * text tower of the VLM. */
#define GEMMA3_TEXT                                                                              \
  .qkv_bias_key = "attention_bias", .qkv_bias_default = false, .o_bias_follows_qkv = true,      \
  .has_mlp_bias_key = false, .tie_default = true, .rope_theta_default = 1000000.0,              \
  .max_positions_default = 131072, .head_dim_default = 256,                                    \
  .hidden_act_key = "hidden_activation",                                                       \
  .hidden_act = "gelu_pytorch_tanh",                                                            \
  .unsupported = {"final_logit_softcapping", "attn_logit_softcapping",                         \
                  "use_bidirectional_attention"},                                               \
  .layer_rule = ML_LAYERS_PATTERN, .sliding_window_default = 4096,                              \
  .sliding_pattern_default = 6, .local_rope = true, .rope_local_theta_default = 10000.0,        \
  .norm_offset = 1.0f, .act = ML_GLU_GELU_TANH, .has_qk_norm = true,                             \
  .attn_norm = "input_layernorm", .attn_out_norm = "post_attention_layernorm",                  \
  .mlp_norm = "pre_feedforward_layernorm", .mlp_out_norm = "post_feedforward_layernorm",        \
  .embed_scale_sqrt_hidden = true, .attn_scalar_key = "query_pre_attn_scalar",                  \
  .attn_scalar_default = 256.0, .hf_tp_plan = HF_PLAN_QK_NORM

/* The module names of a text-only model: model.*, lm_head. */
#define TEXT_MODEL .prefix = "model.", .ckpt_prefix = "model.", .ckpt_lm_head = "lm_head"

/* LlamaDecoderLayer's arithmetic: SiLU-gated MLP, RMSNorm x·w before
 * attention (input_layernorm) and before the MLP (post_attention_layernorm). */
#define LLAMA_BLOCK                                                                              \
  .hidden_act_key = "hidden_act", .hidden_act = "silu", .norm_offset = 0.0f, .act = ML_GLU_SILU, \
  .attn_norm = "input_layernorm", .mlp_norm = "post_attention_layernorm"

static const ml_family families[] = {
    {
        .name = "llama",
        .architecture = "LlamaForCausalLM",
        .model_type = "llama",
        TEXT_MODEL,
        .qkv_bias_key = "attention_bias",
        .qkv_bias_default = false,
        .o_bias_follows_qkv = true,
        .has_mlp_bias_key = true,
        .tie_default = false,
        .rope_theta_default = 10000.0,
        .max_positions_default = 2048,
        .layer_rule = ML_LAYERS_ALL_FULL,
        LLAMA_BLOCK,
        .hf_tp_plan = HF_PLAN_LLAMA,
    },
    {
        /* MistralConfig / MistralModel: Llama's block without biases; one
         * sliding window on every layer unless sliding_window is null */
        .name = "mistral",
        .architecture = "MistralForCausalLM",
        .model_type = "mistral",
        TEXT_MODEL,
        .qkv_bias_key = NULL,
        .qkv_bias_default = false,
        .tie_default = false,
        .rope_theta_default = 10000.0,
        .max_positions_default = 131072,
        .layer_rule = ML_LAYERS_ALL_SLIDING,
        .sliding_window_default = 4096,
        LLAMA_BLOCK,
        .hf_tp_plan = HF_PLAN_LLAMA,
    },
    {
        /* Phi3ForCausalLM: the Llama block stored with fused self_attn.qkv_proj
         * ([q; k; v]) and mlp.gate_up_proj ([gate; up], chunk(2) order), the
         * sliding window (when set) on every layer; dropouts are 0 in eval
         * and not applied. */
        .name = "phi3",
        .architecture = "Phi3ForCausalLM",
        .model_type = "phi3",
        TEXT_MODEL,
        .qkv_bias_key = NULL,
        .qkv_bias_default = false,
        .tie_default = false,
        .rope_theta_default = 10000.0,
        .max_positions_default = 4096,
        .original_max_default = 4096,
        .token_id_defaults = {1, 32000, 32000},
        .layer_rule = ML_LAYERS_ALL_SLIDING,
        LLAMA_BLOCK,
        .fused = {{"self_attn.qkv_proj",
                   {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}},
                  {"mlp.gate_up_proj", {"mlp.gate_proj", "mlp.up_proj"}}},
        /* Phi3Config.base_model_tp_plan (transformers 5.23): the fused outputs
         * gathered, as HF slices them; on meshlm's split modules the optimized
         * plan shards q/k/v by heads instead */
        .hf_tp_plan = "{\"layers.*.self_attn.qkv_proj\": \"colwise_gather_output\", "
                      "\"layers.*.self_attn.o_proj\": \"rowwise_split_input\", "
                      "\"layers.*.mlp.gate_up_proj\": \"colwise_gather_output\", "
                      "\"layers.*.mlp.down_proj\": \"rowwise_split_input\"}",
    },
    {
        .name = "qwen2",
        .architecture = "Qwen2ForCausalLM",
        .model_type = "qwen2",
        TEXT_MODEL,
        .qkv_bias_key = NULL,
        .qkv_bias_default = true,
        .has_mlp_bias_key = false,
        .tie_default = false,
        .rope_theta_default = 1000000.0,
        .max_positions_default = 32768,
        .layer_rule = ML_LAYERS_MAX_WINDOW,
        .sliding_window_default = 4096,
        LLAMA_BLOCK,
        .hf_tp_plan = HF_PLAN_LLAMA,
    },
    {
        .name = "qwen3",
        .architecture = "Qwen3ForCausalLM",
        .model_type = "qwen3",
        TEXT_MODEL,
        .qkv_bias_key = "attention_bias",
        .qkv_bias_default = false,
        .o_bias_follows_qkv = true,
        .has_mlp_bias_key = false,
        .tie_default = false,
        .rope_theta_default = 10000.0,
        .max_positions_default = 32768,
        .head_dim_default = 128,
        .layer_rule = ML_LAYERS_MAX_WINDOW,
        .sliding_window_default = 4096,
        .has_qk_norm = true,
        LLAMA_BLOCK,
        .hf_tp_plan = HF_PLAN_QK_NORM,
    },
    {
        .name = "gemma3",
        .architecture = "Gemma3ForCausalLM",
        .model_type = "gemma3_text",
        TEXT_MODEL,
        GEMMA3_TEXT,
    },
    {
        /* Gemma3ForConditionalGeneration: the gemma3 row's text tower, nested
         * under text_config, its modules named model.language_model.* (lm_head
         * stays top-level) and its checkpoint keys language_model.model.*;
         * the vision tower and projector are not built. */
        .name = "gemma3_vlm",
        .architecture = "Gemma3ForConditionalGeneration",
        .model_type = "gemma3",
        .prefix = "model.language_model.",
        .ckpt_prefix = "language_model.model.",
        .ckpt_lm_head = "language_model.lm_head",
        .text_config_key = "text_config",
        .text_model_type = "gemma3_text",
        .save_as = "gemma3",
        GEMMA3_TEXT,
    },
    {
        /* Qwen3MoeConfig / Qwen3MoeForCausalLM: Qwen3's attention (q/k norms),
         * the sparse MoE block as `mlp` on the layers decoder_sparse_step and
         * mlp_only_layers make sparse, a dense Qwen3MoeMLP (intermediate_size)
         * on the others; with use_sliding_window, sliding_window on every
         * layer (Qwen3MoeModel's mask). The class plan shards experts
         * (local_colwise, ...), which meshlm refuses under tp: no HF plan. */
        .name = "qwen3_moe",
        .architecture = "Qwen3MoeForCausalLM",
        .model_type = "qwen3_moe",
        TEXT_MODEL,
        .qkv_bias_key = "attention_bias",
        .qkv_bias_default = false,
        .o_bias_follows_qkv = true,
        .tie_default = false,
        .rope_theta_default = 10000.0,
        .max_positions_default = 32768,
        .layer_rule = ML_LAYERS_ALL_SLIDING,
        .sliding_window_default = 4096,
        .window_gated = true,
        .has_qk_norm = true,
        LLAMA_BLOCK,
        .moe_block = "mlp",
        .expert_leaves = {"gate_proj", "up_proj", "down_proj"},
        .moe_inter_key = "moe_intermediate_size",
        .moe_inter_default = 768,
        .experts_default = 128,
        .top_k_default = 8,
        .norm_topk_key = "norm_topk_prob",
        .moe_sparse_keys = true,
    },
    {
        /* Qwen2MoeConfig / Qwen2MoeForCausalLM: Qwen2's attention (q/k/v
         * biases by qkv_bias, none on o_proj), the sparse block as `mlp` on
         * the layers decoder_sparse_step and mlp_only_layers make sparse (a
         * dense Qwen2MoeMLP of intermediate_size on the others), with a
         * shared expert of shared_expert_intermediate_size gated by
         * sigmoid(shared_expert_gate); with use_sliding_window, the window on
         * the even-indexed layers (0, 2, ...) below max_window_layers. The
         * class plan shards experts, which meshlm refuses under tp: no HF plan. */
        .name = "qwen2_moe",
        .architecture = "Qwen2MoeForCausalLM",
        .model_type = "qwen2_moe",
        TEXT_MODEL,
        .qkv_bias_key = "qkv_bias",
        .qkv_bias_default = true,
        .tie_default = false,
        .rope_theta_default = 10000.0,
        .max_positions_default = 32768,
        .layer_rule = ML_LAYERS_EVEN_BELOW_MAX,
        .sliding_window_default = 4096,
        LLAMA_BLOCK,
        .moe_block = "mlp",
        .expert_leaves = {"gate_proj", "up_proj", "down_proj"},
        .moe_inter_key = "moe_intermediate_size",
        .moe_inter_default = 1408,
        .experts_default = 60,
        .top_k_default = 4,
        .norm_topk_key = "norm_topk_prob",
        .moe_sparse_keys = true,
        .shared_expert = "shared_expert",
        .shared_gate = "shared_expert_gate",
        .shared_inter_key = "shared_expert_intermediate_size",
        .shared_inter_default = 5632,
        .experts_key = "num_experts", /* Qwen2MoeConfig has no num_local_experts alias */
    },
    {
        /* MixtralConfig / MixtralForCausalLM: Mistral's attention (the sliding
         * window, when set, on every layer), every MLP the sparse block
         * `block_sparse_moe` with experts w1 (gate), w3 (up), w2 (down) of
         * intermediate_size, the top-k weights always renormalized; the
         * router's jitter noise is not implemented. */
        .name = "mixtral",
        .architecture = "MixtralForCausalLM",
        .model_type = "mixtral",
        TEXT_MODEL,
        .qkv_bias_key = NULL,
        .qkv_bias_default = false,
        .tie_default = false,
        .rope_theta_default = 1000000.0,
        .max_positions_default = 131072,
        .token_id_defaults = {1, 2, 0},
        .layer_rule = ML_LAYERS_ALL_SLIDING,
        .sliding_window_default = 0,
        LLAMA_BLOCK,
        .moe_block = "block_sparse_moe",
        .expert_leaves = {"w1", "w3", "w2"},
        .moe_inter_key = "intermediate_size",
        .experts_default = 8,
        .top_k_default = 2,
        .moe_sparse_keys = false,
    },
};
enum { N_FAMILIES = sizeof families / sizeof families[0] };

/* Rows added at run time, after the built-in ones (never moved: configs
 * point at them). */
static ml_family registered[ML_FAMILY_MAX_REGISTERED];
static int n_registered;

static int n_all(void) { return N_FAMILIES + n_registered; }
static const ml_family *row(int i) {
  return i < N_FAMILIES ? &families[i] : &registered[i - N_FAMILIES];
}

const ml_family *ml_family_by_architecture(const char *architecture) {
  for (int i = 0; i < n_all(); i++)
    if (strcmp(row(i)->architecture, architecture) == 0) return row(i);
  return NULL;
}

const ml_family *ml_family_by_name(const char *name) {
  for (int i = 0; i < n_all(); i++)
    if (strcmp(row(i)->name, name) == 0) return row(i);
  return NULL;
}

/* A fused tensor's parts: 2 or more linears, consecutive rows in order. */
static int check_fused(const ml_family *f, const ml_fused *fz) {
  const ml_block_row *prev = NULL;
  int n = 0;
  for (; n < ML_FUSED_MAX_PARTS && fz->parts[n]; n++) {
    const ml_block_row *r = ml_block_linear(fz->parts[n]);
    if (!r || (prev && r != prev + 1))
      return ml_err("family %s: fused tensor '%s': part '%s' is not the linear after '%s' in the "
                    "decoder block; expected consecutive linears (self_attn.q_proj, "
                    "self_attn.k_proj, self_attn.v_proj or mlp.gate_proj, mlp.up_proj)",
                    f->name, fz->leaf, fz->parts[n], prev ? prev->leaf : "");
    prev = r;
  }
  if (n < 2 || fz->parts[n])
    return ml_err("family %s: fused tensor '%s' has %d parts; expected 2 to %d", f->name,
                  fz->leaf, n, ML_FUSED_MAX_PARTS);
  return 0;
}

int ml_family_register(const ml_family *f) {
  if (ml_family_by_architecture(f->architecture) || ml_family_by_name(f->name))
    return ml_err("family %s (%s): the architecture or the name is already registered", f->name,
                  f->architecture);
  if (n_registered == ML_FAMILY_MAX_REGISTERED)
    return ml_err("family %s: %d families are registered already, the most this build holds",
                  f->name, ML_FAMILY_MAX_REGISTERED);
  for (int i = 0; i < ML_FAMILY_MAX_FUSED && f->fused[i].leaf; i++)
    ML_TRY(check_fused(f, &f->fused[i]));
  registered[n_registered++] = *f;
  return 0;
}

static const char *join(char *buf, size_t cap, int use_arch) {
  buf[0] = '\0';
  for (int i = 0; i < n_all(); i++) {
    if (!use_arch && row(i)->save_as) continue;
    if (buf[0]) strncat(buf, ", ", cap - strlen(buf) - 1);
    strncat(buf, use_arch ? row(i)->architecture : row(i)->name, cap - strlen(buf) - 1);
  }
  return buf;
}

const char *ml_family_list_architectures(void) {
  static char buf[2048];
  return join(buf, sizeof buf, 1);
}

const char *ml_family_list_names(void) {
  static char buf[1024];
  return join(buf, sizeof buf, 0);
}

const ml_family *ml_family_saved(const ml_family *f) {
  const ml_family *s = f->save_as ? ml_family_by_name(f->save_as) : NULL;
  return s ? s : f;
}

int ml_family_rename(const ml_family *from, const ml_family *to, const char *name, char *out,
                     size_t cap) {
  size_t np = strlen(from->ckpt_prefix), nl = strlen(from->ckpt_lm_head);
  int len;
  if (strncmp(name, from->ckpt_prefix, np) == 0)
    len = snprintf(out, cap, "%s%s", to->ckpt_prefix, name + np);
  else if (strncmp(name, from->ckpt_lm_head, nl) == 0)
    len = snprintf(out, cap, "%s%s", to->ckpt_lm_head, name + nl);
  else
    len = snprintf(out, cap, "%s", name);
  if (len < 0 || (size_t)len >= cap)
    return ml_err("parameter name '%s' does not fit %zu bytes in the %s layout", name, cap,
                  to->name);
  return 0;
}
