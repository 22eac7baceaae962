/* kernels.h — the one op API of zps: forward and backward tensor ops, each dispatched through
 * a back-end table (kernels/backend.h says what a back-end provides; ref, cpu and cuda do).
 *
 * Callers pick a back-end (k_backend_ref/cpu/cuda/by_name) and call the k_* functions below
 * with it. An op whose table entry is missing, or a blocked descriptor on a back-end without
 * blocked layouts, is ZPS_ERR_UNSUPPORTED (logged); nothing falls back behind the caller's back.
 * The table's memory entries (host_memory, alloc, free, copy_in, copy_out) are part of this
 * API too: callers move their buffers with them, so this header includes backend.h.
 *
 * Conventions, for every op and every back-end:
 *   - Tensors are dense float32, NCHW (activations), KCRS (conv weights), (out, in) (dense
 *     weights). Pointers are in the back-end's memory (host for ref/cpu, device for cuda).
 *   - Blocked activations (opt-in, per descriptor: x_blocked/y_blocked/blocked = K_BLOCK16 or
 *     K_BLOCK8, below): a back-end whose prefers_blocked(c) is nonzero for a channel count c
 *     may keep such activations in its native layout, which for "cpu" is oneDNN's nChw16c,
 *     [n][c/16][h][w][16], for c a multiple of 16, or nChw8c for c a multiple of 8. Such a
 *     tensor holds exactly n*c*h*w floats, so elementwise ops, axpy, dropout and channel
 *     concat/split of tensors in one blocked layout work unchanged (concat copies per-image
 *     chunks of c*h*w floats), and at h = w = 1 every layout equals NCHW. A convolution may
 *     take any two layouts (the back-end converts where it has no direct kernel), a dense
 *     layer a blocked x (x_blocked). k_to_layout and k_from_layout (k_to_blocked,
 *     k_from_blocked for nChw16c) convert (host back-ends). Descriptors default to NCHW.
 *   - Backward ops ACCUMULATE (+=) into parameter gradients (dw, db, dgamma, dbeta) and
 *     OVERWRITE input gradients (dx). A NULL dx skips the input gradient.
 *   - Shape descriptors (k_conv2d, k_bn, k_pool, k_dense) are owned by the caller. Their `impl`
 *     slot caches back-end state (oneDNN primitives, workspaces) created on first use for that
 *     shape; release it with k_op_release() before changing the shape or freeing the
 *     descriptor. A descriptor with cached state must be used with one back-end only and from
 *     one thread at a time. Max pooling and fused batchnorm+ReLU keep a workspace in impl
 *     between forward and backward, so run backward on the same descriptor as its forward.
 *   - Average pooling counts padding in the divisor (PyTorch count_include_pad=True, which
 *     torchvision's Inception uses); output sizes round down (ceil_mode=False).
 *   - Batchnorm normalises with the biased batch variance and updates running_var with the
 *     unbiased one (PyTorch semantics): run = (1 - momentum) * run + momentum * batch.
 *   - Dropout is seeded and counter-based: element i of a call with seed s is dropped when
 *     hash(s, i) < p * 2^32, identically on every back-end; kept elements scale by 1/(1-p).
 */
#ifndef ZPS_KERNELS_KERNELS_H
#define ZPS_KERNELS_KERNELS_H

#include "common/hd.h"

#include <stddef.h>
#include <stdint.h>

#include "common/bf16.h"
#include "common/status.h"
#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Convolution: x (n, c, h, w) * w (k, c, r, s) [+ b (k)] -> y (n, k, oh, ow). */
/* Activation layouts, the values of a descriptor's x_blocked / y_blocked / blocked. */
enum {
    K_NCHW = 0,    // plain
    K_BLOCK16 = 1, // [n][c/16][h][w][16] (oneDNN's nChw16c); c a multiple of 16
    K_BLOCK8 = 2,  // [n][c/8][h][w][8] (nChw8c); c a multiple of 8
};
/* Channels side by side in a layout (1 for NCHW). */
static inline int k_block_size(int layout) { return layout == K_BLOCK8 ? 8 : layout ? 16 : 1; }

