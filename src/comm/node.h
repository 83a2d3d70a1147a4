/* Where a process runs among its job's: its rank among the processes of a
 * communicator that share its node, torchrun's LOCAL_RANK, which picks the
 * process's GPU (backend/backend.h, ml_backend_get). Found from MPI itself
 * (MPI_Comm_split_type with MPI_COMM_TYPE_SHARED: the processes that can
 * share memory, one host), so it holds under every launcher — mpirun,
 * srun, MPICH's hydra — whether or not it sets a local-rank variable
 * (OMPI_COMM_WORLD_LOCAL_RANK is Open MPI's mpirun's alone). */
#ifndef ML_COMM_NODE_H
#define ML_COMM_NODE_H

#include <mpi.h>

/* *local_rank = this process's rank among the ranks of comm on its node,
 * in comm's rank order (0 .. the node's count − 1). Collective over comm.
 * Errors: MPI failures, with MPI's message. */
int ml_node_rank(MPI_Comm comm, int *local_rank);

#endif
