/* test_k_ref.c — the ref back-end, the oracle of tests/test_k_backends.c: every ref backward
 * against finite differences, and the formulas of the ops that have no backward.
 *
 * Inputs are fresh random numbers each run; the seed is printed in every failure message
 * (rerun with ZPS_TEST_SEED=<seed> to reproduce). Tolerances, |a - b| <= atol + rtol * |ref|:
 *   finite differences (float forward, central difference h = 1e-2 in double): 2e-2 + 2e-2
 *   fused batchnorm+ReLU backward against plain batchnorm backward of masked dy: 1e-6 + 1e-5
 * The cpu back-end's NCHW batchnorm (its own loops, not oneDNN's) gets the same checks.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tests/test_k.h"
#include "tests/testutil.h"
#include "common/log.h"
#include "kernels/kernels.h"

/* LeakSanitizer asks for these at start-up. Criterion 2.4's runner process loses a 48-byte
 * stats record (allocated inside libcriterion) when some tests run concurrently with -j2 (its
 * runner-side test_stats leak, Snaipe/Criterion#113). The suppression names the runner's entry
 * point, which only the runner's stacks contain (test bodies run in separate processes whose
 * stacks start at boxfort's bxfi_main), so leaks in zps code and tests are still reported; the
 * full unwinder is needed to see through libcriterion's frames. Linked into the test binary. */
const char *__lsan_default_suppressions(void);
/* libdnnl keeps a small per-thread record (56 bytes) that it does not free when a thread
 * exits (seen with models trained in two threads); only allocations made inside libdnnl are
 * matched. */
const char *__lsan_default_suppressions(void)
{
    return "leak:criterion_run_all_tests\nleak:libdnnl.so\n";
}
/* print_suppressions=0: the run's closing line stays Criterion's synthesis (pass and fail
 * counts), not LeakSanitizer's table of the suppressions it used. */
const char *__lsan_default_options(void);
const char *__lsan_default_options(void)
{
    return "fast_unwind_on_malloc=0:print_suppressions=0";
}

static uint64_t s_seed;

static void s_seed_init(void) { s_seed = zt_k_init(); }

/* ---- finite differences: loss = sum(y * r) for a fixed random r ---- */

typedef double (*s_loss_fn)(void *ctx);

/* Checks analytic gradient g of buffer p (n values) at up to 24 random entries. */
static void s_fd(const char *what, s_loss_fn f, void *ctx, float *p, const float *g, size_t n)
{
    const double h = 1e-2;
    for (int t = 0; t < 24 && t < (int)n * 2; t++) {
        size_t i = n <= 24 ? (size_t)t % n : zt_rand() % n;
        float keep = p[i];
        p[i] = (float)(keep + h);
        double lp = f(ctx);
        p[i] = (float)(keep - h);
        double lm = f(ctx);
        p[i] = keep;
        double num = (lp - lm) / (2 * h);
        cr_assert(fabs(num - g[i]) <= 2e-2 + 2e-2 * fabs(num),
                  "%s grad[%zu]: analytic %.6g numeric %.6g (seed %llu)", what, i, g[i], num,
                  (unsigned long long)s_seed);
    }
}

static double s_dot(const float *y, const float *r, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += (double)y[i] * r[i];
    return s;
}

/* A layer with weights, convolution (d) or dense (fc), and the buffers of its loss. */
typedef struct s_layer_case {
    k_conv2d d;
    k_dense fc;
    float *x, *w, *b, *y, *r;
} s_layer_case;

static double s_conv_loss(void *ctx)
{
    s_layer_case *c = ctx;
    cr_assert_eq(k_conv2d_fwd(k_backend_ref(), &c->d, c->x, c->w, c->b, c->y), ZPS_OK);
    return s_dot(c->y, c->r, (size_t)c->d.n * c->d.k * c->d.oh * c->d.ow);
}

