/* sync_node.c — --node-trainers G in the PS modes: the trainers of a node all-reduce their
 * gradients first, and one of them (the node's leader, its local rank 0) pushes and pulls for
 * the node (BytePS's and TF's "replicated" layout). The servers see one trainer per node, so
 * the PS traffic is 1/G of the flat layout's (see sync.h; docs/training.md).
 *
 * Trainer i is local rank i mod G of node i / G; the node's ranks meet in the shared-memory
 * segment "<job>-node<k>" (trainer/allreduce.h) and the leader runs the PS back-end
 * (sync_ps.c) as trainer k of N / G, over the same parameter and gradient buffers. A step:
 *
 *   begin_step  whether any rank of the node wishes to stop (one sum), then the leader's
 *               begin_step, its stop decision (and the PS back-end's) broadcast to the node
 *   backward    the reported gradients gather into buckets of variables (tr_buckets, as the
 *               all-reduce's); a full bucket goes to each rank's communication thread
 *               (tr_worker), which sums it with the node (the mean, in rank order, so every
 *               rank has the same bits), and on the leader hands its variables to the PS
 *               back-end at once, so the node's pushes leave while backward computes the
 *               layers below. That is with a model on a device; on the CPU the whole
 *               gradient is one bucket (overlapping cost more than it hid there)
 *   end_step    the rest of the gradient the same way; once the thread is idle, the leader
 *               ends the step in the PS back-end (also after a failed hand-off: a sync
 *               rollback is its recovery) and waits for the new values; then it broadcasts
 *               them with the step's outcome (status, redo_from), so every rank of the node
 *               computes the next step from the same values, or goes back to the same step
 *               after a servers' rollback
 *   finish      the leader's final values, broadcast
 *
 * Invariants:
 *  - Every rank of a node makes the same collective calls in the same order: the stop
 *    broadcast per step begun, then per step the buckets' sums (edges that depend only on
 *    the model, so the same on every rank) and the values broadcast. A hand-off that failed
 *    stops the leader's later hand-offs of the step but not its sums: the node's other ranks
 *    wait for them.
 *  - The PS back-end is called from one thread at a time: the communication thread during
 *    backward, the loop's thread from end_step on (the thread is idle then).
 *  - Only the leader talks to the servers; the servers must expect N / G trainers
 *    (zps-server --num-trainers, or none: they take the trainers' word).
 *  - Nothing is allocated per step.
 * A model on a device reaches this back-end through stage.c's mirrors, like sync_ps.c.
 */
#include "trainer/sync.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "trainer/allreduce.h"
#include "trainer/trace.h"

typedef struct s_node {
    tr_sync base;             // first: the tr_sync the loop holds
    tr_sync *ps;              // the leader's PS back-end (NULL on the other ranks)
    tr_allreduce *ar;         // the node's segment
    int rank;                 // local rank
    float *params, *grads;    // (n) the model's (host memory)
    size_t n;
    tr_buckets buckets;       // this step's (sync.h)
    tr_worker worker;         // the communication thread: one job per bucket
    zps_status sum_err;       // the node's sums failed (the thread's; read when it is idle)
    zps_status hook_err;      // this step's buckets went wrong (out of order, too many)
    struct tr_trace *trace;   // --trace (NULL: none): each bucket's sum is a span
} s_node;

static zps_status s_share(s_node *s, tr_node_word *w) { return tr_node_share(s->ar, w); }

zps_status tr_node_share(struct tr_allreduce *ar, tr_node_word *w)
{
    return tr_allreduce_broadcast(ar, w, sizeof *w, 0);
}

zps_status tr_node_open(const tr_sync_env *env, struct tr_allreduce **ar)
{
    int group = env->cfg->node_trainers;
    if (group < 1 || env->n_trainers % group != 0) {
        zps_log(ZPS_ERROR, "trainer", "--node-trainers %d does not divide the job's %d "
                "trainers", group, env->n_trainers);
        return ZPS_ERR_CONFIG;
    }
    char name[160];
    snprintf(name, sizeof name, "%s-node%d", env->cfg->job[0] ? env->cfg->job : "zps",
             env->id / group);
    return tr_allreduce_new(name, env->id % group, group, env->nparams, NULL, ar);
}

zps_status tr_node_lead_result(const tr_sync_env *env, int group, zps_status st)
{
    int node = env->id / group, nodes = env->n_trainers / group;
    if (st == ZPS_OK)
        return st;
    if (env->id % group != 0)
        zps_log(ZPS_ERROR, "trainer", "node %d's leader (trainer %d) could not join the "
                "servers: %s", node, node * group, zps_strerror(st));
    else if (st == ZPS_ERR_CONFIG) /* the servers' reason is logged above */
        zps_log(ZPS_ERROR, "trainer", "with --node-trainers %d the servers count nodes as "
                "trainers: zps-server --num-trainers %d, and --replicas-to-aggregate at "
                "most %d", group, nodes, nodes);
    return st;
}

