/* test_launch.c — scripts/zps-launch driven with stand-in binaries (small shell scripts put in
 * a temporary --bin-dir): normal completion and the summary table, the first failure stopping
 * every other process (their PIDs verified gone), exit codes (failure, death by signal,
 * missing binary, usage, timeout, Ctrl-C), and the ssh launcher through a stand-in ssh that
 * runs the "remote" command in another session, as a real remote host would.
 *
 * The launcher's stdout is read through a pipe; its "started ROLE I pid P" lines give the
 * PIDs and are the synchronisation point for signals. Processes that are not our children
 * (the stand-in ssh's "remote" side) are awaited with pidfd + poll, bounded.
 *
 * scripts/compare is tested here too: its table, JSON and plot on metrics files written by
 * trainer/metrics.c itself (so the two agree on the format), and a run of fleets through
 * zps-launch with a stand-in trainer that writes metrics where --metrics says.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/testutil.h"
#include "trainer/metrics.h"

#define S_OUT 65536

typedef struct {
    char dir[128];      // temporary directory (cwd of the launcher)
    char out[S_OUT];    // launcher stdout + stderr
    int code;           // launcher exit code (-signal)
    int pids[16];       // started pids, servers then trainers, -1 when unknown
    int n_pids;
} s_run;

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

static void s_write_exec(const char *dir, const char *name, const char *text)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    fputs(text, f);
    fclose(f);
    cr_assert_eq(chmod(path, 0755), 0);
}

static void s_setup(s_run *r, int with_trainer)
{
    memset(r, 0, sizeof *r);
    snprintf(r->dir, sizeof r->dir, "/tmp/zps-launch-XXXXXX");
    cr_assert_not_null(mkdtemp(r->dir));
    char bin[192];
    snprintf(bin, sizeof bin, "%s/bin", r->dir);
    cr_assert_eq(mkdir(bin, 0755), 0);
    s_write_exec(bin, "zps-server", s_server_sh);
    if (with_trainer)
        s_write_exec(bin, "zps-trainer", s_trainer_sh);
    s_write_exec(r->dir, "fake-ssh", s_ssh_sh);
}

static void s_cleanup(s_run *r)
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

static void s_parse_pids(s_run *r)
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

/* Runs the launcher in r->dir with args (NULL-terminated). When sig != 0, sends it to the
 * launcher once `wait_for` has appeared on its output. */
static void s_launch(s_run *r, int sig, const char *wait_for, const char *const *args)
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
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    size_t len = 0;
    ssize_t k;
    int signalled = 0;
    while ((k = read(fds[0], r->out + len, S_OUT - 1 - len)) > 0) {
        len += (size_t)k;
        r->out[len] = 0;
        if (sig && !signalled && strstr(r->out, wait_for)) {
            kill(pid, sig);
            signalled = 1;
        }
    }
    close(fds[0]);
    int st = 0;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    r->code = WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
    s_parse_pids(r);
}

