/* api_test_util.h — helpers shared by the suites of libzps.so's API (tests/test_capi.c) and
 * of the Python package on top of it (tests/test_python.c). */
#ifndef ZPS_TESTS_API_TEST_UTIL_H
#define ZPS_TESTS_API_TEST_UTIL_H

#include <stddef.h>

/* Runs the shell command cmd in $ZPS_ROOT (the current directory without it) with stderr on
 * stdout, under `timeout -s KILL timeout_s` so it cannot outlive the test; the output's first
 * cap - 1 bytes into out (NUL-terminated), the whole output echoed to stderr. Returns the
 * exit status (137 when killed by the timeout). */
int at_sh(const char *cmd, double timeout_s, char *out, size_t cap);
/* The directory holding libzps.so: $ZPS_BIN/../lib (build/lib without ZPS_BIN), absolute. */
void at_libdir(char *buf, size_t len);

#endif
