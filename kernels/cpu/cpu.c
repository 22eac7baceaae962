/* cpu.c — the fast CPU back-end: oneDNN 2.6 (C API) for convolution, batchnorm (with the ReLU
 * fused), pooling and inner product; elementwise ops, losses and optimizers come from ref.
 *
 * Every op descriptor (k_conv2d, k_bn, ...) gets its primitives created once, on first use,
 * in its `impl` slot: a forward primitive and the backward ones, with memory objects whose data
 * handles are re-pointed at the caller's buffers on each call (no per-call allocation). The
 * max-pool and fused batchnorm+ReLU workspaces live in impl from forward to backward.
 * Tensors are plain NCHW/KCRS at this API; oneDNN picks its own kernels for those layouts and
 * uses every core (its OpenMP runtime).
 *
 * Batchnorm's batch statistics are summed here, in double, and handed to oneDNN: its own float
 * sums are not accurate enough (s_bn_stats says why).
 *
 * oneDNN backward-weights primitives overwrite their output, but the kernels API accumulates
 * into parameter gradients: they write into a thread-local scratch that is then added.
 * Backward ops accumulate (+=) into parameter gradients and overwrite input gradients.
 */
#include <dnnl.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/simd.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"

#define S_DNNL(expr)                                                                   \
    do {                                                                               \
        dnnl_status_t s_st_ = (expr);                                                  \
        if (s_st_ != dnnl_success) {                                                   \
            zps_log(ZPS_ERROR, "kernels", "%s failed: oneDNN status %d", #expr,         \
                    (int)s_st_);                                                       \
            return ZPS_ERR_DNNL;                                                       \
        }                                                                              \
    } while (0)

/* One engine for the process; one stream per thread (several models may train in different
 * threads, e.g. all-reduce replicas; each model itself is used by one thread at a time). */
static dnnl_engine_t s_engine;
static _Thread_local dnnl_stream_t s_stream;
static dnnl_status_t s_init_status = dnnl_success;
static pthread_once_t s_once = PTHREAD_ONCE_INIT;
static pthread_key_t s_stream_key; // destroys a thread's stream when the thread exits

static _Thread_local float *s_scratch;
static _Thread_local size_t s_scratch_len;

/* Thread exit: the stream and the scratch of that thread. */
static void s_stream_free(void *st)
{
    dnnl_stream_destroy((dnnl_stream_t)st);
    zps_aligned_free(s_scratch);
    s_scratch = NULL;
    s_scratch_len = 0;
}

static void s_init(void)
{
    s_init_status = dnnl_engine_create(&s_engine, dnnl_cpu, 0);
    if (pthread_key_create(&s_stream_key, s_stream_free) != 0)
        s_init_status = dnnl_runtime_error;
}

static zps_status s_ready(void)
{
    pthread_once(&s_once, s_init);
    S_DNNL(s_init_status);
    if (!s_stream) {
        S_DNNL(dnnl_stream_create(&s_stream, s_engine, dnnl_stream_default_flags));
        pthread_setspecific(s_stream_key, s_stream);
    }
    return ZPS_OK;
}

/* Thread-local scratch (s_scratch above) for outputs that oneDNN overwrites but the API
 * accumulates; always used after s_ready(), which arranges its release at thread exit. */

static float *s_scratch_get(size_t n)
{
    if (n > s_scratch_len) {
        zps_aligned_free(s_scratch);
        s_scratch = zps_xaligned(64, n * sizeof(float));
        s_scratch_len = n;
    }
    return s_scratch;
}

static void s_acc(size_t n, const float *src, float *dst)
{
    for (size_t i = 0; i < n; i++)
        dst[i] += src[i];
}

/* ---- one primitive with its argument list ---- */

enum { S_MAX_ARGS = 12 };

typedef struct s_prim {
    dnnl_primitive_desc_t pd;             // owned
    dnnl_primitive_t p;                   // owned
    int nargs;                            // used entries of args
    dnnl_exec_arg_t args[S_MAX_ARGS];     // memory objects (owned unless shared[i])
    int shared[S_MAX_ARGS];               // 1: memory owned elsewhere (workspace)
} s_prim;

static void s_prim_free(s_prim *p)
{
    for (int i = 0; i < p->nargs; i++)
        if (!p->shared[i])
            dnnl_memory_destroy(p->args[i].memory);
    if (p->p)
        dnnl_primitive_destroy(p->p);
    if (p->pd)
        dnnl_primitive_desc_destroy(p->pd);
    memset(p, 0, sizeof *p);
}

static zps_status s_prim_create(s_prim *p, const_dnnl_op_desc_t desc,
                                const_dnnl_primitive_desc_t hint)
{
    S_DNNL(dnnl_primitive_desc_create(&p->pd, desc, NULL, s_engine, hint));
    S_DNNL(dnnl_primitive_create(&p->p, p->pd));
    return ZPS_OK;
}

/* Adds argument `arg` with the layout the primitive expects for query q (index 0). */
static zps_status s_prim_arg(s_prim *p, int arg, dnnl_query_t q)
{
    const dnnl_memory_desc_t *md = dnnl_primitive_desc_query_md(p->pd, q, 0);
    if (!md)
        return ZPS_ERR_DNNL;
    dnnl_memory_t m;
    S_DNNL(dnnl_memory_create(&m, md, s_engine, DNNL_MEMORY_NONE));
    p->args[p->nargs].arg = arg;
    p->args[p->nargs].memory = m;
    p->shared[p->nargs++] = 0;
    return ZPS_OK;
}

static void s_prim_shared(s_prim *p, int arg, dnnl_memory_t m)
{
    p->args[p->nargs].arg = arg;
    p->args[p->nargs].memory = m;
    p->shared[p->nargs++] = 1;
}

