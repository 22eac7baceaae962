/* test_exits.c — how zps processes end (suite it_exits: real processes on 127.0.0.1;
 * docs/training.md "Stopping and failing", docs/ps.md "Liveness" and "Stopping a server").
 *
 *  - A sync trainer that fails on a corrupt record sends LEAVE on its way out: its peer
 *    finishes its steps at once (the servers run with --trainer-timeout 0, so only LEAVE can
 *    free it; without LEAVE it stalls for the client's ~150 s of retries), and the failed
 *    trainer's summary record says "error".
 *  - --skip-corrupt N: the same fleet finishes and the summary counts the skipped records;
 *    one record past N is an error.
 *  - A trainer blocked on a dead server (kill -9) stops within about a second of SIGTERM,
 *    exit 0, with its summary record written.
 *  - The client's waits end on the stop flag (ZPS_ERR_INTERRUPTED) and at a deadline.
 *  - zps-server with --checkpoint-dir: SIGTERM writes a checkpoint of the current version
 *    and exits 0.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/mem.h"
#include "ps/ckpt.h"
#include "ps/client.h"
#include "tests/ps_test_util.h"
#include "tests/testutil.h"

static char s_tmp[512], s_data[600];

static void s_cleanup(void)
{
    if (s_tmp[0])
        zt_rmtmp(s_tmp);
}

TestSuite(it_exits, .fini = s_cleanup, .timeout = 240);

/* A small Fashion-MNIST copy in two shards; trainer 0 of 2 reads shard 0 (pipeline.h,
 * assignment). With corrupt, record 5 of shard 0 gets a flipped bit (its CRC fails). */
static void s_make_data(int corrupt)
{
    zt_mktmp(s_tmp, sizeof s_tmp, "zps-exits");
    snprintf(s_data, sizeof s_data, "%s/fm", s_tmp);
    char log[700];
    snprintf(log, sizeof log, "%s/data.log", s_tmp);
    zt_make_fashion(s_data, 2048, 2, log);
    if (corrupt) {
        char shard[700];
        snprintf(shard, sizeof shard, "%s/train/train-00000-of-00002", s_data);
        zt_shard_corrupt(shard, 5, 40, 0x10);
    }
}

/* The summary line of a metrics file (the caller frees; NULL when there is none). */
static char *s_summary_line(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    char line[4096];
    char *sum = NULL;
    while (fgets(line, sizeof line, f))
        if (strstr(line, "\"type\":\"summary\"")) {
            free(sum);
            sum = zps_xstrdup(line);
        }
    fclose(f);
    return sum;
}

/* The number after "key": in line (-1 when absent). */
static double s_num(const char *line, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(line, pat);
    return p ? strtod(p + strlen(pat), NULL) : -1;
}

/* Waits up to timeout_s for p to exit; its wait status (fails, dumping log, on a timeout). */
static int s_wait(pst_server *p, const char *log, double timeout_s)
{
    int st = pst_wait(p, timeout_s);
    if (st == -1) {
        pst_kill(p, SIGKILL);
        pst_dump(log);
        cr_assert_fail("%s did not end within %.0f s", log, timeout_s);
    }
    return st;
}

typedef struct s_trainer {
    pst_server p;
    char log[700], metrics[700];
} s_trainer;

/* Trainer id of n against uri with the mlp on s_data, then extra (NULL-terminated). */
static void s_start_trainer(s_trainer *t, const char *uri, int id, int n, const char *const *extra)
{
    char sid[8], sn[8];
    snprintf(sid, sizeof sid, "%d", id);
    snprintf(sn, sizeof sn, "%d", n);
    snprintf(t->log, sizeof t->log, "%s/t%d.log", s_tmp, id);
    snprintf(t->metrics, sizeof t->metrics, "%s/t%d.jsonl", s_tmp, id);
    const char *args[64];
    int k = 0;
    const char *base[] = {"--data", s_data, "--servers", uri, "--num-trainers", sn,
                          "--trainer-id", sid, "--model", "mlp", "--no-progress", "--metrics",
                          t->metrics, "--threads", "0", "--eval-batches", "1", NULL};
    for (int i = 0; base[i]; i++)
        args[k++] = base[i];
    for (int i = 0; extra[i]; i++)
        args[k++] = extra[i];
    args[k] = NULL;
    cr_assert_eq(pst_start(&t->p, "zps-trainer", t->log, args), 0);
}

