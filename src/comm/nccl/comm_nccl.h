/* The NCCL comm: the data comm of a mesh group on the CUDA backend
 * (comm/comm.h's device mapping). One NCCL communicator per mesh group,
 * bootstrapped over the group's MPI communicator (rank 0's ncclGetUniqueId
 * broadcast with MPI_Bcast, then ncclCommInitRank on every member, as
 * torch's ProcessGroupNCCL does over its store); one CUDA stream per group
 * (each mesh group kind — tp, dp_shard_cp, cp, ... — has its own, so
 * their collectives overlap one another and the compute stream).
 *
 * A collective: an event recorded on the backend's compute stream when its
 * inputs are ready, the group's stream waits on it (cudaStreamWaitEvent),
 * the NCCL call is enqueued there (fp32 and bf16: ncclFloat32,
 * ncclBfloat16; ncclSum / ncclMax / ncclMin; the ring pass as ncclSend +
 * ncclRecv in one ncclGroupStart/End), and an event recorded after it is
 * the request. ml_wait orders the compute stream after that event
 * (cudaStreamWaitEvent: the host does not block; whatever reads the
 * result is enqueued after it, and a read by the host — ml_be_copy D2H —
 * synchronises the compute stream). A watchdog per communicator
 * (watchdog.h) ends the process naming the collective and the group when
 * one fails or exceeds ML_NCCL_TIMEOUT_S. Sums over two ranks are one
 * addition, so they equal MPI's bit for bit; over more, NCCL's ring or tree
 * order. libnccl.so.2 is loaded at run time (nccl_lib.h). */
#ifndef ML_COMM_NCCL_H
#define ML_COMM_NCCL_H

#include <mpi.h>
#include <stddef.h>

#include "backend/backend.h"
#include "comm/comm.h"

/* Seconds a collective may take before the watchdog ends the process:
 * torch.distributed's default timeout for NCCL process groups (10 min). */
#define ML_NCCL_TIMEOUT_S 600.0

/* An NCCL comm over the ranks of `group` on CUDA backend be, its
 * collectives watched with a limit of timeout_s seconds. `name` names the
 * group in messages. Collective over group. Errors: be not the CUDA
 * backend; NCCL not loadable (nccl_lib.h); the NCCL, CUDA and MPI calls'
 * failures, naming the call and the group. */
int ml_comm_nccl_create(ml_backend *be, MPI_Comm group, const char *name, double timeout_s,
                        ml_comm **out);

/* A mesh comm factory (parallel/mesh.h, ml_comm_factory) with ctx the CUDA
 * backend: the NCCL comm (ML_NCCL_TIMEOUT_S) for a group of several ranks,
 * the local comm (comm/comm_local.h) for a group of one. */
int ml_comm_nccl_make(void *ctx, MPI_Comm group, const char *name, ml_comm **out);

/* Whether NCCL can serve meshes over the ranks of `comm` on CUDA backend
 * be: *ok 1 or 0 (the same on every rank), and in why[cap] the reason (for
 * rank 0's line and for the error of --device-comm nccl): libnccl.so.2
 * cannot be loaded; or more ranks share a GPU (found by PCI bus id among
 * the ranks of each node) than NCCL allows — one, or two with NCCL >= 2.30
 * and NCCL_MULTI_RANK_GPU_ENABLE=1 (its experimental multi-rank mode, set
 * on every rank). Collective over comm. Errors: be not the CUDA backend,
 * CUDA and MPI failures. */
int ml_nccl_usable(MPI_Comm comm, ml_backend *be, int *ok, char *why, size_t cap);

#endif
