/* test_launch_slurm.c — zps-launch --launcher slurm (suite it_slurm) on a real single-node
 * Slurm cluster brought up in a temporary directory by tests/slurm-cluster.sh (its own munge
 * key and munged, slurm.conf on free ports, slurmctld and slurmd; stopped by PID at the end,
 * also when the test fails or times out):
 * - scripts/zps-slurm.sbatch submitted with sbatch: a 2-server, 2-trainer fleet derived from
 *   the allocation trains to its target and the job exits 0;
 * - in a long run, server 1's task killed: the launcher restarts it with --restore (a new
 *   step); then scancel of the job: Slurm SIGTERMs every step and the launcher; the servers
 *   write their final checkpoint and exit 0, the launcher reports every process "stopped (job
 *   cancelled)" in its summary, and no process of the job is left (by PID);
 * and without daemons: outside an allocation (or without Slurm's commands) the launcher
 * refuses and starts nothing; the placement read from an allocation with GPUs, through a
 * stand-in scontrol (--dry-run).
 *
 * The cluster file names the node by its Slurm name (this machine's short host name), which
 * zps-server binds and the trainers connect to; the fleets get --port-base from free ports (the default derives from the
 * job id, the same in two of these tests running at once). Waits are polls of files and of
 * squeue, each with a deadline.
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/launch_test_util.h"
#include "tests/testutil.h"

static char s_dir[128]; // the cluster's directory, also the jobs' working directory

static const char *s_root(void)
{
    const char *r = getenv("ZPS_ROOT");
    return r && *r ? r : ".";
}

static const char *s_bin(void)
{
    static char path[4096];
    const char *b = getenv("ZPS_BIN");
    if (b && *b)
        snprintf(path, sizeof path, "%s", b);
    else if (!realpath("build/bin", path))
        snprintf(path, sizeof path, "build/bin");
    return path;
}

static double s_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* Runs the shell command (printf format); its stdout (stderr too) into out[cap] when out is
 * not NULL. Returns the exit status (-1 when it did not exit). */
static int s_sh(char *out, size_t cap, const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p, "popen %s", cmd);
    char sink[4096];
    size_t n = 0, k;
    while ((k = fread(out ? out + n : sink, 1, out ? cap - 1 - n : sizeof sink, p)) > 0)
        n += out ? k : 0;
    if (out)
        out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Polls until the file at path holds what (exists, when what is NULL), for timeout_s. */
static int s_wait_file(const char *path, const char *what, double timeout_s)
{
    for (double end = s_now() + timeout_s; s_now() < end; usleep(50 * 1000))
        if (what ? zt_file_has(path, what) : access(path, R_OK) == 0)
            return 1;
    return 0;
}

/* Polls until squeue no longer lists job (all its processes have ended), for timeout_s. */
static int s_wait_job_gone(const char *job, double timeout_s)
{
    char out[256];
    for (double end = s_now() + timeout_s; s_now() < end; usleep(100 * 1000))
        if (s_sh(out, sizeof out, "squeue -h -j %s -o %%i 2>/dev/null", job) == 0 && !out[0])
            return 1;
    return 0;
}

static void s_down(void)
{
    if (!s_dir[0])
        return;
    s_sh(NULL, 0, "'%s/tests/slurm-cluster.sh' down '%s' 2>&1", s_root(), s_dir);
    zt_rmtmp(s_dir);
    s_dir[0] = 0;
}

