/* cluster.c — the cluster-file parser of cluster.h. Strict by design: a typo in a fleet's
 * file must stop the launch with a line number, never start a half-right fleet. */
#include "common/cluster.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/mem.h"

#define S_LINE_MAX 1024

static zps_status s_fail(zps_parse_error *err, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static zps_status s_fail(zps_parse_error *err, int line, const char *fmt, ...)
{
    if (err) {
        err->line = line;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return ZPS_ERR_PARSE;
}

static char *s_trim(char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r'))
        s[--n] = 0;
    return s;
}

static int s_name_ok(const char *s, const char *extra)
{
    if (!*s)
        return 0;
    for (; *s; s++)
        if (!isalnum((unsigned char)*s) && !strchr(extra, *s))
            return 0;
    return 1;
}

/* HOST or [V6]; writes the bare host into out. Returns the rest of s after the host. */
static const char *s_host(const char *s, char *out, int *ok)
{
    *ok = 0;
    size_t n;
    if (*s == '[') {
        const char *close = strchr(s, ']');
        if (!close)
            return s;
        n = (size_t)(close - s - 1);
        if (n == 0 || n >= ZPS_HOST_MAX)
            return s;
        memcpy(out, s + 1, n);
        out[n] = 0;
        if (!s_name_ok(out, ":.") || !strchr(out, ':'))
            return s;
        *ok = 1;
        return close + 1;
    }
    n = strcspn(s, ":");
    if (n == 0 || n >= ZPS_HOST_MAX)
        return s;
    memcpy(out, s, n);
    out[n] = 0;
    if (!s_name_ok(out, ".-") || out[0] == '-' || out[0] == '.')
        return s;
    *ok = 1;
    return s + n;
}

static zps_status s_parse_line(zps_cluster *c, char *line, int ln, int *have_job, int *cap_s,
                               int *cap_t, zps_parse_error *err)
{
    char *hash = strchr(line, '#');
    if (hash)
        *hash = 0;
    char *s = s_trim(line);
    if (!*s)
        return ZPS_OK;
    char *eq = strchr(s, '=');
    if (!eq)
        return s_fail(err, ln, "expected 'key = value', got '%.60s'", s);
    *eq = 0;
    char *key = s_trim(s), *val = s_trim(eq + 1);
    if (!*key)
        return s_fail(err, ln, "missing key before '='");
    if (!*val)
        return s_fail(err, ln, "missing value for '%s'", key);
    if (strchr(val, '='))
        return s_fail(err, ln, "more than one '=' on the line");
    if (strpbrk(val, " \t"))
        return s_fail(err, ln, "value '%.60s' contains blanks", val);

    if (strcmp(key, "job") == 0) {
        if (*have_job)
            return s_fail(err, ln, "duplicate key 'job'");
        if (!s_name_ok(val, "_.-") || strlen(val) >= sizeof c->job)
            return s_fail(err, ln, "bad job name '%.60s' (use [A-Za-z0-9_.-], at most %zu)",
                          val, sizeof c->job - 1);
        snprintf(c->job, sizeof c->job, "%s", val);
        *have_job = 1;
        return ZPS_OK;
    }
    if (strcmp(key, "server") == 0) {
        zps_endpoint e = {0};
        int ok;
        const char *rest = s_host(val, e.host, &ok);
        if (!ok)
            return s_fail(err, ln, "bad server host in '%.60s' (want HOST:PORT)", val);
        if (*rest != ':')
            return s_fail(err, ln, "server '%.60s' has no port (want HOST:PORT)", val);
        rest++;
        char *end;
        errno = 0;
        long port = strtol(rest, &end, 10);
        if (end == rest || *end || errno || !isdigit((unsigned char)*rest))
            return s_fail(err, ln, "bad port '%.20s' (want 1-65535)", rest);
        if (port < 1 || port > 65535)
            return s_fail(err, ln, "port %ld out of range 1-65535", port);
        e.port = (int)port;
        for (int i = 0; i < c->n_servers; i++)
            if (c->servers[i].port == e.port && strcmp(c->servers[i].host, e.host) == 0)
                return s_fail(err, ln, "duplicate server %s:%d (also server %d)", e.host,
                              e.port, i);
        if (c->n_servers == *cap_s) {
            *cap_s = *cap_s ? 2 * *cap_s : 8;
            c->servers = zps_xrealloc(c->servers, (size_t)*cap_s * sizeof *c->servers);
        }
        c->servers[c->n_servers++] = e;
        return ZPS_OK;
    }
    if (strcmp(key, "trainer") == 0) {
        zps_endpoint e = {0};
        int ok;
        const char *rest = s_host(val, e.host, &ok);
        if (!ok || *rest)
            return s_fail(err, ln, "bad trainer host '%.60s' (want HOST, no port)", val);
        if (c->n_trainers == *cap_t) {
            *cap_t = *cap_t ? 2 * *cap_t : 8;
            c->trainers = zps_xrealloc(c->trainers, (size_t)*cap_t * sizeof *c->trainers);
        }
        c->trainers[c->n_trainers++] = e;
        return ZPS_OK;
    }
    return s_fail(err, ln, "unknown key '%.40s' (known: job, server, trainer)", key);
}

zps_status zps_cluster_parse(const char *text, zps_cluster **out, zps_parse_error *err)
{
    *out = NULL;
    if (err) {
        err->line = 0;
        err->msg[0] = 0;
    }
    zps_cluster *c = zps_xcalloc(1, sizeof *c);
    int have_job = 0, cap_s = 0, cap_t = 0, ln = 0;
    zps_status st = ZPS_OK;
    char line[S_LINE_MAX + 2];
    const char *p = text;
    while (*p && st == ZPS_OK) {
        ln++;
        size_t n = strcspn(p, "\n");
        if (n > S_LINE_MAX) {
            st = s_fail(err, ln, "line longer than %d characters", S_LINE_MAX);
            break;
        }
        memcpy(line, p, n);
        line[n] = 0;
        st = s_parse_line(c, line, ln, &have_job, &cap_s, &cap_t, err);
        p += n;
        if (*p == '\n')
            p++;
    }
    /* no server line is allowed: an all-reduce fleet has none (zps-server and the PS modes
     * of zps-trainer say so when they need one) */
    if (st == ZPS_OK && c->n_trainers == 0)
        st = s_fail(err, 0, "no 'trainer = HOST' line");
    if (st != ZPS_OK) {
        zps_cluster_destroy(&c);
        return st;
    }
    *out = c;
    return ZPS_OK;
}

zps_status zps_cluster_load(const char *path, zps_cluster **out, zps_parse_error *err)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        int e = errno;
        if (!err) /* else the caller reports err, and one failure is one message */
            zps_log(ZPS_ERROR, "cluster", "cannot open cluster file %s: %s", path, strerror(e));
        else {
            err->line = 0;
            snprintf(err->msg, sizeof err->msg, "cannot open %s: %s", path, strerror(e));
        }
        return e == ENOENT ? ZPS_ERR_NOT_FOUND : ZPS_ERR_IO;
    }
    size_t cap = 4096, n = 0;
    char *buf = zps_xmalloc(cap);
    size_t r;
    while ((r = fread(buf + n, 1, cap - n - 1, f)) > 0) {
        n += r;
        if (cap - n - 1 == 0) {
            if (cap >= (1u << 24)) {
                fclose(f);
                free(buf);
                if (err) {
                    err->line = 0;
                    snprintf(err->msg, sizeof err->msg, "%s is larger than 16 MiB", path);
                }
                return ZPS_ERR_PARSE;
            }
            cap *= 2;
            buf = zps_xrealloc(buf, cap);
        }
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        zps_log(ZPS_ERROR, "cluster", "read error on %s", path);
        return ZPS_ERR_IO;
    }
    buf[n] = 0;
    zps_status st;
    if (strlen(buf) != n)
        st = s_fail(err, 0, "%s contains a NUL byte", path);
    else
        st = zps_cluster_parse(buf, out, err);
    free(buf);
    return st;
}

