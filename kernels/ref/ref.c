/* ref.c — plain-C reference ops and the ref back-end's table (see ref.h, and kernels.h for
 * the conventions).
 *
 * Written for obviousness, not speed: direct loops, double accumulators where a sum runs over
 * a whole batch. Backward ops accumulate (+=) into parameter gradients and overwrite input
 * gradients.
 */
#include "kernels/ref/ref.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "common/mem.h"
#include "common/simd.h"
#include "kernels/kernels.h"

void *k_ref_alloc(size_t n) { return zps_xaligned(64, n ? n : 64); }
void k_ref_free(void *p) { zps_aligned_free(p); }
zps_status k_ref_copy(void *dst, const void *src, size_t n)
{
    memmove(dst, src, n);
    return ZPS_OK;
}
/* ref caches nothing in a descriptor's impl. */
static void s_release(void **impl) { *impl = NULL; }

/* An input of a product: as it is, or rounded to bfloat16 for a bf16 convolution. */
static inline double s_in(const k_conv2d *d, float v) { return d->bf16 ? zps_bf16_round(v) : v; }

zps_status k_ref_conv2d_fwd(k_conv2d *d, const float *x, const float *w, const float *b,
                            float *y)
{
    for (int n = 0; n < d->n; n++)
        for (int k = 0; k < d->k; k++)
            for (int oy = 0; oy < d->oh; oy++)
                for (int ox = 0; ox < d->ow; ox++) {
                    double acc = b ? b[k] : 0.0;
                    for (int c = 0; c < d->c; c++)
                        for (int r = 0; r < d->r; r++) {
                            int iy = oy * d->stride_h - d->pad_h + r;
                            if (iy < 0 || iy >= d->h)
                                continue;
                            for (int s = 0; s < d->s; s++) {
                                int ix = ox * d->stride_w - d->pad_w + s;
                                if (ix < 0 || ix >= d->w)
                                    continue;
                                acc += s_in(d, x[((size_t)(n * d->c + c) * d->h + iy) * d->w + ix]) *
                                       s_in(d, w[((size_t)(k * d->c + c) * d->r + r) * d->s + s]);
                            }
                        }
                    y[((size_t)(n * d->k + k) * d->oh + oy) * d->ow + ox] = (float)acc;
                }
    return ZPS_OK;
}

/* Each gradient element is one sum in double, added (dw, db) or stored (dx) once, as the
 * forward sums: a float running sum over a batch's positions (dw of a 32-to-32 3x3 conv at
 * 28x28, batch 8: 6272 terms each) was 1.2e-6 off in relative L2, double 3e-8, and the
 * floors the model comparisons measure on ref are ~1e-5. dx gathers:
 * output row oy reads input row iy through kernel row r where iy = oy * stride - pad + r. */
zps_status k_ref_conv2d_bwd(k_conv2d *d, const float *x, const float *w, const float *dy,
                            float *dx, float *dw, float *db)
{
    size_t ohw = (size_t)d->oh * d->ow;
    if (db) /* a plain sum, not a product: float dy even in bf16 */
        for (int k = 0; k < d->k; k++) {
            double acc = 0;
            for (int n = 0; n < d->n; n++) {
                const float *g = dy + (size_t)(n * d->k + k) * ohw;
                for (size_t i = 0; i < ohw; i++)
                    acc += g[i];
            }
            db[k] += (float)acc;
        }
    if (dw)
        for (int k = 0; k < d->k; k++)
            for (int c = 0; c < d->c; c++)
                for (int r = 0; r < d->r; r++)
                    for (int s = 0; s < d->s; s++) {
                        double acc = 0;
                        for (int n = 0; n < d->n; n++)
                            for (int oy = 0; oy < d->oh; oy++) {
                                int iy = oy * d->stride_h - d->pad_h + r;
                                if (iy < 0 || iy >= d->h)
                                    continue;
                                const float *g = dy + ((size_t)(n * d->k + k) * d->oh + oy) * d->ow;
                                const float *xr = x + ((size_t)(n * d->c + c) * d->h + iy) * d->w;
                                for (int ox = 0; ox < d->ow; ox++) {
                                    int ix = ox * d->stride_w - d->pad_w + s;
                                    if (ix >= 0 && ix < d->w)
                                        acc += s_in(d, g[ox]) * s_in(d, xr[ix]);
                                }
                            }
                        dw[((size_t)(k * d->c + c) * d->r + r) * d->s + s] += (float)acc;
                    }
    if (dx)
        for (int n = 0; n < d->n; n++)
            for (int c = 0; c < d->c; c++)
                for (int iy = 0; iy < d->h; iy++)
                    for (int ix = 0; ix < d->w; ix++) {
                        double acc = 0;
                        for (int k = 0; k < d->k; k++)
                            for (int r = 0; r < d->r; r++) {
                                int ty = iy + d->pad_h - r;
                                if (ty < 0 || ty % d->stride_h || ty / d->stride_h >= d->oh)
                                    continue;
                                const float *g = dy + ((size_t)(n * d->k + k) * d->oh +
                                                       ty / d->stride_h) * d->ow;
                                const float *wr = w + ((size_t)(k * d->c + c) * d->r + r) * d->s;
                                for (int s = 0; s < d->s; s++) {
                                    int tx = ix + d->pad_w - s;
                                    if (tx >= 0 && tx % d->stride_w == 0 &&
                                        tx / d->stride_w < d->ow)
                                        acc += s_in(d, g[tx / d->stride_w]) * s_in(d, wr[s]);
                                }
                            }
                        dx[((size_t)(n * d->c + c) * d->h + iy) * d->w + ix] = (float)acc;
                    }
    return ZPS_OK;
}

