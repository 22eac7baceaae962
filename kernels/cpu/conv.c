/* conv.c — the cpu back-end's convolution (cpu_int.h): oneDNN forward, backward-data and
 * backward-weights primitives created together on first use of a descriptor.
 *
 * Weights stay KCRS in the caller's flat buffer. Each forward reorders them into the layout its
 * primitive picked (once per step); backward-data reuses that copy when it wants the same
 * layout and the weights pointer is the forward's (weights must not change between a forward
 * and its backward). The weight gradient comes back to KCRS through a reorder with a sum
 * post-op, which adds it into dw as the API requires; without a reorder it goes through
 * scratch and is added.
 */
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/mem.h"
#include "kernels/cpu/cpu_int.h"

/* A reorder between two layouts of the same tensor; p.p is NULL when they are equal. */
typedef struct s_reorder {
    k_cpu_prim p; // args: src, dst
} s_reorder;

static zps_status s_reorder_create(s_reorder *r, const dnnl_memory_desc_t *from,
                                   const dnnl_memory_desc_t *to, int accumulate)
{
    return k_cpu_reorder_create(&r->p, from, to, accumulate);
}

typedef struct s_conv {
    int has_bias;           // bias given at the first forward (fixed afterwards)
    k_cpu_prim fwd;         // args: src, weights, [bias], dst
    k_cpu_prim bwd_data;    // args: diff_dst, weights, diff_src
    k_cpu_prim bwd_weights; // args: src, diff_dst, diff_weights, [diff_bias]
    s_reorder w_fwd;        // plain weights -> forward layout
    s_reorder w_bwd;        // plain weights -> backward-data layout
    s_reorder dw_back;      // backward-weights layout -> plain
    float *wf, *wb, *dwb;   // reordered weights (forward, backward data), diff weights (owned)
    const float *wf_src;    // plain weights wf was made from by the last forward
    int same_w;             // backward data wants the forward's weight layout
} s_conv;

static float *s_layout_buf(const s_reorder *r, const k_cpu_prim *p, dnnl_query_t q)
{
    if (!r->p.p)
        return NULL;
    const dnnl_memory_desc_t *md = dnnl_primitive_desc_query_md(p->pd, q, 0);
    return zps_xaligned(64, dnnl_memory_desc_get_size(md) + 64);
}

/* The memory descriptors and geometry the three convolution primitives share. */
typedef struct s_conv_shape {
    dnnl_memory_desc_t src, wei, wplain, bia, dst; // wei: any layout; wplain: KCRS
    dnnl_dims_t strides, pl, pr;                    // strides, padding left/top, right/bottom
} s_conv_shape;

static zps_status s_conv_shape_init(const k_conv2d *d, s_conv_shape *g)
{
    ZPS_TRY(k_cpu_md4(&g->src, d->n, d->c, d->h, d->w, k_cpu_act_tag(d->x_blocked)));
    ZPS_TRY(k_cpu_md4(&g->wei, d->k, d->c, d->r, d->s, dnnl_format_tag_any));
    ZPS_TRY(k_cpu_md4(&g->wplain, d->k, d->c, d->r, d->s, dnnl_oihw));
    ZPS_TRY(k_cpu_md1(&g->bia, d->k));
    ZPS_TRY(k_cpu_md4(&g->dst, d->n, d->k, d->oh, d->ow, k_cpu_act_tag(d->y_blocked)));
    g->strides[0] = d->stride_h, g->strides[1] = d->stride_w;
    g->pl[0] = d->pad_h, g->pl[1] = d->pad_w;
    g->pr[0] = (d->oh - 1) * d->stride_h + d->r - d->h - d->pad_h;
    g->pr[1] = (d->ow - 1) * d->stride_w + d->s - d->w - d->pad_w;
    return ZPS_OK;
}

static const dnnl_memory_desc_t *s_md(const k_cpu_prim *p, dnnl_query_t q)
{
    return dnnl_primitive_desc_query_md(p->pd, q, 0);
}

