/* test_server_config.c — zps-server's flag parser: good command lines give the settings
 * (--cluster FILE --index I resolves to that server's address), bad ones are refused with
 * exit code 2 and a message naming the flag; --keygen skips the checks across flags. */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps/server_config.h"
#include "testutil.h"

/* Parses args (NULL-terminated, without argv[0]) from the defaults; returns the exit code
 * (-1: go on). */
static int s_parse(ps_server_config *c, const char *const *args, const char **keygen,
                   zps_status *st)
{
    char *argv[64];
    int argc = zt_argv("zps-server", args, argv, 64);
    ps_server_config_default(c);
    int code;
    *st = ps_server_config_parse(c, argc, argv, keygen, &code);
    return code;
}

Test(server_config, defaults_without_flags)
{
    ps_server_config c, d;
    const char *kg;
    zps_status st;
    const char *a[] = {NULL};
    cr_assert_eq(s_parse(&c, a, &kg, &st), -1);
    cr_assert_eq(st, ZPS_OK);
    cr_assert_null(kg);
    ps_server_config_default(&d);
    cr_assert_str_eq(c.bind, d.bind);
    cr_assert_eq(c.mode, PS_MODE_UNSET, "the mode comes from REGISTER");
    cr_assert_eq(c.staleness, -1);
    cr_assert_eq(c.index, 0);
    cr_assert_eq(c.check_index, 0, "no --index: REGISTER's index is not checked");
    cr_assert_eq(c.max_message_bytes, 1ull << 30);
}

Test(server_config, every_value_flag_lands_in_its_field)
{
    ps_server_config c;
    const char *kg;
    zps_status st;
    const char *a[] = {"--bind", "tcp://127.0.0.1:7100", "--index", "3", "--mode", "ssp",
                       "--num-trainers", "4", "--replicas-to-aggregate", "3", "--staleness", "2",
                       "--trainer-timeout", "1.5", "--checkpoint-dir", "/tmp/ck",
                       "--checkpoint-every-versions", "1e3", "--checkpoint-every-seconds", "60",
                       "--restore", "--allow-reinit", "--max-message-bytes", "4096",
                       "--stats-every", "0", "--io-threads", "2", NULL};
    cr_assert_eq(s_parse(&c, a, &kg, &st), -1);
    cr_assert_eq(st, ZPS_OK);
    cr_assert_str_eq(c.bind, "tcp://127.0.0.1:7100");
    cr_assert_eq(c.index, 3);
    cr_assert_eq(c.check_index, 1);
    cr_assert_eq(c.mode, PS_MODE_SSP);
    cr_assert_eq(c.num_trainers, 4);
    cr_assert_eq(c.replicas_to_aggregate, 3);
    cr_assert_eq(c.staleness, 2);
    cr_assert_float_eq(c.trainer_timeout_s, 1.5, 1e-12);
    cr_assert_str_eq(c.checkpoint_dir, "/tmp/ck");
    cr_assert_eq(c.checkpoint_every_versions, 1000, "an integer written as a number");
    cr_assert_float_eq(c.checkpoint_every_seconds, 60, 1e-12);
    cr_assert_eq(c.restore, 1);
    cr_assert_eq(c.allow_reinit, 1);
    cr_assert_eq(c.max_message_bytes, 4096);
    cr_assert_float_eq(c.stats_every_s, 0, 1e-12);
    cr_assert_eq(c.io_threads, 2);
}

Test(server_config, mode_names)
{
    ps_server_config c;
    const char *kg;
    zps_status st;
    static const struct {
        const char *name;
        ps_mode mode;
    } want[] = {{"sync", PS_MODE_SYNC}, {"async", PS_MODE_ASYNC}, {"ssp", PS_MODE_SSP}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const char *a[] = {"--mode", want[i].name, NULL};
        cr_assert_eq(s_parse(&c, a, &kg, &st), -1);
        cr_assert_eq(c.mode, want[i].mode, "%s", want[i].name);
    }
}

