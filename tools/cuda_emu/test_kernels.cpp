// Every kernel of src/kernels/cuda but attention (test_attention.cpp), run
// on the CPU under tools/cuda_emu's emulator (AddressSanitizer, UBSan),
// against its counterpart in src/kernels/cpu (or tensor/dtype.c for the
// conversions) on edge shapes: n % 4 != 0, pointers one element past an
// aligned address (a vector access there would be a misaligned float4/uint2
// load, which UBSan stops), more than 65,535 rows (the row kernels' grids
// stop at 65,535 blocks and loop; xent_bwd's rows are grid.y), odd vocab
// shards, targets and ids outside the shard (below, above, -1: kernels.h
// says they give zeros / no gradient / weight 0), embedding tables above
// 2^16 rows (three radix passes), the grid-stride loops past their 4096
// blocks, outputs aliasing inputs where kernels.h allows it. Every output
// buffer starts as NaN so that an element left unwritten shows; threads and
// blocks run in shuffled orders, so that a race or a missing barrier shows.
//
// Tolerances are those tests/cuda/test_cuda_ops.c uses for the CUDA backend
// against the CPU backend, from tests/tolerance.h (R1-R5, §1, §5; derived in
// tests/cuda/op_bounds.h, shared by both):
// where both sides perform the same correctly rounded operations on the same
// operands the results must be bitwise equal and are compared so; elsewhere
// each side is within tolerance.h's bound of the exact value (the kernels
// repeat the CPU kernels' expressions operation for operation, a contracted
// FMA rounding once where the count has two), so they differ by at most
// twice it. The emulated kernels call glibc's libm, the device's is within
// TOL_LIBM too. Each check prints its worst error/bound; the exit status is
// nonzero when any failed. usage: test_kernels [convert|add_scale|glu|...]
// (one group of checks; none: all).
#include <stdarg.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cuda/op_bounds.h"
#include "emu.h"
#include "kernels/cuda/kernels.h"
extern "C" {
#include "kernels/cpu/kernels.h"
#include "tensor/dtype.h"
}
#include "tolerance.h"

static int failures = 0;
static std::mt19937_64 rng(20261126);

/* ---- buffers ---------------------------------------------------------------
 * Exact-size heap blocks (AddressSanitizer sees one element past the end),
 * 16-byte aligned by malloc; `off` elements in (off 1: misaligned for every
 * vector access). Freed at the end of each check. */
struct Pool {
  std::vector<void *> blocks;
  template <class T>
  T *get(int64_t n, int off = 0) {
    size_t bytes = sizeof(T) * (size_t)(n + off);
    void *p = malloc(bytes ? bytes : 1);
    if ((uintptr_t)p % 16) abort();
    memset(p, 0xFF, bytes);  // NaN as fp32 and bf16, -1 as int
    blocks.push_back(p);
    return (T *)p + off;
  }
  template <class T>
  T *copy(const T *src, int64_t n, int off = 0) {
    T *p = get<T>(n, off);
    memcpy(p, src, sizeof(T) * (size_t)n);
    return p;
  }
  ~Pool() {
    for (void *p : blocks) free(p);
  }
};

static float *rand_f(Pool &pl, int64_t n, float scale, int off = 0) {
  std::uniform_real_distribution<float> U(-scale, scale);
  float *p = pl.get<float>(n, off);
  for (int64_t i = 0; i < n; i++) p[i] = U(rng);
  return p;
}

static void ok(cudaError_t e, const char *what) {
  if (e != cudaSuccess) {
    printf("  %-52s launch error %d\n", what, (int)e);
    failures++;
  }
}

/* ---- comparisons ------------------------------------------------------------ */

static void same(const std::string &what, const void *got, const void *ref, size_t bytes) {
  const unsigned char *g = (const unsigned char *)got, *r = (const unsigned char *)ref;
  size_t at = 0;
  while (at < bytes && g[at] == r[at]) at++;
  printf("  %-52s %s\n", what.c_str(), at == bytes ? "bitwise equal" : "DIFFERENT");
  if (at < bytes) {
    printf("    byte %zu: 0x%02x, expected 0x%02x\n", at, g[at], r[at]);
    failures++;
  }
}

// |got_i - ref_i| <= bound_i (NaN never within; a zero bound asks equality)
static void close(const std::string &what, const float *got, const float *ref,
                  const std::vector<double> &bound, int64_t n) {
  double worst = 0;
  int64_t bad = -1;
  for (int64_t i = 0; i < n; i++) {
    double d = fabs((double)got[i] - ref[i]);
    if (!(d <= bound[i])) {
      if (bad < 0) bad = i;
      worst = INFINITY;
    } else if (bound[i] > 0) {
      worst = std::max(worst, d / bound[i]);
    }
  }
  printf("  %-52s error/bound %.3g\n", what.c_str(), worst);
  if (bad >= 0) {
    printf("    element %lld: %.9g, expected %.9g within %.3g\n", (long long)bad, got[bad],
           ref[bad], bound[bad]);
    failures++;
  }
}

static std::string fmt(const char *f, ...) __attribute__((format(printf, 1, 2)));
static std::string fmt(const char *f, ...) {
  char b[160];
  va_list ap;
  va_start(ap, f);
  vsnprintf(b, sizeof b, f, ap);
  va_end(ap);
  return b;
}

/* ---- conversions: bitwise (tensor/dtype's integer arithmetic, ported) ------ */
static void test_convert() {
  printf("conversions\n");
  const int64_t n = 65536 + 3;  // every 16-bit pattern, then 3 more
  for (int off = 0; off < 2; off++) {
    Pool pl;
    std::uniform_int_distribution<uint32_t> bits;
    float *x = pl.get<float>(n, off), *ref = pl.get<float>(n);
    const uint32_t special[] = {0x7fc00000u, 0xffc00001u, 0x7f800000u, 0xff800000u, 0x7f7fffffu,
                                0x00000001u, 0x80000000u, 0x3f808000u, 0x3f818000u, 0x33000000u,
                                0x387fe000u, 0x477ff000u, 0x38800000u, 0x7f7f8000u};
    for (int64_t i = 0; i < n; i++) {
      uint32_t u = i < 14  ? special[i]
                   : i % 3 ? bits(rng)
                           : (bits(rng) & 0x87ffffffu) | 0x30000000u;
      memcpy(&x[i], &u, 4);
    }
    uint16_t *h = pl.get<uint16_t>(n, off), *href = pl.get<uint16_t>(n);
    ok(kc_f32_to_bf16(nullptr, x, h, n), "f32_to_bf16");
    for (int64_t i = 0; i < n; i++) href[i] = ml_f32_to_bf16(x[i]);
    same(fmt("f32 -> bf16 n=%lld off=%d", (long long)n, off), h, href, 2 * n);
    ok(kc_f32_to_f16(nullptr, x, h, n), "f32_to_f16");
    for (int64_t i = 0; i < n; i++) href[i] = ml_f32_to_f16(x[i]);
    same("f32 -> f16", h, href, 2 * n);
    for (int64_t i = 0; i < n; i++) h[i] = (uint16_t)i;  // all patterns
    float *y = pl.get<float>(n, 1 - off);
    ok(kc_bf16_to_f32(nullptr, h, y, n), "bf16_to_f32");
    for (int64_t i = 0; i < n; i++) ref[i] = ml_bf16_to_f32(h[i]);
    same("bf16 -> f32 (every pattern)", y, ref, 4 * n);
    ok(kc_f16_to_f32(nullptr, h, y, n), "f16_to_f32");
    for (int64_t i = 0; i < n; i++) ref[i] = ml_f16_to_f32(h[i]);
    same("f16 -> f32 (every pattern)", y, ref, 4 * n);
    memcpy(ref, x, 4 * n);
    ml_round_bf16(ref, (size_t)n);
    /* the cast into another buffer with its bf16 copy (kc_round_bf16_to): bitwise k_round_bf16_to,
     * so round_bf16's values and the conversion's bits; y and y16 misaligned against x */
    float *yt = pl.get<float>(n, 1 - off), *yc = pl.get<float>(n);
    uint16_t *ht = pl.get<uint16_t>(n, 1 - off), *hc = pl.get<uint16_t>(n);
    ok(kc_round_bf16_to(nullptr, x, yt, ht, n), "round_bf16_to");
    k_round_bf16_to(x, yc, hc, n);
    same(fmt("round_bf16_to n=%lld x+%d: y", (long long)n, off), yt, yc, 4 * n);
    same("  y = round_bf16's", yt, ref, 4 * n);
    same("  y16", ht, hc, 2 * n);
    for (int64_t i = 0; i < n; i++) href[i] = ml_f32_to_bf16(x[i]);
    same("  y16 = the conversion's", ht, href, 2 * n);
    ok(kc_round_bf16_to(nullptr, x, yt, nullptr, n), "round_bf16_to");
    same("  without y16", yt, ref, 4 * n);
    ok(kc_round_bf16(nullptr, x, n), "round_bf16");
    same("round_bf16 (in place)", x, ref, 4 * n);
  }
}

