/* Device mesh over an MPI communicator (MPI_COMM_WORLD for a job):
 * dp_replicate × dp_shard × cp × tp, row-major with tp fastest (ranks
 * r .. r+tp−1 form one tp group), as torch's
 * init_device_mesh(("dp_replicate", "dp_shard", "cp", "tp")) and NeMo
 * Automodel's mesh layout (ARCHITECTURE.md §2). One process group per dimension plus
 * the flattened ones (torch's DeviceMesh._flatten, Automodel's names), all
 * in one table indexed by ml_group:
 *   world          every rank
 *   dp_replicate   HSDP: the replicas of one shard (grads all-reduced)
 *   dp_shard       the data-parallel shards of one replica
 *   cp             context parallel (sequence shards of one sample)
 *   tp             tensor parallel
 *   dp             dp_replicate × dp_shard: data loading
 *   dp_shard_cp    dp_shard × cp: the group FSDP shards parameters over
 *   dp_cp          dp_replicate × dp_shard × cp: loss and grad-norm reductions
 *   ep             expert parallelism (NeMo Automodel's MoE mesh): the world
 *                  flattened (dp_replicate, dp_shard, cp, tp) and split into
 *                  (ep_shard, ep), ep fastest, so an ep group is ep
 *                  consecutive world ranks; one rank alone until
 *                  ml_mesh_set_ep (no expert parallelism)
 *   ep_shard       the other factor of that split: the world ranks of one
 *                  ep coordinate (rank mod ep), world / ep of them, which
 *                  the experts' FSDP units shard over (NeMo Automodel's
 *                  ep_shard_mesh); one rank alone until ml_mesh_set_ep
 * A flattened group orders its members by world rank (the mesh's row-major
 * order), so its rank is the row-major index of the member's coordinates
 * in those dimensions.
 *
 * Each group has a data comm (comm/comm.h: a counting comm over the
 * backend's comm, which the caller's factory makes from the group's MPI
 * communicator) and a host channel (comm/host.h, MPI) for control values. */
#ifndef ML_MESH_H
#define ML_MESH_H

#include <mpi.h>

#include "comm/comm.h"
#include "comm/host.h"

typedef enum {
  ML_GROUP_WORLD,
  ML_GROUP_DP_REPLICATE,
  ML_GROUP_DP_SHARD,
  ML_GROUP_CP,
  ML_GROUP_TP,
  ML_GROUP_DP,
  ML_GROUP_DP_SHARD_CP,
  ML_GROUP_DP_CP,
  ML_GROUP_EP,
  ML_GROUP_EP_SHARD,
  ML_GROUP_KINDS
} ml_group;

/* "world", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp",
 * "dp_cp", "ep", "ep_shard": the names the mesh gives its groups' comms and channels ("?"
 * out of range). */
const char *ml_group_name(ml_group g);

/* The backend's data-comm factory: a comm over the ranks of `group` (an MPI
 * communicator the mesh frees after the call; the comm keeps what it needs,
 * e.g. a duplicate, or an NCCL communicator bootstrapped over it with
 * ncclGetUniqueId + broadcast + ncclCommInitRank, or split from a parent
 * with ncclCommSplit). `name` is the group's (ml_group_name). Collective
 * over `group`. Returns 0 with *out set, or −1 with the error recorded. */
typedef int (*ml_comm_factory)(void *ctx, MPI_Comm group, const char *name, ml_comm **out);

/* One mesh group. */
typedef struct ml_mesh_group {
  ml_comm *comm; /* data path: a counting comm over the factory's comm */
  ml_host *host; /* control plane */
  int size, rank;
  const char *name; /* ml_group_name */
} ml_mesh_group;

typedef struct ml_mesh {
  int world_size, rank;
  int dp_replicate, dp_shard, cp, tp; /* sizes */
  int dp_replicate_rank, dp_shard_rank, cp_rank, tp_rank;
  ml_mesh_group groups[ML_GROUP_KINDS];
} ml_mesh;

/* Build the mesh over the ranks of `base` (its size is the world size).
 * dp_replicate, cp and tp must be >= 1; dp_shard <= 0 means "infer"
 * (world / (dp_replicate·cp·tp)). make_comm makes each group's data comm
 * (called with ctx; NULL = MPI, comm/comm_mpi.h); the mesh wraps it in a
 * counting comm and owns it. Collective over base.
 * Errors (on every rank): a size < 1, or a product that does not
 * equal the world size, named with the numbers found and expected; MPI or
 * factory failures (the mesh is then left empty; a factory that fails on
 * some ranks only fails every rank, the others naming the first failing
 * rank). */
int ml_mesh_create(MPI_Comm base, int dp_replicate, int dp_shard, int cp, int tp,
                   ml_comm_factory make_comm, void *ctx, ml_mesh *out);
/* The mesh as rank `rank` of a dp_replicate × dp_shard × cp × tp world
 * would see it, without that world: every group's data comm is a counting
 * comm over a null comm of the group's size and rank (comm/comm_null.h),
 * its host channel is this process alone (MPI_COMM_SELF: control values
 * stay this rank's). With the meta backend this runs one rank's step of a
 * mesh that does not exist (`meshlm plan`, engine/predict.h). Needs MPI
 * initialised. Errors: a size outside 1..65536, a world beyond 2^24 ranks,
 * a rank outside it, allocation. */
int ml_mesh_create_meta(int dp_replicate, int dp_shard, int cp, int tp, int rank, ml_mesh *out);
/* Expert parallelism of degree ep over the mesh m built on `base` (as
 * ml_mesh_create was called): group ML_GROUP_EP becomes world ranks
 * [g·ep, (g+1)·ep) for this rank's g = rank / ep (its data comm from
 * make_comm, NULL = MPI, and its host channel), replacing the one-rank
 * group, and group ML_GROUP_EP_SHARD the world ranks r with r mod ep =
 * rank mod ep (ordered by world rank, so its rank is rank / ep). ep = 1
 * leaves both as they are. Collective over base. Errors (on every
 * rank): ep < 1, or dp_replicate·dp_shard·cp·tp not a multiple of ep (both
 * named with the values, the flag being --ep / ep_size), MPI or factory
 * failures. */
int ml_mesh_set_ep(ml_mesh *m, MPI_Comm base, int ep, ml_comm_factory make_comm, void *ctx);
/* ml_mesh_set_ep on a mesh of ml_mesh_create_meta: the ep group a null comm
 * of ep ranks (this rank's: rank mod ep), the ep_shard group one of
 * world / ep ranks (this rank's: rank / ep), their channels this process
 * alone.
 * Errors: as ml_mesh_set_ep's size checks, allocation. */
int ml_mesh_set_ep_meta(ml_mesh *m, int ep);
void ml_mesh_destroy(ml_mesh *m);

/* The data comm and the host channel of group g. */
ml_comm *ml_mesh_comm(const ml_mesh *m, ml_group g);
ml_host *ml_mesh_host(const ml_mesh *m, ml_group g);

/* Reset the collective counters of every group. */
void ml_mesh_stats_reset(ml_mesh *m);

#endif
