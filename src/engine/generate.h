/* Text generation with a KV cache on an engine's own mesh (the engine level
 * of meshlm_generate, include/meshlm/meshlm.h): prompts continued token by
 * token, as transformers' GenerationMixin.generate with use_cache (sampling:
 * engine/sample.h: TemperatureLogitsWarper, TopKLogitsWarper,
 * TopPLogitsWarper, MinPLogitsWarper, then a draw; greedy: argmax).
 *
 * The model's own forward runs (model/model.h ml_layer_forward: no second
 * copy of the layer math); only its attention core is replaced for the
 * call by the KV cache's core (engine/kvcache.h). RoPE rotates by each
 * token's own position: each step points the layers' tables at its tokens'
 * rows, gathered from tables built per sequence (ml_be_rope_tables, the
 * same tables ml_model_begin builds for positions 0 .. cap−1). RoPE types that depend
 * on the forward's length (dynamic, longrope) are computed for the prompt's
 * length P, as HF's prefill: the same as HF for every position while the
 * generation stays within the length they switch at (max_position_embeddings
 * for dynamic, original_max_position_embeddings for longrope); past it HF's
 * dynamic_rope_update recomputes the frequencies for each new position (the
 * cached keys keeping theirs), which tables built once do not follow.
 *
 * Batching (continuous, as vLLM's scheduler): every sequence of the call
 * decodes together, one forward per generated token over all running
 * sequences, each at its own position: a step is a packed batch [1, T]
 * (the varlen layout of model/varlen.h) of segments — one token per
 * decoding sequence, or (while prompts wait for it, vLLM's V0 scheduler)
 * chunks of prompts being prefilled — through the
 * KV cache's attention core (engine/kvcache.h: one block attention per
 * segment over its own slot's paged keys; the GEMMs run once over all T
 * tokens). Prompts enter in order (first come, first served) while slots
 * are free and the KV cache has the blocks the prompt's samples need now
 * (below): a prompt of n samples takes n slots at once, its prefill runs
 * once in the first (chunks of at most prefill_tokens, cut at multiples of
 * it from position 0, so a prompt's chunks do not depend on its batch; a
 * prefill step holds whole chunks up to prefill_tokens, or one), then the
 * other n − 1 slots share its keys (ml_kv_fork: the full blocks by
 * reference, the partial last one copied) and each sample draws its first
 * token from the prompt's last logits. A sequence that finishes (a stop
 * id, or its max_new) hands its slot and its blocks back at once and the
 * next prompt takes them.
 *
 * Preemption (vLLM's recompute preemption): before a decode step, while
 * the decoding sequences' next positions need more blocks than are free,
 * the running sequence that arrived last (the highest row) is preempted:
 * its blocks released (blocks it shares stay with their other holders),
 * its slot freed, its row queued to re-enter before any prompt not yet
 * admitted, the earliest preempted first. It re-enters by prefilling its
 * prompt and the tokens it generated so far in a slot of its own (its
 * RoPE tables for its prompt's length, as before), then draws its next
 * token from the last position's logits with its own stream, which its
 * earlier draws advanced: in the batch-invariant mode its keys, values,
 * logits and draws are the bits it had (each computed in one order
 * whatever the step; tests/mpi/test_generate.c asserts the rows of a
 * tight pool bitwise a roomy pool's), in the default mode up to the GEMMs'
 * row bits at another M. o->stats->preemptions counts them.
 *
 * Invariance: a sequence's attention is the same block calls whatever its
 * batch, its draws come from its own stream, and row-wise kernels (norms,
 * RoPE, GLU) do not mix rows; its tokens and log-probs are bitwise those of
 * its prompt alone wherever the GEMMs give a row the same bits whatever
 * their M (the number of tokens of the step) — tests/mpi/test_generate.c
 * asserts it where that holds.
 *
 * Cost: the KV cache is a pool of blocks of ML_KV_BLOCK positions, each
 * 2 · n_layers · 16 · n_kv_heads · head_dim elements (bf16 where
 * param_dtype is bf16, else fp32: engine/kvcache.h); a sequence holds the
 * blocks its positions reach, a prompt's samples share its full prompt
 * blocks. A prompt enters on its current need (vLLM's admission): the
 * blocks of its prefill and of each sample's next position (⌈min(P + 1,
 * L) / 16⌉ for the first, that less the ⌊P / 16⌋ shared blocks for each
 * other, L = P + max_new − 1 its last position), free beside those the
 * prefills admitted before it will still take; a preempted row re-enters
 * on ⌈min(P + j + 1, L) / 16⌉ (j tokens generated). A finished sequence
 * returns its blocks at once. The pool holds max_kv_bytes (o), by
 * default room for max_running / n_samples prompts of the call's largest
 * need to their last positions (nothing is then preempted), at most that,
 * and at least one sequence alone to its last position and every prompt's
 * samples entering (less is refused): on the CPU its pages are mapped as blocks are first
 * written (the lowest blocks first), so the resident memory follows the
 * blocks in use. The model's activations are sized for the step's T
 * tokens (ml_model_begin: re-sized when T changes).
 *
 * The engine's mesh (cp 1; api/generate.c also keeps a one-rank replica):
 *  - tensor parallelism: the tp ranks of a data-parallel rank generate
 *    together, the same prompts and options on each, through the model's
 *    own forward under the training plan (its column/row-parallel linears,
 *    the all-reduces or, with sequence parallelism, the gathers of its
 *    edges); the KV cache holds this rank's key/value heads only
 *    (k_proj's local rows) and the block attention runs over its local
 *    query heads. Vocab-sharded logits (lm_head colwise with no output
 *    edge) are all-gathered over tp (Shard(−1) → Replicate,
 *    parallel/redistribute.h: [slots, V] floats per step) so every tp rank
 *    samples from the whole distribution: the same logits bits and the
 *    same row streams give every tp rank the same tokens, which the call
 *    checks at its end (a fingerprint of the outputs compared over tp).
 *    Gathering the rows costs V floats a sequence a step where reducing
 *    the sampler's statistics (max, sum of exp, top-k/top-p thresholds)
 *    would cost O(k); the logits are what the batch-invariant mode's
 *    log-probs and the sampler's selection read whole.
 *  - data parallelism: each data-parallel rank continues its own prompts,
 *    alone after the unshard (no collective across dp while decoding, so
 *    ranks may run different numbers of steps), but under expert
    parallelism (--ep) the ranks of an ep group step together: each step's
    sparse layers exchange rows over the group, so a rank whose sequences
    are done (or that has none) runs steps of zero tokens, computing its
    experts for the others' rows, until every rank of the group is done —
    one all-reduce per step over the group (engine/gen_ep.h); a failure on
    one rank of the group before a step ends the call on every rank of it.
 *  - FSDP: every unit is all-gathered once for the call (the
 *    unshard_for_inference of scoring, for every unit at once) and
 *    resharded after; the vocab-parallel embed_tokens / lm_head rows, which
 *    tie FSDP ranks' forwards together, are gathered whole for the call
 *    (engine/gen_vocab.h). The weights are the training weights: nothing
 *    is copied or refitted.
 *  - context parallelism: refused (the KV cache holds whole sequences).
 * Tokens and log-probs under tp differ from one rank's by the row-parallel
 * sums' order (tests/tolerance.h); greedy tokens agree unless two logits
 * are within that bound of each other. In the batch-invariant mode they
 * are one rank's bitwise (row-parallel linears computed whole,
 * parallel/tp_whole.h).
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
#include "engine/sample.h"

/* Why a sequence ended (ml_generate's out_finish). */
typedef enum { ML_FINISH_STOP = 1, ML_FINISH_LENGTH = 2 } ml_finish;

