#include "api/pack.h"

#include <stdlib.h>
#include <string.h>

#include "common/checked.h"

int api_plan_batch(meshlm_session *s, const meshlm_seqs *b, bool forward_only, api_plan *p) {
  memset(p, 0, sizeof *p);
  int64_t n1 = b->n > 0 ? b->n : 1;
  p->start = ml_malloc_array(n1 + 1, sizeof *p->start, "the batch's offsets");
  p->ids = ml_malloc_array(n1, sizeof *p->ids, "the batch's offsets");
  int rc = p->start && p->ids ? 0 : -1;
  if (rc == 0) {
    p->start[0] = 0;
    for (int64_t k = 0; k < b->n; k++) {
      p->ids[k] = b->tokens + p->start[k];
      p->start[k + 1] = p->start[k] + b->lens[k];
    }
  }
  ML_TRY(ml_host_agree(s->world, rc));
  ML_TRY(ml_pack_plan(&p->pack, &s->e, s->world, b->n, b->lens, p->ids,
                      s->o.micro_batch_tokens));
  return ml_host_agree(s->world, ml_pack_reserve(&p->pack, &s->e, forward_only));
}

void api_plan_free(api_plan *p) {
  ml_pack_free(&p->pack);
  free(p->start);
  free(p->ids);
  memset(p, 0, sizeof *p);
}

void api_plan_stats(meshlm_session *s, const api_plan *p) {
  const ml_pack *k = &p->pack;
  meshlm_call_stats *st = &s->last;
  memset(st, 0, sizeof *st);
  st->micro_batches = k->n_mb;
  for (int64_t j = 0; j < k->n_mb; j++) {
    st->tokens += k->mb[j].S;
    st->padding += k->mb[j].S - k->mb[j].tokens;
  }
  const ml_comm_stats *f = ml_comm_stats_of(ml_mesh_comm(&s->mesh, ML_GROUP_DP_SHARD_CP));
  st->fsdp_all_gathers = f->calls[ML_COLL_ALL_GATHER];
  st->fsdp_reduce_scatters = f->calls[ML_COLL_REDUCE_SCATTER];
  st->fsdp_all_reduces = f->calls[ML_COLL_ALL_REDUCE];
  for (int c = 0; c < ML_COLL_KINDS; c++) {
    st->fsdp_bytes += f->bytes[c];
    st->tp_collectives += ml_comm_stats_of(ml_mesh_comm(&s->mesh, ML_GROUP_TP))->calls[c];
    st->cp_collectives += ml_comm_stats_of(ml_mesh_comm(&s->mesh, ML_GROUP_CP))->calls[c];
    st->dp_replicate_collectives +=
        ml_comm_stats_of(ml_mesh_comm(&s->mesh, ML_GROUP_DP_REPLICATE))->calls[c];
  }
}

int meshlm_last_call_stats(meshlm_session *s, meshlm_call_stats *out) {
  ML_TRY(api_local(s, "meshlm_last_call_stats"));
  if (!out) return api_leave(s, ml_err("meshlm_last_call_stats: out is NULL"));
  return api_leave(s, API_WRITE("meshlm_last_call_stats", meshlm_call_stats, out, &s->last));
}
