#define _GNU_SOURCE
#include "held.h"

#include <mpi.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

enum { HELD_MAX = 256 };

static struct held {
  void *p;
  held_release_fn release;
} g_held[HELD_MAX];
static int g_n;

/* A failed assertion longjmps out of the test, and the teardown's own calls
 * reuse the stack its frames occupied: an object on the stack would be
 * released from overwritten memory. Held objects are static or heap. */
static void check_not_on_stack(const void *p) {
  static const char *lo, *hi;
  if (!lo) {
    pthread_attr_t a;
    void *base;
    size_t size;
    if (pthread_getattr_np(pthread_self(), &a) || pthread_attr_getstack(&a, &base, &size)) return;
    pthread_attr_destroy(&a);
    lo = base;
    hi = lo + size;
  }
  if ((const char *)p >= lo && (const char *)p < hi) {
    fprintf(stderr, "held.c: object %p is on the stack; declare it static (or allocate it)\n", p);
    abort();
  }
}

void hold(void *p, held_release_fn release) {
  check_not_on_stack(p);
  if (g_n == HELD_MAX) {
    fprintf(stderr, "held.c: more than %d objects held by one test\n", HELD_MAX);
    abort();
  }
  g_held[g_n].p = p;
  g_held[g_n].release = release;
  g_n++;
}

void unhold(void *p) {
  for (int i = g_n - 1; i >= 0; i--)
    if (g_held[i].p == p) {
      for (int j = i; j + 1 < g_n; j++) g_held[j] = g_held[j + 1];
      g_n--;
      return;
    }
}

int release_held(void **state) {
  (void)state;
  while (g_n > 0) {
    struct held h = g_held[--g_n];
    h.release(h.p);
  }
  return 0;
}

int held_finish(int failed) {
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any ? 1 : 0;
}
