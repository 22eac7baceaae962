/* bn.c — the cpu back-end's batchnorm, optionally with the ReLU fused (cpu_int.h).
 *
 * Batch statistics are summed here, in double, and handed to oneDNN's training forward as
 * inputs (use_global_stats): oneDNN 2.6's own float sums are not accurate enough (s_bn_stats
 * says why; docs/kernels.md "Batch statistics (cpu)"). The backward is created without that
 * flag, so it still differentiates through the statistics. Running averages follow PyTorch
 * (unbiased variance). With the fused ReLU the forward's workspace (the mask) stays in impl
 * for the backward, so backward runs on the descriptor of its forward. That is the blocked
 * path; NCHW data trains in bn_plain.c's loops (the same statistics and shift), and only its
 * inference goes through oneDNN.
 */
#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/mem.h"
#include "common/simd.h"
#include "kernels/cpu/cpu_int.h"

typedef struct s_bn_impl {
    k_cpu_head head;
    k_cpu_prim fwd;    // training, statistics given: src, mean, variance, scale, shift, dst
                       // [+ workspace]
    k_cpu_prim infer;  // inference: src, mean, variance, scale, shift, dst
    k_cpu_prim bwd;    // src, mean, variance, diff_dst, scale, shift, diff_src, diff_scale,
                       // diff_shift [+ workspace]
    dnnl_memory_t ws;  // ReLU mask from the training forward (owned), or NULL
    double *acc;       // (4, c) scratch: s_bn_stats (3 c), then the mean's residual (c)
    float *beta;       // (c) shift given to the training forward (k_cpu_bn_fwd_train)
    int have_infer;    // infer created
} s_bn_impl;

static unsigned s_bn_flags(const k_bn *d)
{
    return dnnl_use_scale | dnnl_use_shift | (d->relu ? dnnl_fuse_norm_relu : 0);
}

/* Sums of x - shift and of its square per channel of a blocked x: B channels side by side,
 * one vector lane each (inlined with B constant). */
static inline void s_bn_sums_blocked(const k_bn *d, const float *x, const double *shift,
                                     double *sum, double *sq, const int B)
{
    const int c = d->c;
    const size_t hw = (size_t)d->h * d->w;
    for (int cb = 0; cb < c / B; cb++) {
        double s[16] = {0}, q[16] = {0};
        const double *sh = shift + cb * B;
        for (int n = 0; n < d->n; n++) {
            const float *p = x + ((size_t)n * (c / B) + cb) * hw * B;
            for (size_t i = 0; i < hw; i++)
                for (int l = 0; l < B; l++) {
                    double t = (double)p[i * B + l] - sh[l];
                    s[l] += t;
                    q[l] += t * t;
                }
        }
        for (int l = 0; l < B; l++)
            sum[cb * B + l] = s[l], sq[cb * B + l] = q[l];
    }
}

/* Batch mean and biased variance of every channel, summed in double; resid (c) receives
 * mean - (float)mean, the part of the mean that float cannot hold.
 *
 * Why not oneDNN's: batchnorm 2.6 sums a channel in float, so over ~10^4 values its mean is
 * off by ~1e-6 of the channel's std for every unit of |mean|/std (up to ~6 in Inception's
 * early layers; ref and this function are within one float rounding). That error shifts a
 * whole channel coherently, and Inception-v3 at 75x75 batch 8 (batchnorm over 8 values in
 * Mixed_7) amplifies it into percent-level errors of Mixed_7 gradients. The training forward
 * therefore gets these statistics as inputs (use_global_stats); its backward still
 * differentiates through them (it is created without that flag).
 *
 * One pass over x - shift, shift being the channel's first value, so that the sum of squares
 * minus the squared sum does not cancel (in double even |mean - shift| = 1000 std would lose
 * only ~1e-10). acc: 3 * c doubles of scratch.
 *
 * On x86-64 it is compiled for AVX-512, AVX2 and the baseline, picked at load time (a GCC and
 * Clang ifunc): the build targets the baseline, where these double sums run 2 wide, and this
 * pass is one more read of every batchnorm input per step. */
