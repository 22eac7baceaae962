/* bn_pool.cu — the CUDA back-end's batchnorm (+ReLU) and pooling (kernels/kernels.h k_bn,
 * k_pool), own kernels written to ref's semantics: biased batch variance, unbiased running
 * variance, padding counted by average pooling, the first maximum in scan order. Backward
 * accumulates (+=) into dgamma and dbeta and overwrites dx.
 */
#include <stdlib.h>

#include "kernels/cuda/bn_math.h"
#include "kernels/cuda/cuda_int.h"
#include "kernels/cuda/pool_math.h"

/* ---- batchnorm ----
 * Statistics and gradient sums: a grid of (channel, split) blocks, each summing its channel
 * over a run of images in double, its partials written to the descriptor's scratch; one
 * thread per channel then adds a channel's partials in split order (deterministic: no
 * atomics) into the mean and biased variance, or the two gradient sums. Splits are chosen so
 * that the grid has about S_BN_BLOCKS blocks even for a few channels of large maps (the
 * stem's 32 channels at 147x147), where one block per channel would leave most of the GPU
 * idle. Elementwise passes run one block per (image, channel) plane, so no thread divides an
 * index by the map size. */

#define S_BN_BLOCKS 2048

/* Each thread's a and b summed over the block into s1[0] and s2[0] (shared arrays of
 * blockDim.x, a power of two), the same tree in both statistics and gradient sums. */
__device__ void d_block_sum2(double *s1, double *s2, double a, double b)
{
    s1[threadIdx.x] = a, s2[threadIdx.x] = b;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s)
            s1[threadIdx.x] += s1[threadIdx.x + s], s2[threadIdx.x] += s2[threadIdx.x + s];
        __syncthreads();
    }
}

/* Block (ch, split): images [split * per, +per) of channel ch. mode 0: sums of x and x^2;
 * mode 1: sums of g and g * xhat, g = dy masked by y > 0 where relu. Partials at
 * part[ch * splits + split] and part[(c + ch) * splits + split]. */
__global__ void g_bn_part(int mode, int n, int c, int hw, int per, const float *x,
                          const float *y, const float *dy, const float *mean, const float *var,
                          float eps, int relu, double *part)
{
    int ch = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    __shared__ double s1[KC_T], s2[KC_T];
    double a, b, m = 0, inv = 0;
    if (mode)
        m = mean[ch], inv = K_BN_RSQRT((double)var[ch] + eps);
    k_bn_part_thread(mode, n, c, hw, per, ch, split, (int)threadIdx.x, (int)blockDim.x, x, y,
                     dy, m, inv, relu, &a, &b);
    d_block_sum2(s1, s2, a, b);
    if (threadIdx.x == 0)
        part[(size_t)ch * splits + split] = s1[0], part[(size_t)(c + ch) * splits + split] = s2[0];
}
__global__ void g_bn_stats_fin(int c, int splits, double cnt, const double *part, float *mean,
                               float *var)
{
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c)
        return;
    double a, b;
    k_bn_total(part, c, splits, ch, &a, &b);
    k_bn_stats(a, b, cnt, &mean[ch], &var[ch]);
}
__global__ void g_bn_grad_fin(int c, int splits, const double *part, float *sg, float *sgx,
                              float *dgamma, float *dbeta)
{
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c)
        return;
    double a, b;
    k_bn_total(part, c, splits, ch, &a, &b);
    sg[ch] = (float)a, sgx[ch] = (float)b;
    if (dbeta)
        dbeta[ch] += (float)a;
    if (dgamma)
        dgamma[ch] += (float)b;
}
/* One block per (image, channel) plane. */
__global__ void g_bn_apply(int c, int hw, const float *x, const float *g, const float *b,
                           const float *mean, const float *var, float eps, int relu, float *y)
{
    size_t plane = blockIdx.x;
    int ch = (int)(plane % c);
    float m = mean[ch], inv = K_BN_RSQRTF(var[ch] + eps), gg = g[ch], bb = b[ch];
    const float *px = x + plane * hw;
    float *py = y + plane * hw;
    for (int i = threadIdx.x; i < hw; i += blockDim.x)
        py[i] = k_bn_apply_el(px[i], m, inv, gg, bb, relu);
}
__global__ void g_bn_running(int c, float m, float unbias, const float *mean, const float *var,
                             float *rm, float *rv)
{
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch < c) {
        if (rm)
            rm[ch] = (1.0f - m) * rm[ch] + m * mean[ch];
        if (rv)
            rv[ch] = (1.0f - m) * rv[ch] + m * var[ch] * unbias;
    }
}
__global__ void g_bn_bwd_dx(int c, int hw, float cnt, const float *x, const float *y,
                            const float *dy, const float *gamma, const float *mean,
                            const float *var, float eps, int relu, const float *sg,
                            const float *sgx, float *dx)
{
    size_t plane = blockIdx.x, base = plane * hw;
    int ch = (int)(plane % c);
    float inv = K_BN_RSQRTF(var[ch] + eps), m = mean[ch], g = gamma[ch];
    float mg = sg[ch] / cnt, mgx = sgx[ch] / cnt;
    for (int i = threadIdx.x; i < hw; i += blockDim.x)
        dx[base + i] = k_bn_dx_at(x, y, dy, base + i, g, m, inv, mg, mgx, relu);
}

