/* The device comms against the MPI comm: `mpiexec -n N test_device_comm
 * DEVICE` (cpu or cuda; exits 77, skipped, when DEVICE cannot be opened:
 * no GPU, or a build without CUDA). On DEVICE's memory, each comm runs
 * every collective of comm.h — all-reduce (fp32 SUM, MAX, MIN; bf16 SUM),
 * all-gather and reduce-scatter (fp32, bf16), the ring pass (fp32), the
 * all-to-all with uneven blocks (fp32: ml_iall_to_all_v, expert
 * parallelism's exchange; rank q sends a2a_count(q, r) elements to r), all
 * issued before any is waited on, waited in reverse order, then once more
 * blocking — and its results, copied to the host, must equal bit for bit
 * the MPI comm's on host copies of the same inputs:
 *  - the staged comm (comm/comm_staged.h) on every device: the same MPI
 *    calls on the same bytes;
 *  - the NCCL comm (comm/nccl/comm_nccl.h) on cuda, when NCCL can serve
 *    the ranks (ml_nccl_usable; with 2 ranks on one GPU only under
 *    NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1, else it prints why and
 *    is not run): one rank is a 1-rank communicator; on two ranks a sum is
 *    one addition, and the inputs (multiples of 1/8 of small magnitude)
 *    make any order exact anyway.
 * Checks that fail on some ranks are agreed on after the collectives, so
 * no rank is left waiting, and every rank exits with the same status.
 * `test_device_comm cuda watchdog` checks the NCCL watchdog (below). */
#include <mpi.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "comm/comm_mpi.h"
#include "comm/comm_staged.h"
#include "comm/node.h"
#include "common/status.h"
#include "tensor/dtype.h"
#ifdef ML_HAVE_NCCL
#include "comm/nccl/comm_nccl.h"
#endif

enum { N = 1031 }; /* elements per rank: odd, so no size is a multiple of a vector's */

static int g_rank, g_size, g_fails;

static void failed(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void failed(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "rank %d: FAIL ", g_rank);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  g_fails++;
}

/* Element i of rank q's input: a multiple of 1/8 in [−2, 2]. */
static float val(int q, int64_t i) { return (float)((int)((q * 7 + i * 5) % 33) - 16) * 0.125f; }

/* The collectives of one round, by index. */
enum { AR_SUM, AR_MAX, AR_MIN, AR_BF16, AG, AG_BF16, RS, RS_BF16, RING, A2A, KINDS };
static const char *const k_names[KINDS] = {"all_reduce f32 SUM", "all_reduce f32 MAX",
                                           "all_reduce f32 MIN", "all_reduce bf16 SUM",
                                           "all_gather f32",     "all_gather bf16",
                                           "reduce_scatter f32", "reduce_scatter bf16",
                                           "ring pass f32",      "all_to_all_v f32"};

/* Elements rank q sends to rank r in the all-to-all: uneven, 1 .. 97 (some blocks
 * shorter than a vector, none a multiple of another's). */
static int64_t a2a_count(int q, int r) { return 1 + (q * 37 + r * 61 + 11) % 97; }
enum { MAX_RANKS = 64 };
static int64_t g_a2a_send[MAX_RANKS], g_a2a_recv[MAX_RANKS]; /* this rank's counts */
static size_t g_a2a_in, g_a2a_out;                           /* their sums */

/* Bytes of kind k's input and output on a group of g_size ranks. */
static size_t in_bytes(int k) {
  if (k == A2A) return g_a2a_in * 4;
  size_t e = k == AR_BF16 || k == AG_BF16 || k == RS_BF16 ? 2 : 4;
  return (k == RS || k == RS_BF16 ? (size_t)g_size : 1) * N * e;
}
static size_t out_bytes(int k) {
  if (k == A2A) return g_a2a_out * 4;
  size_t e = k == AR_BF16 || k == AG_BF16 || k == RS_BF16 ? 2 : 4;
  return (k == AG || k == AG_BF16 ? (size_t)g_size : 1) * N * e;
}

/* Issue kind k on c: buf (all-reduce, in place) or send → recv. */
static int issue(ml_comm *c, int k, void *send, void *recv, ml_request *req) {
  switch (k) {
    case AR_SUM: return ml_iall_reduce(c, send, N, ML_ELEM_F32, ML_RED_SUM, req);
    case AR_MAX: return ml_iall_reduce(c, send, N, ML_ELEM_F32, ML_RED_MAX, req);
    case AR_MIN: return ml_iall_reduce(c, send, N, ML_ELEM_F32, ML_RED_MIN, req);
    case AR_BF16: return ml_iall_reduce(c, send, N, ML_ELEM_BF16, ML_RED_SUM, req);
    case AG: return ml_iall_gather(c, send, recv, N, ML_ELEM_F32, req);
    case AG_BF16: return ml_iall_gather(c, send, recv, N, ML_ELEM_BF16, req);
    case RS: return ml_ireduce_scatter(c, send, recv, N, ML_ELEM_F32, req);
    case RS_BF16: return ml_ireduce_scatter(c, send, recv, N, ML_ELEM_BF16, req);
    case RING: return ml_iring_pass(c, send, recv, N, ML_ELEM_F32, req);
    default:
      return ml_iall_to_all_v(c, send, g_a2a_send, recv, g_a2a_recv, ML_ELEM_F32, req);
  }
}

