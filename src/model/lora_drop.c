/* LoRA dropout masks (model/lora_drop.h). */
#include "model/lora_drop.h"

#include "common/rng.h"
#include "common/status.h"

bool ml_lora_drop_keep(uint64_t key, int64_t g, int64_t f, int64_t in, double p) {
  uint64_t z = ml_rng_hash(key, (uint64_t)g * (uint64_t)in + (uint64_t)f);
  return (double)(z >> 11) * 0x1p-53 >= p;
}

bool ml_lora_drop_active(const ml_linear *lin) {
  return lin->lora_drop && lin->lora_drop->active && lin->lora_drop->p > 0;
}

int ml_lora_drop_apply(ml_backend *be, const ml_linear *lin, const ml_act *x, const float *src,
                       float *out) {
  const ml_lora_dropout *d = lin->lora_drop;
  if (x->s != x->S)
    return ml_err("%s: LoRA dropout on an input of %lld of %lld positions; expected whole "
                  "sequences at the adapter", lin->lora_a->name, (long long)x->s,
                  (long long)x->S);
  int64_t T = x->B * x->s, c = x->c, f0 = lin->lora_a->offset[1], in = lin->lora_a->shape[1];
  float *h = ml_be_host_alloc(be, T * c, sizeof(float), "%s's dropout mask [%lld x %lld]",
                              lin->lora_a->name, (long long)T, (long long)c);
  if (!h) return -1;
  int rc = ml_be_copy(be, h, src, sizeof(float) * (size_t)(T * c), ML_COPY_D2H);
  uint64_t key = ml_rng_hash(d->key, lin->lora_id);
  float scale = (float)(1.0 / (1.0 - d->p));
#pragma omp parallel for if (T * c > 65536)
  for (int64_t t = 0; t < T; t++) {
    int64_t b = t / x->s, i = t % x->s;
    int64_t g = (d->row0 + b) * d->row_len + (d->row_pos ? d->row_pos[i] : i);
    float *row = h + t * c;
    for (int64_t j = 0; j < c; j++)
      row[j] = ml_lora_drop_keep(key, g, f0 + j, in, d->p) ? row[j] * scale : 0.0f;
  }
  if (!rc) rc = ml_be_copy(be, out, h, sizeof(float) * (size_t)(T * c), ML_COPY_H2D);
  ml_be_host_free(be, h);
  return rc;
}