/* Mean and biased variance of channel c. */
static void s_bn_stats(const k_bn *d, const float *x, int c, double *mean, double *var)
{
    size_t hw = (size_t)d->h * d->w;
    double s = 0, ss = 0;
    for (int n = 0; n < d->n; n++) {
        const float *p = x + ((size_t)n * d->c + c) * hw;
        for (size_t i = 0; i < hw; i++)
            s += p[i];
    }
    double m = s / ((double)d->n * hw);
    for (int n = 0; n < d->n; n++) {
        const float *p = x + ((size_t)n * d->c + c) * hw;
        for (size_t i = 0; i < hw; i++)
            ss += (p[i] - m) * (p[i] - m);
    }
    *mean = m;
    *var = ss / ((double)d->n * hw);
}

static void s_bn_apply(const k_bn *d, const float *x, int c, double mean, double var,
                       float gamma, float beta, float *y)
{
    size_t hw = (size_t)d->h * d->w;
    double inv = 1.0 / sqrt(var + d->eps);
    for (int n = 0; n < d->n; n++) {
        size_t o = ((size_t)n * d->c + c) * hw;
        for (size_t i = 0; i < hw; i++) {
            float v = (float)(gamma * (x[o + i] - mean) * inv + beta);
            y[o + i] = d->relu && v < 0 ? 0.0f : v;
        }
    }
}

zps_status k_ref_bn_fwd_train(k_bn *d, const float *x, const float *gamma, const float *beta,
                              float *y, float *mean, float *var, float *run_mean,
                              float *run_var)
{
    double cnt = (double)d->n * d->h * d->w;
    for (int c = 0; c < d->c; c++) {
        double m, v;
        s_bn_stats(d, x, c, &m, &v);
        s_bn_apply(d, x, c, m, v, gamma[c], beta[c], y);
        mean[c] = (float)m;
        var[c] = (float)v;
        if (run_mean)
            run_mean[c] = (1.0f - d->momentum) * run_mean[c] + d->momentum * (float)m;
        if (run_var)
            run_var[c] = (1.0f - d->momentum) * run_var[c] +
                         d->momentum * (float)(cnt > 1 ? v * cnt / (cnt - 1) : v);
    }
    return ZPS_OK;
}

zps_status k_ref_bn_fwd_infer(k_bn *d, const float *x, const float *gamma, const float *beta,
                              const float *run_mean, const float *run_var, float *y)
{
    for (int c = 0; c < d->c; c++)
        s_bn_apply(d, x, c, run_mean[c], run_var[c], gamma[c], beta[c], y);
    return ZPS_OK;
}