typedef struct k_conv2d {
    int n, c, h, w;            // input shape
    int k, r, s;               // output channels, kernel height, kernel width
    int stride_h, stride_w;    // strides
    int pad_h, pad_w;          // zero padding on each side
    int oh, ow;                // output size, filled by k_conv2d_init
    int x_blocked, y_blocked;  // input / output (and their gradients) in the blocked layout
    int bf16;                  // 1: bf16 compute: the products read x, w and (backward) dy
                               // rounded to bfloat16 (zps_bf16_round, common/bf16.h, the PS
                               // wire's rounding; a product of two is exact in float) and are
                               // summed in float; db is the float sum of dy; every tensor
                               // stays float32 in memory
    void *impl;                // back-end state (k_op_release)
} k_conv2d;

/* Batchnorm over (n, h, w) per channel c, optionally followed by a fused ReLU. */
typedef struct k_bn {
    int n, c, h, w;  // data shape
    float eps;       // added to the variance (Inception: 0.001)
    float momentum;  // running-average factor (PyTorch's convention, default 0.1)
    int relu;        // 1: y = relu(bn(x)) and backward masks by y > 0
    int blocked;     // data in the blocked layout
    void *impl;      // back-end state (k_op_release)
} k_bn;

typedef enum k_pool_kind { K_POOL_MAX = 0, K_POOL_AVG = 1 } k_pool_kind;

/* Max or average pooling, x (n, c, h, w) -> y (n, c, oh, ow). */
typedef struct k_pool {
    k_pool_kind kind;       // max or average (padding counted in the divisor)
    int n, c, h, w;         // input shape
    int r, s;               // window height, width
    int stride_h, stride_w; // strides
    int pad_h, pad_w;       // padding on each side (ignored by max, counted by avg)
    int oh, ow;             // output size, filled by k_pool_init
    int blocked;            // input and output in the blocked layout
    void *impl;             // back-end state (k_op_release)
} k_pool;

/* Fully connected: x (n, in) . w (out, in)^T + b (out) -> y (n, out). With x_blocked, x and
 * dx are a feature map (n, x_c, in / x_c) in the blocked layout (the features are still
 * numbered in NCHW order, as w's columns are): a convolutional trunk's last map read without
 * a conversion by the caller. */
typedef struct k_dense {
    int n, in, out; // batch, input and output features
    int x_c;        // x_blocked: channels of the map x (in a multiple of x_c)
    int x_blocked;  // x and dx in the blocked layout
    void *impl;     // back-end state (k_op_release)
} k_dense;

/* Back-ends. ref and cpu always exist; cuda is NULL when the library or a device is absent
 * (reason, when non-NULL, receives why). */
const k_backend *k_backend_ref(void);
const k_backend *k_backend_cpu(void);
const k_backend *k_backend_cuda(char *reason, size_t reason_len);
/* cpu's ops behind a device's memory interface (backend.h, "staged"), for tests of the
 * device paths on machines without a GPU. */
const k_backend *k_backend_staged(void);
/* 1 when be has the asynchronous group (backend.h): a device back-end's queues and events. */
static inline int k_backend_async(const k_backend *be) { return be->event_new != NULL; }
/* "ref", "cpu", "cuda", "staged", or "auto" (cuda when present, else cpu). NULL when
 * unavailable. */
const k_backend *k_backend_by_name(const char *name);

/* Shape helpers: fill the derived output size; ZPS_ERR_INVALID when the shape is empty. */
zps_status k_conv2d_init(k_conv2d *d, int n, int c, int h, int w, int k, int r, int s,
                         int stride_h, int stride_w, int pad_h, int pad_w);
zps_status k_pool_init(k_pool *d, k_pool_kind kind, int n, int c, int h, int w, int r, int s,
                       int stride_h, int stride_w, int pad_h, int pad_w);
