/* cluster.h — the cluster file: which servers and trainers make up a job.
 *
 * Format (docs/cluster.md): one `key = value` per line; `#` starts a comment; blank lines are
 * ignored. Keys:
 *     job = NAME          optional, at most once ([A-Za-z0-9_.-]+)
 *     server = HOST:PORT  one line per server, in server-index order; no duplicates
 *     trainer = HOST      one line per trainer, in trainer-index order; a host may repeat
 * HOST is a name or IPv4 address ([A-Za-z0-9.-]+) or a bracketed IPv6 address ([::1]);
 * names are resolved where the address is bound or connected (common/net.h), not here.
 * At least one server and one trainer. Anything else is rejected with its line number.
 */
#ifndef ZPS_COMMON_CLUSTER_H
#define ZPS_COMMON_CLUSTER_H

#include <stddef.h>

#include "common/status.h"

#define ZPS_HOST_MAX 256

typedef struct zps_endpoint {
    char host[ZPS_HOST_MAX]; // without brackets for IPv6
    int port;                // 1..65535; 0 for trainers
} zps_endpoint;

typedef struct zps_cluster {
    char job[64];           // "" when not given
    int n_servers;          // >= 1
    zps_endpoint *servers;  // (n_servers)
    int n_trainers;         // >= 1
    zps_endpoint *trainers; // (n_trainers), port 0
} zps_cluster;

/* Where parsing failed: line is 1-based (0 when the whole file is at fault). */
typedef struct zps_parse_error {
    int line;
    char msg[256];
} zps_parse_error;

/* Parses the text of a cluster file. On success *out is the caller's (zps_cluster_destroy).
 * On failure returns ZPS_ERR_PARSE and fills err (when not NULL). */
zps_status zps_cluster_parse(const char *text, zps_cluster **out, zps_parse_error *err);
/* Reads and parses path; ZPS_ERR_NOT_FOUND / ZPS_ERR_IO when it cannot be read (logged
 * only when err is NULL: else err says why, for the caller to report). */
zps_status zps_cluster_load(const char *path, zps_cluster **out, zps_parse_error *err);
void zps_cluster_destroy(zps_cluster **pc);
/* "tcp://HOST:PORT" (IPv6 bracketed) into buf; returns buf. */
char *zps_endpoint_uri(const zps_endpoint *e, char *buf, unsigned len);

/* The servers' URIs, in index order, from a cluster file (path non-empty) or else from a
 * comma-separated list (an item without "://" gets "tcp://"): *uris (n of them) is the
 * caller's (zps_uris_free). *n_trainers: the file's trainer count (0 for a list). A file
 * that cannot be read or parsed fills err (line 0: the file as a whole); a list that names
 * no server is ZPS_ERR_INVALID with err saying so; the caller reports. */
zps_status zps_cluster_server_uris(const char *path, const char *list, char ***uris, int *n,
                                   int *n_trainers, zps_parse_error *err);
void zps_uris_free(char ***uris, int *n);
/* The error of loading path for a person, into buf: "cluster file PATH:LINE: why", or for
 * the file as a whole (line 0) "cluster file PATH: why", or "cluster file: why" when why
 * names the path already ("cannot open PATH: ..."). */
char *zps_cluster_error(const char *path, const zps_parse_error *err, char *buf, size_t len);

#endif
