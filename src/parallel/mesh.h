/* Device mesh over an MPI communicator (MPI_COMM_WORLD for a job): dp_replicate × dp_shard × cp × tp,
 * row-major with tp fastest (ranks r .. r+tp−1 form one tp group), as
 * torch's init_device_mesh(("dp_replicate", "dp_shard", "cp", "tp")) and
 * NeMo's mesh layout. One process group per dimension plus the flattened
 * groups FSDP and the reductions use (DESIGN §2). Every group is a counting
 * comm, so collectives can be inspected per dimension. */
#ifndef ML_MESH_H
#define ML_MESH_H

#include <mpi.h>

#include "comm/comm.h"

typedef struct ml_mesh {
  int world_size, rank;
  int dp_replicate, dp_shard, cp, tp; /* sizes */
  int dp_replicate_rank, dp_shard_rank, cp_rank, tp_rank;
  ml_comm *world;
  ml_comm *tp_comm;
  ml_comm *dp_shard_comm; /* FSDP shards over dp_shard × cp (cp = 1 for now) */
  ml_comm *dp_replicate_comm; /* HSDP: the replicas of one shard (grads all-reduced) */
  ml_comm *dp_comm;       /* dp_replicate × dp_shard: data loading and the loss */
} ml_mesh;

/* Build the mesh over the ranks of `base` (its size is the world size). dp_replicate, cp and tp must be
 * >= 1; dp_shard <= 0 means "infer" (world / (dp_replicate·cp·tp)).
 * Errors (same on every rank): a size < 1, or a product that does not
 * equal the world size, named with the numbers found and expected. */
int ml_mesh_create(MPI_Comm base, int dp_replicate, int dp_shard, int cp, int tp, ml_mesh *out);
void ml_mesh_destroy(ml_mesh *m);

/* Reset the collective counters of every group. */
void ml_mesh_stats_reset(ml_mesh *m);

#endif
