/* The node-local rank (node.h). */
#include "comm/node.h"

#include "comm/comm_mpi.h"
#include "common/status.h"

int ml_node_rank(MPI_Comm comm, int *local_rank) {
  int rank;
  MPI_Comm node;
  ML_TRY(ml_mpi_check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank", "node"));
  ML_TRY(ml_mpi_check(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node),
                      "MPI_Comm_split_type (shared memory)", "node"));
  int rc = ml_mpi_check(MPI_Comm_rank(node, local_rank), "MPI_Comm_rank", "node");
  MPI_Comm_free(&node);
  return rc;
}
