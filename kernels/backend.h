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
 *   "staged" kernels/cpu/staged.c  cpu's ops behind a device's memory interface: tensors in
 *                            memory of their own, reached only through the copies, and the
 *                            asynchronous copies held back until someone waits for them; it
 *                            lets the CPU suite prove the trainer's device paths (no GPU here)
 *
 * Contract of a table:
 *   - Every entry is set, except the fusions (bn_pool_*), which a back-end may leave NULL: a
 *     caller asks k_bn_pool_fuses first and runs the ops one by one where it says 0.
 *     Elsewhere there is no implicit fallback: a back-end that does not accelerate
 *     an op names another back-end's function for it explicitly (cpu names ref's), which is
 *     only possible between back-ends that share host memory. A NULL entry is reported by the
 *     dispatcher as ZPS_ERR_UNSUPPORTED, never silently replaced.
 *   - Pointers are in the back-end's memory: host for host_memory back-ends, device memory
 *     otherwise. alloc/free/copy_in/copy_out are the only way to move data in and out.
 *   - Results follow kernels.h's conventions exactly (accumulating parameter gradients,
 *     overwriting input gradients, PyTorch batchnorm and pooling semantics, the shared dropout
 *     hash): the back-end harness (tests/test_k_backends.c) checks every entry against ref.
 *   - Blocked activations (a descriptor's x_blocked/y_blocked/blocked) reach a back-end only
 *     when its prefers_blocked is set and nonzero for the channel count, and the layout's
 *     block divides it (the dispatcher refuses them otherwise); an entry that hands a blocked tensor to a plain-layout function of
 *     another back-end is a bug.
 *   - `release` frees whatever the back-end cached in a descriptor's impl slot.
 *   - Queues (device back-ends, host_memory 0): the ops and copy_in/copy_out run in order on
 *     the back-end's compute queue; copy_in/copy_out return when their copy is done (and
 *     with it, the compute work before it). The asynchronous group (host_alloc ...
 *     event_sync) is all set or all NULL; host back-ends leave it NULL, and their callers
 *     then alias host mirrors to the tensors instead of copying. Its copies run on two copy
 *     queues of their own, one per direction (copy_in_async on K_QUEUE_IN, copy_out_async
 *     on K_QUEUE_OUT), each in order, so a batch or values going up never wait behind
 *     gradients going down (and a GPU's two copy engines both work). Nothing orders the
 *     three queues but events: event_record marks a point of a queue, event_wait makes a
 *     queue's later work wait for such a point (the host does not wait), event_sync makes
 *     the host wait for it. An asynchronous copy's host side is host_alloc memory (pinned,
 *     so the copy is DMA) and must not be touched until an event recorded after the copy
 *     completed.
 */
#ifndef ZPS_KERNELS_BACKEND_H
#define ZPS_KERNELS_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "common/optim_math.h"
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

/* The queues of a device back-end (see the contract above): the ops', and one copy queue
 * per direction (host to device, device to host). */
enum { K_QUEUE_COMPUTE = 0, K_QUEUE_IN = 1, K_QUEUE_OUT = 2 };
/* A point in a queue (the back-end's own type: a CUDA event for cuda). */
typedef struct k_event k_event;

/* The signature of every op entry, one type per entry: the table holds pointers to them, and
 * a back-end declares its functions with them (k_conv2d_fwd_fn k_ref_conv2d_fwd;), so the
 * compiler checks every back-end against this one list. */
/* Convolution, x (n, c, h, w) * w (k, c, r, s) [+ b (k)] -> y (n, k, oh, ow). */
typedef zps_status k_conv2d_fwd_fn(k_conv2d *d, const float *x, const float *w, const float *b,
                                   float *y);
typedef zps_status k_conv2d_bwd_fn(k_conv2d *d, const float *x, const float *w, const float *dy,
                                   float *dx, float *dw, float *db);
/* Batchnorm training forward: y, batch mean and biased variance, running stats. */
typedef zps_status k_bn_fwd_train_fn(k_bn *d, const float *x, const float *gamma,
                                     const float *beta, float *y, float *mean, float *var,
                                     float *run_mean, float *run_var);
typedef zps_status k_bn_fwd_infer_fn(k_bn *d, const float *x, const float *gamma,
                                     const float *beta, const float *run_mean,
                                     const float *run_var, float *y);
typedef zps_status k_bn_bwd_fn(k_bn *d, const float *x, const float *y, const float *dy,
                               const float *gamma, const float *mean, const float *var,
                               float *dx, float *dgamma, float *dbeta);
/* Fused batchnorm (training) + ReLU + max pooling: the two ops' results without the map between
 * them (kernels.h, k_bn_pool_fwd). fuses: 1 where the back-end runs this pair of descriptors
 * fused. */
typedef int k_bn_pool_fuses_fn(const k_bn *bn, const k_pool *pool);
typedef zps_status k_bn_pool_fwd_fn(k_bn *bn, k_pool *pool, const float *x, const float *gamma,
                                    const float *beta, float *y, float *mean, float *var,
                                    float *run_mean, float *run_var);
typedef zps_status k_bn_pool_bwd_fn(k_bn *bn, k_pool *pool, const float *x, const float *dy,
                                    const float *gamma, const float *mean, const float *var,
                                    float *dx, float *dgamma, float *dbeta);