static zps_status s_begin_step(tr_sync *b, int64_t step, int *stop)
{
    s_node *s = (s_node *)b;
    ZPS_TRY(s->sum_err); /* the node is broken: the loop ends */
    tr_buckets_reset(&s->buckets);
    tr_worker_clear(&s->worker); /* a hand-off's failure was the PS back-end's to judge */
    s->hook_err = ZPS_OK;
    ZPS_TRY(tr_sync_any_stop(s->ar, stop)); /* the node's wishes, then the leader's servers' */
    tr_node_word w = {.stop = *stop, .redo_from = -1};
    if (s->ps)
        w.status = s->ps->begin_step(s->ps, step, stop), w.stop = *stop;
    ZPS_TRY(s_share(s, &w));
    *stop = w.stop;
    b->net_wait = 0;
    b->redo_from = -1;
    return w.status;
}

static zps_status s_params_ready(tr_sync *b)
{
    (void)b; /* end_step left the node's values in place */
    return ZPS_OK;
}

/* A bucket, on the communication thread: the node's mean; the leader hands it on. */
static zps_status s_job(void *ctx, const tr_job *j, zps_status failed)
{
    s_node *s = ctx;
    if (s->sum_err != ZPS_OK)
        return s->sum_err;
    s->sum_err = tr_allreduce_sum(s->ar, s->grads + j->lo, j->hi - j->lo, 1);
    tr_trace_async(s->trace, "node", "bucket: node sum", j->t0, zps_now_ns(),
                   (int64_t)(j->hi - j->lo));
    if (s->sum_err != ZPS_OK)
        return s->sum_err;
    if (!s->ps || failed != ZPS_OK || j->n == 0) /* after a failed hand-off: the sums only */
        return ZPS_OK;
    return s->ps->grads_ready(s->ps, j->first, j->n);
}

/* A hook's own failure: kept for end_step, and no more hand-offs this step (the sums go on). */
static zps_status s_hook_fail(s_node *s, zps_status st)
{
    if (s->hook_err == ZPS_OK)
        s->hook_err = st;
    (void)tr_worker_fail(&s->worker, st);
    return st;
}

static zps_status s_post(s_node *s, const tr_bucket *k)
{
    tr_job j = {.lo = k->lo, .hi = k->hi, .first = k->first, .n = k->nv,
                .t0 = tr_trace_now(s->trace)};
    zps_status st = tr_worker_post(&s->worker, &j);
    return st == ZPS_OK ? st : s_hook_fail(s, st);
}

static zps_status s_grads_ready(tr_sync *b, size_t first, size_t n)
{
    s_node *s = (s_node *)b;
    tr_bucket k;
    int full = tr_buckets_report(&s->buckets, first, n, &k);
    if (full < 0)
        return s_hook_fail(s, ZPS_ERR_INTERNAL);
    return full ? s_post(s, &k) : ZPS_OK;
}

/* The leader's end of a step: the PS back-end's, then the new values. */
static zps_status s_lead(s_node *s, tr_step_record *rec)
{
    zps_status st = s->ps->end_step(s->ps, rec);
    if (st == ZPS_OK)
        st = s->ps->params_ready(s->ps);
    return st;
}

static zps_status s_end_step(tr_sync *b, tr_step_record *rec)
{
    s_node *s = (s_node *)b;
    uint64_t t0 = zps_now_ns(), tt = tr_trace_now(s->trace);
    tr_bucket k;
    if (tr_buckets_rest(&s->buckets, &k))
        (void)s_post(s, &k);
    (void)tr_worker_wait(&s->worker); /* a failed hand-off is the PS back-end's (push_err) */
    tr_trace_span(s->trace, TR_TRACE_MAIN, "wait: node sum", tt, -1);
    double sum_wait = (double)(zps_now_ns() - t0) * 1e-9;
    ZPS_TRY(s->sum_err); /* no node to broadcast to: every rank fails here */
    zps_status st = s->hook_err;
    tr_node_word w = {.status = st, .redo_from = -1};
    if (s->ps && st == ZPS_OK) {
        w.status = s_lead(s, rec);
        w.redo_from = s->ps->redo_from;
    }
    ZPS_TRY(s_share(s, &w));
    if (w.status == ZPS_OK || w.redo_from >= 0) /* a rollback left the older values */
        ZPS_TRY(tr_allreduce_broadcast(s->ar, s->params, s->n * sizeof(float), 0));
    b->redo_from = w.redo_from;
    b->net_wait = s->ps ? sum_wait + s->ps->net_wait : (double)(zps_now_ns() - t0) * 1e-9;
    rec->net_wait_s = b->net_wait;
    return st != ZPS_OK ? st : w.status; /* a member's own failure, else the leader's word */
}

