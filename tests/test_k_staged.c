/* test_k_staged.c — the asynchronous group of the back-end interface (backend.h: pinned host
 * memory, the copy queue, events) and the "staged" back-end that lets the CPU suite run the
 * device paths.
 *
 *   k_async   an H2D copy, an op waiting for it, a D2H copy waiting for the op, on every
 *             back-end that has the group: staged always, cuda where a GPU answers (else
 *             SKIP through ZPS_GPU_SKIP)
 *   k_staged  what makes staged a strict stand-in for a device: copies held back until an
 *             event after them is waited for, in order; fresh memory is NaN; the compute
 *             queue never waits; and whole models (the convnet with heads, the detector's
 *             outputs in blocked layouts) give the cpu back-end's loss and gradients bit for
 *             bit when their tensors live in staged memory, evaluations too (on a training
 *             plan, with fewer rows than planned, on an inference plan).
 *   gpu_model one training step of the convnet and of Inception-v3 (w0.25 at 139x139) on
 *             the cuda back-end against the cpu's, in full f32, each variable within 1e-3
 *             relative L2 plus 4 x the cpu's own sensitivity to a 1e-5 input change, and
 *             the evaluations of k_staged within 1e-3 (SKIP without a GPU; the GPU suite
 *             requires it).
 * Fresh random inputs every run (seed printed on failure; ZPS_TEST_SEED reproduces).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/kernels.h"
#include "tests/test_k.h"
#include "tests/testutil.h"
#include "trainer/models/models.h"
#include "trainer/nn/nn.h"

static uint64_t s_seed;

static void s_init(void)
{
    s_seed = zt_seed_init();
    zps_log_set_level(ZPS_LOG_WARN);
}

/* H2D on the in queue -> the compute queue waits -> scale by 2 -> the out queue waits ->
 * D2H -> the host waits: every byte comes back doubled, exactly. */
static void s_round_trip(const k_backend *be)
{
    cr_assert(k_backend_async(be), "%s lacks the asynchronous group", be->name);
    size_t n = (size_t)zt_irand(1, 300000);
    float *a = be->host_alloc(n * sizeof *a), *b = be->host_alloc(n * sizeof *b);
    float *d = be->alloc(n * sizeof *d);
    cr_assert(a && b && d);
    for (size_t i = 0; i < n; i++)
        a[i] = zt_unif(-10, 10);
    k_event *in, *op, *out;
    cr_assert_eq(be->event_new(&in), ZPS_OK);
    cr_assert_eq(be->event_new(&op), ZPS_OK);
    cr_assert_eq(be->event_new(&out), ZPS_OK);
    cr_assert_eq(be->copy_in_async(d, a, n * sizeof *a), ZPS_OK);
    cr_assert_eq(be->event_record(in, K_QUEUE_IN), ZPS_OK);
    cr_assert_eq(be->event_wait(K_QUEUE_COMPUTE, in), ZPS_OK);
    cr_assert_eq(k_scale(be, n, 2.0f, d), ZPS_OK);
    cr_assert_eq(be->event_record(op, K_QUEUE_COMPUTE), ZPS_OK);
    cr_assert_eq(be->event_wait(K_QUEUE_OUT, op), ZPS_OK);
    cr_assert_eq(be->copy_out_async(b, d, n * sizeof *b), ZPS_OK);
    cr_assert_eq(be->event_record(out, K_QUEUE_OUT), ZPS_OK);
    cr_assert_eq(be->event_sync(out), ZPS_OK);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(b[i], 2.0f * a[i], "%s: element %zu of %zu: %g, want %g (seed %llu)",
                     be->name, i, n, b[i], 2.0f * a[i], (unsigned long long)s_seed);
    be->event_free(in);
    be->event_free(op);
    be->event_free(out);
    be->free(d);
    be->host_free(a);
    be->host_free(b);
}

Test(k_async, staged_round_trip, .init = s_init, .timeout = 30)
{
    s_round_trip(k_backend_staged());
}

Test(k_async, cuda_round_trip, .init = s_init, .timeout = 60)
{
    s_round_trip(ZT_CUDA_OR_SKIP());
}

