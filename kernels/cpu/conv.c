/* conv.c — the cpu back-end's convolution (cpu_int.h): oneDNN forward, backward-data and
 * backward-weights primitives created together on first use of a descriptor.
 *
 * Weights stay KCRS in the caller's flat buffer. Each forward reorders them into the layout its
 * primitive picked (once per step); backward-data reuses that copy when it wants the same
 * layout and the weights pointer is the forward's (weights must not change between a forward
 * and its backward). The weight gradient comes back to KCRS through a reorder with a sum
 * post-op, which adds it into dw as the API requires; without a reorder it goes through
 * scratch and is added.
 *
 * Activations: the descriptor's layouts where oneDNN has a direct kernel for the pair and no
 * primitive comes out as its reference implementation; otherwise the primitives take the
 * layouts oneDNN picks and x, y, dy, dx are reordered at the convolution's edges, through the
 * thread's scratch (s_conv_create, s_edge); there dx keeps x's 8-channel blocks where oneDNN
 * would pad its channels to 16 (s_bwd_data_src).
 *
 * bf16 (k_conv2d.bf16): the primitives read x, w and dy as bfloat16 (oneDNN's bf16 kernels,
 * native with AVX512_BF16) and write y, dx and dw as float, so the edges always reorder the
 * inputs, converting as they go (round to nearest even, zps_bf16_round's rounding), and the
 * outputs only where the layouts differ. In 16-channel blocks on both sides (oneDNN 2.6's
 * plain-layout bf16 forward wrote garbage at the right padding of a 1x5 kernel over 15
 * channels), except on CPUs with AMX, whose kernels take channels-last only (s_amx): there
 * each shape runs channels-last only when its three primitives give the blocked ones' results
 * on random data at creation, as oneDNN 2.6's AMX kernels miscompute some shapes (s_agree);
 * never Winograd. Where oneDNN has no bf16 kernel for a shape (its thin layers, under 16 channels)
 * the float primitives run on copies of x, w and dy rounded to bfloat16 ("emulate"): the
 * same results, as products of bf16 values are exact in float.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
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

/* An activation's reorder at the convolution's edge: used where the tensor's layout is not
 * one the primitives run on directly (s_conv_shape_init); r.p.p NULL otherwise. The
 * primitive's side lives in this thread's scratch for the length of one call (s_edge_scratch),
 * so a convolution holds no activation-sized buffers between calls. */
typedef struct s_edge {
    s_reorder r;
    size_t len; // floats of the primitive's side, rounded to 16 (64 bytes); 0 without reorder
} s_edge;

static zps_status s_edge_create(s_edge *e, const dnnl_memory_desc_t *from,
                                const dnnl_memory_desc_t *to, const dnnl_memory_desc_t *prim)
{
    ZPS_TRY(s_reorder_create(&e->r, from, to, 0));
    e->len = e->r.p.p ? (dnnl_memory_desc_get_size(prim) / sizeof(float) + 15) & ~(size_t)15 : 0;
    return ZPS_OK;
}

/* Scratch for two edges and `extra` floats after them: a's slice, b's slice, then extra. */
static float *s_edge_scratch(const s_edge *a, const s_edge *b, size_t extra, float **pa,
                             float **pb)
{
    float *sc = k_cpu_scratch(a->len + b->len + extra);
    *pa = sc, *pb = sc + a->len;
    return sc + a->len + b->len;
}

/* An input as the primitive wants it: t itself, or t reordered into buf. */
static zps_status s_edge_in(s_edge *e, float *buf, const float *t, const float **out)
{
    *out = t;
    if (!e->r.p.p)
        return ZPS_OK;
    const void *ptrs[2] = {t, buf};
    ZPS_TRY(k_cpu_prim_run(&e->r.p, ptrs, 2));
    *out = buf;
    return ZPS_OK;
}

/* Where the primitive writes an output: t itself, or buf (then s_edge_out). */
static float *s_edge_dst(s_edge *e, float *buf, float *t) { return e->r.p.p ? buf : t; }
static zps_status s_edge_out(s_edge *e, float *buf, float *t)
{
    if (!e->r.p.p)
        return ZPS_OK;
    const void *ptrs[2] = {buf, t};
    return k_cpu_prim_run(&e->r.p, ptrs, 2);
}

