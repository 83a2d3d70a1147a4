/* What an MPI test holds (engines and meshes, fixtures, batches, exported
 * tensors), so that a failed assertion, which longjmps out of the test
 * function, still releases it: every test runs with release_held as its
 * cmocka teardown, which releases whatever is still held, newest first.
 * On the normal path the usual close/free functions release their object
 * and drop it from the list (unhold). A held object must be static or on
 * the heap, never a local of the test (hold aborts on a stack address): the
 * longjmp leaves test frames behind that the teardown's calls overwrite. */
#ifndef ML_HELD_H
#define ML_HELD_H

typedef void (*held_release_fn)(void *);

/* Hold p until unhold(p) or the teardown, which calls release(p). */
void hold(void *p, held_release_fn release);
/* Drop p from the list without releasing it (its owner does). */
void unhold(void *p);
/* cmocka teardown: release everything still held, newest first. */
int release_held(void **state);

/* The end of an MPI test program's main: `failed` is this rank's count of
 * failed tests; returns 1 (after MPI_Finalize) when any rank failed one,
 * else 0, so every rank's exit status tells the whole run's result. */
int held_finish(int failed);

/* A test function run with release_held as its teardown. */
#define held_test(f) cmocka_unit_test_teardown(f, release_held)

#endif
