/* st_list DIR [--bf16]: one line per tensor of the HF checkpoint in DIR
 * (model.safetensors, or the shards of model.safetensors.index.json),
 * sorted by name: "NAME DTYPE [d0,d1,..] HASH", HASH the FNV-1a 64 of the
 * stored bytes. With --bf16, F32 tensors are listed as the BF16 tensors
 * torch's tensor.to(torch.bfloat16) makes of them (round to nearest even,
 * tensor/dtype.h), so that a bf16 export can be compared with the fp32
 * weights it came from. For the CLI tests (tests/cli/test_export.sh),
 * which have neither python3 nor the safetensors package. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "io/checkpoint.h"

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

/* t's bytes hashed, as bf16 when to_bf16 and t is F32. */
static uint64_t tensor_hash(const ml_st_tensor *t, int to_bf16) {
  uint64_t h = 0xcbf29ce484222325ull;
  if (!(to_bf16 && t->dtype == ML_F32)) return fnv1a(h, t->data, t->nbytes);
  for (int64_t i = 0; i < t->numel; i++) {
    float f;
    memcpy(&f, t->data + 4 * i, sizeof f);
    uint16_t b = ml_f32_to_bf16(f);
    h = fnv1a(h, &b, sizeof b);
  }
  return h;
}

static int line_cmp(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv) {
  int to_bf16 = argc == 3 && strcmp(argv[2], "--bf16") == 0;
  if (argc != 2 && !to_bf16) {
    fprintf(stderr, "usage: st_list DIR [--bf16]\n");
    return 2;
  }
  ml_ckpt c;
  if (ml_ckpt_open(argv[1], &c) != 0) {
    fprintf(stderr, "st_list: %s\n", ml_error_msg());
    return 1;
  }
  size_t n = 0, k = 0;
  for (size_t f = 0; f < c.nfiles; f++) n += c.files[f].n;
  char **lines = calloc(n + 1, sizeof *lines);
  for (size_t f = 0; lines && f < c.nfiles; f++)
    for (size_t i = 0; i < c.files[f].n; i++) {
      const ml_st_tensor *t = &c.files[f].tensors[i];
      char shape[256] = "[";
      for (int d = 0; d < t->ndim; d++)
        snprintf(shape + strlen(shape), sizeof shape - strlen(shape), "%s%lld", d ? "," : "",
                 (long long)t->shape[d]);
      strcat(shape, "]");
      int bf = to_bf16 && t->dtype == ML_F32;
      size_t len = strlen(t->name) + strlen(shape) + 48;
      if (!(lines[k] = malloc(len))) break;
      snprintf(lines[k++], len, "%s %s %s %016llx", t->name, bf ? "BF16" : ml_dtype_name(t->dtype),
               shape, (unsigned long long)tensor_hash(t, to_bf16));
    }
  if (!lines || k < n) {
    fprintf(stderr, "st_list: out of memory\n");
    return 1;
  }
  qsort(lines, n, sizeof *lines, line_cmp);
  for (size_t i = 0; i < n; i++) {
    puts(lines[i]);
    free(lines[i]);
  }
  free(lines);
  ml_ckpt_close(&c);
  return 0;
}
