/* The local comm: the data comm of a one-rank mesh group whose buffers are
 * device memory of a backend (backend/backend.h). Its collectives are what
 * torch.distributed's are on a group of one: all-reduce leaves the buffer
 * as it is; all-gather and reduce-scatter copy send to recv (device to
 * device, on the backend's stream). A device backend needs it because the
 * MPI comm copies a one-rank group's blocks with host memcpy; groups of
 * several ranks on a GPU use NCCL (comm/nccl/comm_nccl.h) or the staged comm
 * (comm/comm_staged.h), parallel/device.h chooses. */
#ifndef ML_COMM_LOCAL_H
#define ML_COMM_LOCAL_H

#include <mpi.h>

#include "backend/backend.h"
#include "comm/comm.h"

/* A mesh comm factory (parallel/mesh.h, ml_comm_factory) with ctx the
 * ml_backend whose memory the buffers are. Errors: a group of more than
 * one rank (named, with its size), allocation. */
int ml_comm_local_make(void *ctx, MPI_Comm group, const char *name, ml_comm **out);

#endif
