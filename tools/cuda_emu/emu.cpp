// The CPU emulation of emu.h: each GPU thread of a block is a fiber on its
// own stack, switched by a small x86-64 routine (no system call, unlike
// swapcontext) with AddressSanitizer told of every switch; the scheduler
// runs the block's fibers in a chosen order until each waits at a barrier
// or collective, releases the warps whose 32 lanes all wait at the same
// collective, else the block when every thread waits at __syncthreads, and
// aborts on divergence (counts or kinds of collectives differ, exited
// threads at a barrier) and deadlock. Launches check sm_90's limits (grid.y
// and grid.z <= 65535, grid.x < 2^31, block <= 1024 threads with z <= 64,
// dynamic shared memory <= the kernel's attribute (48 KiB by default, at
// most 227 KiB), static shared memory <= 48 KiB and both together <= 227
// KiB, __launch_bounds__) and refuse with cudaErrorInvalidConfiguration as
// the device does. A kernel that transform.py found no barrier in runs its
// threads one after the other on the scheduler's stack (much faster; a
// barrier reached there aborts). mma and ldmatrix follow the PTX ISA's
// fragment layouts.
//
// Not emulated: a data race between two barriers is seen only through
// results that change with the scheduling order (fibers switch at barriers
// and collectives alone, so a plain read-modify-write is never torn, and
// memory is the host's: no caches, no fences, no visibility delays);
// collectives on partial masks or widths other than 32 (they abort, the
// kernels use none); registers, occupancy, __launch_bounds__'s minimum
// blocks; streams (every launch runs to completion at once, in order, so
// asynchronous errors and inter-stream ordering are not exercised); the
// device's arithmetic: libm is glibc's, nvcc's FMA contraction is the host
// compiler's, and mma sums each 16-term product exactly and rounds once,
// where tensor cores truncate per block (the bounds cover both, the bits
// differ from a GPU's); cp.async, TMA, wgmma (the kernels use none).
#include "emu.h"

#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#include <sys/mman.h>

#include <map>
#include <random>
#include <vector>

#ifndef __x86_64__
#error "tools/cuda_emu switches fibers with x86-64 code"
#endif

// Saves the callee-saved registers, MXCSR and the x87 control word on the
// current stack, stores its pointer in *save, and resumes the stack `to`.
extern "C" void emu_ctx_switch(void **save, void *to);
__asm__(
    ".text\n.p2align 4\n.globl emu_ctx_switch\n.type emu_ctx_switch,@function\n"
    "emu_ctx_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $16, %rsp\n  stmxcsr (%rsp)\n  fnstcw 8(%rsp)\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 8(%rsp)\n  addq $16, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size emu_ctx_switch, .-emu_ctx_switch\n");

enum { RUN, WAIT_BLOCK, WAIT_WARP, DONE };
enum : size_t {
  STACK = 256 * 1024,           // per fiber (attention's register tiles, ASan's redzones)
  SMEM_STATIC_MAX = 48 * 1024,  // sm_90: static __shared__ per block
  SMEM_OPTIN_MAX = 232448,      // sm_90: 227 KiB per block, opted in
};
struct EmuCopy {  // one cp.async
  void *dst;
  const void *src;  // nullptr: zeros
  int bytes;
};
struct EmuThread {
  void *sp;
  char *stack;
  unsigned tid;
  uint3 idx;
  int state;
  long nblock, nwarp;  // barriers and collectives reached (divergence check)
  emu_op op;           // the collective it waits at
  void *fake;
  std::vector<EmuCopy> cp_open;                  // cp.async since the last commit
  std::vector<std::vector<EmuCopy>> cp_groups;  // committed, not landed, oldest first
};

uint3 emu_block_idx;
dim3 emu_grid_dim, emu_block_dim;
int emu_order = 0;
unsigned emu_seed = 1;
long emu_switches = 0;
size_t emu_blocks_run = 0;