Test(k_async, host_backends_have_no_queues, .init = s_init)
{
    cr_assert(!k_backend_async(k_backend_cpu()));
    cr_assert(!k_backend_async(k_backend_ref()));
    cr_assert(k_backend_async(k_backend_staged()));
    cr_assert_eq(k_backend_by_name("staged"), k_backend_staged());
    cr_assert_eq(k_backend_staged()->host_memory, 0);
}

/* A copy happens when an event recorded on its queue after it is waited for, not before, and
 * a queue's copies run in the order they were queued (the second write to the same place
 * wins). The two copy queues are independent: a copy-out waits for a copy-in queued before it
 * only through an event. */
Test(k_staged, copies_wait_for_an_event, .init = s_init)
{
    const k_backend *be = k_backend_staged();
    float *h = be->host_alloc(4 * sizeof *h), *d = be->alloc(4 * sizeof *d);
    cr_assert(isnan(h[0]) && isnan(d[3]), "fresh memory is NaN");
    float one[4] = {1, 2, 3, 4}, two[4] = {5, 6, 7, 8};
    k_event *e1, *e2, *e3, *c;
    cr_assert_eq(be->event_new(&e1), ZPS_OK);
    cr_assert_eq(be->event_new(&e2), ZPS_OK);
    cr_assert_eq(be->event_new(&e3), ZPS_OK);
    cr_assert_eq(be->event_new(&c), ZPS_OK);
    cr_assert_eq(be->copy_in_async(d, one, sizeof one), ZPS_OK);
    cr_assert_eq(be->event_record(e1, K_QUEUE_IN), ZPS_OK);
    cr_assert_eq(be->copy_in_async(d, two, sizeof two), ZPS_OK);
    cr_assert_eq(be->event_record(e2, K_QUEUE_IN), ZPS_OK);
    cr_assert(isnan(d[0]), "nothing waited yet: the copy has not happened");
    /* a copy queue waiting for the compute queue changes nothing */
    cr_assert_eq(be->event_record(c, K_QUEUE_COMPUTE), ZPS_OK);
    cr_assert_eq(be->event_wait(K_QUEUE_IN, c), ZPS_OK);
    cr_assert_eq(be->event_wait(K_QUEUE_OUT, c), ZPS_OK);
    cr_assert(isnan(d[0]));
    /* an event of the other copy queue does not run this one's copies */
    cr_assert_eq(be->event_record(e3, K_QUEUE_OUT), ZPS_OK);
    cr_assert_eq(be->event_sync(e3), ZPS_OK);
    cr_assert(isnan(d[0]));
    cr_assert_eq(be->event_wait(K_QUEUE_COMPUTE, e1), ZPS_OK);
    cr_assert_eq(d[0], 1.0f, "the first copy ran when the compute queue waited for it");
    cr_assert_eq(d[3], 4.0f);
    cr_assert_eq(be->copy_out_async(h, d, sizeof one), ZPS_OK);
    cr_assert_eq(be->event_record(e3, K_QUEUE_OUT), ZPS_OK);
    cr_assert(isnan(h[0]), "the copy-out waits too");
    cr_assert_eq(be->event_sync(e3), ZPS_OK);
    cr_assert_eq(h[0], 1.0f, "the copy-out did not wait for the copy-in on the other queue");
    cr_assert_eq(d[0], 1.0f);
    /* the out queue waiting for the in queue's point: the second copy-in, then the copy-out */
    cr_assert_eq(be->event_wait(K_QUEUE_OUT, e2), ZPS_OK);
    cr_assert_eq(be->copy_out_async(h, d, sizeof one), ZPS_OK);
    cr_assert_eq(be->event_record(e3, K_QUEUE_OUT), ZPS_OK);
    cr_assert_eq(be->event_sync(e3), ZPS_OK);
    cr_assert_eq(h[0], 5.0f);
    cr_assert_eq(h[2], 7.0f);
    /* compute events are complete at once */
    cr_assert_eq(be->event_record(e1, K_QUEUE_COMPUTE), ZPS_OK);
    cr_assert_eq(be->event_sync(e1), ZPS_OK);
    be->event_free(e1);
    be->event_free(e2);
    be->event_free(e3);
    be->event_free(c);
    be->free(d);
    be->host_free(h);
}

