/* bn_pool.c — the cpu back-end's fusion of batchnorm (training) + ReLU with the 2x2 stride-2
 * max pool that reads its output, for 16-channel blocks on AVX-512 (kernels.h, k_bn_pool_fwd).
 *
 * Why: run one by one, the batchnorm writes its output map, the pool reads it, the pool's
 * backward writes the map's gradient and batchnorm's backward reads it twice: five passes over
 * a map four times the pooled one. At the convnet's first block (28x28x32, batch 32: 3.2 MB)
 * none of them stays in this machine's 1 MiB of L2 per core, and together they were a fifth of
 * the one-thread step. Fused, the map is never written: the forward reads x once (after the
 * statistics' pass), the backward reads it once and writes dx.
 *
 * Forward: statistics as bn.c's (k_cpu_bn_train_stats: double sums, the shift corrected for the
 * float mean), then per window of 16 channels z = (x - mean) s + shift (s = gamma / sd),
 * y = max(z, 0), and the first maximum of y in ref's window order ((0,0), (0,1), (1,0), (1,1)),
 * written to the pooled y. The pool's impl keeps, per output, where the maximum was (arg: the
 * max-pool loops' two masks), whether it was above 0 (act) and x there (xmax).
 *
 * Backward: the gradient reaching z is dz = dy at a window's maximum when it was above 0, else
 * 0 (the pool's, then the ReLU's rule). With M = n h w values per channel and r = 1 / sd:
 *   pass 1, over the pooled map: sz = sum dz, sx = sum dz (xmax - mean), per channel (float
 *           within a row of the map, double across rows); dbeta += sz, dgamma += r sx;
 *   pass 2, over x: dx = k dz + b (x - mean) + c, with k = gamma r, b = -k r^2 sx / M and
 *           c = -k sz / M (batchnorm's backward through its batch statistics).
 * Both passes are this thread's alone (the statistics' pass too, bn.c): oneDNN's batchnorm
 * would have used every core; the fused passes move a third of the bytes.
 */
#include <math.h>
#include <stdint.h>

#include "common/check.h"
#include "kernels/cpu/cpu_int.h"

int k_cpu_bn_pool_fuses(const k_bn *bn, const k_pool *pool)
{
    return bn->blocked == K_BLOCK16 && k_cpu_pool_max2(pool);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define S_AVX512 __attribute__((target("avx512f")))

/* One row of outputs (ow windows over two input rows r0, r1) forward. */
S_AVX512 static void s_fwd_row(int ow, const float *r0, const float *r1, __m512 vm, __m512 vs,
                               __m512 vt, float *y, uint16_t *arg, uint16_t *act, float *xmax)
{
    const __m512 zero = _mm512_setzero_ps();
    for (int ox = 0; ox < ow; ox++, y += 16, xmax += 16, arg += 2, act++) {
        __m512 a = _mm512_loadu_ps(r0 + 32 * ox), b = _mm512_loadu_ps(r0 + 32 * ox + 16);
        __m512 c = _mm512_loadu_ps(r1 + 32 * ox), e = _mm512_loadu_ps(r1 + 32 * ox + 16);
        __m512 ya = _mm512_max_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(a, vm), vs), vt), zero);
        __m512 yb = _mm512_max_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(b, vm), vs), vt), zero);
        __m512 yc = _mm512_max_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(c, vm), vs), vt), zero);
        __m512 ye = _mm512_max_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(e, vm), vs), vt), zero);
        __mmask16 kb = _mm512_cmp_ps_mask(yb, ya, _CMP_GT_OQ);
        __m512 m = _mm512_mask_mov_ps(ya, kb, yb), xm = _mm512_mask_mov_ps(a, kb, b);
        __mmask16 kc = _mm512_cmp_ps_mask(yc, m, _CMP_GT_OQ);
        m = _mm512_mask_mov_ps(m, kc, yc), xm = _mm512_mask_mov_ps(xm, kc, c);
        __mmask16 ke = _mm512_cmp_ps_mask(ye, m, _CMP_GT_OQ);
        m = _mm512_mask_mov_ps(m, ke, ye), xm = _mm512_mask_mov_ps(xm, ke, e);
        _mm512_storeu_ps(y, m);
        _mm512_storeu_ps(xmax, xm);
        arg[0] = (uint16_t)(ke | (kb & ~kc)), arg[1] = (uint16_t)(ke | kc);
        *act = (uint16_t)_mm512_cmp_ps_mask(m, zero, _CMP_GT_OQ);
    }
}

