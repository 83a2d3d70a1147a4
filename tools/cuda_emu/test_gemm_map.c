/* The CUDA backend's cuBLASLt operand mapping (backend/cuda/gemm_map.h,
 * the function backend/cuda/gemm.c builds its descriptors and call with)
 * checked on the CPU: for every GEMM the engine issues on the fixtures
 * (tests/fixtures/(name)/config.json: each model's Linear layers, from
 * ml_model_create's module tree, in their forward y = x·W^T, and backward
 * dx = dy·W and dW += dy^T·x, model/linear.c's ml_gemm calls field for
 * field; whole weights and tensor-parallel halves (torch.chunk: the first
 * piece, rows or columns), T = 1 and 5 tokens; each also with its leading
 * dimensions 3 above the widths), the (m, n, k, ops,
 * layouts, operands) it computes go through cblas_sgemm in column-major,
 * as cuBLASLt would compute them, and the result is compared with
 * cblas_sgemm of the row-major ml_gemm itself. Both are fp32 dot products
 * of the same K terms in some order, each within gamma_K·sum|a·b| of the
 * exact value (tests/tolerance.h R2), so they differ by at most twice
 * that; a wrong transpose, swap or leading dimension gives another matrix
 * (or a parameter cblas refuses). Also: each layout as cuBLASLt checks it
 * (op(A') m x k, op(B') k x n, D m x n, ld >= rows), and within the
 * operand it names.
 * usage: test_gemm_map FIXTURES_DIR */
#include <cblas.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/gemm_map.h"
#include "common/status.h"
#include "model/config.h"
#include "model/model.h"
#include "tolerance.h"

static int failures, checked;
static uint64_t rng = 88172645463325252ull;

