/* Router replay's arrays at the library's edge (api/routing.h). */
#include "api/routing.h"

#include <string.h>

#include "common/status.h"

int api_routing_check(const meshlm_session *s, const char *call, const char *field) {
  const ml_model_config *c = &s->e.model.cfg;
  if (c->n_experts == 0)
    return ml_err("%s: %s is set but %s has no experts; expected NULL", call, field,
                  c->family->architecture);
  /* under tp every tp rank holds the same sequences and routes all their tokens (model/moe.h,
   * also under ep with tp); cp's ranks hold pieces of them, which this layout does not map */
  if (s->mesh.cp > 1)
    return ml_err("%s: %s under cp %d is not implemented; expected cp 1", call, field,
                  s->mesh.cp);
  return 0;
}

int64_t api_routing_cols(const meshlm_session *s) {
  return s->e.model.cfg.n_layers * s->e.model.cfg.top_k;
}

/* The rows of micro-batch j between the two layouts: to_packed copies the
 * caller's into the packed row (and −1 into its padding), else back. */
static void copy(const api_plan *p, const meshlm_seqs *b, int64_t j, int64_t cols,
                 const int32_t *src, int32_t *dst, bool to_packed) {
  const ml_pack *pk = &p->pack;
  const ml_micro *m = &pk->mb[j];
  size_t row = sizeof(int32_t) * (size_t)cols;
  int64_t at = 0;
  for (int64_t i = 0; i < m->count; i++) {
    int64_t q = pk->order[m->first + i], L = b->lens[q];
    for (int64_t t = 0; t < L; t++) {
      int64_t mine = (p->start[q] + t) * cols, packed = (at + t) * cols;
      memcpy(dst + (to_packed ? packed : mine), src + (to_packed ? mine : packed), row);
    }
    at += L;
  }
  for (int64_t i = at * cols; to_packed && i < m->S * cols; i++) dst[i] = -1;
}

void api_routing_pack(const api_plan *p, const meshlm_seqs *b, int64_t j, int64_t cols,
                      const int32_t *caller, int32_t *packed) {
  copy(p, b, j, cols, caller, packed, true);
}

void api_routing_unpack(const api_plan *p, const meshlm_seqs *b, int64_t j, int64_t cols,
                        const int32_t *packed, int32_t *caller) {
  copy(p, b, j, cols, packed, caller, false);
}
