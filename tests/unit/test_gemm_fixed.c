/* The batch-invariant GEMM (backend/cpu/gemm_fixed.c, ml_cpu_gemm_fixed):
 * every element bitwise equal (memcmp) to a scalar evaluation of the one
 * documented order — 16 lanes of fmaf over k ≡ l (mod 16) in increasing k,
 * the lanes summed (l + l+8, +4, +2, +1), + bias, then C + that when
 * accumulating — for shapes around the kernel's 4 × 4 register tiles, its
 * 64 × 64 tasks and the 16-lane chunks of K, fp32 and bf16 operands, on 1
 * and 2 OpenMP threads. An order that depended on M, N, the blocking or
 * the threads would differ from the scalar one somewhere. Then through the
 * backend (ml_be_gemm in batch-invariant mode, operands converted as the
 * compute dtype wants): every row of a 130-row product equals that row
 * computed alone. The widened form of a bf16 A (gemm.c's) gives the same
 * bits, and the default path's small-M products are the same order.
 * fp32 operands flagged bf16-exact (ml_gemm.a_exact, b_exact) change no bit
 * on either path, and the emulation reads them in place. */
#include <math.h>
#include <omp.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>  // after the headers it needs

#include "backend/cpu/cpu.h"
#include "tensor/dtype.h"

