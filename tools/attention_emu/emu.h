// CPU emulation of the CUDA features attention.cu uses: one fiber per thread,
// cooperative scheduling at barriers / warp collectives.
#pragma once
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <functional>
using std::max;
using std::min;

#undef __global__
#undef __device__
#undef __forceinline__
#undef __launch_bounds__
#undef __restrict__
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict

struct __nv_bfloat16 {
  uint16_t x;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
static inline uint16_t emu_f2bf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {emu_f2bf(f)}; }
static inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {{emu_f2bf(a)}, {emu_f2bf(b)}};
}
static inline float __bfloat162float(__nv_bfloat16 h) {
  uint32_t u = (uint32_t)h.x << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline float2 make_float2(float x, float y) {
  float2 r;
  r.x = x;
  r.y = y;
  return r;
}

struct emu_dim {
  unsigned x, y, z;
};
struct EmuThread;
extern EmuThread *emu_cur;
extern emu_dim emu_block_idx, emu_grid_dim, emu_block_dim;
extern unsigned char *emu_smem_ptr;
extern size_t emu_smem_size;
unsigned emu_tid();
#define threadIdx (emu_dim{emu_tid(), 0, 0})
#define blockIdx emu_block_idx
#define gridDim emu_grid_dim
#define blockDim emu_block_dim

void emu_syncthreads();
void emu_warp_barrier();
void *emu_warp_slot(int lane);  // 64 bytes per lane
#define __syncthreads() emu_syncthreads()
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) {
    fprintf(stderr, "partial syncwarp\n");
    abort();
  }
  emu_warp_barrier();
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lm) {
  if (mask != 0xffffffffu) {
    fprintf(stderr, "partial shfl\n");
    abort();
  }
  int lane = emu_tid() & 31;
  memcpy(emu_warp_slot(lane), &v, sizeof(T));
  emu_warp_barrier();
  T r;
  memcpy(&r, emu_warp_slot(lane ^ lm), sizeof(T));
  emu_warp_barrier();
  return r;
}
void emu_ldsm(uint32_t (&r)[4], const __nv_bfloat16 *p, bool trans);
void emu_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

// launch machinery
size_t emu_max_smem(const void *k);
cudaError_t emu_set_smem(const void *k, int bytes);
void emu_run_grid(const void *k, unsigned grid, unsigned block, size_t smem,
                  const std::function<void()> &body);
template <class T>
cudaError_t cudaFuncSetAttribute(T *k, cudaFuncAttribute attr, int v) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) abort();
  return emu_set_smem((const void *)k, v);
}
template <class... P, class... A>
void emu_launch(void (*k)(P...), unsigned grid, int block, size_t smem, cudaStream_t, A... args) {
  emu_run_grid((const void *)k, grid, (unsigned)block, smem, [&]() { k(args...); });
}
