/* test_log.c — level parsing, ZPS_LOG, and the shape of a log line. */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

Test(log, parses_levels)
{
    const char *names[] = {"trace", "debug", "info", "warn", "error", "off"};
    for (int i = 0; i < 6; i++) {
        zps_log_level l = ZPS_LOG_OFF;
        cr_assert_eq(zps_log_level_parse(names[i], &l), ZPS_OK, "%s", names[i]);
        cr_assert_eq((int)l, i);
    }
    zps_log_level l;
    cr_assert_eq(zps_log_level_parse("WARNING", &l), ZPS_OK);
    cr_assert_eq(l, ZPS_LOG_WARN);
    cr_assert_eq(zps_log_level_parse("loud", &l), ZPS_ERR_INVALID);
    cr_assert_eq(zps_log_level_parse("", &l), ZPS_ERR_INVALID);
    cr_assert_eq(zps_log_level_parse(NULL, &l), ZPS_ERR_INVALID);
}

Test(log, line_has_time_role_module_and_filters_by_level, .init = cr_redirect_stderr)
{
    setenv("ZPS_LOG", "warn", 1);
    zps_log_init("server", 3);
    zps_log(ZPS_INFO, "ps", "hidden %d", 1);
    zps_log(ZPS_WARN, "ps", "shown %d", 2);
    fflush(stderr);
    char buf[512] = {0};
    FILE *f = cr_get_redirected_stderr();
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    cr_assert(n > 0);
    cr_assert_null(strstr(buf, "hidden"));
    cr_assert_not_null(strstr(buf, " W server[3] ps: shown 2 (test_log.c:"), "got: %s", buf);
    int y, mo, d, h, mi, s, ms;
    cr_assert_eq(sscanf(buf, "%d-%d-%d %d:%d:%d.%d", &y, &mo, &d, &h, &mi, &s, &ms), 7);
    cr_assert(y >= 2024);
}

Test(log, a_failure_is_told_once, .init = cr_redirect_stderr)
{
    zps_log_init("data", -1);
    cr_assert_eq(zps_log_errors(), 0);
    zps_log_failure("zps-x", ZPS_ERR_NOT_FOUND, "inspect %s", "/d");
    zps_log(ZPS_ERROR, "ds", "no shards in /d");
    cr_assert_eq(zps_log_errors(), 1);
    /* the module said why: main's own line would be the same failure a second time */
    zps_log_failure("zps-x", ZPS_ERR_NOT_FOUND, "inspect %s", "/d");
    fflush(stderr);
    char buf[1024] = {0};
    size_t n = fread(buf, 1, sizeof buf - 1, cr_get_redirected_stderr());
    cr_assert(n > 0);
    const char *first = strstr(buf, "zps-x: inspect /d: not found\n");
    cr_assert_eq(first, buf, "main's line when nothing was logged:\n%s", buf);
    cr_assert_null(strstr(first + 1, "zps-x:"), "and only then:\n%s", buf);
}