/* More copies than the queue's first capacity, across a slide and a growth: all in order. */
Test(k_staged, a_long_backlog_keeps_its_order, .init = s_init)
{
    const k_backend *be = k_backend_staged();
    enum { N = 1500 };
    float *src = malloc(N * sizeof *src), *d = be->alloc(N * sizeof *d);
    k_event *e;
    cr_assert_eq(be->event_new(&e), ZPS_OK);
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < N; i++) {
            src[i] = (float)(round * N + i);
            cr_assert_eq(be->copy_in_async(d + i, src + i, sizeof *src), ZPS_OK);
            if (i == N / 2) { /* half of them run now: the rest slide to the front */
                cr_assert_eq(be->event_record(e, K_QUEUE_IN), ZPS_OK);
                cr_assert_eq(be->event_sync(e), ZPS_OK);
                cr_assert_eq(d[i], (float)(round * N + i));
            }
        }
        cr_assert_eq(be->event_record(e, K_QUEUE_IN), ZPS_OK);
        cr_assert_eq(be->event_sync(e), ZPS_OK);
        for (int i = 0; i < N; i++)
            cr_assert_eq(d[i], (float)(round * N + i));
    }
    be->event_free(e);
    be->free(d);
    free(src);
}

/* One training step of a fresh model (options o) on back-end be: its loss and gradients
 * (host copies, the caller frees *g). */
static float s_step(const nn_model_opts *o, const k_backend *be, const float *x,
                    const int32_t *y, int batch, float **g, const nn_var **vars, size_t *nv)
{
    nn_model *m;
    cr_assert_eq(nn_model_create(be, o, &m), ZPS_OK);
    size_t np = nn_model_param_count(m);
    float loss;
    cr_assert_eq(nn_model_forward(m, x, y, batch, 1, &loss, NULL), ZPS_OK);
    cr_assert_eq(nn_model_backward(m, NULL, NULL), ZPS_OK);
    *g = malloc(np * sizeof(float));
    cr_assert_eq(be->copy_out(*g, nn_model_grads(m), np * sizeof(float)), ZPS_OK);
    if (vars) { /* the table outlives the model: copy it */
        const nn_var *t = nn_model_vars(m, nv);
        nn_var *c = malloc(*nv * sizeof *c);
        memcpy(c, t, *nv * sizeof *c);
        *vars = c;
    }
    nn_model_destroy(&m);
    return loss;
}

/* Relative L2 distance of variable v's gradients a and b from a's (NaN: infinite). */
static double s_rel(const nn_var *v, const float *a, const float *b, double *worst, size_t *at)
{
    double d2 = 0, r2 = 0;
    *worst = 0, *at = v->offset;
    for (size_t i = v->offset; i < v->offset + v->count; i++) {
        double d = (double)b[i] - a[i];
        d2 += d * d, r2 += (double)a[i] * a[i];
        if (!(fabs(d) <= *worst)) /* NaN counts as worst */
            *worst = fabs(d), *at = i;
    }
    return isnan(d2) ? INFINITY : r2 > 0 ? sqrt(d2 / r2) : sqrt(d2);
}

/* One training step of model o on the cpu and on back-end be, from the same seed and batch.
 * tol 0: loss and gradients equal bit for bit. Else each variable's gradient within
 * tol + 4 x how far the cpu's own gradient moves when the input moves by 1e-5 (relative L2;
 * test_nn_inception.c's rule: deep nets flip ReLU masks and amplify rounding, so a fixed
 * bound is either loose for the last layers or broken for the stem), and the loss within
 * tol relative. */
