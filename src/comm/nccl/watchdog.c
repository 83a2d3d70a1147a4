/* The NCCL comm's watchdog (watchdog.h). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include "comm/nccl/watchdog.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "common/status.h"

/* How often the thread looks at the collectives in flight. */
enum { POLL_MS = 100 };

struct ml_nccl_flight {
  cudaEvent_t done;
  ml_coll coll;
  size_t bytes;
  double t0; /* CLOCK_MONOTONIC seconds when issued */
  bool waited;
  ml_nccl_flight *next;
};

struct ml_nccl_watch {
  const ml_nccl_lib *lib;
  ncclComm_t comm;
  char group[32];
  int device, world_rank;
  double timeout_s;
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t wake;
  bool stop;
  ml_nccl_flight *flights; /* newest first */
};

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The end of the process: the line, the abort, status 1 (watchdog.h). */
static void fail(ml_nccl_watch *w, const ml_nccl_flight *f, const char *cause) {
  if (f)
    fprintf(stderr, "meshlm: error (rank %d): NCCL %s of %zu bytes on group '%s' %s; aborting the "
                    "communicator (ncclCommAbort) and this rank\n",
            w->world_rank, ml_coll_name(f->coll), f->bytes, w->group, cause);
  else
    fprintf(stderr, "meshlm: error (rank %d): NCCL on group '%s': %s; aborting the communicator "
                    "(ncclCommAbort) and this rank\n",
            w->world_rank, w->group, cause);
  fflush(stderr);
  w->lib->CommAbort(w->comm);
  _exit(1);
}

/* One look: NCCL's asynchronous error, then each flight's event and age;
 * completed flights that were waited on are freed. Called with mu held. */
static void look(ml_nccl_watch *w) {
  ncclResult_t async = ncclSuccess;
  char cause[512];
  if (w->lib->CommGetAsyncError(w->comm, &async) == ncclSuccess && async != ncclSuccess &&
      async != ncclInProgress) {
    const char *last = w->lib->GetLastError(w->comm);
    snprintf(cause, sizeof cause, "failed: %s%s%s", w->lib->GetErrorString(async),
             last && last[0] ? ": " : "", last && last[0] ? last : "");
    fail(w, w->flights, cause);
  }
  double t = now_s();
  for (ml_nccl_flight **p = &w->flights; *p;) {
    ml_nccl_flight *f = *p;
    cudaError_t e = cudaEventQuery(f->done);
    if (e == cudaSuccess && f->waited) {
      *p = f->next;
      cudaEventDestroy(f->done);
      free(f);
      continue;
    }
    if (e != cudaSuccess && e != cudaErrorNotReady) {
      snprintf(cause, sizeof cause, "failed on the device: %s (%s)", cudaGetErrorName(e),
               cudaGetErrorString(e));
      fail(w, f, cause);
    }
    if (e == cudaErrorNotReady && t - f->t0 > w->timeout_s) {
      snprintf(cause, sizeof cause,
               "has not completed %.0f s after it was issued (the limit; a peer died or did not "
               "issue it)",
               t - f->t0);
      fail(w, f, cause);
    }
    p = &f->next;
  }
}

static void *run(void *arg) {
  ml_nccl_watch *w = arg;
  cudaSetDevice(w->device); /* the events' device, current in this thread */
  pthread_mutex_lock(&w->mu);
  while (!w->stop || w->flights) {
    look(w);
    if (w->stop && !w->flights) break;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += POLL_MS * 1000000L;
    until.tv_sec += until.tv_nsec / 1000000000L;
    until.tv_nsec %= 1000000000L;
    pthread_cond_timedwait(&w->wake, &w->mu, &until); /* timed out or woken: look again */
  }
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

int ml_nccl_watch_start(const ml_nccl_lib *lib, ncclComm_t comm, const char *group, int device,
                        int world_rank, double timeout_s, ml_nccl_watch **out) {
  ml_nccl_watch *w = ml_calloc(1, sizeof *w, "an NCCL watchdog");
  if (!w) return -1;
  *w = (ml_nccl_watch){.lib = lib, .comm = comm, .device = device, .world_rank = world_rank,
                       .timeout_s = timeout_s};
  snprintf(w->group, sizeof w->group, "%s", group);
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->wake, NULL);
  int rc = pthread_create(&w->thread, NULL, run, w);
  if (rc) {
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->wake);
    free(w);
    return ml_err("NCCL watchdog of group '%s': pthread_create failed (error %d)", group, rc);
  }
  *out = w;
  return 0;
}

int ml_nccl_watch_add(ml_nccl_watch *w, cudaEvent_t done, ml_coll coll, size_t bytes,
                      ml_nccl_flight **out) {
  ml_nccl_flight *f = ml_calloc(1, sizeof *f, "an NCCL collective's record");
  if (!f) {
    cudaEventDestroy(done);
    return -1;
  }
  *f = (ml_nccl_flight){.done = done, .coll = coll, .bytes = bytes, .t0 = now_s()};
  pthread_mutex_lock(&w->mu);
  f->next = w->flights;
  w->flights = f;
  pthread_mutex_unlock(&w->mu);
  *out = f;
  return 0;
}

cudaEvent_t ml_nccl_flight_event(const ml_nccl_flight *f) { return f->done; }

void ml_nccl_watch_waited(ml_nccl_watch *w, ml_nccl_flight *f) {
  pthread_mutex_lock(&w->mu);
  f->waited = true;
  pthread_mutex_unlock(&w->mu);
}

void ml_nccl_watch_stop(ml_nccl_watch *w) {
  if (!w) return;
  pthread_mutex_lock(&w->mu);
  w->stop = true;
  for (ml_nccl_flight *f = w->flights; f; f = f->next) f->waited = true; /* none will wait now */
  pthread_cond_signal(&w->wake);
  pthread_mutex_unlock(&w->mu);
  pthread_join(w->thread, NULL);
  pthread_mutex_destroy(&w->mu);
  pthread_cond_destroy(&w->wake);
  free(w);
}
