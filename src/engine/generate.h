/* Text generation with a KV cache on a one-rank engine (the engine level of
 * meshlm_generate, include/meshlm/meshlm.h): prompts continued token by
 * token, as transformers' GenerationMixin.generate with use_cache (sampling:
 * TemperatureLogitsWarper, then TopPLogitsWarper, then a draw; greedy:
 * argmax).
 *
 * The model's own forward runs (model/model.h ml_layer_forward: no second
 * copy of the layer math); only its attention core is replaced for the
 * call by a KV-cache core: each layer's keys and values of the positions
 * seen so far stay in a cache [B, cap, nkv, hd] per layer, a forward of
 * the new positions p0 .. p0+S−1 appends theirs and runs the backend's
 * block attention (ml_be_attention_block_fwd) of the new queries over
 * keys 0 .. p0+S−1 (causal, the layer's sliding window). RoPE rotates by
 * the global positions: each forward points the layers' tables at rows p0
 * .. of tables built once for the call (ml_be_rope_tables, the same tables
 * ml_model_begin builds for positions 0 .. cap−1). RoPE types that depend
 * on the forward's length (dynamic, longrope) are computed for the prompt's
 * length P, as HF's prefill: the same as HF for every position while the
 * generation stays within the length they switch at (max_position_embeddings
 * for dynamic, original_max_position_embeddings for longrope); past it HF's
 * dynamic_rope_update recomputes the frequencies for each new position (the
 * cached keys keeping theirs), which tables built once do not follow.
 *
 * Batching: the rows of one forward share their positions, so prompts of
 * equal length form one group (GRPO's repeated prompts batch together):
 * per group one prefill [B, P] (the logits of the last position only),
 * then one forward [B, 1] per generated token. A row that has finished
 * (eos, or its max_new tokens) keeps running with the group, its outputs
 * ignored; a group stops when all of its rows have. Groups run one after
 * another in order of length.
 *
 * Mixed precision as the engine's forward: parameters in FSDP's
 * param_dtype, the residual stream rounded to it at each unit input
 * (FSDP2's cast_forward_inputs), the logits rounded to output_dtype, so
 * the tokens are drawn from the distribution ml_engine_logprobs scores. */
#ifndef ML_GENERATE_H
#define ML_GENERATE_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/engine.h"

typedef struct ml_gen_opts {
  int64_t max_new;   /* tokens to generate per prompt, >= 1 */
  float temperature; /* > 0 (finite): logits / temperature; ignored when greedy */
  float top_p;       /* (0, 1]: keep the smallest set of most probable tokens whose
                        probability reaches top_p, renormalised (TopPLogitsWarper; 1:
                        every token); ignored when greedy */
  bool greedy;       /* argmax of the logits, the lowest id on ties */
  int32_t eos;       /* a row stops after generating this id; < 0: never */
  uint64_t seed;     /* the draws: the same seed, prompts and weights give the same tokens */
} ml_gen_opts;

/* Continue each of n prompts with up to o->max_new tokens. Not collective.
 *
 * e: an engine on a one-rank mesh (tp = cp = dp_shard = dp_replicate = 1)
 * on a backend with block attention (the CPU's; CUDA has none yet).
 * prompts: lens [n] (each >= 1) and tokens [Σ lens] int32, the prompts
 * concatenated, each id in [0, vocab_size); lens[k] + max_new <=
 * max_position_embeddings.
 * Out (host memory): out_tokens [n, max_new] int32, row k's first
 * out_lens[k] entries generated (the eos included), −1 after;
 * out_logprobs [n, max_new] (NULL: not wanted): log p of each generated
 * token under the model's distribution at temperature 1, the log_softmax of
 * the logits lm_head gives (rounded to output_dtype, as the loss path reads
 * them), 0 after the row's end.
 *
 * Draws: row k draws one uniform number per sampled token from its own
 * stream (common/rng.h, a function of seed and k only), so a row's tokens
 * do not depend on which other prompts it was batched with.
 *
 * Memory (device) per group of B prompts of P tokens: the model's forward
 * activations for [B, P] (ml_model_begin; the model keeps those of the
 * last group's [B, 1] until the engine's next forward re-sizes them), the
 * KV cache 2 · n_layers · B · (P + max_new − 1) · n_kv_heads · head_dim
 * floats, the RoPE tables of those positions and the batch; on the host
 * [B, vocab] logits and, with top_p < 1, a [vocab] sort buffer; all but the
 * activations freed before returning. Every FSDP unit is unsharded for the
 * call (the whole model in param_dtype) and resharded after it.
 *
 * The engine keeps working afterwards: its attention core and the layers'
 * RoPE tables are restored, and its next forward (ml_engine_logprobs,
 * ml_engine_forward_backward) sets its own geometry as usual.
 *
 * Errors (-1, message naming the argument with the value found and the
 * range expected): n < 0, a prompt length < 1, a token id out of range,
 * max_new < 1, temperature <= 0 or top_p outside (0, 1] when sampling, a
 * prompt too long for max_position_embeddings, a mesh of more than one
 * rank, a backend without block attention, allocation. */
int ml_generate(ml_engine *e, int64_t n, const int64_t *lens, const int32_t *tokens,
                const ml_gen_opts *o, int32_t *out_tokens, int64_t *out_lens,
                float *out_logprobs);

#endif