/* The cluster, and the data the fleets train on (a small Fashion-MNIST in s_dir/fm). */
static void s_up(void)
{
    if (s_sh(NULL, 0, "command -v sbatch && test -x /usr/sbin/slurmctld && "
                      "command -v munged || test -x /usr/sbin/munged") != 0)
        ZPS_TEST_SKIP("Slurm or munge not installed (make deps)");
    if (geteuid() != 0)
        ZPS_TEST_SKIP("the test cluster runs its daemons as root (SlurmUser=root)");
    zt_mktmp(s_dir, sizeof s_dir, "zps-slurm");
    char out[2048];
    int rc = s_sh(out, sizeof out, "'%s/tests/slurm-cluster.sh' up '%s' %d 2>&1", s_root(),
                  s_dir, (int)getpid());
    cr_assert_eq(rc, 0, "the Slurm cluster did not come up:\n%s", out);
    out[strcspn(out, "\n")] = 0;
    setenv("SLURM_CONF", out, 1);
    for (const char *v = "SLURM_JOB_ID\0SLURM_JOBID\0SLURM_JOB_NODELIST\0"; *v;
         v += strlen(v) + 1)
        unsetenv(v); // the test may itself run inside an allocation
    rc = s_sh(out, sizeof out, "'%s/zps-data' convert fashion-mnist --out '%s/fm' --limit 2048 "
                               "--shards 2 2>&1", s_bin(), s_dir);
    cr_assert_eq(rc, 0, "zps-data convert: %s", out);
}

/* A base port P with P and P + 1 free on 127.0.0.1 now. The default base derives from the
 * job id, and every test cluster starts at job 1: two of these tests at once would share
 * ports. */
static int s_port_base(void)
{
    for (int tries = 0; tries < 50; tries++) {
        int fd[2] = {socket(AF_INET, SOCK_STREAM, 0), socket(AF_INET, SOCK_STREAM, 0)};
        cr_assert(fd[0] >= 0 && fd[1] >= 0, "socket: %s", strerror(errno));
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000001)};
        socklen_t len = sizeof a;
        int base = 0;
        if (bind(fd[0], (struct sockaddr *)&a, sizeof a) == 0 &&
            getsockname(fd[0], (struct sockaddr *)&a, &len) == 0 &&
            ntohs(a.sin_port) < 65535) {
            a.sin_port = htons((uint16_t)(ntohs(a.sin_port) + 1));
            if (bind(fd[1], (struct sockaddr *)&a, sizeof a) == 0)
                base = ntohs(a.sin_port) - 1;
        }
        close(fd[0]);
        close(fd[1]);
        if (base)
            return base;
    }
    cr_assert_fail("no two consecutive free ports");
    return 0;
}

/* sbatch of the example script for a fleet of 2 servers and 2 trainers on the one node,
 * run folder s_dir/run; the job id into job[32]. */
static void s_sbatch(const char *run, int steps, char *job)
{
    char out[1024];
    int rc = s_sh(out, sizeof out,
                  "cd '%s' && sbatch --parsable --nodes=1 --ntasks=2 --output=%s.out "
                  "--export=ALL,ZPS_ROOT='%s' '%s/scripts/zps-slurm.sbatch' --bin-dir '%s' "
                  "--servers-per-node 2 --trainers-per-node 2 "
                  "--port-base %d --run-dir '%s/%s' --grace 5 --trainer-args='--data fm "
                  "--mode async --model mlp --steps %d --batch-size 32 --eval-batches 4 "
                  "--no-progress --threads 0 --stop-accuracy 0.7' 2>&1",
                  s_dir, run, s_root(), s_root(), s_bin(), s_port_base(), s_dir, run, steps);
    cr_assert_eq(rc, 0, "sbatch: %s", out);
    cr_assert(sscanf(out, "%31[0-9]", job) == 1, "sbatch said: %s", out);
}

/* "server0=STATUS/EXIT/rRESTARTS ... trainer1=... | EXIT" from run's summary.json. */
static void s_summary(const char *run, char *out, size_t cap)
{
    char path[300];
    snprintf(path, sizeof path, "%s/%s/summary.json", s_dir, run);
    if (!s_wait_file(path, NULL, 40)) {
        s_sh(out, cap, "squeue -s; tail -n 20 '%s/%s.out'", s_dir, run);
        cr_assert_fail("no %s after 40 s:\n%s", path, out);
    }
    s_sh(out, cap,
         "python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); "
         "print(\" \".join(\"%%s%%d=%%s/%%s/r%%d\" %% (p[\"role\"], p[\"index\"], "
         "p[\"status\"], p[\"exit_code\"], p[\"restarts\"]) for p in d[\"processes\"]), "
         "\"|\", d[\"exit_code\"])' '%s' 2>&1",
         path);
}