Test(k_ref, conv2d_backward_matches_finite_differences, .init = s_seed_init)
{
    for (int iter = 0; iter < 6; iter++) {
        s_layer_case c;
        zt_k_random_conv(&c.d, 0);
        size_t nx = (size_t)c.d.n * c.d.c * c.d.h * c.d.w, nw = (size_t)c.d.k * c.d.c * c.d.r * c.d.s;
        size_t ny = (size_t)c.d.n * c.d.k * c.d.oh * c.d.ow;
        c.x = zt_k_randv(nx, -1, 1), c.w = zt_k_randv(nw, -1, 1), c.b = zt_k_randv((size_t)c.d.k, -1, 1);
        c.y = zt_k_zeros(ny), c.r = zt_k_randv(ny, -1, 1);
        float *dx = zt_k_zeros(nx), *dw = zt_k_randv(nw, -1, 1), *db = zt_k_randv((size_t)c.d.k, -1, 1);
        float *dw0 = zt_k_copyv(dw, nw), *db0 = zt_k_copyv(db, (size_t)c.d.k);
        cr_assert_eq(k_conv2d_bwd(k_backend_ref(), &c.d, c.x, c.w, c.r, dx, dw, db), ZPS_OK);
        for (size_t i = 0; i < nw; i++) /* accumulate: take the old contents back out */
            dw[i] -= dw0[i];
        for (int i = 0; i < c.d.k; i++)
            db[i] -= db0[i];
        s_fd("conv dx", s_conv_loss, &c, c.x, dx, nx);
        s_fd("conv dw", s_conv_loss, &c, c.w, dw, nw);
        s_fd("conv db", s_conv_loss, &c, c.b, db, (size_t)c.d.k);
        free(c.x), free(c.w), free(c.b), free(c.y), free(c.r), free(dx), free(dw), free(db);
        free(dw0), free(db0);
    }
}

typedef struct s_bn_case {
    const k_backend *be;
    k_bn d;
    float *x, *g, *b, *y, *r, *mean, *var;
} s_bn_case;

static double s_bn_loss(void *ctx)
{
    s_bn_case *c = ctx;
    cr_assert_eq(k_bn_fwd_train(c->be, &c->d, c->x, c->g, c->b, c->y, c->mean, c->var, NULL,
                                NULL),
                 ZPS_OK);
    return s_dot(c->y, c->r, (size_t)c->d.n * c->d.c * c->d.h * c->d.w);
}

/* Batchnorm (+ReLU) backward of back-end be, on NCHW, against finite differences of its own
 * forward; planes of up to hw_max values per side. */
/* Redraws each channel of x (NCHW, d's shape) until its biased variance is >= 50 * d->eps. */
static void s_bn_spread(const k_bn *d, float *x)
{
    size_t hw = (size_t)d->h * d->w;
    for (int ch = 0; ch < d->c; ch++)
        for (;;) {
            double s = 0, ss = 0, cnt = (double)d->n * hw;
            for (int i = 0; i < d->n; i++)
                for (size_t j = 0; j < hw; j++) {
                    double v = x[((size_t)i * d->c + ch) * hw + j];
                    s += v, ss += v * v;
                }
            if (ss / cnt - (s / cnt) * (s / cnt) >= 50.0 * d->eps)
                break;
            for (int i = 0; i < d->n; i++)
                for (size_t j = 0; j < hw; j++)
                    x[((size_t)i * d->c + ch) * hw + j] = zt_unif(-2, 2);
        }
}

