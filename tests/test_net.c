/* test_net.c — host-name resolution of endpoints (common/net.h).
 *
 * Suite net: the resolver on names, IPv4 and [IPv6] literals, pass-through endpoints, unknown
 * names and malformed endpoints; binds that try addresses in order; ZeroMQ round trips
 * through a name and through [::1] (which needs ZMQ_IPV6 on the connecting socket); ending a
 * ZeroMQ context that a signal interrupts.
 * Suite it_net (real processes on loopback): zps-server binds `--bind localhost:0`, the
 * machine's host name and [::1]; a fleet whose cluster file names its servers by name (and
 * [::1]) trains; an unresolvable server host stops zps-server and zps-trainer at once with
 * the resolver's message.
 *
 * IPv6 cases need the kernel's IPv6 loopback; without one they SKIP saying so. No host name
 * that resolves to ::1 is assumed (many /etc/hosts have none): IPv6 is exercised through the
 * literal [::1].
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/net.h"
#include "ps/plan.h"
#include "tests/ps_test_util.h"
#include "tests/testutil.h"

/* 1 when a TCP socket can bind ::1 (the kernel has IPv6 loopback). */
static int s_have_v6(void)
{
    int fd = socket(AF_INET6, SOCK_STREAM, 0);
    if (fd < 0)
        return 0;
    struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    int ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    return ok;
}

#define S_NEED_V6()                                                                    \
    do {                                                                               \
        if (!s_have_v6())                                                              \
            ZPS_TEST_SKIP("this kernel has no IPv6 loopback (cannot bind ::1)");       \
    } while (0)

/* This machine's host name when it resolves to a loopback address (what a cluster file on
 * a one-node allocation holds), else "localhost". */
static const char *s_loop_host(void)
{
    static char host[256];
    zps_net_addr a;
    int n;
    if (gethostname(host, sizeof host - 1) == 0) {
        char ep[300];
        snprintf(ep, sizeof ep, "%s:1", host);
        if (zps_net_resolve(ep, "test", 0, &a, 1, &n, NULL, 0) == ZPS_OK &&
            (!strncmp(a.uri, "tcp://127.", 10) || !strncmp(a.uri, "tcp://[::1]", 11)))
            return host;
    }
    return "localhost";
}

/* A TCP port free on the loopback address of family af right now. */
static int s_free_port(int af)
{
    int fd = socket(af, SOCK_STREAM, 0);
    cr_assert(fd >= 0);
    struct sockaddr_storage ss = {0};
    socklen_t len;
    if (af == AF_INET6) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
        *a = (struct sockaddr_in6){.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
        len = sizeof *a;
    } else {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
        *a = (struct sockaddr_in){.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        len = sizeof *a;
    }
    cr_assert_eq(bind(fd, (struct sockaddr *)&ss, len), 0);
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&ss, &len), 0);
    int port = ntohs(af == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                    : ((struct sockaddr_in *)&ss)->sin_port);
    close(fd);
    return port;
}

/* ------------------------------------------------------------------------- suite net */

/* Resolves ep for connecting: asserts success and one address, returns it. */
static zps_net_addr s_one(const char *ep)
{
    zps_net_addr a[ZPS_NET_ADDRS_MAX];
    int n = -1;
    char why[512] = "";
    cr_assert_eq(zps_net_resolve(ep, "server", 0, a, ZPS_NET_ADDRS_MAX, &n, why, sizeof why),
                 ZPS_OK, "%s: %s", ep, why);
    cr_assert(n >= 1, "%s: no address", ep);
    return a[0];
}

