/* test_ps_recover_train.c — sync recovery end to end with zps-trainer processes (docs/ps.md
 * "Recovery"): 2 servers checkpointing every 5 versions and 2 trainers; server 1 is killed
 * with SIGKILL mid-run and restarted with --restore. The trainers are not restarted: they
 * roll the fleet back to the restored version, rewind their input and redo the steps after
 * it. What this proves: the exported model equals, bit for bit, that of the same fleet run
 * without a fault (the redo replays the same batches on the same values), and every
 * server's STATS accounts for every version once. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "ps/client.h"
#include "tests/ps_test_util.h"
#include "trainer/nn/nn.h"

#define STEPS "60"

static char s_tmp[512], s_data[600];

/* Starts $ZPS_BIN/<prog> with args (NULL-terminated), stdout and stderr into log. */
static void s_spawn(pst_server *p, const char *prog, const char *log, const char *const *args)
{
    const char *bin = getenv("ZPS_BIN");
    cr_assert_not_null(bin, "ZPS_BIN unset: run through make test");
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", bin, prog);
    const char *argv[64] = {path};
    int n = 1;
    for (; args[n - 1] && n < 63; n++)
        argv[n] = args[n - 1];
    argv[n] = NULL;
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        execv(path, (char *const *)argv);
        _exit(127);
    }
    p->pid = pid;
    p->uri[0] = 0;
}

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

/* Whether the metrics file holds the record of step `step`. */
static int s_has_step(const char *path, int step)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    char line[4096], pat[32];
    snprintf(pat, sizeof pat, "\"step\":%d,", step);
    int seen = 0;
    while (!seen && fgets(line, sizeof line, f))
        seen = strstr(line, pat) != NULL;
    fclose(f);
    return seen;
}

static uint64_t s_field(const char *json, const char *name)
{
    char key[64];
    snprintf(key, sizeof key, "\"%s\":", name);
    const char *p = strstr(json, key);
    cr_assert(p, "no %s in %s", name, json);
    return strtoull(p + strlen(key), NULL, 10);
}

/* One fleet run; with kill_at > 0, server 1 dies once trainer 1 logged that step and comes
 * back with --restore. The model goes to tag.bin; the servers' STATS are checked. */
static void s_run(const char *tag, int kill_at)
{
    char ck[700], logs[2][700], tlog[2][700], met[2][700], out[700], servers[600];
    snprintf(ck, sizeof ck, "%s/ck-%s", s_tmp, tag);
    snprintf(out, sizeof out, "%s/%s.bin", s_tmp, tag);
    pst_server srv[2], tr[2];
    const char *idx[2] = {"0", "1"};
    const char *sargs[2][14];
    for (int i = 0; i < 2; i++) {
        const char *a[] = {"--mode", "sync", "--num-trainers", "2", "--checkpoint-dir", ck,
                           "--checkpoint-every-versions", "5", "--index", idx[i], NULL, NULL};
        memcpy(sargs[i], a, sizeof a);
        cr_assert_eq(pst_spawn(&srv[i], NULL, sargs[i]), 0);
    }
    char uri1[256];
    snprintf(uri1, sizeof uri1, "%s", srv[1].uri);
    snprintf(servers, sizeof servers, "%s,%s", srv[0].uri, srv[1].uri);
    for (int r = 0; r < 2; r++) {
        snprintf(tlog[r], sizeof tlog[r], "%s/%s-t%d.log", s_tmp, tag, r);
        snprintf(met[r], sizeof met[r], "%s/%s-t%d.jsonl", s_tmp, tag, r);
        const char *a[] = {"--data", s_data, "--servers", servers, "--num-trainers", "2",
                           "--trainer-id", idx[r], "--no-progress", "--metrics", met[r],
                           "--threads", "0", "--mode", "sync", "--model", "mlp", "--steps",
                           STEPS, "--eval-batches", "1", "--timeout-ms", "30000",
                           r == 0 ? "--export" : NULL, out, NULL};
        s_spawn(&tr[r], "zps-trainer", tlog[r], a);
    }
    double restarted = 0;
    if (kill_at > 0) {
        while (!s_has_step(met[1], kill_at))
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
        uint64_t chunks = s_field(json, "chunks"), upd = s_field(json, "updates"),
                 restored = s_field(json, "updates_restored"),
                 undone = s_field(json, "updates_undone");
        cr_log_info("%s server %d: version %" PRIu64 ", updates %" PRIu64 " + restored %" PRIu64
                    " - undone %" PRIu64 ", rollbacks %" PRIu64, tag, i, s_field(json, "version"),
                    upd, restored, undone, s_field(json, "rollbacks"));
        cr_assert_eq(s_field(json, "version"), (uint64_t)atoi(STEPS), "%s", json);
        cr_assert_eq(upd + restored - undone, chunks * (uint64_t)atoi(STEPS), "%s", json);
        if (kill_at > 0 && i == 0)
            cr_assert_geq(s_field(json, "rollbacks"), 1, "server 0 never rolled back: %s", json);
        free(json);
    }
    ps_client_destroy(&c);
    for (int i = 0; i < 2; i++)
        pst_kill(&srv[i], SIGTERM);
}

Test(it_ps_recover, trainers_redo_after_a_server_restore, .timeout = 300)
{
    pst_tmpdir(s_tmp, sizeof s_tmp);
    snprintf(s_data, sizeof s_data, "%s/fm", s_tmp);
    char log[700];
    snprintf(log, sizeof log, "%s/data.log", s_tmp);
    pst_server p;
    const char *args[] = {"convert", "fashion-mnist", "--out", s_data, "--limit", "2048",
                          "--shards", "2", NULL};
    s_spawn(&p, "zps-data", log, args);
    s_expect_ok(&p, log, 60);
    s_run("clean", 0);
    s_run("fault", 27);
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
