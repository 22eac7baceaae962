/* test_api_util.c — the helpers of api_test_util.h (no tests of its own). */
#include <criterion/criterion.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "tests/api_test_util.h"

int at_sh(const char *cmd, double timeout_s, char *out, size_t cap)
{
    const char *root = getenv("ZPS_ROOT");
    char full[PATH_MAX + 128];
    /* the command travels in the environment, so it keeps its own quoting */
    cr_assert_eq(setenv("ZPS_AT_CMD", cmd, 1), 0);
    snprintf(full, sizeof full, "cd '%s' && timeout -s KILL %.0f bash -c \"$ZPS_AT_CMD\" 2>&1",
             root && *root ? root : ".", timeout_s);
    FILE *p = popen(full, "r");
    cr_assert_not_null(p);
    size_t n = 0, got;
    char chunk[4096];
    while ((got = fread(chunk, 1, sizeof chunk, p)) > 0) {
        fwrite(chunk, 1, got, stderr);
        size_t take = got < cap - 1 - n ? got : cap - 1 - n;
        memcpy(out + n, chunk, take);
        n += take;
    }
    out[n] = 0;
    int st = pclose(p);
    unsetenv("ZPS_AT_CMD");
    cr_assert(WIFEXITED(st), "%s", cmd);
    return WEXITSTATUS(st);
}

void at_libdir(char *buf, size_t len)
{
    const char *bin = getenv("ZPS_BIN");
    char rel[PATH_MAX];
    snprintf(rel, sizeof rel, "%s/../lib", bin && *bin ? bin : "build/bin");
    char abs[PATH_MAX];
    cr_assert_not_null(realpath(rel, abs), "no %s", rel);
    cr_assert(strlen(abs) < len);
    snprintf(buf, len, "%s", abs);
}
