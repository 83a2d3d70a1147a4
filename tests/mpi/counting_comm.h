/* A counting comm (comm/comm.h) over an MPI communicator for the MPI tests;
 * fails the test on error. Include after <cmocka.h>. */
#ifndef ML_TEST_COUNTING_COMM_H
#define ML_TEST_COUNTING_COMM_H

#include "comm/comm_mpi.h"
#include "common/status.h"

static inline ml_comm *counting(MPI_Comm mc, const char *name) {
  ml_comm *inner, *c;
  if (ml_comm_mpi_create(mc, name, &inner) || ml_comm_counting_create(inner, &c))
    fail_msg("comm: %s", ml_error_msg());
  return c;
}

#endif
