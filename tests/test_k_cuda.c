/* test_k_cuda.c — the cuda back-end against ref on random shapes, when a GPU answers; every
 * test reports SKIP with the reason otherwise (no device, or zps built without CUDA).
 * Tolerances as the cpu back-end's (docs/kernels.md); seed printed on failure. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/kernels.h"
#include "tests/testutil.h"

static uint64_t s_seed, s_state;
static const k_backend *s_gpu;

static void s_init(void)
{
    const char *e = getenv("ZPS_TEST_SEED");
    s_seed = e ? strtoull(e, NULL, 0)
               : ((uint64_t)time(NULL) * 2654435761u) ^ ((uint64_t)getpid() << 16);
    s_state = s_seed | 1;
    zps_log_set_level(ZPS_LOG_WARN);
    char why[256] = "";
    s_gpu = k_backend_cuda(why, sizeof why);
    if (!s_gpu)
        ZPS_GPU_SKIP("no CUDA device: %s", why);
}

static uint32_t s_rand(void)
{
    s_state ^= s_state << 13;
    s_state ^= s_state >> 7;
    s_state ^= s_state << 17;
    return (uint32_t)(s_state >> 16);
}
static int s_irand(int lo, int hi) { return lo + (int)(s_rand() % (uint32_t)(hi - lo + 1)); }
static float *s_randv(size_t n)
{
    float *v = malloc(n * sizeof *v + 4);
    for (size_t i = 0; i < n; i++)
        v[i] = (float)(s_rand() % 2000001) / 1e6f - 1.0f;
    return v;
}
/* Device copy of host data. */
static float *s_up(const float *h, size_t n)
{
    float *d = s_gpu->alloc(n * sizeof(float) + 4);
    cr_assert_not_null(d);
    cr_assert_eq(s_gpu->copy_in(d, h, n * sizeof(float)), ZPS_OK);
    return d;
}
static void s_check(const char *what, const float *dev, const float *ref, size_t n, double atol)
{
    float *h = malloc(n * sizeof *h + 4);
    cr_assert_eq(s_gpu->copy_out(h, dev, n * sizeof *h), ZPS_OK);
    for (size_t i = 0; i < n; i++)
        cr_assert(fabs((double)h[i] - ref[i]) <= atol + 1e-3 * fabs(ref[i]),
                  "%s[%zu]: cuda %.7g ref %.7g (seed %llu)", what, i, h[i], ref[i],
                  (unsigned long long)s_seed);
    free(h);
}

Test(k_cuda, conv2d_matches_ref, .init = s_init, .timeout = 60)
{
    for (int it = 0; it < 6; it++) {
        k_conv2d d;
        while (k_conv2d_init(&d, s_irand(1, 3), s_irand(1, 16), s_irand(3, 15), s_irand(3, 15),
                             s_irand(1, 16), s_irand(1, 5), s_irand(1, 5), s_irand(1, 2),
                             s_irand(1, 2), s_irand(0, 2), s_irand(0, 2)) != ZPS_OK)
            ;
        k_conv2d dr = d;
        size_t nx = (size_t)d.n * d.c * d.h * d.w, nw = (size_t)d.k * d.c * d.r * d.s;
        size_t ny = (size_t)d.n * d.k * d.oh * d.ow;
        float *x = s_randv(nx), *w = s_randv(nw), *b = s_randv((size_t)d.k), *dy = s_randv(ny);
        float *y = calloc(ny, 4), *dx = calloc(nx, 4), *dw = calloc(nw, 4), *db = calloc((size_t)d.k, 4);
        float *gx = s_up(x, nx), *gw = s_up(w, nw), *gb = s_up(b, (size_t)d.k), *gdy = s_up(dy, ny);
        float *gy = s_up(y, ny), *gdx = s_up(dx, nx), *gdw = s_up(dw, nw), *gdb = s_up(db, (size_t)d.k);
        cr_assert_eq(k_conv2d_fwd(s_gpu, &d, gx, gw, gb, gy), ZPS_OK);
        cr_assert_eq(k_conv2d_bwd(s_gpu, &d, gx, gw, gdy, gdx, gdw, gdb), ZPS_OK);
        k_conv2d_fwd(k_backend_ref(), &dr, x, w, b, y);
        k_conv2d_bwd(k_backend_ref(), &dr, x, w, dy, dx, dw, db);
        double at = 4e-4 * sqrt((double)d.c * d.r * d.s + d.n * d.oh * d.ow + d.k * d.r * d.s);
        s_check("conv y", gy, y, ny, at);
        s_check("conv dx", gdx, dx, nx, at);
        s_check("conv dw", gdw, dw, nw, at);
        s_check("conv db", gdb, db, (size_t)d.k, at);
        k_op_release(s_gpu, &d.impl);
        float *all[] = {gx, gw, gb, gdy, gy, gdx, gdw, gdb};
        for (int i = 0; i < 8; i++)
            s_gpu->free(all[i]);
        free(x), free(w), free(b), free(dy), free(y), free(dx), free(dw), free(db);
    }
}

