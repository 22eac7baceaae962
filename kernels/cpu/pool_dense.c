/* pool_dense.c — the cpu back-end's pooling and inner product (cpu_int.h).
 *
 * Pooling: max, or average with the padding counted in the divisor (oneDNN's
 * pooling_avg_include_padding, PyTorch's count_include_pad=True); max pooling keeps its argmax
 * workspace in impl from forward to backward. 2x2 stride-2 max pooling of 16-blocked maps
 * runs in zps's own AVX-512 loops (s_max2), with the same first-maximum rule as ref. Inner product: y = x w^T + b as three calls of
 * oneDNN's sgemm (its JIT gemm, the one its gemm inner product runs), not the inner-product
 * primitives: the forward is computed transposed, y^T = w x^T, and transposed back with the
 * bias (w's rows streamed once: at the convnet's fc1, 32x3136 into 128, 0.12 ms where the
 * primitive took 0.19-0.29), and the weight gradient is added into dw by the gemm itself
 * (beta 1) instead of through scratch. A blocked x (a convolutional trunk's last map) is
 * reordered into NCHW in impl's buffer, and dx back out of it: the gemms stay on plain 2-D
 * layouts (a blocked source would need the weights reordered twice per step, 4x the floats
 * of x for the convnet's fc1).
 */
#include <assert.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/mem.h"
#include "kernels/cpu/cpu_int.h"

/* ---- pooling ---- */

typedef struct s_pool_impl {
    k_cpu_head head;
    k_cpu_prim fwd;        // src, dst [+ workspace]
    k_cpu_prim bwd;        // diff_dst, diff_src [+ workspace]
    dnnl_memory_t ws;  // max-pool argmax workspace (owned), or NULL
    uint16_t *arg;     // s_max2: where each output's max was, two masks per vector (owned)
    uint16_t *act;     // bn_pool.c's fusion: the max was above 0, a mask per vector (owned)
    float *xmax;       // bn_pool.c's fusion: x at the max, one per output (owned)
} s_pool_impl;

/* 1 for a 2x2 stride-2 max pool without padding over a 16-channel-blocked map of even height
 * and width (the convnet's two pools) on a CPU with AVX-512: zps's own loops (s_max2_fwd,
 * s_max2_bwd), which beat oneDNN's jit pooling there (28x28x32 at batch 32: forward 0.18 ms,
 * backward 0.13). */
