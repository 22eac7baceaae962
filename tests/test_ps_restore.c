/* test_ps_restore.c — checkpoints and restore with real processes: kill -9 a server mid
 * run, restart it with --restore on the same port; the client reconnects, re-registers,
 * learns the restored version, and training goes on from the last checkpointed version
 * with no version applied twice (values equal the reference bit for bit). A truncated or
 * corrupted checkpoint makes --restore fail loudly. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/mem.h"
#include "ps/client.h"
#include "ps/optim.h"
#include "ps/plan.h"
#include "tests/ps_test_util.h"

static const ps_var s_vars[] = {{"conv", 4000}, {"bn", 16}, {"fc", 2000}};
#define NV 3
#define STEPS 8

/* The reference trajectory of STEPS rmsprop steps from values uniform in [-1, 1) from seed:
 * the gradient of step s is noise + 0.1 * values. ref[s] is the values at version s. */
static void s_reference(uint64_t seed, const ps_optim_config *o, uint64_t n, float **ref, float **g)
{
    float *slots[2] = {zps_xmalloc(n * 4), zps_xcalloc(n, 4)};
    for (uint64_t i = 0; i < n; i++)
        slots[0][i] = ps_optim_slot_init(o, 0);
    uint64_t r = seed;
    for (int s = 0; s <= STEPS; s++)
        ref[s] = zps_xmalloc(n * 4);
    for (uint64_t i = 0; i < n; i++)
        ref[0][i] = pst_uniform(&r);
    for (int s = 0; s < STEPS; s++) {
        g[s] = zps_xmalloc(n * 4);
        for (uint64_t i = 0; i < n; i++)
            g[s][i] = pst_uniform(&r) + 0.1f * ref[s][i];
        memcpy(ref[s + 1], ref[s], n * 4);
        ps_optim_apply(o, (uint64_t)s, ref[s + 1], slots, g[s], n);
    }
    free(slots[0]);
    free(slots[1]);
}

/* Pushes the gradients of steps [from, to), each waited for. */
static void s_push_steps(ps_client *c, float **g, int from, int to)
{
    ps_ticket tk;
    for (int s = from; s < to; s++) {
        cr_assert_eq(ps_client_push(c, 0, NV, g[s], s, &tk), ZPS_OK);
        cr_assert_eq(ps_client_wait(c, tk), ZPS_OK, "step %d: %s", s, ps_client_last_error(c));
    }
}

/* Pulls every variable at min_version (-1: any) and asserts the server's version is want
 * and the values equal ref bit for bit. */
static void s_pull_expect(ps_client *c, float *v, int64_t min_version, uint64_t want,
                          const float *ref, uint64_t n, uint64_t seed, const char *what)
{
    ps_ticket tk;
    uint64_t ver;
    cr_assert_eq(ps_client_pull(c, 0, NV, v, min_version, &tk), ZPS_OK);
    cr_assert_eq(ps_client_wait_version(c, tk, &ver), ZPS_OK);
    cr_assert_eq(ver, want);
    cr_assert(!memcmp(v, ref, n * 4), "%s (seed %llu)", what, (unsigned long long)seed);
}

/* --restore must refuse to start (exit 1) from the checkpoint in dir with a flipped byte,
 * then with that byte restored and the file truncated. In sync mode --restore loads the
 * newest versioned checkpoint (docs/ps.md "Recovery"), here the one of version STEPS. */
static void s_expect_corrupt_refused(const char *dir, const char *uri, const char *const *rargs)
{
    pst_server srv;
    char path[512];
    snprintf(path, sizeof path, "%s/server-0.v%d.ckpt", dir, STEPS);
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    int fd = open(path, O_RDWR);
    cr_assert(fd >= 0);
    unsigned char b;
    off_t at = sb.st_size / 2;
    cr_assert_eq(pread(fd, &b, 1, at), 1);
    b ^= 0x10;
    cr_assert_eq(pwrite(fd, &b, 1, at), 1);
    cr_assert_eq(pst_spawn(&srv, uri, rargs), -1, "a corrupt checkpoint was loaded");
    cr_assert(WIFEXITED(srv.status) && WEXITSTATUS(srv.status) == 1, "status %d", srv.status);
    b ^= 0x10;
    cr_assert_eq(pwrite(fd, &b, 1, at), 1);
    cr_assert_eq(ftruncate(fd, sb.st_size - 100), 0);
    close(fd);
    cr_assert_eq(pst_spawn(&srv, uri, rargs), -1, "a truncated checkpoint was loaded");
    cr_assert(WIFEXITED(srv.status) && WEXITSTATUS(srv.status) == 1, "status %d", srv.status);
}