/* ---- scatter rows (the KV cache's appends): bitwise each row's conversion - */
static void test_scatter_rows() {
  printf("scatter rows\n");
  const int64_t n = 37, width = 24, rows_total = 200;
  Pool pl;
  float *src = rand_f(pl, n * width, 3.0f, 0);
  int32_t *rows = pl.get<int32_t>(n);
  std::vector<int32_t> perm(rows_total);
  for (int32_t i = 0; i < rows_total; i++) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int64_t r = 0; r < n; r++) rows[r] = perm[r];
  float *d32 = pl.get<float>(rows_total * width), *r32 = pl.get<float>(rows_total * width);
  uint16_t *d16 = pl.get<uint16_t>(rows_total * width), *r16 = pl.get<uint16_t>(rows_total * width);
  for (int64_t i = 0; i < rows_total * width; i++) d32[i] = r32[i] = -1.0f, d16[i] = r16[i] = 7;
  for (int64_t r = 0; r < n; r++)
    for (int64_t c = 0; c < width; c++) {
      r32[rows[r] * width + c] = src[r * width + c];
      r16[rows[r] * width + c] = ml_f32_to_bf16(src[r * width + c]);
    }
  ok(kc_scatter_rows(nullptr, d32, false, rows, src, n, width), "scatter_rows f32");
  same("scatter rows f32 (other rows untouched)", d32, r32, 4 * rows_total * width);
  ok(kc_scatter_rows(nullptr, d16, true, rows, src, n, width), "scatter_rows bf16");
  same("scatter rows bf16 (other rows untouched)", d16, r16, 2 * rows_total * width);
}

/* ---- add, scale: one correctly rounded operation each: bitwise; the add with
 * a bf16 copy (kc_add_bf16) bitwise k_add_bf16, y16 aligned and not, with
 * ties (1 + 2^-8, 1 + 3·2^-8: exact sums); the add into another buffer
 * (kc_add_to) bitwise k_add_to, and rounded there (kc_add_round_to) bitwise
 * k_add_round_to; a reduced gradient written or added, rounded or not
 * (kc_add_grad) bitwise k_add_grad ----------------------------------------------- */
static void test_add_scale() {
  printf("add, scale\n");
  // 4096 blocks x 256 threads x 4 = 4194304 elements before the grid strides
  const int64_t sizes[] = {1, 5, 4099, 70001, 4194304 + 5};
  for (int64_t n : sizes)
    for (int off = 0; off < 3; off++) {
      if (n > 70001 && off) continue;
      Pool pl;
      int oy = off & 1, ox = off >> 1;  // y misaligned, then x
      float *x = rand_f(pl, n, 3.0f, ox), *y = rand_f(pl, n, 1.0f, oy);
      float *yr = pl.copy(y, n), *xr = pl.copy(x, n);
      ok(kc_add(nullptr, y, x, n), "add");
      k_add(yr, xr, n);
      same(fmt("add n=%lld y+%d x+%d", (long long)n, oy, ox), y, yr, 4 * n);
      if (n <= 70001) {  // the grid-stride loop is add_kernel's with or without y16
        float *xb = pl.copy(x, n, ox), *yb = pl.copy(yr, n), *yc = pl.copy(yr, n);
        for (int64_t i = 0; i < n && i < 4; i++)
          yb[i] = yc[i] = 1.0f, xb[i] = i % 2 ? 0x1p-8f : 0x3p-8f;
        uint16_t *h = pl.get<uint16_t>(n, oy), *hr = pl.get<uint16_t>(n);
        ok(kc_add_bf16(nullptr, yb, xb, h, n), "add bf16");
        k_add_bf16(yc, xb, hr, n);
        same(fmt("add bf16 n=%lld y16+%d x+%d: y", (long long)n, oy, ox), yb, yc, 4 * n);
        same("  y16", h, hr, 2 * n);
        const uint16_t even[4] = {0x3f82, 0x3f80, 0x3f82, 0x3f80};
        same("  y16 ties to even", h, even, 2 * (n < 4 ? n : 4));
        /* into another buffer (kc_add_to), z misaligned as y is: the add's sums */
        float *z = pl.get<float>(n, oy), *zr = pl.get<float>(n);
        ok(kc_add_to(nullptr, z, yr, x, n), "add_to");
        k_add_to(zr, yr, x, n);
        same(fmt("add_to n=%lld z+%d x+%d", (long long)n, oy, ox), z, zr, 4 * n);
        /* rounded to bf16 values (kc_add_round_to), z and z16 misaligned as y is: bitwise
         * k_add_round_to (ties both signs, ±0, inf − inf, NaN, the largest finite value, a
         * subnormal to 0 and a subnormal tie first), with z16, without, and onto y (z = y:
         * the backward's dx) */
        float *zb = pl.get<float>(n, oy), *zbr = pl.get<float>(n);
        uint16_t *zh = pl.get<uint16_t>(n, oy), *zhr = pl.get<uint16_t>(n);
        const float sp[][2] = {{1.0f, 0x1p-8f},     {-1.0f, -0x1p-8f},   {-0.0f, -0.0f},
                               {0.0f, -0.0f},       {INFINITY, -INFINITY}, {NAN, 1.0f},
                               {0x1.fffffep127f, 0}, {0x1p-149f, 0},     {0x1p-133f, 0x1p-134f}};
        float *ys = pl.copy(yr, n), *xs = pl.copy(x, n, ox);  // special sums first
        for (int64_t i = 0; i < n && i < 9; i++) ys[i] = sp[i][0], xs[i] = sp[i][1];
        ok(kc_add_round_to(nullptr, zb, ys, xs, zh, n), "add_round_to");
        k_add_round_to(zbr, ys, xs, zhr, n);
        same(fmt("add_round_to n=%lld z+%d x+%d: z", (long long)n, oy, ox), zb, zbr, 4 * n);
        same("  z16", zh, zhr, 2 * n);
        ok(kc_add_round_to(nullptr, zb, ys, xs, nullptr, n), "add_round_to");
        same("  without z16", zb, zbr, 4 * n);
        ok(kc_add_round_to(nullptr, z, z, x, nullptr, n), "add_round_to");
        k_add_round_to(zr, zr, x, nullptr, n);
        same("  onto y", z, zr, 4 * n);
        /* a reduced gradient into the shard's (kc_add_grad): written (y NaN-filled: not read)
         * or added, x rounded to bf16 values or not, y misaligned as above: bitwise k_add_grad
         * on the special pairs (0 + −0 = +0 written, −0 + −0 = −0 added) */
        for (int mode = 0; mode < 4; mode++) {
          bool ow = mode & 1, rd = mode & 2;
          float *g = pl.copy(ys, n, oy), *gr = pl.copy(ys, n);
          for (int64_t i = 0; ow && i < n; i++) g[i] = NAN;
          ok(kc_add_grad(nullptr, g, xs, n, ow, rd), "add_grad");
          k_add_grad(gr, xs, n, ow, rd);
          same(fmt("add_grad n=%lld y+%d x+%d overwrite %d round %d", (long long)n, oy, ox, ow,
                   rd),
               g, gr, 4 * n);
        }
      }
      ok(kc_scale(nullptr, x, n, -0.37f), "scale");
      k_scale(xr, n, -0.37f);
      same(fmt("scale n=%lld x+%d", (long long)n, ox), x, xr, 4 * n);
    }
}