static uint64_t g_state = 0x9E3779B97F4A7C15ull;
static float rnd(void) { /* xorshift64, uniform in [-1, 1) */
  g_state ^= g_state << 13, g_state ^= g_state >> 7, g_state ^= g_state << 17;
  return (float)((double)(g_state >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

// x of a bf16 operand (bf) or an fp32 one, element k
static float elem(const void *x, int64_t k, bool bf) {
  return bf ? ml_bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
}

/* The documented order for one element: row a · row b over K. */
static float dot_ref(const void *a, const void *b, int64_t K, bool bf) {
  float lane[16] = {0};
  for (int64_t k = 0; k < K; k++) lane[k % 16] = fmaf(elem(a, k, bf), elem(b, k, bf), lane[k % 16]);
  float s8[8], s4[4], s2[2];
  for (int l = 0; l < 8; l++) s8[l] = lane[l] + lane[l + 8];
  for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
  for (int l = 0; l < 2; l++) s2[l] = s4[l] + s4[l + 2];
  return s2[0] + s2[1];
}

static void *operand(int64_t n, bool bf) {
  void *p = malloc((size_t)n * (bf ? sizeof(uint16_t) : sizeof(float)));
  for (int64_t i = 0; i < n; i++) {
    float x = rnd();
    if (bf) ((uint16_t *)p)[i] = ml_f32_to_bf16(x);
    else ((float *)p)[i] = x;
  }
  return p;
}

static const void *row(const void *p, int64_t r, int64_t ld, bool bf) {
  return (const char *)p + (size_t)(r * ld) * (bf ? 2 : 4);
}

/* One shape: C (ldc = N + 3) from ml_cpu_gemm_fixed against dot_ref. */
static void check_shape(int64_t M, int64_t N, int64_t K, bool bf, bool bias, bool accumulate,
                        int threads) {
  int64_t lda = K + 1, ldb = K + 2, ldc = N + 3;
  void *A = operand(M * lda, bf), *B = operand(N * ldb, bf);
  float *bv = bias ? operand(N, false) : NULL, *C = malloc(sizeof(float) * (size_t)(M * ldc));
  float *ref = malloc(sizeof(float) * (size_t)(M * ldc));
  for (int64_t i = 0; i < M * ldc; i++) C[i] = ref[i] = rnd();
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < N; j++) {
      float v = dot_ref(row(A, i, lda, bf), row(B, j, ldb, bf), K, bf);
      if (bias) v += bv[j];
      ref[i * ldc + j] = accumulate ? ref[i * ldc + j] + v : v;
    }
  ml_gemm g = {.trans_b = true, .M = M, .N = N, .K = K, .C = C, .ldc = ldc,
               .accumulate = accumulate};
  omp_set_num_threads(threads);
  assert_int_equal(ml_cpu_gemm_fixed(&g, A, lda, bf, B, ldb, bf, bv), 0);
  if (memcmp(C, ref, sizeof(float) * (size_t)(M * ldc)) != 0)
    fail_msg("M %lld N %lld K %lld %s%s%s, %d threads: not the documented order", (long long)M,
             (long long)N, (long long)K, bf ? "bf16" : "fp32", bias ? " + bias" : "",
             accumulate ? " accumulating" : "", threads);
  if (bf) { /* A widened to fp32 (gemm.c's form of a bf16 GEMM's activations): the same bits */
    float *Aw = malloc(sizeof(float) * (size_t)(M * lda)), *C2 = malloc(sizeof(float) * (size_t)(M * ldc));
    for (int64_t i = 0; i < M * lda; i++) Aw[i] = ml_bf16_to_f32(((const uint16_t *)A)[i]);
    for (int64_t i = 0; i < M; i++) /* C2's start = C's before the call: ref less this call */
      for (int64_t j = 0; j < ldc; j++) C2[i * ldc + j] = j < N ? 0.0f : C[i * ldc + j];
    ml_gemm g2 = g;
    g2.C = C2, g2.accumulate = false;
    assert_int_equal(ml_cpu_gemm_fixed(&g2, Aw, lda, false, B, ldb, true, bv), 0);
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < N; j++) {
        float v = dot_ref(row(A, i, lda, true), row(B, j, ldb, true), K, true);
        if (bias) v += bv[j];
        if (memcmp(&v, &C2[i * ldc + j], sizeof v) != 0)
          fail_msg("M %lld N %lld K %lld: A widened to fp32 differs from A in bf16 at (%lld, %lld)",
                   (long long)M, (long long)N, (long long)K, (long long)i, (long long)j);
      }
    free(Aw), free(C2);
  }
  free(A), free(B), free(bv), free(C), free(ref);
}

static void test_fixed_order(void **state) {
  (void)state;
  static const int64_t Ms[] = {1, 3, 4, 5, 67, 130}, Ns[] = {1, 3, 4, 5, 70};
  static const int64_t Ks[] = {1, 15, 16, 17, 100, 300};
  int n = 0;
  for (size_t a = 0; a < sizeof Ms / sizeof Ms[0]; a++)
    for (size_t b = 0; b < sizeof Ns / sizeof Ns[0]; b++)
      for (size_t c = 0; c < sizeof Ks / sizeof Ks[0]; c++)
        for (int v = 0; v < 8; v++, n++)
          check_shape(Ms[a], Ns[b], Ks[c], v & 1, v & 2, v & 4, 1 + n % 2);
  printf("  %d shapes x dtypes x epilogues: the documented order, bitwise\n", n);
}

/* ml_be_gemm in batch-invariant mode, x·W^T with x [130, K] fp32 and W
 * [N, K] fp32 or bf16 (compute bf16: x rounded by the backend): each row
 * of the 130-row product = the same row alone (M = 1). */
static void test_backend_rows(void **state) {
  (void)state;
  ml_backend *be;
  assert_int_equal(ml_backend_get("cpu", 0, &be), 0);
  assert_int_equal(ml_be_set_batch_invariant(be, true), 0);
  enum { M = 130, N = 70, K = 200 };
  for (int bf = 0; bf < 2; bf++) {
    float *x = operand(M * K, false), *C = malloc(sizeof(float) * M * N), one[N];
    void *W = operand(N * K, bf);
    ml_gemm g = {.trans_b = true, .M = M, .N = N, .K = K, .A = x, .a_type = ML_F32, .lda = K,
                 .B = W, .b_type = bf ? ML_BF16 : ML_F32, .ldb = K, .C = C, .ldc = N,
                 .compute = bf ? ML_BF16 : ML_F32};
    assert_int_equal(ml_be_gemm(be, &g), 0);
    for (int64_t i = 0; i < M; i++) {
      ml_gemm r = g;
      r.M = 1, r.A = x + i * K, r.C = one;
      assert_int_equal(ml_be_gemm(be, &r), 0);
      if (memcmp(one, C + i * N, sizeof one) != 0)
        fail_msg("%s: row %lld of a %d-row product differs from the row alone",
                 bf ? "bf16" : "fp32", (long long)i, M);
    }
    free(x), free(C), free(W);
  }
  assert_int_equal(ml_be_set_batch_invariant(be, false), 0);
  ml_backend_release_all();
}

/* The default path (batch-invariant mode off) runs x·W^T of at most
 * ML_CPU_GEMM_SMALL_M rows on the fixed kernel (cpu.h): each element the
 * documented order on x rounded as the compute dtype wants (bf16: x
 * rounded to bf16, as autocast); one row more goes to oneDNN, not checked
 * here. */
static void test_default_small(void **state) {
  (void)state;
  ml_backend *be;
  assert_int_equal(ml_backend_get("cpu", 0, &be), 0);
  enum { N = 37, K = 300 };
  for (int bf = 0; bf < 2; bf++)
    for (int64_t M = 1; M <= ML_CPU_GEMM_SMALL_M; M++) {
      float *x = operand(M * K, false), *C = malloc(sizeof(float) * (size_t)(M * N));
      void *W = operand(N * K, bf);
      uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(M * K));
      ml_convert_from_f32(ML_BF16, x, xb, (size_t)(M * K));
      ml_gemm g = {.trans_b = true, .M = M, .N = N, .K = K, .A = x, .a_type = ML_F32, .lda = K,
                   .B = W, .b_type = bf ? ML_BF16 : ML_F32, .ldb = K, .C = C, .ldc = N,
                   .compute = bf ? ML_BF16 : ML_F32};
      assert_int_equal(ml_be_gemm(be, &g), 0);
      for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
          float v = bf ? dot_ref(xb + i * K, (const uint16_t *)W + j * K, K, true)
                       : dot_ref(x + i * K, (const float *)W + j * K, K, false);
          if (memcmp(&v, &C[i * N + j], sizeof v) != 0)
            fail_msg("%s M %lld: element (%lld, %lld) %.9g, expected the fixed order's %.9g",
                     bf ? "bf16" : "fp32", (long long)M, (long long)i, (long long)j,
                     (double)C[i * N + j], (double)v);
        }
      free(x), free(C), free(W), free(xb);
    }
  ml_backend_release_all();
}

