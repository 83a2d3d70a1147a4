#include "cli/device.h"

#include <stdio.h>

#include "comm/comm_local.h"
#include "common/status.h"

static const char *const k_devices[] = {"cpu", "cuda", NULL};

ml_arg_choice ml_device_choice(void) { return (ml_arg_choice){k_devices, 0}; }

int ml_device_open(const char *cmd, const ml_arg_choice *device, ml_backend **be,
                   ml_comm_factory *make_comm, void **ctx) {
  const char *name = device->names[device->index];
  if (ml_backend_get(name, be) != 0) {
    char why[ML_ERROR_MSG_CAP];
    snprintf(why, sizeof why, "%s", ml_error_msg());
    ml_error_clear();
    return ml_err("%s: flag --device %s: %s", cmd, name, why);
  }
  bool host_memory = device->index == 0; /* the CPU backend's device memory is the host's */
  *make_comm = host_memory ? NULL : ml_comm_local_make;
  *ctx = host_memory ? NULL : *be;
  return 0;
}
