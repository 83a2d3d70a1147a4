/* Every numerical tolerance of the test suite, each with its derivation.
 *
 * A test compares two computations of one mathematical quantity. A bound
 * here is the most the two can differ by rounding alone on any x86-64 CPU,
 * under any OpenBLAS kernel (OPENBLAS_CORETYPE), so a test exceeding it has
 * found a defect. No bound is a measured value with a margin: each follows
 * from the facts R1-R5 (and, for whole models, the model M1-M2) below, and
 * the tests print measured/bound so the remaining room is visible.
 *
 * u = 2^-24 is fp32's unit roundoff (round to nearest), u64 = 2^-53,
 * u_bf16 = 2^-8 (8 significant bits); gamma_k = k·u / (1 - k·u).
 *
 * R1  + - * /, sqrt and conversions are correctly rounded:
 *     fl(a op b) = (a op b)(1 + d), |d| <= u; an FMA rounds a·b + c once.
 * R2  A sum of n terms computed in ANY order (sequential, blocked, SIMD
 *     lanes, per-rank partial sums reduced by MPI, with or without FMA):
 *     |fl(sum t) - sum t| <= gamma_{n-1} sum |t|; a dot product of length
 *     n: <= gamma_n sum |x_i y_i| (Higham, Accuracy and Stability of
 *     Numerical Algorithms, 2nd ed., §3.1, (3.4)-(3.5)). OpenBLAS's sgemm
 *     computes every output as such a dot product in fp32 arithmetic on
 *     every x86-64 target, so a kernel (Haswell, SkylakeX, ...) chooses only
 *     the order, and the bound holds for all of them; alpha != 1 and
 *     beta = 1 (accumulate into C) add one term or one rounding each,
 *     wherever they are applied (the CPU's bf16 attention tiles scale and
 *     add after oneDNN's product, backend/cpu/gemm.c: the same two
 *     roundings, or one FMA, so every attention bound below stands).
 * R3  |.|-evaluation: an expression built from +, -, * and division by
 *     quantities with known relative error satisfies |fl(f) - f| <=
 *     gamma_k · f_abs, where f_abs evaluates f with each operand replaced
 *     by its absolute value and each - by +, and k counts the roundings on
 *     the longest path, the counts of both operands adding at a product or
 *     quotient (Higham Lemma 3.3: (1+t_j)(1+t_k) = 1+t_{j+k}, and
 *     gamma_j + gamma_k <= gamma_{j+k}).
 * R4  glibc's single-precision expf, logf, powf, sinf, cosf are within
 *     1 ulp and tanhf within 2 ulp on x86-64 (sysdeps/x86_64/fpu/
 *     libm-test-ulps; the double versions likewise <= 2 ulp); 1 ulp <= 2u
 *     relative, so each call counts as TOL_LIBM = 4 roundings. A function f
 *     of an input with absolute error e adds |f'|·e (first order).
 * R5  A double-precision reference has its own error, bounded by the same
 *     rules with u64; every bound against one adds that term.
 */
#ifndef ML_TOLERANCE_H
#define ML_TOLERANCE_H

#include <math.h>

#define TOL_U 0x1p-24
#define TOL_U64 0x1p-53
#define TOL_U_BF16 0x1p-8
#define TOL_LIBM 4.0 /* R4: one libm call, in roundings */

/* gamma_k for fp32 and for double (R2). */
static inline double tol_gamma(double k) { return k * TOL_U / (1.0 - k * TOL_U); }
static inline double tol_gamma64(double k) { return k * TOL_U64 / (1.0 - k * TOL_U64); }

/* An fp32 result with k roundings against a double reference with k64
 * (R3 + R5): the bound is this factor times the |.|-evaluation. */
static inline double tol_vs_double(double k, double k64) { return tol_gamma(k) + tol_gamma64(k64); }

/* Bounds composed from first-order terms (sums of relative errors, R4's
 * |f'|·e) are made strict by this factor: the neglected products of those
 * relative errors, each below 1e-3 wherever it is used, add less than
 * 0.1 % of the first-order bound. */
#define TOL_FIRST_ORDER 1.001

/* ===================================================================== */
/* 1. CPU kernels against double references (tests/unit/test_kernels.c).  */
/*    Each check is per element: |got - ref| <= tol_vs_double(k, k64) ·  */
/*    the element's |.|-evaluation, which the reference computes beside  */
/*    the value. The counts k follow the kernel's code (src/kernels/cpu). */
/* ===================================================================== */

/* linear: sgemm dot products of length n (R2); +1 for the bias or for
 * accumulating into the output (beta = 1). dW accumulated twice: one sum
 * of 2n + 1 terms with an intermediate rounding, 2n + 2. db: column sums
 * in double (k64 = n), converted to fp32 (1) and added to db (1). */
#define TOL_K_LINEAR_DB 2.0
/* rmsnorm (double sum of squares): rstd = 1/sqrtf((float)(ss/H) + eps):
 * conversion 1, + eps 1 (both >= 0), sqrtf 1 and halves the 2 before it,
 * reciprocal 1: relative error <= gamma_3. y = (x·rstd)·(w_offset + w):
 * x·rstd 1 + 3, w_offset + w 1 (against |w_offset| + |w|), product 1: 6. */
#define TOL_K_RMS_RSTD 3.0
#define TOL_K_RMS_FWD 6.0
/* rmsnorm dw += sum_t dy·x·rstd (double): rstd 3, conversion 1, add 1. */
#define TOL_K_RMS_DW 5.0
/* rmsnorm dx = rstd·we·dy - x·c, c = (float)(dot·rstd³/H), dot = sum dy·we·x
 * in double with we = w_offset + w in fp32 (1): the c path has we 1, three
 * rstd factors 9, conversion 1, x·c 1, the difference 1: 13 (the rstd·we·dy
 * path has 3 + 1 + 1 + 1 = 6). */
