/* sync_node_dev.c — --node-trainers G in the PS modes with the model on a GPU per trainer:
 * the node's sums and its new values cross between the GPUs (NCCL), not through the host.
 *
 * sync_node.c's layout (see there; docs/training.md "Nodes"), with the data on the devices:
 * every rank's gradients are summed in device memory by NCCL on its own stream, and only the
 * leader (local rank 0) moves data to and from the host, for its PS back-end, which runs
 * under stage.c's pinned mirrors as it would for a lone trainer on a GPU. A step:
 *
 *   begin_step  whether any rank of the node wishes to stop (one sum), then the leader's
 *               begin_step; its stop decision and the PS back-end's, broadcast over the
 *               node's segment (a few bytes, like sync_node.c's)
 *   backward    the reported gradients gather into buckets of variables (tr_buckets); a full
 *               bucket is queued as one NCCL mean of its device range, ordered after the
 *               compute stream's work so far by an event (the host does not wait). On the
 *               leader, the bucket's variables then go to the staged PS back-end, whose
 *               copy of them to the host waits for a point on NCCL's stream after that sum
 *               (env.grads_point), so the node's pushes leave while the GPUs compute the
 *               layers below
 *   end_step    queues the rest; the compute stream waits for the sums (the next backward
 *               overwrites the gradients). The leader ends the step in the staged PS
 *               back-end, waits for the new values and puts them on its GPU
 *               (tr_sync_staged_upload: also after a sync rollback, whose values are the
 *               older ones); the step's outcome (status, redo_from) goes over the segment,
 *               and then the values as one NCCL broadcast from the leader's GPU, which every
 *               rank's compute stream waits for before the next forward
 *   params_ready, finish
 *               the leader's final values the same way; then the host waits until no
 *               collective of this rank is unfinished (a peer that died fails the job here,
 *               before an evaluation reads the values)
 *   abandon     marks the job failed and aborts NCCL (the peers stop waiting), and abandons
 *               the PS back-end
 *
 * Trainers of a node that share one GPU (NCCL refuses that: two trainers on a one-GPU
 * machine) cannot use this: tr_sync_node_dev_new makes nothing and the trainer runs
 * sync_node.c under stage.c's mirrors instead (train.c), with the node's sums on the host.
 *
 * Invariants:
 *  - Every rank of a node makes the same collective calls in the same order: per step, the
 *    stop word, the buckets' sums (edges that depend only on the model), the outcome word,
 *    and the values broadcast when the step succeeded or rolled back.
 *  - The staged PS back-end is called from this back-end's callers' thread only; its own
 *    staging thread calls the PS back-end during backward (stage.c's invariants).
 *  - A bucket's device range is final when it is queued (its backward ran on the compute
 *    stream before the sum's event), and nothing but the sum writes it before end_step's
 *    join; the leader's copy of it waits for the point after its sum.
 *  - A failure of the node's collectives (the NCCL communicator, the segment) breaks the
 *    back-end: every later call fails and the loop ends. A hand-off the PS back-end refused
 *    is the PS back-end's to judge in its end_step, as in sync_node.c. Gradients are handed
 *    to it only while the communicator stands: an abort ends NCCL's kernels early, and the
 *    copy after them holds no mean (stage.c asks tr_grads_source.valid after each copy).
 *  - Nothing is allocated per step.
 * Not run on two GPUs yet (no session had a machine with more than one): the CPU suite proves
 * the logic over the staged back-end with the node's collectives on the host
 * (tests/test_sync.c).
 */
#include "trainer/sync.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "kernels/device.h"
#include "trainer/allreduce.h"
#include "trainer/trace.h"