Test(server_config, cluster_file_gives_address_and_trainers)
{
    char dir[256], path[300];
    zt_mktmp(dir, sizeof dir, "zps-srvcfg");
    snprintf(path, sizeof path, "%s/cluster.txt", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("server = 127.0.0.1:7000\nserver = 127.0.0.1:7001\n"
          "trainer = 127.0.0.1\ntrainer = 127.0.0.1\ntrainer = 127.0.0.1\n", f);
    fclose(f);
    ps_server_config c;
    const char *kg;
    zps_status st;
    const char *a[] = {"--cluster", path, "--index", "1", NULL};
    cr_assert_eq(s_parse(&c, a, &kg, &st), -1);
    cr_assert_eq(st, ZPS_OK);
    cr_assert_str_eq(c.bind, "tcp://127.0.0.1:7001");
    cr_assert_eq(c.num_trainers, 3, "the file's trainers");
    cr_assert_eq(c.index, 1);
    cr_assert_eq(c.check_index, 1);
    const char *b[] = {"--cluster", path, "--index", "0", "--num-trainers", "2", NULL};
    cr_assert_eq(s_parse(&c, b, &kg, &st), -1);
    cr_assert_eq(c.num_trainers, 2, "--num-trainers wins over the file");
    cr_assert_str_eq(c.bind, "tcp://127.0.0.1:7000");
    const char *past[] = {"--cluster", path, "--index", "2", NULL};
    cr_assert_eq(s_parse(&c, past, &kg, &st), 2, "server 2 of a file with 2 servers");
    cr_assert_eq(st, ZPS_ERR_INVALID);
    zt_rmtmp(dir);
}

Test(server_config, keygen_skips_the_other_checks)
{
    ps_server_config c;
    const char *kg;
    zps_status st;
    const char *a[] = {"--keygen", "keys/server", "--curve-key", "k", NULL};
    cr_assert_eq(s_parse(&c, a, &kg, &st), -1);
    cr_assert_eq(st, ZPS_OK);
    cr_assert_str_eq(kg, "keys/server");
}

Test(server_config, help_exits_zero_and_lists_the_flags, .init = cr_redirect_stdout)
{
    ps_server_config c;
    const char *kg;
    zps_status st;
    const char *a[] = {"--help", NULL};
    cr_assert_eq(s_parse(&c, a, &kg, &st), 0);
    char out[16384];
    zt_read_redirected(cr_get_redirected_stdout(), out, sizeof out);
    static const char *const flags[] = {
        "--bind URI", "--cluster FILE", "--index I", "--mode sync|async|ssp", "--num-trainers N",
        "--replicas-to-aggregate R", "--staleness S", "--trainer-timeout SEC",
        "--checkpoint-dir DIR", "--checkpoint-every-versions K", "--checkpoint-every-seconds S",
        "--restore", "--allow-reinit", "--max-message-bytes B", "--stats-every SEC",
        "--io-threads N", "--log-level", "--curve-key FILE", "--curve-allow FILE",
        "--curve-allow-any", "--keygen PREFIX", "--help"};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        cr_assert_not_null(strstr(out, flags[i]), "'%s' not in:\n%s", flags[i], out);
    cr_assert_not_null(strstr(out, "(default 1073741824)"), "%s", out);
    cr_assert_not_null(strstr(out, "(default 30)"), "--stats-every's default:\n%s", out);
}

static const struct {
    const char *args[8];
    const char *msg; /* in stderr */
} s_bad[] = {
    {{"--mode", "gossip", NULL}, "--mode wants sync, async or ssp, got 'gossip'"},
    {{"--index", "-1", NULL}, "--index wants an integer in [0, 65535], got '-1'"},
    {{"--index", "2.5", NULL}, "--index wants an integer"},
    {{"--num-trainers", "0", NULL}, "--num-trainers wants an integer in [1, 4096]"},
    {{"--replicas-to-aggregate", "4097", NULL}, "--replicas-to-aggregate wants"},
    {{"--staleness", "x", NULL}, "--staleness wants"},
    {{"--trainer-timeout", "-1", NULL}, "--trainer-timeout wants a number"},
    {{"--checkpoint-every-seconds", "nan", NULL}, "--checkpoint-every-seconds wants"},
    {{"--max-message-bytes", "3", NULL}, "--max-message-bytes wants"},
    {{"--io-threads", "17", NULL}, "--io-threads wants"},
    {{"--stats-every", "", NULL}, "--stats-every wants"},
    {{"--log-level", "loud", NULL}, "--log-level wants"},
    {{"extra", NULL}, "unexpected argument 'extra'"},
    {{"--curve-key", "k", NULL}, "needs --curve-allow FILE"},
    {{"--curve-key", "k", "--curve-allow", "a", "--curve-allow-any", NULL}, "not both"},
    {{"--curve-allow-any", NULL}, "need --curve-key FILE"},
    {{"--cluster", "c", "--bind", "tcp://127.0.0.1:1", NULL}, "give --bind or --cluster, not both"},
    {{"--cluster", "/nonexistent/cluster.txt", NULL}, "--cluster needs --index"},
    {{"--cluster", "/nonexistent/cluster.txt", "--index", "0", NULL}, "/nonexistent/cluster.txt"},
    {{"--bogus", NULL}, "zps-server: unknown option '--bogus' (see --help)"},
};

Test(server_config, bad_command_lines_exit_2_and_name_the_flag, .init = cr_redirect_stderr)
{
    char err[8192];
    for (size_t i = 0; i < sizeof s_bad / sizeof s_bad[0]; i++) {
        ps_server_config c;
        const char *kg;
        zps_status st;
        cr_assert_eq(s_parse(&c, s_bad[i].args, &kg, &st), 2, "case %zu accepted", i);
        cr_assert_eq(st, ZPS_ERR_INVALID, "case %zu", i);
        zt_read_redirected(cr_get_redirected_stderr(), err, sizeof err);
        cr_assert_not_null(strstr(err, s_bad[i].msg), "case %zu: '%s' not in:\n%s", i,
                           s_bad[i].msg, err);
    }
}

Test(server_config, a_missing_cluster_file_is_one_line, .init = cr_redirect_stderr)
{
    ps_server_config c;
    const char *kg;
    zps_status st;
    const char *a[] = {"--cluster", "/nonexistent/cluster.txt", "--index", "0", NULL};
    cr_assert_eq(s_parse(&c, a, &kg, &st), 2);
    char err[2048];
    zt_read_redirected(cr_get_redirected_stderr(), err, sizeof err);
    cr_assert_eq(zt_count(err, "No such file or directory"), 1, "%s", err);
    cr_assert_eq(zt_count(err, "\n"), 1, "one line:\n%s", err);
    cr_assert_eq(strncmp(err, "zps-server: ", 12), 0, "%s", err);
}

Test(it_cli, server_log_level_flag_beats_zps_log, .timeout = 30)
{
    const char *env[] = {"ZPS_LOG=debug", NULL};
    const char *a[] = {"--bind", "nonsense", "--log-level", "off", NULL};
    char *out;
    cr_assert_eq(zt_run_tmp("zps-server", a, env, 20, &out), 1);
    cr_assert_null(strstr(out, "server["), "no log line at --log-level off:\n%s", out);
    free(out);
}

/* --metrics FILE --metrics-every SEC (default 10), and the configuration the metrics start
 * record carries: every flag under its name, --bind and --index as used. */
Test(server_config, metrics_flags_and_their_json, .init = cr_redirect_stderr)
{
    ps_server_config c;
    const char *kg;
    zps_status st;
    const char *none[] = {NULL};
    cr_assert_eq(s_parse(&c, none, &kg, &st), -1);
    cr_assert_str_eq(c.metrics, "");
    cr_assert_float_eq(c.metrics_every_s, 10.0, 0);
    const char *a[] = {"--metrics", "/tmp/s.jsonl", "--metrics-every", "0.25", "--index", "2",
                       "--mode", "async", NULL};
    cr_assert_eq(s_parse(&c, a, &kg, &st), -1);
    cr_assert_str_eq(c.metrics, "/tmp/s.jsonl");
    cr_assert_float_eq(c.metrics_every_s, 0.25, 0);
    char buf[4096];
    zps_json j = zps_json_over(buf, sizeof buf);
    ps_server_config_json(&c, &j);
    cr_assert(zps_json_fits(&j));
    const char *want[] = {"{\"bind\":\"tcp://127.0.0.1:0\",", "\"index\":2,", "\"mode\":\"async\",",
                          "\"metrics\":\"/tmp/s.jsonl\",", "\"metrics-every\":0.25,",
                          "\"cluster\":null,", "\"trainer-timeout\":30,", "\"log-level\":"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        cr_assert(strstr(buf, want[i]), "%s not in %s", want[i], buf);
    const char *bad[] = {"--metrics-every", "0", NULL};
    cr_assert_eq(s_parse(&c, bad, &kg, &st), 2, "a period of 0 would write without pause");
}