S_AVX512 static void s_fwd(const k_pool *p, const float *x, const float *mean,
                           const float *scale, const float *shift, float *y, uint16_t *arg,
                           uint16_t *act, float *xmax)
{
    const int cb_n = p->c / 16;
    const size_t rows = (size_t)p->n * cb_n * p->oh, in = (size_t)p->w * 16;
    const size_t out = (size_t)p->ow * 16;
    for (size_t r = 0; r < rows; r++) {
        int cb = (int)(r / (size_t)p->oh % (size_t)cb_n);
        const float *r0 = x + 2 * r * in;
        s_fwd_row(p->ow, r0, r0 + in, _mm512_loadu_ps(mean + 16 * cb),
                  _mm512_loadu_ps(scale + 16 * cb), _mm512_loadu_ps(shift + 16 * cb),
                  y + r * out, arg + 2 * r * p->ow, act + r * p->ow, xmax + r * out);
    }
}

/* Pass 1: sz and sx per channel (s: 2 c doubles, zeroed here). */
S_AVX512 static void s_bwd_sums(const k_pool *p, const float *dy, const float *mean,
                                const uint16_t *act, const float *xmax, double *s)
{
    const int cb_n = p->c / 16;
    const size_t rows = (size_t)p->n * cb_n * p->oh, out = (size_t)p->ow * 16;
    for (int k = 0; k < 2 * p->c; k++)
        s[k] = 0;
    float pz[16], px[16];
    for (size_t r = 0; r < rows; r++) {
        int cb = (int)(r / (size_t)p->oh % (size_t)cb_n);
        const __m512 vm = _mm512_loadu_ps(mean + 16 * cb);
        const float *g = dy + r * out, *xm = xmax + r * out;
        const uint16_t *ac = act + r * p->ow;
        __m512 z = _mm512_setzero_ps(), q = _mm512_setzero_ps();
        for (int ox = 0; ox < p->ow; ox++) {
            __m512 dz = _mm512_maskz_mov_ps(ac[ox], _mm512_loadu_ps(g + 16 * ox));
            z = _mm512_add_ps(z, dz);
            q = _mm512_add_ps(q, _mm512_mul_ps(dz, _mm512_sub_ps(_mm512_loadu_ps(xm + 16 * ox), vm)));
        }
        _mm512_storeu_ps(pz, z);
        _mm512_storeu_ps(px, q);
        for (int l = 0; l < 16; l++)
            s[16 * cb + l] += pz[l], s[p->c + 16 * cb + l] += px[l];
    }
}