/* ---- gated activation: glu_bounds (tests/cuda/op_bounds.h) ---------------- */
static void test_glu() {
  printf("glu\n");
  for (int act = 0; act < 2; act++)
    for (int64_t n : {7, 4099})
      for (int off = 0; off < 2; off++) {
        Pool pl;
        ml_glu_act a = act ? ML_GLU_GELU_TANH : ML_GLU_SILU;
        float *g = rand_f(pl, n, 8.0f, off), *u = rand_f(pl, n, 1.0f),
              *dh = rand_f(pl, n, 1.0f, off);
        float *h = pl.get<float>(n, 1 - off), *dg = pl.get<float>(n), *du = pl.get<float>(n, off);
        float *hr = pl.get<float>(n), *dgr = pl.get<float>(n), *dur = pl.get<float>(n);
        ok(kc_glu_fwd(nullptr, g, u, h, n, a), "glu fwd");
        ok(kc_glu_bwd(nullptr, dh, g, u, dg, du, n, a), "glu bwd");
        k_glu_fwd(g, u, hr, n, a);
        k_glu_bwd(dh, g, u, dgr, dur, n, a);
        std::vector<double> bh(n), bg(n), bu(n);
        glu_bounds(g, u, dh, n, a != ML_GLU_SILU, bh.data(), bg.data(), bu.data());
        close(fmt("glu %s n=%lld off=%d h", act ? "gelu" : "silu", (long long)n, off), h, hr, bh,
              n);
        close("  dg", dg, dgr, bg, n);
        close("  du", du, dur, bu, n);
      }
}

/* ---- gated activation on bf16 g, u: the same kernel order as the fp32
 * kernels on the widened values, so bitwise those (h bf16, and dg, du bf16:
 * kc_f32_to_bf16 of the fp32 results, at every alignment); against the
 * CPU's bf16 variants within glu_bounds of the widened values (expf and FMA
 * contraction differ from the host's) -------------------------------------- */
static void test_glu_bf16() {
  printf("glu_bf16\n");
  for (int act = 0; act < 2; act++)
    for (int64_t n : {7, 4099})
      for (int off = 0; off < 2; off++) {
        Pool pl;
        ml_glu_act a = act ? ML_GLU_GELU_TANH : ML_GLU_SILU;
        float *gw = rand_f(pl, n, 8.0f), *uw = rand_f(pl, n, 1.0f), *dh = rand_f(pl, n, 1.0f, off);
        uint16_t *g = pl.get<uint16_t>(n, off), *u = pl.get<uint16_t>(n, 1 - off);
        for (int64_t i = 0; i < n; i++) {
          g[i] = ml_f32_to_bf16(gw[i]), u[i] = ml_f32_to_bf16(uw[i]);
          gw[i] = ml_bf16_to_f32(g[i]), uw[i] = ml_bf16_to_f32(u[i]);
        }
        float *h = pl.get<float>(n, off), *dg = pl.get<float>(n), *du = pl.get<float>(n, off);
        uint16_t *h16 = pl.get<uint16_t>(n, 1 - off), *r16 = pl.get<uint16_t>(n);
        float *hr = pl.get<float>(n), *dgr = pl.get<float>(n), *dur = pl.get<float>(n);
        ok(kc_glu_fwd_bf16(nullptr, g, u, h, false, n, a), "glu fwd bf16");
        ok(kc_glu_fwd_bf16(nullptr, g, u, h16, true, n, a), "glu fwd bf16 (h bf16)");
        uint16_t *dg16 = pl.get<uint16_t>(n, 1 - off), *du16 = pl.get<uint16_t>(n, off);
        uint16_t *rg16 = pl.get<uint16_t>(n), *ru16 = pl.get<uint16_t>(n);
        ok(kc_glu_bwd_bf16(nullptr, dh, g, u, dg, du, false, n, a), "glu bwd bf16");
        ok(kc_glu_bwd_bf16(nullptr, dh, g, u, dg16, du16, true, n, a), "glu bwd bf16 (bf16 out)");
        ok(kc_glu_fwd(nullptr, gw, uw, hr, n, a), "glu fwd");
        ok(kc_glu_bwd(nullptr, dh, gw, uw, dgr, dur, n, a), "glu bwd");
        for (int64_t i = 0; i < n; i++)
          r16[i] = ml_f32_to_bf16(hr[i]), rg16[i] = ml_f32_to_bf16(dgr[i]),
          ru16[i] = ml_f32_to_bf16(dur[i]);
        std::string tag = fmt("glu_bf16 %s n=%lld off=%d", act ? "gelu" : "silu", (long long)n, off);
        same(tag + " h vs fp32 kernel", h, hr, 4 * n);
        same("  h bf16 vs fp32 kernel's, rounded", h16, r16, 2 * n);
        same("  dg vs fp32 kernel", dg, dgr, 4 * n);
        same("  du vs fp32 kernel", du, dur, 4 * n);
        same("  dg bf16 vs fp32 kernel's, rounded", dg16, rg16, 2 * n);
        same("  du bf16 vs fp32 kernel's, rounded", du16, ru16, 2 * n);
        k_glu_fwd_bf16(g, u, hr, false, n, a);
        k_glu_bwd_bf16(dh, g, u, dgr, dur, false, n, a);
        std::vector<double> bh(n), bg(n), bu(n);
        glu_bounds(gw, uw, dh, n, a != ML_GLU_SILU, bh.data(), bg.data(), bu.data());
        close("  h vs the CPU's", h, hr, bh, n);
        close("  dg vs the CPU's", dg, dgr, bg, n);
        close("  du vs the CPU's", du, dur, bu, n);
      }
}

/* ---- the GEMM's bias rows: C + bias, one correctly rounded add: bitwise;
 * the columns past N of each row (ldc > N) untouched ------------------------ */
static void test_bias_rows() {
  printf("add_bias_rows\n");
  const int64_t shapes[][3] = {{1, 1, 1}, {7, 13, 15}, {70000, 3, 5}};  // M, N, ldc
  for (auto &s : shapes) {
    Pool pl;
    int64_t M = s[0], N = s[1], ldc = s[2];
    float *C = rand_f(pl, M * ldc, 1.0f, 1), *bias = rand_f(pl, N, 1.0f, 1);
    float *ref = pl.copy(C, M * ldc);
    for (int64_t r = 0; r < M; r++)
      for (int64_t c = 0; c < N; c++) ref[r * ldc + c] += bias[c];
    ok(kc_add_bias_rows(nullptr, C, ldc, M, N, bias), "add_bias_rows");
    same(fmt("add_bias_rows M=%lld N=%lld ldc=%lld", (long long)M, (long long)N, (long long)ldc), C,
         ref, 4 * M * ldc);
  }
}

/* ---- bias gradient: bias_grad_bounds (tests/cuda/op_bounds.h) ------------- */
static void test_bias_grad() {
  printf("bias_grad\n");
  const int64_t shapes[][2] = {{1, 1}, {7, 13}, {300, 1030}, {70000, 3}};
  for (auto &s : shapes) {
    Pool pl;
    int64_t T = s[0], N = s[1];
    float *dy = rand_f(pl, T * N, 1.0f, 1), *db = rand_f(pl, N, 1.0f, 1);
    float *ref = pl.copy(db, N);
    void *work = pl.get<char>((int64_t)kc_bias_grad_work(T, N));
    ok(kc_bias_grad(nullptr, dy, T, N, db, work), "bias_grad");
    std::vector<double> bound(N);
    bias_grad_bounds(dy, T, N, ref, bound.data());
    k_bias_grad(dy, T, N, ref);
    close(fmt("bias_grad T=%lld N=%lld (+=)", (long long)T, (long long)N), db, ref, bound, N);
  }
}

/* ---- norms and the non-finite search: sumsq 2·gamma64_n·sum g² (fp64 sums
 * of exact squares, any order); absmax and has_nonfinite exact; n = 0 gives
 * 0 on both ------------------------------------------------------------------ */
// the CPU kernel's partial of one piece (kernels/cpu/kernels.h k_norm_partials)
static double cpu_partial(const float *g, int64_t n, ml_norm_kind kind) {
  ml_norm_seg seg = {g, n};
  double out;
  k_norm_partials(&seg, 1, kind, &out);
  return out;
}

