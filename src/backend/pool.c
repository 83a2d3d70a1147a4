#include "backend/pool.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

enum { SMALL = 1 << 20, SMALL_STEP = 512, LARGE_STEP = 1 << 16 };

typedef struct block {
  void *ptr;
  size_t size; /* its class size */
  size_t req;  /* bytes requested by its current user (while used) */
  bool used;
} block;

struct ml_pool {
  ml_pool_raw raw;
  block *blocks; /* every block held, in no order (a few hundred: linear scans) */
  size_t n, cap;
  ml_pool_stats stats;
};

static size_t class_of(size_t bytes) {
  size_t step = bytes < SMALL ? SMALL_STEP : LARGE_STEP;
  if (bytes > SIZE_MAX - step) return bytes; /* the raw allocator refuses it */
  return bytes == 0 ? step : (bytes + step - 1) / step * step;
}

ml_pool *ml_pool_create(ml_pool_raw raw) {
  ml_pool *p = calloc(1, sizeof *p);
  if (p) p->raw = raw;
  return p;
}

void ml_pool_trim(ml_pool *p) {
  size_t kept = 0;
  for (size_t i = 0; i < p->n; i++) {
    if (p->blocks[i].used) {
      p->blocks[kept++] = p->blocks[i];
    } else {
      p->raw.free(p->raw.ctx, p->blocks[i].ptr);
      p->stats.reserved -= p->blocks[i].size;
    }
  }
  p->n = kept;
}

void ml_pool_destroy(ml_pool *p) {
  if (!p) return;
  for (size_t i = 0; i < p->n; i++) p->raw.free(p->raw.ctx, p->blocks[i].ptr);
  free(p->blocks);
  free(p);
}

/* The smallest cached block of at least `size` and at most size + size/8. */
static block *best_fit(ml_pool *p, size_t size) {
  block *best = NULL;
  for (size_t i = 0; i < p->n; i++) {
    block *b = &p->blocks[i];
    if (!b->used && b->size >= size && b->size - size <= size / 8 &&
        (!best || b->size < best->size))
      best = b;
  }
  return best;
}

static block *add_block(ml_pool *p, void *ptr, size_t size) {
  if (p->n == p->cap) {
    size_t cap = p->cap ? 2 * p->cap : 64;
    block *nb = realloc(p->blocks, cap * sizeof *nb);
    if (!nb) return NULL;
    p->blocks = nb;
    p->cap = cap;
  }
  p->blocks[p->n] = (block){ptr, size, 0, false};
  p->stats.reserved += size;
  p->stats.raw_allocs++;
  return &p->blocks[p->n++];
}

void *ml_pool_alloc(ml_pool *p, size_t bytes) {
  size_t size = class_of(bytes);
  block *b = best_fit(p, size);
  if (!b) {
    void *ptr = p->raw.alloc(p->raw.ctx, size);
    if (!ptr) { /* give the cache back and try once more */
      ml_pool_trim(p);
      ptr = p->raw.alloc(p->raw.ctx, size);
    }
    if (!ptr) return NULL;
    b = add_block(p, ptr, size);
    if (!b) {
      p->raw.free(p->raw.ctx, ptr);
      return NULL;
    }
  }
  b->used = true;
  b->req = bytes;
  p->stats.in_use += bytes;
  if (p->stats.in_use > p->stats.peak) p->stats.peak = p->stats.in_use;
  return b->ptr;
}

void ml_pool_free(ml_pool *p, void *ptr) {
  if (!ptr) return;
  for (size_t i = 0; i < p->n; i++)
    if (p->blocks[i].ptr == ptr && p->blocks[i].used) {
      p->blocks[i].used = false;
      p->stats.in_use -= p->blocks[i].req;
      return;
    }
  fprintf(stderr, "ml_pool_free: %p was not allocated by this pool (or freed twice)\n", ptr);
  abort();
}

ml_pool_stats ml_pool_get_stats(const ml_pool *p) { return p->stats; }

void ml_pool_reset_peak(ml_pool *p) { p->stats.peak = p->stats.in_use; }
