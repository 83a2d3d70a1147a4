#include "comm/host.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

#include "comm/comm_mpi.h"
#include "common/status.h"

int ml_host_create(MPI_Comm base, const char *name, ml_host **out) {
  ml_host *h = ml_calloc(1, sizeof *h, "host channel");
  if (!h) return -1;
  snprintf(h->name, sizeof h->name, "%s", name);
  if (ml_mpi_check(MPI_Comm_dup(base, &h->comm), "MPI_Comm_dup (host channel)", name)) {
    free(h);
    return -1;
  }
  MPI_Comm_rank(h->comm, &h->rank);
  MPI_Comm_size(h->comm, &h->size);
  *out = h;
  return 0;
}

void ml_host_destroy(ml_host *h) {
  if (!h) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&h->comm);
  free(h);
}

static MPI_Op mpi_op(ml_redop op) {
  return op == ML_RED_MAX ? MPI_MAX : op == ML_RED_MIN ? MPI_MIN : MPI_SUM;
}

int ml_host_all_reduce_f64(ml_host *h, double *v, int n, ml_redop op) {
  return ml_mpi_check(MPI_Allreduce(MPI_IN_PLACE, v, n, MPI_DOUBLE, mpi_op(op), h->comm),
                      "MPI_Allreduce (host channel)", h->name);
}

int ml_host_all_reduce_i64(ml_host *h, int64_t *v, int n, ml_redop op) {
  return ml_mpi_check(MPI_Allreduce(MPI_IN_PLACE, v, n, MPI_INT64_T, mpi_op(op), h->comm),
                      "MPI_Allreduce (host channel)", h->name);
}

/* Byte counts go to MPI as int. */
static int bytes_ok(ml_host *h, size_t bytes, const char *what) {
  if (bytes <= (size_t)INT_MAX) return 0;
  return ml_err("%s on host channel '%s': %zu bytes exceeds MPI's int count", what, h->name,
                bytes);
}

int ml_host_broadcast(ml_host *h, void *buf, size_t bytes, int root) {
  ML_TRY(bytes_ok(h, bytes, "broadcast"));
  return ml_mpi_check(MPI_Bcast(buf, (int)bytes, MPI_BYTE, root, h->comm),
                      "MPI_Bcast (host channel)", h->name);
}

int ml_host_all_gather(ml_host *h, const void *send, size_t bytes, void *recv) {
  ML_TRY(bytes_ok(h, bytes * (size_t)h->size, "all-gather"));
  return ml_mpi_check(
      MPI_Allgather(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, h->comm),
      "MPI_Allgather (host channel)", h->name);
}

int ml_host_all_to_all_i64(ml_host *h, const int64_t *send, int n, int64_t *recv) {
  ML_TRY(bytes_ok(h, (size_t)n * (size_t)h->size, "all-to-all"));
  return ml_mpi_check(MPI_Alltoall(send, n, MPI_INT64_T, recv, n, MPI_INT64_T, h->comm),
                      "MPI_Alltoall (host channel)", h->name);
}

int ml_host_all_gather_v(ml_host *h, const void *send, const size_t *bytes, void *recv) {
  size_t total = 0;
  for (int q = 0; q < h->size; q++) {
    ML_TRY(bytes_ok(h, bytes[q], "all-gather (v)"));
    total += bytes[q];
    ML_TRY(bytes_ok(h, total, "all-gather (v)"));
  }
  int *counts = ml_calloc((size_t)h->size * 2, sizeof *counts, "host all-gather counts");
  if (!counts) return -1;
  int *displs = counts + h->size;
  for (int q = 0, at = 0; q < h->size; at += counts[q++]) {
    counts[q] = (int)bytes[q];
    displs[q] = at;
  }
  int rc = ml_mpi_check(MPI_Allgatherv(send, counts[h->rank], MPI_BYTE, recv, counts, displs,
                                       MPI_BYTE, h->comm),
                        "MPI_Allgatherv (host channel)", h->name);
  free(counts);
  return rc;
}

enum { P2P_CHUNK = 1 << 30, P2P_TAG = 7 };

int ml_host_send(ml_host *h, const void *buf, size_t bytes, int dst) {
  for (size_t at = 0; at < bytes; at += P2P_CHUNK) {
    size_t k = bytes - at < P2P_CHUNK ? bytes - at : P2P_CHUNK;
    ML_TRY(ml_mpi_check(MPI_Send((const char *)buf + at, (int)k, MPI_BYTE, dst, P2P_TAG, h->comm),
                        "MPI_Send (host channel)", h->name));
  }
  return 0;
}

int ml_host_recv(ml_host *h, void *buf, size_t bytes, int src) {
  for (size_t at = 0; at < bytes; at += P2P_CHUNK) {
    size_t k = bytes - at < P2P_CHUNK ? bytes - at : P2P_CHUNK;
    MPI_Status st;
    int got = 0;
    ML_TRY(ml_mpi_check(MPI_Recv((char *)buf + at, (int)k, MPI_BYTE, src, P2P_TAG, h->comm, &st),
                        "MPI_Recv (host channel)", h->name));
    MPI_Get_count(&st, MPI_BYTE, &got);
    if ((size_t)got != k)
      return ml_err("MPI_Recv (host channel '%s') from rank %d: %d bytes, expected %zu", h->name,
                    src, got, k);
  }
  return 0;
}

int ml_host_barrier(ml_host *h) {
  return ml_mpi_check(MPI_Barrier(h->comm), "MPI_Barrier (host channel)", h->name);
}

int ml_host_first_failing(ml_host *h, int rc, int *first) {
  int64_t r = rc != 0 ? h->rank : h->size;
  ML_TRY(ml_host_all_reduce_i64(h, &r, 1, ML_RED_MIN));
  *first = r < h->size ? (int)r : -1;
  return 0;
}

int ml_host_agree(ml_host *h, int rc) {
  if (h->size == 1) return rc != 0 ? -1 : 0;
  int first;
  ML_TRY(ml_host_first_failing(h, rc, &first));
  if (first < 0) return 0;
  struct {
    int32_t origin;
    char msg[ML_ERROR_MSG_CAP];
  } report = {-1, ""};
  if (h->rank == first) {
    report.origin = ml_error_origin();
    snprintf(report.msg, sizeof report.msg, "%s", ml_error_msg());
  }
  ML_TRY(ml_host_broadcast(h, &report, sizeof report, first));
  if (report.origin < 0)
    snprintf(report.msg, sizeof report.msg, "rank %d of group '%s' failed without a message",
             first, h->name);
  return ml_error_adopt(report.origin, report.msg);
}

int ml_host_all_equal(ml_host *h, uint64_t v, bool *equal) {
  int64_t x[4] = {(int64_t)(v >> 32), (int64_t)(v & 0xffffffffu), -(int64_t)(v >> 32),
                  -(int64_t)(v & 0xffffffffu)};
  *equal = true;
  if (h->size == 1) return 0;
  ML_TRY(ml_host_all_reduce_i64(h, x, 4, ML_RED_MAX));
  *equal = x[0] == -x[2] && x[1] == -x[3];
  return 0;
}
