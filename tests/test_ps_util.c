/* test_ps_util.c — see ps_test_util.h (helpers; no tests here). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <criterion/criterion.h>

#include "common/clock.h"
#include "common/mem.h"
#include "common/proc.h"
#include "tests/ps_test_util.h"
#include "tests/testutil.h"

ps_client *pst_client_connect(const char *uri, uint32_t t, const ps_client_opts *opts,
                              const ps_plan *plan)
{
    const char *uris[1] = {uri};
    ps_client *c;
    cr_assert_eq(ps_client_new(uris, 1, t, opts, &c), ZPS_OK);
    cr_assert_eq(ps_client_register(c, plan, NULL, NULL), ZPS_OK, "REGISTER: %s",
                 ps_client_last_error(c));
    return c;
}

ps_client *pst_client_init(const char *uri, const ps_plan *plan, uint64_t seed, float *values)
{
    ps_client *c = pst_client_connect(uri, 0, NULL, plan);
    float *v = values ? values : zps_xmalloc(plan->total * 4);
    for (uint64_t i = 0; i < plan->total; i++)
        v[i] = pst_uniform(&seed);
    ps_optim_config o;
    ps_optim_default(&o);
    cr_assert_eq(ps_client_init(c, v, &o, NULL), ZPS_OK, "INIT: %s", ps_client_last_error(c));
    if (!values)
        free(v);
    return c;
}

int pst_spawn(pst_server *s, const char *bind, const char *const *args)
{
    memset(s, 0, sizeof *s);
    const char *bin = getenv("ZPS_BIN");
    char path[1024];
    snprintf(path, sizeof path, "%s/zps-server", bin ? bin : "build/bin");
    const char *argv[64];
    int n = 0;
    argv[n++] = path;
    argv[n++] = "--bind";
    argv[n++] = bind ? bind : "tcp://127.0.0.1:0";
    argv[n++] = "--log-level";
    argv[n++] = getenv("PST_LOG") ? getenv("PST_LOG") : "warn";
    for (int i = 0; args && args[i] && n < 62; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    /* A test that fails an assertion exits at once: the server goes down with it. */
    int fd;
    if (zps_proc_start(argv, &s->pid, &fd) != ZPS_OK)
        return -1;
    char buf[512];
    zps_status st = zps_proc_read_line(fd, "zps-server listening on ", buf, sizeof buf, 10);
    close(fd);
    if (st == ZPS_OK) {
        snprintf(s->uri, sizeof s->uri, "%s", buf);
        return 0;
    }
    s->status = pst_kill(s, SIGKILL);
    return -1;
}

int pst_start(pst_server *s, const char *prog, const char *log, const char *const *args)
{
    memset(s, 0, sizeof *s);
    char path[1024];
    const char *argv[64];
    zt_bin_argv(prog, args, path, sizeof path, argv);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        execv(path, (char *const *)argv);
        _exit(127);
    }
    s->pid = pid;
    return 0;
}

void pst_dump(const char *log)
{
    FILE *f = fopen(log, "r");
    if (!f)
        return;
    char line[1024];
    fprintf(stderr, "---- %s\n", log);
    while (fgets(line, sizeof line, f))
        fputs(line, stderr);
    fclose(f);
}

int pst_wait(pst_server *s, double timeout_s)
{
    if (!s->pid)
        return -1;
    double end = zps_now_s() + timeout_s;
    int st;
    for (;;) {
        pid_t r = waitpid(s->pid, &st, WNOHANG);
        if (r == s->pid) {
            s->pid = 0;
            return st;
        }
        if (zps_now_s() > end)
            return -1;
        zps_sleep_ns(2000000);
    }
}

int pst_kill(pst_server *s, int sig)
{
    if (!s->pid)
        return -1;
    kill(s->pid, sig);
    int st = pst_wait(s, 10);
    if (st == -1 && s->pid) {
        kill(s->pid, SIGKILL);
        st = pst_wait(s, 10);
    }
    return st;
}

uint64_t pst_seed(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = (uint64_t)ts.tv_nsec * 2654435761u ^ (uint64_t)ts.tv_sec ^ ((uint64_t)getpid() << 32);
    return x ? x : 1;
}

float pst_uniform(uint64_t *st)
{
    uint64_t x = *st;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *st = x;
    return (float)((double)((x * 0x2545F4914F6CDD1Dull) >> 40) / (double)(1ull << 23)) - 1.0f;
}

ps_optim_config pst_optim(ps_optim_kind kind, double lr)
{
    ps_optim_config o;
    ps_optim_default(&o);
    o.kind = kind;
    o.lr = lr;
    return o;
}

void pst_tmpdir(char *buf, size_t len)
{
    snprintf(buf, len, "/tmp/zps-test-XXXXXX");
    if (!mkdtemp(buf))
        buf[0] = 0;
}

void pst_rmdir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    char p[1024];
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            unlink(p);
        }
    closedir(d);
    rmdir(dir);
}

void pst_spawn_prog(pst_server *p, const char *prog, const char *log, const char *const *args)
{
    cr_assert_not_null(getenv("ZPS_BIN"), "ZPS_BIN unset: run through make test");
    cr_assert_eq(pst_start(p, prog, log, args), 0, "cannot start %s", prog);
}

uint64_t pst_stat(const char *json, const char *name)
{
    char key[64];
    snprintf(key, sizeof key, "\"%s\":", name);
    const char *p = strstr(json, key);
    cr_assert(p, "no %s in %s", name, json);
    return strtoull(p + strlen(key), NULL, 10);
}