/* Frees cached back-end state; *impl becomes NULL. Safe when already NULL. */
void k_op_release(const k_backend *be, void **impl);

/* Floating-point operations of one forward convolution (2 per multiply-add). */
double k_conv2d_flops(const k_conv2d *d);

/* ---- dispatch: the same signatures as the table, with the back-end first ---- */
zps_status k_conv2d_fwd(const k_backend *be, k_conv2d *d, const float *x, const float *w,
                        const float *b, float *y);
zps_status k_conv2d_bwd(const k_backend *be, k_conv2d *d, const float *x, const float *w,
                        const float *dy, float *dx, float *dw, float *db);
/* Training forward: y, batch mean and biased variance (c each), running stats updated. */
zps_status k_bn_fwd_train(const k_backend *be, k_bn *d, const float *x, const float *gamma,
                          const float *beta, float *y, float *mean, float *var,
                          float *run_mean, float *run_var);
zps_status k_bn_fwd_infer(const k_backend *be, k_bn *d, const float *x, const float *gamma,
                          const float *beta, const float *run_mean, const float *run_var,
                          float *y);
/* mean/var: those of the training forward; y: its output (for the fused ReLU mask). */
zps_status k_bn_bwd(const k_backend *be, k_bn *d, const float *x, const float *y,
                    const float *dy, const float *gamma, const float *mean, const float *var,
                    float *dx, float *dgamma, float *dbeta);
zps_status k_pool_fwd(const k_backend *be, k_pool *d, const float *x, float *y);
zps_status k_pool_bwd(const k_backend *be, k_pool *d, const float *x, const float *y,
                      const float *dy, float *dx);
/* Batchnorm (training, batch statistics) with its ReLU, then max pooling of its output, as one
 * op where the back-end fuses the pair (k_bn_pool_fuses: 1; bn->relu set, pool reads bn's
 * output shape): y (n, c, oh, ow) and the statistics are those of k_bn_fwd_train followed by
 * k_pool_fwd, up to float rounding, but the map between them is never written (the memory
 * traffic it saves is the point). The backward takes the pooled gradient dy and gives dx
 * (overwritten) and dgamma, dbeta (accumulated) as k_pool_bwd then k_bn_bwd would; it must
 * follow its forward on the same pair of descriptors (the pool's impl keeps where each maximum
 * was). k_bn_pool_fuses is 0 on a back-end without the fusion. */
int k_bn_pool_fuses(const k_backend *be, const k_bn *bn, const k_pool *pool);
zps_status k_bn_pool_fwd(const k_backend *be, k_bn *bn, k_pool *pool, const float *x,
                         const float *gamma, const float *beta, float *y, float *mean,
                         float *var, float *run_mean, float *run_var);
zps_status k_bn_pool_bwd(const k_backend *be, k_bn *bn, k_pool *pool, const float *x,
                         const float *dy, const float *gamma, const float *mean,
                         const float *var, float *dx, float *dgamma, float *dbeta);
/* Global average pool (n, c, h, w) -> (n, c): an average pool with the whole map as window. */
zps_status k_gap_fwd(const k_backend *be, k_pool *d, const float *x, float *y);
zps_status k_gap_bwd(const k_backend *be, k_pool *d, const float *dy, float *dx);
zps_status k_dense_fwd(const k_backend *be, k_dense *d, const float *x, const float *w,
                       const float *b, float *y);
zps_status k_dense_bwd(const k_backend *be, k_dense *d, const float *x, const float *w,
                       const float *dy, float *dx, float *dw, float *db);
/* y may equal x. Backward uses the output y: dx = dy * (y > 0); dx may equal dy. */
zps_status k_relu_fwd(const k_backend *be, size_t n, const float *x, float *y);
zps_status k_relu_bwd(const k_backend *be, size_t n, const float *y, const float *dy,
                      float *dx);
