/* test_ps_sync.c — sync mode end to end: 3 trainer threads, 2 zps-server processes. After
 * every step the values each trainer pulls equal, bit for bit, a single-process reference
 * that applies the averaged gradient (summed in trainer-id order), for every optimizer.
 * Trainers push variable by variable, last first, so chunks fill from partial ranges.
 * Also: backup workers (replicas_to_aggregate 2 of 3) and a mode conflict at REGISTER. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mem.h"
#include "ps/client.h"
#include "ps/dtype.h"
#include "ps/optim.h"
#include "ps/plan.h"
#include "tests/ps_test_util.h"

#define NT 3
#define NS 2
#define STEPS 4

static const ps_var s_vars[] = {{"a", 1000}, {"b", 3}, {"c", 5000}, {"d", 17}, {"e", 2500}};
#define NV ((int)(sizeof s_vars / sizeof s_vars[0]))

typedef struct job {
    uint64_t seed;
    ps_optim_config opt;
    int streams;      // ps_client_opts.streams
    ps_dtype dtype;   // ps_client_opts.push_dtype
    ps_plan *plan;
    const char *uris[NS];
    float **ref;      // (STEPS + 1) x total reference values
    int mismatch[NT]; // first step whose pulled values differed (+1), 0 = none
    int fail[NT];     // zps_status of a failed call
    char err[NT][256];
} job;

/* Deterministic noise in [-1, 1) from (seed, trainer, step, i). */
static float s_noise(uint64_t seed, int t, int s, uint64_t i)
{
    uint64_t x = seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)(t + 1)) ^ ((uint64_t)s << 40) ^ (i * 0xD6E8FEB86659FD93ull);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (float)((double)(x >> 40) / (double)(1ull << 23)) - 1.0f;
}

static void s_grad(const job *j, int t, int s, const float *v, float *g)
{
    for (uint64_t i = 0; i < j->plan->total; i++)
        g[i] = 0.1f * v[i] + s_noise(j->seed, t, s, i);
}

static void s_reference(job *j)
{
    uint64_t n = j->plan->total;
    float *v = zps_xmalloc(n * 4), *g = zps_xmalloc(n * 4), *acc = zps_xmalloc(n * 4);
    float *slots[2] = {zps_xmalloc(n * 4), zps_xmalloc(n * 4)};
    uint16_t *wire = zps_xmalloc(n * 2);
    for (int k = 0; k < 2; k++)
        for (uint64_t i = 0; i < n; i++)
            slots[k][i] = ps_optim_slot_init(&j->opt, k);
    memcpy(v, j->ref[0], n * 4);
    for (int s = 0; s < STEPS; s++) {
        for (int t = 0; t < NT; t++) {
            s_grad(j, t, s, v, g);
            if (j->dtype == PS_DTYPE_BF16) { // the gradient as it went on the wire
                ps_f32_to_bf16(wire, g, n);
                ps_bf16_to_f32(g, wire, n);
            }
            for (uint64_t i = 0; i < n; i++)
                acc[i] = t ? acc[i] + g[i] : g[i];
        }
        for (uint64_t i = 0; i < n; i++)
            acc[i] = acc[i] / (float)NT;
        ps_optim_apply(&j->opt, (uint64_t)s, v, slots, acc, n);
        memcpy(j->ref[s + 1], v, n * 4);
    }
    free(v);
    free(g);
    free(acc);
    free(wire);
    free(slots[0]);
    free(slots[1]);
}

typedef struct targ {
    job *j;
    int t;
} targ;

#define T_FAIL(st_)                                                                   \
    do {                                                                              \
        j->fail[t] = (st_);                                                           \
        snprintf(j->err[t], sizeof j->err[t], "%s:%d %s: %s", __FILE__, __LINE__,     \
                 zps_status_name(st_), ps_client_last_error(c));                       \
        goto out;                                                                     \
    } while (0)

