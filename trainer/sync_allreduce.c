/* sync_allreduce.c — --mode allreduce over shared memory (see sync.h, allreduce.h).
 *
 * Every rank holds the whole model. A step sums the mean gradients of the node's ranks
 * (averaged, in rank order, so every rank gets the same bits) and applies the local
 * optimizer, so the replicas stay bit-identical without ever exchanging values after the
 * start, when all take rank 0's.
 *
 * Overlap: backward reports the layers last first (grads_ready); the reported gradients
 * gather into a bucket, and once a bucket holds bucket_floats (default: a quarter of the
 * model, at least TR_SHM_BUCKET_MIN) it goes to this rank's communication thread (tr_worker),
 * which reduces it with the peers while backward computes the layers below. The optimizer is
 * fused into the reduction (tr_allreduce_sum_apply): each stretch of the mean gradient is applied to the values the
 * moment it is final, from cache, so the update makes no pass of its own. end_step sends
 * what is left (the first layers, and any floats no variable covers) and waits for the
 * thread; net_wait is that wait, the part of the exchange backward did not hide.
 *
 * It is the local back-end (sync_local.c) with four calls replaced: begin_step (the stop
 * decision), grads_ready (the buckets), end_step (the rest and the wait) and destroy.
 *
 * Invariants:
 *  - Every rank makes the same collective calls in the same order: one broadcast of the stop
 *    decision per step begun, then the step's buckets. Bucket edges depend only on the model
 *    (its variables and the order of the hooks), so they are the same on every rank.
 *    Every rank stops when any rank wishes to (tr_sync_any_stop: a signal, --time-limit,
 *    the target reached): a rank that stopped on its own would leave the others waiting in
 *    the next sum, and one whose wish was overruled would ignore its SIGTERM.
 *  - The thread is the only user of the tr_allreduce between the first bucket and the end
 *    of end_step; the loop's thread uses it (broadcasts) only while the thread is idle, and
 *    the mutex orders the two. Buckets cover [0, nparams) exactly once per step.
 *  - The sum order per element is fixed (allreduce.h) and the update is elementwise
 *    (ps_optim_apply), so bucket and stretch edges never change a bit: the result equals
 *    one sum of the whole gradient followed by one update (test_sync, it_train).
 *  - Nothing is allocated per step: the queue holds at most one bucket per variable + 1.
 */
#include "trainer/sync.h"

#include <stdlib.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "ps/optim.h"
#include "trainer/allreduce.h"
#include "trainer/trace.h"

typedef struct s_ar {
    tr_sync_local local;      // first: the local back-end this one extends
    tr_allreduce *ar;
    struct tr_trace *trace;   // --trace (NULL: none): each bucket's reduction is a span
    tr_buckets buckets;       // this step's (sync.h)
    tr_worker worker;         // the communication thread: one job per bucket
} s_ar;

/* The fused update of one stretch of the mean gradient (allreduce.h's callback). */
static void s_apply(void *ctx, float *part, size_t len)
{
    s_ar *a = ctx;
    tr_sync_local *l = &a->local;
    size_t at = (size_t)(part - l->grads);
    /* the shared-memory all-reduce works on host memory: the host loop of k_optim_apply */
    zps_optim_apply_host(&l->st, len, l->params + at, l->slots[0] ? l->slots[0] + at : NULL,
                         l->slots[1] ? l->slots[1] + at : NULL, part);
}

/* A bucket, on the worker: reduced with the peers, applied. */
static zps_status s_job(void *ctx, const tr_job *b, zps_status failed)
{
    s_ar *a = ctx;
    if (failed != ZPS_OK) // after a failure the rest is skipped: the job is broken anyway
        return failed;
    zps_status st = tr_allreduce_sum_apply(a->ar, a->local.grads + b->lo, b->hi - b->lo, 1,
                                           s_apply, a);
    tr_trace_async(a->trace, "allreduce", "bucket: reduce + apply", b->t0, zps_now_ns(),
                   (int64_t)(b->hi - b->lo));
    return st;
}

static zps_status s_post(s_ar *a, size_t lo, size_t hi)
{
    return tr_worker_post(&a->worker, &(tr_job){.lo = lo, .hi = hi,
                                                .t0 = tr_trace_now(a->trace)});
}