static void test_reduce() {
  printf("sumsq, absmax, has_nonfinite\n");
  // 262144 quads fill the 1024 blocks of 256 threads: beyond, the threads stride
  for (int64_t n : {0, 1, 1000, 70001, 262144 * 4 + 3})
    for (int off = 0; off < 2; off++) {
      bool big = n > 70001;  // one run of each: 1024 blocks of 256 fibers
      if (big && off) continue;
      Pool pl;
      float *g = rand_f(pl, n, 3.0f, off);
      void *work = pl.get<char>((int64_t)kc_reduce_work(n));
      double *d = pl.get<double>(1);
      int *f = pl.get<int>(1);
      ok(kc_sumsq(nullptr, g, n, d, work), "sumsq");
      double ss = cpu_partial(g, n, ML_NORM_SUMSQ), b = 2.0 * tol_gamma64((double)n) * ss;
      printf("  %-52s |diff| %.3g, bound %.3g\n",
             fmt("sumsq n=%lld off=%d", (long long)n, off).c_str(), fabs(*d - ss), b);
      if (!(fabs(*d - ss) <= b)) failures++;
      ok(kc_absmax(nullptr, g, n, d, work), "absmax");
      double am = cpu_partial(g, n, ML_NORM_ABSMAX);
      same("  absmax", d, &am, 8);
      for (int pos = big ? 2 : 0; pos < 3 + !big && n > 0; pos++) {
        int64_t at = pos == 0 ? 0 : pos == 1 ? n / 2 : n - 1;
        float saved = g[at];
        if (pos < 3) g[at] = pos == 1 ? -INFINITY : NAN;
        ok(kc_has_nonfinite(nullptr, g, n, f, work), "has_nonfinite");
        int want = k_has_nonfinite(g, n);
        same(fmt("  has_nonfinite (%s)", pos < 3 ? "one at first/middle/last" : "none"), f, &want,
             4);
        ok(kc_absmax(nullptr, g, n, d, work), "absmax");
        am = cpu_partial(g, n, ML_NORM_ABSMAX);
        same("  absmax (NaN: +inf)", d, &am, 8);
        g[at] = saved;
      }
      if (n == 0) {
        ok(kc_has_nonfinite(nullptr, g, n, f, work), "has_nonfinite");
        int want = 0;
        same("  has_nonfinite of nothing", f, &want, 4);
      }
    }
}

/* ---- the norm partials of many pieces (kc_norm_segs): each bitwise
 * kc_sumsq's / kc_absmax's of the piece alone (kernels.h); 40 pieces cross
 * the 32 of one launch pair, empty ones among them, one holding a NaN ---- */
static void test_norm_segs() {
  printf("norm partials of many pieces\n");
  std::vector<int64_t> n = {0, 1, 1000, 70001, 5, 0, 3};
  while (n.size() < 40) n.push_back((int64_t)(n.size() * 37 % 301));
  int k = (int)n.size();
  Pool pl;
  std::vector<const float *> g(k);
  for (int s = 0; s < k; s++) g[s] = rand_f(pl, n[s], 3.0f, s % 2);
  const_cast<float *>(g[4])[2] = NAN;
  size_t most = 0;
  for (int s = 0; s < k; s++) most = std::max(most, kc_reduce_work(n[s]));
  void *work = pl.get<char>((int64_t)std::max(most, kc_norm_segs_work(n.data(), k)));
  double *got = pl.get<double>(k), *want = pl.get<double>(k);
  for (int absmax = 0; absmax < 2; absmax++) {
    ok(kc_norm_segs(nullptr, g.data(), n.data(), k, absmax, got, work), "norm_segs");
    for (int s = 0; s < k; s++)
      ok(absmax ? kc_absmax(nullptr, g[s], n[s], want + s, work)
                : kc_sumsq(nullptr, g[s], n[s], want + s, work),
         "sumsq / absmax");
    same(fmt("  %s of %d pieces", absmax ? "absmax" : "sumsq", k), got, want, sizeof(double) * k);
  }
}

/* ---- RMSNorm: rmsnorm_fwd_bounds, rmsnorm_bwd_bounds (tests/cuda/op_bounds.h);
 * the backward from the CPU's rstd on both; y aliasing x and dx aliasing dy
 * repeat the results without aliasing bitwise; the bf16-output forward
 * bitwise the fp32 one rounded (kc_f32_to_bf16 is ml_f32_to_bf16 bit for
 * bit), aligned and not, and on ties --------------------------------------- */
static void test_rmsnorm() {
  printf("rmsnorm\n");
  const int64_t shapes[][2] = {{1, 1}, {3, 7}, {5, 64}, {2, 1030}, {65537, 3}};
  const float eps = 1e-6f;
  int c = 0;
  for (auto &s : shapes)
    for (int off = 0; off < 2; off++)
      for (int wb = 0; wb < 2; wb++, c++) {
        int64_t T = s[0], H = s[1];
        if (T > 65535 && (off || wb)) continue;  // one run of the wide grid
        Pool pl;
        float offset = (float)off;
        bool with_dw = c % 2 == 0;
        float *x = rand_f(pl, T * H, 2.0f, off), *w = rand_f(pl, H, 1.0f);
        float *dy = rand_f(pl, T * H, 1.0f, 1 - off), *dw = rand_f(pl, H, 1.0f, off);
        uint16_t *wh = pl.get<uint16_t>(H, off);
        for (int64_t h = 0; h < H; h++) wh[h] = ml_f32_to_bf16(w[h]);
        if (wb)
          for (int64_t h = 0; h < H; h++) w[h] = ml_bf16_to_f32(wh[h]);
        const void *wk = wb ? (const void *)wh : (const void *)w;
        float *y = pl.get<float>(T * H, 1 - off), *rstd = pl.get<float>(T, off);
        float *yr = pl.get<float>(T * H), *rr = pl.get<float>(T);
        ok(kc_rmsnorm_fwd(nullptr, x, wk, wb, offset, eps, y, rstd, T, H), "rmsnorm fwd");
        k_rmsnorm_fwd(x, w, offset, eps, yr, rr, T, H);
        std::vector<double> by(T * H), br(T);
        rmsnorm_fwd_bounds(x, w, offset, eps, T, H, by.data(), br.data());
        std::string what = fmt("rmsnorm T=%lld H=%lld off=%d %s", (long long)T, (long long)H, off,
                               wb ? "bf16 w" : "f32 w");
        close(what + " y", y, yr, by, T * H);
        close("  rstd", rstd, rr, br, T);
        // the bf16 output: bitwise y rounded, the same rstd, x read only (y16 misaligned: off 1);
        // not on the 65537-row shape (its rows past the grid are the fp32 store's loop; one more
        // launch would double the test's time)
        if (T <= 65535) {
          float *xc = pl.copy(x, T * H), *r16 = pl.get<float>(T);
          uint16_t *y16 = pl.get<uint16_t>(T * H, off), *want = pl.get<uint16_t>(T * H);
          ok(kc_rmsnorm_fwd_bf16(nullptr, xc, wk, wb, offset, eps, y16, r16, T, H),
             "rmsnorm fwd bf16");
          for (int64_t i = 0; i < T * H; i++) want[i] = ml_f32_to_bf16(y[i]);
          same("  y bf16 = y rounded", y16, want, 2 * T * H);
          same("  rstd of the bf16 y", r16, rstd, 4 * T);
          same("  x read only", xc, x, 4 * T * H);
        }
        memcpy(rstd, rr, 4 * T);
        float *dx = pl.get<float>(T * H, off), *dxr = pl.get<float>(T * H);
        float *dwr = pl.copy(dw, H), *dw0 = pl.copy(dw, H);
        void *work = pl.get<char>((int64_t)kc_rmsnorm_bwd_work(T, H));
        ok(kc_rmsnorm_bwd(nullptr, dy, x, wk, wb, offset, rstd, dx, with_dw ? dw : nullptr, T, H,
                          work),
           "rmsnorm bwd");
        k_rmsnorm_bwd(dy, x, w, offset, rr, dxr, with_dw ? dwr : nullptr, T, H);
        std::vector<double> bdx(T * H), bdw(H);
        rmsnorm_bwd_bounds(dy, x, w, offset, rr, dw0, T, H, bdx.data(), bdw.data());
        close("  dx", dx, dxr, bdx, T * H);
        if (with_dw)
          close("  dw (+=)", dw, dwr, bdw, H);
        else
          same("  dw NULL: untouched", dw, dw0, 4 * H);
        if (T > 65535) continue;
        // dx aliasing dy, y aliasing x: the same arithmetic
        float *dw2 = pl.copy(dw0, H);
        ok(kc_rmsnorm_bwd(nullptr, dy, x, wk, wb, offset, rstd, dy, with_dw ? dw2 : nullptr, T, H,
                          work),
           "rmsnorm bwd in place");
        same("  dx aliasing dy", dy, dx, 4 * T * H);
        same("  dw with dx aliasing dy", dw2, with_dw ? dw : dw0, 4 * H);
        ok(kc_rmsnorm_fwd(nullptr, x, wk, wb, offset, eps, x, rstd, T, H), "rmsnorm fwd in place");
        same("  y aliasing x", x, y, 4 * T * H);
      }
  // bf16 ties: x = ±1 with eps 0 gives rstd 1 exactly, so y = ±(offset + w) = ±(1 + 2^-8) and
  // ±(1 + 3·2^-8), halfway between bf16 neighbours: nearest-even stores 1 and 1 + 2^-6
  for (int off = 0; off < 2; off++) {
    Pool pl;
    const int64_t H = 9;
    float *x = pl.get<float>(H), *w = pl.get<float>(H), *rstd = pl.get<float>(1);
    uint16_t *y16 = pl.get<uint16_t>(H, 1), want[H];
    for (int64_t h = 0; h < H; h++) {
      x[h] = h % 3 ? 1.0f : -1.0f;
      w[h] = 1.0f + (h % 2 ? 0x1p-8f : 0x3p-8f) - (float)off; /* exact */
      want[h] = (uint16_t)((h % 3 ? 0 : 0x8000) | (h % 2 ? 0x3f80 : 0x3f82));
    }
    ok(kc_rmsnorm_fwd_bf16(nullptr, x, w, false, (float)off, 0.0f, y16, rstd, 1, H),
       "rmsnorm fwd bf16 (ties)");
    same(fmt("rmsnorm bf16 ties to even, off=%d", off), y16, want, sizeof want);
  }
}

