/* graph.c — building a model: layer calls, loss heads, the variable and statistic tables,
 * deterministic initialisation, finish, introspection and destroy (see nn.h, nn_int.h).
 *
 * Invariants:
 *   - a layer call checks its arguments before it adds anything; on a bad call nothing is
 *     added, the first error is kept in m->err and nn_model_finish() returns it;
 *   - a layer's variables are declared right after its node is added (var0 = nvars then), so
 *     the table is in declaration order and each node's range is contiguous;
 *   - initialisation draws from one counter-based stream of the seed, layer by layer in
 *     declaration order, on the host; the same seed gives the same parameters on every
 *     back-end.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"
#include "trainer/nn/nn_int.h"

static int s_fail(nn_model *m, zps_status st, const char *fmt, const char *name)
{
    if (m->err == ZPS_OK) {
        m->err = st;
        zps_log(ZPS_ERROR, "nn", fmt, name);
    }
    return -1;
}

static int s_add_tensor(nn_model *m, const char *name, int c, int h, int w)
{
    if (m->nt == m->cap_t) {
        m->cap_t = m->cap_t ? 2 * m->cap_t : 64;
        m->t = zps_xrealloc(m->t, sizeof *m->t * (size_t)m->cap_t);
    }
    nn_tensor *t = &m->t[m->nt];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->c = c, t->h = h, t->w = w;
    return m->nt++;
}

static nn_node *s_add_node(nn_model *m, nn_kind kind, const char *name)
{
    if (m->nn == m->cap_n) {
        m->cap_n = m->cap_n ? 2 * m->cap_n : 64;
        m->nodes = zps_xrealloc(m->nodes, sizeof *m->nodes * (size_t)m->cap_n);
    }
    nn_node *nd = &m->nodes[m->nn++];
    memset(nd, 0, sizeof *nd);
    nd->kind = kind;
    nd->train_only = m->train_only;
    snprintf(nd->name, sizeof nd->name, "%s", name);
    nd->var0 = m->nvars;
    nd->stat0 = m->nstats;
    return nd;
}

static void s_declare(nn_var **tab, size_t *n, size_t *cap, size_t *total, const char *name,
                      const char *suffix, int ndim, int a, int b, int c, int d)
{
    if (*n == *cap) {
        *cap = *cap ? 2 * *cap : 128;
        *tab = zps_xrealloc(*tab, sizeof **tab * *cap);
    }
    nn_var *v = &(*tab)[(*n)++];
    memset(v, 0, sizeof *v);
    snprintf(v->name, sizeof v->name, "%s%s", name, suffix);
    int sh[4] = {a, b, c, d};
    v->ndim = ndim;
    v->count = 1;
    for (int i = 0; i < ndim; i++) {
        v->shape[i] = sh[i];
        v->count *= (size_t)sh[i];
    }
    v->offset = *total;
    *total += v->count;
}

/* A trainable variable of the layer being added. */
static void s_var(nn_model *m, const char *name, const char *suffix, int ndim, int a, int b,
                  int c, int d)
{
    s_declare(&m->vars, &m->nvars, &m->cap_v, &m->nparams, name, suffix, ndim, a, b, c, d);
}

/* A running statistic of the layer being added. */
static void s_stat(nn_model *m, const char *name, const char *suffix, int k)
{
    s_declare(&m->stats, &m->nstats, &m->cap_s, &m->nstatf, name, suffix, 1, k, 0, 0, 0);
}

static int s_check_in(nn_model *m, int in, const char *name)
{
    if (m->finished)
        return s_fail(m, ZPS_ERR_INVALID, "layer %s added after nn_model_finish", name);
    if (in < 0 || in >= m->nt)
        return s_fail(m, ZPS_ERR_INVALID, "layer %s: bad input tensor", name);
    return 0;
}

