/* Operator parameters shared by the model description (config, family) and
 * every backend's kernels: the MLP gate activation, RoPE scaling and the
 * pieces of a gradient norm. */
#ifndef ML_BACKEND_TYPES_H
#define ML_BACKEND_TYPES_H

#include <stdbool.h>
#include <stdint.h>

/* Gated MLP activation h = act(g) · u (LlamaMLP: silu; Gemma3MLP:
 * gelu_pytorch_tanh). */
typedef enum { ML_GLU_SILU, ML_GLU_GELU_TANH } ml_glu_act;

/* RoPE frequency scaling: transformers 5.23 modeling_rope_utils'
 * ROPE_INIT_FUNCTIONS by rope_type ("default", "linear", "llama3",
 * "dynamic", "yarn", "longrope"). */
typedef enum {
  ML_ROPE_DEFAULT,
  ML_ROPE_LINEAR,
  ML_ROPE_LLAMA3,
  ML_ROPE_DYNAMIC,  /* _compute_dynamic_ntk_parameters: depends on the forward's length */
  ML_ROPE_YARN,     /* _compute_yarn_parameters */
  ML_ROPE_LONGROPE, /* _compute_longrope_parameters: depends on the forward's length */
} ml_rope_type;

/* The most entries of longrope's short_factor / long_factor: head_dim / 2
 * for head_dim <= ML_MAX_HEAD_DIM (model/config.h). */
enum { ML_ROPE_MAX_FACTORS = 2048 };

typedef struct ml_rope_scaling {
  ml_rope_type type;
  /* linear, llama3, dynamic: the factor; yarn, longrope: 0 when config.json
   * omits it (then max_positions / original_max_positions, as HF does) */
  double factor;
  double low_freq_factor;        /* llama3 */
  double high_freq_factor;       /* llama3 */
  double original_max_positions; /* llama3, yarn, longrope: original_max_position_embeddings */
  /* dynamic, yarn, longrope: max_position_embeddings (dynamic's NTK scaling
   * applies to forwards longer than it) */
  double max_positions;
  /* yarn, longrope: the cos/sin multiplier; 0 when config.json omits it
   * (then HF's default formula, kernels/cpu/rope.c) */
  double attention_factor;
  double mscale, mscale_all_dim; /* yarn: 0 when omitted (unused unless both are set) */
  double beta_fast, beta_slow;   /* yarn: 0 when omitted (then 32 and 1) */
  bool truncate;                 /* yarn: floor/ceil the correction range (HF default true) */
  /* longrope: head_dim / 2 entries each; the short ones for a forward of
   * at most original_max_positions positions, the long ones beyond */
  float short_factor[ML_ROPE_MAX_FACTORS];
  float long_factor[ML_ROPE_MAX_FACTORS];
} ml_rope_scaling;

/* Grad-norm partials of a gradient shard (torch.nn.utils.clip_grad_norm_'s
 * per-tensor norms). */
typedef enum {
  ML_NORM_SUMSQ,  /* sum of g² (fp64 accumulation) */
  ML_NORM_ABSMAX  /* max |g|, +inf for a NaN */
} ml_norm_kind;

/* One piece of gradient for ml_be_norm_partials: g [n] fp32 in device
 * memory (n >= 0). */
typedef struct ml_norm_seg {
  const float *g;
  int64_t n;
} ml_norm_seg;

#endif
