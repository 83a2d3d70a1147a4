/* Rotary position embedding: HF modeling_rope_utils inverse frequencies and
 * apply_rotary_pos_emb (rotate_half convention). */
#include <math.h>

#include "kernels/cpu/kernels.h"

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

// inv_freq: [hd/2]
void k_rope_inv_freq(double theta, int64_t hd, const ml_rope_scaling *sc, float *inv_freq) {
  for (int64_t i = 0; i < hd / 2; i++) {
    float f = 1.0f / powf((float)theta, (float)(2 * i) / (float)hd);
    if (sc && sc->type == ML_ROPE_LINEAR) f /= (float)sc->factor;
    if (sc && sc->type == ML_ROPE_LLAMA3) f = llama3_rescale(f, sc);
    inv_freq[i] = f;
  }
}

// cos_t, sin_t: [S, hd/2]
void k_rope_tables(const float *inv_freq, int64_t hd, int64_t S, float *cos_t, float *sin_t) {
  int64_t half = hd / 2;
#pragma omp parallel for
  for (int64_t p = 0; p < S; p++)
    for (int64_t i = 0; i < half; i++) {
      float a = (float)p * inv_freq[i];
      cos_t[p * half + i] = cosf(a);
      sin_t[p * half + i] = sinf(a);
    }
}

// x: [B*S, nheads, hd] rotated in place by +angle (dir = 1) or −angle (dir = −1)
static void rope_rotate(float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t S,
                        int64_t nheads, int64_t hd, float dir) {
  int64_t half = hd / 2;
#pragma omp parallel for
  for (int64_t t = 0; t < B * S; t++) {
    const float *c = cos_t + (t % S) * half, *s = sin_t + (t % S) * half;
    for (int64_t h = 0; h < nheads; h++) {
      float *x1 = x + (t * nheads + h) * hd, *x2 = x1 + half;
      for (int64_t i = 0; i < half; i++) {
        float a = x1[i], b = x2[i], si = dir * s[i];
        x1[i] = a * c[i] - b * si;
        x2[i] = b * c[i] + a * si;
      }
    }
  }
}

void k_rope_fwd(float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t S,
                int64_t nheads, int64_t hd) {
  rope_rotate(x, cos_t, sin_t, B, S, nheads, hd, 1.0f);
}

void k_rope_bwd(float *dx, const float *cos_t, const float *sin_t, int64_t B, int64_t S,
                int64_t nheads, int64_t hd) {
  rope_rotate(dx, cos_t, sin_t, B, S, nheads, hd, -1.0f);
}