static EmuThread *cur;
static void *sched_sp;
static const void *sched_bottom;
static size_t sched_size;
static char *stacks;  // 1024 fiber stacks, mapped once
static std::vector<EmuThread> threads;
static std::vector<unsigned char> slots;  // per warp 2 banks x 32 lanes x 64 bytes
// The warp's product A·B of an mma (exact products of bf16 values, summed in
// double), formed by the first lane to run after the collective's barrier;
// one per warp and bank, `stamp` the collective count it was formed at
struct MmaProduct {
  long stamp;
  double p[16][8];
};
static std::vector<MmaProduct> mma_products;
static const std::function<void()> *body;
static cudaError_t last_error = cudaSuccess;
static std::map<const void *, int> smem_attr;
static unsigned char *dyn_smem;
static size_t dyn_smem_size, static_smem_size;
static std::map<const void *, void *> static_smem;  // this block's, by declaration
static bool probing, probe_fibers;  // emu_kernel_entry's report on the kernel launched
static unsigned probe_bound;
static bool direct;  // the threads run without fibers

static void die(const char *m) {
  fprintf(stderr, "EMU ERROR: %s (block %u,%u,%u thread %u)\n", m, emu_block_idx.x, emu_block_idx.y,
          emu_block_idx.z, cur ? cur->tid : 0u);
  abort();
}

unsigned emu_tid() { return cur->tid; }
uint3 emu_thread_idx() { return cur->idx; }
int emu_warp_bank() { return (int)(cur->nwarp & 1); }
void *emu_warp_slot(int bank, int lane) {
  return &slots[(((cur->tid / 32) * 2 + bank) * 32 + lane) * 64];
}
void emu_full_mask(unsigned mask, const char *what) {
  if (mask != 0xffffffffu) {
    fprintf(stderr, "EMU ERROR: %s with mask %#x (only full warps are emulated)\n", what, mask);
    abort();
  }
}

static void yield_to_sched() {
  EmuThread *me = cur;
  __sanitizer_start_switch_fiber(&me->fake, sched_bottom, sched_size);
  emu_ctx_switch(&me->sp, sched_sp);
  __sanitizer_finish_switch_fiber(me->fake, &sched_bottom, &sched_size);
}
static void no_barrier_here() {
  if (direct) die("a barrier in a kernel transform.py found none in (run without fibers)");
}
void emu_syncthreads() {
  no_barrier_here();
  cur->state = WAIT_BLOCK;
  cur->nblock++;
  yield_to_sched();
}
void emu_warp_barrier(emu_op op) {
  no_barrier_here();
  cur->state = WAIT_WARP;
  cur->nwarp++;
  cur->op = op;
  yield_to_sched();
}

static void fiber_entry() {
  __sanitizer_finish_switch_fiber(nullptr, &sched_bottom, &sched_size);
  (*body)();
  cur->state = DONE;
  __sanitizer_start_switch_fiber(nullptr, sched_bottom, sched_size);  // this fiber ends
  void *unused;
  emu_ctx_switch(&unused, sched_sp);  // never resumed
}

// thread t's stack laid out as emu_ctx_switch leaves a suspended one: MXCSR
// and the control word, six zero registers, fiber_entry as the return address;
// the top unpoisoned (the previous fiber's fiber_entry frame never returned)
static void fiber_init(EmuThread &t) {
  uint64_t *top = (uint64_t *)(t.stack + STACK);
  ASAN_UNPOISON_MEMORY_REGION(t.stack + STACK - 4096, 4096);
  uint64_t *sp = top - 10;  // 16-byte aligned: fiber_entry starts as if called
  unsigned mxcsr;
  uint16_t cw;
  __asm__ volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(mxcsr), "=m"(cw));
  memset(sp, 0, 10 * sizeof *sp);
  memcpy(&sp[0], &mxcsr, sizeof mxcsr);
  memcpy(&sp[1], &cw, sizeof cw);
  sp[8] = (uint64_t)(uintptr_t)fiber_entry;
  t.sp = sp;
}

static void release_warp(unsigned w, unsigned n) {
  for (unsigned i = w * 32; i < std::min(n, w * 32 + 32); i++) threads[i].state = RUN;
}

// a kernel without barriers: each thread to its end, in order
static void run_direct(unsigned nthreads, std::vector<unsigned> &order, std::mt19937 &rng) {
  dim3 bd = emu_block_dim;
  EmuThread t;
  if (emu_order == 2) std::shuffle(order.begin(), order.end(), rng);
  for (unsigned i : order) {
    t = EmuThread();
    t.tid = i;
    t.idx = {i % bd.x, (i / bd.x) % bd.y, i / (bd.x * bd.y)};
    cur = &t;
    (*body)();
  }
  cur = nullptr;
}

