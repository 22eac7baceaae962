/* test_peers.c — scripts/bench.d/tf-peers and scripts/bench.d/peers-venv (the peer benchmark
 * of `make bench` / `make bench-peers`, docs/training.md "The peer benchmark") on a machine
 * without TensorFlow: the benchmark says it is skipped and why, and does not fail `make
 * bench`; a virtual environment that cannot be made fails with a message that says so; zps's
 * figure counts the steady steps only (metrics files with a slow first step). The
 * benchmark itself needs TensorFlow and minutes of both cores: it is run by `make
 * bench-peers`, never by the tests. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

/* Runs `cmd` in $ZPS_ROOT with stderr on stdout; the output into out (NUL-terminated);
 * returns the exit status. */
static int s_sh(const char *cmd, char *out, size_t cap)
{
    const char *root = getenv("ZPS_ROOT");
    char full[1024];
    snprintf(full, sizeof full, "cd '%s' && %s 2>&1", root && *root ? root : ".", cmd);
    FILE *p = popen(full, "r");
    cr_assert_not_null(p);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int st = pclose(p);
    fprintf(stderr, "%s\n", out);
    cr_assert(WIFEXITED(st), "%s", cmd);
    return WEXITSTATUS(st);
}

Test(it_peers, skipped_without_tensorflow, .timeout = 30)
{
    char dir[] = "/tmp/zps-peers-XXXXXX", cmd[512], out[4096], json[600];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(cmd, sizeof cmd,
             "PEERS_TF_PYTHON=/bin/false ZPS_BENCH_DIR=%s/bench bash scripts/bench.d/tf-peers %s",
             dir, dir);
    cr_assert_eq(s_sh(cmd, out, sizeof out), 0);
    cr_assert(strstr(out, "tf-peers: skipped") && strstr(out, "cannot import tensorflow"), "%s",
              out);
    snprintf(json, sizeof json, "%s/bench/peers.json", dir);
    struct stat sb;
    cr_assert_neq(stat(json, &sb), 0, "no peers.json when skipped");
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

Test(it_peers, venv_that_cannot_be_made_fails_clearly, .timeout = 60)
{
    char out[4096];
    cr_assert_eq(s_sh("bash scripts/bench.d/peers-venv /dev/null/venv", out, sizeof out), 1);
    cr_assert(strstr(out, "bench-peers: python3 -m venv /dev/null/venv failed"), "%s", out);
}

/* Two trainers' metrics files: step 1 is a slow warm-up, steps 2..4 take 0.1 s (trainer 0)
 * and 0.2 s (trainer 1) for 32 images each: 320 + 160 img/s once step 1 is left out (with
 * it, 128 / 1.1 + 128 / 2.2 = 175). */
Test(it_peers, zps_rate_leaves_out_the_warm_up, .timeout = 30)
{
    char dir[] = "/tmp/zps-peers-XXXXXX", path[600], cmd[700], out[4096];
    cr_assert_not_null(mkdtemp(dir));
    for (int t = 0; t < 2; t++) {
        snprintf(path, sizeof path, "%s/metrics-%d.jsonl", dir, t);
        FILE *f = fopen(path, "w");
        cr_assert_not_null(f);
        fprintf(f, "{\"type\":\"start\",\"trainer\":%d,\"git_hash\":\"abc\"}\n", t);
        for (int s = 4; s >= 1; s--) // out of order: the rate must not depend on it
            fprintf(f, "{\"type\":\"step\",\"trainer\":%d,\"step\":%d,\"time\":%g,"
                       "\"images\":32}\n", t, s, (t + 1) * (0.7 + 0.1 * s));
        fprintf(f, "{\"type\":\"summary\",\"trainer\":%d,\"img_s\":1}\n", t);
        cr_assert_eq(fclose(f), 0);
    }
    snprintf(cmd, sizeof cmd, "python3 scripts/bench.d/peers.py --steady-rate %s 2 1", dir);
    cr_assert_eq(s_sh(cmd, out, sizeof out), 0);
    double rate = 0;
    cr_assert_eq(sscanf(out, "{\"img_s\": %lf}", &rate), 1, "%s", out);
    cr_assert(rate > 479.9 && rate < 480.1, "%g", rate);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}
