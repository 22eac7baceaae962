/* nn.c — one step of a model: forward through the layers and the loss heads, backward
 * through the layers in reverse with the gradient hooks (see nn.h, nn_int.h).
 *
 * Invariants:
 *   - forward plans the batch size first (memplan.c) and runs nodes in the order they were
 *     added; evaluation skips training-only nodes and every head but the first;
 *   - a tensor's gradient is "set" once its first consumer (in backward order; the loss heads
 *     first) wrote it; later consumers write into the shared scratch tmp_acc and add (ops
 *     overwrite input gradients);
 *   - a conv+bn node with a fused max pool (nn_node.fuse) runs the pool in training: the
 *     pool node then only passes the gradient's place on (its input counts as set), and
 *     the conv+bn node's backward reads the pool's output gradient;
 *   - backward zeroes a node's gradient range right before the node runs (parameter
 *     gradients accumulate), and calls the hook after it, so the hooks cover every variable
 *     exactly once, in decreasing table order, even for nodes no gradient reached.
 */
#include <assert.h>

#include "common/check.h"
#include "common/log.h"
#include "trainer/nn/nn_int.h"

/* ---- forward ---- */

zps_status nn_node_fwd(nn_model *m, nn_node *nd, int train)
{
    const k_backend *be = m->be;
    float *x = m->t[nd->in[0]].x, *y = m->t[nd->out].x;
    const float *p = m->params;
    switch (nd->kind) {
    case NN_CONV_BN: {
        const nn_var *w = &m->vars[nd->var0];
        const float *g = p + w[1].offset, *b = p + w[2].offset;
        float *rm = m->statbuf + m->stats[nd->stat0].offset;
        float *rv = m->statbuf + m->stats[nd->stat0 + 1].offset;
        if (m->recomputing) /* recompute.c: the forward updated them already */
            rm = m->tmp_stats, rv = m->tmp_stats + nd->k;
        ZPS_TRY(k_conv2d_fwd(be, &nd->conv, x, p + w->offset, NULL, nd->pre));
        if (train && m->bn_momentum > 0) /* a descriptor is re-planned with 0.1 */
            nd->bn.momentum = m->bn_momentum;
        if (train && nd->fuse > 0) { /* the pool after it too (memplan.c's s_fuse) */
            nn_node *pool = &m->nodes[nd->fuse - 1];
            return k_bn_pool_fwd(be, &nd->bn, &pool->pool, nd->pre, g, b, m->t[pool->out].x,
                                 nd->mean, nd->var, rm, rv);
        }
        if (train)
            return k_bn_fwd_train(be, &nd->bn, nd->pre, g, b, y, nd->mean, nd->var, rm, rv);
        return k_bn_fwd_infer(be, &nd->bn, nd->pre, g, b, rm, rv, y);
    }
    case NN_MAXPOOL:
        if (train && nd->fuse < 0) /* its producer ran it */
            return ZPS_OK;
        /* fall through */
    case NN_AVGPOOL:
    case NN_GAP:
        return k_pool_fwd(be, &nd->pool, x, y);
    case NN_CONCAT: {
        const float *xs[NN_MAX_IN];
        int c[NN_MAX_IN];
        for (int j = 0; j < nd->nin; j++)
            xs[j] = m->t[nd->in[j]].x, c[j] = m->t[nd->in[j]].c;
        return k_concat_fwd(be, m->plan_n, m->t[nd->out].h * m->t[nd->out].w, nd->nin, c, xs, y);
    }
    case NN_DROPOUT:
        nd->seed = m->seed ^ (m->step * 0x9E3779B97F4A7C15ull) ^ (uint64_t)(nd - m->nodes);
        return k_dropout_fwd(be, nn_tensor_floats(m, nd->out, m->plan_n),
                             train ? nd->p : 0.0f, nd->seed, x, y);
    case NN_DENSE: {
        const nn_var *w = &m->vars[nd->var0];
        ZPS_TRY(k_dense_fwd(be, &nd->dense, x, p + w->offset, p + w[1].offset, y));
        if (nd->relu)
            return k_relu_fwd(be, nn_tensor_floats(m, nd->out, m->plan_n), y, y);
        return ZPS_OK;
    }
    case NN_CONV: {
        const nn_var *w = &m->vars[nd->var0];
        return k_conv2d_fwd(be, &nd->conv, x, p + w->offset, p + w[1].offset, y);
    }
    }
    return ZPS_ERR_INTERNAL;
}