void zps_cluster_destroy(zps_cluster **pc)
{
    if (!pc || !*pc)
        return;
    free((*pc)->servers);
    free((*pc)->trainers);
    free(*pc);
    *pc = NULL;
}

char *zps_endpoint_uri(const zps_endpoint *e, char *buf, unsigned len)
{
    if (strchr(e->host, ':'))
        snprintf(buf, len, "tcp://[%s]:%d", e->host, e->port);
    else
        snprintf(buf, len, "tcp://%s:%d", e->host, e->port);
    return buf;
}

static void s_add_uri(char ***uris, int *n, const char *uri)
{
    *uris = zps_xrealloc(*uris, (size_t)(*n + 1) * sizeof **uris);
    (*uris)[(*n)++] = zps_xstrdup(uri);
}

zps_status zps_cluster_server_uris(const char *path, const char *list, char ***uris, int *n,
                                   int *n_trainers, zps_parse_error *err)
{
    *uris = NULL;
    *n = *n_trainers = 0;
    if (path && path[0]) {
        zps_cluster *cl;
        zps_status st = zps_cluster_load(path, &cl, err);
        if (st != ZPS_OK)
            return st;
        for (int i = 0; i < cl->n_servers; i++) {
            char buf[ZPS_HOST_MAX + 32];
            s_add_uri(uris, n, zps_endpoint_uri(&cl->servers[i], buf, sizeof buf));
        }
        *n_trainers = cl->n_trainers;
        zps_cluster_destroy(&cl);
        return ZPS_OK;
    }
    char *copy = zps_xstrdup(list ? list : ""), *save = NULL;
    for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        char buf[ZPS_HOST_MAX + 32];
        snprintf(buf, sizeof buf, "%s%s", strstr(t, "://") ? "" : "tcp://", t);
        s_add_uri(uris, n, buf);
    }
    free(copy);
    if (!*n) {
        s_fail(err, 0, "'%s' names no server", list ? list : "");
        return ZPS_ERR_INVALID;
    }
    return ZPS_OK;
}

void zps_uris_free(char ***uris, int *n)
{
    for (int i = 0; *uris && i < *n; i++)
        free((*uris)[i]);
    free(*uris);
    *uris = NULL;
    *n = 0;
}

char *zps_cluster_error(const char *path, const zps_parse_error *err, char *buf, size_t len)
{
    const char *why = err->msg[0] ? err->msg : "cannot read it";
    if (err->line > 0)
        snprintf(buf, len, "cluster file %s:%d: %s", path, err->line, why);
    else if (strstr(why, path))
        snprintf(buf, len, "cluster file: %s", why);
    else
        snprintf(buf, len, "cluster file %s: %s", path, why);
    return buf;
}
