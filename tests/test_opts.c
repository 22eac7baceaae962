/* test_opts.c — the flag table (common/opts.h) on a small made-up binary: every type lands in
 * its field, ranges and names are enforced with one line naming the flag, positional
 * arguments are counted, --help shows each default from the defaults function, and the JSON
 * of a parsed struct lists every flag with its value. Suite it_cli runs every binary of
 * $ZPS_BIN: --version and an unknown option, as a user meets them. */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <dirent.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/opts.h"
#include "common/version.h"
#include "testutil.h"

typedef struct s_cfg {
    int n;
    uint32_t u32;
    int64_t i64;
    uint64_t u64;
    double d;
    float f;
    char name[8];
    const char *path;
    bool on;
    int off;
    int color;
    char size[8];
    int funcs; // times --tick ran
} s_cfg;

static void s_defaults(void *p) { *(s_cfg *)p = (s_cfg){.n = 7, .d = 0.5, .off = 1, .color = 2}; }

static zps_status s_tick(void *cfg, const char *arg, char *why, size_t cap)
{
    (void)arg;
    (void)why;
    (void)cap;
    ((s_cfg *)cfg)->funcs++;
    return ZPS_OK;
}

static const char *s_tick_show(const void *cfg)
{
    return ((const s_cfg *)cfg)->funcs ? "ticked" : NULL;
}

static zps_status s_even(void *cfg, const char *arg, char *why, size_t cap)
{
    (void)cfg;
    if (strlen(arg) % 2 == 0)
        return ZPS_OK;
    snprintf(why, cap, "wants an even length, got '%s'", arg);
    return ZPS_ERR_INVALID;
}

static const zps_opt_name s_colors[] = {{"red", 1}, {"green", 2}, {"blue", 3}, {NULL, 0}};
static const zps_opt_name s_sizes[] = {{"s", 0}, {"m", 0}, {"l", 0}, {NULL, 0}};

#define F(f) ZPS_OPT_FIELD(s_cfg, f)
static const zps_opt s_opt[] = {
    {.type = ZPS_OPT_TEXT, .help = "numbers:"},
    {"n", ZPS_OPT_INT, F(n), -5, 100, .meta = "N", .help = "an int"},
    {"u32", ZPS_OPT_UINT, F(u32), 0, 4e9, .meta = "U", .help = "a uint32"},
    {"i64", ZPS_OPT_INT, F(i64), -1e15, 1e15, .meta = "I", .dflt = "", .help = "an int64"},
    {"u64", ZPS_OPT_UINT, F(u64), 0, 18446744073709551615.0, .meta = "U", .help = "a uint64"},
    {"d", ZPS_OPT_DOUBLE, F(d), 0, 1, .meta = "X", .help = "a double"},
    {"f", ZPS_OPT_DOUBLE, F(f), -1, 1, .meta = "X", .help = "a float"},
    {.type = ZPS_OPT_TEXT, .help = "others:"},
    {"name", ZPS_OPT_STRING, F(name), .meta = "S", .help = "a short string"},
    {"path", ZPS_OPT_ARG, F(path), .meta = "P", .help = "a path"},
    {"on", ZPS_OPT_SET, F(on), .help = "sets a bool"},
    {"no-off", ZPS_OPT_CLEAR, F(off), .help = "clears an int"},
    {"color", ZPS_OPT_ENUM, F(color), .names = s_colors, .help = "an enum"},
    {"size", ZPS_OPT_STRING, F(size), .names = s_sizes, .help = "a string of names"},
    {"tick", ZPS_OPT_FUNC, .fn = s_tick, .show = s_tick_show,
     .help = "a callback without argument"},
    {"even", ZPS_OPT_FUNC, .fn = s_even, .meta = "S", .dflt = "none", .help = "a callback"},
    {.type = ZPS_OPT_END},
};
#undef F

static const zps_opts s_spec = {.prog = "zps-test", .usage = "usage: zps-test [options] [A]\n",
                                .opt = s_opt, .cfg_size = sizeof(s_cfg),
                                .defaults = s_defaults, .max_args = 1};