#define TOL_K_RMS_DX 13.0
/* rope rotation a·c - b·s: a 2-term dot product (R2). */
#define TOL_K_ROPE 2.0
/* rope tables: cosf/sinf of the same fp32 angle the reference uses, values
 * in [-1, 1] where one ulp <= 2^-23 = 2u: absolute error <= 2 ulp (R4 with
 * its margin) = 4u, plus the double cos/sin (2 ulp of 1 = 4·u64). */
#define TOL_ROPE_TABLE_ABS (4.0 * TOL_U + 4.0 * TOL_U64)
/* inv_freq = 1/powf(theta, (float)(2i)/hd): the exponent e = 2i/hd < 1 is
 * rounded once (relative u), which powf turns into a relative error of
 * e·ln(theta)·u (d theta^e / de = ln(theta)·theta^e); powf 4; 1/x 1;
 * the linear scaling divides by a power of two (exact). */
static inline double tol_inv_freq_rel(double theta) {
  return tol_gamma(log(theta) + TOL_LIBM + 1.0) + tol_gamma64(log(theta) + TOL_LIBM + 1.0);
}
/* llama3 rescale of f: wavelen = (float)2π/f (2 + f's), smooth =
 * (old/wavelen - lo)/(hi - lo) (old/wavelen 1, - lo 1 against old/wavelen +
 * lo <= hi + lo inside the band, the divisor's conversion 1), result =
 * (1 - smooth)·f/factor + smooth·f (4 more). An absolute error e_s in smooth
 * moves the result by e_s·f·(1 - 1/factor), i.e. by e_s·(factor - 1)
 * relative to the smallest result f/factor; the other terms are relative:
 * rel <= (factor - 1)·(hi + lo)/(hi - lo)·gamma_{k_f + 5} + gamma_{k_f + 6},
 * k_f the count of f itself. Continuous at both band edges, so a branch
 * decided differently near an edge adds nothing beyond this. */
static inline double tol_llama3_rel(double theta, double factor, double lo, double hi) {
  double kf = log(theta) + TOL_LIBM + 1.0;
  double amp = (factor - 1.0) * (hi + lo) / (hi - lo);
  return amp * tol_vs_double(kf + 5.0, kf + 5.0) + tol_vs_double(kf + 6.0, kf + 6.0);
}
/* dynamic NTK base b' = theta·t^e, t = factor·L/M − (factor − 1) in fp32:
 * factor's conversion, ·L, /M, (factor − 1)'s conversion and the
 * difference: 4 roundings against t_abs = factor·L/M + (factor − 1) (R3);
 * e = (float)(hd/(hd − 2)) rounded once, which moves t^e by e·|ln t|·u;
 * powf 4 and scales t's error by e; theta's conversion and the product 2.
 * Then inv_freq = 1/powf(b', x) as tol_inv_freq_rel with b' for theta,
 * b''s own relative error scaled by x < 1. First order, made strict. */
static inline double tol_dynamic_rel(double theta, double factor, double L, double M, double hd) {
  double t = factor * L / M - (factor - 1.0), e = hd / (hd - 2.0);
  double kb = e * 4.0 * (factor * L / M + factor - 1.0) / t + e * fabs(log(t)) + TOL_LIBM + 2.0;
  double k = kb + log(theta * pow(t, e)) + TOL_LIBM + 1.0;
  return TOL_FIRST_ORDER * (tol_gamma(k) + tol_gamma64(k));
}
/* yarn: pos = powf(theta, x) (x·ln(theta) + 4), extrapolation 1/pos (1),
 * interpolation 1/(factor·pos) (2); the ramp r = ((float)i − (float)lo) /
 * (float)(hi − lo): conversions 3, difference 1, quotient 1, an absolute
 * error <= gamma_5·(i + lo)/(hi − lo) <= gamma_5·(hd/2 + lo)/(hi − lo),
 * then 1 − r (u). That absolute error e_r moves the blend
 * interp·r + extrap·(1 − r) by e_r·extrap·(1 − 1/factor), i.e. by
 * e_r·(factor − 1) relative to its smallest value interp; the blend's own
 * roundings (1 − extra, two products, the sum, all terms positive) add 4
 * to the path of interp. */
static inline double tol_yarn_rel(double theta, double factor, double hd, double lo, double hi) {
  double k = log(theta) + TOL_LIBM + 2.0 + 4.0;
  double e_r = tol_gamma(5.0) * (hd / 2.0 + lo) / (hi - lo) + TOL_U;
  return TOL_FIRST_ORDER * ((factor - 1.0) * e_r + tol_gamma(k) + tol_gamma64(k));
}
/* longrope: 1/(ext·powf(theta, x)): the exponent and powf as
 * tol_inv_freq_rel, the product and the quotient 2 (ext is the same fp32
 * value on both sides). */
static inline double tol_longrope_rel(double theta) {
  return tol_gamma(log(theta) + TOL_LIBM + 2.0) + tol_gamma64(log(theta) + TOL_LIBM + 2.0);
}
/* An attention factor computed in double (log, sqrt, a quotient: 2 libm
 * calls and 4 roundings on either side). Relative. */
