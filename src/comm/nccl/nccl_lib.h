/* NCCL's entry points, loaded from libnccl.so.2 at run time (dlopen) rather
 * than linked: a CUDA build then starts on a machine without NCCL (where
 * meshes of several ranks use the staged comm, comm/comm_staged.h), and
 * the bundle for the GPU machine need not carry NCCL's 200 MiB. Compiled
 * against nccl.h (CMake finds it: ML_HAVE_NCCL); the library loaded must be
 * of the same major version, 2. */
#ifndef ML_COMM_NCCL_LIB_H
#define ML_COMM_NCCL_LIB_H

#include <nccl.h>

/* The functions meshlm calls, under their NCCL names without the prefix. */
typedef struct ml_nccl_lib {
  ncclResult_t (*GetVersion)(int *version);
  ncclResult_t (*GetUniqueId)(ncclUniqueId *id);
  ncclResult_t (*CommInitRank)(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank);
  ncclResult_t (*CommDestroy)(ncclComm_t comm);
  ncclResult_t (*CommAbort)(ncclComm_t comm);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t comm, ncclResult_t *error);
  const char *(*GetErrorString)(ncclResult_t result);
  const char *(*GetLastError)(ncclComm_t comm);
  ncclResult_t (*AllReduce)(const void *send, void *recv, size_t count, ncclDataType_t type,
                            ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
  ncclResult_t (*AllGather)(const void *send, void *recv, size_t count, ncclDataType_t type,
                            ncclComm_t comm, cudaStream_t stream);
  ncclResult_t (*ReduceScatter)(const void *send, void *recv, size_t count, ncclDataType_t type,
                                ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
  ncclResult_t (*Send)(const void *send, size_t count, ncclDataType_t type, int peer,
                       ncclComm_t comm, cudaStream_t stream);
  ncclResult_t (*Recv)(void *recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                       cudaStream_t stream);
  ncclResult_t (*GroupStart)(void);
  ncclResult_t (*GroupEnd)(void);
  int version; /* GetVersion's: 10000·major + 100·minor + patch (2.30.0: 23000) */
} ml_nccl_lib;

/* NCCL, loaded on the first call and kept for the process. Errors (the
 * same on every later call): libnccl.so.2 not found or not loadable (with
 * dlerror's text), an entry point missing, a major version other than 2. */
int ml_nccl_lib_get(const ml_nccl_lib **out);

/* 0 for ncclSuccess, else −1 with "NCCL WHAT on group 'GROUP' failed:
 * <ncclGetErrorString> (<ncclGetLastError>)" recorded; comm may be NULL. */
int ml_nccl_check(const ml_nccl_lib *lib, ncclResult_t rc, ncclComm_t comm, const char *what,
                  const char *group);

#endif
