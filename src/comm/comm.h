/* Data-path collective backend (ARCHITECTURE.md §12): a vtable with an MPI
 * implementation (comm_mpi.c) and a counting wrapper (comm_count.c) that
 * records, per collective, how many calls and how many bytes, for tests and
 * `meshlm plan`. Control-plane values (loss sums, norms, error agreement,
 * checkpoint metadata) do not travel here: they use the host channel
 * (comm/host.h), which every backend keeps on MPI.
 *
 * One ml_comm is one process group (a device-mesh dimension or a flattening
 * of several). Every call is collective over the group: all members issue
 * the same collectives in the same order with the same sizes. Every
 * collective moves equal-size blocks (one per rank), so each call maps 1:1
 * onto NCCL; uneven torch.chunk shards are padded by the caller
 * (parallel/redistribute.h, ml_all_gather_padded), as torch's DTensor pads
 * them. Semantics follow torch.distributed (all_reduce,
 * all_gather_into_tensor, reduce_scatter_tensor) with async_op=True: every
 * collective is issued nonblocking and returns an ml_request (torch's Work)
 * that ml_wait completes; the blocking forms are ml_i* + ml_wait.
 *
 * Backends:
 *  - MPI (CPU): MPI_Iallreduce / MPI_Iallgather / MPI_Ireduce_scatter_block
 *    on a duplicate of the group's communicator; the request owns the
 *    MPI_Request and ml_wait is MPI_Wait. bf16 SUM is a user MPI_Op that adds
 *    in fp32 and rounds to nearest-even (MPI has no bf16 type). Sums over
 *    three or more ranks are in the order of the library's nonblocking
 *    algorithm (Open MPI: libnbc, whose reduce-scatter order differs from its
 *    blocking MPI_Reduce_scatter_block's), the same on every call.
 *  - Staged (comm_staged.h), device memory over MPI: the input copied to
 *    host staging, the MPI comm's collective, the result copied back in
 *    ml_wait (gloo's way with CUDA tensors): the MPI comm's results, bit for
 *    bit, with any number of ranks on one device.
 *  - A device backend (CUDA + NCCL, nccl/comm_nccl.h) maps the same calls onto
 *    ncclAllReduce / ncclAllGather / ncclReduceScatter (ncclFloat32,
 *    ncclBfloat16; ncclSum / ncclMax / ncclMin) enqueued on the
 *    group's communication stream, after a cudaStreamWaitEvent on the event
 *    the compute stream recorded when the inputs were ready; the request is a
 *    cudaEvent recorded on the communication stream after the collective.
 *    ml_wait makes the result usable: cudaStreamWaitEvent(compute stream,
 *    event) (device-side ordering; the host does not block; a host read
 *    of the result, ml_be_copy D2H, synchronises the compute stream).
 *    Buffers are device pointers there; one ncclComm per mesh group of
 *    several ranks (parallel/mesh.h's comm factory: ncclCommInitRank
 *    bootstrapped over the group's MPI communicator); parallel/device.h
 *    chooses it or the staged comm. */
#ifndef ML_COMM_H
#define ML_COMM_H

#include <stddef.h>
#include <stdint.h>

typedef enum { ML_RED_SUM, ML_RED_MAX, ML_RED_MIN } ml_redop;
/* Element types on the wire. ML_ELEM_BF16 is uint16 bf16 (tensor/dtype.h);
 * its SUM adds pairs in fp32 and rounds to bf16 (as NCCL's bf16 reduction),
 * so a bf16 reduction moves half an fp32 one's bytes; MAX and MIN are not
 * supported on it. Scalars of the control plane (fp64 loss sums, norms)
 * travel on the host channel (comm/host.h), not here. */
typedef enum { ML_ELEM_F32, ML_ELEM_BF16 } ml_elem;

/* Bytes per element: 4, 8, 2. */
size_t ml_elem_size(ml_elem e);

/* A collective in flight (torch's Work): started by ml_iall_reduce,
 * ml_iall_gather or ml_ireduce_scatter, done after ml_wait on the comm that
 * started it. impl belongs to the backend (MPI: an MPI_Request; staged: the
 * MPI request and the host staging; NCCL: the watchdog's record of a
 * cudaEvent); NULL when nothing is in flight. */
typedef struct ml_request {
  void *impl;
} ml_request;

typedef enum {
  ML_COLL_ALL_REDUCE,
  ML_COLL_ALL_GATHER,
  ML_COLL_REDUCE_SCATTER,
  ML_COLL_SEND_RECV, /* ml_iring_pass: a point-to-point send and receive per rank */
  ML_COLL_ALL_TO_ALL, /* ml_iall_to_all_v: uneven blocks between every pair of ranks */
  ML_COLL_KINDS
} ml_coll;

typedef struct ml_comm ml_comm;

/* The backend's entry points (see the public functions below). */
typedef struct ml_comm_ops {
  int (*iall_reduce)(ml_comm *c, void *buf, size_t n, ml_elem elem, ml_redop op, ml_request *req);
  int (*iall_gather)(ml_comm *c, const void *send, void *recv, size_t n_per_rank, ml_elem elem,
                     ml_request *req);
  int (*ireduce_scatter)(ml_comm *c, const void *send, void *recv, size_t n_per_rank,
                         ml_elem elem, ml_request *req);
  int (*iring_pass)(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                    ml_request *req);
  int (*wait)(ml_comm *c, ml_request *req);
  void (*destroy)(ml_comm *c);
  int (*iall_to_all_v)(ml_comm *c, const void *send, const int64_t *send_counts, void *recv,
                       const int64_t *recv_counts, ml_elem elem, ml_request *req);
} ml_comm_ops;

