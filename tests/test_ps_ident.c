/* test_ps_ident.c — trainer identity (docs/ps.md "Trainer identity"): two live processes
 * with one trainer id. The second is refused at REGISTER with a message naming both (host,
 * pid); nothing it sends is applied; the id is free again once its holder LEAVEs, or dies
 * or stops and is silent past --trainer-timeout, and the new incarnation's updates count
 * exactly once; a successor on the holder's host that finds the holder's pid gone takes
 * the id at once. The values are compared bit for bit with the same updates applied here. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/mem.h"
#include "ps/client.h"
#include "ps/optim.h"
#include "ps/plan.h"
#include "tests/ps_test_util.h"

static const ps_var s_vars[] = {{"w", 3000}, {"b", 10}};
#define NV 2
#define STEPS_A 6 /* the first holder's pushes */
#define STEPS_C 3 /* the incarnation after its LEAVE */
#define STEPS_D 2 /* the incarnation after C's death */
#define STEPS (STEPS_A + STEPS_C + STEPS_D)

/* What a child process reports on its pipe. */
typedef struct report {
    int reg;      // REGISTER's status
    int push;     // the status of its pushes (the first failure)
    char msg[600];
} report;

static ps_client *s_client(const char *uri, int heartbeat_thread)
{
    const char *uris[1] = {uri};
    ps_client_opts o;
    ps_client_opts_default(&o);
    o.heartbeat_ms = 200; // well inside the server's --trainer-timeout 1
    o.heartbeat_thread = heartbeat_thread;
    o.timeout_ms = 5000;
    ps_client *c;
    cr_assert_eq(ps_client_new(uris, 1, 0, &o, &c), ZPS_OK);
    return c;
}

/* Pushes g[first..first + n) as steps first.. and waits for each; the first failure. */
static zps_status s_push_steps(ps_client *c, float *const *g, int first, int n)
{
    for (int s = first; s < first + n; s++) {
        ps_ticket t;
        zps_status st = ps_client_push(c, 0, NV, g[s], s, &t);
        if (st == ZPS_OK)
            st = ps_client_wait(c, t);
        if (st != ZPS_OK)
            return st;
    }
    return ZPS_OK;
}

/* The child: trainer 0 in a process of its own. Registers, pushes steps [first, first + n)
 * (also when refused: a request of an incarnation the server did not register), reports on
 * fd, then stays alive (heartbeating) until its parent closes hold, or exits at once. */
static void s_child(const char *uri, const ps_plan *plan, float *const *g, int first, int n,
                    int fd, int hold)
{
    ps_client *c = s_client(uri, 1);
    report r = {0};
    r.reg = ps_client_register(c, plan, NULL, NULL);
    snprintf(r.msg, sizeof r.msg, "%s", ps_client_last_error(c));
    r.push = s_push_steps(c, g, first, n);
    if (r.reg == ZPS_OK && r.push != ZPS_OK)
        snprintf(r.msg, sizeof r.msg, "%s", ps_client_last_error(c));
    if (write(fd, &r, sizeof r) != (ssize_t)sizeof r)
        _exit(3);
    char b;
    if (hold >= 0)
        while (read(hold, &b, 1) > 0)
            ;
    _exit(0); // the parent's test state is not ours to tear down
}

/* Forks s_child; its report into *r. *hold_w (when not NULL) keeps the child alive until
 * closed. Returns the child's pid. */
static pid_t s_spawn_child(const char *uri, const ps_plan *plan, float *const *g, int first,
                           int n, report *r, int *hold_w)
{
    int fds[2], hold[2] = {-1, -1};
    cr_assert_eq(pipe(fds), 0);
    if (hold_w)
        cr_assert_eq(pipe(hold), 0);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        if (hold_w)
            close(hold[1]);
        s_child(uri, plan, g, first, n, fds[1], hold[0]);
    }
    close(fds[1]);
    if (hold_w) {
        close(hold[0]);
        *hold_w = hold[1];
    }
    cr_assert_eq(read(fds[0], r, sizeof *r), (ssize_t)sizeof *r, "child %d reported nothing",
                 (int)pid);
    close(fds[0]);
    return pid;
}

/* The refusal names both processes: host and pid of the holder and of the newcomer. */
static void s_expect_names(const char *msg, pid_t holder, pid_t newcomer)
{
    char host[64] = "", want[160];
    cr_assert_eq(gethostname(host, sizeof host), 0);
    host[sizeof host - 1] = 0;
    snprintf(want, sizeof want, "held by a live process, host %s pid %d (", host, (int)holder);
    cr_expect(strstr(msg, want), "want '%s' in '%s'", want, msg);
    snprintf(want, sizeof want, "comes from host %s pid %d (", host, (int)newcomer);
    cr_expect(strstr(msg, want), "want '%s' in '%s'", want, msg);
}

