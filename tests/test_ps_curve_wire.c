/* test_ps_curve_wire.c — what crosses the wire with and without CURVE (docs/ps.md
 * "Security").
 *
 * it_ps_curve (with test_ps_curve_auth.c): a TCP relay between client and server records
 * every byte; pushed and pulled floats never cross the wire in clear with CURVE, and, as a
 * control, the same search finds them without it.
 */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/mem.h"
#include "ps/client.h"
#include "ps/plan.h"
#include "tests/ps_curve_test_util.h"
#include "tests/ps_test_util.h"
#include "tests/testutil.h"

static const ps_var s_vars[] = {{"w", 3000}, {"b", 7}};
#define NV 2

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
    /* the relay stands for another host: payloads must cross the wire, not shared memory */
    setenv("ZPS_SHM", "0", 1);
    char dir[256];
    zt_mktmp(dir, sizeof dir, "zps-curve");
    pct_keygen(dir, "server");
    pct_keygen(dir, "good");
    pct_allow(dir, "good");
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
            pct_curve_server(&srv, dir, "1");
        else
            cr_assert_eq(pst_spawn(&srv, NULL,
                                   (const char *const[]){"--mode", "sync", "--num-trainers", "1", NULL}),
                         0);
        s_relay r;
        s_relay_start(&r, srv.uri);
        char uri[64];
        snprintf(uri, sizeof uri, "tcp://127.0.0.1:%d", r.port);
        ps_client *c;
        cr_assert_eq(pct_client(uri, dir, "server", curve ? "good" : NULL, 0, 0, &c), ZPS_OK);
        pct_train_round(c, plan, 1, init); /* checks the pulled values too */
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
