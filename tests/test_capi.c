/* test_capi.c — libzps.so as a user gets it (docs/ps.md "C API"): `make install` into a
 * DESTDIR stage, api/example.c built against the staged library with pkg-config alone, run
 * against a zps-server on 127.0.0.1 (started and reaped by PID); and the library's
 * interface: the soname, and no symbol but the zps_* API of include/zps/zps.h exported.
 * The install is of the default build (build/, `make install-files`: install without its
 * `all`, without SAN=): the suite is an it_* one, which sanitizer runs (make test-unit) leave
 * out. */
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "tests/api_test_util.h"
#include "tests/ps_test_util.h"
#include "tests/testutil.h"

TestSuite(it_capi, .timeout = 300);

/* The installed tree: the versioned file, its soname link and the development link. */
static void s_check_stage(const char *dir)
{
    char cmd[PATH_MAX * 2], out[4096];
    snprintf(cmd, sizeof cmd,
             "cd '%s/usr' && readlink lib/libzps.so lib/libzps.so.0 && ls lib/libzps.so.0.3.0 "
             "include/zps/zps.h include/zps/status.h lib/pkgconfig/zps.pc bin/zps-server "
             "&& readelf -d lib/libzps.so.0.3.0 | grep SONAME",
             dir);
    cr_assert_eq(at_sh(cmd, 30, out, sizeof out), 0, "%s", out);
    cr_assert(strstr(out, "libzps.so.0\nlibzps.so.0.3.0\n"), "links: %s", out);
    cr_assert(strstr(out, "Library soname: [libzps.so.0]"), "soname: %s", out);
}

Test(it_capi, example_built_with_pkg_config_against_the_staged_install_trains)
{
    char dir[256], cmd[PATH_MAX * 4], out[16384];
    zt_mktmp(dir, sizeof dir, "zps-capi");
    /* install-files: make install without its `all`, which make test has done (a tree
     * edited during the run would otherwise relink binaries other tests are running) */
    snprintf(cmd, sizeof cmd, "make -s install-files DESTDIR='%s' PREFIX=/usr", dir);
    cr_assert_eq(at_sh(cmd, 280, out, sizeof out), 0, "make install failed");
    s_check_stage(dir);
    /* pkg-config is all the build knows: the staged .pc, its paths under the stage */
    snprintf(cmd, sizeof cmd,
             "export PKG_CONFIG_PATH='%1$s/usr/lib/pkgconfig' PKG_CONFIG_SYSROOT_DIR='%1$s'; "
             "cc -std=c11 -Wall -Wextra -Werror api/example.c $(pkg-config --cflags --libs zps) "
             "-o '%1$s/example'",
             dir);
    cr_assert_eq(at_sh(cmd, 60, out, sizeof out), 0, "the example did not build");
    pst_server srv;
    cr_assert_eq(pst_spawn(&srv, NULL, (const char *const[]){"--mode", "sync", NULL}), 0);
    snprintf(cmd, sizeof cmd, "LD_LIBRARY_PATH='%1$s/usr/lib' '%1$s/example' '%2$s'", dir,
             srv.uri);
    int rc = at_sh(cmd, 30, out, sizeof out);
    pst_kill(&srv, SIGTERM);
    cr_assert_eq(rc, 0, "the example failed:\n%s", out);
    /* sgd lr 0.5 on (w - 0.5)^2 / 2 from w = 1: 0.75, 0.625, 0.5625; b falls by 0.5 a step */
    cr_assert(strstr(out, "step 0: version 1, w[0] 0.7500, b -0.5000\n"), "%s", out);
    cr_assert(strstr(out, "step 2: version 3, w[0] 0.5625, b -1.5000\n"), "%s", out);
    cr_assert(strstr(out, "libzps 0.3.0: done\n"), "%s", out);
    zt_rmtmp(dir);
}

Test(it_capi, only_the_api_leaves_the_library)
{
    char lib[PATH_MAX], path[PATH_MAX + 32];
    at_libdir(lib, sizeof lib);
    snprintf(path, sizeof path, "%s/libzps.so.0", lib);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    cr_assert_not_null(h, "dlopen %s: %s", path, dlerror());
    const char *api[] = {"zps_connect", "zps_register", "zps_init", "zps_push", "zps_pull",
                         "zps_pushpull", "zps_wait", "zps_barrier", "zps_stats", "zps_leave",
                         "zps_close", "zps_last_error", "zps_strerror", "zps_status_name"};
    for (size_t i = 0; i < sizeof api / sizeof *api; i++)
        cr_assert_not_null(dlsym(h, api[i]), "%s not exported", api[i]);
    const char *internal[] = {"ps_client_new", "ps_plan_new", "zps_log", "zps_xmalloc_at",
                              "zps__job_config__pack"};
    for (size_t i = 0; i < sizeof internal / sizeof *internal; i++)
        cr_assert_null(dlsym(h, internal[i]), "%s is exported", internal[i]);
    dlclose(h);
}
