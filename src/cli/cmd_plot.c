/* meshlm plot: the curve of one field of a train --metrics JSONL file
 * (cli/metrics.h) over the steps: the step lines' "loss" by default, or
 * any other field of them (--field grad_norm), or the eval lines'
 * "eval_loss" (--field eval_loss; an eval line is one with that key).
 * With gnuplot on PATH it writes a PNG through gnuplot (a generated
 * script on its stdin, the points inline as a datablock; skipped steps
 * marked by dashed vertical lines); without gnuplot, or with --out -, it
 * prints a sparkline (▁▂▃▄▅▆▇█, at most 72 columns, each the mean of its
 * steps; a marker line under the columns holding a skipped step) with the
 * minimum, maximum and last value. One process does the work: under mpirun
 * rank 0 reads and plots and the others wait for its result. */
#define _POSIX_C_SOURCE 200809L /* getline, popen */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "common/status.h"

typedef struct plot_point {
  int64_t step;
  double value; /* NaN where the file has null (a non-finite value) */
  bool skipped;
} plot_point;

typedef struct plot_series {
  const char *path, *field;
  plot_point *p;
  size_t n, cap;
} plot_series;

enum { SPARK_COLS = 72 };

static bool blank(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r' && s[i] != '\n') return false;
  return true;
}

/* Line `ln` of the file: a point when its shape carries the field (eval
 * lines for eval_loss, step lines otherwise), else nothing. */
static int read_line(plot_series *s, const char *line, size_t n, int64_t ln) {
  json_error_t e;
  json_t *o = json_loadb(line, n, 0, &e);
  if (!o)
    return ml_err("%s:%lld:%d: invalid JSON: %s; expected a train --metrics line", s->path,
                  (long long)ln, e.column, e.text);
  int rc = 0;
  bool want_eval = strcmp(s->field, "eval_loss") == 0;
  const json_t *v = json_object_get(o, s->field), *step = json_object_get(o, "step");
  const json_t *skipped = json_object_get(o, "skipped");
  if (!json_is_object(o))
    rc = ml_err("%s:%lld: expected a JSON object (a train --metrics line), found another value",
                s->path, (long long)ln);
  else if (want_eval != (json_object_get(o, "eval_loss") != NULL))
    rc = 1; /* the other kind of line */
  else if (!json_is_integer(step))
    rc = ml_err("%s:%lld: field 'step': %s, expected an integer", s->path, (long long)ln,
                step ? "not an integer" : "missing");
  else if (!v)
    rc = ml_err("%s:%lld: field '%s' (--field): missing, expected a number", s->path,
                (long long)ln, s->field);
  else if (!json_is_number(v) && !json_is_null(v))
    rc = ml_err("%s:%lld: field '%s' (--field): expected a number or null, found another value",
                s->path, (long long)ln, s->field);
  if (rc == 0 && s->n == s->cap) {
    size_t cap = s->cap ? 2 * s->cap : 256;
    plot_point *p = realloc(s->p, cap * sizeof *p);
    if (!p) rc = ml_err("out of memory reading %s (%zu points)", s->path, s->n);
    else {
      s->p = p;
      s->cap = cap;
    }
  }
  if (rc == 0)
    s->p[s->n++] = (plot_point){.step = json_integer_value(step),
                                .value = json_is_null(v) ? NAN : json_number_value(v),
                                .skipped = json_is_true(skipped)};
  json_decref(o);
  return rc > 0 ? 0 : rc;
}

static int read_series(plot_series *s) {
  FILE *f = fopen(s->path, "r");
  if (!f) return ml_err("%s: cannot open the metrics file: %s", s->path, strerror(errno));
  char *line = NULL;
  size_t cap = 0;
  ssize_t n;
  int64_t lines = 0;
  int rc = 0;
  for (int64_t ln = 1; rc == 0 && (n = getline(&line, &cap, f)) >= 0; ln++) {
    if (blank(line, (size_t)n)) continue;
    lines++;
    rc = read_line(s, line, (size_t)n, ln);
  }
  if (rc == 0 && ferror(f)) rc = ml_err("%s: read error: %s", s->path, strerror(errno));
  fclose(f);
  free(line);
  if (rc == 0 && lines == 0)
    rc = ml_err("%s: empty; expected the JSONL lines of train --metrics", s->path);
  else if (rc == 0 && s->n == 0)
    rc = ml_err("%s: no %s line among its %lld lines (--field %s); expected %s", s->path,
                strcmp(s->field, "eval_loss") == 0 ? "eval" : "step", (long long)lines, s->field,
                strcmp(s->field, "eval_loss") == 0 ? "a run with train --eval-data"
                                                   : "the step lines of train --metrics");
  return rc;
}

