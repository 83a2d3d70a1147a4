// The CPU emulation of the CUDA features attention.cu uses (emu.h): each GPU
// thread is a fiber (ucontext) scheduled cooperatively at block barriers and
// warp collectives, with checks for divergence and deadlock; shared memory is
// an exact-size buffer (AddressSanitizer sees overruns) filled with NaN; mma
// and ldmatrix follow the PTX ISA fragment layouts.
#include "emu.h"

#include <sanitizer/common_interface_defs.h>
#include <ucontext.h>

#include <map>
#include <random>
#include <vector>

enum { RUN, WAIT_BLOCK, WAIT_WARP, DONE };
struct EmuThread {
  ucontext_t ctx;
  char *stack;
  unsigned tid;
  int state;
  long nblock = 0, nwarp = 0;  // barrier counts (divergence check)
  void *fake = nullptr;
};
EmuThread *emu_cur;
emu_dim emu_block_idx, emu_grid_dim, emu_block_dim;
unsigned char *emu_smem_ptr;
size_t emu_smem_size;
static ucontext_t sched_ctx;
static const void *sched_bottom;
static size_t sched_size;
static std::vector<EmuThread> threads;
static std::vector<unsigned char> slots;  // per warp 32 lanes x 64 bytes
static const std::function<void()> *body;
static cudaError_t last_error = cudaSuccess;
static std::map<const void *, int> smem_attr;
int emu_order = 0;  // 0 forward, 1 reverse, 2 random
unsigned emu_seed = 1;
long emu_switches = 0;
enum { STACK = 256 * 1024 };

unsigned emu_tid() { return emu_cur->tid; }
void *emu_warp_slot(int lane) { return &slots[((emu_cur->tid / 32) * 32 + lane) * 64]; }

static void yield_to_sched() {
  EmuThread *me = emu_cur;
  __sanitizer_start_switch_fiber(&me->fake, sched_bottom, sched_size);
  swapcontext(&me->ctx, &sched_ctx);
  __sanitizer_finish_switch_fiber(me->fake, &sched_bottom, &sched_size);
}
void emu_syncthreads() {
  emu_cur->state = WAIT_BLOCK;
  emu_cur->nblock++;
  yield_to_sched();
}
void emu_warp_barrier() {
  emu_cur->state = WAIT_WARP;
  emu_cur->nwarp++;
  yield_to_sched();
}

static void entry() {
  __sanitizer_finish_switch_fiber(nullptr, &sched_bottom, &sched_size);
  (*body)();
  emu_cur->state = DONE;
  __sanitizer_start_switch_fiber(nullptr, sched_bottom, sched_size);
  swapcontext(&emu_cur->ctx, &sched_ctx);  // never resumed
}

static void die(const char *m) {
  fprintf(stderr, "EMU ERROR: %s (block %u)\n", m, emu_block_idx.x);
  abort();
}

static void run_block(unsigned nthreads, std::mt19937 &rng) {
  threads.assign(nthreads, EmuThread());
  slots.assign(((nthreads + 31) / 32) * 32 * 64, 0xEE);
  for (unsigned i = 0; i < nthreads; i++) {
    EmuThread &t = threads[i];
    t.tid = i;
    t.state = RUN;
    t.stack = (char *)malloc(STACK);
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = t.stack;
    t.ctx.uc_stack.ss_size = STACK;
    t.ctx.uc_link = nullptr;
    makecontext(&t.ctx, entry, 0);
  }
  std::vector<unsigned> order(nthreads);
  for (;;) {
    for (unsigned i = 0; i < nthreads; i++) order[i] = i;
    if (emu_order == 1) std::reverse(order.begin(), order.end());
    if (emu_order == 2) std::shuffle(order.begin(), order.end(), rng);
    for (unsigned i : order) {
      EmuThread &t = threads[i];
      if (t.state != RUN) continue;
      emu_cur = &t;
      void *fake = nullptr;
      __sanitizer_start_switch_fiber(&fake, t.stack, STACK);
      swapcontext(&sched_ctx, &t.ctx);
      __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
      emu_switches++;
    }
    bool all_done = true, released = false;
    for (auto &t : threads) all_done &= t.state == DONE;
    if (all_done) break;
    // warp barriers
    unsigned nw = (nthreads + 31) / 32;
    for (unsigned w = 0; w < nw; w++) {
      int nwait = 0, ndone = 0, n = 0;
      long cnt = -1;
      for (unsigned i = w * 32; i < std::min(nthreads, w * 32 + 32); i++, n++) {
        if (threads[i].state == WAIT_WARP) {
          nwait++;
          if (cnt >= 0 && threads[i].nwarp != cnt) die("warp collective count mismatch");
          cnt = threads[i].nwarp;
        }
        if (threads[i].state == DONE) ndone++;
      }
      if (nwait == n) {
        for (unsigned i = w * 32; i < w * 32 + 32; i++) threads[i].state = RUN;
        released = true;
      } else if (nwait && ndone)
        die("warp collective with exited lanes");
    }
    if (released) continue;
    int nwait = 0, ndone = 0;
    long cnt = -1;
    for (auto &t : threads) {
      if (t.state == WAIT_BLOCK) {
        nwait++;
        if (cnt >= 0 && t.nblock != cnt) die("syncthreads count mismatch");
        cnt = t.nblock;
      }
      if (t.state == DONE) ndone++;
    }
    if (nwait == (int)nthreads) {
      for (auto &t : threads) t.state = RUN;
      continue;
    }
    if (nwait && ndone) die("syncthreads with exited threads");
    die("deadlock");
  }
  for (auto &t : threads) free(t.stack);
}