nn_model *nn_model_new(const k_backend *be, int c, int h, int w)
{
    nn_model *m = zps_xcalloc(1, sizeof *m);
    m->be = be;
    s_add_tensor(m, "input", c, h, w);
    if (c <= 0 || h <= 0 || w <= 0)
        s_fail(m, ZPS_ERR_INVALID, "%s: empty input shape", "model");
    return m;
}

void nn_model_destroy(nn_model **pm)
{
    if (!pm || !*pm)
        return;
    nn_model *m = *pm;
    nn_plan_free(m);
    if (m->be) {
        m->be->free(m->params);
        m->be->free(m->grads);
        m->be->free(m->statbuf);
    }
    free(m->t);
    free(m->nodes);
    free(m->vars);
    free(m->stats);
    zps_aligned_free(m->scratch);
    zps_aligned_free(m->relayout);
    free(m);
    *pm = NULL;
}

void *nn_model_scratch(nn_model *m, size_t bytes)
{
    if (bytes > m->scratch_cap) {
        zps_aligned_free(m->scratch);
        m->scratch = zps_xaligned(64, bytes);
        m->scratch_cap = bytes;
    }
    return m->scratch;
}

int nn_conv_bn_relu(nn_model *m, const char *name, int in, int k, int r, int s, int stride_h,
                    int stride_w, int pad_h, int pad_w, float init_std)
{
    if (s_check_in(m, in, name) < 0)
        return -1;
    const nn_tensor *x = &m->t[in];
    k_conv2d probe;
    if (k_conv2d_init(&probe, 1, x->c, x->h, x->w, k, r, s, stride_h, stride_w, pad_h, pad_w) !=
        ZPS_OK)
        return s_fail(m, ZPS_ERR_INVALID, "conv %s: kernel does not fit its input", name);
    nn_node *nd = s_add_node(m, NN_CONV_BN, name);
    nd->in[0] = in, nd->nin = 1;
    nd->k = k, nd->r = r, nd->s = s, nd->sh = stride_h, nd->sw = stride_w, nd->ph = pad_h,
    nd->pw = pad_w, nd->std = init_std;
    s_var(m, name, ".conv.weight", 4, k, x->c, r, s);
    s_var(m, name, ".bn.weight", 1, k, 0, 0, 0);
    s_var(m, name, ".bn.bias", 1, k, 0, 0, 0);
    s_stat(m, name, ".bn.running_mean", k);
    s_stat(m, name, ".bn.running_var", k);
    nd->nvars = 3;
    nd->out = s_add_tensor(m, name, k, probe.oh, probe.ow);
    return nd->out;
}

int nn_conv(nn_model *m, const char *name, int in, int k, int r, int s, int stride, int pad,
            float init_std)
{
    if (s_check_in(m, in, name) < 0)
        return -1;
    const nn_tensor *x = &m->t[in];
    k_conv2d probe;
    if (k_conv2d_init(&probe, 1, x->c, x->h, x->w, k, r, s, stride, stride, pad, pad) != ZPS_OK)
        return s_fail(m, ZPS_ERR_INVALID, "conv %s: kernel does not fit its input", name);
    nn_node *nd = s_add_node(m, NN_CONV, name);
    nd->in[0] = in, nd->nin = 1;
    nd->k = k, nd->r = r, nd->s = s, nd->sh = nd->sw = stride, nd->ph = nd->pw = pad;
    nd->std = init_std;
    s_var(m, name, ".weight", 4, k, x->c, r, s);
    s_var(m, name, ".bias", 1, k, 0, 0, 0);
    nd->nvars = 2;
    nd->out = s_add_tensor(m, name, k, probe.oh, probe.ow);
    return nd->out;
}