/* Points the first n non-shared arguments at ptrs (in the order they were added), runs. */
static zps_status s_prim_run(s_prim *p, const void *const *ptrs, int n)
{
    ZPS_TRY(s_ready()); /* this thread's stream */
    int k = 0;
    for (int i = 0; i < p->nargs && k < n; i++) {
        if (p->shared[i])
            continue;
        S_DNNL(dnnl_memory_set_data_handle(p->args[i].memory, (void *)ptrs[k++]));
    }
    S_DNNL(dnnl_primitive_execute(p->p, s_stream, p->nargs, p->args));
    S_DNNL(dnnl_stream_wait(s_stream));
    return ZPS_OK;
}

/* Workspace memory sized as the primitive asks, allocated by oneDNN. NULL when none. */
static zps_status s_workspace(s_prim *p, dnnl_memory_t *out)
{
    *out = NULL;
    const dnnl_memory_desc_t *md = dnnl_primitive_desc_query_md(p->pd, dnnl_query_workspace_md, 0);
    if (!md || dnnl_memory_desc_get_size(md) == 0)
        return ZPS_OK;
    S_DNNL(dnnl_memory_create(out, md, s_engine, DNNL_MEMORY_ALLOCATE));
    return ZPS_OK;
}

static zps_status s_md4(dnnl_memory_desc_t *md, int a, int b, int c, int d,
                        dnnl_format_tag_t tag)
{
    dnnl_dims_t dims = {a, b, c, d};
    S_DNNL(dnnl_memory_desc_init_by_tag(md, 4, dims, dnnl_f32, tag));
    return ZPS_OK;
}

static zps_status s_md2(dnnl_memory_desc_t *md, int a, int b)
{
    dnnl_dims_t dims = {a, b};
    S_DNNL(dnnl_memory_desc_init_by_tag(md, 2, dims, dnnl_f32, dnnl_ab));
    return ZPS_OK;
}

static zps_status s_md1(dnnl_memory_desc_t *md, int a)
{
    dnnl_dims_t dims = {a};
    S_DNNL(dnnl_memory_desc_init_by_tag(md, 1, dims, dnnl_f32, dnnl_a));
    return ZPS_OK;
}

/* ---- convolution ---- */

/* A reorder between two layouts of the same tensor; p.p is NULL when they are equal. */
typedef struct s_reorder {
    s_prim p;          // args: src, dst
} s_reorder;

/* accumulate: the reorder adds into its destination (a sum post-op). */
static zps_status s_reorder_create(s_reorder *r, const dnnl_memory_desc_t *from,
                                   const dnnl_memory_desc_t *to, int accumulate)
{
    memset(r, 0, sizeof *r);
    if (dnnl_memory_desc_equal(from, to))
        return ZPS_OK;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    if (accumulate) {
        S_DNNL(dnnl_primitive_attr_create(&attr));
        S_DNNL(dnnl_post_ops_create(&po));
        S_DNNL(dnnl_post_ops_append_sum(po, 1.0f));
        S_DNNL(dnnl_primitive_attr_set_post_ops(attr, po));
    }
    dnnl_status_t st =
        dnnl_reorder_primitive_desc_create(&r->p.pd, from, s_engine, to, s_engine, attr);
    if (po)
        dnnl_post_ops_destroy(po);
    if (attr)
        dnnl_primitive_attr_destroy(attr);
    S_DNNL(st);
    S_DNNL(dnnl_primitive_create(&r->p.p, r->p.pd));
    dnnl_memory_t a, b;
    S_DNNL(dnnl_memory_create(&a, from, s_engine, DNNL_MEMORY_NONE));
    S_DNNL(dnnl_memory_create(&b, to, s_engine, DNNL_MEMORY_NONE));
    r->p.args[0].arg = DNNL_ARG_FROM, r->p.args[0].memory = a;
    r->p.args[1].arg = DNNL_ARG_TO, r->p.args[1].memory = b;
    r->p.nargs = 2;
    return ZPS_OK;
}

typedef struct s_conv {
    int has_bias;        // bias given at the first forward (fixed afterwards)
    s_prim fwd;          // args: src, weights, [bias], dst
    s_prim bwd_data;     // args: diff_dst, weights, diff_src
    s_prim bwd_weights;  // args: src, diff_dst, diff_weights, [diff_bias]
    s_reorder w_fwd;     // plain weights -> forward layout
    s_reorder w_bwd;     // plain weights -> backward-data layout
    s_reorder dw_back;   // backward-weights layout -> plain
    float *wf, *wb, *dwb; // reordered weights (forward, backward data), diff weights (owned)
    const float *wf_src;  // plain weights wf was made from by the last forward
    int same_w;           // backward data wants the forward's weight layout
} s_conv;

static dnnl_format_tag_t s_act_tag(int blocked) { return blocked ? dnnl_nChw16c : dnnl_nchw; }

static float *s_layout_buf(const s_reorder *r, const s_prim *p, dnnl_query_t q)
{
    if (!r->p.p)
        return NULL;
    const dnnl_memory_desc_t *md = dnnl_primitive_desc_query_md(p->pd, q, 0);
    return zps_xaligned(64, dnnl_memory_desc_get_size(md) + 64);
}

