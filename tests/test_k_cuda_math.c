/* test_k_cuda_math.c — the CUDA back-end's element functions run on the CPU (suite
 * k_cuda_math), so their index math is proven here without a GPU: kernels/cuda/pool_math.h's
 * pooling forward and backward, element by element, against ref's pooling on random shapes
 * (windows, strides, padding, ceil-free and ragged edges), bit for bit. Values are drawn from
 * a few integers so that windows hold ties: the first maximum in scan order must win, as in
 * ref. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

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
