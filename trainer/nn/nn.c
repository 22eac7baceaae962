/* nn.c — the layer graph, its memory plan, the training step and weights files (see nn.h).
 *
 * Invariants:
 *   - nodes run forward in the order they were added and backward in reverse; a node's
 *     variables are declared when it is added, so backward completes variables in decreasing
 *     table order and each node's range is contiguous;
 *   - every tensor has at most one producer; tensor 0 is the input (no gradient);
 *   - a tensor's gradient is "set" once its first consumer (in backward order) wrote it; later
 *     consumers write into the shared scratch and add (ops overwrite input gradients);
 *   - the activation block is planned for one batch size and reused until the size changes.
 */
#include "trainer/nn/nn.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"

enum { S_MAX_IN = 8, S_MAX_HEADS = 4 };

typedef enum s_kind { S_CONV_BN, S_MAXPOOL, S_AVGPOOL, S_GAP, S_CONCAT, S_DROPOUT, S_DENSE } s_kind;

typedef struct s_tensor {
    char name[96];   // name of the producing layer ("input" for tensor 0)
    int c, h, w;     // per-sample shape
    float *x;        // (n, c, h, w) activation, planned
    float *dx;       // gradient, planned (shares the gradient pool)
    int dx_set;      // gradient written this backward
    int has_dx;      // the plan gave it a gradient buffer
    int blocked;     // kept in the back-end's blocked layout (kernels.h)
} s_tensor;

typedef struct s_node {
    s_kind kind;
    char name[96];
    int in[S_MAX_IN];   // input tensor ids
    int nin;            // number of inputs
    int out;            // output tensor id
    int train_only;     // skipped in evaluation
    int k, r, s, sh, sw, ph, pw; // conv / pool geometry (k: out channels or features)
    int relu;           // dense: ReLU after
    float p;            // dropout rate
    float std;          // init standard deviation
    size_t var0, nvars; // range in the variable table
    size_t stat0;       // first statistic (batchnorm)
    k_conv2d conv;      // planned descriptors
    k_bn bn;
    k_pool pool;
    k_dense dense;
    float *pre;         // conv output before batchnorm (n, k, oh, ow)
    float *mean, *var;  // batch statistics (k)
    uint64_t seed;      // dropout seed of the last forward
} s_node;

typedef struct s_head {
    int t;        // logits tensor
    float weight; // loss weight
} s_head;

struct nn_model {
    const k_backend *be;
    s_tensor *t;            // tensors (nt)
    int nt, cap_t;
    s_node *nodes;          // layers (nn)
    int nn, cap_n;
    s_head heads[S_MAX_HEADS];
    int nheads;
    nn_var *vars, *stats;   // tables
    size_t nvars, nstats, cap_v, cap_s;
    size_t nparams, nstatf; // floats
    float *params, *grads, *statbuf;
    int train_only;         // current building section
    zps_status err;         // first building error
    int finished;
    /* plan */
    int plan_n;             // batch size planned (0: none)
    size_t plan_bytes;
    zps_arena *arena;       // host back-ends
    void *dev_block;        // non-host back-ends
    float *tmp_pre;         // conv+bn: gradient before batchnorm
    float *tmp_acc;         // gradient of a tensor already set, before adding
    int32_t *labels;        // device copy of labels (non-host back-ends)
    int have_forward;       // a training forward ran since the last backward
    uint64_t step;          // forward counter (dropout seeds)
    uint64_t seed;          // init seed
    nn_grad_hook fwd_hook;  // called before a layer with parameters runs forward
    void *fwd_ctx;
};

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
    s_tensor *t = &m->t[m->nt];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->c = c, t->h = h, t->w = w;
    return m->nt++;
}

