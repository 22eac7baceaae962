/* test_ps_recover.c — sync recovery without restarting trainers, and fast failover, with
 * real server processes (docs/ps.md "Recovery").
 *
 * kill9_restore_rolls_back_and_redoes: 2 servers and 2 trainer threads in sync mode, checkpoints every K
 * versions. Server 1 is killed with SIGKILL mid-run and restarted with --restore: the
 * trainers learn that the fleet rolls back to the restored version, roll server 0 back,
 * and redo the steps after it. The gradient of a step is a function of (trainer, step,
 * values), so the redo replays exactly the fault-free run: the final values must equal a
 * fault-free reference trajectory bit for bit, and each server's STATS must account for
 * every version once (updates + updates_restored - updates_undone = chunks x steps).
 *
 * trainers_redo_after_a_server_restore: the same end to end with zps-trainer processes
 * (checkpoints every 5 versions): the trainers are not restarted, they roll the fleet back,
 * rewind their input and redo the steps after the restored version. What it proves: the
 * exported model equals, bit for bit, that of the same fleet run without a fault (the redo
 * replays the same batches on the same values), and STATS accounts for every version once.
 * staged_trainers_redo_after_a_server_restore: the fault run's trainers on the staged device
 * back-end (pinned mirrors, trainer/stage.c), against the clean run on the cpu.
 * node_redoes_after_a_server_restore: both runs as one --node-trainers 2 node (the servers
 * see one trainer), the fault run on staged trainers. Every run evaluates after each step
 * (--eval-every 1): a rollback may show in an evaluation's wait for values.
 *
 * a_rollback_in_the_first_step_is_redone: a rollback inside a job's first step.
 * a_stale_backup_worker_pulls_its_buckets_together: a backup worker's stale step catches up
 * with one pull per bucket, sent together (trainer/sync_ps.c s_catch_up).
 *
 * failover_resends_at_once, restored_server_answers_a_waiting_pull: a request the dead
 * server never answered is resent as soon as the restarted server accepts the connection,
 * not after --timeout-ms (30 s here); the time from the restart to the reply is printed. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "ps/client.h"
#include "ps/optim.h"
#include "ps/plan.h"
#include "tests/ps_test_util.h"
#include "tests/testutil.h"
#include "trainer/config.h"
#include "trainer/nn/nn.h"
#include "trainer/sync.h"

static const ps_var s_vars[] = {{"conv", 4000}, {"bn", 16}, {"fc", 2000}};
#define NV 3
#define STEPS 30
#define NT 2
#define KILL_AT 11 // kill server 1 once both trainers finished this many steps

/* The gradient noise of trainer t at step s, element i: a hash, so any thread can
 * recompute it. */