static float frand(void) {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (float)((double)(rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* One ml_gemm (C = op(A)·op(B), C [M, N] overwritten) both ways. */
static void check(const char *what, const ml_gemm *g) {
  int64_t ar = g->trans_a ? g->K : g->M, br = g->trans_b ? g->N : g->K; /* rows as stored */
  float *A = malloc(sizeof(float) * (size_t)(ar * g->lda));
  float *B = malloc(sizeof(float) * (size_t)(br * g->ldb));
  float *C = calloc((size_t)(g->M * g->ldc), sizeof(float));
  float *D = calloc((size_t)(g->M * g->ldc), sizeof(float));
  for (int64_t i = 0; i < ar * g->lda; i++) A[i] = frand();
  for (int64_t i = 0; i < br * g->ldb; i++) B[i] = frand();
  cblas_sgemm(CblasRowMajor, g->trans_a ? CblasTrans : CblasNoTrans,
              g->trans_b ? CblasTrans : CblasNoTrans, (int)g->M, (int)g->N, (int)g->K, 1.0f, A,
              (int)g->lda, B, (int)g->ldb, 0.0f, C, (int)g->ldc);
  ml_lt_gemm l = ml_lt_gemm_of(g);
  const void *la, *lb;
  ml_lt_operands(A, B, &la, &lb);
  int64_t am = l.trans_a ? l.a_cols : l.a_rows, ak = l.trans_a ? l.a_rows : l.a_cols;
  int64_t bk = l.trans_b ? l.b_cols : l.b_rows, bn = l.trans_b ? l.b_rows : l.b_cols;
  const char *bad =
      am != l.m || ak != l.k               ? "op(A') is not m x k"
      : bk != l.k || bn != l.n             ? "op(B') is not k x n"
      : l.c_rows != l.m || l.c_cols != l.n ? "D is not m x n"
      : l.lda < l.a_rows || l.ldb < l.b_rows || l.ldc < l.c_rows
          ? "a leading dimension below its rows"
      /* column-major [rows, cols] with ld ends at ld·(cols − 1) + rows */
      : (l.a_cols - 1) * l.lda + l.a_rows > (la == B ? br * g->ldb : ar * g->lda) ||
              (l.b_cols - 1) * l.ldb + l.b_rows > (lb == B ? br * g->ldb : ar * g->lda) ||
              (l.c_cols - 1) * l.ldc + l.c_rows > g->M * g->ldc
          ? "an operand read or written past its end"
          : NULL;
  double worst = 0;
  if (!bad) {
    cblas_sgemm(CblasColMajor, l.trans_a ? CblasTrans : CblasNoTrans,
                l.trans_b ? CblasTrans : CblasNoTrans, (int)l.m, (int)l.n, (int)l.k, 1.0f, la,
                (int)l.lda, lb, (int)l.ldb, 0.0f, D, (int)l.ldc);
    for (int64_t i = 0; i < g->M && !bad; i++)
      for (int64_t j = 0; j < g->N; j++) {
        double s = 0; /* sum |a·b| */
        for (int64_t p = 0; p < g->K; p++) {
          double a = g->trans_a ? A[p * g->lda + i] : A[i * g->lda + p];
          double b = g->trans_b ? B[j * g->ldb + p] : B[p * g->ldb + j];
          s += fabs(a * b);
        }
        double d = fabs((double)D[i * g->ldc + j] - C[i * g->ldc + j]);
        double bound = 2.0 * tol_gamma((double)g->K) * s;
        if (!(d <= bound)) {
          bad = "the column-major product differs";
          break;
        }
        if (bound > 0) worst = fmax(worst, d / bound);
      }
  }
  checked++;
  if (bad) {
    failures++;
    printf("  %-64s %s (m %lld n %lld k %lld, ops %c%c, ld %lld %lld %lld)\n", what, bad,
           (long long)l.m, (long long)l.n, (long long)l.k, l.trans_a ? 'T' : 'N',
           l.trans_b ? 'T' : 'N', (long long)l.lda, (long long)l.ldb, (long long)l.ldc);
  } else {
    printf("  %-64s error/bound %.3g\n", what, worst);
  }
  free(A), free(B), free(C), free(D);
}

/* g as issued, then with every leading dimension 3 above its width (the
 * engine's are exact; a view's would not be): a mapping that confused a
 * leading dimension with a width would pass the first alone. */
static void check_both(const char *what, ml_gemm g) {
  check(what, &g);
  char padded[200];
  snprintf(padded, sizeof padded, "%s, ld + 3", what);
  g.lda += 3, g.ldb += 3, g.ldc += 3;
  check(padded, &g);
}

/* model/linear.c's three GEMMs of a Linear [out, in] on T tokens. */
static void linear_gemms(const char *name, int64_t out, int64_t in, int64_t T) {
  char what[160];
  ml_gemm f = {.trans_b = true, .M = T, .N = out, .K = in, .lda = in, .ldb = in, .ldc = out};
  snprintf(what, sizeof what, "%s [%lld x %lld] T=%lld forward", name, (long long)out,
           (long long)in, (long long)T);
  check_both(what, f);
  ml_gemm dx = {.M = T, .N = in, .K = out, .lda = out, .ldb = in, .ldc = in};
  snprintf(what, sizeof what, "%s [%lld x %lld] T=%lld dx", name, (long long)out, (long long)in,
           (long long)T);
  check_both(what, dx);
  ml_gemm dw = {.trans_a = true, .M = out, .N = in, .K = T, .lda = out, .ldb = in, .ldc = in};
  snprintf(what, sizeof what, "%s [%lld x %lld] T=%lld dW", name, (long long)out, (long long)in,
           (long long)T);
  check_both(what, dw);
}

static int64_t first_chunk(int64_t n, int64_t parts) { return (n + parts - 1) / parts; }

static void fixture(const char *dir, const char *fx) {
  ml_model_config cfg;
  ml_model m;
  if (ml_model_config_load(dir, &cfg) || ml_model_create(&cfg, &m)) {
    printf("%s: %s\n", fx, ml_error_msg());
    failures++;
    return;
  }
  printf("%s\n", fx);
  /* one of each distinct [out, in]: the mapping sees shapes, not names */
  int64_t seen[64][2];
  int nseen = 0;
  for (int i = 0; i < m.n_modules; i++) {
    if (m.modules[i].kind != ML_MOD_LINEAR) continue;
    const ml_param *w = ((const ml_linear *)m.modules[i].ptr)->weight;
    int64_t out = w->shape[0], in = w->shape[1];
    int dup = 0;
    for (int s = 0; s < nseen; s++) dup |= seen[s][0] == out && seen[s][1] == in;
    if (dup || nseen == 64) continue;
    seen[nseen][0] = out, seen[nseen][1] = in, nseen++;
    for (int64_t T = 1; T <= 5; T += 4) {
      linear_gemms(m.modules[i].name, out, in, T);
      /* tensor parallelism over 2: the column-parallel (out) and row-parallel (in) pieces */
      linear_gemms(m.modules[i].name, first_chunk(out, 2), in, T);
      linear_gemms(m.modules[i].name, out, first_chunk(in, 2), T);
    }
  }
  ml_model_destroy(&m);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: test_gemm_map FIXTURES_DIR\n");
    return 2;
  }
  struct dirent **list;
  int n = scandir(argv[1], &list, NULL, alphasort), fixtures = 0;
  for (int i = 0; i < n; i++) {
    char dir[4096], cfg[4200];
    snprintf(dir, sizeof dir, "%s/%s", argv[1], list[i]->d_name);
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    FILE *f = list[i]->d_name[0] != '.' ? fopen(cfg, "r") : NULL;
    if (f) {
      fclose(f);
      fixture(dir, list[i]->d_name);
      fixtures++;
    }
    free(list[i]);
  }
  free(list);
  printf("%d GEMMs of %d fixtures, %d failed\n", checked, fixtures, failures);
  return failures != 0 || fixtures == 0;
}
