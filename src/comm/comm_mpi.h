/* MPI implementation of the ml_comm vtable (Open MPI on CPUs): nonblocking
 * MPI collectives on a duplicate of the group's communicator (comm.h). */
#ifndef ML_COMM_MPI_H
#define ML_COMM_MPI_H

#include <mpi.h>

#include "comm/comm.h"

/* Wrap `mc` (the comm is duplicated; the caller keeps `mc`). `name` names
 * the mesh group in messages. Errors: MPI failures, with MPI's string. */
int ml_comm_mpi_create(MPI_Comm mc, const char *name, ml_comm **out);

/* ml_comm_mpi_create as a mesh comm factory (parallel/mesh.h,
 * ml_comm_factory); ctx is unused. */
int ml_comm_mpi_make(void *ctx, MPI_Comm group, const char *name, ml_comm **out);

/* 0 when rc is MPI_SUCCESS, else −1 with "WHAT on group 'GROUP' failed:
 * <MPI's error string>" recorded (common/status.h). */
int ml_mpi_check(int rc, const char *what, const char *group);

#endif
