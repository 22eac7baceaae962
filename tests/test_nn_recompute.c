/* test_nn_recompute.c — gradient checkpointing (nn_model_set_recompute, trainer/nn/recompute.c):
 * a training step with recompute gives the same loss, gradients, running statistics and
 * gradient hooks as one without, bit for bit (the cpu back-end is deterministic at a fixed
 * thread count), while the planned activation block shrinks. Models: a dense chain with its
 * dropout in a segment that backward reruns (the rerun must draw the same masks), the
 * convnet, Inception-v3 w0.25 at 299x299 with its aux head (a
 * training-only branch reading a kept tensor), the detector through injected output
 * gradients, and the convnet on the staged back-end (the device path). Also: two steps in a
 * row, an evaluation after a recompute step, and the refusal to hand out a tensor that is not
 * kept. Fresh seed per run (printed on failure; ZPS_TEST_SEED reproduces).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/kernels.h"
#include "tests/testutil.h"
#include "trainer/models/models.h"
#include "trainer/nn/nn.h"

static uint64_t s_seed;

static void s_init(void)
{
    s_seed = zt_seed_init();
    zps_log_set_level(ZPS_LOG_WARN);
    setenv("OMP_NUM_THREADS", "1", 1);
}

/* What one step left behind. */
typedef struct s_out {
    float loss[2];       // two steps
    float *grads;        // (np) after the second step
    float *stats;        // (ns) running statistics after both
    size_t np, ns, bytes;
    int segments;
    size_t hooks[1024];  // hook calls of the second backward: first << 16 | n
    int nhooks;
    float eval_loss;
    int eval_correct;
} s_out;

static void s_hook(void *ctx, size_t first, size_t n)
{
    s_out *o = ctx;
    cr_assert_lt(o->nhooks, 1024);
    o->hooks[o->nhooks++] = first << 16 | n;
}

static void s_batch(const nn_model_opts *o, int batch, float **x, int32_t **y)
{
    size_t nx = (size_t)batch * o->in_channels * o->in_size * o->in_size;
    *x = malloc(nx * sizeof **x);
    *y = malloc((size_t)batch * sizeof **y);
    for (size_t i = 0; i < nx; i++)
        (*x)[i] = zt_unif(-1, 1);
    for (int i = 0; i < batch; i++)
        (*y)[i] = (int32_t)(zt_rand() % (uint32_t)o->classes);
}

/* "dropout_chain": ten dense layers with the dropout right after the first, so that it
 * falls in an early segment, which backward runs again (the convnet's and Inception's
 * dropouts sit in the last segment, which is never rerun). */
static nn_model *s_dropout_chain(const k_backend *be, const nn_model_opts *o)
{
    nn_model *m = nn_model_new(be, o->in_channels, o->in_size, o->in_size);
    int x = nn_dense(m, "fc1", 0, 64, 1, 0.2f);
    x = nn_dropout(m, "dropout", x, 0.5f);
    char name[8];
    for (int i = 2; i <= 9; i++) {
        snprintf(name, sizeof name, "fc%d", i);
        x = nn_dense(m, name, x, 64, 1, 0.2f);
    }
    x = nn_dense(m, "fc10", x, o->classes, 0, 0.1f);
    nn_model_head(m, x, 1.0f);
    cr_assert_eq(nn_model_finish(m, o->seed), ZPS_OK);
    return m;
}

/* Two training steps (the same batch; the second with hooks) and an evaluation. */
static void s_run(const nn_model_opts *o, const k_backend *be, int recompute, int batch,
                  const float *x, const int32_t *y, s_out *out)
{
    nn_model *m;
    if (strcmp(o->name, "dropout_chain") == 0)
        m = s_dropout_chain(be, o);
    else
        cr_assert_eq(nn_model_create(be, o, &m), ZPS_OK);
    nn_model_set_recompute(m, recompute);
    *out = (s_out){.np = nn_model_param_count(m), .ns = nn_model_stat_count(m)};
    for (int step = 0; step < 2; step++) {
        cr_assert_eq(nn_model_forward(m, x, y, batch, 1, &out->loss[step], NULL), ZPS_OK);
        cr_assert_eq(nn_model_backward(m, step ? s_hook : NULL, out), ZPS_OK);
    }
    out->bytes = nn_model_activation_bytes(m);
    out->segments = nn_model_segments(m);
    out->grads = malloc(out->np * sizeof(float));
    out->stats = malloc(out->ns * sizeof(float));
    cr_assert_eq(be->copy_out(out->grads, nn_model_grads(m), out->np * sizeof(float)), ZPS_OK);
    cr_assert_eq(be->copy_out(out->stats, nn_model_statbuf(m), out->ns * sizeof(float)), ZPS_OK);
    cr_assert_eq(nn_model_eval(m, x, y, batch, &out->eval_loss, &out->eval_correct), ZPS_OK);
    nn_model_destroy(&m);
}

