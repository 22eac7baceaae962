/* kernels.c — back-end selection, shape helpers and the k_* dispatchers (kernels.h).
 *
 * Dispatch rule: the back-end's own table entry, always; a missing entry is
 * ZPS_ERR_UNSUPPORTED (every table in the tree is complete, so that is a bug in a new
 * back-end, said loudly). Blocked descriptors reach only back-ends with blocked layouts.
 * The back-end tables themselves live with their back-ends (ref/ref.c, cpu/cpu.c,
 * cuda/backend.cu); the cuda one is reached through device.c, the only door to the library.
 */
#include "kernels/kernels.h"

#include <assert.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "kernels/device.h"

static const k_backend *s_cuda; // the cuda table, or NULL (s_cuda_why says why)
static char s_cuda_why[320];

static void s_cuda_init(void)
{
    k_device_info info;
    if (k_device_select("auto", &info) != ZPS_OK || info.kind != K_DEVICE_CUDA) {
        snprintf(s_cuda_why, sizeof s_cuda_why, "%s", info.reason);
        return;
    }
    const k_cuda_lib *lib = k_device_cuda_lib(s_cuda_why, sizeof s_cuda_why);
    if (lib && !(s_cuda = lib->backend(k_device_gpu())))
        snprintf(s_cuda_why, sizeof s_cuda_why, "CUDA back-end failed to initialise: %s",
                 lib->last_error());
}

const k_backend *k_backend_cuda(char *reason, size_t reason_len)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, s_cuda_init);
    if (!s_cuda && reason && reason_len)
        snprintf(reason, reason_len, "%s", s_cuda_why);
    return s_cuda;
}

const k_backend *k_backend_by_name(const char *name)
{
    if (!name || strcmp(name, "auto") == 0) {
        const k_backend *c = k_backend_cuda(NULL, 0);
        return c ? c : k_backend_cpu();
    }
    if (strcmp(name, "ref") == 0)
        return k_backend_ref();
    if (strcmp(name, "cpu") == 0)
        return k_backend_cpu();
    if (strcmp(name, "cuda") == 0)
        return k_backend_cuda(NULL, 0);
    if (strcmp(name, "staged") == 0)
        return k_backend_staged();
    return NULL;
}

zps_status k_conv2d_init(k_conv2d *d, int n, int c, int h, int w, int k, int r, int s,
                         int stride_h, int stride_w, int pad_h, int pad_w)
{
    memset(d, 0, sizeof *d);
    d->n = n, d->c = c, d->h = h, d->w = w, d->k = k, d->r = r, d->s = s;
    d->stride_h = stride_h, d->stride_w = stride_w, d->pad_h = pad_h, d->pad_w = pad_w;
    if (n <= 0 || c <= 0 || k <= 0 || r <= 0 || s <= 0 || stride_h <= 0 || stride_w <= 0 ||
        pad_h < 0 || pad_w < 0)
        return ZPS_ERR_INVALID;
    d->oh = (h + 2 * pad_h - r) / stride_h + 1;
    d->ow = (w + 2 * pad_w - s) / stride_w + 1;
    if (h + 2 * pad_h < r || w + 2 * pad_w < s || d->oh <= 0 || d->ow <= 0)
        return ZPS_ERR_INVALID;
    return ZPS_OK;
}

zps_status k_pool_init(k_pool *d, k_pool_kind kind, int n, int c, int h, int w, int r, int s,
                       int stride_h, int stride_w, int pad_h, int pad_w)
{
    memset(d, 0, sizeof *d);
    d->kind = kind;
    d->n = n, d->c = c, d->h = h, d->w = w, d->r = r, d->s = s;
    d->stride_h = stride_h, d->stride_w = stride_w, d->pad_h = pad_h, d->pad_w = pad_w;
    if (n <= 0 || c <= 0 || r <= 0 || s <= 0 || stride_h <= 0 || stride_w <= 0 || pad_h < 0 ||
        pad_w < 0 || pad_h >= r || pad_w >= s || h + 2 * pad_h < r || w + 2 * pad_w < s)
        return ZPS_ERR_INVALID;
    d->oh = (h + 2 * pad_h - r) / stride_h + 1;
    d->ow = (w + 2 * pad_w - s) / stride_w + 1;
    return ZPS_OK;
}

