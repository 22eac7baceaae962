/* test_k_backends.c — the back-end harness: every op of every back-end against ref, on fresh
 * random shapes and inputs (ggml's test-backend-ops is the model).
 *
 * Each S_CASE below is one op (or one family of elementwise ops) written once: it copies host
 * inputs into the back-end under test (its alloc and copy_in, so host and device back-ends
 * take the same path), runs the op there and on ref (its argument), copies the results out
 * and compares |got - ref| <= atol + rtol * |ref|. S_CASE makes one Criterion test per back-end:
 *   k_cpu   the cpu back-end (always there)
 *   k_cuda  the cuda back-end; without a GPU every case SKIPs through ZPS_GPU_SKIP (which
 *           fails under the GPU suite's ZPS_REQUIRE_GPU=1, see scripts/test-gpu.sh)
 * A new back-end is one more line in S_CASE and one s_tol. Tolerances that differ between
 * back-ends are in s_tol; the rest are written at the check. docs/kernels.md lists them all.
 * After the cases: the cpu back-end's own checks (its blocked layouts, its batch statistics).
 *
 * Inputs are fresh random numbers each run; the seed is printed in every failure message
 * (rerun with ZPS_TEST_SEED=<seed> to reproduce).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/kernels.h"
#include "ps/dtype.h"
#include "ps/optim.h"
#include "tests/test_k.h"
#include "tests/testutil.h"

/* Tolerances of one back-end against ref where they differ between back-ends. */
typedef struct s_tol {
    double conv;        // conv atol per sqrt(terms summed) (rtol 1e-3)
    int conv_all_terms; // 1: every conv output uses the terms of y, dx and dw summed
    double bn_dx_rtol;  // batchnorm dx rtol (atol 1e-3)
    double pool;        // pooling atol (rtol 1e-3)
    double dense;       // dense atol (rtol 1e-3) ...
    int dense_scaled;   // ... times sqrt(terms summed) when 1
    int bf16_out;       // 1: a bf16 conv's outputs are rounded to bfloat16 (tensor cores,
                        // as autocast does): rtol 4e-3 (2^-8), and the atol of y (bias
                        // added after) and dw (accumulated into) grows by 4e-3 x what is
                        // added to the rounded sum (|b|, |start| <= 1 here)
} s_tol;

/* cpu: oneDNN reorders sums and uses FMA. cuda: cuDNN picks its algorithms (TF32 allowed). */
static const s_tol s_tol_cpu = {4e-4, 0, 1e-2, 1e-4, 4e-4, 1, 0};
static const s_tol s_tol_cuda = {4e-4, 1, 1e-3, 1e-5, 1e-4, 0, 1};

static uint64_t s_seed;
static const k_backend *s_be; // the back-end under test
static void *s_dev[64];       // its buffers made by s_up/s_new, freed by s_dev_free_all
static int s_ndev;

static void s_init_cpu(void)
{
    s_seed = zt_k_init();
    s_be = k_backend_cpu();
}

static void s_init_cuda(void)
{
    s_seed = zt_k_init();
    s_be = ZT_CUDA_OR_SKIP();
}

/* One test per back-end for each case; the body sees the back-end's tolerances as t. */
#define S_CASE(name)                                                                   \
    static void s_case_##name(const s_tol *t, const k_backend *ref);                   \
    Test(k_cpu, name, .init = s_init_cpu, .timeout = 60)                               \
    {                                                                                  \
        s_case_##name(&s_tol_cpu, k_backend_ref());                                    \
    }                                                                                  \
    Test(k_cuda, name, .init = s_init_cuda, .timeout = 60)                             \
    {                                                                                  \
        s_case_##name(&s_tol_cuda, k_backend_ref());                                   \
    }                                                                                  \
    static void s_case_##name(const s_tol *t __attribute__((unused)), const k_backend *ref)

/* ---- the back-end's buffers ---- */

static void *s_new(size_t bytes)
{
    cr_assert_lt(s_ndev, 64);
    void *d = s_be->alloc(bytes + 4);
    cr_assert_not_null(d, "%s: alloc of %zu bytes", s_be->name, bytes);
    s_dev[s_ndev++] = d;
    return d;
}
/* A copy of host data in the back-end's memory. */
static void *s_upb(const void *h, size_t bytes)
{
    void *d = s_new(bytes);
    cr_assert_eq(s_be->copy_in(d, h, bytes), ZPS_OK);
    return d;
}
static float *s_up(const float *h, size_t n) { return s_upb(h, n * sizeof(float)); }
static void s_dev_free_all(void)
{
    while (s_ndev > 0)
        s_be->free(s_dev[--s_ndev]);
}

/* Compares n floats of the back-end's buffer dev with ref's host result. */
static void s_check(const char *what, const float *dev, const float *ref, size_t n, double atol,
                    double rtol)
{
    float *h = malloc(n * sizeof *h + 4);
    cr_assert_eq(s_be->copy_out(h, dev, n * sizeof *h), ZPS_OK);
    zt_k_close(s_be->name, what, h, ref, n, atol, rtol);
    free(h);
}
static void s_check_scalar(const char *what, double got, double ref, double atol, double rtol)
{
    cr_assert(fabs(got - ref) <= atol + rtol * fabs(ref),
              "%s %s: got %.9g want %.9g (seed %llu)", s_be->name, what, got, ref,
              (unsigned long long)s_seed);
}

/* ---- the cases: every op of the table ---- */

/* Values are sums of products of size ~1: atol grows with sqrt of the terms summed. */
/* Forward and backward of random convolutions against ref's; bf16: both sides in bf16
 * compute (k_conv2d.bf16), and ref's float result must differ from it (the flag is obeyed). */
static void s_conv_case(const s_tol *t, const k_backend *ref, int bf16)
{
    for (int iter = 0; iter < 12; iter++) {
        k_conv2d d, dr;
        zt_k_random_conv(&d, 1);
        d.bf16 = bf16;
        dr = d;
        int bias = iter % 2;
        size_t nx = (size_t)d.n * d.c * d.h * d.w, nw = (size_t)d.k * d.c * d.r * d.s;
        size_t ny = (size_t)d.n * d.k * d.oh * d.ow, nk = (size_t)d.k;
        float *x = zt_k_randv(nx, -1, 1), *w = zt_k_randv(nw, -1, 1), *b = zt_k_randv(nk, -1, 1);
        float *yr = zt_k_zeros(ny), *dy = zt_k_randv(ny, -1, 1), *dxr = zt_k_zeros(nx);
        float *dw = zt_k_randv(nw, -1, 1), *dwr = zt_k_copyv(dw, nw); /* accumulated into */
        float *db = zt_k_randv(nk, -1, 1), *dbr = zt_k_copyv(db, nk);
        float *gx = s_up(x, nx), *gw = s_up(w, nw), *gb = bias ? s_up(b, nk) : NULL;
        float *gy = s_up(yr, ny), *gdy = s_up(dy, ny), *gdx = s_up(dxr, nx);
        float *gdw = s_up(dw, nw), *gdb = bias ? s_up(db, nk) : NULL;
        cr_assert_eq(k_conv2d_fwd(s_be, &d, gx, gw, gb, gy), ZPS_OK,
                     "conv %dx%dx%dx%d k%d %dx%d (seed %llu)", d.n, d.c, d.h, d.w, d.k, d.r,
                     d.s, (unsigned long long)s_seed);
        cr_assert_eq(k_conv2d_bwd(s_be, &d, gx, gw, gdy, gdx, gdw, gdb), ZPS_OK);
        cr_assert_eq(k_conv2d_fwd(ref, &dr, x, w, bias ? b : NULL, yr), ZPS_OK);
        cr_assert_eq(k_conv2d_bwd(ref, &dr, x, w, dy, dxr, dwr, bias ? dbr : NULL), ZPS_OK);
        double ty = (double)d.c * d.r * d.s, tdx = (double)d.k * d.r * d.s;
        double tdw = (double)d.n * d.oh * d.ow;
        if (t->conv_all_terms)
            ty = tdx = tdw = ty + tdx + tdw;
        int rb = bf16 && t->bf16_out;
        double rtol = rb ? 4e-3 : 1e-3;
        s_check("conv y", gy, yr, ny, t->conv * sqrt(ty) + (rb && bias ? 4e-3 : 0), rtol);
        s_check("conv dx", gdx, dxr, nx, t->conv * sqrt(tdx), rtol);
        s_check("conv dw", gdw, dwr, nw, t->conv * sqrt(tdw) + (rb ? 4e-3 : 0), rtol);
        if (bias)
            s_check("conv db", gdb, dbr, nk, t->conv * sqrt(tdw), 1e-3);
        if (bf16) { /* float compute is further from it than the two back-ends are */
            k_conv2d df = dr;
            df.bf16 = 0;
            float *yf = zt_k_zeros(ny), *got = malloc(ny * sizeof *got + 4);
            cr_assert_eq(k_conv2d_fwd(ref, &df, x, w, bias ? b : NULL, yf), ZPS_OK);
            cr_assert_eq(s_be->copy_out(got, gy, ny * sizeof *got), ZPS_OK);
            double far = 0, to_bf16 = 0, to_f32 = 0;
            for (size_t i = 0; i < ny; i++) {
                far = fmax(far, fabs((double)yf[i] - yr[i]));
                to_bf16 += ((double)got[i] - yr[i]) * ((double)got[i] - yr[i]);
                to_f32 += ((double)got[i] - yf[i]) * ((double)got[i] - yf[i]);
            }
            cr_assert_gt(far, 1e-6, "ref's bf16 compute gave float's results (seed %llu)",
                         (unsigned long long)s_seed);
            /* the back-end obeyed d.bf16 (not where its output is rounded to bf16 too: that
             * rounding is as large as the inputs') */
            if (!t->bf16_out)
                cr_assert_lt(to_bf16, to_f32, "%s: bf16 conv closer to float compute than to "
                             "ref's bf16 (seed %llu)", s_be->name, (unsigned long long)s_seed);
            free(yf);
            free(got);
        }
        k_op_release(s_be, &d.impl);
        cr_assert_null(d.impl);
        s_dev_free_all();
        free(x), free(w), free(b), free(yr), free(dy), free(dxr), free(dw), free(dwr);
        free(db), free(dbr);
    }
}

