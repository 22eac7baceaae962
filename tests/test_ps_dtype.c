/* test_ps_dtype.c — bfloat16 conversions (ps/dtype.h) against an oracle that picks the
 * nearer of the two neighbouring bfloat16 values in double arithmetic (ties to the even one),
 * on random bit patterns of every exponent; specials; any alignment; the finite checks of
 * bf16 and f32. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ps/dtype.h"
#include "tests/testutil.h"

static float s_f(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t s_u(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* The oracle: x's two bfloat16 neighbours are its truncation t and the next value away from
 * zero; the nearer wins, a tie goes to the one whose last kept bit is 0. Overflow is Inf. */
static uint16_t s_oracle(float x)
{
    uint32_t u = s_u(x);
    if (isnan(x))
        return (uint16_t)((u >> 16) | 0x40);
    uint16_t t = (uint16_t)(u >> 16), up = (uint16_t)(t + 1);
    if ((t & 0x7f80u) == 0x7f80u) // Inf stays Inf
        return t;
    double dx = fabs((double)x), dt = fabs((double)s_f((uint32_t)t << 16));
    double dup = (up & 0x7f80u) == 0x7f80u ? ldexp(1.0, 128) : fabs((double)s_f((uint32_t)up << 16));
    double lo = dx - dt, hi = dup - dx;
    if (lo < hi)
        return t;
    if (hi < lo)
        return up;
    return (t & 1) ? up : t;
}

Test(ps_dtype, rounding_matches_the_nearest_even_oracle)
{
    uint64_t seed = zt_seed_init();
    enum { N = 200000 };
    float *x = malloc(N * sizeof *x);
    uint16_t *h = malloc(N * sizeof *h);
    float *back = malloc(N * sizeof *back);
    cr_assert(x && h && back);
    for (int i = 0; i < N; i++) {
        uint32_t u = zt_rand();
        if (i % 4 == 0)
            u = (u & 0xffff0000u) | 0x8000u; // exact ties
        else if (i % 4 == 1)
            u = (u & 0xffff0000u) | (zt_rand() & 1 ? 0x7fffu : 0x8001u); // just off a tie
        x[i] = s_f(u);
        if (isnan(x[i]))
            x[i] = 1.5f;
    }
    x[0] = s_f(0x7f7fffffu);           // FLT_MAX rounds up past the largest bfloat16: Inf
    x[1] = s_f(0x7f7f7fffu);           // the largest value that stays finite
    x[2] = s_f(0x00000001u);           // the smallest subnormal: rounds to 0
    x[3] = s_f(0x80008000u);           // a negative tie on a subnormal
    x[4] = -0.0f;
    x[5] = INFINITY;
    x[6] = -INFINITY;
    x[7] = NAN;
    x[8] = s_f(0x7f800001u);           // a NaN whose payload would round into Inf
    ps_f32_to_bf16(h, x, N);
    ps_bf16_to_f32(back, h, N);
    for (int i = 0; i < N; i++) {
        uint16_t want = s_oracle(x[i]);
        cr_assert_eq(h[i], want, "x = %a (0x%08x): bf16 0x%04x, oracle 0x%04x (seed %llu)",
                     (double)x[i], s_u(x[i]), h[i], want, (unsigned long long)seed);
        if (isnan(x[i]))
            cr_assert(isnan(back[i]), "NaN must stay NaN (x = 0x%08x)", s_u(x[i]));
        else
            cr_assert_eq(s_u(back[i]), (uint32_t)h[i] << 16, "widening is exact");
    }
    cr_assert_eq(h[0], 0x7f80);
    cr_assert_eq(h[1], 0x7f7f);
    /* rounding in place gives what the server makes of the wire's value, bit for bit */
    ps_f32_round_bf16(x, x, N);
    cr_assert_eq(memcmp(x, back, N * sizeof *x), 0, "round_bf16 != widen(to_bf16)");
    free(x);
    free(h);
    free(back);
}

