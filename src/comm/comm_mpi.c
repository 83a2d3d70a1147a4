#include "comm/comm_mpi.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "tensor/dtype.h"

static MPI_Comm mpi_of(ml_comm *c) { return *(MPI_Comm *)c->impl; }

int ml_mpi_check(int rc, const char *what, const char *group) {
  if (rc == MPI_SUCCESS) return 0;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  return ml_err("%s on group '%s' failed: %s", what, group, msg);
}

static int mpi_check(ml_comm *c, int rc, const char *what) {
  return ml_mpi_check(rc, what, c->name);
}

static int count_ok(ml_comm *c, size_t n) {
  if (n <= (size_t)INT_MAX) return 0;
  return ml_err("collective on comm '%s': %zu elements exceeds MPI's int count", c->name, n);
}

static MPI_Datatype mpi_type(ml_elem e) {
  return e == ML_ELEM_BF16 ? MPI_UINT16_T : MPI_FLOAT;
}

/* inout[i] = bf16(fp32(in[i]) + fp32(inout[i])): MPI has no bf16 type. */
static void bf16_sum(void *in, void *inout, int *len, MPI_Datatype *type) {
  (void)type;
  const uint16_t *a = in;
  uint16_t *b = inout;
  for (int i = 0; i < *len; i++) b[i] = ml_f32_to_bf16(ml_bf16_to_f32(a[i]) + ml_bf16_to_f32(b[i]));
}

/* The reduction op for (elem, op); BF16 supports SUM only. */
static int mpi_op(ml_comm *c, ml_elem elem, ml_redop op, MPI_Op *out) {
  if (elem != ML_ELEM_BF16) {
    *out = op == ML_RED_MAX ? MPI_MAX : op == ML_RED_MIN ? MPI_MIN : MPI_SUM;
    return 0;
  }
  if (op != ML_RED_SUM) return ml_err("comm '%s': bf16 reductions support SUM only", c->name);
  static MPI_Op bf16_op = MPI_OP_NULL; /* created once, lives until MPI_Finalize */
  if (bf16_op == MPI_OP_NULL) ML_TRY(mpi_check(c, MPI_Op_create(bf16_sum, 1, &bf16_op), "MPI_Op_create"));
  *out = bf16_op;
  return 0;
}

/* Two MPI requests (receive, send) behind one ml_request: a ring pass
 * allocates both; the others use the first and leave the second null. */
static MPI_Request *requests(void) {
  MPI_Request *r = ml_malloc(2 * sizeof *r, "MPI request");
  if (r) r[0] = r[1] = MPI_REQUEST_NULL;
  return r;
}

/* Hand the started MPI request r to req, or free it when MPI refused to
 * start (rc: the MPI_I* call's status). */
static int started(ml_comm *c, ml_request *req, MPI_Request *r, int rc, const char *what) {
  if (mpi_check(c, rc, what)) {
    free(r);
    return -1;
  }
  req->impl = r;
  return 0;
}

static int mpi_iall_reduce(ml_comm *c, void *buf, size_t n, ml_elem elem, ml_redop op,
                           ml_request *req) {
  ML_TRY(count_ok(c, n));
  MPI_Op o = MPI_SUM;
  ML_TRY(mpi_op(c, elem, op, &o));
  MPI_Request *r = requests();
  if (!r) return -1;
  return started(c, req, r,
                 MPI_Iallreduce(MPI_IN_PLACE, buf, (int)n, mpi_type(elem), o, mpi_of(c), r),
                 "MPI_Iallreduce");
}

static int mpi_iall_gather(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                           ml_request *req) {
  ML_TRY(count_ok(c, n * (size_t)c->size));
  MPI_Request *r = requests();
  if (!r) return -1;
  MPI_Datatype t = mpi_type(elem);
  return started(c, req, r, MPI_Iallgather(send, (int)n, t, recv, (int)n, t, mpi_of(c), r),
                 "MPI_Iallgather");
}

static int mpi_ireduce_scatter(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                               ml_request *req) {
  ML_TRY(count_ok(c, n * (size_t)c->size));
  MPI_Op o = MPI_SUM;
  ML_TRY(mpi_op(c, elem, ML_RED_SUM, &o));
  MPI_Request *r = requests();
  if (!r) return -1;
  return started(c, req, r,
                 MPI_Ireduce_scatter_block(send, recv, (int)n, mpi_type(elem), o, mpi_of(c), r),
                 "MPI_Ireduce_scatter_block");
}