static void s_bn_fd(const k_backend *be, int hw_max)
{
    const char *name = be->name;
    for (int iter = 0; iter < 6; iter++) {
        s_bn_case c = {.be = be,
                       .d = {.n = zt_irand(1, 3), .c = zt_irand(1, 4), .h = zt_irand(1, hw_max),
                             .w = zt_irand(2, hw_max), .eps = 1e-3f, .momentum = 0.1f,
                             .relu = iter % 2}};
        size_t n = (size_t)c.d.n * c.d.c * c.d.h * c.d.w, nc = (size_t)c.d.c;
        c.x = zt_k_randv(n, -2, 2), c.g = zt_k_randv(nc, 0.5f, 1.5f), c.b = zt_k_randv(nc, -0.5f, 0.5f);
        /* a channel of 2 values whose variance nears eps curves too sharply for the step
         * of s_fd (about 1 seed in 70,000 over its bound, up to 1.36x): redrawn until its
         * variance is at least 50 eps */
        s_bn_spread(&c.d, c.x);
        c.y = zt_k_zeros(n), c.r = zt_k_randv(n, -1, 1), c.mean = zt_k_zeros(nc), c.var = zt_k_zeros(nc);
        float *dx = zt_k_zeros(n), *dg = zt_k_zeros(nc), *dbeta = zt_k_zeros(nc);
        s_bn_loss(&c);
        cr_assert_eq(k_bn_bwd(be, &c.d, c.x, c.y, c.r, c.g, c.mean, c.var, dx, dg, dbeta),
                     ZPS_OK);
        /* without dx: the same parameter gradients, added into what is there */
        float *dg1 = zt_k_copyv(dg, nc), *db1 = zt_k_copyv(dbeta, nc);
        cr_assert_eq(k_bn_bwd(be, &c.d, c.x, c.y, c.r, c.g, c.mean, c.var, NULL, dg1, db1),
                     ZPS_OK);
        for (size_t i = 0; i < nc; i++)
            dg1[i] -= dg[i], db1[i] -= dbeta[i];
        zt_k_close(name, "bn dgamma without dx", dg1, dg, nc, 1e-6, 1e-5);
        zt_k_close(name, "bn dbeta without dx", db1, dbeta, nc, 1e-6, 1e-5);
        if (!c.d.relu) {
            s_fd("bn dx", s_bn_loss, &c, c.x, dx, n);
            s_fd("bn dgamma", s_bn_loss, &c, c.g, dg, nc);
            s_fd("bn dbeta", s_bn_loss, &c, c.b, dbeta, nc);
        } else {
            /* finite differences are unreliable across the ReLU kink: the fused op must equal
             * plain batchnorm backward fed with dy masked by y > 0 */
            k_bn plain = c.d;
            plain.relu = 0, plain.impl = NULL;
            float *dym = zt_k_zeros(n), *dx2 = zt_k_zeros(n), *dg2 = zt_k_zeros(nc), *db2 = zt_k_zeros(nc);
            for (size_t i = 0; i < n; i++)
                dym[i] = c.y[i] > 0 ? c.r[i] : 0.0f;
            k_bn_bwd(be, &plain, c.x, NULL, dym, c.g, c.mean, c.var, dx2, dg2, db2);
            zt_k_close(name, "bn+relu dx", dx, dx2, n, 1e-6, 1e-5);
            zt_k_close(name, "bn+relu dgamma", dg, dg2, nc, 1e-6, 1e-5);
            zt_k_close(name, "bn+relu dbeta", dbeta, db2, nc, 1e-6, 1e-5);
            k_op_release(be, &plain.impl);
            free(dym), free(dx2), free(dg2), free(db2);
        }
        k_op_release(be, &c.d.impl);
        free(c.x), free(c.g), free(c.b), free(c.y), free(c.r), free(c.mean), free(c.var);
        free(dx), free(dg), free(dbeta), free(dg1), free(db1);
    }
}

Test(k_ref, batchnorm_backward_matches_finite_differences, .init = s_seed_init)
{
    s_bn_fd(k_backend_ref(), 4);
}

/* The cpu back-end's own NCHW batchnorm loops (kernels/cpu/bn_plain.c): planes long enough
 * for their vector sums and their tails. */
Test(k_cpu, plain_batchnorm_backward_matches_finite_differences, .init = s_seed_init)
{
    s_bn_fd(k_backend_cpu(), 9);
}

typedef struct s_pool_case {
    k_pool d;
    float *x, *y, *r;
} s_pool_case;

static double s_pool_loss(void *ctx)
{
    s_pool_case *c = ctx;
    cr_assert_eq(k_pool_fwd(k_backend_ref(), &c->d, c->x, c->y), ZPS_OK);
    return s_dot(c->y, c->r, (size_t)c->d.n * c->d.c * c->d.oh * c->d.ow);
}

Test(k_ref, pooling_backward_matches_finite_differences, .init = s_seed_init)
{
    for (int iter = 0; iter < 8; iter++) {
        s_pool_case c;
        zt_k_random_pool(&c.d, iter % 2 ? K_POOL_MAX : K_POOL_AVG, 0);
        size_t nx = (size_t)c.d.n * c.d.c * c.d.h * c.d.w, ny = (size_t)c.d.n * c.d.c * c.d.oh * c.d.ow;
        /* max pooling: distinct values spaced wider than 2h, so the argmax never flips */
        c.x = zt_k_zeros(nx);
        for (size_t i = 0; i < nx; i++)
            c.x[i] = 0.05f * (float)i;
        for (size_t i = nx; i > 1; i--) {
            size_t j = zt_rand() % i;
            float t = c.x[i - 1];
            c.x[i - 1] = c.x[j], c.x[j] = t;
        }
        c.y = zt_k_zeros(ny), c.r = zt_k_randv(ny, -1, 1);
        float *dx = zt_k_zeros(nx);
        s_pool_loss(&c);
        cr_assert_eq(k_pool_bwd(k_backend_ref(), &c.d, c.x, c.y, c.r, dx), ZPS_OK);
        s_fd(iter % 2 ? "maxpool dx" : "avgpool dx", s_pool_loss, &c, c.x, dx, nx);
        free(c.x), free(c.y), free(c.r), free(dx);
    }
}

