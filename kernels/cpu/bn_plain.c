/* bn_plain.c — the cpu back-end's training batchnorm (+ fused ReLU) on NCHW data, in its own
 * loops (cpu_int.h).
 *
 * Why not oneDNN: on NCHW (a model whose channel counts are not multiples of 16, such as
 * Inception-v3 at width 0.25) oneDNN 2.6 picks its ncsp_bnorm, which ran the convnet's
 * batchnorm forward + backward slower than all its convolutions together (docs/kernels.md,
 * "Where the step goes"). A plane of one channel is contiguous in NCHW, so the loops below are
 * plain streams the compiler vectorises (AVX-512/AVX2 clones, common/simd.h).
 *
 * Semantics are oneDNN's and ref's: the forward normalises with the statistics bn.c summed in
 * double (mean, biased variance, the mean's float residual folded into the shift), as
 * gamma * (x - mean) / sd + shift, then the ReLU; the backward differentiates through the
 * statistics, masks by y > 0 under the fused ReLU (the same mask as oneDNN's workspace: y is
 * the ReLU of the pre-activation), sums its two reductions in double and overwrites dx.
 */
#include <math.h>

#include "common/simd.h"
#include "kernels/cpu/cpu_int.h"

enum { S_LANES = 16 }; /* independent float sums in a plane: one AVX-512 vector */

/* y = relu?(a (x - m) + b) over one plane. */
static inline void s_affine(size_t n, const float *restrict x, float a, float m, float b,
                            int relu, float *restrict y)
{
    if (relu)
        for (size_t i = 0; i < n; i++) {
            float v = a * (x[i] - m) + b;
            y[i] = v > 0.0f ? v : 0.0f;
        }
    else
        for (size_t i = 0; i < n; i++)
            y[i] = a * (x[i] - m) + b;
}

ZPS_SIMD_CLONES
void k_cpu_bn_plain_fwd(const k_bn *d, const float *x, const float *mean, const float *var,
                        const float *gamma, const float *shift, float *y)
{
    const size_t hw = (size_t)d->h * d->w;
    for (int c = 0; c < d->c; c++) {
        const float a = (float)((double)gamma[c] / sqrt((double)var[c] + d->eps));
        for (int n = 0; n < d->n; n++) {
            size_t o = ((size_t)n * d->c + c) * hw;
            s_affine(hw, x + o, a, mean[c], shift[c], d->relu, y + o);
        }
    }
}

/* g = dy, masked where y <= 0 under the ReLU. */
static inline float s_g(int relu, float y, float dy) { return relu && !(y > 0.0f) ? 0.0f : dy; }

/* Adds one plane's sums of g and of g * (x - m) to *sg and *sgx. The plane is summed in float
 * (S_LANES interleaved sums in registers: at most a few hundred terms each), then added in
 * double across planes. */
static inline void s_plane_sums(size_t n, const float *restrict x, const float *restrict y,
                                const float *restrict dy, float m, int relu, double *sg,
                                double *sgx)
{
    float s[S_LANES] = {0}, t[S_LANES] = {0}, a = 0, b = 0;
    size_t i = 0;
    for (; i + S_LANES <= n; i += S_LANES)
        for (int l = 0; l < S_LANES; l++) {
            float g = s_g(relu, y[i + l], dy[i + l]);
            s[l] += g;
            t[l] += g * (x[i + l] - m);
        }
    for (; i < n; i++) {
        float g = s_g(relu, y[i], dy[i]);
        a += g;
        b += g * (x[i] - m);
    }
    double da = a, db = b;
    for (int l = 0; l < S_LANES; l++)
        da += s[l], db += t[l];
    *sg += da, *sgx += db;
}

/* dx = k (g - mg - (x - m) kx) over one plane. */
static inline void s_plane_dx(size_t n, const float *restrict x, const float *restrict y,
                              const float *restrict dy, float m, int relu, float k, float mg,
                              float kx, float *restrict dx)
{
    if (relu)
        for (size_t i = 0; i < n; i++)
            dx[i] = k * ((y[i] > 0.0f ? dy[i] : 0.0f) - mg - (x[i] - m) * kx);
    else
        for (size_t i = 0; i < n; i++)
            dx[i] = k * (dy[i] - mg - (x[i] - m) * kx);
}

ZPS_SIMD_CLONES
void k_cpu_bn_plain_bwd(const k_bn *d, const float *x, const float *y, const float *dy,
                        const float *gamma, const float *mean, const float *var, float *dx,
                        float *dgamma, float *dbeta)
{
    const size_t hw = (size_t)d->h * d->w;
    const double cnt = (double)d->n * hw;
    for (int c = 0; c < d->c; c++) {
        const float m = mean[c];
        const double inv = 1.0 / sqrt((double)var[c] + d->eps);
        double sg = 0, sgx = 0;
        for (int n = 0; n < d->n; n++) {
            size_t o = ((size_t)n * d->c + c) * hw;
            s_plane_sums(hw, x + o, y ? y + o : dy + o, dy + o, m, d->relu, &sg, &sgx);
        }
        dbeta[c] = (float)sg;
        dgamma[c] = (float)(sgx * inv);
        if (!dx)
            continue;
        /* dx = gamma inv (g - sg / cnt - (x - mean) inv^2 sgx / cnt) */
        const float k = (float)(gamma[c] * inv), mg = (float)(sg / cnt);
        const float kx = (float)(sgx * inv * inv / cnt);
        for (int n = 0; n < d->n; n++) {
            size_t o = ((size_t)n * d->c + c) * hw;
            s_plane_dx(hw, x + o, y ? y + o : dy + o, dy + o, m, d->relu, k, mg, kx, dx + o);
        }
    }
}
