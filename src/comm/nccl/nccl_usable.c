/* Whether NCCL can serve a mesh (comm_nccl.h, ml_nccl_usable). */
#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda.h"
#include "comm/comm_mpi.h"
#include "comm/nccl/comm_nccl.h"
#include "comm/nccl/nccl_lib.h"
#include "common/status.h"

enum { BUS_ID = 32 }; /* cudaDeviceGetPCIBusId's "dddd:bb:dd.f" and its NUL, with room */

/* The most ranks of comm that share one GPU, found by PCI bus id among the
 * ranks of each node; into *share (the same on every rank). */
static int ranks_per_gpu(MPI_Comm comm, ml_backend *be, int *share) {
  char mine[BUS_ID] = {0};
  cudaError_t e = cudaDeviceGetPCIBusId(mine, BUS_ID, ml_cuda_device(be));
  if (e != cudaSuccess)
    return ml_err("NCCL check: cudaDeviceGetPCIBusId failed: %s", cudaGetErrorString(e));
  MPI_Comm node;
  int rank, size;
  MPI_Comm_rank(comm, &rank);
  ML_TRY(ml_mpi_check(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node),
                      "MPI_Comm_split_type (shared memory)", "node"));
  MPI_Comm_size(node, &size);
  char *all = ml_malloc((size_t)size * BUS_ID, "the PCI bus ids of a node's ranks");
  int rc = all ? 0 : -1;
  if (rc == 0)
    rc = ml_mpi_check(MPI_Allgather(mine, BUS_ID, MPI_CHAR, all, BUS_ID, MPI_CHAR, node),
                      "MPI_Allgather of the PCI bus ids", "node");
  int same = 0;
  for (int q = 0; rc == 0 && q < size; q++) same += strcmp(all + (size_t)q * BUS_ID, mine) == 0;
  free(all);
  MPI_Comm_free(&node);
  ML_TRY(rc);
  *share = same;
  return ml_mpi_check(MPI_Allreduce(MPI_IN_PLACE, share, 1, MPI_INT, MPI_MAX, comm),
                      "MPI_Allreduce of the ranks per GPU", "world");
}

int ml_nccl_usable(MPI_Comm comm, ml_backend *be, int *ok, char *why, size_t cap) {
  if (!ml_cuda_stream(be))
    return ml_err("NCCL check: device '%s'; expected the cuda backend", be->ops->name);
  int share;
  ML_TRY(ranks_per_gpu(comm, be, &share));
  const ml_nccl_lib *lib;
  const char *env = getenv("NCCL_MULTI_RANK_GPU_ENABLE");
  bool multi = env && strcmp(env, "1") == 0;
  *ok = 0;
  if (ml_nccl_lib_get(&lib)) {
    snprintf(why, cap, "%s", ml_error_msg());
    ml_error_clear();
  } else {
    int v = lib->version, major = v / 10000, minor = v / 100 % 100, patch = v % 100;
    if (share == 1) {
      *ok = 1;
      snprintf(why, cap, "one rank per GPU, NCCL %d.%d.%d", major, minor, patch);
    } else if (share > 2) {
      snprintf(why, cap, "%d ranks share one GPU; NCCL allows at most 2 (2.30's multi-rank mode)",
               share);
    } else if (v < 23000) {
      snprintf(why, cap, "2 ranks share one GPU, which NCCL %d.%d.%d refuses (\"Duplicate GPU\"); "
               "expected NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1", major, minor, patch);
    } else if (!multi) {
      snprintf(why, cap, "2 ranks share one GPU and NCCL_MULTI_RANK_GPU_ENABLE is not 1 (NCCL "
               "%d.%d.%d's experimental multi-rank mode)", major, minor, patch);
    } else {
      *ok = 1;
      snprintf(why, cap, "2 ranks share one GPU under NCCL %d.%d.%d's experimental multi-rank "
               "mode, NCCL_MULTI_RANK_GPU_ENABLE=1", major, minor, patch);
    }
  }
  int here = *ok;
  ML_TRY(ml_mpi_check(MPI_Allreduce(&here, ok, 1, MPI_INT, MPI_MIN, comm),
                      "MPI_Allreduce of NCCL's usability", "world"));
  if (here && !*ok) snprintf(why, cap, "NCCL cannot serve another rank of the mesh (it says why)");
  return 0;
}