zps_status k_ref_bn_bwd(k_bn *d, const float *x, const float *y, const float *dy,
                        const float *gamma, const float *mean, const float *var, float *dx,
                        float *dgamma, float *dbeta)
{
    size_t hw = (size_t)d->h * d->w;
    double cnt = (double)d->n * hw;
    for (int c = 0; c < d->c; c++) {
        double inv = 1.0 / sqrt((double)var[c] + d->eps), sg = 0, sgx = 0;
        for (int n = 0; n < d->n; n++) {
            size_t o = ((size_t)n * d->c + c) * hw;
            for (size_t i = 0; i < hw; i++) {
                double g = d->relu && !(y[o + i] > 0) ? 0.0 : dy[o + i];
                sg += g;
                sgx += g * (x[o + i] - mean[c]) * inv;
            }
        }
        if (dbeta)
            dbeta[c] += (float)sg;
        if (dgamma)
            dgamma[c] += (float)sgx;
        if (!dx)
            continue;
        for (int n = 0; n < d->n; n++) {
            size_t o = ((size_t)n * d->c + c) * hw;
            for (size_t i = 0; i < hw; i++) {
                double g = d->relu && !(y[o + i] > 0) ? 0.0 : dy[o + i];
                double xh = (x[o + i] - mean[c]) * inv;
                dx[o + i] = (float)(gamma[c] * inv * (g - sg / cnt - xh * sgx / cnt));
            }
        }
    }
    return ZPS_OK;
}

/* Index (into the input plane) of the max of one window; -1 when the window is all padding. */
static long s_argmax(const k_pool *d, const float *plane, int oy, int ox)
{
    long best = -1;
    float bv = -FLT_MAX;
    for (int r = 0; r < d->r; r++) {
        int iy = oy * d->stride_h - d->pad_h + r;
        if (iy < 0 || iy >= d->h)
            continue;
        for (int s = 0; s < d->s; s++) {
            int ix = ox * d->stride_w - d->pad_w + s;
            if (ix < 0 || ix >= d->w)
                continue;
            long i = (long)iy * d->w + ix;
            if (best < 0 || plane[i] > bv) {
                bv = plane[i];
                best = i;
            }
        }
    }
    return best;
}

zps_status k_ref_pool_fwd(k_pool *d, const float *x, float *y)
{
    size_t ihw = (size_t)d->h * d->w, ohw = (size_t)d->oh * d->ow;
    for (size_t p = 0; p < (size_t)d->n * d->c; p++) {
        const float *plane = x + p * ihw;
        for (int oy = 0; oy < d->oh; oy++)
            for (int ox = 0; ox < d->ow; ox++) {
                float *out = y + p * ohw + (size_t)oy * d->ow + ox;
                if (d->kind == K_POOL_MAX) {
                    long i = s_argmax(d, plane, oy, ox);
                    *out = i < 0 ? 0.0f : plane[i];
                    continue;
                }
                double acc = 0;
                for (int r = 0; r < d->r; r++) {
                    int iy = oy * d->stride_h - d->pad_h + r;
                    if (iy < 0 || iy >= d->h)
                        continue;
                    for (int s = 0; s < d->s; s++) {
                        int ix = ox * d->stride_w - d->pad_w + s;
                        if (ix >= 0 && ix < d->w)
                            acc += plane[(size_t)iy * d->w + ix];
                    }
                }
                *out = (float)(acc / (d->r * d->s));
            }
    }
    return ZPS_OK;
}

zps_status k_ref_pool_bwd(k_pool *d, const float *x, const float *y, const float *dy,
                          float *dx)
{
    (void)y;
    size_t ihw = (size_t)d->h * d->w, ohw = (size_t)d->oh * d->ow;
    memset(dx, 0, sizeof(float) * (size_t)d->n * d->c * ihw);
    for (size_t p = 0; p < (size_t)d->n * d->c; p++) {
        const float *plane = x + p * ihw;
        float *dplane = dx + p * ihw;
        for (int oy = 0; oy < d->oh; oy++)
            for (int ox = 0; ox < d->ow; ox++) {
                float g = dy[p * ohw + (size_t)oy * d->ow + ox];
                if (d->kind == K_POOL_MAX) {
                    long i = s_argmax(d, plane, oy, ox);
                    if (i >= 0)
                        dplane[i] += g;
                    continue;
                }
                float share = g / (float)(d->r * d->s);
                for (int r = 0; r < d->r; r++) {
                    int iy = oy * d->stride_h - d->pad_h + r;
                    if (iy < 0 || iy >= d->h)
                        continue;
                    for (int s = 0; s < d->s; s++) {
                        int ix = ox * d->stride_w - d->pad_w + s;
                        if (ix >= 0 && ix < d->w)
                            dplane[(size_t)iy * d->w + ix] += share;
                    }
                }
            }
    }
    return ZPS_OK;
}

