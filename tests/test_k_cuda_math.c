/* test_k_cuda_math.c — the CUDA back-end's element functions run on the CPU (suite
 * k_cuda_math), so their index math is proven here without a GPU:
 *  - kernels/cuda/pool_math.h's pooling forward and backward, element by element, against
 *    ref's pooling on random shapes (windows, strides, padding, ragged edges), bit for bit.
 *    Values are drawn from a few integers so that windows hold ties: the first maximum in
 *    scan order must win, as in ref;
 *  - kernels/cuda/bn_math.h's batchnorm: the kernels' grid of (channel, split) blocks run
 *    here thread by thread, with the block's tree sum, then the statistics, the forward, the
 *    gradient sums and dx, against ref's batchnorm on random shapes, few channels (many splits)
 *    and many (one), with and without relu. Tolerances: the sums are ref's in another order
 *    (1e-6 relative on mean, var and the gradient sums); y and dx are float against ref's
 *    double (1e-5 + 1e-5 |ref|, 1e-5 + 1e-4 |ref|);
 *  - kernels/cuda/loss_math.h's softmax cross-entropy rows (label smoothing, ties in the
 *    argmax) and smooth-L1 elements against ref: gradients bit for bit (the same double
 *    arithmetic), the loss within 1e-6 (rows summed in another order). */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/bn_math.h"
#include "kernels/cuda/loss_math.h"
#include "kernels/cuda/pool_math.h"
#include "kernels/kernels.h"
#include "tests/test_k.h"
#include "tests/testutil.h"

static void s_pool_case(k_pool_kind kind, uint64_t seed)
{
    k_pool d;
    zt_k_random_pool(&d, kind, 1);
    size_t nx = (size_t)d.n * d.c * d.h * d.w, ny = (size_t)d.n * d.c * d.oh * d.ow;
    float *x = malloc(nx * sizeof *x), *dy = zt_k_randv(ny, -1, 1);
    for (size_t i = 0; i < nx; i++)
        x[i] = (float)zt_irand(0, 5); /* ties */
    float *y = zt_k_zeros(ny), *dx = zt_k_zeros(nx);
    const k_backend *ref = k_backend_ref();
    k_pool dr = d;
    cr_assert_eq(k_pool_fwd(ref, &dr, x, y), ZPS_OK);
    cr_assert_eq(k_pool_bwd(ref, &dr, x, y, dy, dx), ZPS_OK);
    for (size_t i = 0; i < ny; i++) {
        float got = k_pool_fwd_at(&d, x, i);
        cr_assert(!memcmp(&got, &y[i], sizeof got), "%s pool %dx%d (%dx%d stride %d,%d pad %d,%d) "
                  "output %zu: %g, ref %g (seed %llu)", kind == K_POOL_MAX ? "max" : "avg",
                  d.h, d.w, d.r, d.s, d.stride_h, d.stride_w, d.pad_h, d.pad_w, i,
                  (double)got, (double)y[i], (unsigned long long)seed);
    }
    for (size_t i = 0; i < nx; i++) {
        float got = k_pool_bwd_at(&d, x, dy, i);
        cr_assert(!memcmp(&got, &dx[i], sizeof got), "%s pool %dx%d (%dx%d stride %d,%d pad %d,%d) "
                  "input gradient %zu: %g, ref %g (seed %llu)",
                  kind == K_POOL_MAX ? "max" : "avg", d.h, d.w, d.r, d.s, d.stride_h,
                  d.stride_w, d.pad_h, d.pad_w, i, (double)got, (double)dx[i],
                  (unsigned long long)seed);
    }
    free(x), free(dy), free(y), free(dx);
}

Test(k_cuda_math, pooling_elements_equal_ref_bit_for_bit)
{
    uint64_t seed = zt_k_init();
    for (int iter = 0; iter < 400; iter++)
        s_pool_case(iter % 2 ? K_POOL_MAX : K_POOL_AVG, seed);
}

/* k_pool_span against the definition, on every small case: the outputs o with
 * o * stride - pad <= i < o * stride - pad + k, including the negative floor division. */
Test(k_cuda_math, pool_span_is_the_windows_holding_an_input)
{
    for (int k = 1; k <= 5; k++)
        for (int stride = 1; stride <= 3; stride++)
            for (int pad = 0; pad < k && pad <= 2; pad++)
                for (int n_out = 1; n_out <= 9; n_out++)
                    for (int i = 0; i < 20; i++) {
                        int lo, hi, want_lo = -1, want_hi = -2;
                        k_pool_span(i, pad, k, stride, n_out, &lo, &hi);
                        for (int o = 0; o < n_out; o++)
                            if (o * stride - pad <= i && i < o * stride - pad + k) {
                                if (want_lo < 0)
                                    want_lo = o;
                                want_hi = o;
                            }
                        if (want_lo < 0) /* none: an empty span */
                            cr_assert_gt(lo, hi, "i %d k %d stride %d pad %d: [%d, %d] not empty",
                                         i, k, stride, pad, lo, hi);
                        else
                            cr_assert(lo == want_lo && hi == want_hi,
                                      "i %d k %d stride %d pad %d n_out %d: [%d, %d], want "
                                      "[%d, %d]", i, k, stride, pad, n_out, lo, hi, want_lo,
                                      want_hi);
                    }
}

