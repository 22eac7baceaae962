/* test_cluster.c — the cluster-file parser on valid files and on malformed ones, each with
 * its expected line number and message. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/cluster.h"
#include "common/log.h"

Test(cluster, parses_a_full_file)
{
    const char *text = "# demo fleet\n"
                       "job = demo-1\n"
                       "\n"
                       "server = 127.0.0.1:7000\n"
                       "server=host-b.example:7001   # second\r\n"
                       "server = [::1]:7002\n"
                       "trainer = 127.0.0.1\n"
                       "  trainer =\t127.0.0.1\n"
                       "trainer = gpu-node-3\n";
    zps_cluster *c = NULL;
    zps_parse_error err;
    cr_assert_eq(zps_cluster_parse(text, &c, &err), ZPS_OK, "line %d: %s", err.line, err.msg);
    cr_assert_str_eq(c->job, "demo-1");
    cr_assert_eq(c->n_servers, 3);
    cr_assert_str_eq(c->servers[1].host, "host-b.example");
    cr_assert_eq(c->servers[1].port, 7001);
    cr_assert_str_eq(c->servers[2].host, "::1");
    cr_assert_eq(c->n_trainers, 3);
    cr_assert_str_eq(c->trainers[2].host, "gpu-node-3");
    char uri[300];
    cr_assert_str_eq(zps_endpoint_uri(&c->servers[0], uri, sizeof uri), "tcp://127.0.0.1:7000");
    cr_assert_str_eq(zps_endpoint_uri(&c->servers[2], uri, sizeof uri), "tcp://[::1]:7002");
    zps_cluster_destroy(&c);
    cr_assert_null(c);
}

Test(cluster, minimal_file_without_trailing_newline)
{
    zps_cluster *c = NULL;
    cr_assert_eq(zps_cluster_parse("server = a:1\ntrainer = b", &c, NULL), ZPS_OK);
    cr_assert_eq(c->n_servers, 1);
    cr_assert_eq(c->servers[0].port, 1);
    cr_assert_str_eq(c->job, "");
    zps_cluster_destroy(&c);
}

static const struct {
    const char *text;
    int line;
    const char *msg; /* substring of the expected message */
} s_bad[] = {
    {"server = a:1\ntrainer = b\nworker = c\n", 3, "unknown key 'worker'"},
    {"server = a:1\nserver = a:1\ntrainer = b\n", 2, "duplicate server a:1"},
    {"job = x\njob = y\nserver = a:1\ntrainer = b\n", 2, "duplicate key 'job'"},
    {"server = a\ntrainer = b\n", 1, "has no port"},
    {"server = a:0\ntrainer = b\n", 1, "out of range"},
    {"server = a:65536\ntrainer = b\n", 1, "out of range"},
    {"server = a:70x\ntrainer = b\n", 1, "bad port"},
    {"server = a:-5\ntrainer = b\n", 1, "bad port"},
    {"# c\nserver a:1\ntrainer = b\n", 2, "expected 'key = value'"},
    {"server = \ntrainer = b\n", 1, "missing value"},
    {"server = a:1\n = b\n", 2, "missing key"},
    {"server = a:1\ntrainer = b:5\n", 2, "want HOST, no port"},
    {"server = a:1\ntrainer = b c\n", 2, "contains blanks"},
    {"server = a:1\ntrainer = b=c\n", 2, "more than one '='"},
    {"server = [::1:7\ntrainer = b\n", 1, "bad server host"},
    {"server = a_b:7\ntrainer = b\n", 1, "bad server host"},
    {"job = bad/name\nserver = a:1\ntrainer = b\n", 1, "bad job name"},
    {"server = a:1\n\n# only servers\n", 0, "no 'trainer"},
    {"", 0, "no 'trainer"},
};

Test(cluster, rejects_malformed_files_with_line_numbers)
{
    for (size_t i = 0; i < sizeof s_bad / sizeof s_bad[0]; i++) {
        zps_cluster *c = (zps_cluster *)0x1;
        zps_parse_error err = {.line = -1};
        cr_assert_eq(zps_cluster_parse(s_bad[i].text, &c, &err), ZPS_ERR_PARSE, "case %zu", i);
        cr_assert_null(c, "case %zu left an object", i);
        cr_assert_eq(err.line, s_bad[i].line, "case %zu: line %d, want %d (%s)", i, err.line,
                     s_bad[i].line, err.msg);
        cr_assert_not_null(strstr(err.msg, s_bad[i].msg), "case %zu: '%s' lacks '%s'", i,
                           err.msg, s_bad[i].msg);
    }
}