static zps_status s_conv_fwd_create(s_conv *s, s_conv_shape *g)
{
    dnnl_convolution_desc_t cd;
    K_CPU_DNNL(dnnl_convolution_forward_desc_init(
        &cd, dnnl_forward_training, dnnl_convolution_direct, &g->src, &g->wei,
        s->has_bias ? &g->bia : NULL, &g->dst, g->strides, g->pl, g->pr));
    ZPS_TRY(k_cpu_prim_create(&s->fwd, &cd, NULL));
    ZPS_TRY(k_cpu_prim_arg(&s->fwd, DNNL_ARG_SRC, dnnl_query_src_md));
    ZPS_TRY(k_cpu_prim_arg(&s->fwd, DNNL_ARG_WEIGHTS, dnnl_query_weights_md));
    if (s->has_bias)
        ZPS_TRY(k_cpu_prim_arg_at(&s->fwd, DNNL_ARG_BIAS, dnnl_query_weights_md, 1));
    ZPS_TRY(k_cpu_prim_arg(&s->fwd, DNNL_ARG_DST, dnnl_query_dst_md));
    ZPS_TRY(s_reorder_create(&s->w_fwd, &g->wplain, s_md(&s->fwd, dnnl_query_weights_md), 0));
    s->wf = s_layout_buf(&s->w_fwd, &s->fwd, dnnl_query_weights_md);
    return ZPS_OK;
}

static zps_status s_conv_bwd_data_create(s_conv *s, s_conv_shape *g)
{
    dnnl_convolution_desc_t cd;
    K_CPU_DNNL(dnnl_convolution_backward_data_desc_init(&cd, dnnl_convolution_direct, &g->src,
                                                        &g->wei, &g->dst, g->strides, g->pl,
                                                        g->pr));
    ZPS_TRY(k_cpu_prim_create(&s->bwd_data, &cd, s->fwd.pd));
    ZPS_TRY(k_cpu_prim_arg(&s->bwd_data, DNNL_ARG_DIFF_DST, dnnl_query_diff_dst_md));
    ZPS_TRY(k_cpu_prim_arg(&s->bwd_data, DNNL_ARG_WEIGHTS, dnnl_query_weights_md));
    ZPS_TRY(k_cpu_prim_arg(&s->bwd_data, DNNL_ARG_DIFF_SRC, dnnl_query_diff_src_md));
    const dnnl_memory_desc_t *wbmd = s_md(&s->bwd_data, dnnl_query_weights_md);
    s->same_w = dnnl_memory_desc_equal(wbmd, s_md(&s->fwd, dnnl_query_weights_md));
    ZPS_TRY(s_reorder_create(&s->w_bwd, &g->wplain, wbmd, 0));
    s->wb = s_layout_buf(&s->w_bwd, &s->bwd_data, dnnl_query_weights_md);
    return ZPS_OK;
}

static zps_status s_conv_bwd_weights_create(s_conv *s, s_conv_shape *g)
{
    dnnl_convolution_desc_t cd;
    K_CPU_DNNL(dnnl_convolution_backward_weights_desc_init(
        &cd, dnnl_convolution_direct, &g->src, &g->wei, s->has_bias ? &g->bia : NULL, &g->dst,
        g->strides, g->pl, g->pr));
    k_cpu_prim *p = &s->bwd_weights;
    ZPS_TRY(k_cpu_prim_create(p, &cd, s->fwd.pd));
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_SRC, dnnl_query_src_md));
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_DIFF_DST, dnnl_query_diff_dst_md));
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_DIFF_WEIGHTS, dnnl_query_diff_weights_md));
    if (s->has_bias)
        ZPS_TRY(k_cpu_prim_arg_at(p, DNNL_ARG_DIFF_BIAS, dnnl_query_diff_weights_md, 1));
    ZPS_TRY(s_reorder_create(&s->dw_back, s_md(p, dnnl_query_diff_weights_md), &g->wplain, 1));
    s->dwb = s_layout_buf(&s->dw_back, p, dnnl_query_diff_weights_md);
    return ZPS_OK;
}

