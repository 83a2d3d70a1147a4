/* meshlm — the C convenience over <mpi.h>: meshlm_open on an MPI_Comm.
 * meshlm.h itself does not include <mpi.h> (its ABI carries communicators as
 * Fortran handles, meshlm_open_f); include this header instead of meshlm.h
 * where the application has <mpi.h> (`mpicc`, or `pkg-config --cflags
 * meshlm` with MPI's flags). */
#ifndef MESHLM_MPI_H
#define MESHLM_MPI_H

#include <mpi.h>

#include "meshlm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* COLLECTIVE over `comm`: meshlm_open_f on comm's Fortran handle
 * (MPI_Comm_c2f); MPI_COMM_WORLD is the usual choice. Before MPI is
 * initialised (meshlm_open_f initialises it) the session is on
 * MPI_COMM_WORLD. */
static inline int meshlm_open(const char *model_dir, const meshlm_options *o, MPI_Comm comm,
                              meshlm_session **out) {
  int up = 0;
  MPI_Initialized(&up);
  return meshlm_open_f(model_dir, o, up ? (int64_t)MPI_Comm_c2f(comm) : -1, out);
}

#ifdef __cplusplus
}
#endif

#endif
