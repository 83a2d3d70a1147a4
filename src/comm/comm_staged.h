/* The staged comm: the data comm of a mesh group whose buffers are device
 * memory of a backend without a device collective library to use (no NCCL
 * in the build, or several ranks sharing one GPU where NCCL refuses them).
 * Like gloo with CUDA tensors: each collective copies its input from the
 * device into host staging memory (ml_be_host_alloc: pinned on CUDA), runs
 * the MPI comm's collective (comm/comm_mpi.h) on the host buffers, and
 * ml_wait copies the result back to the device. Slower than NCCL (two
 * copies over PCIe and the host's MPI), but any number of ranks may share
 * a device. The results are the MPI comm's on the same bytes, bit for bit:
 * the same MPI calls (in-place all-reduce included) with the same counts.
 *
 * It uses only the backend's memory entry points (ml_be_host_alloc,
 * ml_be_copy), so it runs on every backend: on the CPU backend, whose
 * device pool and host staging pool are distinct, it is what the tests
 * compare with the plain MPI comm.
 *
 * Ordering: issuing copies the input device → host, which on CUDA waits
 * for the compute stream (ml_be_copy D2H), so the collective sees every
 * operator enqueued before it; the MPI collective then progresses while
 * the host enqueues more work; ml_wait completes it and copies host →
 * device (on CUDA: synchronously, so the result is usable by whatever is
 * enqueued next). */
#ifndef ML_COMM_STAGED_H
#define ML_COMM_STAGED_H

#include <mpi.h>

#include "backend/backend.h"
#include "comm/comm.h"

/* A staged comm over the ranks of `group` (an MPI comm over a duplicate of
 * it, comm/comm_mpi.h) for buffers of be's device memory. `name` names the
 * group in messages. Errors: MPI failures, allocation. */
int ml_comm_staged_create(ml_backend *be, MPI_Comm group, const char *name, ml_comm **out);

/* A mesh comm factory (parallel/mesh.h, ml_comm_factory) with ctx the
 * ml_backend whose memory the buffers are: the staged comm for a group of
 * several ranks, the local comm (comm/comm_local.h: device copies, no
 * staging) for a group of one. Errors: ml_comm_staged_create's. */
int ml_comm_staged_make(void *ctx, MPI_Comm group, const char *name, ml_comm **out);

#endif
