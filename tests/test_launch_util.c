/* test_launch_util.c — the launcher runner of the it_launch tests (launch_test_util.h). */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/launch_test_util.h"

static const char *s_server_sh = "#!/bin/sh\n"
                                 "echo \"server $$ args: $*\"\n"
                                 "exec tail -f /dev/null\n";

/* --fail I: trainer I exits with --code C (or kills itself with SIGKILL when C is 'kill');
 * --hang: the others block until signalled; otherwise they exit 0. */
static const char *s_trainer_sh =
    "#!/bin/sh\n"
    "echo \"trainer $$ args: $*\"\n"
    "id=''; fail=''; code=3; hang=''\n"
    "while [ $# -gt 0 ]; do case \"$1\" in\n"
    "  --trainer-id) id=$2; shift;; --fail) fail=$2; shift;; --code) code=$2; shift;;\n"
    "  --hang) hang=1;;\n"
    "esac; shift; done\n"
    "if [ \"$id\" = \"$fail\" ]; then [ \"$code\" = kill ] && kill -9 $$; exit $code; fi\n"
    "[ -n \"$hang\" ] && exec tail -f /dev/null\n"
    "exit 0\n";

/* runs the command in a new session, like a remote host (not in the launcher's group) */
static const char *s_ssh_sh = "#!/bin/sh\n"
                              "while [ $# -gt 0 ]; do case \"$1\" in -o) shift 2;; -*) shift;;"
                              " *) break;; esac; done\n"
                              "shift\n"
                              "exec 3<&0\n" /* a background list would get /dev/null */
                              "setsid sh -c \"$*\" <&3 3<&- &\n"
                              "wait $!\n";

void lt_write_exec(const char *dir, const char *name, const char *text)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    fputs(text, f);
    fclose(f);
    cr_assert_eq(chmod(path, 0755), 0);
}

void lt_setup(lt_run *r, int with_trainer)
{
    memset(r, 0, sizeof *r);
    snprintf(r->dir, sizeof r->dir, "/tmp/zps-launch-XXXXXX");
    cr_assert_not_null(mkdtemp(r->dir));
    char bin[192];
    snprintf(bin, sizeof bin, "%s/bin", r->dir);
    cr_assert_eq(mkdir(bin, 0755), 0);
    lt_write_exec(bin, "zps-server", s_server_sh);
    if (with_trainer)
        lt_write_exec(bin, "zps-trainer", s_trainer_sh);
    lt_write_exec(r->dir, "fake-ssh", s_ssh_sh);
}

void lt_cleanup(lt_run *r)
{
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", r->dir);
    cr_assert_eq(system(cmd), 0);
}

static const char *s_launcher(void)
{
    static char path[4096];
    const char *root = getenv("ZPS_ROOT");
    snprintf(path, sizeof path, "%s/scripts/zps-launch", root && *root ? root : ".");
    return path;
}

static void s_parse_pids(lt_run *r)
{
    r->n_pids = 0;
    for (const char *p = r->out; (p = strstr(p, "zps-launch: started ")); p++) {
        char role[16];
        int idx, pid;
        if (sscanf(p, "zps-launch: started %15s %d pid %d", role, &idx, &pid) == 3 &&
            r->n_pids < 16)
            r->pids[r->n_pids++] = pid;
    }
}

void lt_exec(lt_run *r, const char *const *argv, int sig, const char *wait_for)
{
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    pid_t pid = fork();
    cr_assert_neq(pid, -1);
    if (pid == 0) {
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        close(fds[1]);
        if (chdir(r->dir) != 0)
            _exit(126);
        unsetenv("ZPS_BENCH_DIR");
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    size_t len = 0;
    ssize_t k;
    int signalled = 0;
    while ((k = read(fds[0], r->out + len, LT_OUT - 1 - len)) > 0) {
        len += (size_t)k;
        r->out[len] = 0;
        if (sig && !signalled && strstr(r->out, wait_for)) {
            kill(pid, sig);
            signalled = 1;
        }
    }
    r->out[len] = 0;
    close(fds[0]);
    int st = 0;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    r->code = WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
}

void lt_launch(lt_run *r, int sig, const char *wait_for, const char *const *args)
{
    const char *argv[40];
    int n = 0;
    argv[n++] = "/usr/bin/python3";
    argv[n++] = s_launcher();
    argv[n++] = "--bin-dir";
    argv[n++] = "bin";
    while (*args && n < 38)
        argv[n++] = *args++;
    argv[n] = NULL;
    lt_exec(r, argv, sig, wait_for);
    s_parse_pids(r);
}

/* The text of the file at path (asserts it exists) into buf[cap]. */
char *lt_read_file(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    size_t n = fread(buf, 1, cap - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

void lt_assert_all_gone(const lt_run *r)
{
    for (int i = 0; i < r->n_pids; i++) {
        errno = 0;
        int alive = kill(r->pids[i], 0) == 0 || errno != ESRCH;
        cr_assert(!alive, "pid %d still exists after the launcher ended\n%s", r->pids[i],
                  r->out);
    }
}

/* STATUS of the summary row "ROLE INDEX HOST PID STATUS... RUNTIME LOG" ("" when absent);
 * STATUS may be several words ("exit 5", "killed by SIGKILL"). */
const char *lt_row_status(const lt_run *r, const char *role, int index)
{
    static char status[64];
    status[0] = 0;
    for (const char *p = r->out; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        char line[512];
        size_t n = strcspn(p, "\n");
        if (n >= sizeof line)
            continue;
        memcpy(line, p, n);
        line[n] = 0;
        char *tok[16], *save = NULL;
        int nt = 0;
        for (char *t = strtok_r(line, " ", &save); t && nt < 16; t = strtok_r(NULL, " ", &save))
            tok[nt++] = t;
        if (nt < 7 || strcmp(tok[0], role) || atoi(tok[1]) != index || tok[1][0] < '0' ||
            tok[1][0] > '9')
            continue;
        size_t o = 0;
        for (int i = 4; i < nt - 2; i++)
            o += (size_t)snprintf(status + o, sizeof status - o, "%s%s", i > 4 ? " " : "",
                                  tok[i]);
        return status;
    }
    return status;
}
