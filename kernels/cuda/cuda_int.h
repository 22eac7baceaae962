/* cuda_int.h — what the .cu files of libzps_cuda.so share and export to nobody (nvcc only).
 *
 * The CUDA back-end is split by job, one translation unit each, all on one compute stream:
 *   backend.cu    the table (k_cuda_backend), the device and its two streams, memory, the
 *                 asynchronous group (pinned memory, copies, events), elementwise ops,
 *                 reductions, concat, dropout, the losses, the optimizer
 *   conv.cu       convolutions (cuDNN, float and BF16 tensor cores) and k_pack_bf16
 *   dense.cu      dense layers (cuBLAS)
 *   bn_pool.cu    batchnorm and pooling kernels
 *   nccl_allreduce.cu, probe.cu   NCCL and the device probe (cuda_api.h)
 * Kernels are launched only from the file that defines them (no relocatable device code).
 */
#ifndef ZPS_KERNELS_CUDA_INT_H
#define ZPS_KERNELS_CUDA_INT_H

#include <cuda_runtime.h>
#include <stdio.h>

#include "common/try.h"
#include "kernels/kernels.h"

/* The text of the latest failure (k_cuda_last_error): this library cannot call zps_log (it is
 * dlopened by binaries that do not export it). */
extern char k_cuda_err[256];
/* The back-end's compute stream: every op, cuDNN and cuBLAS run on it. NULL (the legacy
 * stream) before k_cuda_backend opened the device. */
extern cudaStream_t k_cuda_stream;

/* backend.h's k_event on this back-end (nccl_allreduce.cu records them on NCCL's stream). */
struct k_event {
    cudaEvent_t ev; // timing disabled: only ordering
};

/* Checks a CUDA (or, with the files' own KC_CUDNN and KC_CUBLAS, cuDNN or cuBLAS) call: on
 * failure keeps file:line, the call and the library's own text in k_cuda_err and returns
 * status. */
#define KC_CHECK(type, ok, text, status, expr)                                         \
    do {                                                                               \
        type e_ = (expr);                                                              \
        if (e_ != (ok)) {                                                              \
            snprintf(k_cuda_err, sizeof k_cuda_err, "%s:%d %s: %s", __FILE__, __LINE__, \
                     #expr, text(e_));                                                 \
            return status;                                                             \
        }                                                                              \
    } while (0)
#define KC_CUDA(expr) KC_CHECK(cudaError_t, cudaSuccess, cudaGetErrorString, ZPS_ERR_CUDA, expr)
#define KC_LAUNCHED() KC_CUDA(cudaGetLastError())

/* Threads per block of the grid-stride kernels, and their blocks over n elements: at least
 * 1, so n = 0 is a launch that does nothing (a grid of 0 blocks is
 * cudaErrorInvalidConfiguration), as ref's loops do nothing. */
#define KC_T 256
static inline unsigned kc_blocks(size_t n)
{
    size_t b = (n + KC_T - 1) / KC_T;
    return (unsigned)(b < 1 ? 1 : b < 65535 ? b : 65535);
}
#define KC_LOOP(i, n)                                                                  \
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n);           \
         i += (size_t)blockDim.x * gridDim.x)

/* What a descriptor's impl holds (its first int), for k_backend.release. */
enum { KC_IMPL_CONV = 1, KC_IMPL_BN = 2 };

/* buf (device, or pinned host) holds at least bytes afterwards; a growth frees the old one
 * first (cudaFree waits for the device). backend.cu. */
zps_status k_cuda_grow(void **buf, size_t *cap, size_t bytes, int host);

/* conv.cu: the cuDNN handle on the compute stream (once, by k_cuda_backend); the ops; a
 * descriptor's state freed (k_backend.release) */
zps_status k_cuda_conv_open(void);
k_conv2d_fwd_fn k_cuda_conv2d_fwd;
k_conv2d_bwd_fn k_cuda_conv2d_bwd;
k_pack_bf16_fn k_cuda_pack_bf16;
void k_cuda_conv_release(void *impl);

/* dense.cu: the cuBLAS handle on the compute stream (once); the ops */
zps_status k_cuda_dense_open(void);
k_dense_fwd_fn k_cuda_dense_fwd;
k_dense_bwd_fn k_cuda_dense_bwd;

/* bn_pool.cu: the ops; a batchnorm descriptor's scratch freed */
k_bn_fwd_train_fn k_cuda_bn_fwd_train;
k_bn_fwd_infer_fn k_cuda_bn_fwd_infer;
k_bn_bwd_fn k_cuda_bn_bwd;
k_pool_fwd_fn k_cuda_pool_fwd;
k_pool_bwd_fn k_cuda_pool_bwd;
void k_cuda_bn_release(void *impl);

#endif