Test(net, resolves_names_and_literals)
{
    zps_net_addr a = s_one("tcp://localhost:7000");
    /* localhost may come first as ::1 where /etc/hosts says so */
    cr_assert(!strcmp(a.uri, "tcp://127.0.0.1:7000") || !strcmp(a.uri, "tcp://[::1]:7000"),
              "localhost -> %s", a.uri);
    cr_assert_eq(a.ipv6, a.uri[6] == '[');
    a = s_one("localhost:7000"); // tcp:// may be left out
    cr_assert_eq(strncmp(a.uri, "tcp://", 6), 0);
    a = s_one("tcp://127.0.0.1:7001");
    cr_assert_str_eq(a.uri, "tcp://127.0.0.1:7001");
    cr_assert_eq(a.ipv6, 0);
    a = s_one("tcp://[::1]:7002");
    cr_assert_str_eq(a.uri, "tcp://[::1]:7002");
    cr_assert_eq(a.ipv6, 1);
    a = s_one("[0:0:0::1]:*"); // numeric form normalised, ephemeral port kept
    cr_assert_str_eq(a.uri, "tcp://[::1]:*");
    cr_assert_eq(a.ipv6, 1);
    char ep[300];
    snprintf(ep, sizeof ep, "tcp://%s:7003", s_loop_host());
    a = s_one(ep);
    cr_assert(!strncmp(a.uri, "tcp://127.", 10) || !strncmp(a.uri, "tcp://[::1]:", 12), "%s", a.uri);
}

/* Where an endpoint is: loopback for the server's no-CURVE warning, here for the trainers
 * that share this machine's cores; neither resolves names. */