#define TOL_ROPE_ATTENTION_FACTOR_REL (2.0 * tol_gamma64(2.0 * TOL_LIBM + 4.0))
/* attention forward, per row (computed in the test from the row's data):
 * scores s = scale·q·k: dot of length hd and the alpha scaling (R2), an
 * absolute error d_j <= gamma_{hd+1}·scale·sum|q||k|; softmax: m = max_j s_j
 * is off by <= max_j d_j, exp(s_j - m) then has relative error
 * <= d_j + max d + u|s_j - m| + 4u (subtraction, R4), the row sum of
 * <= S positive terms gamma_S, the reciprocal and the product 2u:
 * eps_P = 2(2·max d + u·max|s - m| + 4u) + gamma_S + 2u (a relative error
 * of every P_ij); out = P·V: dot of length S: (gamma_S + eps_P)·sum P|v|.
 * The backward adds, per (i, j): dP = dout·v (gamma_hd·sum|dout||v|), D_i =
 * sum_j P·dP (double, converted: 1), dS = P(dP - D) (2 roundings) and the
 * dq/dk/dv products (dot lengths S, S·group, S·group, + alpha): all
 * propagated first order in the test's reference. */
/* GLU, per element (R3 with R4). SiLU x/(1 + expf(-x)): expf 4, + 1,
 * / 1 -> 6; h = act(g)·u: 7. GELU(tanh): inner = beta(x + kappa·x³)
 * (kappa·x·x·x 3, the fp32 constants kappa and beta 1 each, the sum of
 * same-sign terms 1, beta· 1: 7, as a relative error of inner), tanhf 4
 * plus (1 - th²)·|inner|·gamma_7 from its input, 1 + th 1, 0.5x· 1, ·u 1:
 * |dh| <= gamma_7·|u|·0.5|x|(1 + |th| + (1 - th²)|inner|). */
#define TOL_K_GLU_SILU_FWD 7.0
#define TOL_K_GLU_GELU_FWD 7.0
/* GLU backward. SiLU: s = 1/(1 + expf(-x)) 6; silu' = s(1 + x(1 - s)):
 * 1 - s 1 (against 1 + s), x· 1, 1 + 1, s· 1 with s's 6 twice on the
 * product path: 6 + 6 + 4 = 16; dg = dh·u·silu' 2 more: 18, against
 * |dh||u|·s(1 + |x|(1 + s)). du = dh·silu(g): 7 against |dh||silu|.
 * GELU: th as above (7 + 4), th² 1, 1 - th² 1, the product
 * 0.5x(1 - th²)·beta·(1 + 3kappa·x²) with (1 + 3kappa·x²) 5 and 3 products:
 * 11 + 2 + 5 + 3 = 21, + 0.5(1 + th) 1: 22, dh·u· 2: 24, against
 * |dh||u|(0.5(1 + |th| + (1 - th²)|inner|) + 0.5|x|(1 + th² + 2|th|(|th| +
 * (1 - th²)|inner|))·beta(1 + 3kappa·x²)). */
#define TOL_K_GLU_SILU_DG 18.0
#define TOL_K_GLU_GELU_DG 24.0
#define TOL_K_GLU_DU 7.0
/* embedding: out = scale·W (1); dW += scale·dout over the c rows with the
 * same id: a sum of c + 1 terms of one product each (R2): c + 2. */
#define TOL_K_EMBED_FWD 1.0
/* cross-entropy row (tests/unit xent): se = (float)sum_j expf(l_j - m) in
 * double: each term relative u|l_j - m| (the subtraction) + 4u (expf, R4),
 * the conversion 1: eps_se = u·max_j|l_j - m| + 5u (+ u for two shards,
 * whose se add in fp32) per row; log(se) in double turns it into an
 * absolute error; tl = l_y - m: u|l_y - m|. |loss - ref| <= eps_se +
 * u|l_y - m|. dlogits_j = w(expf(l_j - m)·(1/se)) - w[j = y]: expf 4,
 * 1/se 1, · 1, ·w 1 on top of eps_se and u|l_j - m|, the - w 1:
 * |d - ref| <= |w|p_j(eps_se + u|l_j - m| + 7u) + u|w|(p_j + [j = y]). */
#define TOL_K_XENT_SE 5.0
#define TOL_K_XENT_BWD 7.0
/* the fused classifier's online log-sum-exp over n column tiles
 * (k_xent_online, k_xent_rebase): each tile moves the running sum to the
 * new max, s·exp(m − m') in fp64 (m − m' exact in fp64; exp, the product
 * and the add: TOL_LIBM + 2 fp64 roundings) and rounds it to fp32 (u); the
 * rebase onto the reduced max once more (TOL_LIBM + 1, u). A term's own
 * l_j − m' (m' the max when its tile ran) has |l_j − m'| <= |l_j − m|, as
 * l_j <= m' <= m: inside eps_se's u·max|l_j − m|. Relative, added to
 * eps_se. */
static inline double tol_xent_online(double tiles) {
  return (tiles + 1.0) * TOL_U + (tiles * (TOL_LIBM + 2.0) + TOL_LIBM + 1.0) * TOL_U64;
}

/* ===================================================================== */
/* 2. Finite differences (test_kernels.c): a central difference with the  */
/*    fp32 steps h1 = fl(x + h) - x, h2 = x - fl(x - h) of L = sum dy·y    */
/*    (double) differs from dL/dx by at most                              */
/*      |h1 - h2|/2·M2 + (h1³ + h2³)/(6(h1 + h2))·M3      (Taylor)         */
/*    + (E(x + h1) + E(x - h2))/(h1 + h2)                  (rounding of L)*/
/*    where M2, M3 bound |L''|, |L'''| along that coordinate on the       */
/*    interval and E = sum_j |dy_j|·(bound on y_j's error) + gamma64·sum  */
/*    |dy·y| bounds the error of one evaluation of L; and the analytic    */
/*    gradient itself carries its bound against the exact derivative.    */
/*    M2, M3 come from the sups below (one-variable functions, maximised  */
/*    on a 2e-3 grid over [-40, 40] and at the roots of the next          */
/*    derivative with sympy/mpmath; they decay outside; rounded up).      */
/* ===================================================================== */

