/* test_ps_curve_auth.c — who CURVE servers admit (ps/curve.h, docs/ps.md "Security").
 *
 * it_ps_curve (zps-server processes on 127.0.0.1, each bounded in time and reaped by PID):
 * zps-server --keygen; bad key files stop the server with the file named; an allowed trainer
 * registers, inits, pushes and pulls the right values (and its heartbeat thread's sockets
 * authenticate too); a trainer whose key is not allowed fails fast with
 * ZPS_ERR_UNAUTHORIZED, STATS counts the refusal and the server keeps serving the allowed
 * one; a key bound to a trainer id speaks for that trainer only; a plaintext client, a CURVE
 * client of a plaintext server and a client with the wrong server key all fail fast; a raw
 * plaintext socket gets nothing from a CURVE server; zps-launch --curve runs a secure fleet
 * of real trainers. test_ps_curve_wire.c adds the suite's encryption check.
 *
 * "Fast" is bounded here by 5 s against a client request timeout of 30 s: a failure that
 * waited for the timeout would take at least 30 s.
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/mem.h"
#include "common/proto.h"
#include "ps/client.h"
#include "ps/curve.h"
#include "ps/plan.h"
#include "tests/ps_curve_test_util.h"
#include "tests/ps_test_util.h"
#include "tests/testutil.h"

/* Bound on every expected refusal: far under the clients' request timeout (pct_client: 120
 * s), which a refusal that is not noticed would wait out; loose enough for a loaded 2-core
 * machine running the fault suite beside it (13 s seen once with 5 s here). */
#define FAST_S 20.0

static const ps_var s_vars[] = {{"w", 3000}, {"b", 7}};
#define NV 2

/* Runs $ZPS_BIN/zps-server with args (NULL-terminated), stdout and stderr into
 * dir/server.out and *out (caller frees); returns its exit code. Killed (and the test
 * failed) after 10 s, or when it did not exit normally. */
static int s_run_server(const char *dir, const char *const *args, char **out)
{
    char log[320];
    snprintf(log, sizeof log, "%s/server.out", dir);
    return zt_run("zps-server", args, NULL, log, 10, out);
}

/* A numeric STATS field (-1 when absent). */
static long long s_stat(ps_client *c, const char *field)
{
    char *json = NULL;
    cr_assert_eq(ps_client_stats(c, 0, &json), ZPS_OK, "STATS: %s", ps_client_last_error(c));
    char key[64];
    snprintf(key, sizeof key, "\"%s\":", field);
    const char *p = strstr(json, key);
    long long v = p ? strtoll(p + strlen(key), NULL, 10) : -1;
    free(json);
    return v;
}

/* ------------------------------------------------------------------------- processes */

TestSuite(it_ps_curve, .timeout = 60);