/* pid runs: it exists and is not a zombie. srun forks a helper that, when srun is gone,
 * init reaps some time later; meanwhile it is a zombie, which runs nothing. */
static int s_alive(pid_t pid)
{
    errno = 0;
    if (kill(pid, 0) == -1 && errno == ESRCH)
        return 0;
    char path[64], stat[512] = "";
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    size_t n = fread(stat, 1, sizeof stat - 1, f);
    fclose(f);
    stat[n] = 0;
    const char *st = strrchr(stat, ')'); // "PID (COMM) STATE ..."
    return !(st && st[1] == ' ' && st[2] == 'Z');
}

static void s_assert_gone(const char *pids, const char *why)
{
    for (const char *p = pids; *p;) {
        char *end;
        long pid = strtol(p, &end, 10);
        if (end == p) {
            p++;
            continue;
        }
        p = end;
        if (pid <= 0 || !s_alive((pid_t)pid))
            continue;
        char ps[512];
        s_sh(ps, sizeof ps, "ps -o pid,ppid,stat,args -p %ld 2>&1", pid);
        cr_assert_fail("pid %ld (%s) is still there:\n%s", pid, why, ps);
    }
}

/* A fleet that trains to its target: the job ends COMPLETED, exit 0. */
static void s_check_training(void)
{
    char job[32], out[4096], path[300];
    s_sbatch("train", 300, job);
    s_summary("train", out, sizeof out);
    cr_assert(strstr(out, "server0=ok/0/r0 server1=ok/0/r0 trainer0=ok/0/r0 trainer1=ok/0/r0 "
                          "| 0"),
              "%s", out);
    cr_assert(s_wait_job_gone(job, 15), "job %s did not end", job);
    s_sh(out, sizeof out, "scontrol show job %s 2>&1", job);
    cr_assert(strstr(out, "JobState=COMPLETED") && strstr(out, "ExitCode=0:0"), "%s", out);
    snprintf(path, sizeof path, "%s/train/trainer-0.log", s_dir);
    cr_assert(zt_file_has(path, "reached the target 0.7000"), "see %s", path);
    snprintf(path, sizeof path, "%s/train/server-0.log", s_dir);
    cr_assert(zt_file_has(path, "stopping: final checkpoint"), "see %s", path);
    snprintf(path, sizeof path, "%s/train/server-1.metrics.jsonl", s_dir);
    cr_assert(zt_file_has(path, "{\"type\":\"start\",\"server\":1,"), "see %s", path);
    cr_assert(zt_file_has(path, "{\"type\":\"end\""), "see %s", path);
    /* the cluster file names the node as Slurm does (its short host name here) */
    char host[128] = "", want[160];
    cr_assert_eq(gethostname(host, sizeof host - 1), 0);
    host[strcspn(host, ".")] = 0;
    snprintf(path, sizeof path, "%s/train/cluster.txt", s_dir);
    snprintf(want, sizeof want, "server = %s:", host);
    cr_assert(zt_file_has(path, want), "see %s (want %s)", path, want);
    snprintf(want, sizeof want, "trainer = %s", host);
    cr_assert(zt_file_has(path, want), "see %s (want %s)", path, want);
    snprintf(path, sizeof path, "%s/train.out", s_dir);
    cr_assert(zt_file_has(path, "zps-launch: ok (exit 0)"), "see %s", path);
    cr_assert(zt_file_has(path, "tasks per node [2], GPUs per node [0]"), "see %s", path);
}

/* SIGKILL to server 1's task (its step found by name, its pid by scontrol listpids): the
 * launcher restarts it with --restore in a new step. */
