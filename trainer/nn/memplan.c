/* memplan.c — the memory plan of a model for one batch size (see nn.h, nn_int.h).
 *
 * One block holds, in this order: every tensor's activation, each conv+bn node's scratch
 * (pre-batchnorm output, batch mean and variance), the two step scratches (tmp_pre: the
 * largest conv output, tmp_acc: the largest tensor) and the gradient pool. Every piece is
 * rounded to 16 floats (64 bytes), so a piece's place depends only on the shapes before it.
 *
 * An inference plan (nn_plan's infer, made for forwards with train=0 where no plan of as many
 * rows exists) holds the activations by liveness instead, and no gradient pool
 * (s_place_infer).
 *
 * Invariants:
 *   - a plan is made for one batch size and kept until the size changes: the same size never
 *     allocates again (the arena is reset and asked for the same bytes, so it does not grow;
 *     a device block is only freed and taken again on a new size);
 *   - a gradient buffer is live from its tensor's first consumer's backward (in backward
 *     order; the loss heads first) to its producer's backward, and buffers whose lives do not
 *     overlap share pool space (first fit); the input (tensor 0) has no gradient unless
 *     nn_model_set_input_grad asked for one;
 *   - a conv+bn node whose output only a max pool reads, where the back-end fuses the pair
 *     (k_bn_pool_fuses), runs that pool in training (nn_node.fuse): the pool's output
 *     gradient is then read by the conv+bn node's backward and lives until it, and the
 *     unpooled map between them is neither written nor read in training (its buffers stay,
 *     for evaluation, which runs the two nodes one by one);
 *   - the layouts are chosen for the whole graph at once: either every edge agrees on the
 *     back-end's blocked layout where it prefers it, or everything is plain NCHW.
 */
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"
#include "trainer/nn/nn_int.h"

static size_t s_round(size_t nfloats) { return (nfloats + 15) & ~(size_t)15; }

/* ---- first-fit allocator over a linear pool of floats, for gradient buffers ---- */

typedef struct s_pool_alloc {
    size_t *off, *len; // free blocks, sorted by offset
    int n, cap;
    size_t top;        // end of the highest block in use
    size_t peak;       // largest top seen: the pool size
} s_pool_alloc;

/* Removes free block i. */
static void s_pa_remove(s_pool_alloc *pa, int i)
{
    memmove(pa->off + i, pa->off + i + 1, sizeof(size_t) * (size_t)(pa->n - i - 1));
    memmove(pa->len + i, pa->len + i + 1, sizeof(size_t) * (size_t)(pa->n - i - 1));
    pa->n--;
}

static size_t s_pa_alloc(s_pool_alloc *pa, size_t len)
{
    for (int i = 0; i < pa->n; i++)
        if (pa->len[i] >= len) {
            size_t o = pa->off[i];
            pa->off[i] += len, pa->len[i] -= len;
            if (pa->len[i] == 0)
                s_pa_remove(pa, i);
            return o;
        }
    size_t o = pa->top;
    pa->top += len;
    if (pa->top > pa->peak)
        pa->peak = pa->top;
    return o;
}

static void s_pa_free(s_pool_alloc *pa, size_t off, size_t len)
{
    if (pa->n == pa->cap) {
        pa->cap = pa->cap ? 2 * pa->cap : 32;
        pa->off = zps_xrealloc(pa->off, sizeof(size_t) * (size_t)pa->cap);
        pa->len = zps_xrealloc(pa->len, sizeof(size_t) * (size_t)pa->cap);
    }
    int i = 0;
    while (i < pa->n && pa->off[i] < off)
        i++;
    memmove(pa->off + i + 1, pa->off + i, sizeof(size_t) * (size_t)(pa->n - i));
    memmove(pa->len + i + 1, pa->len + i, sizeof(size_t) * (size_t)(pa->n - i));
    pa->off[i] = off, pa->len[i] = len, pa->n++;
    /* merge with neighbours, and give the end of the pool back to top */
    if (i + 1 < pa->n && pa->off[i] + pa->len[i] == pa->off[i + 1]) {
        pa->len[i] += pa->len[i + 1];
        s_pa_remove(pa, i + 1);
    }
    if (i > 0 && pa->off[i - 1] + pa->len[i - 1] == pa->off[i]) {
        pa->len[i - 1] += pa->len[i];
        s_pa_remove(pa, i);
    }
    if (pa->n > 0 && pa->off[pa->n - 1] + pa->len[pa->n - 1] == pa->top) {
        pa->top = pa->off[pa->n - 1];
        pa->n--;
    }
}

