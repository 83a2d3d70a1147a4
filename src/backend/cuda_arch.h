/* Which GPUs a CUDA build has code for: CMAKE_CUDA_ARCHITECTURES (the list
 * the kernels were compiled for, handed to the backend as ML_CUDA_ARCHS)
 * against a device's compute capability. Plain C, no CUDA: the CUDA
 * backend asks it before choosing a device, the unit tests ask it anywhere. */
#ifndef ML_BACKEND_CUDA_ARCH_H
#define ML_BACKEND_CUDA_ARCH_H

/* Whether `archs` (CMake's CUDA_ARCHITECTURES with ',' between the entries,
 * as CMakeLists.txt hands it over: each NN[a|f] with an optional -real or -virtual suffix, or all /
 * all-major) holds code a device of compute capability major.minor runs:
 * SASS of the same major and a minor not above the device's (an `a` variant:
 * that exact capability), or PTX of a
 * capability not above the device's that the driver compiles for it
 * (never an `a` or `f` variant's). Plain NN is both SASS and PTX.
 * Returns 1 (covered) or 0, or -1 with an error naming an entry it cannot
 * read. */
int ml_cuda_arch_covers(const char *archs, int major, int minor);

#endif
