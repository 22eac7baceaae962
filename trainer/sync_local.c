/* sync_local.c — --mode local: no peers; the optimizer runs in the trainer (see sync.h).
 *
 * k_optim_apply runs the servers' own update (common/optim_math.h) on the model's back-end,
 * so a local run and a PS run apply the same arithmetic to the same mean gradient (the
 * equivalence tests depend on it). The all-reduce
 * back-end is this one plus a sum over the node's trainers before the update.
 */
#include "trainer/sync.h"

#include <stdlib.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"
#include "ps/optim.h"

void tr_sync_local_begin(tr_sync_local *l, int64_t step)
{
    l->step = step;
    ps_optim_prepare(l->opt, (uint64_t)step, &l->st);
}

static zps_status s_begin_step(tr_sync *s, int64_t step, int *stop)
{
    (void)stop;
    tr_sync_local_begin((tr_sync_local *)s, step);
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
    return tr_sync_local_apply((tr_sync_local *)s, rec);
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

/* The optimizer's slots in the back-end's memory, at their initial values. */
static zps_status s_slots(tr_sync_local *l)
{
    int ns = ps_optim_slots(l->opt->kind);
    for (int s = 0; s < ns; s++) {
        l->slots[s] = l->be->alloc(l->n * sizeof(float));
        if (!l->slots[s]) {
            zps_log(ZPS_ERROR, "trainer", "cannot allocate the optimizer's state (%zu floats "
                    "on the %s back-end)", l->n, l->be->name);
            return ZPS_ERR_NOMEM;
        }
        ZPS_TRY(k_fill(l->be, l->n, ps_optim_slot_init(l->opt, s), l->slots[s]));
    }
    return ZPS_OK;
}

zps_status tr_sync_local_init(tr_sync_local *l, const tr_sync_env *env)
{
    *l = (tr_sync_local){.opt = &env->cfg->opt, .params = env->params, .grads = env->grads,
                         .n = env->nparams};
    l->be = env->be ? env->be : env->model ? nn_model_backend(env->model) : k_backend_cpu();
    l->base = (tr_sync){.begin_step = s_begin_step, .params_ready = s_nothing,
                        .grads_ready = s_grads_ready, .end_step = s_end_step,
                        .finish = s_finish, .leave = s_nothing, .destroy = s_destroy,
                        .redo_from = -1};
    tr_sync_local_begin(l, 0);
    zps_status st = s_slots(l);
    if (st != ZPS_OK)
        tr_sync_local_free(l);
    return st;
}

zps_status tr_sync_local_extend(tr_sync_local *l, const tr_sync_env *env, const tr_sync *own)
{
    ZPS_TRY(tr_sync_local_init(l, env));
    l->base.begin_step = own->begin_step;
    l->base.grads_ready = own->grads_ready;
    l->base.end_step = own->end_step;
    l->base.destroy = own->destroy;
    if (own->params_ready)
        l->base.params_ready = own->params_ready;
    if (own->finish)
        l->base.finish = own->finish;
    if (own->abandon)
        l->base.abandon = own->abandon;
    return ZPS_OK;
}

zps_status tr_sync_local_apply(tr_sync_local *l, tr_step_record *rec)
{
    rec->lr = ps_optim_lr(l->opt, (uint64_t)l->step);
    return k_optim_apply(l->be, &l->st, l->n, l->params, l->slots[0], l->slots[1], l->grads);
}

void tr_sync_local_free(tr_sync_local *l)
{
    if (l->be) {
        l->be->free(l->slots[0]);
        l->be->free(l->slots[1]);
    }
    l->slots[0] = l->slots[1] = NULL;
}

zps_status tr_sync_local_new(const tr_sync_env *env, tr_sync **out)
{
    *out = NULL;
    tr_sync_local *l = zps_xmalloc(sizeof *l);
    zps_status st = tr_sync_local_init(l, env);
    if (st != ZPS_OK) {
        free(l);
        return st;
    }
    *out = &l->base;
    return ZPS_OK;
}