/* ml_be_gemm(be, g), whose pool peak inside the call must be
 * ml_be_gemm_temp's bytes above what was in use, in as many new pool blocks
 * as ml_be_gemm_temp_blocks lists, of its bytes in all (the meta backend
 * takes those blocks, so its pool holds the run's). The pool's cache is
 * emptied first, so every block the call takes is a new one (raw_allocs
 * counts them). */
static void temp_run(ml_backend *be, const ml_gemm *g) {
  ml_be_trim(be);
  ml_memory_stats s0 = ml_be_memory_stats(be);
  ml_be_reset_peak(be);
  assert_int_equal(ml_be_gemm(be, g), 0);
  ml_memory_stats s1 = ml_be_memory_stats(be);
  int64_t took = (int64_t)s1.peak - (int64_t)s0.in_use, want = ml_be_gemm_temp(be, g), sum = 0;
  int64_t bytes[ML_GEMM_TEMP_BLOCKS];
  int n = ml_be_gemm_temp_blocks(be, g, bytes);
  for (int i = 0; i < n; i++) sum += bytes[i];
  uint64_t blocks = s1.raw_allocs - s0.raw_allocs;
  if (took != want || sum != want || blocks != (uint64_t)n)
    fail_msg("GEMM M %lld N %lld K %lld%s: took %lld B of scratch in %llu pool blocks; "
             "ml_be_gemm_temp says %lld B, ml_be_gemm_temp_blocks %lld B in %d",
             (long long)g->M, (long long)g->N, (long long)g->K, g->c_bf16 ? " C bf16" : "",
             (long long)took, (unsigned long long)blocks, (long long)want, (long long)sum, n);
}

