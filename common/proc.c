/* proc.c — see proc.h. */
#include "common/proc.h"

#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/log.h"

zps_status zps_proc_start(const char *const *argv, pid_t *pid, int *fd)
{
    int fds[2];
    ZPS_CHECK_SYS(pipe(fds));
    pid_t p = fork();
    if (p < 0) {
        close(fds[0]);
        close(fds[1]);
        ZPS_CHECK_SYS(p);
    }
    if (p == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    *pid = p;
    *fd = fds[0];
    return ZPS_OK;
}

zps_status zps_proc_read_line(int fd, const char *tag, char *buf, size_t len, double timeout_s)
{
    size_t got = 0;
    double end = zps_now_s() + timeout_s;
    while (zps_now_s() < end && got < len - 1) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 100) <= 0)
            continue;
        ssize_t k = read(fd, buf + got, len - 1 - got);
        if (k <= 0)
            return ZPS_ERR_EOF;
        got += (size_t)k;
        buf[got] = 0;
        if (!tag && memchr(buf, 0, got))
            return ZPS_OK;
        char *at = tag ? strstr(buf, tag) : NULL;
        char *nl = at ? strchr(at, '\n') : NULL;
        if (at && nl) {
            *nl = 0;
            memmove(buf, at + strlen(tag), strlen(at + strlen(tag)) + 1);
            return ZPS_OK;
        }
    }
    return ZPS_ERR_TIMEOUT;
}

int zps_thread_start(pthread_t *t, void *(*fn)(void *), void *arg)
{
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(t, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

/* The signal thread: its signals unblocked, asleep until asked to end. A handler that runs
 * here interrupts the wait, which then goes on (a spurious wake-up reads quit again). */
static void *s_sigthread_main(void *arg)
{
    zps_sigthread *t = arg;
    pthread_sigmask(SIG_UNBLOCK, &t->set, NULL);
    pthread_mutex_lock(&t->mu);
    while (!t->quit)
        pthread_cond_wait(&t->wake, &t->mu);
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* A start that failed in call with error number rc: said, as what it costs. */
static zps_status s_no_sigthread(const char *call, int rc)
{
    zps_log(ZPS_WARN, "proc", "no signal thread (%s: %s): a signal may then interrupt a "
            "compute thread", call, strerror(rc));
    return ZPS_ERR_SYS;
}

zps_status zps_sigthread_start(zps_sigthread *t, const int *sigs, int n)
{
    memset(t, 0, sizeof *t);
    sigemptyset(&t->set);
    for (int i = 0; i < n; i++)
        sigaddset(&t->set, sigs[i]);
    int rc = pthread_sigmask(SIG_BLOCK, &t->set, &t->old);
    if (rc != 0)
        return s_no_sigthread("pthread_sigmask", rc);
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->wake, NULL);
    rc = zps_thread_start(&t->thread, s_sigthread_main, t);
    if (rc != 0) {
        pthread_sigmask(SIG_SETMASK, &t->old, NULL);
        pthread_cond_destroy(&t->wake);
        pthread_mutex_destroy(&t->mu);
        return s_no_sigthread("pthread_create", rc);
    }
    t->running = 1;
    return ZPS_OK;
}

void zps_sigthread_stop(zps_sigthread *t)
{
    if (!t->running)
        return;
    pthread_mutex_lock(&t->mu);
    t->quit = 1;
    pthread_cond_signal(&t->wake);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->thread, NULL);
    pthread_cond_destroy(&t->wake);
    pthread_mutex_destroy(&t->mu);
    t->running = 0;
    pthread_sigmask(SIG_SETMASK, &t->old, NULL);
}
