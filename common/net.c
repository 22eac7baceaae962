/* net.c — the endpoint resolver of net.h.
 *
 * Invariants: a resolved address is always numeric (getnameinfo NI_NUMERICHOST), so ZeroMQ
 * never looks a name up itself and never reads a host as an interface name by accident;
 * ZMQ_IPV6 is set on the socket before every bind and connect to match the address used
 * (a failed IPv6 bind attempt must not leave it on for the IPv4 one after it).
 */
#include "common/net.h"

#include <ctype.h>
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"

typedef struct s_parts {
    char host[ZPS_NET_URI_MAX]; // without brackets; "" for a pass-through endpoint
    char port[8];               // digits or "*"
} s_parts;

static zps_status s_why(char *why, size_t len, zps_status st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static zps_status s_why(char *why, size_t len, zps_status st, const char *fmt, ...)
{
    if (why && len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, len, fmt, ap);
        va_end(ap);
    }
    return st;
}

/* 1 for 0-65535 in digits, or "*". */
static int s_port_ok(const char *p)
{
    if (!strcmp(p, "*"))
        return 1;
    if (!*p || strlen(p) > 5)
        return 0;
    for (const char *q = p; *q; q++)
        if (!isdigit((unsigned char)*q))
            return 0;
    return atol(p) <= 65535;
}

/* Splits HOST:PORT or [V6]:PORT (after any tcp://) into p. p->host stays "" for an endpoint
 * of another transport. */
static zps_status s_split(const char *ep, const char *what, s_parts *p, char *why, size_t wl)
{
    memset(p, 0, sizeof *p);
    const char *scheme = strstr(ep, "://");
    if (scheme && strncmp(ep, "tcp://", 6) != 0)
        return ZPS_OK;
    const char *rest = scheme ? ep + 6 : ep, *colon;
    size_t hl;
    if (*rest == '[') {
        const char *close = strchr(rest, ']');
        if (!close || close[1] != ':')
            return s_why(why, wl, ZPS_ERR_INVALID, "bad %s address '%s' (want HOST:PORT or "
                         "[IPv6]:PORT)", what, ep);
        hl = (size_t)(close - rest - 1);
        rest++;
        colon = close + 1;
    } else {
        colon = strrchr(rest, ':');
        if (!colon)
            return s_why(why, wl, ZPS_ERR_INVALID, "%s address '%s' has no port (want "
                         "HOST:PORT)", what, ep);
        hl = (size_t)(colon - rest);
        if (memchr(rest, ':', hl))
            return s_why(why, wl, ZPS_ERR_INVALID, "bad %s address '%s': put an IPv6 "
                         "address in brackets, [ADDR]:PORT", what, ep);
    }
    if (hl == 0 || hl >= sizeof p->host)
        return s_why(why, wl, ZPS_ERR_INVALID, "bad %s address '%s': empty or overlong host",
                     what, ep);
    memcpy(p->host, rest, hl);
    if (strlen(colon + 1) >= sizeof p->port || !s_port_ok(colon + 1))
        return s_why(why, wl, ZPS_ERR_INVALID, "bad port in %s address '%s' (want 0-65535 or "
                     "*)", what, ep);
    snprintf(p->port, sizeof p->port, "%s", colon + 1);
    return ZPS_OK;
}

/* The numeric form of ai into out (uri and ipv6). 0 on success. */
static int s_numeric(const struct addrinfo *ai, const char *port, zps_net_addr *out)
{
    char num[NI_MAXHOST];
    if (getnameinfo(ai->ai_addr, ai->ai_addrlen, num, sizeof num, NULL, 0, NI_NUMERICHOST))
        return -1;
    out->ipv6 = ai->ai_family == AF_INET6;
    snprintf(out->uri, sizeof out->uri, out->ipv6 ? "tcp://[%s]:%s" : "tcp://%s:%s", num, port);
    return 0;
}