/* ---- a corrupt record in a sync fleet ---- */

/* Data with a corrupt record in trainer 0's share, one sync server that never drops a
 * silent trainer (only LEAVE frees the peers), and its 2 trainers with extra flags. */
static void s_sync_fleet(pst_server *srv, s_trainer t[2], const char *const *extra)
{
    s_make_data(1);
    const char *sargs[] = {"--mode", "sync", "--num-trainers", "2", "--trainer-timeout", "0",
                           NULL};
    cr_assert_eq(pst_spawn(srv, NULL, sargs), 0);
    for (int r = 0; r < 2; r++)
        s_start_trainer(&t[r], srv->uri, r, 2, extra);
}

Test(it_exits, sync_trainer_failing_on_a_corrupt_record_leaves)
{
    pst_server srv;
    s_trainer t[2];
    /* debug: the logs say each stale push and catch-up (trainer/sync_ps.c), for a failure */
    const char *extra[] = {"--mode", "sync", "--steps", "30", "--log-level", "debug", NULL};
    s_sync_fleet(&srv, t, extra);
    /* trainer 0 meets the corrupt record within its first epoch (16 steps) */
    int st = s_wait(&t[0].p, t[0].log, 120);
    double t_fail = zps_now_s();
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) != 0, "trainer 0 should fail (status %d)", st);
    st = pst_wait(&t[1].p, 20);
    if (st == -1) { /* both sides of it */
        pst_kill(&t[1].p, SIGKILL);
        pst_dump(t[0].log);
        pst_dump(t[1].log);
        cr_assert_fail("%s did not end within 20 s", t[1].log);
    }
    double waited = zps_now_s() - t_fail;
    cr_log_info("trainer 1 ended %.2f s after trainer 0 failed", waited);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "trainer 1 failed (status %d)", st);
    cr_assert(zt_file_has(t[0].log, "sent LEAVE"), "trainer 0 did not say it left");
    char *sum0 = s_summary_line(t[0].metrics), *sum1 = s_summary_line(t[1].metrics);
    cr_assert_not_null(sum0, "trainer 0 wrote no summary record");
    cr_assert(strstr(sum0, "\"end\":\"error\""), "%s", sum0);
    cr_assert_not_null(sum1);
    cr_assert_eq(s_num(sum1, "steps"), 30, "%s", sum1);
    cr_assert(strstr(sum1, "\"end\":\"done\""), "%s", sum1);
    free(sum0);
    free(sum1);
    pst_kill(&srv, SIGTERM);
}

Test(it_exits, skip_corrupt_skips_and_counts)
{
    pst_server srv;
    s_trainer t[2];
    /* 32 steps of 64 = two epochs of trainer 0's 1024 records: the bad record twice */
    const char *extra[] = {"--mode", "sync", "--steps", "32", "--skip-corrupt", "5", NULL};
    s_sync_fleet(&srv, t, extra);
    for (int r = 0; r < 2; r++) {
        int st = s_wait(&t[r].p, t[r].log, 120);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
            pst_dump(t[r].log);
        cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "trainer %d failed (status %d)", r, st);
    }
    char *sum0 = s_summary_line(t[0].metrics);
    cr_assert_not_null(sum0);
    cr_assert_eq(s_num(sum0, "steps"), 32, "%s", sum0);
    cr_assert_eq(s_num(sum0, "skipped_records"), 2, "%s", sum0);
    cr_assert(strstr(sum0, "\"end\":\"done\""), "%s", sum0);
    cr_assert(zt_file_has(t[0].log, "skipping corrupt record"), "each skip is logged");
    free(sum0);
    pst_kill(&srv, SIGTERM);
}