static zps_status s_begin_step(tr_sync *s, int64_t step, int *stop)
{
    s_ar *a = (s_ar *)s;
    ZPS_TRY(tr_worker_err(&a->worker)); // idle: end_step waited for it
    ZPS_TRY(tr_sync_any_stop(a->ar, stop));
    tr_buckets_reset(&a->buckets);
    tr_sync_local_begin(&a->local, step);
    s->net_wait = 0;
    return ZPS_OK;
}

static zps_status s_grads_ready(tr_sync *s, size_t first, size_t n)
{
    s_ar *a = (s_ar *)s;
    ZPS_TRY(tr_worker_err(&a->worker));
    tr_bucket k;
    int full = tr_buckets_report(&a->buckets, first, n, &k);
    if (full < 0)
        return tr_worker_fail(&a->worker, ZPS_ERR_INTERNAL);
    return full ? s_post(a, k.lo, k.hi) : ZPS_OK;
}

static zps_status s_end_step(tr_sync *s, tr_step_record *rec)
{
    s_ar *a = (s_ar *)s;
    uint64_t t0 = zps_now_ns(), tt = tr_trace_now(a->trace);
    tr_bucket k;
    if (tr_buckets_rest(&a->buckets, &k))
        (void)s_post(a, k.lo, k.hi); /* a refusal is kept by the worker: its wait returns it */
    zps_status err = tr_worker_wait(&a->worker);
    tr_trace_span(a->trace, TR_TRACE_MAIN, "wait: all-reduce", tt, -1);
    s->net_wait += (double)(zps_now_ns() - t0) * 1e-9;
    rec->bytes_pushed = rec->bytes_pulled = a->local.n * sizeof(float);
    rec->net_wait_s = s->net_wait;
    rec->lr = ps_optim_lr(a->local.opt, (uint64_t)a->local.step);
    return err;
}

static void s_destroy(tr_sync *s)
{
    s_ar *a = (s_ar *)s;
    tr_worker_stop(&a->worker);
    tr_allreduce_destroy(&a->ar);
    tr_sync_local_free(&a->local);
    free(a);
}

/* The back-end's own fields; the thread is started by the caller. NULL when the local
 * back-end it extends cannot be made (logged). */
static s_ar *s_alloc(const tr_sync_env *env)
{
    s_ar *a = zps_xcalloc(1, sizeof *a);
    const tr_sync own = {.begin_step = s_begin_step, .grads_ready = s_grads_ready,
                         .end_step = s_end_step, .destroy = s_destroy};
    if (tr_sync_local_extend(&a->local, env, &own) != ZPS_OK) {
        free(a);
        return NULL;
    }
    a->trace = env->trace;
    tr_buckets_init(&a->buckets, env, TR_SHM_BUCKETS, TR_SHM_BUCKET_MIN);
    return a;
}

zps_status tr_sync_allreduce_new(const tr_sync_env *env, tr_sync **out)
{
    *out = NULL;
    s_ar *a = s_alloc(env);
    if (!a)
        return ZPS_ERR_NOMEM;
    if (!a->local.be->host_memory) {
        zps_log(ZPS_ERROR, "allreduce", "the shared-memory all-reduce reduces host memory; "
                "gradients on the %s back-end need the NCCL back-end", a->local.be->name);
        s_destroy(&a->local.base);
        return ZPS_ERR_UNSUPPORTED;
    }
    zps_status st = tr_allreduce_new(env->cfg->job, env->id, env->n_trainers, env->nparams,
                                     NULL, &a->ar);
    /* Everyone starts from rank 0's values (they are equal when seeded alike). */
    if (st == ZPS_OK)
        st = tr_allreduce_broadcast(a->ar, env->params, env->nparams * sizeof(float), 0);
    /* one bucket per variable at most, and the rest */
    if (st == ZPS_OK)
        st = tr_worker_start(&a->worker, env->nvars + 2, s_job, a, "allreduce");
    if (st != ZPS_OK) {
        s_destroy(&a->local.base);
        return st;
    }
    zps_log(ZPS_INFO, "trainer", "all-reduce rank %d of %d (%zu MiB shared segment)", env->id,
            env->n_trainers, tr_allreduce_segment_bytes(a->ar) >> 20);
    *out = &a->local.base;
    return ZPS_OK;
}