S_CASE(conv2d_matches_ref)
{
    s_conv_case(t, ref, 0);
}

S_CASE(conv2d_bf16_matches_ref)
{
    s_conv_case(t, ref, 1);
}

/* Training forward (y, batch statistics, running averages), backward, inference forward. */
S_CASE(batchnorm_matches_ref)
{
    for (int iter = 0; iter < 8; iter++) {
        k_bn d = {.n = zt_irand(1, 4), .c = zt_irand(1, 40), .h = zt_irand(1, 12),
                  .w = zt_irand(1, 12), .eps = 1e-3f, .momentum = zt_unif(0.05f, 0.5f),
                  .relu = iter % 2};
        if (d.n * d.h * d.w < 2)
            d.w = 2;
        k_bn dr = d;
        size_t n = (size_t)d.n * d.c * d.h * d.w, nc = (size_t)d.c;
        float *x = zt_k_randv(n, -2, 3), *g = zt_k_randv(nc, 0.5f, 1.5f), *b = zt_k_randv(nc, -0.5f, 0.5f);
        float *yr = zt_k_zeros(n), *mr = zt_k_zeros(nc), *vr = zt_k_zeros(nc);
        float *rm = zt_k_randv(nc, -1, 1), *rv = zt_k_randv(nc, 0.5f, 2);
        float *gx = s_up(x, n), *gg = s_up(g, nc), *gb = s_up(b, nc), *gy = s_up(yr, n);
        float *gm = s_up(mr, nc), *gv = s_up(vr, nc), *grm = s_up(rm, nc), *grv = s_up(rv, nc);
        cr_assert_eq(k_bn_fwd_train(s_be, &d, gx, gg, gb, gy, gm, gv, grm, grv), ZPS_OK);
        k_bn_fwd_train(ref, &dr, x, g, b, yr, mr, vr, rm, rv);
        s_check("bn y", gy, yr, n, 1e-3, 1e-3);
        s_check("bn mean", gm, mr, nc, 1e-4, 1e-3);
        s_check("bn var", gv, vr, nc, 1e-4, 1e-3);
        s_check("bn running mean", grm, rm, nc, 1e-4, 1e-3);
        s_check("bn running var", grv, rv, nc, 1e-4, 1e-3);
        float *dy = zt_k_randv(n, -1, 1), *dxr = zt_k_zeros(n);
        float *dg = zt_k_randv(nc, -1, 1), *dbt = zt_k_randv(nc, -1, 1); /* accumulated into */
        float *gdy = s_up(dy, n), *gdx = s_up(dxr, n), *gdg = s_up(dg, nc), *gdb = s_up(dbt, nc);
        cr_assert_eq(k_bn_bwd(s_be, &d, gx, gy, gdy, gg, gm, gv, gdx, gdg, gdb), ZPS_OK);
        k_bn_bwd(ref, &dr, x, yr, dy, g, mr, vr, dxr, dg, dbt);
        s_check("bn dx", gdx, dxr, n, 1e-3, t->bn_dx_rtol);
        s_check("bn dgamma", gdg, dg, nc, 1e-3, 1e-3);
        s_check("bn dbeta", gdb, dbt, nc, 1e-3, 1e-3);
        cr_assert_eq(k_bn_fwd_infer(s_be, &d, gx, gg, gb, grm, grv, gy), ZPS_OK);
        k_bn_fwd_infer(ref, &dr, x, g, b, rm, rv, yr);
        s_check("bn inference y", gy, yr, n, 1e-3, 1e-3);
        k_op_release(s_be, &d.impl);
        s_dev_free_all();
        free(x), free(g), free(b), free(yr), free(mr), free(vr), free(rm), free(rv), free(dy);
        free(dxr), free(dg), free(dbt);
    }
}

/* Max and average pooling on random windows; one global average pool (k_gap_*). */
S_CASE(pooling_matches_ref)
{
    for (int iter = 0; iter < 12; iter++) {
        k_pool d, dr;
        zt_k_random_pool(&d, iter % 2 ? K_POOL_MAX : K_POOL_AVG, 1);
        int gap = iter == 10;
        if (gap)
            k_pool_init(&d, K_POOL_AVG, 2, 5, 7, 6, 7, 6, 1, 1, 0, 0);
        dr = d;
        size_t nx = (size_t)d.n * d.c * d.h * d.w, ny = (size_t)d.n * d.c * d.oh * d.ow;
        float *x = zt_k_randv(nx, -1, 1), *yr = zt_k_zeros(ny), *dy = zt_k_randv(ny, -1, 1);
        float *dxr = zt_k_zeros(nx);
        float *gx = s_up(x, nx), *gy = s_up(yr, ny), *gdy = s_up(dy, ny), *gdx = s_up(dxr, nx);
        zps_status st = gap ? k_gap_fwd(s_be, &d, gx, gy) : k_pool_fwd(s_be, &d, gx, gy);
        cr_assert_eq(st, ZPS_OK, "pool %d %dx%d win %dx%d s%d,%d p%d,%d (seed %llu)", d.kind,
                     d.h, d.w, d.r, d.s, d.stride_h, d.stride_w, d.pad_h, d.pad_w,
                     (unsigned long long)s_seed);
        k_pool_fwd(ref, &dr, x, yr);
        s_check("pool y", gy, yr, ny, t->pool, 1e-3);
        st = gap ? k_gap_bwd(s_be, &d, gdy, gdx) : k_pool_bwd(s_be, &d, gx, gy, gdy, gdx);
        cr_assert_eq(st, ZPS_OK);
        k_pool_bwd(ref, &dr, x, yr, dy, dxr);
        s_check("pool dx", gdx, dxr, nx, t->pool, 1e-3);
        k_op_release(s_be, &d.impl);
        s_dev_free_all();
        free(x), free(yr), free(dy), free(dxr);
    }
}

