#include "comm/comm.h"

#include <stdio.h>

#include "common/status.h"

int ml_all_reduce(ml_comm *c, void *buf, size_t n, ml_elem elem, ml_redop op) {
  return c->ops->all_reduce(c, buf, n, elem, op);
}
size_t ml_elem_size(ml_elem e) { return e == ML_ELEM_F64 ? 8 : e == ML_ELEM_BF16 ? 2 : 4; }

int ml_all_gather(ml_comm *c, const float *send, float *recv, size_t n_per_rank) {
  return c->ops->all_gather(c, send, recv, n_per_rank, ML_ELEM_F32);
}
int ml_all_gather_t(ml_comm *c, const void *send, void *recv, size_t n_per_rank, ml_elem elem) {
  return c->ops->all_gather(c, send, recv, n_per_rank, elem);
}
int ml_iall_gather(ml_comm *c, const void *send, void *recv, size_t n_per_rank, ml_elem elem,
                   ml_request *req) {
  return c->ops->iall_gather(c, send, recv, n_per_rank, elem, req);
}
int ml_wait(ml_comm *c, ml_request *req) { return c->ops->wait(c, req); }
int ml_all_gather_v(ml_comm *c, const float *send, size_t n_send, float *recv,
                    const size_t *counts) {
  return c->ops->all_gather_v(c, send, n_send, recv, counts);
}
int ml_reduce_scatter(ml_comm *c, const float *send, float *recv, size_t n_per_rank) {
  return c->ops->reduce_scatter(c, send, recv, n_per_rank, ML_ELEM_F32);
}
int ml_reduce_scatter_t(ml_comm *c, const void *send, void *recv, size_t n_per_rank,
                        ml_elem elem) {
  return c->ops->reduce_scatter(c, send, recv, n_per_rank, elem);
}
int ml_reduce_scatter_v(ml_comm *c, const float *send, float *recv, const size_t *counts) {
  return c->ops->reduce_scatter_v(c, send, recv, counts);
}
int ml_broadcast(ml_comm *c, void *buf, size_t bytes, int root) {
  return c->ops->broadcast(c, buf, bytes, root);
}
void ml_comm_destroy(ml_comm *c) {
  if (c) c->ops->destroy(c);
}

const char *ml_coll_name(ml_coll k) {
  static const char *names[ML_COLL_KINDS] = {"all_reduce", "all_gather", "reduce_scatter",
                                             "broadcast"};
  return names[k];
}

int ml_comm_agree(ml_comm *c, int rc) {
  if (c->size == 1) return rc != 0 ? -1 : 0;
  /* the lowest failing group rank (exact in fp32: group sizes < 2^24) */
  float first = rc != 0 ? (float)c->rank : (float)c->size;
  if (ml_all_reduce(c, &first, 1, ML_ELEM_F32, ML_RED_MIN)) return -1;
  if (first == (float)c->size) return 0;
  struct {
    int32_t origin;
    char msg[ML_ERROR_MSG_CAP];
  } report = {-1, ""};
  if (c->rank == (int)first) {
    report.origin = ml_error_origin();
    snprintf(report.msg, sizeof report.msg, "%s", ml_error_msg());
  }
  if (ml_broadcast(c, &report, sizeof report, (int)first)) return -1;
  if (report.origin < 0)
    snprintf(report.msg, sizeof report.msg, "rank %d of group '%s' failed without a message",
             (int)first, c->name);
  return ml_error_adopt(report.origin, report.msg);
}
