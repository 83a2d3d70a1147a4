/* The NCCL comm (comm_nccl.h). */
#include "comm/nccl/comm_nccl.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend/cuda/cuda.h"
#include "comm/comm_local.h"
#include "comm/comm_mpi.h"
#include "comm/nccl/nccl_lib.h"
#include "comm/nccl/watchdog.h"
#include "common/status.h"

typedef struct nccl {
  const ml_nccl_lib *lib;
  ncclComm_t comm;
  cudaStream_t stream;  /* the group's */
  cudaStream_t compute; /* the backend's */
  cudaEvent_t ready;    /* recorded on compute before each collective */
  ml_nccl_watch *watch;
} nccl;

static nccl *nc_of(ml_comm *c) { return c->impl; }

static int cuda_ok(ml_comm *c, cudaError_t e, const char *what) {
  if (e == cudaSuccess) return 0;
  return ml_err("NCCL comm of group '%s': %s failed: %s (%s)", c->name, what, cudaGetErrorName(e),
                cudaGetErrorString(e));
}

static ncclDataType_t nccl_type(ml_elem e) {
  return e == ML_ELEM_BF16 ? ncclBfloat16 : ncclFloat32;
}

/* The group's stream after everything enqueued on the compute stream so
 * far (the collective's inputs). */
static int begin(ml_comm *c) {
  nccl *n = nc_of(c);
  ML_TRY(cuda_ok(c, cudaEventRecord(n->ready, n->compute), "cudaEventRecord"));
  return cuda_ok(c, cudaStreamWaitEvent(n->stream, n->ready, 0), "cudaStreamWaitEvent");
}

/* After the NCCL call (rc): the event that marks its completion on the
 * group's stream, watched, as the request. */
static int issued(ml_comm *c, ncclResult_t rc, ml_coll coll, size_t bytes, ml_request *req) {
  nccl *n = nc_of(c);
  ML_TRY(ml_nccl_check(n->lib, rc, n->comm, ml_coll_name(coll), c->name));
  cudaEvent_t done;
  ML_TRY(cuda_ok(c, cudaEventCreateWithFlags(&done, cudaEventDisableTiming),
                 "cudaEventCreateWithFlags"));
  if (cuda_ok(c, cudaEventRecord(done, n->stream), "cudaEventRecord")) {
    cudaEventDestroy(done);
    return -1;
  }
  ml_nccl_flight *f;
  ML_TRY(ml_nccl_watch_add(n->watch, done, coll, bytes, &f));
  req->impl = f;
  return 0;
}

static int nc_iall_reduce(ml_comm *c, void *buf, size_t n, ml_elem elem, ml_redop op,
                          ml_request *req) {
  if (elem == ML_ELEM_BF16 && op != ML_RED_SUM)
    return ml_err("comm '%s': bf16 reductions support SUM only", c->name);
  ncclRedOp_t o = op == ML_RED_MAX ? ncclMax : op == ML_RED_MIN ? ncclMin : ncclSum;
  nccl *nc = nc_of(c);
  ML_TRY(begin(c));
  return issued(c, nc->lib->AllReduce(buf, buf, n, nccl_type(elem), o, nc->comm, nc->stream),
                ML_COLL_ALL_REDUCE, n * ml_elem_size(elem), req);
}

static int nc_iall_gather(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                          ml_request *req) {
  nccl *nc = nc_of(c);
  ML_TRY(begin(c));
  return issued(c, nc->lib->AllGather(send, recv, n, nccl_type(elem), nc->comm, nc->stream),
                ML_COLL_ALL_GATHER, n * (size_t)c->size * ml_elem_size(elem), req);
}

static int nc_ireduce_scatter(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                              ml_request *req) {
  nccl *nc = nc_of(c);
  ML_TRY(begin(c));
  return issued(c,
                nc->lib->ReduceScatter(send, recv, n, nccl_type(elem), ncclSum, nc->comm,
                                       nc->stream),
                ML_COLL_REDUCE_SCATTER, n * (size_t)c->size * ml_elem_size(elem), req);
}

/* ncclSend to the next rank and ncclRecv from the previous, one group call. */
static int nc_iring_pass(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                         ml_request *req) {
  nccl *nc = nc_of(c);
  const ml_nccl_lib *l = nc->lib;
  int to = (c->rank + 1) % c->size, from = (c->rank + c->size - 1) % c->size;
  ncclDataType_t t = nccl_type(elem);
  ML_TRY(begin(c));
  ML_TRY(ml_nccl_check(l, l->GroupStart(), nc->comm, "ncclGroupStart", c->name));
  ncclResult_t rc = l->Send(send, n, t, to, nc->comm, nc->stream);
  ncclResult_t rc2 = l->Recv(recv, n, t, from, nc->comm, nc->stream);
  ncclResult_t end = l->GroupEnd();
  return issued(c, rc != ncclSuccess ? rc : rc2 != ncclSuccess ? rc2 : end, ML_COLL_SEND_RECV,
                n * ml_elem_size(elem), req);
}

/* One ncclSend and one ncclRecv per peer with a non-empty block, in one
 * group (torch's NCCL all_to_all_single). */
