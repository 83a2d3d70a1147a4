#include "comm/comm_mpi.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "tensor/dtype.h"

static MPI_Comm mpi_of(ml_comm *c) { return *(MPI_Comm *)c->impl; }

static int mpi_check(ml_comm *c, int rc, const char *what) {
  if (rc == MPI_SUCCESS) return 0;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  return ml_err("%s on comm '%s' failed: %s", what, c->name, msg);
}

static int count_ok(ml_comm *c, size_t n) {
  if (n <= (size_t)INT_MAX) return 0;
  return ml_err("collective on comm '%s': %zu elements exceeds MPI's int count", c->name, n);
}

static MPI_Datatype mpi_type(ml_elem e) {
  return e == ML_ELEM_F64 ? MPI_DOUBLE : e == ML_ELEM_BF16 ? MPI_UINT16_T : MPI_FLOAT;
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

static int mpi_all_reduce(ml_comm *c, void *buf, size_t n, ml_elem elem, ml_redop op) {
  ML_TRY(count_ok(c, n));
  MPI_Op o = MPI_SUM;
  ML_TRY(mpi_op(c, elem, op, &o));
  return mpi_check(c, MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, mpi_type(elem), o, mpi_of(c)),
                   "MPI_Allreduce");
}

static int mpi_all_gather(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem) {
  ML_TRY(count_ok(c, n * (size_t)c->size));
  MPI_Datatype t = mpi_type(elem);
  return mpi_check(c, MPI_Allgather(send, (int)n, t, recv, (int)n, t, mpi_of(c)), "MPI_Allgather");
}

static int mpi_iall_gather(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                           ml_request *req) {
  ML_TRY(count_ok(c, n * (size_t)c->size));
  MPI_Request *r = ml_malloc(sizeof *r, "MPI request");
  if (!r) return -1;
  MPI_Datatype t = mpi_type(elem);
  int rc = mpi_check(c, MPI_Iallgather(send, (int)n, t, recv, (int)n, t, mpi_of(c), r),
                     "MPI_Iallgather");
  if (rc) free(r);
  else req->impl = r;
  return rc;
}

static int mpi_wait(ml_comm *c, ml_request *req) {
  MPI_Request *r = req->impl;
  int rc = mpi_check(c, MPI_Wait(r, MPI_STATUS_IGNORE), "MPI_Wait");
  free(r);
  req->impl = NULL;
  return rc;
}

static int mpi_all_gather_v(ml_comm *c, const float *send, size_t n_send, float *recv,
                            const size_t *counts) {
  int *cnt = ml_malloc(sizeof(int) * 2 * (size_t)c->size, "allgatherv counts");
  if (!cnt) return -1;
  int *displ = cnt + c->size;
  size_t off = 0;
  for (int r = 0; r < c->size; r++) {
    displ[r] = (int)off;
    cnt[r] = (int)counts[r];
    off += counts[r];
  }
  int rc = count_ok(c, off);
  if (rc == 0)
    rc = mpi_check(c,
                   MPI_Allgatherv(send, (int)n_send, MPI_FLOAT, recv, cnt, displ, MPI_FLOAT,
                                  mpi_of(c)),
                   "MPI_Allgatherv");
  free(cnt);
  return rc;
}

static int mpi_reduce_scatter(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem) {
  ML_TRY(count_ok(c, n * (size_t)c->size));
  MPI_Op o = MPI_SUM;
  ML_TRY(mpi_op(c, elem, ML_RED_SUM, &o));
  return mpi_check(c, MPI_Reduce_scatter_block(send, recv, (int)n, mpi_type(elem), o, mpi_of(c)),
                   "MPI_Reduce_scatter_block");
}

static int mpi_reduce_scatter_v(ml_comm *c, const float *send, float *recv, const size_t *counts) {
  int *cnt = ml_malloc(sizeof(int) * (size_t)c->size, "reduce_scatter counts");
  if (!cnt) return -1;
  size_t total = 0;
  for (int r = 0; r < c->size; r++) {
    cnt[r] = (int)counts[r];
    total += counts[r];
  }
  int rc = count_ok(c, total);
  if (rc == 0)
    rc = mpi_check(c, MPI_Reduce_scatter(send, recv, cnt, MPI_FLOAT, MPI_SUM, mpi_of(c)),
                   "MPI_Reduce_scatter");
  free(cnt);
  return rc;
}

static int mpi_broadcast(ml_comm *c, void *buf, size_t bytes, int root) {
  ML_TRY(count_ok(c, bytes));
  return mpi_check(c, MPI_Bcast(buf, (int)bytes, MPI_BYTE, root, mpi_of(c)), "MPI_Bcast");
}

static void mpi_destroy(ml_comm *c) {
  MPI_Comm mc = mpi_of(c);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&mc);
  free(c->impl);
  free(c);
}

static const ml_comm_ops mpi_ops = {
    mpi_all_reduce, mpi_all_gather,  mpi_all_gather_v, mpi_reduce_scatter, mpi_reduce_scatter_v,
    mpi_broadcast,  mpi_iall_gather, mpi_wait,         mpi_destroy};

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