static zps_status s_conv_create(k_conv2d *d, int has_bias, s_conv **out)
{
    ZPS_TRY(s_ready());
    s_conv *s = zps_xcalloc(1, sizeof *s);
    s->has_bias = has_bias;
    *out = s;
    dnnl_memory_desc_t src, wei, wplain, bia, dst;
    ZPS_TRY(s_md4(&src, d->n, d->c, d->h, d->w, s_act_tag(d->x_blocked)));
    ZPS_TRY(s_md4(&wei, d->k, d->c, d->r, d->s, dnnl_format_tag_any));
    ZPS_TRY(s_md4(&wplain, d->k, d->c, d->r, d->s, dnnl_oihw));
    ZPS_TRY(s_md1(&bia, d->k));
    ZPS_TRY(s_md4(&dst, d->n, d->k, d->oh, d->ow, s_act_tag(d->y_blocked)));
    dnnl_dims_t strides = {d->stride_h, d->stride_w}, pl = {d->pad_h, d->pad_w};
    dnnl_dims_t pr = {(d->oh - 1) * d->stride_h + d->r - d->h - d->pad_h,
                      (d->ow - 1) * d->stride_w + d->s - d->w - d->pad_w};
    dnnl_convolution_desc_t cd;
    S_DNNL(dnnl_convolution_forward_desc_init(&cd, dnnl_forward_training,
                                              dnnl_convolution_direct, &src, &wei,
                                              has_bias ? &bia : NULL, &dst, strides, pl, pr));
    ZPS_TRY(s_prim_create(&s->fwd, &cd, NULL));
    ZPS_TRY(s_prim_arg(&s->fwd, DNNL_ARG_SRC, dnnl_query_src_md));
    ZPS_TRY(s_prim_arg(&s->fwd, DNNL_ARG_WEIGHTS, dnnl_query_weights_md));
    if (has_bias) {
        const dnnl_memory_desc_t *bmd =
            dnnl_primitive_desc_query_md(s->fwd.pd, dnnl_query_weights_md, 1);
        dnnl_memory_t m;
        S_DNNL(dnnl_memory_create(&m, bmd, s_engine, DNNL_MEMORY_NONE));
        s->fwd.args[s->fwd.nargs].arg = DNNL_ARG_BIAS;
        s->fwd.args[s->fwd.nargs].memory = m;
        s->fwd.shared[s->fwd.nargs++] = 0;
    }
    ZPS_TRY(s_prim_arg(&s->fwd, DNNL_ARG_DST, dnnl_query_dst_md));
    ZPS_TRY(s_reorder_create(&s->w_fwd, &wplain,
                             dnnl_primitive_desc_query_md(s->fwd.pd, dnnl_query_weights_md, 0), 0));
    s->wf = s_layout_buf(&s->w_fwd, &s->fwd, dnnl_query_weights_md);

    S_DNNL(dnnl_convolution_backward_data_desc_init(&cd, dnnl_convolution_direct, &src, &wei,
                                                    &dst, strides, pl, pr));
    ZPS_TRY(s_prim_create(&s->bwd_data, &cd, s->fwd.pd));
    ZPS_TRY(s_prim_arg(&s->bwd_data, DNNL_ARG_DIFF_DST, dnnl_query_diff_dst_md));
    ZPS_TRY(s_prim_arg(&s->bwd_data, DNNL_ARG_WEIGHTS, dnnl_query_weights_md));
    ZPS_TRY(s_prim_arg(&s->bwd_data, DNNL_ARG_DIFF_SRC, dnnl_query_diff_src_md));
    const dnnl_memory_desc_t *wbmd =
        dnnl_primitive_desc_query_md(s->bwd_data.pd, dnnl_query_weights_md, 0);
    s->same_w = dnnl_memory_desc_equal(wbmd,
                                       dnnl_primitive_desc_query_md(s->fwd.pd, dnnl_query_weights_md, 0));
    ZPS_TRY(s_reorder_create(&s->w_bwd, &wplain, wbmd, 0));
    s->wb = s_layout_buf(&s->w_bwd, &s->bwd_data, dnnl_query_weights_md);

    S_DNNL(dnnl_convolution_backward_weights_desc_init(&cd, dnnl_convolution_direct, &src, &wei,
                                                       has_bias ? &bia : NULL, &dst, strides,
                                                       pl, pr));
    ZPS_TRY(s_prim_create(&s->bwd_weights, &cd, s->fwd.pd));
    ZPS_TRY(s_prim_arg(&s->bwd_weights, DNNL_ARG_SRC, dnnl_query_src_md));
    ZPS_TRY(s_prim_arg(&s->bwd_weights, DNNL_ARG_DIFF_DST, dnnl_query_diff_dst_md));
    ZPS_TRY(s_prim_arg(&s->bwd_weights, DNNL_ARG_DIFF_WEIGHTS, dnnl_query_diff_weights_md));
    if (has_bias) {
        const dnnl_memory_desc_t *bmd =
            dnnl_primitive_desc_query_md(s->bwd_weights.pd, dnnl_query_diff_weights_md, 1);
        dnnl_memory_t m;
        S_DNNL(dnnl_memory_create(&m, bmd, s_engine, DNNL_MEMORY_NONE));
        s->bwd_weights.args[s->bwd_weights.nargs].arg = DNNL_ARG_DIFF_BIAS;
        s->bwd_weights.args[s->bwd_weights.nargs].memory = m;
        s->bwd_weights.shared[s->bwd_weights.nargs++] = 0;
    }
    ZPS_TRY(s_reorder_create(
        &s->dw_back, dnnl_primitive_desc_query_md(s->bwd_weights.pd, dnnl_query_diff_weights_md, 0),
        &wplain, 1));
    s->dwb = s_layout_buf(&s->dw_back, &s->bwd_weights, dnnl_query_diff_weights_md);
    return ZPS_OK;
}

typedef enum s_kind { S_CONV = 1, S_BN, S_POOL, S_DENSE } s_kind;

/* Every impl starts with its kind so release() can tell them apart. */
typedef struct s_head {
    s_kind kind;
} s_head;

typedef struct s_conv_impl {
    s_head head;
    s_conv *conv;
} s_conv_impl;

static zps_status s_conv_get(k_conv2d *d, int has_bias, s_conv **out)
{
    s_conv_impl *im = d->impl;
    if (!im) {
        im = zps_xcalloc(1, sizeof *im);
        im->head.kind = S_CONV;
        d->impl = im;
        zps_status st = s_conv_create(d, has_bias, &im->conv);
        if (st != ZPS_OK) {
            zps_log(ZPS_ERROR, "kernels", "conv %dx%dx%dx%d k%d %dx%d s%d,%d p%d,%d: no oneDNN "
                    "primitive", d->n, d->c, d->h, d->w, d->k, d->r, d->s, d->stride_h,
                    d->stride_w, d->pad_h, d->pad_w);
            return st;
        }
    }
    *out = im->conv;
    return ZPS_OK;
}

