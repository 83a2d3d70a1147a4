/* --device: where `train` and `logprobs` compute, one of the devices of
 * the registry (backend/backend.h), opened as a mesh's device
 * (parallel/device.h). The default is cpu. --device-comm: the mesh's data
 * comm (parallel/device.h's ml_device_comm), auto by default. */
#ifndef ML_CLI_DEVICE_H
#define ML_CLI_DEVICE_H

#include "backend/backend.h"
#include "cli/args.h"
#include "parallel/mesh.h"

/* The --device flag's value: the registry's names, cpu by default. */
ml_arg_choice ml_device_choice(void);

/* The flag's help line: the devices with their descriptions (those this
 * build lacks marked so). */
const char *ml_device_help(void);

/* The --device-comm flag's value: auto, nccl, staged; auto by default. */
ml_arg_choice ml_device_comm_choice(void);

/* The --device-comm flag's help line. */
const char *ml_device_comm_help(void);

/* The chosen device's backend, for this rank's place on its node among
 * MPI_COMM_WORLD's, and the data-comm factory and its context for
 * ml_mesh_create, as device_comm asks (ml_mesh_device_open). cmd names the
 * command in messages ("train"). Collective over MPI_COMM_WORLD. Errors:
 * the backend's (no GPU visible, a build without CUDA), prefixed with
 * "CMD: flag --device NAME: "; --device-comm nccl where NCCL cannot serve
 * the mesh, prefixed with "CMD: flag --device-comm nccl: ". */
int ml_device_open(const char *cmd, const ml_arg_choice *device, const ml_arg_choice *device_comm,
                   ml_backend **be, ml_comm_factory *make_comm, void **ctx);

#endif