static void *s_trainer(void *arg)
{
    targ *a = arg;
    job *j = a->j;
    int t = a->t;
    uint64_t n = j->plan->total;
    float *v = zps_xmalloc(n * 4), *g = zps_xmalloc(n * 4);
    ps_client *c = NULL;
    ps_client_opts o;
    ps_client_opts_default(&o);
    o.timeout_ms = 20000;
    o.streams = j->streams;
    o.push_dtype = j->dtype;
    o.msg_bytes = 4096; // several messages per push: with 2 streams they interleave
    zps_status st = ps_client_new(j->uris, NS, (uint32_t)t, &o, &c);
    if (st != ZPS_OK) {
        j->fail[t] = st;
        free(v);
        free(g);
        return NULL;
    }
    ps_job jb = {PS_MODE_SYNC, NT, 0, 0};
    if ((st = ps_client_register(c, j->plan, &jb, NULL)) != ZPS_OK)
        T_FAIL(st);
    if (t == 0 && (st = ps_client_init(c, j->ref[0], &j->opt, NULL)) != ZPS_OK)
        T_FAIL(st);
    if ((st = ps_client_barrier(c)) != ZPS_OK)
        T_FAIL(st);
    ps_ticket tk;
    if ((st = ps_client_pull(c, 0, NV, v, 0, &tk)) != ZPS_OK || (st = ps_client_wait(c, tk)) != ZPS_OK)
        T_FAIL(st);
    for (int s = 0; s < STEPS; s++) {
        if (memcmp(v, j->ref[s], n * 4)) {
            j->mismatch[t] = s + 1;
            goto out;
        }
        s_grad(j, t, s, v, g);
        for (int var = NV - 1; var >= 0; var--)
            if ((st = ps_client_push(c, var, 1, g, s, &tk)) != ZPS_OK)
                T_FAIL(st);
        if ((st = ps_client_wait_all(c)) != ZPS_OK)
            T_FAIL(st);
        /* First layers first, as a trainer overlapping forward would. */
        ps_ticket p1, p2;
        if ((st = ps_client_pull(c, 0, 2, v, s + 1, &p1)) != ZPS_OK ||
            (st = ps_client_pull(c, 2, NV - 2, v, s + 1, &p2)) != ZPS_OK)
            T_FAIL(st);
        uint64_t ver = 0;
        if ((st = ps_client_wait_version(c, p1, &ver)) != ZPS_OK || (st = ps_client_wait(c, p2)) != ZPS_OK)
            T_FAIL(st);
        if (ver < (uint64_t)s + 1)
            T_FAIL(ZPS_ERR_INTERNAL);
    }
    if (memcmp(v, j->ref[STEPS], n * 4))
        j->mismatch[t] = STEPS + 1;
out:
    ps_client_destroy(&c);
    free(v);
    free(g);
    return NULL;
}

static void s_run_job(const ps_optim_config *opt, const char *name, int streams, ps_dtype dtype)
{
    job j;
    memset(&j, 0, sizeof j);
    j.seed = pst_seed();
    j.opt = *opt;
    j.streams = streams;
    j.dtype = dtype;
    cr_assert_eq(ps_plan_new(s_vars, NV, NS, 4096, &j.plan), ZPS_OK);
    uint64_t n = j.plan->total;
    j.ref = zps_xcalloc(STEPS + 1, sizeof *j.ref);
    for (int s = 0; s <= STEPS; s++)
        j.ref[s] = zps_xmalloc(n * 4);
    uint64_t r = j.seed;
    for (uint64_t i = 0; i < n; i++)
        j.ref[0][i] = pst_uniform(&r);
    s_reference(&j);
    pst_server srv[NS];
    const char *args[] = {"--mode", "sync", "--num-trainers", "3", NULL};
    for (int i = 0; i < NS; i++) {
        cr_assert_eq(pst_spawn(&srv[i], NULL, args), 0, "zps-server did not start");
        j.uris[i] = srv[i].uri;
    }
    pthread_t th[NT];
    targ ta[NT];
    for (int t = 0; t < NT; t++) {
        ta[t] = (targ){&j, t};
        pthread_create(&th[t], NULL, s_trainer, &ta[t]);
    }
    for (int t = 0; t < NT; t++)
        pthread_join(th[t], NULL);
    for (int i = 0; i < NS; i++)
        pst_kill(&srv[i], SIGTERM);
    for (int t = 0; t < NT; t++) {
        cr_expect_eq(j.fail[t], 0, "%s: trainer %d failed: %s (seed %llu)", name, t, j.err[t],
                     (unsigned long long)j.seed);
        cr_expect_eq(j.mismatch[t], 0, "%s: trainer %d: values differ from the reference at step %d (seed %llu)",
                     name, t, j.mismatch[t] - 1, (unsigned long long)j.seed);
    }
    for (int s = 0; s <= STEPS; s++)
        free(j.ref[s]);
    free(j.ref);
    ps_plan_destroy(&j.plan);
}

static void s_run(const ps_optim_config *opt, const char *name)
{
    s_run_job(opt, name, 1, PS_DTYPE_F32);
}

/* bfloat16 gradients (ps_client_opts.push_dtype): the server sums the widened gradients in
 * trainer-id order, so the run is as bit-reproducible as with f32. */
Test(it_ps_sync, bitwise_equal_to_reference_with_bf16_gradients, .timeout = 30)
{
    ps_optim_config o = pst_optim(PS_OPT_RMSPROP, 0.01);
    o.decay = 0.9;
    o.momentum = 0.9;
    o.epsilon = 1.0;
    s_run_job(&o, "rmsprop, bf16 gradients", 1, PS_DTYPE_BF16);
}

/* Two TCP connections per server: requests of one trainer may be handled out of order; the
 * sync result must not change by a bit. */
