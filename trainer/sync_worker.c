/* sync_worker.c — the communication thread the sync back-ends share (sync.h, tr_worker).
 *
 * Backward's hooks must return at once, so a back-end that talks to its peers per layer
 * group posts each group as a job, and one thread runs the jobs in order while backward
 * goes on: sync_allreduce.c (sum a bucket with the node, apply it), sync_node.c (sum a
 * bucket with the node; the leader hands it to the servers) and stage.c (wait for a group's
 * copy to the host, hand it to the PS back-end).
 *
 * Invariants:
 *  - Jobs run one at a time, in the order posted. tr_worker_wait returns once every job
 *    posted so far has run; the thread is then idle, and the mutex hand-off orders the
 *    memory the jobs wrote before whatever the caller does next (the owner's single-user
 *    rule: its peers are touched by the thread during a step, by the caller between).
 *  - The first failure a job returns is kept until tr_worker_clear and passed to every
 *    later job, which decides what it still does (the collectives must still match on
 *    every rank, say); tr_worker_err reads it from the hooks.
 *  - The queue holds max_jobs per step (tr_worker_wait empties it); nothing is allocated
 *    after tr_worker_start.
 *  - Signals stay with the caller's thread (the loop checks its stop flag).
 */
#include "trainer/sync.h"

#include <stdlib.h>

#include "common/log.h"
#include "common/mem.h"
#include "common/proc.h"

static void *s_thread(void *p)
{
    tr_worker *w = p;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->quit && w->done == w->posted)
            pthread_cond_wait(&w->work, &w->mu);
        if (w->done == w->posted)
            break;
        tr_job job = w->q[w->done];
        zps_status failed = w->err;
        pthread_mutex_unlock(&w->mu);
        zps_status st = w->fn(w->ctx, &job, failed);
        pthread_mutex_lock(&w->mu);
        if (w->err == ZPS_OK)
            w->err = st;
        w->done++;
        if (w->done == w->posted)
            pthread_cond_broadcast(&w->idle);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

zps_status tr_worker_start(tr_worker *w, size_t max_jobs, tr_worker_fn fn, void *ctx,
                           const char *who)
{
    *w = (tr_worker){.fn = fn, .ctx = ctx, .who = who, .max = max_jobs};
    w->q = zps_xcalloc(max_jobs, sizeof *w->q);
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->work, NULL);
    pthread_cond_init(&w->idle, NULL);
    w->inited = 1;
    int rc = zps_thread_start(&w->thread, s_thread, w);
    if (rc != 0) {
        zps_log(ZPS_ERROR, who, "cannot start the communication thread: error %d", rc);
        return ZPS_ERR_SYS;
    }
    w->up = 1;
    return ZPS_OK;
}

zps_status tr_worker_post(tr_worker *w, const tr_job *job)
{
    pthread_mutex_lock(&w->mu);
    int full = w->posted == w->max;
    if (!full) {
        w->q[w->posted++] = *job;
        pthread_cond_signal(&w->work);
    }
    pthread_mutex_unlock(&w->mu);
    if (!full)
        return ZPS_OK;
    zps_log(ZPS_ERROR, w->who, "more than %zu jobs for the communication thread in one step "
            "(internal: its owner planned for fewer)", w->max);
    return tr_worker_fail(w, ZPS_ERR_INTERNAL); /* the owner planned for fewer */
}

zps_status tr_worker_err(tr_worker *w)
{
    pthread_mutex_lock(&w->mu);
    zps_status st = w->err;
    pthread_mutex_unlock(&w->mu);
    return st;
}

zps_status tr_worker_fail(tr_worker *w, zps_status st)
{
    pthread_mutex_lock(&w->mu);
    if (w->err == ZPS_OK)
        w->err = st;
    st = w->err;
    pthread_mutex_unlock(&w->mu);
    return st;
}

zps_status tr_worker_wait(tr_worker *w)
{
    pthread_mutex_lock(&w->mu);
    while (w->done < w->posted)
        pthread_cond_wait(&w->idle, &w->mu);
    w->posted = w->done = 0;
    zps_status st = w->err;
    pthread_mutex_unlock(&w->mu);
    return st;
}

void tr_worker_clear(tr_worker *w)
{
    pthread_mutex_lock(&w->mu);
    w->err = ZPS_OK;
    pthread_mutex_unlock(&w->mu);
}

void tr_worker_stop(tr_worker *w)
{
    if (!w->inited)
        return;
    if (w->up) {
        pthread_mutex_lock(&w->mu);
        w->quit = 1;
        pthread_cond_signal(&w->work);
        pthread_mutex_unlock(&w->mu);
        pthread_join(w->thread, NULL);
        w->up = 0;
    }
    pthread_cond_destroy(&w->work);
    pthread_cond_destroy(&w->idle);
    pthread_mutex_destroy(&w->mu);
    free(w->q);
    w->q = NULL;
    w->inited = 0;
}