/* The smallest, largest (finite) and last value; false when none is finite. */
static bool extremes(const plot_series *s, size_t *lo, size_t *hi) {
  bool any = false;
  for (size_t i = 0; i < s->n; i++) {
    if (!isfinite(s->p[i].value)) continue;
    if (!any || s->p[i].value < s->p[*lo].value) *lo = i;
    if (!any || s->p[i].value > s->p[*hi].value) *hi = i;
    any = true;
  }
  return any;
}

/* "min X (step K), max Y (step L), last Z (step M)[, N skipped]" */
static void print_summary(const plot_series *s) {
  size_t lo = 0, hi = 0, skipped = 0;
  for (size_t i = 0; i < s->n; i++) skipped += s->p[i].skipped;
  const plot_point *last = &s->p[s->n - 1];
  if (extremes(s, &lo, &hi))
    ml_cli_print("plot: min %.6g (step %lld), max %.6g (step %lld), ", s->p[lo].value,
                 (long long)s->p[lo].step, s->p[hi].value, (long long)s->p[hi].step);
  else
    ml_cli_print("plot: no finite value, ");
  ml_cli_print("last %.6g (step %lld)", last->value, (long long)last->step);
  if (skipped) ml_cli_print(", %zu skipped step%s", skipped, skipped == 1 ? "" : "s");
  ml_cli_print("\n");
}

static void sparkline(const plot_series *s) {
  static const char *const blocks[] = {"▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"};
  size_t cols = s->n < SPARK_COLS ? s->n : SPARK_COLS, lo = 0, hi = 0;
  bool any = extremes(s, &lo, &hi), marks = false;
  double vmin = any ? s->p[lo].value : 0, span = any ? s->p[hi].value - vmin : 0;
  char line[SPARK_COLS * 4 + 1] = "", under[SPARK_COLS + 1] = "";
  for (size_t c = 0; c < cols; c++) { /* column c: points [c·n/cols, (c+1)·n/cols) */
    size_t a = c * s->n / cols, z = (c + 1) * s->n / cols, k = 0;
    double sum = 0;
    bool skip = false;
    for (size_t i = a; i < z; i++) {
      if (isfinite(s->p[i].value)) sum += s->p[i].value, k++;
      skip |= s->p[i].skipped;
    }
    int level = k && span > 0 ? (int)lround((sum / (double)k - vmin) / span * 7.0) : 3;
    strcat(line, k ? blocks[level < 0 ? 0 : level > 7 ? 7 : level] : " ");
    under[c] = skip ? '^' : ' ';
    marks |= skip;
  }
  ml_cli_print("plot: %s of %s, steps %lld..%lld (%zu points%s)\n", s->field, s->path,
               (long long)s->p[0].step, (long long)s->p[s->n - 1].step, s->n,
               cols < s->n ? ", each column the mean of its steps" : "");
  ml_cli_print("%s\n", line);
  if (marks) ml_cli_print("%s  (^: a skipped step)\n", under);
  print_summary(s);
}

/* Whether `prog` is an executable file in a directory of PATH. */
static bool on_path(const char *prog) {
  const char *path = getenv("PATH");
  if (!path) return false;
  char buf[4096];
  for (const char *d = path; *d;) {
    size_t len = strcspn(d, ":");
    snprintf(buf, sizeof buf, "%.*s/%s", (int)(len ? len : 1), len ? d : ".", prog);
    struct stat sb;
    if (stat(buf, &sb) == 0 && S_ISREG(sb.st_mode) && access(buf, X_OK) == 0) return true;
    d += len + (d[len] == ':');
  }
  return false;
}

/* s as a gnuplot single-quoted string ('' stands for a quote). */
static void put_quoted(FILE *g, const char *s) {
  fputc('\'', g);
  for (; *s; s++) {
    if (*s == '\'') fputc('\'', g);
    fputc(*s, g);
  }
  fputc('\'', g);
}