Test(it_ps_sync, bitwise_equal_to_reference_with_two_streams, .timeout = 30)
{
    ps_optim_config o = pst_optim(PS_OPT_MOMENTUM, 0.02);
    o.momentum = 0.9;
    s_run_job(&o, "momentum, 2 streams", 2, PS_DTYPE_F32);
}

Test(it_ps_sync, bitwise_equal_to_reference_for_every_optimizer, .timeout = 60)
{
    ps_optim_config o = pst_optim(PS_OPT_SGD, 0.05);
    o.weight_decay = 1e-3;
    s_run(&o, "sgd");
    o = pst_optim(PS_OPT_MOMENTUM, 0.02);
    o.momentum = 0.9;
    s_run(&o, "momentum");
    o.nesterov = 1;
    o.sched = PS_SCHED_EXPONENTIAL;
    o.decay_rate = 0.5;
    o.decay_steps = 2;
    o.staircase = 1;
    s_run(&o, "nesterov+exponential");
    o = pst_optim(PS_OPT_RMSPROP, 0.045);
    o.decay = 0.9;
    o.momentum = 0.9;
    o.epsilon = 1.0;
    s_run(&o, "rmsprop");
    o = pst_optim(PS_OPT_ADAM, 1e-3);
    o.warmup_steps = 2;
    o.sched = PS_SCHED_COSINE;
    o.total_steps = 3;
    o.min_lr = 1e-5;
    s_run(&o, "adam+warmup+cosine");
    o = pst_optim(PS_OPT_ADAGRAD, 0.1);
    o.epsilon = 1e-7;
    o.weight_decay = 1e-4;
    s_run(&o, "adagrad");
}

/* Pushes every variable's gradient g for step s from c and waits for the reply. */
static void s_push_wait(ps_client *c, const float *g, int s)
{
    ps_ticket tk;
    cr_assert_eq(ps_client_push(c, 0, NV, g, s, &tk), ZPS_OK);
    cr_assert_eq(ps_client_wait(c, tk), ZPS_OK, "%s", ps_client_last_error(c));
}

/* Pulls every variable at min_version (-1: any) into v; asserts the version is want. */
static void s_pull_version(ps_client *c, float *v, int64_t min_version, uint64_t want)
{
    ps_ticket tk;
    uint64_t ver;
    cr_assert_eq(ps_client_pull(c, 0, NV, v, min_version, &tk), ZPS_OK);
    cr_assert_eq(ps_client_wait_version(c, tk, &ver), ZPS_OK);
    cr_assert_eq(ver, want);
}

/* One step s of the two fast trainers c[0] and c[1] with fresh noise gradients g[0], g[1];
 * applies their average to ref (momentum slot mom) and checks trainer 0 pulls exactly ref. */
static void s_backup_step(ps_client **c, float **g, const ps_optim_config *o, float *ref,
                          float *mom, float *v, uint64_t n, int s, uint64_t *r, uint64_t seed)
{
    for (int t = 0; t < 2; t++) {
        for (uint64_t i = 0; i < n; i++)
            g[t][i] = pst_uniform(r);
        s_push_wait(c[t], g[t], s);
    }
    float *sp[1] = {mom};
    float *avg = zps_xmalloc(n * 4);
    for (uint64_t i = 0; i < n; i++)
        avg[i] = (g[0][i] + g[1][i]) / 2.0f;
    ps_optim_apply(o, (uint64_t)s, ref, sp, avg, n);
    free(avg);
    s_pull_version(c[0], v, s + 1, (uint64_t)s + 1);
    cr_assert(!memcmp(v, ref, n * 4), "step %d differs from the 2-replica reference (seed %llu)", s,
              (unsigned long long)seed);
}

/* Backup workers: 3 trainers, the server aggregates 2. Trainers 0 and 1 step without
 * trainer 2; its late push for step 0 is dropped (ZPS_ERR_STALE) and counted in STATS; it
 * then pulls the latest version and rejoins. Values follow the 2-replica reference. */