/* ---- layouts and descriptors ---- */

/* The layout two tensors that must share one can both take: NCHW when either is NCHW, the
 * 8-channel blocks when they prefer different blocks (8 divides every multiple of 16). */
static int s_meet(int a, int b) { return !a || !b ? 0 : a == b ? a : K_BLOCK8; }

/* Chooses each tensor's layout: the blocked layout the back-end prefers for its channel
 * count, except where an op ties tensors to one layout: pooling and dropout (input and
 * output), concat (every input and the output). Such a group takes the meet of its members'
 * preferences, repeated until nothing changes (each pass only lowers layouts). Convolutions
 * convert between any two layouts, and a dense layer reads a blocked map as it is (k_dense's
 * x_blocked: the back-end converts at that edge). The input and the loss heads stay NCHW. */
static void s_layouts(nn_model *m)
{
    for (int t = 0; t < m->nt; t++)
        m->t[t].blocked = t > 0 && m->be->prefers_blocked ? m->be->prefers_blocked(m->t[t].c) : 0;
    for (int h = 0; h < m->nheads; h++) /* the losses read NCHW */
        m->t[m->heads[h].t].blocked = 0;
    for (int changed = 1; changed;) {
        changed = 0;
        for (int i = 0; i < m->nn; i++) {
            nn_node *nd = &m->nodes[i];
            if (nd->kind == NN_CONV_BN || nd->kind == NN_CONV || nd->kind == NN_DENSE)
                continue;
            int l = m->t[nd->out].blocked;
            for (int j = 0; j < nd->nin; j++)
                l = s_meet(l, m->t[nd->in[j]].blocked);
            for (int j = 0; j <= nd->nin; j++) {
                nn_tensor *t = &m->t[j < nd->nin ? nd->in[j] : nd->out];
                changed |= t->blocked != l;
                t->blocked = l;
            }
        }
    }
}

/* The op descriptors of node nd for n samples, in the layouts s_layouts chose. */
static zps_status s_describe(nn_model *m, nn_node *nd, int n)
{
    const nn_tensor *x = &m->t[nd->in[0]];
    switch (nd->kind) {
    case NN_CONV_BN:
        ZPS_TRY(k_conv2d_init(&nd->conv, n, x->c, x->h, x->w, nd->k, nd->r, nd->s, nd->sh,
                              nd->sw, nd->ph, nd->pw));
        nd->conv.x_blocked = x->blocked;
        nd->conv.y_blocked = m->t[nd->out].blocked;
        nd->conv.bf16 = m->bf16;
        nd->bn = (k_bn){.n = n, .c = nd->k, .h = nd->conv.oh, .w = nd->conv.ow,
                        .eps = 0.001f, .momentum = 0.1f, .relu = 1,
                        .blocked = m->t[nd->out].blocked};
        return ZPS_OK;
    case NN_CONV:
        ZPS_TRY(k_conv2d_init(&nd->conv, n, x->c, x->h, x->w, nd->k, nd->r, nd->s, nd->sh,
                              nd->sw, nd->ph, nd->pw));
        nd->conv.x_blocked = x->blocked;
        nd->conv.y_blocked = m->t[nd->out].blocked;
        nd->conv.bf16 = m->bf16;
        return ZPS_OK;
    case NN_MAXPOOL:
    case NN_AVGPOOL:
        ZPS_TRY(k_pool_init(&nd->pool, nd->kind == NN_MAXPOOL ? K_POOL_MAX : K_POOL_AVG, n,
                            x->c, x->h, x->w, nd->r, nd->s, nd->sh, nd->sw, nd->ph, nd->pw));
        nd->pool.blocked = x->blocked;
        return ZPS_OK;
    case NN_GAP:
        ZPS_TRY(k_pool_init(&nd->pool, K_POOL_AVG, n, x->c, x->h, x->w, x->h, x->w, 1, 1, 0,
                            0));
        nd->pool.blocked = x->blocked;
        return ZPS_OK;
    case NN_DENSE:
        /* at 1x1 the blocked layout is NCHW's; else the map's own layout (K_BLOCK8 too: a
         * truth value here read 8-blocks as 16-blocks) */
        nd->dense = (k_dense){.n = n, .in = x->c * x->h * x->w, .out = nd->k, .x_c = x->c,
                              .x_blocked = x->h * x->w > 1 ? x->blocked : 0};
        return ZPS_OK;
    default:
        return ZPS_OK;
    }
}