/* Parses args (NULL-terminated, without argv[0]) from the defaults; returns the exit code. */
static int s_parse(s_cfg *c, const char *const *args, int *first, char *argv[64])
{
    int argc = zt_argv("zps-test", args, argv, 64);
    s_defaults(c);
    int code;
    zps_status st = zps_opts_parse(&s_spec, c, argc, argv, first, &code);
    cr_assert_eq(st == ZPS_OK, code <= 0, "status %d with exit code %d", st, code);
    return code;
}

Test(opts, every_type_lands_in_its_field)
{
    s_cfg c;
    char *argv[64];
    int first;
    const char *a[] = {"--n", "-5", "--u32", "4000000000", "--i64", "-1e12", "--u64",
                       "18446744073709551615", "--d", "1", "--f", "-0.25", "--name", "abcdefg",
                       "--path", "/x", "--on", "--no-off", "--color", "blue", "--size", "m",
                       "--tick", "--tick", "--even", "ab", "arg", NULL};
    cr_assert_eq(s_parse(&c, a, &first, argv), -1);
    cr_assert_eq(c.n, -5);
    cr_assert_eq(c.u32, 4000000000u);
    cr_assert_eq(c.i64, -1000000000000ll, "an integer written as a number");
    cr_assert_eq(c.u64, UINT64_MAX);
    cr_assert_float_eq(c.d, 1.0, 0);
    cr_assert_float_eq(c.f, -0.25f, 0);
    cr_assert_str_eq(c.name, "abcdefg");
    cr_assert_str_eq(c.path, "/x");
    cr_assert(c.on);
    cr_assert_eq(c.off, 0);
    cr_assert_eq(c.color, 3);
    cr_assert_str_eq(c.size, "m");
    cr_assert_eq(c.funcs, 2);
    cr_assert_str_eq(argv[first], "arg", "the positional argument comes last");
}

static const struct {
    const char *args[4];
    const char *msg; /* in stderr */
} s_bad[] = {
    {{"--n", "101", NULL}, "zps-test: --n wants an integer in [-5, 100], got '101'"},
    {{"--n", "1.5", NULL}, "--n wants an integer"},
    {{"--n", "0x10", NULL}, "--n wants an integer"},
    {{"--n", "nan", NULL}, "--n wants an integer"},
    {{"--n", "", NULL}, "--n wants an integer"},
    {{"--n", "99999999999999999999", NULL}, "--n wants an integer"},
    {{"--u32", "-1", NULL}, "--u32 wants an integer in [0, 4000000000], got '-1'"},
    {{"--d", "1.01", NULL}, "--d wants a number in [0, 1], got '1.01'"},
    {{"--d", "inf", NULL}, "--d wants a number"},
    {{"--d", "0.5x", NULL}, "--d wants a number"},
    {{"--name", "abcdefgh", NULL}, "--name value is longer than 7 characters"},
    {{"--color", "pink", NULL}, "--color wants red, green or blue, got 'pink'"},
    {{"--size", "xl", NULL}, "--size wants s, m or l, got 'xl'"},
    {{"--even", "abc", NULL}, "--even wants an even length, got 'abc'"},
    {{"a", "b", NULL}, "zps-test: unexpected argument 'b'"},
    {{"--nope", NULL}, "zps-test: unknown option '--nope' (see --help)\n"},
    {{"--nope=3", NULL}, "zps-test: unknown option '--nope' (see --help)\n"},
    {{"-x", NULL}, "zps-test: unknown option '-x' (see --help)\n"},
    {{"--n", NULL}, "zps-test: --n needs a value: N (see --help)\n"},
    {{"--on=1", NULL}, "zps-test: --on takes no value, got '--on=1' (see --help)\n"},
    {{"--version=2", NULL}, "zps-test: --version takes no value"},
    {{"--u", "3", NULL}, "zps-test: option '--u' is ambiguous (--u32, --u64, ...) (see --help)\n"},
};

