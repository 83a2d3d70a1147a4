/* meshlm_register_family (include/meshlm/meshlm.h): a family row built
 * from a built-in one and added to the family table (model/family.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "meshlm/meshlm.h"
#include "model/family.h"
#include "parallel/plan.h"

/* A copy of s for the process's lifetime (the family table keeps it), or
 * NULL for NULL; *oom set when it cannot be made. */
static const char *keep(const char *s, int *oom) {
  if (!s) return NULL;
  char *c = strdup(s);
  if (!c) *oom = 1;
  return c;
}

/* The strings keep() made for row r (none: NULL). */
static void release(ml_family *r) {
  free((char *)r->architecture);
  free((char *)r->model_type);
  free((char *)r->name);
  free((char *)r->tp_plan);
  for (int i = 0; i < ML_FAMILY_MAX_FUSED; i++) {
    free((char *)r->fused[i].leaf);
    for (int j = 0; j < ML_FUSED_MAX_PARTS; j++) free((char *)r->fused[i].parts[j]);
  }
}

/* The row f describes, on its base's. */
static int build(const meshlm_family *f, ml_family *out) {
  if (f->struct_size != sizeof *f)
    return ml_err("meshlm_register_family: struct_size %zu; expected sizeof(meshlm_family) = %zu "
                  "of this library's meshlm.h",
                  f->struct_size, sizeof *f);
  const char *need[] = {"architecture", "model_type", "name", "base"};
  const char *have[] = {f->architecture, f->model_type, f->name, f->base};
  for (int i = 0; i < 4; i++)
    if (!have[i] || !have[i][0])
      return ml_err("meshlm_register_family: field '%s' is missing; expected a non-empty string",
                    need[i]);
  const ml_family *base = ml_family_by_name(f->base);
  if (!base || base->save_as)
    return ml_err("meshlm_register_family: base '%s' is not a built-in text family; expected one "
                  "of %s",
                  f->base, ml_family_list_names());
  *out = *base;
  out->architecture = out->model_type = out->name = out->tp_plan = NULL; /* not yet ours */
  memset(out->fused, 0, sizeof out->fused);
  int oom = 0;
  out->architecture = keep(f->architecture, &oom);
  out->model_type = keep(f->model_type, &oom);
  out->name = keep(f->name, &oom);
  out->tp_plan = keep(f->tp_plan_json, &oom);
  out->hf_tp_plan = NULL; /* the base's class plan names the base's modules only */
  for (int i = 0; i < MESHLM_MAX_FUSED && i < ML_FAMILY_MAX_FUSED && f->fused[i].leaf; i++) {
    out->fused[i].leaf = keep(f->fused[i].leaf, &oom);
    for (int j = 0; j < ML_FUSED_MAX_PARTS && f->fused[i].parts[j]; j++)
      out->fused[i].parts[j] = keep(f->fused[i].parts[j], &oom);
  }
  if (oom) return ml_err("meshlm_register_family: out of memory");
  if (f->tp_plan_json) { /* refused now rather than at the first meshlm_open */
    ml_plan p;
    char what[128];
    snprintf(what, sizeof what, "meshlm_register_family %s: tp_plan_json", f->name);
    ML_TRY(ml_plan_parse(f->tp_plan_json, what, base->prefix, &p));
    ml_plan_free(&p);
  }
  return ml_family_register(out);
}

int meshlm_register_family(const meshlm_family *f, char *err, size_t err_cap) {
  ml_family row = {0};
  int rc = f ? build(f, &row) : ml_err("meshlm_register_family: family is NULL");
  if (rc) release(&row); /* the copies of a refused row (NULL where none) */
  if (err && err_cap) snprintf(err, err_cap, "%s", rc ? ml_error_msg() : "");
  ml_error_clear();
  return rc;
}