static float s_noise(uint64_t seed, int t, int64_t s, uint64_t i)
{
    uint64_t x = seed ^ ((uint64_t)t * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)s << 32) ^ i;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (float)((double)(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static void s_grad(uint64_t seed, int t, int64_t s, const float *v, float *g, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        g[i] = s_noise(seed, t, s, i) + 0.1f * v[i];
}

static void s_opt(ps_optim_config *o)
{
    ps_optim_default(o);
    o->kind = PS_OPT_RMSPROP;
    o->lr = 0.01;
    o->epsilon = 1.0;
}

typedef struct s_trainer {
    int id;
    const char *const *uris;
    const ps_plan *plan;
    uint64_t seed;
    const float *x0;
    float *vals, *grad;       // (n)
    atomic_int done;          // steps completed (this timeline)
    int rollbacks;
    uint64_t rolled_to;
    double back_at;           // time (s) the first rollback completed
    zps_status st;
    char err[400];
} s_trainer;

/* After a failed (or any) wait: 1 when the fleet rolled back (the caller redoes from *s),
 * 0 when st is the step's result. */
static int s_maybe_rollback(s_trainer *a, ps_client *c, zps_status *st, int64_t *s)
{
    if (!ps_client_rollback_pending(c, NULL))
        return 0;
    uint64_t v;
    *st = ps_client_rollback(c, &v);
    if (*st != ZPS_OK)
        return 0;
    if (!a->rollbacks++)
        a->back_at = zps_now_s();
    a->rolled_to = v;
    *s = (int64_t)v;
    atomic_store(&a->done, (int)v);
    return 1;
}

/* One sync step (pull version s, push its gradient); ZPS_OK, or a failure. *s advances, or
 * goes back on a rollback. */
static zps_status s_step(s_trainer *a, ps_client *c, int64_t *s)
{
    uint64_t n = a->plan->total, ver;
    ps_ticket tk;
    zps_status st = ps_client_pull(c, 0, NV, a->vals, *s, &tk);
    if (st == ZPS_OK)
        st = ps_client_wait_version(c, tk, &ver);
    if (s_maybe_rollback(a, c, &st, s) || st != ZPS_OK)
        return st;
    if (*s == STEPS)
        return ZPS_OK;
    s_grad(a->seed, a->id, *s, a->vals, a->grad, n);
    st = ps_client_push(c, 0, NV, a->grad, *s, &tk);
    if (st == ZPS_OK)
        st = ps_client_wait(c, tk);
    if (s_maybe_rollback(a, c, &st, s) || st != ZPS_OK)
        return st;
    (*s)++;
    atomic_store(&a->done, (int)*s);
    zps_sleep_ns(15000000); // keep the run long enough to kill a server in the middle
    return ZPS_OK;
}

static void *s_trainer_main(void *arg)
{
    s_trainer *a = arg;
    ps_client_opts co;
    ps_client_opts_default(&co);
    co.timeout_ms = 30000;
    ps_client *c;
    a->st = ps_client_new(a->uris, 2, (uint32_t)a->id, &co, &c);
    if (a->st != ZPS_OK)
        return NULL;
    ps_job job = {PS_MODE_SYNC, NT, 0, 0};
    ps_optim_config o;
    s_opt(&o);
    a->st = ps_client_register(c, a->plan, &job, NULL);
    if (a->st == ZPS_OK)
        a->st = ps_client_init(c, a->x0, &o, NULL);
    int64_t s = 0;
    /* the final pull (step STEPS) is a step too: a rollback may still send us back */
    while (a->st == ZPS_OK) {
        int64_t before = s;
        a->st = s_step(a, c, &s);
        if (a->st == ZPS_OK && before == STEPS && s == STEPS)
            break;
    }
    if (a->st != ZPS_OK)
        snprintf(a->err, sizeof a->err, "%s", ps_client_last_error(c));
    ps_client_destroy(&c);
    return NULL;
}

/* The fault-free trajectory: x_{s+1} = optimizer(x_s, mean over trainers of their gradient),
 * the mean summed in trainer order and divided as the server does. */
static float *s_reference(uint64_t seed, const float *x0, uint64_t n)
{
    ps_optim_config o;
    s_opt(&o);
    float *x = zps_xmalloc(n * 4), *g = zps_xmalloc(n * 4), *m = zps_xmalloc(n * 4);
    float *slots[2] = {zps_xmalloc(n * 4), zps_xcalloc(n, 4)};
    for (uint64_t i = 0; i < n; i++)
        slots[0][i] = ps_optim_slot_init(&o, 0);
    memcpy(x, x0, n * 4);
    for (int64_t s = 0; s < STEPS; s++) {
        for (int t = 0; t < NT; t++) {
            s_grad(seed, t, s, x, g, n);
            for (uint64_t i = 0; i < n; i++)
                m[i] = t ? m[i] + g[i] : g[i];
        }
        for (uint64_t i = 0; i < n; i++)
            m[i] = m[i] / (float)NT;
        ps_optim_apply(&o, (uint64_t)s, x, slots, m, n);
    }
    free(g);
    free(m);
    free(slots[0]);
    free(slots[1]);
    return x;
}

/* The fewest (most, when most) steps a trainer has completed. */
static int s_done(s_trainer *tr, int most)
{
    int m = atomic_load(&tr[0].done);
    for (int t = 1; t < NT; t++) {
        int d = atomic_load(&tr[t].done);
        if (most ? d > m : d < m)
            m = d;
    }
    return m;
}
static int s_min_done(s_trainer *tr) { return s_done(tr, 0); }

/* Every version accounted for once on server i: at version STEPS, and the updates applied,
 * restored and undone add up to chunks x STEPS. */
static void s_check_stats(const char *const *uris, int i)
{
    ps_client *c;
    cr_assert_eq(ps_client_new(uris, 2, 0, NULL, &c), ZPS_OK);
    char *json = NULL;
    cr_assert_eq(ps_client_stats(c, i, &json), ZPS_OK, "%s", ps_client_last_error(c));
    uint64_t chunks = pst_stat(json, "chunks"), upd = pst_stat(json, "updates"),
             restored = pst_stat(json, "updates_restored"), undone = pst_stat(json, "updates_undone");
    cr_log_info("server %d: version %" PRIu64 ", updates %" PRIu64 " + restored %" PRIu64
                " - undone %" PRIu64 ", rollbacks %" PRIu64, i, pst_stat(json, "version"), upd,
                restored, undone, pst_stat(json, "rollbacks"));
    cr_assert_eq(pst_stat(json, "version"), STEPS, "%s", json);
    cr_assert_eq(upd + restored - undone, chunks * STEPS, "server %d: %s", i, json);
    free(json);
    ps_client_destroy(&c);
}

/* Kills server 1 (both: and server 0) mid-run and restarts it with --restore; the trainer
 * threads finish on the fault-free trajectory. */
static void s_kill_restore(int both)
{
    uint64_t seed = pst_seed();
    char dir[256];
    pst_tmpdir(dir, sizeof dir);
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, NV, 2, 8192, &plan), ZPS_OK);
    uint64_t n = plan->total, r = seed;
    float *x0 = zps_xmalloc(n * 4);
    for (uint64_t i = 0; i < n; i++)
        x0[i] = pst_uniform(&r);
    pst_server srv[2];
    char uri[2][256];
    const char *args[2][14], *idx[2] = {"0", "1"};
    for (int i = 0; i < 2; i++) {
        const char *a[] = {"--mode", "sync", "--num-trainers", "2", "--checkpoint-dir", dir,
                           "--checkpoint-every-versions", "4", "--index", idx[i], NULL, NULL};
        memcpy(args[i], a, sizeof a);
        cr_assert_eq(pst_spawn(&srv[i], NULL, args[i]), 0);
        snprintf(uri[i], sizeof uri[i], "%s", srv[i].uri);
    }
    const char *uris[2] = {uri[0], uri[1]};
    s_trainer tr[NT];
    pthread_t th[NT];
    for (int t = 0; t < NT; t++) {
        tr[t] = (s_trainer){.id = t, .uris = uris, .plan = plan, .seed = seed, .x0 = x0,
                            .vals = zps_xmalloc(n * 4), .grad = zps_xmalloc(n * 4)};
        cr_assert_eq(pthread_create(&th[t], NULL, s_trainer_main, &tr[t]), 0);
    }
    while (s_min_done(tr) < KILL_AT)
        zps_sleep_ns(2000000);
    for (int i = both ? 0 : 1; i < 2; i++)
        pst_kill(&srv[i], SIGKILL);
    /* on a busy machine the trainers may get past KILL_AT before the kill lands: a server
     * is at most one version ahead of the trainers' completed steps */
    uint64_t at_kill = (uint64_t)s_done(tr, 1) + 1;
    zps_sleep_ns(300000000);
    /* each restored server starts its own rollback: with both, the fleet must agree */
    for (int i = both ? 0 : 1; i < 2; i++) {
        args[i][10] = "--restore";
        cr_assert_eq(pst_spawn(&srv[i], uri[i], args[i]), 0, "restart with --restore failed");
    }
    double restarted = zps_now_s();
    for (int t = 0; t < NT; t++)
        pthread_join(th[t], NULL);
    float *ref = s_reference(seed, x0, n);
    for (int t = 0; t < NT; t++) {
        cr_assert_eq(tr[t].st, ZPS_OK, "trainer %d: %s: %s", t, zps_status_name(tr[t].st), tr[t].err);
        cr_assert_geq(tr[t].rollbacks, 1, "trainer %d never rolled back", t);
        cr_log_info("trainer %d rolled back to version %" PRIu64 ", %.3f s after the restart",
                    t, tr[t].rolled_to, tr[t].back_at - restarted);
        cr_assert(tr[t].rolled_to <= at_kill && tr[t].rolled_to % 4 == 0, "rolled to %" PRIu64
                  " (the servers were at most at version %" PRIu64 " when killed)",
                  tr[t].rolled_to, at_kill);
        uint64_t bad = n;
        for (uint64_t i = 0; i < n && bad == n; i++)
            if (memcmp(&tr[t].vals[i], &ref[i], 4))
                bad = i;
        cr_assert_eq(bad, n, "trainer %d: value %" PRIu64 " is %.9g, the fault-free run has %.9g "
                     "(seed %" PRIu64 ")", t, bad, bad < n ? tr[t].vals[bad] : 0.0,
                     bad < n ? ref[bad] : 0.0, seed);
    }
    for (int i = 0; i < 2; i++)
        s_check_stats(uris, i);
    for (int i = 0; i < 2; i++)
        pst_kill(&srv[i], SIGTERM);
    for (int t = 0; t < NT; t++) {
        free(tr[t].vals);
        free(tr[t].grad);
    }
    free(ref);
    free(x0);
    pst_rmdir(dir);
    ps_plan_destroy(&plan);
}