Test(opts, bad_values_exit_2_and_name_the_flag, .init = cr_redirect_stderr)
{
    char err[4096];
    for (size_t i = 0; i < sizeof s_bad / sizeof s_bad[0]; i++) {
        s_cfg c;
        char *argv[64];
        int first;
        cr_assert_eq(s_parse(&c, s_bad[i].args, &first, argv), 2, "case %zu accepted", i);
        zt_read_redirected(cr_get_redirected_stderr(), err, sizeof err);
        cr_assert_not_null(strstr(err, s_bad[i].msg), "case %zu: '%s' not in:\n%s", i,
                           s_bad[i].msg, err);
        cr_assert_eq(strchr(err, '\n'), err + strlen(err) - 1, "case %zu: one line:\n%s", i,
                     err);
    }
}

Test(opts, a_refused_value_leaves_the_field_as_it_was, .init = cr_redirect_stderr)
{
    s_cfg c;
    char *argv[64];
    int first;
    const char *a[] = {"--n", "500", NULL};
    cr_assert_eq(s_parse(&c, a, &first, argv), 2);
    cr_assert_eq(c.n, 7);
}

Test(opts, help_lists_each_flag_with_its_default, .init = cr_redirect_stdout)
{
    s_cfg c;
    char *argv[64];
    int first;
    const char *a[] = {"--n", "3", "-h", NULL};
    cr_assert_eq(s_parse(&c, a, &first, argv), 0);
    char out[8192];
    zt_read_redirected(cr_get_redirected_stdout(), out, sizeof out);
    static const char *const want[] = {
        "usage: zps-test [options] [A]\nnumbers:\n",
        "  --n N                      an int (default 7)\n",
        "  --u32 U                    a uint32 (default 0)\n",
        "  --i64 I                    an int64\n",
        "  --d X                      a double (default 0.5)\n",
        "others:\n",
        "  --on                       sets a bool\n",
        "  --color red|green|blue     an enum (default green)\n",
        "  --size s|m|l               a string of names\n",
        "  --even S                   a callback (default: none)\n",
        "  --help                     this help\n",
        "  --version                  the version and git commit\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        cr_assert_not_null(strstr(out, want[i]), "'%s' not in:\n%s", want[i], out);
}

Test(opts, names)
{
    int v;
    cr_assert_eq(zps_opt_name_parse(s_colors, "green", &v), ZPS_OK);
    cr_assert_eq(v, 2);
    cr_assert_eq(zps_opt_name_parse(s_colors, "Green", &v), ZPS_ERR_INVALID);
    cr_assert_str_eq(zps_opt_name_of(s_colors, 3), "blue");
    cr_assert_null(zps_opt_name_of(s_colors, 0));
    char buf[64];
    zps_opt_names_join(s_colors, ", ", " or ", buf, sizeof buf);
    cr_assert_str_eq(buf, "red, green or blue");
    zps_opt_names_join(s_colors, "|", "|", buf, sizeof buf);
    cr_assert_str_eq(buf, "red|green|blue");
}

static void s_more(FILE *f) { fputs("sub-commands: go\n", f); }

static const zps_opts s_top = {.prog = "zps-test", .usage = "usage: zps-test [options] CMD\n",
                               .opt = s_opt, .cfg_size = sizeof(s_cfg), .defaults = s_defaults,
                               .in_order = 1, .more_help = s_more};

Test(opts, in_order_stops_at_the_sub_command_and_leaves_getopt_fresh_for_it)
{
    s_cfg c;
    s_defaults(&c);
    char *argv[64];
    const char *a[] = {"--n", "3", "go", "pos", "--y", NULL};
    int argc = zt_argv("zps-test", a, argv, 64), first, code;
    cr_assert_eq(zps_opts_parse(&s_top, &c, argc, argv, &first, &code), ZPS_OK);
    cr_assert_eq(code, -1);
    cr_assert_eq(c.n, 3);
    cr_assert_eq(first, 3, "'go' and all after it are the sub-command's");
    /* the sub-command's own parser, as the benchmarks of zps-bench start it: it permutes */
    static const struct option sub[] = {{"y", no_argument, NULL, 'y'}, {NULL, 0, NULL, 0}};
    optind = 1;
    cr_assert_eq(getopt_long(argc - first, argv + first, "", sub, NULL), 'y');
    cr_assert_eq(getopt_long(argc - first, argv + first, "", sub, NULL), -1);
    cr_assert_str_eq(argv[first + optind], "pos");
}

Test(opts, help_ends_with_more_help, .init = cr_redirect_stdout)
{
    s_cfg c;
    s_defaults(&c);
    char *argv[8];
    const char *a[] = {"--help", NULL};
    int argc = zt_argv("zps-test", a, argv, 8), first, code;
    cr_assert_eq(zps_opts_parse(&s_top, &c, argc, argv, &first, &code), ZPS_OK);
    cr_assert_eq(code, 0);
    char out[8192];
    zt_read_redirected(cr_get_redirected_stdout(), out, sizeof out);
    cr_assert_not_null(strstr(out, "git commit\nsub-commands: go\n"), "%s", out);
}

Test(opts, version_prints_the_binary_s_version_line_and_exits_0, .init = cr_redirect_stdout)
{
    static const zps_opts sub = {.prog = "zps-test go", .usage = "usage: zps-test go\n",
                                 .opt = s_opt, .cfg_size = sizeof(s_cfg),
                                 .defaults = s_defaults};
    const zps_opts *specs[] = {&s_spec, &s_top, &sub};
    char out[1024], want[256];
    snprintf(want, sizeof want, "%s\n", zps_version_line("zps-test"));
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        s_cfg c;
        s_defaults(&c);
        char *argv[8];
        const char *a[] = {"--n", "3", "--version", "--n", "500", NULL};
        int argc = zt_argv("zps-test", a, argv, 8), first, code;
        cr_assert_eq(zps_opts_parse(specs[i], &c, argc, argv, &first, &code), ZPS_OK);
        cr_assert_eq(code, 0, "spec %zu", i);
        fflush(stdout);
        zt_read_redirected(cr_get_redirected_stdout(), out, sizeof out);
        cr_assert_str_eq(out, want, "spec %zu: the binary's name, not the sub-command's", i);
    }
    cr_assert_not_null(strstr(want, "zps-test " ZPS_VERSION " (git "), "%s", want);
}

