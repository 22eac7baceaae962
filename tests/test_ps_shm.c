/* test_ps_shm.c — the same-host data plane (ps/shm.h, docs/ps.md "Shared memory"): the
 * segment itself (attach checks, the seqlock), and fleets whose payloads cross in shared
 * memory train to exactly the values they reach through ZeroMQ frames. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/mem.h"
#include "ps/client.h"
#include "ps/dtype.h"
#include "ps/plan.h"
#include "ps/shm.h"
#include "tests/ps_test_util.h"

/* ------------------------------------------------------------------------- the segment */

static ps_shm *s_segment(void)
{
    uint32_t keys[2] = {1, 3};
    uint64_t counts[2] = {1000, 24}, offs[2] = {0, 1000};
    ps_shm *m;
    cr_assert_eq(ps_shm_create(2, keys, counts, offs, 4, 1024, 3, &m), ZPS_OK);
    for (int i = 0; i < 1024; i++)
        m->values[i] = (float)i;
    return m;
}

Test(ps_shm, attach_maps_the_segment_and_checks_what_it_maps)
{
    ps_shm *m = s_segment(), *c;
    char why[256];
    uint32_t pid = (uint32_t)getpid();
    cr_assert_eq(ps_shm_attach(pid, (uint32_t)m->fd, m->bytes, m->hdr->nonce, &c, why, sizeof why),
                 ZPS_OK, "%s", why);
    cr_expect(ps_shm_valid(c));
    cr_expect_eq(c->key_to_local[1], 0);
    cr_expect_eq(c->key_to_local[3], 1);
    cr_expect_eq(c->key_to_local[0], -1);
    cr_expect_eq(c->values[1010], 1010.0f);
    ps_shm_slot(c, 2)[5] = 7.5f; // a trainer's write is the server's read
    cr_expect_eq(ps_shm_slot(m, 2)[5], 7.5f);
    ps_shm_destroy(&c);
    /* another segment's nonce, size or a file that is not one */
    cr_expect_eq(ps_shm_attach(pid, (uint32_t)m->fd, m->bytes, m->hdr->nonce ^ 1, &c, why, sizeof why),
                 ZPS_ERR_CORRUPT);
    cr_expect(strstr(why, "not the segment offered"), "%s", why);
    cr_expect_eq(ps_shm_attach(pid, (uint32_t)m->fd, m->bytes + 4096, m->hdr->nonce, &c, why,
                               sizeof why),
                 ZPS_ERR_CORRUPT);
    cr_expect_eq(ps_shm_attach(pid, 0, m->bytes, m->hdr->nonce, &c, why, sizeof why), ZPS_ERR_CORRUPT);
    /* a process that is gone (another host looks the same) */
    pid_t child = fork();
    cr_assert(child >= 0);
    if (child == 0)
        _exit(0);
    cr_assert_eq(waitpid(child, NULL, 0), child);
    cr_expect_eq(ps_shm_attach((uint32_t)child, (uint32_t)m->fd, m->bytes, m->hdr->nonce, &c, why,
                               sizeof why),
                 ZPS_ERR_NOT_FOUND, "%s", why);
    cr_expect_null(c);
    ps_shm_invalidate(m);
    cr_expect_not(ps_shm_valid(m));
    ps_shm_destroy(&m);
    cr_expect_null(m);
}

Test(ps_shm, a_read_during_a_write_is_torn)
{
    ps_shm *m = s_segment();
    float out[24];
    cr_expect_eq(ps_shm_read(m, 1, 4, 20, out), 0);
    cr_expect_eq(out[0], 1004.0f);
    cr_expect_eq(out[19], 1023.0f);
    ps_shm_write_begin(m, 1);
    cr_expect_eq(ps_shm_read(m, 1, 0, 24, out), -1, "a chunk being written is not read");
    cr_expect_eq(ps_shm_read(m, 0, 0, 24, out), 0, "the other chunks are");
    ps_shm_write_end(m, 1);
    cr_expect_eq(ps_shm_read(m, 1, 0, 24, out), 0);
    ps_shm_destroy(&m);
}

/* ------------------------------------------------------------------------- fleets */

static const ps_var s_vars[] = {{"w", 70000}, {"b", 10}, {"c", 3000}, {"d", 40000}};
#define N_VARS 4
#define STEPS 8

typedef struct targ {
    const char *uri;
    const ps_plan *plan;
    ps_client *c; // trainer 0: the client that initialised; others make their own
    int t, shm, sync;
    ps_dtype dt; // push_dtype; bf16: trainer 1 hands over bf16 bits (pushpull_bf16)
    float *final; // (plan->total) the values after the last step
    char err[256];
} targ;

/* Trainer a->t: STEPS steps whose gradients depend on the values pulled, so any value that
 * crossed wrongly changes everything after it. sync: one PUSHPULL per variable group per
 * step, several in flight; async: push then pull. */