typedef struct s_nd {
    tr_sync base;             // first: the tr_sync the loop holds
    tr_sync *lead;            // the leader's staged PS back-end (NULL on the other ranks)
    tr_allreduce *ar;         // the node's segment: the words, NCCL's id, the peers' liveness
    tr_node_coll coll;        // the node's collectives on device memory (NCCL's)
    tr_grads_source src;      // leader: coll's point and validity, for stage.c
    int rank;
    float *params, *grads;    // (n) the model's, in device memory
    size_t n;
    tr_buckets buckets;       // this step's (sync.h)
    zps_status err;           // the node's collectives failed: the back-end is broken
    int handing;              // leader: this step's hand-offs go on (none once the staged
                              // back-end refused one: its own failure, kept for end_step)
    struct tr_trace *trace;
} s_nd;

static zps_status s_broken(s_nd *s, zps_status st)
{
    if (st != ZPS_OK && s->err == ZPS_OK)
        s->err = st;
    return st;
}

static zps_status s_begin_step(tr_sync *b, int64_t step, int *stop)
{
    s_nd *s = (s_nd *)b;
    ZPS_TRY(s->err);
    tr_buckets_reset(&s->buckets);
    s->handing = 1;
    ZPS_TRY(s_broken(s, tr_sync_any_stop(s->ar, stop))); /* the node's wishes, then the lead's */
    tr_node_word w = {.stop = *stop, .redo_from = -1};
    if (s->lead)
        w.status = s->lead->begin_step(s->lead, step, stop), w.stop = *stop;
    ZPS_TRY(s_broken(s, tr_node_share(s->ar, &w)));
    *stop = w.stop;
    b->net_wait = 0;
    b->redo_from = -1;
    return w.status;
}

/* The node's mean of the bucket queued; the leader hands its variables on. */
static zps_status s_post(s_nd *s, const tr_bucket *k)
{
    ZPS_TRY(s_broken(s, s->coll.sum(s->coll.ctx, s->grads + k->lo, k->hi - k->lo)));
    if (!s->lead || !s->handing || k->nv == 0)
        return ZPS_OK;
    zps_status st = s->lead->grads_ready(s->lead, k->first, k->nv);
    s->handing = st == ZPS_OK; /* refused: its end_step returns why */
    return ZPS_OK;
}

static zps_status s_grads_ready(tr_sync *b, size_t first, size_t n)
{
    s_nd *s = (s_nd *)b;
    ZPS_TRY(s->err);
    tr_bucket k;
    int full = tr_buckets_report(&s->buckets, first, n, &k);
    if (full < 0) /* the ranks' buckets no longer match: the node cannot go on */
        return s_broken(s, ZPS_ERR_INTERNAL);
    return full ? s_post(s, &k) : ZPS_OK;
}

/* The leader's end of a step: the PS back-end's, the new values (or a rollback's older
 * ones) on its GPU. */
static void s_lead(s_nd *s, tr_step_record *rec, tr_node_word *w)
{
    tr_sync *l = s->lead;
    zps_status st = l->end_step(l, rec);
    if (st == ZPS_OK)
        st = l->params_ready(l);
    w->redo_from = l->redo_from;
    if (st == ZPS_OK || w->redo_from >= 0) {
        zps_status up = tr_sync_staged_upload(l);
        if (up != ZPS_OK)
            st = up, w->redo_from = -1;
    }
    w->status = st;
}

/* Rank 0's device values to every rank; the next forward waits for them. */
static zps_status s_values(s_nd *s)
{
    zps_status st = s->coll.broadcast(s->coll.ctx, s->params, s->n);
    if (st == ZPS_OK)
        st = s->coll.join(s->coll.ctx);
    return s_broken(s, st);
}