struct ml_comm {
  const ml_comm_ops *ops;
  void *impl;
  int rank, size;
  char name[32]; /* mesh group name, for messages and stats ("tp", "dp_shard") */
};

/* ---- nonblocking: each returns once the collective is issued. Until
 * ml_wait(c, req) returns, send must not be written, and recv (buf for the
 * all-reduce) neither read nor written. Every member issues the group's
 * collectives in the same order; several may be in flight and be waited on
 * in any order. On error nothing is in flight (req->impl NULL). Errors: a
 * count beyond the backend's limit (MPI: int), BF16 with MAX or MIN,
 * allocation, the backend's failure (with its message). */

/* In place: buf[n] = op over ranks of buf[n] (torch all_reduce). */
int ml_iall_reduce(ml_comm *c, void *buf, size_t n, ml_elem elem, ml_redop op, ml_request *req);
/* recv[size · n] = concatenation of every rank's send[n] in rank order
 * (torch all_gather_into_tensor). send and recv must not overlap. */
int ml_iall_gather(ml_comm *c, const void *send, void *recv, size_t n_per_rank, ml_elem elem,
                   ml_request *req);
/* recv[n] = sum over ranks of their send[rank · n .. (rank+1) · n)
 * (torch reduce_scatter_tensor, SUM). send [size · n] and recv must not
 * overlap. */
int ml_ireduce_scatter(ml_comm *c, const void *send, void *recv, size_t n_per_rank, ml_elem elem,
                       ml_request *req);
/* One step around the group's ring (context parallelism's ring attention,
 * torch's batch_isend_irecv of a P2POp pair): send[n] goes to rank
 * (rank + 1) mod size, recv[n] receives what rank (rank − 1) mod size sent.
 * send and recv must not overlap. On a group of one rank recv = send.
 * MPI: MPI_Isend + MPI_Irecv; NCCL: ncclSend + ncclRecv in one group. */
int ml_iring_pass(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                  ml_request *req);
/* All-to-all with uneven blocks (torch's all_to_all_single with
 * input_split_sizes / output_split_sizes; MPI_Ialltoallv; NCCL: one
 * ncclSend and one ncclRecv per peer in one group, as torch's NCCL
 * all_to_all). send holds `size` blocks packed in rank order, block q
 * (send_counts[q] elements) for rank q; recv receives them packed in rank
 * order, block q (recv_counts[q] elements) from rank q. recv_counts[q] on
 * this rank must equal send_counts[rank] on rank q (exchange the counts
 * first, e.g. with ml_host_all_to_all_i64 (comm/host.h), as expert
 * parallelism does before its token exchange). The count arrays [size] are
 * read when the call is issued (the backend keeps copies), the buffers as
 * for every collective. Moves bits: recv is bitwise the senders' blocks.
 * send and recv must not overlap. On a group of one rank recv = send.
 * Errors: a negative count, a count or a block offset beyond the backend's
 * limit (MPI: int), allocation, the backend's failure. */
int ml_iall_to_all_v(ml_comm *c, const void *send, const int64_t *send_counts, void *recv,
                     const int64_t *recv_counts, ml_elem elem, ml_request *req);
/* Complete req (see above for what that means on a device backend) and
 * release it (req->impl = NULL). Returns 0 at once when nothing is in
 * flight. */
int ml_wait(ml_comm *c, ml_request *req);

/* ---- blocking: the nonblocking call, then ml_wait. */

int ml_all_reduce(ml_comm *c, void *buf, size_t n, ml_elem elem, ml_redop op);
/* fp32 ml_iall_gather + ml_wait. */
int ml_all_gather(ml_comm *c, const float *send, float *recv, size_t n_per_rank);
int ml_all_gather_t(ml_comm *c, const void *send, void *recv, size_t n_per_rank, ml_elem elem);
/* fp32 ml_ireduce_scatter + ml_wait. */
int ml_reduce_scatter(ml_comm *c, const float *send, float *recv, size_t n_per_rank);
int ml_reduce_scatter_t(ml_comm *c, const void *send, void *recv, size_t n_per_rank, ml_elem elem);

/* ml_iall_to_all_v + ml_wait. */
int ml_all_to_all_v(ml_comm *c, const void *send, const int64_t *send_counts, void *recv,
                    const int64_t *recv_counts, ml_elem elem);

void ml_comm_destroy(ml_comm *c);

/* Counting wrapper (the role of torch's CommDebugMode): calls pass through
 * to `inner` (which it owns). */
typedef struct ml_comm_stats {
  int64_t calls[ML_COLL_KINDS];
  /* Bytes of the collective's full buffer per rank, counted when the
   * collective is issued: all-reduce n·elem, all-gather and reduce-scatter
   * size·n_per_rank·elem, send_recv the n·elem bytes each rank sends,
   * all_to_all the Σ send_counts·elem bytes of the rank's send buffer
   * (its block to itself included, as all-gather counts its own).
   * For uneven torch.chunk shards n_per_rank is the
   * padded chunk (ceil(n / size) rows), so these count the padding too:
   * what goes on the wire, not the tensor's size. */
  int64_t bytes[ML_COLL_KINDS];
  /* Wall-clock seconds spent inside ml_wait (every blocking collective
   * waits there too): the time this rank waited on communication. Issuing
   * is not counted. */
  double wait_s;
} ml_comm_stats;

int ml_comm_counting_create(ml_comm *inner, ml_comm **out);
/* The stats of a counting comm (NULL for any other comm). */
ml_comm_stats *ml_comm_stats_of(ml_comm *c);
void ml_comm_stats_reset(ml_comm *c);
/* "all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all". */
const char *ml_coll_name(ml_coll k);

#endif