Test(it_ps_curve, keygen_binary_round_trip_and_refusal)
{
    char dir[256], prefix[300], kpath[320], ppath[320], why[1024], *out;
    zt_mktmp(dir, sizeof dir, "zps-curve");
    snprintf(prefix, sizeof prefix, "%s/srv", dir);
    snprintf(kpath, sizeof kpath, "%s.key", prefix);
    snprintf(ppath, sizeof ppath, "%s.pub", prefix);
    const char *args[] = {"--keygen", prefix, NULL};
    int code = s_run_server(dir, args, &out);
    cr_assert_eq(code, 0, "keygen failed: %s", out);
    free(out);
    struct stat sk;
    cr_assert_eq(stat(kpath, &sk), 0);
    cr_assert_eq(sk.st_mode & 0777, 0600);
    char pub[41], sec[41], pub2[41];
    cr_assert_eq(ps_curve_load_keypair(kpath, pub, sec, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_eq(ps_curve_load_public(ppath, pub2, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_str_eq(pub, pub2);
    char *before = pct_slurp(kpath);
    code = s_run_server(dir, args, &out);
    cr_assert_eq(code, 1, "second keygen: exit %d: %s", code, out);
    cr_assert_not_null(strstr(out, "exists; not overwriting"), "%s", out);
    free(out);
    char *after = pct_slurp(kpath);
    cr_assert_str_eq(before, after);
    free(before);
    free(after);
    zt_rmtmp(dir);
}

Test(it_ps_curve, server_refuses_bad_key_files)
{
    char dir[256], key[300], allow[300], wide[300], badallow[300], missing[300], *out;
    zt_mktmp(dir, sizeof dir, "zps-curve");
    pct_keygen(dir, "server");
    pct_keygen(dir, "t0");
    pct_allow(dir, "t0");
    snprintf(key, sizeof key, "%s/server.key", dir);
    snprintf(allow, sizeof allow, "%s/allow.txt", dir);
    snprintf(wide, sizeof wide, "%s/wide.key", dir);
    snprintf(badallow, sizeof badallow, "%s/bad-allow.txt", dir);
    snprintf(missing, sizeof missing, "%s/missing.key", dir);
    char *kt = pct_slurp(key);
    pct_write(wide, kt, 0644);
    free(kt);
    pct_write(badallow, "# ok\nnot-a-key\n", 0644);
    static const char *const want[] = {"group or others may access it", "bad-allow.txt:2: not a CURVE public key",
                                       "missing.key: No such file or directory", "needs --curve-allow FILE"};
    const char *cases[][8] = {
        {"--curve-key", wide, "--curve-allow", allow, NULL},
        {"--curve-key", key, "--curve-allow", badallow, NULL},
        {"--curve-key", missing, "--curve-allow", allow, NULL},
        {"--curve-key", key, NULL},
    };
    const char *named[] = {wide, badallow, missing, NULL};
    for (int i = 0; i < 4; i++) {
        int code = s_run_server(dir, cases[i], &out);
        cr_assert_eq(code, i == 3 ? 2 : 1, "case %d: exit %d:\n%s", i, code, out);
        cr_assert_not_null(strstr(out, want[i]), "case %d: '%s' not in:\n%s", i, want[i], out);
        if (named[i])
            cr_assert_not_null(strstr(out, named[i]), "case %d: %s not named:\n%s", i, named[i], out);
        free(out);
    }
    zt_rmtmp(dir);
}

Test(it_ps_curve, allowed_trainer_trains_refused_one_fails_fast)
{
    uint64_t seed = pst_seed();
    char dir[256];
    zt_mktmp(dir, sizeof dir, "zps-curve");
    pct_keygen(dir, "server");
    pct_keygen(dir, "good");
    pct_keygen(dir, "evil");
    pct_allow(dir, "good");
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, NV, 1, 0, &plan), ZPS_OK);
    pst_server srv;
    pct_curve_server(&srv, dir, "1");

    /* the allowed trainer, with the heartbeat thread (its sockets must authenticate too) */
    ps_client *good;
    cr_assert_eq(pct_client(srv.uri, dir, "server", "good", 0, 1, &good), ZPS_OK);
    pct_train_round(good, plan, seed, 0);
    double end = zps_now_s() + FAST_S;
    while (s_stat(good, "auth_accepted") < 2 && zps_now_s() < end)
        zps_sleep_ns(5000000); /* polls for the heartbeat socket's handshake, bounded */
    cr_assert_geq(s_stat(good, "auth_accepted"), 2, "heartbeat thread did not authenticate");
    cr_assert_eq(s_stat(good, "auth_rejected"), 0);
    cr_assert_eq(s_stat(good, "handshake_failed"), 0);

    /* a trainer whose key is not in the allow-list: refused at REGISTER, quickly */
    ps_client *evil;
    cr_assert_eq(pct_client(srv.uri, dir, "server", "evil", 0, 0, &evil), ZPS_OK);
    double t0 = zps_now_s();
    zps_status st = ps_client_register(evil, plan, NULL, NULL);
    double took = zps_now_s() - t0;
    cr_assert_eq(st, ZPS_ERR_UNAUTHORIZED, "got %s: %s", zps_status_name(st),
                 ps_client_last_error(evil));
    cr_assert_lt(took, FAST_S, "refusal took %.1f s", took);
    cr_assert_not_null(strstr(ps_client_last_error(evil), "refused this trainer's CURVE key"),
                       "%s", ps_client_last_error(evil));
    /* later requests to that server fail at once */
    char *json = NULL;
    t0 = zps_now_s();
    cr_assert_eq(ps_client_stats(evil, 0, &json), ZPS_ERR_UNAUTHORIZED);
    cr_assert_lt(zps_now_s() - t0, 0.5);
    ps_client_destroy(&evil);

    cr_assert_geq(s_stat(good, "auth_rejected"), 1, "the refusal is not counted");
    /* the server is still up and serves the allowed trainer */
    cr_assert_eq(pst_wait(&srv, 0), -1, "the server exited");
    uint64_t n = plan->total;
    float *v = zps_xmalloc(n * 4), *g = zps_xcalloc(n, 4);
    ps_ticket t;
    cr_assert_eq(ps_client_pushpull(good, 0, NV, g, v, 1, &t), ZPS_OK);
    cr_assert_eq(ps_client_wait(good, t), ZPS_OK, "%s", ps_client_last_error(good));
    cr_assert_eq(s_stat(good, "updates"), 2 * (long long)plan->server_chunks[0]);
    free(v);
    free(g);
    ps_client_destroy(&good);
    pst_kill(&srv, SIGTERM);
    ps_plan_destroy(&plan);
    zt_rmtmp(dir);
}

/* "KEY trainer=N" in --curve-allow: a key speaks for its own trainer id only, and only
 * trainer 0 may shut the servers down. */
Test(it_ps_curve, bound_key_speaks_only_for_its_trainer)
{
    uint64_t seed = pst_seed();
    char dir[256], path[600], why[1024], pub[2][41];
    zt_mktmp(dir, sizeof dir, "zps-curve");
    pct_keygen(dir, "server");
    const char *names[2] = {"t0", "t1"};
    for (int i = 0; i < 2; i++) {
        pct_keygen(dir, names[i]);
        snprintf(path, sizeof path, "%s/%s.pub", dir, names[i]);
        cr_assert_eq(ps_curve_load_public(path, pub[i], why, sizeof why), ZPS_OK, "%s", why);
    }
    char text[256];
    snprintf(text, sizeof text, "# bound keys\n%s trainer=0\n%s trainer=1 # t1\n", pub[0], pub[1]);
    snprintf(path, sizeof path, "%s/allow.txt", dir);
    pct_write(path, text, 0644);
    char key[600];
    snprintf(key, sizeof key, "%s/server.key", dir);
    const char *args[] = {"--mode", "async", "--num-trainers", "2", "--curve-key", key,
                          "--curve-allow", path, NULL};
    pst_server srv;
    cr_assert_eq(pst_spawn(&srv, NULL, args), 0, "CURVE server did not start");
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, NV, 1, 0, &plan), ZPS_OK);

    /* t1's key saying trainer 0: admitted by ZAP, refused request by request, at once */
    ps_client *liar;
    cr_assert_eq(pct_client(srv.uri, dir, "server", "t1", 0, 0, &liar), ZPS_OK);
    double t0 = zps_now_s();
    zps_status st = ps_client_register(liar, plan, NULL, NULL);
    cr_assert_eq(st, ZPS_ERR_UNAUTHORIZED, "got %s: %s", zps_status_name(st),
                 ps_client_last_error(liar));
    cr_assert_lt(zps_now_s() - t0, FAST_S);
    cr_assert_not_null(strstr(ps_client_last_error(liar), "is bound to trainer 1 in --curve-allow; "
                                                          "this request says trainer 0"),
                       "%s", ps_client_last_error(liar));
    char *json = NULL;
    cr_assert_eq(ps_client_stats(liar, 0, &json), ZPS_ERR_UNAUTHORIZED);
    ps_client_destroy(&liar);

    /* each key as its own trainer works: t0 initialises and trains, t1 joins and pulls */
    ps_client *c0, *c1;
    cr_assert_eq(pct_client(srv.uri, dir, "server", "t0", 0, 0, &c0), ZPS_OK);
    pct_train_round(c0, plan, seed, 0);
    cr_assert_eq(pct_client(srv.uri, dir, "server", "t1", 1, 0, &c1), ZPS_OK);
    cr_assert_eq(ps_client_register(c1, plan, NULL, NULL), ZPS_OK, "%s", ps_client_last_error(c1));
    float *v = zps_xmalloc(plan->total * 4);
    ps_ticket t;
    cr_assert_eq(ps_client_pull(c1, 0, NV, v, 0, &t), ZPS_OK);
    cr_assert_eq(ps_client_wait(c1, t), ZPS_OK, "%s", ps_client_last_error(c1));
    cr_assert_eq(s_stat(c0, "ZPS_ERR_UNAUTHORIZED"), 2, "both refusals are counted");
    cr_assert_eq(s_stat(c0, "auth_rejected"), 0, "ZAP refused nobody: the keys are allowed");

    /* SHUTDOWN is the chief's: trainer 1 is refused and the server stays up; trainer 0 may */
    st = ps_client_shutdown(c1);
    cr_assert_eq(st, ZPS_ERR_UNAUTHORIZED, "got %s", zps_status_name(st));
    cr_assert_not_null(strstr(ps_client_last_error(c1), "only trainer 0 (the chief) may shut"),
                       "%s", ps_client_last_error(c1));
    cr_assert_eq(pst_wait(&srv, 0), -1, "the server exited on trainer 1's SHUTDOWN");
    cr_assert_eq(s_stat(c0, "ZPS_ERR_UNAUTHORIZED"), 3);
    cr_assert_eq(ps_client_shutdown(c0), ZPS_OK, "%s", ps_client_last_error(c0));
    int ws = pst_wait(&srv, 10);
    if (ws == -1)
        pst_kill(&srv, SIGKILL); // reaped before the verdict
    cr_assert(ws != -1 && WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "the server did not stop "
              "cleanly on trainer 0's SHUTDOWN (status %d)", ws);
    free(v);
    ps_client_destroy(&c0);
    ps_client_destroy(&c1);
    ps_plan_destroy(&plan);
    zt_rmtmp(dir);
}