static void s_same_step(const nn_model_opts *o, int batch, const k_backend *be, double tol)
{
    nn_model_opts probe = *o;
    nn_model *shape;
    cr_assert_eq(nn_model_create(k_backend_cpu(), &probe, &shape), ZPS_OK);
    int c, h, w;
    nn_model_input_shape(shape, &c, &h, &w);
    int classes = nn_model_classes(shape);
    nn_model_destroy(&shape);
    size_t nx = (size_t)batch * c * h * w;
    float *x = malloc(nx * sizeof *x), *xp = malloc(nx * sizeof *xp);
    int32_t *y = malloc((size_t)batch * sizeof *y);
    for (size_t i = 0; i < nx; i++)
        x[i] = zt_unif(-1, 1), xp[i] = x[i] * (1 + 1e-5f * zt_unif(-1, 1));
    for (int i = 0; i < batch; i++)
        y[i] = (int32_t)(zt_rand() % (uint32_t)classes);
    float *g0, *g1, *gp = NULL;
    const nn_var *vars;
    size_t nv;
    float l0 = s_step(o, k_backend_cpu(), x, y, batch, &g0, &vars, &nv);
    float l1 = s_step(o, be, x, y, batch, &g1, NULL, NULL);
    if (tol > 0)
        (void)s_step(o, k_backend_cpu(), xp, y, batch, &gp, NULL, NULL);
    cr_assert(isfinite(l0));
    cr_assert(fabsf(l0 - l1) <= tol * fabsf(l0), "%s: loss %.9g on cpu, %.9g on %s (seed %llu)",
              o->name, l0, l1, be->name, (unsigned long long)s_seed);
    for (size_t v = 0; v < nv; v++) {
        double worst, wp;
        size_t at, atp;
        double rel = s_rel(&vars[v], g0, g1, &worst, &at);
        double allowed = tol > 0 ? tol + 4 * s_rel(&vars[v], g0, gp, &wp, &atp) : 0;
        cr_assert(tol > 0 ? rel <= allowed : worst == 0,
                  "%s: gradient of %s differs on %s: relative L2 %g, allowed %g, worst at %zu "
                  "(cpu %g, %s %g; seed %llu)", o->name, vars[v].name, be->name, rel, allowed,
                  at - vars[v].offset, g0[at], be->name, g1[at], (unsigned long long)s_seed);
    }
    free((void *)vars);
    free(g0), free(g1), free(gp);
    free(x), free(xp), free(y);
}

static void s_opts(nn_model_opts *o, const char *name)
{
    nn_model_opts_default(o, name);
    o->seed = s_seed;
    o->dropout = 0; /* the same mask on both anyway; off keeps the comparison about the ops */
}

Test(k_staged, convnet_step_equals_cpu, .init = s_init, .timeout = 60)
{
    nn_model_opts o;
    s_opts(&o, "convnet");
    s_same_step(&o, 8, k_backend_staged(), 0);
}

/* A GPU training step against the cpu's, in full f32 (NVIDIA_TF32_OVERRIDE=0: cuDNN and
 * cuBLAS would otherwise use TF32's 10-bit mantissas, as PyTorch lets them by default): the
 * op tolerances compounded through the net: 1e-3 relative L2 per variable plus 4 x the cpu's
 * own sensitivity to a 1e-5 input change (s_same_step). Inception at 139x139 and batch 8, so
 * that Mixed_7's batchnorm still sees 32 values a channel. */
static const k_backend *s_cuda_or_skip(void)
{
    setenv("NVIDIA_TF32_OVERRIDE", "0", 1); /* before the libraries start */
    return ZT_CUDA_OR_SKIP();
}

Test(gpu_model, convnet_step_close_to_cpu, .init = s_init, .timeout = 120)
{
    const k_backend *be = s_cuda_or_skip();
    nn_model_opts o;
    s_opts(&o, "convnet");
    s_same_step(&o, 16, be, 1e-3);
}

Test(gpu_model, inception_v3_step_close_to_cpu, .init = s_init, .timeout = 300)
{
    const k_backend *be = s_cuda_or_skip();
    nn_model_opts o;
    s_opts(&o, "inception_v3");
    o.in_size = 139;
    o.width = 0.25f;
    s_same_step(&o, 8, be, 1e-3);
}

/* Evaluations on back-end be against the cpu's, from the same seed and batch: after a
 * training forward of 8 (its plan), an evaluation of 8 rows and one of the last 5 (on that
 * plan: 5 rows copied in, 3 zeroed in the back-end's memory), and on a fresh model one of 5
 * (an inference plan, in memory that staged fills with NaN, so a piece the liveness plan
 * handed out twice or a row left unzeroed would show); the detector's outputs the same way.
 * tol 0: losses, counts and outputs bit for bit; else the losses and outputs within tol
 * relative (outputs: L2) and the counts within one. */