static int s_pool(nn_model *m, nn_kind kind, const char *name, int in, int r, int stride, int pad)
{
    if (s_check_in(m, in, name) < 0)
        return -1;
    const nn_tensor *x = &m->t[in];
    k_pool probe;
    if (k_pool_init(&probe, kind == NN_MAXPOOL ? K_POOL_MAX : K_POOL_AVG, 1, x->c, x->h, x->w, r,
                    r, stride, stride, pad, pad) != ZPS_OK)
        return s_fail(m, ZPS_ERR_INVALID, "pool %s: window does not fit its input", name);
    nn_node *nd = s_add_node(m, kind, name);
    nd->in[0] = in, nd->nin = 1;
    nd->r = nd->s = r, nd->sh = nd->sw = stride, nd->ph = nd->pw = pad;
    nd->out = s_add_tensor(m, name, x->c, probe.oh, probe.ow);
    return nd->out;
}

int nn_maxpool(nn_model *m, const char *name, int in, int r, int stride, int pad)
{
    return s_pool(m, NN_MAXPOOL, name, in, r, stride, pad);
}

int nn_avgpool(nn_model *m, const char *name, int in, int r, int stride, int pad)
{
    return s_pool(m, NN_AVGPOOL, name, in, r, stride, pad);
}

int nn_gap(nn_model *m, const char *name, int in)
{
    if (s_check_in(m, in, name) < 0)
        return -1;
    nn_node *nd = s_add_node(m, NN_GAP, name);
    nd->in[0] = in, nd->nin = 1;
    nd->out = s_add_tensor(m, name, m->t[in].c, 1, 1);
    return nd->out;
}

int nn_concat(nn_model *m, const char *name, int n, const int *ins)
{
    if (n < 1 || n > NN_MAX_IN)
        return s_fail(m, ZPS_ERR_INVALID, "concat %s: 1 to 8 inputs", name);
    int c = 0;
    for (int i = 0; i < n; i++) {
        if (s_check_in(m, ins[i], name) < 0)
            return -1;
        if (m->t[ins[i]].h != m->t[ins[0]].h || m->t[ins[i]].w != m->t[ins[0]].w)
            return s_fail(m, ZPS_ERR_INVALID, "concat %s: inputs differ in height or width",
                          name);
        c += m->t[ins[i]].c;
    }
    nn_node *nd = s_add_node(m, NN_CONCAT, name);
    memcpy(nd->in, ins, sizeof(int) * (size_t)n);
    nd->nin = n;
    nd->out = s_add_tensor(m, name, c, m->t[ins[0]].h, m->t[ins[0]].w);
    return nd->out;
}

int nn_dropout(nn_model *m, const char *name, int in, float p)
{
    if (s_check_in(m, in, name) < 0)
        return -1;
    if (!(p >= 0 && p < 1))
        return s_fail(m, ZPS_ERR_INVALID, "dropout %s: rate must be in [0, 1)", name);
    nn_node *nd = s_add_node(m, NN_DROPOUT, name);
    nd->in[0] = in, nd->nin = 1, nd->p = p;
    nd->out = s_add_tensor(m, name, m->t[in].c, m->t[in].h, m->t[in].w);
    return nd->out;
}

int nn_dense(nn_model *m, const char *name, int in, int out, int relu, float init_std)
{
    if (s_check_in(m, in, name) < 0)
        return -1;
    if (out <= 0)
        return s_fail(m, ZPS_ERR_INVALID, "dense %s: no outputs", name);
    const nn_tensor *x = &m->t[in];
    int nin = x->c * x->h * x->w;
    nn_node *nd = s_add_node(m, NN_DENSE, name);
    nd->in[0] = in, nd->nin = 1, nd->k = out, nd->relu = relu, nd->std = init_std;
    s_var(m, name, ".weight", 2, out, nin, 0, 0);
    s_var(m, name, ".bias", 1, out, 0, 0, 0);
    nd->nvars = 2;
    nd->out = s_add_tensor(m, name, out, 1, 1);
    return nd->out;
}

void nn_model_train_only(nn_model *m, int on) { m->train_only = on; }

