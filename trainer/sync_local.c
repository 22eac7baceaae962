/* sync_local.c — --mode local: no peers; the optimizer runs in the trainer (see sync.h).
 *
 * ps_optim_apply is the servers' own update code, so a local run and a PS run apply the same
 * arithmetic to the same mean gradient (the equivalence tests depend on it). The all-reduce
 * back-end is this one plus a sum over the node's trainers before the update.
 */
#include "trainer/sync.h"

#include <stdlib.h>

#include "common/mem.h"
#include "ps/optim.h"

static zps_status s_begin_step(tr_sync *s, int64_t step, int *stop)
{
    (void)stop;
    ((tr_sync_local *)s)->step = step;
    return ZPS_OK;
}

/* The values never change outside end_step: nothing to wait for, nothing to say at the end. */
static zps_status s_nothing(tr_sync *s)
{
    (void)s;
    return ZPS_OK;
}

/* No gradient leaves before end_step. */
static zps_status s_grads_ready(tr_sync *s, size_t first, size_t n)
{
    (void)s;
    (void)first;
    (void)n;
    return ZPS_OK;
}

static zps_status s_end_step(tr_sync *s, tr_step_record *rec)
{
    tr_sync_local_apply((tr_sync_local *)s, rec);
    return ZPS_OK;
}

static zps_status s_finish(tr_sync *s, int *fresh)
{
    (void)s;
    *fresh = 0;
    return ZPS_OK;
}

static void s_destroy(tr_sync *s)
{
    tr_sync_local_free((tr_sync_local *)s);
    free(s);
}

void tr_sync_local_init(tr_sync_local *l, const tr_sync_env *env)
{
    *l = (tr_sync_local){.opt = &env->cfg->opt, .params = env->params, .grads = env->grads,
                         .n = env->nparams};
    l->base = (tr_sync){.begin_step = s_begin_step, .params_ready = s_nothing,
                        .grads_ready = s_grads_ready, .end_step = s_end_step,
                        .finish = s_finish, .leave = s_nothing, .destroy = s_destroy,
                        .redo_from = -1};
    int ns = ps_optim_slots(l->opt->kind);
    for (int s = 0; s < ns; s++) {
        l->slots[s] = zps_xaligned(64, l->n * sizeof(float));
        float v = ps_optim_slot_init(l->opt, s);
        for (size_t i = 0; i < l->n; i++)
            l->slots[s][i] = v;
    }
}

void tr_sync_local_apply(tr_sync_local *l, tr_step_record *rec)
{
    rec->lr = ps_optim_lr(l->opt, (uint64_t)l->step);
    ps_optim_apply(l->opt, (uint64_t)l->step, l->params, l->slots, l->grads, l->n);
}

void tr_sync_local_free(tr_sync_local *l)
{
    zps_aligned_free(l->slots[0]);
    zps_aligned_free(l->slots[1]);
    l->slots[0] = l->slots[1] = NULL;
}

zps_status tr_sync_local_new(const tr_sync_env *env, tr_sync **out)
{
    tr_sync_local *l = zps_xmalloc(sizeof *l);
    tr_sync_local_init(l, env);
    *out = &l->base;
    return ZPS_OK;
}