Test(it_ps_recover, kill9_restore_rolls_back_and_redoes, .timeout = 90) { s_kill_restore(0); }

/* Both servers die and come back, each with its own rollback token: one wins everywhere. */
Test(it_ps_recover, both_servers_restored_agree_on_one_rollback, .timeout = 90)
{
    s_kill_restore(1);
}

/* One server started with args (its endpoint into uri, 256 bytes) and n clients of it,
 * trainers 0..n-1, with --timeout-ms 30000: a recovery must not wait for it. */
static void s_one_server(pst_server *srv, const char *const *args, char *uri, int n,
                         ps_client **c)
{
    cr_assert_eq(pst_spawn(srv, NULL, args), 0);
    snprintf(uri, 256, "%s", srv->uri);
    const char *uris[1] = {uri};
    ps_client_opts co;
    ps_client_opts_default(&co);
    co.timeout_ms = 30000;
    for (int t = 0; t < n; t++)
        cr_assert_eq(ps_client_new(uris, 1, (uint32_t)t, &co, &c[t]), ZPS_OK);
}

Test(it_ps_recover, restored_server_answers_a_waiting_pull, .timeout = 25)
{
    char dir[256];
    pst_tmpdir(dir, sizeof dir);
    ps_var v1 = {"w", 3000};
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(&v1, 1, 1, 0, &plan), ZPS_OK);
    const char *args[] = {"--mode", "sync", "--num-trainers", "1", "--checkpoint-dir", dir,
                          "--checkpoint-every-versions", "1", NULL, NULL};
    pst_server srv;
    char uri[256];
    ps_client *c;
    s_one_server(&srv, args, uri, 1, &c);
    cr_assert_eq(ps_client_register(c, plan, NULL, NULL), ZPS_OK);
    float *v = zps_xcalloc(plan->total, 4), *g = zps_xcalloc(plan->total, 4);
    for (uint64_t i = 0; i < plan->total; i++)
        v[i] = g[i] = 0.5f;
    ps_optim_config o;
    ps_optim_default(&o);
    cr_assert_eq(ps_client_init(c, v, &o, NULL), ZPS_OK);
    ps_ticket tk;
    cr_assert_eq(ps_client_push(c, 0, 1, g, 0, &tk), ZPS_OK);
    cr_assert_eq(ps_client_wait(c, tk), ZPS_OK, "%s", ps_client_last_error(c));
    /* a pull for version 2 waits on the server (nobody pushes step 1): the server dies with
     * it, so only a resend can get it answered */
    cr_assert_eq(ps_client_pull(c, 0, 1, v, 2, &tk), ZPS_OK);
    int done;
    cr_assert_eq(ps_client_poll(c, tk, 200, &done), ZPS_OK);
    cr_assert(!done);
    pst_kill(&srv, SIGKILL);
    cr_assert_eq(ps_client_poll(c, tk, 700, &done), ZPS_OK);
    cr_assert(!done);
    args[8] = "--restore";
    cr_assert_eq(pst_spawn(&srv, uri, args), 0, "restart with --restore failed");
    double t0 = zps_now_s();
    uint64_t ver;
    zps_status st = ps_client_wait_version(c, tk, &ver);
    double dt = zps_now_s() - t0;
    cr_log_info("failover: first reply %.3f s after the server's restart (--timeout-ms 30000)", dt);
    printf("failover: first reply %.3f s after the server's restart\n", dt);
    /* the restored server (version 1) tells the trainer to roll back to 1 */
    cr_assert_eq(st, ZPS_ERR_STALE, "%s: %s", zps_status_name(st), ps_client_last_error(c));
    cr_assert_lt(dt, 5.0, "the resend waited %.1f s", dt);
    cr_assert_eq(ps_client_rollback(c, &ver), ZPS_OK, "%s", ps_client_last_error(c));
    cr_assert_eq(ver, 1);
    cr_assert_eq(ps_client_push(c, 0, 1, g, 1, &tk), ZPS_OK);
    cr_assert_eq(ps_client_wait(c, tk), ZPS_OK, "%s", ps_client_last_error(c));
    cr_assert_eq(ps_client_pull(c, 0, 1, v, 2, &tk), ZPS_OK);
    cr_assert_eq(ps_client_wait_version(c, tk, &ver), ZPS_OK, "%s", ps_client_last_error(c));
    cr_assert_eq(ver, 2);
    ps_client_destroy(&c);
    pst_kill(&srv, SIGTERM);
    free(v);
    free(g);
    pst_rmdir(dir);
    ps_plan_destroy(&plan);
}