Test(it_ps_sync, backup_workers_drop_late_pushes, .timeout = 30)
{
    uint64_t seed = pst_seed();
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, NV, NS, 4096, &plan), ZPS_OK);
    uint64_t n = plan->total;
    pst_server srv[NS];
    const char *args[] = {"--mode", "sync", "--num-trainers", "3", "--replicas-to-aggregate", "2", NULL};
    const char *uris[NS];
    for (int i = 0; i < NS; i++) {
        cr_assert_eq(pst_spawn(&srv[i], NULL, args), 0);
        uris[i] = srv[i].uri;
    }
    ps_client *c[3];
    for (int t = 0; t < 3; t++) {
        cr_assert_eq(ps_client_new(uris, NS, (uint32_t)t, NULL, &c[t]), ZPS_OK);
        cr_assert_eq(ps_client_register(c[t], plan, NULL, NULL), ZPS_OK, "%s", ps_client_last_error(c[t]));
    }
    ps_optim_config o = pst_optim(PS_OPT_MOMENTUM, 0.05);
    float *v = zps_xmalloc(n * 4), *ref = zps_xmalloc(n * 4), *g[3], *mom = zps_xcalloc(n, 4);
    for (int t = 0; t < 3; t++)
        g[t] = zps_xmalloc(n * 4);
    uint64_t r = seed;
    for (uint64_t i = 0; i < n; i++)
        ref[i] = pst_uniform(&r);
    cr_assert_eq(ps_client_init(c[0], ref, &o, NULL), ZPS_OK);
    /* Trainer 2 computes its step-0 gradient now, from version 0, and sits on it. */
    for (uint64_t i = 0; i < n; i++)
        g[2][i] = pst_uniform(&r);
    const int steps = 3;
    for (int s = 0; s < steps; s++)
        s_backup_step(c, g, &o, ref, mom, v, n, s, &r, seed);
    /* The slow trainer finally pushes step 0. */
    ps_ticket tk;
    cr_assert_eq(ps_client_push(c[2], 0, NV, g[2], 0, &tk), ZPS_OK);
    uint64_t ver = 0;
    cr_assert_eq(ps_client_wait_version(c[2], tk, &ver), ZPS_ERR_STALE);
    cr_assert_eq(ver, (uint64_t)steps);
    cr_assert(strstr(ps_client_last_error(c[2]), "behind"), "message: %s", ps_client_last_error(c[2]));
    for (int i = 0; i < NS; i++) {
        char *json = NULL;
        cr_assert_eq(ps_client_stats(c[0], i, &json), ZPS_OK);
        cr_assert(strstr(json, "\"stale_dropped\":0,") == NULL, "server %d: %s", i, json);
        cr_assert(strstr(json, "\"version\":3,") != NULL, "server %d: %s", i, json);
        free(json);
    }
    /* Rejoin: pull the latest version, push the current step with a fast trainer. */
    s_pull_version(c[2], v, -1, (uint64_t)steps);
    s_push_wait(c[2], g[2], steps);
    s_push_wait(c[0], g[0], steps);
    s_pull_version(c[1], v, steps + 1, (uint64_t)steps + 1);
    for (int t = 0; t < 3; t++) {
        ps_client_destroy(&c[t]);
        free(g[t]);
    }
    for (int i = 0; i < NS; i++)
        pst_kill(&srv[i], SIGTERM);
    free(v);
    free(ref);
    free(mom);
    ps_plan_destroy(&plan);
}

/* REGISTER conflicts: the server's flags win, and a different plan is refused with a
 * message naming both sides. */
Test(it_ps_sync, register_conflicts_are_refused, .timeout = 20)
{
    pst_server srv;
    const char *args[] = {"--mode", "sync", "--num-trainers", "2", NULL};
    cr_assert_eq(pst_spawn(&srv, NULL, args), 0);
    const char *uris[1] = {srv.uri};
    ps_plan *p1, *p2;
    ps_var other[] = {{"a", 1000}, {"b", 4}};
    cr_assert_eq(ps_plan_new(s_vars, NV, 1, 4096, &p1), ZPS_OK);
    cr_assert_eq(ps_plan_new(other, 2, 1, 4096, &p2), ZPS_OK);
    ps_client *c0, *c1;
    cr_assert_eq(ps_client_new(uris, 1, 0, NULL, &c0), ZPS_OK);
    cr_assert_eq(ps_client_new(uris, 1, 1, NULL, &c1), ZPS_OK);
    ps_job async_job = {PS_MODE_ASYNC, 2, 0, 0};
    cr_assert_eq(ps_client_register(c0, p1, &async_job, NULL), ZPS_ERR_CONFIG);
    cr_assert(strstr(ps_client_last_error(c0), "sync"), "%s", ps_client_last_error(c0));
    ps_job eff;
    cr_assert_eq(ps_client_register(c0, p1, NULL, &eff), ZPS_OK);
    cr_assert_eq(eff.mode, PS_MODE_SYNC);
    cr_assert_eq(eff.num_trainers, 2);
    cr_assert_eq(ps_client_register(c1, p2, NULL, NULL), ZPS_ERR_PLAN);
    cr_assert(strstr(ps_client_last_error(c1), "trainer 1 has plan") &&
                  strstr(ps_client_last_error(c1), "2 variables") &&
                  strstr(ps_client_last_error(c1), "from trainer 0"),
              "%s", ps_client_last_error(c1));
    ps_client_destroy(&c0);
    ps_client_destroy(&c1);
    pst_kill(&srv, SIGTERM);
    ps_plan_destroy(&p1);
    ps_plan_destroy(&p2);
}