/* ---- batchnorm: bn_pool.cu's grid on the CPU ---- */

enum { S_BN_THREADS = 256, S_BN_BLOCKS = 2048 }; /* bn_pool.cu's KC_T and S_BN_BLOCKS */

/* g_bn_part's grid: each (ch, split) block's threads, then its tree sum (d_block_sum2). */
static void s_bn_grid(int mode, const k_bn *d, int splits, int per, const float *x,
                      const float *y, const float *dy, const float *mean, const float *var,
                      double *part)
{
    int hw = d->h * d->w;
    static double s1[S_BN_THREADS], s2[S_BN_THREADS];
    for (int ch = 0; ch < d->c; ch++)
        for (int split = 0; split < splits; split++) {
            double m = 0, inv = 0;
            if (mode)
                m = mean[ch], inv = K_BN_RSQRT((double)var[ch] + d->eps);
            for (int t = 0; t < S_BN_THREADS; t++)
                k_bn_part_thread(mode, d->n, d->c, hw, per, ch, split, t, S_BN_THREADS, x, y,
                                 dy, m, inv, d->relu, &s1[t], &s2[t]);
            for (int st = S_BN_THREADS / 2; st > 0; st >>= 1)
                for (int t = 0; t < st; t++)
                    s1[t] += s1[t + st], s2[t] += s2[t + st];
            part[(size_t)ch * splits + split] = s1[0];
            part[(size_t)(d->c + ch) * splits + split] = s2[0];
        }
}

static void s_bn_case(uint64_t seed)
{
    k_bn d = {.n = zt_irand(1, 8), .c = zt_irand(0, 1) ? zt_irand(1, 3) : zt_irand(4, 40),
              .h = zt_irand(1, 20), .w = zt_irand(1, 20), .eps = 1e-3f, .momentum = 0.1f,
              .relu = zt_irand(0, 1)};
    int hw = d.h * d.w, splits, per;
    size_t nx = (size_t)d.n * d.c * hw;
    k_bn_split(d.n, d.c, S_BN_BLOCKS, &splits, &per);
    cr_assert(splits >= 1 && (splits - 1) * per < d.n && splits * per >= d.n,
              "%d splits of %d images for n %d: one is empty or missing", splits, per, d.n);
    float *x = zt_k_randv(nx, -1, 1), *dy = zt_k_randv(nx, -1, 1);
    float off = zt_unif(-3, 3); /* channels off zero, as after a conv */
    for (size_t i = 0; i < nx; i++)
        x[i] += off;
    float *g = zt_k_randv((size_t)d.c, 0.5f, 1.5f), *b = zt_k_randv((size_t)d.c, -1, 1);
    /* ref */
    float *ry = zt_k_zeros(nx), *rm = zt_k_zeros(d.c), *rv = zt_k_zeros(d.c);
    float *rdx = zt_k_zeros(nx), *rdg = zt_k_zeros(d.c), *rdb = zt_k_zeros(d.c);
    const k_backend *ref = k_backend_ref();
    cr_assert_eq(k_bn_fwd_train(ref, &d, x, g, b, ry, rm, rv, NULL, NULL), ZPS_OK);
    cr_assert_eq(k_bn_bwd(ref, &d, x, ry, dy, g, rm, rv, rdx, rdg, rdb), ZPS_OK);
    /* the kernels' way */
    double *part = calloc(2 * (size_t)d.c * splits, sizeof *part);
    float *y = zt_k_zeros(nx), *m = zt_k_zeros(d.c), *v = zt_k_zeros(d.c), *dx = zt_k_zeros(nx);
    float *sg = zt_k_zeros(d.c), *sgx = zt_k_zeros(d.c);
    double cnt = (double)d.n * hw;
    s_bn_grid(0, &d, splits, per, x, NULL, NULL, NULL, NULL, part);
    for (int ch = 0; ch < d.c; ch++) {
        double a, bb;
        k_bn_total(part, d.c, splits, ch, &a, &bb);
        k_bn_stats(a, bb, cnt, &m[ch], &v[ch]);
    }
    for (size_t i = 0; i < nx; i++) {
        int ch = (int)((i / hw) % d.c);
        y[i] = k_bn_apply_el(x[i], m[ch], K_BN_RSQRTF(v[ch] + d.eps), g[ch], b[ch], d.relu);
    }
    /* backward from ref's y, as ref's backward: with relu, a y within rounding of 0 on one
     * side and not the other would flip that element's mask and move dbeta by a whole dy */
    s_bn_grid(1, &d, splits, per, x, ry, dy, m, v, part);
    for (int ch = 0; ch < d.c; ch++) {
        double a, bb;
        k_bn_total(part, d.c, splits, ch, &a, &bb);
        sg[ch] = (float)a, sgx[ch] = (float)bb;
    }
    for (size_t i = 0; i < nx; i++) {
        int ch = (int)((i / hw) % d.c);
        float fc = (float)cnt;
        dx[i] = k_bn_dx_at(x, ry, dy, i, g[ch], m[ch], K_BN_RSQRTF(v[ch] + d.eps), sg[ch] / fc,
                           sgx[ch] / fc, d.relu);
    }
    char who[96];
    snprintf(who, sizeof who, "bn %dx%dx%dx%d relu %d, %d splits (seed %llu)", d.n, d.c, d.h,
             d.w, d.relu, splits, (unsigned long long)seed);
    zt_k_close(who, "mean", m, rm, d.c, 1e-6, 1e-6);
    zt_k_close(who, "var", v, rv, d.c, 1e-6, 1e-6);
    zt_k_close(who, "y", y, ry, nx, 1e-5, 1e-5);
    zt_k_close(who, "dbeta", sg, rdb, d.c, 1e-6, 1e-6);
    zt_k_close(who, "dgamma", sgx, rdg, d.c, 1e-5, 1e-6);
    zt_k_close(who, "dx", dx, rdx, nx, 1e-5, 1e-4);
    free(x), free(dy), free(g), free(b), free(ry), free(rm), free(rv), free(rdx), free(rdg);
    free(rdb), free(part), free(y), free(m), free(v), free(dx), free(sg), free(sgx);
}