static double s_dense_loss(void *ctx)
{
    s_layer_case *c = ctx;
    cr_assert_eq(k_dense_fwd(k_backend_ref(), &c->fc, c->x, c->w, c->b, c->y), ZPS_OK);
    return s_dot(c->y, c->r, (size_t)c->fc.n * c->fc.out);
}

Test(k_ref, dense_backward_matches_finite_differences, .init = s_seed_init)
{
    s_layer_case c = {.fc = {.n = zt_irand(1, 4), .in = zt_irand(1, 9), .out = zt_irand(1, 9)}};
    size_t nx = (size_t)c.fc.n * c.fc.in, nw = (size_t)c.fc.out * c.fc.in, ny = (size_t)c.fc.n * c.fc.out;
    c.x = zt_k_randv(nx, -1, 1), c.w = zt_k_randv(nw, -1, 1), c.b = zt_k_randv((size_t)c.fc.out, -1, 1);
    c.y = zt_k_zeros(ny), c.r = zt_k_randv(ny, -1, 1);
    float *dx = zt_k_zeros(nx), *dw = zt_k_zeros(nw), *db = zt_k_zeros((size_t)c.fc.out);
    cr_assert_eq(k_dense_bwd(k_backend_ref(), &c.fc, c.x, c.w, c.r, dx, dw, db), ZPS_OK);
    s_fd("dense dx", s_dense_loss, &c, c.x, dx, nx);
    s_fd("dense dw", s_dense_loss, &c, c.w, dw, nw);
    s_fd("dense db", s_dense_loss, &c, c.b, db, (size_t)c.fc.out);
    free(c.x), free(c.w), free(c.b), free(c.y), free(c.r), free(dx), free(dw), free(db);
}

typedef struct s_xent_case {
    int n, k;
    float smooth;
    float *z;
    int32_t *labels;
} s_xent_case;

static double s_xent_loss(void *ctx)
{
    s_xent_case *c = ctx;
    float loss;
    cr_assert_eq(k_softmax_xent(k_backend_ref(), c->n, c->k, c->z, c->labels, c->smooth, 1.0f,
                                &loss, NULL, NULL),
                 ZPS_OK);
    return loss;
}

Test(k_ref, losses_match_finite_differences, .init = s_seed_init)
{
    s_xent_case c = {.n = zt_irand(1, 5), .k = zt_irand(2, 12), .smooth = zt_rand() % 2 ? 0.1f : 0};
    size_t nz = (size_t)c.n * c.k;
    c.z = zt_k_randv(nz, -3, 3);
    c.labels = malloc(sizeof(int32_t) * (size_t)c.n);
    for (int i = 0; i < c.n; i++)
        c.labels[i] = (int32_t)zt_irand(0, c.k - 1);
    float loss, *dz = zt_k_zeros(nz);
    int correct = -1;
    cr_assert_eq(k_softmax_xent(k_backend_ref(), c.n, c.k, c.z, c.labels, c.smooth, 1.0f, &loss,
                                &correct, dz),
                 ZPS_OK);
    cr_assert(correct >= 0 && correct <= c.n);
    cr_assert(loss > 0);
    s_fd("xent dlogits", s_xent_loss, &c, c.z, dz, nz);
    c.labels[0] = c.k; /* out of range */
    cr_assert_eq(k_softmax_xent(k_backend_ref(), c.n, c.k, c.z, c.labels, 0, 1, &loss, NULL, NULL),
                 ZPS_ERR_INVALID);

    /* smooth-L1: the gradient is the derivative of the sum */
    size_t n = 50;
    float *x = zt_k_randv(n, -3, 3), *t = zt_k_randv(n, -3, 3), *dx = zt_k_zeros(n), l0, l1, l2;
    cr_assert_eq(k_smooth_l1(k_backend_ref(), n, x, t, 1.0f, 1.0f, &l0, dx), ZPS_OK);
    for (size_t i = 0; i < 10; i++) {
        float keep = x[i];
        x[i] = keep + 1e-2f;
        k_smooth_l1(k_backend_ref(), n, x, t, 1.0f, 1.0f, &l1, NULL);
        x[i] = keep - 1e-2f;
        k_smooth_l1(k_backend_ref(), n, x, t, 1.0f, 1.0f, &l2, NULL);
        x[i] = keep;
        double num = ((double)l1 - l2) / 2e-2;
        cr_assert(fabs(num - dx[i]) < 2e-2, "smooth-l1 grad %zu: %g vs %g (seed %llu)", i, dx[i],
                  num, (unsigned long long)s_seed);
    }
    free(c.z), free(c.labels), free(dz), free(x), free(t), free(dx);
}

