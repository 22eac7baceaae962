/* optim.c — see optim.h. The inner loops are plain float loops the compiler vectorises;
 * keep the operation order as documented, tests compare bits. */
#include "ps/optim.h"

#include "common/simd.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static const char *const s_kind_names[] = {"sgd", "momentum", "rmsprop", "adam", "adagrad"};
static const char *const s_sched_names[] = {"constant", "exponential", "cosine"};

void ps_optim_default(ps_optim_config *c)
{
    memset(c, 0, sizeof *c);
    c->kind = PS_OPT_SGD;
    c->lr = 0.01;
    c->momentum = 0.9;
    c->decay = 0.9;
    c->epsilon = 1e-8;
    c->beta1 = 0.9;
    c->beta2 = 0.999;
    c->initial_accumulator = 0.1;
    c->sched = PS_SCHED_CONSTANT;
    c->decay_rate = 1.0;
    c->decay_steps = 1;
    c->total_steps = 1;
}

zps_status ps_optim_kind_parse(const char *s, ps_optim_kind *out)
{
    for (int i = 0; i < 5; i++)
        if (!strcmp(s, s_kind_names[i])) {
            *out = (ps_optim_kind)i;
            return ZPS_OK;
        }
    return ZPS_ERR_INVALID;
}

const char *ps_optim_kind_name(ps_optim_kind k)
{
    return (unsigned)k < 5 ? s_kind_names[k] : "?";
}

#define S_BAD(...)                                                                     \
    do {                                                                               \
        if (why)                                                                       \
            snprintf(why, why_len, __VA_ARGS__);                                       \
        return ZPS_ERR_INVALID;                                                        \
    } while (0)

zps_status ps_optim_validate(const ps_optim_config *c, char *why, size_t why_len)
{
    if ((unsigned)c->kind > PS_OPT_ADAGRAD)
        S_BAD("unknown optimizer %d", (int)c->kind);
    if (!isfinite(c->lr) || c->lr < 0)
        S_BAD("learning rate %g must be finite and >= 0", c->lr);
    if (!isfinite(c->weight_decay) || c->weight_decay < 0)
        S_BAD("weight_decay %g must be finite and >= 0", c->weight_decay);
    if ((c->kind == PS_OPT_MOMENTUM || c->kind == PS_OPT_RMSPROP) &&
        (!(c->momentum >= 0) || !(c->momentum < 1)))
        S_BAD("momentum %g must be in [0, 1)", c->momentum);
    if (c->kind == PS_OPT_RMSPROP && (!(c->decay >= 0) || !(c->decay < 1)))
        S_BAD("rmsprop decay %g must be in [0, 1)", c->decay);
    if ((c->kind == PS_OPT_RMSPROP || c->kind == PS_OPT_ADAM || c->kind == PS_OPT_ADAGRAD) &&
        (!isfinite(c->epsilon) || !(c->epsilon > 0)))
        S_BAD("epsilon %g must be > 0", c->epsilon);
    if (c->kind == PS_OPT_ADAM && (!(c->beta1 >= 0) || !(c->beta1 < 1) || !(c->beta2 >= 0) ||
                                   !(c->beta2 < 1)))
        S_BAD("adam betas %g, %g must be in [0, 1)", c->beta1, c->beta2);
    if (c->kind == PS_OPT_ADAGRAD &&
        (!isfinite(c->initial_accumulator) || c->initial_accumulator < 0))
        S_BAD("initial_accumulator %g must be >= 0", c->initial_accumulator);
    if ((unsigned)c->sched > PS_SCHED_COSINE)
        S_BAD("unknown schedule %d", (int)c->sched);
    if (c->sched == PS_SCHED_EXPONENTIAL &&
        (c->decay_steps < 1 || !isfinite(c->decay_rate) || !(c->decay_rate > 0)))
        S_BAD("exponential schedule needs decay_steps >= 1 and decay_rate > 0");
    if (c->sched == PS_SCHED_COSINE &&
        (c->total_steps < 1 || !isfinite(c->min_lr) || c->min_lr < 0))
        S_BAD("cosine schedule needs total_steps >= 1 and min_lr >= 0");
    return ZPS_OK;
}

int ps_optim_slots(ps_optim_kind k)
{
    switch (k) {
    case PS_OPT_MOMENTUM:
    case PS_OPT_ADAGRAD:
        return 1;
    case PS_OPT_RMSPROP:
    case PS_OPT_ADAM:
        return 2;
    default:
        return 0;
    }
}

float ps_optim_slot_init(const ps_optim_config *c, int slot)
{
    if (c->kind == PS_OPT_RMSPROP && slot == 0)
        return 1.0f;
    if (c->kind == PS_OPT_ADAGRAD)
        return (float)c->initial_accumulator;
    return 0.0f;
}

double ps_optim_lr(const ps_optim_config *c, uint64_t step)
{
    if (c->warmup_steps && step < c->warmup_steps)
        return c->lr * (double)(step + 1) / (double)c->warmup_steps;
    uint64_t s = step - c->warmup_steps;
    switch (c->sched) {
    case PS_SCHED_EXPONENTIAL: {
        double e = (double)s / (double)c->decay_steps;
        if (c->staircase)
            e = floor(e);
        return c->lr * pow(c->decay_rate, e);
    }
    case PS_SCHED_COSINE: {
        double t = (double)(s < c->total_steps ? s : c->total_steps) / (double)c->total_steps;
        return c->min_lr + (c->lr - c->min_lr) * 0.5 * (1.0 + cos(M_PI * t));
    }
    default:
        return c->lr;
    }
}

