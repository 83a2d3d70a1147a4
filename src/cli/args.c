#include "cli/args.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

static bool is_flag(const char *s) { return strncmp(s, "--", 2) == 0 && s[2] != '\0'; }

/* Index of the spec entry named by `arg` up to `len` chars, or n. */
static size_t find_arg(const ml_arg *spec, size_t n, const char *arg, size_t len) {
  for (size_t i = 0; i < n; i++)
    if (strlen(spec[i].name) == len && strncmp(spec[i].name, arg, len) == 0) return i;
  return n;
}

static int unknown_flag(const char *cmd, const char *arg, size_t len, const ml_arg *spec,
                        size_t n) {
  char list[1024] = "";
  size_t used = 0;
  for (size_t i = 0; i < n && used < sizeof list; i++)
    used += (size_t)snprintf(list + used, sizeof list - used, "%s%s", i ? ", " : "", spec[i].name);
  return ml_err("%s: unknown flag '%.*s'; accepted flags: %s", cmd, (int)len, arg,
                n ? list : "(none)");
}

static int parse_int(const char *cmd, const char *name, const char *val, int64_t *dst) {
  char *end;
  errno = 0;
  long long v = strtoll(val, &end, 10);
  if (end == val || *end != '\0')
    return ml_err("%s: flag %s: expected an integer, found '%s'", cmd, name, val);
  if (errno == ERANGE)
    return ml_err("%s: flag %s: value '%s' is out of range: expected an integer in [%" PRId64
                  ", %" PRId64 "]",
                  cmd, name, val, INT64_MIN, INT64_MAX);
  *dst = v;
  return 0;
}

static int parse_float(const char *cmd, const char *name, const char *val, double *dst) {
  char *end;
  double v = strtod(val, &end);
  if (end == val || *end != '\0')
    return ml_err("%s: flag %s: expected a number, found '%s'", cmd, name, val);
  if (!isfinite(v))
    return ml_err("%s: flag %s: value '%s' is out of range: expected a finite number", cmd, name,
                  val);
  *dst = v;
  return 0;
}

const char *ml_arg_choice_list(const ml_arg_choice *c, const char *sep, char *buf, size_t size) {
  size_t used = 0;
  buf[0] = '\0';
  for (size_t i = 0; c->names[i] && used < size; i++)
    used += (size_t)snprintf(buf + used, size - used, "%s%s", i ? sep : "", c->names[i]);
  return buf;
}

static int parse_choice(const char *cmd, const ml_arg *a, const char *val) {
  ml_arg_choice *c = a->dst;
  for (int i = 0; c->names[i]; i++)
    if (strcmp(c->names[i], val) == 0) {
      c->index = i;
      return 0;
    }
  char list[512];
  return ml_err("%s: flag %s: expected one of %s, found '%s'", cmd, a->name,
                ml_arg_choice_list(c, ", ", list, sizeof list), val);
}

/* `--flag=true` / `--flag=false`. */
static int parse_bool(const char *cmd, const ml_arg *a, const char *val) {
  if (strcmp(val, "true") == 0 || strcmp(val, "false") == 0) {
    *(bool *)a->dst = val[0] == 't';
    return 0;
  }
  return ml_err("%s: flag %s takes no value or =true / =false, found '%s'", cmd, a->name, val);
}

static int set_value(const char *cmd, const ml_arg *a, const char *val) {
  switch (a->type) {
  case ML_ARG_INT: return parse_int(cmd, a->name, val, a->dst);
  case ML_ARG_FLOAT: return parse_float(cmd, a->name, val, a->dst);
  case ML_ARG_STR: *(const char **)a->dst = val; return 0;
  case ML_ARG_FLAG: return parse_bool(cmd, a, val);
  case ML_ARG_CHOICE: return parse_choice(cmd, a, val);
  }
  return ml_err("%s: flag %s has an unknown type", cmd, a->name);
}

/* Parse argv[*i] (a flag) and, if it takes one, its value; advance *i. */
static int parse_one(const char *cmd, int argc, char **argv, int *i, const ml_arg *spec, size_t n,
                     bool *seen) {
  const char *arg = argv[*i];
  const char *eq = strchr(arg, '=');
  size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
  size_t k = find_arg(spec, n, arg, len);
  if (k == n) return unknown_flag(cmd, arg, len, spec, n);
  seen[k] = true;
  if (eq) return set_value(cmd, &spec[k], eq + 1);
  if (spec[k].type == ML_ARG_FLAG) {
    *(bool *)spec[k].dst = true;
    return 0;
  }
  if (*i + 1 >= argc || is_flag(argv[*i + 1]))
    return ml_err("%s: flag %s: missing value", cmd, spec[k].name);
  *i += 1;
  return set_value(cmd, &spec[k], argv[*i]);
}