static inline double tol_fd_taylor(double h1, double h2, double M2, double M3) {
  return fabs(h1 - h2) / 2.0 * M2 + (h1 * h1 * h1 + h2 * h2 * h2) / (6.0 * (h1 + h2)) * M3;
}
/* SiLU and tanh-GELU: sup |f''|, sup |f'''| over the reals. */
#define TOL_SUP_SILU_D2 0.5
#define TOL_SUP_SILU_D3 0.3082
#define TOL_SUP_GELU_D2 0.7979
#define TOL_SUP_GELU_D3 0.7767
/* rmsnorm along x_i: row loss L = r(x)(a·x + b), r = (q + x²/H)^(-1/2),
 * q = (sum_{h != i} x_h²)/H + eps; with s = x/sqrt(qH), r = q^(-1/2)·phi(s),
 * x·r = sqrt(H)·psi(s), phi = (1 + s²)^(-1/2), psi = s·phi, d/dx =
 * (qH)^(-1/2) d/ds, hence |L^(k)| <= (qH)^(-k/2)(|a|sqrt(H)·sup|psi^(k)| +
 * |b|q^(-1/2)·sup|phi^(k)|). Along w: L is linear, 0. */
#define TOL_SUP_PHI_D2 1.0
#define TOL_SUP_PHI_D3 1.9323
#define TOL_SUP_PSI_D2 0.8587
#define TOL_SUP_PSI_D3 3.0
/* attention along q_id of row i: f(t) = E_p(t)[c], p(t) = softmax(s + t·a)
 * over the visible keys, a_j = scale·k_jd, c_j = dout_i·v_j. f'' = E[(a -
 * a̅)²(c - c̅)], f''' = E[(a - a̅)³(c - c̅)] - 3Var(a)Cov(a, c); with the ranges
 * R_a, R_c (|x - x̅| <= R, Var <= R²/4, |Cov| <= R_aR_c/4, Popoviciu):
 * |f''| <= R_a²R_c, |f'''| <= (1 + 3/16)R_a³R_c, independent of t. Along k_jd
 * every row i that sees key j moves with a = scale·q_id at j only (R_a =
 * |scale·q_id|); along v: L is linear, 0. */
#define TOL_SOFTMAX_D3 (19.0 / 16.0)

/* ===================================================================== */
/* 3. Whole models in fp32 (tests/mpi: parity, fsdp, runckpt).            */
/* ===================================================================== */
/* Two fp32 evaluations of the same loss, log-probs or gradients (a mesh and
 * one rank, two meshes, meshlm and the fixture's float64 reference) differ
 * only by rounding in a different order. Model, first order:
 *  M1 (per stage, worst case over orders): a stage summing n terms adds a
 *     relative error <= gamma_n·rho (R2), rho = sum|t| / |sum t| in the L2
 *     sense over the stage's output. For sums of nonnegative terms (sums of
 *     squares, softmax denominators, the mean of per-token losses) rho = 1;
 *     for signed products of the fixtures' weights (independent N(0, 0.1²)
 *     draws, tools/gen_fixtures.py) with activations, E(sum|t|)² / E(sum t)²
 *     = 2n/pi, so rho <= sqrt(n): such a stage counts n·sqrt(n) roundings.
 *     Elementwise stages count their roundings (R1, R4).
 *  M2 (propagation): a relative error entering a later stage leaves it with
 *     relative amplification <= 1 (every block input is RMS-normalised,
 *     which is scale invariant; softmax and cross-entropy outputs are
 *     probabilities; the compared quantities are L2 norms over whole
 *     tensors, where errors from distinct stages do not align).
 * Then one fp32 evaluation is within gamma_K (relative, L2) of the exact
 * value, K the sum of the stage counts along the longest dependency chain
 * (gamma_a + gamma_b <= gamma_{a+b}), counted below from the model's sizes;
 * two evaluations in different orders differ by <= 2·gamma_K. K counts
 * every stage of the largest family (Gemma3's four norms per layer, q/k
 * norms, biases) for every fixture: an upper bound for the others. The
 * measured errors sit near sqrt(K)·u, the random-walk size, well inside. */

typedef struct tol_model {
  double hidden, intermediate, heads, kv_heads, head_dim, layers, vocab;
  double seq;    /* S: keys per query, at most the sequence length */
  double tokens; /* T: token rows of the batch (all dp ranks together) */
  double vocab_tiles; /* column tiles of the fused classifier's online log-sum-exp per row
                         (parallel/loss.h); 0 or 1: whole rows, Megatron's two passes */
  double experts, top_k; /* a sparse MoE layer's E and k (model/moe.h); 0: dense layers.
                            `intermediate` is then the wider of the dense and expert MLPs */
} tol_model;

/* n·sqrt(n): a signed reduction of n terms (M1). */
static inline double tol_signed(double n) { return n * sqrt(n); }

/* The stages a sparse MoE block adds to a layer's forward chain (model/moe.h):
 * the router GEMM (H terms), the fp32 softmax over E (subtract max, expf,
 * sum of E, 1/x), the top-k renormalization (sum of k, a division) and the
 * weighted sum of k expert outputs (a product and k terms); the experts'
 * own GEMMs are gate/up/down's stages, counted with `intermediate`. */
static inline double tol_k_moe_fwd(const tol_model *m) {
  if (m->experts <= 0) return 0.0;
  return tol_signed(m->hidden) + m->experts + TOL_LIBM + 2.0 + m->top_k + 1.0 +
         tol_signed(m->top_k) + 1.0;
}

