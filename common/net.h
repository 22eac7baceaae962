/* net.h — turning a "HOST:PORT" endpoint into addresses ZeroMQ can bind and connect.
 *
 * ZeroMQ reads the host of a tcp:// bind as a network interface name (`tcp://vm:7102`
 * fails with "No such device"), and connects to IPv6 addresses only with ZMQ_IPV6 set on
 * the socket. So every tcp endpoint zps binds or connects is resolved here first, with
 * getaddrinfo(AF_UNSPEC): names and IPv4 / bracketed IPv6 literals alike become numeric
 * endpoints, each with the ZMQ_IPV6 setting it needs (docs/cluster.md "Host names").
 *
 * Forms: "tcp://HOST:PORT", "HOST:PORT", "tcp://[V6]:PORT", "[V6]:PORT". PORT is 0-65535 or
 * `*` (0 and `*`: an ephemeral port, for binds). Passed through unresolved, as the one
 * address: endpoints of other transports (ipc://, inproc://) and the wildcard host `*`.
 * A bind whose host does not resolve but names a network interface of this machine also
 * passes through (ZeroMQ binds the interface, as before).
 */
#ifndef ZPS_COMMON_NET_H
#define ZPS_COMMON_NET_H

#include <stddef.h>

#include "common/status.h"

#define ZPS_NET_URI_MAX 528
/* At most this many addresses of one name are kept (in getaddrinfo's order). */
#define ZPS_NET_ADDRS_MAX 8

typedef struct zps_net_addr {
    char uri[ZPS_NET_URI_MAX]; // tcp://NUMERIC:PORT (IPv6 bracketed), or the endpoint as given
    int ipv6;                  // 1: the socket needs ZMQ_IPV6 to use uri
} zps_net_addr;

/* Resolves ep into out[0..*n) (at most max, at least 1 on success), in getaddrinfo's order
 * (the system's address preference, RFC 6724 / gai.conf). for_bind allows the interface
 * pass-through. `what` names the host's role in messages ("server"). On failure why (when
 * not NULL) holds e.g. "cannot resolve server host 'nosuch': Name or service not known";
 * returns ZPS_ERR_INVALID for a malformed endpoint, ZPS_ERR_NOT_FOUND for a host that does
 * not resolve. Logs nothing. */
zps_status zps_net_resolve(const char *ep, const char *what, int for_bind, zps_net_addr *out,
                           int max, int *n, char *why, size_t why_len);

/* Binds the ZeroMQ socket sock to ep: each resolved address in order until one binds (a
 * name may resolve to several; ZMQ_IPV6 set to match each). Port 0 means `*`. Logs the
 * failure (ZPS_ERR_INVALID / ZPS_ERR_NOT_FOUND / ZPS_ERR_ZMQ). ZMQ_LAST_ENDPOINT then gives
 * the numeric address bound. */
zps_status zps_net_bind(void *sock, const char *ep, const char *what);

/* The loop of zps_net_bind over addresses already resolved (ep names them in messages). */
zps_status zps_net_bind_addrs(void *sock, const zps_net_addr *a, int n, const char *ep);

/* Connects sock n_conn times (one TCP connection each) to ep's first resolved address, with
 * ZMQ_IPV6 set when it is IPv6. Logs the failure like zps_net_bind. */
zps_status zps_net_connect(void *sock, const char *ep, const char *what, int n_conn);

/* Where an endpoint is. loopback: its host is 127.x.x.x, ::1 or localhost; here: loopback,
 * an address one of this machine's interfaces holds (a cluster file that lists its hosts by
 * address), or the host is this machine's name (whole, or both cut at their first dot, as
 * Slurm and short cluster files write names). Endpoints of other transports (ipc://,
 * inproc://) are both; a malformed one is neither. The host forms take a bare host (IPv6
 * without brackets). Names are not resolved (no DNS on this path): another name of this
 * machine does not count as here. */
int zps_net_host_loopback(const char *host);
int zps_net_host_here(const char *host);
int zps_net_endpoint_loopback(const char *ep);
int zps_net_endpoint_here(const char *ep);

/* Ends a ZeroMQ context (every socket closed before): zmq_ctx_term, again while a signal
 * interrupts it. Only its return means zmq's threads are joined and every zero-copy frame
 * released, so an interrupted one (a second SIGTERM, one sent to the process and its group)
 * must not be taken for done: the frames freed after it would still be in zmq's hands. Any
 * other failure is logged with `who`. */
void zps_net_ctx_end(void *ctx, const char *who);

#endif