/* A bf16 C (ml_gemm.c_bf16) on every CPU path is bitwise the same GEMM
 * with an fp32 C then rounded by ml_convert_from_f32 (nearest-even): oneDNN
 * (M > ML_CPU_GEMM_SMALL_M, its fp32 product rounded), the fixed kernel
 * (small M, and every x·W^T in batch-invariant mode), the backward's layouts (trans_a,
 * no trans_b), an fp32 GEMM (rounded after it), K = 0, with and without a
 * bias of either dtype; ldc > N leaves the gaps alone. Operands scaled by
 * 1, and by 2^-64 each (normal inputs, subnormal outputs without a bias:
 * a store converting with DAZ/FTZ semantics, as VCVTNEPS2BF16 does, would
 * differ there). accumulate with a bf16 C is refused. Each call's pool
 * scratch is ml_be_gemm_temp's (temp_run). */
static void test_c_bf16(void **state) {
  (void)state;
  ml_backend *be;
  assert_int_equal(ml_backend_get("cpu", 0, &be), 0);
  enum { N = 37, K = 70 };
  static const int64_t Ms[] = {3, 64};
  int n = 0;
  for (int inv = 0; inv < 2; inv++) {
    assert_int_equal(ml_be_set_batch_invariant(be, inv), 0);
    for (int v = 0; v < 128; v++) {
      int64_t M = Ms[v & 1], k = v & 64 ? 0 : K, ldc = N + 5;
      bool bf = v & 2, ta = v & 4, bias = v & 8, bias_bf = v & 16;
      float scale = v & 32 ? 0x1p-64f : 1.0f; /* on x and W: products near 2^-128 */
      float *x = operand(M * K, false), *C = malloc(sizeof(float) * (size_t)(M * N));
      void *W = operand(N * K, bf), *b = operand(N, bias_bf);
      for (int64_t i = 0; i < M * K; i++) x[i] *= scale;
      for (int64_t i = 0; i < N * K; i++) /* exact: a power of two, the result normal */
        if (bf) ((uint16_t *)W)[i] = ml_f32_to_bf16(ml_bf16_to_f32(((uint16_t *)W)[i]) * scale);
        else ((float *)W)[i] *= scale;
      uint16_t *C16 = malloc(sizeof(uint16_t) * (size_t)(M * ldc)), *R16 = malloc(sizeof(uint16_t) * (size_t)(M * ldc));
      for (int64_t i = 0; i < M * ldc; i++) C16[i] = R16[i] = 0x5555;
      ml_gemm g = {.trans_a = ta, .trans_b = !ta, .M = M, .N = N, .K = k, .A = x,
                   .a_type = ML_F32, .lda = ta ? M : K, .B = W,
                   .b_type = bf ? ML_BF16 : ML_F32, .ldb = ta ? N : K, .C = C, .ldc = N,
                   .bias = bias ? b : NULL, .bias_type = bias_bf ? ML_BF16 : ML_F32,
                   .compute = bf ? ML_BF16 : ML_F32};
      temp_run(be, &g);
      for (int64_t i = 0; i < M; i++) ml_convert_from_f32(ML_BF16, C + i * N, R16 + i * ldc, N);
      ml_gemm h = g;
      h.C = C16, h.ldc = ldc, h.c_bf16 = true;
      temp_run(be, &h);
      if (memcmp(C16, R16, sizeof(uint16_t) * (size_t)(M * ldc)) != 0)
        fail_msg("%s M %lld K %lld %s%s%s scale %g: the bf16 C differs from the fp32 C rounded",
                 bf ? "bf16" : "fp32", (long long)M, (long long)k, ta ? "A^T·B" : "A·B^T",
                 bias ? (bias_bf ? " + bf16 bias" : " + bias") : "",
                 inv ? " (batch-invariant)" : "", (double)scale);
      free(x), free(C), free(W), free(b), free(C16), free(R16);
      n++;
    }
  }
  assert_int_equal(ml_be_set_batch_invariant(be, false), 0);
  uint16_t c = 0;
  float a = 1.0f;
  ml_gemm acc = {.trans_b = true, .M = 1, .N = 1, .K = 1, .A = &a, .a_type = ML_F32, .lda = 1,
                 .B = &a, .b_type = ML_F32, .ldb = 1, .C = &c, .ldc = 1, .c_bf16 = true,
                 .accumulate = true, .compute = ML_F32};
  assert_int_not_equal(ml_be_gemm(be, &acc), 0);
  printf("  %d GEMMs with a bf16 C: bitwise the fp32 C rounded; accumulate refused\n", n);
  ml_backend_release_all();
}

