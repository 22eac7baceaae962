/* bn_math.h — the CUDA back-end's batchnorm (bn_pool.cu) as functions the CPU can run too:
 * how the sums are split over blocks, one thread's share of a block's sums, a channel's
 * totals and statistics, and one element of the forward and of dx. The kernels call them;
 * tests/test_k_cuda_math.c runs the same grid on the CPU (the block's tree sum included) and
 * checks it against ref without a GPU. Only the reciprocal square root differs between the
 * two: the device's rsqrt/rsqrtf (within 2 ulp) against 1/sqrt here.
 */
#ifndef ZPS_KERNELS_CUDA_BN_MATH_H
#define ZPS_KERNELS_CUDA_BN_MATH_H

#include "common/hd.h"

#include <math.h>
#include <stddef.h>

#ifdef __CUDA_ARCH__
#define K_BN_RSQRT(v) rsqrt(v)
#define K_BN_RSQRTF(v) rsqrtf(v)
#else
#define K_BN_RSQRT(v) (1.0 / sqrt(v))
#define K_BN_RSQRTF(v) (1.0f / sqrtf(v))
#endif

/* About `blocks` blocks for the sums of n images of c channels: *splits blocks per channel,
 * each over *per images, none empty (so a few channels of large maps still fill the GPU). */
ZPS_HD void k_bn_split(int n, int c, int blocks, int *splits, int *per)
{
    int want = (blocks + c - 1) / c;
    int s = want < 1 ? 1 : want > n ? n : want;
    *per = (n + s - 1) / s;
    *splits = (n + *per - 1) / *per;
}

/* Thread t of nt's share of block (ch, split): images [split * per, +per) of channel ch, its
 * values t, t + nt, ... of each plane. mode 0: sums of x and x^2; mode 1: sums of g and
 * g * xhat, g = dy masked by y > 0 where relu, with mean m and inv = 1/sqrt(var + eps). */
ZPS_HD void k_bn_part_thread(int mode, int n, int c, int hw, int per, int ch, int split,
                              int t, int nt, const float *x, const float *y, const float *dy,
                              double m, double inv, int relu, double *pa, double *pb)
{
    double a = 0, b = 0;
    int n0 = split * per, n1 = n0 + per < n ? n0 + per : n;
    for (int img = n0; img < n1; img++) {
        size_t base = ((size_t)img * c + ch) * hw;
        for (int i = t; i < hw; i += nt) {
            double v = x[base + i];
            if (!mode) {
                a += v, b += v * v;
                continue;
            }
            double gv = relu && !(y[base + i] > 0) ? 0.0 : dy[base + i];
            a += gv, b += gv * (v - m) * inv;
        }
    }
    *pa = a, *pb = b;
}

/* Channel ch's two sums: its blocks' partials (part[ch * splits + s], part[(c + ch) * splits
 * + s]) added in split order. */
ZPS_HD void k_bn_total(const double *part, int c, int splits, int ch, double *a, double *b)
{
    *a = 0, *b = 0;
    for (int s = 0; s < splits; s++)
        *a += part[(size_t)ch * splits + s], *b += part[(size_t)(c + ch) * splits + s];
}

/* The batch mean and biased variance of a channel from its sums over cnt values. */
ZPS_HD void k_bn_stats(double a, double b, double cnt, float *mean, float *var)
{
    double m = a / cnt, v = b / cnt - m * m;
    *mean = (float)m;
    *var = (float)(v > 0 ? v : 0);
}

/* One element of the forward: gamma (x - mean) / sqrt(var + eps) + beta, then relu. */
ZPS_HD float k_bn_apply_el(float x, float m, float inv, float g, float b, int relu)
{
    float v = g * (x - m) * inv + b;
    return relu && v < 0 ? 0.0f : v;
}

/* Element i of dx, from the channel's mean gradient sums mg = sg / cnt and mgx = sgx / cnt
 * (y is read only with relu: it may be NULL without). */
ZPS_HD float k_bn_dx_at(const float *x, const float *y, const float *dy, size_t i, float g,
                         float m, float inv, float mg, float mgx, int relu)
{
    float gv = relu && !(y[i] > 0) ? 0.0f : dy[i];
    float xh = (x[i] - m) * inv;
    return g * inv * (gv - mg - xh * mgx);
}

#endif
