/* sync_nccl.c — --mode allreduce with the model on a GPU: NCCL sums the device gradients (see
 * sync.h, allreduce.h's tr_nccl).
 *
 * The local back-end (sync_local.c: the optimizer through k_optim_apply on the device) with
 * four calls replaced, as sync_allreduce.c does for host memory:
 *   begin_step  rank 0's stop decision, broadcast over the node's shared-memory segment (a
 *               few bytes; the segment also carried NCCL's unique id at set-up)
 *   grads_ready the reported gradients gather into a bucket; a full bucket is queued as one
 *               NCCL all-reduce (mean) of that device range, ordered after the compute
 *               stream's work so far by an event, so it runs on NCCL's stream while the
 *               compute stream goes on with the layers below. The host waits only
 *               until NCCL has taken the call (allreduce_nccl.c s_settle)
 *   end_step    queues the rest, makes the compute stream wait for NCCL's stream, and queues
 *               the optimizer on the compute stream: the next step's forward follows it
 *   params_ready, finish
 *               wait until no sum of this rank is unfinished (a peer that dies in the last
 *               step fails the job here, before an evaluation or the export reads values)
 *   abandon     marks the job failed and aborts NCCL, so the peers stop waiting for our sums
 *   destroy
 * Every rank starts from rank 0's values (one NCCL broadcast at set-up). Ranks that share one
 * GPU (two trainers on a one-GPU machine: NCCL refuses that) are declined (*out NULL, with a
 * warning): train.c then runs the shared-memory all-reduce under stage.c's mirrors, as for
 * any device without NCCL.
 *
 * Invariants:
 *  - Every rank makes the same collective calls in the same order: the stop broadcast per
 *    step begun, then the step's buckets, whose edges depend only on the model (the
 *    variables and the hook order), so they are the same on every rank.
 *  - A bucket's range is final when it is queued (its layers' backward ran on the compute
 *    stream before the event the all-reduce waits for), and nothing writes it again before
 *    the optimizer, which the compute stream runs after the join.
 *  - Nothing is allocated per step.
 * Not run yet on a GPU (no session had one): it_gpu's all-reduce fleet is its test.
 */
#include "trainer/sync.h"

#include <stdlib.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"
#include "kernels/device.h"
#include "ps/optim.h"
#include "trainer/allreduce.h"

typedef struct s_nccl {
    tr_sync_local local;      // first: the local back-end this one extends
    tr_allreduce *ar;         // the node's segment: NCCL's id and the stop decisions
    tr_nccl *nc;
    tr_buckets buckets;       // this step's (sync.h)
    zps_status err;           // the first failure (hooks cannot return one)
} s_nccl;

/* Queues [lo, hi) as one all-reduce (mean). */
static void s_post(s_nccl *a, size_t lo, size_t hi)
{
    if (a->err == ZPS_OK)
        a->err = tr_nccl_sum_device_async(a->nc, a->local.grads + lo, hi - lo, 1);
}

static zps_status s_begin_step(tr_sync *s, int64_t step, int *stop)
{
    s_nccl *a = (s_nccl *)s;
    ZPS_TRY(a->err);
    ZPS_TRY(tr_sync_any_stop(a->ar, stop));
    tr_buckets_reset(&a->buckets);
    tr_sync_local_begin(&a->local, step);
    s->net_wait = 0;
    return ZPS_OK;
}

static zps_status s_grads_ready(tr_sync *s, size_t first, size_t n)
{
    s_nccl *a = (s_nccl *)s;
    tr_bucket k;
    if (a->err != ZPS_OK)
        return a->err;
    int full = tr_buckets_report(&a->buckets, first, n, &k);
    if (full < 0)
        return a->err = ZPS_ERR_INTERNAL;
    if (full)
        s_post(a, k.lo, k.hi);
    return a->err;
}