static zps_status s_conv_create(k_conv2d *d, int has_bias, s_conv **out)
{
    ZPS_TRY(k_cpu_ready());
    s_conv *s = zps_xcalloc(1, sizeof *s);
    s->has_bias = has_bias;
    *out = s;
    s_conv_shape g;
    ZPS_TRY(s_conv_shape_init(d, &g));
    ZPS_TRY(s_conv_fwd_create(s, &g));
    ZPS_TRY(s_conv_bwd_data_create(s, &g));
    return s_conv_bwd_weights_create(s, &g);
}

typedef struct s_conv_impl {
    k_cpu_head head;
    s_conv *conv;
} s_conv_impl;

static zps_status s_conv_get(k_conv2d *d, int has_bias, s_conv **out)
{
    s_conv_impl *im = d->impl;
    if (!im) {
        im = k_cpu_impl_new(&d->impl, K_CPU_CONV, sizeof *im);
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
    ZPS_TRY(k_cpu_prim_run(&r->p, ptrs, 2));
    *out = buf;
    return ZPS_OK;
}

zps_status k_cpu_conv2d_fwd(k_conv2d *d, const float *x, const float *w, const float *b,
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
    return k_cpu_prim_run(&s->fwd, ptrs, b ? 4 : 3);
}

/* db of a convolution created without bias (its primitive has no diff_bias): summed here,
 * from plain NCHW dy only. */
static zps_status s_bias_grad(const k_conv2d *d, const float *dy, float *db)
{
    if (d->y_blocked)
        return ZPS_ERR_INVALID;
    size_t ohw = (size_t)d->oh * d->ow;
    for (int n = 0; n < d->n; n++)
        for (int k = 0; k < d->k; k++) {
            const float *p = dy + ((size_t)n * d->k + k) * ohw;
            float acc = 0;
            for (size_t i = 0; i < ohw; i++)
                acc += p[i];
            db[k] += acc;
        }
    return ZPS_OK;
}

zps_status k_cpu_conv2d_bwd(k_conv2d *d, const float *x, const float *w, const float *dy,
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
        ZPS_TRY(k_cpu_prim_run(&s->bwd_data, ptrs, 3));
    }
    if (dw || db) {
        size_t nw = (size_t)d->k * d->c * d->r * d->s;
        float *sw = k_cpu_scratch(nw + (size_t)d->k);
        const void *ptrs[4] = {x, dy, s->dwb ? s->dwb : sw, sw + nw};
        ZPS_TRY(k_cpu_prim_run(&s->bwd_weights, ptrs, s->has_bias ? 4 : 3));
        if (s->dwb && dw) { /* back to KCRS, added into dw by the reorder itself */
            const void *rp[2] = {s->dwb, dw};
            ZPS_TRY(k_cpu_prim_run(&s->dw_back.p, rp, 2));
        } else if (dw) {
            k_cpu_acc(nw, sw, dw);
        }
        if (db) {
            if (s->has_bias) {
                k_cpu_acc((size_t)d->k, sw + nw, db);
            } else {
                ZPS_TRY(s_bias_grad(d, dy, db));
            }
        }
    }
    return ZPS_OK;
}

void k_cpu_conv_release(k_cpu_head *impl)
{
    s_conv *c = ((s_conv_impl *)impl)->conv;
    if (!c)
        return;
    k_cpu_prim_free(&c->fwd);
    k_cpu_prim_free(&c->bwd_data);
    k_cpu_prim_free(&c->bwd_weights);
    k_cpu_prim_free(&c->w_fwd.p);
    k_cpu_prim_free(&c->w_bwd.p);
    k_cpu_prim_free(&c->dw_back.p);
    zps_aligned_free(c->wf);
    zps_aligned_free(c->wb);
    zps_aligned_free(c->dwb);
    free(c);
}