static void s_release_descriptors(nn_model *m)
{
    for (int i = 0; i < m->nn; i++) {
        nn_node *nd = &m->nodes[i];
        k_op_release(m->be, &nd->conv.impl);
        k_op_release(m->be, &nd->bn.impl);
        k_op_release(m->be, &nd->pool.impl);
        k_op_release(m->be, &nd->dense.impl);
    }
}

/* ---- placing the pieces of the block ---- */

/* Where each piece goes, in floats from the start of the block. */
typedef struct s_offsets {
    size_t *x;      // (nt) activations
    size_t *g;      // (nt) gradients, from the start of the gradient pool
    char *has;      // (nt) the tensor gets a gradient buffer
    size_t *node;   // (nn) conv+bn batch mean and variance
    size_t *pre;    // (nn) conv+bn pre-batchnorm map
    size_t tmp_stats; // recompute: running statistics of a rerun (2 x the widest batchnorm)
    size_t tmp_pre; // conv+bn gradient before batchnorm
    size_t tmp_acc; // gradient of a tensor already set
    size_t gpool;   // the gradient pool
    size_t total;   // floats in the block
} s_offsets;

static void s_offsets_free(s_offsets *o)
{
    free(o->x), free(o->g), free(o->has), free(o->node), free(o->pre);
}

/* nfloats (rounded) at the end of the block so far: their offset. */
static size_t s_take(s_offsets *o, size_t nfloats)
{
    size_t at = o->total;
    o->total += s_round(nfloats);
    return at;
}

/* Each node's scratch: a conv+bn node's batch mean and variance, and its pre-batchnorm map
 * where pre; the largest such map and the widest batchnorm into *max_pre, *max_k. */
static void s_place_nodes(nn_model *m, int n, s_offsets *o, int pre, size_t *max_pre,
                          size_t *max_k)
{
    for (int i = 0; i < m->nn; i++) {
        nn_node *nd = &m->nodes[i];
        o->node[i] = o->total;
        if (nd->kind != NN_CONV_BN)
            continue;
        o->total += 2 * s_round((size_t)nd->k);
        size_t map = nn_tensor_floats(m, nd->out, n);
        if (pre)
            o->pre[i] = s_take(o, map);
        if (map > *max_pre)
            *max_pre = map;
        if ((size_t)nd->k > *max_k)
            *max_k = (size_t)nd->k;
    }
}

/* The segments' shared region (recompute.c): every local tensor and pre-batchnorm map of a
 * segment from the region's start, the region as large as the largest segment. */
static void s_place_local(nn_model *m, int n, s_offsets *o)
{
    size_t region = 0;
    for (int s = 0; s < m->nseg; s++) {
        size_t at = o->total;
        for (int i = 0; i < m->nn; i++) {
            nn_node *nd = &m->nodes[i];
            if (nd->seg != s)
                continue;
            if (m->t[nd->out].local) {
                o->x[nd->out] = at;
                at += s_round(nn_tensor_floats(m, nd->out, n));
            }
            if (nd->kind == NN_CONV_BN) {
                o->pre[i] = at;
                at += s_round(nn_tensor_floats(m, nd->out, n));
            }
        }
        if (at - o->total > region)
            region = at - o->total;
    }
    o->total += region;
}

