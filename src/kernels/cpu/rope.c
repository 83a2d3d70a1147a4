/* Rotary position embedding: HF modeling_rope_utils inverse frequencies and
 * apply_rotary_pos_emb (rotate_half convention). */
#include <math.h>
#include <string.h>

#include "kernels/cpu/kernels.h"
#include "tensor/dtype.h"

static const double TWO_PI = 6.283185307179586;  // 2 * math.pi

// _compute_llama3_parameters on one frequency, in fp32 like the torch tensors
static float llama3_rescale(float f, const ml_rope_scaling *sc) {
  float factor = (float)sc->factor, lo = (float)sc->low_freq_factor;
  float old = (float)sc->original_max_positions;
  float low_wavelen = (float)(sc->original_max_positions / sc->low_freq_factor);
  float high_wavelen = (float)(sc->original_max_positions / sc->high_freq_factor);
  float wavelen = (float)TWO_PI / f;
  float scaled = wavelen > low_wavelen ? f / factor : f;
  if (wavelen < high_wavelen || wavelen > low_wavelen) return scaled;
  float smooth = (old / wavelen - lo) / (float)(sc->high_freq_factor - sc->low_freq_factor);
  return (1.0f - smooth) * scaled / factor + smooth * scaled;
}

// theta^(2i/hd) in fp32, as torch's `base ** (arange(0, dim, 2).float() / dim)`
static float theta_pow(float theta, int64_t i, int64_t hd) {
  return powf(theta, (float)(2 * i) / (float)hd);
}

// _compute_dynamic_ntk_parameters' base for a forward of seq_len positions.
// Beyond max_positions dynamic_rope_update passes seq_len as a tensor, so
// the base is computed in fp32 like it; up to it the model keeps the
// frequencies of its construction (seq_len None → max_positions, in double).
static float dynamic_base(double theta, int64_t hd, const ml_rope_scaling *sc, int64_t seq_len) {
  double M = sc->max_positions, exponent = (double)hd / (double)(hd - 2);
  if ((double)seq_len <= M)
    return (float)(theta * pow(sc->factor * M / M - (sc->factor - 1.0), exponent));
  float t = (float)sc->factor * (float)seq_len / (float)M - (float)(sc->factor - 1.0);
  return (float)theta * powf(t, (float)exponent);
}

// _compute_yarn_parameters' get_mscale
static double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}

// _compute_yarn_parameters' find_correction_dim
static double yarn_correction_dim(double rotations, int64_t hd, double theta, double orig) {
  return (double)hd * log(orig / (rotations * TWO_PI)) / (2.0 * log(theta));
}

// _compute_yarn_parameters: inv_freq blends interpolation (f / factor) and
// extrapolation (f) by a linear ramp over the correction range; returns the
// attention factor
static double yarn(double theta, int64_t hd, const ml_rope_scaling *sc, float *inv_freq) {
  double factor = sc->factor > 0 ? sc->factor : sc->max_positions / sc->original_max_positions;
  double fast = sc->beta_fast != 0 ? sc->beta_fast : 32.0;
  double slow = sc->beta_slow != 0 ? sc->beta_slow : 1.0;
  double lo = yarn_correction_dim(fast, hd, theta, sc->original_max_positions);
  double hi = yarn_correction_dim(slow, hd, theta, sc->original_max_positions);
  if (sc->truncate) lo = floor(lo), hi = ceil(hi);
  lo = lo > 0 ? lo : 0;
  hi = hi < (double)(hd - 1) ? hi : (double)(hd - 1);
  if (lo == hi) hi += 0.001; // linear_ramp_factor's guard against a zero width
  for (int64_t i = 0; i < hd / 2; i++) {
    float pos = theta_pow((float)theta, i, hd); // pos_freqs
    float ramp = ((float)i - (float)lo) / (float)(hi - lo);
    ramp = ramp < 0.0f ? 0.0f : ramp > 1.0f ? 1.0f : ramp;
    float extra = 1.0f - ramp; // inv_freq_extrapolation_factor
    inv_freq[i] = 1.0f / ((float)factor * pos) * (1.0f - extra) + 1.0f / pos * extra;
  }
  if (sc->attention_factor > 0) return sc->attention_factor;
  if (sc->mscale != 0 && sc->mscale_all_dim != 0)
    return yarn_mscale(factor, sc->mscale) / yarn_mscale(factor, sc->mscale_all_dim);
  return yarn_mscale(factor, 1.0);
}

// _compute_longrope_parameters with dynamic_rope_update's choice: the long
// factors for a forward longer than original_max_positions; returns the
// attention factor
static double longrope(double theta, int64_t hd, const ml_rope_scaling *sc, int64_t seq_len,
                       float *inv_freq) {
  double orig = sc->original_max_positions;
  const float *ext = (double)seq_len > orig ? sc->long_factor : sc->short_factor;
  for (int64_t i = 0; i < hd / 2; i++)
    inv_freq[i] = 1.0f / (ext[i] * theta_pow((float)theta, i, hd));
  if (sc->attention_factor > 0) return sc->attention_factor;
  double factor = sc->factor > 0 ? sc->factor : sc->max_positions / orig;
  return factor <= 1.0 ? 1.0 : sqrt(1.0 + log(factor) / log(orig));
}

