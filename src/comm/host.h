/* Host channel: the control plane of one process group (ARCHITECTURE.md §12).
 * Small values the host decides on — loss sums, norms, the first failing
 * rank and its error message, checkpoint names and metadata, timings —
 * travel here, over MPI, whatever backend carries the data path (comm.h):
 * a CUDA + NCCL backend keeps this channel on MPI (host memory, blocking)
 * while its tensors go over NCCL. Every mesh group carries one
 * (parallel/mesh.h); the CLI has one over MPI_COMM_WORLD.
 *
 * Every call is collective over the group and blocking; all members make
 * the same calls in the same order with the same sizes. Buffers are host
 * memory. The channel has its own communicator (a duplicate), so control
 * messages never interleave with the data path's. Errors: MPI failures,
 * with MPI's message, naming the group. */
#ifndef ML_HOST_H
#define ML_HOST_H

#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "comm/comm.h"

typedef struct ml_host {
  MPI_Comm comm; /* a duplicate owned by the channel */
  int rank, size;
  char name[32]; /* the group's name ("world", "dp_cp"), for messages */
} ml_host;

/* A channel over the ranks of `base` (duplicated; the caller keeps base).
 * Errors: MPI failures, allocation. */
int ml_host_create(MPI_Comm base, const char *name, ml_host **out);
/* Free the channel (NULL: nothing). */
void ml_host_destroy(ml_host *h);

/* In place: v[n] = op over ranks of v[n] (MPI_Allreduce, exact for MAX and
 * MIN; SUM in MPI's order). */
int ml_host_all_reduce_f64(ml_host *h, double *v, int n, ml_redop op);
int ml_host_all_reduce_i64(ml_host *h, int64_t *v, int n, ml_redop op);
/* buf[bytes] from `root` to every rank (MPI_Bcast). */
int ml_host_broadcast(ml_host *h, void *buf, size_t bytes, int root);
/* recv[size · bytes] = every rank's send[bytes] in rank order
 * (MPI_Allgather of bytes). */
int ml_host_all_gather(ml_host *h, const void *send, size_t bytes, void *recv);
/* recv = every rank's send[bytes[rank]] in rank order, packed: rank q's
 * block at offset bytes[0] + ... + bytes[q−1] (MPI_Allgatherv of bytes).
 * bytes[size] is the same array on every rank (a rank's block may be
 * empty); recv has room for their sum. For host results of different
 * lengths per rank (e.g. per-sequence log-probs). Errors: a block or the
 * sum beyond MPI's int count, allocation, MPI failures. */
int ml_host_all_gather_v(ml_host *h, const void *send, const size_t *bytes, void *recv);
/* recv[q · n .. (q+1) · n) = rank q's send[rank · n .. (rank+1) · n) for
 * every rank q (MPI_Alltoall of int64, torch's all_to_all_single of a
 * counts tensor): the block sizes of an uneven exchange (comm.h
 * ml_iall_to_all_v), exchanged before it. send and recv hold size · n
 * values and must not overlap. Errors: size · n beyond MPI's int count, MPI
 * failures. */
int ml_host_all_to_all_i64(ml_host *h, const int64_t *send, int n, int64_t *recv);
/* Point to point, the exception to "collective" above: only the two ranks
 * take part, with matching calls in the same order. ml_host_send sends
 * buf[bytes] to rank `dst`; ml_host_recv receives the same count from rank
 * `src` into buf[bytes] (MPI_Send / MPI_Recv, in messages of at most 1 GiB,
 * so any size goes). For streaming one rank's data to a writer (the HF
 * export gathers one tensor at a time to world rank 0, ckpt/save.h).
 * Errors: MPI failures, a message of another size than expected. */
int ml_host_send(ml_host *h, const void *buf, size_t bytes, int dst);
int ml_host_recv(ml_host *h, void *buf, size_t bytes, int src);
/* Every rank has entered (MPI_Barrier). */
int ml_host_barrier(ml_host *h);

/* The lowest rank whose rc != 0 into *first, or −1 when every rc is 0: one
 * all-reduce MIN. Returns 0, or −1 when the all-reduce failed. */
int ml_host_first_failing(ml_host *h, int rc, int *first);

/* Error agreement: 0 when rc == 0 on every rank, else −1 on every rank,
 * each of which then holds the lowest failing rank's message and origin
 * (common/status.h: broadcast from it, replacing whatever this rank had
 * recorded). For steps where only some ranks may fail (rank 0 writing a
 * file, one rank's disk full), so that all exit and whichever rank prints
 * shows the real cause and the rank it arose on. */
int ml_host_agree(ml_host *h, int rc);

/* Whether every rank of h passed the same value v (e.g. a fingerprint,
 * common/hash.h): *equal on every rank, from one all-reduce MAX of v's
 * two 32-bit halves and their negations (max = −min: all equal). Errors:
 * MPI failures. */
int ml_host_all_equal(ml_host *h, uint64_t v, bool *equal);

#endif
