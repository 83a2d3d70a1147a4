#define _POSIX_C_SOURCE 200809L /* clock_gettime */

#include "train/metrics.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include <jansson.h>

#include "common/status.h"
#include "kernels/cpu/kernels.h"

void ml_metrics_print(FILE *f, const ml_step_metrics *m) {
  fprintf(f, "step %lld | loss %.4f | grad_norm %.3f | lr %.2e | tok/s %.1f | ", (long long)m->step,
          m->loss, m->grad_norm, m->lr, m->tokens_per_s);
  if (m->peak_tflops > 0)
    fprintf(f, "mfu %.2f%% of %s | ", 100.0 * m->mfu,
            m->peak_measured ? "measured peak" : "--peak-tflops");
  else
    fputs("mfu n/a | ", f);
  fprintf(f, "peak_rss %.1f MiB", m->peak_rss_mib_max);
  if (m->peak_rss_mib_max - m->peak_rss_mib_min >= 0.05) /* differs as printed */
    fprintf(f, " (min %.1f)", m->peak_rss_mib_min);
  fprintf(f, "%s\n", m->skipped ? " | skipped" : "");
}

int ml_metrics_open(const char *path, ml_metrics_writer *w) {
  w->path = NULL;
  w->f = fopen(path, "w");
  if (!w->f) return ml_err("%s: cannot create metrics file: %s", path, strerror(errno));
  w->path = ml_malloc(strlen(path) + 1, "metrics file path");
  if (!w->path) {
    ml_metrics_close(w);
    return -1;
  }
  memcpy(w->path, path, strlen(path) + 1);
  return 0;
}

/* A JSON real, or null for NaN/inf (which JSON cannot represent). */
static json_t *real_or_null(double x) { return isfinite(x) ? json_real(x) : json_null(); }

static json_t *metrics_json(const ml_step_metrics *m) {
  json_t *o = json_object();
  if (!o) return NULL;
  int bad = json_object_set_new(o, "step", json_integer(m->step));
  bad |= json_object_set_new(o, "loss", real_or_null(m->loss));
  bad |= json_object_set_new(o, "grad_norm", real_or_null(m->grad_norm));
  bad |= json_object_set_new(o, "lr", real_or_null(m->lr));
  bad |= json_object_set_new(o, "tokens", json_integer(m->tokens));
  bad |= json_object_set_new(o, "tokens_per_s", real_or_null(m->tokens_per_s));
  bool known = m->peak_tflops > 0;
  bad |= json_object_set_new(o, "mfu", known ? real_or_null(m->mfu) : json_null());
  bad |= json_object_set_new(o, "peak_tflops", known ? real_or_null(m->peak_tflops) : json_null());
  bad |= json_object_set_new(o, "peak_measured", json_boolean(m->peak_measured));
  bad |= json_object_set_new(o, "peak_rss_mib_min", real_or_null(m->peak_rss_mib_min));
  bad |= json_object_set_new(o, "peak_rss_mib_max", real_or_null(m->peak_rss_mib_max));
  bad |= json_object_set_new(o, "skipped", json_boolean(m->skipped));
  bad |= json_object_set_new(o, "fsdp_wait_ms", real_or_null(m->fsdp_wait_ms));
  if (!bad) return o;
  json_decref(o);
  return NULL;
}

int ml_metrics_write(ml_metrics_writer *w, const ml_step_metrics *m) {
  json_t *o = metrics_json(m);
  char *line = o ? json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
  json_decref(o);
  if (!line) return ml_err("%s: out of memory formatting metrics of step %lld", w->path,
                           (long long)m->step);
  int bad = fputs(line, w->f) < 0 || fputc('\n', w->f) == EOF || fflush(w->f) != 0;
  free(line);
  if (bad) return ml_err("%s: cannot write metrics: %s", w->path, strerror(errno));
  return 0;
}

void ml_metrics_close(ml_metrics_writer *w) {
  if (w->f) fclose(w->f);
  free(w->path);
  w->f = NULL;
  w->path = NULL;
}

double ml_peak_rss_mib(void) {
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0.0;
  return (double)ru.ru_maxrss / 1024.0;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double ml_gemm_flops_per_s(double seconds) {
  enum { N = 1024 };
  float *x = malloc(sizeof(float) * 3 * N * N);
  if (!x) return 0.0;
  float *w = x + N * N, *y = w + N * N;
  for (size_t i = 0; i < 2 * (size_t)N * N; i++) x[i] = (float)(i % 17) * (1.0f / 64); /* finite */
  k_linear_fwd(x, w, NULL, y, N, N, N); /* warm-up: threads, pages, caches */
  int64_t calls = 0;
  double t0 = now_s(), dt;
  do {
    k_linear_fwd(x, w, NULL, y, N, N, N);
    calls++;
    dt = now_s() - t0;
  } while (dt < seconds);
  free(x);
  return 2.0 * N * N * N * (double)calls / dt;
}

double ml_flops_per_token(double n_params, int64_t n_layers, int64_t hidden, int64_t seq_len) {
  return 6.0 * n_params + 12.0 * (double)n_layers * (double)hidden * (double)seq_len;
}

double ml_mfu(double flops_per_token, double tokens_per_s, double peak_flops) {
  return peak_flops > 0 ? flops_per_token * tokens_per_s / peak_flops : 0.0;
}