/* The text of the file at path (asserts it exists) into buf[cap]. */
static char *s_read_file(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    size_t n = fread(buf, 1, cap - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

static void s_assert_all_gone(const s_run *r)
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
static const char *s_row_status(const s_run *r, const char *role, int index)
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

Test(it_launch, normal_completion_and_summary, .timeout = 30)
{
    s_run r;
    s_setup(&r, 1);
    const char *args[] = {"--servers", "2", "--trainers", "3", "--job", "ok-job", "--run-dir",
                          "run", "--trainer-args", "--extra {index} --n {n_trainers}", NULL};
    s_launch(&r, 0, NULL, args);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert_eq(r.n_pids, 5, "%s", r.out);
    cr_assert(strstr(r.out, "role     index  host       pid"), "summary header:\n%s", r.out);
    for (int i = 0; i < 3; i++)
        cr_assert_str_eq(s_row_status(&r, "trainer", i), "ok", "%s", r.out);
    for (int i = 0; i < 2; i++)
        cr_assert_str_eq(s_row_status(&r, "server", i), "stopped", "%s", r.out);
    s_assert_all_gone(&r);

    /* the cluster file: two distinct loopback ports, three trainers */
    char path[256], text[4096];
    snprintf(path, sizeof path, "%s/run/cluster.txt", r.dir);
    s_read_file(path, text, sizeof text);
    int p0 = 0, p1 = 0, trainers = 0;
    const char *s1 = strstr(text, "server = 127.0.0.1:");
    cr_assert_not_null(s1, "%s", text);
    sscanf(s1, "server = 127.0.0.1:%d", &p0);
    const char *s2 = strstr(s1 + 1, "server = 127.0.0.1:");
    cr_assert_not_null(s2, "%s", text);
    sscanf(s2, "server = 127.0.0.1:%d", &p1);
    cr_assert(p0 > 0 && p1 > 0 && p0 != p1, "ports %d %d", p0, p1);
    for (const char *t = text; (t = strstr(t, "trainer = 127.0.0.1")); t++)
        trainers++;
    cr_assert_eq(trainers, 3);
    cr_assert(strstr(text, "job = ok-job"));

    /* the command line of trainer 2: cluster file, id and the pass-through arguments */
    snprintf(path, sizeof path, "%s/run/trainer-2.log", r.dir);
    s_read_file(path, text, sizeof text);
    char want[512];
    snprintf(want, sizeof want, "--cluster %s/run/cluster.txt --trainer-id 2 --extra 2 --n 3",
             r.dir);
    cr_assert(strstr(text, want), "trainer-2.log: %s\nwant: %s", text, want);
    snprintf(path, sizeof path, "%s/run/summary.json", r.dir);
    cr_assert_eq(access(path, R_OK), 0, "summary.json");
    s_cleanup(&r);
}

/* --servers 0: an all-reduce fleet, trainers only; the real zps-trainer refuses such a
 * cluster file in a PS mode, naming the file. */
Test(it_launch, fleet_without_servers, .timeout = 30)
{
    s_run r;
    s_setup(&r, 1);
    const char *args[] = {"--servers", "0", "--trainers", "2", "--run-dir", "run", NULL};
    s_launch(&r, 0, NULL, args);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert_eq(r.n_pids, 2, "%s", r.out);
    for (int i = 0; i < 2; i++)
        cr_assert_str_eq(s_row_status(&r, "trainer", i), "ok", "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "server", 0), "", "a server row:\n%s", r.out);
    cr_assert(strstr(r.out, "0 server(s), 2 trainer(s)"), "%s", r.out);
    s_assert_all_gone(&r);
    char path[256], text[4096];
    snprintf(path, sizeof path, "%s/run/cluster.txt", r.dir);
    s_read_file(path, text, sizeof text);
    cr_assert_null(strstr(text, "server ="), "%s", text);

    const char *neg[] = {"--servers", "-1", "--trainers", "2", NULL};
    s_launch(&r, 0, NULL, neg);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "--servers must be >= 0"), "%s", r.out);

    /* the real trainer with that cluster file */
    char *out, logp[300];
    snprintf(logp, sizeof logp, "%s/trainer.txt", r.dir);
    const char *targs[] = {"--mode", "async", "--cluster", path, "--trainer-id", "0", "--data",
                           "/nonexistent-zps-data", NULL}; // the servers are looked up first
    int code = zt_run("zps-trainer", targs, NULL, logp, 20, &out);
    cr_assert_neq(code, 0, "a PS trainer ran without servers:\n%s", out);
    cr_assert(strstr(out, "lists no server: --mode async needs at least one"), "%s", out);
    free(out);
    s_cleanup(&r);
}

Test(it_launch, first_failure_stops_the_others, .timeout = 30)
{
    s_run r;
    s_setup(&r, 1);
    const char *args[] = {"--servers", "2", "--trainers", "3", "--run-dir", "run", "--grace",
                          "5", "--on-trainer-exit", "stop", "--trainer-args",
                          "--fail 1 --code 5 --hang", NULL};
    s_launch(&r, 0, NULL, args);
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert_eq(r.n_pids, 5, "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "trainer", 1), "exit 5", "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "trainer", 0), "stopped", "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "trainer", 2), "stopped", "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "server", 0), "stopped", "%s", r.out);
    cr_assert(strstr(r.out, "trainer 1 failed: exit 5"), "%s", r.out);
    s_assert_all_gone(&r);
    s_cleanup(&r);
}