typedef struct s_barrier_arg {
    ps_client *c;
    zps_status st;
    double at;
} s_barrier_arg;

static void *s_barrier_main(void *arg)
{
    s_barrier_arg *b = arg;
    b->st = ps_client_barrier(b->c);
    b->at = zps_now_s();
    return NULL;
}

/* A barrier waits on the server when it dies; only a resend can get it released. Trainer 0
 * must resend as soon as the restarted server accepts the connection: trainer 1's barrier
 * on the new server cannot return before it. */
Test(it_ps_recover, failover_resends_at_once, .timeout = 25)
{
    ps_var v1 = {"w", 1000};
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(&v1, 1, 1, 0, &plan), ZPS_OK);
    const char *args[] = {"--mode", "async", "--num-trainers", "2", NULL};
    pst_server srv;
    char uri[256];
    ps_client *c[2];
    s_one_server(&srv, args, uri, 2, c);
    cr_assert_eq(ps_client_register(c[0], plan, NULL, NULL), ZPS_OK);
    s_barrier_arg b = {c[0], ZPS_OK, 0};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, s_barrier_main, &b), 0);
    zps_sleep_ns(300000000);
    pst_kill(&srv, SIGKILL);
    zps_sleep_ns(700000000);
    cr_assert_eq(pst_spawn(&srv, uri, args), 0, "restart failed");
    double t0 = zps_now_s();
    cr_assert_eq(ps_client_register(c[1], plan, NULL, NULL), ZPS_OK);
    cr_assert_eq(ps_client_barrier(c[1]), ZPS_OK, "%s", ps_client_last_error(c[1]));
    pthread_join(th, NULL);
    cr_assert_eq(b.st, ZPS_OK, "%s", ps_client_last_error(c[0]));
    double dt = b.at - t0;
    cr_log_info("failover: the resent barrier returned %.3f s after the server's restart "
                "(--timeout-ms 30000)", dt);
    printf("failover: resent request answered %.3f s after the server's restart\n", dt);
    cr_assert_lt(dt, 5.0);
    for (int t = 0; t < 2; t++)
        ps_client_destroy(&c[t]);
    pst_kill(&srv, SIGTERM);
    ps_plan_destroy(&plan);
}

