/* NCCL loaded at run time (comm/nccl/nccl_lib.h), what a machine without a
 * GPU can check: libnccl.so.2 loads (skipped, 77, where it is not
 * installed), every entry point meshlm calls resolves, the version is
 * NCCL 2's, a second call returns the same table, ncclGetUniqueId answers
 * (it needs no GPU), and a failed call's message names the call, the group
 * and NCCL's error string. */
#include <stdio.h>
#include <string.h>

#include "comm/nccl/nccl_lib.h"
#include "common/status.h"

static int expect(int ok, const char *what) {
  printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  if (!ok) printf("     message: %s\n", ml_error_msg());
  return ok ? 0 : 1;
}

int main(void) {
  const ml_nccl_lib *lib, *again;
  if (ml_nccl_lib_get(&lib)) {
    printf("skipped: %s\n", ml_error_msg());
    return 77;
  }
  int fails = 0;
  printf("NCCL version code %d\n", lib->version);
  fails += expect(lib->version / 10000 == 2, "NCCL 2");
  fails += expect(ml_nccl_lib_get(&again) == 0 && again == lib, "loaded once");
  ncclUniqueId id;
  ncclResult_t rc = lib->GetUniqueId(&id);
  fails += expect(ml_nccl_check(lib, rc, NULL, "ncclGetUniqueId", "world") == 0, "ncclGetUniqueId");
  ml_error_clear();
  fails += expect(ml_nccl_check(lib, ncclInvalidArgument, NULL, "all_reduce", "tp") == -1 &&
                      strstr(ml_error_msg(), "NCCL all_reduce on group 'tp' failed: ") != NULL,
                  "a failure names the call and the group");
  return fails ? 1 : 0;
}
