/* test_k_bn_pool.c — the fused batchnorm + ReLU + max pool (kernels.h, k_bn_pool_fwd): the
 * cpu back-end's fusion against ref's three ops run one by one, forward and backward, on fresh
 * random shapes (maps full of ties among them), its backward against finite differences, and
 * the dispatcher's refusals where a back-end does not fuse the pair.
 *
 * Inputs are fresh random numbers each run; the seed is printed in every failure message
 * (rerun with ZPS_TEST_SEED=<seed> to reproduce).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/kernels.h"
#include "tests/test_k.h"
#include "tests/testutil.h"

static uint64_t s_seed;

static void s_init(void) { s_seed = zt_k_init(); }

/* One case's tensors, host NCHW, and the two pairs of descriptors (cpu: 16-blocks). */
typedef struct s_case {
    k_bn bn, bnr;
    k_pool pool, poolr;
    size_t nx, ny;
    int c;
    float *x, *gamma, *beta, *dy;
} s_case;

/* ties: x from a handful of values, so most windows hold equal maxima (and equal zeros after
 * the ReLU); otherwise uniform with a per-channel offset and scale. */
static void s_case_new(s_case *t, int n, int c, int h, int w, int ties)
{
    memset(t, 0, sizeof *t);
    t->bn = (k_bn){.n = n, .c = c, .h = h, .w = w, .eps = 1e-3f, .momentum = 0.1f, .relu = 1};
    t->bnr = t->bn;
    t->bn.blocked = K_BLOCK16;
    cr_assert_eq(k_pool_init(&t->poolr, K_POOL_MAX, n, c, h, w, 2, 2, 2, 2, 0, 0), ZPS_OK);
    t->pool = t->poolr;
    t->pool.blocked = K_BLOCK16;
    t->c = c;
    t->nx = (size_t)n * c * h * w, t->ny = (size_t)n * c * t->pool.oh * t->pool.ow;
    t->x = zt_k_randv(t->nx, -1, 1);
    for (size_t i = 0; i < t->nx; i++) {
        int ch = (int)(i / ((size_t)h * w) % (size_t)c);
        t->x[i] = ties ? floorf(t->x[i] * 3.0f) : t->x[i] * (0.5f + ch % 5) + 0.3f * (ch % 7);
    }
    t->gamma = zt_k_randv((size_t)c, -1.5f, 1.5f); /* negative scales flip the maxima */
    t->beta = zt_k_randv((size_t)c, -0.5f, 0.5f);
    t->dy = zt_k_randv(t->ny, -1, 1);
}

static void s_case_free(s_case *t)
{
    k_op_release(k_backend_cpu(), &t->bn.impl);
    k_op_release(k_backend_cpu(), &t->pool.impl);
    free(t->x), free(t->gamma), free(t->beta), free(t->dy);
}

static float *s_blocked(const s_case *t, const float *v, int h, int w)
{
    float *b = zt_k_zeros((size_t)t->bn.n * t->c * h * w);
    k_to_blocked(t->bn.n, t->c, h, w, v, b);
    return b;
}

static float *s_plain(const s_case *t, const float *v, int h, int w)
{
    float *p = zt_k_zeros((size_t)t->bn.n * t->c * h * w);
    k_from_blocked(t->bn.n, t->c, h, w, v, p);
    return p;
}