/* ---- it_cli: the binaries themselves ---- */

/* The zps-* programs of $ZPS_BIN (build/bin without it), so a new binary is covered as soon as
 * it is built; each name into names[i] (cap of them); returns how many. */
static int s_binaries(char names[][64], int cap)
{
    const char *dir = getenv("ZPS_BIN");
    DIR *d = opendir(dir && *dir ? dir : "build/bin");
    cr_assert_not_null(d, "no binaries in %s", dir ? dir : "build/bin");
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL && n < cap;)
        if (strncmp(e->d_name, "zps-", 4) == 0 && strlen(e->d_name) < 64)
            snprintf(names[n++], 64, "%s", e->d_name);
    closedir(d);
    static const char *const known[] = {"zps-server", "zps-trainer", "zps-data", "zps-bench"};
    for (size_t k = 0; k < sizeof known / sizeof known[0]; k++) {
        int found = 0;
        for (int i = 0; i < n; i++)
            found |= strcmp(names[i], known[k]) == 0;
        cr_assert(found, "%s is not built", known[k]);
    }
    return n;
}

Test(it_cli, every_binary_prints_its_version_and_exits_0, .timeout = 60)
{
    char names[16][64];
    int n = s_binaries(names, 16);
    for (int i = 0; i <= n; i++) {
        /* the last round: a zps-bench benchmark answers for zps-bench */
        const char *prog = i < n ? names[i] : "zps-bench";
        const char *const plain[] = {"--version", NULL}, *const sub[] = {"env", "--version", NULL};
        char *out;
        cr_assert_eq(zt_run_tmp(prog, i < n ? plain : sub, NULL, 20, &out), 0, "%s", prog);
        /* "zps-X 0.3.0 (git 0123456789ab[-dirty])": the hash of the binaries' own build */
        char want[128], hash[64] = "", end[8] = "";
        snprintf(want, sizeof want, "%s %s (git %%63[0-9a-f]%%7[^\n]", prog, ZPS_VERSION);
        if (!strstr(out, "(git unknown)\n")) { /* unknown: built outside a git checkout */
            cr_assert_eq(sscanf(out, want, hash, end), 2, "%s --version: %s", prog, out);
            cr_assert_eq(strlen(hash), 12, "%s", out);
            cr_assert(!strcmp(end, ")") || !strcmp(end, "-dirty)"), "%s", out);
        }
        cr_assert_eq(zt_count(out, "\n"), 1, "one line: %s", out);
        free(out);
    }
}

