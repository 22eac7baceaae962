/* test_peers.c — scripts/bench.d/tf-peers and scripts/bench.d/peers-venv (the peer benchmark
 * of `make bench` / `make bench-peers`, docs/training.md "The peer benchmark") on a machine
 * without TensorFlow: the benchmark says it is skipped and why, and does not fail `make
 * bench`; a virtual environment that cannot be made fails with a message that says so. The
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