Test(net, loopback_and_here)
{
    char me[256] = "", ep[320];
    cr_assert_eq(gethostname(me, sizeof me - 1), 0);
    const char *loop[] = {"tcp://127.0.0.1:7000", "127.3.4.5:1", "tcp://[::1]:7000",
                          "tcp://localhost:7000", "ipc:///tmp/zps-x", "inproc://y"};
    for (size_t i = 0; i < sizeof loop / sizeof loop[0]; i++) {
        cr_assert(zps_net_endpoint_loopback(loop[i]), "%s", loop[i]);
        cr_assert(zps_net_endpoint_here(loop[i]), "%s", loop[i]);
    }
    /* documentation addresses (RFC 5737, RFC 3849): no machine's interface holds them */
    const char *away[] = {"tcp://203.0.113.77:7000", "tcp://*:7000", "tcp://[2001:db8::3]:1",
                          "tcp://elsewhere.invalid:7000"};
    for (size_t i = 0; i < sizeof away / sizeof away[0]; i++) {
        cr_assert(!zps_net_endpoint_loopback(away[i]), "%s", away[i]);
        cr_assert(!zps_net_endpoint_here(away[i]), "%s", away[i]);
    }
    const char *bad[] = {"tcp://127.0.0.1", "127.0.0.1:99999", "tcp://::1:7000", ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_assert(!zps_net_endpoint_loopback(bad[i]) && !zps_net_endpoint_here(bad[i]),
                  "malformed '%s'", bad[i]);
    snprintf(ep, sizeof ep, "tcp://%s:7000", me);
    cr_assert(zps_net_endpoint_here(ep), "%s is here", ep);
    cr_assert(zps_net_host_here(me) && zps_net_host_here("::1") && zps_net_host_here("localhost"));
    char shortname[256];
    snprintf(shortname, sizeof shortname, "%.*s.some.domain", (int)strcspn(me, "."), me);
    cr_assert(zps_net_host_here(shortname), "%s: the same short name", shortname);
    snprintf(shortname, sizeof shortname, "%sx", me);
    cr_assert(!zps_net_host_here(shortname), "%s is another host", shortname);
    cr_assert(!zps_net_host_loopback(me[0] ? "10.0.0.1" : "x") && !zps_net_host_here(""));
}

/* A cluster file that lists this machine by the address of one of its interfaces (10.x, a
 * veth in a test's namespace, ...) means this machine: the trainers there share its cores.
 * Before, only loopback and the host's name counted, so two trainers listed by address each
 * took every core (and a sync fleet so listed summed differently from one listed on
 * loopback). */
Test(net, an_address_of_this_machine_is_here)
{
    struct ifaddrs *ifs = NULL;
    cr_assert_eq(getifaddrs(&ifs), 0, "getifaddrs: %s", strerror(errno));
    int checked = 0;
    for (struct ifaddrs *p = ifs; p; p = p->ifa_next) {
        if (!p->ifa_addr || (p->ifa_addr->sa_family != AF_INET &&
                             p->ifa_addr->sa_family != AF_INET6))
            continue;
        char host[INET6_ADDRSTRLEN], ep[INET6_ADDRSTRLEN + 16];
        int v6 = p->ifa_addr->sa_family == AF_INET6;
        const void *a = v6 ? (const void *)&((struct sockaddr_in6 *)(void *)p->ifa_addr)->sin6_addr
                           : (const void *)&((struct sockaddr_in *)(void *)p->ifa_addr)->sin_addr;
        cr_assert_not_null(inet_ntop(p->ifa_addr->sa_family, a, host, sizeof host));
        if (v6 && !strncmp(host, "fe80:", 5))
            continue; /* link-local: an endpoint would need its zone */
        snprintf(ep, sizeof ep, v6 ? "tcp://[%s]:7000" : "tcp://%s:7000", host);
        cr_assert(zps_net_host_here(host), "%s (%s) is this machine's", host, p->ifa_name);
        cr_assert(zps_net_endpoint_here(ep), "%s", ep);
        checked++;
    }
    freeifaddrs(ifs);
    cr_assert_geq(checked, 1, "no interface address (loopback at least)");
}

Test(net, other_transports_and_the_wildcard_pass_through)
{
    const char *eps[] = {"ipc:///tmp/zps-x", "inproc://zps-y", "tcp://*:7000", "tcp://*:*"};
    for (size_t i = 0; i < sizeof eps / sizeof eps[0]; i++) {
        zps_net_addr a = s_one(eps[i]);
        cr_assert_str_eq(a.uri, eps[i]);
        cr_assert_eq(a.ipv6, 0);
    }
}

Test(net, unknown_host_names_the_host_and_the_resolver_error)
{
    zps_net_addr a;
    int n = -1;
    char why[512] = "";
    cr_assert_eq(zps_net_resolve("tcp://nosuch.invalid:7000", "server", 0, &a, 1, &n, why,
                                 sizeof why), ZPS_ERR_NOT_FOUND);
    cr_assert_eq(n, 0);
    const char *want = "cannot resolve server host 'nosuch.invalid': ";
    cr_assert_eq(strncmp(why, want, strlen(want)), 0, "got '%s'", why);
    cr_assert(strlen(why) > strlen(want), "no resolver error text in '%s'", why);
}

static const struct {
    const char *ep;
    const char *msg; /* substring of why */
} s_bad[] = {
    {"tcp://localhost", "has no port"},
    {"localhost", "has no port"},
    {"tcp://::1:7000", "put an IPv6 address in brackets"},
    {"tcp://[::1:7000", "want HOST:PORT or [IPv6]:PORT"},
    {"tcp://[::1]7000", "want HOST:PORT or [IPv6]:PORT"},
    {"tcp://:7000", "empty or overlong host"},
    {"tcp://[]:7000", "empty or overlong host"},
    {"tcp://a:70000", "bad port"},
    {"tcp://a:7x", "bad port"},
    {"tcp://a:", "bad port"},
    {"tcp://a:-1", "bad port"},
};

Test(net, malformed_endpoints_say_what_is_wrong)
{
    for (size_t i = 0; i < sizeof s_bad / sizeof s_bad[0]; i++) {
        zps_net_addr a;
        int n = -1;
        char why[512] = "";
        cr_assert_eq(zps_net_resolve(s_bad[i].ep, "server", 1, &a, 1, &n, why, sizeof why),
                     ZPS_ERR_INVALID, "%s", s_bad[i].ep);
        cr_assert_not_null(strstr(why, s_bad[i].msg), "%s: got '%s', want '%s'", s_bad[i].ep,
                           why, s_bad[i].msg);
        cr_assert_not_null(strstr(why, "server"), "%s: '%s' does not name the role",
                           s_bad[i].ep, why);
    }
}

Test(net, a_bind_may_name_an_interface)
{
    if (!if_nametoindex("lo"))
        ZPS_TEST_SKIP("no network interface named lo");
    zps_net_addr a;
    int n;
    cr_assert_eq(zps_net_resolve("tcp://lo:0", "server", 1, &a, 1, &n, NULL, 0), ZPS_OK);
    cr_assert_str_eq(a.uri, "tcp://lo:0");
    cr_assert_eq(zps_net_resolve("tcp://lo:1", "server", 0, &a, 1, &n, NULL, 0),
                 ZPS_ERR_NOT_FOUND, "a connect must not take an interface name");
}

/* The ROUTER's bound endpoint. */
static void s_last(void *sock, char *ep, size_t len)
{
    cr_assert_eq(zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, ep, &len), 0);
}

