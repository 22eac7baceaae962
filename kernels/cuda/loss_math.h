/* loss_math.h — the CUDA back-end's losses (backend.cu) per row and per element, as functions
 * the CPU can run too: softmax cross-entropy of one row (with label smoothing) and smooth-L1
 * of one element. The kernels call them; tests/test_k_cuda_math.c checks them against ref
 * without a GPU. exp and log are in double on both sides (the device's within an ulp or so).
 */
#ifndef ZPS_KERNELS_CUDA_LOSS_MATH_H
#define ZPS_KERNELS_CUDA_LOSS_MATH_H

#include "common/hd.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* Row r (k logits) with label `label` in [0, k) of a batch of n: its loss (the smoothed
 * targets' cross-entropy), whether its argmax (the first maximum) is the label, and, when
 * dz is not NULL, dz = scale * (softmax - target) / n. */
ZPS_HD void k_xent_row(int k, const float *r, int label, float smooth, float scale, int n,
                          float *dz, float *loss, int *right)
{
    int arg = 0;
    for (int j = 1; j < k; j++)
        if (r[j] > r[arg])
            arg = j;
    double se = 0;
    for (int j = 0; j < k; j++)
        se += exp((double)r[j] - r[arg]);
    double lse = r[arg] + log(se), off = smooth / k, on = 1.0 - smooth + off, l = 0; /* off: float / int, as ref */
    for (int j = 0; j < k; j++) {
        double t = j == label ? on : off, lp = r[j] - lse;
        l -= t * lp;
        if (dz)
            dz[j] = (float)(scale * (exp(lp) - t) / n);
    }
    *loss = (float)l;
    *right = arg == label;
}

/* Element x against target t: its smooth-L1 loss (0.5 d^2 / beta under beta, |d| - beta / 2
 * above), and *dx = scale * its derivative. */
ZPS_HD double k_smooth_l1_el(float x, float t, float beta, float scale, float *dx)
{
    double d = (double)x - t, a = fabs(d), g, l;
    if (a < beta)
        l = 0.5 * d * d / beta, g = d / beta;
    else
        l = a - 0.5 * beta, g = d > 0 ? 1.0 : -1.0;
    *dx = (float)(scale * g);
    return l;
}

#endif
