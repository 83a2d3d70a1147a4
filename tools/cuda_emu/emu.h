// The CUDA device language and runtime subset that src/kernels/cuda uses,
// for running those kernels as C++ on the CPU (tools/cuda_emu: transform.py
// turns each .cu into C++ that includes this header instead of
// cuda_runtime.h / cuda_bf16.h). Types (cudaError_t, cudaStream_t, dim3,
// float4, uint2, ...) are the CUDA toolkit's own (cuda_runtime_api.h), so
// their sizes and alignments are the real ones. Each GPU thread runs as a
// fiber (emu.cpp), scheduled cooperatively at block barriers and warp
// collectives; every collective takes the full warp (mask 0xffffffff,
// width 32) or the emulator aborts, as it does on divergence, deadlock and
// any launch the sm_90 limits refuse (which returns an error, as there).
#pragma once
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <functional>
using std::max;
using std::min;

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __restrict__
#undef __align__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __align__(n) alignas(n)

/* ---- bf16 (cuda_bf16.h's names; round-to-nearest-even as the device) ---- */
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

/* ---- vector constructors and bit casts ------------------------------------ */
static inline float2 make_float2(float x, float y) {
  float2 r;
  r.x = x, r.y = y;
  return r;
}
static inline float4 make_float4(float x, float y, float z, float w) {
  float4 r;
  r.x = x, r.y = y, r.z = z, r.w = w;
  return r;
}
static inline uint2 make_uint2(unsigned x, unsigned y) {
  uint2 r;
  r.x = x, r.y = y;
  return r;
}
static inline float __uint_as_float(unsigned u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline unsigned __float_as_uint(float f) {
  unsigned u;
  memcpy(&u, &f, 4);
  return u;
}
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
/* a product rounded once, never contracted into an FMA (the harness builds without contraction) */
static inline float __fmul_rn(float a, float b) { return a * b; }

/* ---- the running thread, its block and grid ------------------------------- */
extern uint3 emu_block_idx;
extern dim3 emu_grid_dim, emu_block_dim;
uint3 emu_thread_idx();
unsigned emu_tid();  // linear thread index in the block (x fastest): warp = tid / 32
#define threadIdx (emu_thread_idx())
#define blockIdx emu_block_idx
#define gridDim emu_grid_dim
#define blockDim emu_block_dim

/* ---- barriers and warp collectives ---------------------------------------- */
enum emu_op { EMU_SYNCWARP, EMU_SHFL, EMU_MATCH, EMU_LDSM, EMU_MMA };
void emu_syncthreads();
// every lane of the warp reaches the collective `op` (its count and kind checked)
void emu_warp_barrier(emu_op op);
void emu_full_mask(unsigned mask, const char *what);  // aborts unless mask is 0xffffffff
// A collective's lanes write their slots (64 bytes each) of the warp's bank,
// pass one barrier and read: the two banks alternate between successive
// collectives, so a bank is written again only after the next barrier,
// which every lane reaches after its reads.
int emu_warp_bank();
void *emu_warp_slot(int bank, int lane);
#define __syncthreads() emu_syncthreads()
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu_full_mask(mask, "__syncwarp");
  emu_warp_barrier(EMU_SYNCWARP);
}
// every lane publishes v, then reads lane src(lane)'s (its own where src < 0 or > 31)
template <class T, class F>
static inline T emu_shfl(unsigned mask, T v, int width, F src, const char *what) {
  static_assert(sizeof(T) <= 64, "shuffle of a large type");
  emu_full_mask(mask, what);
  if (width != 32) {
    fprintf(stderr, "EMU ERROR: %s width %d (only 32 is emulated)\n", what, width);
    abort();
  }
  int lane = emu_tid() & 31, s = src(lane), bank = emu_warp_bank();
  memcpy(emu_warp_slot(bank, lane), &v, sizeof(T));
  emu_warp_barrier(EMU_SHFL);
  T r = v;
  if (s >= 0 && s < 32) memcpy(&r, emu_warp_slot(bank, s), sizeof(T));
  return r;
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return emu_shfl(
      mask, v, width, [&](int) { return src & 31; }, "__shfl_sync");
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
  return emu_shfl(
      mask, v, width, [&](int l) { return l ^ m; }, "__shfl_xor_sync");
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
  return emu_shfl(
      mask, v, width, [&](int l) { return l + (int)d; }, "__shfl_down_sync");
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
  return emu_shfl(
      mask, v, width, [&](int l) { return l - (int)d; }, "__shfl_up_sync");
}
// the lanes whose v equals this lane's
template <class T>
unsigned __match_any_sync(unsigned mask, T v) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "match of 32 or 64 bits");
  emu_full_mask(mask, "__match_any_sync");
  int lane = emu_tid() & 31, bank = emu_warp_bank();
  memcpy(emu_warp_slot(bank, lane), &v, sizeof(T));
  emu_warp_barrier(EMU_MATCH);
  unsigned m = 0;
  for (int l = 0; l < 32; l++)
    if (!memcmp(emu_warp_slot(bank, l), &v, sizeof(T))) m |= 1u << l;
  return m;
}
// fibers switch only at barriers and collectives, so a read-modify-write is atomic
template <class T>
T atomicAdd(T *p, T v) {
  T old = *p;
  *p = old + v;
  return old;
}

