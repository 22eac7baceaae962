/* sync_buckets.c — what the all-reduce back-ends share (sync.h, tr_buckets): the buckets
 * backward's reports gather into, and rank 0's stop decision at the start of a step.
 *
 * sync_allreduce.c (shared memory, on its communication thread), sync_nccl.c (NCCL on the
 * GPU), sync_node.c and sync_node_dev.c (a node's sum, then its leader's pushes) send the
 * gradient in buckets of consecutive variables, last first, as backward makes them final.
 * The edges depend only on the model (its variables and the hook order) and the bucket
 * size, so every rank cuts the same buckets and the collective calls match.
 */
#include "trainer/sync.h"

#include "common/check.h"
#include "common/log.h"
#include "trainer/allreduce.h"

void tr_buckets_init(tr_buckets *b, const tr_sync_env *env, size_t per_step, size_t min)
{
    *b = (tr_buckets){.vars = env->vars, .nvars = env->nvars, .n = env->nparams};
    b->floats = env->nparams / per_step > min ? env->nparams / per_step : min;
    if (env->bucket_floats)
        b->floats = env->bucket_floats;
    tr_buckets_reset(b);
}

void tr_buckets_reset(tr_buckets *b)
{
    b->lo = b->hi = b->n;
    b->vlo = b->vhi = b->nvars;
}

zps_status tr_sync_any_stop(struct tr_allreduce *ar, int *stop)
{
    float wishes = *stop ? 1.0f : 0.0f;
    ZPS_TRY(tr_allreduce_sum(ar, &wishes, 1, 0));
    if (!*stop && wishes > 0) /* another rank's: this one's own reason stays as it was */
        *stop = 1;
    return ZPS_OK;
}

/* [lo, hi) leaves with the variables from vlo on; the next bucket starts below it. */
static int s_take(tr_buckets *b, size_t lo, size_t vlo, tr_bucket *out)
{
    *out = (tr_bucket){.lo = lo, .hi = b->hi, .first = vlo, .nv = b->vhi - vlo};
    b->hi = b->lo = lo;
    b->vhi = b->vlo = vlo;
    return out->hi > lo;
}

int tr_buckets_report(tr_buckets *b, size_t first, size_t n, tr_bucket *out)
{
    if (!b->vars || n == 0)
        return 0; /* without the variables' places everything leaves at the end */
    const nn_var *top = &b->vars[first + n - 1];
    if (first + n > b->nvars || top->offset + top->count > b->lo) {
        zps_log(ZPS_ERROR, "allreduce", "variables %zu..%zu reported out of order", first,
                first + n - 1);
        return -1;
    }
    b->lo = b->vars[first].offset;
    b->vlo = first;
    return b->hi - b->lo >= b->floats ? s_take(b, b->lo, first, out) : 0;
}

int tr_buckets_rest(tr_buckets *b, tr_bucket *out) { return s_take(b, 0, 0, out); }