Test(net, bind_tries_the_addresses_in_order)
{
    void *ctx = zmq_ctx_new();
    void *r = zmq_socket(ctx, ZMQ_ROUTER);
    /* documentation addresses (RFC 5737, RFC 3849) are on no interface: they fail to bind */
    zps_net_addr a[3] = {{"tcp://[2001:db8::1]:*", 1}, {"tcp://203.0.113.1:*", 0},
                         {"tcp://127.0.0.1:*", 0}};
    cr_assert_eq(zps_net_bind_addrs(r, a, 3, "tcp://several:0"), ZPS_OK);
    char ep[256];
    s_last(r, ep, sizeof ep);
    cr_assert_eq(strncmp(ep, "tcp://127.0.0.1:", 16), 0, "bound %s", ep);
    int v6 = -1;
    size_t len = sizeof v6;
    cr_assert_eq(zmq_getsockopt(r, ZMQ_IPV6, &v6, &len), 0);
    cr_assert_eq(v6, 0, "ZMQ_IPV6 left on after the failed IPv6 attempt");
    void *r2 = zmq_socket(ctx, ZMQ_ROUTER);
    cr_assert_eq(zps_net_bind_addrs(r2, a, 2, "tcp://several:0"), ZPS_ERR_ZMQ);
    zmq_close(r2);
    zmq_close(r);
    zmq_ctx_term(ctx);
}

/* A ROUTER bound to bind_ep and a DEALER connected (2 connections) to connect_fmt with the
 * bound port: one message gets through within 3 s. */
static void s_round_trip(const char *bind_ep, const char *connect_fmt)
{
    void *ctx = zmq_ctx_new();
    void *r = zmq_socket(ctx, ZMQ_ROUTER), *d = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(r, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
    cr_assert_eq(zps_net_bind(r, bind_ep, "server"), ZPS_OK, "bind %s", bind_ep);
    char ep[256], to[300];
    s_last(r, ep, sizeof ep);
    snprintf(to, sizeof to, connect_fmt, strrchr(ep, ':') + 1);
    cr_assert_eq(zps_net_connect(d, to, "server", 2), ZPS_OK, "connect %s", to);
    cr_assert_eq(zmq_send(d, "hi", 2, 0), 2);
    zmq_pollitem_t it = {r, 0, ZMQ_POLLIN, 0};
    cr_assert_eq(zmq_poll(&it, 1, 3000), 1, "nothing arrived at %s from %s", ep, to);
    char buf[16];
    cr_assert(zmq_recv(r, buf, sizeof buf, 0) > 0); // identity
    cr_assert_eq(zmq_recv(r, buf, sizeof buf, 0), 2);
    cr_assert_eq(memcmp(buf, "hi", 2), 0);
    zmq_close(d);
    zmq_close(r);
    zmq_ctx_term(ctx);
}

Test(net, round_trip_through_a_name) { s_round_trip("localhost:0", "tcp://localhost:%s"); }

Test(net, round_trip_through_ipv6)
{
    S_NEED_V6();
    s_round_trip("tcp://[::1]:0", "[::1]:%s");
}

/* ------------------------------------------------------------------------- suite it_net */

static char s_tmp[512], s_data[600];

static void s_cleanup(void)
{
    if (s_tmp[0])
        zt_rmtmp(s_tmp);
}

static volatile sig_atomic_t s_alarms;
static void s_on_alarm(int sig)
{
    (void)sig;
    s_alarms++;
}

/* A context whose ending blocks: a PUSH socket with one message queued for a peer that never
 * answers (127.0.0.1:1 refuses), lingering 400 ms from its close; a SIGALRM (no SA_RESTART)
 * comes every 25 ms from 25 ms on, so whatever delays this process, signals keep arriving while
 * zmq_ctx_term waits. Returns the context, the timer armed; *closed_ns is when the socket was
 * closed (the linger counts from there). */
static void *s_lingering_ctx(uint64_t *closed_ns)
{
    void *ctx = zmq_ctx_new();
    cr_assert_not_null(ctx);
    void *sock = zmq_socket(ctx, ZMQ_PUSH);
    cr_assert_not_null(sock);
    int linger = 400;
    cr_assert_eq(zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger), 0);
    cr_assert_eq(zmq_connect(sock, "tcp://127.0.0.1:1"), 0);
    cr_assert_eq(zmq_send(sock, "x", 1, ZMQ_DONTWAIT), 1);
    *closed_ns = zps_now_ns();
    cr_assert_eq(zmq_close(sock), 0);
    s_alarms = 0;
    struct itimerval it = {.it_value = {.tv_usec = 25000}, .it_interval = {.tv_usec = 25000}};
    cr_assert_eq(setitimer(ITIMER_REAL, &it, NULL), 0);
    return ctx;
}