Test(it_launch, exit_codes, .timeout = 40)
{
    s_run r;
    /* death by a signal is a failure */
    s_setup(&r, 1);
    const char *killed[] = {"--servers", "1", "--trainers", "2", "--run-dir", "run1",
                            "--trainer-args", "--fail 0 --code kill --hang", NULL};
    s_launch(&r, 0, NULL, killed);
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "trainer", 0), "killed by SIGKILL", "%s", r.out);
    s_assert_all_gone(&r);
    s_cleanup(&r);

    /* a binary that does not exist */
    s_setup(&r, 0);
    const char *missing[] = {"--servers", "1", "--trainers", "1", "--run-dir", "run2", NULL};
    s_launch(&r, 0, NULL, missing);
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "trainer", 0), "exit 127", "%s", r.out);
    s_assert_all_gone(&r);

    /* usage errors */
    const char *usage[] = {"--servers", "1", NULL};
    s_launch(&r, 0, NULL, usage);
    cr_assert_eq(r.code, 2, "%s", r.out);
    const char *both[] = {"--servers", "1", "--trainers", "1", "--cluster", "x", NULL};
    s_launch(&r, 0, NULL, both);
    cr_assert_eq(r.code, 2, "%s", r.out);
    s_cleanup(&r);

    /* --timeout with everything hanging */
    s_setup(&r, 1);
    const char *timeout[] = {"--servers", "1", "--trainers", "2", "--run-dir", "run3",
                             "--timeout", "1", "--trainer-args=--hang", NULL};
    s_launch(&r, 0, NULL, timeout);
    cr_assert_eq(r.code, 124, "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "trainer", 1), "stopped", "%s", r.out);
    s_assert_all_gone(&r);
    s_cleanup(&r);
}

Test(it_launch, ctrl_c_stops_everything, .timeout = 30)
{
    s_run r;
    s_setup(&r, 1);
    const char *args[] = {"--servers", "2", "--trainers", "2", "--run-dir", "run",
                          "--trainer-args=--hang", NULL};
    s_launch(&r, SIGINT, "started trainer 1 pid", args);
    cr_assert_eq(r.code, 130, "%s", r.out);
    cr_assert_eq(r.n_pids, 4, "%s", r.out);
    cr_assert(strstr(r.out, "interrupted by SIGINT"), "%s", r.out);
    for (int i = 0; i < 2; i++)
        cr_assert_str_eq(s_row_status(&r, "trainer", i), "stopped", "%s", r.out);
    s_assert_all_gone(&r);
    s_cleanup(&r);
}

/* ---------------------------------------------------------------- supervision */

/* A stand-in server for the supervision tests: prints its arguments; the first incarnation
 * (ZPS_RESTART=0, set by the launcher) of the server named by $ZPS_TEST_DIE does what
 * $ZPS_TEST_HOW says ("kill": SIGKILL itself after 0.3 s, "exit0": exit 0 at once,
 * "always": SIGKILL itself in every incarnation); SIGTERM is handled as the real server
 * does (exit 0), unless $ZPS_TEST_DEAF is set (then it is ignored). */
static const char *s_sup_server_sh =
    "#!/bin/sh\n"
    "echo \"server $$ restart $ZPS_RESTART args: $*\"\n"
    "if [ \"$ZPS_INDEX\" = \"$ZPS_TEST_DIE\" ]; then\n"
    "  case \"$ZPS_TEST_HOW/$ZPS_RESTART\" in\n"
    "    kill/0|always/*) sleep 0.3; kill -9 $$;;\n"
    "    exit0/0) exit 0;;\n"
    "  esac\n"
    "fi\n"
    "if [ -n \"$ZPS_TEST_DEAF\" ]; then trap '' TERM; else trap 'exit 0' TERM; fi\n"
    "while :; do sleep 0.05; done\n";

/* A stand-in trainer: runs for $ZPS_TEST_RUN seconds (default 2) and exits 0; the first
 * incarnation of the trainer named by $ZPS_TEST_TDIE SIGKILLs itself after 0.3 s. */
static const char *s_sup_trainer_sh =
    "#!/bin/sh\n"
    "echo \"trainer $$ restart $ZPS_RESTART args: $*\"\n"
    "if [ \"$ZPS_INDEX\" = \"$ZPS_TEST_TDIE\" ] && [ \"$ZPS_RESTART\" = 0 ]; then\n"
    "  sleep 0.3; kill -9 $$\n"
    "fi\n"
    "sleep ${ZPS_TEST_RUN:-2}\n";

/* s_setup with the supervision stand-ins and env (NULL-terminated "NAME=value") set for
 * the launcher and its children. */