/* Weights as primitive p wants them: w itself, or w reordered into buf. */
static zps_status s_weights(s_reorder *r, const float *w, float *buf, const float **out)
{
    if (!r->p.p) {
        *out = w;
        return ZPS_OK;
    }
    const void *ptrs[2] = {w, buf};
    ZPS_TRY(s_prim_run(&r->p, ptrs, 2));
    *out = buf;
    return ZPS_OK;
}

static zps_status s_conv2d_fwd(k_conv2d *d, const float *x, const float *w, const float *b,
                               float *y)
{
    s_conv *s;
    ZPS_TRY(s_conv_get(d, b != NULL, &s));
    if (s->has_bias != (b != NULL))
        return ZPS_ERR_INVALID;
    const float *wl;
    ZPS_TRY(s_weights(&s->w_fwd, w, s->wf, &wl));
    s->wf_src = w;
    const void *ptrs[4] = {x, wl, b, y};
    if (!b)
        ptrs[2] = y;
    return s_prim_run(&s->fwd, ptrs, b ? 4 : 3);
}

static zps_status s_conv2d_bwd(k_conv2d *d, const float *x, const float *w, const float *dy,
                               float *dx, float *dw, float *db)
{
    s_conv *s;
    ZPS_TRY(s_conv_get(d, db != NULL, &s));
    if (dx) {
        const float *wl;
        if (s->same_w && s->wf && s->wf_src == w) /* reordered by this step's forward */
            wl = s->wf;
        else
            ZPS_TRY(s_weights(&s->w_bwd, w, s->wb, &wl));
        const void *ptrs[3] = {dy, wl, dx};
        ZPS_TRY(s_prim_run(&s->bwd_data, ptrs, 3));
    }
    if (dw || db) {
        size_t nw = (size_t)d->k * d->c * d->r * d->s;
        float *sw = s_scratch_get(nw + (size_t)d->k);
        const void *ptrs[4] = {x, dy, s->dwb ? s->dwb : sw, sw + nw};
        ZPS_TRY(s_prim_run(&s->bwd_weights, ptrs, s->has_bias ? 4 : 3));
        if (s->dwb && dw) { /* back to KCRS, added into dw by the reorder itself */
            const void *rp[2] = {s->dwb, dw};
            ZPS_TRY(s_prim_run(&s->dw_back.p, rp, 2));
        } else if (dw) {
            s_acc(nw, sw, dw);
        }
        if (db) {
            if (s->has_bias) {
                s_acc((size_t)d->k, sw + nw, db);
            } else if (!d->y_blocked) {
                size_t ohw = (size_t)d->oh * d->ow;
                for (int n = 0; n < d->n; n++)
                    for (int k = 0; k < d->k; k++) {
                        const float *p = dy + ((size_t)n * d->k + k) * ohw;
                        float acc = 0;
                        for (size_t i = 0; i < ohw; i++)
                            acc += p[i];
                        db[k] += acc;
                    }
            } else {
                return ZPS_ERR_INVALID;
            }
        }
    }
    return ZPS_OK;
}

/* ---- batchnorm (+ fused ReLU) ---- */

typedef struct s_bn_impl {
    s_head head;
    s_prim fwd;           // training, statistics given: src, mean, variance, scale, shift, dst
                          // [+ workspace]
    s_prim infer;         // inference: src, mean, variance, scale, shift, dst
    s_prim bwd;           // src, mean, variance, diff_dst, scale, diff_src, diff_scale,
                          // diff_shift [+ workspace]
    dnnl_memory_t ws;     // ReLU mask from the training forward (owned), or NULL
    double *acc;          // (4, c) scratch: s_bn_stats (3 c), then the mean's residual (c)
    float *beta;          // (c) shift given to the training forward (s_bn_fwd_train)
    int have_infer;       // infer created
} s_bn_impl;

static unsigned s_bn_flags(const k_bn *d)
{
    return dnnl_use_scale | dnnl_use_shift | (d->relu ? dnnl_fuse_norm_relu : 0);
}

/* Batch mean and biased variance of every channel, summed in double; resid (c) receives
 * mean - (float)mean, the part of the mean that float cannot hold.
 *
 * Why not oneDNN's: batchnorm 2.6 sums a channel in float, so over ~10^4 values its mean is
 * off by ~1e-6 of the channel's std for every unit of |mean|/std (up to ~6 in Inception's
 * early layers; ref and this function are within one float rounding). That error shifts a
 * whole channel coherently, and Inception-v3 at 75x75 batch 8 (batchnorm over 8 values in
 * Mixed_7) amplifies it into percent-level errors of Mixed_7 gradients. The training forward
 * therefore gets these statistics as inputs (use_global_stats); its backward still
 * differentiates through them (it is created without that flag).
 *
 * One pass over x - shift, shift being the channel's first value, so that the sum of squares
 * minus the squared sum does not cancel (in double even |mean - shift| = 1000 std would lose
 * only ~1e-10). acc: 3 * c doubles of scratch.
 *
 * On x86-64 it is compiled for AVX-512, AVX2 and the baseline, picked at load time (a GCC and
 * Clang ifunc): the build targets the baseline, where these double sums run 2 wide, and this
 * pass is one more read of every batchnorm input per step. */