static zps_status s_end_step(tr_sync *b, tr_step_record *rec)
{
    s_nd *s = (s_nd *)b;
    uint64_t t0 = zps_now_ns(), tt = tr_trace_now(s->trace);
    tr_bucket k;
    if (s->err == ZPS_OK && tr_buckets_rest(&s->buckets, &k))
        (void)s_post(s, &k);
    if (s->err == ZPS_OK)
        (void)s_broken(s, s->coll.join(s->coll.ctx));
    ZPS_TRY(s->err); /* no node to tell: every rank fails here */
    tr_node_word w = {.redo_from = -1};
    if (s->lead)
        s_lead(s, rec, &w);
    ZPS_TRY(s_broken(s, tr_node_share(s->ar, &w)));
    if (w.status == ZPS_OK || w.redo_from >= 0)
        ZPS_TRY(s_values(s));
    tr_trace_span(s->trace, TR_TRACE_MAIN, "wait: node step", tt, -1);
    b->redo_from = w.redo_from;
    b->net_wait = s->lead ? s->lead->net_wait : (double)(zps_now_ns() - t0) * 1e-9;
    rec->net_wait_s = b->net_wait;
    return w.status;
}

/* The values about to be read: no collective of this rank may be unfinished. */
static zps_status s_params_ready(tr_sync *b)
{
    s_nd *s = (s_nd *)b;
    ZPS_TRY(s->err);
    return s_broken(s, s->coll.drain(s->coll.ctx));
}

static zps_status s_finish(tr_sync *b, int *fresh)
{
    s_nd *s = (s_nd *)b;
    ZPS_TRY(s->err);
    tr_node_word w = {.redo_from = -1};
    *fresh = 0;
    if (s->lead) {
        w.status = s->lead->finish(s->lead, fresh), w.fresh = *fresh;
        if (w.status == ZPS_OK) /* finish uploaded what was stale; nothing is now */
            w.status = tr_sync_staged_upload(s->lead);
    }
    ZPS_TRY(s_broken(s, tr_node_share(s->ar, &w)));
    if (w.status == ZPS_OK) {
        ZPS_TRY(s_values(s));
        ZPS_TRY(s_params_ready(b));
    }
    *fresh = w.fresh;
    return w.status;
}

static zps_status s_leave(tr_sync *b)
{
    s_nd *s = (s_nd *)b;
    return s->lead ? s->lead->leave(s->lead) : ZPS_OK;
}

static void s_abandon(tr_sync *b)
{
    s_nd *s = (s_nd *)b;
    if (s->coll.abandon)
        s->coll.abandon(s->coll.ctx);
    if (s->lead && s->lead->abandon)
        s->lead->abandon(s->lead);
}

static void s_destroy(tr_sync *b)
{
    s_nd *s = (s_nd *)b;
    tr_sync_destroy(&s->lead);
    if (s->coll.destroy)
        s->coll.destroy(s->coll.ctx); /* before the segment it watches */
    tr_allreduce_destroy(&s->ar);
    free(s);
}

/* The leader's staged PS back-end as trainer `node` of `nodes`; its values and the job's
 * step to every rank. */
static zps_status s_setup(s_nd *s, const tr_sync_env *env, int group, tr_sync_new_fn lead_new)
{
    int node = env->id / group, nodes = env->n_trainers / group;
    tr_node_word w = {.redo_from = -1};
    if (s->rank == 0) {
        tr_sync_env lead = *env;
        lead.id = node;
        lead.n_trainers = nodes;
        s->src = (tr_grads_source){.ctx = s->coll.ctx, .point = s->coll.point,
                                   .valid = s->coll.valid};
        lead.grads_source = &s->src;
        w.status = tr_sync_staged_new(&lead, lead_new, 0, &s->lead);
        if (s->lead) {
            w.start_step = s->lead->start_step;
            w.status = tr_sync_staged_upload(s->lead);
        }
    }
    ZPS_TRY(tr_node_share(s->ar, &w));
    ZPS_TRY(tr_node_lead_result(env, group, (zps_status)w.status));
    s->base.start_step = w.start_step;
    return s_values(s);
}