/* What a call did (ml_gen_opts.stats). */
typedef struct ml_gen_stats {
  int64_t preemptions; /* sequences preempted for want of KV blocks (each re-entered later) */
} ml_gen_stats;

typedef struct ml_gen_opts {
  int64_t max_new;            /* the outputs' width and the default per prompt, >= 1 */
  const int64_t *max_new_per; /* [n] each prompt's own, 1 .. max_new; NULL: max_new for all */
  int64_t n_samples;          /* samples per prompt (GRPO's group), >= 1 */
  ml_sampler sampler;         /* engine/sample.h */
  const int32_t *stop;        /* [n_stop] a sequence stops after generating any of these ids */
  int64_t n_stop;             /* >= 0 */
  uint64_t seed;              /* the draws: the same seed, prompts and weights give the same tokens */
  int64_t max_running;        /* sequences decoding at once (slots), >= n_samples; 0: every
                                 sequence of the call, at most ML_GEN_RUNNING (and n_samples) */
  int64_t prefill_tokens;     /* prompt tokens per step, >= 1; 0: ML_GEN_PREFILL */
  int64_t max_kv_bytes;       /* the KV cache's pool (this rank's), bytes >= 0; 0: room for
                                 max_running sequences of the largest need (below) */
  ml_gen_stats *stats;        /* out (NULL: not wanted), set when the call succeeds */
} ml_gen_opts;

