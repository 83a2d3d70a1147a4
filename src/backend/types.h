/* Operator parameters shared by the model description (config, family) and
 * every backend's kernels: the MLP gate activation and RoPE scaling. */
#ifndef ML_BACKEND_TYPES_H
#define ML_BACKEND_TYPES_H

/* Gated MLP activation h = act(g) · u (LlamaMLP: silu; Gemma3MLP:
 * gelu_pytorch_tanh). */
typedef enum { ML_GLU_SILU, ML_GLU_GELU_TANH } ml_glu_act;

/* RoPE frequency scaling (HF modeling_rope_utils: rope_type "default",
 * "linear", "llama3"). */
typedef enum { ML_ROPE_DEFAULT, ML_ROPE_LINEAR, ML_ROPE_LLAMA3 } ml_rope_type;
typedef struct ml_rope_scaling {
  ml_rope_type type;
  double factor;                  /* linear, llama3 */
  double low_freq_factor;         /* llama3 */
  double high_freq_factor;        /* llama3 */
  double original_max_positions;  /* llama3: original_max_position_embeddings */
} ml_rope_scaling;

#endif