Test(k_cuda, batchnorm_pool_dense_match_ref, .init = s_init, .timeout = 60)
{
    k_bn d = {.n = s_irand(1, 4), .c = s_irand(1, 20), .h = s_irand(1, 9), .w = s_irand(2, 9),
              .eps = 1e-3f, .momentum = 0.1f, .relu = 1};
    k_bn dr = d;
    size_t n = (size_t)d.n * d.c * d.h * d.w, c = (size_t)d.c;
    float *x = s_randv(n), *g = s_randv(c), *b = s_randv(c), *dy = s_randv(n);
    float *y = calloc(n, 4), *m = calloc(c, 4), *v = calloc(c, 4), *dx = calloc(n, 4);
    float *dg = calloc(c, 4), *dbt = calloc(c, 4), *rm = calloc(c, 4), *rv = calloc(c, 4);
    float *gx = s_up(x, n), *gg = s_up(g, c), *gbt = s_up(b, c), *gdy = s_up(dy, n);
    float *gy = s_up(y, n), *gm = s_up(m, c), *gv = s_up(v, c), *gdx = s_up(dx, n);
    float *gdg = s_up(dg, c), *gdb = s_up(dbt, c), *grm = s_up(rm, c), *grv = s_up(rv, c);
    cr_assert_eq(k_bn_fwd_train(s_gpu, &d, gx, gg, gbt, gy, gm, gv, grm, grv), ZPS_OK);
    cr_assert_eq(k_bn_bwd(s_gpu, &d, gx, gy, gdy, gg, gm, gv, gdx, gdg, gdb), ZPS_OK);
    k_bn_fwd_train(k_backend_ref(), &dr, x, g, b, y, m, v, rm, rv);
    k_bn_bwd(k_backend_ref(), &dr, x, y, dy, g, m, v, dx, dg, dbt);
    s_check("bn y", gy, y, n, 1e-3);
    s_check("bn running var", grv, rv, c, 1e-4);
    s_check("bn dx", gdx, dx, n, 1e-3);
    s_check("bn dgamma", gdg, dg, c, 1e-3);
    k_op_release(s_gpu, &d.impl);

    k_pool p;
    while (k_pool_init(&p, s_rand() % 2 ? K_POOL_MAX : K_POOL_AVG, 2, 3, s_irand(3, 12),
                       s_irand(3, 12), 3, 3, s_irand(1, 2), s_irand(1, 2), 1, 1) != ZPS_OK)
        ;
    size_t px = (size_t)p.n * p.c * p.h * p.w, py = (size_t)p.n * p.c * p.oh * p.ow;
    float *pxh = s_randv(px), *pyh = calloc(py, 4), *pdy = s_randv(py), *pdx = calloc(px, 4);
    float *gpx = s_up(pxh, px), *gpy = s_up(pyh, py), *gpdy = s_up(pdy, py), *gpdx = s_up(pdx, px);
    cr_assert_eq(k_pool_fwd(s_gpu, &p, gpx, gpy), ZPS_OK);
    cr_assert_eq(k_pool_bwd(s_gpu, &p, gpx, gpy, gpdy, gpdx), ZPS_OK);
    k_pool_fwd(k_backend_ref(), &p, pxh, pyh);
    k_pool_bwd(k_backend_ref(), &p, pxh, pyh, pdy, pdx);
    s_check("pool y", gpy, pyh, py, 1e-5);
    s_check("pool dx", gpdx, pdx, px, 1e-5);

    k_dense dd = {.n = s_irand(1, 8), .in = s_irand(1, 60), .out = s_irand(1, 30)};
    size_t nx = (size_t)dd.n * dd.in, nw = (size_t)dd.out * dd.in, ny = (size_t)dd.n * dd.out;
    float *ix = s_randv(nx), *iw = s_randv(nw), *ib = s_randv((size_t)dd.out), *idy = s_randv(ny);
    float *iy = calloc(ny, 4), *idx = calloc(nx, 4), *idw = calloc(nw, 4), *idb = calloc((size_t)dd.out, 4);
    float *g1 = s_up(ix, nx), *g2 = s_up(iw, nw), *g3 = s_up(ib, (size_t)dd.out), *g4 = s_up(idy, ny);
    float *g5 = s_up(iy, ny), *g6 = s_up(idx, nx), *g7 = s_up(idw, nw), *g8 = s_up(idb, (size_t)dd.out);
    cr_assert_eq(k_dense_fwd(s_gpu, &dd, g1, g2, g3, g5), ZPS_OK);
    cr_assert_eq(k_dense_bwd(s_gpu, &dd, g1, g2, g4, g6, g7, g8), ZPS_OK);
    k_dense_fwd(k_backend_ref(), &dd, ix, iw, ib, iy);
    k_dense_bwd(k_backend_ref(), &dd, ix, iw, idy, idx, idw, idb);
    s_check("dense y", g5, iy, ny, 1e-4);
    s_check("dense dx", g6, idx, nx, 1e-4);
    s_check("dense dw", g7, idw, nw, 1e-4);
    s_check("dense db", g8, idb, (size_t)dd.out, 1e-4);
}