static long long s_stat(ps_client *c, const char *key)
{
    char *json, want[96];
    cr_assert_eq(ps_client_stats(c, 0, &json), ZPS_OK);
    snprintf(want, sizeof want, "\"%s\":", key);
    const char *p = strstr(json, want);
    long long v = p ? atoll(p + strlen(want)) : -1;
    free(json);
    return v;
}

/* A server in mode with one plan, the initial values and every step's gradient. */
typedef struct fx {
    pst_server srv;
    ps_plan *plan;
    uint64_t n, seed;
    float *ref;       // (n) the initial values, then what the steps make of them
    float *g[STEPS];  // (n) each
    ps_optim_config o;
} fx;

static void s_fx_new_timeout(fx *f, const char *mode, const char *trainers, const char *timeout)
{
    f->seed = pst_seed();
    uint64_t r = f->seed;
    cr_assert_eq(ps_plan_new(s_vars, NV, 1, 0, &f->plan), ZPS_OK);
    f->n = f->plan->total;
    const char *args[] = {"--mode", mode, "--num-trainers", trainers, "--trainer-timeout",
                          timeout, NULL};
    cr_assert_eq(pst_spawn(&f->srv, NULL, args), 0);
    f->ref = zps_xmalloc(f->n * 4);
    for (uint64_t i = 0; i < f->n; i++)
        f->ref[i] = pst_uniform(&r);
    for (int s = 0; s < STEPS; s++) {
        f->g[s] = zps_xmalloc(f->n * 4);
        for (uint64_t i = 0; i < f->n; i++)
            f->g[s][i] = pst_uniform(&r);
    }
    ps_optim_default(&f->o);
    f->o.lr = 0.25;
}

static void s_fx_new(fx *f, const char *mode, const char *trainers)
{
    s_fx_new_timeout(f, mode, trainers, "1");
}

static void s_fx_free(fx *f)
{
    pst_kill(&f->srv, SIGTERM);
    for (int s = 0; s < STEPS; s++)
        free(f->g[s]);
    free(f->ref);
    ps_plan_destroy(&f->plan);
}

/* Every accepted step applied exactly once, in order, and the refused ones not at all: the
 * values (through c) are the first `steps` updates bit for bit, and STATS adds up. */
static void s_expect_steps(fx *f, ps_client *c, int steps)
{
    float *v = zps_xmalloc(f->n * 4);
    for (int s = 0; s < steps; s++)
        ps_optim_apply(&f->o, (uint64_t)s, f->ref, NULL, f->g[s], f->n);
    ps_ticket t;
    cr_assert_eq(ps_client_pull(c, 0, NV, v, -1, &t), ZPS_OK);
    cr_assert_eq(ps_client_wait(c, t), ZPS_OK, "%s", ps_client_last_error(c));
    cr_assert(!memcmp(v, f->ref, f->n * 4), "values differ from %d steps applied once each "
              "(seed %llu)", steps, (unsigned long long)f->seed);
    free(v);
    cr_expect_eq(s_stat(c, "version"), steps);
    cr_expect_eq(s_stat(c, "updates"), (long long)steps * f->plan->n_chunks);
    cr_expect_eq(s_stat(c, "pushes"), (long long)steps * f->plan->n_chunks);
}

/* A holds trainer 0, initialises and pushes; B, a second process with id 0, is refused at
 * REGISTER (naming both) and its push too; A goes on. Returns A. */
static ps_client *s_phase_second_refused(fx *f)
{
    ps_client *a = s_client(f->srv.uri, 1);
    cr_assert_eq(ps_client_register(a, f->plan, NULL, NULL), ZPS_OK, "%s", ps_client_last_error(a));
    cr_assert_eq(ps_client_init(a, f->ref, &f->o, NULL), ZPS_OK, "%s", ps_client_last_error(a));
    cr_assert_eq(s_push_steps(a, f->g, 0, STEPS_A / 2), ZPS_OK, "%s", ps_client_last_error(a));
    report rep;
    pid_t b = s_spawn_child(f->srv.uri, f->plan, f->g, STEPS_A / 2, 1, &rep, NULL);
    cr_assert_eq(waitpid(b, NULL, 0), b);
    cr_assert_eq(rep.reg, ZPS_ERR_EXISTS, "second process: got %s: %s (seed %llu)",
                 zps_status_name(rep.reg), rep.msg, (unsigned long long)f->seed);
    s_expect_names(rep.msg, getpid(), b);
    cr_expect_eq(rep.push, ZPS_ERR_TRAINER, "its push: %s", zps_status_name(rep.push));
    cr_assert_eq(s_push_steps(a, f->g, STEPS_A / 2, STEPS_A - STEPS_A / 2), ZPS_OK,
                 "A after B: %s", ps_client_last_error(a));
    return a;
}