static void s_kill_server_1(const char *job)
{
    char step[64], pid[64], path[300];
    cr_assert_eq(s_sh(step, sizeof step,
                      "squeue -s -j %s -h -o '%%i %%j' | awk '$2 == \"zps-server-1\" "
                      "{sub(/.*[.]/, \"\", $1); print $1}'",
                      job),
                 0);
    step[strcspn(step, "\n")] = 0;
    cr_assert(step[0], "no step zps-server-1");
    s_sh(pid, sizeof pid, "scontrol listpids %s | awk '$3 == \"%s\" {print $1}'", job, step);
    cr_assert_gt(atoi(pid), 0, "no pid for step %s.%s", job, step);
    cr_assert_eq(kill(atoi(pid), SIGKILL), 0);
    snprintf(path, sizeof path, "%s/cancel/server-1.log", s_dir);
    cr_assert(s_wait_file(path, "restored ", 30), "server 1 was not restored: see %s", path);
}

/* A long run, server 1 killed and restored, then the job cancelled: every process stops
 * gracefully and none is left. */
static void s_check_cancel(void)
{
    char job[32], out[4096], path[300], pids[2048];
    s_sbatch("cancel", 100000, job);
    snprintf(path, sizeof path, "%s/cancel/server-1.log", s_dir);
    cr_assert(s_wait_file(path, "checkpoint at version", 30), "no checkpoint in %s", path);
    s_kill_server_1(job);
    cr_assert_eq(s_sh(pids, sizeof pids, "scontrol listpids %s | awk 'NR > 1 {print $1}'", job),
                 0, "%s", pids);
    cr_assert_eq(s_sh(out, sizeof out, "scancel %s 2>&1", job), 0, "scancel: %s", out);
    s_summary("cancel", out, sizeof out);
    for (int i = 0; i < 2; i++) {
        char want[64];
        snprintf(want, sizeof want, "server%d=stopped (job cancelled)/0/r%d", i, i);
        cr_assert(strstr(out, want), "%s\nwant %s", out, want);
        snprintf(path, sizeof path, "%s/cancel/server-%d.log", s_dir, i);
        cr_assert(zt_file_has(path, "stopping: final checkpoint"), "see %s", path);
    }
    cr_assert(strstr(out, "trainer0=stopped (job cancelled)"), "%s", out);
    cr_assert(strstr(out, "| 130"), "%s", out);
    cr_assert(s_wait_job_gone(job, 20), "job %s did not end", job);
    s_assert_gone(pids, "a process of the cancelled job");
    snprintf(path, sizeof path, "%s/cancel.out", s_dir);
    cr_assert(zt_file_has(path, "Slurm signalled every process"), "see %s", path);
    cr_assert(zt_file_has(path, "server 1 failed: exit 137"), "see %s", path);
    snprintf(path, sizeof path, "%s/cancel/server-1.metrics.restart-1.jsonl", s_dir);
    cr_assert(zt_file_has(path, "{\"type\":\"start\",\"server\":1,"), "see %s", path);
}

Test(it_slurm, fleet_from_the_allocation_trains_restarts_and_a_cancel_stops_it,
     .timeout = 120, .fini = s_down)
{
    s_up();
    s_check_training();
    s_check_cancel();
}

/* ---------------------------------------------------------------- without daemons */

/* Outside an allocation, or without Slurm's commands, nothing starts: no run folder. */
Test(it_slurm, refuses_outside_an_allocation, .timeout = 20)
{
    lt_run r;
    lt_setup(&r, 1);
    char launcher[4096];
    snprintf(launcher, sizeof launcher, "%s/scripts/zps-launch", s_root());
    const char *outside[] = {"/usr/bin/env", "-u", "SLURM_JOB_ID", "/usr/bin/python3",
                             launcher, "--launcher", "slurm", "--bin-dir", "bin", "--run-dir",
                             "run", NULL};
    lt_exec(&r, outside, 0, NULL);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "zps-launch: not inside a Slurm allocation: run it from sbatch or "
                            "salloc (see docs/training.md)"),
              "%s", r.out);
    char path[256];
    snprintf(path, sizeof path, "%s/run", r.dir);
    cr_assert_neq(access(path, F_OK), 0, "a run folder was made");

    const char *no_tools[] = {"/usr/bin/env", "SLURM_JOB_ID=7", "PATH=/nonexistent",
                              "/usr/bin/python3", launcher, "--launcher", "slurm",
                              "--run-dir", "run", NULL};
    lt_exec(&r, no_tools, 0, NULL);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "needs srun, scontrol, squeue, scancel on PATH"), "%s", r.out);
    cr_assert_neq(access(path, F_OK), 0, "a run folder was made");
    lt_cleanup(&r);
}

