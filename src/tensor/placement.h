/* DTensor placements on one mesh dimension (torch.distributed.tensor
 * Replicate / Shard(dim) / Partial("sum"); ARCHITECTURE.md §3). Activations are
 * [B, S, C]: Shard(1) is the sequence dim, Shard(2) = Shard(-1) the
 * feature dim. Shards follow torch.chunk sizes (ceil(n/t) per rank, the
 * trailing ranks may be short). */
#ifndef ML_PLACEMENT_H
#define ML_PLACEMENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum { ML_REPLICATE, ML_SHARD, ML_PARTIAL } ml_placement_kind;

typedef struct ml_placement {
  ml_placement_kind kind;
  int dim; /* ML_SHARD only: tensor dim, −1 = the last */
} ml_placement;

static inline ml_placement ml_replicate(void) { return (ml_placement){ML_REPLICATE, 0}; }
static inline ml_placement ml_shard(int dim) { return (ml_placement){ML_SHARD, dim}; }
static inline ml_placement ml_partial(void) { return (ml_placement){ML_PARTIAL, 0}; }

/* Equal placements on a rank-3 activation [B, S, C] (Shard(2) == Shard(−1)). */
static inline bool ml_placement_eq(ml_placement a, ml_placement b) {
  if (a.kind != b.kind) return false;
  if (a.kind != ML_SHARD) return true;
  return (a.dim < 0 ? a.dim + 3 : a.dim) == (b.dim < 0 ? b.dim + 3 : b.dim);
}

/* "Replicate()", "Shard(1)", "Partial(sum)" into buf. */
const char *ml_placement_str(ml_placement p, char *buf, size_t cap);

/* The extent of Shard(d) on rank `rank` of `parts` for a dimension of n
 * elements, as torch.chunk(n, parts)[rank]: chunk = ceil(n / parts), this
 * rank's [*start, *start + *len) with the trailing ranks short or empty
 * (n = 5 over 4 parts: 2, 2, 1, 0). n >= 0, parts >= 1, 0 <= rank < parts. */
void ml_chunk(int64_t n, int parts, int rank, int64_t *start, int64_t *len);
/* torch.chunk's chunk, ceil(n / parts): the largest shard, and the size
 * every shard is padded to for an equal-size collective. */
int64_t ml_chunk_size(int64_t n, int parts);

#endif