/* Channel concat of nin tensors (n, c[i], hw) into y (n, sum c, hw); backward splits dy. */
zps_status k_concat_fwd(const k_backend *be, int n, int hw, int nin, const int *c,
                        const float *const *xs, float *y);
zps_status k_concat_bwd(const k_backend *be, int n, int hw, int nin, const int *c,
                        const float *dy, float *const *dxs);
/* Seeded dropout with rate p in [0, 1); the mask is recomputed from (seed, index). */
zps_status k_dropout_fwd(const k_backend *be, size_t n, float p, uint64_t seed,
                         const float *x, float *y);
zps_status k_dropout_bwd(const k_backend *be, size_t n, float p, uint64_t seed,
                         const float *dy, float *dx);
/* Mean softmax cross-entropy over n rows with label smoothing eps (target 1-eps+eps/K on the
 * label, eps/K elsewhere). loss (host) receives the mean, correct (host, may be NULL) the
 * number of rows whose argmax equals the label, and dlogits (may be NULL) the gradient of
 * grad_scale * loss. Labels outside [0, classes) are ZPS_ERR_INVALID, with dlogits then
 * unspecified (cuda has written the other rows'; callers check labels first, as nn does). */
zps_status k_softmax_xent(const k_backend *be, int n, int classes, const float *logits,
                          const int32_t *labels, float smoothing, float grad_scale,
                          float *loss, int *correct, float *dlogits);
/* Sum of smooth-L1 (Huber with threshold beta) of x - target; dx = grad_scale * d loss/dx. */
zps_status k_smooth_l1(const k_backend *be, size_t n, const float *x, const float *target,
                       float beta, float grad_scale, float *loss, float *dx);
zps_status k_fill(const k_backend *be, size_t n, float v, float *y);
zps_status k_add(const k_backend *be, size_t n, const float *a, const float *b, float *y);
zps_status k_scale(const k_backend *be, size_t n, float alpha, float *x);
zps_status k_axpy(const k_backend *be, size_t n, float alpha, const float *x, float *y);
/* Reductions into a host double. */
/* One optimizer step over n elements in the back-end's memory: w, the slots s0, s1 (NULL
 * beyond ps_optim_slots of the kind) and g. The update is common/optim_math.h's, the one
 * ps_optim_apply runs, so every back-end gives ps_optim_apply's bits; s comes from
 * ps_optim_prepare (the step's scheduled learning rate and constants). */
zps_status k_optim_apply(const k_backend *be, const zps_optim_step *s, size_t n, float *w,
                         float *s0, float *s1, const float *g);
/* y[i] = the bfloat16 bits of x[i] (common/bf16.h's rounding, the PS wire's: round to
 * nearest even, NaN kept quiet), in the back-end's memory: gradients that leave a device
 * already as --push-dtype bf16 cross to the host in half the bytes (trainer/stage.c). */
zps_status k_pack_bf16(const k_backend *be, size_t n, const float *x, uint16_t *y);
zps_status k_sum(const k_backend *be, size_t n, const float *x, double *out);
zps_status k_sumsq(const k_backend *be, size_t n, const float *x, double *out);

/* NCHW <-> nChw16c on the host (c a multiple of 16); src and dst must not overlap. */
void k_to_blocked(int n, int c, int h, int w, const float *src, float *dst);
void k_from_blocked(int n, int c, int h, int w, const float *src, float *dst);
/* The same for any layout (K_NCHW copies). */
void k_to_layout(int layout, int n, int c, int h, int w, const float *src, float *dst);
void k_from_layout(int layout, int n, int c, int h, int w, const float *src, float *dst);

/* Deterministic uniform u32 of (seed, index): the dropout hash (a splitmix64 finaliser over
 * a seed-keyed counter). One definition for every back-end, the CUDA kernels included, so
 * masks agree bit for bit. */
ZPS_HD uint32_t k_hash_u32(uint64_t seed, uint64_t index)
{
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + index + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (uint32_t)(z >> 32);
}

#ifdef __cplusplus
}
#endif

#endif