Test(k_ref, dropout_is_seeded_scaled_and_its_own_backward, .init = s_seed_init)
{
    size_t n = 20000;
    float p = zt_unif(0.1f, 0.7f), *x = zt_k_randv(n, 0.5f, 1.5f), *y = zt_k_zeros(n), *y2 = zt_k_zeros(n);
    uint64_t seed = zt_rand();
    cr_assert_eq(k_dropout_fwd(k_backend_ref(), n, p, seed, x, y), ZPS_OK);
    cr_assert_eq(k_dropout_bwd(k_backend_ref(), n, p, seed, x, y2), ZPS_OK);
    size_t dropped = 0;
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(y[i], y2[i]);
        if (y[i] == 0)
            dropped++;
        else
            cr_assert_float_eq(y[i], x[i] / (1 - p), 1e-5);
    }
    double frac = (double)dropped / n;
    cr_assert(fabs(frac - p) < 0.02, "dropped %.3f, want %.3f (seed %llu)", frac, p,
              (unsigned long long)s_seed);
    cr_assert_eq(k_dropout_fwd(k_backend_ref(), n, 1.0f, seed, x, y), ZPS_ERR_INVALID);
    free(x), free(y), free(y2);
}

Test(k_ref, concat_then_split_is_identity, .init = s_seed_init)
{
    int n = zt_irand(1, 3), hw = zt_irand(1, 20), nin = zt_irand(1, 4), c[4], ctot = 0;
    float *xs[4], *back[4];
    for (int i = 0; i < nin; i++) {
        c[i] = zt_irand(1, 5);
        ctot += c[i];
        xs[i] = zt_k_randv((size_t)n * c[i] * hw, -1, 1);
        back[i] = zt_k_zeros((size_t)n * c[i] * hw);
    }
    float *y = zt_k_zeros((size_t)n * ctot * hw);
    cr_assert_eq(k_concat_fwd(k_backend_ref(), n, hw, nin, c, (const float *const *)xs, y), ZPS_OK);
    /* channel ch of image b of input i sits at channel (offset_i + ch) of image b */
    int off = 0;
    for (int i = 0; i < nin; i++) {
        for (int b = 0; b < n; b++)
            cr_assert_eq(memcmp(y + ((size_t)b * ctot + off) * hw, xs[i] + (size_t)b * c[i] * hw,
                                sizeof(float) * (size_t)c[i] * hw),
                         0);
        off += c[i];
    }
    cr_assert_eq(k_concat_bwd(k_backend_ref(), n, hw, nin, c, y, back), ZPS_OK);
    for (int i = 0; i < nin; i++) {
        cr_assert_eq(memcmp(back[i], xs[i], sizeof(float) * (size_t)n * c[i] * hw), 0);
        free(xs[i]), free(back[i]);
    }
    free(y);
}

Test(k_ref, elementwise_and_reductions, .init = s_seed_init)
{
    size_t n = (size_t)zt_irand(1, 300);
    float *a = zt_k_randv(n, -1, 1), *b = zt_k_randv(n, -1, 1), *y = zt_k_zeros(n);
    const k_backend *be = k_backend_ref();
    cr_assert_eq(k_add(be, n, a, b, y), ZPS_OK);
    double s1 = 0, s2 = 0, sum, sumsq;
    for (size_t i = 0; i < n; i++) {
        cr_assert_float_eq(y[i], a[i] + b[i], 1e-6);
        s1 += y[i], s2 += (double)y[i] * y[i];
    }
    k_sum(be, n, y, &sum), k_sumsq(be, n, y, &sumsq);
    cr_assert_float_eq(sum, s1, 1e-9);
    cr_assert_float_eq(sumsq, s2, 1e-9);
    float alpha = zt_unif(-2, 2);
    float *y0 = zt_k_copyv(y, n);
    k_axpy(be, n, alpha, a, y);
    for (size_t i = 0; i < n; i++)
        cr_assert_float_eq(y[i], y0[i] + alpha * a[i], 1e-5);
    k_scale(be, n, alpha, y0);
    k_fill(be, n, 3.0f, b);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(b[i], 3.0f);
    /* relu */
    k_relu_fwd(be, n, a, y);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(y[i], a[i] > 0 ? a[i] : 0.0f);
    free(a), free(b), free(y), free(y0);
}