static void s_evals(const k_backend *be, double tol)
{
    const k_backend *bes[2] = {k_backend_cpu(), be};
    nn_model_opts o;
    s_opts(&o, "convnet");
    float loss[2][3];
    int right[2][3];
    float *x = NULL;
    int32_t y[8];
    for (int k = 0; k < 2; k++) {
        nn_model *m, *fresh;
        cr_assert_eq(nn_model_create(bes[k], &o, &m), ZPS_OK);
        cr_assert_eq(nn_model_create(bes[k], &o, &fresh), ZPS_OK);
        int c, h, w;
        nn_model_input_shape(m, &c, &h, &w);
        size_t row = (size_t)c * h * w;
        if (!x) {
            x = malloc(8 * row * sizeof *x);
            for (size_t i = 0; i < 8 * row; i++)
                x[i] = zt_unif(-1, 1);
            for (int i = 0; i < 8; i++)
                y[i] = (int32_t)(zt_rand() % (uint32_t)nn_model_classes(m));
        }
        float l;
        cr_assert_eq(nn_model_forward(m, x, y, 8, 1, &l, NULL), ZPS_OK);
        cr_assert_eq(nn_model_eval(m, x, y, 8, &loss[k][0], &right[k][0]), ZPS_OK);
        cr_assert_eq(nn_model_eval(m, x + 3 * row, y + 3, 5, &loss[k][1], &right[k][1]), ZPS_OK);
        cr_assert_eq(nn_model_eval(fresh, x + 3 * row, y + 3, 5, &loss[k][2], &right[k][2]),
                     ZPS_OK);
        nn_model_destroy(&m), nn_model_destroy(&fresh);
    }
    static const char *what[3] = {"8 rows on the training plan", "5 rows on the 8-row plan",
                                  "5 rows on an inference plan"};
    for (int e = 0; e < 3; e++)
        cr_assert(isfinite(loss[1][e]) &&
                  fabsf(loss[0][e] - loss[1][e]) <= tol * fabsf(loss[0][e]) &&
                  abs(right[0][e] - right[1][e]) <= (tol > 0), "evaluation of %s: loss %.9g, "
                  "%d right on cpu; %.9g, %d on %s (seed %llu)", what[e], loss[0][e],
                  right[0][e], loss[1][e], right[1][e], be->name, (unsigned long long)s_seed);
    free(x);
    /* the detector: outputs of the last row, on a 2-row training plan and on a fresh model */
    float *out[2][2][16] = {{{0}}};
    size_t osz[16] = {0};
    int nouts = 0;
    x = NULL;
    for (int k = 0; k < 2; k++) {
        nn_model_opts_default(&o, "ssd");
        o.seed = s_seed;
        nn_model *m[2];
        cr_assert_eq(nn_model_create(bes[k], &o, &m[0]), ZPS_OK);
        cr_assert_eq(nn_model_create(bes[k], &o, &m[1]), ZPS_OK);
        int c, h, w;
        nn_model_input_shape(m[0], &c, &h, &w);
        size_t row = (size_t)c * h * w;
        if (!x) {
            x = malloc(2 * row * sizeof *x);
            for (size_t i = 0; i < 2 * row; i++)
                x[i] = zt_unif(0, 1);
        }
        cr_assert_eq(nn_model_forward_outputs(m[0], x, 2, 1), ZPS_OK);
        for (int f = 0; f < 2; f++) {
            cr_assert_eq(nn_model_forward_outputs(m[f], x + row, 1, 0), ZPS_OK);
            nouts = nn_model_outputs(m[f]);
            for (int i = 0; i < nouts; i++) {
                nn_model_output_shape(m[f], i, &c, &h, &w);
                osz[i] = (size_t)c * h * w;
                out[k][f][i] = malloc(osz[i] * sizeof(float));
                cr_assert_eq(nn_model_output_read(m[f], i, out[k][f][i]), ZPS_OK);
            }
            nn_model_destroy(&m[f]);
        }
    }
    for (int f = 0; f < 2; f++)
        for (int i = 0; i < nouts; i++) {
            double d2 = 0, r2 = 0;
            for (size_t j = 0; j < osz[i]; j++) {
                double d = (double)out[1][f][i][j] - out[0][f][i][j];
                d2 += d * d, r2 += (double)out[0][f][i][j] * out[0][f][i][j];
            }
            cr_assert(tol > 0 ? sqrt(d2) <= tol * sqrt(r2) : d2 == 0, "detector output %d of "
                      "one row on %s differs between cpu and %s: relative L2 %g (seed %llu)", i,
                      f ? "an inference plan" : "a 2-row training plan", be->name,
                      sqrt(d2 / (r2 > 0 ? r2 : 1)), (unsigned long long)s_seed);
            free(out[0][f][i]), free(out[1][f][i]);
        }
    free(x);
}

