/* Micro-batches of a variable-length batch (meshlm_logprobs,
 * meshlm_train_step): sequences sorted by length and packed first-fit
 * decreasing into rows of at most options.micro_batch_tokens tokens (a
 * longer sequence alone), each row a batch of packed documents
 * (train/engine.h ml_engine_batch.docs) — no padding inside a row; where
 * the engine cannot pack (context parallelism, a backend without block
 * attention) one sequence per micro-batch. Every rank runs the same number
 * of micro-batches (FSDP's collectives go in step): a rank with fewer runs
 * empty ones. Under vocab parallelism the ranks of FSDP's group exchange
 * tokens, so micro-batch j has the same length on every rank (the
 * longest), the shorter rows padded at the end. */
#ifndef ML_API_PACK_H
#define ML_API_PACK_H

#include "api/session.h"

typedef struct api_micro {
  int64_t first, count; /* sequences order[first .. first+count−1] */
  int64_t tokens;       /* theirs */
  int64_t S;            /* the row's length, >= tokens (padding after) */
} api_micro;

typedef struct api_plan {
  int64_t n;            /* sequences */
  int64_t *order;       /* [n] sequence indices, micro-batch by micro-batch */
  int64_t *start;       /* [n + 1] first token of sequence k in the batch; start[k] − k: its
                           first prediction */
  api_micro *mb;        /* [n_mb] */
  int64_t n_mb;         /* the same on every rank (the empty ones at the end) */
  int64_t S_max;        /* the longest row */
  bool packed;
  /* one micro-batch's host buffers, [S_max] each (docs [max count + 1]) */
  int32_t *ids;
  uint8_t *mask;
  int64_t *docs;
  ml_obj_in *obj;
  float *lp;
} api_plan;

/* Plan b's micro-batches (collective over the world: the count and, under
 * vocab parallelism, the lengths are agreed) and allocate the buffers.
 * Errors: allocation (every rank). Free with api_plan_free. */
int api_plan_batch(meshlm_session *s, const meshlm_seqs *b, api_plan *p);
void api_plan_free(api_plan *p);

/* Micro-batch j as an engine batch in p's buffers: ids, the documents (or
 * none), mask 1 on every document token but the first of each. (obj is the
 * caller's to fill.) */
void api_plan_fill(const api_plan *p, const meshlm_seqs *b, int64_t j, ml_engine_batch *eb);

/* Set s's call statistics after a call of p's micro-batches (see
 * meshlm_call_stats). */
void api_plan_stats(meshlm_session *s, const api_plan *p);

#endif