void nn_model_head(nn_model *m, int t, float weight)
{
    if (t < 0 || t >= m->nt || m->t[t].h != 1 || m->t[t].w != 1 || m->nheads == NN_MAX_HEADS) {
        s_fail(m, ZPS_ERR_INVALID, "%s: bad loss head", "model");
        return;
    }
    m->heads[m->nheads].t = t;
    m->heads[m->nheads++].weight = weight;
}

/* ---- initialisation (deterministic from the seed) ---- */

static double s_uniform(uint64_t seed, uint64_t *ctr)
{
    return ((double)k_hash_u32(seed, (*ctr)++) + 0.5) / 4294967296.0;
}

/* N(0, std) truncated to [-2, 2] by resampling (torchvision's trunc_normal_(a=-2, b=2)). */
static float s_trunc_normal(uint64_t seed, uint64_t *ctr, float std)
{
    for (;;) {
        double u1 = s_uniform(seed, ctr), u2 = s_uniform(seed, ctr);
        double z = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2) * std;
        if (z >= -2.0 && z <= 2.0)
            return (float)z;
    }
}

static void s_init_params(nn_model *m, float *p, float *st)
{
    uint64_t ctr = 0;
    for (int i = 0; i < m->nn; i++) {
        nn_node *nd = &m->nodes[i];
        if (nd->kind == NN_CONV_BN) {
            const nn_var *w = &m->vars[nd->var0], *g = w + 1, *b = w + 2;
            for (size_t j = 0; j < w->count; j++)
                p[w->offset + j] = s_trunc_normal(m->seed, &ctr, nd->std);
            for (size_t j = 0; j < g->count; j++)
                p[g->offset + j] = 1.0f, p[b->offset + j] = 0.0f;
            const nn_var *rm = &m->stats[nd->stat0], *rv = rm + 1;
            for (size_t j = 0; j < rm->count; j++)
                st[rm->offset + j] = 0.0f, st[rv->offset + j] = 1.0f;
        } else if (nd->kind == NN_CONV) { /* torchvision's SSD heads start with bias 0 */
            const nn_var *w = &m->vars[nd->var0], *b = w + 1;
            for (size_t j = 0; j < w->count; j++)
                p[w->offset + j] = s_trunc_normal(m->seed, &ctr, nd->std);
            for (size_t j = 0; j < b->count; j++)
                p[b->offset + j] = 0.0f;
        } else if (nd->kind == NN_DENSE) {
            const nn_var *w = &m->vars[nd->var0], *b = w + 1;
            for (size_t j = 0; j < w->count; j++)
                p[w->offset + j] = s_trunc_normal(m->seed, &ctr, nd->std);
            double bound = 1.0 / sqrt((double)w->shape[1]);
            for (size_t j = 0; j < b->count; j++)
                p[b->offset + j] = (float)((2 * s_uniform(m->seed, &ctr) - 1) * bound);
        }
    }
}

static float *s_be_alloc(const k_backend *be, size_t nfloats)
{
    float *p = be->alloc(nfloats * sizeof(float) + 64);
    return p;
}

zps_status nn_model_finish(nn_model *m, uint64_t seed)
{
    if (m->err != ZPS_OK)
        return m->err;
    if (m->nheads == 0 && m->nouts == 0) {
        zps_log(ZPS_ERROR, "nn", "model has neither a loss head nor a marked output");
        return ZPS_ERR_INVALID;
    }
    m->seed = seed;
    m->params = s_be_alloc(m->be, m->nparams);
    m->grads = s_be_alloc(m->be, m->nparams);
    m->statbuf = s_be_alloc(m->be, m->nstatf);
    if (!m->params || !m->grads || !m->statbuf)
        return ZPS_ERR_NOMEM;
    float *hp = m->be->host_memory ? m->params : zps_xmalloc(m->nparams * sizeof(float) + 4);
    float *hs = m->be->host_memory ? m->statbuf : zps_xmalloc(m->nstatf * sizeof(float) + 4);
    s_init_params(m, hp, hs);
    zps_status st = ZPS_OK;
    if (!m->be->host_memory) {
        st = m->be->copy_in(m->params, hp, m->nparams * sizeof(float));
        if (st == ZPS_OK)
            st = m->be->copy_in(m->statbuf, hs, m->nstatf * sizeof(float));
        free(hp);
        free(hs);
    }
    ZPS_TRY(st);
    ZPS_TRY(k_fill(m->be, m->nparams, 0.0f, m->grads));
    m->finished = 1;
    return ZPS_OK;
}

