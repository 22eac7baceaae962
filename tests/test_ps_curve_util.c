/* test_ps_curve_util.c — helpers of the CURVE suites (tests/ps_curve_test_util.h): key
 * files written through the library, CURVE servers and clients, one checked training round.
 * No tests here. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/mem.h"
#include "ps/curve.h"
#include "ps/optim.h"
#include "tests/ps_curve_test_util.h"

void pct_write(const char *path, const char *text, mode_t mode)
{
    unlink(path);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, mode);
    cr_assert(fd >= 0, "cannot create %s", path);
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    cr_assert_eq(chmod(path, mode), 0);
}

char *pct_slurp(const char *path)
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
void pct_keygen(const char *dir, const char *name)
{
    char prefix[600], why[1024];
    snprintf(prefix, sizeof prefix, "%s/%s", dir, name);
    cr_assert_eq(ps_curve_keygen(prefix, why, sizeof why), ZPS_OK, "%s", why);
}

/* The public key of dir/name.pub, appended as a line to dir/allow.txt. */
void pct_allow(const char *dir, const char *name)
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

/* A client of uri; with keys (server_pub, name: dir/<server_pub>.pub and dir/<name>.key)
 * unless name is NULL. */
zps_status pct_client(const char *uri, const char *dir, const char *server_pub,
                      const char *name, uint32_t trainer, int hb_thread, ps_client **c)
{
    ps_client_opts o;
    ps_client_opts_default(&o);
    o.heartbeat_thread = hb_thread;
    o.timeout_ms = 120000; /* a refusal must come from the handshake, never from a timeout */
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

/* Starts a CURVE server with dir/server.key and dir/allow.txt (sync, ntrainers trainers). */
void pct_curve_server(pst_server *srv, const char *dir, const char *ntrainers)
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
void pct_train_round(ps_client *c, const ps_plan *plan, uint64_t seed, float fill)
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
    cr_assert_eq(ps_client_push(c, 0, plan->n_vars, g, 0, &t), ZPS_OK);
    cr_assert_eq(ps_client_wait(c, t), ZPS_OK, "%s", ps_client_last_error(c));
    cr_assert_eq(ps_client_pull(c, 0, plan->n_vars, v, 1, &t), ZPS_OK);
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