/* The PNG `out` through gnuplot: the script on its stdin. */
static int gnuplot_png(const plot_series *s, const char *out) {
  struct stat sb;
  if (stat(out, &sb) == 0 && S_ISDIR(sb.st_mode))
    return ml_err("plot: flag --out %s: a directory; expected a PNG file to write", out);
  FILE *g = popen("gnuplot", "w");
  if (!g) return ml_err("plot: cannot run gnuplot: %s", strerror(errno));
  fputs("set terminal pngcairo size 960,540 noenhanced\nset output ", g);
  put_quoted(g, out);
  fputs("\nset title ", g);
  put_quoted(g, s->path);
  fputs("\nset xlabel 'step'\nset ylabel ", g);
  put_quoted(g, s->field);
  fputs("\nset grid\nset key top right\n", g);
  bool skipped = false;
  for (size_t i = 0; i < s->n; i++)
    if (s->p[i].skipped) {
      fprintf(g, "set arrow from %lld, graph 0 to %lld, graph 1 nohead dt 2 lc rgb 'red'\n",
              (long long)s->p[i].step, (long long)s->p[i].step);
      skipped = true;
    }
  fputs("$points << EOD\n", g);
  for (size_t i = 0; i < s->n; i++)
    if (isfinite(s->p[i].value)) fprintf(g, "%lld %.17g\n", (long long)s->p[i].step, s->p[i].value);
    else fprintf(g, "%lld NaN\n", (long long)s->p[i].step);
  fputs("EOD\nplot $points using 1:2 with linespoints pt 7 ps 0.4 lw 2 title ", g);
  put_quoted(g, s->field);
  if (skipped) fputs(", NaN with lines dt 2 lc rgb 'red' title 'skipped step'", g);
  fputs("\n", g);
  int st = pclose(g);
  if (st == -1) return ml_err("plot: gnuplot: %s", strerror(errno));
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    return ml_err("plot: gnuplot failed (%s %d) writing %s; its messages are above",
                  WIFEXITED(st) ? "exit status" : "signal",
                  WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st), out);
  ml_cli_print("plot: wrote %s: %s of %s, steps %lld..%lld (%zu points)\n", out, s->field,
               s->path, (long long)s->p[0].step, (long long)s->p[s->n - 1].step, s->n);
  print_summary(s);
  return 0;
}

static int run(plot_series *s, const char *out, bool out_given) {
  ML_TRY(read_series(s));
  if (strcmp(out, "-") != 0 && on_path("gnuplot")) return gnuplot_png(s, out);
  if (strcmp(out, "-") != 0 && out_given)
    ml_cli_print("plot: gnuplot is not on PATH (Debian: gnuplot-nox; make deps installs it), so "
                 "no %s; a sparkline instead\n", out);
  sparkline(s);
  return 0;
}

int ml_cmd_plot(ml_host *world, int argc, char **argv) {
  const char *path = argc > 0 && strncmp(argv[0], "--", 2) != 0 ? argv[0] : NULL;
  const char *field = "loss", *out = NULL;
  ml_arg spec[] = {
      {"--out", ML_ARG_STR, &out,
       "PNG to write with gnuplot (default: FIELD.png); '-': a sparkline on stdout", false,
       "PNG|-"},
      {"--field", ML_ARG_STR, &field,
       "the field to plot: loss, grad_norm, ... of the step lines, or eval_loss", false,
       "FIELD"},
  };
  int rc = ml_cli_parse("plot METRICS.jsonl", "a field of train --metrics' file over the steps",
                        argc - (path != NULL), argv + (path != NULL), spec,
                        sizeof spec / sizeof spec[0]);
  if (rc == 1) return 0;
  if (rc == 0 && !path)
    rc = ml_err("plot: missing the metrics file; expected 'meshlm plot METRICS.jsonl [--out "
                "PNG|-] [--field F]'");
  char def[256];
  snprintf(def, sizeof def, "%s.png", field);
  plot_series s = {.path = path, .field = field};
  if (rc == 0 && world->rank == 0) rc = run(&s, out ? out : def, out != NULL);
  free(s.p);
  return ml_cli_agree(world, rc);
}
