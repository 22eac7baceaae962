/* zps.c — the stable C API of libzps.so (include/zps/zps.h) over the PS client (ps/client.h).
 *
 * Only this file's ZPS_API functions leave the shared library (api/libzps.map; everything is
 * compiled -fvisibility=hidden). The layer owns what the public types hide: the sharding plan
 * (built at register from the caller's names and counts, as the C trainers build theirs) and
 * the translation of plain option structs into the internal ones.
 *
 * Logging: the client's lines go to stderr as zps's do (info by default; $ZPS_LOG=warn|error|off
 * read at each zps_connect).
 *
 * Invariants:
 * - A handle's plan is NULL until zps_register succeeded; range operations check the range
 *   against it and answer ZPS_ERR_INVALID (with a message) instead of the internal asserts,
 *   because a binding (Python) cannot recover from an abort.
 * - Range buffers hold only the named variables: the client indexes the flat model buffer
 *   by flat offset, so the layer hands it the buffer's address minus the range's offset
 *   (computed in uintptr_t; the client reads or writes only inside the range).
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/version.h"
#include "zps/zps.h"
#include "ps/client.h"
#include "ps/plan.h"

struct zps_client {
    ps_client *c;
    ps_plan *plan; // NULL until registered
    char err[512]; // the layer's own refusals (bad range, not registered)
};

/* The reason zps_connect failed, for zps_last_error(NULL): per thread, as clients are. */
static _Thread_local char s_connect_err[512];

const char *zps_library_version(void) { return ZPS_VERSION; }
void zps_free(void *p) { free(p); }

void zps_options_default(zps_options *o)
{
    ps_client_opts d;
    ps_client_opts_default(&d);
    memset(o, 0, sizeof *o);
    o->timeout_ms = d.timeout_ms;
    o->max_retries = d.max_retries;
    o->backoff_ms = d.backoff_ms;
    o->heartbeat_ms = d.heartbeat_ms;
    o->heartbeat_thread = d.heartbeat_thread;
    o->streams = d.streams;
    o->msg_bytes = d.msg_bytes;
    o->push_dtype = ZPS_DTYPE_F32;
}

void zps_optimizer_default(zps_optimizer *o)
{
    ps_optim_config d;
    ps_optim_default(&d);
    *o = (zps_optimizer){
        .kind = (int)d.kind, .lr = d.lr, .momentum = d.momentum, .nesterov = d.nesterov,
        .decay = d.decay, .epsilon = d.epsilon, .beta1 = d.beta1, .beta2 = d.beta2,
        .weight_decay = d.weight_decay, .initial_accumulator = d.initial_accumulator,
        .sched = (int)d.sched, .decay_rate = d.decay_rate, .decay_steps = d.decay_steps,
        .staircase = d.staircase, .total_steps = d.total_steps, .min_lr = d.min_lr,
        .warmup_steps = d.warmup_steps,
    };
}

static void s_optim_in(const zps_optimizer *o, ps_optim_config *d)
{
    *d = (ps_optim_config){
        .kind = (ps_optim_kind)o->kind, .lr = o->lr, .momentum = o->momentum,
        .nesterov = o->nesterov, .decay = o->decay, .epsilon = o->epsilon, .beta1 = o->beta1,
        .beta2 = o->beta2, .weight_decay = o->weight_decay,
        .initial_accumulator = o->initial_accumulator, .sched = (ps_sched_kind)o->sched,
        .decay_rate = o->decay_rate, .decay_steps = o->decay_steps, .staircase = o->staircase,
        .total_steps = o->total_steps, .min_lr = o->min_lr, .warmup_steps = o->warmup_steps,
    };
}

static zps_status s_refuse(zps_client *c, zps_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    return st;
}