static zps_status s_finish(tr_sync *b, int *fresh)
{
    s_node *s = (s_node *)b;
    tr_node_word w = {.redo_from = -1};
    *fresh = 0;
    if (s->ps)
        w.status = s->ps->finish(s->ps, fresh), w.fresh = *fresh;
    ZPS_TRY(s_share(s, &w));
    if (w.status == ZPS_OK)
        ZPS_TRY(tr_allreduce_broadcast(s->ar, s->params, s->n * sizeof(float), 0));
    *fresh = w.fresh;
    return w.status;
}

static zps_status s_leave(tr_sync *b)
{
    s_node *s = (s_node *)b;
    return s->ps ? s->ps->leave(s->ps) : ZPS_OK;
}

static void s_abandon(tr_sync *b)
{
    s_node *s = (s_node *)b;
    if (s->ps && s->ps->abandon)
        s->ps->abandon(s->ps);
}

static void s_destroy(tr_sync *b)
{
    s_node *s = (s_node *)b;
    tr_worker_stop(&s->worker); /* before the PS back-end its jobs call */
    tr_sync_destroy(&s->ps);
    tr_allreduce_destroy(&s->ar);
    free(s);
}

/* The node's segment; the leader's PS back-end; its values and job step to every rank. */
static zps_status s_setup(s_node *s, const tr_sync_env *env, int group, tr_sync_new_fn lead_new)
{
    ZPS_TRY(tr_node_open(env, &s->ar));
    tr_node_word w = {.redo_from = -1};
    if (s->rank == 0) {
        tr_sync_env lead = *env;
        lead.id = env->id / group;
        lead.n_trainers = env->n_trainers / group;
        w.status = lead_new(&lead, &s->ps);
        if (s->ps)
            w.start_step = s->ps->start_step;
    }
    ZPS_TRY(s_share(s, &w));
    ZPS_TRY(tr_node_lead_result(env, group, (zps_status)w.status));
    s->base.start_step = w.start_step;
    ZPS_TRY(tr_allreduce_broadcast(s->ar, s->params, s->n * sizeof(float), 0));
    /* one bucket per variable at most, and the rest */
    return tr_worker_start(&s->worker, env->nvars + 2, s_job, s, "trainer");
}

zps_status tr_sync_node_new(const tr_sync_env *env, tr_sync **out)
{
    return tr_sync_node_lead_new(env, tr_sync_ps_new, out);
}

zps_status tr_sync_node_lead_new(const tr_sync_env *env, tr_sync_new_fn lead_new,
                                 tr_sync **out)
{
    *out = NULL;
    int group = env->cfg->node_trainers;
    s_node *s = zps_xcalloc(1, sizeof *s);
    *s = (s_node){.rank = env->id % (group > 0 ? group : 1), .params = env->params,
                  .grads = env->grads, .n = env->nparams,
                  .trace = env->trace};
    /* A model on a device leaves the host's cores idle during backward: the node's sums and
     * pushes overlap it. On the CPU the trainers' compute threads already take the cores,
     * and overlapping cost 4-5% (docs/training.md "Nodes"): one bucket, at the end. */
    const k_backend *mbe = env->model ? nn_model_backend(env->model) : NULL;
    if (mbe && !mbe->host_memory)
        tr_buckets_init(&s->buckets, env, TR_SHM_BUCKETS, TR_SHM_BUCKET_MIN);
    else
        tr_buckets_init(&s->buckets, env, 1, env->nparams);
    s->base = (tr_sync){.begin_step = s_begin_step, .params_ready = s_params_ready,
                        .grads_ready = s_grads_ready, .end_step = s_end_step,
                        .finish = s_finish, .leave = s_leave, .abandon = s_abandon,
                        .destroy = s_destroy, .redo_from = -1};
    zps_status st = s_setup(s, env, group, lead_new);
    if (st != ZPS_OK) {
        if (s->ps && s->ps->abandon) /* it joined the servers: they hear of it now */
            s->ps->abandon(s->ps);
        s_destroy(&s->base);
        return st;
    }
    zps_log(ZPS_INFO, "trainer", "node %d, rank %d of %d: %s", env->id / group, s->rank,
            group, s->ps ? "pushes and pulls for the node" : "all-reduces with the node");
    *out = &s->base;
    return ZPS_OK;
}
