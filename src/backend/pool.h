/* A caching allocator over a raw one (malloc on the CPU backend,
 * cudaMalloc on CUDA), as torch's CUDACachingAllocator: a freed block is
 * kept and handed to the next request it fits, so a training loop that
 * frees and re-allocates the same sizes every step (FSDP's unsharded
 * units, the loss's logits chunks) stops calling the raw allocator after
 * its first step. Requests are rounded up to a size class (512 B below
 * 1 MiB, 64 KiB above); a cached block serves a request of its class up to
 * 1/8 larger than it needs. When the raw allocator fails, the cached blocks
 * are released and the request retried once. Not thread-safe: one pool per
 * backend, used from the thread that drives it. */
#ifndef ML_POOL_H
#define ML_POOL_H

#include <stddef.h>
#include <stdint.h>

typedef struct ml_pool ml_pool;

typedef struct ml_pool_raw {
  void *(*alloc)(void *ctx, size_t bytes); /* NULL when it cannot */
  void (*free)(void *ctx, void *p);
  void *ctx;
} ml_pool_raw;

/* A pool over `raw`; NULL when its bookkeeping cannot be allocated. */
ml_pool *ml_pool_create(ml_pool_raw raw);
/* Release every block (in use or cached) and the pool. */
void ml_pool_destroy(ml_pool *p);

/* A block of at least `bytes` (0 allowed: a distinct valid block), or
 * NULL (no message) when the raw allocator fails even after the cache is
 * released. */
void *ml_pool_alloc(ml_pool *p, size_t bytes);
/* Return a block from ml_pool_alloc to the cache (NULL: no-op). A pointer
 * the pool did not hand out aborts: that is a bug, not an input error. */
void ml_pool_free(ml_pool *p, void *ptr);
/* Give every cached (free) block back to the raw allocator. */
void ml_pool_trim(ml_pool *p);

/* Bytes of the pool, as torch.cuda.memory_allocated / max_memory_allocated
 * / memory_reserved count them: in_use, the bytes requested by the blocks
 * handed out and not yet freed (before rounding to a size class); peak,
 * the largest in_use since the pool was made or ml_pool_reset_peak;
 * reserved, what the pool holds from the raw allocator (in use or cached).
 * raw_allocs counts the blocks taken from the raw allocator since the pool
 * was made (torch.cuda.memory_stats' "segment.all.allocated"): a loop whose
 * working set the cache serves leaves it unchanged. */
typedef struct ml_pool_stats {
  size_t in_use, peak, reserved;
  uint64_t raw_allocs;
} ml_pool_stats;

ml_pool_stats ml_pool_get_stats(const ml_pool *p);
/* peak = in_use (torch.cuda.reset_peak_memory_stats). */
void ml_pool_reset_peak(ml_pool *p);

#endif
