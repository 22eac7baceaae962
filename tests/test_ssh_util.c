/* test_ssh_util.c — a real sshd for the ssh launcher tests (ssh_test_util.h). */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/soak_test_util.h" // sk_sh
#include "tests/ssh_test_util.h"

#define SSHD "/usr/sbin/sshd" // sshd re-executes itself, so it must be started by full path

static void s_write(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    fputs(text, f);
    cr_assert_eq(fclose(f), 0, "%s", path);
}

int ssht_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0, "%s", strerror(errno));
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    close(fd);
    return ntohs(a.sin_port);
}

/* The host key, the client key and authorized_keys. */
static void s_keygen(const ssht_sshd *s)
{
    cr_assert_eq(sk_sh("ssh-keygen -q -t ed25519 -N '' -f '%s/host_key' && "
                      "ssh-keygen -q -t ed25519 -N '' -f '%s/client_key' && "
                      "cp '%s/client_key.pub' '%s/authorized_keys'",
                      s->dir, s->dir, s->dir, s->dir),
                 0, "ssh-keygen failed");
}

/* The client's known_hosts: the host key under every name the tests reach sshd by. */
static void s_known_hosts(const ssht_sshd *s, const char *name)
{
    char path[300], key[1024], line[1600];
    snprintf(path, sizeof path, "%s/host_key.pub", s->dir);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    cr_assert_not_null(fgets(key, sizeof key, f));
    fclose(f);
    snprintf(line, sizeof line, "[localhost]:%d,[127.0.0.1]:%d,[%s]:%d %s", s->port, s->port,
             name, s->port, key);
    snprintf(path, sizeof path, "%s/known_hosts", s->dir);
    s_write(path, line);
}

static void s_config(const ssht_sshd *s)
{
    char path[300], text[2048];
    snprintf(text, sizeof text,
             "ListenAddress 127.0.0.1\nPort %d\nHostKey %s/host_key\n"
             "AuthorizedKeysFile %s/authorized_keys\nPidFile %s/sshd.pid\n"
             "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
             "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
             "MaxStartups 64\nMaxSessions 64\nLogLevel INFO\n",
             s->port, s->dir, s->dir, s->dir);
    snprintf(path, sizeof path, "%s/sshd_config", s->dir);
    s_write(path, text);
}

/* Forks sshd -D; it dies with us (PDEATHSIG), whatever ends the test process. */
static pid_t s_spawn(const ssht_sshd *s)
{
    char cfg[300], log[300], out[300];
    snprintf(cfg, sizeof cfg, "%s/sshd_config", s->dir);
    snprintf(log, sizeof log, "%s/sshd.log", s->dir);
    snprintf(out, sizeof out, "%s/sshd.out", s->dir);
    pid_t pid = fork();
    cr_assert_neq(pid, -1);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        int fd = open(out, O_WRONLY | O_CREAT | O_APPEND, 0644);
        int in = open("/dev/null", O_RDONLY);
        if (fd < 0 || in < 0)
            _exit(126);
        dup2(in, 0);
        dup2(fd, 1);
        dup2(fd, 2);
        execl(SSHD, SSHD, "-D", "-f", cfg, "-E", log, (char *)NULL);
        _exit(127);
    }
    return pid;
}

/* Waits (bounded) until sshd wrote its pid file (1: listening) or died (0, reaped). */
static int s_await_ready(int ino, pid_t pid)
{
    int pfd = (int)syscall(SYS_pidfd_open, pid, 0);
    cr_assert_geq(pfd, 0, "pidfd_open: %s", strerror(errno));
    struct pollfd p[2] = {{.fd = ino, .events = POLLIN}, {.fd = pfd, .events = POLLIN}};
    int ready = 0;
    while (!ready) {
        int rc = poll(p, 2, 15000);
        cr_assert_gt(rc, 0, "sshd (pid %d) neither listened nor died within 15 s", pid);
        if (p[1].revents) {
            close(pfd);
            int st;
            cr_assert_eq(waitpid(pid, &st, 0), pid);
            return 0;
        }
        char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
        ssize_t n = read(ino, buf, sizeof buf);
        cr_assert_gt(n, 0);
        for (char *q = buf; q < buf + n;) {
            const struct inotify_event *e = (const struct inotify_event *)q;
            if (e->len && !strcmp(e->name, "sshd.pid"))
                ready = 1;
            q += sizeof *e + e->len;
        }
    }
    close(pfd);
    return 1;
}