static void s_sup_setup(s_run *r, const char *const *env)
{
    s_setup(r, 0);
    char bin[192];
    snprintf(bin, sizeof bin, "%s/bin", r->dir);
    s_write_exec(bin, "zps-server", s_sup_server_sh);
    s_write_exec(bin, "zps-trainer", s_sup_trainer_sh);
    static const char *names[] = {"ZPS_TEST_DIE", "ZPS_TEST_HOW", "ZPS_TEST_DEAF",
                                  "ZPS_TEST_TDIE", "ZPS_TEST_RUN"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        unsetenv(names[i]);
    for (; env && *env; env++)
        cr_assert_eq(putenv((char *)*env), 0);
}

/* summary.json of the run folder "run" into buf. */
static char *s_summary(const s_run *r, char *buf, size_t cap)
{
    char path[256];
    snprintf(path, sizeof path, "%s/run/summary.json", r->dir);
    return s_read_file(path, buf, cap);
}

/* The "t_s" of the n-th event (0-based) in summary.json text (-1 when absent). */
static double s_event_time(const char *json, int n)
{
    const char *p = json;
    for (int i = 0; i <= n; i++) {
        p = strstr(p, "\"t_s\": ");
        if (!p)
            return -1;
        p += 7;
    }
    return strtod(p, NULL);
}

/* A server killed by SIGKILL while the trainers run is restarted with --restore from the
 * checkpoint directory the launcher gave it, and the job ends well (exit 0). */
Test(it_launch, dead_server_is_restarted_with_restore, .timeout = 30)
{
    s_run r;
    const char *env[] = {"ZPS_TEST_DIE=1", "ZPS_TEST_HOW=kill", NULL};
    s_sup_setup(&r, env);
    const char *args[] = {"--servers", "2", "--trainers", "2", "--run-dir", "run", NULL};
    s_launch(&r, 0, NULL, args);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert_eq(r.n_pids, 5, "four processes and one restart:\n%s", r.out);
    cr_assert(strstr(r.out, "server 1 failed: killed by SIGKILL at "), "%s", r.out);
    cr_assert(strstr(r.out, "restart 1 of 3 in 0.5 s with --restore"), "%s", r.out);
    cr_assert(strstr(r.out, "started server 1 pid "), "%s", r.out);
    cr_assert(strstr(r.out, "(restart 1, --restore)"), "%s", r.out);
    cr_assert(strstr(r.out, "events:\n"), "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "server", 1), "ok", "%s", r.out);
    for (int i = 0; i < 2; i++)
        cr_assert_str_eq(s_row_status(&r, "trainer", i), "ok", "%s", r.out);
    char path[256], text[8192], want[512];
    snprintf(path, sizeof path, "%s/run/server-1.log", r.dir);
    s_read_file(path, text, sizeof text);
    snprintf(want, sizeof want, "--checkpoint-dir %s/run/checkpoints --checkpoint-every-versions 50",
             r.dir);
    cr_assert(strstr(text, want), "server-1.log: %s\nwant %s", text, want);
    const char *second = strstr(text, "restart 1 args:");
    cr_assert(second && strstr(second, "--restore"), "server-1.log: %s", text);
    cr_assert_null(strstr(text, "restart 0 args: --restore"), "%s", text);
    cr_assert(strstr(text, "---- zps-launch: restart 1 of server 1 at "), "%s", text);
    s_summary(&r, text, sizeof text);
    cr_assert(strstr(text, "\"restarts\": 1"), "%s", text);
    cr_assert(strstr(text, "\"how\": \"killed by SIGKILL\""), "%s", text);
    double t = s_event_time(text, 0);
    cr_assert(t >= 0.2 && t < 2.0, "event at %g s:\n%s", t, text);
    s_assert_all_gone(&r);
    s_cleanup(&r);
}

/* A server that keeps dying uses up --restart-servers, with the back-off doubling between
 * restarts, and then ends the job. */
Test(it_launch, restarts_back_off_and_run_out, .timeout = 30)
{
    s_run r;
    const char *env[] = {"ZPS_TEST_DIE=0", "ZPS_TEST_HOW=always", "ZPS_TEST_RUN=30", NULL};
    s_sup_setup(&r, env);
    const char *args[] = {"--servers", "1", "--trainers", "1", "--run-dir", "run",
                          "--restart-servers", "2", "--restart-backoff", "0.4", NULL};
    s_launch(&r, 0, NULL, args);
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert(strstr(r.out, "restart 1 of 2 in 0.4 s"), "%s", r.out);
    cr_assert(strstr(r.out, "restart 2 of 2 in 0.8 s"), "%s", r.out);
    cr_assert(strstr(r.out, "stopping the job (no restart left)"), "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "server", 0), "killed by SIGKILL (early)", "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "trainer", 0), "stopped", "%s", r.out);
    char text[8192];
    s_summary(&r, text, sizeof text);
    double t0 = s_event_time(text, 0), t1 = s_event_time(text, 1), t2 = s_event_time(text, 2);
    /* each incarnation lives 0.3 s, then waits out its back-off */
    cr_assert(t1 - t0 >= 0.4 + 0.3 - 0.05, "events at %g %g:\n%s", t0, t1, text);
    cr_assert(t2 - t1 >= 0.8 + 0.3 - 0.05, "events at %g %g:\n%s", t1, t2, text);
    cr_assert(s_event_time(text, 3) < 0, "a fourth death:\n%s", text);
    s_assert_all_gone(&r);
    s_cleanup(&r);
}

/* A server that exits (status 0) while the trainers still run is a failure, not "ok". */
Test(it_launch, server_exiting_early_is_a_failure, .timeout = 30)
{
    s_run r;
    const char *env[] = {"ZPS_TEST_DIE=1", "ZPS_TEST_HOW=exit0", "ZPS_TEST_RUN=30", NULL};
    s_sup_setup(&r, env);
    const char *args[] = {"--servers", "2", "--trainers", "1", "--run-dir", "run",
                          "--restart-servers", "0", "--timeout", "15", NULL};
    s_launch(&r, 0, NULL, args);
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert(strstr(r.out, "server 1 failed: exit 0 (early)"), "%s", r.out);
    cr_assert(strstr(r.out, "stopping the job (restarts off)"), "%s", r.out);
    cr_assert_null(strstr(r.out, "server 1 finished"), "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "server", 1), "exit 0 (early)", "%s", r.out);
    s_assert_all_gone(&r);
    s_cleanup(&r);
}

/* --on-trainer-exit: restart (the default) brings a killed trainer back and the job ends
 * well; continue goes on without it; stop ends the job. */
Test(it_launch, trainer_exit_policies, .timeout = 40)
{
    s_run r;
    const char *env[] = {"ZPS_TEST_TDIE=1", NULL};
    s_sup_setup(&r, env);
    const char *restart[] = {"--servers", "1", "--trainers", "2", "--run-dir", "run", NULL};
    s_launch(&r, 0, NULL, restart);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "trainer 1 failed: killed by SIGKILL at "), "%s", r.out);
    cr_assert(strstr(r.out, "restart 1 of 3 in 0.5 s\n"), "%s", r.out);
    cr_assert(strstr(r.out, "started trainer 1 pid "), "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "trainer", 1), "ok", "%s", r.out);
    s_assert_all_gone(&r);

    const char *cont[] = {"--servers", "1", "--trainers", "2", "--run-dir", "run",
                          "--on-trainer-exit", "continue", NULL};
    s_launch(&r, 0, NULL, cont);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "job goes on without it"), "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "trainer", 1), "killed by SIGKILL (job went on)", "%s",
                     r.out);
    cr_assert_str_eq(s_row_status(&r, "trainer", 0), "ok", "%s", r.out);
    cr_assert_eq(r.n_pids, 3, "%s", r.out);

    const char *stop[] = {"--servers", "1", "--trainers", "2", "--run-dir", "run",
                          "--on-trainer-exit", "stop", NULL};
    s_launch(&r, 0, NULL, stop);
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert(strstr(r.out, "stopping the job (restarts off)"), "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "trainer", 0), "stopped", "%s", r.out);
    s_assert_all_gone(&r);

    const char *bad[] = {"--servers", "1", "--trainers", "1", "--on-trainer-exit", "maybe",
                         NULL};
    s_launch(&r, 0, NULL, bad);
    cr_assert_eq(r.code, 2, "%s", r.out);
    const char *neg[] = {"--servers", "1", "--trainers", "1", "--restart-servers", "-1", NULL};
    s_launch(&r, 0, NULL, neg);
    cr_assert_eq(r.code, 2, "%s", r.out);
    s_cleanup(&r);
}

