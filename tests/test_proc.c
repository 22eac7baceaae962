/* test_proc.c — common/proc: a child's announcement is read after its tag or up to a NUL
 * byte, and a child that exits or stays silent is an error within the timeout, not a hang;
 * a signal thread takes the process's signals, whatever the other threads are doing. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/proc.h"

/* Starts /bin/sh -c script; returns the read end of its stdout. */
static int s_sh(const char *script, pid_t *pid)
{
    const char *argv[] = {"/bin/sh", "-c", script, NULL};
    int fd = -1;
    cr_assert_eq(zps_proc_start(argv, pid, &fd), ZPS_OK);
    cr_assert_gt(*pid, 0);
    return fd;
}

static void s_reap(pid_t pid)
{
    kill(pid, SIGKILL);
    cr_assert_eq(waitpid(pid, NULL, 0), pid);
}

/* The child's stdout ends without the tag line; then the child exits with code. */
static void s_expect_eof_and_exit(int fd, pid_t pid, int code)
{
    char buf[128];
    cr_assert_eq(zps_proc_read_line(fd, "listening on ", buf, sizeof buf, 10), ZPS_ERR_EOF);
    close(fd);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == code, "wait status %#x, want exit %d", st,
              code);
}

TestSuite(proc, .timeout = 30);

Test(proc, tagged_line_after_other_output)
{
    pid_t pid;
    int fd = s_sh("echo starting; printf 'srv listening on tcp://h:1'; sleep 0.2; "
                  "echo; echo more; sleep 5", &pid);
    char buf[128];
    cr_assert_eq(zps_proc_read_line(fd, "listening on ", buf, sizeof buf, 10), ZPS_OK);
    cr_assert_str_eq(buf, "tcp://h:1");
    close(fd);
    s_reap(pid);
}

Test(proc, nul_terminated_announcement)
{
    pid_t pid;
    int fd = s_sh("printf 'tcp://h:2\\0'; sleep 5", &pid);
    char buf[128];
    cr_assert_eq(zps_proc_read_line(fd, NULL, buf, sizeof buf, 10), ZPS_OK);
    cr_assert_str_eq(buf, "tcp://h:2");
    close(fd);
    s_reap(pid);
}

Test(proc, exit_before_the_line_is_eof_and_silence_times_out)
{
    pid_t pid;
    int fd = s_sh("echo no tag here", &pid);
    s_expect_eof_and_exit(fd, pid, 0);

    fd = s_sh("sleep 5", &pid);
    char buf[128];
    double t0 = zps_now_s();
    cr_assert_eq(zps_proc_read_line(fd, "listening on ", buf, sizeof buf, 0.3), ZPS_ERR_TIMEOUT);
    cr_assert_lt(zps_now_s() - t0, 2.0);
    close(fd);
    s_reap(pid);
}

Test(proc, failed_exec_exits_127)
{
    const char *argv[] = {"/nonexistent/zps-no-such-binary", NULL};
    pid_t pid;
    int fd;
    cr_assert_eq(zps_proc_start(argv, &pid, &fd), ZPS_OK);
    s_expect_eof_and_exit(fd, pid, 127);
}

/* Where each SIGUSR1 handler ran (up to S_SIGS of them). Lock-free atomics: the handler
 * runs on another thread than the one that reads them (pthread_self there is glibc's, which
 * reads the thread register: safe in a handler although POSIX does not list it). */
#define S_SIGS 20
static pthread_t s_ran_on[S_SIGS];
static atomic_int s_hits, s_busy_quit;

static void s_on_usr1(int sig)
{
    (void)sig;
    if (s_hits < S_SIGS)
        s_ran_on[s_hits] = pthread_self();
    s_hits++;
}

/* A compute thread started after the signal thread: it spins, as a kernel does. */
static void *s_busy(void *arg)
{
    (void)arg;
    volatile double x = 0;
    while (!s_busy_quit)
        x += 1;
    return NULL;
}

