/* test_ps_optim.c — server-side optimizers against the formulas evaluated in double
 * precision (|a - b| <= 1e-5 + 1e-4 |ref| over 6 steps), learning-rate schedules at known
 * points, validation, and the protobuf round trip. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/mem.h"
#include "ps/apply_pool.h"
#include "ps/optim.h"
#include "tests/ps_test_util.h"

#define N 257
#define STEPS 6

/* The double-precision oracle, written from the formulas in optim.h. */
static void s_ref_step(const ps_optim_config *c, uint64_t step, double *w, double *s0, double *s1,
                       const float *g)
{
    double lr = ps_optim_lr(c, step);
    for (int i = 0; i < N; i++) {
        double gi = g[i] + c->weight_decay * w[i];
        switch (c->kind) {
        case PS_OPT_SGD:
            w[i] -= lr * gi;
            break;
        case PS_OPT_MOMENTUM:
            s0[i] = c->momentum * s0[i] + gi;
            w[i] -= c->nesterov ? lr * (gi + c->momentum * s0[i]) : lr * s0[i];
            break;
        case PS_OPT_RMSPROP:
            s0[i] = c->decay * s0[i] + (1 - c->decay) * gi * gi;
            s1[i] = c->momentum * s1[i] + lr * gi / sqrt(s0[i] + c->epsilon);
            w[i] -= s1[i];
            break;
        case PS_OPT_ADAM: {
            double t = (double)step + 1;
            s0[i] = c->beta1 * s0[i] + (1 - c->beta1) * gi;
            s1[i] = c->beta2 * s1[i] + (1 - c->beta2) * gi * gi;
            double lrt = lr * sqrt(1 - pow(c->beta2, t)) / (1 - pow(c->beta1, t));
            w[i] -= lrt * s0[i] / (sqrt(s1[i]) + c->epsilon);
            break;
        }
        case PS_OPT_ADAGRAD:
            s0[i] += gi * gi;
            w[i] -= lr * gi / (sqrt(s0[i]) + c->epsilon);
            break;
        }
    }
}

static void s_check(const ps_optim_config *c, const char *name)
{
    uint64_t seed = pst_seed(), r = seed;
    float w[N], g[N], s0[N], s1[N];
    double wd[N], d0[N], d1[N];
    for (int i = 0; i < N; i++) {
        w[i] = pst_uniform(&r);
        wd[i] = w[i];
        s0[i] = ps_optim_slot_init(c, 0);
        s1[i] = ps_optim_slot_init(c, 1);
        d0[i] = s0[i];
        d1[i] = s1[i];
    }
    float *slots[2] = {s0, s1};
    for (int s = 0; s < STEPS; s++) {
        for (int i = 0; i < N; i++)
            g[i] = pst_uniform(&r);
        ps_optim_apply(c, (uint64_t)s, w, slots, g, N);
        s_ref_step(c, (uint64_t)s, wd, d0, d1, g);
        for (int i = 0; i < N; i++)
            cr_assert(fabs(w[i] - wd[i]) <= 1e-5 + 1e-4 * fabs(wd[i]),
                      "%s step %d [%d]: %.9g vs %.9g (seed %llu)", name, s, i, w[i], wd[i],
                      (unsigned long long)seed);
    }
}

Test(ps_optim, every_optimizer_matches_the_double_formula)
{
    ps_optim_config c = pst_optim(PS_OPT_SGD, 0.1);
    c.weight_decay = 0.01;
    s_check(&c, "sgd");
    c.kind = PS_OPT_MOMENTUM;
    s_check(&c, "momentum");
    c.nesterov = 1;
    s_check(&c, "nesterov");
    c = pst_optim(PS_OPT_RMSPROP, 0.045);
    c.epsilon = 1.0;
    s_check(&c, "rmsprop");
    c = pst_optim(PS_OPT_ADAM, 0.01);
    s_check(&c, "adam");
    c = pst_optim(PS_OPT_ADAGRAD, 0.1);
    c.epsilon = 1e-7;
    s_check(&c, "adagrad");
}

Test(ps_optim, schedules)
{
    ps_optim_config c;
    ps_optim_default(&c);
    c.lr = 0.1;
    cr_assert_float_eq(ps_optim_lr(&c, 1000), 0.1, 1e-15);
    c.sched = PS_SCHED_EXPONENTIAL;
    c.decay_rate = 0.94;
    c.decay_steps = 2;
    c.staircase = 1;
    cr_assert_float_eq(ps_optim_lr(&c, 0), 0.1, 1e-15);
    cr_assert_float_eq(ps_optim_lr(&c, 1), 0.1, 1e-15);
    cr_assert_float_eq(ps_optim_lr(&c, 5), 0.1 * 0.94 * 0.94, 1e-15);
    c.staircase = 0;
    cr_assert_float_eq(ps_optim_lr(&c, 5), 0.1 * pow(0.94, 2.5), 1e-15);
    c.sched = PS_SCHED_COSINE;
    c.total_steps = 100;
    c.min_lr = 0.001;
    cr_assert_float_eq(ps_optim_lr(&c, 0), 0.1, 1e-15);
    cr_assert_float_eq(ps_optim_lr(&c, 50), 0.001 + 0.099 * 0.5, 1e-12);
    cr_assert_float_eq(ps_optim_lr(&c, 100), 0.001, 1e-15);
    cr_assert_float_eq(ps_optim_lr(&c, 500), 0.001, 1e-15);
    c.warmup_steps = 10;
    cr_assert_float_eq(ps_optim_lr(&c, 0), 0.01, 1e-15);
    cr_assert_float_eq(ps_optim_lr(&c, 9), 0.1, 1e-15);
    cr_assert_float_eq(ps_optim_lr(&c, 10), 0.1, 1e-15);
    cr_assert_float_eq(ps_optim_lr(&c, 60), 0.001 + 0.099 * 0.5, 1e-12);
}