static void s_edge_free(s_edge *e) { k_cpu_prim_free(&e->r.p); }

typedef struct s_conv {
    int has_bias;           // bias given at the first forward (fixed afterwards)
    int wbias;              // backward weights computes the bias gradient too (not in bf16:
                            // oneDNN's bf16 diff_bias is coarser than float dy's sum)
    int emulate;            // bf16 asked, no bf16 kernel: float kernels on rounded copies
    k_cpu_prim fwd;         // args: src, weights, [bias], dst
    k_cpu_prim bwd_data;    // args: diff_dst, weights, diff_src
    k_cpu_prim bwd_weights; // args: src, diff_dst, diff_weights, [diff_bias]
    s_reorder w_fwd;        // plain weights -> forward layout
    s_reorder w_bwd;        // plain weights -> backward-data layout
    s_reorder dw_back;      // backward-weights layout -> plain
    float *wf, *wb, *dwb;   // reordered weights (forward, backward data), diff weights (owned)
    s_edge x_in, x_in_w;    // x -> forward src, -> backward-weights src
    s_edge y_out;           // forward dst -> y
    s_edge dy_in, dy_in_w;  // dy -> backward-data diff_dst, -> backward-weights diff_dst
    s_edge dx_out;          // backward-data diff_src -> dx
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
    dnnl_memory_desc_t ddst, dsrc, dwei; // diff_dst, diff_src, diff_weights: dst, src, wei's,
                                         // in float where bf16 makes those bfloat16 (and dy
                                         // bfloat16 where dst is float)
    dnnl_memory_desc_t xt, yt; // x and y in the tensors' layouts (src, dst: the primitives')
    dnnl_dims_t strides, pl, pr;                    // strides, padding left/top, right/bottom
} s_conv_shape;

/* 1 when both channel counts padded to 16 make less than 1.6 times the work (40 channels and
 * up) on a CPU with AVX-512: 8-blocks on both sides run oneDNN's AVX2 kernels, and its
 * 16-blocked AVX-512 ones with the padding and reorders at the edges are then faster
 * (Inception-v3 at width 0.25: 2-3% of its one-thread step). */
static int s_pad16_pays(const k_conv2d *d)
{
    if (!k_cpu_has_avx512()) /* no 16-wide kernels to pad for */
        return 0;
    long c16 = (d->c + 15) / 16 * 16, k16 = (d->k + 15) / 16 * 16;
    return c16 * k16 * 5 < (long)d->c * d->k * 8;
}

/* Layout pairs oneDNN's direct (jit) convolutions take as they are: the same layout on both
 * sides, or a first layer's few plain input channels into a blocked output. Any other pair
 * (a thin model's 16-blocks into 8-blocks, 12 plain channels into blocks) would get its
 * reference implementation, hundreds of times slower: such a convolution runs in the layouts
 * oneDNN picks and reorders x, y, dy and dx at its edges; so does an 8-block pair where
 * 16-blocks pay (s_pad16_pays). */
static int s_native(const k_conv2d *d)
{
    if (d->x_blocked == K_BLOCK8 && d->y_blocked == K_BLOCK8 && s_pad16_pays(d))
        return 0;
    return d->x_blocked == d->y_blocked || (!d->x_blocked && d->c < 8);
}

/* 1 where a bf16 convolution may run channels-last on AMX. oneDNN 2.6's AMX kernels
 * (Sapphire Rapids and later: brgconv forward, jit backward) take channels-last (nhwc) only;
 * given 16-channel blocks it runs its AVX512_BF16 kernels instead, at half the speed
 * (Inception-v3 at 139x32, a step: 23 img/s in blocks, 45 in nhwc). ZPS_CPU_NO_AMX=1 keeps
 * the blocks on an AMX CPU (the tests run both), as does ZPS_CPU_NO_AVX512; read at each
 * convolution's creation. */