void nn_model_set_bf16(nn_model *m, int on)
{
    if (m->bf16 != !!on)
        m->plan_n = 0; /* the descriptors change: re-planned at the next forward */
    m->bf16 = !!on;
}

void nn_model_set_bn_momentum(nn_model *m, float momentum)
{
    m->bn_momentum = momentum;
}

void nn_model_set_forward_hook(nn_model *m, nn_grad_hook hook, void *ctx)
{
    m->fwd_hook = hook;
    m->fwd_ctx = ctx;
}

/* Labels are checked on the host before anything runs: a bad label would index past the
 * logits in every back-end's loss. */
static zps_status s_check_labels(const nn_model *m, const int32_t *labels, int n)
{
    int classes0 = nn_model_classes(m);
    for (int i = 0; i < n; i++)
        if (labels[i] < 0 || labels[i] >= classes0) {
            zps_log(ZPS_ERROR, "nn", "label %d of row %d outside [0, %d)", labels[i], i,
                    classes0);
            return ZPS_ERR_INVALID;
        }
    return ZPS_OK;
}

void nn_model_set_input(nn_model *m, const float *x) { m->input_next = x; }

const float *nn_input_take(nn_model *m)
{
    const float *x = m->input_next;
    m->input_next = NULL;
    return x;
}

zps_status nn_forward_in(nn_model *m, const float *x, const float *in_place, int n, int train)
{
    /* training: a training plan of n rows; inference: any plan of at least n, exactly n
     * for a caller's buffer in place (it holds n rows only) */
    int fits = train ? m->plan_n == n && !m->plan_infer
                     : m->plan_n >= n && (!in_place || m->plan_n == n);
    if (!fits)
        ZPS_TRY(nn_plan(m, n, !train));
    m->fwd_n = n;
    if (in_place) { /* tensor 0 is only ever read: the caller's buffer serves as it */
        m->t[0].x = (float *)in_place;
        return ZPS_OK;
    }
    m->t[0].x = m->input_plan;
    size_t have = nn_tensor_floats(m, 0, n), all = nn_tensor_floats(m, 0, m->plan_n);
    ZPS_TRY(m->be->copy_in(m->t[0].x, x, have * sizeof(float)));
    return all > have ? k_fill(m->be, all - have, 0.0f, m->t[0].x + have) : ZPS_OK;
}

/* The batch into tensor 0 and, on back-ends with their own memory, the labels into the
 * planned label buffer; *lab is where the loss reads them. With queues the labels go
 * through their pinned staging on the host-to-device queue, which the compute queue waits
 * for: a plain copy_in would make the host wait for all the device's queued work (the last
 * step's backward and optimizer) before it could queue this forward. The staging is
 * rewritten only once its last copy left it (free: the last forward's loss was read back
 * after it). The device buffer's only reader is the loss, in the forward (its gradient is
 * computed there), which the host has waited for by reading the loss back: the copy needs
 * no wait for the compute queue. */
static zps_status s_batch_in(nn_model *m, const float *x, const float *in_place,
                             const int32_t *labels, int n, int train, const int32_t **lab)
{
    ZPS_TRY(nn_forward_in(m, x, in_place, n, train));
    *lab = labels;
    if (m->be->host_memory)
        return ZPS_OK;
    size_t bytes = sizeof(int32_t) * (size_t)n;
    *lab = m->labels;
    if (!m->labels_host)
        return m->be->copy_in(m->labels, labels, bytes);
    ZPS_TRY(m->be->event_sync(m->labels_in));
    memcpy(m->labels_host, labels, bytes);
    ZPS_TRY(m->be->copy_in_async(m->labels, m->labels_host, bytes));
    ZPS_TRY(m->be->event_record(m->labels_in, K_QUEUE_IN));
    return m->be->event_wait(K_QUEUE_COMPUTE, m->labels_in);
}

/* The loss heads (every head in training, the first in evaluation). In training they are
 * the first consumers of their logits, so their gradients set those tensors' dx. */
static zps_status s_heads(nn_model *m, const int32_t *lab, int n, int train, float *loss,
                          int *correct)
{
    for (int t = 0; t < m->nt; t++)
        m->t[t].dx_set = 0;
    float total = 0;
    for (int h = 0; h < (train ? m->nheads : 1); h++) {
        nn_tensor *lt = &m->t[m->heads[h].t];
        float l;
        int c = 0;
        ZPS_TRY(k_softmax_xent(m->be, n, lt->c, lt->x, lab, 0.0f, m->heads[h].weight, &l, &c,
                               train ? lt->dx : NULL));
        if (train)
            lt->dx_set = 1;
        total += (train ? m->heads[h].weight : 1.0f) * l;
        if (h == 0 && correct)
            *correct = c;
    }
    *loss = total;
    return ZPS_OK;
}