static zps_status s_end_step(tr_sync *s, tr_step_record *rec)
{
    s_nccl *a = (s_nccl *)s;
    if (a->err == ZPS_OK) {
        tr_bucket k;
        if (tr_buckets_rest(&a->buckets, &k))
            s_post(a, k.lo, k.hi);
        if (a->err == ZPS_OK)
            a->err = tr_nccl_join(a->nc);
    }
    ZPS_TRY(a->err);
    rec->bytes_pushed = rec->bytes_pulled = a->local.n * sizeof(float);
    rec->net_wait_s = s->net_wait;
    return tr_sync_local_apply(&a->local, rec);
}

/* The values about to be read (after each forward; before an evaluation, which may come
 * right after end_step queued the step's last sums and its optimizer): no sum of this rank
 * may be unfinished, or the evaluation would read what a dead peer left half-summed. Waits
 * under the watchdog's judgement (tr_nccl_drain) and fails if the communicator was
 * aborted. After a forward the sums are long done (its loss read waited for the step's
 * optimizer), so this costs one look. */
static zps_status s_params_ready(tr_sync *s)
{
    s_nccl *a = (s_nccl *)s;
    ZPS_TRY(a->err);
    return tr_nccl_drain(a->nc);
}

static zps_status s_finish(tr_sync *s, int *fresh)
{
    *fresh = 0;
    return s_params_ready(s);
}

/* This rank stops early: the peers must not wait for its sums until the timeout. */
static void s_abandon(tr_sync *s)
{
    tr_nccl_abandon(((s_nccl *)s)->nc);
}

static void s_destroy(tr_sync *s)
{
    s_nccl *a = (s_nccl *)s;
    tr_nccl_destroy(&a->nc);
    tr_allreduce_destroy(&a->ar);
    tr_sync_local_free(&a->local);
    free(a);
}

/* Rank 0's values everywhere; the first forward waits for them. */
static zps_status s_broadcast_values(s_nccl *a)
{
    ZPS_TRY(tr_nccl_broadcast_device_async(a->nc, a->local.params, a->local.n, 0));
    return tr_nccl_join(a->nc);
}

zps_status tr_sync_nccl_new(const tr_sync_env *env, tr_sync **out)
{
    *out = NULL;
    s_nccl *a = zps_xcalloc(1, sizeof *a);
    const tr_sync own = {.begin_step = s_begin_step, .grads_ready = s_grads_ready,
                         .end_step = s_end_step, .params_ready = s_params_ready,
                         .finish = s_finish, .abandon = s_abandon, .destroy = s_destroy};
    zps_status st = tr_sync_local_extend(&a->local, env, &own);
    if (st != ZPS_OK) {
        free(a);
        return st;
    }
    tr_buckets_init(&a->buckets, env, TR_NCCL_BUCKETS, TR_NCCL_BUCKET_MIN);
    /* the segment carries NCCL's id and the stop flags (the starting values go by NCCL) */
    st = tr_allreduce_new(env->cfg->job, env->id, env->n_trainers, env->nparams, NULL, &a->ar);
    int shared = 0;
    if (st == ZPS_OK)
        st = tr_nccl_gpus_shared(a->ar, &shared);
    if (st == ZPS_OK && shared) {
        zps_log(ZPS_WARN, "trainer", "all-reduce rank %d of %d: trainers of this node share a "
                "GPU, which NCCL cannot run on: the gradients are summed through pinned host "
                "memory (one trainer per GPU: --gpu N, or zps-launch --gpus)", env->id,
                env->n_trainers);
        s_destroy(&a->local.base);
        return ZPS_OK;
    }
    if (st == ZPS_OK)
        st = tr_nccl_new(a->ar, k_device_gpu(), &a->nc);
    if (st == ZPS_OK)
        st = s_broadcast_values(a);
    if (st != ZPS_OK) {
        s_destroy(&a->local.base);
        return st;
    }
    zps_log(ZPS_INFO, "trainer", "all-reduce rank %d of %d over NCCL on GPU %d (buckets of %zu "
            "floats)", env->id, env->n_trainers, k_device_gpu(), a->buckets.floats);
    *out = &a->local.base;
    return ZPS_OK;
}