/* Activations (the kept ones: all, without recompute), the nodes' scratch, the segments'
 * region, then the step scratches; after the descriptors and fusions (segments never part a
 * fused pair: its conv+bn node writes the pool's output). */
static void s_place_forward(nn_model *m, int n, s_offsets *o)
{
    size_t max_pre = 0, max_t = 0, max_k = 0;
    if (m->recompute)
        nn_segments(m, n);
    else
        nn_segments_clear(m);
    for (int t = 0; t < m->nt; t++) {
        if (nn_tensor_floats(m, t, n) > max_t)
            max_t = nn_tensor_floats(m, t, n);
        if (!m->t[t].local)
            o->x[t] = s_take(o, nn_tensor_floats(m, t, n));
    }
    s_place_nodes(m, n, o, !m->recompute, &max_pre, &max_k);
    if (m->recompute)
        s_place_local(m, n, o);
    o->tmp_stats = o->total;
    o->total += m->recompute ? 2 * s_round(max_k) : 0;
    o->tmp_pre = s_take(o, max_pre);
    o->tmp_acc = s_take(o, max_t);
}

/* Every node's op descriptors for n samples. */
static zps_status s_describe_all(nn_model *m, int n)
{
    for (int i = 0; i < m->nn; i++)
        ZPS_TRY(s_describe(m, &m->nodes[i], n));
    return ZPS_OK;
}

/* The conv+bn nodes that run the max pool after them (nn_node.fuse): the pool is the only
 * reader of the node's output, which is not a loss head or a marked output, and the back-end
 * fuses the pair's descriptors. */
static void s_fuse(nn_model *m)
{
    for (int i = 0; i < m->nn; i++)
        m->nodes[i].fuse = 0;
    for (int i = 0; i < m->nn; i++) {
        nn_node *nd = &m->nodes[i];
        int t = nd->out, readers = 0, pool = -1;
        if (nd->kind != NN_CONV_BN)
            continue;
        for (int j = i + 1; j < m->nn; j++)
            for (int k = 0; k < m->nodes[j].nin; k++)
                if (m->nodes[j].in[k] == t)
                    readers++, pool = j;
        for (int h = 0; h < m->nheads; h++)
            readers += m->heads[h].t == t ? 2 : 0;
        for (int h = 0; h < m->nouts; h++)
            readers += m->outs[h] == t ? 2 : 0;
        if (readers != 1 || m->nodes[pool].kind != NN_MAXPOOL ||
            m->nodes[pool].train_only != nd->train_only ||
            !k_bn_pool_fuses(m->be, &nd->bn, &m->nodes[pool].pool))
            continue;
        nd->fuse = pool + 1;
        m->nodes[pool].fuse = -1;
    }
}

/* The gradient pool, walking backward: a buffer is taken at its first consumer (the loss
 * heads and the marked outputs, whose gradients come from outside, are consumed first of
 * all) and given back at its producer. */
static void s_place_gradients(nn_model *m, int n, s_offsets *o)
{
    s_pool_alloc pa = {0};
    for (int h = 0; h < m->nheads + m->nouts; h++) {
        int t = h < m->nheads ? m->heads[h].t : m->outs[h - m->nheads];
        if (o->has[t])
            continue;
        o->g[t] = s_pa_alloc(&pa, s_round(nn_tensor_floats(m, t, n)));
        o->has[t] = 1;
    }
    for (int i = m->nn - 1; i >= 0; i--) {
        nn_node *nd = &m->nodes[i];
        for (int j = 0; j < nd->nin; j++) {
            int t = nd->in[j];
            if ((t != 0 || m->input_grad) && !o->has[t]) {
                o->g[t] = s_pa_alloc(&pa, s_round(nn_tensor_floats(m, t, n)));
                o->has[t] = 1;
            }
        }
        /* a fused pool's output gradient lives on to its producer's backward, which reads it
         * (nn_node.fuse) */
        int outs[2] = {nd->fuse < 0 ? -1 : nd->out, nd->fuse > 0 ? m->nodes[nd->fuse - 1].out : -1};
        for (int k = 0; k < 2; k++)
            if (outs[k] >= 0 && o->has[outs[k]])
                s_pa_free(&pa, o->g[outs[k]], s_round(nn_tensor_floats(m, outs[k], n)));
    }
    o->gpool = o->total;
    o->total += pa.peak;
    free(pa.off);
    free(pa.len);
}

