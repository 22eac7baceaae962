/* sync_local.c — --mode local: no peers; the optimizer runs in the trainer (see sync.h).
 *
 * Also home of tr_local_optim, the trainer-side optimizer the all-reduce back-end shares:
 * ps_optim_apply is the servers' own update code, so a local run and a PS run apply the same
 * arithmetic to the same mean gradient (the equivalence tests depend on it).
 */
#include "trainer/sync.h"

#include <stdlib.h>

#include "common/mem.h"
#include "ps/optim.h"

void tr_local_optim_init(tr_local_optim *o, const tr_sync_env *env)
{
    *o = (tr_local_optim){.opt = &env->cfg->opt, .params = env->params, .grads = env->grads,
                          .n = env->nparams};
    int ns = ps_optim_slots(o->opt->kind);
    for (int s = 0; s < ns; s++) {
        o->slots[s] = zps_xaligned(64, o->n * sizeof(float));
        float v = ps_optim_slot_init(o->opt, s);
        for (size_t i = 0; i < o->n; i++)
            o->slots[s][i] = v;
    }
}

void tr_local_optim_step(tr_local_optim *o, int64_t step, tr_step_record *rec)
{
    rec->lr = ps_optim_lr(o->opt, (uint64_t)step);
    ps_optim_apply(o->opt, (uint64_t)step, o->params, o->slots, o->grads, o->n);
}

void tr_local_optim_free(tr_local_optim *o)
{
    zps_aligned_free(o->slots[0]);
    zps_aligned_free(o->slots[1]);
    o->slots[0] = o->slots[1] = NULL;
}

typedef struct s_local {
    tr_sync base;             // first: the tr_sync the loop holds
    tr_local_optim optim;
    int64_t step;             // the step begun last
} s_local;

static zps_status s_begin_step(tr_sync *s, int64_t step, int *stop)
{
    (void)stop;
    ((s_local *)s)->step = step;
    return ZPS_OK;
}

zps_status tr_sync_nothing(tr_sync *s)
{
    (void)s;
    return ZPS_OK;
}

zps_status tr_sync_grads_stay(tr_sync *s, size_t first, size_t n)
{
    (void)s;
    (void)first;
    (void)n;
    return ZPS_OK;
}

static zps_status s_end_step(tr_sync *s, tr_step_record *rec)
{
    s_local *l = (s_local *)s;
    tr_local_optim_step(&l->optim, l->step, rec);
    return ZPS_OK;
}

zps_status tr_sync_values_stay(tr_sync *s, int *fresh)
{
    (void)s;
    *fresh = 0;
    return ZPS_OK;
}

static void s_destroy(tr_sync *s)
{
    s_local *l = (s_local *)s;
    tr_local_optim_free(&l->optim);
    free(l);
}

zps_status tr_sync_local_new(const tr_sync_env *env, tr_sync **out)
{
    s_local *l = zps_xcalloc(1, sizeof *l);
    l->base = (tr_sync){.begin_step = s_begin_step, .params_ready = tr_sync_nothing,
                        .grads_ready = tr_sync_grads_stay, .end_step = s_end_step,
                        .finish = tr_sync_values_stay, .leave = tr_sync_nothing,
                        .destroy = s_destroy};
    tr_local_optim_init(&l->optim, env);
    *out = &l->base;
    return ZPS_OK;
}