/* The allocation as a stand-in scontrol describes it: nodes n1 (2 GPUs) and n2 (1 GPU). */
static const char *s_scontrol_sh =
    "#!/bin/sh\n"
    "case \"$1 $2\" in\n"
    "'show hostnames') [ \"$3\" = 'n[1-2]' ] && echo n1 && echo n2 || echo \"$3\";;\n"
    "'show job') echo '   Nodes=n1 CPU_IDs=0-3 Mem=0 GRES=gpu:2(IDX:0-1)';\n"
    "            echo '   Nodes=n2 CPU_IDs=0-3 Mem=0 GRES=gpu:1(IDX:1)';;\n"
    "*) exit 1;;\n"
    "esac\n";

Test(it_slurm, placement_from_the_allocation, .timeout = 20)
{
    lt_run r;
    lt_setup(&r, 1);
    lt_write_exec(r.dir, "scontrol", s_scontrol_sh);
    lt_write_exec(r.dir, "srun", "#!/bin/sh\nexit 0\n");
    lt_write_exec(r.dir, "squeue", "#!/bin/sh\nexit 0\n");
    lt_write_exec(r.dir, "scancel", "#!/bin/sh\nexit 0\n");
    char launcher[4096], path_env[300];
    snprintf(launcher, sizeof launcher, "%s/scripts/zps-launch", s_root());
    snprintf(path_env, sizeof path_env, "PATH=%s:/usr/bin:/bin", r.dir);
    const char *argv[] = {"/usr/bin/env", path_env, "SLURM_JOB_ID=42",
                          "SLURM_JOB_NODELIST=n[1-2]", "SLURM_TASKS_PER_NODE=2(x2)",
                          "/usr/bin/python3", launcher, "--launcher", "slurm", "--bin-dir",
                          "bin", "--run-dir", "run", "--dry-run", NULL};
    lt_exec(&r, argv, 0, NULL);
    cr_assert_eq(r.code, 0, "%s", r.out);
    /* one server per node on 20000 + 16 * (42 mod 800); one trainer per GPU */
    cr_assert(strstr(r.out, "server 0 on n1: srun --overlap --nodes=1 --ntasks=1 "
                            "--nodelist=n1 --job-name=zps-server-0 "),
              "%s", r.out);
    cr_assert(strstr(r.out, "server 1 on n2: srun --overlap --nodes=1 --ntasks=1 "
                            "--nodelist=n2 --job-name=zps-server-1 "),
              "%s", r.out);
    cr_assert(strstr(r.out, "trainer 1 on n1: srun --overlap"), "%s", r.out);
    cr_assert(strstr(r.out, "zps-gpu 1 "), "trainer 1 takes n1's second GPU:\n%s", r.out);
    cr_assert(strstr(r.out, "trainer 2 on n2: srun --overlap"), "%s", r.out);
    cr_assert_null(strstr(r.out, "trainer 3 "), "%s", r.out);
    char path[256], text[1024];
    snprintf(path, sizeof path, "%s/run/cluster.txt", r.dir);
    lt_read_file(path, text, sizeof text);
    cr_assert(strstr(text, "server = n1:20672\nserver = n2:20672\ntrainer = n1\ntrainer = n1\n"
                           "trainer = n2\n"),
              "%s", text);
    lt_cleanup(&r);
}