ZPS_SIMD_CLONES
static void s_bn_stats(const k_bn *d, const float *x, double *acc, float *mean, float *var,
                       double *resid)
{
    const int c = d->c;
    const size_t hw = (size_t)d->h * d->w;
    double *sum = acc, *sq = acc + c, *shift = acc + 2 * c;
    for (int k = 0; k < c; k++)
        shift[k] = d->blocked ? x[(size_t)(k / 16) * hw * 16 + k % 16] : x[(size_t)k * hw];
    if (d->blocked) { /* nChw16c: 16 channels side by side, one vector lane each */
        for (int cb = 0; cb < c / 16; cb++) {
            double s[16] = {0}, q[16] = {0}, *sh = shift + cb * 16;
            for (int n = 0; n < d->n; n++) {
                const float *p = x + ((size_t)n * (c / 16) + cb) * hw * 16;
                for (size_t i = 0; i < hw; i++)
                    for (int l = 0; l < 16; l++) {
                        double t = (double)p[i * 16 + l] - sh[l];
                        s[l] += t;
                        q[l] += t * t;
                    }
            }
            for (int l = 0; l < 16; l++)
                sum[cb * 16 + l] = s[l], sq[cb * 16 + l] = q[l];
        }
    } else { /* NCHW: four interleaved sums per channel */
        for (int k = 0; k < c; k++) {
            double s[4] = {0}, q[4] = {0}, sh = shift[k];
            for (int n = 0; n < d->n; n++) {
                const float *p = x + ((size_t)n * c + k) * hw;
                size_t i = 0;
                for (; i + 4 <= hw; i += 4)
                    for (int l = 0; l < 4; l++) {
                        double t = (double)p[i + l] - sh;
                        s[l] += t;
                        q[l] += t * t;
                    }
                for (; i < hw; i++) {
                    double t = (double)p[i] - sh;
                    s[0] += t;
                    q[0] += t * t;
                }
            }
            sum[k] = (s[0] + s[1]) + (s[2] + s[3]);
            sq[k] = (q[0] + q[1]) + (q[2] + q[3]);
        }
    }
    const double cnt = (double)d->n * hw;
    for (int k = 0; k < c; k++) {
        double m = sum[k] / cnt, v = sq[k] / cnt - m * m;
        mean[k] = (float)(shift[k] + m);
        resid[k] = (shift[k] + m) - mean[k];
        var[k] = (float)(v > 0 ? v : 0);
    }
}

static zps_status s_bn_get(k_bn *d, s_bn_impl **out)
{
    s_bn_impl *im = d->impl;
    if (im) {
        *out = im;
        return ZPS_OK;
    }
    ZPS_TRY(s_ready());
    im = zps_xcalloc(1, sizeof *im);
    im->head.kind = S_BN;
    d->impl = im;
    dnnl_memory_desc_t data;
    ZPS_TRY(s_md4(&data, d->n, d->c, d->h, d->w, s_act_tag(d->blocked)));
    im->acc = zps_xmalloc(sizeof(double) * 4 * (size_t)d->c);
    im->beta = zps_xmalloc(sizeof(float) * (size_t)d->c);
    /* training forward with the statistics as inputs 1 and 2 (s_bn_stats computes them) */
    dnnl_batch_normalization_desc_t bd;
    S_DNNL(dnnl_batch_normalization_forward_desc_init(&bd, dnnl_forward_training, &data, d->eps,
                                                      s_bn_flags(d) | dnnl_use_global_stats));
    ZPS_TRY(s_prim_create(&im->fwd, &bd, NULL));
    ZPS_TRY(s_prim_arg(&im->fwd, DNNL_ARG_SRC, dnnl_query_src_md));
    const dnnl_memory_desc_t *mmd = dnnl_primitive_desc_query_md(im->fwd.pd, dnnl_query_src_md, 1);
    for (int i = 0; i < 2; i++) {
        dnnl_memory_t m;
        S_DNNL(dnnl_memory_create(&m, mmd, s_engine, DNNL_MEMORY_NONE));
        im->fwd.args[im->fwd.nargs].arg = i == 0 ? DNNL_ARG_MEAN : DNNL_ARG_VARIANCE;
        im->fwd.args[im->fwd.nargs].memory = m;
        im->fwd.shared[im->fwd.nargs++] = 0;
    }
    ZPS_TRY(s_prim_arg(&im->fwd, DNNL_ARG_SCALE, dnnl_query_weights_md));
    ZPS_TRY(s_prim_arg(&im->fwd, DNNL_ARG_SHIFT, dnnl_query_weights_md));
    ZPS_TRY(s_prim_arg(&im->fwd, DNNL_ARG_DST, dnnl_query_dst_md));
    ZPS_TRY(s_workspace(&im->fwd, &im->ws));
    if (d->relu && !im->ws) { /* the backward needs the forward's ReLU mask */
        zps_log(ZPS_ERROR, "kernels", "batchnorm+ReLU %dx%dx%dx%d: no workspace", d->n, d->c,
                d->h, d->w);
        return ZPS_ERR_DNNL;
    }
    if (im->ws)
        s_prim_shared(&im->fwd, DNNL_ARG_WORKSPACE, im->ws);

    S_DNNL(dnnl_batch_normalization_backward_desc_init(&bd, dnnl_backward, &data, &data, d->eps,
                                                       s_bn_flags(d)));
    ZPS_TRY(s_prim_create(&im->bwd, &bd, im->fwd.pd));
    ZPS_TRY(s_prim_arg(&im->bwd, DNNL_ARG_SRC, dnnl_query_src_md));
    for (int i = 0; i < 2; i++) {
        dnnl_memory_t m;
        S_DNNL(dnnl_memory_create(&m, mmd, s_engine, DNNL_MEMORY_NONE));
        im->bwd.args[im->bwd.nargs].arg = i == 0 ? DNNL_ARG_MEAN : DNNL_ARG_VARIANCE;
        im->bwd.args[im->bwd.nargs].memory = m;
        im->bwd.shared[im->bwd.nargs++] = 0;
    }
    ZPS_TRY(s_prim_arg(&im->bwd, DNNL_ARG_DIFF_DST, dnnl_query_diff_dst_md));
    ZPS_TRY(s_prim_arg(&im->bwd, DNNL_ARG_SCALE, dnnl_query_weights_md));
    /* oneDNN 2.6 insists on a shift argument for use_shift backward; it never reads it */
    ZPS_TRY(s_prim_arg(&im->bwd, DNNL_ARG_SHIFT, dnnl_query_weights_md));
    ZPS_TRY(s_prim_arg(&im->bwd, DNNL_ARG_DIFF_SRC, dnnl_query_diff_src_md));
    ZPS_TRY(s_prim_arg(&im->bwd, DNNL_ARG_DIFF_SCALE, dnnl_query_diff_weights_md));
    ZPS_TRY(s_prim_arg(&im->bwd, DNNL_ARG_DIFF_SHIFT, dnnl_query_diff_weights_md));
    if (im->ws)
        s_prim_shared(&im->bwd, DNNL_ARG_WORKSPACE, im->ws);
    *out = im;
    return ZPS_OK;
}

