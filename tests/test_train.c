/* test_train.c — zps-trainer end to end (suite it_train: real processes on 127.0.0.1).
 *
 * equivalence: sync PS with 2 trainers of batch b, sync PS with the same 2 trainers as one
 * node (--node-trainers 2: they all-reduce, trainer 0 pushes for both), all-reduce with 2
 * trainers of batch b and one local trainer of batch 2b end with the same weights after 20
 * steps (SGD and momentum), for the MLP and the small convnet. All read the same global batch stream
 * (--shard batch), dropout is off, and the convnet's local run sees its 2b images as two
 * micro-batches of b (--accumulate 2) so batchnorm normalises over the same b images as
 * each trainer does; the only difference left is float summation order.
 * Tolerance: |a - b| <= 1e-5 + 1e-3 * |local| per weight.
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/log.h"
#include "tests/ps_test_util.h"
#include "tests/train_test_util.h"
#include "tests/testutil.h"
#include "trainer/nn/nn.h"

static char s_tmp[512], s_data[600];

/* Converts Fashion-MNIST (its first `limit` images of each split, or all when limit is
 * NULL) into 2 shards under a fresh s_tmp, at s_data. */
static void s_convert(const char *limit, double timeout_s)
{
    pst_tmpdir(s_tmp, sizeof s_tmp);
    snprintf(s_data, sizeof s_data, "%s/fm", s_tmp);
    char log[700];
    snprintf(log, sizeof log, "%s/data.log", s_tmp);
    pst_server p;
    const char *args[] = {"convert", "fashion-mnist", "--out", s_data, "--shards", "2",
                          limit ? "--limit" : NULL, limit, NULL};
    trt_spawn(&p, "zps-data", log, args);
    trt_expect_ok(&p, log, timeout_s);
}

static void s_cleanup(void)
{
    if (s_tmp[0]) {
        char cmd[700];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", s_tmp);
        int rc = system(cmd);
        (void)rc;
    }
}

/* One equivalence run of model with optimizer opt. The MLP's local run takes batch 2b in
 * one pass; the convnet's takes 2 micro-batches of b (--accumulate 2), because batchnorm
 * normalises over the images one forward sees: that is what a trainer of batch b does. */
