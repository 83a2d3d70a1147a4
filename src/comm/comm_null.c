/* The null comm (comm_null.h). */
#include "comm/comm_null.h"

#include <stdio.h>
#include <stdlib.h>

#include "common/status.h"

static int null_iall_reduce(ml_comm *c, void *buf, size_t n, ml_elem elem, ml_redop op,
                            ml_request *req) {
  return 0;
}
static int null_icoll(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                      ml_request *req) {
  return 0;
}
static int null_all_to_all_v(ml_comm *c, const void *send, const int64_t *send_counts, void *recv,
                             const int64_t *recv_counts, ml_elem elem, ml_request *req) {
  return 0;
}
static int null_wait(ml_comm *c, ml_request *req) { return 0; }
static void null_destroy(ml_comm *c) { free(c); }

static const ml_comm_ops k_null_ops = {.iall_reduce = null_iall_reduce,
                                       .iall_gather = null_icoll,
                                       .ireduce_scatter = null_icoll,
                                       .iring_pass = null_icoll,
                                       .iall_to_all_v = null_all_to_all_v,
                                       .wait = null_wait,
                                       .destroy = null_destroy};

int ml_comm_null_create(int rank, int size, const char *name, ml_comm **out) {
  if (size < 1 || rank < 0 || rank >= size)
    return ml_err("null comm '%s': rank %d of %d; expected 0 <= rank < size", name, rank, size);
  ml_comm *c = ml_calloc(1, sizeof *c, "a null comm");
  if (!c) return -1;
  *c = (ml_comm){.ops = &k_null_ops, .impl = NULL, .rank = rank, .size = size};
  snprintf(c->name, sizeof c->name, "%s", name);
  *out = c;
  return 0;
}
