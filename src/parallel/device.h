/* A mesh's device: the backend of a registered device (backend/backend.h)
 * opened for this process's place on its node, and the data comm its
 * memory needs — what the CLI's --device and the API's
 * meshlm_options.device open (torch's device argument, NeMo's one GPU per
 * rank). A backend whose device memory is host memory (cpu) runs its
 * collectives on MPI; one with device memory (cuda) on the local comm
 * (comm/comm_local.h) until NCCL is in, so its mesh groups must have one
 * rank each. */
#ifndef ML_PARALLEL_DEVICE_H
#define ML_PARALLEL_DEVICE_H

#include <mpi.h>

#include "backend/backend.h"
#include "parallel/mesh.h"

/* The backend of device `name` (ml_backend_get), for this process's rank
 * among the ranks of `comm` on its node (comm/node.h: the GPU it drives),
 * and the data-comm factory and its context for ml_mesh_create
 * (ml_mesh_device_comm). Collective over comm. Errors: the registry's and
 * the backend's (an unknown name, a build without the device, no GPU
 * visible), MPI failures; prefixed with "WHAT NAME: " (what: "train: flag
 * --device"). */
int ml_mesh_device_open(MPI_Comm comm, const char *name, const char *what, ml_backend **be,
                        ml_comm_factory *make_comm, void **ctx);

/* The data-comm factory of a mesh on be and its context: NULL (MPI,
 * comm/comm_mpi.h) when be's device memory is host memory
 * (ml_be_host_memory), else the local comm over be. */
void ml_mesh_device_comm(ml_backend *be, ml_comm_factory *make_comm, void **ctx);

#endif
