#define _POSIX_C_SOURCE 200809L /* clock_gettime */

#include "cli/metrics.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include <jansson.h>

#include "common/status.h"

/* A duration for the progress line: "3.2s" below 10 s, then whole seconds
 * ("42s", "1m23s", "2h05m09s"); a negative one (clocks) as 0. */
static void print_duration(FILE *f, double s) {
  if (!(s >= 0)) s = 0;
  if (s < 9.95) {
    fprintf(f, "%.1fs", s);
    return;
  }
  long long t = llround(s), h = t / 3600, m = t / 60 % 60, sec = t % 60;
  if (h) fprintf(f, "%lldh%02lldm%02llds", h, m, sec);
  else if (m) fprintf(f, "%lldm%02llds", m, sec);
  else fprintf(f, "%llds", sec);
}

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
  fputs(" | elapsed ", f);
  print_duration(f, m->time_s);
  fputs(" eta ", f);
  print_duration(f, m->eta_s);
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
  bad |= json_object_set_new(o, "device_peak_mib", real_or_null(m->device_peak_mib));
  bad |= json_object_set_new(o, "skipped", json_boolean(m->skipped));
  bad |= json_object_set_new(o, "fsdp_wait_ms", real_or_null(m->fsdp_wait_ms));
  bad |= json_object_set_new(o, "minor_faults", json_integer(m->minor_faults));
  bad |= json_object_set_new(o, "time", real_or_null(m->time_s));
  if (!bad) return o;
  json_decref(o);
  return NULL;
}

/* Write object o (consumed) as one line of the file, then flush; `what`
 * names the line in messages ("metrics of step 3"). */
static int write_line(ml_metrics_writer *w, json_t *o, const char *what, int64_t step) {
  char *line = o ? json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
  json_decref(o);
  if (!line) return ml_err("%s: out of memory formatting %s of step %lld", w->path, what,
                           (long long)step);
  int bad = fputs(line, w->f) < 0 || fputc('\n', w->f) == EOF || fflush(w->f) != 0;
  free(line);
  if (bad) return ml_err("%s: cannot write %s: %s", w->path, what, strerror(errno));
  return 0;
}

int ml_metrics_write(ml_metrics_writer *w, const ml_step_metrics *m) {
  return write_line(w, metrics_json(m), "metrics", m->step);
}

int ml_metrics_write_eval(ml_metrics_writer *w, int64_t step, double loss, int64_t tokens) {
  json_t *o = json_object();
  if (o && (json_object_set_new(o, "step", json_integer(step)) |
            json_object_set_new(o, "eval_loss", real_or_null(loss)) |
            json_object_set_new(o, "eval_tokens", json_integer(tokens)))) {
    json_decref(o);
    o = NULL;
  }
  return write_line(w, o, "eval metrics", step);
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

int64_t ml_minor_faults(void) {
  struct rusage ru;
  return getrusage(RUSAGE_SELF, &ru) == 0 ? (int64_t)ru.ru_minflt : 0;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The calibration's operands: x, w [1024, 1024] in `dtype` at *ab (finite
 * values, filled on the host and converted on the device) and y [1024,
 * 1024] fp32 at *y. */
static int calib_operands(ml_backend *be, ml_dtype dtype, int64_t n, void **ab, float **y) {
  float *host = ml_be_host_alloc(be, 2 * n, sizeof(float), "the GEMM calibration's operands");
  float *f32 = ml_be_alloc(be, 2 * n, sizeof(float), "the GEMM calibration's operands");
  *ab = ml_be_alloc(be, 2 * n, ml_dtype_size(dtype), "the GEMM calibration's operands");
  *y = ml_be_alloc(be, n, sizeof(float), "the GEMM calibration's output");
  int rc = host && f32 && *ab && *y ? 0 : -1;
  for (int64_t i = 0; rc == 0 && i < 2 * n; i++) host[i] = (float)(i % 17) * (1.0f / 64);
  if (rc == 0) rc = ml_be_copy(be, f32, host, sizeof(float) * (size_t)(2 * n), ML_COPY_H2D);
  if (rc == 0) rc = ml_be_convert(be, *ab, dtype, f32, ML_F32, (size_t)(2 * n));
  ml_be_host_free(be, host);
  ml_be_free(be, f32);
  return rc;
}

double ml_gemm_flops_per_s(ml_backend *be, ml_dtype dtype, double seconds) {
  enum { N = 1024 };
  void *ab = NULL;
  float *y = NULL;
  int rc = calib_operands(be, dtype, (int64_t)N * N, &ab, &y);
  ml_gemm g = {.trans_b = true, .M = N, .N = N, .K = N, .A = ab, .a_type = dtype, .lda = N,
               .B = (char *)ab + ml_dtype_size(dtype) * N * N, .b_type = dtype, .ldb = N,
               .C = y, .ldc = N, .compute = dtype};
  if (rc == 0) rc = ml_be_gemm(be, &g) || ml_be_sync(be); /* warm-up: threads, pages, caches */
  int64_t calls = 0;
  double t0 = now_s(), dt = 0;
  while (rc == 0 && dt < seconds) {
    rc = ml_be_gemm(be, &g) || ml_be_sync(be);
    calls++;
    dt = now_s() - t0;
  }
  ml_be_free(be, ab);
  ml_be_free(be, y);
  ml_error_clear(); /* a failed calibration only leaves the peak unknown */
  return rc == 0 ? 2.0 * N * N * N * (double)calls / dt : 0.0;
}

double ml_flops_per_token(double n_params, int64_t n_layers, int64_t hidden, int64_t seq_len) {
  return 6.0 * n_params + 12.0 * (double)n_layers * (double)hidden * (double)seq_len;
}

double ml_mfu(double flops_per_token, double tokens_per_s, double peak_flops) {
  return peak_flops > 0 ? flops_per_token * tokens_per_s / peak_flops : 0.0;
}