/* A descriptor's scratch, made on first use (forward or backward) for its shape. */
typedef struct s_bn_impl {
    int kind;     // KC_IMPL_BN
    int splits;   // blocks per channel in the sums
    int per;      // images per split
    double *part; // (2 c splits) device partial sums
    float *sums;  // (2c) device: the gradient sums sg, sgx
} s_bn_impl;

static zps_status s_bn_build(const k_bn *d, s_bn_impl *im)
{
    k_bn_split(d->n, d->c, S_BN_BLOCKS, &im->splits, &im->per);
    /* through k_cuda_grow, which clears a failed allocation's error: left pending, the next
     * op's launch check would report it as its own */
    size_t cap_part = 0, cap_sums = 0;
    ZPS_TRY(k_cuda_grow((void **)&im->part, &cap_part,
                        sizeof(double) * 2 * (size_t)d->c * im->splits, 0));
    ZPS_TRY(k_cuda_grow((void **)&im->sums, &cap_sums, sizeof(float) * 2 * (size_t)d->c, 0));
    return ZPS_OK;
}

/* d's scratch, made on first use; a set-up that fails leaves none (the next call tries
 * again), never a half-made one. */
static zps_status s_bn_get(k_bn *d, s_bn_impl **out)
{
    s_bn_impl *im = (s_bn_impl *)d->impl;
    if (!im) {
        im = (s_bn_impl *)calloc(1, sizeof *im);
        if (!im)
            return ZPS_ERR_NOMEM;
        im->kind = KC_IMPL_BN;
        zps_status st = s_bn_build(d, im);
        if (st != ZPS_OK) {
            k_cuda_bn_release(im);
            return st;
        }
        d->impl = im;
    }
    *out = im;
    return ZPS_OK;
}

/* Threads for a block that walks hw values: a warp multiple, at most KC_T. */
static unsigned s_plane_threads(int hw) { return hw >= KC_T ? KC_T : (unsigned)((hw + 31) / 32 * 32); }

