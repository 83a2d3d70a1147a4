/* tol_bound MODEL_DIR QUANTITY KIND S T: print (%.17g) the relative bound
 * of tests/tolerance.h §3 for QUANTITY (loss | logprobs | grads) of the
 * model in MODEL_DIR (its config.json), with S keys per query (the
 * sequence length) and T token rows in the batch; KIND is pair (two fp32
 * evaluations in different orders: a mesh and one rank, accumulated
 * micro-batches and one batch; tol_model_pair) or ref (meshlm against the
 * fixture's float64 transformers reference: tol_model_vs_ref). For the CLI
 * tests (tests/cli/test_*.sh), so that their comparisons use the bounds the
 * C tests use, derived once.
 * KIND lora-pair:R: two fp32 evaluations with rank-R LoRA adapters on the
 * linears (tol_lora_pair, §8).
 * tol_bound schedule LR: the absolute bound of a learning rate computed by
 * engine/schedule.c for peak LR (tol_schedule_abs, tolerance.h §7).
 * Exit 1 with a message on bad arguments. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "tol_config.h"

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "schedule") == 0) {
    printf("%.17g\n", tol_schedule_abs(atof(argv[2])));
    return 0;
  }
  if (argc != 6) {
    fprintf(stderr, "usage: tol_bound MODEL_DIR loss|logprobs|grads pair|ref|lora-pair:R S T\n"
                    "       tol_bound schedule LR\n");
    return 1;
  }
  ml_model_config c;
  if (ml_model_config_load(argv[1], &c)) {
    fprintf(stderr, "tol_bound: %s\n", ml_error_msg());
    return 1;
  }
  const char *names[] = {"logprobs", "loss", "grads"};
  tol_quantity qs[] = {TOL_LOGPROBS, TOL_LOSS, TOL_GRADS};
  int q = -1;
  for (int i = 0; i < 3; i++)
    if (strcmp(argv[2], names[i]) == 0) q = i;
  int pair = strcmp(argv[3], "pair") == 0, ref = strcmp(argv[3], "ref") == 0;
  long long lora = strncmp(argv[3], "lora-pair:", 10) == 0 ? atoll(argv[3] + 10) : 0;
  long long S = atoll(argv[4]), T = atoll(argv[5]);
  if (q < 0 || !(pair || ref || lora > 0) || S < 1 || T < 1) {
    fprintf(stderr, "tol_bound: expected loss|logprobs|grads, pair|ref|lora-pair:R and S, T >= 1; found %s %s %s %s\n",
            argv[2], argv[3], argv[4], argv[5]);
    return 1;
  }
  tol_model m = tol_model_of_config(&c, S, T);
  if (lora > 0) printf("%.17g\n", tol_lora_pair(&m, qs[q], (double)lora));
  else printf("%.17g\n", pair ? tol_model_pair(&m, qs[q]) : tol_model_vs_ref(&m, qs[q]));
  return 0;
}