Test(it_ps_curve, mismatched_security_fails_fast)
{
    char dir[256];
    zt_mktmp(dir, sizeof dir, "zps-curve");
    pct_keygen(dir, "server");
    pct_keygen(dir, "other-server");
    pct_keygen(dir, "good");
    pct_allow(dir, "good");
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, NV, 1, 0, &plan), ZPS_OK);
    pst_server csrv, psrv;
    pct_curve_server(&csrv, dir, "1");
    cr_assert_eq(pst_spawn(&psrv, NULL, NULL), 0);

    static const struct {
        int curve_server;
        const char *server_pub, *key, *want;
    } cases[] = {
        {1, NULL, NULL, "requires CURVE"},            /* plaintext client, CURVE server */
        {0, "server", "good", "CURVE"},               /* CURVE client, plaintext server */
        {1, "other-server", "good", "--curve-server-key"}, /* wrong server public key */
    };
    for (int i = 0; i < 3; i++) {
        ps_client *c;
        cr_assert_eq(pct_client(cases[i].curve_server ? csrv.uri : psrv.uri, dir,
                                cases[i].server_pub, cases[i].key, 0, 0, &c),
                     ZPS_OK);
        double t0 = zps_now_s();
        zps_status st = ps_client_register(c, plan, NULL, NULL);
        double took = zps_now_s() - t0;
        cr_assert_eq(st, ZPS_ERR_UNAUTHORIZED, "case %d: got %s: %s", i, zps_status_name(st),
                     ps_client_last_error(c));
        cr_assert_lt(took, FAST_S, "case %d took %.1f s", i, took);
        cr_assert_not_null(strstr(ps_client_last_error(c), cases[i].want), "case %d: %s", i,
                           ps_client_last_error(c));
        cr_log_info("case %d refused in %.3f s: %s", i, took, ps_client_last_error(c));
        ps_client_destroy(&c);
    }
    /* the CURVE server saw the plaintext client and the wrong-key client fail (its ZAP
     * thread counts monitor events as they come: poll, bounded) */
    ps_client *good;
    cr_assert_eq(pct_client(csrv.uri, dir, "server", "good", 0, 0, &good), ZPS_OK);
    double end = zps_now_s() + FAST_S;
    while (s_stat(good, "handshake_failed") < 2 && zps_now_s() < end)
        zps_sleep_ns(5000000);
    cr_assert_geq(s_stat(good, "handshake_failed"), 2);
    cr_assert_eq(s_stat(good, "auth_rejected"), 0);
    ps_client_destroy(&good);
    pst_kill(&csrv, SIGTERM);
    pst_kill(&psrv, SIGTERM);
    ps_plan_destroy(&plan);
    zt_rmtmp(dir);
}