Test(it_exits, one_corrupt_record_past_skip_corrupt_is_an_error)
{
    s_make_data(1);
    char log[700], metrics[700], *out = NULL;
    snprintf(log, sizeof log, "%s/local.log", s_tmp);
    snprintf(metrics, sizeof metrics, "%s/local.jsonl", s_tmp);
    /* 64 steps of 64 = two epochs of 2048 records: the bad record twice, once too often */
    const char *args[] = {"--data", s_data, "--model", "mlp", "--steps", "64", "--threads", "0",
                          "--eval-batches", "1", "--no-progress", "--metrics", metrics,
                          "--skip-corrupt", "1", NULL};
    int code = zt_run("zps-trainer", args, NULL, log, 120, &out);
    cr_assert_eq(code, 1);
    cr_assert(strstr(out, "more than --skip-corrupt 1"), "the log says why");
    free(out);
    char *sum = s_summary_line(metrics);
    cr_assert_not_null(sum);
    cr_assert_eq(s_num(sum, "skipped_records"), 2, "%s", sum);
    cr_assert(strstr(sum, "\"end\":\"error\""), "%s", sum);
    free(sum);
}

/* ---- signals ---- */

/* How many of process pid's threads take SIGTERM (do not block it), of *threads: from each
 * /proc/PID/task/TID/status's SigBlk mask. */
static int s_sigterm_takers(pid_t pid, int *threads)
{
    char dir[64];
    snprintf(dir, sizeof dir, "/proc/%d/task", (int)pid);
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "%s: %s", dir, strerror(errno));
    int takers = 0;
    *threads = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.')
            continue;
        char path[400], line[256];
        snprintf(path, sizeof path, "%s/%s/status", dir, e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) /* the thread ended since readdir */
            continue;
        unsigned long long blk = 0;
        int found = 0;
        while (fgets(line, sizeof line, f))
            found |= sscanf(line, "SigBlk: %llx", &blk) == 1;
        fclose(f);
        cr_assert(found, "no SigBlk line in %s", path);
        ++*threads;
        takers += !(blk & (1ull << (SIGTERM - 1)));
    }
    closedir(d);
    return takers;
}

/* An async server and one trainer on the fashion data (steps without end), once the
 * trainer has run 3 steps. */
static void s_async_trainer_at_step_3(pst_server *srv, s_trainer *t)
{
    s_make_data(0);
    const char *sargs[] = {"--mode", "async", "--num-trainers", "1", NULL};
    cr_assert_eq(pst_spawn(srv, NULL, sargs), 0);
    const char *extra[] = {"--mode", "async", "--steps", "1000000", NULL};
    s_start_trainer(t, srv->uri, 0, 1, extra);
    double end = zps_now_s() + 120;
    while (!zt_file_has(t->metrics, "\"step\":3,") && zps_now_s() < end)
        zps_sleep_ns(20000000);
    cr_assert(zt_file_has(t->metrics, "\"step\":3,"), "the trainer did not reach step 3");
}

Test(it_exits, sigterm_stops_a_trainer_blocked_on_a_dead_server)
{
    pst_server srv;
    s_trainer t;
    s_async_trainer_at_step_3(&srv, &t);
    /* One thread takes the signal: the signal thread, never one that computes, where a
     * handler's frame once landed on oneDNN's heap workspace (common/proc.h). */
    int threads, takers = s_sigterm_takers(t.p.pid, &threads);
    cr_log_info("%d of the trainer's %d threads take SIGTERM", takers, threads);
    cr_assert_eq(takers, 1, "%d of %d threads take SIGTERM", takers, threads);
    cr_assert_geq(threads, 4, "only %d threads: main, OpenMP, ZeroMQ, signals expected", threads);
    pst_kill(&srv, SIGKILL);
    zps_sleep_ns(1000000000ull); /* the trainer now waits for replies that never come */
    double t0 = zps_now_s();
    cr_assert_eq(kill(t.p.pid, SIGTERM), 0);
    int st = s_wait(&t.p, t.log, 30);
    double took = zps_now_s() - t0;
    cr_log_info("SIGTERM to exit: %.3f s", took);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d after SIGTERM", st);
    /* 0.5 s of it is the abandon deadline, the rest teardown that grows with load (3.6 s
     * seen on a starved machine); what this rules out is the ~150 s of retries */
    cr_assert(took < 6.0, "the trainer took %.2f s to stop", took);
    char *sum = s_summary_line(t.metrics);
    cr_assert_not_null(sum, "no summary record");
    cr_assert(strstr(sum, "\"end\":\"signal\""), "%s", sum);
    cr_assert(s_num(sum, "steps") >= 3, "%s", sum);
    free(sum);
}