/* ---- end to end: zps-trainer processes ---- */

#define TSTEPS "60"

static char s_tmp[512], s_data[600]; /* the end-to-end test's files */

static void s_expect_ok(pst_server *p, const char *log, double timeout_s)
{
    int st = pst_wait(p, timeout_s);
    if (st == -1)
        pst_kill(p, SIGKILL);
    if (st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        char cmd[800];
        snprintf(cmd, sizeof cmd, "tail -40 '%s' >&2", log);
        int rc = system(cmd);
        (void)rc;
        cr_assert_fail("%s failed or did not finish (wait status %d)", log, st);
    }
}

/* One fleet run of trainers on `device` (node: as one --node-trainers 2 node, which the
 * servers see as one trainer); with kill_at > 0, server 1 dies once trainer 1 logged that
 * step and comes back with --restore. The model goes to tag.bin; the servers' STATS are
 * checked. */
static void s_run(const char *tag, int kill_at, const char *device, int node)
{
    char ck[700], logs[2][700], tlog[2][700], met[2][700], out[700], servers[600];
    snprintf(ck, sizeof ck, "%s/ck-%s", s_tmp, tag);
    snprintf(out, sizeof out, "%s/%s.bin", s_tmp, tag);
    pst_server srv[2], tr[2];
    const char *idx[2] = {"0", "1"};
    const char *sargs[2][14];
    for (int i = 0; i < 2; i++) {
        const char *a[] = {"--mode", "sync", "--num-trainers", node ? "1" : "2", "--checkpoint-dir", ck,
                           "--checkpoint-every-versions", "5", "--index", idx[i], NULL, NULL};
        memcpy(sargs[i], a, sizeof a);
        cr_assert_eq(pst_spawn(&srv[i], NULL, sargs[i]), 0);
    }
    char uri1[256];
    snprintf(uri1, sizeof uri1, "%s", srv[1].uri);
    snprintf(servers, sizeof servers, "%s,%s", srv[0].uri, srv[1].uri);
    char job[64];
    snprintf(job, sizeof job, "rc%d%s", (int)getpid(), tag);
    for (int r = 0; r < 2; r++) {
        snprintf(tlog[r], sizeof tlog[r], "%s/%s-t%d.log", s_tmp, tag, r);
        snprintf(met[r], sizeof met[r], "%s/%s-t%d.jsonl", s_tmp, tag, r);
        const char *a[] = {"--data", s_data, "--servers", servers, "--num-trainers", "2",
                           "--trainer-id", idx[r], "--no-progress", "--metrics", met[r],
                           "--threads", "0", "--mode", "sync", "--model", "mlp", "--steps",
                           TSTEPS, "--eval-batches", "1", "--timeout-ms", "30000",
                           "--job", job, "--node-trainers", node ? "2" : "1", "--eval-every", "1",
                           "--device", device, r == 0 ? "--export" : NULL, out, NULL};
        pst_spawn_prog(&tr[r], "zps-trainer", tlog[r], a);
    }
    double restarted = 0;
    if (kill_at > 0) {
        char pat[32];
        snprintf(pat, sizeof pat, "\"step\":%d,", kill_at);
        while (!zt_file_has(met[1], pat))
            zps_sleep_ns(5000000);
        pst_kill(&srv[1], SIGKILL);
        zps_sleep_ns(300000000);
        sargs[1][10] = "--restore";
        snprintf(logs[1], sizeof logs[1], "%s", uri1);
        cr_assert_eq(pst_spawn(&srv[1], logs[1], sargs[1]), 0, "restart with --restore failed");
        restarted = zps_now_s();
    }
    for (int r = 0; r < 2; r++)
        s_expect_ok(&tr[r], tlog[r], 120);
    if (kill_at > 0)
        cr_log_info("%s: the trainers finished %.1f s after the restart", tag,
                    zps_now_s() - restarted);
    const char *uris[2] = {srv[0].uri, uri1};
    ps_client *c;
    cr_assert_eq(ps_client_new(uris, 2, 0, NULL, &c), ZPS_OK);
    for (int i = 0; i < 2; i++) {
        char *json = NULL;
        cr_assert_eq(ps_client_stats(c, i, &json), ZPS_OK, "%s", ps_client_last_error(c));
        uint64_t chunks = pst_stat(json, "chunks"), upd = pst_stat(json, "updates"),
                 restored = pst_stat(json, "updates_restored"),
                 undone = pst_stat(json, "updates_undone");
        cr_log_info("%s server %d: version %" PRIu64 ", updates %" PRIu64 " + restored %" PRIu64
                    " - undone %" PRIu64 ", rollbacks %" PRIu64, tag, i, pst_stat(json, "version"),
                    upd, restored, undone, pst_stat(json, "rollbacks"));
        cr_assert_eq(pst_stat(json, "version"), (uint64_t)atoi(TSTEPS), "%s", json);
        cr_assert_eq(upd + restored - undone, chunks * (uint64_t)atoi(TSTEPS), "%s", json);
        if (kill_at > 0 && i == 0)
            cr_assert_geq(pst_stat(json, "rollbacks"), 1, "server 0 never rolled back: %s", json);
        free(json);
    }
    ps_client_destroy(&c);
    for (int i = 0; i < 2; i++)
        pst_kill(&srv[i], SIGTERM);
}