/* ---- RoPE from the CPU's tables, forward and backward: rope_bounds
 * (tests/cuda/op_bounds.h); the bf16-output forward and backward bitwise the
 * fp32 ones rounded (kc_f32_to_bf16 is ml_f32_to_bf16 bit for bit), their
 * input untouched, the backward's y aligned and not, with ties to even at
 * position 0 (cos 1, sin 0: the rotation is exact) ---------------------------- */
static void test_rope() {
  printf("rope\n");
  const int64_t dims[][4] = {{1, 1, 3, 64},  {2, 37, 3, 72}, {3, 5, 2, 6},
                             {1, 3, 1, 256}, {1, 9, 5, 10},  {1, 65537, 1, 2}};  // B S nh hd
  for (auto &d : dims) {
    Pool pl;
    int64_t B = d[0], S = d[1], nh = d[2], hd = d[3], half = hd / 2, n = B * S * nh * hd;
    std::vector<float> inv(half);
    double att = k_rope_inv_freq(10000.0, hd, nullptr, S, inv.data());
    float *ct = pl.get<float>(S * half), *st = pl.get<float>(S * half);
    k_rope_tables(inv.data(), (float)att, hd, S, ct, st);
    float *x = rand_f(pl, n, 2.0f);
    for (int64_t i = 0; i < hd; i += 3) x[i] = 1.0f + (i % 2 ? 0x1p-8f : 0x3p-8f); /* ties */
    float *xf = pl.copy(x, n), *xb = pl.copy(x, n), *rf = pl.copy(x, n), *rb = pl.copy(x, n);
    float *xc = pl.copy(x, n);
    uint16_t *y16 = pl.get<uint16_t>(n), *y16o = pl.get<uint16_t>(n, 1), *r16 = pl.get<uint16_t>(n);
    ok(kc_rope_bwd_bf16(nullptr, xc, y16, ct, st, B, S, nh, hd), "rope bwd bf16");
    bool small = B * S < 1024; /* the misaligned stores once per shape but the 65537-row one */
    if (small)
      ok(kc_rope_bwd_bf16(nullptr, xc, y16o, ct, st, B, S, nh, hd), "rope bwd bf16 (y misaligned)");
    ok(kc_rope_fwd(nullptr, xf, ct, st, B, S, nh, hd), "rope fwd");
    ok(kc_rope_bwd(nullptr, xb, ct, st, B, S, nh, hd), "rope bwd");
    k_rope_fwd(rf, ct, st, B, S, nh, hd);
    k_rope_bwd(rb, ct, st, B, S, nh, hd);
    std::vector<double> bound(n);
    rope_bounds(x, ct, st, B, S, nh, hd, bound.data());
    std::string what = fmt("rope B=%lld S=%lld nh=%lld hd=%lld", (long long)B, (long long)S,
                           (long long)nh, (long long)hd);
    close(what + " fwd", xf, rf, bound, n);
    close("  bwd", xb, rb, bound, n);
    /* the bf16 output (ml_be_rope_fwd_bf16): bitwise the fp32 forward's rounding, x read only */
    float *xh = pl.copy(x, n);
    uint16_t *yh = pl.get<uint16_t>(n), *yr = pl.get<uint16_t>(n);
    ok(kc_rope_fwd_bf16(nullptr, xh, yh, ct, st, B, S, nh, hd), "rope fwd bf16");
    for (int64_t i = 0; i < n; i++) yr[i] = ml_f32_to_bf16(xf[i]);
    same("  fwd bf16 = fwd rounded", yh, yr, 2 * n);
    same("  fwd bf16 leaves x", xh, x, 4 * n);
    for (int64_t i = 0; i < n; i++) r16[i] = ml_f32_to_bf16(xb[i]);
    same("  bwd bf16 vs bwd rounded", y16, r16, 2 * n);
    if (small) same("  bwd bf16 (y misaligned) vs bwd rounded", y16o, r16, 2 * n);
    same("  bwd bf16's input untouched", xc, x, 4 * n);
  }
}

/* ---- embedding: forward bitwise (scale·W[id - row0], one product, or 0);
 * backward (+=) against the CPU (whose build may contract to FMA) within
 * emb_bwd_sums, emb_bwd_bound (tests/cuda/op_bounds.h), and bitwise the fp32
 * sum in token order kernels.h promises ---------------------------------------- */
static void test_embedding() {
  printf("embedding\n");
  // T, rows, H: repeats in one sort tile, several tiles, rows above 2^16 (3
  // radix passes), a row wider than one block's 1024 columns, T > 65,535
  const int64_t shapes[][3] = {{300, 50, 7}, {3000, 70000, 5}, {40, 20, 1030}, {65537, 3, 1}};
  const float scale = 2.5f;
  for (auto &s : shapes)
    for (int wb = 0; wb < 2; wb++) {
      int64_t T = s[0], rows = s[1], H = s[2], row0 = 20;
      if (T > 65535 && wb) continue;
      Pool pl;
      int32_t *ids = pl.get<int32_t>(T);
      std::uniform_int_distribution<int64_t> U(0, 99), R(0, rows - 1);
      for (int64_t t = 0; t < T; t++) {
        int64_t r = U(rng);
        ids[t] = r < 5    ? -1
                 : r < 8  ? INT32_MIN + (int32_t)U(rng)
                 : r < 10 ? INT32_MAX - (int32_t)U(rng)
                 : r < 18 ? (int32_t)(U(rng) % row0)
                 : r < 25 ? (int32_t)(row0 + rows + U(rng))
                 : r < 60 ? (int32_t)(row0 + rows - 1 - U(rng) % 3)  // few rows, many repeats
                          : (int32_t)(row0 + R(rng));
      }
      float *W = rand_f(pl, rows * H, 1.0f, 1);
      uint16_t *Wh = pl.get<uint16_t>(rows * H, 1);
      for (int64_t i = 0; i < rows * H; i++) Wh[i] = ml_f32_to_bf16(W[i]);
      const void *Wk = wb ? (const void *)Wh : (const void *)W;
      float *out = pl.get<float>(T * H, 1), *ref = pl.get<float>(T * H);
      ok(kc_embedding_fwd(nullptr, ids, T, Wk, wb, row0, rows, H, scale, out), "embedding fwd");
      k_embedding_fwd(ids, T, Wk, wb, row0, rows, H, scale, ref);
      std::string what = fmt("embedding T=%lld rows=%lld H=%lld %s", (long long)T, (long long)rows,
                             (long long)H, wb ? "bf16" : "f32");
      same(what + " fwd", out, ref, 4 * T * H);
      float *dout = rand_f(pl, T * H, 1.0f), *dW = rand_f(pl, rows * H, 1.0f, 1);
      float *dWr = pl.copy(dW, rows * H);
      std::vector<double> bound(rows * H);
      std::vector<int64_t> cnt(rows);
      for (int64_t i = 0; i < rows * H; i++) bound[i] = fabs(dW[i]);
      emb_bwd_sums(ids, T, dout, row0, rows, H, scale, bound.data(), cnt.data());
      for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < H; h++) bound[r * H + h] = emb_bwd_bound(cnt[r], bound[r * H + h]);
      void *work = pl.get<char>((int64_t)kc_embedding_bwd_work(T));
      // kernels.h: each row's tokens added one at a time in token order, in
      // fp32: exactly this sequence (no contraction here or in the kernel)
      float *dWs = pl.copy(dW, rows * H);
      for (int64_t t = 0; t < T; t++)
        if (ids[t] >= row0 && ids[t] < row0 + rows)
          for (int64_t h = 0; h < H; h++) dWs[(ids[t] - row0) * H + h] += scale * dout[t * H + h];
      ok(kc_embedding_bwd(nullptr, ids, T, dout, row0, rows, H, scale, dW, work), "embedding bwd");
      k_embedding_bwd(ids, T, dout, row0, rows, H, scale, dWr);
      close("  bwd (+=, repeated and out-of-range ids)", dW, dWr, bound, rows * H);
      same("  bwd in token order (the sort is stable)", dW, dWs, 4 * rows * H);
    }
}