Test(it_ps_restore, kill9_restore_resumes_from_checkpoint, .timeout = 60)
{
    uint64_t seed = pst_seed();
    char dir[256];
    pst_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, NV, 1, 8192, &plan), ZPS_OK);
    uint64_t n = plan->total;
    ps_optim_config o = pst_optim(PS_OPT_RMSPROP, 0.01);
    o.epsilon = 1.0;
    float *ref[STEPS + 1], *g[STEPS];
    s_reference(seed, &o, n, ref, g);
    const char *args[] = {"--mode", "sync", "--num-trainers", "1", "--checkpoint-dir", dir,
                          "--checkpoint-every-versions", "2", NULL};
    const char *rargs[] = {"--mode", "sync", "--num-trainers", "1", "--checkpoint-dir", dir,
                           "--checkpoint-every-versions", "2", "--restore", NULL};
    pst_server srv;
    cr_assert_eq(pst_spawn(&srv, NULL, args), 0);
    char uri[256];
    snprintf(uri, sizeof uri, "%s", srv.uri);
    ps_client_opts co;
    ps_client_opts_default(&co);
    co.timeout_ms = 300;
    co.max_retries = 40;
    co.backoff_ms = 20;
    ps_client *c = pst_client_connect(uri, 0, &co, plan);
    cr_assert_eq(ps_client_init(c, ref[0], &o, NULL), ZPS_OK);
    float *v = zps_xmalloc(n * 4);
    s_push_steps(c, g, 0, 5);
    s_pull_expect(c, v, 5, 5, ref[5], n, seed, "values differ at version 5");

    /* kill -9 at version 5; the last checkpoint holds version 4 */
    pst_kill(&srv, SIGKILL);
    cr_assert_eq(pst_spawn(&srv, uri, rargs), 0, "restart with --restore failed");
    cr_assert_str_eq(srv.uri, uri);

    /* The client's step-5 push reaches a server restored at version 4: refused, and the
     * client learns that the fleet rolls back to 4 (sync recovery, docs/ps.md). */
    ps_ticket tk;
    uint64_t ver;
    cr_assert_eq(ps_client_push(c, 0, NV, g[5], 5, &tk), ZPS_OK);
    zps_status st = ps_client_wait_version(c, tk, &ver);
    cr_assert_eq(st, ZPS_ERR_STALE, "got %s: %s", zps_status_name(st), ps_client_last_error(c));
    cr_assert_eq(ver, 4);
    cr_assert(strstr(ps_client_last_error(c), "rolls back to version 4"), "%s",
              ps_client_last_error(c));
    cr_assert(ps_client_rollback_pending(c, &ver));
    cr_assert_eq(ver, 4);
    cr_assert_eq(ps_client_rollback(c, &ver), ZPS_OK, "%s", ps_client_last_error(c));
    cr_assert_eq(ver, 4);
    cr_assert(!ps_client_rollback_pending(c, NULL));
    s_pull_expect(c, v, -1, 4, ref[4], n, seed, "restored values differ from version 4");
    s_push_steps(c, g, 4, STEPS);
    s_pull_expect(c, v, STEPS, STEPS, ref[STEPS], n, seed,
                  "final values differ: a version was lost or applied twice");

    /* SHUTDOWN writes a final checkpoint and the server exits 0. */
    cr_assert_eq(ps_client_shutdown(c), ZPS_OK, "%s", ps_client_last_error(c));
    int ws = pst_wait(&srv, 10);
    cr_assert(ws != -1 && WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "status %d", ws);
    ps_client_destroy(&c);

    /* A restart restores version 8. */
    cr_assert_eq(pst_spawn(&srv, uri, rargs), 0);
    c = pst_client_connect(uri, 0, &co, plan);
    s_pull_expect(c, v, -1, STEPS, ref[STEPS], n, seed, "version 8 was not restored");
    ps_client_destroy(&c);
    pst_kill(&srv, SIGTERM);

    /* Corruption: a flipped byte, then a truncated file: --restore refuses to start. */
    s_expect_corrupt_refused(dir, uri, rargs);

    pst_rmdir(dir);
    for (int s = 0; s <= STEPS; s++)
        free(ref[s]);
    for (int s = 0; s < STEPS; s++)
        free(g[s]);
    free(v);
    ps_plan_destroy(&plan);
}

/* A server that dies for good: the push fails with ZPS_ERR_TIMEOUT after the retries, the
 * client does not hang on frames parked for the dead peer, and the gradient buffer may be
 * freed right after. */
Test(it_ps_restore, dead_server_times_out, .timeout = 30)
{
    ps_var v1 = {"w", 50000};
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(&v1, 1, 1, 0, &plan), ZPS_OK);
    pst_server srv;
    const char *args[] = {"--mode", "async", "--num-trainers", "1", NULL};
    cr_assert_eq(pst_spawn(&srv, NULL, args), 0);
    ps_client_opts co;
    ps_client_opts_default(&co);
    co.timeout_ms = 200;
    co.max_retries = 2;
    co.backoff_ms = 10;
    ps_client *c = pst_client_connect(srv.uri, 0, &co, plan);
    float *g = zps_xmalloc(plan->total * 4);
    uint64_t r = pst_seed();
    for (uint64_t i = 0; i < plan->total; i++)
        g[i] = pst_uniform(&r);
    ps_optim_config o;
    ps_optim_default(&o);
    cr_assert_eq(ps_client_init(c, g, &o, NULL), ZPS_OK);
    pst_kill(&srv, SIGKILL);
    ps_ticket tk;
    cr_assert_eq(ps_client_push(c, 0, 1, g, 0, &tk), ZPS_OK);
    zps_status st = ps_client_wait(c, tk);
    cr_assert_eq(st, ZPS_ERR_TIMEOUT, "%s: %s", zps_status_name(st), ps_client_last_error(c));
    cr_assert(strstr(ps_client_last_error(c), "no reply"), "%s", ps_client_last_error(c));
    free(g);
    ps_client_destroy(&c);
    ps_plan_destroy(&plan);
}
