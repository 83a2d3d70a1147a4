/* MPI implementation of the ml_comm vtable (Open MPI on CPUs). */
#ifndef ML_COMM_MPI_H
#define ML_COMM_MPI_H

#include <mpi.h>

#include "comm/comm.h"

/* Wrap `mc` (the comm is duplicated; the caller keeps `mc`). `name` names
 * the mesh dimension in messages. Errors: MPI failures, with MPI's string. */
int ml_comm_mpi_create(MPI_Comm mc, const char *name, ml_comm **out);

#endif
