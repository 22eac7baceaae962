/* test_k.h — helpers shared by the kernels tests (test_k_ref.c, test_k_backends.c), on top of
 * testutil.h's seeded randomness. Host buffers are malloc'd (the caller frees them) with a few
 * spare bytes, so empty tensors still get a pointer. */
#ifndef ZPS_TESTS_TEST_K_H
#define ZPS_TESTS_TEST_K_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/kernels.h"
#include "tests/testutil.h"

/* zt_seed_init(), kept for zt_k_close's messages, and the log level the kernels tests use;
 * returns the seed. For a Criterion .init. */
uint64_t zt_k_init(void);
/* Uniform in [lo, hi]; zeros; a copy. */
float *zt_k_randv(size_t n, float lo, float hi);
float *zt_k_zeros(size_t n);
float *zt_k_copyv(const float *x, size_t n);
/* Asserts |got - ref| <= atol + rtol * |ref| for n values; failures name who, what, the index
 * and the seed. */
void zt_k_close(const char *who, const char *what, const float *got, const float *ref, size_t n,
                double atol, double rtol);
/* Random valid shapes: convolutions with Inception's 1x7/7x1 kernels among them, pooling
 * windows with padding. big: up to 24 channels and 20x20 maps, else tiny (finite
 * differences). */
void zt_k_random_conv(k_conv2d *d, int big);
void zt_k_random_pool(k_pool *d, k_pool_kind kind, int big);
/* The cuda back-end, or the test skips saying why (ZPS_GPU_SKIP: a failure under
 * ZPS_REQUIRE_GPU), at the caller's file and line. */
#define ZT_CUDA_OR_SKIP()                                                              \
    ({                                                                                 \
        char why_[320] = "";                                                           \
        const k_backend *be_ = k_backend_cuda(why_, sizeof why_);                       \
        if (!be_)                                                                      \
            ZPS_GPU_SKIP("no CUDA device: %s", why_);                                  \
        be_;                                                                           \
    })

#endif
