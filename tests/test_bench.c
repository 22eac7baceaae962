/* test_bench.c — `zps-bench pushpull`, `optim` and `train-step` end to end (suite it_bench: runs
 * $ZPS_BIN/zps-bench): one small pushpull cell with all three sides (zps, raw, raw with warm
 * memory) exits 0 and writes build/bench-style JSON with every documented field, filled; bad
 * options are usage errors. train-step's zps side runs with zps-trainer's OpenMP policy (a
 * user's own value kept) and its JSON says the load and whether the machine was busy.
 * No figure is judged here: speed is the benchmark's business, not a test's. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/omp_env.h"
#include "tests/testutil.h"

static char s_dir[256];

static void s_setup(void) { zt_mktmp(s_dir, sizeof s_dir, "zps-bench"); }
static void s_teardown(void) { zt_rmtmp(s_dir); }

TestSuite(it_bench, .init = s_setup, .fini = s_teardown, .timeout = 150);

/* Runs zps-bench with args (NULL-terminated), $ZPS_BENCH_DIR = s_dir, within timeout_s.
 * Returns the exit status; *out is the output (caller frees). */
static int s_bench_env(char **out, double timeout_s, const char *const *args, const char *more)
{
    char logp[512], envd[600];
    snprintf(logp, sizeof logp, "%s/out.txt", s_dir);
    snprintf(envd, sizeof envd, "ZPS_BENCH_DIR=%s", s_dir);
    const char *env[] = {envd, more, NULL};
    return zt_run("zps-bench", args, env, logp, timeout_s, out);
}

/* s_bench_env with no more environment. */
static int s_bench(char **out, double timeout_s, const char *const *args)
{
    return s_bench_env(out, timeout_s, args, NULL);
}

/* The JSON file s_dir/name into js (n bytes). */
static void s_json(const char *name, char *js, size_t n)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", s_dir, name);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "no %s", path);
    size_t got = fread(js, 1, n - 1, f);
    js[got] = 0;
    fclose(f);
}

/* The number after "key": in the JSON text js (asserts that the key is there). */
static double s_num(const char *js, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\": ", key);
    const char *at = strstr(js, pat);
    cr_assert_not_null(at, "the JSON has no %s:\n%s", key, js);
    char *endp;
    double v = strtod(at + strlen(pat), &endp);
    cr_assert(endp != at + strlen(pat), "%s is not a number in:\n%s", key, js);
    return v;
}

Test(it_bench, pushpull_writes_every_documented_field)
{
    char *out;
    const char *const args[] = {"pushpull", "--quick", "--bytes", "65536", "--op", "push",
                                "--shape", "1x1", "--reps", "2", NULL};
    int rc = s_bench(&out, 120, args);
    cr_assert_eq(rc, 0, "zps-bench pushpull exited %d:\n%s", rc, out);
    cr_assert_not_null(strstr(out, "1x1   65536     push"), "no result row in:\n%s", out);
    free(out);

    char js[8192];
    s_json("pushpull.json", js, sizeof js);
    /* one cell: one object */
    cr_assert_eq(strchr(js, '{'), strrchr(js, '{'), "more than one cell in:\n%s", js);
    cr_assert_eq(s_num(js, "servers"), 1);
    cr_assert_eq(s_num(js, "clients"), 1);
    cr_assert_eq(s_num(js, "bytes"), 65536);
    cr_assert_not_null(strstr(js, "\"op\": \"push\""), "%s", js);
    /* every side ran: its throughput, latency and CPU figures are filled in */
    const char *pos[] = {"zps_gbps", "raw_gbps", "raw_warm_gbps", "ratio", "ratio_warm",
                         "zps_p50_us", "raw_p50_us", "raw_warm_p50_us", "zps_p99_us",
                         "raw_p99_us", "zps_cpu_s_per_gb", "raw_cpu_s_per_gb",
                         "raw_warm_cpu_s_per_gb"};
    for (size_t i = 0; i < sizeof pos / sizeof *pos; i++)
        cr_expect_gt(s_num(js, pos[i]), 0, "%s is not > 0 in:\n%s", pos[i], js);
    cr_expect_geq(s_num(js, "zps_p99_us"), s_num(js, "zps_p50_us"));
    cr_expect_geq(s_num(js, "raw_p99_us"), s_num(js, "raw_p50_us"));
}

/* optim: every optimizer, one row each, both zps runs and the PyTorch peer filled in; a bad
 * size list is a usage error. */
Test(it_bench, optim_writes_every_optimizer_with_its_peer)
{
    char *out;
    const char *const args[] = {"optim", "--sizes", "70000", "--reps", "3", "--warmup", "1",
                                "--threads", "2", NULL};
    int rc = s_bench(&out, 120, args);
    cr_assert_eq(rc, 0, "zps-bench optim exited %d:\n%s", rc, out);
    free(out);
    char js[8192];
    s_json("optim.json", js, sizeof js);
    static const char *const kinds[] = {"sgd", "momentum", "rmsprop", "adam", "adagrad"};
    for (size_t k = 0; k < 5; k++) {
        char pat[64];
        snprintf(pat, sizeof pat, "\"optimizer\": \"%s\"", kinds[k]);
        const char *row = strstr(js, pat);
        cr_assert_not_null(row, "no %s row in:\n%s", kinds[k], js);
        cr_expect_eq(s_num(row, "floats"), 70000);
        cr_expect_eq(s_num(row, "threads"), 2);
        const char *pos[] = {"zps_ms", "zps_threads_ms", "torch_ms", "ratio"};
        for (size_t i = 0; i < 4; i++)
            cr_expect_gt(s_num(row, pos[i]), 0, "%s: %s is not > 0 in:\n%s", kinds[k], pos[i],
                         js);
    }
    const char *const bad[] = {"optim", "--sizes", "12,x", NULL};
    rc = s_bench(&out, 30, bad);
    cr_assert_eq(rc, 2, "a bad size list: exit %d:\n%s", rc, out);
    cr_assert_not_null(strstr(out, "--sizes"), "%s", out);
    free(out);
}

