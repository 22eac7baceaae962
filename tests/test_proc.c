/* test_proc.c — common/proc: a child's announcement is read after its tag or up to a NUL
 * byte, and a child that exits or stays silent is an error within the timeout, not a hang. */
#include <criterion/criterion.h>
#include <signal.h>
#include <string.h>
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