/* n fp32 elements holding bf16 values (rounded), or raw when !exact. */
static float *f32_operand(int64_t n, bool exact) {
  float *x = operand(n, false);
  if (exact) ml_round_bf16(x, (size_t)n);
  return x;
}

/* A bf16 GEMM's fp32 operands flagged exact (ml_gemm.a_exact, b_exact) give C
 * bitwise (memcmp) the unflagged GEMM's, whatever reads them: oneDNN (M 64;
 * the emulation here, oneDNN's bf16 matmul where the CPU has one) and the
 * fixed kernel (M 3, and every x·W^T in batch-invariant mode); the three
 * layouts of a linear (x·W^T, dy·W, dy^T·x); fp32 and bf16 C; accumulate;
 * leading dimensions contiguous and odd (lda, ldb + 3); A, B or both
 * flagged, the other fp32 or bf16. The flag takes effect: each call's pool
 * scratch is ml_be_gemm_temp's (temp_run), and where the backend reads
 * exact operands in place (ml_be_gemm_exact_in_place: the emulation) a
 * contiguous flagged operand takes none — so both flagged, a product with an
 * fp32 C takes no scratch at all. */
static void test_exact_operands(void **state) {
  (void)state;
  ml_backend *be;
  assert_int_equal(ml_backend_get("cpu", 0, &be), 0);
  bool in_place = ml_be_gemm_exact_in_place(be);
  enum { N = 37, K = 70 };
  int n = 0, none = 0;
  for (int inv = 0; inv < 2; inv++) {
    assert_int_equal(ml_be_set_batch_invariant(be, inv), 0);
    for (int v = 0; v < 192; v++) {
      int64_t M = v & 1 ? 64 : 3;
      int layout = v % 3;               /* 0: A·B^T, 1: A·B, 2: A^T·B */
      bool odd = v & 2, c_bf16 = v & 4, acc = (v & 8) && !c_bf16;
      int flags = (v >> 4) % 3 + 1;     /* 1: A, 2: B, 3: both */
      bool b_bf = (v & 64) && flags == 1; /* B read as bf16, not flagged */
      bool ta = layout == 2, tb = layout == 0;
      int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
      int64_t lda = ac + (odd ? 3 : 0), ldb = bc + (odd ? 3 : 0), ldc = N;
      float *A = f32_operand(ar * lda, true);
      void *B = b_bf ? operand(br * ldb, true) : f32_operand(br * ldb, true);
      size_t cb = (size_t)(M * ldc) * (c_bf16 ? sizeof(uint16_t) : sizeof(float));
      float *C0 = operand(M * ldc, false);
      void *C1 = malloc(cb), *C2 = malloc(cb);
      memcpy(C1, C0, cb), memcpy(C2, C0, cb);
      ml_gemm g = {.trans_a = ta, .trans_b = tb, .M = M, .N = N, .K = K, .A = A,
                   .a_type = ML_F32, .lda = lda, .B = B, .b_type = b_bf ? ML_BF16 : ML_F32,
                   .ldb = ldb, .C = C1, .ldc = ldc, .accumulate = acc, .c_bf16 = c_bf16,
                   .compute = ML_BF16};
      temp_run(be, &g);
      ml_gemm h = g;
      h.C = C2, h.a_exact = flags & 1, h.b_exact = flags & 2;
      temp_run(be, &h);
      if (memcmp(C1, C2, cb) != 0)
        fail_msg("M %lld %s%s%s%s, %s flagged exact: C differs from the unflagged GEMM's",
                 (long long)M, layout == 0 ? "A·B^T" : layout == 1 ? "A·B" : "A^T·B",
                 odd ? " (odd ld)" : "", c_bf16 ? " C bf16" : "", acc ? " +=" : "",
                 flags == 3 ? "A and B" : flags == 1 ? "A" : "B");
      if (in_place && flags == 3 && !odd && !c_bf16) {
        if (ml_be_gemm_temp(be, &h) != 0)
          fail_msg("M %lld: both operands exact and contiguous, yet %lld B of scratch",
                   (long long)M, (long long)ml_be_gemm_temp(be, &h));
        none++;
      }
      free(A), free(B), free(C0), free(C1), free(C2);
      n++;
    }
  }
  assert_int_equal(ml_be_set_batch_invariant(be, false), 0);
  printf("  %d bf16 GEMMs with exact operands flagged: bitwise unflagged; %d took no scratch%s\n",
         n, none, in_place ? "" : " (bf16 matmul native here: no in-place reads)");
  ml_backend_release_all();
}