Test(it_bench, pushpull_refuses_bad_options)
{
    const char *const bad[][4] = {{"pushpull", "--only", "both", NULL},
                                  {"pushpull", "--streams", "9", NULL},
                                  {"pushpull", "--push-dtype", "f16", NULL},
                                  {"pushpull", "--no-such-option", NULL, NULL}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char *out;
        int rc = s_bench(&out, 30, bad[i]);
        cr_expect_eq(rc, 2, "%s %s: exit %d, want 2 (usage):\n%s", bad[i][1], bad[i][2] ? bad[i][2] : "",
                     rc, out);
        cr_expect_eq(strncmp(out, "zps-bench pushpull: ", 20), 0, "no program name in:\n%s", out);
        cr_expect_not_null(strstr(out, " (see --help)\n"), "%s", out);
        cr_expect_eq(zt_count(out, "\n"), 1, "one line:\n%s", out);
        free(out);
    }
}

/* One tiny train-step shape, zps side only, with more in its environment (NULL: none). */
static void s_train_step(const char *more, char *js, size_t n)
{
    unsetenv("OMP_WAIT_POLICY");
    unsetenv("GOMP_SPINCOUNT");
    unsetenv("ZPS_OMP_CONFIGURED");
    char *out;
    const char *const args[] = {"train-step", "--no-torch", "--shapes", "75x1", "--steps", "1",
                                "--warmup", "0", NULL};
    int rc = s_bench_env(&out, 120, args, more);
    cr_assert_eq(rc, 0, "zps-bench train-step exited %d:\n%s", rc, out);
    free(out);
    s_json("train_step.json", js, n);
}

Test(it_bench, train_step_runs_zps_with_the_trainers_openmp_policy_and_says_the_load)
{
    char js[4096];
    s_train_step(NULL, js, sizeof js);
    cr_expect_not_null(strstr(js, "\"omp_wait_policy\": \"spin " ZPS_OMP_SPINCOUNT "\""), "%s", js);
    double cores = s_num(js, "cores"), before = s_num(js, "load_before"),
           after = s_num(js, "load_after");
    cr_expect_gt(cores, 0, "%s", js);
    cr_expect_geq(before, 0, "%s", js);
    cr_expect_geq(after, 0, "%s", js);
    const char *busy = before > cores || after > cores ? "\"busy\": true" : "\"busy\": false";
    cr_expect_not_null(strstr(js, busy), "want %s in:\n%s", busy, js);
}

Test(it_bench, train_step_keeps_the_users_openmp_policy)
{
    char js[4096];
    s_train_step("OMP_WAIT_POLICY=active", js, sizeof js);
    cr_expect_not_null(strstr(js, "\"omp_wait_policy\": \"active\""), "%s", js);
}

/* The one-thread comparison's two models, zps side only: the convnet, then the demo's
 * Inception-v3 appended to the same file; each record names its model, parameter count and
 * thread count, and zps ran on one OpenMP thread (where the machine has more). */
Test(it_bench, train_step_one_thread_models_append_to_one_file)
{
    unsetenv("OMP_WAIT_POLICY");
    unsetenv("GOMP_SPINCOUNT");
    unsetenv("OMP_NUM_THREADS");
    unsetenv("ZPS_OMP_CONFIGURED");
    const char *const conv[] = {"train-step", "--no-torch", "--no-tf", "--model", "convnet",
                                "--threads", "1", "--shapes", "28x2", "--steps", "1",
                                "--warmup", "0", NULL};
    const char *const inc[] = {"train-step", "--no-torch", "--no-tf", "--model",
                               "inception_v3", "--width", "0.25", "--channels", "1",
                               "--classes", "10", "--threads", "1", "--shapes", "75x2",
                               "--steps", "1", "--warmup", "0", "--append", NULL};
    const char *const *runs[] = {conv, inc};
    for (int i = 0; i < 2; i++) {
        char *out;
        int rc = s_bench_env(&out, 120, runs[i], NULL);
        cr_assert_eq(rc, 0, "zps-bench train-step exited %d:\n%s", rc, out);
        free(out);
    }
    char js[8192];
    s_json("train_step.json", js, sizeof js);
    cr_expect_eq(zt_count(js, "\"shape\""), 2, "two records:\n%s", js);
    cr_expect_not_null(strstr(js, "\"shape\": \"1x28x28\", \"batch\": 2,"), "%s", js);
    cr_expect_not_null(strstr(js, "\"shape\": \"1x75x75\", \"batch\": 2,"), "%s", js);
    cr_expect_not_null(strstr(js, "\"model\": \"convnet\""), "%s", js);
    cr_expect_not_null(strstr(js, "\"model\": \"inception_v3\", \"width\": 0.25"), "%s", js);
    cr_expect_not_null(strstr(js, "\"params\": 421738"), "%s", js);
    cr_expect_not_null(strstr(js, "\"params\": 1373202"), "%s", js);
    cr_expect_eq(zt_count(js, "\"threads\": 1,"), 2, "%s", js);
    cr_expect_eq(zt_count(js, "\"tf_ips\": null"), 2, "%s", js);
    if (s_num(js, "cores") > 1)
        cr_expect_eq(zt_count(js, "\"omp_num_threads\": \"1\""), 2, "%s", js);
}
