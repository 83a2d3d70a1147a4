#include "cli/device.h"

#include <stdio.h>
#include <string.h>

#include "parallel/device.h"

ml_arg_choice ml_device_choice(void) { return (ml_arg_choice){ml_device_names(), 0}; }

const char *ml_device_help(void) {
  static char help[512];
  if (help[0]) return help;
  snprintf(help, sizeof help, "where to compute:");
  for (int i = 0; ml_device_names()[i]; i++) {
    ml_device_info d = ml_device_at(i);
    size_t n = strlen(help);
    snprintf(help + n, sizeof help - n, "%s %s (%s%s)", i ? ";" : "", d.name, d.description,
             d.available ? "" : "; not in this build");
  }
  return help;
}

ml_arg_choice ml_device_comm_choice(void) {
  return (ml_arg_choice){ml_device_comm_names(), ML_DEVICE_COMM_AUTO};
}

const char *ml_device_comm_help(void) {
  return "collectives of a device mesh: auto (cpu: MPI; cuda: NCCL where it can serve the "
         "mesh, else staged), nccl, staged (MPI through host staging buffers, any number of "
         "ranks per GPU)";
}

int ml_device_open(const char *cmd, const ml_arg_choice *device, const ml_arg_choice *device_comm,
                   ml_backend **be, ml_comm_factory *make_comm, void **ctx) {
  char what[64], comm_what[64];
  snprintf(what, sizeof what, "%s: flag --device", cmd);
  snprintf(comm_what, sizeof comm_what, "%s: flag --device-comm", cmd);
  return ml_mesh_device_open(MPI_COMM_WORLD, device->names[device->index], what,
                             (ml_device_comm)device_comm->index, comm_what, be, make_comm, ctx);
}