int ssht_start(ssht_sshd *s, const char *dir, const char *name, char *why, size_t cap)
{
    memset(s, 0, sizeof *s);
    snprintf(s->dir, sizeof s->dir, "%s", dir);
    if (access(SSHD, X_OK) != 0 || sk_sh("command -v ssh-keygen >/dev/null && "
                                        "command -v ssh >/dev/null") != 0) {
        snprintf(why, cap, "no OpenSSH here (%s, ssh, ssh-keygen: `make deps` installs "
                           "openssh-server)", SSHD);
        return 0;
    }
    /* the privilege separation directory sshd insists on (a root-run sshd checks it) */
    if (mkdir("/run/sshd", 0755) != 0 && errno != EEXIST && getuid() == 0)
        cr_assert_fail("cannot create /run/sshd: %s", strerror(errno));
    s_keygen(s);
    for (int attempt = 0; attempt < 3 && !s->pid; attempt++) {
        s->port = ssht_free_port(); // another program may take it first: then try another
        s_known_hosts(s, name);
        s_config(s);
        int ino = inotify_init1(IN_CLOEXEC);
        cr_assert_geq(ino, 0);
        cr_assert_geq(inotify_add_watch(ino, s->dir, IN_CLOSE_WRITE | IN_MOVED_TO), 0);
        pid_t pid = s_spawn(s);
        if (s_await_ready(ino, pid))
            s->pid = pid;
        close(ino);
    }
    if (!s->pid) {
        char log[300];
        snprintf(log, sizeof log, "%s/sshd.log", s->dir);
        sk_sh("cat '%s' '%s/sshd.out' >&2", log, s->dir);
        cr_assert_fail("sshd did not start (its log is above)");
    }
    snprintf(s->ssh, sizeof s->ssh,
             "ssh -F /dev/null -p %d -i %s/client_key -o IdentitiesOnly=yes "
             "-o UserKnownHostsFile=%s/known_hosts -o StrictHostKeyChecking=yes "
             "-o BatchMode=yes -o LogLevel=ERROR",
             s->port, s->dir, s->dir);
    return 1;
}

void ssht_stop(ssht_sshd *s)
{
    if (!s->pid)
        return;
    int pfd = (int)syscall(SYS_pidfd_open, s->pid, 0);
    kill(s->pid, SIGTERM);
    struct pollfd p = {.fd = pfd, .events = POLLIN};
    if (pfd < 0 || poll(&p, 1, 5000) != 1)
        kill(s->pid, SIGKILL);
    if (pfd >= 0)
        close(pfd);
    waitpid(s->pid, NULL, 0);
    s->pid = 0;
}

int ssht_loopback_name(char *name, size_t cap, char *why, size_t why_cap)
{
    if (gethostname(name, cap) != 0 || !*name) {
        snprintf(why, why_cap, "gethostname: %s", strerror(errno));
        return 0;
    }
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res = NULL;
    int rc = getaddrinfo(name, NULL, &hints, &res);
    if (rc != 0) {
        snprintf(why, why_cap, "this host's name '%s' does not resolve: %s", name,
                 gai_strerror(rc));
        return 0;
    }
    int loopback = 1, v4 = 0; // ssh tries each address: ::1 is refused, then 127.x answers
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        if (a->ai_family == AF_INET) {
            v4 = 1;
            loopback &= ntohl(((struct sockaddr_in *)a->ai_addr)->sin_addr.s_addr) >> 24 == 127;
        } else if (a->ai_family == AF_INET6) {
            loopback &= IN6_IS_ADDR_LOOPBACK(&((struct sockaddr_in6 *)a->ai_addr)->sin6_addr);
        }
    }
    freeaddrinfo(res);
    loopback &= v4;
    if (!loopback)
        snprintf(why, why_cap, "this host's name '%s' resolves to a non-loopback address, "
                               "so it would not reach the test's sshd on 127.0.0.1", name);
    return loopback;
}
