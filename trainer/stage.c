/* stage.c — a model on a device back-end, synchronised by a back-end that reads host memory
 * (PS, shared-memory all-reduce): the pinned host mirrors between them (sync.h,
 * tr_sync_staged_new).
 *
 * The wrapped ("inner") back-end sees host mirrors of the parameters and of the step's mean
 * gradient, and the model computes with device copies of them. The transfers go one layer
 * group at a time on the device's copy queues (gradients down on K_QUEUE_OUT, values up on
 * K_QUEUE_IN, so the two directions overlap each other), ordered by events, so they overlap
 * compute:
 *
 *   backward hook (first, n)   (PS with --push-dtype bf16: the group's gradients rounded to
 *                              bfloat16 on the compute queue, k_pack_bf16, so half the bytes
 *                              cross and the pushes send them as they are) the compute
 *                              queue's point after that layer (or, with env.grads_source,
 *                              that source's: sync_node_dev.c's after the node's NCCL sums)
 *                              -> the out queue waits for it -> gradients D2H into the
 *                              mirror -> an event, handed to the staging thread; that thread
 *                              waits for the event (and asks the source whether what it
 *                              copied is whole) and then calls the inner grads_ready(first,
 *                              n), so pushes leave while the device computes the layers
 *                              before
 *   end_step                   the compute queue's point after the whole backward (`fence`);
 *                              waits until the staging thread handed over every group, then
 *                              the inner end_step; every variable's device copy is now stale
 *   begin_step                 the fence again (after a failed step's part of a backward)
 *   forward hook (first, n)    for stale variables: the inner forward hook (PS: waits for
 *                              their pull into the mirror), H2D on the in queue after the
 *                              fence, and the compute queue waits for it before the layer
 *                              runs
 *   params_ready, finish       whatever is still stale goes up the same way
 *
 * Invariants:
 *  - The inner back-end is called from one thread at a time: during backward only the
 *    staging thread calls it (grads_ready), and the training thread calls it again (end_step
 *    and everything after) only once the staging thread is idle with an empty queue; the
 *    mutex hand-off orders their memory.
 *  - A gradient mirror range is written by its D2H after that step's params_ready, which
 *    (PS sync) or the previous end_step (async, ssp) waited for the pushes that read it; a
 *    parameter range's H2D waits on the in queue for the fence, the compute queue's point
 *    after everything queued before the coming forward (an evaluation's after end_step, the
 *    next step's after begin_step; tr_sync_staged_upload, a node leader's values, and
 *    finish record their own): a layer's new values never overwrite device values a queued
 *    backward still reads. The fence is recorded at those points, not at each upload, or a
 *    group's H2D would wait for the forward of the groups before it instead of overlapping
 *    it.
 *  - The stager's own first failure (a copy, an event; on the staging thread too: a D2H
 *    that did not land, sums NCCL aborted) is kept; later hooks do nothing, and end_step
 *    (before the inner end_step) and params_ready return it. An inner grads_ready's failure
 *    stops the step's hand-offs and is the inner back-end's to report or recover from in its end_step, as
 *    without a device; the next step starts clean.
 *  - Set up once: mirrors, events (one per variable for the hand-offs) and the thread. A step
 *    allocates nothing.
 */
#include "trainer/sync.h"

#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"

typedef struct s_stage {
    tr_sync base;              // first: the tr_sync the loop holds
    tr_sync *inner;            // the host back-end, over the mirrors
    const k_backend *be;       // the model's (device) back-end
    nn_model *model;
    const nn_var *vars;        // (nvars)
    size_t nvars, nparams;
    float *dparams, *dgrads;   // (nparams) the model's values and the step's mean gradient
    float *hparams, *hgrads;   // (nparams) their pinned host mirrors (hgrads NULL with bf16)
    int bf16;                  // PS with --push-dtype bf16: the gradients leave rounded
    uint16_t *dgrads16;        // (nparams) bf16: the gradient rounded on the device,
    uint16_t *hgrads16;        // (nparams) and its pinned mirror, which the pushes send
    uint8_t *stale;            // (nvars) the device values are older than the mirror's
    nn_grad_hook inner_hook;   // the inner back-end's forward hook (PS: waits for pulls)
    void *inner_ctx;
    k_event *point;            // where reported gradients are final (reused: waited for
                               // as recorded): the compute queue's, or the source's
    const tr_grads_source *src; // env's (NULL: the compute queue)
    k_event *up;               // the last H2D's end (reused likewise)
    k_event *fence;            // the compute queue's point before which uploads wait (above)
    k_event **ev;              // (nvars) hand-off events: ev[first] for the group at first
    zps_status err;            // first failure (training thread's side)
    zps_status copy_err;       // the staging thread's own first failure (a copy that did
                               // not land, sums NCCL aborted): written there, read after
                               // s_drain (the worker's mutex orders it)
    tr_worker worker;          // the staging thread: one job per hand-off
} s_stage;

