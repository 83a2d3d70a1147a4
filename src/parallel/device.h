/* A mesh's device: the backend of a registered device (backend/backend.h)
 * opened for this process's place on its node, and the data comm its
 * memory needs — what the CLI's --device / --device-comm and the API's
 * meshlm_options.device open (torch's device argument and
 * init_process_group's backend, NeMo's one GPU per rank).
 *
 * The data comm (ml_device_comm, the CLI's --device-comm):
 *  - a backend whose device memory is host memory (cpu): MPI
 *    (comm/comm_mpi.h) under auto; staged on request (its tests);
 *  - a backend with device memory (cuda): groups of one rank copy on the
 *    device (comm/comm_local.h); groups of several use NCCL
 *    (comm/nccl/comm_nccl.h) where it can serve them, else the staged comm
 *    (comm/comm_staged.h: MPI through host staging, gloo's way with CUDA
 *    tensors). NCCL cannot where the build has no NCCL, or where more
 *    ranks share one GPU than it allows (one; two with NCCL >= 2.30 and
 *    NCCL_MULTI_RANK_GPU_ENABLE=1, its experimental multi-rank mode).
 * On a world of several ranks, rank 0 prints one line saying which comm
 * the mesh uses and why ("meshlm: device comm: ..."), except for MPI on
 * host memory, the plain case. */
#ifndef ML_PARALLEL_DEVICE_H
#define ML_PARALLEL_DEVICE_H

#include <mpi.h>

#include "backend/backend.h"
#include "parallel/mesh.h"

/* The data comm asked for: auto (as above), nccl (an error where NCCL
 * cannot serve the mesh), staged. */
typedef enum { ML_DEVICE_COMM_AUTO, ML_DEVICE_COMM_NCCL, ML_DEVICE_COMM_STAGED } ml_device_comm;

/* "auto", "nccl", "staged" (ml_device_comm's order), NULL-terminated: the
 * values of the CLI's --device-comm. */
const char *const *ml_device_comm_names(void);

/* The backend of device `name` (ml_backend_get), for this process's rank
 * among the ranks of `comm` on its node (comm/node.h: the GPU it drives),
 * and the data-comm factory and its context for ml_mesh_create chosen as
 * `want` asks (see above). Collective over comm. Errors: the registry's
 * and the backend's (an unknown name, a build without the device, no GPU
 * visible), prefixed with "WHAT NAME: " (what: "train: flag --device");
 * nccl asked where NCCL cannot serve (a backend with host memory, a build
 * without NCCL, more ranks on a GPU than NCCL allows), prefixed with
 * "WANT_WHAT nccl: " (want_what: "train: flag --device-comm"); MPI
 * failures. */
int ml_mesh_device_open(MPI_Comm comm, const char *name, const char *what, ml_device_comm want,
                        const char *want_what, ml_backend **be, ml_comm_factory *make_comm,
                        void **ctx);

/* The data-comm factory of a one-rank mesh on be and its context: NULL
 * (MPI, comm/comm_mpi.h) when be's device memory is host memory
 * (ml_be_host_memory), else the local comm over be. */
void ml_mesh_device_comm(ml_backend *be, ml_comm_factory *make_comm, void **ctx);

#endif