Test(ps_optim, validation_and_proto_round_trip)
{
    ps_optim_config c, d;
    char why[200];
    ps_optim_default(&c);
    c.lr = -1;
    cr_assert_eq(ps_optim_validate(&c, why, sizeof why), ZPS_ERR_INVALID);
    cr_assert(strstr(why, "learning rate"));
    ps_optim_default(&c);
    c.kind = PS_OPT_ADAM;
    c.beta1 = 1.0;
    cr_assert_eq(ps_optim_validate(&c, why, sizeof why), ZPS_ERR_INVALID);
    ps_optim_default(&c);
    c.kind = PS_OPT_RMSPROP;
    c.lr = 0.045;
    c.epsilon = 1.0;
    c.weight_decay = 4e-5;
    c.sched = PS_SCHED_EXPONENTIAL;
    c.decay_rate = 0.94;
    c.decay_steps = 7;
    c.staircase = 1;
    c.warmup_steps = 3;
    Zps__OptimizerConfig m;
    Zps__Schedule s;
    ps_optim_to_proto(&c, &m, &s);
    size_t n = zps__optimizer_config__get_packed_size(&m);
    uint8_t *b = zps_xmalloc(n);
    zps__optimizer_config__pack(&m, b);
    Zps__OptimizerConfig *u = zps__optimizer_config__unpack(NULL, n, b);
    cr_assert(u);
    cr_assert_eq(ps_optim_from_proto(u, &d, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert(ps_optim_equal(&c, &d));
    d.lr = 0.05;
    cr_assert(!ps_optim_equal(&c, &d));
    free(u->name);
    u->name = strdup("lamb");
    cr_assert_eq(ps_optim_from_proto(u, &d, why, sizeof why), ZPS_ERR_INVALID);
    cr_assert(strstr(why, "lamb"));
    zps__optimizer_config__free_unpacked(u, NULL);
    free(b);
}

/* ps/apply_pool.h: an update cut over threads gives ps_optim_apply's bits, for every
 * optimizer, at sizes below, at and past the cut's thresholds, on 1 to 5 threads. */
Test(ps_optim, apply_pool_gives_the_same_bits_on_any_threads)
{
    uint64_t seed = pst_seed(), r = seed;
    static const size_t sizes[] = {0, 1, 100, 2 * PS_APPLY_MIN - 1, 2 * PS_APPLY_MIN,
                                   3 * PS_APPLY_MIN + 17, 7 * PS_APPLY_MIN + 5};
    const size_t most = 7 * PS_APPLY_MIN + 5;
    float *w0 = malloc(most * 4), *g = malloc(most * 4), *s0[2] = {malloc(most * 4), malloc(most * 4)};
    float *w1 = malloc(most * 4), *s1[2] = {malloc(most * 4), malloc(most * 4)};
    for (size_t i = 0; i < most; i++) {
        w0[i] = pst_uniform(&r), g[i] = pst_uniform(&r);
        s0[0][i] = 0.5f + 0.5f * pst_uniform(&r), s0[1][i] = 0.5f + 0.5f * pst_uniform(&r);
    }
    static const ps_optim_kind kinds[] = {PS_OPT_SGD, PS_OPT_MOMENTUM, PS_OPT_RMSPROP,
                                          PS_OPT_ADAM, PS_OPT_ADAGRAD};
    for (int threads = 1; threads <= 5; threads += 2) {
        ps_apply_pool *p;
        cr_assert_eq(ps_apply_pool_new(threads, &p), ZPS_OK);
        cr_assert_eq(ps_apply_pool_threads(p), threads);
        for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
            ps_optim_config o = pst_optim(kinds[k], 0.01);
            o.weight_decay = 1e-3, o.momentum = 0.9;
            for (size_t z = 0; z < sizeof sizes / sizeof sizes[0]; z++) {
                size_t n = sizes[z];
                memcpy(w1, w0, most * 4), memcpy(s1[0], s0[0], most * 4);
                memcpy(s1[1], s0[1], most * 4);
                float *want[3] = {malloc(most * 4), malloc(most * 4), malloc(most * 4)};
                memcpy(want[0], w0, most * 4), memcpy(want[1], s0[0], most * 4);
                memcpy(want[2], s0[1], most * 4);
                float *ws[2] = {want[1], want[2]};
                for (uint64_t step = 3; step < 5; step++) {
                    ps_optim_apply(&o, step, want[0], ws, g, n);
                    ps_apply_pool_run(p, &o, step, w1, s1, g, n);
                }
                for (int a = 0; a < 3; a++) {
                    const float *got = a == 0 ? w1 : s1[a - 1];
                    cr_assert(!memcmp(got, want[a], most * 4),
                              "kind %d, %zu floats, %d threads: array %d differs (seed %llu)",
                              (int)kinds[k], n, threads, a, (unsigned long long)seed);
                    free(want[a]);
                }
            }
        }
        ps_apply_pool_destroy(&p);
        cr_assert_null(p);
    }
    ps_apply_pool *bad;
    cr_assert_eq(ps_apply_pool_new(0, &bad), ZPS_ERR_INVALID);
    cr_assert_eq(ps_apply_pool_new(PS_APPLY_MAX_THREADS + 1, &bad), ZPS_ERR_INVALID);
    ps_optim_config sgd = pst_optim(PS_OPT_SGD, 0.1);
    ps_apply_pool_run(NULL, &sgd, 0, w1, s1, g, 100); /* no pool: one call */
    free(w0), free(g), free(w1), free(s0[0]), free(s0[1]), free(s1[0]), free(s1[1]);
}
