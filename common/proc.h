/* proc.h — helper processes that announce themselves on stdout: the zps-server and raw
 * ZeroMQ servers a benchmark or a test starts and talks to.
 *
 * A child started here is sent SIGKILL when the thread that started it dies (a failed test
 * assertion, a crashed benchmark), so no server outlives the run that needs it. Reading the
 * announcement is bounded by a timeout, so a child that never comes up is an error, not a
 * hang. The caller reaps the child by its PID.
 *
 * Also threads and signals. Helper threads take no signals (zps_thread_start). A process
 * whose threads run compute kernels has its caught signals taken by a thread that does
 * nothing else (zps_sigthread): a signal handler runs on the stack of the thread the signal
 * interrupts, and oneDNN 2.6's AVX-512 JIT gemm (Debian's libdnnl) moves rsp onto a heap
 * workspace while it runs (`mov 0x68(%rsp),%rsp` for N > 84). A SIGTERM that landed on a
 * thread inside it wrote the signal frame over the heap below that workspace: seen as a
 * SIGSEGV or SIGFPE in oneDNN's exit handlers (the Xbyak label tables of its static gemm
 * kernels held SA_RESTART and s_on_signal's address) after a clean stop, in about 1 run in
 * 3 of it_exits' all-reduce SIGTERM test.
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
 * handlers set a flag the main loop reads) reach the thread meant for them: the main thread,
 * or a zps_sigthread. 0 or pthread_create's error number. */
int zps_thread_start(pthread_t *t, void *(*fn)(void *), void *arg);

/* The thread that takes a set of signals for the process: it blocks them and sleeps. */
typedef struct zps_sigthread {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t wake;
    int quit;       // under mu: zps_sigthread_stop asks the thread to end
    int running;    // the thread was started (stop joins it)
    sigset_t set;   // the signals it takes
    sigset_t old;   // the starting thread's mask before start
} zps_sigthread;

/* Blocks the n signals sigs in the calling thread, so that every thread it starts from now
 * on (OpenMP's pool, data workers, ZeroMQ's threads) inherits the block, and starts one
 * thread that has them unblocked and sleeps: the kernel then delivers them to it, and the
 * handlers the caller installed run there. Threads started before keep their masks. On a
 * failure (a warning: the caller goes on) the mask is as before and the signals reach any
 * thread, as without it. */
zps_status zps_sigthread_start(zps_sigthread *t, const int *sigs, int n);
/* Ends and joins the thread and gives the calling thread its old mask back: a signal that
 * came in between is delivered to it then. Does nothing when start failed. */
void zps_sigthread_stop(zps_sigthread *t);

#endif
