/* pool_math.h — one element of the CUDA back-end's pooling (bn_pool.cu), as functions the
 * CPU can run too: the kernels call them per thread, and tests/test_k_cuda_math.c checks
 * them against ref's pooling on random shapes without a GPU. Semantics are ref's: padding
 * counted by average pooling, the first maximum in scan order, the same summation order.
 */
#ifndef ZPS_KERNELS_CUDA_POOL_MATH_H
#define ZPS_KERNELS_CUDA_POOL_MATH_H

#include "common/hd.h"

#include <stddef.h>

#include "kernels/kernels.h"

/* Output i (flat NCHW index over n, c, oh, ow) of the forward pass over x. */
ZPS_HD float k_pool_fwd_at(const k_pool *d, const float *x, size_t i)
{
    int ox = (int)(i % d->ow), oy = (int)((i / d->ow) % d->oh);
    const float *p = x + (i / ((size_t)d->oh * d->ow)) * d->h * d->w;
    float best = 0;
    int found = 0;
    double acc = 0;
    for (int r = 0; r < d->r; r++) {
        int iy = oy * d->stride_h - d->pad_h + r;
        if (iy < 0 || iy >= d->h)
            continue;
        for (int s = 0; s < d->s; s++) {
            int ix = ox * d->stride_w - d->pad_w + s;
            if (ix < 0 || ix >= d->w)
                continue;
            float v = p[iy * d->w + ix];
            if (!found || v > best)
                best = v;
            found = 1;
            acc += v;
        }
    }
    return d->kind == K_POOL_MAX ? best : (float)(acc / (d->r * d->s));
}

/* The outputs o in [*lo, *hi] of one axis whose window [o * stride - pad, + k) holds input
 * i: o * stride <= i + pad < o * stride + k (empty when *lo > *hi). Floor division, also of
 * the negative i + pad - k. */
ZPS_HD void k_pool_span(int i, int pad, int k, int stride, int n_out, int *lo, int *hi)
{
    int a = i + pad - k, below = a >= 0 ? a / stride : -((-a + stride - 1) / stride);
    *lo = below + 1 > 0 ? below + 1 : 0;
    *hi = (i + pad) / stride < n_out - 1 ? (i + pad) / stride : n_out - 1;
}

/* Input gradient i (flat NCHW index over n, c, h, w): the sum over the outputs whose window
 * holds it (max: whose argmax it is, first maximum in scan order as in ref), visiting only
 * those outputs, in the order a scan of every output would. */
ZPS_HD float k_pool_bwd_at(const k_pool *d, const float *x, const float *dy, size_t i)
{
    int ix = (int)(i % d->w), iy = (int)((i / d->w) % d->h);
    size_t plane = i / ((size_t)d->h * d->w);
    const float *p = x + plane * d->h * d->w;
    const float *g = dy + plane * d->oh * d->ow;
    float acc = 0;
    int oy0, oy1, ox0, ox1;
    k_pool_span(iy, d->pad_h, d->r, d->stride_h, d->oh, &oy0, &oy1);
    k_pool_span(ix, d->pad_w, d->s, d->stride_w, d->ow, &ox0, &ox1);
    for (int oy = oy0; oy <= oy1; oy++) {
        int y0 = oy * d->stride_h - d->pad_h;
        for (int ox = ox0; ox <= ox1; ox++) {
            int x0 = ox * d->stride_w - d->pad_w;
            if (d->kind == K_POOL_AVG) {
                acc += g[oy * d->ow + ox] / (float)(d->r * d->s);
                continue;
            }
            int by = -1, bx = -1;
            float bv = 0;
            for (int r = 0; r < d->r; r++) {
                int yy = y0 + r;
                if (yy < 0 || yy >= d->h)
                    continue;
                for (int s = 0; s < d->s; s++) {
                    int xx = x0 + s;
                    if (xx < 0 || xx >= d->w)
                        continue;
                    if (by < 0 || p[yy * d->w + xx] > bv)
                        bv = p[yy * d->w + xx], by = yy, bx = xx;
                }
            }
            if (by == iy && bx == ix)
                acc += g[oy * d->ow + ox];
        }
    }
    return acc;
}

#endif