static int s_amx(void)
{
    const char *e = getenv("ZPS_CPU_NO_AMX");
    unsigned isa = (unsigned)dnnl_get_effective_cpu_isa();
    unsigned amx = (unsigned)dnnl_cpu_isa_avx512_core_amx; /* a superset's bits include it */
    return !(e && *e && strcmp(e, "0")) && k_cpu_has_avx512() && (isa & amx) == amx;
}

/* Where the primitives' activations are laid out: the tensors' own layouts, or the ones
 * oneDNN picks (bf16: 16-channel blocks), or bf16 channels-last (s_amx). */
enum { S_TENSORS = 0, S_PICKED = 1, S_CHANNELS_LAST = 2 };

static zps_status s_conv_shape_init(const k_conv2d *d, int any, s_conv_shape *g)
{
    ZPS_TRY(k_cpu_md4(&g->xt, d->n, d->c, d->h, d->w, k_cpu_act_tag(d->x_blocked)));
    ZPS_TRY(k_cpu_md4(&g->wei, d->k, d->c, d->r, d->s, dnnl_format_tag_any));
    ZPS_TRY(k_cpu_md4(&g->wplain, d->k, d->c, d->r, d->s, dnnl_oihw));
    ZPS_TRY(k_cpu_md1(&g->bia, d->k));
    ZPS_TRY(k_cpu_md4(&g->yt, d->n, d->k, d->oh, d->ow, k_cpu_act_tag(d->y_blocked)));
    g->src = g->xt, g->dst = g->yt;
    if (any) { /* oneDNN picks; the edges reorder */
        ZPS_TRY(k_cpu_md4(&g->src, d->n, d->c, d->h, d->w, dnnl_format_tag_any));
        ZPS_TRY(k_cpu_md4(&g->dst, d->n, d->k, d->oh, d->ow, dnnl_format_tag_any));
    }
    if (d->bf16) { /* one layout on both sides: see the file's top */
        dnnl_format_tag_t tag = any == S_CHANNELS_LAST ? dnnl_nhwc : dnnl_nChw16c;
        ZPS_TRY(k_cpu_md4(&g->src, d->n, d->c, d->h, d->w, tag));
        ZPS_TRY(k_cpu_md4(&g->dst, d->n, d->k, d->oh, d->ow, tag));
    }
    g->ddst = g->dst, g->dsrc = g->src, g->dwei = g->wei;
    if (d->bf16) /* the products' inputs; outputs and gradients' results stay float */
        g->src.data_type = g->wei.data_type = g->ddst.data_type = dnnl_bf16;
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

/* 1 where oneDNN's Winograd forward (F(4x4, 3x3), jit_wino_4x3 on AVX-512) was measured
 * faster than its direct kernel, one thread, batch 32: the convnet's 32-to-64 3x3 at 14x14
 * (0.89 ms to 0.58) and the thin Inception's 20-to-48 at 15x15 (0.85 to 0.55). Slower at 7x7
 * and below (16-to-24 at 7x7: 0.055 to 0.071; 1x1 maps: 25x) and with 8 input channels
 * (8-to-16 at 35x35: 0.42 to 0.65); larger maps were not measured and stay direct. Backward
 * data and weights stay direct: oneDNN's Winograd there was no faster on these shapes. */
static int s_wino_pays(const k_conv2d *d)
{
    return !d->bf16 && d->r == 3 && d->s == 3 && d->stride_h == 1 && d->stride_w == 1 && d->c >= 16 &&
           d->oh >= 12 && d->ow >= 12 && d->oh <= 32 && d->ow <= 32;
}

static dnnl_status_t s_fwd_desc(const s_conv *s, const s_conv_shape *g, dnnl_alg_kind_t alg,
                                dnnl_convolution_desc_t *cd)
{
    return dnnl_convolution_forward_desc_init(cd, dnnl_forward_training, alg, &g->src, &g->wei,
                                              s->has_bias ? &g->bia : NULL, &g->dst,
                                              g->strides, g->pl, g->pr);
}

/* 1 when oneDNN has a Winograd kernel for cd; asked without logging, as many shapes and
 * layouts (8-channel blocks, machines without AVX-512) have none. */
static int s_wino_fwd(const dnnl_convolution_desc_t *cd)
{
    dnnl_primitive_desc_t pd;
    if (dnnl_primitive_desc_create(&pd, cd, NULL, k_cpu_engine(), NULL) != dnnl_success)
        return 0;
    const char *impl = NULL;
    dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
    int ok = impl && strstr(impl, "wino") != NULL;
    dnnl_primitive_desc_destroy(pd);
    return ok;
}

/* The forward: Winograd where it pays and oneDNN has it, direct otherwise. */
static zps_status s_conv_fwd_create(const k_conv2d *d, s_conv *s, s_conv_shape *g)
{
    dnnl_convolution_desc_t cd;
    if (!s_wino_pays(d) || s_fwd_desc(s, g, dnnl_convolution_winograd, &cd) != dnnl_success ||
        !s_wino_fwd(&cd))
        K_CPU_DNNL(s_fwd_desc(s, g, dnnl_convolution_direct, &cd));
    ZPS_TRY(k_cpu_prim_create(&s->fwd, &cd, NULL));
    ZPS_TRY(k_cpu_prim_arg(&s->fwd, DNNL_ARG_SRC, dnnl_query_src_md));
    ZPS_TRY(k_cpu_prim_arg(&s->fwd, DNNL_ARG_WEIGHTS, dnnl_query_weights_md));
    if (s->has_bias)
        ZPS_TRY(k_cpu_prim_arg_at(&s->fwd, DNNL_ARG_BIAS, dnnl_query_weights_md, 1));
    ZPS_TRY(k_cpu_prim_arg(&s->fwd, DNNL_ARG_DST, dnnl_query_dst_md));
    ZPS_TRY(s_reorder_create(&s->w_fwd, &g->wplain, s_md(&s->fwd, dnnl_query_weights_md), 0));
    s->wf = s_layout_buf(&s->w_fwd, &s->fwd, dnnl_query_weights_md);
    const dnnl_memory_desc_t *src = s_md(&s->fwd, dnnl_query_src_md);
    const dnnl_memory_desc_t *dst = s_md(&s->fwd, dnnl_query_dst_md);
    ZPS_TRY(s_edge_create(&s->x_in, &g->xt, src, src));
    return s_edge_create(&s->y_out, dst, &g->yt, dst);
}

/* diff_src of backward data. Where oneDNN picks the layouts and x is in 8-channel blocks
 * whose count padded to 16 is more than 1.5 times the work, x's own 8-blocks: oneDNN's pick
 * pads them to 16-blocks and its kernel computes the padding too (Inception-v3 at width
 * 0.25: 8 channels at 35x35, 5 ms where 8-blocks take 0.9). */
static const dnnl_memory_desc_t *s_bwd_data_src(const k_conv2d *d, const s_conv_shape *g)
{
    int c16 = (d->c + 15) / 16 * 16;
    return d->x_blocked && c16 * 2 > d->c * 3 ? &g->xt : &g->dsrc;
}

static zps_status s_conv_bwd_data_create(const k_conv2d *d, s_conv *s, s_conv_shape *g)
{
    dnnl_convolution_desc_t cd;
    K_CPU_DNNL(dnnl_convolution_backward_data_desc_init(&cd, dnnl_convolution_direct,
                                                        s_bwd_data_src(d, g), &g->wei, &g->ddst,
                                                        g->strides, g->pl, g->pr));
    ZPS_TRY(k_cpu_prim_create(&s->bwd_data, &cd, s->fwd.pd));
    ZPS_TRY(k_cpu_prim_arg(&s->bwd_data, DNNL_ARG_DIFF_DST, dnnl_query_diff_dst_md));
    ZPS_TRY(k_cpu_prim_arg(&s->bwd_data, DNNL_ARG_WEIGHTS, dnnl_query_weights_md));
    ZPS_TRY(k_cpu_prim_arg(&s->bwd_data, DNNL_ARG_DIFF_SRC, dnnl_query_diff_src_md));
    const dnnl_memory_desc_t *wbmd = s_md(&s->bwd_data, dnnl_query_weights_md);
    s->same_w = dnnl_memory_desc_equal(wbmd, s_md(&s->fwd, dnnl_query_weights_md));
    ZPS_TRY(s_reorder_create(&s->w_bwd, &g->wplain, wbmd, 0));
    s->wb = s_layout_buf(&s->w_bwd, &s->bwd_data, dnnl_query_weights_md);
    const dnnl_memory_desc_t *ddst = s_md(&s->bwd_data, dnnl_query_diff_dst_md);
    const dnnl_memory_desc_t *dsrc = s_md(&s->bwd_data, dnnl_query_diff_src_md);
    ZPS_TRY(s_edge_create(&s->dy_in, &g->yt, ddst, ddst));
    return s_edge_create(&s->dx_out, dsrc, &g->xt, dsrc);
}

static zps_status s_conv_bwd_weights_create(s_conv *s, s_conv_shape *g)
{
    dnnl_convolution_desc_t cd;
    K_CPU_DNNL(dnnl_convolution_backward_weights_desc_init(
        &cd, dnnl_convolution_direct, &g->src, &g->dwei, s->wbias ? &g->bia : NULL, &g->ddst,
        g->strides, g->pl, g->pr));
    k_cpu_prim *p = &s->bwd_weights;
    ZPS_TRY(k_cpu_prim_create(p, &cd, s->fwd.pd));
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_SRC, dnnl_query_src_md));
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_DIFF_DST, dnnl_query_diff_dst_md));
    ZPS_TRY(k_cpu_prim_arg(p, DNNL_ARG_DIFF_WEIGHTS, dnnl_query_diff_weights_md));
    if (s->wbias)
        ZPS_TRY(k_cpu_prim_arg_at(p, DNNL_ARG_DIFF_BIAS, dnnl_query_diff_weights_md, 1));
    ZPS_TRY(s_reorder_create(&s->dw_back, s_md(p, dnnl_query_diff_weights_md), &g->wplain, 1));
    s->dwb = s_layout_buf(&s->dw_back, p, dnnl_query_diff_weights_md);
    const dnnl_memory_desc_t *src = s_md(p, dnnl_query_src_md);
    const dnnl_memory_desc_t *ddst = s_md(p, dnnl_query_diff_dst_md);
    ZPS_TRY(s_edge_create(&s->x_in_w, &g->xt, src, src));
    return s_edge_create(&s->dy_in_w, &g->yt, ddst, ddst);
}

