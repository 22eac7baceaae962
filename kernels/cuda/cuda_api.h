/* cuda_api.h — the plain-C entry points of libzps_cuda.so. kernels/device.c alone looks them
 * up (dlsym, into k_cuda_lib); every other caller goes through k_device_cuda_lib(). Compiled by
 * gcc (as declarations only) and by nvcc (the .cu files beside it define them). */
#ifndef ZPS_KERNELS_CUDA_API_H
#define ZPS_KERNELS_CUDA_API_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Counts the visible devices (CUDA_VISIBLE_DEVICES applies); fills name and uuid (16 bytes)
 * with device `device`'s when it exists, and msg with the CUDA error text when none answers.
 * Returns 0 when the query itself worked (count may still be 0). */
typedef int (*k_cuda_probe_fn)(int device, int *count, char *name, size_t name_len,
                               unsigned char *uuid, char *msg, size_t msg_len);
int k_cuda_probe(int device, int *count, char *name, size_t name_len, unsigned char *uuid,
                 char *msg, size_t msg_len);

/* The CUDA op table (kernels.h), initialised on visible device `device` (its streams, cuDNN
 * and cuBLAS handles) by the first call; NULL when initialisation fails or a later call asks
 * for another device. Defined in kernels/cuda/backend.cu. */
struct k_backend;
typedef const struct k_backend *(*k_cuda_backend_fn)(int device);
const struct k_backend *k_cuda_backend(int device);
/* Text of the last CUDA/cuDNN/cuBLAS failure in the library ("" when none). */
typedef const char *(*k_cuda_last_error_fn)(void);
const char *k_cuda_last_error(void);

/* ---- NCCL all-reduce (nccl_allreduce.cu); used by trainer/allreduce_nccl.c (tr_nccl_*) ----
 * A non-blocking communicator: no call waits for the peers or the device. Calls return 0
 * when done, 1 when NCCL is still at it in the background ("in progress": poll
 * k_nccl_progress until it answers 0 before the next call), -1 on failure with the NCCL/CUDA
 * error text in msg. */
#define K_NCCL_ID_BYTES 128 /* sizeof(ncclUniqueId) */
/* *version: the NCCL library's (ncclGetVersion: major * 10000 + minor * 100 + patch). */
typedef int (*k_nccl_version_fn)(int *version, char *msg, size_t msg_len);
int k_nccl_version(int *version, char *msg, size_t msg_len);
/* Rank 0 makes the id that every rank passes to k_nccl_init. */
typedef int (*k_nccl_unique_id_fn)(void *id, char *msg, size_t msg_len);
int k_nccl_unique_id(void *id, char *msg, size_t msg_len);
/* *comm: an opaque communicator of rank `rank` of n_ranks on CUDA device `device`; usable
 * once k_nccl_progress answers 0 (the ranks meet in the background). */
typedef int (*k_nccl_init_fn)(void **comm, int n_ranks, int rank, const void *id, int device,
                              char *msg, size_t msg_len);
int k_nccl_init(void **comm, int n_ranks, int rank, const void *id, int device, char *msg,
                size_t msg_len);
/* In place on n floats of device memory (sum, or mean when average), ordered after
 * everything the back-end's compute stream holds so far (an event, not the host). Once
 * settled, k_nccl_mark counts it; k_nccl_join makes the compute stream's later work wait for
 * every all-reduce queued so far. */
typedef int (*k_nccl_allreduce_async_fn)(void *comm, float *dev_buf, size_t n, int average,
                                         char *msg, size_t msg_len);
int k_nccl_allreduce_async(void *comm, float *dev_buf, size_t n, int average, char *msg,
                           size_t msg_len);
/* In place on n floats of device memory: rank root's values on every rank, ordered like
 * k_nccl_allreduce_async (after the compute stream's work so far); mark and join it the same
 * way (a node's new values, sync_node_dev.c). */
typedef int (*k_nccl_broadcast_async_fn)(void *comm, float *dev_buf, size_t n, int root,
                                         char *msg, size_t msg_len);
int k_nccl_broadcast_async(void *comm, float *dev_buf, size_t n, int root, char *msg,
                           size_t msg_len);
/* Records event (the cuda back-end's k_event) on NCCL's stream: a point after every
 * collective queued so far, which the back-end's queues can wait for (event_wait). */
typedef int (*k_nccl_record_fn)(void *comm, void *event, char *msg, size_t msg_len);
int k_nccl_record(void *comm, void *event, char *msg, size_t msg_len);
/* Queues, behind what NCCL's stream holds, a host function that counts one more sum
 * finished (k_nccl_progress's *finished), and counts it posted. */
typedef int (*k_nccl_mark_fn)(void *comm, char *msg, size_t msg_len);
int k_nccl_mark(void *comm, char *msg, size_t msg_len);
typedef int (*k_nccl_join_fn)(void *comm, char *msg, size_t msg_len);
int k_nccl_join(void *comm, char *msg, size_t msg_len);
/* The communicator's state (ncclCommGetAsyncError: 0 ready, 1 in progress, -1 failed: a
 * peer connection or a kernel) and *posted sums marked, *finished of them done on the
 * device. Serialised with the other calls by the caller; after an abort only the counters. */
typedef int (*k_nccl_progress_fn)(void *comm, unsigned long long *posted,
                                  unsigned long long *finished, char *msg, size_t msg_len);
int k_nccl_progress(void *comm, unsigned long long *posted, unsigned long long *finished,
                    char *msg, size_t msg_len);
/* ncclCommAbort, from any thread no other NCCL call of this communicator is in: the kernels
 * still waiting for peers return (their sums are garbage), and the communicator is gone;
 * only progress and destroy may follow. Once only (later calls do nothing). */
typedef int (*k_nccl_abort_fn)(void *comm, char *msg, size_t msg_len);
int k_nccl_abort(void *comm, char *msg, size_t msg_len);
/* ncclCommFinalize: flushes this rank's work and meets the other ranks' finalize, in the
 * background (poll k_nccl_progress); after it, k_nccl_destroy does not wait. */
typedef int (*k_nccl_finalize_fn)(void *comm, char *msg, size_t msg_len);
int k_nccl_finalize(void *comm, char *msg, size_t msg_len);
/* Frees the communicator (unless aborted) and its stream. Finalize (settled) or abort first:
 * ncclCommDestroy otherwise waits for the queued work and for the node's other ranks. */
typedef int (*k_nccl_destroy_fn)(void *comm);
int k_nccl_destroy(void *comm);

#ifdef __cplusplus
}
#endif

#endif