zps_status nn_forward_nodes(nn_model *m, int train)
{
    m->step += train != 0; /* dropout's seeds: an evaluation between steps changes none */
    for (int i = 0; i < m->nn; i++) {
        nn_node *nd = &m->nodes[i];
        if (!train && nd->train_only)
            continue;
        if (m->fwd_hook && nd->nvars)
            m->fwd_hook(m->fwd_ctx, nd->var0, nd->nvars);
        zps_status st = nn_node_fwd(m, nd, train);
        if (st != ZPS_OK) {
            zps_log(ZPS_ERROR, "nn", "forward of %s failed: %s", nd->name, zps_strerror(st));
            return st;
        }
    }
    return ZPS_OK;
}

zps_status nn_model_forward(nn_model *m, const float *x, const int32_t *labels, int n, int train,
                            float *loss, int *correct)
{
    assert(m->finished);
    const float *in_place = nn_input_take(m); /* for this forward only, whatever happens */
    if (n <= 0)
        return ZPS_ERR_INVALID;
    if (m->nheads == 0) {
        zps_log(ZPS_ERROR, "nn", "model has no loss head (nn_model_forward_outputs runs it)");
        return ZPS_ERR_INVALID;
    }
    ZPS_TRY(s_check_labels(m, labels, n));
    const int32_t *lab;
    ZPS_TRY(s_batch_in(m, x, in_place, labels, n, train, &lab));
    ZPS_TRY(nn_forward_nodes(m, train));
    ZPS_TRY(s_heads(m, lab, n, train, loss, correct));
    m->have_forward = train;
    return ZPS_OK;
}

zps_status nn_model_eval(nn_model *m, const float *x, const int32_t *labels, int n, float *loss,
                         int *correct)
{
    return nn_model_forward(m, x, labels, n, 0, loss, correct);
}

/* ---- backward ---- */

/* Where an op should write the gradient of tensor t: NULL (no buffer: the input, unless
 * nn_model_set_input_grad asked for one), t's own buffer, or the scratch when another
 * consumer already wrote it. */
static float *s_dx_target(nn_model *m, int t)
{
    if (!m->t[t].has_dx)
        return NULL;
    return m->t[t].dx_set ? m->tmp_acc : m->t[t].dx;
}

static zps_status s_dx_commit(nn_model *m, int t)
{
    if (!m->t[t].has_dx)
        return ZPS_OK;
    if (m->t[t].dx_set)
        return k_axpy(m->be, nn_tensor_floats(m, t, m->plan_n), 1.0f, m->tmp_acc, m->t[t].dx);
    m->t[t].dx_set = 1;
    return ZPS_OK;
}

/* Concat backward: each input's slice of dy goes straight into its gradient when nothing
 * wrote it yet; inputs already set take their slice through the scratch, one at a time. */
static zps_status s_concat_bwd(nn_model *m, nn_node *nd, const float *dy)
{
    const k_backend *be = m->be;
    nn_tensor *o = &m->t[nd->out];
    float *dxs[NN_MAX_IN];
    int c[NN_MAX_IN], hw = o->h * o->w, again = 0;
    for (int j = 0; j < nd->nin; j++) {
        int t = nd->in[j];
        c[j] = m->t[t].c;
        dxs[j] = (!m->t[t].has_dx || m->t[t].dx_set) ? NULL : m->t[t].dx;
        again |= m->t[t].has_dx && m->t[t].dx_set;
    }
    ZPS_TRY(k_concat_bwd(be, m->plan_n, hw, nd->nin, c, dy, dxs));
    for (int j = 0; j < nd->nin; j++)
        if (dxs[j])
            m->t[nd->in[j]].dx_set = 1;
    if (!again)
        return ZPS_OK;
    for (int j = 0; j < nd->nin; j++) {
        int t = nd->in[j];
        if (dxs[j] || !m->t[t].has_dx)
            continue;
        float *one[NN_MAX_IN] = {0};
        one[j] = m->tmp_acc;
        ZPS_TRY(k_concat_bwd(be, m->plan_n, hw, nd->nin, c, dy, one));
        ZPS_TRY(k_axpy(be, nn_tensor_floats(m, t, m->plan_n), 1.0f, m->tmp_acc, m->t[t].dx));
    }
    return ZPS_OK;
}