static int nc_iall_to_all_v(ml_comm *c, const void *send, const int64_t *send_counts, void *recv,
                            const int64_t *recv_counts, ml_elem elem, ml_request *req) {
  nccl *nc = nc_of(c);
  const ml_nccl_lib *l = nc->lib;
  ncclDataType_t t = nccl_type(elem);
  size_t es = ml_elem_size(elem), so = 0, ro = 0;
  ML_TRY(begin(c));
  ML_TRY(ml_nccl_check(l, l->GroupStart(), nc->comm, "ncclGroupStart", c->name));
  ncclResult_t rc = ncclSuccess;
  for (int q = 0; q < c->size; q++) {
    if (rc == ncclSuccess && send_counts[q])
      rc = l->Send((const char *)send + so * es, (size_t)send_counts[q], t, q, nc->comm, nc->stream);
    if (rc == ncclSuccess && recv_counts[q])
      rc = l->Recv((char *)recv + ro * es, (size_t)recv_counts[q], t, q, nc->comm, nc->stream);
    so += (size_t)send_counts[q];
    ro += (size_t)recv_counts[q];
  }
  ncclResult_t end = l->GroupEnd();
  return issued(c, rc != ncclSuccess ? rc : end, ML_COLL_ALL_TO_ALL, so * es, req);
}

/* The compute stream after the collective (comm_nccl.h). */
static int nc_wait(ml_comm *c, ml_request *req) {
  nccl *n = nc_of(c);
  ml_nccl_flight *f = req->impl;
  req->impl = NULL;
  int rc = cuda_ok(c, cudaStreamWaitEvent(n->compute, ml_nccl_flight_event(f), 0),
                   "cudaStreamWaitEvent");
  ml_nccl_watch_waited(n->watch, f);
  return rc;
}

static void nc_destroy(ml_comm *c) {
  nccl *n = nc_of(c);
  if (n->stream) cudaStreamSynchronize(n->stream);
  ml_nccl_watch_stop(n->watch);
  if (n->comm) n->lib->CommDestroy(n->comm);
  if (n->ready) cudaEventDestroy(n->ready);
  if (n->stream) cudaStreamDestroy(n->stream);
  free(n);
  free(c);
}

static const ml_comm_ops k_nccl_ops = {.iall_reduce = nc_iall_reduce,
                                       .iall_gather = nc_iall_gather,
                                       .ireduce_scatter = nc_ireduce_scatter,
                                       .iring_pass = nc_iring_pass,
                                       .iall_to_all_v = nc_iall_to_all_v,
                                       .wait = nc_wait,
                                       .destroy = nc_destroy};

/* Rank 0's unique id on every rank, with rank 0's success: a failure there
 * fails every rank instead of leaving them in ncclCommInitRank. */
static int unique_id(ml_comm *c, MPI_Comm group, ncclUniqueId *id) {
  nccl *n = nc_of(c);
  struct {
    int rc;
    ncclUniqueId id;
  } msg = {0};
  if (c->rank == 0) msg.rc = ml_nccl_check(n->lib, n->lib->GetUniqueId(&msg.id), NULL,
                                           "ncclGetUniqueId", c->name);
  ML_TRY(ml_mpi_check(MPI_Bcast(&msg, (int)sizeof msg, MPI_BYTE, 0, group),
                      "MPI_Bcast of the NCCL unique id", c->name));
  if (msg.rc && c->rank != 0)
    return ml_err("NCCL comm of group '%s': ncclGetUniqueId failed on the group's rank 0", c->name);
  *id = msg.id;
  return msg.rc;
}

/* The communicator, stream, event and watchdog of c on be. */
static int open_comm(ml_comm *c, ml_backend *be, MPI_Comm group, double timeout_s) {
  nccl *n = nc_of(c);
  int world_rank;
  ncclUniqueId id;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  ML_TRY(unique_id(c, group, &id));
  ML_TRY(ml_nccl_check(n->lib, n->lib->CommInitRank(&n->comm, c->size, id, c->rank), NULL,
                       "ncclCommInitRank", c->name));
  ML_TRY(cuda_ok(c, cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking),
                 "cudaStreamCreateWithFlags"));
  ML_TRY(cuda_ok(c, cudaEventCreateWithFlags(&n->ready, cudaEventDisableTiming),
                 "cudaEventCreateWithFlags"));
  return ml_nccl_watch_start(n->lib, n->comm, c->name, ml_cuda_device(be), world_rank, timeout_s,
                             &n->watch);
}

int ml_comm_nccl_create(ml_backend *be, MPI_Comm group, const char *name, double timeout_s,
                        ml_comm **out) {
  if (!ml_cuda_stream(be))
    return ml_err("NCCL comm of group '%s': device '%s'; expected the cuda backend", name,
                  be->ops->name);
  const ml_nccl_lib *lib;
  ML_TRY(ml_nccl_lib_get(&lib));
  ml_comm *c = ml_calloc(1, sizeof *c, "an NCCL comm");
  nccl *n = ml_calloc(1, sizeof *n, "an NCCL comm");
  if (!c || !n) {
    free(c);
    free(n);
    return -1;
  }
  *n = (nccl){.lib = lib, .compute = ml_cuda_stream(be)};
  *c = (ml_comm){.ops = &k_nccl_ops, .impl = n};
  snprintf(c->name, sizeof c->name, "%s", name);
  MPI_Comm_rank(group, &c->rank);
  MPI_Comm_size(group, &c->size);
  if (open_comm(c, be, group, timeout_s)) {
    nc_destroy(c);
    return -1;
  }
  *out = c;
  return 0;
}

int ml_comm_nccl_make(void *ctx, MPI_Comm group, const char *name, ml_comm **out) {
  int size;
  ML_TRY(ml_mpi_check(MPI_Comm_size(group, &size), "MPI_Comm_size", name));
  if (size == 1) return ml_comm_local_make(ctx, group, name, out);
  return ml_comm_nccl_create(ctx, group, name, ML_NCCL_TIMEOUT_S, out);
}