ZPS_SIMD_CLONES
static void s_bn_stats(const k_bn *d, const float *x, double *acc, float *mean, float *var,
                       double *resid)
{
    const int c = d->c, B = k_block_size(d->blocked);
    const size_t hw = (size_t)d->h * d->w;
    double *sum = acc, *sq = acc + c, *shift = acc + 2 * c;
    for (int k = 0; k < c; k++)
        shift[k] = x[(size_t)(k / B) * hw * B + k % B];
    if (B == 16)
        s_bn_sums_blocked(d, x, shift, sum, sq, 16);
    else if (B == 8)
        s_bn_sums_blocked(d, x, shift, sum, sq, 8);
    else { /* NCHW: four interleaved sums per channel */
        for (int k = 0; k < c; k++) {
            double s[4] = {0}, q[4] = {0}, sh = shift[k];
            for (int n = 0; n < d->n; n++) {
                const float *p = x + ((size_t)n * c + k) * hw;
                size_t i = 0;
                for (; i + 4 <= hw; i += 4)
                    for (int l = 0; l < 4; l++) {
                        double t = (double)p[i + l] - sh;
                        s[l] += t;
                        q[l] += t * t;
                    }
                for (; i < hw; i++) {
                    double t = (double)p[i] - sh;
                    s[0] += t;
                    q[0] += t * t;
                }
            }
            sum[k] = (s[0] + s[1]) + (s[2] + s[3]);
            sq[k] = (q[0] + q[1]) + (q[2] + q[3]);
        }
    }
    const double cnt = (double)d->n * hw;
    for (int k = 0; k < c; k++) {
        double m = sum[k] / cnt, v = sq[k] / cnt - m * m;
        mean[k] = (float)(shift[k] + m);
        resid[k] = (shift[k] + m) - mean[k];
        var[k] = (float)(v > 0 ? v : 0);
    }
}

/* Training forward with the statistics as inputs 1 and 2 (s_bn_stats computes them), and its
 * workspace (the ReLU mask) when oneDNN keeps one. */
static zps_status s_bn_fwd_create(k_bn *d, s_bn_impl *im, const dnnl_memory_desc_t *data)
{
    dnnl_batch_normalization_desc_t bd;
    K_CPU_DNNL(dnnl_batch_normalization_forward_desc_init(
        &bd, dnnl_forward_training, data, d->eps, s_bn_flags(d) | dnnl_use_global_stats));
    k_cpu_prim *p = &im->fwd;
    ZPS_TRY(k_cpu_prim_create(p, &bd, NULL));
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_SRC, dnnl_query_src_md));
    ZPS_TRY(k_cpu_prim_arg_at(p, DNNL_ARG_MEAN, dnnl_query_src_md, 1));
    ZPS_TRY(k_cpu_prim_arg_at(p, DNNL_ARG_VARIANCE, dnnl_query_src_md, 1));
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_SCALE, dnnl_query_weights_md));
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_SHIFT, dnnl_query_weights_md));
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_DST, dnnl_query_dst_md));
    ZPS_TRY(k_cpu_workspace(p, &im->ws));
    if (d->relu && !im->ws) { /* the backward needs the forward's ReLU mask */
        zps_log(ZPS_ERROR, "kernels", "batchnorm+ReLU %dx%dx%dx%d: no workspace", d->n, d->c,
                d->h, d->w);
        return ZPS_ERR_DNNL;
    }
    if (im->ws)
        k_cpu_prim_shared(p, DNNL_ARG_WORKSPACE, im->ws);
    return ZPS_OK;
}