/* ---- introspection ---- */

const k_backend *nn_model_backend(const nn_model *m) { return m->be; }
const nn_var *nn_model_vars(const nn_model *m, size_t *n)
{
    *n = m->nvars;
    return m->vars;
}
const nn_var *nn_model_stats(const nn_model *m, size_t *n)
{
    *n = m->nstats;
    return m->stats;
}
size_t nn_model_param_count(const nn_model *m) { return m->nparams; }
size_t nn_model_stat_count(const nn_model *m) { return m->nstatf; }
float *nn_model_params(nn_model *m) { return m->params; }
float *nn_model_grads(nn_model *m) { return m->grads; }
float *nn_model_statbuf(nn_model *m) { return m->statbuf; }
void nn_model_input_shape(const nn_model *m, int *c, int *h, int *w)
{
    *c = m->t[0].c, *h = m->t[0].h, *w = m->t[0].w;
}
int nn_model_classes(const nn_model *m) { return m->nheads ? m->t[m->heads[0].t].c : 0; }
size_t nn_model_activation_bytes(const nn_model *m) { return m->plan_bytes; }

zps_status nn_model_tensor(nn_model *m, const char *name, float **data, int *n, int *c, int *h,
                           int *w)
{
    for (int i = 0; i < m->nt; i++)
        if (strcmp(m->t[i].name, name) == 0) {
            if (m->t[i].local) { /* recompute.c: a later segment may have overwritten it */
                zps_log(ZPS_ERROR, "nn", "tensor %s is not kept with recompute on", name);
                return ZPS_ERR_INVALID;
            }
            if (m->plan_infer && !nn_kept_by_inference(m, i)) {
                zps_log(ZPS_ERROR, "nn", "tensor %s is not kept by an inference forward (its "
                        "space is reused); a training forward keeps every tensor", name);
                return ZPS_ERR_INVALID;
            }
            *data = m->t[i].x;
            *n = m->plan_n ? m->fwd_n : 0, *c = m->t[i].c, *h = m->t[i].h, *w = m->t[i].w;
            return ZPS_OK;
        }
    return ZPS_ERR_NOT_FOUND;
}

int nn_model_tensor_blocked(const nn_model *m, const char *name)
{
    for (int i = 0; i < m->nt; i++)
        if (strcmp(m->t[i].name, name) == 0) {
            return m->t[i].blocked;
        }
    return 0;
}

int nn_model_layer_fused(const nn_model *m, const char *name)
{
    for (int i = 0; i < m->nn; i++)
        if (strcmp(m->nodes[i].name, name) == 0)
            return m->nodes[i].fuse > 0;
    return 0;
}

double nn_model_flops_per_sample(const nn_model *m)
{
    double f = 0;
    for (int i = 0; i < m->nn; i++) {
        const nn_node *nd = &m->nodes[i];
        const nn_tensor *x = &m->t[nd->in[0]], *y = &m->t[nd->out];
        if (nd->kind == NN_CONV_BN || nd->kind == NN_CONV)
            f += 2.0 * y->c * y->h * y->w * (double)x->c * nd->r * nd->s;
        else if (nd->kind == NN_DENSE)
            f += 2.0 * y->c * (double)x->c * x->h * x->w;
    }
    return f;
}