S_CASE(dense_matches_ref)
{
    for (int iter = 0; iter < 6; iter++) {
        k_dense d = {.n = zt_irand(1, 16), .in = zt_irand(1, 300), .out = zt_irand(1, 40)}, dr = d;
        size_t nx = (size_t)d.n * d.in, nw = (size_t)d.out * d.in, ny = (size_t)d.n * d.out;
        size_t no = (size_t)d.out;
        float *x = zt_k_randv(nx, -1, 1), *w = zt_k_randv(nw, -1, 1), *b = zt_k_randv(no, -1, 1);
        float *yr = zt_k_zeros(ny), *dy = zt_k_randv(ny, -1, 1), *dxr = zt_k_zeros(nx);
        float *dw = zt_k_randv(nw, -1, 1), *db = zt_k_zeros(no); /* dw accumulated into */
        float *gx = s_up(x, nx), *gw = s_up(w, nw), *gb = s_up(b, no), *gy = s_up(yr, ny);
        float *gdy = s_up(dy, ny), *gdx = s_up(dxr, nx), *gdw = s_up(dw, nw), *gdb = s_up(db, no);
        cr_assert_eq(k_dense_fwd(s_be, &d, gx, gw, gb, gy), ZPS_OK);
        cr_assert_eq(k_dense_bwd(s_be, &d, gx, gw, gdy, gdx, gdw, gdb), ZPS_OK);
        k_dense_fwd(ref, &dr, x, w, b, yr);
        k_dense_bwd(ref, &dr, x, w, dy, dxr, dw, db);
        double sy = 1, sdx = 1, sdw = 1;
        if (t->dense_scaled)
            sy = sqrt(d.in), sdx = sqrt(d.out), sdw = sqrt(d.n);
        s_check("dense y", gy, yr, ny, t->dense * sy, 1e-3);
        s_check("dense dx", gdx, dxr, nx, t->dense * sdx, 1e-3);
        s_check("dense dw", gdw, dw, nw, t->dense * sdw, 1e-3);
        s_check("dense db", gdb, db, no, t->dense * sdw, 1e-3);
        k_op_release(s_be, &d.impl);
        s_dev_free_all();
        free(x), free(w), free(b), free(yr), free(dy), free(dxr), free(dw), free(db);
    }
}

S_CASE(relu_matches_ref)
{
    size_t n = (size_t)zt_irand(1, 5000);
    float *x = zt_k_randv(n, -1, 1), *dy = zt_k_randv(n, -1, 1), *y = zt_k_zeros(n), *dx = zt_k_zeros(n);
    float *gx = s_up(x, n), *gdy = s_up(dy, n), *gy = s_up(y, n), *gdx = s_up(dx, n);
    cr_assert_eq(k_relu_fwd(s_be, n, gx, gy), ZPS_OK);
    cr_assert_eq(k_relu_bwd(s_be, n, gy, gdy, gdx), ZPS_OK);
    k_relu_fwd(ref, n, x, y);
    k_relu_bwd(ref, n, y, dy, dx);
    s_check("relu y", gy, y, n, 0, 0);
    s_check("relu dx", gdx, dx, n, 0, 0);
    s_dev_free_all();
    free(x), free(dy), free(y), free(dx);
}

/* Concat then split: copies, so bit-exact. */
S_CASE(concat_matches_ref)
{
    int n = zt_irand(1, 3), hw = zt_irand(1, 20), nin = zt_irand(1, 4), c[4], ctot = 0;
    float *xs[4], *gxs[4], *back[4], *gback[4];
    for (int i = 0; i < nin; i++) {
        c[i] = zt_irand(1, 5);
        ctot += c[i];
        size_t len = (size_t)n * c[i] * hw;
        xs[i] = zt_k_randv(len, -1, 1), back[i] = zt_k_zeros(len);
        gxs[i] = s_up(xs[i], len), gback[i] = s_up(back[i], len);
    }
    size_t ny = (size_t)n * ctot * hw;
    float *y = zt_k_zeros(ny), *gy = s_up(y, ny);
    cr_assert_eq(k_concat_fwd(s_be, n, hw, nin, c, (const float *const *)gxs, gy), ZPS_OK);
    cr_assert_eq(k_concat_bwd(s_be, n, hw, nin, c, gy, gback), ZPS_OK);
    k_concat_fwd(ref, n, hw, nin, c, (const float *const *)xs, y);
    k_concat_bwd(ref, n, hw, nin, c, y, back);
    s_check("concat y", gy, y, ny, 0, 0);
    for (int i = 0; i < nin; i++) {
        s_check("split dx", gback[i], back[i], (size_t)n * c[i] * hw, 0, 0);
        free(xs[i]), free(back[i]);
    }
    s_dev_free_all();
    free(y);
}

/* The same seed drops the same elements on every back-end. */
S_CASE(dropout_matches_ref)
{
    size_t n = (size_t)zt_irand(1, 5000);
    float p = zt_unif(0.1f, 0.7f);
    uint64_t seed = zt_rand();
    float *x = zt_k_randv(n, -1, 1), *y = zt_k_zeros(n), *dx = zt_k_zeros(n);
    float *gx = s_up(x, n), *gy = s_up(y, n), *gdx = s_up(dx, n);
    cr_assert_eq(k_dropout_fwd(s_be, n, p, seed, gx, gy), ZPS_OK);
    cr_assert_eq(k_dropout_bwd(s_be, n, p, seed, gx, gdx), ZPS_OK);
    k_dropout_fwd(ref, n, p, seed, x, y);
    k_dropout_bwd(ref, n, p, seed, x, dx);
    s_check("dropout y", gy, y, n, 1e-6, 1e-3);
    s_check("dropout dx", gdx, dx, n, 1e-6, 1e-3);
    s_dev_free_all();
    free(x), free(y), free(dx);
}

S_CASE(softmax_xent_matches_ref)
{
    int rows = zt_irand(1, 9), k = zt_irand(2, 20);
    size_t nz = (size_t)rows * k;
    float *z = zt_k_randv(nz, -3, 3), *dz = zt_k_zeros(nz), l1, l2;
    int32_t lab[9] = {0};
    for (int i = 0; i < rows; i++)
        lab[i] = (int32_t)zt_irand(0, k - 1);
    int32_t *glab = s_upb(lab, sizeof lab);
    float *gz = s_up(z, nz), *gdz = s_up(dz, nz);
    int c1, c2;
    cr_assert_eq(k_softmax_xent(s_be, rows, k, gz, glab, 0.1f, 1.0f, &l1, &c1, gdz), ZPS_OK);
    k_softmax_xent(ref, rows, k, z, lab, 0.1f, 1.0f, &l2, &c2, dz);
    s_check_scalar("xent loss", l1, l2, 1e-6, 1e-5);
    cr_assert_eq(c1, c2, "%s xent correct %d, ref %d", s_be->name, c1, c2);
    s_check("xent dlogits", gdz, dz, nz, 1e-6, 1e-3);
    lab[0] = k; /* out of range */
    glab = s_upb(lab, sizeof lab);
    cr_assert_eq(k_softmax_xent(s_be, rows, k, gz, glab, 0, 1, &l1, NULL, NULL),
                 ZPS_ERR_INVALID);
    s_dev_free_all();
    free(z), free(dz);
}

S_CASE(smooth_l1_matches_ref)
{
    size_t n = (size_t)zt_irand(1, 5000);
    float beta = zt_unif(0.5f, 2), scale = zt_unif(0.5f, 2), l1, l2;
    float *x = zt_k_randv(n, -3, 3), *tg = zt_k_randv(n, -3, 3), *dx = zt_k_zeros(n);
    float *gx = s_up(x, n), *gt = s_up(tg, n), *gdx = s_up(dx, n);
    cr_assert_eq(k_smooth_l1(s_be, n, gx, gt, beta, scale, &l1, gdx), ZPS_OK);
    k_smooth_l1(ref, n, x, tg, beta, scale, &l2, dx);
    s_check_scalar("smooth-l1 loss", l1, l2, 1e-6, 1e-5);
    s_check("smooth-l1 dx", gdx, dx, n, 1e-6, 1e-3);
    s_dev_free_all();
    free(x), free(tg), free(dx);
}

