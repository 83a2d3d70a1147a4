/* The device registry (backend.h): every device meshlm knows, its backend's
 * constructor where this build has it, and the backends made so far. The
 * one list of device names: the CLI's --device and the API's
 * meshlm_options.device both read it. */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/cpu.h"
#ifdef ML_HAVE_CUDA
#include "backend/cuda/cuda.h"
#define CUDA_CREATE ml_backend_cuda_create
#else
#define CUDA_CREATE NULL
#endif
#include "common/status.h"

/* Every rank of a node shares the host: the CPU backend has no device to
 * pick. */
static int cpu_create(int local_rank, ml_backend **out) { return ml_backend_cpu_create(out); }

/* X(name, description, constructor or NULL when this build lacks it, what
 * the build lacks then), cpu first (the default). */
#define ML_DEVICES(X)                                                                \
  X("cpu", "host memory, collectives on MPI", cpu_create, "")                        \
  X("cuda",                                                                          \
    "one NVIDIA GPU per rank, of a capability the build has code for (sm_90 "        \
    "by default); meshes of several ranks over NCCL or MPI through host staging",   \
    CUDA_CREATE,                                                                     \
    "this build has no CUDA backend (nvcc was not found when it was configured, or " \
    "MESHLM_CUDA=OFF)")

typedef struct device {
  const char *name, *description;
  int (*create)(int local_rank, ml_backend **out);
  const char *missing;
} device;

#define DEVICE_ENTRY(name, description, create, missing) {name, description, create, missing},
#define DEVICE_NAME(name, description, create, missing) name,
#define DEVICE_LISTED(name, description, create, missing) ", " name

static const device k_devices[] = {ML_DEVICES(DEVICE_ENTRY)};
static const char *const k_names[] = {ML_DEVICES(DEVICE_NAME) NULL};
static const char k_list[] = ML_DEVICES(DEVICE_LISTED); /* ", cpu, cuda" */
enum { N_DEVICES = sizeof k_devices / sizeof k_devices[0] };
static ml_backend *g_made[N_DEVICES];

const char *const *ml_device_names(void) { return k_names; }

ml_device_info ml_device_at(int i) {
  return (ml_device_info){k_devices[i].name, k_devices[i].description,
                          k_devices[i].create != NULL};
}

int ml_device_find(const char *name) {
  for (int i = 0; i < N_DEVICES; i++)
    if (strcmp(k_devices[i].name, name) == 0) return i;
  return -1;
}

const char *ml_device_list(void) { return k_list + 2; }

/* Device i is not in this build: why, and the ones that are. */
static int missing(int i) {
  char have[64] = "";
  for (int j = 0; j < N_DEVICES; j++)
    if (k_devices[j].create)
      snprintf(have + strlen(have), sizeof have - strlen(have), "%s%s", have[0] ? ", " : "",
               k_devices[j].name);
  return ml_err("device '%s': %s; expected one of those it has: %s", k_devices[i].name,
                k_devices[i].missing, have);
}

int ml_backend_get(const char *name, int local_rank, ml_backend **out) {
  int i = ml_device_find(name);
  if (i < 0) return ml_err("device '%s': unknown; expected one of %s", name, ml_device_list());
  if (!k_devices[i].create) return missing(i);
  if (!g_made[i]) ML_TRY(k_devices[i].create(local_rank, &g_made[i]));
  *out = g_made[i];
  return 0;
}

void ml_backend_release_all(void) {
  for (int i = 0; i < N_DEVICES; i++) {
    if (g_made[i]) g_made[i]->ops->destroy(g_made[i]);
    g_made[i] = NULL;
  }
}