/* The same stop delivered twice, as timeout(1) does (to its child, then to its process group):
 * the second SIGTERM, 0.1 s after the first, changes nothing, and the trainer stops
 * gracefully (exit 0, summary "end":"signal"). Until 2026-12-07 it killed the trainer
 * (make tsan's stop fleet: exit 143, no LEAVE, its sync peer stuck). The server is frozen
 * (SIGSTOP) meanwhile, so the trainer is surely still in its network waits, then its LEAVE
 * (0.5 s at most), when the second one comes. */
Test(it_exits, a_sigterm_delivered_twice_stops_a_trainer_gracefully)
{
    pst_server srv;
    s_trainer t;
    s_async_trainer_at_step_3(&srv, &t);
    cr_assert_eq(kill(srv.pid, SIGSTOP), 0);
    cr_assert_eq(kill(t.p.pid, SIGTERM), 0);
    zps_sleep_ns(100000000); /* the first one handled by now, as a rule: not coalesced */
    cr_assert_eq(kill(t.p.pid, SIGTERM), 0);
    int st = s_wait(&t.p, t.log, 30);
    cr_assert_eq(kill(srv.pid, SIGCONT), 0);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d after two SIGTERMs (%s)", st,
              WIFSIGNALED(st) ? strsignal(WTERMSIG(st)) : "exited");
    char *sum = s_summary_line(t.metrics);
    cr_assert_not_null(sum, "no summary record");
    cr_assert(strstr(sum, "\"end\":\"signal\""), "%s", sum);
    free(sum);
    pst_kill(&srv, SIGTERM);
}

/* --mode allreduce: a SIGTERM to rank 1 alone stops both ranks at the same step and
 * gracefully (each exits 0 with a summary: rank 1 "signal", rank 0 "done"), where until
 * 2026-11-27 only rank 0's wish counted and rank 1 trained on, its handler spent. */
Test(it_exits, sigterm_to_one_allreduce_rank_stops_both)
{
    s_make_data(0);
    char job[64], sid[2][8];
    snprintf(job, sizeof job, "exits-%d-%u", (int)getpid(), zt_rand());
    s_trainer t[2];
    for (int r = 0; r < 2; r++) {
        snprintf(sid[r], sizeof sid[r], "%d", r);
        snprintf(t[r].log, sizeof t[r].log, "%s/t%d.log", s_tmp, r);
        snprintf(t[r].metrics, sizeof t[r].metrics, "%s/t%d.jsonl", s_tmp, r);
        const char *args[] = {"--data", s_data, "--mode", "allreduce", "--num-trainers", "2",
                              "--trainer-id", sid[r], "--job", job, "--model", "mlp",
                              "--steps", "1000000", "--no-progress", "--metrics", t[r].metrics,
                              "--threads", "0", "--eval-batches", "1", NULL};
        cr_assert_eq(pst_start(&t[r].p, "zps-trainer", t[r].log, args), 0);
    }
    double end = zps_now_s() + 120;
    while (!(zt_file_has(t[0].metrics, "\"step\":3,") && zt_file_has(t[1].metrics, "\"step\":3,"))
           && zps_now_s() < end)
        zps_sleep_ns(20000000);
    cr_assert(zt_file_has(t[1].metrics, "\"step\":3,"), "the ranks did not reach step 3");
    cr_assert_eq(kill(t[1].p.pid, SIGTERM), 0);
    int st[2];
    for (int r = 1; r >= 0; r--) {
        st[r] = s_wait(&t[r].p, t[r].log, 30);
        if (!WIFEXITED(st[r]) || WEXITSTATUS(st[r]) != 0)
            pst_dump(t[r].log);
        cr_assert(WIFEXITED(st[r]) && WEXITSTATUS(st[r]) == 0, "rank %d: status %d", r, st[r]);
    }
    char *s0 = s_summary_line(t[0].metrics), *s1 = s_summary_line(t[1].metrics);
    cr_assert(s0 && s1, "a summary record is missing");
    cr_assert(strstr(s1, "\"end\":\"signal\""), "rank 1: %s", s1);
    cr_assert(strstr(s0, "\"end\":\"done\""), "rank 0: %s", s0);
    cr_assert(s_num(s0, "steps") == s_num(s1, "steps") && s_num(s0, "steps") >= 3,
              "rank 0 stopped after %.0f steps, rank 1 after %.0f", s_num(s0, "steps"),
              s_num(s1, "steps"));
    cr_assert(zt_file_has(t[1].log, "stopped by Terminated"), "rank 1 does not say why");
    free(s0), free(s1);
}

