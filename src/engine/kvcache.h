/* The KV cache of generation (engine/generate.h): a paged pool of keys and
 * values (vLLM's PagedAttention, Kwon et al., 2023), the sequences' block
 * tables over it, and the attention core a decode/prefill step runs
 * through it.
 *
 * Pages: the pool holds n_blocks blocks of ML_KV_BLOCK positions (every
 * layer's keys and values of those positions); a sequence slot's block
 * table lists the blocks of its positions 0 .. in order, so it holds only
 * the blocks its positions reach. Blocks carry reference counts: a
 * prompt's n samples share the full blocks of its prefill by reference
 * (ml_kv_fork); the last, partial block of the prompt is copied for each
 * sample at the fork (copy-on-write, done when the sample is forked since
 * its next token writes into that block), and a block returns to the free
 * list when its last sequence releases it (ml_kv_release). The backend's
 * block attention reads the keys through the tables (backend.h
 * ml_attn_block.kv_table): the same values in the same reductions as keys
 * stored contiguously.
 *
 * Storage: fp32, or bf16 (half the memory) where the attention's products
 * are bf16 (param_dtype bf16: the projections' weights, hence
 * model/layer.c's attention compute, are bf16), whose products read k and
 * v rounded to bf16 anyway: storing them rounded changes no bit of a
 * product (the training forward rounds the same fp32 k, v to bf16 before
 * its products, backend/cpu/cpu.c attention_begin).
 *
 * A step is a packed batch [1, T] of segments, each a run of consecutive
 * positions pos .. pos+n−1 of one slot (a decode token: n = 1; a chunk of a
 * prompt's prefill: n > 1). The core appends each segment's keys and values
 * to its slot's blocks (which ml_kv_reserve has allocated) and runs the
 * block attention of each segment, its n queries at q_pos = pos over the
 * slot's keys 0 .. pos+n−1 (causal, the layer's sliding window; a run of
 * decode tokens at one position in consecutive slots is one call of B
 * sequences, each computed alone by the kernel): the same computation for
 * a segment whatever else the step holds, so a sequence's attention does
 * not depend on its batch.
 *
 * RoPE: each slot keeps the cos/sin tables of its positions 0 .. cap−1,
 * built for its prompt's length (generate.h: length-dependent types as
 * HF's prefill); a step gathers its tokens' rows into [T, hd/2] tables.
 * These stay per slot (4 · hd/2 floats a position, against the pool's
 * 2 · n_layers · nkv · hd elements). */
#ifndef ML_KVCACHE_H
#define ML_KVCACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "model/model.h"

/* Positions a block (vLLM's default block_size). */
enum { ML_KV_BLOCK = 16 };

/* n tokens of the step, from token t0 on, at positions pos .. pos+n−1 of slot. */
typedef struct ml_kv_seg {
  int64_t slot, pos, n, t0;
} ml_kv_seg;

typedef struct ml_kv_pool {
  ml_backend *be;
  int64_t L, slots, cap, nkv, hd, half; /* half = hd / 2 */
  int64_t nblocks, maxb;                /* blocks of the pool; table entries a slot: ⌈cap / block⌉ */
  bool bf16;                            /* storage dtype: bf16, else fp32 */
  void *mem;           /* [L][K, V][nblocks][ML_KV_BLOCK][nkv·hd] (device) */
  int32_t *table;      /* [slots][maxb] the block tables (device) */
  int32_t *host_table; /* [slots][maxb] their host copy */
  int64_t *nb;         /* [slots] blocks in each slot's table */
  int32_t *ref;        /* [nblocks] sequences holding each block */
  int32_t *free_list;  /* [nblocks] free blocks, the lowest id taken first */
  int64_t nfree;
  float *rope; /* [slots][full cos, full sin, sliding cos, sliding sin][cap][half] (device) */
  /* the step's segments (host, the caller's), in token order, set before each forward */
  const ml_kv_seg *seg;
  int64_t nseg;
  /* [rows_cap] each token's row in its layer's blocks (block · ML_KV_BLOCK + offset), the
   * same in every layer: set at the step's layer 0, where its keys are appended (device and
   * host, grown on need) */
  int32_t *rows, *host_rows;
  int64_t rows_cap;
} ml_kv_pool;