static int parse_all(const char *cmd, int argc, char **argv, const ml_arg *spec, size_t n,
                     bool *seen) {
  for (int i = 0; i < argc; i++) {
    if (!is_flag(argv[i]))
      return ml_err("%s: unexpected positional argument '%s': every argument is a --flag", cmd,
                    argv[i]);
    ML_TRY(parse_one(cmd, argc, argv, &i, spec, n, seen));
  }
  for (size_t k = 0; k < n; k++)
    if (spec[k].required && !seen[k])
      return ml_err("%s: missing required flag %s", cmd, spec[k].name);
  return 0;
}

int ml_args_parse(const char *cmd, int argc, char **argv, const ml_arg *spec, size_t n) {
  bool *seen = ml_calloc(n, sizeof *seen, "argument table");
  if (!seen) return -1;
  int rc = parse_all(cmd, argc, argv, spec, n, seen);
  free(seen);
  return rc;
}

const char *ml_args_value(int argc, char **argv, const char *name) {
  const char *val = NULL;
  size_t len = strlen(name);
  for (int i = 0; i < argc; i++) {
    if (strncmp(argv[i], name, len) != 0) continue;
    if (argv[i][len] == '=') val = argv[i] + len + 1;
    else if (argv[i][len] == '\0')
      val = i + 1 < argc && !is_flag(argv[i + 1]) ? argv[i + 1] : NULL;
  }
  return val;
}

/* The value's name: the entry's own, else by type ("" for a flag). */
static const char *value_name(const ml_arg *a, char *buf, size_t size) {
  if (a->value) return a->value;
  switch (a->type) {
  case ML_ARG_INT: return "N";
  case ML_ARG_FLOAT: return "X";
  case ML_ARG_STR: return "VALUE";
  case ML_ARG_CHOICE: return ml_arg_choice_list(a->dst, "|", buf, size);
  case ML_ARG_FLAG: break;
  }
  return "";
}

static void print_default(FILE *f, const ml_arg *a) {
  if (a->required) {
    fputs(" (required)", f);
    return;
  }
  switch (a->type) {
  case ML_ARG_INT: fprintf(f, " (default: %" PRId64 ")", *(const int64_t *)a->dst); break;
  case ML_ARG_FLOAT: fprintf(f, " (default: %g)", *(const double *)a->dst); break;
  case ML_ARG_STR:
    if (*(const char **)a->dst) fprintf(f, " (default: %s)", *(const char **)a->dst);
    break;
  case ML_ARG_FLAG:
    if (*(const bool *)a->dst) fputs(" (default: on)", f);
    break;
  case ML_ARG_CHOICE: {
    const ml_arg_choice *c = a->dst;
    fprintf(f, " (default: %s)", c->names[c->index]);
    break;
  }
  }
}

void ml_args_usage(FILE *f, const char *cmd, const char *summary, const ml_arg *spec, size_t n) {
  fprintf(f, "usage: meshlm %s [flags]\n", cmd);
  if (summary) fprintf(f, "%s\n", summary);
  if (n) fputs("flags:\n", f);
  for (size_t i = 0; i < n; i++) {
    char choices[256];
    int w = fprintf(f, "  %s %s", spec[i].name, value_name(&spec[i], choices, sizeof choices));
    fprintf(f, "%*s%s", w < 28 ? 28 - w : 1, "", spec[i].help ? spec[i].help : "");
    print_default(f, &spec[i]);
    fputc('\n', f);
  }
}

/* One synopsis item of a: "--name VALUE", bracketed unless required. */
static void synopsis_item(const ml_arg *a, char *buf, size_t size) {
  char choices[256];
  const char *value = value_name(a, choices, sizeof choices);
  snprintf(buf, size, "%s%s%s%s%s", a->required ? "" : "[", a->name, *value ? " " : "", value,
           a->required ? "" : "]");
}

void ml_args_synopsis(FILE *f, const char *cmd, const ml_arg *spec, size_t n) {
  int col = fprintf(f, "meshlm %s", cmd);
  for (int pass = 0; pass < 2; pass++) /* the required flags, then the others */
    for (size_t i = 0; i < n; i++) {
      if (spec[i].required != (pass == 0)) continue;
      char item[512];
      synopsis_item(&spec[i], item, sizeof item);
      int len = (int)strlen(item);
      if (col < ML_ARGS_SYNOPSIS_INDENT)
        col += fprintf(f, "%*s", ML_ARGS_SYNOPSIS_INDENT - col, "");
      else if (col + 1 + len > ML_ARGS_SYNOPSIS_WIDTH && col > ML_ARGS_SYNOPSIS_INDENT)
        col = fprintf(f, "\n%*s", ML_ARGS_SYNOPSIS_INDENT, "") - 1;
      else col += fprintf(f, " ");
      col += fprintf(f, "%s", item);
    }
  fputc('\n', f);
}
