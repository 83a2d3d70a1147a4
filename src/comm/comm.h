/* Collective communication backend: a vtable with an MPI implementation
 * (comm_mpi.c) and a counting wrapper (comm_count.c) that records, per
 * collective, how many calls and how many bytes, for tests and `meshlm plan`.
 *
 * One ml_comm is one process group (a device-mesh dimension or a flattening
 * of several). Every call is collective over the group: all members call it
 * in the same order with the same sizes. Buffers are fp32 unless an element
 * type is given. Semantics follow torch.distributed (all_reduce,
 * all_gather_into_tensor, reduce_scatter_tensor, async_op=True + wait). */
#ifndef ML_COMM_H
#define ML_COMM_H

#include <stddef.h>
#include <stdint.h>

typedef enum { ML_RED_SUM, ML_RED_MAX, ML_RED_MIN } ml_redop;
/* Element types on the wire. ML_ELEM_BF16 is uint16 bf16 (tensor/dtype.h);
 * its SUM adds pairs in fp32 and rounds to bf16 (as NCCL's bf16 reduction),
 * so a bf16 reduction moves half an fp32 one's bytes. */
typedef enum { ML_ELEM_F32, ML_ELEM_F64, ML_ELEM_BF16 } ml_elem;

/* Bytes per element: 4, 8, 2. */
size_t ml_elem_size(ml_elem e);

/* A collective in flight (torch's Work): started by ml_iall_gather, done
 * after ml_wait. impl belongs to the backend. */
typedef struct ml_request {
  void *impl;
} ml_request;

typedef enum {
  ML_COLL_ALL_REDUCE,
  ML_COLL_ALL_GATHER,
  ML_COLL_REDUCE_SCATTER,
  ML_COLL_BROADCAST,
  ML_COLL_KINDS
} ml_coll;

typedef struct ml_comm ml_comm;

typedef struct ml_comm_ops {
  int (*all_reduce)(ml_comm *c, void *buf, size_t n, ml_elem elem, ml_redop op);
  int (*all_gather)(ml_comm *c, const void *send, void *recv, size_t n_per_rank, ml_elem elem);
  int (*all_gather_v)(ml_comm *c, const float *send, size_t n_send, float *recv,
                      const size_t *counts);
  int (*reduce_scatter)(ml_comm *c, const void *send, void *recv, size_t n_per_rank,
                        ml_elem elem);
  int (*reduce_scatter_v)(ml_comm *c, const float *send, float *recv, const size_t *counts);
  int (*broadcast)(ml_comm *c, void *buf, size_t bytes, int root);
  int (*iall_gather)(ml_comm *c, const void *send, void *recv, size_t n_per_rank, ml_elem elem,
                     ml_request *req);
  int (*wait)(ml_comm *c, ml_request *req);
  void (*destroy)(ml_comm *c);
} ml_comm_ops;

struct ml_comm {
  const ml_comm_ops *ops;
  void *impl;
  int rank, size;
  char name[32]; /* mesh dimension name, for messages and stats ("tp", "dp_shard") */
};

/* In place: buf[n] = op over ranks of buf[n] (BF16: SUM only). */
int ml_all_reduce(ml_comm *c, void *buf, size_t n, ml_elem elem, ml_redop op);
/* recv[size * n] = concatenation of every rank's send[n], in rank order. */
int ml_all_gather(ml_comm *c, const float *send, float *recv, size_t n_per_rank);
/* The same for any element type: recv[size * n] of `elem`. */
int ml_all_gather_t(ml_comm *c, const void *send, void *recv, size_t n_per_rank, ml_elem elem);
/* Nonblocking ml_all_gather_t (MPI_Iallgather): returns once started;
 * send and recv must stay untouched until ml_wait(c, req) returns. Every
 * member starts the same gathers in the same order. */
int ml_iall_gather(ml_comm *c, const void *send, void *recv, size_t n_per_rank, ml_elem elem,
                   ml_request *req);
/* Block until req completes (req->impl is released). */
int ml_wait(ml_comm *c, ml_request *req);
/* Uneven all-gather (torch.chunk shards): rank r sends counts[r] floats
 * (n_send == counts[rank]); recv = concatenation in rank order. */
int ml_all_gather_v(ml_comm *c, const float *send, size_t n_send, float *recv,
                    const size_t *counts);
/* recv[n] = sum over ranks of send[rank * n .. (rank+1) * n). */
int ml_reduce_scatter(ml_comm *c, const float *send, float *recv, size_t n_per_rank);
/* The same for any element type (BF16: see ml_elem). */
int ml_reduce_scatter_t(ml_comm *c, const void *send, void *recv, size_t n_per_rank, ml_elem elem);
/* Uneven reduce-scatter (torch.chunk shards): send = concatenation of every
 * rank's block in rank order, block r has counts[r] floats (zero allowed);
 * recv[counts[rank]] = sum over ranks of this rank's block. send and recv
 * must not overlap. */
int ml_reduce_scatter_v(ml_comm *c, const float *send, float *recv, const size_t *counts);
/* buf[bytes] from `root` to every rank. */
int ml_broadcast(ml_comm *c, void *buf, size_t bytes, int root);
void ml_comm_destroy(ml_comm *c);

/* Collective: 0 when rc == 0 on every rank, else −1 on every rank, each of
 * which then holds the lowest failing rank's message and origin
 * (common/status.h: broadcast from it, replacing whatever this rank had
 * recorded). For steps where only some ranks may fail (rank 0 writing a
 * file, one rank's disk full), so that all exit and whichever rank prints
 * shows the real cause and the rank it arose on. */
int ml_comm_agree(ml_comm *c, int rc);

/* Counting wrapper: calls pass through to `inner` (which it owns). */
typedef struct ml_comm_stats {
  int64_t calls[ML_COLL_KINDS];
  /* Bytes of the collective's full buffer per rank: all-reduce n·elem,
   * all-gather and reduce-scatter size·n_per_rank·elem (the unsharded
   * size; sum(counts)·4 for the uneven _v forms), broadcast the buffer.
   * A nonblocking all-gather counts when it starts. */
  int64_t bytes[ML_COLL_KINDS];
  /* Wall-clock seconds spent inside blocking collectives and ml_wait: the
   * time this rank waited on communication. */
  double wait_s;
} ml_comm_stats;

int ml_comm_counting_create(ml_comm *inner, ml_comm **out);
/* The stats of a counting comm (NULL for any other comm). */
ml_comm_stats *ml_comm_stats_of(ml_comm *c);
void ml_comm_stats_reset(ml_comm *c);
const char *ml_coll_name(ml_coll k);

#endif
