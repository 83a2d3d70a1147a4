/* --device: where `train` and `logprobs` compute (torch's device argument,
 * NeMo's one GPU per rank). cpu: the CPU backend, collectives on MPI. cuda:
 * the CUDA backend on one GPU per rank (backend/cuda/cuda.h); until NCCL
 * is in, its mesh groups must have one rank each (comm/comm_local.h), so
 * it runs one-rank meshes. The default is cpu. */
#ifndef ML_CLI_DEVICE_H
#define ML_CLI_DEVICE_H

#include "backend/backend.h"
#include "cli/args.h"
#include "parallel/mesh.h"

/* The --device flag's value, cpu by default. */
ml_arg_choice ml_device_choice(void);

/* The chosen device's backend, and the data-comm factory and its context
 * for ml_mesh_create. cmd names the command in messages ("train").
 * Errors: the backend's (no GPU visible, a build without CUDA), prefixed
 * with "CMD: flag --device NAME: ". */
int ml_device_open(const char *cmd, const ml_arg_choice *device, ml_backend **be,
                   ml_comm_factory *make_comm, void **ctx);

#endif