void k_op_release(const k_backend *be, void **impl)
{
    if (be && impl && *impl)
        be->release(impl);
    if (impl)
        *impl = NULL;
}

double k_conv2d_flops(const k_conv2d *d)
{
    return 2.0 * d->n * d->k * d->oh * d->ow * (double)d->c * d->r * d->s;
}

/* Offset of element (b, ch, i) of an (n, c, hw) map in layout `layout`. */
static size_t s_layout_at(int layout, int c, size_t hw, int b, int ch, size_t i)
{
    size_t bs = (size_t)k_block_size(layout);
    return (((size_t)b * (c / bs) + ch / bs) * hw + i) * bs + ch % bs;
}

void k_to_layout(int layout, int n, int c, int h, int w, const float *src, float *dst)
{
    size_t hw = (size_t)h * w;
    for (int b = 0; b < n; b++)
        for (int ch = 0; ch < c; ch++)
            for (size_t i = 0; i < hw; i++)
                dst[s_layout_at(layout, c, hw, b, ch, i)] = src[((size_t)b * c + ch) * hw + i];
}

void k_from_layout(int layout, int n, int c, int h, int w, const float *src, float *dst)
{
    size_t hw = (size_t)h * w;
    for (int b = 0; b < n; b++)
        for (int ch = 0; ch < c; ch++)
            for (size_t i = 0; i < hw; i++)
                dst[((size_t)b * c + ch) * hw + i] = src[s_layout_at(layout, c, hw, b, ch, i)];
}

void k_to_blocked(int n, int c, int h, int w, const float *src, float *dst)
{
    k_to_layout(K_BLOCK16, n, c, h, w, src, dst);
}

void k_from_blocked(int n, int c, int h, int w, const float *src, float *dst)
{
    k_from_layout(K_BLOCK16, n, c, h, w, src, dst);
}

