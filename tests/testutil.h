/* testutil.h — small helpers shared by the Criterion tests.
 *
 * Criterion quirks learnt here: cr_log_warn() makes the run exit 1 even when every test
 * passes, and cr_skip_test()'s message is only shown with --verbose. So a test that cannot
 * run (no GPU) prints its reason on stderr itself and then skips: ZPS_TEST_SKIP. */
#ifndef ZPS_TESTS_TESTUTIL_H
#define ZPS_TESTS_TESTUTIL_H

#include <criterion/criterion.h>
#include <stdio.h>

#define ZPS_TEST_SKIP(...)                                                             \
    do {                                                                               \
        fprintf(stderr, "[SKIP] %s:%d: ", __FILE__, __LINE__);                          \
        fprintf(stderr, __VA_ARGS__);                                                  \
        fputc('\n', stderr);                                                           \
        cr_skip_test("skipped");                                                       \
    } while (0)

#endif