/* ... and to its backward: dw = dy·ye (H terms), the renormalization's
 * backward (a dot of k, a difference, a division), the softmax's (a dot of
 * E, a difference, a product), the router's input gradient (E terms, then
 * added) and the sum of each token's k expert input gradients. */
static inline double tol_k_moe_bwd(const tol_model *m) {
  if (m->experts <= 0) return 0.0;
  return tol_signed(m->hidden) + tol_signed(m->top_k) + 2.0 + tol_signed(m->experts) + 2.0 +
         tol_signed(m->experts) + 1.0 + tol_signed(m->top_k);
}

/* One layer's forward. */
static inline double tol_k_layer_fwd(const tol_model *m) {
  double H = m->hidden, hd = m->head_dim, S = m->seq;
  return tol_k_moe_fwd(m)                     /* a sparse block's router and combine (0: dense) */
         + 4.0 * (H + 4.0)                   /* four RMSNorms: sum of H squares, rstd 3, scale 1 */
         + tol_signed(H + 1.0)               /* q, k, v projections (+ bias) */
         + (hd + 4.0)                        /* q_norm, k_norm */
         + tol_signed(2.0) + S + TOL_LIBM + 1.0 /* rope: rotation; the angle pos·f rounded
                                                   (abs <= S·u: pos < S, f <= 1); cosf/sinf */
         + tol_signed(hd) + 1.0              /* scores q·k and the scale */
         + S + TOL_LIBM + 2.0                /* softmax: subtract max, expf, sum of <= S, 1/x */
         + S * (TOL_LIBM + 3.0)              /* online softmax: at most S blocks merged
                                                (FlashAttention tiles, ring attention's
                                                blocks), each a rescale by expf(m − m'), a
                                                product and an add */
         + tol_signed(S)                     /* P·V */
         + tol_signed(m->heads * hd + 1.0)   /* o_proj (+ bias) */
         + tol_signed(H + 1.0) + 7.0 + TOL_LIBM /* gate/up (+ bias), activation (GELU) × up */
         + tol_signed(m->intermediate + 1.0) /* down_proj */
         + 2.0 * tol_signed(2.0);            /* two residual adds */
}

/* One layer's backward, from its output gradient to its input gradient. */
static inline double tol_k_layer_bwd(const tol_model *m) {
  double H = m->hidden, hd = m->head_dim, S = m->seq, group = m->heads / m->kv_heads;
  return tol_k_moe_bwd(m)                            /* a sparse block's (0: dense) */
         + 2.0 * tol_signed(2.0)                     /* residual gradient adds */
         + tol_signed(H)                             /* down_proj input gradient */
         + 12.0 + TOL_LIBM                           /* activation backward */
         + tol_signed(2.0 * m->intermediate)         /* gate + up input gradients */
         + 4.0 * (tol_signed(H) + 10.0)              /* four RMSNorm backwards: row dot, rescale */
         + tol_signed(H)                             /* o_proj input gradient */
         + tol_signed(hd) + tol_signed(S) + 3.0      /* dP = dout·v, D = sum P·dP, dS */
         + tol_signed(group * S) + 1.0               /* dq (S keys), dk (S·group rows), scale */
         + tol_signed(2.0) + S + TOL_LIBM + 1.0      /* rope backward */
         + tol_signed(hd) + 10.0                     /* q/k norm backward */
         + tol_signed((m->heads + 2.0 * m->kv_heads) * hd); /* q, k, v input gradients */
}

typedef enum { TOL_LOGPROBS, TOL_LOSS, TOL_GRADS } tol_quantity;

/* K of section 3 for one quantity. */
static inline double tol_model_k(const tol_model *m, tol_quantity q) {
  double H = m->hidden, V = m->vocab;
  double fwd = 1.0                                  /* embedding scale (Gemma3) */
               + m->layers * tol_k_layer_fwd(m)
               + (H + 4.0) + tol_signed(H)          /* final norm, lm_head */
               + V + 2.0 * TOL_LIBM + 2.0           /* log-sum-exp over V, z_y - lse */
               + (m->vocab_tiles > 1.0               /* online log-sum-exp over the tiles: */
                      ? m->vocab_tiles * (TOL_LIBM + 3.0) /* per tile the sum so far times
                                                            exp(m - m') (fp64: within one libm
                                                            call), plus the tile's sum, rounded
                                                            to fp32 (as attention's online
                                                            softmax above) */
                            + TOL_LIBM + 2.0        /* the rebase onto the reduced max:
                                                       exp, a product, a rounding */
                      : 0.0);
  if (q == TOL_LOGPROBS) return fwd;
  if (q == TOL_LOSS) return fwd + m->tokens + 1.0;  /* mean of T positive losses */
  return fwd + 3.0 + TOL_LIBM                       /* cross-entropy backward */
         + tol_signed(V) + tol_signed(H) + 10.0     /* lm_head and final norm backward */
         + m->layers * tol_k_layer_bwd(m)
         + tol_signed(m->tokens + 2.0);             /* each weight gradient: a sum over the T
                                                       token rows (split over dp ranks, then
                                                       reduced: R2), + tied lm_head/embedding */
}

/* The fixture's reference (transformers in float64) computes some pieces in
 * fp32 (tools/gen_fixtures.py): RoPE tables, the RMSNorm normalisation and
 * the attention softmax; its gradients run back through the same pieces. */
static inline double tol_model_k_ref(const tol_model *m, tol_quantity q) {
  double H = m->hidden, S = m->seq;
  double fwd = m->layers * (4.0 * (H + 4.0) + S + TOL_LIBM + 1.0 + S + TOL_LIBM + 2.0) + H + 4.0;
  return q == TOL_GRADS ? 2.0 * fwd : fwd;
}