/* The fused op on cpu against ref's batchnorm, then pool, and their backwards in reverse. */
static void s_against_ref(int n, int c, int h, int w, int ties)
{
    const k_backend *cpu = k_backend_cpu(), *ref = k_backend_ref();
    s_case t;
    s_case_new(&t, n, c, h, w, ties);
    cr_assert(k_bn_pool_fuses(cpu, &t.bn, &t.pool), "cpu does not fuse %dx%dx%dx%d", n, c, h, w);
    int oh = t.pool.oh, ow = t.pool.ow;
    /* ref: the three ops, the unpooled map and its gradient in between */
    float *yf = zt_k_zeros(t.nx), *yr = zt_k_zeros(t.ny), *dyf = zt_k_zeros(t.nx);
    float *mr = zt_k_zeros((size_t)c), *vr = zt_k_zeros((size_t)c), *dxr = zt_k_zeros(t.nx);
    float *rmr = zt_k_randv((size_t)c, -1, 1), *rvr = zt_k_randv((size_t)c, 0.5f, 2);
    float *dg0 = zt_k_randv((size_t)c, -1, 1), *db0 = zt_k_randv((size_t)c, -1, 1);
    float *rm = zt_k_copyv(rmr, (size_t)c), *rv = zt_k_copyv(rvr, (size_t)c);
    float *dgr = zt_k_copyv(dg0, (size_t)c), *dbr = zt_k_copyv(db0, (size_t)c);
    float *dg = zt_k_zeros((size_t)c), *db = zt_k_zeros((size_t)c);
    cr_assert_eq(k_bn_fwd_train(ref, &t.bnr, t.x, t.gamma, t.beta, yf, mr, vr, rmr, rvr), ZPS_OK);
    cr_assert_eq(k_pool_fwd(ref, &t.poolr, yf, yr), ZPS_OK);
    cr_assert_eq(k_pool_bwd(ref, &t.poolr, yf, yr, t.dy, dyf), ZPS_OK);
    cr_assert_eq(k_bn_bwd(ref, &t.bnr, t.x, yf, dyf, t.gamma, mr, vr, dxr, dgr, dbr), ZPS_OK);
    /* cpu fused, twice: the second pass runs on the state the first made; the running
     * averages move once, the gradients accumulate into the same start each pass */
    float *xb = s_blocked(&t, t.x, h, w), *dyb = s_blocked(&t, t.dy, oh, ow);
    float *y = zt_k_zeros(t.ny), *dx = zt_k_randv(t.nx, -1, 1);
    float *m = zt_k_zeros((size_t)c), *v = zt_k_zeros((size_t)c);
    for (int pass = 0; pass < 2; pass++) {
        memcpy(dg, dg0, sizeof(float) * (size_t)c);
        memcpy(db, db0, sizeof(float) * (size_t)c);
        cr_assert_eq(k_bn_pool_fwd(cpu, &t.bn, &t.pool, xb, t.gamma, t.beta, y, m, v,
                                   pass ? NULL : rm, pass ? NULL : rv), ZPS_OK);
        cr_assert_eq(k_bn_pool_bwd(cpu, &t.bn, &t.pool, xb, dyb, t.gamma, m, v, dx, dg, db),
                     ZPS_OK);
    }
    float *yp = s_plain(&t, y, oh, ow), *dxp = s_plain(&t, dx, h, w);
    zt_k_close("cpu", "fused mean", m, mr, (size_t)c, 1e-6, 1e-5);
    zt_k_close("cpu", "fused var", v, vr, (size_t)c, 1e-6, 1e-5);
    zt_k_close("cpu", "fused pooled y", yp, yr, t.ny, 1e-5, 1e-5);
    zt_k_close("cpu", "fused dx", dxp, dxr, t.nx, 1e-5, 1e-4);
    zt_k_close("cpu", "fused dgamma (accumulated)", dg, dgr, (size_t)c, 1e-4, 1e-4);
    zt_k_close("cpu", "fused dbeta (accumulated)", db, dbr, (size_t)c, 1e-4, 1e-4);
    zt_k_close("cpu", "fused running mean", rm, rmr, (size_t)c, 1e-6, 1e-5);
    zt_k_close("cpu", "fused running var", rv, rvr, (size_t)c, 1e-6, 1e-5);
    s_case_free(&t);
    free(yf), free(yr), free(dyf), free(mr), free(vr), free(dxr), free(rmr), free(rvr);
    free(dg0), free(db0), free(dgr), free(dbr), free(rm), free(rv), free(dg), free(db);
    free(xb), free(dyb), free(y), free(dx), free(m), free(v), free(yp), free(dxp);
}

Test(k_cpu, fused_bn_pool_equals_ref_ops, .init = s_init, .timeout = 60)
{
    s_case t;
    s_case_new(&t, 1, 16, 2, 2, 0);
    int fuses = k_bn_pool_fuses(k_backend_cpu(), &t.bn, &t.pool);
    s_case_free(&t);
    if (!fuses)
        cr_skip_test("this CPU has no AVX-512: the cpu back-end does not fuse (nothing to test)");
    s_against_ref(4, 32, 28, 28, 0); /* the convnet's first block, at batch 4 */
    s_against_ref(3, 32, 28, 28, 1);
    for (int i = 0; i < 6; i++)
        s_against_ref(zt_irand(1, 4), 16 * zt_irand(1, 4), 2 * zt_irand(1, 9), 2 * zt_irand(1, 9),
                      i % 2);
}