/* Every one of 20 signals sent to the process runs its handler on the signal thread, never
 * on the starting thread or a thread it started later (both busy): a handler on a thread
 * inside oneDNN's JIT gemm wrote its frame over the heap (common/proc.h). Afterwards the
 * starting thread's mask is as before. */
Test(proc, the_signal_thread_takes_the_signals)
{
    struct sigaction sa = {.sa_handler = s_on_usr1}, old_sa;
    sigemptyset(&sa.sa_mask);
    cr_assert_eq(sigaction(SIGUSR1, &sa, &old_sa), 0);
    zps_sigthread t;
    cr_assert_eq(zps_sigthread_start(&t, (const int[]){SIGUSR1}, 1), ZPS_OK);
    pthread_t busy;
    cr_assert_eq(pthread_create(&busy, NULL, s_busy, NULL), 0);
    for (int i = 0; i < S_SIGS; i++) {
        cr_assert_eq(kill(getpid(), SIGUSR1), 0);
        double end = zps_now_s() + 10;
        while (s_hits <= i && zps_now_s() < end) /* the main thread busy too */
            ;
        cr_assert_eq(s_hits, i + 1, "signal %d: %d handler runs", i + 1, atomic_load(&s_hits));
    }
    s_busy_quit = 1;
    cr_assert_eq(pthread_join(busy, NULL), 0);
    for (int i = 0; i < S_SIGS; i++)
        cr_expect(pthread_equal(s_ran_on[i], t.thread), "signal %d ran its handler on %s", i + 1,
                  pthread_equal(s_ran_on[i], pthread_self()) ? "the main thread" : "another thread");
    zps_sigthread_stop(&t);
    sigset_t now;
    cr_assert_eq(pthread_sigmask(SIG_SETMASK, NULL, &now), 0);
    cr_expect_not(sigismember(&now, SIGUSR1), "SIGUSR1 still blocked after stop");
    cr_assert_eq(sigaction(SIGUSR1, &old_sa, NULL), 0);
}

/* Bytes the process maps now (/proc/self/statm's first field). */
static size_t s_mapped(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    cr_assert_not_null(f);
    unsigned long pages = 0;
    cr_assert_eq(fscanf(f, "%lu", &pages), 1);
    fclose(f);
    return pages * (size_t)sysconf(_SC_PAGESIZE);
}

/* A signal thread that cannot start (no address space left for its stack: a soft RLIMIT_AS
 * 1 MiB above what the process maps) is the caller's warning, not its failure: ZPS_ERR_SYS,
 * nothing running, the calling thread's mask as before, and stop does nothing. */
Test(proc, a_signal_thread_that_cannot_start_leaves_the_mask_as_it_was)
{
    sigset_t before, now;
    cr_assert_eq(pthread_sigmask(SIG_SETMASK, NULL, &before), 0);
    cr_assert_not(sigismember(&before, SIGUSR2));
    struct rlimit old, low;
    cr_assert_eq(getrlimit(RLIMIT_AS, &old), 0);
    low = old;
    low.rlim_cur = s_mapped() + (1u << 20);
    cr_assert_eq(setrlimit(RLIMIT_AS, &low), 0);
    zps_sigthread t;
    zps_status st = zps_sigthread_start(&t, (const int[]){SIGUSR2}, 1);
    cr_assert_eq(setrlimit(RLIMIT_AS, &old), 0);
    cr_assert_eq(st, ZPS_ERR_SYS, "start under the limit: %s", zps_strerror(st));
    cr_assert_eq(t.running, 0);
    cr_assert_eq(pthread_sigmask(SIG_SETMASK, NULL, &now), 0);
    cr_assert_not(sigismember(&now, SIGUSR2), "SIGUSR2 left blocked by a start that failed");
    zps_sigthread_stop(&t);
    cr_assert_eq(pthread_sigmask(SIG_SETMASK, NULL, &now), 0);
    cr_assert_not(sigismember(&now, SIGUSR2));
}
