/* A mesh's device (device.h). */
#include "parallel/device.h"

#include <stdio.h>

#include "comm/comm_local.h"
#include "comm/node.h"
#include "common/status.h"

int ml_mesh_device_open(MPI_Comm comm, const char *name, const char *what, ml_backend **be,
                        ml_comm_factory *make_comm, void **ctx) {
  int local_rank;
  if (ml_node_rank(comm, &local_rank) || ml_backend_get(name, local_rank, be)) {
    char why[ML_ERROR_MSG_CAP];
    snprintf(why, sizeof why, "%s", ml_error_msg());
    ml_error_clear();
    return ml_err("%s %s: %s", what, name, why);
  }
  ml_mesh_device_comm(*be, make_comm, ctx);
  return 0;
}

void ml_mesh_device_comm(ml_backend *be, ml_comm_factory *make_comm, void **ctx) {
  bool host_memory = ml_be_host_memory(be);
  *make_comm = host_memory ? NULL : ml_comm_local_make;
  *ctx = host_memory ? NULL : be;
}