static void s_out_free(s_out *o)
{
    free(o->grads);
    free(o->stats);
}

/* Without and with recompute on back-end `be_with`: equal in every respect, smaller. */
static void s_same(const nn_model_opts *o, int batch, const k_backend *be_with,
                   double max_ratio)
{
    float *x;
    int32_t *y;
    s_batch(o, batch, &x, &y);
    s_out a, b;
    s_run(o, k_backend_cpu(), 0, batch, x, y, &a);
    s_run(o, be_with, 1, batch, x, y, &b);
    const char *name = o->name;
    cr_assert_eq(a.segments, 1, "%s: segments without recompute", name);
    cr_assert_gt(b.segments, 1, "%s: recompute planned no segments", name);
    for (int s = 0; s < 2; s++)
        cr_assert_eq(a.loss[s], b.loss[s], "%s step %d: loss %.9g, with recompute %.9g "
                     "(seed %llu)", name, s + 1, a.loss[s], b.loss[s],
                     (unsigned long long)s_seed);
    cr_assert(isfinite(a.loss[1]));
    for (size_t i = 0; i < a.np; i++)
        cr_assert_eq(a.grads[i], b.grads[i], "%s: gradient %zu of %zu: %.9g, with recompute "
                     "%.9g (seed %llu)", name, i, a.np, a.grads[i], b.grads[i],
                     (unsigned long long)s_seed);
    cr_assert_eq(memcmp(a.stats, b.stats, a.ns * sizeof(float)), 0,
                 "%s: running statistics differ with recompute (seed %llu)", name,
                 (unsigned long long)s_seed);
    cr_assert_eq(a.nhooks, b.nhooks, "%s: %d hook calls, with recompute %d", name, a.nhooks,
                 b.nhooks);
    cr_assert_eq(memcmp(a.hooks, b.hooks, (size_t)a.nhooks * sizeof *a.hooks), 0,
                 "%s: the hooks came in another order with recompute", name);
    cr_assert_eq(a.eval_loss, b.eval_loss, "%s: evaluation after a recompute step", name);
    cr_assert_eq(a.eval_correct, b.eval_correct);
    cr_assert_lt((double)b.bytes, max_ratio * (double)a.bytes,
                 "%s: %zu bytes planned with recompute (%d segments), %zu without", name,
                 b.bytes, b.segments, a.bytes);
    cr_log_info("%s batch %d: %.1f MiB of activations and gradients, %.1f MiB with recompute "
                "(%d segments)", name, batch, a.bytes / 1048576.0, b.bytes / 1048576.0,
                b.segments);
    s_out_free(&a);
    s_out_free(&b);
    free(x);
    free(y);
}

static void s_opts(nn_model_opts *o, const char *name)
{
    nn_model_opts_default(o, name);
    o->seed = s_seed;
}

Test(nn_recompute, convnet_with_dropout_is_bit_identical, .init = s_init, .timeout = 60)
{
    nn_model_opts o;
    s_opts(&o, "convnet");
    cr_assert_gt(o.dropout, 0, "the convnet's dropout is what this case is about");
    s_same(&o, 16, k_backend_cpu(), 0.9);
}

Test(nn_recompute, dropout_in_a_rerun_segment_draws_the_same_masks, .init = s_init,
     .timeout = 60)
{
    nn_model_opts o;
    s_opts(&o, "mlp");
    o.name = "dropout_chain", o.in_channels = 1, o.in_size = 8, o.classes = 10;
    s_same(&o, 16, k_backend_cpu(), 1.0);
}