enum { ML_GEN_RUNNING = 256, ML_GEN_PREFILL = 512 };

/* Continue each of n prompts with n_samples sequences of up to its max_new
 * tokens each. Collective over the tp group (every argument the same on
 * each of its ranks) and, when FSDP's group has more than one rank, over it
 * (the unshard; a rank with n = 0 takes part) and, under expert
 * parallelism, over the ep group every step (a rank with n = 0 takes
 * part); each data-parallel rank passes its own prompts. On a one-rank mesh: not collective.
 *
 * e: an engine on a mesh with cp = 1 (any tp, dp_shard, dp_replicate) on a
 * backend with block attention (the CPU's; CUDA has none yet).
 * prompts: lens [n] (each >= 1) and tokens [Σ lens] int32, the prompts
 * concatenated, each id in [0, vocab_size); lens[k] + max_new <=
 * max_position_embeddings.
 * Out (host memory), R = n · n_samples rows, row r = k · n_samples + j
 * sample j of prompt k: out_tokens [R, max_new] int32, row r's first
 * out_lens[r] entries generated (the stop id included), −1 after;
 * out_logprobs [R, max_new] (NULL: not wanted): log p of each generated
 * token under the model's distribution at temperature 1, the log_softmax of
 * the logits lm_head gives (rounded to output_dtype, as the loss path reads
 * them), 0 after the row's end; out_finish [R] (NULL: not wanted):
 * ML_FINISH_STOP (a stop id) or ML_FINISH_LENGTH (its max_new).
 *
 * Draws: row r draws one uniform number per sampled token from its own
 * stream (common/rng.h, a function of seed and r only), so a row's tokens
 * do not depend on which other prompts it was batched with.
 *
 * Memory (device): the KV cache and its RoPE tables (above), the model's
 * forward-only activations (one layer's: ml_model.forward_only) for a step
 * of at most max(max_running, prefill_tokens) tokens (the model keeps the
 * last step's until the engine's next forward re-sizes them), [max_running, vocab] logits; on the host the logits (no
 * second copy where the backend's memory is the host's: the CPU's) and
 * the sampler's [max_running, 2 · vocab] scratch; all but the activations
 * freed before returning. Every FSDP unit is unsharded for the call (the
 * whole model in param_dtype) and resharded after it.
 *
 * The engine keeps working afterwards: its attention core and the layers'
 * RoPE tables are restored, and its next forward (ml_engine_logprobs,
 * ml_engine_forward_backward) sets its own geometry as usual.
 *
 * Errors (-1, message naming the argument with the value found and the
 * range expected): n < 0, a prompt length < 1, a token id out of range,
 * max_new < 1, max_new_per[k] outside 1 .. max_new, n_samples < 1,
 * n_stop < 0 or a stop id out of range, max_running < n_samples (when set),
 * prefill_tokens < 0, max_kv_bytes < 0 or too small for one sequence to
 * its last position or a prompt's samples to enter (the bytes named), the
 * sampler's (ml_sampler_check), a prompt too long
 * for max_position_embeddings, a mesh with cp > 1, a backend without block
 * attention, allocation, tp ranks whose tokens differ (a bug, or different
 * arguments on them). */
int ml_generate(ml_engine *e, int64_t n, const int64_t *lens, const int32_t *tokens,
                const ml_gen_opts *o, int32_t *out_tokens, int64_t *out_lens,
                float *out_logprobs, int32_t *out_finish);

/* ml_generate's checks of its arguments against e's model config (not of
 * its mesh or backend; not collective; the errors listed above but the
 * mesh's, the backend's and allocation): a caller whose ranks must enter
 * ml_generate together (tp, FSDP) agrees on it first; it reads only e's
 * config, so any engine of the same checkpoint checks for another. */
int ml_generate_check(const ml_engine *e, int64_t n, const int64_t *lens, const int32_t *tokens,
                      const ml_gen_opts *o, const int32_t *out_tokens, const int64_t *out_lens);

#endif
