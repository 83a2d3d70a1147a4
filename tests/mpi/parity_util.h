/* Helpers shared by the MPI parity tests: fixture loading and error
 * metrics. Fixtures (tests/fixtures/NAME) come from tools/gen_fixtures.py
 * (HF transformers, float64 reference). Loaded fixtures and batches are
 * held (held.h) until freed. */
#ifndef ML_PARITY_UTIL_H
#define ML_PARITY_UTIL_H

#include <stdint.h>

typedef struct fixture {
  char dir[512];
  int64_t B, S;
  int32_t *ids;  /* [B, S] */
  uint8_t *mask; /* [B, S]: token is a target */
  double loss;
  double *logprobs; /* [B, S-1] */
  int64_t targets;  /* number of targets in the batch */
  /* Composite (vision-language) fixtures: checkpoint key prefix of the text
   * tower ("language_model.model."); "" for text models. Only such fixtures
   * may hold checkpoint tensors without a gradient (the vision tower, which
   * meshlm never builds). */
  char text_prefix[64];
} fixture;

/* Load tests/fixtures/<name>/expected.json; aborts the test on error. */
void fixture_load(const char *name, fixture *fx);
void fixture_free(fixture *fx);

/* The fixture's batch repeated to `rows` rows (so that up to `rows` dp
 * ranks get one each). */
typedef struct batch {
  int64_t B, S, targets;
  int32_t *ids;
  uint8_t *mask;
} batch;

void batch_make(const fixture *fx, int64_t rows, batch *b);
void batch_free(batch *b);

/* ||a − b||₂ / ||b||₂ (b = reference). */
double rel_l2(const float *a, const float *b, int64_t n);

#endif
