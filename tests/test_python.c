/* test_python.c — the Python package (python/zps, docs/ps.md "Python client") under `make
 * test`: each pytest file of python/tests runs as one Criterion test (a subprocess, bounded,
 * its output echoed), so the closing synthesis line counts them; a file passes when pytest
 * exits 0. The package is used from the checkout with $ZPS_LIB pointing at this build's
 * libzps.so; one more test installs it with pip (offline: no build isolation, no
 * dependencies) and imports it from there. Skips, saying why, when /usr/bin/python3 lacks
 * pytest, numpy or torch (scripts/deps.sh installs them). */
#include <criterion/criterion.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "tests/api_test_util.h"
#include "tests/testutil.h"

TestSuite(it_python, .timeout = 300);

#define S_PY "/usr/bin/python3"

/* The environment the pytest runs get, as a shell prefix. */
static void s_env(char *buf, size_t len)
{
    char lib[PATH_MAX];
    at_libdir(lib, sizeof lib);
    snprintf(buf, len, "export ZPS_LIB='%s' PYTHONDONTWRITEBYTECODE=1; ", lib);
}

static void s_need_python(void)
{
    char out[4096];
    if (at_sh(S_PY " -c 'import pytest, numpy, torch'", 60, out, sizeof out) != 0)
        ZPS_TEST_SKIP("%s cannot import pytest, numpy and torch: %s", S_PY, out);
}

static void s_pytest(const char *file, double timeout_s)
{
    s_need_python();
    char env[PATH_MAX + 128], cmd[2 * PATH_MAX + 512];
    static char out[1 << 20];
    s_env(env, sizeof env);
    snprintf(cmd, sizeof cmd, "%s" S_PY " -m pytest -q -p no:cacheprovider -o addopts='' "
             "python/tests/%s", env, file);
    int rc = at_sh(cmd, timeout_s, out, sizeof out);
    cr_assert_eq(rc, 0, "pytest python/tests/%s exited %d", file, rc);
    cr_assert(strstr(out, " passed"), "no test passed in python/tests/%s", file);
}

Test(it_python, roundtrip_bit_exact_f32_and_bf16) { s_pytest("test_roundtrip.py", 240); }
Test(it_python, no_copy_of_a_256_mib_tensor) { s_pytest("test_nocopy.py", 240); }
Test(it_python, server_errors_as_exceptions) { s_pytest("test_errors.py", 240); }
Test(it_python, sync_fleet_of_two_equals_one_process) { s_pytest("test_fleet.py", 280); }
Test(it_python, torch_hooks_push_during_backward) { s_pytest("test_torch.py", 240); }
Test(it_python, example_reads_the_shards_and_trains) { s_pytest("test_example.py", 280); }

Test(it_python, pip_installs_the_package)
{
    s_need_python();
    char dir[256], env[PATH_MAX + 128], cmd[4 * PATH_MAX], out[65536];
    zt_mktmp(dir, sizeof dir, "zps-pip");
    s_env(env, sizeof env);
    snprintf(cmd, sizeof cmd,
             "%1$scp -r python '%2$s/src' && " /* setuptools builds in its source folder */
             S_PY " -m pip install -q --no-build-isolation --no-deps --no-index "
             "--target '%2$s/site' '%2$s/src' && cd '%2$s' && PYTHONPATH='%2$s/site' " S_PY
             " -c 'import zps, zps.torch; print(\"zps\", zps.__version__, zps.__file__)'",
             env, dir);
    int rc = at_sh(cmd, 200, out, sizeof out);
    cr_assert_eq(rc, 0, "pip install ./python failed");
    char want[300];
    snprintf(want, sizeof want, "zps 0.3.0 %s/site/zps/__init__.py", dir);
    cr_assert(strstr(out, want), "the installed package was not the one imported: %s", out);
    zt_rmtmp(dir);
}