/* The inputs of kind k on this rank, host memory. */
static void fill(int k, void *h) {
  size_t n = in_bytes(k) / (k == AR_BF16 || k == AG_BF16 || k == RS_BF16 ? 2 : 4);
  for (size_t i = 0; i < n; i++) {
    /* the all-to-all moves bits: every element distinct, so a block misplaced shows */
    float v = k == A2A ? (float)(g_rank * 100000 + (int64_t)i) : val(g_rank, (int64_t)i);
    if (k == AR_BF16 || k == AG_BF16 || k == RS_BF16)
      ((uint16_t *)h)[i] = ml_f32_to_bf16(v);
    else
      ((float *)h)[i] = v;
  }
}

/* Every kind on `dev` (device buffers of be) against `ref` (MPI, host),
 * nonblocking (all in flight at once) when nonblocking, else one by one. */
static void compare(const char *label, ml_comm *dev, ml_comm *ref, ml_backend *be,
                    int nonblocking) {
  void *d_in[KINDS], *d_out[KINDS], *h_in[KINDS], *h_out[KINDS], *got[KINDS];
  ml_request rd[KINDS], rh[KINDS];
  int issued = 0;
  for (int k = 0; k < KINDS; k++) {
    d_in[k] = ml_be_alloc(be, (int64_t)in_bytes(k), 1, "test input");
    d_out[k] = ml_be_alloc(be, (int64_t)out_bytes(k), 1, "test output");
    h_in[k] = malloc(in_bytes(k));
    h_out[k] = malloc(out_bytes(k));
    got[k] = malloc(in_bytes(k) > out_bytes(k) ? in_bytes(k) : out_bytes(k));
    if (!d_in[k] || !d_out[k] || !h_in[k] || !h_out[k] || !got[k]) {
      fprintf(stderr, "rank %d: out of memory: %s\n", g_rank, ml_error_msg());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    fill(k, h_in[k]);
    if (ml_be_copy(be, d_in[k], h_in[k], in_bytes(k), ML_COPY_H2D)) failed("%s", ml_error_msg());
  }
  for (int k = 0; k < KINDS; k++) {
    if (issue(ref, k, h_in[k], h_out[k], &rh[k]) ||
        issue(dev, k, d_in[k], d_out[k], &rd[k])) {
      failed("%s: issuing %s: %s", label, k_names[k], ml_error_msg());
      break;
    }
    issued++;
    if (!nonblocking && (ml_wait(ref, &rh[k]) || ml_wait(dev, &rd[k])))
      failed("%s: %s: %s", label, k_names[k], ml_error_msg());
  }
  for (int k = issued - 1; nonblocking && k >= 0; k--)
    if (ml_wait(dev, &rd[k]) || ml_wait(ref, &rh[k]))
      failed("%s: waiting on %s: %s", label, k_names[k], ml_error_msg());
  for (int k = 0; k < issued; k++) {
    int in_place = k <= AR_BF16;
    size_t bytes = in_place ? in_bytes(k) : out_bytes(k);
    if (ml_be_copy(be, got[k], in_place ? d_in[k] : d_out[k], bytes, ML_COPY_D2H))
      failed("%s: %s", label, ml_error_msg());
    else if (memcmp(got[k], in_place ? h_in[k] : h_out[k], bytes) != 0)
      failed("%s: %s (%s): differs from the MPI comm's", label, k_names[k],
             nonblocking ? "all in flight" : "one at a time");
  }
  for (int k = 0; k < KINDS; k++) {
    ml_be_free(be, d_in[k]);
    ml_be_free(be, d_out[k]);
    free(h_in[k]);
    free(h_out[k]);
    free(got[k]);
  }
  if (g_rank == 0) printf("%s: %d collectives compared (%s)\n", label, issued,
                          nonblocking ? "all in flight" : "one at a time");
}

/* Both rounds of `dev` against a fresh MPI comm. */
static void check_comm(const char *label, ml_comm *dev, ml_backend *be) {
  ml_comm *ref;
  if (ml_comm_mpi_create(MPI_COMM_WORLD, "world", &ref)) {
    failed("MPI comm: %s", ml_error_msg());
    return;
  }
  compare(label, dev, ref, be, 1);
  compare(label, dev, ref, be, 0);
  ml_comm_destroy(ref);
}

#ifdef ML_HAVE_NCCL
/* The NCCL comm where NCCL can serve these ranks. */
static void check_nccl(ml_backend *be) {
  char why[512];
  int ok;
  if (ml_nccl_usable(MPI_COMM_WORLD, be, &ok, why, sizeof why)) {
    failed("ml_nccl_usable: %s", ml_error_msg());
    return;
  }
  if (!ok) {
    if (g_rank == 0) printf("nccl on %d rank(s): not run: %s\n", g_size, why);
    return;
  }
  ml_comm *c;
  if (ml_comm_nccl_create(be, MPI_COMM_WORLD, "world", 60, &c)) {
    failed("ml_comm_nccl_create (%s): %s", why, ml_error_msg());
    return;
  }
  char label[600];
  snprintf(label, sizeof label, "nccl on %d rank(s) (%s)", g_size, why);
  check_comm(label, c, be);
  ml_comm_destroy(c);
}

/* The watchdog (comm/nccl/watchdog.h), `test_device_comm cuda watchdog` on 2
 * ranks: rank 1 never issues the all-reduce rank 0 issues and waits for, so
 * rank 0's watchdog must end the job once the collective is 2 s old, its
 * message naming the collective, its bytes and the group (the test's
 * PASS_REGULAR_EXPRESSION); returning from here is the failure. */
static int watchdog(ml_backend *be) {
  char why[512];
  int ok = 0;
  ml_comm *c;
  if (ml_nccl_usable(MPI_COMM_WORLD, be, &ok, why, sizeof why)) {
    fprintf(stderr, "FAIL: watchdog: ml_nccl_usable: %s\n", ml_error_msg());
    return 1;
  }
  if (!ok) {
    if (g_rank == 0) printf("not run: the watchdog needs NCCL: %s\n", why);
    return 77;
  }
  if (g_size != 2 || ml_comm_nccl_create(be, MPI_COMM_WORLD, "world", 2.0, &c)) {
    fprintf(stderr, "FAIL: watchdog: expected 2 ranks and an NCCL comm (%s)\n", ml_error_msg());
    return 1;
  }
  if (g_rank == 0) {
    ml_request req;
    float *buf = ml_be_alloc(be, N, sizeof(float), "the watchdog's buffer");
    if (buf && ml_be_zero(be, buf, N * sizeof(float)) == 0 &&
        ml_iall_reduce(c, buf, N, ML_ELEM_F32, ML_RED_SUM, &req) == 0 && ml_wait(c, &req) == 0)
      ml_be_sync(be); /* blocks until the watchdog ends the process */
  } else {
    sleep(60);
  }
  fprintf(stderr, "rank %d: FAIL: the watchdog did not end the job (%s)\n", g_rank,
          ml_error_msg());
  return 1;
}
#endif

int main(int argc, char **argv) {
  if (argc != 2 && !(argc == 3 && strcmp(argv[2], "watchdog") == 0)) {
    fprintf(stderr, "usage: mpiexec -n N test_device_comm cpu|cuda [watchdog]\n");
    return 2;
  }
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  if (g_size > MAX_RANKS) {
    if (g_rank == 0) fprintf(stderr, "test_device_comm: at most %d ranks\n", MAX_RANKS);
    MPI_Finalize();
    return 2;
  }
  for (int r = 0; r < g_size; r++) {
    g_a2a_in += (size_t)(g_a2a_send[r] = a2a_count(g_rank, r));
    g_a2a_out += (size_t)(g_a2a_recv[r] = a2a_count(r, g_rank));
  }
  int local = 0, opened, all;
  ml_backend *be = NULL;
  opened = ml_node_rank(MPI_COMM_WORLD, &local) == 0 && ml_backend_get(argv[1], local, &be) == 0;
  MPI_Allreduce(&opened, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all) {
    if (g_rank == 0)
      printf("skipped: device %s: %s\n", argv[1],
             opened ? "another rank could not open it" : ml_error_msg());
    MPI_Finalize();
    return 77;
  }
#ifdef ML_HAVE_NCCL
  if (argc == 3) {
    int rc = ml_be_host_memory(be) ? 2 : watchdog(be);
    MPI_Finalize();
    return rc;
  }
#endif
  ml_comm *staged;
  if (ml_comm_staged_create(be, MPI_COMM_WORLD, "world", &staged)) {
    failed("ml_comm_staged_create: %s", ml_error_msg());
  } else {
    char label[64];
    snprintf(label, sizeof label, "staged on %s, %d rank(s)", argv[1], g_size);
    check_comm(label, staged, be);
    ml_comm_destroy(staged);
  }
#ifdef ML_HAVE_NCCL
  if (!ml_be_host_memory(be)) check_nccl(be);
#endif
  int fails = 0;
  MPI_Allreduce(&g_fails, &fails, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (g_rank == 0)
    printf("%s: %d failure(s) over %d rank(s)\n", fails ? "FAIL" : "ok", fails, g_size);
  ml_backend_release_all();
  MPI_Finalize();
  return fails ? 1 : 0;
}
