/* ssh_test_util.h — a real OpenSSH server for the ssh launcher tests (test_launch_ssh.c):
 * /usr/sbin/sshd on 127.0.0.1 and a free port, with a host key and a client key generated
 * by ssh-keygen into the test's temporary directory, and the client command that reaches it
 * (zps-launch --ssh).
 *
 * Invariants: sshd runs in the foreground (-D) as our child and is stopped by its PID;
 * "ready" means sshd wrote its pid file, which it does only once its listening socket is
 * bound (awaited with inotify, bounded, together with a pidfd in case sshd dies first).
 * The client trusts exactly the generated host key, under every name the tests use. */
#ifndef ZPS_TESTS_SSH_TEST_UTIL_H
#define ZPS_TESTS_SSH_TEST_UTIL_H

#include <stddef.h>
#include <sys/types.h>

typedef struct {
    char dir[256];  // keys, sshd_config, known_hosts, sshd.log (the caller's directory)
    int port;       // where sshd listens on 127.0.0.1
    pid_t pid;      // sshd, our child; 0 when not running
    char ssh[1024]; // the client command (ssh -F /dev/null -p PORT -i KEY -o ...)
} ssht_sshd;

/* Starts sshd with its files in dir, trusting the host key under "localhost",
 * "127.0.0.1" and `name` (the second loopback name). Returns 1 when it runs; 0 with the
 * reason in why when this machine cannot run it (no sshd / ssh-keygen): the caller skips.
 * Asserts on anything else. */
int ssht_start(ssht_sshd *s, const char *dir, const char *name, char *why, size_t cap);
/* Stops sshd (SIGTERM, then SIGKILL after 5 s) and reaps it; idempotent. */
void ssht_stop(ssht_sshd *s);
/* A TCP port on 127.0.0.1 that was free a moment ago. */
int ssht_free_port(void);
/* This machine's host name into name when it resolves to a loopback address only (so an
 * ssh to it lands on the test's sshd); 0 with the reason in why otherwise. */
int ssht_loopback_name(char *name, size_t cap, char *why, size_t why_cap);

#endif