zps_status k_ref_dense_fwd(k_dense *d, const float *x, const float *w, const float *b,
                           float *y)
{
    for (int n = 0; n < d->n; n++)
        for (int o = 0; o < d->out; o++) {
            double acc = b ? b[o] : 0.0;
            for (int i = 0; i < d->in; i++)
                acc += (double)x[(size_t)n * d->in + i] * w[(size_t)o * d->in + i];
            y[(size_t)n * d->out + o] = (float)acc;
        }
    return ZPS_OK;
}

zps_status k_ref_dense_bwd(k_dense *d, const float *x, const float *w, const float *dy,
                           float *dx, float *dw, float *db)
{
    if (dx)
        for (int n = 0; n < d->n; n++)
            for (int i = 0; i < d->in; i++) {
                double acc = 0;
                for (int o = 0; o < d->out; o++)
                    acc += (double)dy[(size_t)n * d->out + o] * w[(size_t)o * d->in + i];
                dx[(size_t)n * d->in + i] = (float)acc;
            }
    for (int o = 0; o < d->out; o++) {
        double accb = 0;
        for (int n = 0; n < d->n; n++)
            accb += dy[(size_t)n * d->out + o];
        if (db)
            db[o] += (float)accb;
        if (dw)
            for (int i = 0; i < d->in; i++) {
                double acc = 0;
                for (int n = 0; n < d->n; n++)
                    acc += (double)dy[(size_t)n * d->out + o] * x[(size_t)n * d->in + i];
                dw[(size_t)o * d->in + i] += (float)acc;
            }
    }
    return ZPS_OK;
}

zps_status k_ref_relu_fwd(size_t n, const float *x, float *y)
{
    for (size_t i = 0; i < n; i++)
        y[i] = x[i] > 0 ? x[i] : 0.0f;
    return ZPS_OK;
}

zps_status k_ref_relu_bwd(size_t n, const float *y, const float *dy, float *dx)
{
    for (size_t i = 0; i < n; i++)
        dx[i] = y[i] > 0 ? dy[i] : 0.0f;
    return ZPS_OK;
}

zps_status k_ref_concat_fwd(int n, int hw, int nin, const int *c, const float *const *xs,
                            float *y)
{
    int ctot = 0;
    for (int i = 0; i < nin; i++)
        ctot += c[i];
    for (int b = 0; b < n; b++) {
        size_t off = (size_t)b * ctot * hw;
        for (int i = 0; i < nin; i++) {
            size_t len = (size_t)c[i] * hw;
            memcpy(y + off, xs[i] + (size_t)b * len, len * sizeof(float));
            off += len;
        }
    }
    return ZPS_OK;
}

zps_status k_ref_concat_bwd(int n, int hw, int nin, const int *c, const float *dy,
                            float *const *dxs)
{
    int ctot = 0;
    for (int i = 0; i < nin; i++)
        ctot += c[i];
    for (int b = 0; b < n; b++) {
        size_t off = (size_t)b * ctot * hw;
        for (int i = 0; i < nin; i++) {
            size_t len = (size_t)c[i] * hw;
            if (dxs[i])
                memcpy(dxs[i] + (size_t)b * len, dy + off, len * sizeof(float));
            off += len;
        }
    }
    return ZPS_OK;
}

/* Threshold below which an element is dropped: p * 2^32, saturated. */
static uint64_t s_drop_threshold(float p) { return (uint64_t)((double)p * 4294967296.0); }

zps_status k_ref_dropout_fwd(size_t n, float p, uint64_t seed, const float *x, float *y)
{
    uint64_t t = s_drop_threshold(p);
    float keep = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
    for (size_t i = 0; i < n; i++)
        y[i] = (uint64_t)k_hash_u32(seed, i) < t ? 0.0f : x[i] * keep;
    return ZPS_OK;
}

zps_status k_ref_dropout_bwd(size_t n, float p, uint64_t seed, const float *dy, float *dx)
{
    return k_ref_dropout_fwd(n, p, seed, dy, dx);
}

