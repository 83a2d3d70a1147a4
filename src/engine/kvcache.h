/* The KV cache of generation (engine/generate.h): a pool of per-sequence
 * slots, and the attention core a decode/prefill step runs through it.
 *
 * Slots, not pages: the backend's block attention (ml_be_attention_block_fwd)
 * reads each sequence's keys as one run of rows at a fixed pitch, so a
 * sequence's keys live contiguously in one slot of `cap` positions (the
 * longest prompt + max_new − 1 of the call) per layer. A finished sequence
 * hands its slot back and a waiting prompt takes it (continuous batching,
 * as vLLM, at slot granularity): memory is slots · cap positions whatever
 * the sequences' lengths, where vLLM's 16-position pages would hold only
 * the positions in use, and a prompt's n samples each hold a copy of its
 * keys (ml_kv_copy_prefix) where pages would be shared by reference.
 *
 * A step is a packed batch [1, T] of segments, each a run of consecutive
 * positions pos .. pos+n−1 of one slot (a decode token: n = 1; a chunk of a
 * prompt's prefill: n > 1). The core appends each segment's keys and values
 * to its slot and runs the block attention of each segment, its n queries
 * at q_pos = pos over the slot's keys 0 .. pos+n−1 (causal, the layer's
 * sliding window; a run of decode tokens at one position in consecutive
 * slots is one call of B sequences, each computed alone by the kernel):
 * the same computation for a segment whatever else the step holds, so a
 * sequence's attention does not depend on its batch.
 *
 * RoPE: each slot keeps the cos/sin tables of its positions 0 .. cap−1,
 * built for its prompt's length (generate.h: length-dependent types as
 * HF's prefill); a step gathers its tokens' rows into [T, hd/2] tables.
 *
 * fp32 keys and values whatever param_dtype: the block attention reads fp32
 * k and v (backend.h ml_attn_block: `compute` picks the products'
 * precision, not the storage), so a bf16 cache would need a kernel that
 * reads bf16 (half the cache's memory); not done here. */
#ifndef ML_KVCACHE_H
#define ML_KVCACHE_H

#include <stdint.h>

#include "backend/backend.h"
#include "model/model.h"

/* n tokens of the step, from token t0 on, at positions pos .. pos+n−1 of slot. */
typedef struct ml_kv_seg {
  int64_t slot, pos, n, t0;
} ml_kv_seg;

typedef struct ml_kv_pool {
  ml_backend *be;
  int64_t L, slots, cap, nkv, hd, half; /* half = hd / 2 */
  float *mem;  /* [L][K, V][slots][cap][nkv·hd] (device) */
  float *rope; /* [slots][full cos, full sin, sliding cos, sliding sin][cap][half] (device) */
  /* the step's segments (host, the caller's), in token order, set before each forward */
  const ml_kv_seg *seg;
  int64_t nseg;
} ml_kv_pool;

/* Allocates slots × cap positions of keys and values of nkv key/value
 * heads (this rank's: c->n_kv_heads on one rank, its local heads under
 * tensor parallelism, parallel/tp.h) for every layer of c, and their RoPE
 * tables. Errors: allocation, naming the sizes. */
int ml_kv_pool_create(ml_kv_pool *p, ml_backend *be, const ml_model_config *c, int64_t nkv,
                      int64_t slots, int64_t cap);
void ml_kv_pool_destroy(ml_kv_pool *p);

/* Slot s's RoPE tables for a sequence whose prompt has P tokens
 * (ml_be_rope_tables with seq_len P, positions 0 .. cap−1). */
int ml_kv_slot_rope(ml_kv_pool *p, const ml_model_config *c, int64_t s, int64_t P);

/* Slot `to` takes slot `from`'s keys and values of positions 0 .. n−1 in
 * every layer, and its RoPE tables (a prompt's prefill shared by its
 * samples: bitwise the same keys). */
int ml_kv_copy_prefix(ml_kv_pool *p, int64_t from, int64_t to, int64_t n);

/* The step's RoPE tables: dst [4][T][half] (device; full cos, sin, sliding
 * cos, sin), row t of token t = its slot's row at its position, over p's
 * segments (T = the last segment's t0 + n). */
int ml_kv_gather_rope(const ml_kv_pool *p, float *dst, int64_t T);

/* The attention core over the pool (ctx = p), for m->attn_core: fwd only
 * (generation has no backward), q [1, T, nh, hd], k, v [1, T, nkv, hd]
 * → out [1, T, nh·hd], lse [1, T, nh]; saved: never less than the
 * backend's own attention saves, so the model's buffers stay valid for it
 * once the core is restored. Errors: a call whose sizes do not match the
 * pool or the segments (named), the backend's. */
ml_attn_core ml_kv_core(ml_kv_pool *p);

#endif
