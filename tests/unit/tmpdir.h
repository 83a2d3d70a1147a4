/* tmpdir.h: a private temporary directory for one cmocka test program.
 *
 * Use:
 *   #define _XOPEN_SOURCE 700             (before any #include: nftw, mkdtemp)
 *   #define TMPDIR_PREFIX "ml_test_xyz"   (optional; default "ml_test")
 *   ...system headers, <cmocka.h>...
 *   #include "tmpdir.h"
 *
 * and pass tmpdir_setup / tmpdir_teardown to cmocka_run_group_tests (or call
 * them from the program's own group fixtures). tmpdir_setup creates
 * /tmp/TMPDIR_PREFIX_XXXXXX as g_dir; tpath("name") is g_dir/name;
 * tmpdir_teardown removes g_dir and everything under it.
 *
 * Everything here is static: each test program gets its own copy. */
#ifndef ML_TESTS_TMPDIR_H
#define ML_TESTS_TMPDIR_H

#if !defined(_XOPEN_SOURCE) || _XOPEN_SOURCE < 500
#error "define _XOPEN_SOURCE 700 before any #include to use tmpdir.h"
#endif

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#ifndef TMPDIR_PREFIX
#define TMPDIR_PREFIX "ml_test"
#endif

/* The directory; mkdtemp fills in the Xs. */
static char g_dir[] = "/tmp/" TMPDIR_PREFIX "_XXXXXX";

/* g_dir/name; a small ring of buffers so a few can be live at once. */
static inline const char *tpath(const char *name) {
  static char bufs[4][512];
  static unsigned k;
  char *b = bufs[k++ % 4];
  snprintf(b, sizeof bufs[0], "%s/%s", g_dir, name);
  return b;
}

static inline int tmpdir_rm_entry(const char *p, const struct stat *sb, int flag,
                                  struct FTW *ftw) {
  (void)sb, (void)flag, (void)ftw;
  return remove(p);
}

/* cmocka group setup: create g_dir. */
static inline int tmpdir_setup(void **state) {
  (void)state;
  return mkdtemp(g_dir) ? 0 : -1;
}

/* cmocka group teardown: remove g_dir and its contents. */
static inline int tmpdir_teardown(void **state) {
  (void)state;
  return nftw(g_dir, tmpdir_rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

#endif /* ML_TESTS_TMPDIR_H */