Test(cluster, overlong_line)
{
    char text[3000];
    memset(text, 'x', sizeof text - 1);
    text[sizeof text - 1] = 0;
    memcpy(text, "server = a:1\njob = ", 19);
    zps_cluster *c;
    zps_parse_error err;
    cr_assert_eq(zps_cluster_parse(text, &c, &err), ZPS_ERR_PARSE);
    cr_assert_eq(err.line, 2);
    cr_assert_not_null(strstr(err.msg, "longer than"));
}

Test(cluster, load_from_file_and_missing_file)
{
    char path[] = "/tmp/zps-cluster-XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    const char *text = "server = 127.0.0.1:7100\ntrainer = 127.0.0.1\ntrainer = 127.0.0.1\n";
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    zps_cluster *c;
    zps_parse_error err;
    cr_assert_eq(zps_cluster_load(path, &c, &err), ZPS_OK, "%s", err.msg);
    cr_assert_eq(c->n_trainers, 2);
    zps_cluster_destroy(&c);
    unlink(path);
    zps_log_set_level(ZPS_LOG_OFF); /* the error below is expected */
    cr_assert_eq(zps_cluster_load(path, &c, &err), ZPS_ERR_NOT_FOUND);
    cr_assert_null(c);
    cr_assert_not_null(strstr(err.msg, "cannot open"));
}

/* The servers' URIs as zps-trainer and zps-ctl take them: a file in index order, or a list
 * whose bare HOST:PORT items get tcp://; a list naming nothing is refused with a reason. */
Test(cluster, server_uris_from_a_file_or_a_list)
{
    char path[] = "/tmp/zps-cluster-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    const char *text = "server = b:2\nserver = [::1]:3\ntrainer = t\ntrainer = u\ntrainer = v\n";
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    char **uris;
    int n, n_trainers;
    zps_parse_error err;
    cr_assert_eq(zps_cluster_server_uris(path, "ignored:1", &uris, &n, &n_trainers, &err), ZPS_OK);
    unlink(path);
    cr_assert_eq(n, 2);
    cr_assert_eq(n_trainers, 3);
    cr_assert_str_eq(uris[0], "tcp://b:2");
    cr_assert_str_eq(uris[1], "tcp://[::1]:3");
    zps_uris_free(&uris, &n);
    cr_assert_null(uris);
    cr_assert_eq(n, 0);

    cr_assert_eq(zps_cluster_server_uris("", "h:1,tcp://g:2,ipc:///x", &uris, &n, &n_trainers,
                                         &err), ZPS_OK);
    cr_assert_eq(n, 3);
    cr_assert_eq(n_trainers, 0);
    cr_assert_str_eq(uris[0], "tcp://h:1");
    cr_assert_str_eq(uris[1], "tcp://g:2");
    cr_assert_str_eq(uris[2], "ipc:///x");
    zps_uris_free(&uris, &n);

    cr_assert_eq(zps_cluster_server_uris("", ",,", &uris, &n, &n_trainers, &err),
                 ZPS_ERR_INVALID);
    cr_assert_eq(n, 0);
    cr_assert_str_eq(err.msg, "',,' names no server");
    cr_assert_eq(zps_cluster_server_uris("/nonexistent/c.txt", "", &uris, &n, &n_trainers, &err),
                 ZPS_ERR_NOT_FOUND);
    cr_assert_null(uris);
}

/* A load error for a person: the path once, the line when there is one. */
Test(cluster, error_text_names_the_path_once)
{
    char buf[512];
    zps_parse_error e = {.line = 3, .msg = "server 'a' has no port (want HOST:PORT)"};
    cr_assert_str_eq(zps_cluster_error("c.txt", &e, buf, sizeof buf),
                     "cluster file c.txt:3: server 'a' has no port (want HOST:PORT)");
    e = (zps_parse_error){.line = 0, .msg = "no 'trainer = HOST' line"};
    cr_assert_str_eq(zps_cluster_error("c.txt", &e, buf, sizeof buf),
                     "cluster file c.txt: no 'trainer = HOST' line");
    zps_cluster *c = NULL;
    cr_assert_eq(zps_cluster_load("/nonexistent/c.txt", &c, &e), ZPS_ERR_NOT_FOUND);
    zps_cluster_error("/nonexistent/c.txt", &e, buf, sizeof buf);
    cr_assert(strstr(buf, "cluster file: cannot open /nonexistent/c.txt"), "%s", buf);
    cr_assert_null(strstr(strstr(buf, "/nonexistent") + 1, "/nonexistent"), "path twice: %s", buf);
}
