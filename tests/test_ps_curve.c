/* test_ps_curve.c — CURVE authentication and encryption (ps/curve.h, docs/ps.md "Security").
 *
 * ps_curve (unit, no processes): key validity, the allow-list parser, keygen round trip and
 * its refusal to overwrite, bad key files rejected with the file named.
 *
 * it_ps_curve (zps-server processes on 127.0.0.1, each bounded in time and reaped by PID):
 * zps-server --keygen; bad key files stop the server with the file named; an allowed trainer
 * registers, inits, pushes and pulls the right values (and its heartbeat thread's sockets
 * authenticate too); a trainer whose key is not allowed fails fast with
 * ZPS_ERR_UNAUTHORIZED, STATS counts the refusal and the server keeps serving the allowed
 * one; a plaintext client, a CURVE client of a plaintext server and a client with the wrong
 * server key all fail fast; a TCP relay between client and server shows that pushed and
 * pulled floats never cross the wire in clear with CURVE (and, as a control, that they do
 * without it); zps-launch --curve runs a secure fleet of real trainers.
 *
 * "Fast" is bounded here by 5 s against a client request timeout of 30 s: a failure that
 * waited for the timeout would take at least 30 s.
 */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/mem.h"
#include "common/proto.h"
#include "ps/client.h"
#include "ps/curve.h"
#include "ps/optim.h"
#include "ps/plan.h"
#include "tests/ps_test_util.h"
#include "tests/testutil.h"

#define FAST_S 5.0 /* bound on every expected refusal (the request timeout is 30 s) */

static const ps_var s_vars[] = {{"w", 3000}, {"b", 7}};
#define NV 2

/* ------------------------------------------------------------------------- helpers */

static void s_write(const char *path, const char *text, mode_t mode)
{
    unlink(path);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, mode);
    cr_assert(fd >= 0, "cannot create %s", path);
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    cr_assert_eq(chmod(path, mode), 0);
}