/* Backward (created without use_global_stats, so it differentiates through the statistics). */
static zps_status s_bn_bwd_create(k_bn *d, s_bn_impl *im, const dnnl_memory_desc_t *data)
{
    dnnl_batch_normalization_desc_t bd;
    K_CPU_DNNL(dnnl_batch_normalization_backward_desc_init(&bd, dnnl_backward, data, data,
                                                           d->eps, s_bn_flags(d)));
    k_cpu_prim *p = &im->bwd;
    ZPS_TRY(k_cpu_prim_create(p, &bd, im->fwd.pd));
    const dnnl_memory_desc_t *mmd = dnnl_primitive_desc_query_md(im->fwd.pd, dnnl_query_src_md, 1);
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_SRC, dnnl_query_src_md));
    ZPS_TRY(k_cpu_prim_arg_md(p, DNNL_ARG_MEAN, mmd));
    ZPS_TRY(k_cpu_prim_arg_md(p, DNNL_ARG_VARIANCE, mmd));
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_DIFF_DST, dnnl_query_diff_dst_md));
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_SCALE, dnnl_query_weights_md));
    /* oneDNN 2.6 insists on a shift argument for use_shift backward; it never reads it */
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_SHIFT, dnnl_query_weights_md));
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_DIFF_SRC, dnnl_query_diff_src_md));
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_DIFF_SCALE, dnnl_query_diff_weights_md));
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_DIFF_SHIFT, dnnl_query_diff_weights_md));
    if (im->ws)
        k_cpu_prim_shared(p, DNNL_ARG_WORKSPACE, im->ws);
    return ZPS_OK;
}

static zps_status s_bn_get(k_bn *d, s_bn_impl **out)
{
    s_bn_impl *im = d->impl;
    if (im) {
        *out = im;
        return ZPS_OK;
    }
    ZPS_TRY(k_cpu_ready());
    im = k_cpu_impl_new(&d->impl, K_CPU_BN, sizeof *im);
    dnnl_memory_desc_t data;
    ZPS_TRY(k_cpu_md4(&data, d->n, d->c, d->h, d->w, k_cpu_act_tag(d->blocked)));
    im->acc = zps_xmalloc(sizeof(double) * 4 * (size_t)d->c);
    im->beta = zps_xmalloc(sizeof(float) * (size_t)d->c);
    if (d->blocked) {
        ZPS_TRY(s_bn_fwd_create(d, im, &data));
        ZPS_TRY(s_bn_bwd_create(d, im, &data));
    }
    *out = im;
    return ZPS_OK;
}

zps_status k_cpu_bn_train_stats(k_bn *d, const float *x, const float *gamma, const float *beta,
                                float *mean, float *var, float *run_mean, float *run_var,
                                const float **shift)
{
    s_bn_impl *im;
    ZPS_TRY(s_bn_get(d, &im));
    /* The float mean is off by resid; oneDNN normalises with it, so the shift makes up for
     * that: gamma (x - mean - resid) / sd + beta = gamma (x - mean) / sd + (beta - gamma
     * resid / sd). Without this a channel with |mean|/std = 50 would be off by ~3e-6 of its
     * std, all in the same direction; with it y is within float rounding of ref's. */
    double *resid = im->acc + 3 * d->c;
    s_bn_stats(d, x, im->acc, mean, var, resid);
    for (int c = 0; c < d->c; c++)
        im->beta[c] = (float)(beta[c] - gamma[c] * resid[c] / sqrt((double)var[c] + d->eps));
    float cnt = (float)d->n * d->h * d->w, m = d->momentum;
    float unbias = cnt > 1 ? cnt / (cnt - 1) : 1.0f;
    for (int c = 0; c < d->c; c++) {
        if (run_mean)
            run_mean[c] = (1.0f - m) * run_mean[c] + m * mean[c];
        if (run_var)
            run_var[c] = (1.0f - m) * run_var[c] + m * var[c] * unbias;
    }
    *shift = im->beta;
    return ZPS_OK;
}

zps_status k_cpu_bn_fwd_train(k_bn *d, const float *x, const float *gamma, const float *beta,
                              float *y, float *mean, float *var, float *run_mean,
                              float *run_var)
{
    const float *shift;
    ZPS_TRY(k_cpu_bn_train_stats(d, x, gamma, beta, mean, var, run_mean, run_var, &shift));
    if (!d->blocked) {
        k_cpu_bn_plain_fwd(d, x, mean, var, gamma, shift, y);
        return ZPS_OK;
    }
    const void *ptrs[6] = {x, mean, var, gamma, shift, y};
    return k_cpu_prim_run(&((s_bn_impl *)d->impl)->fwd, ptrs, 6);
}