static void s_equivalence(const char *model, const char *opt)
{
    s_convert("2048", 60);
    /* one thread on every side, as all-reduce's two trainers on this machine get: oneDNN's
     * blocked convolutions split their weight-gradient sums by thread, so a 2-thread local run
     * adds in another order, and 20 steps of a batchnorm net carry that past the tolerance */
    setenv("OMP_NUM_THREADS", "1", 1);
    int bn = strcmp(model, "convnet") == 0;
    const char *common[] = {"--data", s_data, "--model", model, "--steps", "20", "--shard",
                            "batch", "--optimizer", opt, "--eval-batches", "1", "--no-progress",
                            "--seed", "7", "--threads", "0", "--dropout", "0"};
    const int nc = sizeof common / sizeof common[0];
    char lw[700], aw[700], pw[700], iw[700], log[700], logs[2][700], id[2][4], job[64];
    snprintf(lw, sizeof lw, "%s/local.w", s_tmp);
    snprintf(aw, sizeof aw, "%s/ar.w", s_tmp);
    snprintf(pw, sizeof pw, "%s/ps.w", s_tmp);
    snprintf(iw, sizeof iw, "%s/init.w", s_tmp);
    snprintf(job, sizeof job, "eq%d", (int)getpid());
    for (int r = 0; r < 2; r++)
        snprintf(id[r], sizeof id[r], "%d", r);
    pst_server p, t[2];

    /* local, batch 2b; and the seeded start (lr 0) to check the runs really trained */
    const char *local[] = {"--mode", "local", "--lr", "0.05", "--batch-size", bn ? "16" : "32",
                           "--accumulate", bn ? "2" : "1", "--export", lw, NULL};
    trt_trainer(&p, s_tmp, "local", log, sizeof log, common, nc, local);
    trt_expect_ok(&p, log, 120);
    const char *init[] = {"--mode", "local", "--lr", "0", "--batch-size", bn ? "16" : "32",
                          "--accumulate", bn ? "2" : "1", "--export", iw, NULL};
    trt_trainer(&p, s_tmp, "init", log, sizeof log, common, nc, init);
    trt_expect_ok(&p, log, 120);

    /* all-reduce, 2 x b */
    for (int r = 0; r < 2; r++) {
        const char *more[] = {"--mode", "allreduce", "--lr", "0.05", "--batch-size", "16",
                              "--num-trainers", "2", "--trainer-id", id[r], "--job", job,
                              "--export", aw, NULL};
        char name[16];
        snprintf(name, sizeof name, "ar%d", r);
        trt_trainer(&t[r], s_tmp, name, logs[r], sizeof logs[r], common, nc, more);
    }
    for (int r = 0; r < 2; r++)
        trt_expect_ok(&t[r], logs[r], 120);

    /* sync PS: 2 servers, 2 x b */
    pst_server srv[2];
    const char *sargs[] = {"--mode", "sync", "--num-trainers", "2", NULL};
    char servers[600];
    trt_servers(srv, sargs, servers, sizeof servers);
    for (int r = 0; r < 2; r++) {
        const char *more[] = {"--mode", "sync", "--lr", "0.05", "--batch-size", "16",
                              "--num-trainers", "2", "--trainer-id", id[r], "--servers",
                              servers, "--export", pw, NULL};
        char name[16];
        snprintf(name, sizeof name, "ps%d", r);
        trt_trainer(&t[r], s_tmp, name, logs[r], sizeof logs[r], common, nc, more);
    }
    for (int r = 0; r < 2; r++)
        trt_expect_ok(&t[r], logs[r], 120);
    for (int s = 0; s < 2; s++)
        pst_kill(&srv[s], SIGTERM);

    /* sync PS through one node of 2 trainers (--node-trainers 2): the servers see 1 */
    char nw[700];
    snprintf(nw, sizeof nw, "%s/node.w", s_tmp);
    const char *nargs[] = {"--mode", "sync", "--num-trainers", "1", NULL};
    trt_servers(srv, nargs, servers, sizeof servers);
    snprintf(job, sizeof job, "nd%d", (int)getpid());
    for (int r = 0; r < 2; r++) {
        const char *more[] = {"--mode", "sync", "--lr", "0.05", "--batch-size", "16",
                              "--num-trainers", "2", "--trainer-id", id[r], "--servers",
                              servers, "--node-trainers", "2", "--job", job, "--export", nw,
                              NULL};
        char name[16];
        snprintf(name, sizeof name, "node%d", r);
        trt_trainer(&t[r], s_tmp, name, logs[r], sizeof logs[r], common, nc, more);
    }
    for (int r = 0; r < 2; r++)
        trt_expect_ok(&t[r], logs[r], 120);
    cr_assert(zt_file_has(logs[0], "pushes and pulls for the node"), "trainer 0 led no node");
    cr_assert(zt_file_has(logs[1], "all-reduces with the node"), "trainer 1 was no member");
    for (int s = 0; s < 2; s++)
        pst_kill(&srv[s], SIGTERM);

    double moved = trt_max_diff(lw, iw);
    cr_assert(moved > 1e-3, "20 steps moved no weight by more than %g", moved);
    trt_compare(lw, aw, "all-reduce 2 x b");
    trt_compare(lw, pw, "sync PS 2 x b");
    trt_compare(lw, nw, "sync PS through a node of 2 x b");
}

TestSuite(it_train, .fini = s_cleanup, .timeout = 300);

Test(it_train, equivalence_mlp_sgd) { s_equivalence("mlp", "sgd"); }
Test(it_train, equivalence_convnet_sgd) { s_equivalence("convnet", "sgd"); }
Test(it_train, equivalence_convnet_momentum) { s_equivalence("convnet", "momentum"); }

/* ---- fleets: 2 servers and 2 trainers ---- */

typedef struct s_fleet {
    pst_server srv[2];
    char servers[600];
    pst_server tr[2];
    char log[2][700], metrics[2][700];
} s_fleet;

static void s_fleet_servers(s_fleet *f, const char *const *sargs)
{
    trt_servers(f->srv, sargs, f->servers, sizeof f->servers);
}