/* 1 when oneDNN gave primitive p its reference implementation. */
static int s_is_ref(const k_cpu_prim *p)
{
    const char *impl = NULL;
    dnnl_primitive_desc_query(p->pd, dnnl_query_impl_info_str, 0, &impl);
    return impl && strncmp(impl, "ref", 3) == 0;
}

static void s_conv_free(s_conv *c);

/* wbias: the backward-weights primitive sums db too (not where dy is rounded to bf16). */
static zps_status s_conv_try(k_conv2d *d, int has_bias, int wbias, int any, s_conv **out)
{
    s_conv *s = zps_xcalloc(1, sizeof *s);
    s->has_bias = has_bias;
    s->wbias = wbias;
    *out = s;
    s_conv_shape g;
    ZPS_TRY(s_conv_shape_init(d, any, &g));
    ZPS_TRY(s_conv_fwd_create(d, s, &g));
    ZPS_TRY(s_conv_bwd_data_create(d, s, &g));
    return s_conv_bwd_weights_create(s, &g);
}

/* The tensors' own layouts where oneDNN runs them directly (s_native) with no reference
 * implementation among the three primitives (some shapes have no direct backward-weights
 * kernel for 8-channel blocks or a plain first layer); otherwise the layouts oneDNN picks. */
static int s_any_ref(const s_conv *s)
{
    return s_is_ref(&s->fwd) || s_is_ref(&s->bwd_data) || s_is_ref(&s->bwd_weights);
}