static zps_status s_node_bwd(nn_model *m, nn_node *nd)
{
    const k_backend *be = m->be;
    nn_tensor *o = &m->t[nd->out];
    int in = nd->in[0];
    float *x = m->t[in].x, *dy = o->dx;
    float *p = m->params, *g = m->grads;
    switch (nd->kind) {
    case NN_CONV_BN: {
        const nn_var *w = &m->vars[nd->var0];
        if (nd->fuse > 0) { /* from the gradient of the pool it ran */
            nn_node *pool = &m->nodes[nd->fuse - 1];
            ZPS_TRY(k_bn_pool_bwd(be, &nd->bn, &pool->pool, nd->pre, m->t[pool->out].dx,
                                  p + w[1].offset, nd->mean, nd->var, m->tmp_pre,
                                  g + w[1].offset, g + w[2].offset));
        } else {
            ZPS_TRY(k_bn_bwd(be, &nd->bn, nd->pre, o->x, dy, p + w[1].offset, nd->mean,
                             nd->var, m->tmp_pre, g + w[1].offset, g + w[2].offset));
        }
        ZPS_TRY(k_conv2d_bwd(be, &nd->conv, x, p + w->offset, m->tmp_pre, s_dx_target(m, in),
                             g + w->offset, NULL));
        return s_dx_commit(m, in);
    }
    case NN_MAXPOOL:
        if (nd->fuse < 0) { /* its producer's backward reads dy (memplan.c's s_fuse) */
            m->t[in].dx_set = 1;
            return ZPS_OK;
        }
        /* fall through */
    case NN_AVGPOOL:
    case NN_GAP: {
        float *dx = s_dx_target(m, in);
        if (dx)
            ZPS_TRY(k_pool_bwd(be, &nd->pool, x, o->x, dy, dx));
        return s_dx_commit(m, in);
    }
    case NN_CONCAT:
        return s_concat_bwd(m, nd, dy);
    case NN_DROPOUT: {
        float *dx = s_dx_target(m, in);
        if (dx)
            ZPS_TRY(k_dropout_bwd(be, nn_tensor_floats(m, nd->out, m->plan_n), nd->p, nd->seed,
                                  dy, dx));
        return s_dx_commit(m, in);
    }
    case NN_DENSE: {
        const nn_var *w = &m->vars[nd->var0];
        if (nd->relu)
            ZPS_TRY(k_relu_bwd(be, nn_tensor_floats(m, nd->out, m->plan_n), o->x, dy, dy));
        ZPS_TRY(k_dense_bwd(be, &nd->dense, x, p + w->offset, dy, s_dx_target(m, in),
                            g + w->offset, g + w[1].offset));
        return s_dx_commit(m, in);
    }
    case NN_CONV: {
        const nn_var *w = &m->vars[nd->var0];
        ZPS_TRY(k_conv2d_bwd(be, &nd->conv, x, p + w->offset, dy, s_dx_target(m, in),
                             g + w->offset, g + w[1].offset));
        return s_dx_commit(m, in);
    }
    }
    return ZPS_ERR_INTERNAL;
}

zps_status nn_node_backward(nn_model *m, nn_node *nd, nn_grad_hook hook, void *ctx)
{
    if (nd->nvars) {
        const nn_var *first = &m->vars[nd->var0], *last = &m->vars[nd->var0 + nd->nvars - 1];
        ZPS_TRY(k_fill(m->be, last->offset + last->count - first->offset, 0.0f,
                       m->grads + first->offset));
    }
    if (m->t[nd->out].dx_set) {
        zps_status st = s_node_bwd(m, nd);
        if (st != ZPS_OK) {
            zps_log(ZPS_ERROR, "nn", "backward of %s failed: %s", nd->name, zps_strerror(st));
            return st;
        }
    }
    if (nd->nvars && hook)
        hook(ctx, nd->var0, nd->nvars);
    return ZPS_OK;
}

zps_status nn_model_backward(nn_model *m, nn_grad_hook hook, void *ctx)
{
    if (!m->have_forward) {
        zps_log(ZPS_ERROR, "nn", "backward without a training forward");
        return ZPS_ERR_INVALID;
    }
    zps_status st = ZPS_OK;
    if (m->nseg > 1) /* recompute.c */
        st = nn_backward_segments(m, hook, ctx);
    for (int i = m->nn - 1; m->nseg <= 1 && i >= 0 && st == ZPS_OK; i--)
        st = nn_node_backward(m, &m->nodes[i], hook, ctx);
    if (st == ZPS_OK)
        m->have_forward = 0;
    return st;
}
