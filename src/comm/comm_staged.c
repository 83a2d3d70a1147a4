/* The staged comm (comm_staged.h). */
#include "comm/comm_staged.h"

#include <stdio.h>
#include <stdlib.h>

#include "comm/comm_local.h"
#include "comm/comm_mpi.h"
#include "common/status.h"

typedef struct staged {
  ml_backend *be;
  ml_comm *mpi; /* the collectives, on host memory */
} staged;

/* One collective in flight: the MPI request over the host block
 * [send | recv], and which of its bytes go where on the device. */
typedef struct staged_req {
  ml_request mpi;
  char *host;          /* ml_be_host_alloc'd: the send part, then the recv part */
  const char *result;  /* inside host: the recv part (the send part for all-reduce) */
  size_t result_bytes;
  void *dev_recv;      /* the device destination of result */
} staged_req;

static staged *st_of(ml_comm *c) { return c->impl; }

static void req_free(ml_comm *c, staged_req *r) {
  ml_be_host_free(st_of(c)->be, r->host);
  free(r);
}

/* A request with a host block of send_bytes + recv_bytes, the send part
 * copied from the device's `send`; its result is the recv part (recv_bytes
 * 0: the send part, reduced in place), bound for dev_recv. */
static staged_req *stage(ml_comm *c, const void *send, size_t send_bytes, size_t recv_bytes,
                         void *dev_recv) {
  ml_backend *be = st_of(c)->be;
  staged_req *r = ml_calloc(1, sizeof *r, "a staged collective");
  if (!r) return NULL;
  r->host = ml_be_host_alloc(be, (int64_t)(send_bytes + recv_bytes), 1,
                             "the host staging of a collective on group '%s'", c->name);
  if (!r->host || ml_be_copy(be, r->host, send, send_bytes, ML_COPY_D2H)) {
    req_free(c, r);
    return NULL;
  }
  r->result = recv_bytes ? r->host + send_bytes : r->host;
  r->result_bytes = recv_bytes ? recv_bytes : send_bytes;
  r->dev_recv = dev_recv;
  return r;
}

/* Hand r to req when the MPI collective started (rc 0), else free it. */
static int issued(ml_comm *c, staged_req *r, int rc, ml_request *req) {
  if (rc) {
    req_free(c, r);
    return -1;
  }
  req->impl = r;
  return 0;
}

/* All-reduce in place on the staged copy (MPI_IN_PLACE, as the MPI comm). */
static int st_iall_reduce(ml_comm *c, void *buf, size_t n, ml_elem elem, ml_redop op,
                          ml_request *req) {
  staged_req *r = stage(c, buf, n * ml_elem_size(elem), 0, buf);
  if (!r) return -1;
  return issued(c, r, ml_iall_reduce(st_of(c)->mpi, r->host, n, elem, op, &r->mpi), req);
}

static int st_iall_gather(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                          ml_request *req) {
  size_t bytes = n * ml_elem_size(elem);
  staged_req *r = stage(c, send, bytes, bytes * (size_t)c->size, recv);
  if (!r) return -1;
  return issued(c, r, ml_iall_gather(st_of(c)->mpi, r->host, r->host + bytes, n, elem, &r->mpi),
                req);
}

static int st_ireduce_scatter(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                              ml_request *req) {
  size_t bytes = n * ml_elem_size(elem), all = bytes * (size_t)c->size;
  staged_req *r = stage(c, send, all, bytes, recv);
  if (!r) return -1;
  return issued(c, r,
                ml_ireduce_scatter(st_of(c)->mpi, r->host, r->host + all, n, elem, &r->mpi), req);
}

static int st_iring_pass(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                         ml_request *req) {
  size_t bytes = n * ml_elem_size(elem);
  staged_req *r = stage(c, send, bytes, bytes, recv);
  if (!r) return -1;
  return issued(c, r, ml_iring_pass(st_of(c)->mpi, r->host, r->host + bytes, n, elem, &r->mpi),
                req);
}

static int st_iall_to_all_v(ml_comm *c, const void *send, const int64_t *send_counts, void *recv,
                            const int64_t *recv_counts, ml_elem elem, ml_request *req) {
  int64_t ns = 0, nr = 0;
  for (int q = 0; q < c->size; q++) ns += send_counts[q], nr += recv_counts[q];
  size_t sb = (size_t)ns * ml_elem_size(elem), rb = (size_t)nr * ml_elem_size(elem);
  staged_req *r = stage(c, send, sb, rb ? rb : 1, recv);
  if (!r) return -1;
  r->result_bytes = rb;
  return issued(c, r,
                ml_iall_to_all_v(st_of(c)->mpi, r->host, send_counts, r->host + sb, recv_counts,
                                 elem, &r->mpi),
                req);
}

/* The MPI collective's completion, then its result host → device. */
static int st_wait(ml_comm *c, ml_request *req) {
  staged_req *r = req->impl;
  req->impl = NULL;
  int rc = ml_wait(st_of(c)->mpi, &r->mpi);
  if (rc == 0) rc = ml_be_copy(st_of(c)->be, r->dev_recv, r->result, r->result_bytes, ML_COPY_H2D);
  req_free(c, r);
  return rc;
}

static void st_destroy(ml_comm *c) {
  ml_comm_destroy(st_of(c)->mpi);
  free(c->impl);
  free(c);
}

static const ml_comm_ops k_staged_ops = {.iall_reduce = st_iall_reduce,
                                         .iall_gather = st_iall_gather,
                                         .ireduce_scatter = st_ireduce_scatter,
                                         .iring_pass = st_iring_pass,
                                         .iall_to_all_v = st_iall_to_all_v,
                                         .wait = st_wait,
                                         .destroy = st_destroy};

int ml_comm_staged_create(ml_backend *be, MPI_Comm group, const char *name, ml_comm **out) {
  ml_comm *c = ml_calloc(1, sizeof *c, "a staged comm");
  staged *s = ml_calloc(1, sizeof *s, "a staged comm");
  if (!c || !s || ml_comm_mpi_create(group, name, &s->mpi)) {
    free(c);
    free(s);
    return -1;
  }
  s->be = be;
  *c = (ml_comm){.ops = &k_staged_ops, .impl = s, .rank = s->mpi->rank, .size = s->mpi->size};
  snprintf(c->name, sizeof c->name, "%s", name);
  *out = c;
  return 0;
}

int ml_comm_staged_make(void *ctx, MPI_Comm group, const char *name, ml_comm **out) {
  int size;
  ML_TRY(ml_mpi_check(MPI_Comm_size(group, &size), "MPI_Comm_size", name));
  if (size == 1) return ml_comm_local_make(ctx, group, name, out);
  return ml_comm_staged_create(ctx, group, name, out);
}