zps_status k_cpu_bn_fwd_infer(k_bn *d, const float *x, const float *gamma, const float *beta,
                              const float *run_mean, const float *run_var, float *y)
{
    s_bn_impl *im;
    ZPS_TRY(s_bn_get(d, &im));
    if (!im->have_infer) {
        dnnl_memory_desc_t data;
        ZPS_TRY(k_cpu_md4(&data, d->n, d->c, d->h, d->w, k_cpu_act_tag(d->blocked)));
        dnnl_batch_normalization_desc_t bd;
        K_CPU_DNNL(dnnl_batch_normalization_forward_desc_init(
            &bd, dnnl_forward_inference, &data, d->eps, s_bn_flags(d) | dnnl_use_global_stats));
        ZPS_TRY(k_cpu_prim_create(&im->infer, &bd, NULL));
        ZPS_TRY(k_cpu_prim_arg(&im->infer, DNNL_ARG_SRC, dnnl_query_src_md));
        ZPS_TRY(k_cpu_prim_arg_at(&im->infer, DNNL_ARG_MEAN, dnnl_query_src_md, 1));
        ZPS_TRY(k_cpu_prim_arg_at(&im->infer, DNNL_ARG_VARIANCE, dnnl_query_src_md, 2));
        ZPS_TRY(k_cpu_prim_arg(&im->infer, DNNL_ARG_SCALE, dnnl_query_weights_md));
        ZPS_TRY(k_cpu_prim_arg(&im->infer, DNNL_ARG_SHIFT, dnnl_query_weights_md));
        ZPS_TRY(k_cpu_prim_arg(&im->infer, DNNL_ARG_DST, dnnl_query_dst_md));
        im->have_infer = 1;
    }
    const void *ptrs[6] = {x, run_mean, run_var, gamma, beta, y};
    return k_cpu_prim_run(&im->infer, ptrs, 6);
}

zps_status k_cpu_bn_bwd(k_bn *d, const float *x, const float *y, const float *dy,
                        const float *gamma, const float *mean, const float *var, float *dx,
                        float *dgamma, float *dbeta)
{
    s_bn_impl *im;
    ZPS_TRY(s_bn_get(d, &im));
    if (!d->blocked) {
        assert(y || !d->relu);
        float *sc = k_cpu_scratch((size_t)2 * d->c);
        k_cpu_bn_plain_bwd(d, x, y, dy, gamma, mean, var, dx, sc, sc + d->c);
        if (dgamma)
            k_cpu_acc((size_t)d->c, sc, dgamma);
        if (dbeta)
            k_cpu_acc((size_t)d->c, sc + d->c, dbeta);
        return ZPS_OK;
    }
    /* blocked: the fused ReLU mask is in the forward's workspace, y is not read */
    /* oneDNN always writes diff_src: without dx it goes to scratch, in the descriptor's own
     * layout (ref's loops would misread a blocked x, y and dy) */
    size_t total = dx ? 0 : (size_t)d->n * d->c * d->h * d->w;
    float *sc = k_cpu_scratch((size_t)2 * d->c + total);
    const void *ptrs[9] = {x, mean, var, dy, gamma, gamma, dx ? dx : sc + 2 * d->c, sc,
                           sc + d->c};
    ZPS_TRY(k_cpu_prim_run(&im->bwd, ptrs, 9));
    if (dgamma)
        k_cpu_acc((size_t)d->c, sc, dgamma);
    if (dbeta)
        k_cpu_acc((size_t)d->c, sc + d->c, dbeta);
    return ZPS_OK;
}

void k_cpu_bn_release(k_cpu_head *impl)
{
    s_bn_impl *im = (s_bn_impl *)impl;
    k_cpu_prim_free(&im->fwd);
    k_cpu_prim_free(&im->infer);
    k_cpu_prim_free(&im->bwd);
    if (im->ws)
        dnnl_memory_destroy(im->ws);
    free(im->acc);
    free(im->beta);
}