/* ---- cross-entropy pieces on a shard [v0, v0 + V): targets inside, outside
 * on both sides, -1: rowmax and the target logit bitwise, the rest within
 * xent_se_bounds, xent_logprob_bounds, xent_bwd_bounds
 * (tests/cuda/op_bounds.h) --------------------------------------------------- */
static void test_xent() {
  printf("cross-entropy\n");
  const int64_t shapes[][2] = {{7, 5}, {7, 1001}, {3, 70001}, {70000, 3}};  // T, V
  const int64_t v0 = 100;
  for (auto &s : shapes) {
    Pool pl;
    int64_t T = s[0], V = s[1], n = T * V;
    bool wide = T > 65535;  // rows beyond grid.y: the backward only (rowmax and sumexp
                            // run 1024-thread blocks, too slow to emulate 65,535 of)
    int32_t *y = pl.get<int32_t>(T, 1);
    const int32_t ys[7] = {
        (int32_t)v0,           (int32_t)(v0 + V - 1), -1, (int32_t)(v0 + V / 2), 3,
        (int32_t)(v0 + V + 7), (int32_t)(v0 + 1)};
    for (int64_t t = 0; t < T; t++) y[t] = ys[t % 7];
    float *lg = rand_f(pl, n, 6.0f, 1);
    float *mx = pl.get<float>(T, 1), *se = pl.get<float>(T), *tl = pl.get<float>(T, 1);
    float *mxr = pl.get<float>(T), *ser = pl.get<float>(T), *tlr = pl.get<float>(T);
    k_xent_rowmax(lg, T, V, mxr);
    k_xent_sumexp_target(lg, T, V, v0, y, mxr, ser, tlr);
    std::string what = fmt("xent T=%lld V=%lld", (long long)T, (long long)V);
    if (!wide) {
      ok(kc_xent_rowmax(nullptr, lg, T, V, mx), "xent rowmax");
      same(what + " rowmax", mx, mxr, 4 * T);
      ok(kc_xent_sumexp_target(nullptr, lg, T, V, v0, y, mxr, se, tl), "xent sumexp");
      std::vector<double> bse(T);
      xent_se_bounds(lg, T, V, mxr, bse.data());
      close("  sum of exponentials", se, ser, bse, T);
      same("  target logit", tl, tlr, 4 * T);
      float *lp = pl.get<float>(T), *w = pl.get<float>(T, 1), *lpr = pl.get<float>(T);
      float *wr = pl.get<float>(T);
      double *sums = pl.get<double>(2), lr[2] = {0, 0};  // [−Σ log-probs, targets], accumulated
      sums[0] = sums[1] = 0;
      void *work = pl.get<char>((int64_t)kc_xent_logprobs_work(T));
      ok(kc_xent_logprobs(nullptr, ser, tlr, y, T, 0.5f, lp, w, sums, work), "logprobs");
      k_xent_logprobs(ser, tlr, y, T, 0.5f, lpr, wr, lr);
      std::vector<double> blp(T);
      double lb = xent_logprob_bounds(ser, tlr, y, T, 0.0, blp.data());
      close("  log-probs", lp, lpr, blp, T);
      same("  weights", w, wr, 4 * T);
      printf("  %-52s |diff| %.3g, bound %.3g; count %.0f, %.0f\n", "loss sum",
             fabs(sums[0] - lr[0]), lb, sums[1], lr[1]);
      if (!(fabs(sums[0] - lr[0]) <= lb) || sums[1] != lr[1]) failures++;
      double s2[2];
      sums[0] = sums[1] = 0;
      ok(kc_xent_logprobs(nullptr, ser, tlr, y, T, 0.5f, nullptr, w, sums, work), "logprobs");
      s2[0] = sums[0], s2[1] = sums[1];
      sums[0] = sums[1] = 0;
      ok(kc_xent_logprobs(nullptr, ser, tlr, y, T, 0.5f, lp, w, sums, work), "logprobs");
      bool eq = s2[0] == sums[0] && s2[1] == sums[1];
      printf("  %-52s %s\n", "log-probs NULL: the same sums", eq ? "bitwise equal" : "DIFFERENT");
      if (!eq) failures++;
      // The online log-sum-exp over one tile covering the shard (kernels.h): its
      // mx is the row max and its raw target logit a copy (bitwise); rebased
      // onto the same max its se is sumexp's, so within the se bound above
      // (the same fp64 sum of the same terms in another order) and tl − mx
      // one subtraction (bitwise). Rebased onto a larger M (odd rows, M = mx
      // + 0.5) from the same se on both sides: one fp64 exp (both within an
      // ulp of double) and product, rounded once to fp32: 2(u + gamma64_4)·se.
      float *omx = pl.get<float>(T), *ose = pl.get<float>(T, 1), *otl = pl.get<float>(T);
      float *rmx = pl.get<float>(T), *rse = pl.get<float>(T), *rtl = pl.get<float>(T);
      memset(ose, 0, 4 * T), memset(otl, 0, 4 * T), memset(rse, 0, 4 * T), memset(rtl, 0, 4 * T);
      ok(kc_xent_online(nullptr, lg, T, V, v0, y, omx, ose, otl), "xent online");
      k_xent_online(lg, T, V, v0, y, rmx, rse, rtl);
      same("  online: running max = rowmax", omx, mxr, 4 * T);
      same("  online: raw target logit", otl, rtl, 4 * T);
      ok(kc_xent_rebase(nullptr, T, V, v0, y, omx, mxr, ose, otl), "xent rebase");
      close("  online + rebase onto the row max: se", ose, ser, bse, T);
      same("  online + rebase onto the row max: tl", otl, tlr, 4 * T);
      float *M = pl.copy(mxr, T), *gse = pl.copy(rse, T), *gtl = pl.copy(rtl, T);
      for (int64_t t = 1; t < T; t += 2) M[t] += 0.5f;
      ok(kc_xent_rebase(nullptr, T, V, v0, y, rmx, M, gse, gtl), "xent rebase");
      k_xent_rebase(T, V, v0, y, rmx, M, rse, rtl);
      std::vector<double> bre(T);
      for (int64_t t = 0; t < T; t++) bre[t] = 2.0 * (TOL_U + tol_gamma64(4.0)) * fabs(rse[t]);
      close("  rebase onto a larger max: se", gse, rse, bre, T);
      same("  rebase onto a larger max: tl", gtl, rtl, 4 * T);
    }
    float *w = pl.get<float>(T);
    for (int64_t t = 0; t < T; t++) w[t] = y[t] >= 0 ? 0.5f : 0.0f;
    float *dl = pl.get<float>(n), *dlr = pl.get<float>(n);
    ok(kc_xent_bwd(nullptr, lg, T, V, v0, y, mxr, ser, w, dl), "xent bwd");
    k_xent_bwd(lg, T, V, v0, y, mxr, ser, w, dlr);
    std::vector<double> bd(n);
    xent_bwd_bounds(lg, T, V, v0, y, mxr, ser, w, bd.data());
    close(wide ? what + " bwd" : "  bwd", dl, dlr, bd, n);
    ok(kc_xent_bwd(nullptr, lg, T, V, v0, y, mxr, ser, w, lg), "xent bwd in place");
    same("  bwd in place (dlogits aliasing logits)", lg, dl, 4 * n);
  }
  // NaNs skipped by the row max (kernels.h, xent.c): one among numbers, a row
  // of NaN (-inf), NaN beside -inf
  Pool pl;
  const int64_t T = 3, V = 9;
  float *lg = rand_f(pl, T * V, 4.0f, 1), *mx = pl.get<float>(T), *mxr = pl.get<float>(T);
  lg[4] = NAN;
  for (int64_t j = 0; j < V; j++) lg[V + j] = NAN;
  for (int64_t j = 0; j < V; j++) lg[2 * V + j] = j % 2 ? NAN : -INFINITY;
  ok(kc_xent_rowmax(nullptr, lg, T, V, mx), "xent rowmax");
  k_xent_rowmax(lg, T, V, mxr);
  same("xent rowmax with NaNs", mx, mxr, 4 * T);
}