/* Stopping: servers get SIGTERM once the trainers are done (the real server exits 0 on it:
 * row "ok"); one that ignores SIGTERM gets SIGKILL after --grace. --before-stop runs
 * between the two, while the servers are still up. */
Test(it_launch, graceful_stop_then_sigkill, .timeout = 30)
{
    s_run r;
    const char *env[] = {"ZPS_TEST_RUN=0.3", NULL};
    s_sup_setup(&r, env);
    const char *args[] = {"--servers", "1", "--trainers", "1", "--run-dir", "run",
                          "--before-stop", "echo hook {n_servers} > {run_dir}/hook.txt", NULL};
    s_launch(&r, 0, NULL, args);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "server", 0), "ok", "%s", r.out);
    char path[256], text[256];
    snprintf(path, sizeof path, "%s/run/hook.txt", r.dir);
    cr_assert_str_eq(s_read_file(path, text, sizeof text), "hook 1\n");
    const char *fail_hook[] = {"--servers", "1", "--trainers", "1", "--run-dir", "run",
                               "--before-stop", "exit 3", NULL};
    s_launch(&r, 0, NULL, fail_hook);
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert(strstr(r.out, "before-stop failed: exit 3"), "%s", r.out);

    const char *deaf_env[] = {"ZPS_TEST_RUN=0.3", "ZPS_TEST_DEAF=1", NULL};
    s_sup_setup(&r, deaf_env);
    const char *deaf[] = {"--servers", "1", "--trainers", "1", "--run-dir", "run", "--grace",
                          "1", NULL};
    s_launch(&r, 0, NULL, deaf);
    cr_assert(strstr(r.out, "server 0 ignored SIGTERM for 1 s: SIGKILL"), "%s", r.out);
    cr_assert_str_eq(s_row_status(&r, "server", 0), "stopped", "%s", r.out);
    cr_assert_eq(r.code, 0, "%s", r.out);
    s_assert_all_gone(&r);
    s_cleanup(&r);
}