Test(it_cli, every_binary_names_an_unknown_option_in_one_line_and_exits_2, .timeout = 60)
{
    char names[16][64];
    int n = s_binaries(names, 16);
    for (int i = 0; i <= n; i++) {
        const char *prog = i < n ? names[i] : "zps-bench";
        const char *const plain[] = {"--bogus-flag=1", NULL};
        const char *const sub[] = {"env", "--bogus-flag=1", NULL};
        char *out;
        cr_assert_eq(zt_run_tmp(prog, i < n ? plain : sub, NULL, 20, &out), 2, "%s", prog);
        char want[256];
        snprintf(want, sizeof want, "%s%s: unknown option '--bogus-flag' (see --help)\n", prog,
                 i < n ? "" : " env");
        cr_assert_str_eq(out, want, "one line, the program's name and no path");
        free(out);
    }
}

/* zps_opts_json: every flag once, under its name, with the value parsed (or defaulted). */
Test(opts, json_lists_every_flag_with_its_value)
{
    s_cfg c;
    char *argv[64];
    int first;
    const char *a[] = {"--n", "-5", "--u32", "4000000000", "--i64", "-1e12", "--u64",
                       "18446744073709551615", "--d", "0.3", "--f", "-0.25", "--name", "q\"\\\t",
                       "--on", "--no-off", "--color", "blue", "--size", "m", "--tick", NULL};
    cr_assert_eq(s_parse(&c, a, &first, argv), -1);
    const char *want = "{\"n\":-5,\"u32\":4000000000,\"i64\":-1000000000000,"
                       "\"u64\":18446744073709551615,\"d\":0.3,\"f\":-0.25,"
                       "\"name\":\"q\\\"\\\\\\u0009\",\"path\":null,\"on\":true,\"no-off\":true,"
                       "\"color\":\"blue\",\"size\":\"m\",\"tick\":\"ticked\",\"even\":null}";
    zps_json m = zps_json_over(NULL, 0);
    zps_opts_json(&s_spec, &c, &m);
    cr_assert_eq(m.len, strlen(want), "measuring gives the length written");
    char buf[512];
    zps_json j = zps_json_over(buf, sizeof buf);
    zps_opts_json(&s_spec, &c, &j);
    cr_assert(zps_json_fits(&j));
    cr_assert_str_eq(buf, want);

    const char *none[] = {NULL};
    cr_assert_eq(s_parse(&c, none, &first, argv), -1);
    j = zps_json_over(buf, sizeof buf);
    zps_opts_json(&s_spec, &c, &j);
    cr_assert(strstr(buf, "\"n\":7,") && strstr(buf, "\"no-off\":false,") &&
                  strstr(buf, "\"color\":\"green\"") && strstr(buf, "\"tick\":null"),
              "the defaults: %s", buf);

    char small[16];
    j = zps_json_over(small, sizeof small);
    zps_opts_json(&s_spec, &c, &j);
    cr_assert(!zps_json_fits(&j) && j.len == strlen(buf), "a cut text still counts it all");
    cr_assert_eq(strlen(small), sizeof small - 1, "and stays NUL-terminated");
    j = zps_json_over(buf, sizeof buf);
    zps_json_num(&j, 0.0 / 0.0, 6);
    zps_json_raw(&j, ",");
    zps_json_num(&j, 1.5, 6);
    cr_assert_str_eq(buf, "null,1.5", "no NaN in JSON");
}