/* fill, add, scale, axpy. */
S_CASE(elementwise_matches_ref)
{
    size_t n = (size_t)zt_irand(1, 5000);
    float alpha = zt_unif(-2, 2), v = zt_unif(-2, 2);
    float *a = zt_k_randv(n, -1, 1), *b = zt_k_randv(n, -1, 1), *y = zt_k_zeros(n);
    float *ga = s_up(a, n), *gb = s_up(b, n), *gy = s_up(y, n);
    cr_assert_eq(k_add(s_be, n, ga, gb, gy), ZPS_OK);
    k_add(ref, n, a, b, y);
    s_check("add", gy, y, n, 1e-6, 1e-3);
    cr_assert_eq(k_axpy(s_be, n, 0.5f, ga, gb), ZPS_OK);
    k_axpy(ref, n, 0.5f, a, b);
    s_check("axpy", gb, b, n, 1e-6, 1e-3);
    cr_assert_eq(k_scale(s_be, n, alpha, gy), ZPS_OK);
    k_scale(ref, n, alpha, y);
    s_check("scale", gy, y, n, 1e-6, 1e-3);
    cr_assert_eq(k_fill(s_be, n, v, gy), ZPS_OK);
    k_fill(ref, n, v, y);
    s_check("fill", gy, y, n, 0, 0);
    s_dev_free_all();
    free(a), free(b), free(y);
}

/* Bit for bit the update of ps_optim_apply (the servers' own), for every optimizer: the
 * step's constants from ps_optim_prepare, the values and slots in the back-end's memory. */
static void s_optim_case(const ps_optim_config *c, uint64_t step)
{
    size_t n = (size_t)zt_irand(1, 20000);
    int k = ps_optim_slots(c->kind);
    float *w = zt_k_randv(n, -1, 1), *g = zt_k_randv(n, -1, 1);
    float *s0 = zt_k_randv(n, 0.01f, 1), *s1 = zt_k_randv(n, 0.01f, 1); /* ms, acc, v > 0 */
    float *dw = s_up(w, n), *dg = s_up(g, n), *d0 = s_up(s0, n), *d1 = s_up(s1, n);
    float *slots[2] = {s0, s1};
    ps_optim_apply(c, step, w, slots, g, n);
    zps_optim_step st;
    ps_optim_prepare(c, step, &st);
    cr_assert_eq(k_optim_apply(s_be, &st, n, dw, k > 0 ? d0 : NULL, k > 1 ? d1 : NULL, dg),
                 ZPS_OK);
    float *h = malloc(n * sizeof *h);
    const float *want[3] = {w, s0, s1}, *got[3] = {dw, d0, d1};
    for (int i = 0; i <= k; i++) {
        cr_assert_eq(s_be->copy_out(h, got[i], n * sizeof *h), ZPS_OK);
        cr_assert(!memcmp(h, want[i], n * sizeof *h), "%s %s (nesterov %d) step %llu: %s "
                  "differs from ps_optim_apply's (n %zu, seed %llu)", s_be->name,
                  ps_optim_kind_name(c->kind), c->nesterov, (unsigned long long)step,
                  i ? "a slot" : "the values", n, (unsigned long long)s_seed);
    }
    free(h);
    s_dev_free_all();
    free(w), free(g), free(s0), free(s1);
}

S_CASE(optim_apply_equals_ps_optim_bit_for_bit)
{
    (void)ref;
    for (int kind = PS_OPT_SGD; kind <= PS_OPT_ADAGRAD; kind++)
        for (int nesterov = 0; nesterov <= (kind == PS_OPT_MOMENTUM); nesterov++) {
            ps_optim_config c;
            ps_optim_default(&c);
            c.kind = (ps_optim_kind)kind, c.nesterov = nesterov;
            c.lr = zt_unif(0.001f, 0.5f), c.momentum = 0.9, c.weight_decay = 1e-4;
            c.sched = PS_SCHED_EXPONENTIAL, c.decay_rate = 0.94, c.decay_steps = 3;
            s_optim_case(&c, (uint64_t)zt_irand(0, 50));
        }
}

/* The bfloat16 bits of the PS wire (ps_f32_to_bf16), exactly: random floats of every
 * magnitude, plus ties (both ways to even), values that round up into the next exponent or
 * to infinity, zeros, denormals, infinities and NaNs (kept quiet). */
S_CASE(pack_bf16_is_the_wire_rounding)
{
    (void)ref;
    size_t n = (size_t)zt_irand(64, 50000);
    float *x = malloc(n * sizeof *x);
    static const uint32_t special[] = {
        0x3f808000u, 0x3f818000u, 0xbf808000u, 0x3f80ffffu, 0x7f7fffffu, 0xff7fc000u,
        0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x7f800000u, 0xff800000u,
        0x7fc00000u, 0x7f800001u, 0xffa00000u, 0x3f7f8000u};
    enum { NS = sizeof special / sizeof special[0] };
    for (size_t i = 0; i < n; i++) {
        uint32_t b = i < NS ? special[i] : zt_rand();
        memcpy(&x[i], &b, 4);
    }
    uint16_t *want = malloc(n * 2), *got = malloc(n * 2);
    ps_f32_to_bf16(want, x, n);
    float *gx = s_up(x, n);
    uint16_t *gy = s_new(n * 2);
    cr_assert_eq(k_pack_bf16(s_be, n, gx, gy), ZPS_OK);
    cr_assert_eq(s_be->copy_out(got, gy, n * 2), ZPS_OK);
    for (size_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, &x[i], 4);
        cr_assert_eq(got[i], want[i], "%s: 0x%08x became 0x%04x, the wire's 0x%04x (n %zu, "
                     "seed %llu)", s_be->name, b, got[i], want[i], n, (unsigned long long)s_seed);
    }
    s_dev_free_all();
    free(x), free(want), free(got);
}

/* Every elementwise op and reduction over 0 elements does nothing and succeeds, as ref's
 * loops do (a GPU grid of 0 blocks is an invalid launch). */
S_CASE(zero_elements_are_no_work)
{
    (void)ref;
    float *a = s_new(64), *b = s_new(64);
    uint16_t *h = s_new(64);
    double sum = -1, sumsq = -1;
    cr_assert_eq(k_fill(s_be, 0, 1.0f, a), ZPS_OK, "%s: fill", s_be->name);
    cr_assert_eq(k_add(s_be, 0, a, a, b), ZPS_OK, "%s: add", s_be->name);
    cr_assert_eq(k_scale(s_be, 0, 2.0f, a), ZPS_OK, "%s: scale", s_be->name);
    cr_assert_eq(k_axpy(s_be, 0, 2.0f, a, b), ZPS_OK, "%s: axpy", s_be->name);
    cr_assert_eq(k_relu_fwd(s_be, 0, a, b), ZPS_OK, "%s: relu", s_be->name);
    cr_assert_eq(k_relu_bwd(s_be, 0, a, a, b), ZPS_OK, "%s: relu backward", s_be->name);
    cr_assert_eq(k_dropout_fwd(s_be, 0, 0.5f, 7, a, b), ZPS_OK, "%s: dropout", s_be->name);
    cr_assert_eq(k_pack_bf16(s_be, 0, a, h), ZPS_OK, "%s: pack_bf16", s_be->name);
    cr_assert_eq(k_sum(s_be, 0, a, &sum), ZPS_OK, "%s: sum", s_be->name);
    cr_assert_eq(k_sumsq(s_be, 0, a, &sumsq), ZPS_OK, "%s: sumsq", s_be->name);
    cr_assert(sum == 0 && sumsq == 0, "%s: sums of nothing are %g and %g", s_be->name, sum,
              sumsq);
    s_dev_free_all();
}