/* The internal options from o: CURVE keys read from their files, dtype checked. */
static zps_status s_opts_in(const zps_options *o, ps_client_opts *d)
{
    ps_client_opts_default(d);
    if (!o)
        return ZPS_OK;
    d->timeout_ms = o->timeout_ms;
    d->max_retries = o->max_retries;
    d->backoff_ms = o->backoff_ms;
    d->heartbeat_ms = o->heartbeat_ms;
    d->heartbeat_thread = o->heartbeat_thread;
    d->streams = o->streams;
    d->msg_bytes = o->msg_bytes;
    if (o->push_dtype != ZPS_DTYPE_F32 && o->push_dtype != ZPS_DTYPE_BF16) {
        snprintf(s_connect_err, sizeof s_connect_err, "push_dtype %d is neither "
                 "ZPS_DTYPE_F32 nor ZPS_DTYPE_BF16", o->push_dtype);
        return ZPS_ERR_INVALID;
    }
    d->push_dtype = o->push_dtype == ZPS_DTYPE_BF16 ? PS_DTYPE_BF16 : PS_DTYPE_F32;
    if (!o->curve_server_key_file && !o->curve_key_file)
        return ZPS_OK;
    if (!o->curve_server_key_file || !o->curve_key_file) {
        snprintf(s_connect_err, sizeof s_connect_err,
                 "CURVE wants both curve_server_key_file and curve_key_file");
        return ZPS_ERR_INVALID;
    }
    return ps_client_opts_curve(d, o->curve_server_key_file, o->curve_key_file, s_connect_err,
                                sizeof s_connect_err);
}

zps_status zps_connect(const char *const *servers, int n_servers, uint32_t trainer_id,
                       const zps_options *opts, zps_client **out)
{
    *out = NULL;
    s_connect_err[0] = '\0';
    /* the library's log lines (stderr) name the trainer; ZPS_LOG sets their level */
    zps_log_init("trainer", (int)trainer_id);
    if (!servers || n_servers < 1) {
        snprintf(s_connect_err, sizeof s_connect_err, "no servers given");
        return ZPS_ERR_INVALID;
    }
    ps_client_opts o;
    zps_status st = s_opts_in(opts, &o);
    ps_client *pc = NULL;
    if (st == ZPS_OK)
        st = ps_client_new(servers, n_servers, trainer_id, &o, &pc);
    explicit_bzero(o.curve_secret_key, sizeof o.curve_secret_key);
    if (st != ZPS_OK) {
        if (!s_connect_err[0])
            snprintf(s_connect_err, sizeof s_connect_err, "cannot connect to the %d servers: %s",
                     n_servers, zps_strerror(st));
        return st;
    }
    zps_client *c = calloc(1, sizeof *c);
    if (!c) {
        ps_client_destroy(&pc);
        snprintf(s_connect_err, sizeof s_connect_err, "out of memory");
        return ZPS_ERR_NOMEM;
    }
    c->c = pc;
    *out = c;
    return ZPS_OK;
}

void zps_close(zps_client **pc)
{
    if (!pc || !*pc)
        return;
    ps_client_destroy(&(*pc)->c);
    ps_plan_destroy(&(*pc)->plan);
    free(*pc);
    *pc = NULL;
}

zps_status zps_register(zps_client *c, const char *const *names, const uint64_t *counts,
                        int n_vars, uint64_t chunk_bytes, const zps_job *job,
                        zps_job *effective)
{
    c->err[0] = '\0';
    if (c->plan)
        return s_refuse(c, ZPS_ERR_INVALID, "already registered");
    if (n_vars < 1 || !names || !counts)
        return s_refuse(c, ZPS_ERR_INVALID, "no variables");
    ps_var *vars = calloc((size_t)n_vars, sizeof *vars);
    if (!vars)
        return s_refuse(c, ZPS_ERR_NOMEM, "out of memory");
    for (int i = 0; i < n_vars; i++)
        vars[i] = (ps_var){.name = names[i], .count = counts[i]};
    ps_plan *plan = NULL;
    zps_status st = ps_plan_new(vars, n_vars, ps_client_num_servers(c->c), chunk_bytes, &plan);
    free(vars);
    if (st != ZPS_OK)
        return s_refuse(c, st, "bad variable list (an empty name list, a count of 0, or "
                        "chunk_bytes < 4)");
    ps_job want = {0}, got = {0};
    if (job)
        want = (ps_job){.mode = (ps_mode)job->mode, .num_trainers = job->num_trainers,
                        .replicas_to_aggregate = job->replicas_to_aggregate,
                        .staleness = job->staleness};
    st = ps_client_register(c->c, plan, job ? &want : NULL, &got);
    if (st != ZPS_OK) {
        ps_plan_destroy(&plan);
        return st;
    }
    c->plan = plan;
    if (effective)
        *effective = (zps_job){.mode = (int)got.mode, .num_trainers = got.num_trainers,
                               .replicas_to_aggregate = got.replicas_to_aggregate,
                               .staleness = got.staleness};
    return ZPS_OK;
}