/* The flag is what the emulation acts on: fp32 operands flagged exact that
 * are not (raw values) are read as they are, so the bf16 GEMM is bitwise the
 * fp32 GEMM of those values (the same primitive), where an honest flag would
 * have changed nothing (test_exact_operands). Only where the backend reads
 * exact operands in place (ml_be_gemm_exact_in_place). */
static void test_exact_read_in_place(void **state) {
  (void)state;
  ml_backend *be;
  assert_int_equal(ml_backend_get("cpu", 0, &be), 0);
  if (!ml_be_gemm_exact_in_place(be)) {
    printf("  skipped: bf16 matmul native on this CPU (flagged operands are converted)\n");
    ml_backend_release_all();
    skip();
  }
  enum { M = 64, N = 37, K = 70 };
  for (int ta = 0; ta < 2; ta++) {
    float *A = f32_operand(M * K, false), *B = f32_operand(N * K, false);
    float *C32 = malloc(sizeof(float) * M * N), *C16 = malloc(sizeof(float) * M * N);
    ml_gemm g = {.trans_a = ta, .trans_b = !ta, .M = M, .N = N, .K = K, .A = A,
                 .a_type = ML_F32, .lda = ta ? M : K, .B = B, .b_type = ML_F32,
                 .ldb = ta ? N : K, .C = C32, .ldc = N, .compute = ML_F32};
    assert_int_equal(ml_be_gemm(be, &g), 0);
    g.C = C16, g.compute = ML_BF16, g.a_exact = g.b_exact = true;
    assert_int_equal(ml_be_gemm(be, &g), 0);
    if (memcmp(C32, C16, sizeof(float) * M * N) != 0)
      fail_msg("%s: raw operands flagged exact were rounded (C is not the fp32 GEMM's)",
               ta ? "A^T·B" : "A·B^T");
    free(A), free(B), free(C32), free(C16);
  }
  ml_backend_release_all();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fixed_order),
      cmocka_unit_test(test_backend_rows),
      cmocka_unit_test(test_default_small),
      cmocka_unit_test(test_c_bf16),
      cmocka_unit_test(test_exact_operands),
      cmocka_unit_test(test_exact_read_in_place),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