/* Waits (bounded) until pid is gone; pid need not be our child. */
static int s_wait_gone(int pid, int timeout_ms)
{
    int fd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (fd < 0)
        return errno == ESRCH;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int rc = poll(&p, 1, timeout_ms);
    close(fd);
    return rc == 1;
}

Test(it_launch, ssh_launcher_ends_remote_processes, .timeout = 30)
{
    s_run r;
    s_setup(&r, 1);
    char cluster[256], ssh[256];
    snprintf(cluster, sizeof cluster, "%s/c.txt", r.dir);
    FILE *f = fopen(cluster, "w");
    fputs("job = sshjob\nserver = 127.0.0.1:7001\ntrainer = host-a\ntrainer = host-b\n", f);
    fclose(f);
    snprintf(ssh, sizeof ssh, "%s/fake-ssh -o BatchMode=yes", r.dir);
    /* everything hangs; once trainer 0's "remote" side has printed its pid (copied to our
     * pipe by --follow), Ctrl-C the launcher */
    const char *args[] = {"--cluster", "c.txt", "--launcher", "ssh", "--ssh", ssh, "--run-dir",
                          "run", "--follow", "trainer:0", "--trainer-args=--hang", NULL};
    s_launch(&r, SIGINT, "--trainer-id 0 --hang", args);
    cr_assert_eq(r.code, 130, "%s", r.out);
    s_assert_all_gone(&r); // the local ssh processes
    /* the "remote" process of trainer 0, in another session: its pid is in its log */
    const char *line = strstr(r.out, "\ntrainer ");
    int pid = 0;
    cr_assert(line && sscanf(line, "\ntrainer %d args:", &pid) == 1 && pid > 0, "%s", r.out);
    cr_assert(s_wait_gone(pid, 5000), "remote-side pid %d survived the launcher", pid);
    s_cleanup(&r);
}

Test(it_launch, slurm_and_ssh_command_lines, .timeout = 10)
{
    s_run r;
    s_setup(&r, 1);
    char cluster[256];
    snprintf(cluster, sizeof cluster, "%s/c.txt", r.dir);
    FILE *f = fopen(cluster, "w");
    fputs("server = node1:7000\ntrainer = node2\n", f);
    fclose(f);
    const char *slurm[] = {"--cluster", "c.txt", "--launcher", "slurm", "--dry-run",
                           "--run-dir", "run", "--job", "sj", NULL};
    s_launch(&r, 0, NULL, slurm);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "server 0 on node1: srun --nodes=1 --ntasks=1 --nodelist=node1 "
                            "--job-name=sj "),
              "%s", r.out);
    cr_assert(strstr(r.out, "zps-trainer --cluster "), "%s", r.out);
    const char *ssh[] = {"--cluster", "c.txt", "--launcher", "ssh", "--dry-run", "--run-dir",
                         "run", NULL};
    s_launch(&r, 0, NULL, ssh);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "trainer 0 on node2: ssh -o BatchMode=yes node2 'sh -c "), "%s",
              r.out);
    s_cleanup(&r);
}

