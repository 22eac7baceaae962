/* train_test_util.h — helpers of the zps-trainer end-to-end suites (it_train, it_detect_train):
 * start a program and wait for its success, compare two weights files weight by weight, read
 * a metrics file's summary. */
#ifndef ZPS_TESTS_TRAIN_TEST_UTIL_H
#define ZPS_TESTS_TRAIN_TEST_UTIL_H

#include <stddef.h>

#include "tests/ps_test_util.h"

/* Starts $ZPS_BIN/<prog> with args (NULL-terminated), stdout+stderr to log; it dies with
 * the test, so a failed assert never leaves it holding Criterion's pipes. */
void trt_spawn(pst_server *p, const char *prog, const char *log, const char *const *args);
/* Waits for a process to exit 0 within timeout_s (else kills it, shows its log and fails). */
void trt_expect_ok(pst_server *p, const char *log, double timeout_s);
/* Starts zps-trainer with base[] (nb entries) then more[] (NULL-terminated); its log is
 * dir/<name>.log (written into log). */
void trt_trainer(pst_server *p, const char *dir, const char *name, char *log, size_t log_len,
                 const char *const *base, int nb, const char *const *more);
/* Starts 2 zps-servers with sargs (NULL-terminated) on ephemeral ports; their URIs into
 * servers ("tcp://...,tcp://..."). */
void trt_servers(pst_server srv[2], const char *const *sargs, char *servers, size_t len);
/* Fails unless every weight of other_path is within 1e-5 + 1e-3 |ref| of ref_path's; returns
 * the largest difference. */
double trt_compare(const char *ref_path, const char *other_path, const char *what);
/* The largest |a - b| over the weights of two files (that training moved them). */
double trt_max_diff(const char *a_path, const char *b_path);
/* The value of "key": in the summary line of a metrics file (-1 when absent or null). */
double trt_summary(const char *path, const char *key);

#endif