static zps_status s_conv_create_f32(k_conv2d *d, int has_bias, int wbias, s_conv **out);
static zps_status s_fwd(s_conv *s, const k_conv2d *d, const float *x, const float *w,
                        const float *b, float *y);
static zps_status s_bwd(s_conv *s, const k_conv2d *d, const float *x, const float *w,
                        const float *dy, float *dx, float *dw, float *db);

/* Floats rounded up to 64 bytes. */
static size_t s_r16(size_t n) { return (n + 15) & ~(size_t)15; }

/* The largest |a - b| over n floats, and the largest |b|. */
static void s_diff(size_t n, const float *a, const float *b, double *diff, double *mag)
{
    for (size_t i = 0; i < n; i++) {
        *diff = fmax(*diff, fabs((double)a[i] - b[i]));
        *mag = fmax(*mag, fabs((double)b[i]));
    }
}

/* 1 when convolution a gives b's y, dx and dw for d on random inputs (in d's layouts, with a
 * bias when a has one), within 1e-3 of each result's largest value: summation orders differ
 * by ~1e-6 of it, the AMX kernels' wrong shapes by 2% to all of it. Once per shape, at
 * creation; the buffers are the check's own. */
static int s_agree(const k_conv2d *d, s_conv *a, s_conv *b)
{
    size_t nx = (size_t)d->n * d->c * d->h * d->w, nw = (size_t)d->k * d->c * d->r * d->s;
    size_t ny = (size_t)d->n * d->k * d->oh * d->ow, nb = (size_t)d->k;
    enum { X, W, B, DY, YA, YB, DXA, DXB, DWA, DWB, N };
    size_t len[N] = {nx, nw, nb, ny, ny, ny, nx, nx, nw, nw}, off[N + 1] = {0};
    for (int i = 0; i < N; i++)
        off[i + 1] = off[i] + s_r16(len[i]);
    float *buf = zps_xaligned(64, off[N] * sizeof(float));
    float *t[N];
    for (int i = 0; i < N; i++)
        t[i] = buf + off[i];
    uint32_t r = 0x9e3779b9u;
    for (size_t i = 0; i < off[YA]; i++) { /* x, w, b, dy: uniform in [-1, 1) */
        r = r * 1664525u + 1013904223u;
        buf[i] = (float)(r >> 8) * (2.0f / 16777216.0f) - 1.0f;
    }
    memset(t[DWA], 0, (off[N] - off[DWA]) * sizeof(float)); /* dw accumulates */
    const float *bias = a->has_bias ? t[B] : NULL;
    double dy = 0, my = 0, dx = 0, mx = 0, dw = 0, mw = 0;
    int ok = s_fwd(a, d, t[X], t[W], bias, t[YA]) == ZPS_OK &&
             s_fwd(b, d, t[X], t[W], bias, t[YB]) == ZPS_OK &&
             s_bwd(a, d, t[X], t[W], t[DY], t[DXA], t[DWA], NULL) == ZPS_OK &&
             s_bwd(b, d, t[X], t[W], t[DY], t[DXB], t[DWB], NULL) == ZPS_OK;
    if (ok) {
        s_diff(ny, t[YA], t[YB], &dy, &my);
        s_diff(nx, t[DXA], t[DXB], &dx, &mx);
        s_diff(nw, t[DWA], t[DWB], &dw, &mw);
        ok = dy <= 1e-3 * my && dx <= 1e-3 * mx && dw <= 1e-3 * mw;
        if (!ok)
            zps_log(ZPS_INFO, "kernels", "bf16 conv %dx%dx%dx%d k%d %dx%d s%d,%d p%d,%d: oneDNN's "
                    "AMX kernels are off by %.2g, %.2g, %.2g of y, dx, dw: it runs in 16-channel "
                    "blocks", d->n, d->c, d->h, d->w, d->k, d->r, d->s, d->stride_h, d->stride_w,
                    d->pad_h, d->pad_w, dy / fmax(my, 1e-30), dx / fmax(mx, 1e-30),
                    dw / fmax(mw, 1e-30));
    }
    a->wf_src = b->wf_src = NULL; /* their weight copies are of the check's weights */
    zps_aligned_free(buf);
    return ok;
}