/* Max or average pooling. */
typedef zps_status k_pool_fwd_fn(k_pool *d, const float *x, float *y);
typedef zps_status k_pool_bwd_fn(k_pool *d, const float *x, const float *y, const float *dy,
                                 float *dx);
/* Fully connected, y = x w^T + b. */
typedef zps_status k_dense_fwd_fn(k_dense *d, const float *x, const float *w, const float *b,
                                  float *y);
typedef zps_status k_dense_bwd_fn(k_dense *d, const float *x, const float *w, const float *dy,
                                  float *dx, float *dw, float *db);
/* Elementwise and layout-free ops (kernels.h documents each). */
typedef zps_status k_relu_fwd_fn(size_t n, const float *x, float *y);
typedef zps_status k_relu_bwd_fn(size_t n, const float *y, const float *dy, float *dx);
typedef zps_status k_concat_fwd_fn(int n, int hw, int nin, const int *c, const float *const *xs,
                                   float *y);
typedef zps_status k_concat_bwd_fn(int n, int hw, int nin, const int *c, const float *dy,
                                   float *const *dxs);
typedef zps_status k_dropout_fwd_fn(size_t n, float p, uint64_t seed, const float *x, float *y);
typedef zps_status k_dropout_bwd_fn(size_t n, float p, uint64_t seed, const float *dy,
                                    float *dx);
typedef zps_status k_softmax_xent_fn(int n, int classes, const float *logits,
                                     const int32_t *labels, float smoothing, float grad_scale,
                                     float *loss, int *correct, float *dlogits);
typedef zps_status k_smooth_l1_fn(size_t n, const float *x, const float *target, float beta,
                                  float grad_scale, float *loss, float *dx);
typedef zps_status k_fill_fn(size_t n, float v, float *y);
typedef zps_status k_add_fn(size_t n, const float *a, const float *b, float *y);
typedef zps_status k_scale_fn(size_t n, float alpha, float *x);
typedef zps_status k_axpy_fn(size_t n, float alpha, const float *x, float *y);
typedef zps_status k_sum_fn(size_t n, const float *x, double *out);
typedef zps_status k_sumsq_fn(size_t n, const float *x, double *out);
typedef zps_status k_optim_apply_fn(const zps_optim_step *s, size_t n, float *w, float *s0,
                                    float *s1, const float *g);
typedef zps_status k_pack_bf16_fn(size_t n, const float *x, uint16_t *y);

struct k_backend {
    const char *name;  // "ref", "cpu", "cuda"
    int host_memory;   // 1 when tensors are ordinary host pointers
    void *(*alloc)(size_t bytes);                       // NULL on failure
    void (*free)(void *p);                              // NULL is a no-op
    zps_status (*copy_in)(void *dst, const void *host_src, size_t bytes);
    zps_status (*copy_out)(void *host_dst, const void *src, size_t bytes);
    void (*release)(void **impl);                       // frees an op's cached state
    int (*prefers_blocked)(int c);  // the layout it prefers for c channels (K_BLOCK16,
                                    // K_BLOCK8); NULL or 0: plain NCHW only

    /* asynchronous transfers (device back-ends; all NULL on host back-ends) */
    void *(*host_alloc)(size_t bytes);                  // pinned host memory; NULL on failure
    void (*host_free)(void *p);                         // NULL is a no-op
    zps_status (*copy_in_async)(void *dst, const void *host_src, size_t bytes);  // QUEUE_IN
    zps_status (*copy_out_async)(void *host_dst, const void *src, size_t bytes); // QUEUE_OUT
    zps_status (*event_new)(k_event **out);
    void (*event_free)(k_event *e);                     // NULL is a no-op
    zps_status (*event_record)(k_event *e, int queue);  // e: queue's work so far
    zps_status (*event_wait)(int queue, k_event *e);    // queue's later work waits for e
    zps_status (*event_sync)(k_event *e);               // the host waits for e

    /* the ops, one entry per k_* dispatcher of kernels.h */
    k_conv2d_fwd_fn *conv2d_fwd;
    k_conv2d_bwd_fn *conv2d_bwd;
    k_bn_fwd_train_fn *bn_fwd_train;
    k_bn_fwd_infer_fn *bn_fwd_infer;
    k_bn_bwd_fn *bn_bwd;
    k_pool_fwd_fn *pool_fwd;
    k_pool_bwd_fn *pool_bwd;
    k_bn_pool_fuses_fn *bn_pool_fuses; // the optional fusion: NULL, or all three set
    k_bn_pool_fwd_fn *bn_pool_fwd;
    k_bn_pool_bwd_fn *bn_pool_bwd;
    k_dense_fwd_fn *dense_fwd;
    k_dense_bwd_fn *dense_bwd;
    k_relu_fwd_fn *relu_fwd;
    k_relu_bwd_fn *relu_bwd;
    k_concat_fwd_fn *concat_fwd;
    k_concat_bwd_fn *concat_bwd;
    k_dropout_fwd_fn *dropout_fwd;
    k_dropout_bwd_fn *dropout_bwd;
    k_softmax_xent_fn *softmax_xent;
    k_smooth_l1_fn *smooth_l1;
    k_fill_fn *fill;
    k_add_fn *add;
    k_scale_fn *scale;
    k_axpy_fn *axpy;
    k_sum_fn *sum;
    k_sumsq_fn *sumsq;
    k_optim_apply_fn *optim_apply;
    k_pack_bf16_fn *pack_bf16;
};

#ifdef __cplusplus
}
#endif

#endif