size_t emu_max_smem(const void *k) {
  auto it = smem_attr.find(k);
  return it == smem_attr.end() ? 48 * 1024 : (size_t)it->second;
}
cudaError_t emu_set_smem(const void *k, int bytes) {
  if (bytes > 232448) return cudaErrorInvalidValue;  // sm_90 opt-in limit (227 KiB)
  smem_attr[k] = bytes;
  return cudaSuccess;
}
extern "C" cudaError_t cudaGetLastError(void) {
  cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}
size_t emu_blocks_run = 0;
void emu_run_grid(const void *k, unsigned grid, unsigned block, size_t smem,
                  const std::function<void()> &b) {
  if (grid < 1 || grid > 2147483647u || block < 1 || block > 1024 || smem > emu_max_smem(k)) {
    fprintf(stderr, "EMU: bad launch grid %u block %u smem %zu (max %zu)\n", grid, block, smem,
            emu_max_smem(k));
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  body = &b;
  std::mt19937 rng(emu_seed);
  std::vector<unsigned> blocks(grid);
  for (unsigned i = 0; i < grid; i++) blocks[i] = i;
  if (emu_order == 1) std::reverse(blocks.begin(), blocks.end());
  if (emu_order == 2) std::shuffle(blocks.begin(), blocks.end(), rng);
  emu_grid_dim = {grid, 1, 1};
  emu_block_dim = {block, 1, 1};
  for (unsigned bid : blocks) {
    emu_block_idx = {bid, 0, 0};
    emu_smem_size = smem;
    emu_smem_ptr = (unsigned char *)malloc(smem ? smem : 1);
    memset(emu_smem_ptr, 0xFF, smem);  // NaN in fp32 and bf16
    run_block(block, rng);
    free(emu_smem_ptr);
    emu_blocks_run++;
  }
}

static void check_smem(const void *p, size_t bytes) {
  const unsigned char *c = (const unsigned char *)p;
  if (c < emu_smem_ptr || c + bytes > emu_smem_ptr + emu_smem_size) die("ldmatrix out of smem");
  if ((uintptr_t)(c - emu_smem_ptr) % 16) die("ldmatrix row misaligned");
}

void emu_ldsm(uint32_t (&r)[4], const __nv_bfloat16 *p, bool trans) {
  int lane = emu_tid() & 31;
  check_smem(p, 16);
  memcpy(emu_warp_slot(lane), &p, sizeof p);
  emu_warp_barrier();
  const __nv_bfloat16 *rows[32];
  for (int l = 0; l < 32; l++) memcpy(&rows[l], emu_warp_slot(l), sizeof rows[l]);
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
  emu_warp_barrier();
}

static float lo(uint32_t u) { return __bfloat162float({(uint16_t)(u & 0xffff)}); }
static float hi(uint32_t u) { return __bfloat162float({(uint16_t)(u >> 16)}); }

void emu_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  int lane = emu_tid() & 31;
  uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  memcpy(emu_warp_slot(lane), mine, sizeof mine);
  emu_warp_barrier();
  float A[16][16], B[16][8];
  for (int L = 0; L < 32; L++) {
    uint32_t f[6];
    memcpy(f, emu_warp_slot(L), sizeof f);
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
  int g = lane >> 2, t = lane & 3;
  for (int e = 0; e < 4; e++) {
    int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
    double acc = c[e];
    for (int k = 0; k < 16; k++) acc += (double)A[row][k] * B[k][col];
    c[e] = (float)acc;
  }
  emu_warp_barrier();
}