int zps_num_vars(const zps_client *c) { return c->plan ? c->plan->n_vars : 0; }
uint64_t zps_num_elements(const zps_client *c) { return c->plan ? c->plan->total : 0; }

zps_status zps_init(zps_client *c, const float *values, const zps_optimizer *opt, int *first)
{
    c->err[0] = '\0';
    if (!c->plan)
        return s_refuse(c, ZPS_ERR_INVALID, "zps_init before zps_register");
    zps_optimizer dflt;
    if (!opt) {
        zps_optimizer_default(&dflt);
        opt = &dflt;
    }
    ps_optim_config o;
    s_optim_in(opt, &o);
    char why[256];
    if (ps_optim_validate(&o, why, sizeof why) != ZPS_OK)
        return s_refuse(c, ZPS_ERR_INVALID, "optimizer: %s", why);
    return ps_client_init(c->c, values, &o, first);
}

/* The flat-buffer base the client indexes for a range whose first variable sits at data. */
static zps_status s_range(zps_client *c, int first_var, int n_vars, const void *data,
                          uintptr_t *base)
{
    c->err[0] = '\0';
    if (!c->plan)
        return s_refuse(c, ZPS_ERR_INVALID, "push or pull before zps_register");
    if (first_var < 0 || n_vars < 1 || first_var > c->plan->n_vars - n_vars)
        return s_refuse(c, ZPS_ERR_INVALID, "variables [%d, %d) outside the model's %d",
                        first_var, first_var + n_vars, c->plan->n_vars);
    if (!data)
        return s_refuse(c, ZPS_ERR_INVALID, "NULL buffer");
    *base = (uintptr_t)data - (uintptr_t)(c->plan->var_offset[first_var] * sizeof(float));
    return ZPS_OK;
}

zps_status zps_push(zps_client *c, int first_var, int n_vars, const float *grads, int64_t step,
                    zps_ticket *t)
{
    uintptr_t g;
    zps_status st = s_range(c, first_var, n_vars, grads, &g);
    return st ? st : ps_client_push(c->c, first_var, n_vars, (const float *)g, step, t);
}

zps_status zps_pull(zps_client *c, int first_var, int n_vars, float *values, int64_t step,
                    zps_ticket *t)
{
    uintptr_t v;
    zps_status st = s_range(c, first_var, n_vars, values, &v);
    return st ? st : ps_client_pull(c->c, first_var, n_vars, (float *)v, step, t);
}

zps_status zps_pushpull(zps_client *c, int first_var, int n_vars, const float *grads,
                        float *values, int64_t step, zps_ticket *t)
{
    uintptr_t g, v;
    zps_status st = s_range(c, first_var, n_vars, grads, &g);
    if (st == ZPS_OK)
        st = s_range(c, first_var, n_vars, values, &v);
    return st ? st
              : ps_client_pushpull(c->c, first_var, n_vars, (const float *)g, (float *)v, step, t);
}

zps_status zps_wait(zps_client *c, zps_ticket t, uint64_t *version)
{
    c->err[0] = '\0';
    uint64_t v = 0;
    zps_status st = ps_client_wait_version(c->c, t, &v);
    if (version)
        *version = v;
    return st;
}

zps_status zps_wait_all(zps_client *c)
{
    c->err[0] = '\0';
    return ps_client_wait_all(c->c);
}

zps_status zps_poll(zps_client *c, zps_ticket t, int timeout_ms, int *done)
{
    c->err[0] = '\0';
    return ps_client_poll(c->c, t, timeout_ms, done);
}

zps_status zps_barrier(zps_client *c)
{
    c->err[0] = '\0';
    return ps_client_barrier(c->c);
}

zps_status zps_stats(zps_client *c, int server, char **json)
{
    c->err[0] = '\0';
    *json = NULL;
    if (server < 0 || server >= ps_client_num_servers(c->c))
        return s_refuse(c, ZPS_ERR_INVALID, "server %d outside 0..%d", server,
                        ps_client_num_servers(c->c) - 1);
    return ps_client_stats(c->c, server, json);
}

zps_status zps_leave(zps_client *c)
{
    c->err[0] = '\0';
    return ps_client_leave(c->c);
}

const char *zps_last_error(const zps_client *c)
{
    if (!c)
        return s_connect_err;
    return c->err[0] ? c->err : ps_client_last_error(c->c);
}