/* sum and sum of squares into a host double. */
S_CASE(reductions_match_ref)
{
    size_t n = (size_t)zt_irand(1, 5000);
    float *a = zt_k_randv(n, -1, 1), *ga = s_up(a, n);
    double s1, s2;
    cr_assert_eq(k_sum(s_be, n, ga, &s1), ZPS_OK);
    k_sum(ref, n, a, &s2);
    s_check_scalar("sum", s1, s2, 1e-9, 1e-6);
    cr_assert_eq(k_sumsq(s_be, n, ga, &s1), ZPS_OK);
    k_sumsq(ref, n, a, &s2);
    s_check_scalar("sumsq", s1, s2, 1e-9, 1e-6);
    s_dev_free_all();
    free(a);
}

/* ---- the cpu back-end's own checks ---- */

/* Batch statistics of channels whose mean is far from zero, as after Inception's stem: ~10^4
 * values per channel, |mean| 10-50 times the std, plain and blocked layouts. ref sums in double
 * and rounds once; the cpu back-end must do as well (oneDNN 2.6 sums in float: its means were
 * off by several float roundings, shifting whole channels, see s_bn_stats in cpu/bn.c).
 * Tolerances: mean and variance within 2 float roundings (2.4e-7 relative); y within
 * 4e-7 * (1 + |y|), a few roundings of y (off by up to ~3e-5 before). */
Test(k_cpu, batchnorm_statistics_exact_on_offset_channels, .init = s_init_cpu, .timeout = 60)
{
    const k_backend *cpu = k_backend_cpu(), *ref = k_backend_ref();
    for (int iter = 0; iter < 4; iter++) {
        int hw = zt_irand(28, 37);
        k_bn d = {.n = 8, .c = 16 * zt_irand(1, 3), .h = hw, .w = hw, .eps = 1e-3f,
                  .momentum = 0.1f, .relu = iter % 2, .blocked = iter / 2}, dr = d;
        dr.blocked = 0;
        size_t n = (size_t)d.n * d.c * d.h * d.w, nc = (size_t)d.c, plane = (size_t)hw * hw;
        float *x = zt_k_zeros(n), *xb = zt_k_zeros(n), *g = zt_k_randv(nc, 0.5f, 1.5f);
        float *b = zt_k_randv(nc, -0.5f, 0.5f), *y = zt_k_zeros(n), *yp = zt_k_zeros(n), *yr = zt_k_zeros(n);
        float *m = zt_k_zeros(nc), *v = zt_k_zeros(nc), *mr = zt_k_zeros(nc), *vr = zt_k_zeros(nc);
        for (int c = 0; c < d.c; c++) {
            float sd = zt_unif(0.5f, 2), mu = zt_unif(10, 50) * sd * (zt_rand() % 2 ? 1 : -1);
            for (int i = 0; i < d.n; i++)
                for (size_t j = 0; j < plane; j++)
                    x[((size_t)i * d.c + c) * plane + j] = mu + sd * zt_unif(-1.7f, 1.7f);
        }
        if (d.blocked)
            k_to_blocked(d.n, d.c, d.h, d.w, x, xb);
        else
            memcpy(xb, x, n * sizeof *x);
        cr_assert_eq(k_bn_fwd_train(cpu, &d, xb, g, b, y, m, v, NULL, NULL), ZPS_OK);
        k_bn_fwd_train(ref, &dr, x, g, b, yr, mr, vr, NULL, NULL);
        if (d.blocked)
            k_from_blocked(d.n, d.c, d.h, d.w, y, yp);
        else
            memcpy(yp, y, n * sizeof *y);
        for (int c = 0; c < d.c; c++) {
            cr_assert(fabs(m[c] - mr[c]) <= 2.4e-7 * fabs(mr[c]),
                      "bn mean[%d] %.9g, ref %.9g (%s %dx%d; seed %llu)", c, m[c], mr[c],
                      d.blocked ? "blocked" : "plain", hw, hw, (unsigned long long)s_seed);
            cr_assert(fabs(v[c] - vr[c]) <= 2.4e-7 * vr[c],
                      "bn var[%d] %.9g, ref %.9g (%s %dx%d; seed %llu)", c, v[c], vr[c],
                      d.blocked ? "blocked" : "plain", hw, hw, (unsigned long long)s_seed);
        }
        zt_k_close(s_be->name, d.blocked ? "blocked offset bn y" : "offset bn y", yp, yr, n, 4e-7, 4e-7);
        k_op_release(cpu, &d.impl);
        free(x), free(xb), free(g), free(b), free(y), free(yp), free(yr), free(m), free(v);
        free(mr), free(vr);
    }
}

/* A copy of x between NCHW and the layout a descriptor flag asks for: into that layout
 * (to_layout), or back into NCHW. A plain layout is copied as it is. */
static float *s_relayout(int blocked, int to_layout, int n, int c, int h, int w, const float *x)
{
    size_t len = (size_t)n * c * h * w;
    float *out = zt_k_zeros(len);
    if (blocked && to_layout)
        k_to_layout(blocked, n, c, h, w, x, out);
    else if (blocked)
        k_from_layout(blocked, n, c, h, w, x, out);
    else
        memcpy(out, x, len * sizeof *x);
    return out;
}
static float *s_maybe_blocked(int blocked, int n, int c, int h, int w, const float *x)
{
    return s_relayout(blocked, 1, n, c, h, w, x);
}
static float *s_maybe_plain(int blocked, int n, int c, int h, int w, const float *x)
{
    return s_relayout(blocked, 0, n, c, h, w, x);
}

/* Batchnorm + ReLU (forward, backward with and without dx) and max pooling on the blocked
 * output y (n, k, oh, ow) of a convolution; yr: the same tensor in NCHW. */
static void s_blocked_bn_pool(int lay, int n, int k, int oh, int ow, const float *yr)
{
    const k_backend *cpu = k_backend_cpu(), *ref = k_backend_ref();
    k_bn b = {.n = n, .c = k, .h = oh, .w = ow, .eps = 1e-3f, .momentum = 0.1f, .relu = 1,
              .blocked = lay}, br = b;
    br.blocked = 0;
    size_t nc = (size_t)k, ny = (size_t)n * k * oh * ow;
    float *g = zt_k_randv(nc, 0.5f, 1.5f), *be = zt_k_randv(nc, -0.5f, 0.5f);
    float *m = zt_k_zeros(nc), *v = zt_k_zeros(nc), *mr = zt_k_zeros(nc), *vr = zt_k_zeros(nc);
    float *z = zt_k_zeros(ny), *zr = zt_k_zeros(ny), *yb = s_maybe_blocked(lay, n, k, oh, ow, yr);
    cr_assert_eq(k_bn_fwd_train(cpu, &b, yb, g, be, z, m, v, NULL, NULL), ZPS_OK);
    k_bn_fwd_train(ref, &br, yr, g, be, zr, mr, vr, NULL, NULL);
    float *zp = s_maybe_plain(lay, n, k, oh, ow, z);
    zt_k_close(s_be->name, "blocked bn y", zp, zr, ny, 1e-3, 1e-3);
    zt_k_close(s_be->name, "blocked bn mean", m, mr, nc, 1e-4, 1e-3);
    /* backward, then again without dx: parameter gradients only */
    float *dz = zt_k_randv(ny, -1, 1), *dzb = s_maybe_blocked(lay, n, k, oh, ow, dz);
    float *dx = zt_k_zeros(ny), *dxr = zt_k_zeros(ny), *dg = zt_k_zeros(nc), *dgr = zt_k_zeros(nc);
    float *db = zt_k_zeros(nc), *dbr = zt_k_zeros(nc);
    cr_assert_eq(k_bn_bwd(cpu, &b, yb, z, dzb, g, m, v, dx, dg, db), ZPS_OK);
    k_bn_bwd(ref, &br, yr, zr, dz, g, mr, vr, dxr, dgr, dbr);
    float *dxp = s_maybe_plain(lay, n, k, oh, ow, dx);
    zt_k_close(s_be->name, "blocked bn dx", dxp, dxr, ny, 1e-3, 1e-2);
    memset(dg, 0, nc * sizeof *dg), memset(db, 0, nc * sizeof *db);
    cr_assert_eq(k_bn_bwd(cpu, &b, yb, z, dzb, g, m, v, NULL, dg, db), ZPS_OK);
    zt_k_close(s_be->name, "blocked bn dgamma (no dx)", dg, dgr, nc, 1e-3, 1e-3);
    zt_k_close(s_be->name, "blocked bn dbeta (no dx)", db, dbr, nc, 1e-3, 1e-3);
    k_op_release(cpu, &b.impl);
    k_pool p, pr;
    if (k_pool_init(&p, K_POOL_MAX, n, k, oh, ow, 2, 2, 2, 2, 0, 0) == ZPS_OK) {
        pr = p;
        p.blocked = lay;
        size_t no = (size_t)p.n * p.c * p.oh * p.ow;
        float *o = zt_k_zeros(no), *orf = zt_k_zeros(no);
        cr_assert_eq(k_pool_fwd(cpu, &p, yb, o), ZPS_OK);
        k_pool_fwd(ref, &pr, yr, orf);
        float *op = s_maybe_plain(lay, p.n, p.c, p.oh, p.ow, o);
        zt_k_close(s_be->name, "blocked maxpool y", op, orf, no, 1e-6, 1e-6);
        k_op_release(cpu, &p.impl);
        free(o), free(orf), free(op);
    }
    free(g), free(be), free(m), free(v), free(mr), free(vr), free(z), free(zr), free(yb);
    free(zp), free(dz), free(dzb), free(dx), free(dxr), free(dg), free(dgr), free(db);
    free(dbr), free(dxp);
}

