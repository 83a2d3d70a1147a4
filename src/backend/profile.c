#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include "backend/profile.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"

enum { MAX_CLASSES = 256, NAME_CAP = 64 };

typedef struct {
  char name[NAME_CAP];
  double seconds;
  long calls;
} op_class;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int enabled = -1; /* -1: environment not read yet (read outside the lock) */
static op_class classes[MAX_CLASSES];
static int n_classes;
static char current[NAME_CAP]; /* the operator running since `since` ("" before the first) */
static double since;

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int by_time_desc(const void *a, const void *b) {
  double x = ((const op_class *)a)->seconds, y = ((const op_class *)b)->seconds;
  return (x < y) - (x > y);
}

static void report(void) {
  if (n_classes == 0) return;
  double total = 0;
  for (int i = 0; i < n_classes; i++) total += classes[i].seconds;
  qsort(classes, (size_t)n_classes, sizeof classes[0], by_time_desc);
  fprintf(stderr, "op profile (MESHLM_OP_PROFILE=1; device synchronized at every operator): "
                  "%.1f ms in %d classes\n%-44s %8s %11s %11s %7s\n",
          1e3 * total, n_classes, "class", "calls", "total ms", "mean us", "share");
  for (int i = 0; i < n_classes; i++)
    fprintf(stderr, "%-44s %8ld %11.2f %11.1f %6.1f%%\n", classes[i].name, classes[i].calls,
            1e3 * classes[i].seconds, 1e6 * classes[i].seconds / (double)classes[i].calls,
            total > 0 ? 100 * classes[i].seconds / total : 0.0);
}

bool ml_be_profile_on(void) {
  if (enabled < 0) {
    pthread_mutex_lock(&lock);
    if (enabled < 0) {
      const char *e = getenv("MESHLM_OP_PROFILE");
      enabled = e && strcmp(e, "1") == 0;
      if (enabled) atexit(report);
    }
    pthread_mutex_unlock(&lock);
  }
  return enabled == 1;
}

/* The class named `name`, added when new (NULL when the table is full). */
static op_class *class_of(const char *name) {
  for (int i = 0; i < n_classes; i++)
    if (strcmp(classes[i].name, name) == 0) return &classes[i];
  if (n_classes == MAX_CLASSES) return NULL;
  op_class *c = &classes[n_classes++];
  *c = (op_class){.calls = 0};
  snprintf(c->name, sizeof c->name, "%s", name);
  return c;
}

void ml_be_profile_mark(struct ml_backend *be, const char *name) {
  pthread_mutex_lock(&lock);
  be->ops->sync(be);
  double t = now_s();
  if (current[0]) {
    op_class *c = class_of(current);
    if (!c) c = class_of("(classes beyond the table's 256)");
    if (c) {
      c->seconds += t - since;
      c->calls++;
    }
  }
  snprintf(current, sizeof current, "%s", name);
  since = t;
  pthread_mutex_unlock(&lock);
}

void ml_be_profile_restart(struct ml_backend *be) {
  pthread_mutex_lock(&lock);
  be->ops->sync(be);
  n_classes = 0;
  current[0] = '\0';
  pthread_mutex_unlock(&lock);
}
