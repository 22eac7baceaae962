/* backend.h — the back-end interface of the kernels: one table of function pointers per
 * back-end (ggml-backend's shape), filled by the back-end itself and read by the k_* dispatch
 * functions of kernels.h. The op API (what each op computes) is kernels.h's; this header says
 * what a back-end must provide and how.
 *
 * The back-ends and their tables:
 *   "ref"   kernels/ref/     plain C loops, the oracle (k_backend_ref)
 *   "cpu"   kernels/cpu/     oneDNN for convolution, batchnorm, pooling and inner product;
 *                            its table names ref's functions for every other op
 *   "cuda"  kernels/cuda/    cuDNN/cuBLAS and own kernels in build/lib/libzps_cuda.so,
 *                            reached through kernels/device.c (k_backend_cuda)
 *
 * Contract of a table:
 *   - Every entry is set. There is no implicit fallback: a back-end that does not accelerate
 *     an op names another back-end's function for it explicitly (cpu names ref's), which is
 *     only possible between back-ends that share host memory. A NULL entry is reported by the
 *     dispatcher as ZPS_ERR_UNSUPPORTED, never silently replaced.
 *   - Pointers are in the back-end's memory: host for host_memory back-ends, device memory
 *     otherwise. alloc/free/copy_in/copy_out are the only way to move data in and out.
 *   - Results follow kernels.h's conventions exactly (accumulating parameter gradients,
 *     overwriting input gradients, PyTorch batchnorm and pooling semantics, the shared dropout
 *     hash): the back-end harness (tests/test_k_backends.c) checks every entry against ref.
 *   - Blocked activations (a descriptor's x_blocked/y_blocked/blocked) reach a back-end only
 *     when its prefers_blocked is set and true for the channel count (the dispatcher refuses
 *     them otherwise); an entry that hands a blocked tensor to a plain-layout function of
 *     another back-end is a bug.
 *   - `release` frees whatever the back-end cached in a descriptor's impl slot.
 */
#ifndef ZPS_KERNELS_BACKEND_H
#define ZPS_KERNELS_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The op descriptors (defined in kernels.h); the table only passes pointers to them. */
typedef struct k_conv2d k_conv2d;
typedef struct k_bn k_bn;
typedef struct k_pool k_pool;
typedef struct k_dense k_dense;

typedef struct k_backend k_backend;

struct k_backend {
    const char *name;  // "ref", "cpu", "cuda"
    int host_memory;   // 1 when tensors are ordinary host pointers
    void *(*alloc)(size_t bytes);                       // NULL on failure
    void (*free)(void *p);                              // NULL is a no-op
    zps_status (*copy_in)(void *dst, const void *host_src, size_t bytes);
    zps_status (*copy_out)(void *host_dst, const void *src, size_t bytes);
    void (*release)(void **impl);                       // frees an op's cached state
    int (*prefers_blocked)(int c);  // NULL or 0: plain NCHW only

    zps_status (*conv2d_fwd)(k_conv2d *d, const float *x, const float *w, const float *b,
                             float *y);
    zps_status (*conv2d_bwd)(k_conv2d *d, const float *x, const float *w, const float *dy,
                             float *dx, float *dw, float *db);
    zps_status (*bn_fwd_train)(k_bn *d, const float *x, const float *gamma,
                               const float *beta, float *y, float *mean, float *var,
                               float *run_mean, float *run_var);
    zps_status (*bn_fwd_infer)(k_bn *d, const float *x, const float *gamma,
                               const float *beta, const float *run_mean,
                               const float *run_var, float *y);
    zps_status (*bn_bwd)(k_bn *d, const float *x, const float *y, const float *dy,
                         const float *gamma, const float *mean, const float *var, float *dx,
                         float *dgamma, float *dbeta);
    zps_status (*pool_fwd)(k_pool *d, const float *x, float *y);
    zps_status (*pool_bwd)(k_pool *d, const float *x, const float *y, const float *dy,
                           float *dx);
    zps_status (*dense_fwd)(k_dense *d, const float *x, const float *w, const float *b,
                            float *y);
    zps_status (*dense_bwd)(k_dense *d, const float *x, const float *w, const float *dy,
                            float *dx, float *dw, float *db);
    zps_status (*relu_fwd)(size_t n, const float *x, float *y);
    zps_status (*relu_bwd)(size_t n, const float *y, const float *dy, float *dx);
    zps_status (*concat_fwd)(int n, int hw, int nin, const int *c, const float *const *xs,
                             float *y);
    zps_status (*concat_bwd)(int n, int hw, int nin, const int *c, const float *dy,
                             float *const *dxs);
    zps_status (*dropout_fwd)(size_t n, float p, uint64_t seed, const float *x, float *y);
    zps_status (*dropout_bwd)(size_t n, float p, uint64_t seed, const float *dy, float *dx);
    zps_status (*softmax_xent)(int n, int classes, const float *logits, const int32_t *labels,
                               float smoothing, float grad_scale, float *loss, int *correct,
                               float *dlogits);
    zps_status (*smooth_l1)(size_t n, const float *x, const float *target, float beta,
                            float grad_scale, float *loss, float *dx);
    zps_status (*fill)(size_t n, float v, float *y);
    zps_status (*add)(size_t n, const float *a, const float *b, float *y);
    zps_status (*scale)(size_t n, float alpha, float *x);
    zps_status (*axpy)(size_t n, float alpha, const float *x, float *y);
    zps_status (*sum)(size_t n, const float *x, double *out);
    zps_status (*sumsq)(size_t n, const float *x, double *out);
};

#ifdef __cplusplus
}
#endif

#endif
