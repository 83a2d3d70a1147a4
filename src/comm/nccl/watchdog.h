/* The NCCL comm's watchdog (torch's ProcessGroupNCCL watchdog with
 * TORCH_NCCL_ASYNC_ERROR_HANDLING=1): a thread per communicator that
 * follows each collective in flight by the CUDA event recorded after it on
 * the group's stream. When NCCL reports an asynchronous error (a peer died,
 * a network failure: ncclCommGetAsyncError), when the event reports a CUDA
 * error, or when a collective has not completed `timeout_s` seconds after it
 * was issued, it prints one line naming the collective, its bytes, the
 * group and the cause ("meshlm: error (rank R): NCCL all_reduce of N bytes
 * on group 'tp' ..."), aborts the communicator (ncclCommAbort: its kernels
 * stop, so no stream waits on it forever) and ends the process with status
 * 1; the launcher then ends the other ranks. A hang thus becomes an exit
 * naming what hung, on every rank whose watchdog sees it. */
#ifndef ML_COMM_NCCL_WATCHDOG_H
#define ML_COMM_NCCL_WATCHDOG_H

#include <cuda_runtime_api.h>
#include <stddef.h>

#include "comm/comm.h"
#include "comm/nccl/nccl_lib.h"

typedef struct ml_nccl_watch ml_nccl_watch;
/* One collective in flight, from ml_nccl_watch_add to its completion. */
typedef struct ml_nccl_flight ml_nccl_flight;

/* Start watching communicator `comm` of group `group` on CUDA device
 * `device`, rank `world_rank` of the job (for the message), with a limit
 * of timeout_s seconds per collective. Errors: allocation, thread
 * creation. */
int ml_nccl_watch_start(const ml_nccl_lib *lib, ncclComm_t comm, const char *group, int device,
                        int world_rank, double timeout_s, ml_nccl_watch **out);

/* Follow a collective of kind `coll` over `bytes` whose completion `done`
 * (an event recorded on the group's stream after it) marks; the watchdog
 * owns the event from here. *out is the flight, for ml_nccl_watch_waited.
 * Errors: allocation (then the event is destroyed). */
int ml_nccl_watch_add(ml_nccl_watch *w, cudaEvent_t done, ml_coll coll, size_t bytes,
                      ml_nccl_flight **out);

/* The event of flight f (valid until ml_nccl_watch_waited(f)). */
cudaEvent_t ml_nccl_flight_event(const ml_nccl_flight *f);

/* The comm's ml_wait has ordered the compute stream after f: the watchdog
 * forgets f (and destroys its event) once it has completed. */
void ml_nccl_watch_waited(ml_nccl_watch *w, ml_nccl_flight *f);

/* Stop the thread (after the collectives in flight completed or timed
 * out) and free everything (NULL: nothing). */
void ml_nccl_watch_stop(ml_nccl_watch *w);

#endif