double k_rope_inv_freq(double theta, int64_t hd, const ml_rope_scaling *sc, int64_t seq_len,
                       float *inv_freq) {
  ml_rope_type type = sc ? sc->type : ML_ROPE_DEFAULT;
  if (type == ML_ROPE_YARN) return yarn(theta, hd, sc, inv_freq);
  if (type == ML_ROPE_LONGROPE) return longrope(theta, hd, sc, seq_len, inv_freq);
  float base = type == ML_ROPE_DYNAMIC ? dynamic_base(theta, hd, sc, seq_len) : (float)theta;
  for (int64_t i = 0; i < hd / 2; i++) {
    float f = 1.0f / theta_pow(base, i, hd);
    if (type == ML_ROPE_LINEAR) f /= (float)sc->factor;
    if (type == ML_ROPE_LLAMA3) f = llama3_rescale(f, sc);
    inv_freq[i] = f;
  }
  return 1.0;
}

// cos_t, sin_t: [S, hd/2]
void k_rope_tables(const float *inv_freq, float scale, int64_t hd, int64_t S, float *cos_t,
                   float *sin_t) {
  int64_t half = hd / 2;
#pragma omp parallel for if (K_PAR(S, S * hd))
  for (int64_t p = 0; p < S; p++)
    for (int64_t i = 0; i < half; i++) {
      float a = (float)p * inv_freq[i];
      cos_t[p * half + i] = cosf(a) * scale;
      sin_t[p * half + i] = sinf(a) * scale;
    }
}

enum { ROPE_CHUNK = 64 }; /* rotated pairs a head takes at a time, on the stack */

/* x: [B*S, nheads, hd] rotated by +angle (dir = 1) or −angle (dir = −1): in place, or with
 * y (the same shape in bf16) into y rounded to nearest-even, x unchanged. One loop computes
 * the rotation for both (the same values), a second stores them: both vectorize. */
static void rope_rotate(float *x, uint16_t *y, const float *cos_t, const float *sin_t, int64_t B,
                        int64_t S, int64_t nheads, int64_t hd, float dir) {
  int64_t half = hd / 2;
#pragma omp parallel for if (K_PAR(B * S, B * S * nheads * hd))
  for (int64_t t = 0; t < B * S; t++) {
    const float *c = cos_t + (t % S) * half, *s = sin_t + (t % S) * half;
    for (int64_t h = 0; h < nheads; h++) {
      int64_t o = (t * nheads + h) * hd;
      float *x1 = x + o, *x2 = x1 + half;
      for (int64_t i0 = 0; i0 < half; i0 += ROPE_CHUNK) {
        int64_t w = half - i0 < ROPE_CHUNK ? half - i0 : ROPE_CHUNK;
        float r1[ROPE_CHUNK], r2[ROPE_CHUNK];
        for (int64_t i = 0; i < w; i++) {
          float a = x1[i0 + i], b = x2[i0 + i], si = dir * s[i0 + i];
          r1[i] = a * c[i0 + i] - b * si;
          r2[i] = b * c[i0 + i] + a * si;
        }
        if (y) {
          for (int64_t i = 0; i < w; i++) {
            y[o + i0 + i] = ml_f32_to_bf16(r1[i]);
            y[o + half + i0 + i] = ml_f32_to_bf16(r2[i]);
          }
        } else {
          memcpy(x1 + i0, r1, sizeof(float) * (size_t)w);
          memcpy(x2 + i0, r2, sizeof(float) * (size_t)w);
        }
      }
    }
  }
}

void k_rope_fwd(float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t S,
                int64_t nheads, int64_t hd) {
  rope_rotate(x, NULL, cos_t, sin_t, B, S, nheads, hd, 1.0f);
}

void k_rope_bwd(float *dx, const float *cos_t, const float *sin_t, int64_t B, int64_t S,
                int64_t nheads, int64_t hd) {
  rope_rotate(dx, NULL, cos_t, sin_t, B, S, nheads, hd, -1.0f);
}

void k_rope_bwd_bf16(const float *dx, uint16_t *y, const float *cos_t, const float *sin_t,
                     int64_t B, int64_t S, int64_t nheads, int64_t hd) {
  rope_rotate((float *)dx, y, cos_t, sin_t, B, S, nheads, hd, -1.0f); /* dx only read */
}

void k_rope_fwd_bf16(const float *x, uint16_t *y, const float *cos_t, const float *sin_t,
                     int64_t B, int64_t S, int64_t nheads, int64_t hd) {
  rope_rotate((float *)x, y, cos_t, sin_t, B, S, nheads, hd, 1.0f); /* x only read */
}