/* ep unchanged as the only address. */
static zps_status s_pass(const char *ep, zps_net_addr *out, int *n, char *why, size_t wl)
{
    if (strlen(ep) >= sizeof out->uri)
        return s_why(why, wl, ZPS_ERR_INVALID, "endpoint '%.60s...' is too long", ep);
    snprintf(out->uri, sizeof out->uri, "%s", ep);
    out->ipv6 = 0;
    *n = 1;
    return ZPS_OK;
}

zps_status zps_net_resolve(const char *ep, const char *what, int for_bind, zps_net_addr *out,
                           int max, int *n, char *why, size_t why_len)
{
    *n = 0;
    s_parts p;
    zps_status st = s_split(ep, what, &p, why, why_len);
    if (st != ZPS_OK)
        return st;
    if (!p.host[0] || !strcmp(p.host, "*"))
        return s_pass(ep, out, n, why, why_len);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int rc = getaddrinfo(p.host, NULL, &hints, &res);
    if (rc != 0) {
        int e = errno;
        if (for_bind && if_nametoindex(p.host))
            return s_pass(ep, out, n, why, why_len);
        return s_why(why, why_len, ZPS_ERR_NOT_FOUND, "cannot resolve %s host '%s': %s", what,
                     p.host, rc == EAI_SYSTEM ? strerror(e) : gai_strerror(rc));
    }
    for (const struct addrinfo *ai = res; ai && *n < max; ai = ai->ai_next) {
        if ((ai->ai_family != AF_INET && ai->ai_family != AF_INET6) ||
            s_numeric(ai, p.port, &out[*n]))
            continue;
        int dup = 0;
        for (int k = 0; k < *n; k++)
            dup |= !strcmp(out[k].uri, out[*n].uri);
        *n += !dup;
    }
    freeaddrinfo(res);
    if (*n == 0)
        return s_why(why, why_len, ZPS_ERR_NOT_FOUND, "cannot resolve %s host '%s': no IPv4 "
                     "or IPv6 address", what, p.host);
    return ZPS_OK;
}

/* ZMQ_IPV6 on sock to match a. -1 on failure. */
static int s_ipv6(void *sock, const zps_net_addr *a)
{
    return zmq_setsockopt(sock, ZMQ_IPV6, &a->ipv6, sizeof a->ipv6);
}

zps_status zps_net_bind_addrs(void *sock, const zps_net_addr *a, int n, const char *ep)
{
    int err = 0;
    for (int i = 0; i < n; i++) {
        if (s_ipv6(sock, &a[i]) == 0 && zmq_bind(sock, a[i].uri) == 0) {
            if (strcmp(a[i].uri, ep))
                zps_log(ZPS_DEBUG, "net", "%s: bound %s", ep, a[i].uri);
            return ZPS_OK;
        }
        err = zmq_errno();
        zps_log(n > 1 ? ZPS_INFO : ZPS_DEBUG, "net", "cannot bind %s (address %d of %d of %s): "
                "%s", a[i].uri, i + 1, n, ep, zmq_strerror(err));
    }
    if (n == 1 && !strcmp(a[0].uri, ep))
        zps_log(ZPS_ERROR, "net", "cannot bind %s: %s", ep, zmq_strerror(err));
    else
        zps_log(ZPS_ERROR, "net", "cannot bind %s (resolved to %s%s): %s", ep, a[0].uri,
                n > 1 ? " and more" : "", zmq_strerror(err));
    return ZPS_ERR_ZMQ;
}

zps_status zps_net_bind(void *sock, const char *ep, const char *what)
{
    char why[512], bind_ep[ZPS_NET_URI_MAX];
    snprintf(bind_ep, sizeof bind_ep, "%s", ep);
    size_t bl = strlen(bind_ep);
    if (bl > 2 && !strcmp(bind_ep + bl - 2, ":0")) // some libzmq versions want * for "any port"
        bind_ep[bl - 1] = '*';
    zps_net_addr a[ZPS_NET_ADDRS_MAX];
    int n;
    zps_status st = zps_net_resolve(bind_ep, what, 1, a, ZPS_NET_ADDRS_MAX, &n, why, sizeof why);
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "net", "%s", why); // why names the host or the endpoint
        return st;
    }
    return zps_net_bind_addrs(sock, a, n, bind_ep);
}

