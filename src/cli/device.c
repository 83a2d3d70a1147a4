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

int ml_device_open(const char *cmd, const ml_arg_choice *device, ml_backend **be,
                   ml_comm_factory *make_comm, void **ctx) {
  char what[64];
  snprintf(what, sizeof what, "%s: flag --device", cmd);
  return ml_mesh_device_open(MPI_COMM_WORLD, device->names[device->index], what, be, make_comm,
                             ctx);
}