static zps_status s_bn_fwd_train(k_bn *d, const float *x, const float *gamma,
                                 const float *beta, float *y, float *mean, float *var,
                                 float *run_mean, float *run_var)
{
    s_bn_impl *im;
    ZPS_TRY(s_bn_get(d, &im));
    /* The float mean is off by resid; oneDNN normalises with it, so the shift makes up for
     * that: gamma (x - mean - resid) / sd + beta = gamma (x - mean) / sd + (beta - gamma
     * resid / sd). Without this a channel with |mean|/std = 50 would be off by ~3e-6 of its
     * std, all in the same direction; with it y is within float rounding of ref's. */
    double *resid = im->acc + 3 * d->c;
    s_bn_stats(d, x, im->acc, mean, var, resid);
    for (int c = 0; c < d->c; c++)
        im->beta[c] = (float)(beta[c] - gamma[c] * resid[c] / sqrt((double)var[c] + d->eps));
    const void *ptrs[6] = {x, mean, var, gamma, im->beta, y};
    ZPS_TRY(s_prim_run(&im->fwd, ptrs, 6));
    float cnt = (float)d->n * d->h * d->w, m = d->momentum;
    float unbias = cnt > 1 ? cnt / (cnt - 1) : 1.0f;
    for (int c = 0; c < d->c; c++) {
        if (run_mean)
            run_mean[c] = (1.0f - m) * run_mean[c] + m * mean[c];
        if (run_var)
            run_var[c] = (1.0f - m) * run_var[c] + m * var[c] * unbias;
    }
    return ZPS_OK;
}

static zps_status s_bn_fwd_infer(k_bn *d, const float *x, const float *gamma,
                                 const float *beta, const float *run_mean,
                                 const float *run_var, float *y)
{
    s_bn_impl *im;
    ZPS_TRY(s_bn_get(d, &im));
    if (!im->have_infer) {
        dnnl_memory_desc_t data;
        ZPS_TRY(s_md4(&data, d->n, d->c, d->h, d->w, s_act_tag(d->blocked)));
        dnnl_batch_normalization_desc_t bd;
        S_DNNL(dnnl_batch_normalization_forward_desc_init(
            &bd, dnnl_forward_inference, &data, d->eps, s_bn_flags(d) | dnnl_use_global_stats));
        ZPS_TRY(s_prim_create(&im->infer, &bd, NULL));
        ZPS_TRY(s_prim_arg(&im->infer, DNNL_ARG_SRC, dnnl_query_src_md));
        for (int i = 0; i < 2; i++) {
            const dnnl_memory_desc_t *smd =
                dnnl_primitive_desc_query_md(im->infer.pd, dnnl_query_src_md, 1 + i);
            dnnl_memory_t m;
            S_DNNL(dnnl_memory_create(&m, smd, s_engine, DNNL_MEMORY_NONE));
            im->infer.args[im->infer.nargs].arg = i == 0 ? DNNL_ARG_MEAN : DNNL_ARG_VARIANCE;
            im->infer.args[im->infer.nargs].memory = m;
            im->infer.shared[im->infer.nargs++] = 0;
        }
        ZPS_TRY(s_prim_arg(&im->infer, DNNL_ARG_SCALE, dnnl_query_weights_md));
        ZPS_TRY(s_prim_arg(&im->infer, DNNL_ARG_SHIFT, dnnl_query_weights_md));
        ZPS_TRY(s_prim_arg(&im->infer, DNNL_ARG_DST, dnnl_query_dst_md));
        im->have_infer = 1;
    }
    const void *ptrs[6] = {x, run_mean, run_var, gamma, beta, y};
    return s_prim_run(&im->infer, ptrs, 6);
}

static zps_status s_bn_bwd(k_bn *d, const float *x, const float *y, const float *dy,
                           const float *gamma, const float *mean, const float *var, float *dx,
                           float *dgamma, float *dbeta)
{
    (void)y; /* the fused ReLU mask is in the workspace */
    s_bn_impl *im;
    ZPS_TRY(s_bn_get(d, &im));
    /* oneDNN always writes diff_src: without dx it goes to scratch, in the descriptor's own
     * layout (ref's loops would misread a blocked x, y and dy) */
    size_t total = dx ? 0 : (size_t)d->n * d->c * d->h * d->w;
    float *sc = s_scratch_get((size_t)2 * d->c + total);
    const void *ptrs[9] = {x, mean, var, dy, gamma, gamma, dx ? dx : sc + 2 * d->c, sc,
                           sc + d->c};
    ZPS_TRY(s_prim_run(&im->bwd, ptrs, 9));
    if (dgamma)
        s_acc((size_t)d->c, sc, dgamma);
    if (dbeta)
        s_acc((size_t)d->c, sc + d->c, dbeta);
    return ZPS_OK;
}

/* ---- pooling ---- */

typedef struct s_pool_impl {
    s_head head;
    s_prim fwd;        // src, dst [+ workspace]
    s_prim bwd;        // diff_dst, diff_src [+ workspace]
    dnnl_memory_t ws;  // max-pool argmax workspace (owned), or NULL
} s_pool_impl;

