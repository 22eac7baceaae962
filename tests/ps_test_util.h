/* ps_test_util.h — helpers for the ps test suites: spawn zps-server processes on ephemeral
 * loopback ports, kill and reap them by PID, random data with a printed seed. */
#ifndef ZPS_TESTS_PS_TEST_UTIL_H
#define ZPS_TESTS_PS_TEST_UTIL_H

#include <stdint.h>
#include <sys/types.h>

#include "ps/client.h"
#include "ps/optim.h"

typedef struct pst_server {
    pid_t pid;      // 0 when not running
    char uri[256];  // the bound endpoint, from the "listening on" line
    int status;     // wait status when pst_spawn failed and reaped the process
} pst_server;

/* Starts $ZPS_BIN/zps-server with --bind BIND (NULL: tcp://127.0.0.1:0) and the extra
 * arguments (NULL-terminated), waits (<= 10 s) for its "listening on" line. 0 on success. */
int pst_spawn(pst_server *s, const char *bind, const char *const *args);
/* Starts $ZPS_BIN/<prog> with args (NULL-terminated), stdout and stderr into log, without
 * waiting for anything; it dies with the test (PR_SET_PDEATHSIG). 0 on success. */
int pst_start(pst_server *s, const char *prog, const char *log, const char *const *args);
/* Echoes a process's log file to stderr (after a failure). */
void pst_dump(const char *log);
/* Starts $ZPS_BIN/<prog> with args (NULL-terminated), stdout and stderr into log; the
 * child dies with the test. Does not wait: pst_wait / pst_kill reap it. */
void pst_spawn_prog(pst_server *p, const char *prog, const char *log, const char *const *args);
/* Sends sig and reaps the process (<= 10 s, then SIGKILL). Returns the wait status. */
int pst_kill(pst_server *s, int sig);
/* Waits up to timeout_s for the process to exit by itself; returns the wait status or -1. */
int pst_wait(pst_server *s, double timeout_s);
/* A fresh seed (time and pid) — tests print it on failure. */
uint64_t pst_seed(void);
/* xorshift64* uniform in [-1, 1). */
float pst_uniform(uint64_t *state);
/* ps_optim_default with kind and lr set: the start of every optimizer case in the tests. */
ps_optim_config pst_optim(ps_optim_kind kind, double lr);
/* A temporary directory path (mkdtemp) into buf. */
void pst_tmpdir(char *buf, size_t len);
/* Trainer t's client to the single server at uri, with opts (NULL: the defaults), registered
 * for plan. Asserts on failure; the caller destroys the client. */
ps_client *pst_client_connect(const char *uri, uint32_t t, const ps_client_opts *opts,
                              const ps_plan *plan);
/* Trainer 0's client to the single server at uri: registered for plan and INIT with values
 * uniform in [-1, 1) from seed (copied into values when not NULL) and the default
 * optimizer (sgd, lr 0.01). Asserts on failure; the caller destroys the client. */
ps_client *pst_client_init(const char *uri, const ps_plan *plan, uint64_t seed, float *values);
/* A number field of a STATS JSON (asserts it is there). */
uint64_t pst_stat(const char *json, const char *name);
/* rm -r of a directory holding only files. */
void pst_rmdir(const char *dir);

#endif