#define S_CALL(be, fn, ...)                                                            \
    do {                                                                               \
        if (!(be)->fn) {                                                               \
            zps_log(ZPS_ERROR, "kernels", "back-end %s has no " #fn, (be)->name);       \
            return ZPS_ERR_UNSUPPORTED;                                                \
        }                                                                              \
        return (be)->fn(__VA_ARGS__);                                                  \
    } while (0)

/* A blocked tensor of c channels reaches only a back-end whose prefers_blocked(c) holds. */
static zps_status s_blocked_ok(const k_backend *be, int blocked, int c)
{
    if (!blocked || (be->prefers_blocked && be->prefers_blocked(c) && c % k_block_size(blocked) == 0))
        return ZPS_OK;
    zps_log(ZPS_ERROR, "kernels", "back-end %s has no %d-channel blocked layout for %d channels",
            be->name, k_block_size(blocked), c);
    return ZPS_ERR_UNSUPPORTED;
}

zps_status k_conv2d_fwd(const k_backend *be, k_conv2d *d, const float *x, const float *w,
                        const float *b, float *y)
{
    ZPS_TRY(s_blocked_ok(be, d->x_blocked, d->c));
    ZPS_TRY(s_blocked_ok(be, d->y_blocked, d->k));
    S_CALL(be, conv2d_fwd, d, x, w, b, y);
}
zps_status k_conv2d_bwd(const k_backend *be, k_conv2d *d, const float *x, const float *w,
                        const float *dy, float *dx, float *dw, float *db)
{
    ZPS_TRY(s_blocked_ok(be, d->x_blocked, d->c));
    ZPS_TRY(s_blocked_ok(be, d->y_blocked, d->k));
    S_CALL(be, conv2d_bwd, d, x, w, dy, dx, dw, db);
}
zps_status k_bn_fwd_train(const k_backend *be, k_bn *d, const float *x, const float *gamma,
                          const float *beta, float *y, float *mean, float *var,
                          float *run_mean, float *run_var)
{
    ZPS_TRY(s_blocked_ok(be, d->blocked, d->c));
    S_CALL(be, bn_fwd_train, d, x, gamma, beta, y, mean, var, run_mean, run_var);
}
zps_status k_bn_fwd_infer(const k_backend *be, k_bn *d, const float *x, const float *gamma,
                          const float *beta, const float *run_mean, const float *run_var,
                          float *y)
{
    ZPS_TRY(s_blocked_ok(be, d->blocked, d->c));
    S_CALL(be, bn_fwd_infer, d, x, gamma, beta, run_mean, run_var, y);
}
zps_status k_bn_bwd(const k_backend *be, k_bn *d, const float *x, const float *y,
                    const float *dy, const float *gamma, const float *mean, const float *var,
                    float *dx, float *dgamma, float *dbeta)
{
    ZPS_TRY(s_blocked_ok(be, d->blocked, d->c));
    S_CALL(be, bn_bwd, d, x, y, dy, gamma, mean, var, dx, dgamma, dbeta);
}
zps_status k_pool_fwd(const k_backend *be, k_pool *d, const float *x, float *y)
{
    ZPS_TRY(s_blocked_ok(be, d->blocked, d->c));
    S_CALL(be, pool_fwd, d, x, y);
}
zps_status k_pool_bwd(const k_backend *be, k_pool *d, const float *x, const float *y,
                      const float *dy, float *dx)
{
    ZPS_TRY(s_blocked_ok(be, d->blocked, d->c));
    S_CALL(be, pool_bwd, d, x, y, dy, dx);
}
int k_bn_pool_fuses(const k_backend *be, const k_bn *bn, const k_pool *pool)
{
    return be->bn_pool_fuses && bn->relu && pool->kind == K_POOL_MAX && bn->n == pool->n &&
           bn->c == pool->c && bn->h == pool->h && bn->w == pool->w &&
           bn->blocked == pool->blocked && be->bn_pool_fuses(bn, pool);
}
/* The fused op where be fuses the pair, else ZPS_ERR_UNSUPPORTED (logged). */
static zps_status s_fused(const k_backend *be, const k_bn *bn, const k_pool *pool)
{
    if (k_bn_pool_fuses(be, bn, pool))
        return ZPS_OK;
    zps_log(ZPS_ERROR, "kernels", "back-end %s does not fuse this batchnorm and pooling",
            be->name);
    return ZPS_ERR_UNSUPPORTED;
}
zps_status k_bn_pool_fwd(const k_backend *be, k_bn *bn, k_pool *pool, const float *x,
                         const float *gamma, const float *beta, float *y, float *mean,
                         float *var, float *run_mean, float *run_var)
{
    ZPS_TRY(s_fused(be, bn, pool));
    S_CALL(be, bn_pool_fwd, bn, pool, x, gamma, beta, y, mean, var, run_mean, run_var);
}
zps_status k_bn_pool_bwd(const k_backend *be, k_bn *bn, k_pool *pool, const float *x,
                         const float *dy, const float *gamma, const float *mean,
                         const float *var, float *dx, float *dgamma, float *dbeta)
{
    ZPS_TRY(s_fused(be, bn, pool));
    S_CALL(be, bn_pool_bwd, bn, pool, x, dy, gamma, mean, var, dx, dgamma, dbeta);
}
zps_status k_gap_fwd(const k_backend *be, k_pool *d, const float *x, float *y)
{
    assert(d->kind == K_POOL_AVG && d->r == d->h && d->s == d->w && d->oh == 1 && d->ow == 1);
    return k_pool_fwd(be, d, x, y);
}
zps_status k_gap_bwd(const k_backend *be, k_pool *d, const float *dy, float *dx)
{
    assert(d->kind == K_POOL_AVG && d->r == d->h && d->s == d->w && d->oh == 1 && d->ow == 1);
    /* average pooling backward never reads x or y */
    return k_pool_bwd(be, d, dx, NULL, dy, dx);
}
zps_status k_dense_fwd(const k_backend *be, k_dense *d, const float *x, const float *w,
                       const float *b, float *y)
{
    ZPS_TRY(s_blocked_ok(be, d->x_blocked, d->x_c));
    S_CALL(be, dense_fwd, d, x, w, b, y);
}
zps_status k_dense_bwd(const k_backend *be, k_dense *d, const float *x, const float *w,
                       const float *dy, float *dx, float *dw, float *db)
{
    ZPS_TRY(s_blocked_ok(be, d->x_blocked, d->x_c));
    S_CALL(be, dense_bwd, d, x, w, dy, dx, dw, db);
}
zps_status k_relu_fwd(const k_backend *be, size_t n, const float *x, float *y)
{
    S_CALL(be, relu_fwd, n, x, y);
}
zps_status k_relu_bwd(const k_backend *be, size_t n, const float *y, const float *dy,
                      float *dx)
{
    S_CALL(be, relu_bwd, n, y, dy, dx);
}
zps_status k_concat_fwd(const k_backend *be, int n, int hw, int nin, const int *c,
                        const float *const *xs, float *y)
{
    S_CALL(be, concat_fwd, n, hw, nin, c, xs, y);
}
zps_status k_concat_bwd(const k_backend *be, int n, int hw, int nin, const int *c,
                        const float *dy, float *const *dxs)
{
    S_CALL(be, concat_bwd, n, hw, nin, c, dy, dxs);
}
zps_status k_dropout_fwd(const k_backend *be, size_t n, float p, uint64_t seed,
                         const float *x, float *y)
{
    if (!(p >= 0.0f && p < 1.0f))
        return ZPS_ERR_INVALID;
    S_CALL(be, dropout_fwd, n, p, seed, x, y);
}
zps_status k_dropout_bwd(const k_backend *be, size_t n, float p, uint64_t seed,
                         const float *dy, float *dx)
{
    if (!(p >= 0.0f && p < 1.0f))
        return ZPS_ERR_INVALID;
    S_CALL(be, dropout_bwd, n, p, seed, dy, dx);
}
zps_status k_softmax_xent(const k_backend *be, int n, int classes, const float *logits,
                          const int32_t *labels, float smoothing, float grad_scale,
                          float *loss, int *correct, float *dlogits)
{
    S_CALL(be, softmax_xent, n, classes, logits, labels, smoothing, grad_scale, loss, correct,
           dlogits);
}
zps_status k_smooth_l1(const k_backend *be, size_t n, const float *x, const float *target,
                       float beta, float grad_scale, float *loss, float *dx)
{
    S_CALL(be, smooth_l1, n, x, target, beta, grad_scale, loss, dx);
}
zps_status k_fill(const k_backend *be, size_t n, float v, float *y) { S_CALL(be, fill, n, v, y); }
zps_status k_add(const k_backend *be, size_t n, const float *a, const float *b, float *y)
{
    S_CALL(be, add, n, a, b, y);
}
zps_status k_scale(const k_backend *be, size_t n, float alpha, float *x)
{
    S_CALL(be, scale, n, alpha, x);
}
zps_status k_axpy(const k_backend *be, size_t n, float alpha, const float *x, float *y)
{
    S_CALL(be, axpy, n, alpha, x, y);
}
zps_status k_optim_apply(const k_backend *be, const zps_optim_step *s, size_t n, float *w,
                         float *s0, float *s1, const float *g)
{
    S_CALL(be, optim_apply, s, n, w, s0, s1, g);
}
zps_status k_pack_bf16(const k_backend *be, size_t n, const float *x, uint16_t *y)
{
    S_CALL(be, pack_bf16, n, x, y);
}
zps_status k_sum(const k_backend *be, size_t n, const float *x, double *out)
{
    S_CALL(be, sum, n, x, out);
}
zps_status k_sumsq(const k_backend *be, size_t n, const float *x, double *out)
{
    S_CALL(be, sumsq, n, x, out);
}