static void s_disarm(void)
{
    struct itimerval off = {{0, 0}, {0, 0}};
    cr_assert_eq(setitimer(ITIMER_REAL, &off, NULL), 0);
}

/* zmq_ctx_term interrupted by a signal returns EINTR with the context not ended (its threads
 * running, its frames not released); zps_net_ctx_end goes on until it has ended: it returns
 * after the linger, with the signals handled on the way. A server freeing its zero-copy
 * frames after an interrupted zmq_ctx_term (a second SIGTERM) would free frames zmq held. */
Test(net, ending_a_context_outlasts_a_signal, .timeout = 10)
{
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = s_on_alarm; /* no SA_RESTART: blocking calls return EINTR */
    cr_assert_eq(sigaction(SIGALRM, &sa, &old), 0);
    uint64_t closed;
    void *ctx = s_lingering_ctx(&closed);
    int rc = zmq_ctx_term(ctx), err = zmq_errno();
    double took = (double)(zps_now_ns() - closed) * 1e-9;
    cr_assert(rc == -1 && err == EINTR && s_alarms >= 1, "zmq_ctx_term under signals: rc %d "
              "(%s) after %.3f s, %d alarm(s): the case this test is about did not arise", rc,
              zmq_strerror(err), took, (int)s_alarms);
    while (zmq_ctx_term(ctx) == -1 && zmq_errno() == EINTR)
        ;
    s_disarm();
    ctx = s_lingering_ctx(&closed);
    zps_net_ctx_end(ctx, "test");
    took = (double)(zps_now_ns() - closed) * 1e-9;
    int alarms = s_alarms;
    s_disarm();
    cr_assert(alarms >= 1 && took >= 0.38, "zps_net_ctx_end returned %.3f s after the close "
              "with %d alarm(s): before the 400 ms linger, so a signal ended it early", took,
              alarms);
    cr_assert_eq(sigaction(SIGALRM, &old, NULL), 0);
}

TestSuite(it_net, .fini = s_cleanup, .timeout = 120);

/* Starts zps-server --bind bind and registers a client through connect_fmt (with the bound
 * port); the bound address must start with want. */