int nn_kept_by_inference(const nn_model *m, int t)
{
    int kept = t == 0;
    for (int h = 0; h < m->nheads; h++)
        kept |= m->heads[h].t == t;
    for (int h = 0; h < m->nouts; h++)
        kept |= m->outs[h] == t;
    return kept;
}

/* An inference plan's pieces (nn_plan with infer): activations share one pool by
 * liveness in node order, a tensor from its producer to its last reader (taken before the
 * producer's inputs are given back, so an output never overlaps an input), while the input,
 * the loss heads and the marked outputs hold their place throughout (they are read after the
 * forward); every conv+bn node's pre-batchnorm map is the one tmp_pre (its batchnorm reads it
 * at once); nothing for backward. */
static void s_place_infer(nn_model *m, int n, s_offsets *o)
{
    nn_segments_clear(m);
    int *last = zps_xcalloc((size_t)m->nt, sizeof *last); // last reader + 1 (0: none)
    for (int i = 0; i < m->nn; i++)
        for (int j = 0; j < m->nodes[i].nin; j++)
            last[m->nodes[i].in[j]] = i + 1;
    char *kept = zps_xcalloc((size_t)m->nt, 1), *freed = zps_xcalloc((size_t)m->nt, 1);
    for (int t = 0; t < m->nt; t++)
        kept[t] = (char)nn_kept_by_inference(m, t);
    size_t max_pre = 0, max_k = 0;
    for (int t = 0; t < m->nt; t++)
        if (kept[t])
            o->x[t] = s_take(o, nn_tensor_floats(m, t, n));
    s_place_nodes(m, n, o, 0, &max_pre, &max_k);
    o->tmp_pre = o->tmp_stats = o->tmp_acc = s_take(o, max_pre);
    for (int i = 0; i < m->nn; i++)
        o->pre[i] = o->tmp_pre;
    s_pool_alloc pa = {0};
    size_t *at = zps_xcalloc((size_t)m->nt, sizeof *at);
    for (int i = 0; i < m->nn; i++) {
        nn_node *nd = &m->nodes[i];
        int t = nd->out;
        if (!kept[t])
            at[t] = s_pa_alloc(&pa, s_round(nn_tensor_floats(m, t, n)));
        for (int j = 0; j <= nd->nin; j++) { /* the inputs read last here; an unread output */
            int u = j < nd->nin ? nd->in[j] : t;
            if (!kept[u] && !freed[u] && last[u] <= i + 1) {
                s_pa_free(&pa, at[u], s_round(nn_tensor_floats(m, u, n)));
                freed[u] = 1;
            }
        }
    }
    for (int t = 0; t < m->nt; t++)
        if (!kept[t])
            o->x[t] = o->total + at[t];
    o->total += pa.peak;
    o->gpool = o->total;
    free(pa.off), free(pa.len), free(at), free(last), free(kept), free(freed);
}

/* The block itself: from the arena on host back-ends (reset, so the same size reuses the
 * same memory), from the back-end's allocator otherwise, with a device buffer for labels. */