/* A trainer restarted while its predecessor still holds its id: stopped (SIGSTOP: silent,
 * its pid alive, as a predecessor on another host looks) it holds the id until the server's
 * --trainer-timeout passes, and the new one waits (--register-wait) instead of failing;
 * killed (kill -9 on this host) the new one finds the pid gone and takes the id at once. */
static void s_restart_after(int sig)
{
    s_make_data(0);
    pst_server srv;
    /* 8 s: the new trainer must register while the stopped one still holds the id, which on
     * a starved machine took over 2 s (the premise then failed, "it never had to wait") */
    const char *sargs[] = {"--mode", "async", "--num-trainers", "1", "--trainer-timeout", "8",
                           NULL};
    cr_assert_eq(pst_spawn(&srv, NULL, sargs), 0);
    s_trainer t;
    const char *forever[] = {"--mode", "async", "--steps", "1000000", NULL};
    s_start_trainer(&t, srv.uri, 0, 1, forever);
    double end = zps_now_s() + 120;
    while (!zt_file_has(t.metrics, "\"step\":3,") && zps_now_s() < end)
        zps_sleep_ns(20000000);
    cr_assert(zt_file_has(t.metrics, "\"step\":3,"), "the trainer did not reach step 3");
    pid_t old = t.p.pid;
    if (sig == SIGKILL)
        pst_kill(&t.p, SIGKILL);
    else
        cr_assert_eq(kill(old, SIGSTOP), 0);
    const char *five[] = {"--mode", "async", "--steps", "5", "--register-wait", "30", NULL};
    s_start_trainer(&t, srv.uri, 0, 1, five);
    int st = s_wait(&t.p, t.log, 90);
    if (sig != SIGKILL) {
        kill(old, SIGKILL);
        cr_assert_eq(waitpid(old, NULL, 0), old);
    }
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        pst_dump(t.log);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the restarted trainer: status %d", st);
    if (sig == SIGKILL) {
        cr_assert(!zt_file_has(t.log, "--register-wait"), "it waited for a dead predecessor");
        cr_assert(zt_file_has(t.log, "is gone: taking the id over"), "no takeover logged");
    } else {
        cr_assert(zt_file_has(t.log, "--register-wait"), "it never had to wait: the test "
                  "proves nothing");
    }
    char *sum = s_summary_line(t.metrics);
    cr_assert_not_null(sum, "no summary record");
    cr_assert(s_num(sum, "steps") == 5, "%s", sum);
    free(sum);
    pst_kill(&srv, SIGTERM);
}

Test(it_exits, a_restarted_trainer_waits_for_its_silent_predecessor)
{
    s_restart_after(SIGSTOP);
}

Test(it_exits, a_restarted_trainer_takes_over_from_its_killed_predecessor_at_once)
{
    s_restart_after(SIGKILL);
}

/* ---- the client's interruptible waits ---- */

static const ps_var s_vars[] = {{"w", 3000}, {"b", 10}};

typedef struct s_raise {
    atomic_int *flag;
    int after_ms;
} s_raise;

static void *s_raise_main(void *arg)
{
    s_raise *r = arg;
    zps_sleep_ns((uint64_t)r->after_ms * 1000000ull);
    *r->flag = 1;
    return NULL;
}