static void s_serve_and_register(const char *bind, const char *want, const char *connect_fmt)
{
    pst_server s;
    const char *args[] = {"--mode", "async", "--num-trainers", "1", NULL};
    cr_assert_eq(pst_spawn(&s, bind, args), 0, "zps-server --bind %s did not start", bind);
    cr_assert_eq(strncmp(s.uri, want, strlen(want)), 0, "--bind %s: listening on %s", bind,
                 s.uri);
    char to[300];
    snprintf(to, sizeof to, connect_fmt, strrchr(s.uri, ':') + 1);
    static const ps_var vars[] = {{"w", 100}};
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(vars, 1, 1, 0, &plan), ZPS_OK);
    ps_client *c = pst_client_connect(to, 0, NULL, plan);
    ps_client_destroy(&c);
    ps_plan_destroy(&plan);
    int st = pst_kill(&s, SIGTERM);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "server ended with status %d", st);
}

Test(it_net, server_binds_localhost_and_the_host_name)
{
    s_serve_and_register("localhost:0", "tcp://", "tcp://localhost:%s");
    char bind[300], to[300];
    snprintf(bind, sizeof bind, "tcp://%s:0", s_loop_host());
    snprintf(to, sizeof to, "tcp://%s:%%s", s_loop_host());
    s_serve_and_register(bind, "tcp://", to);
}

Test(it_net, server_binds_ipv6_loopback)
{
    S_NEED_V6();
    s_serve_and_register("[::1]:0", "tcp://[::1]:", "tcp://[::1]:%s");
}

/* Starts zps-server --bind bind (log in s_tmp), stops it once it listens; 1 when it warned
 * that it listens beyond this machine without CURVE. */
static int s_warns_beyond_loopback(const char *bind, int k)
{
    char log[700];
    snprintf(log, sizeof log, "%s/bind%d.log", s_tmp, k);
    pst_server s;
    const char *args[] = {"--bind", bind, "--mode", "async", "--num-trainers", "1", NULL};
    cr_assert_eq(pst_start(&s, "zps-server", log, args), 0);
    double end = zps_now_s() + 10;
    while (!zt_file_has(log, "zps-server listening on ") && zps_now_s() < end)
        zps_sleep_ns(20000000);
    int st = pst_kill(&s, SIGTERM);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0 || !zt_file_has(log, "listening on "))
        pst_dump(log);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "--bind %s: wait status %d", bind, st);
    return zt_file_has(log, "without CURVE");
}

Test(it_net, curve_warning_judges_the_bound_address)
{
    zt_mktmp(s_tmp, sizeof s_tmp, "zps-net");
    char host[300];
    snprintf(host, sizeof host, "%s:0", s_loop_host());
    cr_assert_not(s_warns_beyond_loopback("localhost:0", 0), "localhost is loopback");
    cr_assert_not(s_warns_beyond_loopback(host, 1), "%s resolves to loopback", host);
    if (s_have_v6())
        cr_assert_not(s_warns_beyond_loopback("[::1]:0", 2), "::1 is loopback");
    cr_assert(s_warns_beyond_loopback("tcp://*:0", 3), "no warning for every interface");
}

/* 512 Fashion-MNIST images in two shards at s_data. */
static void s_make_data(void)
{
    zt_mktmp(s_tmp, sizeof s_tmp, "zps-net");
    snprintf(s_data, sizeof s_data, "%s/fm", s_tmp);
    char log[700];
    snprintf(log, sizeof log, "%s/data.log", s_tmp);
    zt_make_fashion(s_data, 512, 2, log);
}

