#include "comm/comm.h"

#include "common/status.h"

size_t ml_elem_size(ml_elem e) { return e == ML_ELEM_BF16 ? 2 : 4; }

int ml_iall_reduce(ml_comm *c, void *buf, size_t n, ml_elem elem, ml_redop op, ml_request *req) {
  req->impl = NULL;
  return c->ops->iall_reduce(c, buf, n, elem, op, req);
}
int ml_iall_gather(ml_comm *c, const void *send, void *recv, size_t n_per_rank, ml_elem elem,
                   ml_request *req) {
  req->impl = NULL;
  return c->ops->iall_gather(c, send, recv, n_per_rank, elem, req);
}
int ml_ireduce_scatter(ml_comm *c, const void *send, void *recv, size_t n_per_rank, ml_elem elem,
                       ml_request *req) {
  req->impl = NULL;
  return c->ops->ireduce_scatter(c, send, recv, n_per_rank, elem, req);
}
int ml_iring_pass(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                  ml_request *req) {
  req->impl = NULL;
  return c->ops->iring_pass(c, send, recv, n, elem, req);
}
int ml_iall_to_all_v(ml_comm *c, const void *send, const int64_t *send_counts, void *recv,
                     const int64_t *recv_counts, ml_elem elem, ml_request *req) {
  req->impl = NULL;
  for (int q = 0; q < c->size; q++)
    if (send_counts[q] < 0 || recv_counts[q] < 0)
      return ml_err("all-to-all on comm '%s': block %d has send count %lld and receive count "
                    "%lld; expected counts >= 0",
                    c->name, q, (long long)send_counts[q], (long long)recv_counts[q]);
  return c->ops->iall_to_all_v(c, send, send_counts, recv, recv_counts, elem, req);
}
int ml_all_to_all_v(ml_comm *c, const void *send, const int64_t *send_counts, void *recv,
                    const int64_t *recv_counts, ml_elem elem) {
  ml_request req;
  if (ml_iall_to_all_v(c, send, send_counts, recv, recv_counts, elem, &req)) return -1;
  return ml_wait(c, &req);
}
int ml_wait(ml_comm *c, ml_request *req) { return req->impl ? c->ops->wait(c, req) : 0; }

int ml_all_reduce(ml_comm *c, void *buf, size_t n, ml_elem elem, ml_redop op) {
  ml_request req;
  if (ml_iall_reduce(c, buf, n, elem, op, &req)) return -1;
  return ml_wait(c, &req);
}
int ml_all_gather_t(ml_comm *c, const void *send, void *recv, size_t n_per_rank, ml_elem elem) {
  ml_request req;
  if (ml_iall_gather(c, send, recv, n_per_rank, elem, &req)) return -1;
  return ml_wait(c, &req);
}
int ml_all_gather(ml_comm *c, const float *send, float *recv, size_t n_per_rank) {
  return ml_all_gather_t(c, send, recv, n_per_rank, ML_ELEM_F32);
}
int ml_reduce_scatter_t(ml_comm *c, const void *send, void *recv, size_t n_per_rank,
                        ml_elem elem) {
  ml_request req;
  if (ml_ireduce_scatter(c, send, recv, n_per_rank, elem, &req)) return -1;
  return ml_wait(c, &req);
}
int ml_reduce_scatter(ml_comm *c, const float *send, float *recv, size_t n_per_rank) {
  return ml_reduce_scatter_t(c, send, recv, n_per_rank, ML_ELEM_F32);
}

void ml_comm_destroy(ml_comm *c) {
  if (c) c->ops->destroy(c);
}

const char *ml_coll_name(ml_coll k) {
  static const char *names[ML_COLL_KINDS] = {"all_reduce", "all_gather", "reduce_scatter",
                                             "send_recv", "all_to_all"};
  return names[k];
}