/* A random convolution from layout xl into layout yl (K_NCHW, K_BLOCK16, K_BLOCK8); a plain
 * input has 1-20 channels: first-layer style (a few) and thin-model style (12, which the cpu
 * back-end reorders at the convolution's edges). */
static void s_random_blocked_conv(k_conv2d *d, int xl, int yl)
{
    int c = xl ? k_block_size(xl) * zt_irand(1, 3) : zt_irand(1, 20);
    int k = yl ? k_block_size(yl) * zt_irand(1, 3) : zt_irand(1, 20);
    for (;;) {
        int r = zt_irand(1, 4), s = zt_irand(1, 4);
        if (k_conv2d_init(d, zt_irand(1, 3), c, zt_irand(r, 14), zt_irand(s, 14), k, r, s,
                          zt_irand(1, 2), zt_irand(1, 2), zt_irand(0, r / 2),
                          zt_irand(0, s / 2)) == ZPS_OK)
            break;
    }
    d->x_blocked = xl, d->y_blocked = yl;
}

/* The cpu back-end's convolution d (its layouts and bf16 set) against ref's on plain copies:
 * y, dx, and dw accumulated onto a random start, within tol x sqrt(the sums' lengths), what
 * names the layouts in a failure. Returns ref's y (the caller frees it). */
static float *s_blocked_conv_vs_ref(const k_conv2d *dc, double tol, const char *what)
{
    const k_backend *cpu = k_backend_cpu(), *ref = k_backend_ref();
    k_conv2d d = *dc, dr = *dc;
    int xl = d.x_blocked, yl = d.y_blocked;
    dr.x_blocked = dr.y_blocked = 0;
    size_t nx = (size_t)d.n * d.c * d.h * d.w, nw = (size_t)d.k * d.c * d.r * d.s;
    size_t ny = (size_t)d.n * d.k * d.oh * d.ow;
    float *x = zt_k_randv(nx, -1, 1), *w = zt_k_randv(nw, -1, 1), *dy = zt_k_randv(ny, -1, 1);
    float *xbl = s_maybe_blocked(xl, d.n, d.c, d.h, d.w, x);
    float *dyb = s_maybe_blocked(yl, d.n, d.k, d.oh, d.ow, dy);
    float *y = zt_k_zeros(ny), *yr = zt_k_zeros(ny), *dx = zt_k_zeros(nx), *dxr = zt_k_zeros(nx);
    float *dw = zt_k_randv(nw, -1, 1), *dwr = zt_k_copyv(dw, nw);
    char name[128];
    cr_assert_eq(k_conv2d_fwd(cpu, &d, xbl, w, NULL, y), ZPS_OK);
    cr_assert_eq(k_conv2d_fwd(ref, &dr, x, w, NULL, yr), ZPS_OK);
    float *yp = s_maybe_plain(yl, d.n, d.k, d.oh, d.ow, y);
    snprintf(name, sizeof name, "%s y (layouts %d->%d, %d->%d channels)", what, xl, yl, d.c, d.k);
    zt_k_close(s_be->name, name, yp, yr, ny, tol * sqrt((double)d.c * d.r * d.s), 1e-3);
    cr_assert_eq(k_conv2d_bwd(cpu, &d, xbl, w, dyb, dx, dw, NULL), ZPS_OK);
    cr_assert_eq(k_conv2d_bwd(ref, &dr, x, w, dy, dxr, dwr, NULL), ZPS_OK);
    float *dxp = s_maybe_plain(xl, d.n, d.c, d.h, d.w, dx);
    snprintf(name, sizeof name, "%s dx (layouts %d->%d)", what, xl, yl);
    zt_k_close(s_be->name, name, dxp, dxr, nx, tol * sqrt((double)d.k * d.r * d.s), 1e-3);
    snprintf(name, sizeof name, "%s dw (layouts %d->%d)", what, xl, yl);
    zt_k_close(s_be->name, name, dw, dwr, nw, tol * sqrt((double)d.n * d.oh * d.ow), 1e-3);
    k_op_release(cpu, &d.impl);
    free(x), free(w), free(dy), free(xbl), free(dyb), free(y), free(yp);
    free(dx), free(dxr), free(dxp), free(dw), free(dwr);
    return yr;
}

/* bf16 convolutions in every pair of layouts (NCHW, 16- and 8-blocks) give ref's bf16
 * results: oneDNN's bf16 kernels where the CPU has them, float ones on rounded copies
 * ("emulate", conv.c) where it has not, in whatever layouts oneDNN picks at the edges. An
 * AVX2-only CPU asks for 8-blocks (prefers_blocked), so this is the path its bf16 models take.
 * Inception's shapes too: its 1xn and nx1 kernels with their padding, a stride-2 reduction,
 * and the 1x5 kernel over 15 channels whose right padding oneDNN's plain-layout bf16 forward
 * once wrote garbage into. Twice on a CPU with AMX: with its channels-last kernels, and in the
 * 16-channel blocks of the others (ZPS_CPU_NO_AMX, conv.c's s_amx). The last three shapes are
 * ones oneDNN 2.6's AMX kernels get wrong (y, y, dx: found by this test's random shapes, 2026-12-07),
 * which conv.c's check at creation must catch (s_agree). */