static s_node *s_add_node(nn_model *m, s_kind kind, const char *name)
{
    if (m->nn == m->cap_n) {
        m->cap_n = m->cap_n ? 2 * m->cap_n : 64;
        m->nodes = zps_xrealloc(m->nodes, sizeof *m->nodes * (size_t)m->cap_n);
    }
    s_node *nd = &m->nodes[m->nn++];
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

static void s_release_plan(nn_model *m)
{
    for (int i = 0; i < m->nn; i++) {
        s_node *nd = &m->nodes[i];
        k_op_release(m->be, &nd->conv.impl);
        k_op_release(m->be, &nd->bn.impl);
        k_op_release(m->be, &nd->pool.impl);
        k_op_release(m->be, &nd->dense.impl);
    }
}

void nn_model_destroy(nn_model **pm)
{
    if (!pm || !*pm)
        return;
    nn_model *m = *pm;
    s_release_plan(m);
    zps_arena_destroy(&m->arena);
    if (m->be) {
        m->be->free(m->dev_block);
        m->be->free(m->params);
        m->be->free(m->grads);
        m->be->free(m->statbuf);
        if (!m->be->host_memory)
            m->be->free(m->labels);
    }
    free(m->t);
    free(m->nodes);
    free(m->vars);
    free(m->stats);
    free(m);
    *pm = NULL;
}

int nn_conv_bn_relu(nn_model *m, const char *name, int in, int k, int r, int s, int stride_h,
                    int stride_w, int pad_h, int pad_w, float init_std)
{
    if (s_check_in(m, in, name) < 0)
        return -1;
    const s_tensor *x = &m->t[in];
    k_conv2d probe;
    if (k_conv2d_init(&probe, 1, x->c, x->h, x->w, k, r, s, stride_h, stride_w, pad_h, pad_w) !=
        ZPS_OK)
        return s_fail(m, ZPS_ERR_INVALID, "conv %s: kernel does not fit its input", name);
    s_node *nd = s_add_node(m, S_CONV_BN, name);
    nd->in[0] = in, nd->nin = 1;
    nd->k = k, nd->r = r, nd->s = s, nd->sh = stride_h, nd->sw = stride_w, nd->ph = pad_h,
    nd->pw = pad_w, nd->std = init_std;
    s_declare(&m->vars, &m->nvars, &m->cap_v, &m->nparams, name, ".conv.weight", 4, k, x->c, r, s);
    s_declare(&m->vars, &m->nvars, &m->cap_v, &m->nparams, name, ".bn.weight", 1, k, 0, 0, 0);
    s_declare(&m->vars, &m->nvars, &m->cap_v, &m->nparams, name, ".bn.bias", 1, k, 0, 0, 0);
    s_declare(&m->stats, &m->nstats, &m->cap_s, &m->nstatf, name, ".bn.running_mean", 1, k, 0, 0, 0);
    s_declare(&m->stats, &m->nstats, &m->cap_s, &m->nstatf, name, ".bn.running_var", 1, k, 0, 0, 0);
    nd->nvars = 3;
    nd->out = s_add_tensor(m, name, k, probe.oh, probe.ow);
    return nd->out;
}

static int s_pool(nn_model *m, s_kind kind, const char *name, int in, int r, int stride, int pad)
{
    if (s_check_in(m, in, name) < 0)
        return -1;
    const s_tensor *x = &m->t[in];
    k_pool probe;
    if (k_pool_init(&probe, kind == S_MAXPOOL ? K_POOL_MAX : K_POOL_AVG, 1, x->c, x->h, x->w, r,
                    r, stride, stride, pad, pad) != ZPS_OK)
        return s_fail(m, ZPS_ERR_INVALID, "pool %s: window does not fit its input", name);
    s_node *nd = s_add_node(m, kind, name);
    nd->in[0] = in, nd->nin = 1;
    nd->r = nd->s = r, nd->sh = nd->sw = stride, nd->ph = nd->pw = pad;
    nd->out = s_add_tensor(m, name, x->c, probe.oh, probe.ow);
    return nd->out;
}

int nn_maxpool(nn_model *m, const char *name, int in, int r, int stride, int pad)
{
    return s_pool(m, S_MAXPOOL, name, in, r, stride, pad);
}

int nn_avgpool(nn_model *m, const char *name, int in, int r, int stride, int pad)
{
    return s_pool(m, S_AVGPOOL, name, in, r, stride, pad);
}

int nn_gap(nn_model *m, const char *name, int in)
{
    if (s_check_in(m, in, name) < 0)
        return -1;
    s_node *nd = s_add_node(m, S_GAP, name);
    nd->in[0] = in, nd->nin = 1;
    nd->out = s_add_tensor(m, name, m->t[in].c, 1, 1);
    return nd->out;
}

int nn_concat(nn_model *m, const char *name, int n, const int *ins)
{
    if (n < 1 || n > S_MAX_IN)
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
    s_node *nd = s_add_node(m, S_CONCAT, name);
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
    s_node *nd = s_add_node(m, S_DROPOUT, name);
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
    const s_tensor *x = &m->t[in];
    int nin = x->c * x->h * x->w;
    s_node *nd = s_add_node(m, S_DENSE, name);
    nd->in[0] = in, nd->nin = 1, nd->k = out, nd->relu = relu, nd->std = init_std;
    s_declare(&m->vars, &m->nvars, &m->cap_v, &m->nparams, name, ".weight", 2, out, nin, 0, 0);
    s_declare(&m->vars, &m->nvars, &m->cap_v, &m->nparams, name, ".bias", 1, out, 0, 0, 0);
    nd->nvars = 2;
    nd->out = s_add_tensor(m, name, out, 1, 1);
    return nd->out;
}

void nn_model_train_only(nn_model *m, int on) { m->train_only = on; }

void nn_model_head(nn_model *m, int t, float weight)
{
    if (t < 0 || t >= m->nt || m->t[t].h != 1 || m->t[t].w != 1 || m->nheads == S_MAX_HEADS) {
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
        s_node *nd = &m->nodes[i];
        if (nd->kind == S_CONV_BN) {
            const nn_var *w = &m->vars[nd->var0], *g = w + 1, *b = w + 2;
            for (size_t j = 0; j < w->count; j++)
                p[w->offset + j] = s_trunc_normal(m->seed, &ctr, nd->std);
            for (size_t j = 0; j < g->count; j++)
                p[g->offset + j] = 1.0f, p[b->offset + j] = 0.0f;
            const nn_var *rm = &m->stats[nd->stat0], *rv = rm + 1;
            for (size_t j = 0; j < rm->count; j++)
                st[rm->offset + j] = 0.0f, st[rv->offset + j] = 1.0f;
        } else if (nd->kind == S_DENSE) {
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
    if (m->nheads == 0) {
        zps_log(ZPS_ERROR, "nn", "model has no loss head");
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
            *data = m->t[i].x;
            *n = m->plan_n, *c = m->t[i].c, *h = m->t[i].h, *w = m->t[i].w;
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

double nn_model_flops_per_sample(const nn_model *m)
{
    double f = 0;
    for (int i = 0; i < m->nn; i++) {
        const s_node *nd = &m->nodes[i];
        const s_tensor *x = &m->t[nd->in[0]], *y = &m->t[nd->out];
        if (nd->kind == S_CONV_BN)
            f += 2.0 * y->c * y->h * y->w * (double)x->c * nd->r * nd->s;
        else if (nd->kind == S_DENSE)
            f += 2.0 * y->c * (double)x->c * x->h * x->w;
    }
    return f;
}

/* ---- memory plan ---- */

static size_t s_tsize(const nn_model *m, int t, int n)
{
    return (size_t)n * m->t[t].c * m->t[t].h * m->t[t].w;
}

static size_t s_round(size_t nfloats) { return (nfloats + 15) & ~(size_t)15; }

/* First-fit allocator over a linear pool of floats, for gradient buffers. */
typedef struct s_pool_alloc {
    size_t *off, *len; // free blocks, sorted by offset
    int n, cap;
    size_t top;        // end of the highest block in use
    size_t peak;       // largest top seen: the pool size
} s_pool_alloc;

static size_t s_pa_alloc(s_pool_alloc *pa, size_t len)
{
    for (int i = 0; i < pa->n; i++)
        if (pa->len[i] >= len) {
            size_t o = pa->off[i];
            pa->off[i] += len, pa->len[i] -= len;
            if (pa->len[i] == 0) {
                memmove(pa->off + i, pa->off + i + 1, sizeof(size_t) * (size_t)(pa->n - i - 1));
                memmove(pa->len + i, pa->len + i + 1, sizeof(size_t) * (size_t)(pa->n - i - 1));
                pa->n--;
            }
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
    /* merge with neighbours */
    if (i + 1 < pa->n && pa->off[i] + pa->len[i] == pa->off[i + 1]) {
        pa->len[i] += pa->len[i + 1];
        memmove(pa->off + i + 1, pa->off + i + 2, sizeof(size_t) * (size_t)(pa->n - i - 2));
        memmove(pa->len + i + 1, pa->len + i + 2, sizeof(size_t) * (size_t)(pa->n - i - 2));
        pa->n--;
    }
    if (i > 0 && pa->off[i - 1] + pa->len[i - 1] == pa->off[i]) {
        pa->len[i - 1] += pa->len[i];
        memmove(pa->off + i, pa->off + i + 1, sizeof(size_t) * (size_t)(pa->n - i - 1));
        memmove(pa->len + i, pa->len + i + 1, sizeof(size_t) * (size_t)(pa->n - i - 1));
        pa->n--;
    }
    if (pa->n > 0 && pa->off[pa->n - 1] + pa->len[pa->n - 1] == pa->top) {
        pa->top = pa->off[pa->n - 1];
        pa->n--;
    }
}

/* Chooses the blocked layout for every tensor the back-end prefers it for, when the whole
 * graph can stay blocked between its edges: concat inputs agree, and dense layers read either
 * plain tensors or 1x1 maps (where blocked equals NCHW). Otherwise everything stays NCHW. */
static void s_layouts(nn_model *m)
{
    int ok = m->be->prefers_blocked != NULL;
    for (int t = 0; t < m->nt; t++)
        m->t[t].blocked = 0;
    for (int i = 0; ok && i < m->nn; i++) {
        s_node *nd = &m->nodes[i];
        s_tensor *x = &m->t[nd->in[0]], *y = &m->t[nd->out];
        switch (nd->kind) {
        case S_CONV_BN:
            y->blocked = m->be->prefers_blocked(y->c);
            break;
        case S_CONCAT:
            for (int j = 1; j < nd->nin; j++)
                ok &= m->t[nd->in[j]].blocked == x->blocked;
            y->blocked = x->blocked;
            break;
        case S_DENSE:
            ok &= !x->blocked || (x->h == 1 && x->w == 1);
            break;
        default:
            y->blocked = x->blocked;
            break;
        }
    }
    if (!ok)
        for (int t = 0; t < m->nt; t++)
            m->t[t].blocked = 0;
}

static zps_status s_plan(nn_model *m, int n)
{
    if (m->plan_n == n)
        return ZPS_OK;
    s_release_plan(m);
    s_layouts(m);
    size_t total = 0;
    /* offsets (in floats) first, pointers once the block exists */
    size_t *xoff = zps_xcalloc((size_t)m->nt, sizeof(size_t));
    size_t *goff = zps_xcalloc((size_t)m->nt, sizeof(size_t));
    size_t *nodeoff = zps_xcalloc((size_t)m->nn, sizeof(size_t));
    size_t max_pre = 0, max_t = 0;
    for (int t = 0; t < m->nt; t++) {
        xoff[t] = total;
        total += s_round(s_tsize(m, t, n));
        if (s_tsize(m, t, n) > max_t)
            max_t = s_tsize(m, t, n);
    }
    for (int i = 0; i < m->nn; i++) {
        s_node *nd = &m->nodes[i];
        const s_tensor *x = &m->t[nd->in[0]];
        nodeoff[i] = total;
        switch (nd->kind) {
        case S_CONV_BN:
            ZPS_TRY(k_conv2d_init(&nd->conv, n, x->c, x->h, x->w, nd->k, nd->r, nd->s, nd->sh,
                                  nd->sw, nd->ph, nd->pw));
            nd->conv.x_blocked = x->blocked;
            nd->conv.y_blocked = m->t[nd->out].blocked;
            nd->bn = (k_bn){.n = n, .c = nd->k, .h = nd->conv.oh, .w = nd->conv.ow,
                            .eps = 0.001f, .momentum = 0.1f, .relu = 1,
                            .blocked = m->t[nd->out].blocked};
            total += s_round(s_tsize(m, nd->out, n)) + 2 * s_round((size_t)nd->k);
            if (s_tsize(m, nd->out, n) > max_pre)
                max_pre = s_tsize(m, nd->out, n);
            break;
        case S_MAXPOOL:
        case S_AVGPOOL:
            ZPS_TRY(k_pool_init(&nd->pool, nd->kind == S_MAXPOOL ? K_POOL_MAX : K_POOL_AVG, n,
                                x->c, x->h, x->w, nd->r, nd->s, nd->sh, nd->sw, nd->ph, nd->pw));
            nd->pool.blocked = x->blocked;
            break;
        case S_GAP:
            ZPS_TRY(k_pool_init(&nd->pool, K_POOL_AVG, n, x->c, x->h, x->w, x->h, x->w, 1, 1, 0,
                                0));
            nd->pool.blocked = x->blocked;
            break;
        case S_DENSE:
            nd->dense = (k_dense){.n = n, .in = x->c * x->h * x->w, .out = nd->k};
            break;
        default:
            break;
        }
    }
    size_t tmp_pre = total;
    total += s_round(max_pre);
    size_t tmp_acc = total;
    total += s_round(max_t);
    /* gradient pool: live from the first consumer's backward to the producer's backward */
    s_pool_alloc pa = {0};
    char *has = zps_xcalloc((size_t)m->nt, 1);
    for (int h = 0; h < m->nheads; h++) {
        int t = m->heads[h].t;
        goff[t] = s_pa_alloc(&pa, s_round(s_tsize(m, t, n)));
        has[t] = 1;
    }
    for (int i = m->nn - 1; i >= 0; i--) {
        s_node *nd = &m->nodes[i];
        for (int j = 0; j < nd->nin; j++) {
            int t = nd->in[j];
            if (t != 0 && !has[t]) {
                goff[t] = s_pa_alloc(&pa, s_round(s_tsize(m, t, n)));
                has[t] = 1;
            }
        }
        if (has[nd->out])
            s_pa_free(&pa, goff[nd->out], s_round(s_tsize(m, nd->out, n)));
    }
    size_t gpool = total;
    total += pa.peak;
    free(pa.off);
    free(pa.len);

    size_t bytes = total * sizeof(float) + 64;
    float *base;
    if (m->be->host_memory) {
        if (!m->arena)
            m->arena = zps_arena_new(0);
        zps_arena_reset(m->arena);
        base = zps_arena_alloc(m->arena, bytes);
    } else {
        m->be->free(m->dev_block);
        m->be->free(m->labels);
        m->dev_block = m->be->alloc(bytes);
        m->labels = m->be->alloc(sizeof(int32_t) * (size_t)n);
        if (!m->dev_block || !m->labels) {
            free(xoff), free(goff), free(nodeoff), free(has);
            m->plan_n = 0;
            return ZPS_ERR_NOMEM;
        }
        base = m->dev_block;
    }
    for (int t = 0; t < m->nt; t++) {
        m->t[t].x = base + xoff[t];
        m->t[t].has_dx = has[t];
        m->t[t].dx = has[t] ? base + gpool + goff[t] : NULL;
    }
    for (int i = 0; i < m->nn; i++) {
        s_node *nd = &m->nodes[i];
        if (nd->kind == S_CONV_BN) {
            nd->pre = base + nodeoff[i];
            nd->mean = nd->pre + s_round(s_tsize(m, nd->out, n));
            nd->var = nd->mean + s_round((size_t)nd->k);
        }
    }
    m->tmp_pre = base + tmp_pre;
    m->tmp_acc = base + tmp_acc;
    m->plan_n = n;
    m->plan_bytes = bytes;
    zps_log(ZPS_DEBUG, "nn", "planned batch %d: %.1f MiB of activations and gradients", n,
            (double)bytes / (1 << 20));
    free(xoff), free(goff), free(nodeoff), free(has);
    return ZPS_OK;
}

/* ---- forward ---- */

static zps_status s_node_fwd(nn_model *m, s_node *nd, int train)
{
    const k_backend *be = m->be;
    float *x = m->t[nd->in[0]].x, *y = m->t[nd->out].x;
    const float *p = m->params;
    switch (nd->kind) {
    case S_CONV_BN: {
        const nn_var *w = &m->vars[nd->var0];
        const float *g = p + w[1].offset, *b = p + w[2].offset;
        float *rm = m->statbuf + m->stats[nd->stat0].offset;
        float *rv = m->statbuf + m->stats[nd->stat0 + 1].offset;
        ZPS_TRY(k_conv2d_fwd(be, &nd->conv, x, p + w->offset, NULL, nd->pre));
        if (train)
            return k_bn_fwd_train(be, &nd->bn, nd->pre, g, b, y, nd->mean, nd->var, rm, rv);
        return k_bn_fwd_infer(be, &nd->bn, nd->pre, g, b, rm, rv, y);
    }
    case S_MAXPOOL:
    case S_AVGPOOL:
    case S_GAP:
        return k_pool_fwd(be, &nd->pool, x, y);
    case S_CONCAT: {
        const float *xs[S_MAX_IN];
        int c[S_MAX_IN];
        for (int j = 0; j < nd->nin; j++)
            xs[j] = m->t[nd->in[j]].x, c[j] = m->t[nd->in[j]].c;
        return k_concat_fwd(be, m->plan_n, m->t[nd->out].h * m->t[nd->out].w, nd->nin, c, xs, y);
    }
    case S_DROPOUT:
        nd->seed = m->seed ^ (m->step * 0x9E3779B97F4A7C15ull) ^ (uint64_t)(nd - m->nodes);
        return k_dropout_fwd(be, s_tsize(m, nd->out, m->plan_n), train ? nd->p : 0.0f, nd->seed,
                             x, y);
    case S_DENSE: {
        const nn_var *w = &m->vars[nd->var0];
        ZPS_TRY(k_dense_fwd(be, &nd->dense, x, p + w->offset, p + w[1].offset, y));
        if (nd->relu)
            return k_relu_fwd(be, s_tsize(m, nd->out, m->plan_n), y, y);
        return ZPS_OK;
    }
    }
    return ZPS_ERR_INTERNAL;
}

void nn_model_set_forward_hook(nn_model *m, nn_grad_hook hook, void *ctx)
{
    m->fwd_hook = hook;
    m->fwd_ctx = ctx;
}

zps_status nn_model_forward(nn_model *m, const float *x, const int32_t *labels, int n, int train,
                            float *loss, int *correct)
{
    assert(m->finished);
    if (n <= 0)
        return ZPS_ERR_INVALID;
    int classes0 = nn_model_classes(m);
    for (int i = 0; i < n; i++)
        if (labels[i] < 0 || labels[i] >= classes0) {
            zps_log(ZPS_ERROR, "nn", "label %d of row %d outside [0, %d)", labels[i], i,
                    classes0);
            return ZPS_ERR_INVALID;
        }
    ZPS_TRY(s_plan(m, n));
    ZPS_TRY(m->be->copy_in(m->t[0].x, x, s_tsize(m, 0, n) * sizeof(float)));
    const int32_t *lab = labels;
    if (!m->be->host_memory) {
        ZPS_TRY(m->be->copy_in(m->labels, labels, sizeof(int32_t) * (size_t)n));
        lab = m->labels;
    }
    m->step++;
    for (int i = 0; i < m->nn; i++) {
        s_node *nd = &m->nodes[i];
        if (!train && nd->train_only)
            continue;
        if (m->fwd_hook && nd->nvars)
            m->fwd_hook(m->fwd_ctx, nd->var0, nd->nvars);
        zps_status st = s_node_fwd(m, nd, train);
        if (st != ZPS_OK) {
            zps_log(ZPS_ERROR, "nn", "forward of %s failed: %s", nd->name, zps_strerror(st));
            return st;
        }
    }
    for (int t = 0; t < m->nt; t++)
        m->t[t].dx_set = 0;
    float total = 0;
    for (int h = 0; h < (train ? m->nheads : 1); h++) {
        s_tensor *lt = &m->t[m->heads[h].t];
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
    m->have_forward = train;
    return ZPS_OK;
}

zps_status nn_model_eval(nn_model *m, const float *x, const int32_t *labels, int n, float *loss,
                         int *correct)
{
    return nn_model_forward(m, x, labels, n, 0, loss, correct);
}

/* ---- backward ---- */

/* Where an op should write the gradient of tensor t: NULL (the input needs none), t's own
 * buffer, or the scratch when another consumer already wrote it. */
static float *s_dx_target(nn_model *m, int t)
{
    if (t == 0 || !m->t[t].has_dx)
        return NULL;
    return m->t[t].dx_set ? m->tmp_acc : m->t[t].dx;
}

static zps_status s_dx_commit(nn_model *m, int t)
{
    if (t == 0 || !m->t[t].has_dx)
        return ZPS_OK;
    if (m->t[t].dx_set)
        return k_axpy(m->be, s_tsize(m, t, m->plan_n), 1.0f, m->tmp_acc, m->t[t].dx);
    m->t[t].dx_set = 1;
    return ZPS_OK;
}

static zps_status s_node_bwd(nn_model *m, s_node *nd)
{
    const k_backend *be = m->be;
    s_tensor *o = &m->t[nd->out];
    int in = nd->in[0];
    float *x = m->t[in].x, *dy = o->dx;
    float *p = m->params, *g = m->grads;
    switch (nd->kind) {
    case S_CONV_BN: {
        const nn_var *w = &m->vars[nd->var0];
        ZPS_TRY(k_bn_bwd(be, &nd->bn, nd->pre, o->x, dy, p + w[1].offset, nd->mean, nd->var,
                         m->tmp_pre, g + w[1].offset, g + w[2].offset));
        ZPS_TRY(k_conv2d_bwd(be, &nd->conv, x, p + w->offset, m->tmp_pre, s_dx_target(m, in),
                             g + w->offset, NULL));
        return s_dx_commit(m, in);
    }
    case S_MAXPOOL:
    case S_AVGPOOL:
    case S_GAP: {
        float *dx = s_dx_target(m, in);
        if (dx)
            ZPS_TRY(k_pool_bwd(be, &nd->pool, x, o->x, dy, dx));
        return s_dx_commit(m, in);
    }
    case S_CONCAT: {
        float *dxs[S_MAX_IN];
        int c[S_MAX_IN], hw = o->h * o->w, again = 0;
        for (int j = 0; j < nd->nin; j++) {
            int t = nd->in[j];
            c[j] = m->t[t].c;
            dxs[j] = (t == 0 || !m->t[t].has_dx || m->t[t].dx_set) ? NULL : m->t[t].dx;
            again |= t != 0 && m->t[t].has_dx && m->t[t].dx_set;
        }
        ZPS_TRY(k_concat_bwd(be, m->plan_n, hw, nd->nin, c, dy, dxs));
        for (int j = 0; j < nd->nin; j++)
            if (dxs[j])
                m->t[nd->in[j]].dx_set = 1;
        if (!again)
            return ZPS_OK;
        /* inputs whose gradient was already set: one at a time through the scratch */
        for (int j = 0; j < nd->nin; j++) {
            int t = nd->in[j];
            if (dxs[j] || t == 0 || !m->t[t].has_dx)
                continue;
            float *one[S_MAX_IN] = {0};
            one[j] = m->tmp_acc;
            ZPS_TRY(k_concat_bwd(be, m->plan_n, hw, nd->nin, c, dy, one));
            ZPS_TRY(k_axpy(be, s_tsize(m, t, m->plan_n), 1.0f, m->tmp_acc, m->t[t].dx));
        }
        return ZPS_OK;
    }
    case S_DROPOUT: {
        float *dx = s_dx_target(m, in);
        if (dx)
            ZPS_TRY(k_dropout_bwd(be, s_tsize(m, nd->out, m->plan_n), nd->p, nd->seed, dy, dx));
        return s_dx_commit(m, in);
    }
    case S_DENSE: {
        const nn_var *w = &m->vars[nd->var0];
        if (nd->relu)
            ZPS_TRY(k_relu_bwd(be, s_tsize(m, nd->out, m->plan_n), o->x, dy, dy));
        ZPS_TRY(k_dense_bwd(be, &nd->dense, x, p + w->offset, dy, s_dx_target(m, in),
                            g + w->offset, g + w[1].offset));
        return s_dx_commit(m, in);
    }
    }
    return ZPS_ERR_INTERNAL;
}

zps_status nn_model_backward(nn_model *m, nn_grad_hook hook, void *ctx)
{
    if (!m->have_forward) {
        zps_log(ZPS_ERROR, "nn", "backward without a training forward");
        return ZPS_ERR_INVALID;
    }
    for (int i = m->nn - 1; i >= 0; i--) {
        s_node *nd = &m->nodes[i];
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
    }
    m->have_forward = 0;
    return ZPS_OK;
}

/* ---- weights files ---- */

static const char s_magic[8] = {'Z', 'P', 'S', 'W', 'G', 'T', '0', '1'};
enum { S_WEIGHTS_VERSION = 1, S_MAX_NAME = 95 };

static int s_wr(FILE *f, const void *p, size_t n) { return fwrite(p, 1, n, f) == n ? 0 : -1; }
static int s_rd(FILE *f, void *p, size_t n) { return fread(p, 1, n, f) == n ? 0 : -1; }

static int s_write_table(FILE *f, const nn_var *v, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint16_t len = (uint16_t)strlen(v[i].name);
        uint32_t nd = (uint32_t)v[i].ndim;
        uint64_t cnt = v[i].count;
        if (s_wr(f, &len, 2) || s_wr(f, v[i].name, len) || s_wr(f, &nd, 4))
            return -1;
        for (int d = 0; d < v[i].ndim; d++) {
            uint32_t s = (uint32_t)v[i].shape[d];
            if (s_wr(f, &s, 4))
                return -1;
        }
        if (s_wr(f, &cnt, 8))
            return -1;
    }
    return 0;
}

zps_status nn_weights_write(const char *path, const nn_var *vars, size_t nvars,
                            const float *params, const nn_var *stats, size_t nstats,
                            const float *statdata)
{
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        zps_log(ZPS_ERROR, "nn", "%s: cannot create: %s", tmp, strerror(errno));
        return ZPS_ERR_IO;
    }
    uint32_t hdr[3] = {S_WEIGHTS_VERSION, (uint32_t)nvars, (uint32_t)nstats};
    size_t np = 0, ns = 0;
    for (size_t i = 0; i < nvars; i++)
        np += vars[i].count;
    for (size_t i = 0; i < nstats; i++)
        ns += stats[i].count;
    int bad = s_wr(f, s_magic, 8) || s_wr(f, hdr, sizeof hdr) || s_write_table(f, vars, nvars) ||
              s_write_table(f, stats, nstats) || s_wr(f, params, np * sizeof(float)) ||
              (ns && s_wr(f, statdata, ns * sizeof(float)));
    if (fclose(f) != 0)
        bad = 1;
    if (bad || rename(tmp, path) != 0) {
        zps_log(ZPS_ERROR, "nn", "%s: write failed: %s", path, strerror(errno));
        unlink(tmp);
        return ZPS_ERR_IO;
    }
    return ZPS_OK;
}

static int s_read_table(FILE *f, nn_var *v, size_t n, size_t *total)
{
    *total = 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t len;
        uint32_t nd;
        uint64_t cnt;
        memset(&v[i], 0, sizeof v[i]);
        if (s_rd(f, &len, 2) || len > S_MAX_NAME || s_rd(f, v[i].name, len) || s_rd(f, &nd, 4) ||
            nd < 1 || nd > 4)
            return -1;
        v[i].ndim = (int)nd;
        uint64_t prod = 1;
        for (uint32_t d = 0; d < nd; d++) {
            uint32_t s;
            if (s_rd(f, &s, 4) || s == 0 || s > (1u << 30))
                return -1;
            v[i].shape[d] = (int)s;
            prod *= s;
        }
        if (s_rd(f, &cnt, 8) || cnt != prod || prod > ((uint64_t)1 << 34))
            return -1;
        v[i].count = cnt;
        v[i].offset = *total;
        *total += cnt;
    }
    return 0;
}

void nn_weights_destroy(nn_weights **pw)
{
    if (!pw || !*pw)
        return;
    free((*pw)->vars);
    free((*pw)->stats);
    free((*pw)->params);
    free((*pw)->statdata);
    free(*pw);
    *pw = NULL;
}

zps_status nn_weights_read(const char *path, nn_weights **out)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        zps_log(ZPS_ERROR, "nn", "%s: cannot open: %s", path, strerror(errno));
        return errno == ENOENT ? ZPS_ERR_NOT_FOUND : ZPS_ERR_IO;
    }
    char magic[8];
    uint32_t hdr[3];
    nn_weights *w = zps_xcalloc(1, sizeof *w);
    zps_status st = ZPS_ERR_CORRUPT;
    if (s_rd(f, magic, 8) || memcmp(magic, s_magic, 8) != 0 || s_rd(f, hdr, sizeof hdr))
        goto done;
    if (hdr[0] != S_WEIGHTS_VERSION) {
        st = ZPS_ERR_VERSION;
        goto done;
    }
    if (hdr[1] > 100000 || hdr[2] > 100000)
        goto done;
    w->nvars = hdr[1], w->nstats = hdr[2];
    w->vars = zps_xcalloc(w->nvars + 1, sizeof *w->vars);
    w->stats = zps_xcalloc(w->nstats + 1, sizeof *w->stats);
    if (s_read_table(f, w->vars, w->nvars, &w->param_count) ||
        s_read_table(f, w->stats, w->nstats, &w->stat_count))
        goto done;
    /* the data must be exactly what the tables promise */
    long here = ftell(f);
    if (here < 0 || fseek(f, 0, SEEK_END) != 0)
        goto done;
    long end = ftell(f);
    if (end < 0 || (uint64_t)(end - here) != (w->param_count + w->stat_count) * sizeof(float) ||
        fseek(f, here, SEEK_SET) != 0)
        goto done;
    w->params = zps_xmalloc(w->param_count * sizeof(float) + 4);
    w->statdata = zps_xmalloc(w->stat_count * sizeof(float) + 4);
    if (s_rd(f, w->params, w->param_count * sizeof(float)) ||
        s_rd(f, w->statdata, w->stat_count * sizeof(float)))
        goto done;
    st = ZPS_OK;
done:
    fclose(f);
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "nn", "%s: not a valid zps weights file (%s)", path, zps_strerror(st));
        nn_weights_destroy(&w);
    }
    *out = w;
    return st;
}