static void *s_trainer(void *arg)
{
    targ *a = arg;
    ps_client_opts o;
    ps_client_opts_default(&o);
    o.shm = a->shm;
    o.msg_bytes = 64 << 10; // several messages per push
    o.push_dtype = a->dt;
    ps_client *c = a->c ? a->c : pst_client_connect(a->uri, (uint32_t)a->t, &o, a->plan);
    uint64_t n = a->plan->total;
    float *v = zps_xmalloc(n * 4), *g = zps_xmalloc(n * 4);
    uint16_t *g16 = a->dt == PS_DTYPE_BF16 && a->t == 1 ? zps_xmalloc(n * 2) : NULL;
    ps_ticket tk[N_VARS];
    zps_status st = ps_client_pull(c, 0, N_VARS, v, 0, &tk[0]);
    if (st == ZPS_OK)
        st = ps_client_wait(c, tk[0]);
    for (int s = 0; s < STEPS && st == ZPS_OK; s++) {
        for (uint64_t i = 0; i < n; i++)
            g[i] = 0.25f * v[i] + 0.001f * (float)((i * 7 + (uint64_t)a->t * 3 + (uint64_t)s) % 13);
        if (g16)
            ps_f32_to_bf16(g16, g, n);
        if (a->sync) {
            for (int k = 0; k < N_VARS && st == ZPS_OK; k++)
                st = g16 ? ps_client_pushpull_bf16(c, k, 1, g16, v, s, &tk[k])
                         : ps_client_pushpull(c, k, 1, g, v, s, &tk[k]);
            for (int k = 0; k < N_VARS && st == ZPS_OK; k++)
                st = ps_client_wait(c, tk[k]);
        } else {
            if ((st = ps_client_push(c, 0, N_VARS, g, s, &tk[0])) == ZPS_OK &&
                (st = ps_client_wait(c, tk[0])) == ZPS_OK &&
                (st = ps_client_pull(c, 0, N_VARS, v, s + 1, &tk[0])) == ZPS_OK)
                st = ps_client_wait(c, tk[0]);
        }
    }
    if (st != ZPS_OK)
        snprintf(a->err, sizeof a->err, "trainer %d: %s: %s", a->t, zps_status_name(st),
                 ps_client_last_error(c));
    memcpy(a->final, v, n * 4);
    ps_client_destroy(&c);
    free(v);
    free(g);
    free(g16);
    return NULL;
}

typedef struct fleet_run {
    float *final[2]; // each trainer's last values
    char stats[4096];
} fleet_run;

/* One server (extra: more of its flags), trainers that use shared memory when shm says so;
 * ends with the server's STATS. */
static void s_fleet_dt(const char *mode, int trainers, const char *extra, int shm, ps_dtype dt,
                      fleet_run *r)
{
    pst_server srv;
    char nt[8];
    snprintf(nt, sizeof nt, "%d", trainers);
    const char *args[] = {"--mode", mode, "--num-trainers", nt, extra, NULL};
    cr_assert_eq(pst_spawn(&srv, NULL, args), 0);
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, N_VARS, 1, 64 << 10, &plan), ZPS_OK);
    /* trainer 0 initialises (with the same client options as the rest) */
    ps_client_opts o;
    ps_client_opts_default(&o);
    o.shm = shm;
    o.push_dtype = dt;
    ps_client *c0 = pst_client_connect(srv.uri, 0, &o, plan);
    float *v0 = zps_xmalloc(plan->total * 4);
    uint64_t seed = 42;
    for (uint64_t i = 0; i < plan->total; i++)
        v0[i] = pst_uniform(&seed);
    ps_optim_config opt;
    ps_optim_default(&opt);
    cr_assert_eq(ps_client_init(c0, v0, &opt, NULL), ZPS_OK, "%s", ps_client_last_error(c0));
    free(v0);
    pthread_t th[2];
    targ ta[2];
    for (int t = 0; t < trainers; t++) {
        r->final[t] = zps_xmalloc(plan->total * 4);
        ta[t] = (targ){srv.uri, plan, t == 0 ? c0 : NULL, t, shm, !strcmp(mode, "sync"), dt,
                       r->final[t], ""};
        cr_assert_eq(pthread_create(&th[t], NULL, s_trainer, &ta[t]), 0);
    }
    for (int t = 0; t < trainers; t++) {
        pthread_join(th[t], NULL);
        cr_expect_eq(ta[t].err[0], 0, "%s", ta[t].err);
    }
    const char *uris[1] = {srv.uri};
    ps_client *c;
    cr_assert_eq(ps_client_new(uris, 1, 0, NULL, &c), ZPS_OK);
    char *js;
    cr_assert_eq(ps_client_stats(c, 0, &js), ZPS_OK);
    snprintf(r->stats, sizeof r->stats, "%s", js);
    free(js);
    ps_client_destroy(&c);
    pst_kill(&srv, SIGTERM);
    ps_plan_destroy(&plan);
}

static void s_fleet(const char *mode, int trainers, const char *extra, int shm, fleet_run *r)
{
    s_fleet_dt(mode, trainers, extra, shm, PS_DTYPE_F32, r);
}

static uint64_t s_total(void)
{
    uint64_t n = 0;
    for (int i = 0; i < N_VARS; i++)
        n += s_vars[i].count;
    return n;
}