Test(it_exits, client_waits_end_on_the_stop_flag_and_at_a_deadline, .timeout = 30)
{
    pst_server srv;
    const char *sargs[] = {"--mode", "sync", "--num-trainers", "1", NULL};
    cr_assert_eq(pst_spawn(&srv, NULL, sargs), 0);
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, 2, 1, 0, &plan), ZPS_OK);
    static atomic_int stop;
    ps_client_opts o;
    ps_client_opts_default(&o);
    o.stop = &stop;
    const char *uris[1] = {srv.uri};
    ps_client *c;
    cr_assert_eq(ps_client_new(uris, 1, 0, &o, &c), ZPS_OK);
    cr_assert_eq(ps_client_register(c, plan, NULL, NULL), ZPS_OK);
    float *v = zps_xcalloc(plan->total, sizeof *v);
    ps_optim_config opt;
    ps_optim_default(&opt);
    cr_assert_eq(ps_client_init(c, v, &opt, NULL), ZPS_OK);
    /* sync: version 5 never comes, so the pull waits until the flag rises */
    ps_ticket tk;
    cr_assert_eq(ps_client_pull(c, 0, 2, v, 5, &tk), ZPS_OK);
    s_raise r = {&stop, 300};
    pthread_t th;
    double t0 = zps_now_s();
    pthread_create(&th, NULL, s_raise_main, &r);
    zps_status st = ps_client_wait(c, tk);
    double took = zps_now_s() - t0;
    pthread_join(th, NULL);
    cr_assert_eq(st, ZPS_ERR_INTERRUPTED, "%s", zps_strerror(st));
    /* within a poll slice (0.1 s) of the flag; the rest is slack for a loaded machine */
    cr_assert(took >= 0.29 && took < 1.5, "the wait ended %.3f s after it began", took);
    /* a deadline: the flag no longer interrupts, a live server answers LEAVE */
    ps_client_set_deadline(c, 500);
    cr_assert_eq(ps_client_leave(c), ZPS_OK, "%s", ps_client_last_error(c));
    /* and a wait for what never comes ends at the deadline */
    ps_client_set_deadline(c, 300);
    t0 = zps_now_s();
    cr_assert_eq(ps_client_pull(c, 0, 2, v, 6, &tk), ZPS_OK);
    cr_assert_eq(ps_client_wait(c, tk), ZPS_ERR_TIMEOUT);
    took = zps_now_s() - t0;
    cr_assert(took >= 0.29 && took < 1.5, "the deadline wait took %.3f s", took);
    ps_client_set_deadline(c, 0);
    ps_client_destroy(&c);
    free(v);
    ps_plan_destroy(&plan);
    pst_kill(&srv, SIGTERM);
}

/* ---- the server ---- */

Test(it_exits, sigterm_makes_the_server_checkpoint_and_exit_0, .timeout = 30)
{
    zt_mktmp(s_tmp, sizeof s_tmp, "zps-exits");
    pst_server srv;
    /* a periodic checkpoint every 2 versions exists; SIGTERM must add the last one */
    const char *sargs[] = {"--mode", "sync", "--num-trainers", "1", "--checkpoint-dir", s_tmp,
                           "--checkpoint-every-versions", "2", NULL};
    cr_assert_eq(pst_spawn(&srv, NULL, sargs), 0);
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, 2, 1, 0, &plan), ZPS_OK);
    uint64_t seed = pst_seed();
    ps_client *c = pst_client_init(srv.uri, plan, seed, NULL);
    float *g = zps_xmalloc(plan->total * sizeof *g), *v = zps_xmalloc(plan->total * sizeof *v);
    ps_ticket tk;
    for (int s = 0; s < 5; s++) {
        for (uint64_t i = 0; i < plan->total; i++)
            g[i] = pst_uniform(&seed);
        cr_assert_eq(ps_client_push(c, 0, 2, g, s, &tk), ZPS_OK);
        cr_assert_eq(ps_client_wait(c, tk), ZPS_OK, "%s", ps_client_last_error(c));
    }
    uint64_t ver = 0;
    cr_assert_eq(ps_client_pull(c, 0, 2, v, 5, &tk), ZPS_OK);
    cr_assert_eq(ps_client_wait_version(c, tk, &ver), ZPS_OK);
    cr_assert_eq(ver, 5);
    ps_client_destroy(&c);
    int st = pst_kill(&srv, SIGTERM);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "server status %d after SIGTERM", st);
    char path[700], why[256];
    ps_ckpt_path(s_tmp, 0, path, sizeof path);
    ps_ckpt ck;
    cr_assert_eq(ps_ckpt_read(path, &ck, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_eq(ck.local_total, plan->total);
    for (uint32_t k = 0; k < ck.n_local; k++)
        cr_assert_eq(ck.chunks[k].version, 5, "chunk %u is at version %llu", k,
                     (unsigned long long)ck.chunks[k].version);
    cr_assert(!memcmp(ck.values, v, plan->total * sizeof *v),
              "the checkpoint does not hold the final values (seed %llu)",
              (unsigned long long)seed);
    ps_ckpt_free(&ck);
    free(g);
    free(v);
    ps_plan_destroy(&plan);
}