/* A raw DEALER without keys gets no answer from a CURVE server (a plaintext server answers
 * the same request), and nothing it sends is counted as a request. */
Test(it_ps_curve, raw_plaintext_socket_gets_nothing)
{
    char dir[256];
    zt_mktmp(dir, sizeof dir, "zps-curve");
    pct_keygen(dir, "server");
    pct_keygen(dir, "good");
    pct_allow(dir, "good");
    pst_server csrv, psrv;
    pct_curve_server(&csrv, dir, "1");
    cr_assert_eq(pst_spawn(&psrv, NULL, NULL), 0);
    void *ctx = zmq_ctx_new();
    Zps__Header h = ZPS__HEADER__INIT;
    h.version = ZPS_PROTOCOL_VERSION;
    h.op = ZPS__OP__OP_STATS;
    h.request_id = 1;
    uint8_t buf[64];
    size_t hl = zps__header__pack(&h, buf);
    for (int k = 0; k < 2; k++) {
        void *d = zmq_socket(ctx, ZMQ_DEALER);
        int zero = 0;
        zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
        cr_assert_eq(zmq_connect(d, k ? psrv.uri : csrv.uri), 0);
        cr_assert_eq(zmq_send(d, buf, hl, 0), (int)hl);
        zmq_pollitem_t it = {d, 0, ZMQ_POLLIN, 0};
        int rc = zmq_poll(&it, 1, 1000);
        if (k == 0)
            cr_assert_eq(rc, 0, "the CURVE server answered a plaintext socket");
        else
            cr_assert_eq(rc, 1, "the plaintext server did not answer (the check is void)");
        zmq_close(d);
    }
    zmq_ctx_term(ctx);
    ps_client *good;
    cr_assert_eq(pct_client(csrv.uri, dir, "server", "good", 0, 0, &good), ZPS_OK);
    char *json = NULL;
    cr_assert_eq(ps_client_stats(good, 0, &json), ZPS_OK);
    cr_assert_not_null(strstr(json, "\"stats\":1,"), "only this STATS got through: %s", json);
    cr_assert_not_null(strstr(json, "\"rejected_total\":0,"), "%s", json);
    free(json);
    ps_client_destroy(&good);
    pst_kill(&csrv, SIGTERM);
    pst_kill(&psrv, SIGTERM);
    zt_rmtmp(dir);
}
/* zps-launch --curve: keys generated in the run folder, a real fleet of 1 server and 2
 * trainers trains over CURVE; trainer 1's key removed from the allow-list (second run, same
 * folder, keys reused): the fleet fails with the refusal in trainer 1's log. */