/* A leaves: C (a process kept alive through *hold) takes the id over and pushes; A, no
 * longer the holder, is refused while C lives. Returns C's pid. */
static pid_t s_phase_after_leave(fx *f, ps_client *a, int *hold)
{
    cr_assert_eq(ps_client_leave(a), ZPS_OK);
    report rep;
    pid_t cpid = s_spawn_child(f->srv.uri, f->plan, f->g, STEPS_A, STEPS_C, &rep, hold);
    cr_assert_eq(rep.reg, ZPS_OK, "after LEAVE: %s", rep.msg);
    cr_assert_eq(rep.push, ZPS_OK, "after LEAVE: %s", rep.msg);
    float *v = zps_xmalloc(f->n * 4);
    ps_ticket t;
    cr_assert_eq(ps_client_pull(a, 0, NV, v, -1, &t), ZPS_OK);
    zps_status st = ps_client_wait(a, t);
    cr_assert_eq(st, ZPS_ERR_EXISTS, "the replaced holder: got %s: %s", zps_status_name(st),
                 ps_client_last_error(a));
    s_expect_names(ps_client_last_error(a), cpid, getpid());
    free(v);
    return cpid;
}

/* D is refused while C lives; C stops (SIGSTOP: silent, and its pid still exists, as a
 * holder on another host looks to D); D gets the id once C timed out and pushes; C is then
 * killed. Returns D. */
static ps_client *s_phase_after_kill(fx *f, pid_t cpid, int hold)
{
    ps_client *d = s_client(f->srv.uri, 0);
    zps_status st = ps_client_register(d, f->plan, NULL, NULL);
    cr_assert_eq(st, ZPS_ERR_EXISTS, "while C lives: got %s: %s", zps_status_name(st),
                 ps_client_last_error(d));
    s_expect_names(ps_client_last_error(d), cpid, getpid());
    double t_stop = zps_now_s();
    kill(cpid, SIGSTOP);
    while ((st = ps_client_register(d, f->plan, NULL, NULL)) == ZPS_ERR_EXISTS &&
           zps_now_s() < t_stop + 10)
        zps_sleep_ns(100000000);
    double took = zps_now_s() - t_stop;
    kill(cpid, SIGKILL);
    cr_assert_eq(waitpid(cpid, NULL, 0), cpid);
    close(hold);
    cr_assert_eq(st, ZPS_OK, "after C fell silent: %s", ps_client_last_error(d));
    cr_assert_geq(took, 0.5, "a live (stopped) holder lost its id after %.2f s, before "
                  "--trainer-timeout 1", took);
    cr_log_info("the id was free %.2f s after SIGSTOP (--trainer-timeout 1)", took);
    cr_assert_eq(s_push_steps(d, f->g, STEPS_A + STEPS_C, STEPS_D), ZPS_OK, "%s",
                 ps_client_last_error(d));
    return d;
}

/* async, --trainer-timeout 1: holder A (this process), B refused while A lives, C after A's
 * LEAVE (and A refused once C holds the id), D refused while C lives, then accepted once C
 * was stopped and timed out. Every accepted push counts once, no refused one at all. */
Test(it_ps_ident, a_second_live_process_with_one_trainer_id_is_refused, .timeout = 60)
{
    fx f;
    s_fx_new(&f, "async", "2");
    ps_client *a = s_phase_second_refused(&f);
    int hold;
    pid_t cpid = s_phase_after_leave(&f, a, &hold);
    ps_client *d = s_phase_after_kill(&f, cpid, hold);
    s_expect_steps(&f, d, STEPS);
    /* B, A's re-REGISTER, D (and D's tries until C timed out) */
    cr_expect_geq(s_stat(d, "ZPS_ERR_EXISTS"), 3);
    cr_expect_geq(s_stat(d, "ZPS_ERR_TRAINER"), 2, "B's push and A's pull");
    ps_client_destroy(&a);
    ps_client_destroy(&d);
    s_fx_free(&f);
}

/* async, --trainer-timeout 100: C holds the id and is killed (kill -9, no LEAVE); D, a new
 * process on the same host, is first told who holds the id, finds that pid gone and takes
 * the id over with its next REGISTER, long before the timeout. Its pushes count once. */