static size_t s_span_floats(const s_stage *s, size_t first, size_t n)
{
    const nn_var *last = &s->vars[first + n - 1];
    return last->offset + last->count - s->vars[first].offset;
}

static void s_fail(s_stage *s, zps_status st, const char *what)
{
    if (st == ZPS_OK || s->err != ZPS_OK)
        return;
    s->err = st;
    zps_log(ZPS_ERROR, "trainer", "device staging: %s: %s", what, zps_strerror(st));
}

/* ---- gradients: device -> mirror -> inner ---- */

/* A hand-off, on the staging thread: once the group's copy landed, to the inner back-end.
 * A failure of the copy itself is the stager's (copy_err: end_step returns it); one of the
 * inner back-end's is that back-end's to judge. */
static zps_status s_hand_off(void *ctx, const tr_job *h, zps_status failed)
{
    s_stage *s = ctx;
    if (failed != ZPS_OK) /* the step's hand-offs stop at the first failure */
        return failed;
    zps_status st = s->be->event_sync(s->ev[h->first]);
    if (st == ZPS_OK && s->src) /* (NCCL aborted: its sums ended early, the copy holds no mean) */
        st = s->src->valid(s->src->ctx);
    if (st != ZPS_OK) {
        if (s->copy_err == ZPS_OK)
            s->copy_err = st;
        return st;
    }
    return s->inner->grads_ready(s->inner, h->first, h->n);
}

/* Waits until every hand-off of the step reached the inner back-end; its first failure. */
static zps_status s_drain(s_stage *s)
{
    return tr_worker_wait(&s->worker);
}

static zps_status s_grads_ready(tr_sync *b, size_t first, size_t n)
{
    s_stage *s = (s_stage *)b;
    if (s->err != ZPS_OK)
        return s->err;
    size_t off = s->vars[first].offset, span = s_span_floats(s, first, n);
    k_event *done = s->ev[first]; /* a step's groups do not overlap (sync.h) */
    zps_status st = ZPS_OK;
    if (s->bf16) /* rounded where they are: half the bytes cross */
        st = k_pack_bf16(s->be, span, s->dgrads + off, s->dgrads16 + off);
    if (st == ZPS_OK)
        st = s->src ? s->src->point(s->src->ctx, s->point)
                    : s->be->event_record(s->point, K_QUEUE_COMPUTE);
    if (st == ZPS_OK)
        st = s->be->event_wait(K_QUEUE_OUT, s->point);
    if (st == ZPS_OK)
        st = s->bf16 ? s->be->copy_out_async(s->hgrads16 + off, s->dgrads16 + off, span * 2)
                     : s->be->copy_out_async(s->hgrads + off, s->dgrads + off, span * 4);
    if (st == ZPS_OK)
        st = s->be->event_record(done, K_QUEUE_OUT);
    if (st != ZPS_OK) {
        s_fail(s, st, "gradients to the host");
        return st;
    }
    return tr_worker_post(&s->worker, &(tr_job){.first = first, .n = n});
}

/* ---- values: inner -> mirror -> device ---- */

/* The stale variables of [first, first + n) up to the device, after the fence; the compute
 * queue waits. */
static zps_status s_upload(s_stage *s, size_t first, size_t n)
{
    int any = 0;
    for (size_t v = first; v < first + n; v++) {
        if (!s->stale[v])
            continue;
        if (!any) /* (waiting again for a point waited for already costs nothing) */
            ZPS_TRY(s->be->event_wait(K_QUEUE_IN, s->fence));
        size_t run = 1; /* a run of stale variables: one copy */
        while (v + run < first + n && s->stale[v + run])
            run++;
        size_t off = s->vars[v].offset;
        ZPS_TRY(s->be->copy_in_async(s->dparams + off, s->hparams + off,
                                     s_span_floats(s, v, run) * sizeof(float)));
        memset(s->stale + v, 0, run);
        v += run - 1;
        any = 1;
    }
    if (!any)
        return ZPS_OK;
    ZPS_TRY(s->be->event_record(s->up, K_QUEUE_IN));
    return s->be->event_wait(K_QUEUE_COMPUTE, s->up);
}

/* The compute queue's present point becomes the fence (called where no forward the coming
 * uploads feed is queued yet). */
static void s_fence(s_stage *s)
{
    if (s->err == ZPS_OK)
        s_fail(s, s->be->event_record(s->fence, K_QUEUE_COMPUTE), "the uploads' fence");
}