/* ---------------------------------------------------------------- scripts/compare */

static const char *s_compare(void)
{
    static char path[4096];
    const char *root = getenv("ZPS_ROOT");
    snprintf(path, sizeof path, "%s/scripts/compare", root && *root ? root : ".");
    return path;
}

/* Runs scripts/compare in r->dir with args; output into r->out. */
static void s_run_compare(s_run *r, const char *const *args)
{
    const char *argv[40];
    int n = 0;
    argv[n++] = "/usr/bin/python3";
    argv[n++] = s_compare();
    while (*args && n < 38)
        argv[n++] = *args++;
    argv[n] = NULL;
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
    while ((k = read(fds[0], r->out + len, S_OUT - 1 - len)) > 0)
        len += (size_t)k;
    r->out[len] = 0;
    close(fds[0]);
    int st = 0;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    r->code = WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
}

/* number after "key": inside the compare.json entry of mode (NAN for null / absent) */
static double s_entry(const char *json, const char *mode, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"mode\": \"%s\"", mode);
    const char *e = strstr(json, pat);
    if (!e)
        return NAN;
    const char *end = strchr(e, '}');
    snprintf(pat, sizeof pat, "\"%s\": ", key);
    const char *p = strstr(e, pat);
    if (!p || (end && p > end) || !strncmp(p + strlen(pat), "null", 4))
        return NAN;
    return strtod(p + strlen(pat), NULL);
}

Test(it_launch, compare_table_json_and_plot_from_metrics_files, .timeout = 60)
{
    s_run r;
    s_setup(&r, 1);
    uint64_t seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 16);
    srand((unsigned)seed);
    static const char *modes[] = {"sync", "async", "ssp", "allreduce"};
    double img_s_sum[4] = {0}, hit[4], final_acc[4];
    const char *cargs[16];
    int nc = 0;
    char specs[4][256];
    cargs[nc++] = "--from-runs";
    for (int mi = 0; mi < 4; mi++) {
        char dir[256];
        snprintf(dir, sizeof dir, "%s/%s", r.dir, modes[mi]);
        cr_assert_eq(mkdir(dir, 0755), 0);
        snprintf(specs[mi], sizeof specs[mi], "%s=%s", modes[mi], modes[mi]);
        cargs[nc++] = specs[mi];
        /* mode mi reaches 85% at evaluation 3 + mi (never for allreduce); trainer 0 evaluates
         * every 10 steps of 0.25 s; trainer 1 never evaluates */
        hit[mi] = mi < 3 ? 0.25 * 10 * (3 + mi) : NAN;
        for (int t = 0; t < 2; t++) {
            char path[300];
            snprintf(path, sizeof path, "%s/metrics-%d.jsonl", dir, t);
            tr_metrics_opts o = {.jsonl_path = path, .mode = TR_PROGRESS_OFF, .trainer_id = t,
                                 .mode_name = modes[mi], .batch = 32, .n_trainers = 2,
                                 .target_accuracy = 0.85};
            tr_metrics *m = NULL;
            cr_assert_eq(tr_metrics_new(&o, &m), ZPS_OK);
            int64_t images = 0;
            double acc = 0;
            for (int s = 1; s <= 80; s++) {
                tr_metrics_set_fake_time(m, 0.25 * s);
                tr_step_record rec = tr_step_record_empty(s);
                rec.images = 16 + rand() % 32;
                rec.loss = 2.0 / s;
                images += rec.images;
                if (t == 0 && s % 10 == 0) {
                    int ev = s / 10;
                    acc = ev < 3 + mi || mi == 3 ? 0.5 + 0.3 * rand() / RAND_MAX
                                                 : 0.85 + 0.1 * rand() / RAND_MAX;
                    rec.test_accuracy = acc;
                }
                cr_assert_eq(tr_metrics_step(m, &rec), ZPS_OK);
            }
            if (t == 0)
                final_acc[mi] = acc;
            img_s_sum[mi] += (double)images / 20.0;
            tr_metrics_destroy(&m);
        }
    }
    cargs[nc++] = "--out-dir";
    cargs[nc++] = "out";
    cargs[nc] = NULL;
    s_run_compare(&r, cargs);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "time to 85%"), "table header: %s", r.out);
    cr_assert(strstr(r.out, "allreduce"), "%s", r.out);

    char path[300], json[16384];
    snprintf(path, sizeof path, "%s/out/compare.json", r.dir);
    s_read_file(path, json, sizeof json);
    for (int mi = 0; mi < 4; mi++) {
        double v = s_entry(json, modes[mi], "img_s");
        cr_assert(fabs(v - img_s_sum[mi]) < 1e-3 * img_s_sum[mi], "%s img_s %g want %g (seed %llx)",
                  modes[mi], v, img_s_sum[mi], (unsigned long long)seed);
        double t = s_entry(json, modes[mi], "time_to_target");
        if (isnan(hit[mi]))
            cr_assert(isnan(t), "%s never reached 85%% but time_to_target %g", modes[mi], t);
        else /* trainers' start records differ by the ms they were created apart */
            cr_assert(fabs(t - hit[mi]) < 0.5, "%s time_to_target %g want %g", modes[mi], t,
                      hit[mi]);
        cr_assert(fabs(s_entry(json, modes[mi], "final_accuracy") - final_acc[mi]) < 1e-5,
                  "%s final accuracy", modes[mi]);
        cr_assert_eq(s_entry(json, modes[mi], "trainers"), 2.0);
    }
    unsigned char magic[8] = {0};
    snprintf(path, sizeof path, "%s/out/compare.png", r.dir);
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "no plot: %s", r.out);
    cr_assert_eq(fread(magic, 1, 8, f), 8u);
    fclose(f);
    cr_assert(!memcmp(magic, "\x89PNG\r\n\x1a\n", 8), "compare.png is not a PNG");
    s_cleanup(&r);
}