/* Bytes of one block: ML_KV_BLOCK positions of keys and values of nkv
 * key/value heads of head_dim for every layer of c, in bf16 or fp32
 * (saturates at INT64_MAX). */
int64_t ml_kv_block_bytes(const ml_model_config *c, int64_t nkv, bool bf16);

/* Blocks that hold `positions` positions: ⌈positions / ML_KV_BLOCK⌉. */
int64_t ml_kv_blocks(int64_t positions);

/* A pool of nblocks blocks of keys and values of nkv key/value heads (this
 * rank's: c->n_kv_heads on one rank, its local heads under tensor
 * parallelism, parallel/tp.h) for every layer of c, in bf16 or fp32, and
 * slots sequence slots of up to cap positions (block tables, RoPE tables),
 * every block free. The pool's memory is taken from the backend at once
 * (on the CPU, pages the system maps as the blocks are first written: the
 * free list hands out the lowest blocks first). Errors: allocation, naming
 * the sizes. */
int ml_kv_pool_create(ml_kv_pool *p, ml_backend *be, const ml_model_config *c, int64_t nkv,
                      int64_t slots, int64_t cap, int64_t nblocks, bool bf16);
void ml_kv_pool_destroy(ml_kv_pool *p);

/* Slot s's RoPE tables for a sequence whose prompt has P tokens
 * (ml_be_rope_tables with seq_len P, positions 0 .. cap−1). */
int ml_kv_slot_rope(ml_kv_pool *p, const ml_model_config *c, int64_t s, int64_t P);

/* Slot s's table extended with free blocks until it holds positions
 * 0 .. positions−1 (<= cap); *taken (may be NULL) = the blocks taken.
 * Errors: positions beyond cap, no free block (the caller's admission
 * promised them: a bug), both named. */
int ml_kv_reserve(ml_kv_pool *p, int64_t s, int64_t positions, int64_t *taken);

/* Slot `to` (empty) takes slot `from`'s keys and values of positions
 * 0 .. n−1 and its RoPE tables: the full blocks by reference (their counts
 * raised), a partial last block (n not a multiple of ML_KV_BLOCK) copied
 * into a free block of its own (copy-on-write: `to` writes its next
 * position there). *taken = the blocks taken (0 or 1). Errors: as
 * ml_kv_reserve's. */
int ml_kv_fork(ml_kv_pool *p, int64_t from, int64_t to, int64_t n, int64_t *taken);

/* Slot s's blocks released (each block's count lowered, a block nobody
 * holds back on the free list), its table emptied; returns the blocks
 * freed. */
int64_t ml_kv_release(ml_kv_pool *p, int64_t s);

/* The step's RoPE tables: dst [4][T][half] (device; full cos, sin, sliding
 * cos, sin), row t of token t = its slot's row at its position, over p's
 * segments (T = the last segment's t0 + n). */
int ml_kv_gather_rope(const ml_kv_pool *p, float *dst, int64_t T);

/* The attention core over the pool (ctx = p), for m->attn_core: fwd only
 * (generation has no backward), q [1, T, nh, hd], k, v [1, T, nkv, hd]
 * → out [1, T, nh·hd], lse [1, T, nh]; saved: never less than the
 * backend's own attention saves, so the model's buffers stay valid for it
 * once the core is restored. Errors: a call whose sizes do not match the
 * pool or the segments, a segment reaching past its slot's blocks, a bf16
 * pool under fp32 products (named), the backend's. */
ml_attn_core ml_kv_core(ml_kv_pool *p);

#endif
