/* external.c — outputs whose loss is computed outside nn (see nn.h, "outputs"): marking them,
 * the forward that stops at the layers, reading them in NCHW on the host, the backward from
 * gradients the caller injects into them, and the input's gradient on request.
 *
 * Invariants:
 *   - a marked output gets a gradient buffer live for the whole backward (memplan.c places
 *     it with the loss heads'), so an output another layer also reads is fine: the injected
 *     gradient is set first and that layer's contribution is added to it;
 *   - the caller's tensors are always plain NCHW; only this file converts to and from the
 *     layout the plan chose for a tensor (kernels.h: blocked layouts exist on host back-ends
 *     only, so a back-end with its own memory moves NCHW bytes as they are);
 *   - the input is NCHW in every plan (memplan.c), so its gradient needs no conversion;
 *   - the backward here is nn_model_backward itself once the gradients are in place: the
 *     same node order, gradient zeroing and hooks as the classifier's step.
 */
#include <assert.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"
#include "trainer/nn/nn_int.h"

int nn_model_output(nn_model *m, int t)
{
    int bad = m->finished || t <= 0 || t >= m->nt || m->nouts == NN_MAX_OUTS;
    for (int i = 0; i < m->nouts && !bad; i++)
        bad = m->outs[i] == t;
    if (bad) {
        if (m->err == ZPS_OK) {
            m->err = ZPS_ERR_INVALID;
            zps_log(ZPS_ERROR, "nn", "bad output tensor %d (the input, unknown, marked twice, "
                    "after finish, or more than %d)", t, NN_MAX_OUTS);
        }
        return -1;
    }
    m->outs[m->nouts] = t;
    return m->nouts++;
}

int nn_model_outputs(const nn_model *m) { return m->nouts; }

void nn_model_output_shape(const nn_model *m, int i, int *c, int *h, int *w)
{
    assert(i >= 0 && i < m->nouts);
    const nn_tensor *t = &m->t[m->outs[i]];
    *c = t->c, *h = t->h, *w = t->w;
}

zps_status nn_model_forward_outputs(nn_model *m, const float *x, int n, int train)
{
    assert(m->finished);
    const float *in_place = nn_input_take(m); /* for this forward only, whatever happens */
    if (n <= 0 || m->nouts == 0) {
        zps_log(ZPS_ERROR, "nn", "forward_outputs: %s", n <= 0 ? "empty batch" : "no outputs");
        return ZPS_ERR_INVALID;
    }
    ZPS_TRY(nn_forward_in(m, x, in_place, n, train));
    m->have_forward = 0;
    ZPS_TRY(nn_forward_nodes(m, train));
    m->have_forward = train;
    return ZPS_OK;
}

/* Host floats for a blocked tensor on its way to or from a device back-end (the "staged"
 * one: cpu's layouts in memory of its own). */
static float *s_relayout(nn_model *m, size_t n)
{
    if (n > m->relayout_cap) {
        zps_aligned_free(m->relayout);
        m->relayout = zps_xaligned(64, n * sizeof(float));
        m->relayout_cap = n;
    }
    return m->relayout;
}

zps_status nn_model_output_read(nn_model *m, int i, float *dst)
{
    assert(i >= 0 && i < m->nouts);
    const nn_tensor *t = &m->t[m->outs[i]];
    if (m->plan_n == 0)
        return ZPS_ERR_INVALID;
    size_t n = nn_tensor_floats(m, m->outs[i], m->fwd_n); /* a prefix: rows are outermost */
    const float *src = t->x;
    if (!m->be->host_memory) {
        float *host = t->blocked ? s_relayout(m, n) : dst;
        ZPS_TRY(m->be->copy_out(host, t->x, n * sizeof(float)));
        if (!t->blocked)
            return ZPS_OK;
        src = host;
    }
    k_from_layout(t->blocked, m->fwd_n, t->c, t->h, t->w, src, dst);
    return ZPS_OK;
}

/* dy (host, NCHW) into tensor t's gradient buffer, in t's layout. */
static zps_status s_inject(nn_model *m, int t, const float *dy)
{
    nn_tensor *x = &m->t[t];
    size_t n = nn_tensor_floats(m, t, m->plan_n);
    if (m->be->host_memory) {
        k_to_layout(x->blocked, m->plan_n, x->c, x->h, x->w, dy, x->dx);
    } else if (!x->blocked) {
        ZPS_TRY(m->be->copy_in(x->dx, dy, n * sizeof(float)));
    } else {
        float *host = s_relayout(m, n);
        k_to_layout(x->blocked, m->plan_n, x->c, x->h, x->w, dy, host);
        ZPS_TRY(m->be->copy_in(x->dx, host, n * sizeof(float)));
    }
    x->dx_set = 1;
    return ZPS_OK;
}

zps_status nn_model_backward_outputs(nn_model *m, const float *const *dys, nn_grad_hook hook,
                                     void *ctx)
{
    if (!m->have_forward) {
        zps_log(ZPS_ERROR, "nn", "backward without a training forward");
        return ZPS_ERR_INVALID;
    }
    for (int t = 0; t < m->nt; t++) /* a forward with heads set theirs: not this step's */
        m->t[t].dx_set = 0;
    for (int i = 0; i < m->nouts; i++)
        if (dys[i])
            ZPS_TRY(s_inject(m, m->outs[i], dys[i]));
    return nn_model_backward(m, hook, ctx);
}

void nn_model_set_input_grad(nn_model *m, int on)
{
    if (m->input_grad != !!on)
        m->plan_n = 0; /* the next forward re-plans with (or without) the buffer */
    m->input_grad = !!on;
}

zps_status nn_model_input_grad(nn_model *m, float *dst)
{
    nn_tensor *x = &m->t[0];
    if (m->plan_n == 0 || !x->has_dx)
        return ZPS_ERR_INVALID;
    size_t bytes = nn_tensor_floats(m, 0, m->plan_n) * sizeof(float);
    if (!x->dx_set) { /* no gradient reached the input */
        memset(dst, 0, bytes);
        return ZPS_OK;
    }
    return m->be->copy_out(dst, x->dx, bytes);
}