Test(k_cpu, bf16_blocked_layouts_match_ref, .init = s_init_cpu, .timeout = 90)
{
    static const int inc[9][9] = {/* c, h, w, k, r, s, stride, pad h, pad w */
                                  {32, 17, 17, 48, 1, 7, 1, 0, 3}, {48, 17, 17, 32, 7, 1, 1, 3, 0},
                                  {15, 9, 11, 16, 1, 5, 1, 0, 2},  {64, 15, 15, 96, 3, 3, 2, 0, 0},
                                  {48, 8, 8, 64, 1, 3, 1, 0, 1},   {3, 19, 19, 32, 3, 3, 2, 0, 0},
                                  {48, 14, 9, 48, 1, 4, 2, 0, 0},  {3, 1, 11, 48, 1, 2, 1, 0, 0},
                                  {32, 8, 8, 15, 4, 3, 2, 2, 0}};
    for (int no_amx = 0; no_amx < 2; no_amx++) {
        cr_assert_eq(setenv("ZPS_CPU_NO_AMX", no_amx ? "1" : "0", 1), 0);
        for (int iter = 0; iter < 25; iter++) {
            k_conv2d d;
            s_random_blocked_conv(&d, (iter + 1) % 3, (iter + 1) / 3 % 3);
            if (iter >= 8 && iter < 16) { /* wide 8-blocks, where the float path pads to 16 */
                cr_assert_eq(k_conv2d_init(&d, 2, 8 * zt_irand(5, 9), 6, 7, 8 * zt_irand(5, 9),
                                           3, 3, 1, 1, 1, 1), ZPS_OK);
                d.x_blocked = d.y_blocked = K_BLOCK8;
            }
            if (iter >= 16) {
                const int *s = inc[iter - 16];
                cr_assert_eq(k_conv2d_init(&d, 2, s[0], s[1], s[2], s[3], s[4], s[5], s[6],
                                           s[6], s[7], s[8]), ZPS_OK);
                d.x_blocked = k_backend_cpu()->prefers_blocked(s[0]);
                d.y_blocked = k_backend_cpu()->prefers_blocked(s[3]);
            }
            d.bf16 = 1;
            free(s_blocked_conv_vs_ref(&d, 1e-4, no_amx ? "bf16 conv (no AMX)" : "bf16 conv"));
        }
    }
    cr_assert_eq(unsetenv("ZPS_CPU_NO_AMX"), 0);
}

/* The shapes whose forward the cpu back-end runs with oneDNN's Winograd kernel (conv.c,
 * s_wino_pays: 3x3, stride 1, 16+ input channels, 12-32 output rows and columns) stay within
 * the direct kernels' tolerances of ref: y, and dx and dw from the direct backward that
 * follows it; partial 4x4 tiles, plain and blocked edges, with and without bias. A plain pair
 * (16 to 32 NCHW) has no Winograd kernel and falls back to direct. */
Test(k_cpu, winograd_shapes_match_ref, .init = s_init_cpu, .timeout = 60)
{
    const k_backend *cpu = k_backend_cpu(), *ref = k_backend_ref();
    static const int cs[5][9] = {/* n, c, h, w, k, pad, x and y layouts, bias */
                                 {2, 32, 14, 14, 64, 1, K_BLOCK16, K_BLOCK16, 0},
                                 {2, 32, 14, 14, 64, 1, K_BLOCK16, K_BLOCK16, 1},
                                 {2, 20, 17, 17, 48, 0, K_NCHW, K_BLOCK16, 0},
                                 {3, 16, 13, 15, 32, 1, K_NCHW, K_NCHW, 1},
                                 {1, 48, 30, 14, 16, 1, K_BLOCK16, K_BLOCK16, 0}};
    for (int i = 0; i < 5; i++) {
        const int *q = cs[i];
        k_conv2d d, dr;
        cr_assert_eq(k_conv2d_init(&d, q[0], q[1], q[2], q[3], q[4], 3, 3, 1, 1, q[5], q[5]),
                     ZPS_OK);
        dr = d;
        d.x_blocked = q[6], d.y_blocked = q[7];
        size_t nx = (size_t)d.n * d.c * d.h * d.w, nw = (size_t)d.k * d.c * 9;
        size_t ny = (size_t)d.n * d.k * d.oh * d.ow;
        float *x = zt_k_randv(nx, -1, 1), *w = zt_k_randv(nw, -1, 1), *dy = zt_k_randv(ny, -1, 1);
        float *b = q[8] ? zt_k_randv((size_t)d.k, -1, 1) : NULL;
        float *xbl = s_maybe_blocked(d.x_blocked, d.n, d.c, d.h, d.w, x);
        float *dyb = s_maybe_blocked(d.y_blocked, d.n, d.k, d.oh, d.ow, dy);
        float *y = zt_k_zeros(ny), *yr = zt_k_zeros(ny), *dx = zt_k_zeros(nx), *dxr = zt_k_zeros(nx);
        float *dw = zt_k_zeros(nw), *dwr = zt_k_zeros(nw);
        for (int pass = 0; pass < 2; pass++) /* the second on the cached primitives */
            cr_assert_eq(k_conv2d_fwd(cpu, &d, xbl, w, b, y), ZPS_OK);
        k_conv2d_fwd(ref, &dr, x, w, b, yr);
        float *yp = s_maybe_plain(d.y_blocked, d.n, d.k, d.oh, d.ow, y);
        zt_k_close("cpu", "winograd conv y", yp, yr, ny, 4e-4 * sqrt((double)d.c * 9), 1e-3);
        cr_assert_eq(k_conv2d_bwd(cpu, &d, xbl, w, dyb, dx, dw, NULL), ZPS_OK);
        k_conv2d_bwd(ref, &dr, x, w, dy, dxr, dwr, NULL);
        float *dxp = s_maybe_plain(d.x_blocked, d.n, d.c, d.h, d.w, dx);
        zt_k_close("cpu", "winograd conv dx", dxp, dxr, nx, 4e-4 * sqrt((double)d.k * 9), 1e-3);
        zt_k_close("cpu", "winograd conv dw", dw, dwr, nw,
                   4e-4 * sqrt((double)d.n * d.oh * d.ow), 1e-3);
        k_op_release(cpu, &d.impl);
        free(x), free(w), free(dy), free(b), free(xbl), free(dyb), free(y), free(yr), free(yp);
        free(dx), free(dxr), free(dxp), free(dw), free(dwr);
    }
}

/* 2x2 stride-2 max pooling of blocked maps (the cpu back-end's own loops for 16-blocks of even
 * height and width, oneDNN's otherwise) equals ref exactly, forward and backward, ties
 * included: ReLU-like maps, a third zeros, the rest from 5 values, so most windows hold
 * equal maxima and the gradient must go to the first, as ref's does. */
Test(k_cpu, blocked_max_pool_2x2_equals_ref, .init = s_init_cpu, .timeout = 60)
{
    const k_backend *cpu = k_backend_cpu(), *ref = k_backend_ref();
    static const int cs[5][5] = {/* layout, n, c, h, w */
                                 {K_BLOCK16, 3, 32, 28, 28}, {K_BLOCK16, 2, 16, 14, 6},
                                 {K_BLOCK8, 2, 24, 10, 12},  {K_BLOCK16, 2, 16, 7, 9},
                                 {K_BLOCK8, 1, 8, 2, 2}};
    for (int i = 0; i < 5; i++) {
        const int *q = cs[i];
        k_pool d, dr;
        cr_assert_eq(k_pool_init(&d, K_POOL_MAX, q[1], q[2], q[3], q[4], 2, 2, 2, 2, 0, 0),
                     ZPS_OK);
        dr = d;
        d.blocked = q[0];
        size_t nx = (size_t)d.n * d.c * d.h * d.w, ny = (size_t)d.n * d.c * d.oh * d.ow;
        float *x = zt_k_randv(nx, -1, 1), *dy = zt_k_randv(ny, -1, 1);
        for (size_t j = 0; j < nx; j++)
            x[j] = x[j] < -0.33f ? 0.0f : floorf(x[j] * 3.0f);
        float *xb = s_maybe_blocked(q[0], d.n, d.c, d.h, d.w, x);
        float *dyb = s_maybe_blocked(q[0], d.n, d.c, d.oh, d.ow, dy);
        float *y = zt_k_zeros(ny), *yr = zt_k_zeros(ny), *dx = zt_k_randv(nx, -1, 1);
        float *dxr = zt_k_zeros(nx);
        for (int pass = 0; pass < 2; pass++) { /* the second on the cached state */
            cr_assert_eq(k_pool_fwd(cpu, &d, xb, y), ZPS_OK);
            cr_assert_eq(k_pool_bwd(cpu, &d, xb, y, dyb, dx), ZPS_OK);
        }
        k_pool_fwd(ref, &dr, x, yr);
        k_pool_bwd(ref, &dr, x, yr, dy, dxr);
        float *yp = s_maybe_plain(q[0], d.n, d.c, d.oh, d.ow, y);
        float *dxp = s_maybe_plain(q[0], d.n, d.c, d.h, d.w, dx);
        zt_k_close("cpu", "max pool 2x2 y", yp, yr, ny, 0, 0);
        zt_k_close("cpu", "max pool 2x2 dx", dxp, dxr, nx, 0, 0);
        k_op_release(cpu, &d.impl);
        cr_assert_null(d.impl);
        free(x), free(dy), free(xb), free(dyb), free(y), free(yr), free(dx), free(dxr);
        free(yp), free(dxp);
    }
}