static void run_block(unsigned nthreads, std::mt19937 &rng) {
  dim3 bd = emu_block_dim;
  threads.assign(nthreads, EmuThread());
  slots.assign(((nthreads + 31) / 32) * 2 * 32 * 64, 0xEE);
  mma_products.assign(((nthreads + 31) / 32) * 2, MmaProduct{-1, {}});
  for (unsigned i = 0; i < nthreads; i++) {
    EmuThread &t = threads[i];
    t.tid = i;
    t.idx = {i % bd.x, (i / bd.x) % bd.y, i / (bd.x * bd.y)};
    t.state = RUN;
    t.stack = stacks + (size_t)i * STACK;
    fiber_init(t);
  }
  std::vector<unsigned> order(nthreads);
  for (unsigned i = 0; i < nthreads; i++) order[i] = i;
  if (emu_order == 1) std::reverse(order.begin(), order.end());
  unsigned nw = (nthreads + 31) / 32;
  std::vector<unsigned> ready;
  for (;;) {
    // order 2: one warp chosen at random runs until each of its threads
    // waits (a warp runs ahead of the others by whole barriers-free phases);
    // else every thread that can run, in order
    unsigned lo = 0, hi = nthreads;
    if (emu_order == 2) {
      ready.clear();
      for (unsigned w = 0; w < nw; w++)
        for (unsigned i = w * 32; i < std::min(nthreads, w * 32 + 32); i++)
          if (threads[i].state == RUN) {
            ready.push_back(w);
            break;
          }
      if (!ready.empty()) {
        lo = ready[rng() % ready.size()] * 32, hi = std::min(nthreads, lo + 32);
        std::shuffle(order.begin() + lo, order.begin() + hi, rng);
      }
    }
    for (unsigned k = lo; k < hi; k++) {
      EmuThread &t = threads[order[k]];
      if (t.state != RUN) continue;
      cur = &t;
      void *fake = nullptr;
      __sanitizer_start_switch_fiber(&fake, t.stack, STACK);
      emu_ctx_switch(&sched_sp, t.sp);
      __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
      emu_switches++;
    }
    cur = nullptr;
    bool released = false;
    unsigned ndone = 0, nblock = 0, nrun = 0;
    for (unsigned w = 0; w < nw; w++) {
      unsigned wlo = w * 32, whi = std::min(nthreads, wlo + 32), nwait = 0, wdone = 0;
      const EmuThread *first = nullptr;  // the first lane waiting at a collective
      for (unsigned i = wlo; i < whi; i++) {
        EmuThread &t = threads[i];
        if (t.state == WAIT_WARP) {
          if (first && (t.nwarp != first->nwarp || t.op != first->op))
            die("lanes of a warp at different collectives");
          first = first ? first : &t;
          nwait++;
        }
        wdone += t.state == DONE;
        nblock += t.state == WAIT_BLOCK;
        nrun += t.state == RUN;
      }
      ndone += wdone;
      if (nwait && whi - wlo < 32) die("warp collective in a partial warp");
      if (nwait && wdone) die("warp collective with exited lanes");
      if (nwait == 32) {
        release_warp(w, nthreads);
        released = true;
      }
    }
    if (ndone == nthreads) break;
    if (released || nrun) continue;
    if (nblock == nthreads) {
      for (auto &t : threads)
        if (t.nblock != threads[0].nblock) die("threads at different __syncthreads");
      for (auto &t : threads) t.state = RUN;
      continue;
    }
    if (nblock && ndone) die("__syncthreads with exited threads");
    die("deadlock");
  }
}

unsigned char *emu_dyn_smem() { return dyn_smem; }

void *emu_static_smem(const void *site, size_t bytes) {
  auto it = static_smem.find(site);
  if (it != static_smem.end()) return it->second;
  static_smem_size += bytes;
  if (static_smem_size > SMEM_STATIC_MAX) die("static shared memory above 48 KiB");
  if (static_smem_size + dyn_smem_size > SMEM_OPTIN_MAX)
    die("static and dynamic shared memory above 227 KiB");
  void *p = malloc(bytes);
  memset(p, 0xFF, bytes);  // NaN in fp32 and bf16
  static_smem[site] = p;
  return p;
}