/* Whether moving one entry (which: 0 x, 1 gamma, 2 beta; i its index, x plain NCHW) by up to
 * h can move a ReLU input of its channel across 0, or change which element holds a window's
 * positive maximum: central differences across such a kink measure neither side's slope. The
 * bound on how far each pre-ReLU z_j = gamma (x_j - mean) / sd + beta moves is first order
 * and doubled: h |xhat_j| for gamma, h for beta, and for x_i, |gamma| h / sd times 1 at j = i
 * plus (1 + |xhat_i xhat_j|) / count through the batch mean and variance. */
static int s_kink(const s_case *t, const float *x, const float *m, const float *v, int which,
                  int i, double h)
{
    int hw = t->bn.h * t->bn.w, cnt = t->bn.n * hw;
    int ch = which ? i : i / hw % t->c;
    double sd = sqrt((double)v[ch] + t->bn.eps), g = t->gamma[ch];
    double xi = which ? 0 : ((double)x[i] - m[ch]) / sd;
    double *z = malloc(sizeof(double) * (size_t)cnt), *mv = malloc(sizeof(double) * (size_t)cnt);
    cr_assert(z && mv);
    int kink = 0;
    for (int j = 0; j < cnt; j++) {
        int at = (j / hw * t->c + ch) * hw + j % hw;
        double xh = ((double)x[at] - m[ch]) / sd;
        z[j] = g * xh + t->beta[ch];
        mv[j] = 2 * h * (which == 1 ? fabs(xh) : which == 2 ? 1.0
                         : fabs(g) / sd * ((at == i) + (1 + fabs(xi * xh)) / cnt));
        kink |= fabs(z[j]) <= mv[j];
    }
    /* the 2x2 windows, stride 2: two elements that may both be the positive maximum */
    for (int a = 0; a < cnt && !kink; a++)
        for (int b = a + 1; b < cnt && !kink; b++) {
            int ra = a % hw / t->bn.w, ca = a % t->bn.w, rb = b % hw / t->bn.w, cb = b % t->bn.w;
            if (a / hw != b / hw || ra / 2 != rb / 2 || ca / 2 != cb / 2)
                continue;
            kink = fmax(z[a], z[b]) > -fmax(mv[a], mv[b]) && fabs(z[a] - z[b]) <= mv[a] + mv[b];
        }
    free(z), free(mv);
    return kink;
}

/* L = sum of y (pooled) times fixed weights, in double, for the finite differences. */
static double s_loss(s_case *t, const float *xb, const float *wts, float *y, float *m, float *v)
{
    cr_assert_eq(k_bn_pool_fwd(k_backend_cpu(), &t->bn, &t->pool, xb, t->gamma, t->beta, y, m, v,
                               NULL, NULL), ZPS_OK);
    double l = 0;
    for (size_t i = 0; i < t->ny; i++)
        l += (double)wts[i] * y[i];
    return l;
}

/* The fused backward against central differences of the fused forward, h = 1e-3: 24 entries
 * each of x, gamma and beta, drawn where no kink lies within h (s_kink); an entry that stays
 * near a kink after 64 draws is looked at again at h/10 and h/100. None may miss. */