/* The clean run on the cpu against a fault run on `device`, both flat or both as one node:
 * the same model, bit for bit. */
static void s_redo(const char *device, int node)
{
    pst_tmpdir(s_tmp, sizeof s_tmp);
    snprintf(s_data, sizeof s_data, "%s/fm", s_tmp);
    char log[700];
    snprintf(log, sizeof log, "%s/data.log", s_tmp);
    pst_server p;
    const char *args[] = {"convert", "fashion-mnist", "--out", s_data, "--limit", "2048",
                          "--shards", "2", NULL};
    pst_spawn_prog(&p, "zps-data", log, args);
    s_expect_ok(&p, log, 60);
    s_run("clean", 0, "cpu", node);
    s_run("fault", 27, device, node);
    char a[700], b[700];
    snprintf(a, sizeof a, "%s/clean.bin", s_tmp);
    snprintf(b, sizeof b, "%s/fault.bin", s_tmp);
    nn_weights *wa = NULL, *wb = NULL;
    cr_assert_eq(nn_weights_read(a, &wa), ZPS_OK);
    cr_assert_eq(nn_weights_read(b, &wb), ZPS_OK);
    cr_assert_eq(wa->param_count, wb->param_count);
    size_t bad = wa->param_count;
    for (size_t i = 0; i < wa->param_count && bad == wa->param_count; i++)
        if (memcmp(&wa->params[i], &wb->params[i], sizeof(float)))
            bad = i;
    cr_assert_eq(bad, wa->param_count, "weight %zu: %.9g after the recovery, %.9g without a fault",
                 bad, bad < wb->param_count ? (double)wb->params[bad] : 0.0,
                 bad < wa->param_count ? (double)wa->params[bad] : 0.0);
    nn_weights_destroy(&wa);
    nn_weights_destroy(&wb);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", s_tmp);
    int rc = system(cmd);
    (void)rc;
}

Test(it_ps_recover, trainers_redo_after_a_server_restore, .timeout = 300) { s_redo("cpu", 0); }

/* The same through the device path (trainer/stage.c on the staged back-end): the rollback's
 * older values reach the device copy, and the hand-offs go on after the failed step. */
Test(it_ps_recover, staged_trainers_redo_after_a_server_restore, .timeout = 300)
{
    s_redo("staged", 0);
}