bool emu_kernel_entry(bool fibers, unsigned bound) {
  if (!probing) return false;
  probe_fibers = fibers, probe_bound = bound;
  return true;
}

cudaError_t emu_set_smem(const void *k, int bytes) {
  if (bytes < 0 || (size_t)bytes > SMEM_OPTIN_MAX) return cudaErrorInvalidValue;
  smem_attr[k] = bytes;
  return cudaSuccess;
}

extern "C" cudaError_t cudaGetLastError(void) {
  cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

extern "C" cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t) {
  memset(p, v, n);
  return cudaSuccess;
}

void emu_run_grid(const void *k, dim3 grid, dim3 block, size_t smem,
                  const std::function<void()> &b) {
  auto it = smem_attr.find(k);
  size_t smem_max = it == smem_attr.end() ? SMEM_STATIC_MAX : (size_t)it->second;
  uint64_t nthreads = (uint64_t)block.x * block.y * block.z;
  if (grid.x < 1 || grid.x > 2147483647u || grid.y < 1 || grid.y > 65535 || grid.z < 1 ||
      grid.z > 65535 || block.x < 1 || block.y < 1 || block.z < 1 || block.z > 64 ||
      nthreads > 1024 || smem > smem_max) {
    fprintf(stderr,
            "EMU: launch refused: grid (%u, %u, %u) block (%u, %u, %u) shared %zu (max %zu)\n",
            grid.x, grid.y, grid.z, block.x, block.y, block.z, smem, smem_max);
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (!stacks) {
    stacks = (char *)mmap(nullptr, 1024 * STACK, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stacks == MAP_FAILED) die("no memory for the fiber stacks");
  }
  body = &b;
  EmuThread probe = {};
  cur = &probe;
  probing = true;
  b();
  probing = false;
  cur = nullptr;
  if (nthreads > probe_bound) {
    fprintf(stderr, "EMU: launch refused: block of %llu threads, __launch_bounds__(%u)\n",
            (unsigned long long)nthreads, probe_bound);
    last_error = cudaErrorInvalidConfiguration;  // the device: too many resources requested
    return;
  }
  direct = !probe_fibers;
  std::vector<unsigned> order(nthreads);
  for (unsigned i = 0; i < nthreads; i++)
    order[i] = emu_order == 1 ? (unsigned)nthreads - 1 - i : i;
  std::mt19937 rng(emu_seed);
  uint64_t nblocks = (uint64_t)grid.x * grid.y * grid.z;
  std::vector<uint64_t> blocks(nblocks);
  for (uint64_t i = 0; i < nblocks; i++) blocks[i] = i;
  if (emu_order == 1) std::reverse(blocks.begin(), blocks.end());
  if (emu_order == 2) std::shuffle(blocks.begin(), blocks.end(), rng);
  emu_grid_dim = grid;
  emu_block_dim = block;
  for (uint64_t bid : blocks) {
    emu_block_idx = {(unsigned)(bid % grid.x), (unsigned)(bid / grid.x % grid.y),
                     (unsigned)(bid / grid.x / grid.y)};
    dyn_smem_size = smem;
    static_smem_size = 0;
    dyn_smem = (unsigned char *)malloc(smem ? smem : 1);
    memset(dyn_smem, 0xFF, smem);  // NaN in fp32 and bf16
    if (direct)
      run_direct((unsigned)nthreads, order, rng);
    else
      run_block((unsigned)nthreads, rng);
    free(dyn_smem);
    for (auto &s : static_smem) free(s.second);
    static_smem.clear();
    emu_blocks_run++;
  }
  direct = false;
}

/* ---- ldmatrix and mma ------------------------------------------------------ */

static void check_smem(const void *p, size_t bytes) {
  const unsigned char *c = (const unsigned char *)p;
  if (c < dyn_smem || c + bytes > dyn_smem + dyn_smem_size) die("ldmatrix out of shared memory");
  if ((uintptr_t)(c - dyn_smem) % 16) die("ldmatrix row misaligned");
}

void emu_ldsm(uint32_t (&r)[4], const __nv_bfloat16 *p, bool trans) {
  int lane = emu_tid() & 31, bank = emu_warp_bank();
  check_smem(p, 16);
  memcpy(emu_warp_slot(bank, lane), &p, sizeof p);
  emu_warp_barrier(EMU_LDSM);
  const __nv_bfloat16 *rows[32];
  for (int l = 0; l < 32; l++) memcpy(&rows[l], emu_warp_slot(bank, l), sizeof rows[l]);
  int g = lane >> 2, t = lane & 3;
  for (int m = 0; m < 4; m++) {
    uint16_t e0, e1;
    if (!trans) {
      e0 = rows[8 * m + g][2 * t].x;
      e1 = rows[8 * m + g][2 * t + 1].x;
    } else {
      e0 = rows[8 * m + 2 * t][g].x;
      e1 = rows[8 * m + 2 * t + 1][g].x;
    }
    r[m] = (uint32_t)e0 | ((uint32_t)e1 << 16);
  }
  emu_warp_barrier(EMU_LDSM);  // the warp reads shared memory at once, before any lane writes
}

static float lo(uint32_t u) { return __bfloat162float({(uint16_t)(u & 0xffff)}); }
static float hi(uint32_t u) { return __bfloat162float({(uint16_t)(u >> 16)}); }

static void mma_form(MmaProduct &mp, int bank) {
  float A[16][16], B[16][8];
  for (int L = 0; L < 32; L++) {
    uint32_t f[6];
    memcpy(f, emu_warp_slot(bank, L), sizeof f);
    int g = L >> 2, t = L & 3;
    // PTX ISA: A row = g for a0,a1,a4,a5 (regs 0, 2), g+8 for regs 1, 3;
    // col = 2t + (i&1), +8 for a4..a7 (regs 2, 3)
    A[g][2 * t] = lo(f[0]);
    A[g][2 * t + 1] = hi(f[0]);
    A[g + 8][2 * t] = lo(f[1]);
    A[g + 8][2 * t + 1] = hi(f[1]);
    A[g][2 * t + 8] = lo(f[2]);
    A[g][2 * t + 9] = hi(f[2]);
    A[g + 8][2 * t + 8] = lo(f[3]);
    A[g + 8][2 * t + 9] = hi(f[3]);
    // B row = 2t + (i&1) (+8 for b2, b3), col = g
    B[2 * t][g] = lo(f[4]);
    B[2 * t + 1][g] = hi(f[4]);
    B[2 * t + 8][g] = lo(f[5]);
    B[2 * t + 9][g] = hi(f[5]);
  }
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < 8; c++) {
      double acc = 0;
      for (int k = 0; k < 16; k++) acc += (double)A[r][k] * B[k][c];
      mp.p[r][c] = acc;
    }
}