zps_status zps_net_connect(void *sock, const char *ep, const char *what, int n_conn)
{
    char why[512];
    zps_net_addr a;
    int n;
    zps_status st = zps_net_resolve(ep, what, 0, &a, 1, &n, why, sizeof why);
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "net", "%s", why); // why names the host or the endpoint
        return st;
    }
    if (s_ipv6(sock, &a) == -1) {
        zps_log(ZPS_ERROR, "net", "cannot connect to %s: ZMQ_IPV6: %s", ep,
                zmq_strerror(zmq_errno()));
        return ZPS_ERR_ZMQ;
    }
    for (int k = 0; k < n_conn; k++)
        if (zmq_connect(sock, a.uri) == -1) {
            zps_log(ZPS_ERROR, "net", "cannot connect to %s (%s): %s", ep, a.uri,
                    zmq_strerror(zmq_errno()));
            return ZPS_ERR_ZMQ;
        }
    return ZPS_OK;
}

int zps_net_host_loopback(const char *host)
{
    return !strncmp(host, "127.", 4) || !strcmp(host, "::1") || !strcmp(host, "localhost") ||
           !strcmp(host, "localhost.");
}

/* 1 when host is a numeric address (IPv4, or IPv6 without brackets) that one of this
 * machine's interfaces holds (getifaddrs: this network namespace's). */
static int s_address_here(const char *host)
{
    struct in_addr a4;
    struct in6_addr a6;
    int fam = inet_pton(AF_INET, host, &a4) == 1    ? AF_INET
              : inet_pton(AF_INET6, host, &a6) == 1 ? AF_INET6
                                                     : 0;
    struct ifaddrs *ifs = NULL;
    if (!fam || getifaddrs(&ifs) != 0)
        return 0;
    int hit = 0;
    for (struct ifaddrs *p = ifs; p && !hit; p = p->ifa_next) {
        if (!p->ifa_addr || p->ifa_addr->sa_family != fam)
            continue;
        if (fam == AF_INET)
            hit = !memcmp(&((struct sockaddr_in *)(void *)p->ifa_addr)->sin_addr, &a4, sizeof a4);
        else
            hit = !memcmp(&((struct sockaddr_in6 *)(void *)p->ifa_addr)->sin6_addr, &a6,
                          sizeof a6);
    }
    freeifaddrs(ifs);
    return hit;
}

int zps_net_host_here(const char *host)
{
    if (zps_net_host_loopback(host) || s_address_here(host))
        return 1;
    char me[256] = "";
    if (gethostname(me, sizeof me - 1) != 0 || !me[0])
        return 0;
    size_t a = strcspn(host, "."), b = strcspn(me, ".");
    return !strcmp(host, me) || (a == b && a > 0 && !strncmp(host, me, a));
}

/* -1: malformed; 1: another transport; 0: tcp, its host in p. */
static int s_endpoint(const char *ep, s_parts *p)
{
    if (s_split(ep, "", p, NULL, 0) != ZPS_OK)
        return -1;
    return p->host[0] ? 0 : 1;
}

int zps_net_endpoint_loopback(const char *ep)
{
    s_parts p;
    int k = s_endpoint(ep, &p);
    return k < 0 ? 0 : k ? 1 : zps_net_host_loopback(p.host);
}

int zps_net_endpoint_here(const char *ep)
{
    s_parts p;
    int k = s_endpoint(ep, &p);
    return k < 0 ? 0 : k ? 1 : zps_net_host_here(p.host);
}

void zps_net_ctx_end(void *ctx, const char *who)
{
    if (!ctx)
        return;
    int rc;
    while ((rc = zmq_ctx_term(ctx)) == -1 && zmq_errno() == EINTR)
        ;
    if (rc == -1)
        zps_log(ZPS_ERROR, "net", "%s: ending the ZeroMQ context: %s", who,
                zmq_strerror(zmq_errno()));
}