static void s_forward_hook(void *ctx, size_t first, size_t n)
{
    s_stage *s = ctx;
    if (s->err != ZPS_OK)
        return;
    int any = 0;
    for (size_t v = first; v < first + n && !any; v++)
        any = s->stale[v];
    if (!any)
        return;
    if (s->inner_hook)
        s->inner_hook(s->inner_ctx, first, n);
    s_fail(s, s_upload(s, first, n), "values to the device");
}

/* The inner back-end's forward hook, kept for s_forward_hook to call first. */
static void s_set_inner_hook(void *owner, nn_grad_hook hook, void *ctx)
{
    s_stage *s = owner;
    s->inner_hook = hook;
    s->inner_ctx = ctx;
}

static void s_all_stale(s_stage *s) { memset(s->stale, 1, s->nvars); }

/* After an inner call: what the loop reads from the back-end. */
static zps_status s_mirror(s_stage *s, zps_status st)
{
    s->base.net_wait = s->inner->net_wait;
    s->base.redo_from = s->inner->redo_from;
    if (s->base.redo_from >= 0) /* the servers' older values are in the mirror */
        s_all_stale(s);
    return st;
}

/* ---- the calls ---- */

static zps_status s_begin_step(tr_sync *b, int64_t step, int *stop)
{
    s_stage *s = (s_stage *)b;
    tr_worker_clear(&s->worker); /* idle (end_step drained it); the inner back-end judged
                                  * last step's failure already (a redo goes on) */
    s_fence(s); /* this step's forward is not queued yet (and a failed one's backward is) */
    return s_mirror(s, s->inner->begin_step(s->inner, step, stop));
}

static zps_status s_params_ready(tr_sync *b)
{
    s_stage *s = (s_stage *)b;
    if (s->err != ZPS_OK)
        return s->err;
    zps_status st = s_mirror(s, s->inner->params_ready(s->inner));
    if (st == ZPS_OK)
        s_fail(s, st = s_upload(s, 0, s->nvars), "values to the device");
    return st;
}

zps_status tr_sync_staged_upload(tr_sync *b)
{
    s_stage *s = (s_stage *)b;
    if (s->err != ZPS_OK)
        return s->err;
    s_fence(s); /* between steps: now (a backward may still be reading the values) */
    zps_status st = s->err;
    if (st == ZPS_OK)
        st = s_upload(s, 0, s->nvars);
    s_fail(s, st, "values to the device");
    return st;
}

static zps_status s_end_step(tr_sync *b, tr_step_record *rec)
{
    s_stage *s = (s_stage *)b;
    s_fence(s); /* the whole backward is queued: an evaluation's uploads come next */
    (void)s_drain(s); /* a hand-off's failure is the inner back-end's: its end_step returns
                       * it, or recovers from it (PS sync: a rollback, redo_from) */
    /* ... but not a copy's: the groups after it never reached the inner back-end, whose
     * end_step would run on a part of the gradients */
    s_fail(s, s->copy_err, "gradients to the host");
    if (s->err != ZPS_OK)
        return s->err;
    zps_status st = s->inner->end_step(s->inner, rec);
    s_all_stale(s);
    return s_mirror(s, st);
}

static zps_status s_finish(tr_sync *b, int *fresh)
{
    s_stage *s = (s_stage *)b;
    ZPS_TRY(s_drain(s));
    zps_status st = s->inner->finish(s->inner, fresh);
    if (st != ZPS_OK)
        return s_mirror(s, st);
    s_all_stale(s);
    s_fence(s); /* after the loop: now */
    ZPS_TRY(s->err);
    ZPS_TRY(s_upload(s, 0, s->nvars));
    return s_mirror(s, ZPS_OK);
}

static zps_status s_leave(tr_sync *b)
{
    s_stage *s = (s_stage *)b;
    return s->inner->leave(s->inner);
}

static void s_abandon(tr_sync *b)
{
    s_stage *s = (s_stage *)b;
    tr_worker_stop(&s->worker); /* the queued hand-offs are handed first: nothing is
                                 * half-sent */
    if (s->inner && s->inner->abandon)
        s->inner->abandon(s->inner);
}

static void s_destroy(tr_sync *b)
{
    s_stage *s = (s_stage *)b;
    tr_worker_stop(&s->worker);
    if (s->model)
        nn_model_set_forward_hook(s->model, NULL, NULL);
    tr_sync_destroy(&s->inner);
    for (size_t v = 0; s->ev && v < s->nvars; v++)
        s->be->event_free(s->ev[v]);
    s->be->event_free(s->point);
    s->be->event_free(s->up);
    s->be->event_free(s->fence);
    s->be->host_free(s->hparams);
    s->be->host_free(s->hgrads);
    s->be->host_free(s->hgrads16);
    s->be->free(s->dgrads16);
    free(s->ev);
    free(s->stale);
    free(s);
}