/* A stand-in trainer that writes a small metrics file where --metrics says. */
static const char *s_metrics_trainer_sh =
    "#!/bin/sh\n"
    "id=''; mode=''; out=''\n"
    "while [ $# -gt 0 ]; do case \"$1\" in\n"
    "  --trainer-id) id=$2; shift;; --mode) mode=$2; shift;; --metrics) out=$2; shift;;\n"
    "esac; shift; done\n"
    "[ -n \"$out\" ] || exit 9\n"
    "{ echo \"{\\\"type\\\":\\\"start\\\",\\\"trainer\\\":$id,\\\"mode\\\":\\\"$mode\\\","
    "\\\"wall_ms\\\":1000}\"\n"
    "  echo \"{\\\"type\\\":\\\"step\\\",\\\"trainer\\\":$id,\\\"step\\\":1,\\\"time\\\":1.0,"
    "\\\"images\\\":50,\\\"loss\\\":0.5,\\\"accuracy\\\":0.9}\"\n"
    "  echo \"{\\\"type\\\":\\\"summary\\\",\\\"trainer\\\":$id,\\\"steps\\\":1,"
    "\\\"img_s\\\":50}\"\n"
    "} > \"$out\"\n";

Test(it_launch, compare_runs_fleets_through_the_launcher, .timeout = 60)
{
    s_run r;
    s_setup(&r, 0);
    char bin[256];
    snprintf(bin, sizeof bin, "%s/bin", r.dir);
    s_write_exec(bin, "zps-trainer", s_metrics_trainer_sh);
    const char *args[] = {"--modes", "sync,allreduce", "--trainers", "2", "--servers", "1",
                          "--bin-dir", bin, "--runs-root", "runs", "--out-dir", "out",
                          "--no-plot", "--timeout", "20", NULL};
    s_run_compare(&r, args);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char path[300], json[16384];
    snprintf(path, sizeof path, "%s/out/compare.json", r.dir);
    s_read_file(path, json, sizeof json);
    cr_assert_eq(s_entry(json, "sync", "img_s"), 100.0, "%s", json);
    cr_assert_eq(s_entry(json, "allreduce", "img_s"), 100.0, "%s", json);
    cr_assert(fabs(s_entry(json, "sync", "time_to_target") - 1.0) < 1e-9, "%s", json);
    snprintf(path, sizeof path, "%s/runs/sync/metrics-1.jsonl", r.dir);
    char text[2048];
    s_read_file(path, text, sizeof text);
    cr_assert(strstr(text, "\"mode\":\"sync\""), "%s", text);
    s_cleanup(&r);
}