Test(nn_recompute, inception_with_aux_is_bit_identical, .init = s_init, .timeout = 120)
{
    nn_model_opts o;
    s_opts(&o, "inception_v3");
    o.in_size = 299, o.width = 0.25f, o.in_channels = 1, o.classes = 10, o.aux = 1;
    s_same(&o, 2, k_backend_cpu(), 0.6);
}

Test(nn_recompute, staged_device_is_bit_identical, .init = s_init, .timeout = 60)
{
    nn_model_opts o;
    s_opts(&o, "convnet");
    s_same(&o, 16, k_backend_staged(), 0.9);
}

/* The detector: gradients injected into its outputs, which recompute keeps. */
Test(nn_recompute, detector_outputs_are_bit_identical, .init = s_init, .timeout = 120)
{
    nn_model_opts o;
    s_opts(&o, "ssd");
    int batch = 2;
    size_t nx = (size_t)batch * o.in_channels * o.in_size * o.in_size;
    float *x = malloc(nx * sizeof *x);
    for (size_t i = 0; i < nx; i++)
        x[i] = zt_unif(0, 1);
    float *g[2] = {0};
    size_t np = 0, bytes[2];
    for (int rc = 0; rc < 2; rc++) {
        nn_model *m;
        cr_assert_eq(nn_model_create(k_backend_cpu(), &o, &m), ZPS_OK);
        nn_model_set_recompute(m, rc);
        cr_assert_eq(nn_model_forward_outputs(m, x, batch, 1), ZPS_OK);
        int nouts = nn_model_outputs(m);
        float *dys[16];
        for (int i = 0; i < nouts; i++) {
            int c, h, w;
            nn_model_output_shape(m, i, &c, &h, &w);
            dys[i] = malloc((size_t)batch * c * h * w * sizeof(float));
            cr_assert_eq(nn_model_output_read(m, i, dys[i]), ZPS_OK);
        }
        cr_assert_eq(nn_model_backward_outputs(m, (const float *const *)dys, NULL, NULL),
                     ZPS_OK);
        np = nn_model_param_count(m);
        g[rc] = malloc(np * sizeof(float));
        memcpy(g[rc], nn_model_grads(m), np * sizeof(float));
        bytes[rc] = nn_model_activation_bytes(m);
        if (rc)
            cr_assert_gt(nn_model_segments(m), 1);
        for (int i = 0; i < nouts; i++)
            free(dys[i]);
        nn_model_destroy(&m);
    }
    cr_assert_eq(memcmp(g[0], g[1], np * sizeof(float)), 0,
                 "detector gradients differ with recompute (seed %llu)",
                 (unsigned long long)s_seed);
    cr_assert_lt(bytes[1], bytes[0]);
    free(g[0]);
    free(g[1]);
    free(x);
}

/* A tensor inside a segment is not handed out: a later segment may have overwritten it. */
Test(nn_recompute, tensors_not_kept_are_refused, .init = s_init, .timeout = 60)
{
    nn_model_opts o;
    s_opts(&o, "inception_v3");
    o.in_size = 75, o.width = 0.25f, o.in_channels = 1, o.classes = 10, o.aux = 0;
    nn_model *m;
    cr_assert_eq(nn_model_create(k_backend_cpu(), &o, &m), ZPS_OK);
    nn_model_set_recompute(m, 1);
    float *x;
    int32_t *y;
    s_batch(&o, 2, &x, &y);
    float loss;
    cr_assert_eq(nn_model_forward(m, x, y, 2, 1, &loss, NULL), ZPS_OK);
    float *d;
    int n, c, h, w;
    /* a branch inside a block is local; the block's concat is where segments are cut */
    cr_assert_eq(nn_model_tensor(m, "Mixed_5b.branch1x1", &d, &n, &c, &h, &w),
                 ZPS_ERR_INVALID);
    cr_assert_eq(nn_model_tensor(m, "nosuch", &d, &n, &c, &h, &w), ZPS_ERR_NOT_FOUND);
    nn_model_set_recompute(m, 0);
    cr_assert_eq(nn_model_forward(m, x, y, 2, 1, &loss, NULL), ZPS_OK);
    cr_assert_eq(nn_model_segments(m), 1);
    cr_assert_eq(nn_model_tensor(m, "Mixed_5b.branch1x1", &d, &n, &c, &h, &w), ZPS_OK);
    nn_model_destroy(&m);
    free(x);
    free(y);
}