/* A bf16 convolution: oneDNN's bf16 kernels in 16-channel blocks, or its float ones on
 * rounded copies where it has none for the shape ("emulate"); on AMX, channels-last where
 * that agrees with them (s_agree). */
static zps_status s_conv_create_bf16(k_conv2d *d, int has_bias, s_conv **out)
{
    s_conv *blk = NULL, *amx = NULL;
    zps_status st = s_conv_try(d, has_bias, 0, S_PICKED, &blk);
    if (st != ZPS_OK || s_any_ref(blk)) {
        s_conv_free(blk); /* no bf16 kernel for this shape: float ones on rounded copies */
        k_conv2d f = *d;
        f.bf16 = 0;
        blk = NULL;
        ZPS_TRY(s_conv_create_f32(&f, has_bias, 0, &blk));
        blk->emulate = 1;
    }
    if (s_amx()) {
        st = s_conv_try(d, has_bias, 0, S_CHANNELS_LAST, &amx);
        if (st == ZPS_OK && !s_any_ref(amx) && s_agree(d, amx, blk)) {
            s_conv_free(blk);
            *out = amx;
            return ZPS_OK;
        }
        s_conv_free(amx);
    }
    *out = blk;
    return ZPS_OK;
}

static zps_status s_conv_create(k_conv2d *d, int has_bias, s_conv **out)
{
    ZPS_TRY(k_cpu_ready());
    if (d->bf16)
        return s_conv_create_bf16(d, has_bias, out);
    return s_conv_create_f32(d, has_bias, has_bias, out);
}

