/* CUDA_ARCHITECTURES against a device's compute capability (cuda_arch.h). */
#include "backend/cuda_arch.h"

#include <stdbool.h>
#include <string.h>

#include "common/status.h"

/* Entry [p, p + n) of the list against capability cc (10·major + minor):
 * 1 covers, 0 does not, -1 unreadable. */
static int entry_covers(const char *p, size_t n, int cc) {
  if ((n == 3 && !strncmp(p, "all", 3)) || (n == 9 && !strncmp(p, "all-major", 9))) return 1;
  const char *q = p, *end = p + n;
  int arch = 0;
  for (; q < end && *q >= '0' && *q <= '9' && arch < 10000; q++) arch = 10 * arch + (*q - '0');
  if (q == p || arch < 10) return -1;
  char variant = q < end && (*q == 'a' || *q == 'f') ? *q++ : 0;
  bool sass = true, ptx = true;
  if (end - q == 5 && !strncmp(q, "-real", 5))
    ptx = false, q = end;
  else if (end - q == 8 && !strncmp(q, "-virtual", 8))
    sass = false, q = end;
  if (q != end) return -1;
  if (sass && arch / 10 == cc / 10 && (variant == 'a' ? arch == cc : arch % 10 <= cc % 10))
    return 1;
  return ptx && !variant && arch <= cc;
}

int ml_cuda_arch_covers(const char *archs, int major, int minor) {
  int covered = 0;
  for (const char *p = archs; *p;) {
    size_t n = strcspn(p, ",");
    if (n > 0) {
      int rc = entry_covers(p, n, 10 * major + minor);
      if (rc < 0)
        return ml_err("CUDA architectures '%s': cannot read the entry '%.*s' (expected NN, NNa or "
                      "NNf, optionally -real or -virtual, or all, all-major)",
                      archs, (int)n, p);
      covered |= rc;
    }
    p += p[n] ? n + 1 : n;
  }
  return covered;
}