zps_status tr_sync_node_dev_with(const tr_sync_env *env, tr_node_coll_new_fn coll_new,
                                 tr_sync_new_fn lead_new, tr_sync **out)
{
    *out = NULL;
    int group = env->cfg->node_trainers;
    s_nd *s = zps_xcalloc(1, sizeof *s);
    *s = (s_nd){.rank = env->id % (group > 0 ? group : 1), .params = env->params,
                .grads = env->grads, .n = env->nparams, .trace = env->trace};
    s->base = (tr_sync){.begin_step = s_begin_step, .params_ready = s_params_ready,
                        .grads_ready = s_grads_ready, .end_step = s_end_step,
                        .finish = s_finish, .leave = s_leave, .abandon = s_abandon,
                        .destroy = s_destroy, .redo_from = -1};
    tr_buckets_init(&s->buckets, env, TR_NCCL_BUCKETS, TR_NCCL_BUCKET_MIN);
    zps_status st = tr_node_open(env, &s->ar);
    if (st == ZPS_OK)
        st = coll_new(s->ar, env, &s->coll);
    if (st == ZPS_OK && !s->coll.sum) { /* declined (GPUs shared): the caller's choice */
        s_destroy(&s->base);
        return ZPS_OK;
    }
    if (st == ZPS_OK)
        st = s_setup(s, env, group, lead_new);
    if (st != ZPS_OK) {
        if (s->lead && s->lead->abandon) /* it joined the servers: they hear of it now */
            s->lead->abandon(s->lead);
        s_destroy(&s->base);
        return st;
    }
    zps_log(ZPS_INFO, "trainer", "node %d, rank %d of %d, sums on the GPUs (buckets of %zu "
            "floats): %s", env->id / group, s->rank, group, s->buckets.floats,
            s->lead ? "pushes and pulls for the node" : "all-reduces with the node");
    *out = &s->base;
    return ZPS_OK;
}

/* ---- the node's collectives over NCCL ---- */

static zps_status s_nccl_sum(void *ctx, float *dev, size_t n)
{
    return tr_nccl_sum_device_async(ctx, dev, n, 1);
}
static zps_status s_nccl_broadcast(void *ctx, float *dev, size_t n)
{
    return tr_nccl_broadcast_device_async(ctx, dev, n, 0);
}
static zps_status s_nccl_point(void *ctx, struct k_event *e) { return tr_nccl_record(ctx, e); }
static zps_status s_nccl_valid(void *ctx) { return tr_nccl_ok(ctx); }
static zps_status s_nccl_join(void *ctx) { return tr_nccl_join(ctx); }
static zps_status s_nccl_drain(void *ctx) { return tr_nccl_drain(ctx); }
static void s_nccl_abandon(void *ctx) { tr_nccl_abandon(ctx); }
static void s_nccl_destroy(void *ctx)
{
    tr_nccl *nc = ctx;
    tr_nccl_destroy(&nc);
}

zps_status tr_node_coll_nccl_new(tr_allreduce *ar, const tr_sync_env *env, tr_node_coll *out)
{
    int shared = 0;
    *out = (tr_node_coll){0};
    ZPS_TRY(tr_nccl_gpus_shared(ar, &shared));
    if (shared) {
        zps_log(ZPS_INFO, "trainer", "trainer %d: trainers of this node share a GPU, which "
                "NCCL cannot run on: the node sums through pinned host memory", env->id);
        return ZPS_OK;
    }
    tr_nccl *nc;
    ZPS_TRY(tr_nccl_new(ar, k_device_gpu(), &nc));
    *out = (tr_node_coll){.ctx = nc, .sum = s_nccl_sum, .broadcast = s_nccl_broadcast,
                          .point = s_nccl_point, .valid = s_nccl_valid, .join = s_nccl_join,
                          .drain = s_nccl_drain,
                          .abandon = s_nccl_abandon, .destroy = s_nccl_destroy};
    return ZPS_OK;
}

/* (ZPS_OK with *out NULL when the node's trainers share a GPU: sync.h) */
zps_status tr_sync_node_dev_new(const tr_sync_env *env, tr_sync **out)
{
    return tr_sync_node_dev_with(env, tr_node_coll_nccl_new, tr_sync_ps_new, out);
}