/* meshlm (fp32) against the fixture: meshlm's gamma_K, the reference's fp32
 * pieces, its float64 arithmetic over the same chain, and for gradients
 * the rounding of the stored float32 gradient (u). Relative (L2). */
static inline double tol_model_vs_ref(const tol_model *m, tol_quantity q) {
  double k = tol_model_k(m, q);
  return tol_gamma(k) + tol_gamma(tol_model_k_ref(m, q)) + tol_gamma64(k) +
         (q == TOL_GRADS ? TOL_U : 0.0);
}

/* Two fp32 evaluations in different orders (mesh vs one rank, HSDP vs
 * FSDP, a checkpoint's next step on another mesh). Relative (L2). */
static inline double tol_model_pair(const tol_model *m, tol_quantity q) {
  return 2.0 * tol_gamma(tol_model_k(m, q));
}

/* ===================================================================== */
/* 4. bf16 mixed precision against fp32 (tests/mpi/test_fsdp.c).          */
/* ===================================================================== */
/* With param_dtype bf16 the FSDP all-gather rounds every parameter to bf16,
 * the residual stream is rounded at each unit input and its gradient at
 * each unit boundary, the local gradient before the reduction; reduce_dtype
 * bf16 rounds once per reduction hop (dp - 1), output_dtype bf16 the
 * logits once. Each such site perturbs one operand by a relative d,
 * |d| <= u_bf16. The worst case over the signs of d is vacuous (a site
 * consumed by a signed sum of n terms could move it by u_bf16·sqrt(n), and
 * ~80 sites exceed 100 %), and unlike section 3 this rounding is not a
 * choice of order: it is the same deterministic RNE of data whose low bits
 * are effectively random, the standard setting of probabilistic rounding
 * analysis (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019): independent,
 * zero-mean d. A site then moves its stage by a relative L2 error of rms
 * <= u_bf16/sqrt(3) (uniform in [-u_bf16, u_bf16] at worst), and M2 carries
 * it unamplified. Bound: the sum over the D sites on the chain of u_bf16,
 * i.e. D·u_bf16, which exceeds the root-sum-square of the site errors by
 * sqrt(3D); by Chebyshev the chance to exceed it is <= 1/(3D) even without
 * Gaussian tails. fp32 reordering (section 3) is two orders smaller and
 * inside the same margin. Relative (L2, or the loss's relative error). */
static inline double tol_bf16_sites(const tol_model *m, tol_quantity q, double reduce_hops,
                                    int rounded_logits) {
  /* per layer: q, k, v, o, gate, up, down, three biases, four norms and
   * q/k norms = 16 rounded parameters, the unit input, the fp32
   * activations the bf16 GEMMs round (autocast's casts): the input of
   * q/k/v (one tensor), of o, of gate/up and of down = 4, and attention's
   * operands, which its products round as autocast's bf16 SDPA does
   * (ml_be_attention_fwd with compute bf16): q and k for the scores, the
   * probabilities P and v for P·v = 4 (the softmax between them is fp32,
   * a function of the rounded scores: M2 carries their error); and the
   * dense MLP's gate and up outputs g, u, which their GEMMs write in bf16
   * (autocast's bf16 matmul outputs, ml_model_bf16_mlp) = 2 (act(g)·u is
   * then computed in fp32 from them and rounded once as down's input, the
   * site counted above: a fused rounding, no extra site). Counted on every
   * layer: where a model keeps g, u fp32 (MoE, an output edge on gate/up)
   * the bound only over-counts. */
  double gu_out = 2.0; /* g, u written in bf16 by their GEMMs */
  double fwd = m->layers * (16.0 + 1.0 + 4.0 + 4.0 + gu_out)
               + 3.0                                   /* embedding, final norm, lm_head */
               + 1.0                                   /* the root unit's input */
               + 1.0                                   /* lm_head's input */
               + (rounded_logits ? 1.0 : 0.0);
  if (q != TOL_GRADS) return fwd;
  return fwd + m->layers * 16.0 + 3.0 /* the same rounded weights in the backward matmuls */ +
         m->layers * 4.0               /* the same rounded q, k, v, P in attention's backward
                                          products (dout·v^T, P^T·dout, dS·k, dS^T·q) */ +
         m->layers * gu_out            /* the same rounded g, u in the GLU's backward
                                          (dg = dh·u·act'(g), du = dh·act(g)) */ +
         m->layers * 7.0 + 1.0         /* each linear's output gradient, rounded for its
                                          dx and dW GEMMs (7 per layer, lm_head) */ +
         m->layers * 2.0               /* attention's output gradient dout and dS = P ⊙
                                          (dP − D), each rounded for its two products */ +
         m->layers * 1.0               /* attention's output out, read in bf16 for D =
                                          rowsum(dout ⊙ out) (ml_model_bf16_att: the saved att
                                          is o_proj's bf16 operand, as FlashAttention-2 in bf16
                                          reads its bf16 out): each element of out moved by a
                                          relative d, |d| <= u_bf16, moves D by at most
                                          u_bf16·Σ|dout·out| over its row, the one operand of
                                          dS = P ⊙ (dP − D) it enters: one site on the chain to
                                          dq, dk. Counted on every mesh: where the feature is off
                                          (an attention core, a tp hook on o_proj's input) it
                                          only loosens the bound */ +
         (m->layers + 1.0)             /* gradient rounded at each unit boundary */ +
         1.0                           /* local gradient rounded before the reduction */ +
         reduce_hops;
}
static inline double tol_bf16(const tol_model *m, tol_quantity q, double reduce_hops,
                              int rounded_logits) {
  return tol_bf16_sites(m, q, reduce_hops, rounded_logits) * TOL_U_BF16;
}