/* Mirrors (holding the model's initial values), events, the thread. */
static zps_status s_setup(s_stage *s)
{
    const k_backend *be = s->be;
    size_t n = s->nparams;
    s->hparams = be->host_alloc(n * sizeof(float));
    if (s->bf16)
        s->hgrads16 = be->host_alloc(n * 2);
    else
        s->hgrads = be->host_alloc(n * sizeof(float));
    if (!s->hparams || !(s->hgrads || s->hgrads16)) {
        zps_log(ZPS_ERROR, "trainer", "cannot allocate %zu MiB of pinned host memory for the "
                "%s back-end's mirrors", (n * (s->bf16 ? 6 : 8)) >> 20, be->name);
        return ZPS_ERR_NOMEM;
    }
    if (s->bf16 && !(s->dgrads16 = be->alloc(n * 2))) {
        zps_log(ZPS_ERROR, "trainer", "cannot allocate %zu MiB on the %s back-end for the "
                "bf16 gradients", (n * 2) >> 20, be->name);
        return ZPS_ERR_NOMEM;
    }
    ZPS_TRY(be->copy_out(s->hparams, s->dparams, s->nparams * sizeof(float)));
    ZPS_TRY(be->event_new(&s->point));
    ZPS_TRY(be->event_new(&s->up));
    ZPS_TRY(be->event_new(&s->fence));
    ZPS_TRY(be->event_record(s->fence, K_QUEUE_COMPUTE));
    for (size_t v = 0; v < s->nvars; v++)
        ZPS_TRY(be->event_new(&s->ev[v]));
    return tr_worker_start(&s->worker, s->nvars, s_hand_off, s, "trainer");
}

zps_status tr_sync_staged_new(const tr_sync_env *env, tr_sync_new_fn inner_new, int bf16_out,
                              tr_sync **out)
{
    *out = NULL;
    const k_backend *be = env->model ? nn_model_backend(env->model) : env->be;
    if (!be || !k_backend_async(be)) {
        zps_log(ZPS_ERROR, "trainer", "the %s back-end has no copy queue to stage through",
                be ? be->name : "(no)");
        return ZPS_ERR_UNSUPPORTED;
    }
    if (bf16_out && env->grads_source) {
        zps_log(ZPS_ERROR, "trainer", "bf16 gradients are rounded on the compute queue, "
                "before they are final elsewhere: not supported together");
        return ZPS_ERR_INTERNAL;
    }
    s_stage *s = zps_xcalloc(1, sizeof *s);
    *s = (s_stage){.be = be, .model = env->model, .vars = env->vars, .nvars = env->nvars,
                   .nparams = env->nparams, .dparams = env->params, .dgrads = env->grads,
                   .bf16 = bf16_out, .src = env->grads_source};
    s->base = (tr_sync){.begin_step = s_begin_step, .params_ready = s_params_ready,
                        .grads_ready = s_grads_ready, .end_step = s_end_step,
                        .finish = s_finish, .leave = s_leave, .abandon = s_abandon,
                        .destroy = s_destroy, .redo_from = -1};
    s->stale = zps_xcalloc(s->nvars, 1);
    s->ev = zps_xcalloc(s->nvars, sizeof *s->ev);
    zps_status st = s_setup(s);
    if (st == ZPS_OK) {
        tr_sync_env host = *env;
        host.be = k_backend_cpu();
        host.params = s->hparams;
        host.grads = s->hgrads;
        host.grads_bf16 = s->hgrads16;
        host.set_forward_hook = s_set_inner_hook;
        host.hook_owner = s;
        host.grads_source = NULL;
        st = inner_new(&host, &s->inner);
    }
    if (st != ZPS_OK) {
        s_destroy(&s->base);
        return st;
    }
    s->base.start_step = s->inner->start_step;
    s_all_stale(s); /* the inner set-up may have pulled or broadcast new values */
    if (s->model) /* (without one: a test drives the calls) */
        nn_model_set_forward_hook(s->model, s_forward_hook, s);
    zps_log(ZPS_INFO, "trainer", "%s back-end: values and %s gradients staged through %zu MiB "
            "of pinned host mirrors", be->name, s->bf16 ? "bf16" : "f32",
            (s->nparams * (s->bf16 ? 6 : 8)) >> 20);
    *out = &s->base;
    return ZPS_OK;
}
