/* Prints the OpenBLAS kernel family in use ("core=NAME"): CMake runs it
 * once to learn the default (the parity tests' second kernel is one of
 * another family) and CTest runs it under OPENBLAS_CORETYPE to show that
 * the variable takes effect. */
#include <stdio.h>

char *openblas_get_corename(void);

int main(void) {
  printf("core=%s\n", openblas_get_corename());
  return 0;
}
