/* sync_allreduce.c — --mode allreduce over shared memory (see sync.h, allreduce.h).
 *
 * Every rank holds the whole model. A step sums the mean gradients of the node's ranks
 * (averaged, in rank order, so every rank gets the same bits) and applies the local
 * optimizer, so the replicas stay bit-identical without ever exchanging values after the
 * start, when all take rank 0's.
 *
 * It is the local back-end (sync_local.c) with three calls replaced: begin_step (the stop
 * decision), end_step (the sum before the update) and destroy.
 *
 * Invariants:
 *  - Every rank makes the same collective calls in the same order: one broadcast of the stop
 *    decision per step begun, one sum per step ended. Stopping is therefore decided by
 *    rank 0 alone (its wish, broadcast): a rank that stopped on its own would leave the
 *    others waiting in the next sum.
 */
#include "trainer/sync.h"

#include <stdlib.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "trainer/allreduce.h"

typedef struct s_ar {
    tr_sync_local local;      // first: the local back-end this one extends
    tr_allreduce *ar;
} s_ar;

static zps_status s_begin_step(tr_sync *s, int64_t step, int *stop)
{
    s_ar *a = (s_ar *)s;
    int32_t flag = *stop;
    ZPS_TRY(tr_allreduce_broadcast(a->ar, &flag, sizeof flag, 0));
    *stop = flag;
    a->local.step = step;
    s->net_wait = 0;
    return ZPS_OK;
}

static zps_status s_end_step(tr_sync *s, tr_step_record *rec)
{
    s_ar *a = (s_ar *)s;
    uint64_t t0 = zps_now_ns();
    ZPS_TRY(tr_allreduce_sum(a->ar, a->local.grads, a->local.n, 1));
    s->net_wait += (double)(zps_now_ns() - t0) * 1e-9;
    rec->bytes_pushed = rec->bytes_pulled = a->local.n * sizeof(float);
    rec->net_wait_s = s->net_wait;
    tr_sync_local_apply(&a->local, rec);
    return ZPS_OK;
}

static void s_destroy(tr_sync *s)
{
    s_ar *a = (s_ar *)s;
    tr_allreduce_destroy(&a->ar);
    tr_sync_local_free(&a->local);
    free(a);
}

zps_status tr_sync_allreduce_new(const tr_sync_env *env, tr_sync **out)
{
    *out = NULL;
    s_ar *a = zps_xcalloc(1, sizeof *a);
    tr_sync_local_init(&a->local, env);
    a->local.base.begin_step = s_begin_step;
    a->local.base.end_step = s_end_step;
    a->local.base.destroy = s_destroy;
    zps_status st = tr_allreduce_new(env->cfg->job, env->id, env->n_trainers, env->nparams,
                                     NULL, &a->ar);
    /* Everyone starts from rank 0's values (they are equal when seeded alike). */
    if (st == ZPS_OK)
        st = tr_allreduce_broadcast(a->ar, env->params, env->nparams * sizeof(float), 0);
    if (st != ZPS_OK) {
        s_destroy(&a->local.base);
        return st;
    }
    zps_log(ZPS_INFO, "trainer", "all-reduce rank %d of %d (%zu MiB shared segment)", env->id,
            env->n_trainers, tr_allreduce_segment_bytes(a->ar) >> 20);
    *out = &a->local.base;
    return ZPS_OK;
}