/* Two bf16 runs on different meshes (tests/mpi/test_bf16.c): each differs
 * from the exact result by its own site errors, and a site whose fp32
 * input differs between the meshes (section 3's reordering, two orders
 * smaller) may round its elements to the neighbouring bf16 value, so the
 * pair differs by at most both runs' site bounds. */
static inline double tol_bf16_pair(const tol_model *m, tol_quantity q) {
  return 2.0 * tol_bf16(m, q, 0, 0);
}

/* Issue 10's acceptance limits for real bf16 compute against fp32 on the
 * fixtures: the loss's relative error <= 1e-2 and the mean over tokens of
 * |Δ log-prob| <= 2e-2 nats. Why they hold with margin: each of the D
 * sites above perturbs a vector of at least `hidden` elements with
 * independent relative errors of rms <= u_bf16/sqrt(3); the next matmul or
 * norm mixes them, so one token's log-prob moves by a relative rms of
 * about sqrt(D/3)·u_bf16/sqrt(hidden) (the errors of one site average
 * over its elements), i.e. its absolute change is that times |log-prob|
 * (~log V, the loss). The loss averages T such token errors of either
 * sign: another 1/sqrt(T). tol_bf16_expected gives the first figure; the
 * test prints it beside the limits and the measurement. */
#define TOL_BF16_LOSS_LIMIT 1e-2
#define TOL_BF16_LOGPROB_LIMIT 2e-2
static inline double tol_bf16_expected(const tol_model *m) {
  return sqrt(tol_bf16_sites(m, TOL_LOSS, 0, 0) / 3.0) * TOL_U_BF16 / sqrt(m->hidden);
}

/* ===================================================================== */
/* 5. AdamW, element by element (tests/mpi/train_check.c, test_kernels).  */
/* ===================================================================== */
/* k_adamw_step in fp32 with fp32-rounded hyperparameters (decay = 1 - lr·wd,
 * w1 = 1 - b1, w2 = 1 - b2, step = lr/bc1, sqrt(bc2), eps: 1 rounding each
 * from double), against the same update in double from the same inputs
 * (p, g, m, v before the step; g rounded once more by clipping), R3 counts:
 *  m' = m + w1(g - m): g's rounding 1, g - m 1, w1 1, · 1, + m 1: 5,
 *     against A_m = |m| + w1(|g| + |m|);
 *  v' = v·b2 (double) + w2·g·g: w2 1, g² 2, two products 2, the store 1
 *     (the sum is in double): 6, against v' (all terms >= 0);
 *  denom = sqrtf(v')/sqrt(bc2) + eps: half of v''s 6, sqrtf 1, sqrt(bc2) 1,
 *     / 1, eps 1, + 1: 8, against denom (terms >= 0);
 *  p' = p·decay + (-step)·m'/denom: decay 1, · 1 (3 on the p·decay path
 *     with the final +), step 1, · 1, / 1, + 1 and denom's 8 on the
 *     update's path: 12 against |p·decay| + |upd|; m''s own error reaches
 *     the update times step/denom (m' may cancel, so that part stays
 *     absolute) and v''s through denom (counted above).
 * The same counts bound an earlier error carried into this step, first
 * order: dm' = b1·dm, dv' = b2·dv, dp' = decay·dp + (step/denom)·dm' +
 * |upd|·(sqrt(v'/bc2)/denom)/(2v')·dv'. tol_adamw_step returns the exact
 * step in double (on the exact state s) with the bounds carried and added;
 * with zero incoming bounds it is one fp32 step from an exact state. Every
 * element of every rank's shard gets exactly this update whatever the mesh,
 * so the check has no model assumption and no order dependence. */
#define TOL_K_ADAMW_M 5.0
#define TOL_K_ADAMW_V 6.0
#define TOL_K_ADAMW_P 12.0
/* the double reference's own arithmetic: about a dozen operations (R5) */
#define TOL_K64_ADAMW 16.0

typedef struct tol_adamw {
  double p, m, v;    /* state (exact, in double) */
  double bp, bm, bv; /* bounds on the fp32 state's distance from it */
} tol_adamw;

static inline tol_adamw tol_adamw_step(tol_adamw s, double g, double lr, double b1, double b2,
                                       double eps, double wd, double t) {
  double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
  double decay = 1.0 - lr * wd, step = lr / bc1;
  tol_adamw o;
  o.m = s.m + (1.0 - b1) * (g - s.m);
  o.v = s.v * b2 + (1.0 - b2) * g * g;
  double den = sqrt(o.v) / sqrt(bc2) + eps, upd = -step * o.m / den;
  o.p = s.p * decay + upd;
  double am = fabs(s.m) + (1.0 - b1) * (fabs(g) + fabs(s.m));
  o.bm = TOL_FIRST_ORDER * (b1 * s.bm + tol_vs_double(TOL_K_ADAMW_M, TOL_K64_ADAMW) * am);
  o.bv = TOL_FIRST_ORDER * (b2 * s.bv + tol_vs_double(TOL_K_ADAMW_V, TOL_K64_ADAMW) * o.v);
  double dv = o.v > 0 ? fabs(upd) * (sqrt(o.v / bc2) / den) / (2.0 * o.v) : 0.0;
  double tp = tol_vs_double(TOL_K_ADAMW_P, TOL_K64_ADAMW);
  o.bp = TOL_FIRST_ORDER * (decay * s.bp + tp * (fabs(s.p) * decay + fabs(upd)) +
                            step / den * o.bm + dv * b2 * s.bv);
  return o;
}

