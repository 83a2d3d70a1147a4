/* The local comm (comm_local.h). */
#include "comm/comm_local.h"

#include <stdio.h>
#include <stdlib.h>

#include "common/status.h"

static ml_backend *be_of(ml_comm *c) { return c->impl; }

static int local_iall_reduce(ml_comm *c, void *buf, size_t n, ml_elem elem, ml_redop op,
                             ml_request *req) {
  req->impl = NULL;
  return 0;
}

/* all-gather, reduce-scatter and ring pass of one rank: recv = send */
static int local_copy(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                      ml_request *req) {
  req->impl = NULL;
  return ml_be_copy(be_of(c), recv, send, n * ml_elem_size(elem), ML_COPY_D2D);
}

/* all-to-all of one rank: recv = its one block */
static int local_all_to_all_v(ml_comm *c, const void *send, const int64_t *send_counts, void *recv,
                              const int64_t *recv_counts, ml_elem elem, ml_request *req) {
  if (send_counts[0] != recv_counts[0])
    return ml_err("all-to-all on comm '%s' of one rank: send count %lld, receive count %lld; "
                  "expected equal", c->name, (long long)send_counts[0], (long long)recv_counts[0]);
  return local_copy(c, send, recv, (size_t)send_counts[0], elem, req);
}

static int local_wait(ml_comm *c, ml_request *req) {
  req->impl = NULL;
  return 0;
}

static void local_destroy(ml_comm *c) { free(c); }

static const ml_comm_ops k_local_ops = {.iall_reduce = local_iall_reduce,
                                        .iall_gather = local_copy,
                                        .ireduce_scatter = local_copy,
                                        .iring_pass = local_copy,
                                        .iall_to_all_v = local_all_to_all_v,
                                        .wait = local_wait,
                                        .destroy = local_destroy};

int ml_comm_local_make(void *ctx, MPI_Comm group, const char *name, ml_comm **out) {
  int size;
  MPI_Comm_size(group, &size);
  if (size != 1)
    return ml_err("mesh group '%s' has %d ranks on device '%s': the local comm serves groups "
                  "of one rank; expected the staged or NCCL comm for several (parallel/device.h)",
                  name, size, ((ml_backend *)ctx)->ops->name);
  ml_comm *c = ml_calloc(1, sizeof *c, "a local comm");
  if (!c) return -1;
  *c = (ml_comm){.ops = &k_local_ops, .impl = ctx, .rank = 0, .size = 1};
  snprintf(c->name, sizeof c->name, "%s", name);
  *out = c;
  return 0;
}