Test(k_cpu, fused_bn_pool_backward_matches_finite_differences, .init = s_init, .timeout = 60)
{
    const k_backend *cpu = k_backend_cpu();
    s_case t;
    s_case_new(&t, 2, 16, 6, 4, 0);
    if (!k_bn_pool_fuses(cpu, &t.bn, &t.pool))
        cr_skip_test("this CPU has no AVX-512: the cpu back-end does not fuse (nothing to test)");
    float *xb = s_blocked(&t, t.x, 6, 4), *y = zt_k_zeros(t.ny), *dx = zt_k_zeros(t.nx);
    float *m = zt_k_zeros(16), *v = zt_k_zeros(16), *dg = zt_k_zeros(16), *db = zt_k_zeros(16);
    float *wts = zt_k_randv(t.ny, -1, 1);
    s_loss(&t, xb, wts, y, m, v);
    cr_assert_eq(k_bn_pool_bwd(cpu, &t.bn, &t.pool, xb, wts, t.gamma, m, v, dx, dg, db), ZPS_OK);
    float *xp = s_plain(&t, xb, 6, 4), *m0 = zt_k_copyv(m, 16), *v0 = zt_k_copyv(v, 16);
    int bad = 0, near = 0;
    char last[200] = "";
    for (int k = 0; k < 72; k++) {
        int which = k % 3, i = 0, kink = 1;
        for (int draw = 0; draw < 64 && kink; draw++) {
            i = which ? zt_irand(0, 15) : zt_irand(0, (int)t.nx - 1);
            int ip = i; /* x: the blocked index's plain twin, for s_kink */
            if (!which) {
                int hw = 24, blk = i / (16 * hw), r = i % (16 * hw);
                ip = (blk * 16 + r % 16) * hw + r / 16;
            }
            kink = s_kink(&t, xp, m0, v0, which, ip, 1e-3);
        }
        near += kink;
        float *p = which == 0 ? &xb[i] : which == 1 ? &t.gamma[i] : &t.beta[i];
        float keep = *p, got = which == 0 ? dx[i] : which == 1 ? dg[i] : db[i];
        double num = 0;
        int ok = 0;
        for (float h = 1e-3f; h > (kink ? 1e-6f : 1e-4f) && !ok; h /= 10) {
            *p = keep + h;
            double lp = s_loss(&t, xb, wts, y, m, v);
            *p = keep - h;
            double lm = s_loss(&t, xb, wts, y, m, v);
            *p = keep;
            num = (lp - lm) / (2.0 * h);
            ok = fabs(num - got) <= 2e-3 + 2e-2 * fabs(num);
        }
        if (!ok) {
            bad++;
            snprintf(last, sizeof last, "%s[%d]%s: analytic %.6g numeric %.6g",
                     which == 0 ? "x" : which == 1 ? "gamma" : "beta", i,
                     kink ? " (near a kink)" : "", got, num);
        }
    }
    cr_assert(bad == 0, "%d of 72 gradients off (%d near a kink), last %s (seed %llu)", bad, near,
              last, (unsigned long long)s_seed);
    s_case_free(&t);
    free(xb), free(y), free(dx), free(m), free(v), free(dg), free(db), free(wts);
    free(xp), free(m0), free(v0);
}

/* Where a back-end does not fuse the pair, k_bn_pool_fuses says so and the ops refuse. */
Test(k_cpu, fused_bn_pool_refused_where_not_fused, .init = s_init, .timeout = 30)
{
    const k_backend *cpu = k_backend_cpu(), *ref = k_backend_ref();
    s_case t;
    s_case_new(&t, 1, 16, 4, 4, 0);
    float buf[1024] = {0};
    zps_log_set_level(ZPS_LOG_OFF);
    cr_assert_not(k_bn_pool_fuses(ref, &t.bnr, &t.poolr), "ref has no fusion");
    cr_assert_eq(k_bn_pool_fwd(ref, &t.bnr, &t.poolr, buf, buf, buf, buf, buf, buf, NULL, NULL),
                 ZPS_ERR_UNSUPPORTED);
    cr_assert_eq(k_bn_pool_bwd(ref, &t.bnr, &t.poolr, buf, buf, buf, buf, buf, buf, buf, buf),
                 ZPS_ERR_UNSUPPORTED);
    k_bn nchw = t.bnr;
    cr_assert_not(k_bn_pool_fuses(cpu, &nchw, &t.poolr), "cpu fuses 16-blocks only");
    k_bn norelu = t.bn;
    norelu.relu = 0;
    cr_assert_not(k_bn_pool_fuses(cpu, &norelu, &t.pool), "the fusion is batchnorm + ReLU");
    k_pool odd;
    cr_assert_eq(k_pool_init(&odd, K_POOL_MAX, 1, 16, 4, 4, 3, 3, 2, 2, 0, 0), ZPS_OK);
    odd.blocked = K_BLOCK16;
    cr_assert_not(k_bn_pool_fuses(cpu, &t.bn, &odd), "3x3 windows are not fused");
    k_pool avg = t.pool;
    avg.kind = K_POOL_AVG;
    cr_assert_not(k_bn_pool_fuses(cpu, &t.bn, &avg), "average pooling is not fused");
    cr_assert_eq(k_bn_pool_fwd(cpu, &t.bn, &avg, buf, buf, buf, buf, buf, buf, NULL, NULL),
                 ZPS_ERR_UNSUPPORTED);
    s_case_free(&t);
}