/* ===================================================================== */
/* 6. Gradient norms (tests/mpi/test_fsdp.c).                             */
/* ===================================================================== */
/* The inf-norm is max |g| over fp32 gradients: max is exact and order-free,
 * so the engine's value must equal max |g| of the same run's exported
 * gradients bitwise (TOL_EXACT). Across meshes, |max|a| - max|b|| <=
 * max|a - b| exactly (both sides are exact in double: differences of fp32
 * values), and the gradients themselves are bounded by section 3.
 * The L2 norm is sqrt of a double sum of the squares of N fp32 gradients
 * (each square exact in double), in any order: the sum is within
 * gamma64_N of the exact sum (R2, positive terms), its square root within
 * half that plus one rounding (R1): every such value (the engine's norm,
 * the test's norms of the exported a, b and a - b) is within t =
 * tol_norm2_rel(N) (relative) of the exact norm. Hence the engine's norm
 * and the test's of the same gradients differ by <= 2t/(1 - t) relative,
 * and across meshes |‖a‖ - ‖b‖| <= ‖a - b‖ (triangle inequality) becomes
 * |n_a - n_b| <= (n_{a-b} + t(n_a + n_b))/(1 - t) for the computed n. */
static inline double tol_norm2_rel(double n) { return tol_gamma64(n) + tol_gamma64(2.0); }

/* ===================================================================== */
/* 6b. The CUDA backend against the CPU backend (tests/cuda).             */
/* ===================================================================== */
/* Whole models in fp32 (test_cuda_engine.c): the acceptance limits of the
 * CUDA backend's parity mode (fp32 GEMMs on CUBLAS_COMPUTE_32F, never
 * TF32): per-token log-probs within 1e-4 nats, the loss within 1e-5
 * relative, every gradient within 1e-4 relative L2. Both backends are fp32
 * evaluations of one computation in different orders, so section 3's
 * tol_model_pair bounds them too (CUDA's expf/logf/tanhf are within 2 ulp,
 * CUDA C Programming Guide, "Mathematical Functions": TOL_LIBM's 4
 * roundings cover them as they cover glibc's); the test asserts both and
 * prints both. */
#define TOL_CUDA_LOGPROB_ABS 1e-4
#define TOL_CUDA_LOSS_REL 1e-5
#define TOL_CUDA_GRAD_REL 1e-4

/* ===================================================================== */
/* 7. Exact comparisons (bound 0), and closed forms in double.            */
/* ===================================================================== */
/* TOL_EXACT marks comparisons that must hold bitwise, each derived where
 * used: the same kernels on the same inputs in the same order (activation
 * checkpointing, prefetch/reshard policies, ZeRO-2 vs ZeRO-3, HSDP vs FSDP
 * first-step loss over the same 4-rank dp group, resume on the same mesh),
 * copies (checkpoint loads), sums of multiples of 2^-6 far below 2^53 in
 * double (placement algebra, its adjoint pairing), and correctly rounded
 * single operations (MFU = 1e9·1000/1e13: 1e12 is exact and the division
 * rounds to the double nearest 0.1, the literal). */
#define TOL_EXACT 0.0
/* LR schedules, ml_lr_at against the transformers lambdas (both in double).
 * Cosine, ml_lr_at: p = (k - W)/span 1 (absolute u64, p <= 1), pi·p 1,
 * so the argument is off by <= 2pi·u64; cos 2 ulp (R4: 4u64) plus
 * |sin|·2pi·u64; 1 + cos 1 (2u64); 0.5· exact: f is off by <= (pi +
 * 3)u64; (lr - min)·f + min adds 3 roundings of quantities <= lr: 9.2·u64·lr.
 * transformers: the same f, then f·(1 - min/lr) + min/lr and base_lr·factor
 * add 5: 11.2·u64·lr. Warmup and linear decay take fewer. Both together:
 * |got - want| <= 2·gamma64_14·lr. */
static inline double tol_schedule_abs(double lr) { return 2.0 * tol_gamma64(14.0) * lr; }

/* ===================================================================== */
/* 8. LoRA adapters on the linears (tests/mpi/test_lora.c).               */
/* ===================================================================== */
/* Each adapted linear adds to section 3's chain, in series with the base
 * GEMM's stages (the down-projection x·A^T runs beside the base GEMM, over
 * the same `in` terms, so it adds no length): forward, the up-projection
 * u·B^T (r signed terms), the scaling (1) and the add onto the base output
 * (1); backward, the input gradient's du·A (r terms), the scaling and the
 * add onto the base's dx (1 + 1), and for the adapters' own gradients du =
 * dy·B (at most max(H, I, heads·hd) terms) before dA's sum over the tokens
 * (counted by section 3's weight-gradient sum). Four linears lie on a
 * layer's chain (q/k/v, o_proj, gate/up, down_proj) each way. */
static inline double tol_k_lora(const tol_model *m, tol_quantity q, double r) {
  double per = tol_signed(r) + 2.0, wide = fmax(fmax(m->hidden, m->intermediate),
                                                m->heads * m->head_dim);
  double k = m->layers * 4.0 * per;
  return q == TOL_GRADS ? 2.0 * k + tol_signed(wide) : k;
}
/* meshlm with rank-r adapters against PEFT's float64 reference (as
 * tol_model_vs_ref, K grown by tol_k_lora). Relative (L2). */
static inline double tol_lora_vs_ref(const tol_model *m, tol_quantity q, double r) {
  double k = tol_model_k(m, q) + tol_k_lora(m, q, r);
  return tol_gamma(k) + tol_gamma(tol_model_k_ref(m, q)) + tol_gamma64(k) +
         (q == TOL_GRADS ? TOL_U : 0.0);
}
/* Two fp32 LoRA evaluations in different orders (a mesh and one rank). */
static inline double tol_lora_pair(const tol_model *m, tol_quantity q, double r) {
  return 2.0 * tol_gamma(tol_model_k(m, q) + tol_k_lora(m, q, r));
}

#endif
