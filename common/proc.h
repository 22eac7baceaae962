/* proc.h — helper processes that announce themselves on stdout: the zps-server and raw
 * ZeroMQ servers a benchmark or a test starts and talks to.
 *
 * A child started here is sent SIGKILL when the thread that started it dies (a failed test
 * assertion, a crashed benchmark), so no server outlives the run that needs it. Reading the
 * announcement is bounded by a timeout, so a child that never comes up is an error, not a
 * hang. The caller reaps the child by its PID. Also: helper threads that take no signals.
 */
#ifndef ZPS_COMMON_PROC_H
#define ZPS_COMMON_PROC_H

#include <pthread.h>
#include <stddef.h>
#include <sys/types.h>

#include "common/status.h"

/* Starts argv[0] (a path) with argv (NULL-terminated), its stdout on a pipe: *pid is the
 * child, *fd the pipe's read end (the caller's to close). A failed exec shows as the child
 * exiting 127 and the pipe reaching end of file. */
zps_status zps_proc_start(const char *const *argv, pid_t *pid, int *fd);

/* Reads fd until a line holding tag arrives and leaves in buf what follows tag on that line;
 * with tag NULL, reads until a NUL byte and leaves what came before it. ZPS_ERR_EOF when fd
 * closes first, ZPS_ERR_TIMEOUT after timeout_s or when len bytes came without it. */
zps_status zps_proc_read_line(int fd, const char *tag, char *buf, size_t len, double timeout_s);

/* pthread_create of a helper thread with every signal blocked, so a process's signals (whose
 * handlers set a flag the main loop reads) always reach the thread that reads it. 0 or
 * pthread_create's error number. */
int zps_thread_start(pthread_t *t, void *(*fn)(void *), void *arg);

#endif
