/* A mesh's device (device.h). */
#include "parallel/device.h"

#include <stdio.h>

#include "comm/comm_local.h"
#include "comm/comm_mpi.h"
#include "comm/comm_staged.h"
#include "comm/node.h"
#include "common/status.h"
#ifdef ML_HAVE_NCCL
#include "comm/nccl/comm_nccl.h"
#endif

static const char *const k_comm_names[] = {"auto", "nccl", "staged", NULL};

const char *const *ml_device_comm_names(void) { return k_comm_names; }

/* Whether NCCL can serve the ranks of comm on be, and why not (into why).
 * Collective over comm. */
static int nccl_usable(MPI_Comm comm, ml_backend *be, int *ok, char *why, size_t cap) {
#ifdef ML_HAVE_NCCL
  return ml_nccl_usable(comm, be, ok, why, cap);
#else
  *ok = 0;
  snprintf(why, cap, "this build has no NCCL (not found when it was configured)");
  return 0;
#endif
}

/* The data comm of a mesh over comm on be, as `want` asks (device.h):
 * the factory, and in `line` what rank 0 says of it ("" for nothing). */
static int choose_comm(MPI_Comm comm, ml_backend *be, ml_device_comm want, const char *want_what,
                       ml_comm_factory *make_comm, char *line, size_t cap) {
  int world;
  ML_TRY(ml_mpi_check(MPI_Comm_size(comm, &world), "MPI_Comm_size", "world"));
  line[0] = 0;
  const char *staged = "staged (MPI through host staging buffers)";
  if (want == ML_DEVICE_COMM_STAGED) {
    *make_comm = ml_comm_staged_make;
    snprintf(line, cap, "%s, as %s staged asks", staged, want_what);
    return 0;
  }
  if (ml_be_host_memory(be)) {
    *make_comm = NULL;
    if (want == ML_DEVICE_COMM_NCCL)
      return ml_err("%s nccl: device '%s' keeps tensors in host memory, which NCCL does not "
                    "reduce; expected --device cuda, or auto (MPI) or staged",
                    want_what, be->ops->name);
    return 0;
  }
  if (world == 1) { /* every group has one rank: device copies */
    *make_comm = ml_comm_local_make;
    return 0;
  }
  char why[512];
  int ok;
  ML_TRY(nccl_usable(comm, be, &ok, why, sizeof why));
  if (want == ML_DEVICE_COMM_NCCL && !ok)
    return ml_err("%s nccl: NCCL cannot serve this mesh: %s; expected auto or staged", want_what,
                  why);
#ifdef ML_HAVE_NCCL
  if (ok) {
    *make_comm = ml_comm_nccl_make;
    snprintf(line, cap, "nccl (%s)", why);
    return 0;
  }
#endif
  *make_comm = ml_comm_staged_make;
  snprintf(line, cap, "%s: %s", staged, why);
  return 0;
}

int ml_mesh_device_open(MPI_Comm comm, const char *name, const char *what, ml_device_comm want,
                        const char *want_what, ml_backend **be, ml_comm_factory *make_comm,
                        void **ctx) {
  int local_rank, rank, world;
  if (ml_node_rank(comm, &local_rank) || ml_backend_get(name, local_rank, be)) {
    char why[ML_ERROR_MSG_CAP];
    snprintf(why, sizeof why, "%s", ml_error_msg());
    ml_error_clear();
    return ml_err("%s %s: %s", what, name, why);
  }
  char line[640];
  ML_TRY(choose_comm(comm, *be, want, want_what, make_comm, line, sizeof line));
  *ctx = *make_comm ? *be : NULL;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &world);
  if (rank == 0 && world > 1 && line[0]) {
    fprintf(stderr, "meshlm: device comm: %s\n", line);
    fflush(stderr);
  }
  return 0;
}

void ml_mesh_device_comm(ml_backend *be, ml_comm_factory *make_comm, void **ctx) {
  bool host_memory = ml_be_host_memory(be);
  *make_comm = host_memory ? NULL : ml_comm_local_make;
  *ctx = host_memory ? NULL : be;
}