int k_cpu_pool_max2(const k_pool *d)
{
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    return d->kind == K_POOL_MAX && d->blocked == K_BLOCK16 && d->r == 2 && d->s == 2 &&
           d->stride_h == 2 && d->stride_w == 2 && d->pad_h == 0 && d->pad_w == 0 &&
           d->h == 2 * d->oh && d->w == 2 * d->ow && k_cpu_has_avx512();
#else
    (void)d;
    return 0;
#endif
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define S_AVX512 __attribute__((target("avx512f")))

/* Forward: each vector of 16 outputs gets its max and, in arg, the window position of the
 * first maximum in the order (0,0), (0,1), (1,0), (1,1) (ref's pick) as two 16-bit masks:
 * bit 0 of the position, then bit 1. */
S_AVX512 static void s_max2_fwd(const k_pool *d, const float *x, float *y, uint16_t *arg)
{
    const size_t rows = (size_t)d->n * (d->c / 16) * d->oh, in = (size_t)d->w * 16;
    for (size_t r = 0; r < rows; r++) {
        const float *r0 = x + 2 * r * in, *r1 = r0 + in;
        for (int ox = 0; ox < d->ow; ox++, y += 16, arg += 2) {
            __m512 m = _mm512_loadu_ps(r0 + 32 * ox), b = _mm512_loadu_ps(r0 + 32 * ox + 16);
            __m512 c = _mm512_loadu_ps(r1 + 32 * ox), e = _mm512_loadu_ps(r1 + 32 * ox + 16);
            __mmask16 kb = _mm512_cmp_ps_mask(b, m, _CMP_GT_OQ);
            m = _mm512_mask_mov_ps(m, kb, b);
            __mmask16 kc = _mm512_cmp_ps_mask(c, m, _CMP_GT_OQ);
            m = _mm512_mask_mov_ps(m, kc, c);
            __mmask16 ke = _mm512_cmp_ps_mask(e, m, _CMP_GT_OQ);
            _mm512_storeu_ps(y, _mm512_mask_mov_ps(m, ke, e));
            arg[0] = (uint16_t)(ke | (kb & ~kc)), arg[1] = (uint16_t)(ke | kc);
        }
    }
}

/* Backward: each window's gradient to the position arg names, zeros to the other three. */
S_AVX512 static void s_max2_bwd(const k_pool *d, const float *dy, const uint16_t *arg,
                                float *dx)
{
    const size_t rows = (size_t)d->n * (d->c / 16) * d->oh, in = (size_t)d->w * 16;
    for (size_t r = 0; r < rows; r++) {
        float *r0 = dx + 2 * r * in, *r1 = r0 + in;
        for (int ox = 0; ox < d->ow; ox++, dy += 16, arg += 2) {
            __m512 g = _mm512_loadu_ps(dy);
            __mmask16 b0 = arg[0], b1 = arg[1];
            _mm512_storeu_ps(r0 + 32 * ox, _mm512_maskz_mov_ps(~b1 & ~b0, g));
            _mm512_storeu_ps(r0 + 32 * ox + 16, _mm512_maskz_mov_ps(~b1 & b0, g));
            _mm512_storeu_ps(r1 + 32 * ox, _mm512_maskz_mov_ps(b1 & ~b0, g));
            _mm512_storeu_ps(r1 + 32 * ox + 16, _mm512_maskz_mov_ps(b1 & b0, g));
        }
    }
}
#else
static void s_max2_fwd(const k_pool *d, const float *x, float *y, uint16_t *arg)
{
    (void)d, (void)x, (void)y, (void)arg;
}
static void s_max2_bwd(const k_pool *d, const float *dy, const uint16_t *arg, float *dx)
{
    (void)d, (void)dy, (void)arg, (void)dx;
}
#endif

static zps_status s_pool_get(k_pool *d, s_pool_impl **out)
{
    s_pool_impl *im = d->impl;
    if (im) {
        *out = im;
        return ZPS_OK;
    }
    ZPS_TRY(k_cpu_ready());
    im = k_cpu_impl_new(&d->impl, K_CPU_POOL, sizeof *im);
    if (k_cpu_pool_max2(d)) {
        im->arg = zps_xaligned(64, (size_t)d->n * d->c * d->oh * d->ow / 4 + 64);
        *out = im;
        return ZPS_OK;
    }
    dnnl_memory_desc_t src, dst;
    ZPS_TRY(k_cpu_md4(&src, d->n, d->c, d->h, d->w, k_cpu_act_tag(d->blocked)));
    ZPS_TRY(k_cpu_md4(&dst, d->n, d->c, d->oh, d->ow, k_cpu_act_tag(d->blocked)));
    dnnl_dims_t strides = {d->stride_h, d->stride_w}, kernel = {d->r, d->s}, dil = {0, 0};
    dnnl_dims_t pl = {d->pad_h, d->pad_w};
    dnnl_dims_t pr = {(d->oh - 1) * d->stride_h + d->r - d->h - d->pad_h,
                      (d->ow - 1) * d->stride_w + d->s - d->w - d->pad_w};
    dnnl_alg_kind_t alg =
        d->kind == K_POOL_MAX ? dnnl_pooling_max : dnnl_pooling_avg_include_padding;
    dnnl_pooling_v2_desc_t pd;
    K_CPU_DNNL(dnnl_pooling_v2_forward_desc_init(&pd, dnnl_forward_training, alg, &src, &dst,
                                             strides, kernel, dil, pl, pr));
    ZPS_TRY(k_cpu_prim_create(&im->fwd, &pd, NULL));
    ZPS_TRY(k_cpu_prim_arg(&im->fwd, DNNL_ARG_SRC, dnnl_query_src_md));
    ZPS_TRY(k_cpu_prim_arg(&im->fwd, DNNL_ARG_DST, dnnl_query_dst_md));
    ZPS_TRY(k_cpu_workspace(&im->fwd, &im->ws));
    if (im->ws)
        k_cpu_prim_shared(&im->fwd, DNNL_ARG_WORKSPACE, im->ws);
    K_CPU_DNNL(dnnl_pooling_v2_backward_desc_init(&pd, alg, &src, &dst, strides, kernel, dil, pl,
                                              pr));
    ZPS_TRY(k_cpu_prim_create(&im->bwd, &pd, im->fwd.pd));
    ZPS_TRY(k_cpu_prim_arg(&im->bwd, DNNL_ARG_DIFF_DST, dnnl_query_diff_dst_md));
    ZPS_TRY(k_cpu_prim_arg(&im->bwd, DNNL_ARG_DIFF_SRC, dnnl_query_diff_src_md));
    if (im->ws)
        k_cpu_prim_shared(&im->bwd, DNNL_ARG_WORKSPACE, im->ws);
    *out = im;
    return ZPS_OK;
}

zps_status k_cpu_pool_fwd(k_pool *d, const float *x, float *y)
{
    s_pool_impl *im;
    ZPS_TRY(s_pool_get(d, &im));
    if (im->arg) {
        s_max2_fwd(d, x, y, im->arg);
        return ZPS_OK;
    }
    const void *ptrs[2] = {x, y};
    return k_cpu_prim_run(&im->fwd, ptrs, 2);
}

zps_status k_cpu_pool_bwd(k_pool *d, const float *x, const float *y, const float *dy,
                          float *dx)
{
    (void)x, (void)y;
    s_pool_impl *im;
    ZPS_TRY(s_pool_get(d, &im));
    if (im->arg) {
        s_max2_bwd(d, dy, im->arg, dx);
        return ZPS_OK;
    }
    const void *ptrs[2] = {dy, dx};
    return k_cpu_prim_run(&im->bwd, ptrs, 2);
}

zps_status k_cpu_pool_max2_ws(k_pool *d, uint16_t **arg, uint16_t **act, float **xmax)
{
    assert(k_cpu_pool_max2(d));
    s_pool_impl *im;
    ZPS_TRY(s_pool_get(d, &im));
    size_t ny = (size_t)d->n * d->c * d->oh * d->ow;
    if (!im->xmax) {
        im->act = zps_xaligned(64, ny / 8 + 64);
        im->xmax = zps_xaligned(64, ny * sizeof(float) + 64);
    }
    *arg = im->arg, *act = im->act, *xmax = im->xmax;
    return ZPS_OK;
}

void k_cpu_pool_release(k_cpu_head *impl)
{
    s_pool_impl *im = (s_pool_impl *)impl;
    k_cpu_prim_free(&im->fwd);
    k_cpu_prim_free(&im->bwd);
    if (im->ws)
        dnnl_memory_destroy(im->ws);
    zps_aligned_free(im->arg);
    zps_aligned_free(im->act);
    zps_aligned_free(im->xmax);
}

/* ---- inner product ---- */

typedef struct s_dense_impl {
    k_cpu_head head;
    k_cpu_prim to_plain;     // x_blocked: x (blocked) -> xp (NCHW)
    k_cpu_prim to_blocked;   // x_blocked: dx (NCHW, in xp) -> dx (blocked)
    float *xp;               // x_blocked: (n, in) plain x, then plain dx (owned)
} s_dense_impl;

/* The reorders between the blocked map x and its NCHW copy in xp. */
static zps_status s_dense_blocked_init(k_dense *d, s_dense_impl *im)
{
    assert(d->x_c > 0 && d->in % d->x_c == 0);
    int hw = d->in / d->x_c; /* (h, w) folded into one axis: the same offsets in both layouts */
    dnnl_memory_desc_t blk, pln;
    ZPS_TRY(k_cpu_md4(&blk, d->n, d->x_c, hw, 1, k_cpu_act_tag(d->x_blocked)));
    ZPS_TRY(k_cpu_md4(&pln, d->n, d->x_c, hw, 1, k_cpu_act_tag(0)));
    ZPS_TRY(k_cpu_reorder_create(&im->to_plain, &blk, &pln, 0));
    ZPS_TRY(k_cpu_reorder_create(&im->to_blocked, &pln, &blk, 0));
    im->xp = zps_xaligned(64, sizeof(float) * (size_t)d->n * d->in);
    return ZPS_OK;
}

/* x itself, or its NCHW copy in xp when x is blocked. */
static zps_status s_dense_plain_x(const k_dense *d, s_dense_impl *im, const float **x)
{
    if (!d->x_blocked)
        return ZPS_OK;
    const void *ptrs[2] = {*x, im->xp};
    ZPS_TRY(k_cpu_prim_run(&im->to_plain, ptrs, 2));
    *x = im->xp;
    return ZPS_OK;
}

static zps_status s_dense_get(k_dense *d, s_dense_impl **out)
{
    s_dense_impl *im = d->impl;
    if (im) {
        *out = im;
        return ZPS_OK;
    }
    ZPS_TRY(k_cpu_ready());
    im = k_cpu_impl_new(&d->impl, K_CPU_DENSE, sizeof *im);
    if (d->x_blocked)
        ZPS_TRY(s_dense_blocked_init(d, im));
    *out = im;
    return ZPS_OK;
}

/* C (m, n) = A (m, k) op B + beta C, row-major; tb: B is (n, k), transposed. */
static zps_status s_gemm(char ta, char tb, int m, int n, int k, const float *a, const float *b,
                         float beta, float *c)
{
    K_CPU_DNNL(dnnl_sgemm(ta, tb, m, n, k, 1.0f, a, ta == 'T' ? m : k, b, tb == 'T' ? k : n,
                          beta, c, n));
    return ZPS_OK;
}

zps_status k_cpu_dense_fwd(k_dense *d, const float *x, const float *w, const float *b,
                           float *y)
{
    s_dense_impl *im;
    ZPS_TRY(s_dense_get(d, &im));
    ZPS_TRY(s_dense_plain_x(d, im, &x));
    float *yt = k_cpu_scratch((size_t)d->out * d->n); /* y^T (out, n) */
    ZPS_TRY(s_gemm('N', 'T', d->out, d->n, d->in, w, x, 0.0f, yt));
    for (int i = 0; i < d->n; i++)
        for (int o = 0; o < d->out; o++)
            y[(size_t)i * d->out + o] = yt[(size_t)o * d->n + i] + (b ? b[o] : 0.0f);
    return ZPS_OK;
}

zps_status k_cpu_dense_bwd(k_dense *d, const float *x, const float *w, const float *dy,
                           float *dx, float *dw, float *db)
{
    s_dense_impl *im;
    ZPS_TRY(s_dense_get(d, &im));
    /* weights first: with a blocked x, xp holds the plain x until backward data reuses it */
    if (dw) {
        ZPS_TRY(s_dense_plain_x(d, im, &x));
        ZPS_TRY(s_gemm('T', 'N', d->out, d->in, d->n, dy, x, 1.0f, dw));
    }
    for (int i = 0; db && i < d->n; i++)
        k_cpu_acc((size_t)d->out, dy + (size_t)i * d->out, db);
    if (dx) {
        ZPS_TRY(s_gemm('N', 'N', d->n, d->in, d->out, dy, w, 0.0f, d->x_blocked ? im->xp : dx));
        if (d->x_blocked) {
            const void *back[2] = {im->xp, dx};
            ZPS_TRY(k_cpu_prim_run(&im->to_blocked, back, 2));
        }
    }
    return ZPS_OK;
}

void k_cpu_dense_release(k_cpu_head *impl)
{
    s_dense_impl *im = (s_dense_impl *)impl;
    k_cpu_prim_free(&im->to_plain);
    k_cpu_prim_free(&im->to_blocked);
    zps_aligned_free(im->xp);
}