/* Sync, 2 trainers: through the segment, with --no-shm on the server, and with clients that
 * do not take the offer: every value the same, bit for bit. */
Test(it_ps_shm, sync_through_shared_memory_equals_zeromq_bit_for_bit, .timeout = 60)
{
    fleet_run a, b, c;
    s_fleet("sync", 2, NULL, 1, &a);
    s_fleet("sync", 2, "--no-shm", 1, &b);
    s_fleet("sync", 2, NULL, 0, &c);
    uint64_t n = s_total();
    for (int t = 0; t < 2; t++) {
        cr_expect_eq(memcmp(a.final[t], b.final[t], n * 4), 0, "trainer %d: shm != --no-shm", t);
        cr_expect_eq(memcmp(a.final[t], c.final[t], n * 4), 0, "trainer %d: shm != clients off", t);
        cr_expect_eq(memcmp(a.final[t], a.final[0], n * 4), 0, "trainers disagree");
    }
    /* every push and pull of the shared-memory run crossed there; none of the others */
    cr_expect(strstr(a.stats, "\"shm\":true"), "%s", a.stats);
    cr_expect_eq(pst_stat(a.stats, "shm_pushes"), pst_stat(a.stats, "pushes"), "%s", a.stats);
    cr_expect_gt(pst_stat(a.stats, "shm_pushes"), 0);
    /* each trainer's first pull may precede its attach (offered in that reply) */
    cr_expect_geq(pst_stat(a.stats, "shm_pulls") + 2 * pst_stat(a.stats, "chunks"),
                  pst_stat(a.stats, "pulls"), "%s", a.stats);
    cr_expect_gt(pst_stat(a.stats, "shm_pulls"), 0);
    cr_expect(strstr(b.stats, "\"shm\":false"), "%s", b.stats);
    cr_expect_eq(pst_stat(b.stats, "shm_pushes") + pst_stat(b.stats, "shm_pulls"), 0);
    cr_expect_eq(pst_stat(c.stats, "shm_pushes") + pst_stat(c.stats, "shm_pulls"), 0, "%s", c.stats);
    cr_expect_eq(pst_stat(a.stats, "version"), STEPS);
    for (int t = 0; t < 2; t++) {
        free(a.final[t]);
        free(b.final[t]);
        free(c.final[t]);
    }
}

/* Sync with bf16 pushes (trainer 0 rounds in the library, trainer 1 hands over bf16 bits):
 * through the segment the gradients cross as the f32 the server would widen the wire's
 * bfloat16 to, so the values equal the frames path's bit for bit, and differ from f32
 * pushes (the rounding happened). */
Test(it_ps_shm, sync_bf16_pushes_through_shared_memory_equal_zeromq, .timeout = 60)
{
    fleet_run a, b, f;
    s_fleet_dt("sync", 2, NULL, 1, PS_DTYPE_BF16, &a);
    s_fleet_dt("sync", 2, "--no-shm", 1, PS_DTYPE_BF16, &b);
    s_fleet("sync", 2, NULL, 1, &f);
    uint64_t n = s_total();
    for (int t = 0; t < 2; t++) {
        cr_expect_eq(memcmp(a.final[t], b.final[t], n * 4), 0, "trainer %d: shm != --no-shm", t);
        cr_expect_eq(memcmp(a.final[t], a.final[0], n * 4), 0, "trainers disagree");
    }
    cr_expect_neq(memcmp(a.final[0], f.final[0], n * 4), 0, "bf16 pushes gave the f32 values");
    cr_expect_eq(pst_stat(a.stats, "shm_pushes"), pst_stat(a.stats, "pushes"), "%s", a.stats);
    cr_expect_gt(pst_stat(a.stats, "shm_pushes"), 0);
    cr_expect_eq(pst_stat(b.stats, "shm_pushes"), 0, "%s", b.stats);
    cr_expect_eq(pst_stat(a.stats, "version"), STEPS);
    for (int t = 0; t < 2; t++) {
        free(a.final[t]);
        free(b.final[t]);
        free(f.final[t]);
    }
}

/* Async: pulls come out of the segment, pushes still travel in frames (the server applies
 * them after its reply, when the trainer may already rewrite its slot); one trainer, so the
 * result is deterministic and must equal the frames-only run's. */
Test(it_ps_shm, async_pulls_through_shared_memory_pushes_in_frames, .timeout = 60)
{
    fleet_run a, b;
    s_fleet("async", 1, NULL, 1, &a);
    s_fleet("async", 1, "--no-shm", 1, &b);
    cr_expect_eq(memcmp(a.final[0], b.final[0], s_total() * 4), 0);
    cr_expect_eq(pst_stat(a.stats, "shm_pushes"), 0, "%s", a.stats);
    cr_expect_gt(pst_stat(a.stats, "shm_pulls"), 0, "%s", a.stats);
    cr_expect_eq(pst_stat(b.stats, "shm_pulls"), 0, "%s", b.stats);
    free(a.final[0]);
    free(b.final[0]);
}