/* A dense layer reading a blocked map (n, c, h, w) gives ref's results on the NCHW map, its dx
 * comes back blocked, and dw/db are added into. */
static void s_blocked_dense(int lay, int n, int c, int h, int w, int out)
{
    const k_backend *cpu = k_backend_cpu(), *ref = k_backend_ref();
    k_dense d = {.n = n, .in = c * h * w, .out = out, .x_c = c, .x_blocked = lay}, dr = d;
    dr.x_blocked = 0;
    size_t nx = (size_t)n * d.in, nw = (size_t)out * d.in, ny = (size_t)n * out;
    float *x = zt_k_randv(nx, -1, 1), *wt = zt_k_randv(nw, -1, 1), *b = zt_k_randv(out, -1, 1);
    float *dy = zt_k_randv(ny, -1, 1), *xb = s_maybe_blocked(lay, n, c, h, w, x);
    float *y = zt_k_zeros(ny), *yr = zt_k_zeros(ny), *dx = zt_k_zeros(nx), *dxr = zt_k_zeros(nx);
    float *dw = zt_k_randv(nw, -1, 1), *dwr = zt_k_copyv(dw, nw);
    float *db = zt_k_randv(out, -1, 1), *dbr = zt_k_copyv(db, out);
    for (int pass = 0; pass < 2; pass++) { /* the second runs on the cached primitives */
        cr_assert_eq(k_dense_fwd(cpu, &d, xb, wt, b, y), ZPS_OK);
        cr_assert_eq(k_dense_bwd(cpu, &d, xb, wt, dy, dx, dw, db), ZPS_OK);
        k_dense_fwd(ref, &dr, x, wt, b, yr);
        k_dense_bwd(ref, &dr, x, wt, dy, dxr, dwr, dbr);
    }
    float *dxp = s_maybe_plain(lay, n, c, h, w, dx);
    zt_k_close(s_be->name, "blocked dense y", y, yr, ny, 1e-4 * sqrt((double)d.in), 1e-3);
    zt_k_close(s_be->name, "blocked dense dx", dxp, dxr, nx, 1e-4 * sqrt((double)out), 1e-3);
    zt_k_close(s_be->name, "blocked dense dw", dw, dwr, nw, 1e-4 * sqrt((double)n), 1e-3);
    zt_k_close(s_be->name, "blocked dense db", db, dbr, (size_t)out, 1e-4 * sqrt((double)n), 1e-3);
    k_op_release(cpu, &d.impl);
    free(x), free(wt), free(b), free(dy), free(xb), free(y), free(yr), free(dx), free(dxr);
    free(dw), free(dwr), free(db), free(dbr), free(dxp);
}

/* The layout the cpu back-end asks for follows the CPU: 16 channels side by side only with
 * AVX-512. An AVX2-only CPU gets 8 wherever 8 divides the channels, since oneDNN 2.6 has no
 * AVX2 batchnorm or pooling for nChw16c and ran its reference loops there (the convnet's step
 * 12x slower, Inception-v3 w0.25's 4x, on an AMD EPYC without AVX-512). ZPS_CPU_NO_AVX512
 * takes the AVX2 choice on any CPU. */
Test(k_cpu, the_blocked_layout_follows_the_cpus_vectors)
{
    const k_backend *cpu = k_backend_cpu();
#if defined(__x86_64__)
    int avx512 = __builtin_cpu_supports("avx512f");
#else
    int avx512 = 0;
#endif
    for (int c = 8; c <= 256; c += 8)
        cr_assert_eq(cpu->prefers_blocked(c), c % 16 == 0 && avx512 ? K_BLOCK16 : K_BLOCK8,
                     "%d channels, avx512f %d", c, avx512);
    cr_assert(!cpu->prefers_blocked(12) && !cpu->prefers_blocked(0));
    setenv("ZPS_CPU_NO_AVX512", "1", 1);
    for (int c = 8; c <= 256; c += 8)
        cr_assert_eq(cpu->prefers_blocked(c), K_BLOCK8, "%d channels without AVX-512", c);
    setenv("ZPS_CPU_NO_AVX512", "0", 1);
    cr_assert_eq(cpu->prefers_blocked(32), avx512 ? K_BLOCK16 : K_BLOCK8);
    unsetenv("ZPS_CPU_NO_AVX512");
}

/* The blocked layouts of the cpu back-end (nChw16c, nChw8c, and every pair of them and NCHW
 * around a convolution, and wide 8-block pairs, which it runs in 16-blocks) give ref's
 * results after conversion; the dispatcher refuses blocked
 * tensors where the back-end has no such layout. */
Test(k_cpu, blocked_layouts_match_ref, .init = s_init_cpu, .timeout = 60)
{
    const k_backend *cpu = k_backend_cpu(), *ref = k_backend_ref();
    cr_assert(cpu->prefers_blocked);
    cr_assert(cpu->prefers_blocked(24) == K_BLOCK8 && !cpu->prefers_blocked(12));
    for (int iter = 0; iter < 11; iter++) {
        k_conv2d d;
        int xl = (iter + 1) % 3, yl = (iter + 1) / 3 % 3; /* every pair but NCHW -> NCHW */
        if (iter < 8) {
            s_random_blocked_conv(&d, xl, yl);
        } else { /* wide 8-blocks: the cpu back-end runs them in 16-blocks (conv.c) */
            static const int ck[3][2] = {{40, 40}, {72, 40}, {40, 72}};
            xl = yl = K_BLOCK8;
            cr_assert_eq(k_conv2d_init(&d, 2, ck[iter - 8][0], 5, 7, ck[iter - 8][1], 1 + iter % 3,
                                       3, 1, 1 + iter % 2, iter % 2, 1), ZPS_OK);
            d.x_blocked = xl, d.y_blocked = yl;
        }
        float *yr = s_blocked_conv_vs_ref(&d, 4e-4, "blocked conv");
        if (yl) {
            s_blocked_bn_pool(yl, d.n, d.k, d.oh, d.ow, yr);
            s_blocked_dense(yl, d.n, d.k, d.oh, d.ow, zt_irand(1, 40));
        }
        free(yr);
    }
    /* ref has no blocked layout and says so */
    k_conv2d d;
    k_conv2d_init(&d, 1, 16, 4, 4, 16, 1, 1, 1, 1, 0, 0);
    d.x_blocked = 1;
    float buf[512] = {0};
    zps_log_set_level(ZPS_LOG_OFF);
    cr_assert_eq(k_conv2d_fwd(ref, &d, buf, buf, NULL, buf), ZPS_ERR_UNSUPPORTED);
    /* nor has cpu 16-channel blocks for a channel count that is not a multiple of 16 */
    k_conv2d_init(&d, 1, 16, 4, 4, 24, 1, 1, 1, 1, 0, 0);
    d.y_blocked = K_BLOCK16;
    cr_assert_eq(k_conv2d_fwd(cpu, &d, buf, buf, NULL, buf), ZPS_ERR_UNSUPPORTED);
    k_bn b = {.n = 1, .c = 24, .h = 2, .w = 2, .eps = 1e-3f, .blocked = 1};
    cr_assert_eq(k_bn_fwd_infer(cpu, &b, buf, buf, buf, buf, buf, buf), ZPS_ERR_UNSUPPORTED);
    k_dense e = {.n = 1, .in = 64, .out = 2, .x_c = 16, .x_blocked = 1};
    cr_assert_eq(k_dense_fwd(ref, &e, buf, buf, NULL, buf), ZPS_ERR_UNSUPPORTED);
    cr_assert_null(e.impl);
    cr_assert_null(d.impl);
    cr_assert_null(b.impl);
}