static int mpi_iring_pass(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                          ml_request *req) {
  ML_TRY(count_ok(c, n));
  MPI_Request *r = requests();
  if (!r) return -1;
  int to = (c->rank + 1) % c->size, from = (c->rank + c->size - 1) % c->size, tag = 1;
  MPI_Datatype t = mpi_type(elem);
  int rc = MPI_Irecv(recv, (int)n, t, from, tag, mpi_of(c), &r[0]);
  if (rc == MPI_SUCCESS) rc = MPI_Isend(send, (int)n, t, to, tag, mpi_of(c), &r[1]);
  if (rc != MPI_SUCCESS && r[0] != MPI_REQUEST_NULL) {
    MPI_Cancel(&r[0]);
    MPI_Request_free(&r[0]);
  }
  return started(c, req, r, rc, "MPI_Isend/MPI_Irecv");
}

/* MPI_Ialltoallv: its int counts and displacements must live until the
 * wait, so they follow the two MPI requests in the request's allocation. */
static int mpi_iall_to_all_v(ml_comm *c, const void *send, const int64_t *send_counts, void *recv,
                             const int64_t *recv_counts, ml_elem elem, ml_request *req) {
  int p = c->size;
  MPI_Request *r = ml_malloc(2 * sizeof *r + 4 * (size_t)p * sizeof(int), "MPI all-to-all request");
  if (!r) return -1;
  r[0] = r[1] = MPI_REQUEST_NULL;
  int *sc = (int *)(r + 2), *sd = sc + p, *rc_ = sd + p, *rd = rc_ + p;
  int64_t so = 0, ro = 0;
  for (int q = 0; q < p; q++) {
    if (count_ok(c, (size_t)(so + send_counts[q])) || count_ok(c, (size_t)(ro + recv_counts[q]))) {
      free(r);
      return -1;
    }
    sc[q] = (int)send_counts[q], sd[q] = (int)so, so += send_counts[q];
    rc_[q] = (int)recv_counts[q], rd[q] = (int)ro, ro += recv_counts[q];
  }
  MPI_Datatype t = mpi_type(elem);
  return started(c, req, r, MPI_Ialltoallv(send, sc, sd, t, recv, rc_, rd, t, mpi_of(c), r),
                 "MPI_Ialltoallv");
}

static int mpi_wait(ml_comm *c, ml_request *req) {
  MPI_Request *r = req->impl;
  int rc = mpi_check(c, MPI_Waitall(2, r, MPI_STATUSES_IGNORE), "MPI_Waitall");
  free(r);
  req->impl = NULL;
  return rc;
}

static void mpi_destroy(ml_comm *c) {
  MPI_Comm mc = mpi_of(c);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&mc);
  free(c->impl);
  free(c);
}

static const ml_comm_ops mpi_ops = {mpi_iall_reduce, mpi_iall_gather, mpi_ireduce_scatter,
                                    mpi_iring_pass,  mpi_wait,        mpi_destroy,
                                    mpi_iall_to_all_v};

int ml_comm_mpi_create(MPI_Comm mc, const char *name, ml_comm **out) {
  ml_comm *c = ml_calloc(1, sizeof *c, "comm");
  MPI_Comm *dup = ml_malloc(sizeof *dup, "comm");
  if (!c || !dup) {
    free(c);
    free(dup);
    return -1;
  }
  c->ops = &mpi_ops;
  c->impl = dup;
  snprintf(c->name, sizeof c->name, "%s", name);
  if (mpi_check(c, MPI_Comm_dup(mc, dup), "MPI_Comm_dup")) {
    free(c);
    free(dup);
    return -1;
  }
  MPI_Comm_rank(*dup, &c->rank);
  MPI_Comm_size(*dup, &c->size);
  *out = c;
  return 0;
}

int ml_comm_mpi_make(void *ctx, MPI_Comm group, const char *name, ml_comm **out) {
  (void)ctx;
  return ml_comm_mpi_create(group, name, out);
}
