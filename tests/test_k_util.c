/* test_k_util.c — the kernels tests' shared helpers declared in test_k.h (no tests). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "tests/test_k.h"
#include "tests/testutil.h"

static uint64_t s_seed;

uint64_t zt_k_init(void)
{
    s_seed = zt_seed_init();
    zps_log_set_level(ZPS_LOG_WARN);
    return s_seed;
}

float *zt_k_randv(size_t n, float lo, float hi)
{
    float *v = malloc(n * sizeof *v + 4);
    for (size_t i = 0; i < n; i++)
        v[i] = zt_unif(lo, hi);
    return v;
}

float *zt_k_zeros(size_t n) { return calloc(n + 1, sizeof(float)); }

float *zt_k_copyv(const float *x, size_t n)
{
    float *v = malloc(n * sizeof *v + 4);
    memcpy(v, x, n * sizeof *v);
    return v;
}

void zt_k_close(const char *who, const char *what, const float *got, const float *ref, size_t n,
                double atol, double rtol)
{
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        cr_assert(d <= atol + rtol * fabs(ref[i]),
                  "%s %s[%zu]: got %.7g want %.7g (|d|=%.3g > %.3g + %.3g*|ref|; seed %llu)",
                  who, what, i, got[i], ref[i], d, atol, rtol, (unsigned long long)s_seed);
    }
}

void zt_k_random_conv(k_conv2d *d, int big)
{
    for (;;) {
        int r = zt_irand(1, 5), s = zt_irand(1, 5);
        if (zt_rand() % 3 == 0) { /* Inception's factorised kernels */
            r = zt_rand() % 2 ? 1 : 7;
            s = r == 1 ? 7 : 1;
        }
        int h = zt_irand(r, big ? 20 : 9), w = zt_irand(s, big ? 20 : 9);
        int st = zt_irand(1, 2), sw = zt_rand() % 4 == 0 ? 3 - st : st;
        if (k_conv2d_init(d, zt_irand(1, 3), zt_irand(1, big ? 24 : 4), h, w,
                          zt_irand(1, big ? 24 : 4), r, s, st, sw, zt_irand(0, r / 2),
                          zt_irand(0, s / 2)) == ZPS_OK)
            return;
    }
}

void zt_k_random_pool(k_pool *d, k_pool_kind kind, int big)
{
    while (k_pool_init(d, kind, zt_irand(1, 3), zt_irand(1, big ? 16 : 3),
                       zt_irand(1, big ? 19 : 8), zt_irand(1, big ? 19 : 8), zt_irand(1, 5),
                       zt_irand(1, 5), zt_irand(1, 3), zt_irand(1, 3), zt_irand(0, 2),
                       zt_irand(0, 2)) != ZPS_OK)
        ;
}