void emu_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  int lane = emu_tid() & 31, bank = emu_warp_bank();
  uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  memcpy(emu_warp_slot(bank, lane), mine, sizeof mine);
  emu_warp_barrier(EMU_MMA);
  MmaProduct &mp = mma_products[(cur->tid / 32) * 2 + bank];
  if (mp.stamp != cur->nwarp) {
    mma_form(mp, bank);
    mp.stamp = cur->nwarp;
  }
  int g = lane >> 2, t = lane & 3;
  for (int e = 0; e < 4; e++) c[e] = (float)(c[e] + mp.p[g + 8 * (e >> 1)][2 * t + (e & 1)]);
}

/* ---- cp.async ---------------------------------------------------------------- */

void emu_cp_async(void *dst, const void *src, int bytes, bool in) {
  const unsigned char *c = (const unsigned char *)dst;
  if (c < dyn_smem || c + bytes > dyn_smem + dyn_smem_size) die("cp.async out of shared memory");
  if ((uintptr_t)(c - dyn_smem) % bytes || (uintptr_t)src % bytes) die("cp.async misaligned");
  cur->cp_open.push_back({dst, in ? src : nullptr, bytes});
}

void emu_cp_commit() {
  cur->cp_groups.push_back(std::move(cur->cp_open));
  cur->cp_open.clear();
}

void emu_cp_wait(int n) {
  auto &g = cur->cp_groups;
  size_t land = g.size() > (size_t)n ? g.size() - (size_t)n : 0;
  for (size_t i = 0; i < land; i++)
    for (const EmuCopy &x : g[i])
      x.src ? (void)memcpy(x.dst, x.src, x.bytes) : (void)memset(x.dst, 0, x.bytes);
  g.erase(g.begin(), g.begin() + (long)land);
}
