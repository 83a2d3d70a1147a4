/* NCCL loaded at run time (nccl_lib.h). */
#include "comm/nccl/nccl_lib.h"

#include <stdio.h>

#include "common/dl.h"
#include "common/status.h"

static ml_nccl_lib g_lib;
static int g_state; /* 0 not tried, 1 loaded, −1 failed (g_why) */
static char g_why[512];

static void load(void) {
  const ml_dl_sym k[] = {
      {"ncclGetVersion", (void **)&g_lib.GetVersion},
      {"ncclGetUniqueId", (void **)&g_lib.GetUniqueId},
      {"ncclCommInitRank", (void **)&g_lib.CommInitRank},
      {"ncclCommDestroy", (void **)&g_lib.CommDestroy},
      {"ncclCommAbort", (void **)&g_lib.CommAbort},
      {"ncclCommGetAsyncError", (void **)&g_lib.CommGetAsyncError},
      {"ncclGetErrorString", (void **)&g_lib.GetErrorString},
      {"ncclGetLastError", (void **)&g_lib.GetLastError},
      {"ncclAllReduce", (void **)&g_lib.AllReduce},
      {"ncclAllGather", (void **)&g_lib.AllGather},
      {"ncclReduceScatter", (void **)&g_lib.ReduceScatter},
      {"ncclSend", (void **)&g_lib.Send},
      {"ncclRecv", (void **)&g_lib.Recv},
      {"ncclGroupStart", (void **)&g_lib.GroupStart},
      {"ncclGroupEnd", (void **)&g_lib.GroupEnd},
  };
  if (ml_dl_load("libnccl.so.2", k, sizeof k / sizeof k[0], "NCCL 2", g_why, sizeof g_why) ||
      g_lib.GetVersion(&g_lib.version) != ncclSuccess) {
    if (!g_why[0]) snprintf(g_why, sizeof g_why, "libnccl.so.2: ncclGetVersion failed");
    g_state = -1;
    return;
  }
  if (g_lib.version / 10000 != 2) {
    snprintf(g_why, sizeof g_why, "libnccl.so.2 is NCCL version code %d; expected NCCL 2",
             g_lib.version);
    g_state = -1;
    return;
  }
  g_state = 1;
}

int ml_nccl_lib_get(const ml_nccl_lib **out) {
  if (g_state == 0) load();
  if (g_state < 0) return ml_err("NCCL: %s", g_why);
  *out = &g_lib;
  return 0;
}

int ml_nccl_check(const ml_nccl_lib *lib, ncclResult_t rc, ncclComm_t comm, const char *what,
                  const char *group) {
  if (rc == ncclSuccess) return 0;
  const char *last = lib->GetLastError(comm);
  return ml_err("NCCL %s on group '%s' failed: %s%s%s%s", what, group, lib->GetErrorString(rc),
                last && last[0] ? " (" : "", last && last[0] ? last : "",
                last && last[0] ? ")" : "");
}
