/* test_status.c — every status code has a distinct name and a real message. */
#include <criterion/criterion.h>
#include <string.h>

#include "common/status.h"

Test(status, every_code_has_a_string)
{
    for (int s = 0; s > -ZPS_STATUS_COUNT; s--) {
        const char *msg = zps_strerror(s), *name = zps_status_name(s);
        cr_assert_not_null(name, "status %d has no name", s);
        cr_assert(strlen(msg) > 3, "status %d has message '%s'", s, msg);
        cr_assert_str_neq(msg, "unknown status", "status %d", s);
        for (int t = 0; t > s; t--) {
            cr_assert_str_neq(zps_status_name(t), name, "codes %d and %d share a name", t, s);
            cr_assert_str_neq(zps_strerror(t), msg, "codes %d and %d share a message", t, s);
        }
    }
}

Test(status, outside_the_list_is_unknown)
{
    cr_assert_str_eq(zps_strerror(-ZPS_STATUS_COUNT), "unknown status");
    cr_assert_str_eq(zps_strerror(1), "unknown status");
    cr_assert_null(zps_status_name(-ZPS_STATUS_COUNT));
    cr_assert_str_eq(zps_status_name(ZPS_ERR_RANGE), "ZPS_ERR_RANGE");
}