/* ---- the entropy and top-k pieces (kernels/cpu/xent_entropy.c,
 * xent_topk.c): sl about a given max and online over two tiles (the same
 * fp64 terms in another order, each side rounded once: within 2(u +
 * gamma64(V))·|sl|, the terms all of one sign), the rebase and the entropy
 * (the same fp64 expression rounded once: 2(u + gamma64(6)) relative); the
 * top-k lists (exact selection: bitwise), their merge and log-probs (the
 * same operations: bitwise); the entropy bonus's backward (the same fp32
 * operations but for the contractions a CPU build may make of w·p + ew·q
 * and the bracket: 2u(|w·p| + |ew·p·(z − c)|) + u|d| apart, p and z − c
 * each side's own). Rows NaN-free but for one top-k NaN. ------------------ */
static void test_xent_scores() {
  printf("entropy and top-k\n");
  const int64_t shapes[][2] = {{7, 5}, {7, 1001}, {3, 5003}};  // T, V
  const int64_t k = 6;
  for (auto &sh : shapes) {
    Pool pl;
    int64_t T = sh[0], V = sh[1], h = V / 2;  // tiles [0, h) and [h, V)
    float *lg = rand_f(pl, T * V, 6.0f, 1);
    lg[V - 1] = -INFINITY;
    std::string what = fmt("T=%lld V=%lld", (long long)T, (long long)V);
    // whole rows about the row max
    float *mx = pl.get<float>(T), *sl = pl.get<float>(T, 1), *slr = pl.get<float>(T);
    k_xent_rowmax(lg, T, V, mx);
    ok(kc_xent_entropy_sum(nullptr, lg, T, V, mx, sl), "entropy sum");
    k_xent_entropy_sum(lg, T, V, mx, slr);
    std::vector<double> b(T);
    for (int64_t t = 0; t < T; t++) b[t] = 2.0 * (TOL_U + tol_gamma64((double)V)) * fabs(slr[t]);
    close(what + " entropy sum", sl, slr, b, T);
    // online over two tiles (the tiles copied out, as loss.c's buffers)
    float *t0 = pl.get<float>(T * h), *t1 = pl.get<float>(T * (V - h), 1);
    for (int64_t t = 0; t < T; t++) {
      memcpy(t0 + t * h, lg + t * V, sizeof(float) * h);
      memcpy(t1 + t * (V - h), lg + t * V + h, sizeof(float) * (V - h));
    }
    float *rmx = pl.get<float>(T), *rse = pl.get<float>(T), *rtl = pl.get<float>(T);
    float *osl = pl.get<float>(T), *rsl = pl.get<float>(T);
    int32_t *y = pl.get<int32_t>(T);
    for (int64_t t = 0; t < T; t++) y[t] = -1, rse[t] = 0, rtl[t] = 0, osl[t] = 0, rsl[t] = 0;
    const float *tiles[2] = {t0, t1};
    int64_t w[2] = {h, V - h}, v0[2] = {0, h};
    for (int i = 0; i < 2; i++) {
      if (w[i] == 0) continue;
      ok(kc_xent_entropy_online(nullptr, tiles[i], T, w[i], rmx, rse, osl), "entropy online");
      k_xent_entropy_online(tiles[i], T, w[i], rmx, rse, rsl);
      // the next tile from the same running statistics on both sides
      float *gsl = pl.copy(rsl, T);
      for (int64_t t = 0; t < T; t++) b[t] = 2.0 * (TOL_U + tol_gamma64((double)V)) * fabs(rsl[t]);
      close(what + fmt(" entropy online, tile %d", i), osl, gsl, b, T);
      memcpy(osl, rsl, sizeof(float) * T);
      k_xent_online(tiles[i], T, w[i], v0[i], y, rmx, rse, rtl);
    }
    // rebase onto a larger max (odd rows), and the entropy
    float *M = pl.copy(rmx, T), *gsl = pl.copy(rsl, T);
    for (int64_t t = 1; t < T; t += 2) M[t] += 0.5f;
    ok(kc_xent_entropy_rebase(nullptr, T, rmx, M, rse, gsl), "entropy rebase");
    k_xent_entropy_rebase(T, rmx, M, rse, rsl);
    for (int64_t t = 0; t < T; t++) b[t] = 2.0 * (TOL_U + tol_gamma64(6.0)) * fabs(rsl[t]);
    close(what + " entropy rebase", gsl, rsl, b, T);
    float *H = pl.get<float>(T, 1), *Hr = pl.get<float>(T);
    ok(kc_xent_entropy(nullptr, rse, rsl, T, H), "entropy");
    k_xent_entropy(rse, rsl, T, Hr);
    for (int64_t t = 0; t < T; t++) b[t] = 2.0 * (TOL_U + tol_gamma64(6.0)) * fabs(Hr[t]);
    close(what + " entropy", H, Hr, b, T);
    // top-k: a NaN skipped, ties (row 0: three equal maxima)
    lg[3] = NAN;
    if (V > 10) lg[1] = lg[7] = lg[9] = 40.0f;
    for (int64_t t = 0; t < T; t++) memcpy(t0 + t * h, lg + t * V, sizeof(float) * h);
    float *val = pl.get<float>(T * k), *valr = pl.get<float>(T * k, 1);
    int32_t *id = pl.get<int32_t>(T * k, 1), *idr = pl.get<int32_t>(T * k);
    ok(kc_xent_topk_clear(nullptr, T, k, val, id), "top-k clear");
    k_xent_topk_clear(T, k, valr, idr);
    for (int i = 0; i < 2; i++) {
      ok(kc_xent_topk_online(nullptr, tiles[i], T, w[i], v0[i], k, val, id), "top-k online");
      k_xent_topk_online(tiles[i], T, w[i], v0[i], k, valr, idr);
    }
    same(what + " top-k logits", val, valr, 4 * T * k);
    same(what + " top-k ids", id, idr, 4 * T * k);
    // merge of P = 2 lists (the same lists twice and the tiles' apart)
    float *cv = pl.get<float>(2 * T * k), *mv = pl.get<float>(T * k), *mvr = pl.get<float>(T * k);
    int32_t *ci = pl.get<int32_t>(2 * T * k), *mi = pl.get<int32_t>(T * k, 1);
    int32_t *mir = pl.get<int32_t>(T * k);
    memcpy(cv, valr, 4 * T * k), memcpy(cv + T * k, valr, 4 * T * k);
    memcpy(ci, idr, 4 * T * k), memcpy(ci + T * k, idr, 4 * T * k);
    for (int64_t i = 0; i < T * k; i += 3) ci[T * k + i] = -1;  // some entries empty
    ok(kc_xent_topk_merge(nullptr, 2, T, k, cv, ci, mv, mi), "top-k merge");
    k_xent_topk_merge(2, T, k, cv, ci, mvr, mir);
    same(what + " top-k merge logits", mv, mvr, 4 * T * k);
    same(what + " top-k merge ids", mi, mir, 4 * T * k);
    float *lp = pl.get<float>(T * k), *lpr = pl.get<float>(T * k);
    ok(kc_xent_topk_logprobs(nullptr, T, k, rmx, rse, valr, idr, lp), "top-k log-probs");
    k_xent_topk_logprobs(T, k, rmx, rse, valr, idr, lpr);
    same(what + " top-k log-probs", lp, lpr, 4 * T * k);
    ok(kc_xent_topk_logprobs(nullptr, T, k, rmx, rse, valr, idr, valr), "top-k in place");
    same(what + " top-k log-probs in place", valr, lpr, 4 * T * k);
    // the entropy bonus's backward on the whole rows (targets in and out of range, ignored)
    lg[3] = 0.5f;
    float *se = pl.get<float>(T), *tl = pl.get<float>(T), *w2 = pl.get<float>(T);
    float *ew = pl.get<float>(T, 1);
    for (int64_t t = 0; t < T; t++) {
      y[t] = t % 3 == 2 ? -1 : (int32_t)((t * 7) % (V + 2));
      w2[t] = y[t] >= 0 ? 0.5f : 0.0f;
      ew[t] = 0.1f * (float)(t % 4) - 0.15f;
    }
    k_xent_rowmax(lg, T, V, mx);
    k_xent_sumexp_target(lg, T, V, 0, y, mx, se, tl);
    k_xent_entropy_sum(lg, T, V, mx, slr);
    k_xent_entropy(se, slr, T, Hr);
    float *dl = pl.get<float>(T * V), *dlr = pl.get<float>(T * V);
    ok(kc_xent_bwd_entropy(nullptr, lg, T, V, 0, y, mx, se, w2, Hr, ew, dl), "bwd entropy");
    k_xent_bwd_entropy(lg, T, V, 0, y, mx, se, w2, Hr, ew, dlr);
    std::vector<double> bd(T * V);
    for (int64_t t = 0; t < T; t++) {
      double c = log((double)se[t]) - Hr[t];
      for (int64_t j = 0; j < V; j++) {
        double z = (double)lg[t * V + j] - mx[t], p = exp(z) / se[t];
        double q = p != 0.0 ? p * (z - c) : 0.0; /* the −inf logit: no term */
        bd[t * V + j] = 2.0 * TOL_U * (fabs(w2[t] * p) + fabs(ew[t] * q)) +
                        TOL_U * fabs(dlr[t * V + j]);
      }
    }
    close(what + " entropy bonus backward", dl, dlr, bd, T * V);
    ok(kc_xent_bwd_entropy(nullptr, lg, T, V, 0, y, mx, se, w2, Hr, ew, lg), "bwd in place");
    same(what + " entropy bonus backward in place", lg, dl, 4 * T * V);
  }
}