static char *s_slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "cannot open %s", path);
    char *buf = zps_xcalloc(1, 1 << 16);
    size_t n = fread(buf, 1, (1 << 16) - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* dir/name.key and dir/name.pub through the library. */
static void s_keygen(const char *dir, const char *name)
{
    char prefix[600], why[1024];
    snprintf(prefix, sizeof prefix, "%s/%s", dir, name);
    cr_assert_eq(ps_curve_keygen(prefix, why, sizeof why), ZPS_OK, "%s", why);
}

/* The public key of dir/name.pub, appended as a line to dir/allow.txt. */
static void s_allow(const char *dir, const char *name)
{
    char path[600], pub[41], why[1024];
    snprintf(path, sizeof path, "%s/%s.pub", dir, name);
    cr_assert_eq(ps_curve_load_public(path, pub, why, sizeof why), ZPS_OK, "%s", why);
    snprintf(path, sizeof path, "%s/allow.txt", dir);
    FILE *f = fopen(path, "a");
    cr_assert_not_null(f);
    fprintf(f, "# %s\n%s\n", name, pub);
    fclose(f);
}

/* Runs $ZPS_BIN/zps-server with args (NULL-terminated), stdout and stderr into out;
 * returns the wait status. Killed (and the test failed) after timeout_s. */
static int s_run_server(const char *const *args, char *out, size_t cap, double timeout_s)
{
    const char *bin = getenv("ZPS_BIN");
    char path[1024];
    snprintf(path, sizeof path, "%s/zps-server", bin ? bin : "build/bin");
    const char *argv[32];
    int n = 0;
    argv[n++] = path;
    for (int i = 0; args[i] && n < 31; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        close(fds[1]);
        execv(path, (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    size_t got = 0;
    double end = zps_now_s() + timeout_s;
    for (;;) {
        struct pollfd p = {fds[0], POLLIN, 0};
        if (zps_now_s() > end)
            break;
        if (poll(&p, 1, 100) <= 0)
            continue;
        ssize_t k = read(fds[0], out + got, cap - 1 - got);
        if (k <= 0)
            break;
        got += (size_t)k;
        if (got == cap - 1)
            break;
    }
    out[got] = 0;
    close(fds[0]);
    pst_server p = {.pid = pid};
    int st = pst_wait(&p, end - zps_now_s() > 0.1 ? end - zps_now_s() : 0.1);
    if (st == -1) {
        st = pst_kill(&p, SIGKILL);
        cr_assert_fail("zps-server %s did not finish in %.0f s:\n%s", args[0], timeout_s, out);
    }
    return st;
}

/* A client of uri; with keys (server_pub, name: dir/<server_pub>.pub and dir/<name>.key)
 * unless name is NULL. */
static zps_status s_client(const char *uri, const char *dir, const char *server_pub,
                           const char *name, uint32_t trainer, int hb_thread, ps_client **c)
{
    ps_client_opts o;
    ps_client_opts_default(&o);
    o.heartbeat_thread = hb_thread;
    if (name) {
        char path[600], why[1024];
        snprintf(path, sizeof path, "%s/%s.pub", dir, server_pub);
        cr_assert_eq(ps_curve_load_public(path, o.curve_server_key, why, sizeof why), ZPS_OK,
                     "%s", why);
        snprintf(path, sizeof path, "%s/%s.key", dir, name);
        cr_assert_eq(ps_curve_load_keypair(path, o.curve_public_key, o.curve_secret_key, why,
                                           sizeof why),
                     ZPS_OK, "%s", why);
    }
    const char *uris[1] = {uri};
    return ps_client_new(uris, 1, trainer, &o, c);
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

/* Starts a CURVE server with dir/server.key and dir/allow.txt (sync, one trainer). */
static void s_curve_server(pst_server *srv, const char *dir, const char *ntrainers)
{
    char key[600], allow[600];
    snprintf(key, sizeof key, "%s/server.key", dir);
    snprintf(allow, sizeof allow, "%s/allow.txt", dir);
    const char *args[] = {"--mode", "sync", "--num-trainers", ntrainers, "--curve-key", key,
                          "--curve-allow", allow, NULL};
    cr_assert_eq(pst_spawn(srv, NULL, args), 0, "CURVE server did not start");
}

/* Register, init with values from the seed, push a gradient, pull: the values must be
 * what ps_optim_apply gives (same code, same float inputs; tolerance 1e-7 + 1e-6 |ref|). */
static void s_train_round(ps_client *c, const ps_plan *plan, uint64_t seed, float fill)
{
    uint64_t n = plan->total, r = seed;
    float *v = zps_xmalloc(n * 4), *ref = zps_xmalloc(n * 4), *g = zps_xmalloc(n * 4);
    for (uint64_t i = 0; i < n; i++) {
        ref[i] = fill ? fill : pst_uniform(&r);
        g[i] = fill ? 0.25f : pst_uniform(&r);
    }
    ps_optim_config o;
    ps_optim_default(&o);
    o.kind = PS_OPT_SGD;
    o.lr = 0.5;
    cr_assert_eq(ps_client_register(c, plan, NULL, NULL), ZPS_OK, "%s", ps_client_last_error(c));
    cr_assert_eq(ps_client_init(c, ref, &o, NULL), ZPS_OK, "%s", ps_client_last_error(c));
    ps_ticket t;
    cr_assert_eq(ps_client_push(c, 0, NV, g, 0, &t), ZPS_OK);
    cr_assert_eq(ps_client_wait(c, t), ZPS_OK, "%s", ps_client_last_error(c));
    cr_assert_eq(ps_client_pull(c, 0, NV, v, 1, &t), ZPS_OK);
    cr_assert_eq(ps_client_wait(c, t), ZPS_OK, "%s", ps_client_last_error(c));
    float *slots[2] = {NULL, NULL};
    float before = ref[0];
    ps_optim_apply(&o, 0, ref, slots, g, n);
    cr_assert_neq(ref[0], before, "the update changed nothing: the check would be void");
    for (uint64_t i = 0; i < n; i++) {
        double d = fabs((double)v[i] - (double)ref[i]), lim = 1e-7 + 1e-6 * fabs((double)ref[i]);
        cr_assert(d <= lim, "value %llu: %.9g, want %.9g (seed %llu)", (unsigned long long)i,
                  (double)v[i], (double)ref[i], (unsigned long long)seed);
    }
    free(v);
    free(ref);
    free(g);
}

/* ------------------------------------------------------------------------- unit */

Test(ps_curve, key_validity)
{
    char pub[41], sec[41];
    cr_assert_eq(zmq_curve_keypair(pub, sec), 0);
    cr_assert(ps_curve_key_valid(pub, 40));
    cr_assert(ps_curve_key_valid(sec, 40));
    cr_assert_not(ps_curve_key_valid(pub, 39), "short");
    char bad[41];
    memcpy(bad, pub, 41);
    bad[7] = '"'; /* not in the Z85 alphabet */
    cr_assert_not(ps_curve_key_valid(bad, 40));
    memset(bad, '#', 40); /* Z85 characters, but each group of 5 exceeds 2^32 - 1 */
    cr_assert_not(ps_curve_key_valid(bad, 40));
}

Test(ps_curve, allow_list_parser)
{
    char k[3][41], sec[41];
    for (int i = 0; i < 3; i++)
        cr_assert_eq(zmq_curve_keypair(k[i], sec), 0);
    /* '#' is a Z85 character: a key may hold it, just never first (a group starting with
     * '#' would exceed 2^32), so '#' lines are comments and '#' inside a key is not */
    char hashkey[41] = "";
    for (int tries = 0; tries < 100000 && !hashkey[0]; tries++) {
        char p[41];
        cr_assert_eq(zmq_curve_keypair(p, sec), 0);
        cr_assert_neq(p[0], '#');
        if (strchr(p, '#'))
            memcpy(hashkey, p, 41);
    }
    cr_assert_eq(strlen(hashkey), 40, "no key holding '#' in 100000 tries");
    char comment[41];
    memcpy(comment, hashkey, 41);
    comment[0] = '#'; /* 40 characters, the rest Z85: still a comment */
    char text[1024];
    snprintf(text, sizeof text,
             "# trainers of job x\r\n"
             "\n"
             "  %s  \r\n"
             "%s # trainer 1\n"
             "\t# indented comment\n"
             "%s\n"
             "%s\n"
             "%s", /* last line without a newline */
             k[0], k[1], comment, hashkey, k[2]);
    char why[512] = "";
    ps_curve_allow *a = NULL;
    cr_assert_eq(ps_curve_allow_parse(text, "allow.txt", &a, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_eq(ps_curve_allow_count(a), 4);
    uint8_t bin[32];
    for (int i = 0; i < 3; i++)
        cr_assert(ps_curve_allow_has(a, zmq_z85_decode(bin, k[i])), "key %d missing", i);
    cr_assert(ps_curve_allow_has(a, zmq_z85_decode(bin, hashkey)));
    char other[41];
    cr_assert_eq(zmq_curve_keypair(other, sec), 0);
    cr_assert_not(ps_curve_allow_has(a, zmq_z85_decode(bin, other)));
    ps_curve_allow_destroy(&a);
    cr_assert_null(a);

    static const struct {
        const char *text, *want;
    } bad[] = {
        {"# nothing\n\n", "allow.txt lists no keys"},
        {"", "allow.txt lists no keys"},
        {"# a\nshortkey\n", "allow.txt:2: not a CURVE public key (want 40 Z85 characters, got 8)"},
        {"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"\n", "allow.txt:1: not a CURVE public key (40 characters, but not valid Z85)"},
        {"secret = x\n", "allow.txt:1: this is a key pair file"},
        {"public = x\n", "allow.txt:1: this is a key pair file"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        why[0] = 0;
        cr_assert_eq(ps_curve_allow_parse(bad[i].text, "allow.txt", &a, why, sizeof why),
                     ZPS_ERR_PARSE, "case %zu accepted", i);
        cr_assert_null(a);
        cr_assert_not_null(strstr(why, bad[i].want), "case %zu: '%s' not in '%s'", i,
                           bad[i].want, why);
    }
    /* text after a key that is neither a binding nor a comment */
    const char *after[] = {"trainer-1", "trainer=", "trainer=4096", "trainer=x", "trainer=3 x",
                           "trainer=-1"};
    for (size_t i = 0; i < sizeof after / sizeof *after; i++) {
        snprintf(text, sizeof text, "%s %s\n", k[0], after[i]);
        cr_assert_eq(ps_curve_allow_parse(text, "allow.txt", &a, why, sizeof why), ZPS_ERR_PARSE,
                     "'%s' accepted", after[i]);
        cr_assert_not_null(strstr(why, "allow.txt:1: text after the key"), "%s", why);
    }

    /* trainer bindings: "KEY trainer=N", with or without a comment; unbound keys stay -1;
     * a key listed twice must say the same */
    snprintf(text, sizeof text, "%s trainer=0\n%s\ttrainer=4095   # the last one\n%s\n%s trainer=0\n",
             k[0], k[1], k[2], k[0]);
    cr_assert_eq(ps_curve_allow_parse(text, "allow.txt", &a, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_eq(ps_curve_allow_trainer(a, zmq_z85_decode(bin, k[0])), 0);
    cr_assert_eq(ps_curve_allow_trainer(a, zmq_z85_decode(bin, k[1])), 4095);
    cr_assert_eq(ps_curve_allow_trainer(a, zmq_z85_decode(bin, k[2])), -1);
    cr_assert_eq(ps_curve_allow_trainer(a, zmq_z85_decode(bin, other)), -2);
    cr_assert_eq(ps_curve_allow_bound(a), 3);
    ps_curve_allow_destroy(&a);
    const char *conflicts[][2] = {{"trainer=0", "trainer=7"}, {"trainer=2", ""}, {"", "trainer=2"}};
    for (size_t i = 0; i < sizeof conflicts / sizeof *conflicts; i++) {
        snprintf(text, sizeof text, "%s %s\n%s\n%s %s\n", k[0], conflicts[i][0], k[1], k[0],
                 conflicts[i][1]);
        cr_assert_eq(ps_curve_allow_parse(text, "allow.txt", &a, why, sizeof why), ZPS_ERR_PARSE,
                     "conflict %zu accepted", i);
        cr_assert_not_null(strstr(why, "allow.txt:3: this key is listed before with another "
                                       "trainer binding"), "%s", why);
    }
}

Test(ps_curve, keygen_round_trip_and_no_overwrite)
{
    char dir[256], prefix[300], kpath[320], ppath[320], why[1024];
    zt_mktmp(dir, sizeof dir, "zps-curve");
    snprintf(prefix, sizeof prefix, "%s/t0", dir);
    snprintf(kpath, sizeof kpath, "%s.key", prefix);
    snprintf(ppath, sizeof ppath, "%s.pub", prefix);
    cr_assert_eq(ps_curve_keygen(prefix, why, sizeof why), ZPS_OK, "%s", why);
    struct stat sk, sp;
    cr_assert_eq(stat(kpath, &sk), 0);
    cr_assert_eq(stat(ppath, &sp), 0);
    cr_assert_eq(sk.st_mode & 0777, 0600, "key pair mode %o", sk.st_mode & 0777);
    cr_assert_eq(sp.st_mode & 0022, 0, "public key mode %o", sp.st_mode & 0777);
    char pub[41], sec[41], pub2[41], derived[41];
    cr_assert_eq(ps_curve_load_keypair(kpath, pub, sec, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_eq(ps_curve_load_public(ppath, pub2, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_str_eq(pub, pub2);
    cr_assert_eq(zmq_curve_public(derived, sec), 0);
    cr_assert_str_eq(derived, pub);
    char *pub_text = s_slurp(ppath);
    cr_assert_null(strstr(pub_text, sec), "the .pub file holds the secret key");
    char *before = s_slurp(kpath);
    cr_assert_eq(ps_curve_keygen(prefix, why, sizeof why), ZPS_ERR_EXISTS);
    cr_assert_not_null(strstr(why, ppath), "%s", why);
    unlink(ppath); /* only the .key left: still refused, and the .pub is not recreated */
    cr_assert_eq(ps_curve_keygen(prefix, why, sizeof why), ZPS_ERR_EXISTS);
    cr_assert_not_null(strstr(why, kpath), "%s", why);
    cr_assert_neq(access(ppath, F_OK), 0);
    char *after = s_slurp(kpath);
    cr_assert_str_eq(before, after, "the key pair was overwritten");
    free(pub_text);
    free(before);
    free(after);
    zt_rmtmp(dir);
}

Test(ps_curve, bad_key_files_name_the_file)
{
    char dir[256], why[1024], pub[41], sec[41], k[41], s[41], path[320], text[512];
    zt_mktmp(dir, sizeof dir, "zps-curve");
    cr_assert_eq(zmq_curve_keypair(k, s), 0);
    char other[41], osec[41];
    cr_assert_eq(zmq_curve_keypair(other, osec), 0);

    snprintf(path, sizeof path, "%s/missing.key", dir);
    cr_assert_eq(ps_curve_load_keypair(path, pub, sec, why, sizeof why), ZPS_ERR_NOT_FOUND);
    cr_assert_not_null(strstr(why, path), "%s", why);
    cr_assert_eq(ps_curve_load_public(path, pub, why, sizeof why), ZPS_ERR_NOT_FOUND);
    cr_assert_not_null(strstr(why, path), "%s", why);

    static const struct {
        const char *fmt;
        mode_t mode;
        zps_status st;
        const char *want;
    } cases[] = {
        {"public = %1$s\nsecret = %2$s\n", 0644, ZPS_ERR_INVALID, "group or others may access it (mode 0644)"},
        {"public = %1$s\nsecret = %2$s\n", 0604, ZPS_ERR_INVALID, "(mode 0604)"},
        {"public = %1$s\nsecret = %2$.39s\n", 0600, ZPS_ERR_PARSE, ":2: the secret key is not 40 Z85 characters"},
        {"public = %1$s\nsecret = %2$.39s\"\n", 0600, ZPS_ERR_PARSE, ":2: the secret key is not 40 Z85 characters"},
        {"public = %3$s\nsecret = %2$s\n", 0600, ZPS_ERR_PARSE, "the public key does not belong to the secret key"},
        {"public = %1$s\n", 0600, ZPS_ERR_PARSE, "no 'secret = KEY' line"},
        {"%1$s\n", 0600, ZPS_ERR_PARSE, ":1: expected 'public = KEY' or 'secret = KEY' (is this a .pub file?"},
        {"secret = %2$s\nsecret = %2$s\n", 0600, ZPS_ERR_PARSE, ":2: a second 'secret' line"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(path, sizeof path, "%s/case%zu.key", dir, i);
        snprintf(text, sizeof text, cases[i].fmt, k, s, other);
        s_write(path, text, cases[i].mode);
        why[0] = 0;
        cr_assert_eq(ps_curve_load_keypair(path, pub, sec, why, sizeof why), cases[i].st,
                     "case %zu: %s", i, why);
        cr_assert_not_null(strstr(why, path), "case %zu: file not named: %s", i, why);
        cr_assert_not_null(strstr(why, cases[i].want), "case %zu: '%s' not in '%s'", i,
                           cases[i].want, why);
        cr_assert_null(strstr(why, s), "case %zu: the message quotes the secret key", i);
        cr_assert_eq(sec[0], 0, "case %zu: a secret was returned on failure", i);
    }
    /* a secret-less file may be readable by anyone; only the secret is protected */
    snprintf(path, sizeof path, "%s/ok.key", dir);
    snprintf(text, sizeof text, "# mine\nsecret = %s\n", s);
    s_write(path, text, 0600);
    cr_assert_eq(ps_curve_load_keypair(path, pub, sec, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_str_eq(pub, k, "public key derived from the secret");
    /* a public key file with two keys is not a .pub */
    snprintf(path, sizeof path, "%s/two.pub", dir);
    snprintf(text, sizeof text, "%s\n%s\n", k, other);
    s_write(path, text, 0644);
    cr_assert_eq(ps_curve_load_public(path, pub, why, sizeof why), ZPS_ERR_PARSE);
    cr_assert_not_null(strstr(why, "holds 2 keys"), "%s", why);
    cr_assert_not_null(strstr(why, path), "%s", why);
    zt_rmtmp(dir);
}

Test(ps_curve, client_wants_all_three_keys)
{
    ps_client_opts o;
    ps_client_opts_default(&o);
    char sec[41];
    cr_assert_eq(zmq_curve_keypair(o.curve_server_key, sec), 0);
    const char *uris[1] = {"tcp://127.0.0.1:9"};
    ps_client *c = NULL;
    cr_assert_eq(ps_client_new(uris, 1, 0, &o, &c), ZPS_ERR_INVALID, "server key alone");
    cr_assert_null(c);
    cr_assert_eq(zmq_curve_keypair(o.curve_public_key, o.curve_secret_key), 0);
    o.curve_secret_key[5] = '"';
    cr_assert_eq(ps_client_new(uris, 1, 0, &o, &c), ZPS_ERR_INVALID, "bad Z85");
    cr_assert_eq(zmq_curve_keypair(o.curve_public_key, o.curve_secret_key), 0);
    cr_assert_eq(ps_client_new(uris, 1, 0, &o, &c), ZPS_OK);
    ps_client_destroy(&c);
}

Test(ps_curve, client_refuses_bad_streams_and_push_dtype)
{
    ps_client_opts o;
    ps_client_opts_default(&o);
    const char *uris[1] = {"tcp://127.0.0.1:9"};
    ps_client *c = NULL;
    static const int bad[] = {0, 9};
    for (int k = 0; k < 2; k++) {
        o.streams = bad[k];
        cr_assert_eq(ps_client_new(uris, 1, 0, &o, &c), ZPS_ERR_INVALID, "streams %d", o.streams);
        cr_assert_null(c);
    }
    o.streams = 8;
    cr_assert_eq(ps_client_new(uris, 1, 0, &o, &c), ZPS_OK);
    ps_client_destroy(&c);
    o.push_dtype = (ps_dtype)2; // neither f32 nor bf16
    cr_assert_eq(ps_client_new(uris, 1, 0, &o, &c), ZPS_ERR_INVALID);
    cr_assert_null(c);
    o.push_dtype = PS_DTYPE_BF16;
    cr_assert_eq(ps_client_new(uris, 1, 0, &o, &c), ZPS_OK);
    ps_client_destroy(&c);
}

/* ------------------------------------------------------------------------- processes */

TestSuite(it_ps_curve, .timeout = 60);

Test(it_ps_curve, keygen_binary_round_trip_and_refusal)
{
    char dir[256], prefix[300], kpath[320], ppath[320], out[8192], why[1024];
    zt_mktmp(dir, sizeof dir, "zps-curve");
    snprintf(prefix, sizeof prefix, "%s/srv", dir);
    snprintf(kpath, sizeof kpath, "%s.key", prefix);
    snprintf(ppath, sizeof ppath, "%s.pub", prefix);
    const char *args[] = {"--keygen", prefix, NULL};
    int st = s_run_server(args, out, sizeof out, 10);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "keygen failed: %s", out);
    struct stat sk;
    cr_assert_eq(stat(kpath, &sk), 0);
    cr_assert_eq(sk.st_mode & 0777, 0600);
    char pub[41], sec[41], pub2[41];
    cr_assert_eq(ps_curve_load_keypair(kpath, pub, sec, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_eq(ps_curve_load_public(ppath, pub2, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_str_eq(pub, pub2);
    char *before = s_slurp(kpath);
    st = s_run_server(args, out, sizeof out, 10);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1, "second keygen: status %d: %s", st, out);
    cr_assert_not_null(strstr(out, "exists; not overwriting"), "%s", out);
    char *after = s_slurp(kpath);
    cr_assert_str_eq(before, after);
    free(before);
    free(after);
    zt_rmtmp(dir);
}

Test(it_ps_curve, server_refuses_bad_key_files)
{
    char dir[256], key[300], allow[300], wide[300], badallow[300], missing[300], out[8192];
    zt_mktmp(dir, sizeof dir, "zps-curve");
    s_keygen(dir, "server");
    s_keygen(dir, "t0");
    s_allow(dir, "t0");
    snprintf(key, sizeof key, "%s/server.key", dir);
    snprintf(allow, sizeof allow, "%s/allow.txt", dir);
    snprintf(wide, sizeof wide, "%s/wide.key", dir);
    snprintf(badallow, sizeof badallow, "%s/bad-allow.txt", dir);
    snprintf(missing, sizeof missing, "%s/missing.key", dir);
    char *kt = s_slurp(key);
    s_write(wide, kt, 0644);
    free(kt);
    s_write(badallow, "# ok\nnot-a-key\n", 0644);
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
        int st = s_run_server(cases[i], out, sizeof out, 10);
        cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == (i == 3 ? 2 : 1),
                  "case %d: status %d:\n%s", i, st, out);
        cr_assert_not_null(strstr(out, want[i]), "case %d: '%s' not in:\n%s", i, want[i], out);
        if (named[i])
            cr_assert_not_null(strstr(out, named[i]), "case %d: %s not named:\n%s", i, named[i], out);
    }
    zt_rmtmp(dir);
}

Test(it_ps_curve, allowed_trainer_trains_refused_one_fails_fast)
{
    uint64_t seed = pst_seed();
    char dir[256];
    zt_mktmp(dir, sizeof dir, "zps-curve");
    s_keygen(dir, "server");
    s_keygen(dir, "good");
    s_keygen(dir, "evil");
    s_allow(dir, "good");
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, NV, 1, 0, &plan), ZPS_OK);
    pst_server srv;
    s_curve_server(&srv, dir, "1");

    /* the allowed trainer, with the heartbeat thread (its sockets must authenticate too) */
    ps_client *good;
    cr_assert_eq(s_client(srv.uri, dir, "server", "good", 0, 1, &good), ZPS_OK);
    s_train_round(good, plan, seed, 0);
    double end = zps_now_s() + FAST_S;
    while (s_stat(good, "auth_accepted") < 2 && zps_now_s() < end)
        zps_sleep_ns(5000000); /* polls for the heartbeat socket's handshake, bounded */
    cr_assert_geq(s_stat(good, "auth_accepted"), 2, "heartbeat thread did not authenticate");
    cr_assert_eq(s_stat(good, "auth_rejected"), 0);
    cr_assert_eq(s_stat(good, "handshake_failed"), 0);

    /* a trainer whose key is not in the allow-list: refused at REGISTER, quickly */
    ps_client *evil;
    cr_assert_eq(s_client(srv.uri, dir, "server", "evil", 0, 0, &evil), ZPS_OK);
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
    s_keygen(dir, "server");
    const char *names[2] = {"t0", "t1"};
    for (int i = 0; i < 2; i++) {
        s_keygen(dir, names[i]);
        snprintf(path, sizeof path, "%s/%s.pub", dir, names[i]);
        cr_assert_eq(ps_curve_load_public(path, pub[i], why, sizeof why), ZPS_OK, "%s", why);
    }
    char text[256];
    snprintf(text, sizeof text, "# bound keys\n%s trainer=0\n%s trainer=1 # t1\n", pub[0], pub[1]);
    snprintf(path, sizeof path, "%s/allow.txt", dir);
    s_write(path, text, 0644);
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
    cr_assert_eq(s_client(srv.uri, dir, "server", "t1", 0, 0, &liar), ZPS_OK);
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
    cr_assert_eq(s_client(srv.uri, dir, "server", "t0", 0, 0, &c0), ZPS_OK);
    s_train_round(c0, plan, seed, 0);
    cr_assert_eq(s_client(srv.uri, dir, "server", "t1", 1, 0, &c1), ZPS_OK);
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
    s_keygen(dir, "server");
    s_keygen(dir, "other-server");
    s_keygen(dir, "good");
    s_allow(dir, "good");
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, NV, 1, 0, &plan), ZPS_OK);
    pst_server csrv, psrv;
    s_curve_server(&csrv, dir, "1");
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
        cr_assert_eq(s_client(cases[i].curve_server ? csrv.uri : psrv.uri, dir,
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
    cr_assert_eq(s_client(csrv.uri, dir, "server", "good", 0, 0, &good), ZPS_OK);
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
    s_keygen(dir, "server");
    s_keygen(dir, "good");
    s_allow(dir, "good");
    pst_server csrv, psrv;
    s_curve_server(&csrv, dir, "1");
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
    cr_assert_eq(s_client(csrv.uri, dir, "server", "good", 0, 0, &good), ZPS_OK);
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

/* ---- a TCP relay that records every byte between the client and the server ---- */

#define RELAY_CAP (4u << 20)
#define RELAY_PAIRS 8

typedef struct s_relay {
    int lfd;            // listening socket on 127.0.0.1
    int port;           // its port
    int target;         // the server's port
    int stop[2];        // pipe: a byte stops the thread
    pthread_t th;
    unsigned char *up;  // (RELAY_CAP) client -> server bytes
    unsigned char *down; // (RELAY_CAP) server -> client bytes
    size_t n_up, n_down;
} s_relay;

static void *s_relay_main(void *arg)
{
    s_relay *r = arg;
    int a[RELAY_PAIRS], b[RELAY_PAIRS], np = 0;
    char buf[65536];
    for (;;) {
        struct pollfd p[2 + 2 * RELAY_PAIRS];
        int n = 0;
        p[n++] = (struct pollfd){r->stop[0], POLLIN, 0};
        p[n++] = (struct pollfd){r->lfd, POLLIN, 0};
        for (int i = 0; i < np; i++) {
            p[n++] = (struct pollfd){a[i], POLLIN, 0};
            p[n++] = (struct pollfd){b[i], POLLIN, 0};
        }
        if (poll(p, (nfds_t)n, -1) < 0)
            continue;
        if (p[0].revents)
            break;
        if ((p[1].revents & POLLIN) && np < RELAY_PAIRS) {
            int c = accept(r->lfd, NULL, NULL);
            int s = socket(AF_INET, SOCK_STREAM, 0);
            struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)r->target)};
            sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            if (c >= 0 && s >= 0 && connect(s, (struct sockaddr *)&sa, sizeof sa) == 0) {
                a[np] = c;
                b[np] = s;
                np++;
            } else {
                if (c >= 0)
                    close(c);
                if (s >= 0)
                    close(s);
            }
        }
        for (int i = 0; i < np; i++) {
            for (int dir = 0; dir < 2; dir++) {
                struct pollfd *q = &p[2 + 2 * i + dir];
                if (!(q->revents & (POLLIN | POLLHUP | POLLERR)))
                    continue;
                int from = dir ? b[i] : a[i], to = dir ? a[i] : b[i];
                ssize_t k = read(from, buf, sizeof buf);
                if (k <= 0) { /* one side closed: close the pair */
                    close(a[i]);
                    close(b[i]);
                    a[i] = a[np - 1];
                    b[i] = b[np - 1];
                    np--;
                    goto next_round;
                }
                unsigned char *cap = dir ? r->down : r->up;
                size_t *cn = dir ? &r->n_down : &r->n_up;
                size_t keep = (size_t)k < RELAY_CAP - *cn ? (size_t)k : RELAY_CAP - *cn;
                memcpy(cap + *cn, buf, keep);
                *cn += keep;
                for (ssize_t off = 0; off < k;) {
                    ssize_t w = write(to, buf + off, (size_t)(k - off));
                    if (w <= 0)
                        break;
                    off += w;
                }
            }
        }
    next_round:;
    }
    for (int i = 0; i < np; i++) {
        close(a[i]);
        close(b[i]);
    }
    return NULL;
}

static void s_relay_start(s_relay *r, const char *server_uri)
{
    memset(r, 0, sizeof *r);
    const char *colon = strrchr(server_uri, ':');
    cr_assert_not_null(colon);
    r->target = atoi(colon + 1);
    r->up = zps_xmalloc(RELAY_CAP);
    r->down = zps_xmalloc(RELAY_CAP);
    r->lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(bind(r->lfd, (struct sockaddr *)&sa, sizeof sa), 0);
    cr_assert_eq(listen(r->lfd, 8), 0);
    socklen_t sl = sizeof sa;
    cr_assert_eq(getsockname(r->lfd, (struct sockaddr *)&sa, &sl), 0);
    r->port = ntohs(sa.sin_port);
    cr_assert_eq(pipe(r->stop), 0);
    cr_assert_eq(pthread_create(&r->th, NULL, s_relay_main, r), 0);
}

static void s_relay_stop(s_relay *r)
{
    cr_assert_eq(write(r->stop[1], "x", 1), 1);
    pthread_join(r->th, NULL);
    close(r->stop[0]);
    close(r->stop[1]);
    close(r->lfd);
}

static void s_relay_free(s_relay *r)
{
    free(r->up);
    free(r->down);
}

/* 32 copies of float x: what a run of that value looks like on the wire in clear. */
static void s_pattern(float x, unsigned char *pat)
{
    for (int i = 0; i < 32; i++)
        memcpy(pat + 4 * i, &x, 4);
}

Test(it_ps_curve, traffic_is_encrypted)
{
    char dir[256];
    zt_mktmp(dir, sizeof dir, "zps-curve");
    s_keygen(dir, "server");
    s_keygen(dir, "good");
    s_allow(dir, "good");
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, NV, 1, 0, &plan), ZPS_OK);
    /* init values 1234.5678, gradient 0.25, lr 0.5: pulls carry 1234.4428 */
    const float init = 1234.5678f, pulled = init - 0.5f * 0.25f;
    unsigned char pin[128], pout[128];
    s_pattern(init, pin);
    s_pattern(pulled, pout);
    for (int curve = 0; curve < 2; curve++) {
        pst_server srv;
        if (curve)
            s_curve_server(&srv, dir, "1");
        else
            cr_assert_eq(pst_spawn(&srv, NULL,
                                   (const char *const[]){"--mode", "sync", "--num-trainers", "1", NULL}),
                         0);
        s_relay r;
        s_relay_start(&r, srv.uri);
        char uri[64];
        snprintf(uri, sizeof uri, "tcp://127.0.0.1:%d", r.port);
        ps_client *c;
        cr_assert_eq(s_client(uri, dir, "server", curve ? "good" : NULL, 0, 0, &c), ZPS_OK);
        s_train_round(c, plan, 1, init); /* checks the pulled values too */
        ps_client_destroy(&c);
        s_relay_stop(&r);
        pst_kill(&srv, SIGTERM);
        size_t need = plan->total * 4;
        cr_assert_geq(r.n_up, need, "%zu bytes went up, want >= %zu", r.n_up, need);
        cr_assert_geq(r.n_down, need, "%zu bytes came down, want >= %zu", r.n_down, need);
        int in_up = memmem(r.up, r.n_up, pin, sizeof pin) != NULL;
        int in_down = memmem(r.down, r.n_down, pout, sizeof pout) != NULL;
        cr_log_info("%s: %zu bytes up, %zu down; initial values in clear: %s, pulled values in "
                    "clear: %s", curve ? "CURVE" : "plaintext", r.n_up, r.n_down,
                    in_up ? "yes" : "no", in_down ? "yes" : "no");
        if (curve) {
            cr_assert_not(in_up, "initial values cross the wire in clear with CURVE");
            cr_assert_not(in_down, "pulled values cross the wire in clear with CURVE");
        } else { /* control: the same search finds them without CURVE */
            cr_assert(in_up, "control: initial values not found in plaintext traffic");
            cr_assert(in_down, "control: pulled values not found in plaintext traffic");
        }
        s_relay_free(&r);
    }
    ps_plan_destroy(&plan);
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
    char *log = s_slurp(path);
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
    log = s_slurp(path);
    cr_assert_not_null(strstr(log, "CURVE on"), "%s", log);
    cr_assert_not_null(strstr(log, "2 trainer key(s) allowed"), "%s", log);
    cr_assert_not_null(strstr(log, "2 of them bound to one trainer id"), "%s", log);
    free(log);
    snprintf(path, sizeof path, "%s/run/keys/allow.txt", dir);
    log = s_slurp(path);
    cr_assert_not_null(strstr(log, " trainer=0  # trainer-0\n"), "%s", log);
    cr_assert_not_null(strstr(log, " trainer=1  # trainer-1\n"), "%s", log);
    free(log);
    snprintf(path, sizeof path, "%s/run/trainer-1.log", dir);
    log = s_slurp(path);
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
    s_write(allow1, text, 0644);
    snprintf(cmd, sizeof cmd,
             "cd '%s' && timeout 150 '%s/scripts/zps-launch' --bin-dir '%s' --servers 1 "
             "--trainers 2 --curve --run-dir run --timeout 100 --grace 5 --quiet "
             "--server-args='--curve-allow %s' --trainer-args='%s' > launch2.log 2>&1",
             dir, root && *root ? root : ".", bin, allow1, targs);
    st = system(cmd);
    snprintf(path, sizeof path, "%s/launch2.log", dir);
    log = s_slurp(path);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1, "fleet with a refused trainer: %d\n%s", st,
              log);
    free(log);
    snprintf(path, sizeof path, "%s/run/trainer-1.log", dir);
    log = s_slurp(path);
    cr_assert_not_null(strstr(log, "refused this trainer's CURVE key"), "%s", log);
    free(log);
    zt_rmtmp(dir);
}