/* Pass 2: dx = k dz + b (x - mean) + c over every window (coef: k, b, c, each c floats). */
S_AVX512 static void s_bwd_dx(const k_pool *p, const float *x, const float *dy,
                              const float *mean, const float *coef, const uint16_t *arg,
                              const uint16_t *act, float *dx)
{
    const int cb_n = p->c / 16, c = p->c;
    const size_t rows = (size_t)p->n * cb_n * p->oh, in = (size_t)p->w * 16;
    const size_t out = (size_t)p->ow * 16;
    for (size_t r = 0; r < rows; r++) {
        int cb = (int)(r / (size_t)p->oh % (size_t)cb_n);
        const __m512 vm = _mm512_loadu_ps(mean + 16 * cb), vk = _mm512_loadu_ps(coef + 16 * cb);
        const __m512 vb = _mm512_loadu_ps(coef + c + 16 * cb);
        const __m512 vc = _mm512_loadu_ps(coef + 2 * c + 16 * cb);
        const float *x0 = x + 2 * r * in, *x1 = x0 + in, *g = dy + r * out;
        float *d0 = dx + 2 * r * in, *d1 = d0 + in;
        const uint16_t *ag = arg + 2 * r * p->ow, *ac = act + r * p->ow;
        for (int ox = 0; ox < p->ow; ox++) {
            __m512 gk = _mm512_mul_ps(_mm512_loadu_ps(g + 16 * ox), vk);
            __mmask16 b0 = ag[2 * ox], b1 = ag[2 * ox + 1], on = ac[ox];
            const float *src[4] = {x0 + 32 * ox, x0 + 32 * ox + 16, x1 + 32 * ox,
                                   x1 + 32 * ox + 16};
            float *dst[4] = {d0 + 32 * ox, d0 + 32 * ox + 16, d1 + 32 * ox, d1 + 32 * ox + 16};
            __mmask16 sel[4] = {on & ~b1 & ~b0, on & ~b1 & b0, on & b1 & ~b0, on & b1 & b0};
            for (int j = 0; j < 4; j++) {
                __m512 v = _mm512_add_ps(
                    _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(src[j]), vm), vb), vc);
                _mm512_storeu_ps(dst[j], _mm512_mask_add_ps(v, sel[j], v, gk));
            }
        }
    }
}
#else
static void s_fwd(const k_pool *p, const float *x, const float *mean, const float *scale,
                  const float *shift, float *y, uint16_t *arg, uint16_t *act, float *xmax)
{
    (void)p, (void)x, (void)mean, (void)scale, (void)shift, (void)y, (void)arg, (void)act;
    (void)xmax;
}
static void s_bwd_sums(const k_pool *p, const float *dy, const float *mean,
                       const uint16_t *act, const float *xmax, double *s)
{
    (void)p, (void)dy, (void)mean, (void)act, (void)xmax, (void)s;
}
static void s_bwd_dx(const k_pool *p, const float *x, const float *dy, const float *mean,
                     const float *coef, const uint16_t *arg, const uint16_t *act, float *dx)
{
    (void)p, (void)x, (void)dy, (void)mean, (void)coef, (void)arg, (void)act, (void)dx;
}
#endif

zps_status k_cpu_bn_pool_fwd(k_bn *bn, k_pool *pool, const float *x, const float *gamma,
                             const float *beta, float *y, float *mean, float *var,
                             float *run_mean, float *run_var)
{
    const float *shift;
    uint16_t *arg, *act;
    float *xmax;
    ZPS_TRY(k_cpu_pool_max2_ws(pool, &arg, &act, &xmax));
    ZPS_TRY(k_cpu_bn_train_stats(bn, x, gamma, beta, mean, var, run_mean, run_var, &shift));
    float *scale = k_cpu_scratch((size_t)bn->c);
    for (int c = 0; c < bn->c; c++)
        scale[c] = (float)(gamma[c] / sqrt((double)var[c] + bn->eps));
    s_fwd(pool, x, mean, scale, shift, y, arg, act, xmax);
    return ZPS_OK;
}

zps_status k_cpu_bn_pool_bwd(k_bn *bn, k_pool *pool, const float *x, const float *dy,
                             const float *gamma, const float *mean, const float *var,
                             float *dx, float *dgamma, float *dbeta)
{
    uint16_t *arg, *act;
    float *xmax;
    ZPS_TRY(k_cpu_pool_max2_ws(pool, &arg, &act, &xmax));
    const int C = bn->c;
    /* one scratch block: the sums (2 C doubles), then the coefficients (3 C floats) */
    float *sc = k_cpu_scratch((size_t)7 * C);
    double *s = (double *)(void *)sc;
    float *coef = sc + 4 * C;
    s_bwd_sums(pool, dy, mean, act, xmax, s);
    const double M = (double)bn->n * bn->h * bn->w;
    for (int c = 0; c < C; c++) {
        double r = 1.0 / sqrt((double)var[c] + bn->eps), k = gamma[c] * r;
        if (dgamma)
            dgamma[c] += (float)(s[C + c] * r);
        if (dbeta)
            dbeta[c] += (float)s[c];
        coef[c] = (float)k;
        coef[C + c] = (float)(-k * r * r * s[C + c] / M);
        coef[2 * C + c] = (float)(-k * s[c] / M);
    }
    if (dx)
        s_bwd_dx(pool, x, dy, mean, coef, arg, act, dx);
    return ZPS_OK;
}