static zps_status s_take_block(nn_model *m, int n, size_t bytes, float **base)
{
    if (m->be->host_memory) {
        if (!m->arena)
            m->arena = zps_arena_new(0);
        zps_arena_reset(m->arena);
        *base = zps_arena_alloc(m->arena, bytes);
        return ZPS_OK;
    }
    m->be->free(m->dev_block);
    m->be->free(m->labels);
    m->dev_block = m->be->alloc(bytes);
    m->labels = m->be->alloc(sizeof(int32_t) * (size_t)n);
    if (!m->dev_block || !m->labels)
        return ZPS_ERR_NOMEM;
    if (m->be->host_alloc) { /* the labels go up on the in queue, not by a host sync */
        if (m->labels_in)
            ZPS_TRY(m->be->event_sync(m->labels_in)); /* the old staging's copy left it */
        else
            ZPS_TRY(m->be->event_new(&m->labels_in));
        m->be->host_free(m->labels_host);
        m->labels_host = m->be->host_alloc(sizeof(int32_t) * (size_t)n);
        if (!m->labels_host)
            return ZPS_ERR_NOMEM;
    }
    *base = m->dev_block;
    return ZPS_OK;
}

static void s_bind(nn_model *m, const s_offsets *o, float *base)
{
    for (int t = 0; t < m->nt; t++) {
        m->t[t].x = base + o->x[t];
        m->t[t].has_dx = o->has[t];
        m->t[t].dx = o->has[t] ? base + o->gpool + o->g[t] : NULL;
    }
    for (int i = 0; i < m->nn; i++) {
        nn_node *nd = &m->nodes[i];
        if (nd->kind == NN_CONV_BN) {
            nd->pre = base + o->pre[i];
            nd->mean = base + o->node[i];
            nd->var = nd->mean + s_round((size_t)nd->k);
        }
    }
    m->input_plan = m->t[0].x;
    m->tmp_stats = base + o->tmp_stats;
    m->tmp_pre = base + o->tmp_pre;
    m->tmp_acc = base + o->tmp_acc;
}

zps_status nn_plan(nn_model *m, int n, int infer)
{
    if (m->plan_n == n && m->plan_infer == infer)
        return ZPS_OK;
    s_release_descriptors(m);
    m->plan_n = 0, m->plan_bytes = 0;
    s_layouts(m);
    s_offsets o = {
        .x = zps_xcalloc((size_t)m->nt, sizeof(size_t)),
        .g = zps_xcalloc((size_t)m->nt, sizeof(size_t)),
        .has = zps_xcalloc((size_t)m->nt, 1),
        .node = zps_xcalloc((size_t)m->nn, sizeof(size_t)),
        .pre = zps_xcalloc((size_t)m->nn, sizeof(size_t)),
    };
    zps_status st = s_describe_all(m, n);
    float *base = NULL;
    size_t bytes = 0;
    if (st == ZPS_OK) {
        s_fuse(m);
        if (infer) {
            s_place_infer(m, n, &o);
        } else {
            s_place_forward(m, n, &o);
            s_place_gradients(m, n, &o);
        }
        bytes = o.total * sizeof(float) + 64;
        st = s_take_block(m, n, bytes, &base);
    }
    if (st == ZPS_OK) {
        s_bind(m, &o, base);
        m->plan_n = n;
        m->plan_infer = infer;
        m->plan_bytes = bytes;
        zps_log(ZPS_DEBUG, "nn", "planned batch %d: %.1f MiB of activations%s", n,
                (double)bytes / (1 << 20), infer ? " (inference)" : m->nseg > 1 ?
                " and gradients (recompute)" : " and gradients");
        if (!infer && m->recompute && m->nseg == 1)
            zps_log(ZPS_WARN, "nn", "recompute: the model has no place to cut into segments "
                    "(too few layers, or one tensor never alone): every activation is kept");
    }
    s_offsets_free(&o);
    return st;
}

void nn_plan_free(nn_model *m)
{
    s_release_descriptors(m);
    zps_arena_destroy(&m->arena);
    if (m->be) {
        m->be->free(m->dev_block);
        if (!m->be->host_memory)
            m->be->free(m->labels);
        if (m->labels_in) /* its copy has left the staging before both go */
            (void)m->be->event_sync(m->labels_in);
        if (m->be->host_free)
            m->be->host_free(m->labels_host);
        if (m->be->event_free)
            m->be->event_free(m->labels_in);
    }
    m->dev_block = NULL, m->labels = NULL, m->labels_host = NULL, m->labels_in = NULL;
    m->plan_n = 0;
}