Test(ps_dtype, any_alignment_gives_the_same_bits)
{
    zt_seed_init();
    enum { N = 1037 };
    float x[N];
    for (int i = 0; i < N; i++)
        x[i] = zt_unif(-1e3f, 1e3f);
    uint16_t ref[N];
    ps_f32_to_bf16(ref, x, N);
    uint8_t buf[2 * N + 8];
    float out[N];
    for (int off = 0; off < 4; off++) {
        ps_f32_to_bf16(buf + off, x, N);
        cr_assert(!memcmp(buf + off, ref, sizeof ref), "offset %d", off);
        ps_bf16_to_f32(out, buf + off, N);
        for (int i = 0; i < N; i++)
            cr_assert_eq(s_u(out[i]), (uint32_t)ref[i] << 16, "offset %d, element %d", off, i);
        cr_assert(ps_bf16_all_finite(buf + off, N));
    }
}

Test(ps_dtype, finite_check_finds_every_nan_and_inf)
{
    zt_seed_init();
    enum { N = 4099 };
    uint8_t buf[2 * N + 1];
    static const uint16_t bad[] = {0x7f80, 0xff80, 0x7fc0, 0xffc1, 0x7f81};
    for (int off = 0; off < 2; off++) {
        for (int i = 0; i < N; i++) {
            uint16_t h = (uint16_t)(zt_rand() & 0xffff);
            if ((h & 0x7f80u) == 0x7f80u)
                h &= 0xbfff; // an exponent that is not all ones
            memcpy(buf + off + 2 * i, &h, 2);
        }
        cr_assert(ps_bf16_all_finite(buf + off, N));
        for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
            int at = zt_irand(0, N - 1);
            uint16_t keep;
            memcpy(&keep, buf + off + 2 * at, 2);
            memcpy(buf + off + 2 * at, &bad[k], 2);
            cr_assert(!ps_bf16_all_finite(buf + off, N), "0x%04x at %d (offset %d)", bad[k], at, off);
            cr_assert(ps_bf16_all_finite(buf + off, (size_t)at), "the part before it is finite");
            memcpy(buf + off + 2 * at, &keep, 2);
        }
    }
}

Test(ps_dtype, f32_finite_check_at_any_alignment)
{
    zt_seed_init();
    enum { N = 1029 };
    uint8_t buf[4 * N + 3];
    static const uint32_t bad[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u,
                                   0x7f800001u};
    for (int off = 0; off < 4; off++) {
        for (int i = 0; i < N; i++) {
            uint32_t u = zt_rand();
            if ((u & 0x7f800000u) == 0x7f800000u)
                u &= 0xbfffffffu; // an exponent that is not all ones: every finite kind
            memcpy(buf + off + 4 * i, &u, 4);
        }
        cr_assert(ps_f32_all_finite(buf + off, N), "offset %d", off);
        for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
            int at = zt_irand(0, N - 1);
            uint8_t keep[4];
            memcpy(keep, buf + off + 4 * at, 4);
            memcpy(buf + off + 4 * at, &bad[k], 4);
            cr_assert(!ps_f32_all_finite(buf + off, N), "0x%08x at %d (offset %d)", bad[k], at,
                      off);
            cr_assert(ps_f32_all_finite(buf + off, (size_t)at), "the part before it is finite");
            memcpy(buf + off + 4 * at, keep, 4);
        }
    }
}

Test(ps_dtype, names_round_trip)
{
    ps_dtype d;
    cr_assert_eq(ps_dtype_parse("bf16", &d), 0);
    cr_assert_eq(d, PS_DTYPE_BF16);
    cr_assert_str_eq(ps_dtype_name(d), "bf16");
    cr_assert_eq(ps_dtype_parse("f32", &d), 0);
    cr_assert_eq(d, PS_DTYPE_F32);
    cr_assert_eq(ps_dtype_size(PS_DTYPE_F32), 4);
    cr_assert_eq(ps_dtype_size(PS_DTYPE_BF16), 2);
    cr_assert_eq(ps_dtype_parse("f16", &d), -1);
    cr_assert_eq(ps_dtype_parse(NULL, &d), -1);
    cr_assert_null(ps_dtype_name((ps_dtype)7));
}