Test(it_ps_curve, launch_curve_fleet, .timeout = 200)
{
    const char *bin = getenv("ZPS_BIN"), *root = getenv("ZPS_ROOT");
    cr_assert_not_null(bin, "ZPS_BIN unset: run through make test");
    char dir[256], cmd[4096], path[600];
    zt_mktmp(dir, sizeof dir, "zps-curve");
    snprintf(cmd, sizeof cmd,
             "cd '%s' && timeout 60 '%s/zps-data' convert fashion-mnist --out fm --limit 512 "
             "--shards 1 > data.log 2>&1",
             dir, bin);
    cr_assert_eq(system(cmd), 0, "zps-data convert failed (see %s/data.log)", dir);
    const char *targs = "--data fm --mode async --model mlp --steps 3 --batch-size 16 "
                        "--no-progress --eval-batches 1 --threads 0";
    snprintf(cmd, sizeof cmd,
             "cd '%s' && timeout 150 '%s/scripts/zps-launch' --bin-dir '%s' --servers 1 "
             "--trainers 2 --curve --run-dir run --timeout 100 --grace 5 --quiet "
             "--trainer-args='%s' > launch.log 2>&1",
             dir, root && *root ? root : ".", bin, targs);
    int st = system(cmd);
    snprintf(path, sizeof path, "%s/launch.log", dir);
    char *log = pct_slurp(path);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "secure fleet failed:\n%s", log);
    free(log);
    static const char *const files[] = {"server.key", "server.pub", "trainer-0.key",
                                        "trainer-0.pub", "trainer-1.key", "allow.txt"};
    for (int i = 0; i < 6; i++) {
        struct stat sb;
        snprintf(path, sizeof path, "%s/run/keys/%s", dir, files[i]);
        cr_assert_eq(stat(path, &sb), 0, "%s missing", path);
        if (strstr(files[i], ".key"))
            cr_assert_eq(sb.st_mode & 0777, 0600, "%s mode %o", path, sb.st_mode & 0777);
    }
    snprintf(path, sizeof path, "%s/run/server-0.log", dir);
    log = pct_slurp(path);
    cr_assert_not_null(strstr(log, "CURVE on"), "%s", log);
    cr_assert_not_null(strstr(log, "2 trainer key(s) allowed"), "%s", log);
    cr_assert_not_null(strstr(log, "2 of them bound to one trainer id; 1 admin key(s)"), "%s", log);
    free(log);
    snprintf(path, sizeof path, "%s/run/keys/allow.txt", dir);
    log = pct_slurp(path);
    cr_assert_not_null(strstr(log, " trainer=0  # trainer-0\n"), "%s", log);
    cr_assert_not_null(strstr(log, " trainer=1  # trainer-1\n"), "%s", log);
    cr_assert_not_null(strstr(log, " admin  # zps-ctl\n"), "%s", log);
    free(log);
    snprintf(path, sizeof path, "%s/run/trainer-1.log", dir);
    log = pct_slurp(path);
    cr_assert_not_null(strstr(log, "CURVE on"), "%s", log);
    free(log);

    /* the same fleet, keys reused, but the server admits trainer 0 only: the launcher
     * rewrites allow.txt from the keys, so a later --curve-allow in --server-args (the last
     * one wins) names a list without trainer 1 */
    char allow1[600], pub0[41], why[1024];
    snprintf(path, sizeof path, "%s/run/keys/trainer-0.pub", dir);
    cr_assert_eq(ps_curve_load_public(path, pub0, why, sizeof why), ZPS_OK, "%s", why);
    snprintf(allow1, sizeof allow1, "%s/only-trainer-0.txt", dir);
    char text[128];
    snprintf(text, sizeof text, "%s\n", pub0);
    pct_write(allow1, text, 0644);
    snprintf(cmd, sizeof cmd,
             "cd '%s' && timeout 150 '%s/scripts/zps-launch' --bin-dir '%s' --servers 1 "
             "--trainers 2 --curve --run-dir run --timeout 100 --grace 5 --quiet "
             "--server-args='--curve-allow %s' --trainer-args='%s' > launch2.log 2>&1",
             dir, root && *root ? root : ".", bin, allow1, targs);
    st = system(cmd);
    snprintf(path, sizeof path, "%s/launch2.log", dir);
    log = pct_slurp(path);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1, "fleet with a refused trainer: %d\n%s", st,
              log);
    free(log);
    snprintf(path, sizeof path, "%s/run/trainer-1.log", dir);
    log = pct_slurp(path);
    cr_assert_not_null(strstr(log, "refused this trainer's CURVE key"), "%s", log);
    free(log);
    zt_rmtmp(dir);
}
