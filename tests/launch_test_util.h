/* launch_test_util.h — running scripts/zps-launch from the it_launch tests (test_launch.c,
 * test_launch_sup.c) with stand-in binaries: small shell scripts in a temporary --bin-dir.
 *
 * The launcher's stdout is read through a pipe; its "started ROLE I pid P" lines give the
 * PIDs (restarts included) and are the synchronisation point for signals. */
#ifndef ZPS_TESTS_LAUNCH_TEST_UTIL_H
#define ZPS_TESTS_LAUNCH_TEST_UTIL_H

#include <stddef.h>

#define LT_OUT 65536

typedef struct {
    char dir[128];      // temporary directory (cwd of the launcher)
    char out[LT_OUT];   // launcher stdout + stderr
    int code;           // launcher exit code (-signal)
    int pids[16];       // started pids, servers then trainers, -1 when unknown
    int n_pids;
} lt_run;

/* Writes an executable script dir/name. */
void lt_write_exec(const char *dir, const char *name, const char *text);
/* A fresh r->dir with bin/zps-server (a stand-in that blocks), bin/zps-trainer when
 * with_trainer (--fail I --code C|kill, --hang; else exit 0) and fake-ssh. */
void lt_setup(lt_run *r, int with_trainer);
void lt_cleanup(lt_run *r);
/* Runs argv (NULL-terminated) in r->dir, without $ZPS_BENCH_DIR; stdout and stderr into
 * r->out, exit code into r->code. When sig != 0, sends it once `wait_for` has appeared on
 * the output. */
void lt_exec(lt_run *r, const char *const *argv, int sig, const char *wait_for);
/* Runs the launcher in r->dir with args (NULL-terminated) and --bin-dir bin. When sig != 0,
 * sends it to the launcher once `wait_for` has appeared on its output. */
void lt_launch(lt_run *r, int sig, const char *wait_for, const char *const *args);
/* The text of the file at path (asserts it exists) into buf[cap]. */
char *lt_read_file(const char *path, char *buf, size_t cap);
/* Asserts that none of the started pids exists any more. */
void lt_assert_all_gone(const lt_run *r);
/* STATUS of the summary row "ROLE INDEX HOST PID STATUS... RUNTIME LOG" ("" when absent). */
const char *lt_row_status(const lt_run *r, const char *role, int index);

#endif