Test(it_ps_ident, a_successor_finds_its_dead_holder_and_takes_the_id_at_once, .timeout = 60)
{
    fx f;
    s_fx_new_timeout(&f, "async", "2", "100");
    ps_client *a = s_phase_second_refused(&f);
    int hold;
    pid_t cpid = s_phase_after_leave(&f, a, &hold);
    kill(cpid, SIGKILL);
    cr_assert_eq(waitpid(cpid, NULL, 0), cpid);
    close(hold);
    double t0 = zps_now_s();
    ps_client *d = s_client(f.srv.uri, 0);
    zps_status st = ps_client_register(d, f.plan, NULL, NULL);
    cr_assert_eq(st, ZPS_OK, "the successor of a killed holder (--trainer-timeout 100): %s: %s",
                 zps_status_name(st), ps_client_last_error(d));
    cr_log_info("the id was taken over %.2f s after kill -9", zps_now_s() - t0);
    cr_assert_eq(s_push_steps(d, f.g, STEPS_A + STEPS_C, STEPS_D), ZPS_OK, "%s",
                 ps_client_last_error(d));
    s_expect_steps(&f, d, STEPS);
    /* B, A's re-REGISTER, D's first REGISTER (which named the dead holder) */
    cr_expect_eq(s_stat(d, "ZPS_ERR_EXISTS"), 3);
    ps_client_destroy(&a);
    ps_client_destroy(&d);
    s_fx_free(&f);
}

/* sync with one trainer: the second process is refused before it can push anything (it
 * used to fail later, on "elements pushed more than once"); every step is A's alone. */
Test(it_ps_ident, sync_refuses_a_second_process_before_it_pushes, .timeout = 30)
{
    fx f;
    s_fx_new(&f, "sync", "1");
    ps_client *a = s_phase_second_refused(&f);
    s_expect_steps(&f, a, STEPS_A);
    cr_expect_eq(s_stat(a, "ZPS_ERR_EXISTS"), 1);
    cr_expect_eq(s_stat(a, "stale_dropped"), 0);
    ps_client_destroy(&a);
    s_fx_free(&f);
}

/* Two servers whose views of the holder differ (server 0 times it out after 1 s, server 1
 * after 100 s): a newcomer that server 1 refuses LEAVEs both, so server 0 hands the id
 * back and the holder, silent but alive, goes on instead of being refused there. */
Test(it_ps_ident, a_refusal_by_one_server_hands_the_id_back_on_the_others, .timeout = 30)
{
    uint64_t seed = pst_seed(), r = seed;
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, NV, 2, 0, &plan), ZPS_OK);
    cr_assert(plan->server_chunks[0] && plan->server_chunks[1]);
    pst_server srv[2];
    const char *to[2] = {"1", "100"};
    for (int i = 0; i < 2; i++) {
        const char *args[] = {"--mode", "async", "--num-trainers", "1", "--trainer-timeout",
                              to[i], NULL};
        cr_assert_eq(pst_spawn(&srv[i], NULL, args), 0);
    }
    const char *uris[2] = {srv[0].uri, srv[1].uri};
    ps_client_opts o;
    ps_client_opts_default(&o);
    o.timeout_ms = 5000;
    ps_client *x, *y;
    cr_assert_eq(ps_client_new(uris, 2, 0, &o, &x), ZPS_OK);
    cr_assert_eq(ps_client_new(uris, 2, 0, &o, &y), ZPS_OK);
    float *v = zps_xmalloc(plan->total * 4);
    for (uint64_t i = 0; i < plan->total; i++)
        v[i] = pst_uniform(&r);
    ps_optim_config oc;
    ps_optim_default(&oc);
    cr_assert_eq(ps_client_register(x, plan, NULL, NULL), ZPS_OK, "%s", ps_client_last_error(x));
    cr_assert_eq(ps_client_init(x, v, &oc, NULL), ZPS_OK, "%s", ps_client_last_error(x));
    zps_sleep_ns(1600000000ull); // x is silent: past server 0's timeout, not server 1's
    zps_status st = ps_client_register(y, plan, NULL, NULL);
    cr_assert_eq(st, ZPS_ERR_EXISTS, "got %s: %s", zps_status_name(st), ps_client_last_error(y));
    ps_ticket t;
    cr_assert_eq(ps_client_push(x, 0, NV, v, 0, &t), ZPS_OK);
    st = ps_client_wait(x, t);
    cr_assert_eq(st, ZPS_OK, "the holder after a refused newcomer: %s: %s (seed %llu)",
                 zps_status_name(st), ps_client_last_error(x), (unsigned long long)seed);
    ps_client_destroy(&x);
    ps_client_destroy(&y);
    for (int i = 0; i < 2; i++)
        pst_kill(&srv[i], SIGTERM);
    free(v);
    ps_plan_destroy(&plan);
}