/* Writes text to s_tmp/name; the path into path. */
static void s_write(const char *name, const char *text, char *path, size_t len)
{
    snprintf(path, len, "%s/%s", s_tmp, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

Test(it_net, fleet_from_a_cluster_file_with_host_names_trains, .timeout = 180)
{
    s_make_data();
    int v6 = s_have_v6();
    if (!v6)
        fprintf(stderr, "[NOTE] no IPv6 loopback: the fleet runs without its [::1] server\n");
    char text[1024], cluster[700];
    /* both resolve to 127.0.0.1: two picks of a released port 0 can be the same port */
    int p1 = s_free_port(AF_INET), p2;
    while ((p2 = s_free_port(AF_INET)) == p1)
        ;
    int n = snprintf(text, sizeof text, "job = net\nserver = localhost:%d\nserver = %s:%d\n",
                     p1, s_loop_host(), p2);
    if (v6)
        n += snprintf(text + n, sizeof text - (size_t)n, "server = [::1]:%d\n",
                      s_free_port(AF_INET6));
    snprintf(text + n, sizeof text - (size_t)n, "trainer = localhost\ntrainer = %s\n",
             s_loop_host());
    s_write("cluster.txt", text, cluster, sizeof cluster);
    int ns = v6 ? 3 : 2;
    pst_server srv[3], tr[2];
    char slog[3][700], tlog[2][700], idx[3][4];
    for (int i = 0; i < ns; i++) {
        snprintf(idx[i], sizeof idx[i], "%d", i);
        snprintf(slog[i], sizeof slog[i], "%s/s%d.log", s_tmp, i);
        const char *a[] = {"--cluster", cluster, "--index", idx[i], "--mode", "async", NULL};
        cr_assert_eq(pst_start(&srv[i], "zps-server", slog[i], a), 0);
    }
    for (int t = 0; t < 2; t++) {
        snprintf(tlog[t], sizeof tlog[t], "%s/t%d.log", s_tmp, t);
        const char *a[] = {"--cluster", cluster, "--trainer-id", idx[t], "--mode", "async",
                           "--data", s_data, "--model", "mlp", "--steps", "5", "--no-progress",
                           "--threads", "0", "--eval-batches", "1", NULL};
        cr_assert_eq(pst_start(&tr[t], "zps-trainer", tlog[t], a), 0);
    }
    for (int t = 0; t < 2; t++) {
        int st = pst_wait(&tr[t], 90);
        if (st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "cluster file:\n%s", text);
            for (int i = 0; i < ns; i++)
                pst_dump(slog[i]);
            pst_dump(tlog[t]);
            cr_assert_fail("trainer %d: wait status %d", t, st);
        }
    }
    for (int i = 0; i < ns; i++) {
        int st = pst_kill(&srv[i], SIGTERM);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
            pst_dump(slog[i]);
        cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "server %d: wait status %d", i, st);
        cr_assert(zt_file_has(slog[i], "trainer 1 registered"), "server %d saw no trainer 1", i);
    }
}

/* Runs prog with args, expecting a failure within 15 s and the resolver's message on its
 * output: fast, not after the client's 30 s request timeout (.invalid never resolves, RFC
 * 6761; the bound leaves room for a slow DNS server's NXDOMAIN). */
static void s_expect_unresolved(const char *prog, const char *const *args)
{
    char log[700], *out = NULL;
    snprintf(log, sizeof log, "%s/%s.log", s_tmp, prog);
    double t0 = zps_now_s();
    int st = zt_run(prog, args, NULL, log, 30, &out);
    double took = zps_now_s() - t0;
    cr_assert_neq(st, 0, "%s exited 0", prog);
    cr_assert_not_null(strstr(out, "cannot resolve server host 'nosuch.invalid': "),
                       "%s: no resolver message in:\n%s", prog, out);
    cr_assert(took < 15, "%s took %.1f s to fail", prog, took);
    free(out);
}

Test(it_net, unresolvable_server_host_fails_fast_with_its_name)
{
    s_make_data();
    char cluster[700];
    s_write("bad.txt", "server = localhost:9\nserver = nosuch.invalid:7000\ntrainer = localhost\n",
            cluster, sizeof cluster);
    const char *srv[] = {"--cluster", cluster, "--index", "1", NULL};
    s_expect_unresolved("zps-server", srv);
    const char *bind[] = {"--bind", "tcp://nosuch.invalid:7000", NULL};
    s_expect_unresolved("zps-server", bind);
    const char *tr[] = {"--cluster", cluster, "--mode", "async", "--data", s_data, "--model",
                        "mlp", "--steps", "5", "--no-progress", "--threads", "0", NULL};
    s_expect_unresolved("zps-trainer", tr);
}