zps_status nn_model_save(nn_model *m, const char *path)
{
    float *hp = m->params, *hs = m->statbuf;
    if (!m->be->host_memory) {
        hp = zps_xmalloc(m->nparams * sizeof(float) + 4);
        hs = zps_xmalloc(m->nstatf * sizeof(float) + 4);
        zps_status st = m->be->copy_out(hp, m->params, m->nparams * sizeof(float));
        if (st == ZPS_OK)
            st = m->be->copy_out(hs, m->statbuf, m->nstatf * sizeof(float));
        if (st != ZPS_OK) {
            free(hp), free(hs);
            return st;
        }
    }
    zps_status st = nn_weights_write(path, m->vars, m->nvars, hp, m->stats, m->nstats, hs);
    if (!m->be->host_memory)
        free(hp), free(hs);
    return st;
}

static int s_same_table(const nn_var *a, size_t na, const nn_var *b, size_t nb, const char **bad)
{
    if (na != nb) {
        *bad = "number of variables";
        return 0;
    }
    for (size_t i = 0; i < na; i++)
        if (strcmp(a[i].name, b[i].name) != 0 || a[i].count != b[i].count ||
            a[i].ndim != b[i].ndim || memcmp(a[i].shape, b[i].shape, sizeof(int) * (size_t)a[i].ndim)) {
            *bad = a[i].name;
            return 0;
        }
    return 1;
}

zps_status nn_model_load(nn_model *m, const char *path)
{
    nn_weights *w;
    ZPS_TRY(nn_weights_read(path, &w));
    const char *bad = NULL;
    zps_status st = ZPS_OK;
    if (!s_same_table(w->vars, w->nvars, m->vars, m->nvars, &bad) ||
        !s_same_table(w->stats, w->nstats, m->stats, m->nstats, &bad)) {
        zps_log(ZPS_ERROR, "nn", "%s does not fit this model (first difference: %s)", path, bad);
        st = ZPS_ERR_CONFIG;
    }
    if (st == ZPS_OK)
        st = m->be->copy_in(m->params, w->params, m->nparams * sizeof(float));
    if (st == ZPS_OK && m->nstatf)
        st = m->be->copy_in(m->statbuf, w->statdata, m->nstatf * sizeof(float));
    nn_weights_destroy(&w);
    return st;
}