static zps_status s_pool_get(k_pool *d, s_pool_impl **out)
{
    s_pool_impl *im = d->impl;
    if (im) {
        *out = im;
        return ZPS_OK;
    }
    ZPS_TRY(s_ready());
    im = zps_xcalloc(1, sizeof *im);
    im->head.kind = S_POOL;
    d->impl = im;
    dnnl_memory_desc_t src, dst;
    ZPS_TRY(s_md4(&src, d->n, d->c, d->h, d->w, s_act_tag(d->blocked)));
    ZPS_TRY(s_md4(&dst, d->n, d->c, d->oh, d->ow, s_act_tag(d->blocked)));
    dnnl_dims_t strides = {d->stride_h, d->stride_w}, kernel = {d->r, d->s}, dil = {0, 0};
    dnnl_dims_t pl = {d->pad_h, d->pad_w};
    dnnl_dims_t pr = {(d->oh - 1) * d->stride_h + d->r - d->h - d->pad_h,
                      (d->ow - 1) * d->stride_w + d->s - d->w - d->pad_w};
    dnnl_alg_kind_t alg =
        d->kind == K_POOL_MAX ? dnnl_pooling_max : dnnl_pooling_avg_include_padding;
    dnnl_pooling_v2_desc_t pd;
    S_DNNL(dnnl_pooling_v2_forward_desc_init(&pd, dnnl_forward_training, alg, &src, &dst,
                                             strides, kernel, dil, pl, pr));
    ZPS_TRY(s_prim_create(&im->fwd, &pd, NULL));
    ZPS_TRY(s_prim_arg(&im->fwd, DNNL_ARG_SRC, dnnl_query_src_md));
    ZPS_TRY(s_prim_arg(&im->fwd, DNNL_ARG_DST, dnnl_query_dst_md));
    ZPS_TRY(s_workspace(&im->fwd, &im->ws));
    if (im->ws)
        s_prim_shared(&im->fwd, DNNL_ARG_WORKSPACE, im->ws);
    S_DNNL(dnnl_pooling_v2_backward_desc_init(&pd, alg, &src, &dst, strides, kernel, dil, pl,
                                              pr));
    ZPS_TRY(s_prim_create(&im->bwd, &pd, im->fwd.pd));
    ZPS_TRY(s_prim_arg(&im->bwd, DNNL_ARG_DIFF_DST, dnnl_query_diff_dst_md));
    ZPS_TRY(s_prim_arg(&im->bwd, DNNL_ARG_DIFF_SRC, dnnl_query_diff_src_md));
    if (im->ws)
        s_prim_shared(&im->bwd, DNNL_ARG_WORKSPACE, im->ws);
    *out = im;
    return ZPS_OK;
}

static zps_status s_pool_fwd(k_pool *d, const float *x, float *y)
{
    s_pool_impl *im;
    ZPS_TRY(s_pool_get(d, &im));
    const void *ptrs[2] = {x, y};
    return s_prim_run(&im->fwd, ptrs, 2);
}

static zps_status s_pool_bwd(k_pool *d, const float *x, const float *y, const float *dy,
                             float *dx)
{
    (void)x, (void)y;
    s_pool_impl *im;
    ZPS_TRY(s_pool_get(d, &im));
    const void *ptrs[2] = {dy, dx};
    return s_prim_run(&im->bwd, ptrs, 2);
}

/* ---- inner product ---- */

typedef struct s_dense_impl {
    s_head head;
    s_prim fwd;          // src, weights, bias, dst
    s_prim bwd_data;     // diff_dst, weights, diff_src
    s_prim bwd_weights;  // src, diff_dst, diff_weights, diff_bias
} s_dense_impl;

static zps_status s_dense_get(k_dense *d, s_dense_impl **out)
{
    s_dense_impl *im = d->impl;
    if (im) {
        *out = im;
        return ZPS_OK;
    }
    ZPS_TRY(s_ready());
    im = zps_xcalloc(1, sizeof *im);
    im->head.kind = S_DENSE;
    d->impl = im;
    dnnl_memory_desc_t src, wei, bia, dst;
    ZPS_TRY(s_md2(&src, d->n, d->in));
    ZPS_TRY(s_md2(&wei, d->out, d->in));
    ZPS_TRY(s_md1(&bia, d->out));
    ZPS_TRY(s_md2(&dst, d->n, d->out));
    dnnl_inner_product_desc_t id;
    S_DNNL(dnnl_inner_product_forward_desc_init(&id, dnnl_forward_training, &src, &wei, &bia,
                                                &dst));
    ZPS_TRY(s_prim_create(&im->fwd, &id, NULL));
    ZPS_TRY(s_prim_arg(&im->fwd, DNNL_ARG_SRC, dnnl_query_src_md));
    ZPS_TRY(s_prim_arg(&im->fwd, DNNL_ARG_WEIGHTS, dnnl_query_weights_md));
    {
        const dnnl_memory_desc_t *bmd =
            dnnl_primitive_desc_query_md(im->fwd.pd, dnnl_query_weights_md, 1);
        dnnl_memory_t m;
        S_DNNL(dnnl_memory_create(&m, bmd, s_engine, DNNL_MEMORY_NONE));
        im->fwd.args[im->fwd.nargs].arg = DNNL_ARG_BIAS;
        im->fwd.args[im->fwd.nargs].memory = m;
        im->fwd.shared[im->fwd.nargs++] = 0;
    }
    ZPS_TRY(s_prim_arg(&im->fwd, DNNL_ARG_DST, dnnl_query_dst_md));
    S_DNNL(dnnl_inner_product_backward_data_desc_init(&id, &src, &wei, &dst));
    ZPS_TRY(s_prim_create(&im->bwd_data, &id, im->fwd.pd));
    ZPS_TRY(s_prim_arg(&im->bwd_data, DNNL_ARG_DIFF_DST, dnnl_query_diff_dst_md));
    ZPS_TRY(s_prim_arg(&im->bwd_data, DNNL_ARG_WEIGHTS, dnnl_query_weights_md));
    ZPS_TRY(s_prim_arg(&im->bwd_data, DNNL_ARG_DIFF_SRC, dnnl_query_diff_src_md));
    S_DNNL(dnnl_inner_product_backward_weights_desc_init(&id, &src, &wei, &bia, &dst));
    ZPS_TRY(s_prim_create(&im->bwd_weights, &id, im->fwd.pd));
    ZPS_TRY(s_prim_arg(&im->bwd_weights, DNNL_ARG_SRC, dnnl_query_src_md));
    ZPS_TRY(s_prim_arg(&im->bwd_weights, DNNL_ARG_DIFF_DST, dnnl_query_diff_dst_md));
    ZPS_TRY(s_prim_arg(&im->bwd_weights, DNNL_ARG_DIFF_WEIGHTS, dnnl_query_diff_weights_md));
    {
        const dnnl_memory_desc_t *bmd =
            dnnl_primitive_desc_query_md(im->bwd_weights.pd, dnnl_query_diff_weights_md, 1);
        dnnl_memory_t m;
        S_DNNL(dnnl_memory_create(&m, bmd, s_engine, DNNL_MEMORY_NONE));
        im->bwd_weights.args[im->bwd_weights.nargs].arg = DNNL_ARG_DIFF_BIAS;
        im->bwd_weights.args[im->bwd_weights.nargs].memory = m;
        im->bwd_weights.shared[im->bwd_weights.nargs++] = 0;
    }
    *out = im;
    return ZPS_OK;
}