zps_status k_ref_softmax_xent(int n, int classes, const float *logits, const int32_t *labels,
                              float smoothing, float grad_scale, float *loss, int *correct,
                              float *dlogits)
{
    double total = 0;
    int right = 0;
    for (int b = 0; b < n; b++)
        if (labels[b] < 0 || labels[b] >= classes)
            return ZPS_ERR_INVALID;
    for (int b = 0; b < n; b++) {
        const float *z = logits + (size_t)b * classes;
        int arg = 0;
        for (int j = 1; j < classes; j++)
            if (z[j] > z[arg])
                arg = j;
        right += arg == labels[b];
        double se = 0;
        for (int j = 0; j < classes; j++)
            se += exp((double)z[j] - z[arg]);
        double lse = z[arg] + log(se);
        double off = smoothing / classes, on = 1.0 - smoothing + off;
        for (int j = 0; j < classes; j++) {
            double t = j == labels[b] ? on : off;
            double lp = z[j] - lse;
            total -= t * lp;
            if (dlogits)
                dlogits[(size_t)b * classes + j] =
                    (float)(grad_scale * (exp(lp) - t) / n);
        }
    }
    *loss = (float)(total / n);
    if (correct)
        *correct = right;
    return ZPS_OK;
}

zps_status k_ref_smooth_l1(size_t n, const float *x, const float *target, float beta,
                           float grad_scale, float *loss, float *dx)
{
    double total = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)x[i] - target[i], a = fabs(d);
        double g;
        if (a < beta) {
            total += 0.5 * d * d / beta;
            g = d / beta;
        } else {
            total += a - 0.5 * beta;
            g = d > 0 ? 1.0 : -1.0;
        }
        if (dx)
            dx[i] = (float)(grad_scale * g);
    }
    *loss = (float)total;
    return ZPS_OK;
}

/* The elementwise streams below are the cpu back-end's too, run on every gradient of every
 * step (nn's fills before a node's backward, its adds into a gradient with several
 * consumers): compiled per SIMD width (common/simd.h, the same bits in every clone), and a
 * fill of +0.0 is memset, whose wide stores the loop does not reach. */
ZPS_SIMD_CLONES zps_status k_ref_fill(size_t n, float v, float *y)
{
    if (v == 0.0f && !signbit(v)) {
        memset(y, 0, n * sizeof *y);
        return ZPS_OK;
    }
    for (size_t i = 0; i < n; i++)
        y[i] = v;
    return ZPS_OK;
}

ZPS_SIMD_CLONES zps_status k_ref_add(size_t n, const float *a, const float *b, float *y)
{
    for (size_t i = 0; i < n; i++)
        y[i] = a[i] + b[i];
    return ZPS_OK;
}

zps_status k_ref_scale(size_t n, float alpha, float *x)
{
    for (size_t i = 0; i < n; i++)
        x[i] *= alpha;
    return ZPS_OK;
}

/* The host loop every host back-end shares with ps_optim_apply (common/optim_math.h). */
zps_status k_ref_optim_apply(const zps_optim_step *s, size_t n, float *w, float *s0, float *s1,
                             const float *g)
{
    zps_optim_apply_host(s, n, w, s0, s1, g);
    return ZPS_OK;
}

ZPS_SIMD_CLONES zps_status k_ref_axpy(size_t n, float alpha, const float *x, float *y)
{
    for (size_t i = 0; i < n; i++)
        y[i] += alpha * x[i];
    return ZPS_OK;
}

zps_status k_ref_sum(size_t n, const float *x, double *out)
{
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += x[i];
    *out = s;
    return ZPS_OK;
}

zps_status k_ref_sumsq(size_t n, const float *x, double *out)
{
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += (double)x[i] * x[i];
    *out = s;
    return ZPS_OK;
}

ZPS_SIMD_CLONES zps_status k_ref_pack_bf16(size_t n, const float *x, uint16_t *y)
{
    for (size_t i = 0; i < n; i++)
        y[i] = zps_bf16_bits(x[i]);
    return ZPS_OK;
}

static const k_backend s_ref = {
    .name = "ref",
    .host_memory = 1,
    K_REF_HOST_MEMORY_ENTRIES,
    .release = s_release,
    .prefers_blocked = NULL,
    .conv2d_fwd = k_ref_conv2d_fwd,
    .conv2d_bwd = k_ref_conv2d_bwd,
    .bn_fwd_train = k_ref_bn_fwd_train,
    .bn_fwd_infer = k_ref_bn_fwd_infer,
    .bn_bwd = k_ref_bn_bwd,
    .pool_fwd = k_ref_pool_fwd,
    .pool_bwd = k_ref_pool_bwd,
    .dense_fwd = k_ref_dense_fwd,
    .dense_bwd = k_ref_dense_bwd,
    K_REF_LAYOUT_FREE_ENTRIES,
};

const k_backend *k_backend_ref(void) { return &s_ref; }