Test(k_cuda, elementwise_losses_dropout_match_ref, .init = s_init, .timeout = 60)
{
    size_t n = (size_t)s_irand(1, 5000);
    float *a = s_randv(n), *b = s_randv(n), *y = calloc(n, 4);
    float *ga = s_up(a, n), *gb = s_up(b, n), *gy = s_up(y, n);
    cr_assert_eq(k_axpy(s_gpu, n, 0.5f, ga, gb), ZPS_OK);
    k_axpy(k_backend_ref(), n, 0.5f, a, b);
    s_check("axpy", gb, b, n, 1e-6);
    cr_assert_eq(k_dropout_fwd(s_gpu, n, 0.3f, 77, ga, gy), ZPS_OK);
    k_dropout_fwd(k_backend_ref(), n, 0.3f, 77, a, y);
    s_check("dropout", gy, y, n, 1e-6);
    double s1, s2;
    cr_assert_eq(k_sumsq(s_gpu, n, ga, &s1), ZPS_OK);
    k_sumsq(k_backend_ref(), n, a, &s2);
    cr_assert(fabs(s1 - s2) <= 1e-6 * s2 + 1e-9);
    int rows = s_irand(1, 9), k = s_irand(2, 20);
    float *z = s_randv((size_t)rows * k), *dz = calloc((size_t)rows * k, 4);
    int32_t lab[9];
    for (int i = 0; i < rows; i++)
        lab[i] = (int32_t)(s_rand() % (uint32_t)k);
    int32_t *glab = s_gpu->alloc(sizeof lab);
    s_gpu->copy_in(glab, lab, sizeof lab);
    float *gz = s_up(z, (size_t)rows * k), *gdz = s_up(dz, (size_t)rows * k), l1, l2;
    int c1, c2;
    cr_assert_eq(k_softmax_xent(s_gpu, rows, k, gz, glab, 0.1f, 1.0f, &l1, &c1, gdz), ZPS_OK);
    k_softmax_xent(k_backend_ref(), rows, k, z, lab, 0.1f, 1.0f, &l2, &c2, dz);
    cr_assert(fabs(l1 - l2) <= 1e-5 * fabs(l2) + 1e-6 && c1 == c2, "xent %g vs %g", l1, l2);
    s_check("xent dlogits", gdz, dz, (size_t)rows * k, 1e-6);
}
