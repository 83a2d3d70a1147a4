/* Generation's ep group stepping together (gen_ep.h). */
#include "engine/gen_ep.h"

#include <stdint.h>

#include "comm/host.h"
#include "common/status.h"
#include "model/moe.h"

enum { DONE = 0, STEPS = 1, FAILED = 2 }; /* a rank's vote before a step */

/* The group's largest vote (MAX: any failure wins over any step). */
static int vote(ml_engine *e, int64_t mine, int64_t *most) {
  *most = mine;
  return ml_host_all_reduce_i64(ml_mesh_host(e->mesh, ML_GROUP_EP), most, 1, ML_RED_MAX);
}

static int other_failed(const ml_engine *e) {
  return ml_err("generate: a rank of this rank's expert-parallel group (ep %d) failed; expected "
                "every rank of the group to step until all are done (the failed rank's error "
                "says why)",
                e->mesh->groups[ML_GROUP_EP].size);
}

static bool ep_on(const ml_engine *e) { return e->mesh->groups[ML_GROUP_EP].size > 1; }

int ml_gen_ep_step(ml_gen_ep *s) {
  if (!ep_on(s->e)) return 0;
  int64_t most;
  ML_TRY(vote(s->e, STEPS, &most));
  s->heard = most == FAILED;
  return s->heard ? other_failed(s->e) : 0;
}

int ml_gen_ep_finish(ml_gen_ep *s, bool failed) {
  ml_engine *e = s->e;
  if (!ep_on(e)) return failed ? -1 : 0;
  int64_t most;
  if (failed) { /* once: the others stop at this step */
    if (!s->heard) vote(e, FAILED, &most);
    return -1;
  }
  for (;;) {
    ML_TRY(vote(e, DONE, &most));
    if (most == DONE) return 0;
    if (most == FAILED) return other_failed(e);
    ml_model *m = &e->model;
    for (int64_t l = 0; l < m->cfg.n_layers; l++) /* a step of zero tokens */
      if (m->layers[l].moe.gate.weight) ML_TRY(ml_moe_forward_idle(m, &m->layers[l]));
  }
}