static zps_status s_conv_create_f32(k_conv2d *d, int has_bias, int wbias, s_conv **out)
{
    if (s_native(d)) {
        zps_status st = s_conv_try(d, has_bias, wbias, S_TENSORS, out);
        if (st == ZPS_OK && !s_any_ref(*out))
            return ZPS_OK;
        s_conv_free(*out);
        *out = NULL;
    }
    return s_conv_try(d, has_bias, wbias, S_PICKED, out);
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


/* emulate: the inputs of a product rounded to bfloat16 into the scratch at *at (advanced). */
static const float *s_rounded(const s_conv *s, const float *t, size_t n, float **at)
{
    if (!s->emulate)
        return t;
    float *r = *at;
    k_cpu_round_bf16(n, t, r);
    *at += s_r16(n);
    return r;
}

zps_status k_cpu_conv2d_fwd(k_conv2d *d, const float *x, const float *w, const float *b,
                            float *y)
{
    s_conv *s;
    ZPS_TRY(s_conv_get(d, b != NULL, &s));
    if (s->has_bias != (b != NULL))
        return ZPS_ERR_INVALID;
    return s_fwd(s, d, x, w, b, y);
}

static zps_status s_fwd(s_conv *s, const k_conv2d *d, const float *x, const float *w,
                        const float *b, float *y)
{
    size_t nx = (size_t)d->n * d->c * d->h * d->w, nw = (size_t)d->k * d->c * d->r * d->s;
    float *xb, *yb;
    float *at = s_edge_scratch(&s->x_in, &s->y_out, s->emulate ? s_r16(nx) + s_r16(nw) : 0,
                               &xb, &yb);
    x = s_rounded(s, x, nx, &at);
    const float *wr = s_rounded(s, w, nw, &at), *wl;
    ZPS_TRY(s_weights(&s->w_fwd, wr, s->wf, &wl));
    s->wf_src = w; /* emulate: wf holds w's rounded copy, reordered: the same for backward */
    ZPS_TRY(s_edge_in(&s->x_in, xb, x, &x));
    float *yp = s_edge_dst(&s->y_out, yb, y);
    const void *ptrs[4] = {x, wl, b, yp};
    if (!b)
        ptrs[2] = yp;
    ZPS_TRY(k_cpu_prim_run(&s->fwd, ptrs, b ? 4 : 3));
    return s_edge_out(&s->y_out, yb, y);
}

/* db where the backward-weights primitive does not sum it (a convolution created without
 * bias, or bf16): summed here from float dy, in its layout (channel blocks of bs). */
static zps_status s_bias_grad(const k_conv2d *d, const float *dy, float *db)
{
    size_t ohw = (size_t)d->oh * d->ow, bs = (size_t)k_block_size(d->y_blocked);
    for (int n = 0; n < d->n; n++)
        for (int k = 0; k < d->k; k++) {
            const float *p = dy + (((size_t)n * (d->k / bs) + k / bs) * ohw) * bs + k % bs;
            float acc = 0;
            for (size_t i = 0; i < ohw; i++)
                acc += p[i * bs];
            db[k] += acc;
        }
    return ZPS_OK;
}

zps_status k_cpu_conv2d_bwd(k_conv2d *d, const float *x, const float *w, const float *dy,
                            float *dx, float *dw, float *db)
{
    s_conv *s;
    ZPS_TRY(s_conv_get(d, db != NULL, &s));
    return s_bwd(s, d, x, w, dy, dx, dw, db);
}

static zps_status s_bwd(s_conv *s, const k_conv2d *d, const float *x, const float *w,
                        const float *dy, float *dx, float *dw, float *db)
{
    size_t nx = (size_t)d->n * d->c * d->h * d->w, nw = (size_t)d->k * d->c * d->r * d->s;
    size_t ny = (size_t)d->n * d->k * d->oh * d->ow;
    if (dx) {
        const float *wl, *dyp;
        float *dyb, *dxb;
        float *at = s_edge_scratch(&s->dy_in, &s->dx_out,
                                   s->emulate ? s_r16(nw) + s_r16(ny) : 0, &dyb, &dxb);
        if (s->same_w && s->wf && s->wf_src == w) /* reordered by this step's forward */
            wl = s->wf;
        else
            ZPS_TRY(s_weights(&s->w_bwd, s_rounded(s, w, nw, &at), s->wb, &wl));
        ZPS_TRY(s_edge_in(&s->dy_in, dyb, s_rounded(s, dy, ny, &at), &dyp));
        const void *ptrs[3] = {dyp, wl, s_edge_dst(&s->dx_out, dxb, dx)};
        ZPS_TRY(k_cpu_prim_run(&s->bwd_data, ptrs, 3));
        ZPS_TRY(s_edge_out(&s->dx_out, dxb, dx));
    }
    if (dw || db) {
        const float *xp, *dyp;
        float *xb, *dyb;
        size_t own = s_r16(nw + (size_t)d->k); /* dw and db, where no reorder gives them */
        float *sw = s_edge_scratch(&s->x_in_w, &s->dy_in_w,
                                   own + (s->emulate ? s_r16(nx) + s_r16(ny) : 0), &xb, &dyb);
        float *at = sw + own;
        ZPS_TRY(s_edge_in(&s->x_in_w, xb, s_rounded(s, x, nx, &at), &xp));
        ZPS_TRY(s_edge_in(&s->dy_in_w, dyb, s_rounded(s, dy, ny, &at), &dyp));
        const void *ptrs[4] = {xp, dyp, s->dwb ? s->dwb : sw, sw + nw};
        ZPS_TRY(k_cpu_prim_run(&s->bwd_weights, ptrs, s->wbias ? 4 : 3));
        if (s->dwb && dw) { /* back to KCRS, added into dw by the reorder itself */
            const void *rp[2] = {s->dwb, dw};
            ZPS_TRY(k_cpu_prim_run(&s->dw_back.p, rp, 2));
        } else if (dw) {
            k_cpu_acc(nw, sw, dw);
        }
        if (db && s->wbias)
            k_cpu_acc((size_t)d->k, sw + nw, db);
        else if (db)
            ZPS_TRY(s_bias_grad(d, dy, db));
    }
    return ZPS_OK;
}

void k_cpu_conv_release(k_cpu_head *impl) { s_conv_free(((s_conv_impl *)impl)->conv); }

static void s_conv_free(s_conv *c)
{
    if (!c)
        return;
    k_cpu_prim_free(&c->fwd);
    k_cpu_prim_free(&c->bwd_data);
    k_cpu_prim_free(&c->bwd_weights);
    k_cpu_prim_free(&c->w_fwd.p);
    k_cpu_prim_free(&c->w_bwd.p);
    k_cpu_prim_free(&c->dw_back.p);
    s_edge_free(&c->x_in), s_edge_free(&c->x_in_w), s_edge_free(&c->y_out);
    s_edge_free(&c->dy_in), s_edge_free(&c->dy_in_w), s_edge_free(&c->dx_out);
    zps_aligned_free(c->wf);
    zps_aligned_free(c->wb);
    zps_aligned_free(c->dwb);
    free(c);
}