/* Starts trainer r with the common flags plus extra (NULL-terminated). */
static void s_fleet_trainer(s_fleet *f, int r, const char *const *extra)
{
    static char id[2][4];
    snprintf(id[r], sizeof id[r], "%d", r);
    snprintf(f->log[r], sizeof f->log[r], "%s/t%d.log", s_tmp, r);
    if (!f->metrics[r][0])
        snprintf(f->metrics[r], sizeof f->metrics[r], "%s/t%d.jsonl", s_tmp, r);
    const char *args[64];
    int n = 0;
    const char *base[] = {"--data", s_data, "--servers", f->servers, "--num-trainers", "2",
                          "--trainer-id", id[r], "--no-progress", "--metrics",
                          f->metrics[r], "--threads", "0", NULL};
    for (int i = 0; base[i]; i++)
        args[n++] = base[i];
    for (int i = 0; extra[i]; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    trt_spawn(&f->tr[r], "zps-trainer", f->log[r], args);
}

static void s_fleet_stop(s_fleet *f)
{
    for (int r = 0; r < 2; r++)
        if (f->tr[r].pid > 0)
            pst_kill(&f->tr[r], SIGKILL);
    for (int s = 0; s < 2; s++)
        if (f->srv[s].pid > 0)
            pst_kill(&f->srv[s], SIGTERM);
}

/* Reads a metrics FIFO until the record of step `step` arrives (blocking reads: the writer
 * is the synchronisation). */
static void s_wait_step(const char *fifo, int step)
{
    char pat[32];
    snprintf(pat, sizeof pat, "\"step\":%d,", step);
    cr_assert(zt_file_has(fifo, pat), "the trainer ended before step %d", step);
}

/* A 2-trainer fleet in mode reaches 85% test accuracy; dtype: --push-dtype. */
static void s_reach_85(const char *mode, const char *dtype)
{
    s_convert(NULL, 120); // the accuracy targets are for the real test split
    s_fleet f = {0};
    const char *sargs[] = {"--mode", mode, "--num-trainers", "2", "--staleness", "2", NULL};
    s_fleet_servers(&f, sargs);
    const char *extra[] = {"--mode", mode, "--model", "convnet", "--batch-size", "32",
                           "--optimizer", "momentum", "--lr", "0.02", "--epochs", "3",
                           "--eval-every", "50", "--eval-batches", "8", "--stop-accuracy",
                           "0.85", "--staleness", "2", "--push-dtype", dtype, NULL};
    for (int r = 0; r < 2; r++)
        s_fleet_trainer(&f, r, extra);
    trt_expect_ok(&f.tr[0], f.log[0], 400);
    /* trainer 0 stopped at the target; trainer 1 is not needed any more */
    pst_kill(&f.tr[1], SIGTERM);
    f.tr[1].pid = 0;
    s_fleet_stop(&f);
    double acc = trt_summary(f.metrics[0], "best_accuracy");
    double t85 = trt_summary(f.metrics[0], "time_to_target");
    cr_log_info("%s, %s gradients: best accuracy %.4f, time to 85%% %.1f s", mode, dtype, acc, t85);
    cr_assert(acc >= 0.85, "%s fleet (%s gradients) reached only %.4f test accuracy", mode,
              dtype, acc);
}

Test(it_train, async_fleet_reaches_85_percent, .timeout = 450) { s_reach_85("async", "f32"); }
/* ssp also carries the bfloat16 wire format end to end: half the bytes, same target */
Test(it_train, ssp_fleet_with_bf16_gradients_reaches_85_percent, .timeout = 450)
{
    s_reach_85("ssp", "bf16");
}

/* Trainer 1's metrics go to a FIFO, so that the test can follow its steps as they come. */
static void s_trainer1_fifo(s_fleet *f)
{
    snprintf(f->metrics[1], sizeof f->metrics[1], "%s/t1.fifo", s_tmp);
    cr_assert_eq(mkfifo(f->metrics[1], 0600), 0);
}

/* Kills trainer 1 (SIGKILL, reaped); trainer 0 must still exit 0 after its `steps` steps. */
static void s_kill1_trainer0_finishes(s_fleet *f, int steps)
{
    cr_assert(kill(f->tr[1].pid, SIGKILL) == 0);
    pst_wait(&f->tr[1], 10);
    f->tr[1].pid = 0;
    trt_expect_ok(&f->tr[0], f->log[0], 120);
    cr_assert_eq(trt_summary(f->metrics[0], "steps"), steps);
}

/* async: kill -9 one trainer mid-run; the other finishes all its steps. */
Test(it_train, async_survives_a_killed_trainer)
{
    s_convert("2048", 60);
    s_fleet f = {0};
    const char *sargs[] = {"--mode", "async", "--num-trainers", "2", NULL};
    s_fleet_servers(&f, sargs);
    s_trainer1_fifo(&f);
    const char *e0[] = {"--mode", "async", "--model", "mlp", "--steps", "150",
                        "--eval-batches", "1", NULL};
    const char *e1[] = {"--mode", "async", "--model", "mlp", "--steps", "100000",
                        "--eval-batches", "1", NULL};
    s_fleet_trainer(&f, 1, e1);
    s_wait_step(f.metrics[1], 5);
    s_fleet_trainer(&f, 0, e0);
    s_kill1_trainer0_finishes(&f, 150);
    s_fleet_stop(&f);
}

/* sync with --trainer-timeout: kill one trainer; the other goes on after the timeout. */
Test(it_train, sync_goes_on_after_trainer_timeout)
{
    s_convert("2048", 60);
    s_fleet f = {0};
    const char *sargs[] = {"--mode", "sync", "--num-trainers", "2", "--trainer-timeout", "2",
                           NULL};
    s_fleet_servers(&f, sargs);
    s_trainer1_fifo(&f);
    const char *e[] = {"--mode", "sync", "--model", "mlp", "--steps", "40", "--eval-batches",
                       "1", NULL};
    s_fleet_trainer(&f, 0, e);
    s_fleet_trainer(&f, 1, e);
    s_wait_step(f.metrics[1], 10);
    s_kill1_trainer0_finishes(&f, 40);
    s_fleet_stop(&f);
}

/* The requests of type op ("pull", "pushpull", ...) server stats JSON s counts. */
static long s_requests(const char *s, const char *op)
{
    const char *r = strstr(s, "\"requests\":");
    char pat[32];
    snprintf(pat, sizeof pat, "\"%s\":", op);
    const char *p = r ? strstr(r, pat) : NULL;
    cr_assert_not_null(p, "no requests.%s in %s", op, s);
    return strtol(p + strlen(pat), NULL, 10);
}

/* sync: each layer group's pull rides on its push (PUSHPULL), so the values come back while
 * backward goes on; the only plain pulls are each trainer's first and last. */
Test(it_train, sync_pulls_ride_on_the_pushes)
{
    s_convert("2048", 60);
    s_fleet f = {0};
    const char *sargs[] = {"--mode", "sync", "--num-trainers", "2", NULL};
    s_fleet_servers(&f, sargs);
    const char *e[] = {"--mode", "sync", "--model", "mlp", "--steps", "20", "--eval-batches",
                       "1", NULL};
    for (int r = 0; r < 2; r++)
        s_fleet_trainer(&f, r, e);
    for (int r = 0; r < 2; r++)
        trt_expect_ok(&f.tr[r], f.log[r], 120);
    long pulls = 0, pushpulls = 0;
    for (int s = 0; s < 2; s++) {
        const char *args[] = {"stats", "--servers", f.srv[s].uri, NULL};
        char *out = NULL;
        cr_assert_eq(zt_run_tmp("zps-ctl", args, NULL, 30, &out), 0);
        pulls += s_requests(out, "pull");
        pushpulls += s_requests(out, "pushpull");
        cr_assert_eq(s_requests(out, "push"), 0, "sync pushed without PUSHPULL: %s", out);
        free(out);
    }
    cr_assert_geq(pushpulls, 2 * 20, "PUSHPULLs: %ld", pushpulls);
    cr_assert_leq(pulls, 2 * 2 * 2, "plain pulls: %ld (one per group and step?)", pulls);
    s_fleet_stop(&f);
}

/* A node whose leader the servers refuse (they expect 2 trainers, the node counts as 1): both
 * of its trainers fail, each saying why (the member cannot see the servers itself). */
Test(it_train, node_leader_refused_fails_every_rank_with_the_reason)
{
    s_convert("256", 60);
    pst_server srv[2], t[2];
    const char *sargs[] = {"--mode", "sync", "--num-trainers", "2", NULL};
    char servers[600], logs[2][700], id[2][4], job[64];
    trt_servers(srv, sargs, servers, sizeof servers);
    snprintf(job, sizeof job, "nr%d", (int)getpid());
    const char *common[] = {"--data", s_data, "--model", "mlp", "--steps", "2", "--no-progress",
                            "--threads", "0", "--batch-size", "16", "--eval-batches", "1"};
    for (int r = 0; r < 2; r++) {
        snprintf(id[r], sizeof id[r], "%d", r);
        const char *more[] = {"--mode", "sync", "--num-trainers", "2", "--trainer-id", id[r],
                              "--servers", servers, "--node-trainers", "2", "--job", job,
                              NULL};
        char name[16];
        snprintf(name, sizeof name, "refused%d", r);
        trt_trainer(&t[r], s_tmp, name, logs[r], sizeof logs[r], common,
                    sizeof common / sizeof common[0], more);
    }
    for (int r = 0; r < 2; r++) {
        int st = pst_wait(&t[r], 60);
        cr_assert(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) != 0,
                  "trainer %d did not fail (wait status %d)", r, st);
    }
    cr_assert(zt_file_has(logs[0], "REGISTER"), "the leader does not say the servers refused it");
    cr_assert(zt_file_has(logs[0], "the servers count nodes as trainers: zps-server "
                                   "--num-trainers 1"),
              "the leader does not say what to change");
    cr_assert(zt_file_has(logs[1], "node 0's leader (trainer 0) could not join the servers"),
              "the member does not say why");
    for (int s = 0; s < 2; s++)
        pst_kill(&srv[s], SIGTERM);
}