/* A node of two staged trainers (--node-trainers 2): the leader's hand-offs fail during
 * backward while the node's bucket sums go on, its PS back-end rolls back in end_step, and
 * both ranks redo the same steps from the restored values. */
Test(it_ps_recover, node_redoes_after_a_server_restore, .timeout = 300)
{
    s_redo("staged", 1);
}

/* A sync job whose very first step is rolled back (its server killed during step 0 and
 * restored from the version-0 checkpoint): end_step says redo from step 0, and the redo and
 * the steps after it push and pull every variable, with the groups the first step learnt
 * (one per variable here, last first; the back-end is driven directly). The rarer case, a
 * push that cannot even be sent in step 0 while a rollback is pending, takes the other
 * branch of end_step (sync_ps.c's begin_step forgets the groups then); no test reaches it. */
static void s_no_hook(void *owner, nn_grad_hook hook, void *ctx)
{
    (void)owner, (void)hook, (void)ctx;
}

static zps_status s_ps_step(tr_sync *s, int64_t step, float *grads, size_t n)
{
    int stop = 0;
    zps_status st = s->begin_step(s, step, &stop);
    if (st == ZPS_OK)
        st = s->params_ready(s);
    for (size_t i = 0; i < n; i++)
        grads[i] = 0.001f * (float)((i + (size_t)step) % 7);
    for (int v = NV - 1; v >= 0 && st == ZPS_OK; v--)
        st = s->grads_ready(s, (size_t)v, 1);
    tr_step_record rec = tr_step_record_empty(step + 1);
    return st == ZPS_OK ? s->end_step(s, &rec) : st;
}

/* An in-process sync trainer (trainer/sync_ps.c) of s_vars against the server at uri. */
typedef struct s_tr {
    tr_config cfg;
    nn_var vars[NV];
    float *params, *grads;
    size_t n;
    const char *uris[1];
    tr_sync_env env;
} s_tr;

static void s_tr_init(s_tr *t, const char *uri, int id, int n_trainers)
{
    tr_config_default(&t->cfg);
    t->cfg.mode = TR_MODE_SYNC;
    t->cfg.timeout_ms = 2000;
    t->n = 0;
    for (int v = 0; v < NV; v++) {
        t->vars[v] = (nn_var){.offset = t->n, .count = s_vars[v].count, .ndim = 1,
                              .shape = {(int)s_vars[v].count}};
        snprintf(t->vars[v].name, sizeof t->vars[v].name, "%s", s_vars[v].name);
        t->n += s_vars[v].count;
    }
    t->params = zps_xcalloc(t->n, sizeof *t->params);
    t->grads = zps_xcalloc(t->n, sizeof *t->grads);
    for (size_t i = 0; i < t->n; i++)
        t->params[i] = 0.01f * (float)(i % 13);
    t->uris[0] = uri;
    t->env = (tr_sync_env){.cfg = &t->cfg, .id = id, .n_trainers = n_trainers,
                           .vars = t->vars, .nvars = NV, .nparams = t->n,
                           .params = t->params, .grads = t->grads, .uris = t->uris,
                           .n_uris = 1, .set_forward_hook = s_no_hook};
}

static void s_tr_free(s_tr *t)
{
    free(t->params);
    free(t->grads);
}

Test(it_ps_recover, a_rollback_in_the_first_step_is_redone, .timeout = 90)
{
    char tmp[512], ck[600];
    pst_tmpdir(tmp, sizeof tmp);
    snprintf(ck, sizeof ck, "%s/ck", tmp);
    const char *sargs[] = {"--mode", "sync", "--num-trainers", "1", "--checkpoint-dir", ck,
                           "--checkpoint-every-versions", "1", NULL, NULL};
    pst_server srv;
    cr_assert_eq(pst_spawn(&srv, NULL, sargs), 0);
    char uri[256];
    snprintf(uri, sizeof uri, "%s", srv.uri);
    static s_tr tr;
    s_tr_init(&tr, uri, 0, 1);
    float *grads = tr.grads;
    size_t n = tr.n;
    const char *const *uris = tr.uris;
    tr_sync *s = NULL;
    cr_assert_eq(tr_sync_ps_new(&tr.env, &s), ZPS_OK);
    int stop = 0;
    cr_assert_eq(s->begin_step(s, 0, &stop), ZPS_OK);
    cr_assert_eq(s->params_ready(s), ZPS_OK);
    pst_kill(&srv, SIGKILL); /* step 0 under way: its server comes back at version 0 */
    sargs[8] = "--restore";
    cr_assert_eq(pst_spawn(&srv, uri, sargs), 0, "restart with --restore failed");
    for (int v = NV - 1; v >= 0; v--)
        (void)s->grads_ready(s, (size_t)v, 1);
    tr_step_record rec = tr_step_record_empty(1);
    zps_status st = s->end_step(s, &rec);
    cr_assert_eq(st, ZPS_ERR_STALE, "step 0 after the restore: %s", zps_strerror(st));
    cr_assert_eq(s->redo_from, 0, "redo from %lld", (long long)s->redo_from);
    for (int64_t step = 0; step < 3; step++) {
        st = s_ps_step(s, step, grads, n);
        cr_assert_eq(st, ZPS_OK, "step %lld after the redo: %s", (long long)step,
                     zps_strerror(st));
    }
    int fresh;
    cr_assert_eq(s->finish(s, &fresh), ZPS_OK);
    cr_assert_eq(s->leave(s), ZPS_OK);
    tr_sync_destroy(&s);
    ps_client *c;
    cr_assert_eq(ps_client_new(uris, 1, 0, NULL, &c), ZPS_OK);
    char *json = NULL;
    cr_assert_eq(ps_client_stats(c, 0, &json), ZPS_OK, "%s", ps_client_last_error(c));
    cr_assert_eq(pst_stat(json, "version"), 3, "%s", json);
    free(json);
    ps_client_destroy(&c);
    pst_kill(&srv, SIGTERM);
    s_tr_free(&tr);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    int rc = system(cmd);
    (void)rc;
}