/* ---- AdamW: four steps from the same state (some |g| near eps): both within
 * tol_adamw_step's bounds (tolerance.h §5) of the exact trajectory, so within
 * twice them of each other after every step -------------------------------- */
static void test_adamw() {
  printf("adamw\n");
  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1;
  for (int64_t n : {1, 5, 4099})
    for (int off = 0; off < 2; off++) {
      Pool pl;
      float *p = rand_f(pl, n, 1.0f, off), *m = pl.get<float>(n, 1 - off), *v = pl.get<float>(n);
      memset(m, 0, 4 * n), memset(v, 0, 4 * n);
      float *pr = pl.copy(p, n), *mr = pl.copy(m, n), *vr = pl.copy(v, n);
      std::vector<tol_adamw> ex(n);
      for (int64_t i = 0; i < n; i++) ex[i] = {p[i], 0, 0, 0, 0, 0};
      std::vector<double> bp(n), bm(n), bv(n);
      for (int64_t step = 1; step <= 4; step++) {
        float *g = rand_f(pl, n, 1e-2f, off);
        for (int64_t i = 0; i < n; i += 7) g[i] *= 1e-6f;
        // even steps clip: the gradient scaled (one rounded product, written
        // back, bitwise on both sides) before the update
        float gs = step % 2 ? 1.0f : 0.5f;
        float *gr = pl.copy(g, n);
        // odd steps also write the bf16 copy (p_bf16): bit for bit the rounding of the kernel's
        // own updated p (ml_f32_to_bf16, the CPU's conversion)
        uint16_t *lp = step % 2 ? pl.get<uint16_t>(n, off) : nullptr;
        ok(kc_adamw(nullptr, p, g, m, v, lp, n, gs, lr, b1, b2, eps, wd, step), "adamw");
        k_adamw_step(pr, gr, mr, vr, nullptr, n, gs, lr, b1, b2, eps, wd, step);
        same(fmt("adamw n=%lld off=%d step %lld: the scaled gradient", (long long)n, off,
                 (long long)step),
             g, gr, 4 * n);
        if (lp) {
          std::vector<uint16_t> want(n);
          for (int64_t i = 0; i < n; i++) want[i] = ml_f32_to_bf16(p[i]);
          same(fmt("adamw n=%lld off=%d step %lld: p_bf16", (long long)n, off, (long long)step),
               lp, want.data(), 2 * n);
        }
        for (int64_t i = 0; i < n; i++) {
          ex[i] = tol_adamw_step(ex[i], g[i], lr, b1, b2, eps, wd, (double)step);
          bp[i] = 2.0 * ex[i].bp, bm[i] = 2.0 * ex[i].bm, bv[i] = 2.0 * ex[i].bv;
        }
        close(fmt("adamw n=%lld off=%d step %lld p", (long long)n, off, (long long)step), p, pr, bp,
              n);
        close("  exp_avg", m, mr, bm, n);
        close("  exp_avg_sq", v, vr, bv, n);
      }
    }
}

/* ---- launch errors: a refused launch names its kernel (kernels.h) --------- */
static void test_launch_error() {
  printf("launch errors\n");
  // kc_rope's check refuses nheads·quads > INT32_MAX before any launch: no name
  cudaError_t e = kc_rope_fwd(nullptr, nullptr, nullptr, nullptr, 1, 1, (int64_t)1 << 31, 8);
  const char *name = kc_failed_kernel();
  printf("  %-52s %s, %s\n", "rope with 2^31 heads", e == cudaErrorInvalidValue ? "refused" : "ran",
         name ? name : "no kernel named");
  if (e != cudaErrorInvalidValue || name) failures++;
}

/* ---- the emulator's launch limits (sm_90), on a kernel of this file: each
 * launch the device refuses is refused, the largest it takes runs ---------- */
static int probe_runs;
static void probe(int) {
  if (emu_kernel_entry(false, 64)) return;  // as __launch_bounds__(64)
  probe_runs++;
}
static void test_emulator() {
  printf("emulator launch limits\n");
  struct {
    const char *what;
    dim3 grid, block;
    size_t smem;
    int attr;  // MaxDynamicSharedMemorySize set first (0: none)
    bool runs;
  } cases[] = {
      {"grid (1, 65535, 2), block 64", dim3(1, 65535, 2), dim3(64), 0, 0, true},
      {"grid.y 65536", dim3(1, 65536), dim3(32), 0, 0, false},
      {"grid.z 65536", dim3(1, 1, 65536), dim3(32), 0, 0, false},
      {"grid.x 2^31", dim3(2147483648u), dim3(32), 0, 0, false},
      {"block 65 > __launch_bounds__(64)", dim3(1), dim3(65), 0, 0, false},
      {"shared 48 KiB", dim3(1), dim3(32), 49152, 0, true},
      {"shared 48 KiB + 1 without the attribute", dim3(1), dim3(32), 49153, 0, false},
      {"shared 227 KiB with the attribute", dim3(1), dim3(32), 232448, 232448, true},
      {"shared above the attribute", dim3(1), dim3(32), 100001, 100000, false},
  };
  for (auto &c : cases) {
    probe_runs = 0;
    if (c.attr)
      ok(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, c.attr),
         "cudaFuncSetAttribute");
    emu_launch(probe, c.grid, c.block, c.smem, nullptr, 0);
    cudaError_t e = cudaGetLastError();
    uint64_t threads = (uint64_t)c.grid.x * c.grid.y * c.grid.z * c.block.x;
    bool ran = e == cudaSuccess && (uint64_t)probe_runs == threads;
    printf("  %-52s %s\n", c.what, ran ? "runs" : "refused");
    if (ran != c.runs || (!ran && e != cudaErrorInvalidConfiguration)) failures++;
  }
  cudaError_t e = cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 232449);
  printf("  %-52s %s\n", "the attribute above 227 KiB", e == cudaSuccess ? "taken" : "refused");
  if (e != cudaErrorInvalidValue) failures++;
}

int main(int argc, char **argv) {
  emu_order = 2;  // threads and blocks shuffled: a race or a missing barrier changes results
  struct {
    const char *name;
    void (*fn)();
  } tests[] = {{"convert", test_convert},
               {"scatter_rows", test_scatter_rows},
               {"add_scale", test_add_scale},
               {"glu", test_glu},
               {"glu_bf16", test_glu_bf16},
               {"bias_rows", test_bias_rows},
               {"bias_grad", test_bias_grad},
               {"reduce", test_reduce},
               {"norm_segs", test_norm_segs},
               {"rmsnorm", test_rmsnorm},
               {"rope", test_rope},
               {"embedding", test_embedding},
               {"xent", test_xent},
               {"xent_scores", test_xent_scores},
               {"adamw", test_adamw},
               {"launch_error", test_launch_error},
               {"emulator", test_emulator}};
  for (auto &t : tests)
    if (argc < 2 || !strcmp(argv[1], t.name)) t.fn();
  printf("%d failed checks; %zu blocks, %ld fiber switches\n", failures, emu_blocks_run,
         emu_switches);
  return failures != 0;
}