/* ---- tensor cores (attention.cu's inline PTX, emulated from the PTX ISA) -- */
void emu_ldsm(uint32_t (&r)[4], const __nv_bfloat16 *p, bool trans);
void emu_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
/* cp.async: a thread's copies (bytes to shared memory; zeros when !in) are
 * queued and land only at its emu_cp_wait(n), which lands all but its n most
 * recently committed groups (emu_cp_commit closes a group), as
 * cp.async.wait_group: a tile read before its wait reads the 0xFF fill. */
void emu_cp_async(void *dst, const void *src, int bytes, bool in);
void emu_cp_commit();
void emu_cp_wait(int n);

/* ---- shared memory ----------------------------------------------------------
 * Dynamic: one exact-size buffer per block (AddressSanitizer sees overruns),
 * filled with 0xFF bytes (NaN in fp32 and bf16). Static (__shared__ T x[n]
 * in a function, transform.py: auto &x = *emu_shared<T[n]>(EMU_SITE)): one
 * buffer per declaration and block, allocated at first use, filled alike;
 * EMU_SITE is a distinct address per declaration and template instance. */
unsigned char *emu_dyn_smem();
void *emu_static_smem(const void *site, size_t bytes);
template <class A>
A *emu_shared(const void *site) {
  return (A *)emu_static_smem(site, sizeof(A));
}
#define EMU_SITE           \
  ([]() -> const void * {  \
    static char emu_site_; \
    return &emu_site_;     \
  }())
// A kernel's first statement (transform.py): `fibers` whether it reaches
// barriers or collectives (each thread then runs on its own stack; else the
// threads run one after another on the scheduler's), `bound` its
// __launch_bounds__ (the block must not exceed it). True when the emulator
// only asked for these (the kernel returns at once).
bool emu_kernel_entry(bool fibers, unsigned bound);

/* ---- launches and the runtime calls the kernels make ---------------------- */
cudaError_t emu_set_smem(const void *k, int bytes);
void emu_run_grid(const void *k, dim3 grid, dim3 block, size_t smem,
                  const std::function<void()> &body);
template <class T>
cudaError_t cudaFuncSetAttribute(T *k, cudaFuncAttribute attr, int v) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) abort();
  return emu_set_smem((const void *)k, v);
}
// kernel<<<grid, block, smem, st>>>(args...) (transform.py rewrites the launch)
template <class... P, class... A>
void emu_launch(void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t, A... args) {
  emu_run_grid((const void *)k, grid, block, smem, [&]() { k(args...); });
}

/* ---- scheduling options (tests) -------------------------------------------- */
// How the scheduler orders the threads of a block (and the blocks): 0 every
// thread that can run, ascending, then the next round; 1 the same descending;
// 2 one warp at a time, chosen at random with emu_seed, each until all its
// threads wait (blocks shuffled). A race or a missing barrier shows as
// results that depend on the order; 2 lets a warp run ahead of the others
// by whole phases between block barriers, which 0 and 1 (all warps advance
// one collective per round) do not.
extern int emu_order;
extern unsigned emu_seed;
extern long emu_switches;      // fiber switches so far
extern size_t emu_blocks_run;  // blocks run so far