/* A backup worker (--replicas-to-aggregate 2 of 3) whose step the fleet finished without it:
 * each of its PUSHPULLs comes back stale, with no values. It catches up with one plain pull
 * per bucket, all sent before any is waited for (one round trip, not one a bucket), and
 * ends the step with the values the others got, bit for bit. */
Test(it_ps_recover, a_stale_backup_worker_pulls_its_buckets_together, .timeout = 60)
{
    const char *sargs[] = {"--mode", "sync", "--num-trainers", "3", "--replicas-to-aggregate",
                           "2", NULL};
    pst_server srv;
    cr_assert_eq(pst_spawn(&srv, NULL, sargs), 0);
    static s_tr tr[3];
    tr_sync *s[3] = {NULL};
    for (int i = 0; i < 3; i++) {
        s_tr_init(&tr[i], srv.uri, i, 3);
        cr_assert_eq(tr_sync_ps_new(&tr[i].env, &s[i]), ZPS_OK, "trainer %d", i);
    }
    for (int i = 0; i < 3; i++) { /* step 0 computes with version 0 everywhere */
        int stop = 0;
        cr_assert_eq(s[i]->begin_step(s[i], 0, &stop), ZPS_OK);
        cr_assert_eq(s[i]->params_ready(s[i]), ZPS_OK);
        for (size_t k = 0; k < tr[i].n; k++)
            tr[i].grads[k] = 0.001f * (float)((k + (size_t)i) % 7);
    }
    /* trainers 0 and 1 make version 1 (the first 2 pushes of a bucket win, so trainer 2
     * pushes only after their steps ended with the new values); trainer 2 comes too late */
    for (int i = 0; i < 3; i++) {
        for (int v = NV - 1; v >= 0; v--)
            cr_assert_eq(s[i]->grads_ready(s[i], (size_t)v, 1), ZPS_OK, "trainer %d", i);
        if (i == 1)
            for (int j = 0; j < 2; j++) {
                tr_step_record rec = tr_step_record_empty(1);
                cr_assert_eq(s[j]->end_step(s[j], &rec), ZPS_OK, "trainer %d", j);
            }
    }
    char tmp[512];
    pst_tmpdir(tmp, sizeof tmp);
    zps_log_set_level(ZPS_LOG_DEBUG);
    zt_capture_begin(tmp);
    tr_step_record rec = tr_step_record_empty(1);
    zps_status st = s[2]->end_step(s[2], &rec);
    char *log = zt_capture_end();
    zps_log_set_level(ZPS_LOG_WARN);
    cr_assert_eq(st, ZPS_OK, "the backup worker's stale step: %s", zps_strerror(st));
    cr_assert_not_null(strstr(log, "3 of 3 buckets came back stale: pulling them together"),
                       "the backup worker did not pull its buckets together:\n%s", log);
    free(log);
    cr_assert_eq(memcmp(tr[2].params, tr[0].params, tr[0].n * sizeof(float)), 0,
                 "the backup worker's values differ from version 1's");
    cr_assert_eq(memcmp(tr[1].params, tr[0].params, tr[0].n * sizeof(float)), 0);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(s[i]->leave(s[i]), ZPS_OK);
        tr_sync_destroy(&s[i]);
        s_tr_free(&tr[i]);
    }
    pst_kill(&srv, SIGTERM);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    int rc = system(cmd);
    (void)rc;
}