static zps_status s_dense_fwd(k_dense *d, const float *x, const float *w, const float *b,
                              float *y)
{
    s_dense_impl *im;
    ZPS_TRY(s_dense_get(d, &im));
    float *zero = NULL;
    if (!b) {
        zero = s_scratch_get((size_t)d->out);
        memset(zero, 0, sizeof(float) * (size_t)d->out);
        b = zero;
    }
    const void *ptrs[4] = {x, w, b, y};
    return s_prim_run(&im->fwd, ptrs, 4);
}

static zps_status s_dense_bwd(k_dense *d, const float *x, const float *w, const float *dy,
                              float *dx, float *dw, float *db)
{
    s_dense_impl *im;
    ZPS_TRY(s_dense_get(d, &im));
    if (dx) {
        const void *ptrs[3] = {dy, w, dx};
        ZPS_TRY(s_prim_run(&im->bwd_data, ptrs, 3));
    }
    if (dw || db) {
        size_t nw = (size_t)d->out * d->in;
        float *sw = s_scratch_get(nw + (size_t)d->out);
        const void *ptrs[4] = {x, dy, sw, sw + nw};
        ZPS_TRY(s_prim_run(&im->bwd_weights, ptrs, 4));
        if (dw)
            s_acc(nw, sw, dw);
        if (db)
            s_acc((size_t)d->out, sw + nw, db);
    }
    return ZPS_OK;
}

static void s_release(void **impl)
{
    s_head *h = *impl;
    if (!h)
        return;
    switch (h->kind) {
    case S_CONV: {
        s_conv_impl *im = (s_conv_impl *)h;
        if (im->conv) {
            s_prim_free(&im->conv->fwd);
            s_prim_free(&im->conv->bwd_data);
            s_prim_free(&im->conv->bwd_weights);
            s_prim_free(&im->conv->w_fwd.p);
            s_prim_free(&im->conv->w_bwd.p);
            s_prim_free(&im->conv->dw_back.p);
            zps_aligned_free(im->conv->wf);
            zps_aligned_free(im->conv->wb);
            zps_aligned_free(im->conv->dwb);
            free(im->conv);
        }
        break;
    }
    case S_BN: {
        s_bn_impl *im = (s_bn_impl *)h;
        s_prim_free(&im->fwd);
        s_prim_free(&im->infer);
        s_prim_free(&im->bwd);
        if (im->ws)
            dnnl_memory_destroy(im->ws);
        free(im->acc);
        free(im->beta);
        break;
    }
    case S_POOL: {
        s_pool_impl *im = (s_pool_impl *)h;
        s_prim_free(&im->fwd);
        s_prim_free(&im->bwd);
        if (im->ws)
            dnnl_memory_destroy(im->ws);
        break;
    }
    case S_DENSE: {
        s_dense_impl *im = (s_dense_impl *)h;
        s_prim_free(&im->fwd);
        s_prim_free(&im->bwd_data);
        s_prim_free(&im->bwd_weights);
        break;
    }
    }
    free(h);
    *impl = NULL;
}

static int s_prefers_blocked(int c) { return c > 0 && c % 16 == 0; }

static const k_backend s_cpu = {
    .name = "cpu",
    .host_memory = 1,
    .alloc = k_ref_alloc,
    .free = k_ref_free,
    .copy_in = k_ref_copy,
    .copy_out = k_ref_copy,
    .release = s_release,
    .prefers_blocked = s_prefers_blocked,
    .conv2d_fwd = s_conv2d_fwd,
    .conv2d_bwd = s_conv2d_bwd,
    .bn_fwd_train = s_bn_fwd_train,
    .bn_fwd_infer = s_bn_fwd_infer,
    .bn_bwd = s_bn_bwd,
    .pool_fwd = s_pool_fwd,
    .pool_bwd = s_pool_bwd,
    .dense_fwd = s_dense_fwd,
    .dense_bwd = s_dense_bwd,
    /* ref's loops, on the same host memory: these ops are memory-bound streams or tiny */
    .relu_fwd = k_ref_relu_fwd,
    .relu_bwd = k_ref_relu_bwd,
    .concat_fwd = k_ref_concat_fwd,
    .concat_bwd = k_ref_concat_bwd,
    .dropout_fwd = k_ref_dropout_fwd,
    .dropout_bwd = k_ref_dropout_bwd,
    .softmax_xent = k_ref_softmax_xent,
    .smooth_l1 = k_ref_smooth_l1,
    .fill = k_ref_fill,
    .add = k_ref_add,
    .scale = k_ref_scale,
    .axpy = k_ref_axpy,
    .sum = k_ref_sum,
    .sumsq = k_ref_sumsq,
};

const k_backend *k_backend_cpu(void) { return &s_cpu; }