Test(k_cuda_math, batchnorm_grid_equals_ref)
{
    uint64_t seed = zt_k_init();
    for (int iter = 0; iter < 60; iter++)
        s_bn_case(seed);
}

/* ---- losses ---- */

Test(k_cuda_math, losses_equal_ref)
{
    uint64_t seed = zt_k_init();
    const k_backend *ref = k_backend_ref();
    for (int iter = 0; iter < 50; iter++) {
        int n = zt_irand(1, 40), k = zt_irand(2, 30);
        float smooth = iter % 2 ? zt_unif(0, 0.3f) : 0, scale = zt_unif(0.5f, 2);
        float *z = zt_k_randv((size_t)n * k, -4, 4);
        for (int i = 0; i < n * k; i += 7)
            z[i] = 1.0f; /* ties: the first maximum is the argmax */
        int32_t *lab = malloc((size_t)n * sizeof *lab);
        for (int i = 0; i < n; i++)
            lab[i] = zt_irand(0, k - 1);
        float *rdz = zt_k_zeros((size_t)n * k), *dz = zt_k_zeros((size_t)n * k), rloss;
        int rright;
        cr_assert_eq(k_softmax_xent(ref, n, k, z, lab, smooth, scale, &rloss, &rright, rdz),
                     ZPS_OK);
        double total = 0; /* as s_softmax_xent adds the rows' losses on the host */
        int right = 0;
        for (int b = 0; b < n; b++) {
            float l;
            int r;
            k_xent_row(k, z + (size_t)b * k, lab[b], smooth, scale, n, dz + (size_t)b * k, &l,
                       &r);
            total += l, right += r;
        }
        cr_assert_eq(right, rright, "xent %dx%d: %d right, ref %d (seed %llu)", n, k, right,
                     rright, (unsigned long long)seed);
        cr_assert(!memcmp(dz, rdz, (size_t)n * k * sizeof *dz), "xent %dx%d: dz differs from "
                  "ref's (seed %llu)", n, k, (unsigned long long)seed);
        float loss = (float)(total / n);
        zt_k_close("xent", "loss", &loss, &rloss, 1, 1e-6, 1e-6);
        size_t m = (size_t)zt_irand(1, 3000);
        float *x = zt_k_randv(m, -3, 3), *t = zt_k_randv(m, -3, 3), beta = zt_unif(0.1f, 2);
        float *rdx = zt_k_zeros(m), *dx = zt_k_zeros(m), rl;
        cr_assert_eq(k_smooth_l1(ref, m, x, t, beta, scale, &rl, rdx), ZPS_OK);
        double acc = 0;
        for (size_t i = 0; i < m; i++)
            acc += k_smooth_l1_el(x[i], t[i], beta, scale, &dx[i]);
        cr_assert(!memcmp(dx, rdx, m * sizeof *dx), "smooth-L1 n %zu: dx differs from ref's "
                  "(seed %llu)", m, (unsigned long long)seed);
        float l1 = (float)acc;
        zt_k_close("smooth-L1", "loss", &l1, &rl, 1, 1e-6, 1e-6);
        free(z), free(lab), free(rdz), free(dz), free(x), free(t), free(rdx), free(dx);
    }
}