zps_status k_cuda_bn_fwd_train(k_bn *d, const float *x, const float *gamma, const float *beta,
                                 float *y, float *mean, float *var, float *rm, float *rv)
{
    s_bn_impl *im;
    ZPS_TRY(s_bn_get(d, &im));
    int hw = d->h * d->w;
    double cnt = (double)d->n * hw;
    g_bn_part<<<dim3(d->c, im->splits), KC_T, 0, k_cuda_stream>>>(0, d->n, d->c, hw, im->per, x, NULL,
                                                            NULL, NULL, NULL, 0, 0, im->part);
    g_bn_stats_fin<<<(d->c + 127) / 128, 128, 0, k_cuda_stream>>>(d->c, im->splits, cnt, im->part,
                                                             mean, var);
    g_bn_apply<<<(unsigned)((size_t)d->n * d->c), s_plane_threads(hw), 0, k_cuda_stream>>>(
        d->c, hw, x, gamma, beta, mean, var, d->eps, d->relu, y);
    g_bn_running<<<(d->c + 127) / 128, 128, 0, k_cuda_stream>>>(
        d->c, d->momentum, cnt > 1 ? (float)(cnt / (cnt - 1)) : 1.0f, mean, var, rm, rv);
    KC_LAUNCHED();
    return ZPS_OK;
}
zps_status k_cuda_bn_fwd_infer(k_bn *d, const float *x, const float *gamma, const float *beta,
                                 const float *rm, const float *rv, float *y)
{
    int hw = d->h * d->w;
    g_bn_apply<<<(unsigned)((size_t)d->n * d->c), s_plane_threads(hw), 0, k_cuda_stream>>>(
        d->c, hw, x, gamma, beta, rm, rv, d->eps, d->relu, y);
    KC_LAUNCHED();
    return ZPS_OK;
}

zps_status k_cuda_bn_bwd(k_bn *d, const float *x, const float *y, const float *dy,
                           const float *gamma, const float *mean, const float *var, float *dx,
                           float *dgamma, float *dbeta)
{
    s_bn_impl *im;
    ZPS_TRY(s_bn_get(d, &im));
    int hw = d->h * d->w;
    g_bn_part<<<dim3(d->c, im->splits), KC_T, 0, k_cuda_stream>>>(1, d->n, d->c, hw, im->per, x, y,
                                                            dy, mean, var, d->eps, d->relu,
                                                            im->part);
    g_bn_grad_fin<<<(d->c + 127) / 128, 128, 0, k_cuda_stream>>>(d->c, im->splits, im->part,
                                                            im->sums, im->sums + d->c, dgamma,
                                                            dbeta);
    if (dx)
        g_bn_bwd_dx<<<(unsigned)((size_t)d->n * d->c), s_plane_threads(hw), 0, k_cuda_stream>>>(
            d->c, hw, (float)((double)d->n * hw), x, y, dy, gamma, mean, var, d->eps, d->relu,
            im->sums, im->sums + d->c, dx);
    KC_LAUNCHED();
    return ZPS_OK;
}

void k_cuda_bn_release(void *impl)
{
    s_bn_impl *im = (s_bn_impl *)impl;
    if (!im)
        return;
    cudaFree(im->part);
    cudaFree(im->sums);
    free(im);
}

/* ---- pooling: one thread per output (forward) / per input (backward), pool_math.h's
 * element functions (tested on the CPU against ref) ---- */

__global__ void g_pool_fwd(k_pool d, const float *x, float *y)
{
    size_t total = (size_t)d.n * d.c * d.oh * d.ow;
    KC_LOOP(i, total) y[i] = k_pool_fwd_at(&d, x, i);
}
__global__ void g_pool_bwd(k_pool d, const float *x, const float *dy, float *dx)
{
    size_t total = (size_t)d.n * d.c * d.h * d.w;
    KC_LOOP(i, total) dx[i] = k_pool_bwd_at(&d, x, dy, i);
}
zps_status k_cuda_pool_fwd(k_pool *d, const float *x, float *y)
{
    g_pool_fwd<<<kc_blocks((size_t)d->n * d->c * d->oh * d->ow), KC_T, 0, k_cuda_stream>>>(*d, x, y);
    KC_LAUNCHED();
    return ZPS_OK;
}
zps_status k_cuda_pool_bwd(k_pool *d, const float *x, const float *y, const float *dy, float *dx)
{
    (void)y;
    g_pool_bwd<<<kc_blocks((size_t)d->n * d->c * d->h * d->w), KC_T, 0, k_cuda_stream>>>(*d, x, dy, dx);
    KC_LAUNCHED();
    return ZPS_OK;
}