Test(k_staged, evaluations_equal_cpu, .init = s_init, .timeout = 120)
{
    s_evals(k_backend_staged(), 0);
}

Test(gpu_model, evaluations_close_to_cpu, .init = s_init, .timeout = 120)
{
    s_evals(s_cuda_or_skip(), 1e-3);
}

/* The detector's outputs are kept in cpu's blocked layouts: reading them from staged memory
 * and injecting their gradients go through host relayouts (nn/external.c). */
Test(k_staged, detector_outputs_equal_cpu, .init = s_init, .timeout = 120)
{
    const k_backend *bes[2] = {k_backend_cpu(), k_backend_staged()};
    nn_model *m[2];
    float *outs[2][16] = {{0}};
    float *g[2];
    float *x = NULL;
    int batch = 2, nouts = 0, blocked = 0;
    size_t np = 0, osz[16] = {0};
    for (int k = 0; k < 2; k++) {
        nn_model_opts o;
        nn_model_opts_default(&o, "ssd");
        o.seed = s_seed;
        cr_assert_eq(nn_model_create(bes[k], &o, &m[k]), ZPS_OK);
        np = nn_model_param_count(m[k]);
        int c, h, w;
        nn_model_input_shape(m[k], &c, &h, &w);
        if (!x) {
            x = malloc((size_t)batch * c * h * w * sizeof *x);
            for (size_t i = 0; i < (size_t)batch * c * h * w; i++)
                x[i] = zt_unif(0, 1);
        }
        cr_assert_eq(nn_model_forward_outputs(m[k], x, batch, 1), ZPS_OK);
        nouts = nn_model_outputs(m[k]);
        const float *dys[16];
        for (int i = 0; i < nouts; i++) {
            nn_model_output_shape(m[k], i, &c, &h, &w);
            osz[i] = (size_t)batch * c * h * w;
            outs[k][i] = malloc(osz[i] * sizeof(float));
            cr_assert_eq(nn_model_output_read(m[k], i, outs[k][i]), ZPS_OK);
            dys[i] = outs[k][i]; /* dL/dy = y: any fixed function of the outputs */
        }
        cr_assert_eq(nn_model_backward_outputs(m[k], dys, NULL, NULL), ZPS_OK);
        g[k] = malloc(np * sizeof(float));
        cr_assert_eq(bes[k]->copy_out(g[k], nn_model_grads(m[k]), np * sizeof(float)), ZPS_OK);
    }
    for (int i = 0; i < nouts; i++) {
        cr_assert_eq(memcmp(outs[0][i], outs[1][i], osz[i] * sizeof(float)), 0,
                     "output %d differs between cpu and staged (seed %llu)", i,
                     (unsigned long long)s_seed);
        for (int k = 0; k < 2; k++)
            free(outs[k][i]);
    }
    cr_assert_eq(memcmp(g[0], g[1], np * sizeof(float)), 0,
                 "detector gradients differ between cpu and staged (seed %llu)",
                 (unsigned long long)s_seed);
    /* the point of this test: some output really is blocked on both */
    for (int kind = 0; kind < 2; kind++)
        for (int i = 0; i < nouts / 2; i++) {
            char name[96];
            snprintf(name, sizeof name, "head.%s_head.module_list.%d",
                     kind ? "regression" : "classification", i);
            blocked += nn_model_tensor_blocked(m[1], name) != 0;
        }
    cr_assert_gt(blocked, 0, "no blocked tensor among the detector's outputs");
    for (int k = 0; k < 2; k++) {
        nn_model_destroy(&m[k]);
        free(g[k]);
    }
    free(x);
}