void ps_optim_prepare(const ps_optim_config *c, uint64_t step, zps_optim_step *s)
{
    *s = (zps_optim_step){.kind = (int)c->kind, .nesterov = c->nesterov};
    s->lr = (float)ps_optim_lr(c, step);
    s->wd = (float)c->weight_decay;
    s->mu = (float)c->momentum;
    s->rho = (float)c->decay, s->one_m_rho = (float)(1.0 - c->decay);
    s->eps = (float)c->epsilon;
    s->b1 = (float)c->beta1, s->b2 = (float)c->beta2;
    s->ob1 = (float)(1.0 - c->beta1), s->ob2 = (float)(1.0 - c->beta2);
    if (c->kind == PS_OPT_ADAM) {
        const double t = (double)step + 1.0;
        s->lr_t = (float)(ps_optim_lr(c, step) * sqrt(1.0 - pow(c->beta2, t)) /
                          (1.0 - pow(c->beta1, t)));
    }
}

void ps_optim_apply(const ps_optim_config *c, uint64_t step, float *w, float *const *slots,
                    const float *g, size_t n)
{
    zps_optim_step s;
    ps_optim_prepare(c, step, &s);
    int k = ps_optim_slots(c->kind);
    zps_optim_apply_host(&s, n, w, k > 0 ? slots[0] : NULL, k > 1 ? slots[1] : NULL, g);
}

zps_status ps_optim_from_proto(const Zps__OptimizerConfig *m, ps_optim_config *c, char *why,
                               size_t why_len)
{
    ps_optim_default(c);
    if (!m)
        S_BAD("no optimizer config");
    if (!m->name || ps_optim_kind_parse(m->name, &c->kind) != ZPS_OK)
        S_BAD("unknown optimizer '%.40s' (sgd|momentum|rmsprop|adam|adagrad)",
              m->name ? m->name : "");
    c->lr = m->lr;
    c->momentum = m->momentum;
    c->nesterov = m->nesterov;
    c->decay = m->decay;
    c->epsilon = m->epsilon;
    c->beta1 = m->beta1;
    c->beta2 = m->beta2;
    c->weight_decay = m->weight_decay;
    c->initial_accumulator = m->initial_accumulator;
    if (m->schedule) {
        const Zps__Schedule *s = m->schedule;
        const char *k = s->kind && *s->kind ? s->kind : "constant";
        int found = 0;
        for (int i = 0; i < 3; i++)
            if (!strcmp(k, s_sched_names[i])) {
                c->sched = (ps_sched_kind)i;
                found = 1;
            }
        if (!found)
            S_BAD("unknown schedule '%.40s' (constant|exponential|cosine)", k);
        c->decay_rate = s->decay_rate;
        c->decay_steps = s->decay_steps;
        c->staircase = s->staircase;
        c->total_steps = s->total_steps;
        c->min_lr = s->min_lr;
        c->warmup_steps = s->warmup_steps;
        if (c->sched != PS_SCHED_EXPONENTIAL) {
            c->decay_rate = c->decay_rate ? c->decay_rate : 1.0;
            c->decay_steps = c->decay_steps ? c->decay_steps : 1;
        }
        if (c->sched != PS_SCHED_COSINE)
            c->total_steps = c->total_steps ? c->total_steps : 1;
    }
    return ps_optim_validate(c, why, why_len);
}

void ps_optim_to_proto(const ps_optim_config *c, Zps__OptimizerConfig *m, Zps__Schedule *sched)
{
    zps__optimizer_config__init(m);
    zps__schedule__init(sched);
    m->name = (char *)ps_optim_kind_name(c->kind);
    m->lr = c->lr;
    m->momentum = c->momentum;
    m->nesterov = c->nesterov;
    m->decay = c->decay;
    m->epsilon = c->epsilon;
    m->beta1 = c->beta1;
    m->beta2 = c->beta2;
    m->weight_decay = c->weight_decay;
    m->initial_accumulator = c->initial_accumulator;
    sched->kind = (char *)s_sched_names[(unsigned)c->sched <= 2 ? c->sched : 0];
    sched->decay_rate = c->decay_rate;
    sched->decay_steps = c->decay_steps;
    sched->staircase = c->staircase;
    sched->total_steps = c->total_steps;
    sched->min_lr = c->min_lr;
    sched->warmup_steps = c->warmup_steps;
    m->schedule = sched;
}

int ps_optim_equal(const ps_optim_config *a, const ps_optim_config *b)
{
    return a->kind == b->kind && a->lr == b->lr && a->momentum == b->momentum &&
           !a->nesterov == !b->nesterov && a->decay == b->decay && a->epsilon == b->epsilon &&
           a->beta1 == b->beta1 && a->beta2 == b->beta2 && a->weight_decay == b->weight_decay &&
           a->initial_accumulator == b->initial_accumulator && a->sched == b->sched &&
           a->decay_rate == b->decay_rate && a->decay_steps == b->decay_steps &&
           !a->staircase == !b->staircase && a->total_steps == b->total_steps &&
           a->min_lr == b->min_lr && a->warmup_steps == b->warmup_steps;
}
